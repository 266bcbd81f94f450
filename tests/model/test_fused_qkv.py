"""The one-token q/k/v projection with RoPE and the K/V write in one kernel in the model (the default,
KILN_DECODE_QKV=separate for the two kernels; kiln.model.layers.Attention._fused_qkv): a one-token decode step gives the separate form's logits and cache
writes; the fused kernel runs in every layer and rope_kv_write in none; q/k-normed models (Qwen3), steps of
several tokens and prefills keep the separate form; a bad switch value is a clear error."""

from __future__ import annotations

import pytest
import torch

import kiln.model.layers as layers
from kiln.errors import KilnError
from kiln.kernels.dispatch import use_backend
from kiln.model import ModelConfig, build_model
from kiln.model.config import KernelConfig, decode_qkv

from .test_norm_split import _clones, _decode_step, env_form

BASE = dict(vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden=40, max_seq_len=128)
CFGS = {
    "qwen2": dict(arch="qwen2", qkv_bias=True, head_dim=16),
    "llama": dict(arch="llama", head_dim=16),
    "qwen3": dict(arch="qwen3", head_dim=16, qk_norm=True),
}
# float32: the fused kernel sums K in 256-wide steps, the separate projection in the interpreter's 32-wide
# ones, so the projections differ in the last bits (a few ulps) and the two layers carry that to the logits
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def qkv_form(monkeypatch):
    """Set KILN_DECODE_QKV for the next forward."""
    with env_form(monkeypatch, "KILN_DECODE_QKV", decode_qkv) as set_form:
        yield set_form


@pytest.fixture
def calls(monkeypatch):
    n = {"fused": 0, "rope_kv_write": 0}
    fused, rkw = layers.qkv_rope, layers.rope_kv_write

    def count_fused(*a, **kw):
        n["fused"] += 1
        return fused(*a, **kw)

    def count_rkw(*a, **kw):
        n["rope_kv_write"] += 1
        return rkw(*a, **kw)

    monkeypatch.setattr(layers, "qkv_rope", count_fused)
    monkeypatch.setattr(layers, "rope_kv_write", count_rkw)

    def take() -> dict:
        out = dict(n)
        n.update(fused=0, rope_kv_write=0)
        return out

    return take


def _step(model, tokens, pos, meta, caches):
    with torch.no_grad(), use_backend("triton"):
        h, _ = model.model(tokens, pos, meta, caches)
        return model.compute_logits(h), caches


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_one_token_fused_equals_separate(name, qkv_form, calls, device):
    model = build_model(ModelConfig(**{**BASE, **CFGS[name]}), device, seed=1,
                        kernels=KernelConfig(linear="kiln")).eval()  # fmt: skip
    tokens, pos, meta, caches = _decode_step(model.config, [9], page=8, seed=2, device=device)
    qkv_form("separate")
    want, want_caches = _step(model, tokens, pos, meta, _clones(caches))
    assert calls() == {"fused": 0, "rope_kv_write": 2}
    qkv_form("fused")
    got, got_caches = _step(model, tokens, pos, meta, _clones(caches))
    assert calls() == {"fused": 2, "rope_kv_write": 0}
    torch.testing.assert_close(got, want, **TOL)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        torch.testing.assert_close(gk, wk, **TOL)
        torch.testing.assert_close(gv, wv, **TOL)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_norm_form_equals_separate(name, qkv_form, calls, monkeypatch, device):
    # KILN_DECODE_QKV=norm: the block's add + RMSNorm inside the fused q/k/v kernel too. The logits and the
    # cache writes of the separate kernels up to rstd's float32 sum order (and the preloaded one-shot K sum
    # against the interpreter's 32-wide loop); the input norms are not launched, the post-attention and
    # final ones are
    norms = []
    rmsnorm = layers.rmsnorm
    monkeypatch.setattr(layers, "rmsnorm", lambda *a, **kw: norms.append(1) or rmsnorm(*a, **kw))
    model = build_model(ModelConfig(**{**BASE, **CFGS[name]}), device, seed=1,
                        kernels=KernelConfig(linear="kiln")).eval()  # fmt: skip
    L = model.config.n_layers
    tokens, pos, meta, caches = _decode_step(model.config, [9], page=8, seed=2, device=device)
    qkv_form("separate")
    want, want_caches = _step(model, tokens, pos, meta, _clones(caches))
    assert calls() == {"fused": 0, "rope_kv_write": L} and len(norms) == 2 * L + 1
    norms.clear()
    qkv_form("norm")
    got, got_caches = _step(model, tokens, pos, meta, _clones(caches))
    assert calls() == {"fused": L, "rope_kv_write": 0} and len(norms) == L + 1
    torch.testing.assert_close(got, want, **TOL)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        torch.testing.assert_close(gk, wk, **TOL)
        torch.testing.assert_close(gv, wv, **TOL)
    # two tokens, or a hook that may change the call, keep the separate norm (and the norm form's kernel)
    _step(model, *_decode_step(model.config, [3, 9], page=8, seed=2, device=device))
    assert calls() == {"fused": 0, "rope_kv_write": L}
    norms.clear()
    handle = model.model.layers[1].input_layernorm.register_forward_pre_hook(lambda m, a: None)
    _step(model, tokens, pos, meta, _clones(caches))
    handle.remove()
    assert calls() == {"fused": L, "rope_kv_write": 0} and len(norms) == L + 2  # layer 1's input norm runs


