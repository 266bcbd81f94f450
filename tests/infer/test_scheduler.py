"""Scheduler: continuous batching, chunked prefill, preemption and resumption, finishing, abort, limits.

The "model" is a plain function of a sequence's tokens (the next token), so a run is deterministic and a
recomputed sequence produces the same tokens as one that was never preempted. Each step also runs a fake
KV cache: one slot per (block, offset) holding the token id whose "K/V" was written there. A step writes
its new tokens through the block tables, then every scheduled sequence "attends" over all its positions
by reading them back; the read must give exactly its tokens, so a wrong block table, a prefix hit on a
block not yet written, or a block reused while still held fails the run. Stale slots are never cleared,
as on a real cache.
"""

import random
import weakref

import pytest

from kiln.errors import KilnError
from kiln.infer.block_manager import BlockManager
from kiln.infer.scheduler import Scheduler, SchedulerConfig
from kiln.infer.sequence import SequenceStatus

from ._helpers import make_seq

EOS = 0


def next_token(token_ids: list[int]) -> int:
    """A deterministic stand-in for a model: never EOS, depends on the whole sequence."""
    return 1 + (sum(token_ids) * 31 + 7 * len(token_ids)) % 97


def make(num_blocks=64, block_size=4, **cfg):
    cfg = {"max_model_len": 256, "block_size": block_size, "eos_token_ids": [EOS], **cfg}
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**cfg), bm), bm


def check_batch(sched, batch):
    """What the runner relies on: positions in range, block tables covering them, sampling rule."""
    bs = sched.config.block_size
    assert batch.num_tokens <= sched.config.max_num_batched_tokens
    assert len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
    for seq, n, before, samples in zip(
        batch.seqs, batch.num_new_tokens, batch.computed_before, batch.samples
    ):
        assert seq.status is SequenceStatus.RUNNING and n >= 1
        # schedule has advanced the computed count and given each sampling sequence a pending token
        assert before + n == seq.num_computed_tokens and before + n <= seq.num_tokens
        assert len(seq.block_table) * bs >= before + n
        assert seq.num_pending == samples
        assert samples == (before + n == seq.num_tokens - seq.num_pending)


_caches: "weakref.WeakKeyDictionary[BlockManager, list[int]]" = weakref.WeakKeyDictionary()


