"""The on-device sampler: per-request parameters as (B,) tensors, one batched pass, no host syncs.

Order (vLLM's), for logits (B, V) float32, one row per sampling sequence:
  1. logprobs of the raw logits, log_softmax in float32: what is returned (sampled token + top-k);
  2. penalties: repetition (HF: a seen token's l -> l / p if l > 0 else l * p, "seen" = in the prompt or
     the output), then frequency and presence (OpenAI: l -= f * count_in_output + r * (count > 0));
  3. greedy rows (temperature 0) take the argmax of the penalized logits;
  4. temperature: l / t;
  5. top-k: keep l >= the k-th largest (ties with it kept);
  6. top-p: over the top-k survivors' softmax, sorted descending, drop a token when the mass strictly
     before it already reaches top_p (the most likely token always survives);
  7. min-p: drop p < min_p * max p (probabilities of the survivors);
  8. sample: the Gumbel-max trick, argmax(l + g) with g = -log(-log u), which draws from softmax(l)
     exactly (the same as the exponential race argmax(p / e), e = -log u).

Randomness is counter-based, so a row's draw depends on (seed, step) and its logits alone, never on the
batch's size, order or other rows, nor on a generator's state: u for vocabulary index v is
    key = splitmix64(splitmix64(seed) + (step + 1) * G)        G = 0x9E3779B97F4A7C15 (the golden gamma)
    u   = (top 23 bits of splitmix64(key + (v + 1) * G) + 0.5) / 2**23          in (0, 1), never 0 or 1
i.e. the (v + 1)-th output of a SplitMix64 stream whose state is the (step + 1)-th output of the stream of
`seed` (SplitMix64: Steele, Lea, Flood 2014; its finalizer is Stafford's Mix13). All in int64 torch ops on
the device (multiplication wraps modulo 2**64; logical right shifts are arithmetic shifts masked), then
float32. `step` is the number of tokens the sequence has generated before this one, so a recompute after
preemption draws the same token again. The 23 bits keep u - as a float32 - strictly inside (0, 1).

Nothing here calls .item() or .tolist(): the host-side flags (all greedy? any penalty? largest k?) are
computed from the Python parameters when the tensors are built. The caller copies token ids (and logprobs
when asked) to the host once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.infer.sequence import Sequence

_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic: it copies the sign bit)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 (bit patterns as unsigned 64-bit)."""
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B,) int64 seeds and steps -> (B, V) float32 uniforms in (0, 1), a function of (seed, step, v) only."""
    key = splitmix64(splitmix64(seeds) + (steps + 1) * _GAMMA)  # (B,)
    v = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64) * _GAMMA  # (V,)
    bits = _shr(splitmix64(key[:, None] + v[None, :]), 41)  # (B, V), 23 bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, V) float32 standard Gumbel noise -log(-log u); finite since u is strictly inside (0, 1)."""
    return -torch.log(-torch.log(uniform_noise(seeds, steps, vocab_size)))


