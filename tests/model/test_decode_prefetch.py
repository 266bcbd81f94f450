"""The decode step's L2 prefetch plan (KILN_DECODE_PREFETCH, kiln.model.transformer.Decoder.prefetch_plan):
which bytes each dense block asks for and where in the step; nothing on prefill, under the switch's "off",
or where the GPU cannot prefetch; the same logits with it on (a prefetch changes no value); a bad switch
value is a clear error."""

from __future__ import annotations

import pytest
import torch

import kiln.model.layers as layers
import kiln.model.transformer as transformer
from kiln.errors import KilnError
from kiln.kernels.dispatch import use_backend
from kiln.model import ModelConfig, build_model
from kiln.model.config import DecodePrefetch, KernelConfig, decode_prefetch
from tests.model.test_norm_split import _decode_step, _logits

CFG = dict(arch="qwen2", qkv_bias=True, head_dim=16, vocab_size=97, d_model=48, n_layers=3, n_heads=6,
           n_kv_heads=2, ffn_hidden=40, max_seq_len=128)  # fmt: skip


@pytest.fixture
def prefetch_env(monkeypatch):
    def set_value(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("KILN_DECODE_PREFETCH", raising=False)
        else:
            monkeypatch.setenv("KILN_DECODE_PREFETCH", value)
        decode_prefetch.cache_clear()

    yield set_value
    monkeypatch.delenv("KILN_DECODE_PREFETCH", raising=False)
    decode_prefetch.cache_clear()


@pytest.fixture
def issued(monkeypatch):
    """Pretend the device can prefetch; record every l2_prefetch call as (where, [(tensor, bytes)])."""
    log: list = []
    monkeypatch.setattr(transformer, "can_prefetch", lambda t: True)

    def record(regions):
        log.append(list(regions))

    monkeypatch.setattr(layers, "l2_prefetch", record)
    return log


def test_switch_values(prefetch_env):
    for raw, want in [(None, DecodePrefetch(0, False)), ("off", DecodePrefetch(0, False)),
                      ("24", DecodePrefetch(24, False)), ("0,next", DecodePrefetch(0, True)),
                      ("16,next", DecodePrefetch(16, True))]:  # fmt: skip
        prefetch_env(raw)
        assert decode_prefetch() == want
    for bad in ("yes", "24,all", "-3"):
        prefetch_env(bad)
        with pytest.raises(KilnError, match="KILN_DECODE_PREFETCH"):
            decode_prefetch()


def test_plan_regions_and_same_logits(prefetch_env, issued, device):
    model = build_model(ModelConfig(**CFG), device, seed=1, kernels=KernelConfig(linear="kiln")).eval()
    cfg = model.config
    step = _decode_step(cfg, [4, 17], page=8, seed=2, device=device)
    prefetch_env("off")
    want = _logits(model, *step)
    assert issued == []
    prefetch_env("1,next")
    got = _logits(model, *step)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    layers_ = model.model.layers
    # per block: after qkv (o_proj whole, 1 MB of gate_up: all of this small one); after gate_up the next
    # block's qkv, except after the last block
    expect = []
    for i, b in enumerate(layers_):
        expect.append([(b.self_attn.o_proj.weight, b.self_attn.o_proj.weight.nbytes),
                       (b.mlp.gate_up_proj.weight, 1_000_000)])  # fmt: skip
        if i + 1 < len(layers_):
            w = layers_[i + 1].self_attn.qkv_proj.weight
            expect.append([(w, w.nbytes)])
    assert len(issued) == len(expect)
    for got_regions, want_regions in zip(issued, expect):
        assert [(t.data_ptr(), n) for t, n in got_regions] == [(t.data_ptr(), n) for t, n in want_regions]


def test_no_plan_on_prefill_or_without_hardware(prefetch_env, monkeypatch, device):
    model = build_model(ModelConfig(**CFG), device, seed=1, kernels=KernelConfig(linear="kiln")).eval()
    prefetch_env("24,next")
    h = torch.zeros(40, CFG["d_model"], device=device)  # 40 rows: a prefill, not decode-sized
    with torch.no_grad(), use_backend("triton"):
        assert model.model.prefetch_plan(h[:1]) is None  # the CPU / interpreter cannot prefetch
        monkeypatch.setattr(transformer, "can_prefetch", lambda t: True)
        assert model.model.prefetch_plan(h) is None
        assert model.model.prefetch_plan(h[:1]) is not None
        prefetch_env("off")
        assert model.model.prefetch_plan(h[:1]) is None
