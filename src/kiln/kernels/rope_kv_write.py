"""RoPE and the paged K/V write in one kernel, for decode steps: q rotated, k rotated into its cache slot,
v copied into its slot.

Shapes: q (N, Hq, D), k and v (N, Hk, D) (any strides but a contiguous last dim: the views the fused qkv
projection's output is cut into); cos and sin (R, D/2) tables with rows (N,) picking each token's row
(kiln.model.rope.RotaryTables gives both); the caches (num_blocks, block_size, Hk, D) and slots (N,) int64
as in kiln.kernels.paged_kv (a negative slot is a padding row: its q is rotated, nothing is written).
Returns the rotated q as a new contiguous (N, Hq, D) tensor; k and v land only in the caches (decode
attention reads every key, the new one included, from there).

Math: each pair (a, b) of q and k (half-rotated (x[i], x[i + D/2]), or interleaved (x[2i], x[2i+1]),
kiln.kernels.rope) becomes (a cos - b sin, a sin + b cos) in float32; outputs in the input dtype (the
caches' dtype for k and v), exactly what kiln.kernels.rope.apply_rope followed by
kiln.kernels.paged_kv.paged_kv_write produce, which is the reference (`rope_kv_write_ref`).

Why: in a decode step these were two launches per layer (RoPE, then the K/V write: 2 x 28 kernels of
1.3-1.8 us each on the H200 at batch 1, docs/perf/inference.md) moving a few KB each. One program per
token does all of it: its cos/sin row is loaded once, q and k are rotated in registers, and k never
makes the round trip through a rotated copy in memory. Inference only: no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import FLOAT_DTYPES, pdl, pdl_prologue
from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import CachedLaunch, pow2
from kiln.kernels.paged_kv import paged_kv_write_ref
from kiln.kernels.rope import apply_rope_ref


# ----------------------------------------------------------------------------------------- reference
def rope_kv_write_ref(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved=False) -> torch.Tensor:
    """apply_rope on (q, k) as one row of N tokens, then the paged write of (rotated k, v): the two ops
    the kernel replaces, as the model ran them."""
    q_rot, k_rot = apply_rope_ref(q[None], k[None], cos, sin, rows[None], interleaved)
    paged_kv_write_ref(k_cache, v_cache, k_rot[0], v, slots)
    return q_rot[0].contiguous()


# ------------------------------------------------------------------------------------- Triton kernel
@triton.jit
def _rotate_heads(X, c, s, offs_h, n_heads, half, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):  # fmt: skip
    """Rotate the (BLOCK_H, D) rows at X + offs_h[:, None] (head row pointers; heads >= n_heads masked)
    by c, s (1, BLOCK_D) float32: returns (first, second, mask), where for half-rotated pairs first and
    second are the (BLOCK_H, BLOCK_D) halves of the output row, and for interleaved pairs first is the
    whole (BLOCK_H, 2 BLOCK_D) row (second unused)."""
    h_ok = offs_h[:, None] < n_heads
    if INTERLEAVED:
        j = tl.arange(0, 2 * BLOCK_D)[None, :]
        mask = h_ok & (j < 2 * half)
        x = tl.load(X + j, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_H, 2 BLOCK_D), whole rows
        a, b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D, 2)))
        y = tl.reshape(tl.join(a * c - b * s, a * s + b * c), (BLOCK_H, 2 * BLOCK_D))
        return y, y, mask
    i = tl.arange(0, BLOCK_D)[None, :]
    mask = h_ok & (i < half)
    a = tl.load(X + i, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_H, BLOCK_D): x[i]
    b = tl.load(X + i + half, mask=mask, other=0.0).to(tl.float32)  # x[i + D/2]
    return a * c - b * s, a * s + b * c, mask


@triton.jit
def _store_rotated(O, first, second, mask, half, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store _rotate_heads' output at the row pointers O (BLOCK_H, 1)."""
    if INTERLEAVED:
        tl.store(O + tl.arange(0, 2 * BLOCK_D)[None, :], first.to(O.dtype.element_ty), mask=mask)
    else:
        i = tl.arange(0, BLOCK_D)[None, :]
        tl.store(O + i, first.to(O.dtype.element_ty), mask=mask)
        tl.store(O + i + half, second.to(O.dtype.element_ty), mask=mask)


