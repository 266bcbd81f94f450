"""The inference engine: requests in, tokens out, one scheduled step at a time.

    request -> Scheduler (continuous batching, chunked prefill, preemption; BlockManager: paged KV,
               prefix caching) -> ModelRunner (flat tokens + AttnMetadata, one forward)
            -> Sampler (per-request parameters on the device) -> Scheduler.postprocess (append, stop)
            -> detokenize, stop strings -> RequestOutput

`LLMEngine` is the step loop (`add_request`, `step`, `abort`), on which `LLM` (offline: `generate`,
`stream`) and the HTTP server build. One device-to-host copy per step: the sampled ids (with their
logprobs when a request asked for them), non-blocking into a pinned host buffer.

Asynchronous scheduling (EngineConfig.async_scheduling; vLLM v1's async scheduling, SGLang's overlap
scheduler). A step is launched, then resolved: waited for, postprocessed, detokenized. Synchronously, each
step() launches step N and resolves it. Asynchronously, step() schedules and launches step N+1 while step N
still runs on the device, and only then resolves step N, so the host's scheduling, input staging,
postprocess and detokenizing overlap the GPU's work:

    host:   schedule N+1 | stage + launch N+1 | wait N | postprocess N, detokenize | schedule N+2 | ...
    device: ........ step N ............ | ...... step N+1 ...... (no gap while the host keeps ahead)

The scheduler counts step N's sampled tokens as pending (Sequence.num_pending: KV slot reserved, length
advanced); step N+1 takes their ids from step N's id tensor on the device (ModelRunner's Feed). A sequence
that step N ends (EOS, stop id or string, abort) has had step N+1 computed for it in vain: that token is
dropped and its blocks freed, so the outputs are those of the synchronous engine, token for token.
step() returns the requests that step N moved (one step behind the launches), and has_unfinished() stays
true while a step is in flight. A step whose next sampling depends on its ids on the host is resolved
before the next one is scheduled: penalties (repetition, frequency, presence), whose counts are built from
the host's token lists.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError
from kiln.infer.block_manager import BlockManager
from kiln.infer.config import EngineConfig
from kiln.infer.loading import eos_ids, load_for_inference
from kiln.infer.runner import Feed, ModelRunner, StepOutput
from kiln.infer.sampler import Sampler, SamplingTensors, plain_greedy, token_logprobs
from kiln.infer.sampling_params import SamplingParams
from kiln.infer.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kiln.infer.sequence import Sequence
from kiln.model.transformer import Transformer


# ---------------------------------------------------------------------------------------------- outputs
@dataclass
class CompletionOutput:
    """One of a request's n completions. logprobs: per token, the sampled token's logprob and the top-k
    (token id, logprob) pairs, when the request asked for them."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else float(sum(self.logprobs))


@dataclass
class RequestOutput:
    """A request's state: its prompt, its completions so far, and (when finished) its timings in seconds:
    time to first token, end to end, and the mean time per output token after the first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[float] | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class _Request:
    """The engine's bookkeeping for one request: its n sequences and what each has emitted as text."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams):
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.seqs: list[Sequence] = []
        self.texts: list[str] = []  # detokenized output of each sequence (stop strings cut off)
        self.bytes: list[bytes] = []  # the bytes of each sequence's output tokens so far
        self.n_decoded: list[int] = []  # output tokens already in `bytes`
        self.arrival = time.monotonic()

    @property
    def finished(self) -> bool:
        for s in self.seqs:  # a loop, not all(<genexpr>): asked for every request a step moves
            if not s.is_finished:
                return False
        return True


@dataclass
class _Launched:
    """A step launched on the device and not yet resolved. ids: (R,) int64 sampled ids on the device (one
    per sampling sequence, in batch.sampling_seqs order), the next step's Feed source; host_ids: their
    pinned host copy, valid once `event` has completed (None on CPU: copied synchronously); logprobs:
    (chosen (R,), top values (R, k), top ids (R, k)) host copies when a request asked; rows: seq_id -> row
    of ids; needs_host: the next step's sampling needs these ids on the host (penalties)."""

    batch: ScheduledBatch
    sampling: list[Sequence]
    ids: torch.Tensor | None
    host_ids: torch.Tensor | None
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    event: object | None
    rows: dict[int, int]
    needs_host: bool
    step: StepOutput | None


