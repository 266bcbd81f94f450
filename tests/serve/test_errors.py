"""Every error the server answers, with its status and OpenAI's error body: 400 (bad JSON, missing
fields, wrong types, unknown fields, empty or over-long prompts, out-of-range sampling values, no chat
template), 404 (unknown model or route), 401 (API key), 413 (body size), 503 (at capacity); and the CLI's
own errors."""

from __future__ import annotations

import threading

import httpx
import pytest

from kiln.cli import main

from ._server import RunningServer, served

OK = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2}


def error_of(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err["message"]


@pytest.fixture(scope="module")
def server(model_dir):
    llm, config = served(model_dir)
    with RunningServer(llm, config) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": "x"}, "'model' is required"),
        ({"model": "tiny"}, "'prompt' is required"),
        ({**OK, "max_tokens": "5"}, "max_tokens"),
        ({**OK, "temperature": "hot"}, "temperature"),
        ({**OK, "prompt": 3}, "prompt"),
        ({**OK, "prompt": ""}, "prompt is empty"),
        ({**OK, "prompt": []}, "prompt is empty"),
        ({**OK, "prompt": [1, 2, 10**6]}, "token ids must be ints"),
        ({**OK, "max_tokens": 10_000}, "exceeds the context"),
        ({**OK, "temperature": -1.0}, "temperature must be >= 0"),
        ({**OK, "top_p": 1.5}, "top_p must be in (0, 1]"),
        ({**OK, "presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
        ({**OK, "n": 0}, "n must be >= 1"),
        ({**OK, "logprobs": 21}, "logprobs must be None or in [0, 20]"),
        ({**OK, "max_tokens": 0}, "max_tokens must be >= 1"),
        ({**OK, "stop": [""]}, "stop strings must be non-empty"),
        ({**OK, "best_of": 2}, "unknown field 'best_of'"),
        ({**OK, "stream_options": {"include_usage": True}}, "stream_options is only allowed"),
    ],
)
def test_completion_400(http, body, words):
    assert words in error_of(http.post("/v1/completions", json=body), 400)


def test_chat_400(http):
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ({**base, "messages": []}, "messages is empty"),
        ({**base, "messages": [{"role": "wizard", "content": "hi"}]}, "role"),
        ({**base, "messages": [{"content": "hi"}]}, "role"),
        ({**base, "top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({**base, "max_tokens": 2, "max_completion_tokens": 2}, "not both"),
        ({**base, "messages": [{"role": "user", "content": "x " * 300}]}, "exceeds the context"),
        ({**base, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text content"),
    ]
    for body, words in cases:
        assert words in error_of(http.post("/v1/chat/completions", json=body), 400), body


def test_malformed_bodies_and_routes(http):
    assert "not valid JSON" in error_of(http.post("/v1/completions", content=b"{nope"), 400)
    assert "JSON object" in error_of(http.post("/v1/completions", content=b"[1, 2]"), 400)
    assert "does not exist" in error_of(http.post("/v1/completions", json={**OK, "model": "gpt-4"}), 404)
    error_of(http.get("/v1/nothing"), 404)
    error_of(http.get("/v1/completions"), 405)
    assert http.post("/v1/completions", json=OK).status_code == 200  # the server still serves


def test_key_body_limit_no_template_and_capacity(model_dir):
    """A server with an API key, a 2 KB body limit, no chat template and room for 1 sequence in all."""
    llm, config = served(
        model_dir, api_key="sekrit", max_body_bytes=2048, max_waiting=0, max_num_seqs=1, num_blocks=64
    )
    config.chat_template = None
    key = {"Authorization": "Bearer sekrit"}
    with RunningServer(llm, config) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        assert "API key" in error_of(http.post("/v1/completions", json=OK), 401)
        bad = {"Authorization": "Bearer wrong"}
        error_of(http.post("/v1/completions", json=OK, headers=bad), 401)
        error_of(http.get("/v1/models"), 401)
        assert http.get("/health").status_code == 200  # health and metrics need no key
        assert http.post("/v1/completions", json=OK, headers=key).status_code == 200
        big = {**OK, "prompt": "x" * 4000}
        assert "exceeds the limit of 2048 bytes" in error_of(
            http.post("/v1/completions", json=big, headers=key), 413
        )
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        assert "no chat template" in error_of(http.post("/v1/chat/completions", json=chat, headers=key), 400)
        # capacity: one long stream holds the only place; the next request is refused with 503
        long = {**OK, "max_tokens": 150, "ignore_eos": True, "stream": True}
        started, release = threading.Event(), threading.Event()

        def hold():
            with http.stream("POST", "/v1/completions", json=long, headers=key) as r:
                for _ in r.iter_lines():
                    started.set()
                    if release.is_set():
                        break

        t = threading.Thread(target=hold)
        t.start()
        assert started.wait(30)
        r = http.post("/v1/completions", json=OK, headers=key)
        assert "at capacity" in error_of(r, 503) and r.headers["retry-after"] == "1"
        # more sequences than the server could ever hold is the request's fault: 400, not 503
        assert "exceed what this server holds" in error_of(
            http.post("/v1/completions", json={**OK, "n": 2}, headers=key), 400
        )
        release.set()
        t.join(30)
        assert s.wait_idle()
        assert http.post("/v1/completions", json=OK, headers=key).status_code == 200
        metrics = http.get("/metrics").text
        assert "kiln_requests_rejected_total 1.0" in metrics


def test_cli_errors(tmp_path, capsys):
    assert main(["serve", "--model", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    assert "kiln: error:" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--port", "70000"]) == 2
    assert "--port must be in" in capsys.readouterr().err


def test_engine_failure_is_500_and_unhealthy(model_dir):
    llm, config = served(model_dir)

    def broken_step():
        raise RuntimeError("device lost")

    with RunningServer(llm, config) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        llm.engine.step = broken_step  # the engine thread's next step fails
        assert "device lost" in error_of(http.post("/v1/completions", json=OK), 500)
        assert "not running" in error_of(http.get("/health"), 503)
        error_of(http.post("/v1/completions", json=OK), 503)  # nothing is admitted any more
