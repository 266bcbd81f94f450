"""Round-to-nearest quantization of one weight matrix W (N, K) into kiln's formats (kiln.model.quant_linear).

int8: s[n] = max_k |W[n, k]| / 127, q = round(W / s) in [-127, 127].
int4 symmetric: per group of G columns, s = max |W| / 7.5 ... rounded so that q - 8 covers [-8, 7]:
    s = amax / 8 if the extreme is negative else amax / 7 (the largest magnitude lands on -8 or 7 exactly),
    q = clamp(round(W / s) + 8, 0, 15).
int4 asymmetric: s = (max - min) / 15, z = clamp(round(-min / s), 0, 15), q = clamp(round(W / s) + z, 0, 15).
fp8: s[n] = max |W[n, :]| / 448, q = e4m3(W / s).
Every scale is rounded to bfloat16 before the values are quantized against it, so the stored scale is exact
in any float dtype the model is later cast to (bfloat16, float16 at these magnitudes, float32), and q
is computed against the very scale the kernels apply.
"""

from __future__ import annotations

import torch

from kiln.kernels.fp8_matmul import FP8, FP8_MAX
from kiln.kernels.quant_matmul import pack_int4

TINY = 1e-10  # the scale of an all-zero row or group (q is exactly its zero either way)


def _bf16(s: torch.Tensor) -> torch.Tensor:
    return s.clamp_min(TINY).to(torch.bfloat16)


def int4_params(w: torch.Tensor, asymmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale bf16, zero float) per row of w (rows x G, float32): the group's parameters, each (rows, 1)."""
    if asymmetric:
        lo = w.amin(dim=1, keepdim=True).clamp_max(0)
        hi = w.amax(dim=1, keepdim=True).clamp_min(0)
        s = _bf16((hi - lo) / 15)
        z = (-lo / s.float()).round().clamp(0, 15)
        return s, z
    lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    amax = torch.maximum(-lo, hi)
    # q - 8 spans [-8, 7]: a negative extreme may use -8, a positive one only 7
    s = _bf16(torch.where(-lo >= hi, amax / 8, amax / 7))
    return s, torch.full_like(s, 8, dtype=torch.float32)


def quantize_int4_values(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """q in [0, 15] (float) of w against scale s and zero z (broadcast)."""
    return (w / s.float()).round().add(z).clamp(0, 15)


def quantize_weight(w: torch.Tensor, kind: str, group_size: int = 0, asymmetric: bool = False) -> dict:
    """W (N, K) float -> {"qweight", "scales", "zeros"} for QuantLinear.set_quantized (zeros None unless
    asymmetric int4)."""
    w = w.detach().float()
    N, K = w.shape
    if kind == "int8":
        s = _bf16(w.abs().amax(dim=1, keepdim=True) / 127)
        q = (w / s.float()).round().clamp(-127, 127).to(torch.int8)
        return {"qweight": q, "scales": s, "zeros": None}
    if kind == "fp8":
        s = _bf16(w.abs().amax(dim=1, keepdim=True) / FP8_MAX)
        q = (w / s.float()).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return {"qweight": q, "scales": s, "zeros": None}
    if kind != "int4":
        raise ValueError(f"unknown kind {kind!r}")
    G = group_size
    wg = w.reshape(N * K // G, G)  # one group per row
    s, z = int4_params(wg, asymmetric)
    q = quantize_int4_values(wg, s, z).reshape(N, K)
    return {
        "qweight": pack_int4(q),
        "scales": s.reshape(N, K // G),
        "zeros": z.reshape(N, K // G).to(torch.uint8) if asymmetric else None,
    }
