"""Shared helpers of the inference tests: sequences with explicit ids and seeds."""

from kiln.infer.sampling_params import SamplingParams
from kiln.infer.sequence import Sequence


def make_seq(seq_id: int, prompt: list[int], seed: int | None = None, **params) -> Sequence:
    return Sequence(seq_id, prompt, SamplingParams(**params), seed=seq_id if seed is None else seed)
