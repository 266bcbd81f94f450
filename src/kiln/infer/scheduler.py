"""Scheduler: continuous batching with chunked prefill, prefix caching and recompute preemption.

There are no separate prefill and decode phases (vLLM v1's scheduler): each step has a token budget
(max_num_batched_tokens) and every sequence needs `num_tokens - num_computed_tokens` more tokens computed:
1 for a decode, the rest of its prompt for a prefill. A step
  1. serves RUNNING sequences in admission order: a decode takes 1 token, a sequence still in chunked
     prefill takes its next chunk (up to the budget left). A decode whose next token starts a new block
     needs that block; when none is free, the most recently admitted running sequence is preempted (its
     blocks freed, back to the front of the waiting queue, to be recomputed) and the block retried; a
     sequence that is itself the most recent preempts itself;
  2. if nothing was preempted, admits WAITING sequences FIFO while the budget, max_num_seqs and free
     blocks allow: blocks for all their tokens (reusing the cached prefix), and as many tokens as the
     budget leaves (chunked) or, without chunked prefill, all of them or it waits. FIFO is strict: a
     request that does not fit blocks the ones behind it (no starvation of long prompts).
A sequence samples in a step when that step computes its last token.

Bookkeeping happens at schedule time (vLLM v1's): `schedule` advances each scheduled sequence's
num_computed_tokens by its new tokens and gives each sampling sequence a pending token
(Sequence.num_pending), so the next step can be scheduled before this one's ids reach the host
(asynchronous scheduling, kiln.infer.engine): such a sequence decodes its pending token, whose id the
runner takes from the previous step's sampled ids on the device. `postprocess` then replaces the
placeholder by the real id, registers the computed blocks, and checks stops. A sequence whose pending
tokens already reach its length limit is not scheduled again (it finishes when they arrive); one that
ends on EOS or a stop has had one step computed in vain, whose token `postprocess` drops. A sequence
preempted with a token pending still gets it (it joins the recompute); one that waits with a token pending
is not admitted until it arrives.

Lengths: a sequence never grows past max_model_len tokens (finish_reason "length" there), so `add` refuses a
prompt that leaves no room for one output token, and one whose longest possible run could not fit in the
whole cache (it would be preempted forever). Everything else eventually runs.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kiln.errors import KilnError
from kiln.infer.block_manager import BlockManager
from kiln.infer.sequence import Sequence, SequenceStatus


@dataclass(kw_only=True)
class SchedulerConfig:
    """max_num_seqs: running sequences at most; max_num_batched_tokens: tokens computed per step at most;
    chunked_prefill: split a prompt over steps when it exceeds the budget left; max_model_len: tokens per
    sequence at most (prompt + output); block_size: token slots per KV block (the block manager's);
    eos_token_ids: the model's end tokens (finish_reason "stop" unless ignore_eos)."""

    max_model_len: int
    block_size: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    chunked_prefill: bool = True
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KilnError(f"scheduler.{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len < 2:
            raise KilnError(
                f"scheduler.max_model_len must be >= 2 (a prompt token and an output), got {self.max_model_len}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            # each running sequence needs a token per step; with fewer, the last ones would starve
            raise KilnError(
                f"scheduler.max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs one token per step"
            )
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise KilnError(
                f"without chunked prefill a whole prompt must fit one step: scheduler.max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}); "
                "raise it or enable chunked_prefill"
            )
        if isinstance(self.eos_token_ids, int):
            self.eos_token_ids = [self.eos_token_ids]
        if not isinstance(self.eos_token_ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.eos_token_ids
        ):
            raise KilnError(
                f"scheduler.eos_token_ids must be a list of token ids, got {self.eos_token_ids!r}"
            )
        self.eos_token_ids = list(self.eos_token_ids)


@dataclass
class ScheduledBatch:
    """One step's work, in the order the runner lays out the flat token batch.

    Sequence i computes the tokens at positions computed_before[i] .. computed_before[i] +
    num_new_tokens[i] - 1 (their ids: seq.token_ids[those positions], or, for a position past the known
    tokens, the id a launched step is still sampling: then n is 1); samples[i] says whether that reaches
    its last token, so its logits at the last position are sampled. `preempted` lists the sequences
    preempted while building this batch (for metrics; they are WAITING again).
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    computed_before: list[int]
    samples: list[bool]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def is_decode_only(self) -> bool:
        return bool(self.seqs) and all(n == 1 for n in self.num_new_tokens) and all(self.samples)

    @property
    def sampling_indices(self) -> list[int]:
        """Indices into `seqs` of the sequences that sample: the rows of the step's logits, in order."""
        return [i for i, s in enumerate(self.samples) if s]

    @property
    def sampling_seqs(self) -> list[Sequence]:
        return [seq for seq, s in zip(self.seqs, self.samples) if s]


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if block_manager.block_size != config.block_size:
            raise KilnError(
                f"scheduler.block_size ({config.block_size}) differs from the block manager's "
                f"({block_manager.block_size})"
            )
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the first to preempt
        self._eos = frozenset(config.eos_token_ids)

    # -- requests --------------------------------------------------------------------------------------

    def max_length(self, seq: Sequence) -> int:
        """The most tokens seq can ever hold: prompt + max_tokens, capped at max_model_len."""
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """KilnError if `seq` is not a new request or can never fit; nothing changes either way."""
        cfg = self.config
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.output_token_ids:
            raise KilnError(f"sequence {seq.seq_id} is not a new request ({seq!r})")
        if seq.num_prompt_tokens >= cfg.max_model_len:
            raise KilnError(
                f"the prompt has {seq.num_prompt_tokens} tokens but max_model_len is {cfg.max_model_len}: "
                "shorten the prompt (it must leave room for at least one output token)"
            )
        # the last sampled token's K/V is never computed: the cache holds at most max_length - 1 tokens
        need = -(-(self.max_length(seq) - 1) // cfg.block_size)
        if need > self.block_manager.num_blocks:
            raise KilnError(
                f"request {seq.seq_id} needs up to {need} KV blocks ({seq.num_prompt_tokens} prompt tokens + "
                f"max_tokens {seq.params.max_tokens}, block size {cfg.block_size}) but the cache has only "
                f"{self.block_manager.num_blocks}: lower max_tokens or the prompt, or give the cache more memory"
            )

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a waiting or running sequence: free its blocks and drop it from the queues.

        The engine calls this for stop strings (matched on text, outside the scheduler)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.deallocate(seq)
        seq.finish(reason, stop_reason)

    def abort(self, seq_id: int) -> Sequence | None:
        """Finish the unfinished sequence seq_id with reason "abort"; None if there is none (already done)."""
        for seq in (*self.running, *self.waiting):
            if seq.seq_id == seq_id:
                self.finish(seq, "abort")
                return seq
        return None

    # -- a step ----------------------------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        bm = self.block_manager
        batch = ScheduledBatch([], [], [], [])
        budget = cfg.max_num_batched_tokens

        def take(seq: Sequence, n: int) -> None:
            before = seq.num_computed_tokens
            samples = before + n == seq.num_tokens
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.computed_before.append(before)
            batch.samples.append(samples)
            seq.num_computed_tokens = before + n
            seq.num_pending += samples  # its next token: a placeholder until postprocess

        # 1. running sequences, oldest first; preemption victims come from the back of the list, i.e. from
        # sequences not yet served this step
        i = 0
        bs = cfg.block_size
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = seq.num_tokens
            if seq.num_pending and num_tokens >= self.max_length(seq):
                i += 1  # its pending token is its last (max_tokens or max_model_len): nothing to compute
                continue
            n = min(num_tokens - seq.num_computed_tokens, budget)
            if len(seq.block_table) * bs >= num_tokens:  # the common decode: its block has room
                take(seq, n)
                budget -= n
                i += 1
                continue
            while not bm.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.append_slot(seq)
                take(seq, n)
                budget -= n
                i += 1

        # 2. waiting sequences, FIFO, unless this step had to preempt (they would only evict each other)
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            if seq.num_pending:  # preempted with a token in flight: admitted once it has arrived
                break
            n = seq.num_tokens - bm.num_cached_prefix_tokens(seq)
            if n > budget:
                if not cfg.chunked_prefill:
                    break
                n = budget
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            take(seq, n)
            budget -= n
        return batch

    def postprocess(
        self,
        batch: ScheduledBatch,
        sampled_token_ids: list[int],
        logprobs: list[float] | None = None,
        top_logprobs: list[list[tuple[int, float]]] | None = None,
    ) -> list[Sequence]:
        """Apply a step's results; return the sequences that finished in it.

        sampled_token_ids (and logprobs, top_logprobs when the step computed them) have one entry per
        sampling sequence, in batch.sampling_indices order: the rows of the sampler's output. A sequence
        stores its logprobs only if it asked (params.logprobs), and keeps the first params.logprobs of the
        top list (which holds the batch's largest k). Sequences finished meanwhile (aborted, or ended by the
        previous step's token while this one ran) are skipped: their token is dropped. A sequence preempted
        meanwhile (it is WAITING) still takes its token; its blocks are gone, so none is registered.
        """
        n_sampling = sum(batch.samples)
        if len(sampled_token_ids) != n_sampling:
            raise ValueError(f"{len(sampled_token_ids)} sampled tokens for {n_sampling} sampling sequences")
        for name, values in (("logprobs", logprobs), ("top_logprobs", top_logprobs)):
            if values is not None and len(values) != n_sampling:
                raise ValueError(f"{len(values)} {name} for {n_sampling} sampling sequences")
        bm = self.block_manager
        finished: list[Sequence] = []
        now = time.monotonic()
        row = 0
        for seq, n_new, before, samples in zip(
            batch.seqs, batch.num_new_tokens, batch.computed_before, batch.samples
        ):
            r = row
            row += samples
            if seq.is_finished:
                continue
            if seq.status is SequenceStatus.RUNNING:
                # the blocks this step wrote, not those of a step scheduled since (their K/V are in flight)
                bm.mark_computed(seq, upto=before + n_new)
            if not samples:
                continue
            seq.num_pending -= 1
            token = sampled_token_ids[r]
            seq.append_token(token, now)
            k = seq.params.logprobs
            if k is not None:
                if logprobs is None:
                    raise ValueError(f"sequence {seq.seq_id} asked for logprobs but the step computed none")
                seq.output_logprobs.append(logprobs[r])
                seq.output_top_logprobs.append(list(top_logprobs[r][:k]) if top_logprobs is not None else [])
            reason, stop_reason = self._check_stop(seq, token)
            if reason is not None:
                self.finish(seq, reason, stop_reason)
                finished.append(seq)
        return finished

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        # a stop token wins over length: the model ended the text itself, even on its last allowed token
        if not seq.params.ignore_eos and token in self._eos:
            return "stop", None  # EOS: stop_reason None (vLLM's convention)
        if token in seq.params.stop_token_ids:
            return "stop", token
        if (
            seq.num_output_tokens >= seq.params.max_tokens
            or seq.num_known_tokens >= self.config.max_model_len
        ):
            return "length", None
        return None, None
