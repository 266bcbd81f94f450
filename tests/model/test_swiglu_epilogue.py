"""The SwiGLU in the gate_up decode matmul's epilogue in the model (the default,
KILN_DECODE_SWIGLU=separate for the SwiGLU kernel; kiln.model.layers.GatedMLP): a decode-sized step gives the logits of the separate SwiGLU kernel bit for bit
and launches that kernel no more; with the split norm (prenorm), a prefill, or a bad switch value nothing
changes but the clear error."""

from __future__ import annotations

import pytest
import torch

import kiln.model.layers as layers
import kiln.model.linear as linear
from kiln.errors import KilnError
from kiln.kernels import matmul_decode
from kiln.kernels.matmul_decode import DecodeConfig
from kiln.model.config import decode_norm, decode_swiglu

from .test_norm_split import BASE, _clones, _decode_step, _logits, _model, env_form


@pytest.fixture
def swiglu_form(monkeypatch):
    """Set KILN_DECODE_SWIGLU for the next forward."""
    with env_form(monkeypatch, "KILN_DECODE_SWIGLU", decode_swiglu) as set_form:
        yield set_form


@pytest.fixture
def calls(monkeypatch):
    """Counts of the separate SwiGLU kernel and of the decode matmul's swiglu epilogue."""
    n = {"swiglu": 0, "epilogue": 0}
    swiglu, decode_matmul = layers.swiglu, linear.decode_matmul

    def counted_swiglu(*args, **kw):
        n["swiglu"] += 1
        return swiglu(*args, **kw)

    def counted_matmul(*args, **kw):
        n["epilogue"] += kw.get("epilogue") == "swiglu"
        return decode_matmul(*args, **kw)

    monkeypatch.setattr(layers, "swiglu", counted_swiglu)
    monkeypatch.setattr(linear, "decode_matmul", counted_matmul)

    def take() -> dict:
        out = dict(n)
        n.update(swiglu=0, epilogue=0)
        return out

    return take


def _gemv_everywhere(monkeypatch):
    """The interpreter's rule takes the dot kernel for 2-16 rows, whose tl.dot is numpy's matmul there: its
    float32 K sum depends on a W row's place in the tile (tests/kernels/test_swiglu_epilogue.py), and the
    epilogue's tile orders W's rows as gate/up pairs. The FMA kernel at every row count sums each row
    alike wherever it sits: the same bits are then a fair test of the model's wiring."""
    monkeypatch.setattr(matmul_decode, "decode_config", lambda *args, **kw: DecodeConfig("gemv", 16, 32))


@pytest.mark.parametrize(
    "name,lens,kernel",
    [("llama", [9], "rule"), ("qwen2", [0, 5, 30, 12], "gemv")],
    ids=["llama-1row-gemv", "qwen2-4rows-gemv"],
)
def test_decode_step_epilogue_equals_separate(name, lens, kernel, swiglu_form, calls, monkeypatch, device):
    if kernel == "gemv":
        _gemv_everywhere(monkeypatch)
    model = _model(name, device)
    L = model.config.n_layers
    step = _decode_step(model.config, lens, page=8, seed=2, device=device)
    swiglu_form("separate")
    want = _logits(model, *step)
    assert calls() == {"swiglu": L, "epilogue": 0}
    swiglu_form(None)  # the default
    got = _logits(model, *step)
    assert calls() == {"swiglu": 0, "epilogue": L}  # every layer's SwiGLU in its gate_up matmul
    assert torch.equal(got, want)


def test_decode_step_dot_kernel_4_rows(swiglu_form, calls, device):
    # the rule's dot kernel at 4 rows: through the interpreter its K sums may differ from the unfused
    # call's in the last float32 bits (see _gemv_everywhere), which the layers carry to the logits; on the
    # GPU test below the two forms are the same bits
    model = _model("qwen2", device)
    step = _decode_step(model.config, [0, 5, 30, 12], page=8, seed=3, device=device)
    swiglu_form("separate")
    want = _logits(model, *step)
    swiglu_form("epilogue")
    got = _logits(model, *step)
    assert calls() == {"swiglu": 2, "epilogue": 2}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_decode_step_wide_tiles_36_rows(swiglu_form, calls, monkeypatch, device):
    # 17-64 rows take the wide tiles (KILN_DECODE_ROWS, default 64): the epilogue from 33 rows, where the
    # rule splits no K (its tile is then the unfused call's); where it would split, and at 17-32 rows, the
    # separate SwiGLU stays. Through the interpreter the dot kernel's K sums may differ in the last float32
    # bits (see above).
    model = _model("qwen2", device)
    L = model.config.n_layers
    step = _decode_step(model.config, [3 * i % 17 for i in range(36)], page=8, seed=4, device=device)
    swiglu_form("separate")
    want = _logits(model, *step)
    assert calls() == {"swiglu": L, "epilogue": 0}
    swiglu_form("epilogue")
    got = _logits(model, *step)
    assert calls() == {"swiglu": 0, "epilogue": L}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _logits(model, *_decode_step(model.config, list(range(20)), page=8, seed=4, device=device))
    assert calls() == {"swiglu": L, "epilogue": 0}  # 20 rows
    rule = matmul_decode.decode_config
    monkeypatch.setattr(linear, "decode_config", lambda *a, **kw: rule(*a, **kw)._replace(split_k=2))
    _logits(model, *step)
    assert calls() == {"swiglu": L, "epilogue": 0}