def _has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


# ----------------------------------------------------------------------------------------------- engine
class LLMEngine:
    """model: a kiln Transformer (weights on the engine's device, in its dtype); tokenizer: kiln's Tokenizer
    (encode_ordinary, decode_bytes), or None for token-id requests (then outputs carry ids, no text);
    log: where the start-up capacity line goes (None: nowhere)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer=None,
        config: EngineConfig | None = None,
        eos_token_ids: Seq[int] = (),
        log=print,
    ):
        self.config = config = config or EngineConfig()
        self.device = next(model.parameters()).device
        self.model = model.eval()
        self.model.set_kernels(config.kernels)
        self.tokenizer = tokenizer
        mcfg = model.config
        self.vocab_size = mcfg.vocab_size
        self.max_model_len = min(config.max_model_len or mcfg.max_seq_len, mcfg.max_seq_len)
        self.runner = ModelRunner(model, config, self.device, self.max_model_len)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_model_len=self.max_model_len,
                block_size=config.block_size,
                # every running sequence needs a token of the step's budget
                max_num_seqs=min(config.max_num_seqs, config.max_num_batched_tokens),
                max_num_batched_tokens=config.max_num_batched_tokens,
                chunked_prefill=config.chunked_prefill,
                eos_token_ids=list(eos_token_ids),
            ),
            self.block_manager,
        )
        self.sampler = Sampler()
        self.async_scheduling = config.resolve_async(self.device)
        self._inflight: _Launched | None = None  # the launched, unresolved step (async scheduling)
        # the batch the last step() scheduled and launched (None: nothing to run); callers that time steps
        # read its composition (kiln serve logs the steps that take seconds)
        self.last_batch: ScheduledBatch | None = None
        # the last step's host time in seconds: (scheduling, launching its batch, waiting for the step before
        # it and postprocessing), for the same callers (a launch that compiles kernels shows in the middle)
        self.last_step_s: tuple[float, float, float] | None = None
        # the sampled ids' host copies, reused: two, since step N+1's copy is enqueued before step N's is read
        cuda = self.device.type == "cuda"
        rows = min(config.max_num_seqs, config.max_num_batched_tokens)
        self._host_ids = [torch.zeros(rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else [None, None]
        self._slot = 0
        self.requests: dict[str, _Request] = {}
        self._aborted: dict[str, _Request] = {}  # aborted since the last step's outputs
        self._by_seq: dict[int, tuple[_Request, int]] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._seeds = random.Random(config.seed)
        if config.warmup and self.device.type == "cuda":
            t = time.perf_counter()
            kinds = self.runner.warm_up()
            if log is not None:
                log(f"kiln engine: attention kernels tuned for every step shape ({kinds} layer kind(s)) in "
                    f"{time.perf_counter() - t:.1f} s")  # fmt: skip
        n_tokens = self.runner.num_blocks * config.block_size
        if log is not None:
            log(
                f"kiln engine: {self.runner.num_blocks} KV blocks x {config.block_size} tokens = {n_tokens} tokens "
                f"({self.runner.num_blocks * self.runner.bytes_per_block / 2**30:.2f} GiB, "
                f"{self.runner.dtype}); max {n_tokens // self.max_model_len} sequences at the full "
                f"{self.max_model_len}-token context, {config.max_num_seqs} per step; device {self.device}"
            )

    # ---- requests -----------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a prompt (text, or token ids); returns its request id. Bad input is a KilnError and
        leaves the engine as it was."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise KilnError(f"params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise KilnError("this engine has no tokenizer: pass the prompt as a list of token ids")
            text, ids = prompt, list(self.tokenizer.encode_ordinary(prompt))
        else:
            text, ids = None, list(prompt)
            bad = [
                t
                for t in ids
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size
            ]
            if bad:
                raise KilnError(
                    f"prompt token ids must be ints in [0, {self.vocab_size}): got {bad[:5]} "
                    f"(the model's vocabulary has {self.vocab_size} tokens)"
                )
        if not ids:
            raise KilnError("the prompt is empty: give at least one token")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise KilnError(
                f"the prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens: shorten the prompt or lower max_tokens"
            )
        rid = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        if rid in self.requests:
            raise KilnError(f"request id {rid!r} is already in use")
        req = _Request(rid, text, ids, params)
        seqs = []
        for j in range(params.n):
            seed = None if params.seed is not None else self._seeds.getrandbits(63)
            seq = Sequence(next(self._seq_ids), ids, params, seed=seed)
            if params.seed is not None and j > 0:  # n seeded samples: distinct, still reproducible
                seq.seed = (params.seed * 1_000_003 + j) % (1 << 63)
            seqs.append(seq)
        for seq in seqs:  # all-or-nothing: a sequence that can never fit refuses the whole request
            self.scheduler.check(seq)
        for j, seq in enumerate(seqs):
            self.scheduler.add(seq)
            self._by_seq[seq.seq_id] = (req, j)
        req.seqs, req.texts = seqs, [""] * len(seqs)
        req.bytes, req.n_decoded = [b""] * len(seqs), [0] * len(seqs)
        self.requests[rid] = req
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request (e.g. its client went away): its sequences finish with reason "abort"."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            self.scheduler.abort(seq.seq_id)
        self._aborted[request_id] = req  # reported by the next step, which may sample none of its sequences

    def has_unfinished(self) -> bool:
        """Requests waiting or running, or a launched step not yet resolved (async scheduling)."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- a step -------------------------------------------------------------------------------------------
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Run one scheduled step; return the state of every request that made progress (the finished ones
        for the last time: they are dropped from the engine). Synchronously that is the step just run;
        with async scheduling it launches the next step first and returns what the previous one did.
        finished_only: return only the requests that finished, for callers that read nothing else (offline
        generation): the running ones' snapshots (a copy of every output token list) are then not built."""
        touched: dict[str, _Request] = {}
        t0 = time.perf_counter()
        prev, self._inflight = self._inflight, None
        if prev is not None and prev.needs_host:  # not an overlap case (it is resolved at launch): safety
            self._resolve(prev, touched)
            prev = None
        batch = self.scheduler.schedule()
        self.last_batch = None if batch.is_empty else batch
        t1 = time.perf_counter()
        launched = None if batch.is_empty else self._launch(batch, prev)
        t2 = time.perf_counter()
        if prev is not None:
            self._resolve(prev, touched)  # step N, while step N+1 runs
        if launched is not None:
            if self.async_scheduling and not launched.needs_host:
                self._inflight = launched
            else:
                self._resolve(launched, touched)
        self.last_step_s = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        return self._collect(touched, finished_only)

    def _launch(self, batch: ScheduledBatch, prev: _Launched | None) -> _Launched:
        """Run the step's forward and sampling, and enqueue the copy of its ids to the host; no sync. A row
        whose token the previous step sampled (still in flight) takes it from prev.ids on the device."""
        feed = None
        if prev is not None:
            rows, src = [], []
            for i, (seq, start) in enumerate(zip(batch.seqs, batch.computed_before)):
                if start >= seq.num_known_tokens:
                    rows.append(i)
                    src.append(prev.rows[seq.seq_id])  # KeyError: a pending token no launched step samples
            if rows:
                feed = Feed(prev.ids, rows, src)
        step = self.runner.execute(batch, feed)
        sampling = batch.sampling_seqs
        ids = host = logprobs = event = None
        if sampling:
            n = len(sampling)
            cuda = self.device.type == "cuda"
            if plain_greedy(sampling):
                ids = step.greedy_ids if step.greedy_ids is not None else step.logits.argmax(dim=-1)
            else:
                # the noise is keyed by (seed, tokens generated before this one), pending ones included
                steps = [s.num_output_tokens + s.num_pending - 1 for s in sampling]
                params = SamplingTensors.build(sampling, self.vocab_size, self.device, steps=steps)
                out = self.sampler(step.logits.float(), params)
                ids = out.token_ids
                if out.logprobs is not None:
                    logprobs = tuple(
                        t.to("cpu", non_blocking=cuda) for t in (out.logprobs, out.top_logprobs, out.top_ids)
                    )
            # the step's one device-to-host copy (a few hundred bytes), into a reused pinned buffer
            host = self._host_ids[self._slot][:n]
            host.copy_(ids, non_blocking=cuda)
            event = self._events[self._slot]
            if event is not None:
                event.record(torch.cuda.current_stream(self.device))  # the stream the copy is on
            self._slot ^= 1
        return _Launched(
            batch=batch,
            sampling=sampling,
            ids=ids,
            host_ids=host,
            logprobs=logprobs,
            event=event,
            rows={s.seq_id: r for r, s in enumerate(sampling)},
            needs_host=any(map(_has_penalty, sampling)),
            # the flat batch and hidden states only when prompt logprobs read them (they hold (N, d))
            step=step if any(s.params.prompt_logprobs is not None for s in batch.seqs) else None,
        )

    def _resolve(self, done: _Launched, touched: dict[str, _Request]) -> None:
        """Wait for a launched step's ids, then postprocess it: tokens in place of its placeholders, stops,
        prompt logprobs, detokenizing; the requests it moved go into `touched`."""
        ids = lps = top = None
        if done.sampling:
            if done.event is not None:
                done.event.synchronize()  # this step's copy only; a step launched after it keeps running
            ids = done.host_ids.tolist()
            if done.logprobs is not None:
                chosen, values, top_ids = done.logprobs
                lps = chosen.tolist()
                top = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), values.tolist())]
        step = done.step
        if step is not None and step.hidden is not None:
            self._prompt_logprobs(done.batch, step.inputs, step.hidden)
        live = [seq for seq in done.sampling if not seq.is_finished]  # those that get their token
        self.scheduler.postprocess(done.batch, ids or [], lps, top)
        for seq in live:
            entry = self._by_seq.get(seq.seq_id)
            if entry is not None:
                touched[entry[0].request_id] = entry[0]
                self._detokenize(seq)

    def _prompt_logprobs(self, batch, inputs, hidden) -> None:
        """log P(prompt[p] | prompt[:p]) at the prompt positions this step computed, for requests that asked."""
        for i, seq in enumerate(batch.seqs):
            k = seq.params.prompt_logprobs
            start, n = batch.computed_before[i], batch.num_new_tokens[i]
            last = min(start + n, seq.num_prompt_tokens - 1)  # positions whose next token is a prompt token
            if k is None or last <= start or len(seq.prompt_logprobs) >= seq.num_prompt_tokens - 1:
                continue
            rows = hidden[inputs.cu_seqlens[i] : inputs.cu_seqlens[i] + (last - start)]
            lp = torch.log_softmax(self.runner.logits(rows), dim=-1)
            nxt = torch.tensor(seq.prompt_token_ids[start + 1 : last + 1], device=lp.device)
            chosen, values, top_ids = token_logprobs(lp, nxt, max(k, 1))
            tops = [list(zip(i_, v))[:k] for i_, v in zip(top_ids.tolist(), values.tolist())]
            seq.record_prompt_logprobs(start + 1, chosen.tolist(), tops)

    def _detokenize(self, seq: Sequence) -> None:
        """Text of the sequence's output; a stop string ends it (the text stops before the string).

        Incremental: the bytes of the new tokens are appended to the sequence's byte buffer, which is
        decoded whole (a C-speed pass; a character cut between two tokens becomes whole when its last
        byte arrives). Ids the tokenizer does not know (a model vocabulary padded past the tokenizer's)
        give no text."""
        if seq.seq_id not in self._by_seq or self.tokenizer is None:
            return
        req, j = self._by_seq[seq.seq_id]
        new = seq.output_token_ids[req.n_decoded[j] :]
        req.n_decoded[j] = seq.num_output_tokens
        req.bytes[j] += b"".join(self._token_bytes(t) for t in new)
        text = req.bytes[j].decode("utf-8", errors="replace")
        stops = seq.params.stop
        if stops and not (seq.is_finished and seq.finish_reason == "abort"):
            # only the new tail can hold a new match (the longest stop string back from the old end)
            begin = max(0, len(req.texts[j]) - max(map(len, stops)))
            hits = [(at, s) for s in stops if (at := text.find(s, begin)) >= 0]
            if hits:
                at, s = min(hits)
                text = text[:at]
                if not seq.is_finished:
                    self.scheduler.finish(seq, "stop", s)
                else:  # it had also ended on a token this step: the string came first
                    seq.finish_reason, seq.stop_reason = "stop", s
        req.texts[j] = text

    def _token_bytes(self, token: int) -> bytes:
        try:
            return self.tokenizer.decode_bytes([token])
        except ValueError:  # not in the tokenizer's vocabulary
            return b""

    def _collect(self, touched: dict[str, _Request], finished_only: bool) -> list[RequestOutput]:
        """Outputs of the requests a step touched and of those aborted since the last step (only the
        finished ones with finished_only); finished requests leave the engine. Requests that did not
        move are not visited: with hundreds waiting, a step costs the ones it ran."""
        touched.update(self._aborted)
        self._aborted.clear()
        outs = []
        for rid, req in touched.items():
            done = req.finished
            if done or not finished_only:
                outs.append(self._output(req))
            if done:
                del self.requests[rid]
                for seq in req.seqs:
                    self._by_seq.pop(seq.seq_id, None)
        return outs

    def _output(self, req: _Request) -> RequestOutput:
        comps = []
        for j, seq in enumerate(req.seqs):
            want = seq.params.logprobs is not None
            comps.append(
                CompletionOutput(
                    index=j,
                    text=req.texts[j],
                    token_ids=list(seq.output_token_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    logprobs=list(seq.output_logprobs) if want else None,
                    top_logprobs=[list(t) for t in seq.output_top_logprobs] if want else None,
                )
            )
        first = req.seqs[0]
        metrics = {}
        if req.finished:
            end = max(s.finished_time for s in req.seqs)
            metrics["e2e_s"] = end - req.arrival
            if first.first_token_time is not None:
                metrics["ttft_s"] = first.first_token_time - req.arrival
                n = first.num_output_tokens
                if n > 1:
                    metrics["tpot_s"] = (first.finished_time - first.first_token_time) / (n - 1)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_ids,
            outputs=comps,
            finished=req.finished,
            prompt_logprobs=list(first.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            metrics=metrics,
        )


# ---------------------------------------------------------------------------------------------- offline
class LLM:
    """Offline generation: `LLM(model_or_path, **engine_config).generate(prompts, params)`.

    model_or_path: a kiln Transformer (then pass `tokenizer=`), or a path that kiln.model.checkpoint reads:
    an HF checkpoint directory (safetensors, sharded or not), a kiln model directory, or a `kiln run`
    directory / checkpoint. The tokenizer is found beside the weights (tokenizer.json, kiln's tokenizer
    files, or the run's tokenizer/). Engine options are EngineConfig's fields.
    """

    def __init__(
        self, model_or_path, tokenizer=None, eos_token_ids: Seq[int] | None = None, log=print, **engine
    ):
        config = EngineConfig(**engine)
        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        path = None
        if isinstance(model_or_path, Transformer):
            model = model_or_path.to(device=device, dtype=dtype)
        else:
            path = model_or_path
            model, found_tok = load_for_inference(path, device, dtype)
            tokenizer = tokenizer if tokenizer is not None else found_tok
        eos = list(eos_token_ids) if eos_token_ids is not None else eos_ids(path, tokenizer)
        self.engine = LLMEngine(model, tokenizer, config, eos, log=log)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (one prompt: text or a list of ids; or a list of them)."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)
        )
        batch = [prompts] if single else list(prompts)
        if not batch:
            raise KilnError("the prompt list is empty: give at least one prompt")
        if isinstance(params, list) and len(params) != len(batch):
            raise KilnError(f"{len(params)} SamplingParams for {len(batch)} prompts")
        plist = params if isinstance(params, list) else [params] * len(batch)
        eng = self.engine
        if eng.has_unfinished():
            raise KilnError("the engine is busy with other requests: generate() runs a batch to its end")
        ids = []
        try:
            for p, sp in zip(batch, plist):
                ids.append(eng.add_request(p, sp))
        except KilnError:
            for rid in ids:
                eng.abort(rid)
            while eng.has_unfinished():
                eng.step()
            raise
        done: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while eng.has_unfinished():
            for out in eng.step(finished_only=True):
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[r] for r in ids]

    def stream(
        self, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield the request's state after every step that added tokens, the last one finished."""
        eng = self.engine
        rid = eng.add_request(prompt, params)
        while True:
            for out in eng.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return
            if not eng.has_unfinished():
                return
