"""Sequence: one request's tokens, its place in the KV cache, its progress and its results.

Lifecycle: WAITING (queued; no blocks) -> RUNNING (admitted: a block table covering its tokens; each step
computes K/V for some of them and, once all known tokens are computed, samples one more) -> FINISHED.
A preempted sequence goes back to WAITING with its blocks freed and num_computed_tokens = 0; its output
tokens so far are kept, and its next prefill recomputes prompt + outputs (recompute preemption; blocks it
had computed stay in the prefix cache while free, so the recompute often hits them).

Invariants while RUNNING: num_cached_tokens <= num_computed_tokens <= num_tokens - 1 between steps
(the last token's K/V is computed by the step that samples its successor), and the block table covers
all num_tokens positions.

Pending tokens. The scheduler advances num_computed_tokens when it schedules a step, and a step that
samples adds a placeholder (`num_pending`) until its id reaches the host (Scheduler.postprocess). With
asynchronous scheduling (kiln.infer.engine) the next step is scheduled before that: `num_tokens` counts
the placeholders (their positions get KV slots, their ids are fed to the next step on the device), while
`token_ids` / `output_token_ids` hold the known ids only.
"""

from __future__ import annotations

import enum
import time

from kiln.errors import KilnError
from kiln.infer.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


FINISH_REASONS = ("stop", "length", "abort")


class Sequence:
    """One generation stream. `seq_id` comes from a counter the engine owns; `seed` is the effective seed.

    `seed` None means params.seed; the engine passes its own when params.seed is None (one it drew at
    arrival) and, for n > 1 completions of a seeded request, params.seed + i for the i-th (else all n
    would be the same text). Sampling depends only on (seed, tokens generated so far), so a sequence is
    reproducible from its seed alone. Seeds are 64-bit: [-2**63, 2**64); the sampler uses the bit pattern.

    Block-manager bookkeeping: `block_hashes[i]` is the chained content hash of full block i; while the
    sequence holds blocks, exactly its registered (full and computed) blocks have an entry. The hashes are a
    function of the tokens alone, so they stay valid across preemption.
    """

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int | None = None,
        arrival_time: float | None = None,
    ) -> None:
        if not isinstance(prompt_token_ids, list | tuple) or len(prompt_token_ids) == 0:
            raise KilnError("a request needs a non-empty prompt (a list of token ids)")
        if seed is None:
            seed = params.seed
        if seed is None:
            raise KilnError(
                f"sequence {seq_id}: no seed; the engine draws one at arrival when SamplingParams.seed is None"
            )
        if not -(1 << 63) <= seed < (1 << 64):
            raise KilnError(f"sequence {seq_id}: seed {seed} does not fit in 64 bits")
        self.seq_id = seq_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed - (1 << 64) if seed >= (1 << 63) else seed  # as a signed int64, same bits
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_pending = 0  # tokens sampled by launched steps whose ids have not reached the host (0-2)
        self.finish_reason: str | None = None
        # the stop token id or stop string; None for EOS and for "length"/"abort" (vLLM's convention)
        self.stop_reason: int | str | None = None
        # per output token: the sampled token's logprob and the top-k (id, logprob), most likely first
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []
        # per prompt position p >= 1: log P(prompt[p] | prompt[:p]) and the top-k there
        self.prompt_logprobs: list[float] = []
        self.prompt_top_logprobs: list[list[tuple[int, float]]] = []
        self.num_preemptions = 0
        # time.monotonic() seconds
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens, the pending ones (sampled, id not yet on the host) included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        """Prompt + output tokens whose ids the host holds."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks_needed(self, block_size: int) -> int:
        """Blocks that hold K/V for all current tokens: ceil(num_tokens / block_size)."""
        return -(-self.num_tokens // block_size)

    def block_token_ids(self, index: int, block_size: int) -> list[int]:
        """The token ids stored in block `index` of this sequence (the last one may be partial)."""
        start = index * block_size
        n_prompt = len(self.prompt_token_ids)
        if start + block_size <= n_prompt:
            return self.prompt_token_ids[start : start + block_size]
        return self.token_ids[start : start + block_size]

    def append_token(self, token_id: int, now: float | None = None) -> None:
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic() if now is None else now

    def record_prompt_logprobs(
        self, start: int, logprobs: list[float], top: list[list[tuple[int, float]]] | None = None
    ) -> None:
        """Record prompt logprobs for positions start, start + 1, ... (position p: log P(prompt[p] | prompt[:p])).

        Position 0 has none, so the list index is p - 1. Positions already recorded (a recompute after
        preemption covers the prompt again) are skipped; positions past the prompt are ignored.
        """
        if start < 1:
            raise ValueError(f"prompt logprobs start at position 1, got {start}")
        if top is not None and len(top) != len(logprobs):
            raise ValueError(f"{len(logprobs)} logprobs but {len(top)} top lists")
        have = len(self.prompt_logprobs)  # positions 1 .. have are recorded
        if start > have + 1:
            raise ValueError(f"prompt logprobs must be recorded in order: next is {have + 1}, got {start}")
        first = have + 1 - start
        last = min(len(logprobs), self.num_prompt_tokens - start)
        for i in range(first, last):
            self.prompt_logprobs.append(logprobs[i])
            self.prompt_top_logprobs.append(top[i] if top is not None else [])

    def finish(self, reason: str, stop_reason: int | str | None = None, now: float | None = None) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        self.status = SequenceStatus.FINISHED
        self.num_pending = 0  # a launched step's token for it is dropped
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finished_time = time.monotonic() if now is None else now

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_prompt_tokens}+"
            f"{self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
