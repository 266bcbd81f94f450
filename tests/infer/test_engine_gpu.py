"""The engine on the GPU in bf16 against transformers in bf16 (marked gpu: skipped on CPU).

Two bf16 implementations round differently (kernel tile orders, fused vs separate ops), so on a random
model whose top logits are close they can pick different argmaxes at some step, after which their texts
differ for good. The check is vLLM's (`check_logprobs_close`): tokens equal up to the first difference,
and there each side's token is among the other's top-5 (a near-tie, not a bug); most sequences must
match in full.
"""

from __future__ import annotations

import pytest
import torch

from kiln.infer import SamplingParams
from kiln.infer.engine import LLM

from ._hf import hf_causal_lm
from .test_engine import PROMPTS

pytestmark = pytest.mark.gpu


def _check_close(kiln_out, hf_tokens, hf_model, prompt):
    got = kiln_out.outputs[0].token_ids
    if got == hf_tokens:
        return True
    i = next(j for j, (a, b) in enumerate(zip(got, hf_tokens)) if a != b)
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + hf_tokens[:i]], device="cuda")).logits[0, -1].float()
    assert got[i] in logits.topk(5).indices.tolist(), (i, got[i], hf_tokens[i])
    assert hf_tokens[i] in [t for t, _ in kiln_out.outputs[0].top_logprobs[i]], (i, got[i], hf_tokens[i])
    return False


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "mixtral", "gpt2"])
def test_gpu_bf16_greedy_close_to_hf(arch, tmp_path):
    hf = hf_causal_lm(arch)
    hf.save_pretrained(tmp_path)
    hf = hf.to("cuda", torch.bfloat16)
    llm = LLM(tmp_path, log=None, device="cuda", dtype="bf16", block_size=16, memory_fraction=0.2)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5)
    outs = llm.generate(PROMPTS, params)
    exact = 0
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([prompt], device="cuda")
        want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                           do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
        exact += _check_close(out, want, hf, prompt)
    assert exact >= len(PROMPTS) // 2, f"only {exact} of {len(PROMPTS)} sequences equal in full"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_gpu_batched_equals_alone_and_prefix_cache(tmp_path):
    hf_causal_lm("qwen2").save_pretrained(tmp_path)
    llm = LLM(tmp_path, log=None, device="cuda", dtype="fp32", block_size=16, memory_fraction=0.2,
              max_num_batched_tokens=32)  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.0)
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    # the same kernels at fp32 on different batch layouts: equal, except where a near-tie flips
    same = sum(a == b for a, b in zip(alone, batched))
    assert same >= len(PROMPTS) - 1, (alone, batched)


