import math

import pytest
import torch

from kiln.train.optim import OptimConfig, WarmupCosine, build_optimizer, lr_at, param_groups


def test_warmup_then_cosine_to_the_floor():
    lrs = [lr_at(s, 1.0, 10, 110, 0.1) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))  # rising during warmup
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:110]))  # falling after
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[110] == pytest.approx(0.1) and lrs[119] == pytest.approx(0.1)


def test_no_decay_on_norms_and_biases():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Embedding(5, 4))
    decay, no_decay = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {p.dim() for p in decay["params"]} == {2} and len(decay["params"]) == 2
    assert {p.dim() for p in no_decay["params"]} == {1} and len(no_decay["params"]) == 3


def test_scheduler_state_round_trips():
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, OptimConfig(1e-3, 0.1, 0.9, 0.95, 1e-8))
    sched = WarmupCosine(opt, 1e-3, 5, 50, 0.1)
    for _ in range(7):
        sched.step()
    other = WarmupCosine(opt, 1e-3, 5, 50, 0.1)
    other.load_state_dict(sched.state_dict())
    assert other.lr == sched.lr == pytest.approx(lr_at(7, 1e-3, 5, 50, 0.1))
