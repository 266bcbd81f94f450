"""Rotary position embedding applied to q and k.

Shapes: q (B, T, Hq, D), k (B, T, Hk, D); cos and sin (P, D/2) tables indexed by position
(the model owns their frequencies, including every scaling variant); position_ids (B, T) or None
for 0..T-1 (packed sequences restart their ids; decoding passes the cache offset). Two pair layouts:
- half-rotated (HF Llama, `interleaved=False`): pairs are (x[i], x[i + D/2]);
- interleaved (the original RoFormer/GPT-J form, `interleaved=True`): pairs are (x[2i], x[2i+1]).
Each pair (a, b) becomes (a cos - b sin, a sin + b cos). Float32 math (float64 for float64 inputs,
the tests' oracle), outputs in the input dtype.

Backward: the rotation is orthogonal, so the gradient is the inverse rotation of dq and dk
(sin -> -sin), the same kernel run again. cos and sin are constants: they get no gradient (the Triton
path refuses tables that require one).

One launch does q and k: one program per token (b, t) loads its cos/sin row once and rotates all Hq
query heads and Hk key heads as (heads, D/2) tiles. Any strides for B, T and heads are taken as they
are (so (B, H, T, D) tensors passed as `.transpose(1, 2)` views, or q/k sliced out of a fused qkv
projection, are read in place); only the last dim must be contiguous. Position ids must lie in [0, P):
like any indexing kernel, the GPU path does not check this (a check would cost a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.dispatch import use_triton
from kiln.kernels.rmsnorm import FLOAT_DTYPES


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # x (B, T, H, D); cos/sin (B, T, 1, D/2)
    xf = x.to(cos.dtype)
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
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 math (float64 for a float64 oracle)
    c = cos.to(acc)[position_ids].unsqueeze(2)  # (B, T, 1, D/2)
    s = sin.to(acc)[position_ids].unsqueeze(2)
    return _rotate(q, c, s, interleaved), _rotate(k, c, s, interleaved)


@triton.jit
def _rotate_heads(
    X_ptr,  # this token's first head: X + b * stride_b + t * stride_t
    O_ptr,  # the same token in the output
    x_head_stride,
    o_head_stride,
    n_heads,
    half,  # D / 2
    c,  # (1, BLOCK_D) float32 cos for this token
    s,  # (1, BLOCK_D) float32 sin (negated for the backward)
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    i = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D) pair index
    mask = (heads < n_heads) & (i < half)
    if INTERLEAVED:
        ia, ib = 2 * i, 2 * i + 1
    else:
        ia, ib = i, i + half
    x_rows = X_ptr + heads * x_head_stride
    o_rows = O_ptr + heads * o_head_stride
    a = tl.load(x_rows + ia, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_rows + ib, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_rows + ia, (a * c - b * s).to(O_ptr.dtype.element_ty), mask=mask)
    tl.store(o_rows + ib, (a * s + b * c).to(O_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q_ptr,  # (B, T, Hq, D) any strides but the last
    K_ptr,  # (B, T, Hk, D)
    QO_ptr,  # (B, T, Hq, D) out, contiguous
    KO_ptr,  # (B, T, Hk, D) out, contiguous
    COS_ptr,  # (P, D/2)
    SIN_ptr,  # (P, D/2)
    POS_ptr,  # (B, T) integer positions (read only if HAS_POS)
    q_stride_b, q_stride_t, q_stride_h,
    k_stride_b, k_stride_t, k_stride_h,
    cos_row_stride,
    sin_row_stride,
    pos_stride_b, pos_stride_t,
    T, n_q_heads, n_k_heads, half,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,  # rotate by -angle: the gradient of the forward rotation
    BLOCK_QH: tl.constexpr,  # next_power_of_2(Hq)
    BLOCK_KH: tl.constexpr,  # next_power_of_2(Hk)
    BLOCK_D: tl.constexpr,  # next_power_of_2(D / 2)
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    if HAS_POS:
        pos = tl.load(POS_ptr + b * pos_stride_b + t * pos_stride_t).to(tl.int64)
    else:
        pos = t
    i = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(COS_ptr + pos * cos_row_stride + i, mask=i < half, other=0.0).to(tl.float32)
    s = tl.load(SIN_ptr + pos * sin_row_stride + i, mask=i < half, other=0.0).to(tl.float32)
    if BACKWARD:
        s = -s
    D = 2 * half
    _rotate_heads(
        Q_ptr + b * q_stride_b + t * q_stride_t, QO_ptr + pid * n_q_heads * D, q_stride_h, D,
        n_q_heads, half, c, s, INTERLEAVED, BLOCK_QH, BLOCK_D,
    )  # fmt: skip
    _rotate_heads(
        K_ptr + b * k_stride_b + t * k_stride_t, KO_ptr + pid * n_k_heads * D, k_stride_h, D,
        n_k_heads, half, c, s, INTERLEAVED, BLOCK_KH, BLOCK_D,
    )  # fmt: skip


def _check(q, k, cos, sin, position_ids) -> None:
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"apply_rope: q and k must be (B, T, H, D) with the same B, T and D, got {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    D = q.shape[-1]
    if D % 2:
        raise ValueError(f"apply_rope: head dim must be even, got {D}")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype:
        raise TypeError(
            f"apply_rope: q and k must share a float dtype (fp32/fp16/bf16), got {q.dtype}, {k.dtype}"
        )
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != D // 2:
        raise ValueError(
            f"apply_rope: cos and sin must be (P, D/2) = (P, {D // 2}), got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("apply_rope: the Triton path treats cos/sin as constants; pass them detached")
    if position_ids is not None:
        if position_ids.shape != q.shape[:2] or position_ids.dtype.is_floating_point:
            raise ValueError(
                f"apply_rope: position_ids must be integer (B, T) = {tuple(q.shape[:2])}, got "
                f"{tuple(position_ids.shape)} {position_ids.dtype}"
            )
        if (
            not position_ids.is_cuda
            and position_ids.numel()
            and (int(position_ids.min()) < 0 or int(position_ids.max()) >= cos.shape[0])
        ):
            raise ValueError(
                f"apply_rope: position_ids must lie in [0, {cos.shape[0]}) (the rows of cos/sin)"
            )
    for t in (k, cos, sin, position_ids):
        if t is not None and t.device != q.device:
            raise ValueError(f"apply_rope: all tensors must be on one device, got {q.device} and {t.device}")


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    backward: bool = False,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (by -angle if `backward`) in one launch; returns new contiguous tensors."""
    q, k, cos, sin = (_last_contiguous(t) for t in (q, k, cos, sin))
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if B * T == 0:
        return qo, ko
    pos = position_ids if position_ids is not None else q  # a dummy pointer when HAS_POS is off
    block_d = triton.next_power_of_2(D // 2)
    block_qh, block_kh = triton.next_power_of_2(Hq), triton.next_power_of_2(Hk)
    if num_warps is None:  # ~16 elements of q per thread, at least one warp
        num_warps = max(1, min(16, block_qh * block_d * 2 // 512))
    _rope_kernel[(B * T,)](
        q, k, qo, ko, cos, sin, pos,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), sin.stride(0),
        pos.stride(0) if position_ids is not None else 0, pos.stride(1) if position_ids is not None else 0,
        T, Hq, Hk, D // 2,
        HAS_POS=position_ids is not None, INTERLEAVED=interleaved, BACKWARD=backward,
        BLOCK_QH=block_qh, BLOCK_KH=block_kh, BLOCK_D=block_d, num_warps=num_warps,
    )  # fmt: skip
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, interleaved):
        _check(q, k, cos, sin, position_ids)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.interleaved = interleaved
        return rope_launch(q, k, cos, sin, position_ids, interleaved)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        dq, dk = rope_launch(dq, dk, cos, sin, position_ids, ctx.interleaved, backward=True)
        return dq, dk, None, None, None, None


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, T, Hq, D) and k (B, T, Hk, D) by the angles of cos/sin (P, D/2) at position_ids."""
    if use_triton(q, k, cos, sin, position_ids):
        return RoPEFunction.apply(q, k, cos, sin, position_ids, interleaved)
    return apply_rope_ref(q, k, cos, sin, position_ids, interleaved)
