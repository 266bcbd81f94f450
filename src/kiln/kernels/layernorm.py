"""LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * w + b, optionally after a fused residual add.

Shapes: x (..., D), weight (D,), bias (D,) or None. With `residual`, returns (norm(x + residual),
x + residual). Float32 math, output in x's dtype.

Only the eager reference lives here so far; the Triton kernel plugs in behind `layernorm`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layernorm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    b = None if bias is None else bias.float()
    y = F.layer_norm(h.float(), (h.shape[-1],), weight.float(), b, eps).to(x.dtype)
    return y if residual is None else (y, h)


def layernorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return layernorm_ref(x, weight, bias, eps, residual)
