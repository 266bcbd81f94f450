"""Cross-entropy over a vocabulary, and the fused linear + cross-entropy that never holds all logits.

cross_entropy(logits (N, V), targets (N,)): per-token loss
    lse(z) - (1 - eps) * z[t] - eps * mean(z)      (label smoothing eps; eps = 0 is plain CE)
tokens whose target == ignore_index contribute nothing and are not counted in the mean.
linear_cross_entropy(hidden (N, H), weight (V, H), targets (N,), bias (V,) or None): the same loss
of logits = hidden @ weight.T + bias, the training head's loss.
reduction: "mean" (over non-ignored tokens), "sum", or "none" (per token, float32).

Only the eager reference lives here so far; the Triton kernels plug in behind the public ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy_ref(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    return F.cross_entropy(
        logits.float(), targets, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction
    )


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    return cross_entropy_ref(logits, targets, ignore_index, label_smoothing, reduction)


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    return cross_entropy_ref(logits, targets, ignore_index, label_smoothing, reduction)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    return linear_cross_entropy_ref(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction)
