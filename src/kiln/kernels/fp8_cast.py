"""FP8 cast of a 2-D tensor into both layouts at once: q = fp8(sat(t / s)) row-major, and its transpose.

    t (R, C) float, s () float32  ->  q (R, C) and qt (C, R), both contiguous, in e4m3 or e5m2
    q[r, c] = qt[c, r] = fp8(clamp(t[r, c] / s, -fmax, fmax))     (round to nearest even)

Why: FP8 training (kiln.kernels.fp8_train) feeds each quantized tensor to two GEMMs that want it in two
layouts. torch._scaled_mm takes its first operand row-major and its second column-major, so x (tokens, K)
is read as is by the forward and transposed by the weight gradient, and the output gradient likewise by dX
and dW. Made by a copy after the cast, those transposes were ATen's byte-wise transposing copies: 68.7 ms of
a 240 ms step at the 1.1B shape on the H200 (bench/train.py --profile), more than the FP8 GEMMs themselves
(66.2 ms). Here one pass reads t once and writes both layouts: a (BLOCK_R, BLOCK_C) tile is loaded,
divided, saturated and cast, and stored twice, the second store at transposed addresses (Triton moves the
tile through shared memory so that both stores are coalesced).

Two Triton hazards around transposed FP8 stores are stepped around: the tile is stored as its bytes
(bitcast to uint8), never transposed as an FP8 tensor (tl.trans of FP8 tiles has miscompiled,
mlc-ai/pith-train#74), and the saturation is two selects, not min/max (min.NaN / max.NaN next to a
transposed 1-byte store miscompiled it, triton-lang/triton#11111).

Shapes: any 2-D t with any strides and a float dtype; s a one-element float32 tensor. `fp8_cast_dual` is
a torch.library custom op (`kiln::fp8_cast_dual`), so torch.compile keeps the kernel as it is (no inductor
codegen of the transposed store) and fuses the amax that makes s into the neighbouring kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import CachedLaunch, cdiv

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
BLOCK_R, BLOCK_C = 64, 64  # a tile: 4096 values, 8 KB of bf16 in, 2 x 4 KB out


def cast_dual_ref(t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: (q (R, C), qt (C, R)) contiguous in `dtype`, cast as kiln.kernels.fp8_train.quantize."""
    fmax = FP8_MAX[dtype]
    q = (t.float() / s.float().reshape(())).clamp(-fmax, fmax).to(dtype)
    return q, q.t().contiguous()


@triton.jit
def _cast_dual_kernel(
    T_ptr,  # (R, C) float: t[r, c] at T_ptr + r * stride_tr + c * stride_tc
    S_ptr,  # (1,) float32: the scale
    Q_ptr,  # (R, C) uint8 (the FP8 bytes), contiguous
    QT_ptr,  # (C, R) uint8, contiguous
    R,
    C,
    stride_tr,
    stride_tc,
    FMAX: tl.constexpr,
    E5M2: tl.constexpr,  # e5m2, else e4m3
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)).to(tl.int64)
    mask = (r < R)[:, None] & (c < C)[None, :]
    t = tl.load(T_ptr + r[:, None] * stride_tr + c[None, :] * stride_tc, mask=mask, other=0.0).to(tl.float32)
    v = t / tl.load(S_ptr)
    v = tl.where(v > FMAX, FMAX, v)  # saturate by selects (module doc); NaN stays NaN, as torch's clamp
    v = tl.where(v < -FMAX, -FMAX, v)
    if E5M2:
        q = v.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        q = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(Q_ptr + r[:, None] * C + c[None, :], q, mask=mask)
    tl.store(QT_ptr + c[None, :] * R + r[:, None], q, mask=mask)


_cast_dual_launch = CachedLaunch(_cast_dual_kernel)


def cast_dual_triton(
    t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launcher: (q (R, C), qt (C, R)) in `dtype` (module doc)."""
    R, C = t.shape
    q = torch.empty((R, C), dtype=dtype, device=t.device)
    qt = torch.empty((C, R), dtype=dtype, device=t.device)
    if R and C:
        grid = (cdiv(R, BLOCK_R), cdiv(C, BLOCK_C))
        _cast_dual_launch[grid](
            t, s.float().reshape(1), q.view(torch.uint8), qt.view(torch.uint8), R, C, t.stride(0), t.stride(1),
            FMAX=FP8_MAX[dtype], E5M2=dtype == E5M2, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C, num_warps=4,
        )  # fmt: skip
    return q, qt


@torch.library.custom_op("kiln::fp8_cast_dual", mutates_args=())
def fp8_cast_dual(t: torch.Tensor, s: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) float, s one float32 -> (q (R, C), qt (C, R)) contiguous FP8 (e5m2, else e4m3) with
    q = qt^T = fp8(sat(t / s)); the Triton kernel where kiln's kernels run, else the reference."""
    if t.dim() != 2 or s.numel() != 1:
        raise ValueError(
            f"fp8_cast_dual: t must be 2-D and s one value, got {tuple(t.shape)} and {tuple(s.shape)}"
        )
    dtype = E5M2 if e5m2 else E4M3
    if use_triton(t):
        return cast_dual_triton(t, s, dtype)
    return cast_dual_ref(t, s, dtype)


@fp8_cast_dual.register_fake
def _(t, s, e5m2):
    dtype = E5M2 if e5m2 else E4M3
    return t.new_empty(t.shape, dtype=dtype), t.new_empty((t.shape[1], t.shape[0]), dtype=dtype)