def test_where_it_does_not_apply(qkv_form, calls, device):
    qkv_form("fused")
    qwen3 = build_model(ModelConfig(**{**BASE, **CFGS["qwen3"]}), device, seed=1,
                        kernels=KernelConfig(linear="kiln")).eval()  # fmt: skip
    _step(qwen3, *_decode_step(qwen3.config, [9], page=8, seed=2, device=device))
    assert calls() == {"fused": 0, "rope_kv_write": 2}  # q/k norm between the projection and RoPE
    qwen2 = build_model(ModelConfig(**{**BASE, **CFGS["qwen2"]}), device, seed=1,
                        kernels=KernelConfig(linear="kiln")).eval()  # fmt: skip
    _step(qwen2, *_decode_step(qwen2.config, [3, 9], page=8, seed=2, device=device))
    assert calls() == {"fused": 0, "rope_kv_write": 2}  # two tokens
    from kiln.quant import QuantScheme, quantize_model

    quantize_model(qwen2, QuantScheme.parse("int8"))
    _step(qwen2, *_decode_step(qwen2.config, [9], page=8, seed=2, device=device))
    assert calls() == {"fused": 0, "rope_kv_write": 2}  # a quantized q/k/v projection (a QuantLinear)


def test_profiler_ranges_do_not_turn_the_fusions_off(qkv_form, calls, device):
    # kiln.profile.naming.module_scopes' hooks only open and close profiler ranges: a profiled step runs the
    # kernels an unprofiled one runs (the fused q/k/v here); a hook that may change the call does turn it off
    from kiln.profile.naming import module_scopes

    qkv_form(None)
    model = build_model(ModelConfig(**{**BASE, **CFGS["qwen2"]}), device, seed=1,
                        kernels=KernelConfig(linear="kiln")).eval()  # fmt: skip
    with module_scopes(model):
        _step(model, *_decode_step(model.config, [9], page=8, seed=2, device=device))
    assert calls() == {"fused": 2, "rope_kv_write": 0}
    handle = model.model.layers[0].self_attn.qkv_proj.register_forward_hook(lambda m, a, out: out)
    _step(model, *_decode_step(model.config, [9], page=8, seed=2, device=device))
    handle.remove()
    assert calls() == {"fused": 1, "rope_kv_write": 1}  # layer 0 keeps the separate kernels


def test_bad_switch_value(qkv_form):
    qkv_form("yes")
    with pytest.raises(KilnError, match="KILN_DECODE_QKV"):
        decode_qkv()
    qkv_form(None)
    assert decode_qkv() == "fused"  # the default