def run_fake_model(bm, batch, model):
    """Write the step's tokens into the fake cache, read every scheduled sequence back, sample."""
    bs = bm.block_size
    slots = _caches.setdefault(bm, [-1] * (bm.num_blocks * bs))
    slot = lambda seq, pos: seq.block_table[pos // bs] * bs + pos % bs
    for seq, n, before in zip(batch.seqs, batch.num_new_tokens, batch.computed_before):
        for pos in range(before, before + n):
            slots[slot(seq, pos)] = seq.token_ids[pos]
    sampled = []
    for seq, n, before, samples in zip(
        batch.seqs, batch.num_new_tokens, batch.computed_before, batch.samples
    ):
        seen = [slots[slot(seq, pos)] for pos in range(before + n)]
        assert seen == seq.token_ids[: before + n], f"sequence {seq.seq_id} reads wrong K/V"
        if samples:
            sampled.append(model(seen))
    return sampled


def step(sched, model=next_token):
    batch = sched.schedule()
    check_batch(sched, batch)
    return batch, sched.postprocess(batch, run_fake_model(sched.block_manager, batch, model))


def run(sched, model=next_token, max_steps=10_000):
    batches = []
    while sched.has_unfinished():
        batches.append(step(sched, model)[0])
        assert len(batches) < max_steps, "the scheduler made no progress"
    return batches


def reference_output(prompt, max_tokens):
    out = []
    for _ in range(max_tokens):
        out.append(next_token(prompt + out))
    return out


def test_continuous_batching_admits_while_others_decode():
    sched, bm = make()
    a = make_seq(0, [5, 6, 7], max_tokens=10)
    sched.add(a)
    b1, _ = step(sched)
    assert b1.seqs == [a] and b1.num_new_tokens == [3] and b1.samples == [True]
    b2, _ = step(sched)
    assert b2.is_decode_only and b2.computed_before == [3]
    b = make_seq(1, [9] * 6, max_tokens=4)
    sched.add(b)
    b3, _ = step(sched)  # a's decode and b's whole prefill in one step
    assert b3.seqs == [a, b] and b3.num_new_tokens == [1, 6] and b3.samples == [True, True]
    assert not b3.is_decode_only
    run(sched)
    assert a.output_token_ids == reference_output([5, 6, 7], 10)
    assert b.output_token_ids == reference_output([9] * 6, 4)
    assert a.finish_reason == b.finish_reason == "length"
    assert bm.num_free_blocks == 64


def test_chunked_prefill_splits_a_long_prompt_with_correct_positions():
    sched, _ = make(max_num_batched_tokens=8, max_num_seqs=4)
    a = make_seq(0, [1, 2], max_tokens=20)
    sched.add(a)
    step(sched)
    prompt = list(range(10, 30))  # 20 tokens
    b = make_seq(1, prompt, max_tokens=3)
    sched.add(b)
    chunks = []
    while not b.output_token_ids:
        batch, _ = step(sched)
        assert batch.seqs[0] is a and batch.num_new_tokens[0] == 1  # a keeps decoding every step
        i = batch.seqs.index(b)
        chunks.append((batch.computed_before[i], batch.num_new_tokens[i], batch.samples[i]))
    # a takes 1 token of each 8-token step, b the other 7
    assert chunks == [(0, 7, False), (7, 7, False), (14, 6, True)]
    run(sched)
    assert b.output_token_ids == reference_output(prompt, 3)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched, _ = make(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=16, chunked_prefill=False)
    a = make_seq(0, [3] * 10, max_tokens=4)
    b = make_seq(1, [4] * 10, max_tokens=4)
    sched.add(a)
    sched.add(b)
    b1, _ = step(sched)
    assert b1.seqs == [a]  # b's 10 tokens do not fit the 6 left, and it may not be split
    b2, _ = step(sched)
    assert b2.seqs == [a, b] and b2.num_new_tokens == [1, 10]


def test_max_num_seqs_limits_running():
    sched, _ = make(max_num_seqs=2)
    seqs = [make_seq(i, [i + 1] * 3, max_tokens=5) for i in range(3)]
    for s in seqs:
        sched.add(s)
    b1, _ = step(sched)
    assert b1.seqs == seqs[:2] and seqs[2].status is SequenceStatus.WAITING
    run(sched)
    assert all(s.output_token_ids == reference_output(s.prompt_token_ids, 5) for s in seqs)


def test_preemption_when_blocks_run_out_and_resumption():
    # 6 blocks of 2 slots; two sequences each grow to 3 + 8 tokens (5 blocks): both cannot stay
    sched, bm = make(num_blocks=6, block_size=2)
    a = make_seq(0, [1, 2, 3], max_tokens=8)
    b = make_seq(1, [4, 5, 6], max_tokens=8)
    sched.add(a)
    sched.add(b)
    preempted = []
    while sched.has_unfinished():
        batch, _ = step(sched)
        for victim in batch.preempted:
            # recompute preemption: blocks freed, outputs kept, first in line again
            assert victim.status is SequenceStatus.WAITING and victim.block_table == []
            assert victim.num_computed_tokens == 0 and victim.output_token_ids
            assert sched.waiting[0] is victim
            preempted.append(victim.seq_id)
    assert preempted and preempted[0] == 1  # the most recently admitted goes first
    assert b.num_preemptions >= 1
    for s in (a, b):
        assert s.output_token_ids == reference_output(s.prompt_token_ids, 8) and s.finish_reason == "length"
    assert bm.num_free_blocks == 6


def test_the_most_recent_sequence_preempts_itself_and_resumes():
    # step 3: a (served first) takes the last free block for its 5th token; b, the most recently admitted,
    # then needs a block for its 3rd token and is its own victim; it resumes once a is done
    sched, bm = make(num_blocks=4, block_size=2)
    a = make_seq(0, [1, 2, 3], max_tokens=5)  # up to 7 tokens in cache: 4 blocks
    b = make_seq(1, [7], max_tokens=6)
    sched.add(a)
    sched.add(b)
    step(sched)
    step(sched)
    batch, _ = step(sched)
    assert batch.seqs == [a] and batch.preempted == [b] and list(sched.waiting) == [b]
    assert b.output_token_ids == reference_output([7], 2)
    run(sched)
    assert a.output_token_ids == reference_output([1, 2, 3], 5)
    assert b.output_token_ids == reference_output([7], 6)
    assert bm.num_free_blocks == 4


def test_finish_reasons():
    def model(ids):
        return EOS if len(ids) == 6 else 50 + len(ids)

    sched, bm = make()
    eos = make_seq(0, [1, 2, 3], max_tokens=10)
    ignore = make_seq(1, [1, 2, 3], max_tokens=5, ignore_eos=True)
    stop_id = make_seq(2, [1, 2, 3], max_tokens=10, stop_token_ids=[54])
    length = make_seq(3, [1, 2, 3], max_tokens=2)
    for s in (eos, ignore, stop_id, length):
        sched.add(s)
    run(sched, model)
    assert eos.output_token_ids == [53, 54, 55, EOS] and (eos.finish_reason, eos.stop_reason) == (
        "stop",
        None,
    )
    assert ignore.output_token_ids == [53, 54, 55, EOS, 57] and ignore.finish_reason == "length"
    assert stop_id.output_token_ids == [53, 54] and (stop_id.finish_reason, stop_id.stop_reason) == (
        "stop",
        54,
    )
    assert length.output_token_ids == [53, 54] and length.finish_reason == "length"
    for s in (eos, ignore, stop_id, length):
        assert s.is_finished and s.block_table == [] and s.finished_time >= s.first_token_time
    assert bm.num_free_blocks == 64


def test_max_model_len_caps_generation():
    sched, _ = make(max_model_len=8)
    s = make_seq(0, [1, 2, 3, 4, 5], max_tokens=100)
    sched.add(s)
    run(sched)
    assert s.num_tokens == 8 and s.finish_reason == "length"


def test_abort_frees_blocks():
    sched, bm = make()
    a = make_seq(0, [1] * 9, max_tokens=50)
    b = make_seq(1, [2] * 9, max_tokens=50)
    sched.add(a)
    step(sched)
    step(sched)
    sched.add(b)
    assert bm.num_used_blocks == 3
    assert sched.abort(0) is a and sched.abort(1) is b
    assert (a.finish_reason, b.finish_reason) == ("abort", "abort") and a.is_finished and b.is_finished
    assert bm.num_free_blocks == 64 and not sched.has_unfinished()
    assert sched.abort(0) is None and sched.abort(12345) is None


def test_abort_between_schedule_and_postprocess():
    sched, bm = make()
    a = make_seq(0, [1, 2, 3], max_tokens=5)
    b = make_seq(1, [1, 2, 4], max_tokens=5)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sampled = run_fake_model(bm, batch, next_token)  # the runner's step; the abort arrives meanwhile
    sched.abort(0)
    finished = sched.postprocess(batch, sampled)
    assert finished == [] and a.output_token_ids == [] and b.output_token_ids == [sampled[1]]
    run(sched)
    assert bm.num_free_blocks == 64


def test_requests_that_can_never_fit_are_refused():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(KilnError, match="max_model_len"):
        sched.add(make_seq(0, [1] * 64))
    with pytest.raises(KilnError, match="KV blocks"):
        sched.add(make_seq(1, [1] * 10, max_tokens=8))  # up to 17 cached tokens: 5 blocks > 4
    sched.add(make_seq(2, [1] * 10, max_tokens=7))  # 16 tokens: exactly the 4 blocks
    assert run(sched)


def test_prefix_cache_hit_across_requests():
    sched, bm = make()
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks of 4
    a = make_seq(0, prompt, max_tokens=2)
    sched.add(a)
    run(sched)
    b = make_seq(1, prompt, max_tokens=2)
    sched.add(b)
    batch, _ = step(sched)
    assert b.num_cached_tokens == 12 and batch.computed_before == [12] and batch.num_new_tokens == [1]
    run(sched)
    assert b.output_token_ids == a.output_token_ids
    # a prompt of exactly 3 full cached blocks: the last is recomputed, so a token is left to sample from
    c = make_seq(2, prompt[:12], max_tokens=2)
    sched.add(c)
    batch, _ = step(sched)
    assert c.num_cached_tokens == 8 and batch.num_new_tokens == [4] and batch.samples == [True]
    run(sched)
    assert c.output_token_ids == reference_output(prompt[:12], 2)


def test_no_prefix_hit_on_a_prefill_still_in_progress():
    sched, bm = make(max_num_batched_tokens=8, max_num_seqs=4)
    prompt = list(range(1, 31))  # 30 tokens: A prefills them in 8-token chunks
    a = make_seq(0, prompt, max_tokens=3)
    sched.add(a)
    step(sched)  # A has computed 8 tokens: blocks 0 and 1
    b = make_seq(1, prompt + [99], max_tokens=3)
    sched.add(b)
    step(sched)  # A takes the whole budget; B waits
    assert b.status is SequenceStatus.WAITING
    assert bm.num_cached_prefix_tokens(b) == 16  # only what A has computed, not its whole prompt
    run(sched)
    assert b.num_cached_tokens >= 16
    assert a.output_token_ids == reference_output(prompt, 3)
    assert b.output_token_ids == reference_output(prompt + [99], 3)


def test_logprobs_are_stored_for_the_sequences_that_asked():
    sched, _ = make()
    a = make_seq(0, [1, 2], max_tokens=1, logprobs=1)
    b = make_seq(1, [3, 4], max_tokens=1)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.postprocess(
        batch, [5, 6], logprobs=[-0.5, -1.5], top_logprobs=[[(5, -0.5), (9, -2.0)], [(6, -1.5), (1, -3.0)]]
    )
    assert a.output_logprobs == [-0.5] and a.output_top_logprobs == [[(5, -0.5)]]
    assert b.output_logprobs == [] and b.output_top_logprobs == []


def test_random_workload_no_leaks_same_outputs():
    rng = random.Random(0)
    shared = [rng.randrange(1, 100) for _ in range(10)]
    specs = []
    for i in range(24):
        prompt = (shared if i % 2 else []) + [rng.randrange(1, 100) for _ in range(rng.randrange(1, 30))]
        specs.append((prompt, rng.randrange(1, 20)))
    # a tight cache and budget: chunked prefill, prefix hits and preemption all happen
    sched, bm = make(num_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64)
    seqs = []
    batches = []
    for i, (prompt, max_tokens) in enumerate(specs):
        seqs.append(make_seq(i, prompt, max_tokens=max_tokens))
        sched.add(seqs[-1])
        if i % 3 == 2:  # requests keep arriving while others run
            batches.append(step(sched)[0])
    batches += run(sched)
    assert any(b.preempted for b in batches)
    assert any(not s for b in batches for s in b.samples)  # some chunked prefill
    assert any(s.num_cached_tokens > 0 for s in seqs)
    for s, (prompt, max_tokens) in zip(seqs, specs):
        assert s.output_token_ids == reference_output(prompt, max_tokens)
    assert bm.num_free_blocks == 24 and sum(bm.ref_counts) == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_model_len": 0}, "max_model_len"),
        ({"eos_token_ids": ["</s>"]}, "eos_token_ids"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
        (
            {"max_num_batched_tokens": 64, "max_model_len": 128, "max_num_seqs": 8, "chunked_prefill": False},
            "chunked",
        ),
    ],
)
def test_config_validation(kwargs, field):
    base = {"max_model_len": 64, "block_size": 4}
    with pytest.raises(KilnError, match=field):
        SchedulerConfig(**{**base, **kwargs})


def test_block_size_must_match():
    with pytest.raises(KilnError, match="block_size"):
        Scheduler(SchedulerConfig(max_model_len=64, block_size=8), BlockManager(8, 4))
