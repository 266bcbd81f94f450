"""Sequence: token bookkeeping, blocks needed, the effective seed, prompt logprobs recorded once."""

import pytest

from kiln.errors import KilnError
from kiln.infer.sampling_params import SamplingParams
from kiln.infer.sequence import Sequence, SequenceStatus

from ._helpers import make_seq


def test_tokens_and_blocks():
    seq = make_seq(3, [1, 2, 3, 4, 5])
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens) == (5, 5, 0)
    assert [seq.num_blocks_needed(b) for b in (1, 2, 4, 5, 16)] == [5, 3, 2, 1, 1]
    seq.append_token(9, now=2.0)
    seq.append_token(8, now=3.0)
    assert seq.token_ids == [1, 2, 3, 4, 5, 9, 8] and seq.last_token_id == 8 and seq.first_token_time == 2.0
    assert [seq.block_token_ids(i, 3) for i in range(3)] == [[1, 2, 3], [4, 5, 9], [8]]
    seq.finish("length", now=4.0)
    assert seq.is_finished and seq.finish_reason == "length" and seq.finished_time == 4.0
    with pytest.raises(ValueError, match="finish reason"):
        seq.finish("done")


def test_effective_seed():
    assert Sequence(0, [1], SamplingParams(seed=5)).seed == 5  # the request's own seed
    assert Sequence(0, [1], SamplingParams(), seed=99).seed == 99  # else the engine's draw
    assert Sequence(0, [1], SamplingParams(seed=5), seed=6).seed == 6  # the engine's choice (n > 1: seed + i)
    assert Sequence(0, [1], SamplingParams(seed=2**64 - 1)).seed == -1  # the same 64 bits, signed
    with pytest.raises(KilnError, match="seed"):
        Sequence(0, [1], SamplingParams())
    with pytest.raises(KilnError, match="non-empty prompt"):
        Sequence(0, [], SamplingParams(), seed=1)


def test_prompt_logprobs_recorded_once_in_order():
    seq = make_seq(0, [10, 11, 12, 13, 14])  # positions 1..4 have prompt logprobs
    seq.record_prompt_logprobs(1, [-1.0, -2.0], [[(10, -0.5)], [(11, -0.6)]])
    seq.record_prompt_logprobs(1, [-1.0, -2.0, -3.0])  # a recompute after preemption: only position 3 is new
    seq.record_prompt_logprobs(
        4, [-4.0, -9.0]
    )  # the last chunk also predicts the first output: not a prompt one
    assert seq.prompt_logprobs == [-1.0, -2.0, -3.0, -4.0]
    assert seq.prompt_top_logprobs == [[(10, -0.5)], [(11, -0.6)], [], []]
    with pytest.raises(ValueError, match="in order"):
        make_seq(1, [1, 2, 3, 4]).record_prompt_logprobs(2, [-1.0])
