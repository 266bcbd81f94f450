"""A quantized model: logit error and perplexity against the float model per scheme (tied and untied heads),
the quantized directory's round trip, the Triton kernels through the interpreter equal to the reference
path, and the inference engine loading the directory and generating what the model itself generates."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.dispatch import use_backend
from kiln.model.config import ModelConfig
from kiln.model.quant_linear import QuantLinear
from kiln.model.transformer import build_model
from kiln.quant import QuantScheme, load_quantized, quantize_model, save_quantized

CFG = dict(arch="qwen2", vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=256,
           max_seq_len=64, qkv_bias=True)  # fmt: skip
# logits' relative L2 error bounds per scheme, about 2x what the random-init model measures (int8 0.006,
# fp8 0.034, int4 0.085-0.093): random weights are the worst case for a 4-bit grid (no outliers to protect,
# every weight uniformly spread)
BOUNDS = {"int8": 0.015, "fp8": 0.07, "int4-g32": 0.2, "int4-g128": 0.2}


def _ids(seed: int, shape=(2, 48)) -> torch.Tensor:
    return torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(seed))


def _ppl(logits: torch.Tensor, ids: torch.Tensor) -> float:
    return math.exp(
        F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()
    )


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("scheme", list(BOUNDS))
def test_logit_error_and_perplexity(scheme, tied):
    cfg = ModelConfig(**CFG, tie_embeddings=tied)
    ids = _ids(0)
    base = build_model(cfg, seed=1).eval()
    with torch.no_grad():
        ref = base(ids)
    model = build_model(cfg, seed=1).eval()
    names = quantize_model(model, QuantScheme.parse(scheme))
    assert "lm_head" in names and isinstance(model.lm_head, QuantLinear) and len(names) == 2 * 4 + 1
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the lookup stays float
    with torch.no_grad():
        got = model(ids)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < BOUNDS[scheme], f"{scheme}: logits relative error {rel:.4f}"
    assert abs(_ppl(got, ids) / _ppl(ref, ids) - 1) < BOUNDS[scheme]
    with pytest.raises(ValueError, match="head is quantized"):
        model.loss(ids, ids)


def test_head_left_in_float():
    model = build_model(ModelConfig(**CFG, tie_embeddings=True), seed=0)
    names = quantize_model(model, QuantScheme.parse("int8", head=False))
    assert "lm_head" not in names and model.lm_head is None


@pytest.mark.parametrize("scheme", ["int4-g64", "fp8"])
def test_directory_round_trip(scheme, tmp_path):
    model = build_model(ModelConfig(**CFG, tie_embeddings=True), seed=2).eval()
    s = QuantScheme.parse(scheme, asymmetric=scheme.startswith("int4"))
    quantize_model(model, s)
    save_quantized(model, s, tmp_path)
    back = load_quantized(tmp_path, "cpu", torch.float32)
    ids = _ids(3)
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    # a bf16 load keeps the quantized values and scales as stored
    b16 = load_quantized(tmp_path, "cpu", torch.bfloat16)
    q = b16.model.layers[0].self_attn.qkv_proj
    assert q.scales.dtype == torch.bfloat16 and torch.equal(
        q.qweight, model.model.layers[0].self_attn.qkv_proj.qweight
    )
    assert b16.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.slow  # ~15 s: every kernel of the model through the interpreter
def test_triton_path_equals_reference_path():
    """Every op of a quantized model through Triton's interpreter (the one-row decode kernel, the tile kernel
    at 20 rows; the 2-16-row decode kernel is tests/kernels/test_quant_matmul.py's) against the eager
    reference path."""
    cfg = ModelConfig(
        **{**CFG, "n_layers": 1, "d_model": 64, "ffn_hidden": 128, "vocab_size": 96}, tie_embeddings=True
    )
    model = build_model(cfg, seed=4).eval()
    quantize_model(model, QuantScheme.parse("int4-g32", asymmetric=True))
    for shape in [(1, 1), (1, 20)]:
        ids = torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(shape[0]))
        with torch.no_grad():
            want = model(ids)
            with use_backend("triton"):
                got = model(ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_fp8_producers_quantize_the_rows(monkeypatch):
    """An FP8 model through the interpreter at 20 tokens (no swept decode config): the RMSNorms before qkv
    and gate_up and the SwiGLU before down hand their rows over quantized (Fp8Rows), so fp8_linear quantizes
    only o_proj's input and the head's; the logits are the bits of the path where fp8_linear quantizes every
    input itself."""
    from kiln.kernels import fp8_matmul

    cfg = ModelConfig(
        **{**CFG, "n_layers": 2, "d_model": 64, "ffn_hidden": 96, "vocab_size": 96}, tie_embeddings=True
    )
    model = build_model(cfg, seed=7).eval()
    quantize_model(model, QuantScheme.parse("fp8"))
    calls = []
    quantize = fp8_matmul.quantize_fp8
    monkeypatch.setattr(
        fp8_matmul, "quantize_fp8", lambda x, *a, **k: calls.append(x.shape) or quantize(x, *a, **k)
    )
    ids = torch.randint(0, 96, (1, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad(), use_backend("triton"):
        fused = model(ids)
        assert calls == [(20, 64)] * 3  # o_proj twice, the head
        monkeypatch.setattr(QuantLinear, "takes_fp8_rows", lambda self, x: False)
        calls.clear()
        want = model(ids)
        assert len(calls) == 2 * 4 + 1
    assert torch.equal(fused, want)


@pytest.mark.gpu
def test_gpu_fp8_producers_give_the_same_logits(monkeypatch):
    """bf16 on the GPU at 300 tokens: the norms and SwiGLU quantizing their rows give the logits of the path
    where fp8_linear quantizes every input (tests/kernels/test_fp8_producers.py checks the kernels' bits)."""
    cfg = ModelConfig(**{**CFG, "d_model": 256, "ffn_hidden": 640, "max_seq_len": 512}, tie_embeddings=True)
    model = build_model(cfg, device="cuda", dtype=torch.bfloat16, seed=9).eval()
    quantize_model(model, QuantScheme.parse("fp8"))
    ids = torch.randint(0, 512, (1, 300), generator=torch.Generator().manual_seed(9)).cuda()
    with torch.no_grad():
        fused = model(ids)
        monkeypatch.setattr(QuantLinear, "takes_fp8_rows", lambda self, x: False)
        want = model(ids)
    assert torch.equal(fused, want)


def test_engine_loads_the_quantized_directory(tmp_path):
    from kiln.infer import SamplingParams
    from kiln.infer.engine import LLM

    model = build_model(ModelConfig(**CFG, tie_embeddings=True), seed=5).eval()
    s = QuantScheme.parse("int4-g32")
    quantize_model(model, s)
    save_quantized(model, s, tmp_path)
    prompts = [[5, 9, 100, 7], [300] * 11]
    llm = LLM(tmp_path, log=None, device="cpu", dtype="fp32", block_size=4, num_blocks=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for p, out in zip(prompts, outs):
        want = model.generate(torch.tensor([p]), max_new_tokens=8, temperature=0.0)[0, len(p) :].tolist()
        assert out.outputs[0].token_ids == want


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["int8", "int4-g128", "fp8"])
def test_gpu_engine_on_quantized_model(scheme, tmp_path):
    """The engine in bf16 on the GPU (decode kernels at 1-8 rows, prefill tiles) against the quantized
    model's own dense generate: tokens equal up to the first difference, and there a near-tie (the other
    side's token among the engine's top 5), with most sequences equal in full (tests/infer/test_engine_gpu.py's
    check: two bf16 paths round differently)."""
    from kiln.infer import SamplingParams
    from kiln.infer.engine import LLM

    cfg = ModelConfig(**{**CFG, "d_model": 256, "ffn_hidden": 512, "n_heads": 4}, tie_embeddings=True)
    model = build_model(cfg, seed=6).eval()
    s = QuantScheme.parse(scheme)
    quantize_model(model, s)
    save_quantized(model, s, tmp_path)
    prompts = [[(7 * i + j) % 512 for i in range(3 + 5 * j)] for j in range(8)]
    llm = LLM(tmp_path, log=None, device="cuda", dtype="bf16", block_size=16, memory_fraction=0.1)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, logprobs=5))
    dense = load_quantized(tmp_path, "cuda", torch.bfloat16).eval()
    exact = 0
    for p, out in zip(prompts, outs):
        got = out.outputs[0].token_ids
        want = dense.generate(torch.tensor([p], device="cuda"), max_new_tokens=16, temperature=0.0)[
            0, len(p) :
        ]
        want = want.tolist()
        if got == want:
            exact += 1
            continue
        i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
        assert want[i] in [t for t, _ in out.outputs[0].top_logprobs[i]], (p, i, got[i], want[i])
    assert exact >= len(prompts) // 2, f"only {exact} of {len(prompts)} sequences equal in full"
