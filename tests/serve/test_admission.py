"""Admission: requests submitted together reach the engine together. The adds of one tick of the event loop
leave as one command, the engine takes every queued command before a step (and an idle engine waits a
moment for the rest of a burst), and answers each intake at once; a bad request in a burst still gets its
own 400 while the others run."""

from __future__ import annotations

import asyncio
import queue

import httpx

from kiln.infer.sampling_params import SamplingParams
from kiln.kernels.compile_watch import CompileWatch
from kiln.serve import engine_loop, worker
from kiln.serve.engine_loop import EngineLoop
from kiln.serve.protocol import APIError

from ._server import RunningServer, engine_for, served

GOOD = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TOO_LONG = SamplingParams(
    max_tokens=10_000
)  # prompt + max_tokens beyond the 256-token context: the engine's 400


class _Recorder:
    """A sink that records the loop's events."""

    def __init__(self, engine):
        self.engine, self.intakes, self.steps, self.timings = engine, [], [], []

    def intake(self, results, steps, timing):
        self.intakes.append((results, steps))
        self.timings.append(timing)

    def step(self, items, gauges):
        if items:
            self.steps.append((len(self.engine.scheduler.running), gauges))

    def crashed(self, message):
        raise AssertionError(message)


def test_an_idle_engine_takes_a_burst_before_its_first_step(model_dir):
    """The first command wakes the idle loop; the ones arriving within the burst gap join the same intake,
    and the first step runs all of them. A busy loop only takes what is already queued (timeout 0)."""
    eng = engine_for(model_dir).engine
    rec = _Recorder(eng)
    adds = [("add", [(k, [[5 + k, 6, 7]], GOOD)]) for k in range(4)]
    script = [adds[0], adds[1], adds[2], queue.Empty, adds[3], ("stop",)]
    timeouts = []

    def get(timeout):
        timeouts.append(timeout)
        if len(timeouts) > 1 and not rec.steps and timeouts[-1] is not None:
            assert 0 <= timeout <= engine_loop.BURST_GAP_S  # still in the idle engine's burst window
        item = script.pop(0)
        if item is queue.Empty:
            raise queue.Empty
        return item

    EngineLoop(eng, rec).run(get)
    assert timeouts[0] is None  # idle: blocks for the first command
    (first, steps0), (second, steps1) = rec.intakes
    assert [r[0] for r in first] == [0, 1, 2] and all(r[1] == 3 and r[2] is None for r in first)
    assert steps0 == 0 and rec.steps[0][0] == 3  # the first step scheduled the whole burst
    assert [r[0] for r in second] == [3] and steps1 == 1  # busy: the next intake came after one step
    assert timeouts[4:] == [0.0, 0.0]  # busy: only what is queued


def _burst(s: RunningServer, params: list[SamplingParams]) -> list:
    """Submit one request per params in one tick of the server's event loop; wait for each accepted one
    to finish. Returns per request its final output's token count, or the APIError it got."""
    worker = s.server.worker

    async def go():
        subs = [worker.submit([[11, 12, 13, i]], p, stream=False) for i, p in enumerate(params)]
        got = await asyncio.gather(*subs, return_exceptions=True)
        out = []
        for h in got:
            if isinstance(h, BaseException):
                out.append(h)
                continue
            while not h.done:
                _, last = await h.next()
            h.abort()  # what a handler's finally does: the admission is released
            out.append(len(last.outputs[0].token_ids))
        return out

    return asyncio.run_coroutine_threadsafe(go(), worker._loop).result(60)


def _sample(s: RunningServer, name: str) -> float:
    return s.server.metrics.registry.get_sample_value(name) or 0.0


def check_burst_is_one_intake(s: RunningServer, monkeypatch) -> None:
    """Eight requests in one tick, the fourth refused by the engine: one command, one intake of the seven
    others, which all run; the refused one gets its own 400 naming the problem."""
    monkeypatch.setattr(worker, "ADD_BATCH_S", 60.0)  # the tick alone decides (a slow machine's tick is long)
    count0 = _sample(s, "kiln_engine_intake_requests_count")
    sum0 = _sample(s, "kiln_engine_intake_requests_sum")
    params = [GOOD] * 3 + [TOO_LONG] + [GOOD] * 4
    got = _burst(s, params)
    bad = got.pop(3)
    assert isinstance(bad, APIError) and bad.status == 400 and "exceeds the context" in bad.message
    assert got == [4] * 7
    assert _sample(s, "kiln_engine_intake_requests_count") - count0 == 1
    assert _sample(s, "kiln_engine_intake_requests_sum") - sum0 == 7
    assert _sample(s, "kiln_admission_latency_seconds_count") >= 7
    assert s.server.worker.in_flight == 0