@dataclass
class SamplingTensors:
    """One step's per-row sampling parameters on the device, plus host flags that skip unneeded work.

    Rows follow the sampling sequences (ScheduledBatch.sampling_seqs). Greedy rows carry temperature 1 and
    no filters (their token is the argmax, taken before temperature). top_k is V when off.
    """

    temperature: torch.Tensor  # (B,) float32
    greedy: torch.Tensor  # (B,) bool
    top_k: torch.Tensor  # (B,) int64
    top_p: torch.Tensor  # (B,) float32
    min_p: torch.Tensor  # (B,) float32
    repetition_penalty: torch.Tensor  # (B,) float32
    frequency_penalty: torch.Tensor  # (B,) float32
    presence_penalty: torch.Tensor  # (B,) float32
    seeds: torch.Tensor  # (B,) int64
    steps: torch.Tensor  # (B,) int64: tokens generated so far
    output_counts: torch.Tensor | None  # (B, V) int32 counts of each token in the output; None: no penalties
    seen: torch.Tensor | None  # (B, V) bool: in prompt or output; None: no repetition penalty
    all_greedy: bool
    any_greedy: bool
    do_penalties: bool
    do_top_k: bool
    max_top_k: int  # the largest top_k of the filtered rows (V when some row has top-p without top-k)
    do_top_p: bool
    do_min_p: bool
    max_logprobs: int  # the largest params.logprobs; -1 = no row wants logprobs

    @classmethod
    def build(
        cls,
        seqs: list[Sequence],
        vocab_size: int,
        device: torch.device | str,
        steps: list[int] | None = None,
    ) -> SamplingTensors:
        """steps: each row's noise step, the tokens it generated before this one; default its output
        tokens on the host (the engine passes them when some are still in flight: async scheduling)."""
        device = torch.device(device)
        V = vocab_size
        params = [s.params for s in seqs]
        greedy = [p.temperature == 0.0 for p in params]
        top_k = [V if g or p.top_k == -1 else min(p.top_k, V) for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        do_rep = any(r != 1.0 for r in rep)
        do_freq_pres = any(f != 0.0 for f in freq) or any(r != 0.0 for r in pres)
        do_top_k = any(k < V for k in top_k)
        do_top_p = any(p < 1.0 for p in top_p)

        def vec(values: list, dtype: torch.dtype) -> torch.Tensor:
            # pinned host memory makes the copy asynchronous on CUDA
            host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
            return host.to(device, non_blocking=True)

        output_counts = seen = None
        if do_rep or do_freq_pres:
            output_counts = _token_counts([s.output_token_ids for s in seqs], V, device)
        if do_rep:
            seen = (_token_counts([s.prompt_token_ids for s in seqs], V, device) > 0) | (output_counts > 0)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=vec([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32),
            greedy=vec(greedy, torch.bool),
            top_k=vec(top_k, torch.int64),
            top_p=vec(top_p, torch.float32),
            min_p=vec(min_p, torch.float32),
            repetition_penalty=vec(rep, torch.float32),
            frequency_penalty=vec(freq, torch.float32),
            presence_penalty=vec(pres, torch.float32),
            seeds=vec([s.seed for s in seqs], torch.int64),
            steps=vec([s.num_output_tokens for s in seqs] if steps is None else steps, torch.int64),
            output_counts=output_counts,
            seen=seen,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            do_penalties=do_rep or do_freq_pres,
            do_top_k=do_top_k,
            max_top_k=V if do_top_p else max((k for k in top_k if k < V), default=V),
            do_top_p=do_top_p,
            do_min_p=any(m > 0.0 for m in min_p),
            max_logprobs=max(logprobs, default=-1),
        )


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """(B, V) int32 occurrence counts from ragged id lists: padded (B, L) ids scattered into V + 1 columns
    (the pad id V lands in the extra column, then dropped)."""
    B = len(rows)
    L = max((len(r) for r in rows), default=0)
    ids = torch.full((B, max(L, 1)), vocab_size, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    ids = ids.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else ids
    counts = torch.zeros(B, vocab_size + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size]


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (B,) int64
    logprobs: (
        torch.Tensor | None
    )  # (B,) float32: the sampled token's logprob (raw logits); None if none asked
    top_logprobs: torch.Tensor | None  # (B, k) float32, k = the batch's largest params.logprobs
    top_ids: torch.Tensor | None  # (B, k) int64

    def to_host(self) -> tuple[list[int], list[float] | None, list[list[tuple[int, float]]] | None]:
        """The step's one copy to the host, in Scheduler.postprocess's argument order:
        (token ids, sampled-token logprobs or None, per row the top-k (id, logprob) pairs or None)."""
        token_ids = self.token_ids.tolist()  # the sync; the copies below find their tensors ready
        if self.logprobs is None:
            return token_ids, None, None
        top = [list(zip(ids, lps)) for ids, lps in zip(self.top_ids.tolist(), self.top_logprobs.tolist())]
        return token_ids, self.logprobs.tolist(), top


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition, then frequency and presence penalties on (B, V) float32 logits (a new tensor)."""
    if t.seen is not None:
        p = t.repetition_penalty[:, None]
        logits = torch.where(t.seen, torch.where(logits > 0, logits / p, logits * p), logits)
    counts = t.output_counts.to(torch.float32)
    logits = logits - t.frequency_penalty[:, None] * counts - t.presence_penalty[:, None] * (counts > 0)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Mask (to -inf) what top-k, then top-p, drop; rows with both off come back unchanged."""
    if not t.do_top_p:
        # top-k alone: the k-th largest of each row from one topk of the batch's largest k
        values = torch.topk(logits, t.max_top_k, dim=-1).values  # (B, K) descending
        kth = values.gather(1, (t.top_k.clamp(max=t.max_top_k) - 1)[:, None])  # (B, 1)
        off = t.top_k[:, None] > t.max_top_k  # rows without top-k (their top_k is V)
        return logits.masked_fill((logits < kth) & ~off, float("-inf"))
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
    if t.do_top_k:
        kth = sorted_logits.gather(1, (t.top_k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # exclusive cumulative mass: the first token has 0 < top_p before it, so it always survives
    # rows with top_p = 1 are exempt: the float cumsum can round past 1 before the tail and drop it
    drop = ((probs.cumsum(dim=-1) - probs) >= t.top_p[:, None]) & (t.top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    drop = probs < t.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(drop, float("-inf"))


def apply_filters(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on (B, V) float32 (penalized) logits: what the sampler draws from."""
    logits = logits / t.temperature[:, None]
    if t.do_top_k or t.do_top_p:
        logits = apply_top_k_top_p(logits, t)
    if t.do_min_p:
        logits = apply_min_p(logits, t)
    return logits


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From (N, V) logprobs: the given tokens' (N,) logprobs and the top-k (N, k) logprobs and ids.

    Also what prompt logprobs need (the runner passes the logprobs at prompt positions and the next ids).
    """
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    top = torch.topk(logprobs, k, dim=-1)
    return chosen, top.values, top.indices


def plain_greedy(seqs: list[Sequence]) -> bool:
    """Every row greedy, with no penalty and no logprobs: the Sampler's tokens are then the argmax of the
    raw logits, and a caller can take them without building the per-row tensors (a decode step's host
    time, at batch 64, is otherwise spent creating ten small device tensors)."""
    return all(
        p.temperature == 0.0
        and p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and p.logprobs is None
        for p in (s.params for s in seqs)
    )


class Sampler:
    """Turns a step's logits into tokens following each row's SamplingParams (see the module docstring)."""

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != t.temperature.shape[0]:
            raise ValueError(
                f"logits must be (rows, vocab) with one row per sampling sequence ({t.temperature.shape[0]}), "
                f"got {tuple(logits.shape)}"
            )
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if t.max_logprobs >= 0 else None
        if t.do_penalties:
            logits = apply_penalties(logits, t)
        if t.all_greedy:
            token_ids = logits.argmax(dim=-1)
        else:
            greedy_ids = logits.argmax(dim=-1) if t.any_greedy else None
            logits = apply_filters(logits, t)
            token_ids = (logits + gumbel_noise(t.seeds, t.steps, logits.shape[1])).argmax(dim=-1)
            if greedy_ids is not None:
                token_ids = torch.where(t.greedy, greedy_ids, token_ids)
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None, None)
        chosen, top_values, top_ids = token_logprobs(raw_logprobs, token_ids, t.max_logprobs)
        return SamplerOutput(token_ids, chosen, top_values, top_ids)
