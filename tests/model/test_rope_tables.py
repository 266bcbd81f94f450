"""RoPE frequencies and attention scaling equal transformers' rope initialization functions, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kiln.model import ModelConfig
from kiln.model.rope import RotaryTables, rope_frequencies

from ._helpers import transformers

ROPE_CASES = [
    None,
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "dynamic", "factor": 3.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
    {
        "rope_type": "yarn",
        "factor": 8.0,
        "original_max_position_embeddings": 1024,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3, "truncate": False},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
]


def _hf(rope_scaling, head_dim, theta, max_pos):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = (
        {"rope_type": "default", "rope_theta": theta}
        if rope_scaling is None
        else {**rope_scaling, "rope_theta": theta}
    )
    cfg = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=params,
    )
    kind = params["rope_type"]
    if kind == "default":
        return lambda seq_len=None: _default(cfg)
    return lambda seq_len=None: ROPE_INIT_FUNCTIONS[kind](cfg, "cpu", seq_len=seq_len)


def _default(cfg):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)


@pytest.mark.parametrize("rope_scaling", ROPE_CASES, ids=lambda r: "default" if r is None else r["rope_type"])
@pytest.mark.parametrize("head_dim,theta", [(64, 10000.0), (96, 500000.0), (22, 1e6)])
def test_inverse_frequencies_equal_transformers(rope_scaling, head_dim, theta):
    max_pos = 4096
    cfg = ModelConfig(
        arch="llama",
        vocab_size=8,
        d_model=head_dim * 4,
        n_heads=4,
        head_dim=head_dim,
        n_layers=1,
        ffn_hidden=8,
        max_seq_len=max_pos,
        rope_theta=theta,
        rope_scaling=rope_scaling,
    )
    hf = _hf(rope_scaling, head_dim, theta, max_pos)
    seq_lens = [None, 3 * max_pos + 17] if cfg.rope_type == "dynamic" else [None]
    for seq_len in seq_lens:
        want_freq, want_scale = hf(seq_len)
        got_freq, got_scale = rope_frequencies(cfg, seq_len)
        assert got_freq.dtype == torch.float32
        assert torch.equal(got_freq, want_freq.float()), (got_freq - want_freq).abs().max()
        assert got_scale == pytest.approx(want_scale, rel=1e-12, abs=0)


def test_dynamic_frequencies_follow_positions_without_sync():
    cfg = ModelConfig(
        arch="llama",
        vocab_size=8,
        d_model=64,
        n_heads=4,
        n_layers=1,
        ffn_hidden=8,
        max_seq_len=32,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    tables = RotaryTables(cfg)
    short = torch.arange(20)[None]
    long = torch.arange(50)[None]
    cos_s, _, _ = tables(short)
    cos_l, _, _ = tables(long)
    base_freq, _ = rope_frequencies(cfg)
    torch.testing.assert_close(cos_s, torch.cos(short[0, :, None].float() * base_freq), rtol=0, atol=0)
    # beyond max_seq_len the base grows, so the slowest frequency rotates less than before
    assert not torch.allclose(cos_l[:20], cos_s)
    scaled, _ = rope_frequencies(cfg, 50)
    torch.testing.assert_close(cos_l, torch.cos(long[0, :, None].float() * scaled), rtol=0, atol=0)


def test_static_ntk_scales_the_base():
    cfg = ModelConfig(
        arch="llama",
        vocab_size=8,
        d_model=64,
        n_heads=4,
        n_layers=1,
        ffn_hidden=8,
        max_seq_len=32,
        rope_scaling={"rope_type": "ntk", "factor": 4.0},
    )
    got, scale = rope_frequencies(cfg)
    D = 16
    want = 1.0 / (10000.0 * 4.0 ** (D / (D - 2))) ** (torch.arange(0, D, 2).double() / D)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0)
    assert scale == 1.0
    assert (
        got[0] == 1.0
        and got[-1] < rope_frequencies(ModelConfig(**{**cfg.to_dict(), "rope_scaling": None}))[0][-1]
    )
