"""The engine against Hugging Face: greedy tokens equal to transformers' generate, alone and batched;
batching, prefix caching, chunked prefill and preemption never change a request's tokens; no block leaks."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import KilnError
from kiln.infer import SamplingParams
from kiln.infer.engine import LLM
from kiln.kernels.dispatch import use_backend

from ._hf import ARCHS, hf_causal_lm, hf_greedy

N_NEW = 20
# 8 prompts of mixed lengths (1 to 37 tokens), some sharing a 12-token prefix
PREFIX = [(7 * i + 3) % 512 for i in range(12)]
PROMPTS = [
    [5],
    PREFIX + [100, 101],
    [(11 * i) % 512 for i in range(37)],
    PREFIX,
    [400, 2, 9],
    PREFIX + [(3 * i) % 512 for i in range(9)],
    [(13 * i + 1) % 512 for i in range(23)],
    [42] * 16,
]


@pytest.fixture(scope="module", params=[*ARCHS, "gpt2"])
def checkpoint(request, tmp_path_factory):
    """(arch, HF model, its saved directory)."""
    model = hf_causal_lm(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def make_llm(path, **engine) -> LLM:
    engine = {"device": "cpu", "block_size": 4, "num_blocks": 256, "max_num_batched_tokens": 64, **engine}
    return LLM(path, log=None, **engine)


def greedy(n=N_NEW, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_equals_hf_alone_and_batched(checkpoint):
    arch, hf, path = checkpoint
    want = [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    llm = make_llm(path)
    free = llm.engine.block_manager.num_free_blocks
    alone = [tokens(llm.generate(p, greedy()))[0] for p in PROMPTS[:3]]
    assert alone == want[:3], arch
    batched = tokens(llm.generate(PROMPTS, greedy()))
    assert batched == want, arch
    assert llm.engine.block_manager.num_free_blocks == free  # every block back after every request


def test_logprobs_equal_hf_log_softmax(checkpoint):
    arch, hf, path = checkpoint
    llm = make_llm(path)
    prompt = PROMPTS[2]
    out = llm.generate(prompt, greedy(6, logprobs=3, prompt_logprobs=2))[0]
    ids = out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ids])).logits[0].double()
    ref = torch.log_softmax(logits, dim=-1)
    n = len(prompt)
    for i, t in enumerate(ids):
        assert math.isclose(out.outputs[0].logprobs[i], ref[n - 1 + i, t].item(), abs_tol=1e-4)
        top = out.outputs[0].top_logprobs[i]
        assert [tid for tid, _ in top] == ref[n - 1 + i].topk(3).indices.tolist()
        assert top[0][0] == t  # greedy: the sampled token is the most likely
    assert len(out.prompt_logprobs) == n - 1
    for p in range(1, n):
        assert math.isclose(out.prompt_logprobs[p - 1], ref[p - 1, prompt[p]].item(), abs_tol=1e-4)


def test_prompt_logprobs_of_a_cached_prompt(tmp_path):
    # the prompt's blocks are in the prefix cache from the first request; the second asks for prompt
    # logprobs, which the cache cannot give: it is computed whole, with the logprobs of a fresh engine
    hf = hf_causal_lm("llama", seed=2)
    hf.save_pretrained(tmp_path)
    prompt = PROMPTS[2]
    llm = make_llm(tmp_path)
    llm.generate(prompt, greedy(2))
    got = llm.generate(prompt, greedy(2, prompt_logprobs=1))[0].prompt_logprobs
    want = make_llm(tmp_path).generate(prompt, greedy(2, prompt_logprobs=1))[0].prompt_logprobs
    assert len(got) == len(prompt) - 1
    assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_prefix_cache_and_preemption_keep_tokens(arch, tmp_path):
    hf = hf_causal_lm(arch, seed=1)
    hf.save_pretrained(tmp_path)
    ref = tokens(make_llm(tmp_path, enable_prefix_caching=False).generate(PROMPTS, greedy()))
    # chunks of 5 and 16 tokens per step
    for budget in (5, 16):
        llm = make_llm(tmp_path, max_num_batched_tokens=budget, enable_prefix_caching=False)
        assert tokens(llm.generate(PROMPTS, greedy())) == ref, budget
    # prefix caching: the shared prefix is computed once, then hit
    llm = make_llm(tmp_path)
    first = tokens(llm.generate(PROMPTS[1], greedy()))
    again = tokens(llm.generate(PROMPTS[5], greedy()))
    assert first == [ref[1]] and again == [ref[5]]
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    # preemption: 24 blocks of 4 tokens cannot hold 8 requests of up to 57 tokens at once
    small = make_llm(tmp_path, num_blocks=24)
    got = small.generate(PROMPTS, greedy())
    assert tokens(got) == ref
    assert small.engine.block_manager.num_free_blocks == 24


def test_prefix_hits_are_counted(tmp_path):
    hf_causal_lm("llama").save_pretrained(tmp_path)
    llm = make_llm(tmp_path)
    llm.generate(PROMPTS[3], greedy(2))  # the 12-token prefix: 3 full blocks
    eng = llm.engine
    rid = eng.add_request(PROMPTS[1], greedy(2))
    seq = eng.requests[rid].seqs[0]
    eng.step()
    assert seq.num_cached_tokens == 12
    while eng.has_unfinished():
        eng.step()


def test_seeded_sampling_is_reproducible_and_batch_independent(tmp_path):
    hf_causal_lm("qwen2").save_pretrained(tmp_path)
    llm = make_llm(tmp_path)
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    alone = tokens(llm.generate(PROMPTS[4], sp))[0]
    mixed = llm.generate(PROMPTS, [SamplingParams(max_tokens=12, temperature=0.7, seed=i) for i in range(8)])
    together = tokens(llm.generate([PROMPTS[0], PROMPTS[4], PROMPTS[2]], [greedy(), sp, greedy()]))[1]
    assert alone == together
    assert tokens(llm.generate(PROMPTS[4], sp))[0] == alone
    assert len({tuple(t) for t in tokens(mixed)}) > 1
    n3 = llm.generate(PROMPTS[4], SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=5))[0]
    assert len(n3.outputs) == 3 and len({tuple(o.token_ids) for o in n3.outputs}) == 3


def test_stops_eos_and_max_tokens(tmp_path):
    hf_causal_lm("llama").save_pretrained(tmp_path)
    llm = make_llm(tmp_path)
    ref = tokens(llm.generate(PROMPTS[2], greedy()))[0]
    stop_tok = ref[5]
    out = llm.generate(PROMPTS[2], greedy(stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.token_ids == ref[: ref.index(stop_tok) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_tok
    out = llm.generate(PROMPTS[2], greedy(7))[0].outputs[0]
    assert out.token_ids == ref[:7] and out.finish_reason == "length"
    eos = LLM(tmp_path, log=None, eos_token_ids=[stop_tok], device="cpu", num_blocks=64)
    out = eos.generate(PROMPTS[2], greedy())[0].outputs[0]
    assert out.token_ids == ref[: ref.index(stop_tok) + 1] and out.finish_reason == "stop"
    out = eos.generate(PROMPTS[2], greedy(ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref and out.finish_reason == "length"


def test_triton_kernels_through_the_interpreter(tmp_path):
    # the engine's GPU path (paged write, varlen prefill over a cached prefix, paged decode) on the CPU
    hf = hf_causal_lm("qwen2", seed=2)
    hf.save_pretrained(tmp_path)
    prompts = [PROMPTS[1], PROMPTS[5], PROMPTS[0]]
    want = [hf_greedy(hf, p, 6) for p in prompts]
    llm = make_llm(tmp_path, max_num_batched_tokens=16)
    with use_backend("triton"):
        assert tokens(llm.generate(prompts, greedy(6))) == want


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ([], greedy(), "empty"),
        ([1, 2, 600], greedy(), "token ids"),
        ([1, 2, -1], greedy(), "token ids"),
        ([1] * 120, greedy(20), "context"),
        ([1, 2], "greedy", "SamplingParams"),
    ],
)
def test_bad_requests_are_clear_errors(prompt, params, match, tmp_path_factory):
    path = tmp_path_factory.mktemp("bad")
    hf_causal_lm("llama").save_pretrained(path)
    llm = make_llm(path)
    with pytest.raises(KilnError, match=match):
        llm.generate(prompt, params)
    assert not llm.engine.has_unfinished()
    assert tokens(llm.generate([1, 2], greedy(3)))  # the engine still serves


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sampling_params(kw, field):
    with pytest.raises(KilnError, match=field):
        SamplingParams(**kw)


def test_text_stop_strings_and_streaming(tmp_path):
    # a byte-level tokenizer of 300 ids under a 512-id model: ids past the tokenizer give no text
    from kiln.tokenizer import train_bpe

    hf_causal_lm("llama", seed=3).save_pretrained(tmp_path)
    tok = train_bpe(["hello world, " * 50, "abc def ghi " * 40], vocab_size=300)
    llm = LLM(tmp_path, tokenizer=tok, log=None, device="cpu", num_blocks=64)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    full = llm.generate("hello", params)[0].outputs[0]
    assert full.text == tok.decode([t for t in full.token_ids if t < tok.n_vocab])
    text = full.text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    cut = llm.generate("hello", SamplingParams(max_tokens=40, temperature=1.0, seed=7, stop=[stop]))[0]
    out = cut.outputs[0]
    assert out.text == text[: text.find(stop)] and out.finish_reason == "stop" and out.stop_reason == stop
    streamed = [s.outputs[0].text for s in llm.stream("hello", params)]
    assert streamed[-1] == text and all(
        b.startswith(a.rstrip("\ufffd")) for a, b in zip(streamed, streamed[1:])
    )


def test_decode_buckets_equal_eager(tmp_path):
    # the static-buffer decode step (padded to its bucket; a CUDA graph on GPU) against the eager step
    hf_causal_lm("qwen2", seed=3).save_pretrained(tmp_path)
    eager = make_llm(tmp_path, decode_backend="eager")
    graphs = make_llm(tmp_path, max_graph_batch=4)  # buckets 1, 2, 4; a batch of 5 decodes eagerly
    assert eager.engine.runner.graphs is None and graphs.engine.runner.graphs.buckets == [1, 2, 4]
    for n in (1, 2, 3, 5):
        assert tokens(graphs.generate(PROMPTS[:n], greedy(6))) == tokens(
            eager.generate(PROMPTS[:n], greedy(6))
        )
    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=3, logprobs=2)
    want, got = eager.generate(PROMPTS[:3], sampled), graphs.generate(PROMPTS[:3], sampled)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        assert g.outputs[0].logprobs == pytest.approx(w.outputs[0].logprobs, abs=1e-5)


def test_decode_backend_is_validated(tmp_path):
    with pytest.raises(KilnError, match="decode_backend"):
        make_llm(tmp_path, decode_backend="fast")


def test_step_finished_only_reports_each_request_once_when_it_ends(tmp_path):
    hf_causal_lm("llama").save_pretrained(tmp_path)
    llm = make_llm(tmp_path)
    want = tokens(llm.generate(PROMPTS[:3], [greedy(3), greedy(5), greedy(4)]))
    eng = llm.engine
    ids = [eng.add_request(p, greedy(n)) for p, n in zip(PROMPTS[:3], (3, 5, 4))]
    seen = []
    while eng.has_unfinished():
        for out in eng.step(finished_only=True):
            assert out.finished
            seen.append(out)
    assert [o.request_id for o in seen] == [ids[0], ids[2], ids[1]]
    assert [o.outputs[0].token_ids for o in sorted(seen, key=lambda o: ids.index(o.request_id))] == want
    rid = eng.add_request(PROMPTS[4], greedy(8))
    eng.step()
    eng.abort(rid)
    assert not eng.has_unfinished()
    (out,) = eng.step(finished_only=True)  # an abort is reported by the next step, even an empty one
    assert out.request_id == rid and out.outputs[0].finish_reason == "abort" and not eng.requests


def test_warm_up_runs_every_attention_bucket_and_changes_nothing(tmp_path):
    # ModelRunner.warm_up (what a CUDA engine runs at start, so no served step stops to autotune): through
    # the Triton interpreter here, packed prefill at each length bucket with and without a prefix and, with
    # eager decode, decode attention at each split bucket; the KV cache is untouched and the engine's
    # tokens are still HF's
    hf = hf_causal_lm("qwen2", seed=3)
    hf.save_pretrained(tmp_path)
    llm = make_llm(tmp_path, max_num_batched_tokens=16, decode_backend="eager", max_num_seqs=4)
    runner = llm.engine.runner
    assert llm.engine.config.warmup  # on by default (the engine runs it on CUDA only)
    with use_backend("triton"):
        assert runner.warm_up() == 1  # one layer kind: no window, no sinks
        assert all(not c.any() for kv in runner.kv_caches for c in kv)
        prompts = [PROMPTS[1], PROMPTS[2]]
        assert tokens(llm.generate(prompts, greedy(5))) == [hf_greedy(hf, p, 5) for p in prompts]


@pytest.mark.parametrize(
    "engine", [dict(decode_backend="eager"), dict(max_graph_batch=2)], ids=["eager", "graphs"]
)
def test_eager_decode_steps_meet_what_warm_up_launched(engine, tmp_path, monkeypatch):
    # A decode step that runs without a graph (every step with the eager backend; past the largest bucket
    # with graphs) pads its block tables to the engine's fixed width, as a captured step does, so decode
    # attention's split count, form and specialization follow the batch alone; warm_up launched decode
    # attention at each such batch size over tables of that width: no served step meets a kernel that was
    # not compiled at start.
    import kiln.model.layers as layers

    hf_causal_lm("qwen2", seed=3).save_pretrained(tmp_path)
    llm = make_llm(tmp_path, max_num_seqs=3, **engine)
    runner = llm.engine.runner
    assert runner.table_width == -(-runner.max_model_len // 4)
    calls = []
    real = layers.decode_attention

    def spy(q, k_cache, v_cache, block_table, seq_lens, **kw):
        calls.append((q.shape[0], block_table.shape[1]))
        return real(q, k_cache, v_cache, block_table, seq_lens, **kw)

    monkeypatch.setattr(layers, "decode_attention", spy)
    runner.warm_up()
    warmed, calls[:] = set(calls), []
    first_eager = 1 if engine.get("decode_backend") == "eager" else 3
    assert warmed == {(B, runner.table_width) for B in range(first_eager, 4)}
    want = tokens(llm.generate(PROMPTS[:3], greedy(4)))
    served = set(calls)
    assert served and served <= warmed, (served, warmed)
    monkeypatch.undo()
    assert tokens(llm.generate(PROMPTS[:3], greedy(4))) == want