def test_split_norm_keeps_the_separate_swiglu(swiglu_form, calls, monkeypatch, device):
    # KILN_DECODE_NORM=split: a gate_up that normalizes in its prologue (prenorm) keeps today's code, the
    # separate SwiGLU; here both layers' post-attention norms split, so no epilogue runs, and the logits
    # are those of the split norm alone
    model = _model("llama", device)
    step = _decode_step(model.config, [4], page=8, seed=5, device=device)
    monkeypatch.setenv("KILN_DECODE_NORM", "split")
    decode_norm.cache_clear()
    try:
        swiglu_form(None)
        want = _logits(model, *step)
        calls()
        swiglu_form("epilogue")
        got = _logits(model, *step)
        assert calls() == {"swiglu": 2, "epilogue": 0}
    finally:
        monkeypatch.delenv("KILN_DECODE_NORM")
        decode_norm.cache_clear()
    assert torch.equal(got, want)


def test_prefill_takes_the_old_path(swiglu_form, calls, device):
    # more flat tokens than the decode tiles take (decode_rows(), 64): the separate SwiGLU kernel in both
    # forms, the same bits
    from kiln.kernels.dispatch import use_backend

    model = _model("llama", device)
    ids = torch.randint(0, BASE["vocab_size"], (1, 65), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad(), use_backend("triton"):
        swiglu_form(None)
        want = model(ids)
        swiglu_form("epilogue")
        got = model(ids)
    assert calls() == {"swiglu": 4, "epilogue": 0}  # 2 layers, both forwards
    assert torch.equal(got, want)


def test_bad_switch_value_is_a_clear_error(swiglu_form, device):
    model = _model("llama", device)
    step = _decode_step(model.config, [2], page=8, seed=6, device=device)
    swiglu_form("fused")
    with pytest.raises(KilnError, match=r"KILN_DECODE_SWIGLU='fused' is not one of epilogue, separate"):
        _logits(model, *step)
    for form, want in (("separate", "separate"), ("epilogue", "epilogue"), ("", "epilogue")):
        swiglu_form(form)
        assert decode_swiglu() == want


@pytest.mark.gpu
def test_cuda_graph_of_an_epilogue_decode_step_bf16(swiglu_form, calls):
    # Qwen2.5-1.5B's block shapes (d 1536, FFN 8960: gate_up K 1536, N 17920), 2 layers, bf16; decode steps
    # of 1 and 4 rows (the gemv and the 64 x 128 dot tile) with the SwiGLU in the epilogue, eager and captured
    # in a CUDA graph: the same bits as the separate SwiGLU kernel
    dev = torch.device("cuda")
    cfg = dict(vocab_size=1024, d_model=1536, n_layers=2, n_heads=12, n_kv_heads=2, ffn_hidden=8960,
               max_seq_len=256, head_dim=128)  # fmt: skip
    model = _model("qwen2", dev, **cfg).to(torch.bfloat16)
    for lens in ([100], [3, 50, 130, 7]):
        tokens, pos, meta, caches = _decode_step(model.config, lens, page=16, seed=7, device=dev)
        caches = [(k.bfloat16(), v.bfloat16()) for k, v in caches]
        with torch.no_grad():
            swiglu_form("separate")
            want = model.model(tokens, pos, meta, _clones(caches))[0]
            swiglu_form("epilogue")
            eager = model.model(tokens, pos, meta, _clones(caches))[
                0
            ]  # compiles every kernel before the capture
            calls()
            graph_caches = _clones(caches)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                h = model.model(tokens, pos, meta, graph_caches)[0]
        assert calls() == {"swiglu": 0, "epilogue": 2}  # captured with the epilogue
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(eager, want)
        assert torch.equal(h, eager)


@pytest.mark.parametrize("scheme", ["int8", "int4-g32"])
def test_quantized_gate_up_takes_the_epilogue_at_one_token(scheme, swiglu_form, calls, monkeypatch, device):
    """An int8 / int4 gate_up (QuantLinear) of a one-token step takes the SwiGLU in its fma decode kernel's
    epilogue (QuantLinear.swiglu_decode): the logits of the separate SwiGLU kernel bit for bit, that kernel
    launched no more; two tokens, or KILN_DECODE_SWIGLU=separate, keep it. (The interpreter's rule takes the
    quantized gemv form at one row: the GPU's fma form is put in its place for every quantized linear.)"""
    import kiln.model.quant_linear as quant_linear
    from kiln.kernels import quant_matmul
    from kiln.quant import QuantScheme, quantize_model

    rule = quant_matmul.wq_decode_config
    monkeypatch.setattr(quant_matmul, "_PLANS", {})  # plans made under the rule by earlier tests
    monkeypatch.setattr(
        quant_matmul,
        "wq_decode_config",
        lambda M, *a, **kw: DecodeConfig("fma", 16, 32) if M == 1 else rule(M, *a, **kw),
    )
    fused = {"n": 0}
    fwd = quant_linear.wq_matmul_fwd

    def counted(*args, **kw):
        fused["n"] += kw.get("epilogue") == "swiglu"
        return fwd(*args, **kw)

    monkeypatch.setattr(quant_linear, "wq_matmul_fwd", counted)
    model = _model("qwen2", device, d_model=64, ffn_hidden=64)
    quantize_model(model, QuantScheme.parse(scheme))
    L = model.config.n_layers
    step = _decode_step(model.config, [9], page=8, seed=2, device=device)
    swiglu_form("separate")
    want = _logits(model, *step)
    assert calls()["swiglu"] == L and fused["n"] == 0
    swiglu_form(None)
    got = _logits(model, *step)
    assert calls()["swiglu"] == 0 and fused["n"] == L
    assert torch.equal(got, want)
    _logits(model, *_decode_step(model.config, [9, 4], page=8, seed=2, device=device))
    assert calls()["swiglu"] == L and fused["n"] == L  # two tokens: the separate kernel
