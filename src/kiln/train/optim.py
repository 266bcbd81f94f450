"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the model's two groups: decayed matrices, and undecayed norms/biases
    (`Transformer.param_groups`, where the model says which of its parameters are which)."""
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(
        model.param_groups(cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
    )


def lr_at(step: int, max_lr: float, warmup: int, total: int, min_lr_ratio: float) -> float:
    """Linear warmup over `warmup` steps to max_lr, then cosine decay to max_lr * min_lr_ratio at `total`."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return max_lr * min_lr_ratio
    progress = (step - warmup) / max(1, total - warmup)
    coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * coeff)


class WarmupCosine:
    """Sets each param group's lr from `lr_at`; its only state is the step, saved with checkpoints."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, max_lr: float, warmup: int, total: int, min_lr_ratio: float
    ):
        self.optimizer = optimizer
        self.max_lr, self.warmup, self.total, self.min_lr_ratio = max_lr, warmup, total, min_lr_ratio
        self.step_num = 0
        self._apply()

    def _apply(self) -> float:
        lr = lr_at(self.step_num, self.max_lr, self.warmup, self.total, self.min_lr_ratio)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def step(self) -> float:
        self.step_num += 1
        return self._apply()

    def state_dict(self) -> dict:
        return {"step_num": self.step_num}

    def load_state_dict(self, state: dict) -> None:
        self.step_num = int(state["step_num"])
        self._apply()
