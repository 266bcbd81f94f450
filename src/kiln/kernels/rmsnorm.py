"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, optionally after a fused residual add.

Shapes: x (..., D), weight (D,). With `residual` (same shape as x), the op first forms
h = x + residual and returns (norm(h), h): the new residual stream, as pre-norm blocks need it.
The math is done in float32 and the output cast back to x's dtype.

Only the eager reference lives here so far; the Triton kernel plugs in behind `rmsnorm`.
"""

from __future__ import annotations

import torch


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * weight.float()).to(x.dtype)
    return y if residual is None else (y, h)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    return rmsnorm_ref(x, weight, eps, residual)
