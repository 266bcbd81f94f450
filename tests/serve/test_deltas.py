"""The engine process's wire format: the deltas it sends each step rebuild exactly the engine's cumulative
outputs on the server side (tokens, logprobs, text that grows, text whose cut character is completed, text a
stop string cuts back, n completions finishing at different steps), in lists no later step touches."""

from __future__ import annotations

import pickle

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
    """Every step of an engine run with stop strings, n = 2 and logprobs, through the encoder and decoder."""
    eng = engine_for(model_dir).engine
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=5, n=2, logprobs=2, stop=["e", "("])
    eng.add_request("def contextmanager(func):", params, request_id="0-0")
    enc, dec, n = DeltaEncoder(), DeltaDecoder(), 0
    while eng.has_unfinished():
        for out in eng.step():
            delta = pickle.loads(pickle.dumps(enc.encode(0, 0, out)))
            assert dec.output(*dec.apply(delta), delta[2], delta[5], copy=True) == out
            n += 1
    assert n > 1 and len(dec) == 0
