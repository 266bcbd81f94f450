"""The engine in a process of its own (`kiln serve`'s transport), through the real `openai` client: the same
responses as the engine in a thread (text, logprobs, usage; streamed and not; n > 1), a disconnect frees
the KV blocks (the gauge on /metrics), a killed engine process answers 500 and /health 503, a model that does
not load is `kiln: error:` and exit 2. Each engine process start costs seconds: they are few."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from kiln.cli import main
from kiln.infer import SamplingParams

from ._server import RunningServer, engine_for, process_server, served
from .test_load import metric

PROMPT = "def contextmanager(func):"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def proc_server(model_dir):
    with process_server(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def thread_server(model_dir):
    llm, config = served(model_dir)
    with RunningServer(llm, config) as s:
        yield s


def _client(s: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _same(a, b) -> None:
    """Two responses are the same but for their id and creation time."""
    a, b = a.model_dump(), b.model_dump()
    for d in (a, b):
        d.pop("id"), d.pop("created")
    assert a == b


def test_greedy_text_equals_the_offline_engine_streamed_or_not(proc_server, model_dir):
    client = _client(proc_server)
    ref = engine_for(model_dir).generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0))[0]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert whole.choices[0].text == ref.outputs[0].text
    assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == ref.outputs[0].text
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_responses_equal_the_thread_transport(proc_server, thread_server):
    """Logprobs (both shapes), echo, stop strings, n > 1 seeded sampling, chat: field for field the same."""
    p, t = _client(proc_server), _client(thread_server)
    for kw in (
        # a prompt neither server has seen: the engine fails on the prompt logprobs of a prompt whose
        # prefix is cached ("prompt logprobs must be recorded in order"; kiln.infer, either transport)
        dict(prompt="class Bar(object):", max_tokens=16, temperature=0, logprobs=3, echo=True),
        dict(prompt=[PROMPT, "class Foo:"], n=3, max_tokens=10, temperature=1.0, seed=11, logprobs=1),
        dict(prompt=PROMPT, max_tokens=24, temperature=0.8, seed=2, stop=["e", "("]),
    ):
        _same(p.completions.create(model="tiny", **kw), t.completions.create(model="tiny", **kw))
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    _same(p.chat.completions.create(**kw), t.chat.completions.create(**kw))
    # streamed, n = 2: each choice's text and logprobs add up to the thread transport's
    kw = dict(
        model="tiny", prompt=PROMPT, n=2, max_tokens=10, temperature=1.0, seed=4, logprobs=2, stream=True
    )
    for_p, for_t = list(p.completions.create(**kw)), list(t.completions.create(**kw))
    for idx in (0, 1):
        a = [c.choices[0] for c in for_p if c.choices[0].index == idx]
        b = [c.choices[0] for c in for_t if c.choices[0].index == idx]
        assert "".join(x.text for x in a) == "".join(x.text for x in b)
        lp = [v for x in a if x.logprobs for v in x.logprobs.token_logprobs]
        assert lp == [v for x in b if x.logprobs for v in x.logprobs.token_logprobs] and lp
        assert a[-1].finish_reason == b[-1].finish_reason


def test_disconnect_aborts_and_frees_the_blocks(proc_server):
    url = proc_server.url
    body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            # the first chunk, then hang up: it leaves at the first token, while later chunks wait out the
            # stream interval (20 ms each), long enough on a busy machine for the engine to finish all 200.
            # `lines` stays referenced until /metrics is read: a line iterator dropped at the break closes
            # the connection (httpcore closes it when its byte stream is closed), and the abort can then
            # reach the engine before the read
            lines = r.iter_lines()
            for ln in lines:
                if ln.startswith("data: {"):
                    break
            text = http.get("/metrics").text
            assert metric(text, "kiln_kv_blocks_used") > 0 and metric(text, "kiln_requests_running") == 1
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = http.get("/metrics").text
            if metric(text, "kiln_kv_blocks_used") == 0 and metric(text, "kiln_requests_running") == 0:
                break
            time.sleep(0.05)
        assert metric(text, "kiln_kv_blocks_used") == 0 and metric(text, "kiln_requests_running") == 0
        assert metric(text, 'kiln_requests_finished_total{finish_reason="abort"}') >= 1
        assert http.get("/health").status_code == 200


def test_killed_engine_process_is_500_and_unhealthy(model_dir):
    with process_server(model_dir) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        long = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True}
        results: dict = {}
        started = threading.Event()

        def whole():
            results["whole"] = http.post("/v1/completions", json=long)

        def stream():
            with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                lines = []
                for ln in r.iter_lines():
                    lines.append(ln)
                    started.set()
                results["stream"] = lines

        threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
        for th in threads:
            th.start()
        assert started.wait(30)
        os.kill(s.server.worker.pid, signal.SIGKILL)
        for th in threads:
            th.join(30)
        r = results["whole"]
        assert r.status_code == 500 and "the engine failed" in r.json()["error"]["message"], r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        # the stream had begun (200): it ends with the error in OpenAI's shape, then [DONE]
        lines = [ln for ln in results["stream"] if ln]
        assert lines[-1] == "data: [DONE]"
        assert "killed by SIGKILL" in json.loads(lines[-2][6:])["error"]["message"]
        assert http.get("/health").status_code == 503
        assert http.post("/v1/completions", json={**long, "max_tokens": 2}).status_code == 503


def test_model_that_does_not_load_is_a_cli_error(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")  # exists, is no model: the engine process's load fails
    assert main(["serve", "--model", str(tmp_path), "--device", "cpu", "--port", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error:") and "Traceback" not in err, err


def test_burst_is_one_intake_process_transport(proc_server, monkeypatch):
    """The adds of one tick cross the pipe as one command and come back as one intake (test_admission)."""
    from .test_admission import check_burst_is_one_intake

    check_burst_is_one_intake(proc_server, monkeypatch)
    reg = proc_server.server.metrics.registry
    assert reg.get_sample_value("kiln_engine_steps_total") >= 4
    # every intake and step message was stamped by the engine process and timed here
    assert reg.get_sample_value("kiln_engine_reply_lag_seconds_count") >= 5
    assert reg.get_sample_value("kiln_engine_reply_lag_seconds_sum") < 60
    # admission's stages: the command's crossing, the intake, the sender, the pipe and the event loop
    for stage in ("batch", "command", "intake", "sender", "pipe", "event_loop"):
        assert reg.get_sample_value("kiln_admission_stage_seconds_count", {"stage": stage}) >= 1, stage
    assert reg.get_sample_value("kiln_engine_step_seconds_count") == reg.get_sample_value(
        "kiln_engine_steps_total"
    )


def test_reader_frames_match_connection_send():
    """The reader's own framing (engine_process._frames) reads what multiprocessing's Connection.send
    wrote, cut anywhere: small messages, one larger than the pipe, several in one read."""
    import multiprocessing as mp
    import os
    import threading

    from kiln.serve.engine_process import _frames

    r, w = mp.Pipe(duplex=False)
    msgs = [("intake", [(1, 5, None)], 0, 1.5)]
    msgs += [("step", list(range(n)), (1, 2, 3, 4), 2.5) for n in (0, 7, 50000)]
    msgs += [("stopped",)]
    t = threading.Thread(target=lambda: [w.send(m) for m in msgs])
    t.start()
    buf, got = bytearray(), []
    while len(got) < len(msgs):
        buf += os.read(r.fileno(), 997)  # frames cut at every kind of place
        got += _frames(buf)
    t.join()
    assert got == msgs and not buf
    r.close()
    w.close()
