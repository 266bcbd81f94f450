"""Rotary position embedding applied to q and k.

Shapes: q (B, T, Hq, D), k (B, T, Hk, D); cos and sin (P, D/2) tables indexed by position
(the model owns their frequencies, including every scaling variant); position_ids (B, T) or None
for 0..T-1. Two layouts:
- half-rotated (HF Llama, `interleaved=False`): pairs are (x[i], x[i + D/2]);
- interleaved (the original RoFormer/GPT-NeoX-less form, `interleaved=True`): pairs are (x[2i], x[2i+1]).
Each pair (a, b) becomes (a cos - b sin, a sin + b cos). Float32 math, outputs in the input dtype.

Only the eager reference lives here so far; the Triton kernel plugs in behind `apply_rope`.
"""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # x (B, T, H, D); cos/sin (B, T, 1, D/2)
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.to(x.dtype)


def apply_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T = q.shape[:2]
    if position_ids is None:
        position_ids = torch.arange(T, device=q.device).expand(B, T)
    c = cos.float()[position_ids].unsqueeze(2)  # (B, T, 1, D/2)
    s = sin.float()[position_ids].unsqueeze(2)
    return _rotate(q, c, s, interleaved), _rotate(k, c, s, interleaved)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rope_ref(q, k, cos, sin, position_ids, interleaved)
