import math

import pytest

from kiln.model import ModelConfig, build_model
from kiln.train.optim import OptimConfig, WarmupCosine, build_optimizer, lr_at


def test_warmup_then_cosine_to_the_floor():
    lrs = [lr_at(s, 1.0, 10, 110, 0.1) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # rising during warmup
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:110]))  # falling after
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)


def test_no_decay_on_norms_and_biases():
    cfg = ModelConfig(
        arch="qwen2",
        vocab_size=64,
        d_model=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=24,
        max_seq_len=16,
        qkv_bias=True,
    )
    model = build_model(cfg, seed=0)
    opt = build_optimizer(model, OptimConfig(1e-3, 0.1, 0.9, 0.95, 1e-8))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed = {names[id(p)] for p in no_decay["params"]}
    assert any("norm" in n for n in undecayed) and any(n.endswith("qkv_proj.bias") for n in undecayed)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_scheduler_state_round_trips():
    model = build_model(
        ModelConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, ffn_hidden=8, max_seq_len=8)
    )
    opt = build_optimizer(model, OptimConfig(1e-3, 0.1, 0.9, 0.95, 1e-8))
    sched = WarmupCosine(opt, 1e-3, 5, 50, 0.1)
    for _ in range(7):
        sched.step()
    other = WarmupCosine(opt, 1e-3, 5, 50, 0.1)
    other.load_state_dict(sched.state_dict())
    assert other.lr == sched.lr == pytest.approx(lr_at(7, 1e-3, 5, 50, 0.1))
