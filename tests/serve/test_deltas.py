"""The engine process's wire format: the deltas it sends each step rebuild exactly the engine's cumulative
outputs on the server side (tokens, logprobs, text that grows, text whose cut character is completed, text a
stop string cuts back, n completions finishing at different steps), in lists no later step touches."""

from __future__ import annotations

import pickle
from dataclasses import replace

from kiln.infer import SamplingParams
from kiln.infer.engine import CompletionOutput, RequestOutput
from kiln.serve.deltas import DeltaDecoder, DeltaEncoder

from ._server import engine_for


def _out(texts, tokens, finished=False, reasons=None, lps=True, plp=None) -> RequestOutput:
    comps = [
        CompletionOutput(
            j,
            t,
            list(ids),
            (reasons or {}).get(j),
            None,
            [-0.5 * k for k in range(len(ids))] if lps else None,
            [[(k, -1.0)] for k in range(len(ids))] if lps else None,
        )
        for j, (t, ids) in enumerate(zip(texts, tokens))
    ]
    return RequestOutput("3-1", "p", [7, 8], comps, finished, plp, {"e2e_s": 1.0} if finished else {})


def _roundtrip(steps: list[RequestOutput]) -> list[RequestOutput]:
    enc, dec, got = DeltaEncoder(), DeltaDecoder(), []
    for out in steps:
        delta = pickle.loads(pickle.dumps(enc.encode(3, 1, out)))  # what crosses the pipe
        key, i = dec.apply(delta)
        got.append(dec.output(key, i, delta[2], delta[5], copy=True))
    assert len(dec) == 0  # the finished request is forgotten on both sides
    return got


def test_deltas_rebuild_the_cumulative_outputs():
    steps = [
        _out(["a", ""], [[1], []], plp=[-1.0]),
        _out(["ab\ufffd", "x"], [[1, 2], [5]], plp=[-1.0, -2.0]),  # a character cut between two tokens
        _out(["ab\u00e9", "x"], [[1, 2, 3], [5]], plp=[-1.0, -2.0]),  # ... completed: U+FFFD replaced
        _out(["ab\u00e9", "xy"], [[1, 2, 3], [5, 6]], reasons={0: "length"}, plp=[-1.0, -2.0]),
        _out(["ab\u00e9", "x"], [[1, 2, 3], [5, 6, 9]], True, {0: "length", 1: "stop"}, plp=[-1.0, -2.0]),
    ]
    got = _roundtrip(steps)
    assert got == steps
    # each delivered output has lists of its own: later steps did not extend the first one's
    assert got[0].outputs[0].token_ids == [1] and got[0].outputs[0].logprobs == [0.0]
    assert _roundtrip([_out(["q"], [[4]], True, {0: "stop"}, lps=False)])[0].outputs[0].logprobs is None


def test_deltas_of_a_real_engine_run(model_dir):
    """Two engines on the same weights and seeds, stop strings, n = 2, logprobs or none, prompt logprobs, more
    requests than a step holds: one steps as the thread transport does (cumulative outputs, encoded), the
    other as the engine process does (finished_only, running requests read live). Both decode, step by
    step, to exactly the first engine's outputs."""
    ref, live = engine_for(model_dir, max_num_seqs=3).engine, engine_for(model_dir, max_num_seqs=3).engine
    prompts = ["def contextmanager(func):", "class Foo:", "import os", "with open(", "x = [1, 2"]
    for eng in (ref, live):
        for k, p in enumerate(prompts):
            # n = 1 without logprobs (k = 0, 2) is the engine process's fast path (encode_live)
            lp = 2 if k % 2 else None
            params = SamplingParams(
                max_tokens=6 + 3 * k, temperature=1.0, seed=k, n=1 + k % 2, logprobs=lp, stop=["e", "("]
            )
            if k == 4:
                params = SamplingParams(max_tokens=5, temperature=0.0, logprobs=1, prompt_logprobs=1)
            eng.add_request(p, params, request_id=f"{k}-0")
    enc_ref, dec_ref, enc_live, dec_live, steps = (
        DeltaEncoder(),
        DeltaDecoder(),
        DeltaEncoder(),
        DeltaDecoder(),
        0,
    )
    while ref.has_unfinished():
        want = {out.request_id: out for out in ref.step()}
        for out in want.values():
            delta = pickle.loads(pickle.dumps(enc_ref.encode(int(out.request_id[0]), 0, out)))
            assert dec_ref.output(*dec_ref.apply(delta), delta[2], delta[5], copy=True) == out
        got, deltas = {}, []
        running = {rid: req for rid, req in live.requests.items()}
        for out in live.step(finished_only=True):
            deltas.append(enc_live.encode(int(out.request_id[0]), 0, out))
            running.pop(out.request_id)
        for rid, req in running.items():
            d = enc_live.encode_live(int(rid[0]), 0, req)
            if d is not None:
                deltas.append(d)
        for delta in pickle.loads(pickle.dumps(deltas)):
            out = dec_live.output(*dec_live.apply(delta), delta[2], delta[5], copy=True)
            got[out.request_id] = out
        # two engines' timings differ: compare which timings came, and everything else exactly
        assert {k: replace(o, metrics=set(o.metrics)) for k, o in got.items()} == {
            k: replace(o, metrics=set(o.metrics)) for k, o in want.items()
        }, steps
        steps += 1
    assert steps > 5 and not live.has_unfinished() and len(dec_ref) == len(dec_live) == 0
