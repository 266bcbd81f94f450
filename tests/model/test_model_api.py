"""The model API the training pipeline builds on: config, construction, init, loss, param groups."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError
from kiln.kernels.cross_entropy import cross_entropy_ref
from kiln.model import ModelConfig, build_model

TINY = dict(
    arch="llama",
    vocab_size=101,
    d_model=40,
    n_layers=2,
    n_heads=5,
    n_kv_heads=1,
    ffn_hidden=72,
    max_seq_len=32,
)


def test_config_round_trip_and_unknown_keys():
    cfg = ModelConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.head_dim == 8 and cfg.n_kv_heads == 1
    with pytest.raises(KilnError, match="n_layer"):
        ModelConfig.from_dict({**TINY, "n_layer": 3})
    with pytest.raises(KilnError, match="n_kv_heads"):
        ModelConfig(**{**TINY, "n_kv_heads": 2})
    with pytest.raises(KilnError, match="rope_type"):
        ModelConfig(**TINY, rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(KilnError, match="beta_fast"):
        ModelConfig(**TINY, rope_scaling={"rope_type": "linear", "factor": 2.0, "beta_fast": 3})


def test_build_is_deterministic_and_counts_params():
    cfg = ModelConfig(**TINY)
    a, b = build_model(cfg, seed=3), build_model(cfg, seed=3)
    c = build_model(cfg, seed=4)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if p.dim() == 2:
            assert not torch.equal(p, r), n
    assert sum(p.numel() for p in a.parameters()) == cfg.num_params()
    assert cfg.num_params(non_embedding=True) == cfg.num_params() - 101 * 40
    bf = build_model(cfg, dtype=torch.bfloat16, seed=3)
    assert all(p.dtype == torch.bfloat16 for p in bf.parameters())


def test_loss_matches_logits_and_ignores():
    cfg = ModelConfig(**TINY)
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 101, (3, 11), generator=g)
    tgt = torch.randint(0, 101, (3, 11), generator=g)
    tgt[1, 4:] = -100
    logits = model(ids)
    want = cross_entropy_ref(logits.reshape(-1, 101), tgt.reshape(-1))
    torch.testing.assert_close(model.loss(ids, tgt), want)
    want_sum = cross_entropy_ref(logits.reshape(-1, 101), tgt.reshape(-1), reduction="sum")
    torch.testing.assert_close(model.loss(ids, tgt, reduction="sum"), want_sum)
    loss = model.loss(ids, tgt)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match="reduction"):
        model.loss(ids, tgt, reduction="none")


def test_no_weight_decay_names():
    model = build_model(ModelConfig(**TINY))
    names = model.no_weight_decay_param_names()
    assert "model.norm.weight" in names and "model.layers.0.input_layernorm.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names and "lm_head.weight" not in names
    groups = model.param_groups(0.1)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
