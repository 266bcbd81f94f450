"""Asynchronous scheduling (step N+1 launched before step N's ids reach the host) gives the synchronous
engine's outputs token for token, over a workload that exercises every engine feature at once, and leaves
the block manager as it found it."""

from __future__ import annotations

import pytest

from kiln.errors import KilnError
from kiln.infer import SamplingParams
from kiln.infer.config import EngineConfig
from kiln.infer.engine import LLM

from ._hf import hf_causal_lm

SHARED = [(7 * i + 3) % 300 for i in range(12)]  # a 12-token prefix (3 blocks of 4) several prompts share
PROMPTS = [
    [5],
    SHARED + [100, 101],
    [(11 * i) % 300 for i in range(37)],  # longer than the 16-token step budget: chunked
    SHARED,
    [40, 2, 9],
    SHARED + [(3 * i) % 300 for i in range(9)],
    [(13 * i + 1) % 300 for i in range(23)],
    [42] * 16,
    SHARED + [7],
    [1, 2, 3, 4, 5],
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint path, a byte-level tokenizer of 300 ids under the 512-id model)."""
    from kiln.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("async")
    hf_causal_lm("llama", seed=4).save_pretrained(path)
    tok = train_bpe(["hello world, " * 50, "abc def ghi " * 40], vocab_size=300)
    return path, tok


def make(setup, async_on: bool, eos=(), **engine) -> LLM:
    path, tok = setup
    engine = {
        "device": "cpu",
        "block_size": 4,
        "num_blocks": 256,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 8,
        "max_graph_batch": 8,
        "async_scheduling": "on" if async_on else "off",
        **engine,
    }
    return LLM(path, tokenizer=tok, eos_token_ids=list(eos), log=None, **engine)


def workload(stop_tok: int, stop_str: str) -> list[SamplingParams]:
    """One SamplingParams per prompt: every feature the engine has."""
    g = dict(temperature=0.0)
    return [
        SamplingParams(max_tokens=9, **g),  # greedy, length
        SamplingParams(max_tokens=14, **g, stop_token_ids=[stop_tok]),  # a stop id
        SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=11, logprobs=3),
        SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3),  # n > 1, seeded
        SamplingParams(max_tokens=16, temperature=1.0, seed=6, stop=[stop_str]),  # a stop string
        SamplingParams(max_tokens=11, **g, prompt_logprobs=2, logprobs=1),
        # penalties make their steps synchronous: short, so most of the run overlaps
        SamplingParams(max_tokens=4, temperature=0.8, seed=3, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(max_tokens=3, **g, repetition_penalty=1.3),
        SamplingParams(max_tokens=13, temperature=0.7, min_p=0.05, seed=9),
        SamplingParams(max_tokens=20, **g),  # aborted after 3 tokens
    ]


def drive(
    llm: LLM, params: list[SamplingParams], abort_index: int | None, abort_after: int = 3, prompts=None
):
    """Run the requests through the step loop; abort one once it has reported abort_after tokens (the
    same moment for both engines: async reports a step later, and drops the token in flight). Returns
    the final outputs by prompt index, the number of steps, and the preemptions."""
    eng = llm.engine
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts or PROMPTS, params)]
    seqs = [s for rid in rids for s in eng.requests[rid].seqs]
    final, steps = {}, 0
    while eng.has_unfinished():
        steps += 1
        for out in eng.step():
            if out.finished:
                final[rids.index(out.request_id)] = out
            elif abort_index is not None and out.request_id == rids[abort_index]:
                if len(out.outputs[0].token_ids) >= abort_after:
                    eng.abort(out.request_id)
    return [final[i] for i in range(len(rids))], steps, sum(s.num_preemptions for s in seqs)


def assert_same(got, want) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert len(g.outputs) == len(w.outputs), i
        for a, b in zip(g.outputs, w.outputs):
            where = (i, a.index)
            assert a.token_ids == b.token_ids, where
            assert a.text == b.text, where
            assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason), where
            # a step of the async engine can hold one more row (a sequence's wasted last step) or a
            # prefill chunk one token shorter, so float sums run in another order: 1e-5, not bitwise
            if b.logprobs is None:
                assert a.logprobs is None, where
            else:
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5), where
                assert [[t for t, _ in top] for top in a.top_logprobs] == [
                    [t for t, _ in top] for top in b.top_logprobs
                ], where
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None
        else:
            assert g.prompt_logprobs == pytest.approx(w.prompt_logprobs, abs=1e-5), i


def _stops(setup):
    """A stop id and a stop string that the workload's requests do meet (from a synchronous first pass)."""
    _, tok = setup
    llm = make(setup, False)
    ids = llm.generate(PROMPTS[1], SamplingParams(max_tokens=14, temperature=0.0))[0].outputs[0].token_ids
    text = llm.generate(PROMPTS[4], SamplingParams(max_tokens=16, temperature=1.0, seed=6))[0].outputs[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    return ids[6], stop, ids[3]


@pytest.mark.parametrize(
    "engine",
    [
        {},  # chunked prefill (16-token budget), prefix caching, static-buffer decode buckets 1, 2, 4, 8
        {"num_blocks": 30, "enable_prefix_caching": False},  # preemption under KV pressure
        {"decode_backend": "eager", "max_num_batched_tokens": 64},  # eager decode, whole prompts
    ],
    ids=["chunked-prefix-graphs", "preemption", "eager"],
)
def test_async_equals_sync_over_a_mixed_workload(setup, engine):
    stop_tok, stop_str, eos = _stops(setup)
    params = workload(stop_tok, stop_str)
    sync, asyn = make(setup, False, eos=[eos], **engine), make(setup, True, eos=[eos], **engine)
    assert not sync.engine.async_scheduling and asyn.engine.async_scheduling
    fed = []  # rows per step whose token came from the previous step's ids on the device
    run = asyn.engine.runner.execute
    asyn.engine.runner.execute = lambda batch, feed=None: (
        fed.append(len(feed.rows) if feed else 0),
        run(batch, feed),
    )[1]
    free = sync.engine.block_manager.num_free_blocks
    want, sync_steps, sync_preempted = drive(sync, params, abort_index=9)
    got, async_steps, async_preempted = drive(asyn, params, abort_index=9)
    assert_same(got, want)
    reasons = {o.finish_reason for r in want for o in r.outputs}
    assert reasons == {"stop", "length", "abort"}  # the workload does meet every ending
    assert any(o.stop_reason == stop_str for r in want for o in r.outputs)
    assert want[9].outputs[0].finish_reason == "abort" and len(want[9].outputs[0].token_ids) == 3
    if engine.get("num_blocks") == 30:
        assert sync_preempted and async_preempted  # the KV pressure did preempt
    assert sum(fed) > 0  # the overlap did happen
    # async runs about as many steps: one more at the end (the last launch), a few for the sync fallbacks
    assert abs(async_steps - sync_steps) <= 3, (async_steps, sync_steps)
    for llm in (sync, asyn):
        eng = llm.engine
        assert not eng.has_unfinished() and not eng.requests and eng._inflight is None
        assert eng.block_manager.num_free_blocks == free  # no leaked block


def test_async_preempts_and_recomputes_with_a_token_in_flight(setup):
    # 13 blocks of 4 tokens for 6 sequences growing to ~20 tokens: decodes preempt each other while
    # the victims' next tokens are still in flight; the recompute must include them
    prompts = [[(5 * i + j) % 300 for j in range(6 + i)] for i in range(6)]
    sp = [SamplingParams(max_tokens=14, temperature=1.0, seed=i, ignore_eos=True) for i in range(6)]
    outs = {}
    for a in (False, True):
        llm = make(setup, a, num_blocks=13, enable_prefix_caching=False)
        outs[a], _, preempted = drive(llm, sp, abort_index=None, prompts=prompts)
        assert preempted > 0
        assert llm.engine.block_manager.num_free_blocks == 13
    assert_same(outs[True], outs[False])
    assert all(len(o.outputs[0].token_ids) == 14 for o in outs[True])


def test_async_scheduling_switch_is_validated():
    assert EngineConfig(async_scheduling=True).async_scheduling == "on"
    assert EngineConfig(async_scheduling=False).async_scheduling == "off"
    cfg = EngineConfig()
    import torch

    assert cfg.resolve_async(torch.device("cpu")) is False and cfg.resolve_async(torch.device("cuda")) is True
    with pytest.raises(KilnError, match="async_scheduling"):
        EngineConfig(async_scheduling="maybe")


def test_async_stream_and_abort_with_a_step_in_flight(setup):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=6)
    want = [s.outputs[0].text for s in make(setup, False).stream("hello", params)]
    llm = make(setup, True)
    got = [s.outputs[0].text for s in llm.stream("hello", params)]
    assert got[-1] == want[-1] and len(got) == len(want)  # the same states, each one call later
    eng = llm.engine
    rid = eng.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0))
    assert eng.step() == []  # step 1 launched; nothing resolved yet
    assert eng._inflight is not None and eng.has_unfinished()
    eng.step()  # step 2 launched, step 1 resolved: one token
    eng.abort(rid)
    assert eng.has_unfinished()  # step 2 is still in flight
    (out,) = eng.step()  # step 2's token is dropped; the abort is reported
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 1
    assert not eng.has_unfinished() and eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