def test_burst_is_one_intake_thread_transport(model_dir, monkeypatch):
    llm, config = served(model_dir, max_num_seqs=8)
    with RunningServer(llm, config) as s:
        check_burst_is_one_intake(s, monkeypatch)
        assert _sample(s, "kiln_engine_steps_total") >= 4
        assert s.wait_idle()


def test_concurrent_http_requests_one_bad(model_dir):
    """Through HTTP, however the requests were batched: each gets its own answer."""
    llm, config = served(model_dir)
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def go(url):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            bodies = [body] * 5 + [{**body, "max_tokens": 10_000}] + [body] * 5
            return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))

    with RunningServer(llm, config) as s:
        rs = asyncio.run(go(s.url))
        bad = rs.pop(5)
        assert bad.status_code == 400 and "exceeds the context" in bad.json()["error"]["message"]
        texts = {r.json()["choices"][0]["text"] for r in rs}
        assert all(r.status_code == 200 for r in rs) and len(texts) == 1  # greedy: the same text each
        assert all(r.json()["usage"]["completion_tokens"] == 5 for r in rs)


def test_adds_leave_at_the_end_of_the_tick_or_when_old(model_dir, monkeypatch):
    """One command per tick; with ADD_BATCH_S = 0 every add leaves at once (a long tick holds none back)."""
    llm, config = served(model_dir)
    with RunningServer(llm, config) as s:
        w = s.server.worker
        sent = []
        send = w.send
        monkeypatch.setattr(w, "send", lambda cmd: (sent.append(cmd), send(cmd))[1])
        monkeypatch.setattr(worker, "ADD_BATCH_S", 60.0)
        assert _burst(s, [GOOD] * 3) == [4] * 3
        assert [len(c[1]) for c in sent if c[0] == "add"] == [3]
        sent.clear()
        monkeypatch.setattr(worker, "ADD_BATCH_S", 0.0)
        assert _burst(s, [GOOD] * 3) == [4] * 3
        assert [len(c[1]) for c in sent if c[0] == "add"] == [1, 1, 1]


def test_a_slow_step_is_logged_with_what_it_ran(model_dir, monkeypatch):
    """A step over SLOW_STEP_S leaves one log line naming its step number, its time and the batch it ran
    (here: every step, the threshold lowered to 0): the first step is the prefill of both prompts, the
    later ones decode rows only."""
    monkeypatch.setattr(engine_loop, "SLOW_STEP_S", 0.0)
    eng = engine_for(model_dir).engine
    lines: list[str] = []
    script = [("add", [(0, [[5, 6, 7], [8, 9, 10, 11]], GOOD)])]

    def get(timeout):  # the add when idle, then nothing while busy; "stop" once idle again
        if timeout is None:
            return script.pop(0) if script else ("stop",)
        raise queue.Empty

    EngineLoop(eng, _Recorder(eng), log=lines.append).run(get)
    assert lines, "no step was logged"
    first = lines[0]
    assert first.startswith("kiln serve: slow engine step 1: ") and " s; " in first
    assert "2 sequences, 7 tokens (0 decode rows, 2 prefill chunks of 7 tokens, longest 4)" in first
    assert "mixed/prefill" in first
    assert "; host s: schedule " in first and ", launch " in first and ", wait+post " in first
    assert "Triton compiles" not in first  # no CompileWatch given: nothing to report
    # with one, a step's compiles are named (here: the watch told of two during the step)
    compiled = CompileWatch.describe([("_k", 1.0), ("_k", 0.25)])
    assert engine_loop.slow_step_line(3, 1.5, eng, compiled).endswith("; 2 Triton compiles, 1.25 s: _k x2")
    assert any("decode only" in ln and "0 prefill chunks" in ln for ln in lines[1:])
    # without a log nothing is written (and nothing is formatted)
    monkeypatch.setattr(engine_loop, "slow_step_line", lambda *a: (_ for _ in ()).throw(AssertionError))
    script[:] = [("add", [(1, [[5, 6, 7]], GOOD)])]
    EngineLoop(eng, _Recorder(eng)).run(get)