def test_gpu_graph_replay_equals_eager_every_bucket(tmp_path):
    # each bucket's replay against the same step run eagerly on the same static buffers: same kernels,
    # same shapes, so the logits must be bitwise equal (rows B-1 and B of each bucket: one padded row)
    hf_causal_lm("qwen2").save_pretrained(tmp_path)
    llm = LLM(tmp_path, log=None, device="cuda", dtype="bf16", block_size=16, memory_fraction=0.2,
              max_graph_batch=16)  # fmt: skip
    runner = llm.engine.runner
    graphs = runner.graphs
    assert graphs.buckets == [1, 2, 4, 8, 16] and sorted(graphs.graphs) == graphs.buckets
    for cache in runner.kv_caches:  # random keys and values in every page
        for c in cache:
            c.normal_()
    g = torch.Generator().manual_seed(0)
    for B in graphs.buckets:
        for b in {max(B - 1, 1), B}:
            positions = torch.randint(0, llm.engine.max_model_len - 1, (b,), generator=g).tolist()
            tables = [
                torch.randperm(runner.num_blocks, generator=g)[: p // 16 + 1].tolist() for p in positions
            ]
            toks = torch.randint(0, llm.engine.vocab_size, (b,), generator=g).tolist()
            logits, ids = graphs.run(toks, positions, tables)
            replayed = logits.clone(), ids.clone()
            eager_logits, eager_ids = graphs.step_fn(graphs.bucket(b))
            assert torch.equal(replayed[0], eager_logits[:b]) and torch.equal(replayed[1], eager_ids[:b])
            assert torch.isfinite(eager_logits).all()  # the padding rows too


def test_gpu_async_scheduling_equals_sync(tmp_path):
    # CUDA graphs, chunked prefill, prefix caching; greedy, seeded, logprobs, stop ids, n = 2, penalties (a
    # synchronous step), prompt logprobs. fp32: the async engine's batches differ from the synchronous
    # one's only by the rows of sequences that have just ended (their wasted step), which can change a
    # bucket and so a kernel's reduction order: equal, except where a near-tie flips
    hf_causal_lm("qwen2").save_pretrained(tmp_path)
    outs = {}
    for mode in ("off", "on"):
        llm = LLM(tmp_path, log=None, device="cuda", dtype="fp32", block_size=16, memory_fraction=0.2,
                  max_num_batched_tokens=32, max_graph_batch=8, async_scheduling=mode)  # fmt: skip
        assert llm.engine.async_scheduling == (mode == "on")
        params = [
            SamplingParams(max_tokens=20 + i, temperature=0.0 if i % 2 else 0.9, seed=i, logprobs=2,
                           stop_token_ids=[7] if i == 3 else [], n=2 if i == 5 else 1,
                           presence_penalty=0.4 if i == 6 else 0.0, prompt_logprobs=1 if i == 2 else None)
            for i in range(len(PROMPTS))
        ]  # fmt: skip
        outs[mode] = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)]
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished()
        del llm
        torch.cuda.empty_cache()
    same = sum(a == b for a, b in zip(outs["off"], outs["on"]))
    assert same >= len(PROMPTS) - 1, (outs["off"], outs["on"])


def _outputs_per_switch(monkeypatch, path, var, values, read_once, generate, **llm_kw):
    """{(value, backend): generate(llm)} for each value of the read-once switch `var` (its cache cleared
    before each and after all) and each decode backend, one engine each."""
    outs = {}
    for value in values:
        monkeypatch.setenv(var, value)
        read_once.cache_clear()
        for backend in ("eager", "graphs"):
            llm = LLM(path, log=None, device="cuda", block_size=16, memory_fraction=0.2, decode_backend=backend,
                      **llm_kw)  # fmt: skip
            outs[value, backend] = generate(llm)
            del llm
            torch.cuda.empty_cache()
    read_once.cache_clear()
    return outs


