"""Each decoder block in one kernel at a one-token decode step (KILN_DECODE_BLOCK=fused,
kiln.model.transformer.Decoder.fused_blocks): the separate form's logits and cache writes (Qwen2 with q/k/v
bias, Llama, a Mistral window); the fused kernel runs in every block; q/k-normed models (Qwen3), steps of
several tokens, the model under autocast and a block with a hook keep the separate form (the hooked one
alone); a bad switch value is a clear error. The engine's tokens with fused blocks on the GPU, CUDA graphs
on and off: tests/infer/test_engine_gpu.py."""

from __future__ import annotations

import pytest
import torch

import kiln.model.transformer as transformer
from kiln.errors import KilnError
from kiln.model import ModelConfig, build_model
from kiln.model.config import KernelConfig, decode_block

from . import test_fused_qkv as qkv
from .test_norm_split import _clones, _decode_step, env_form

CFGS = {**qkv.CFGS, "mistral": dict(arch="mistral", head_dim=16, sliding_window=6)}
# float32: the fused kernel sums each projection's K in other steps than the separate decode matmuls (a few
# ulps a projection), which two blocks carry to the logits
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture
def block_form(monkeypatch):
    """Set KILN_DECODE_BLOCK for the next forward."""
    with env_form(monkeypatch, "KILN_DECODE_BLOCK", decode_block) as set_form:
        yield set_form


@pytest.fixture
def calls(monkeypatch):
    n = {"fused": 0}
    fused = transformer.fused_block

    def count(*a, **kw):
        n["fused"] += 1
        return fused(*a, **kw)

    monkeypatch.setattr(transformer, "fused_block", count)

    def take() -> int:
        out = n["fused"]
        n["fused"] = 0
        return out

    return take


def _model(name, device):
    return build_model(ModelConfig(**{**qkv.BASE, **CFGS[name]}), device, seed=1,
                       kernels=KernelConfig(linear="kiln")).eval()  # fmt: skip


_step = qkv._step


@pytest.mark.parametrize("name,n", [("qwen2", 9), ("llama", 30), ("mistral", 11)])
def test_one_token_fused_equals_separate(name, n, block_form, calls, device):
    model = _model(name, device)
    tokens, pos, meta, caches = _decode_step(model.config, [n], page=8, seed=2, device=device)
    block_form(None)
    want, want_caches = _step(model, tokens, pos, meta, _clones(caches))
    assert calls() == 0  # off by default
    block_form("fused")
    got, got_caches = _step(model, tokens, pos, meta, _clones(caches))
    assert calls() == model.config.n_layers
    torch.testing.assert_close(got, want, **TOL)
    for (gk, gv), (wk, wv) in zip(got_caches, want_caches):
        torch.testing.assert_close(gk, wk, **TOL)
        torch.testing.assert_close(gv, wv, **TOL)


def test_where_it_does_not_apply(block_form, calls, device):
    block_form("fused")
    qwen3 = _model("qwen3", device)
    _step(qwen3, *_decode_step(qwen3.config, [9], page=8, seed=2, device=device))
    assert calls() == 0  # q/k norm between the projection and RoPE
    qwen2 = _model("qwen2", device)
    _step(qwen2, *_decode_step(qwen2.config, [3, 9], page=8, seed=2, device=device))
    assert calls() == 0  # two tokens
    step = _decode_step(qwen2.config, [9], page=8, seed=2, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        _step(qwen2, *step)
    assert calls() == 0  # autocast: a float32 stream meets 16-bit outputs
    handle = qwen2.model.layers[1].self_attn.register_forward_hook(lambda *a: None)
    want, _ = _step(qwen2, *step[:3], _clones(step[3]))
    assert calls() == 1  # the hooked block runs its modules; the other one is fused
    handle.remove()
    block_form(None)
    sep, _ = _step(qwen2, *step[:3], _clones(step[3]))
    torch.testing.assert_close(want, sep, **TOL)


def test_bad_switch_value(block_form):
    block_form("yes")
    with pytest.raises(KilnError, match="KILN_DECODE_BLOCK"):
        decode_block()
    block_form(None)
    assert decode_block() == "separate"
