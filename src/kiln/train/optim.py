"""The optimizer (AdamW, or Muon + AdamW) and the learning-rate schedule (warmup, then cosine or WSD).

AdamW takes decoupled weight decay on matrices only. Muon (kiln.train.muon) takes the hidden matrices
and leaves the embeddings, head, norms and biases to AdamW. The schedule scales every param group's own
starting lr by one factor, so Muon's and AdamW's learning rates rise and decay together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd")


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    name: str = (
        "adamw"  # adamw, or muon (Muon for the hidden matrices, AdamW with the fields above for the rest)
    )
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5
    muon_weight_decay: float = 0.0
    embed_lr: float | None = None  # muon only: AdamW's lr for the embeddings (None: lr)


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig):
    """AdamW over the model's two groups: decayed matrices, and undecayed norms/biases
    (`Transformer.param_groups`, where the model says which of its parameters are which); or, for
    name="muon", kiln.train.muon.MuonAdamW."""
    if cfg.name == "muon":
        from kiln.train.muon import MuonAdamW

        return MuonAdamW(
            model,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(cfg.beta1, cfg.beta2),
            eps=cfg.eps,
            muon_lr=cfg.muon_lr,
            muon_momentum=cfg.muon_momentum,
            muon_ns_steps=cfg.muon_ns_steps,
            muon_weight_decay=cfg.muon_weight_decay,
            embed_lr=cfg.embed_lr,
        )
    if cfg.name != "adamw":
        raise ValueError(f"optimizer {cfg.name!r} is not one of {', '.join(OPTIMIZERS)}")
    fused = all(p.is_cuda for p in model.parameters())
    return torch.optim.AdamW(
        model.param_groups(cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=fused or None,
    )


def lr_at(
    step: int,
    max_lr: float,
    warmup: int,
    total: int,
    min_lr_ratio: float,
    schedule: str = "cosine",
    cooldown_frac: float = 0.2,
) -> float:
    """Linear warmup over `warmup` steps to max_lr, then down to max_lr * min_lr_ratio at `total`:
    "cosine" decays along a half cosine from the end of warmup; "wsd" (warmup-stable-decay) holds max_lr
    and decays linearly over the last `cooldown_frac` of the steps."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return max_lr * min_lr_ratio
    if schedule == "wsd":
        start = total - cooldown_frac * total
        if step < start:
            return max_lr
        coeff = (total - step) / max(1e-9, total - start)  # 1 -> 0 over the cooldown
    else:
        progress = (step - warmup) / max(1, total - warmup)
        coeff = 0.5 * (1.0 + math.cos(math.pi * progress))
    return max_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * coeff)


class WarmupCosine:
    """Sets each param group's lr to its starting lr times lr_at(step) / max_lr; its only state is the step,
    saved with checkpoints. (Named for its default schedule; schedule="wsd" gives warmup-stable-decay.)"""

    def __init__(
        self,
        optimizer,
        max_lr: float,
        warmup: int,
        total: int,
        min_lr_ratio: float,
        schedule: str = "cosine",
        cooldown_frac: float = 0.2,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
        self.optimizer = optimizer
        self.max_lr, self.warmup, self.total, self.min_lr_ratio = max_lr, warmup, total, min_lr_ratio
        self.schedule, self.cooldown_frac = schedule, cooldown_frac
        for g in optimizer.param_groups:  # each group's own peak (Muon's differs from AdamW's)
            g.setdefault("initial_lr", g["lr"])
        self.step_num = 0
        self._apply()

    def _apply(self) -> float:
        lr = lr_at(
            self.step_num,
            self.max_lr,
            self.warmup,
            self.total,
            self.min_lr_ratio,
            self.schedule,
            self.cooldown_frac,
        )
        for g in self.optimizer.param_groups:
            peak = g["initial_lr"]
            g["lr"] = lr if peak == self.max_lr else peak * (lr / self.max_lr)
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