def test_gpu_fused_blocks_equal_separate(tmp_path, monkeypatch):
    # KILN_DECODE_BLOCK=fused (each block of a one-token decode step in one kernel,
    # kiln.kernels.decode_block): the engine's greedy tokens one prompt at a time, eager and with CUDA graphs, against the separate form.
    # fp32: the fused kernel sums each projection in another order than the decode matmuls (a few ulps),
    # so tokens are equal except where a near-tie flips
    from kiln.model import config as model_config
    from kiln.model import transformer

    hf_causal_lm("qwen2").save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    calls = []
    fused = transformer.fused_block
    monkeypatch.setattr(transformer, "fused_block", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    # the fused kernel's calls so far beside each run's tokens: none in the separate form (which runs first)
    tokens = lambda llm: ([llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS], len(calls))  # noqa: E731
    outs = _outputs_per_switch(monkeypatch, tmp_path, "KILN_DECODE_BLOCK", ("separate", "fused"),
                               model_config.decode_block, tokens, dtype="fp32", max_graph_batch=1)  # fmt: skip
    assert outs["separate", "graphs"][1] == 0 and outs["fused", "eager"][1] > outs["separate", "graphs"][1]
    outs = {key: got for key, (got, _) in outs.items()}
    assert outs["fused", "eager"] == outs["fused", "graphs"]  # the same kernels: the same bits
    same = sum(a == b for a, b in zip(outs["separate", "eager"], outs["fused", "eager"]))
    assert same >= len(PROMPTS) - 1, (outs["separate", "eager"], outs["fused", "eager"])


def test_gpu_pdl_first_same_bits(tmp_path, monkeypatch):
    # KILN_PDL_FIRST=all: the norm, RoPE + K/V write and decode attention kernels signal the next kernel
    # before their own programmatic-launch wait (the norm and the reduction where the projection after
    # them preloads its weight), so up to three kernels of a step overlap. Only the schedule changes: the
    # same kernels on the same inputs, so the same bits (greedy tokens and their logprobs), eager and in
    # CUDA graphs, bf16 (PDL on): one prompt at a time (one-token steps, where the norm and the reduction
    # signal first), then all together
    from kiln.kernels import _common

    hf_causal_lm("qwen2").save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3)

    def run(llm):
        got = [llm.generate(p, params)[0] for p in PROMPTS[:3]] + llm.generate(PROMPTS, params)
        return [(o.outputs[0].token_ids, o.outputs[0].top_logprobs) for o in got]

    outs = _outputs_per_switch(monkeypatch, tmp_path, "KILN_PDL_FIRST", ("none", "all"), _common._pdl_first_set,
                               run, dtype="bf16", max_graph_batch=8)  # fmt: skip
    assert outs["all", "eager"] == outs["none", "eager"]
    assert outs["all", "graphs"] == outs["none", "graphs"]


@pytest.mark.parametrize("var,values,switch", [("KILN_DECODE_QKV", ("separate", "fused"), "decode_qkv"),
                                               ("KILN_DECODE_SWIGLU", ("separate", "epilogue"), "decode_swiglu")])  # fmt: skip
def test_gpu_decode_fusions_same_bits(tmp_path, monkeypatch, var, values, switch):
    # The defaults against the separate kernels they replace: the q/k/v projection with RoPE and the K/V
    # write in its epilogue (one-token steps; its W slice preloaded as the separate gemv's), and the SwiGLU in
    # gate_up's epilogue (decode-sized steps). The same sums rounded at the same places: the same greedy tokens
    # and logprobs, bf16, eager and in CUDA graphs, one prompt at a time and all together
    from kiln.model import config as model_config

    hf_causal_lm("qwen2").save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=3)

    def run(llm):
        got = [llm.generate(p, params)[0] for p in PROMPTS[:3]] + llm.generate(PROMPTS, params)
        return [(o.outputs[0].token_ids, o.outputs[0].top_logprobs) for o in got]

    outs = _outputs_per_switch(monkeypatch, tmp_path, var, values, getattr(model_config, switch), run,
                               dtype="bf16", max_graph_batch=8)  # fmt: skip
    for backend in ("eager", "graphs"):
        assert outs[values[0], backend] == outs[values[1], backend], (var, backend)


def test_gpu_norm_in_qkv_kernel_close_to_separate(tmp_path, monkeypatch):
    # KILN_DECODE_QKV=norm: the block's add + RMSNorm in the fused q/k/v kernel too (one-token steps). Its
    # rstd sums the row in another order than the norm kernel (a bf16 ulp here and there), so tokens are
    # those of the separate kernels except where a near-tie flips; eager and CUDA graphs run the same
    # kernels: the same bits
    from kiln.model import config as model_config

    hf_causal_lm("qwen2").save_pretrained(tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def run(llm):
        return [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]

    outs = _outputs_per_switch(monkeypatch, tmp_path, "KILN_DECODE_QKV", ("separate", "norm"),
                               model_config.decode_qkv, run, dtype="bf16", max_graph_batch=1)  # fmt: skip
    assert outs["norm", "eager"] == outs["norm", "graphs"]
    same = sum(a == b for a, b in zip(outs["separate", "graphs"], outs["norm", "graphs"]))
    assert same >= len(PROMPTS) - 1, (outs["separate", "graphs"], outs["norm", "graphs"])
