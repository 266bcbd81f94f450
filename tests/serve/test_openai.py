"""The server through the real `openai` client: completions and chat, streamed and not; streamed text equals
the whole text for greedy; usage equals the tokenizer's counts; logprobs equal the offline engine's."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from kiln.infer import SamplingParams
from kiln.tokenizer.chat import render_chat

from ._server import RunningServer, engine_for, served

PROMPT = "def contextmanager(func):"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(model_dir):
    llm, config = served(model_dir)
    with RunningServer(llm, config) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(model_dir):
    """An engine of its own on the same weights: the reference for the server's tokens and logprobs."""
    return engine_for(model_dir)


def test_completion_stream_equals_whole_and_usage(client, server):
    tok = server.engine.tokenizer
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=1)
    c = whole.choices[0]
    assert c.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens == len(tok.encode_ordinary(PROMPT))
    assert whole.usage.completion_tokens == len(c.logprobs.tokens)
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
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
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == c.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert server.wait_idle()


def test_completion_logprobs_equal_the_engine(client, offline):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, logprobs=3))[0].outputs[0]
    lp = got.choices[0].logprobs
    assert got.choices[0].text == ref.text
    assert len(lp.token_logprobs) == len(ref.logprobs)
    tok = offline.tokenizer
    for i, (a, b) in enumerate(zip(lp.token_logprobs, ref.logprobs)):
        assert math.isclose(a, b, abs_tol=1e-5), i
        assert lp.tokens[i] == tok.decode([ref.token_ids[i]])
        # the chosen token and the 3 most likely (greedy: the chosen is the most likely)
        want = {tok.decode([t]): v for t, v in ref.top_logprobs[i][:3]}
        assert set(lp.top_logprobs[i]) == set(want)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(a, abs=1e-6)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_stream_equals_whole_usage_and_logprobs(client, server, offline):
    tok = server.engine.tokenizer
    whole = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=20, temperature=0, logprobs=True, top_logprobs=2
    )
    c = whole.choices[0]
    assert c.message.role == "assistant"
    prompt_ids = tok.encode(render_chat(MESSAGES, add_generation_prompt=True), allowed_special="all")
    assert whole.usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == len(c.logprobs.content)
    ref = offline.generate(prompt_ids, SamplingParams(max_tokens=20, temperature=0.0, logprobs=2))[0]
    ref = ref.outputs[0]
    assert c.message.content == ref.text
    for entry, lp, t, top in zip(c.logprobs.content, ref.logprobs, ref.token_ids, ref.top_logprobs):
        assert math.isclose(entry.logprob, lp, abs_tol=1e-5)
        assert entry.bytes == list(tok.decode_bytes([t]))
        assert [x.logprob for x in entry.top_logprobs] == pytest.approx([v for _, v in top[:2]], abs=1e-5)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_completion_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_stop_string_streamed_equals_whole(client):
    base = (
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    )
    # a stop string from the middle of the greedy text: both forms end right before it
    stop = next(base[i : i + 2] for i in range(4, len(base) - 2) if "\ufffd" not in base[i : i + 2])
    cut = base[: base.find(stop)]
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_batch_prompts_n_seed_and_echo(client, server):
    ids = server.engine.tokenizer.encode_ordinary("with open(")
    tok = server.engine.tokenizer
    batch = [PROMPT, "class Foo:"]
    r = client.completions.create(
        model="tiny", prompt=batch, n=2, max_tokens=6, temperature=0.9, seed=7, logprobs=0
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    again = client.completions.create(model="tiny", prompt=batch, n=2, max_tokens=6, temperature=0.9, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seeded: reproducible
    assert r.choices[0].text != r.choices[1].text  # n samples of one prompt differ
    assert r.usage.prompt_tokens == sum(len(tok.encode_ordinary(p)) for p in batch)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    # token-id prompt with echo: the text starts with the prompt's text; logprobs start with its tokens
    e = client.completions.create(
        model="tiny", prompt=ids, max_tokens=4, temperature=0, echo=True, logprobs=1
    )
    lp = e.choices[0].logprobs
    assert e.choices[0].text.startswith("with open(")
    assert e.usage.prompt_tokens == len(ids)
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == len(ids) + e.usage.completion_tokens
    s = client.completions.create(
        model="tiny", prompt=ids, max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(ch.choices[0].text for ch in s) == e.choices[0].text


def test_models_health_metrics(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "kiln_requests_running",
        "kiln_requests_waiting",
        "kiln_kv_blocks_used",
        "kiln_prompt_tokens_total",
        "kiln_generation_tokens_total",
        "kiln_time_to_first_token_seconds_bucket",
        "kiln_inter_token_latency_seconds_bucket",
        "kiln_e2e_request_latency_seconds_bucket",
    ):
        assert name in text, name
    gen = next(
        float(ln.split()[1]) for ln in text.splitlines() if ln.startswith("kiln_generation_tokens_total")
    )
    assert gen > 0


def test_stream_n_choices_each_end_once(client):
    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=3, stream=True, stop=["e"]
        )
    )
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, n=3, max_tokens=8, temperature=1.0, seed=3, stop=["e"]
    )
    for c in whole.choices:
        mine = [ch.choices[0] for ch in chunks if ch.choices[0].index == c.index]
        assert "".join(x.text for x in mine) == c.text
        ends = [x.finish_reason for x in mine if x.finish_reason is not None]
        assert ends == [c.finish_reason]  # one finish chunk per choice, the last of its chunks
        assert mine[-1].finish_reason == c.finish_reason


def test_streamed_logprobs_add_up_to_the_whole(client):
    kw = dict(model="tiny", max_tokens=10, temperature=0)
    whole = client.chat.completions.create(messages=MESSAGES, logprobs=True, top_logprobs=1, **kw)
    stream = client.chat.completions.create(
        messages=MESSAGES, logprobs=True, top_logprobs=1, stream=True, **kw
    )
    parts = [
        e for ch in stream if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in parts] == [
        (e.token, e.logprob) for e in whole.choices[0].logprobs.content
    ]
    whole = client.completions.create(prompt=PROMPT, logprobs=2, **kw)
    stream = client.completions.create(prompt=PROMPT, logprobs=2, stream=True, **kw)
    chunks = [ch.choices[0].logprobs for ch in stream if ch.choices[0].logprobs]
    want = whole.choices[0].logprobs
    assert [t for lp in chunks for t in lp.tokens] == want.tokens
    assert [v for lp in chunks for v in lp.token_logprobs] == want.token_logprobs
    assert [d for lp in chunks for d in lp.top_logprobs] == want.top_logprobs