# fmt: off
@triton.jit
def _rope_kv_write_kernel(
    Q, K, V,  # q (N, Hq, D), k and v (N, Hk, D): any token and head strides, D contiguous
    Q_OUT,  # (N, Hq, D) contiguous: the rotated q
    COS, SIN, ROWS,  # cos, sin (R, D/2); rows (N,): each token's table row
    K_CACHE, V_CACHE, SLOTS,  # caches (num_blocks, PAGE_SIZE, Hk, D); slots (N,) int64, < 0: padding
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cos, stride_sin, stride_rows,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    Hq, Hk, half,  # half = D / 2
    PAGE_SIZE: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,  # next powers of two >= Hq, Hk
    BLOCK_D: tl.constexpr,  # next power of two >= D / 2
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
):
    pdl_prologue(PDL)
    i = tl.program_id(0)  # one token: all its q, k and v heads
    i64 = i.to(tl.int64)
    row = tl.load(ROWS + i64 * stride_rows).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(COS + row * stride_cos + d, mask=d < half, other=0.0).to(tl.float32)  # (1, BLOCK_D)
    s = tl.load(SIN + row * stride_sin + d, mask=d < half, other=0.0).to(tl.float32)
    qh = tl.arange(0, BLOCK_QH)[:, None]
    q1, q2, q_mask = _rotate_heads(Q + i64 * stride_qn + qh * stride_qh, c, s, tl.arange(0, BLOCK_QH), Hq,
                                   half, INTERLEAVED, BLOCK_QH, BLOCK_D)
    _store_rotated(Q_OUT + (i64 * Hq + qh) * (2 * half), q1, q2, q_mask, half, INTERLEAVED, BLOCK_D)
    slot = tl.load(SLOTS + i64).to(tl.int64)
    if slot >= 0:  # a padding row writes nothing
        page = slot // PAGE_SIZE
        pos = slot % PAGE_SIZE
        kh = tl.arange(0, BLOCK_KH)[:, None]
        k1, k2, k_mask = _rotate_heads(K + i64 * stride_kn + kh * stride_kh, c, s, tl.arange(0, BLOCK_KH), Hk,
                                       half, INTERLEAVED, BLOCK_KH, BLOCK_D)
        _store_rotated(K_CACHE + page * stride_kcp + pos * stride_kct + kh * stride_kch, k1, k2, k_mask, half,
                       INTERLEAVED, BLOCK_D)
        j = tl.arange(0, 2 * BLOCK_D)[None, :]
        v_mask = (kh < Hk) & (j < 2 * half)
        v = tl.load(V + i64 * stride_vn + kh * stride_vh + j, mask=v_mask, other=0.0)
        tl.store(V_CACHE + page * stride_vcp + pos * stride_vct + kh * stride_vch + j,
                 v.to(V_CACHE.dtype.element_ty), mask=v_mask)
# fmt: on


_launch = CachedLaunch(_rope_kv_write_kernel)


# ------------------------------------------------------------------------------------------ launcher
def rope_kv_write_triton(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved) -> torch.Tensor:
    """The kernel on checked inputs (contiguous last dims); returns the rotated q (N, Hq, D)."""
    N, Hq, D = q.shape
    Hk = k.shape[1]
    q_out = torch.empty((N, Hq, D), dtype=q.dtype, device=q.device)
    if N == 0:
        return q_out
    use_pdl = pdl(q)
    # one token per program: Hq + 2 Hk rows of D (16 x 128 at Qwen2.5-1.5B), 4 warps; decode steps are a
    # few hundred tokens at most, so the grid is small and each program's loads all issue at once
    _launch[(N,)](
        q, k, v, q_out, cos, sin, rows, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), rows.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], Hq, Hk, D // 2,
        PAGE_SIZE=k_cache.shape[1], INTERLEAVED=interleaved, BLOCK_QH=pow2(Hq), BLOCK_KH=pow2(Hk),
        BLOCK_D=pow2(D // 2), PDL=use_pdl, num_warps=4, launch_pdl=use_pdl,
    )  # fmt: skip
    return q_out


# ------------------------------------------------------------------------------ torch.compile: custom op
# Under torch.compile the public op calls this (Dynamo cannot trace the launch): it writes the caches in
# place, declared so (the compiler orders it against the decode attention that reads them).
@torch.library.custom_op("kiln::rope_kv_write", mutates_args=("k_cache", "v_cache"))
def rope_kv_write_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    return rope_kv_write_triton(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved)


@rope_kv_write_op.register_fake
def _(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved):
    return q.new_empty(q.shape)


# ------------------------------------------------------------------------------------------ public op
def _check(q, k, v, cos, sin, rows, k_cache, v_cache, slots) -> None:
    if (
        q.dim() != 3
        or k.dim() != 3
        or k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[2] != k.shape[2]
    ):
        raise ValueError(
            f"rope_kv_write: q must be (N, Hq, D) and k, v (N, Hk, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    N, Hq, D = q.shape
    if D % 2:
        raise ValueError(f"rope_kv_write: head dim must be even, got {D}")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"rope_kv_write: q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != D // 2:
        raise ValueError(
            f"rope_kv_write: cos and sin must be (R, D/2) = (R, {D // 2}), got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if rows.shape != (N,) or rows.dtype.is_floating_point:
        raise ValueError(f"rope_kv_write: rows must be integer ({N},), got {tuple(rows.shape)} {rows.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"rope_kv_write: caches must be (num_blocks, block_size, {k.shape[1]}, {D}), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if slots.shape != (N,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rope_kv_write: slots must be ({N},) int32/int64, got {tuple(slots.shape)} {slots.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_kv_write: the caches' last dim must be contiguous")
    for t in (k, v, cos, sin, rows, k_cache, v_cache, slots):
        if t.device != q.device:
            raise ValueError(
                f"rope_kv_write: all tensors must be on one device, got {q.device} and {t.device}"
            )


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate q and k by cos/sin at `rows`, write rotated k and v into the caches at `slots` (in place);
    returns the rotated q (N, Hq, D). See the module doc."""
    _check(q, k, v, cos, sin, rows, k_cache, v_cache, slots)
    if not use_triton(q, k, v, cos, sin, k_cache, v_cache):
        return rope_kv_write_ref(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved)
    q, k, v, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, cos, sin))
    if torch.compiler.is_compiling():
        return rope_kv_write_op(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved)
    return rope_kv_write_triton(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved)
