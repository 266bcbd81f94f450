"""Token permutation for mixture-of-experts: rows gathered into expert-sorted order and combined back.

The routing plan (`routing_plan`, torch ops on the device, no host sync): the N*k (token, slot) pairs of
expert_idx (N, k), pair p = token * k + slot, are sorted by expert, stably (within an expert, by pair),
which gives
    src     (R,)    the pair each row of the sorted buffer holds, -1 for an empty row
    dest    (N*k,)  the row each pair went to, -1 for a dropped pair (its inverse)
    offsets (E+1,)  expert e owns rows [offsets[e], offsets[e+1]) (kernels/moe_gemm.py reads these)
    counts  (E,)    pairs routed to each expert;  dropped (E,) pairs each expert dropped
Dropless (capacity None): R = N*k, offsets the cumsum of counts, nothing dropped. With a capacity C
(`expert_capacity`: ceil(factor * N * k / E)), every expert owns C rows, R = E*C, offsets = e*C: an
expert keeps its first C pairs in token order (Switch Transformer's priority), the rest are dropped
(their output is zero: the token keeps its other experts' share, weights not renormalized), and the
rows it leaves empty are zero. The shapes depend on N, k, E and C only: CUDA-graph safe.

Data movement (the Triton kernels; no atomics, every output element written once, so deterministic):
    permute(x, plan)            xs[r] = x[src[r] // k]                        (0 where src[r] = -1)
    unpermute(y, plan, w)       out[n] = sum_j w[n, j] * y[dest[n*k + j]]     (skipping dest = -1)
the routing weights applied on the way back, fused into the combine, float32 accumulation.
Backward: permute's is unpermute without weights (dx[n] = sum over its slots); unpermute's is
    dy[r] = w[src[r]] * dout[src[r] // k]      (permute with a per-row scale; 0 on empty rows)
    dw[n, j] = <dout[n], y[dest[n*k + j]]>      (0 for a dropped pair)
Shapes: x (N, d), y (R, d), w (N, k) float; any float dtype, rows with a contiguous last dim.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kiln.kernels._common import FLOAT_DTYPES, as_rows, needs_grad
from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import CachedLaunch, cdiv, pow2

BLOCK_D = 1024  # columns per program: 8 per thread at 4 warps, 16-byte loads in bf16


class RoutingPlan(NamedTuple):
    """Where every (token, slot) pair goes (module docstring); all int32 on the routing's device."""

    src: torch.Tensor  # (R,)
    dest: torch.Tensor  # (N*k,)
    offsets: torch.Tensor  # (E+1,)
    counts: torch.Tensor  # (E,)
    dropped: torch.Tensor  # (E,)
    top_k: int


def expert_capacity(n_tokens: int, top_k: int, n_experts: int, factor: float) -> int:
    """Rows per expert at a capacity factor: ceil(factor * N * k / E) (at least 1)."""
    if not factor > 0:
        raise ValueError(f"capacity factor must be positive, got {factor}")
    return max(1, math.ceil(factor * n_tokens * top_k / n_experts))


def routing_plan(
    expert_idx: torch.Tensor, n_experts: int, capacity: int | None = None, counts: torch.Tensor | None = None
) -> RoutingPlan:
    """The plan for expert_idx (N, k) (ints in [0, E), not checked on the device: a host sync); capacity
    None is dropless, else C rows per expert. counts: the (E,) int32 pairs per expert when the caller has
    them (the router's), saving their scatter-add."""
    if expert_idx.dim() != 2 or expert_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_idx must be an (N, k) integer tensor, got {tuple(expert_idx.shape)} "
                         f"{expert_idx.dtype}")  # fmt: skip
    if n_experts <= 0 or (capacity is not None and capacity <= 0):
        raise ValueError(f"n_experts ({n_experts}) and capacity ({capacity}) must be positive")
    N, k = expert_idx.shape
    dev = expert_idx.device
    flat = expert_idx.reshape(-1).long()  # (N*k,) pairs in token order
    if counts is None:
        counts = torch.zeros(n_experts, dtype=torch.int32, device=dev).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32)
        )
    elif counts.shape != (n_experts,) or counts.dtype != torch.int32:
        raise ValueError(
            f"counts must be an ({n_experts},) int32 tensor, got {tuple(counts.shape)} {counts.dtype}"
        )
    order = torch.argsort(flat, stable=True)  # (N*k,) the pair of each sorted position
    pos = torch.arange(N * k, device=dev)
    if capacity is None:
        dest = torch.empty_like(pos).scatter_(0, order, pos)
        offsets = torch.zeros(n_experts + 1, dtype=torch.int32, device=dev)
        offsets[1:] = counts.cumsum(0)
        return RoutingPlan(order.int(), dest.int(), offsets, counts, torch.zeros_like(counts), k)
    starts = counts.cumsum(0) - counts  # (E,) first sorted position of each expert
    sorted_e = flat[order]
    rank = pos - starts[sorted_e]  # position of each sorted pair within its expert
    keep = rank < capacity
    row = torch.where(keep, sorted_e * capacity + rank, -1)
    dest = torch.empty_like(pos).scatter_(0, order, row)
    R = n_experts * capacity
    src = torch.full((R + 1,), -1, dtype=torch.int64, device=dev)
    src.scatter_(0, torch.where(keep, row, R), order)  # dropped pairs land in the spare last slot
    offsets = torch.arange(n_experts + 1, dtype=torch.int32, device=dev) * capacity
    dropped = (counts - capacity).clamp_(min=0)
    return RoutingPlan(src[:R].int(), dest.int(), offsets, counts, dropped, k)


# ---------------------------------------------------------------------------------------- references
def permute_ref(x: torch.Tensor, src: torch.Tensor, top_k: int, scale: torch.Tensor | None = None):
    """xs[r] = (scale[src[r]] *) x[src[r] // k], 0 where src[r] < 0; float32 math, x's dtype."""
    ok = (src >= 0)[:, None]
    p = src.clamp(min=0).long()
    wide = torch.promote_types(x.dtype, torch.float32)
    rows = x[p // top_k].to(wide)
    if scale is not None:
        rows = rows * scale.reshape(-1)[p].to(wide)[:, None]
    return torch.where(ok, rows, 0).to(x.dtype)


def unpermute_ref(y: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor | None, top_k: int):
    """out[n] = sum_j (w[n, j] *) y[dest[n*k + j]], dropped pairs skipped; float32 math, y's dtype."""
    ok = (dest >= 0)[:, None]
    wide = torch.promote_types(y.dtype, torch.float32)
    rows = torch.where(ok, y[dest.clamp(min=0).long()].to(wide), 0)  # (N*k, d)
    if weights is not None:
        rows = rows * weights.reshape(-1, 1).to(wide)
    return rows.view(-1, top_k, y.shape[1]).sum(1).to(y.dtype)


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _gather_kernel(
    X_ptr,  # (N, d) tokens, rows at x_stride
    Src_ptr,  # (R,) int32 pair of each output row, -1 empty
    Scale_ptr,  # (N*k,) per-pair scale, read when HAS_SCALE
    Out_ptr,  # (R, d) contiguous
    d,
    x_stride,
    n_col_blocks,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    row = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    pair = tl.load(Src_ptr + row).to(tl.int64)
    ok = cols < d
    v = tl.load(X_ptr + tl.maximum(pair, 0) // TOP_K * x_stride + cols, mask=ok & (pair >= 0), other=0.0)
    if HAS_SCALE:
        s = tl.load(Scale_ptr + tl.maximum(pair, 0)).to(tl.float32)
        v = tl.where(pair >= 0, v.to(tl.float32) * s, 0.0)
    tl.store(Out_ptr + row * d + cols, v.to(Out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_kernel(
    Y_ptr,  # (R, d) expert outputs, rows at y_stride
    Dest_ptr,  # (N*k,) int32 row of each pair, -1 dropped
    W_ptr,  # (N*k,) routing weights, read when HAS_W
    Out_ptr,  # (N, d) contiguous
    d,
    y_stride,
    n_col_blocks,
    TOP_K: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    n = (pid // n_col_blocks).to(tl.int64)
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < d
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        r = tl.load(Dest_ptr + n * TOP_K + j).to(tl.int64)
        v = tl.load(Y_ptr + tl.maximum(r, 0) * y_stride + cols, mask=ok & (r >= 0), other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(W_ptr + n * TOP_K + j).to(tl.float32)
        acc += v
    tl.store(Out_ptr + n * d + cols, acc.to(Out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _combine_dw_kernel(
    DO_ptr,  # (N, d) gradient of the combined output, rows at do_stride
    Y_ptr,  # (R, d) expert outputs, rows at y_stride
    Dest_ptr,  # (N*k,) int32
    DW_ptr,  # (N*k,) out: <dout[n], y[dest[p]]>, 0 for a dropped pair
    n_pairs,
    d,
    do_stride,
    y_stride,
    TOP_K: tl.constexpr,
    BLOCK_P: tl.constexpr,  # pairs per program
    BLOCK: tl.constexpr,  # columns per step
):
    p = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < n_pairs
    r = tl.load(Dest_ptr + p, mask=p_ok, other=-1).to(tl.int64)
    live = (r >= 0)[:, None]
    acc = tl.zeros((BLOCK_P, BLOCK), dtype=tl.float32)
    for c0 in range(0, d, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = live & (cols < d)[None, :]
        g = tl.load(DO_ptr + (p // TOP_K)[:, None] * do_stride + cols[None, :], mask=ok, other=0.0)
        v = tl.load(Y_ptr + tl.maximum(r, 0)[:, None] * y_stride + cols[None, :], mask=ok, other=0.0)
        acc += g.to(tl.float32) * v.to(tl.float32)
    tl.store(DW_ptr + p, tl.sum(acc, 1).to(DW_ptr.dtype.element_ty), mask=p_ok)


_gather = CachedLaunch(_gather_kernel)
_combine = CachedLaunch(_combine_kernel)
_combine_dw = CachedLaunch(_combine_dw_kernel)


def _block(d: int) -> int:
    return min(BLOCK_D, max(16, pow2(d)))


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    if t.dim() != 2 or t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a 2-D float32, float16 or bfloat16 tensor, got {tuple(t.shape)} "
                         f"{t.dtype}")  # fmt: skip
    return as_rows(t, t.shape[1])


def gather_rows(x: torch.Tensor, src: torch.Tensor, top_k: int, scale: torch.Tensor | None = None):
    """Launcher: (R, d) rows, row r = (scale[src[r]] *) x[src[r] // top_k], zero where src[r] < 0."""
    x = _rows("x", x)
    d = x.shape[1]
    out = torch.empty(src.shape[0], d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block = _block(d)
    ncb = cdiv(d, block)
    sc = None if scale is None else scale.reshape(-1)
    _gather[(src.shape[0] * ncb,)](x, src, x if sc is None else sc, out, d, x.stride(0), ncb, TOP_K=top_k,
                                    HAS_SCALE=sc is not None, BLOCK=block, num_warps=4)  # fmt: skip
    return out


def combine_rows(y: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor | None, top_k: int):
    """Launcher: (N, d), row n = sum_j (weights[n, j] *) y[dest[n*k + j]], dropped pairs skipped."""
    y = _rows("y", y)
    d = y.shape[1]
    n = dest.shape[0] // top_k
    out = torch.empty(n, d, dtype=y.dtype, device=y.device)
    if out.numel() == 0:
        return out
    block = _block(d)
    ncb = cdiv(d, block)
    w = None if weights is None else weights.reshape(-1)
    _combine[(n * ncb,)](y, dest, y if w is None else w, out, d, y.stride(0), ncb, TOP_K=top_k,
                         HAS_W=w is not None, BLOCK=block, num_warps=4)  # fmt: skip
    return out


def combine_dw(dout: torch.Tensor, y: torch.Tensor, dest: torch.Tensor, top_k: int, dtype: torch.dtype):
    """Launcher: (N, k) in `dtype`, <dout[n], y[dest[n*k + j]]> (0 for a dropped pair)."""
    dout, y = _rows("dout", dout), _rows("y", y)
    dw = torch.empty(dest.shape[0], dtype=dtype, device=y.device)
    if dw.numel():
        block = min(256, _block(y.shape[1]))
        bp = 4096 // block  # a (pairs, columns) tile of 4096 products per step
        _combine_dw[(cdiv(dest.shape[0], bp),)](dout, y, dest, dw, dest.shape[0], y.shape[1], dout.stride(0),
                                                y.stride(0), TOP_K=top_k, BLOCK_P=bp, BLOCK=block,
                                                num_warps=4)  # fmt: skip
    return dw.view(-1, top_k)


def _check_plan(x: torch.Tensor, src: torch.Tensor, dest: torch.Tensor, top_k: int, what: str) -> None:
    if src.dtype != torch.int32 or dest.dtype != torch.int32 or src.dim() != 1 or dest.dim() != 1:
        raise ValueError(f"{what}: src and dest must be 1-D int32 (a RoutingPlan's), got {src.dtype} "
                         f"{tuple(src.shape)} and {dest.dtype} {tuple(dest.shape)}")  # fmt: skip
    if top_k <= 0 or dest.shape[0] % top_k:
        raise ValueError(f"{what}: dest has {dest.shape[0]} pairs, not a multiple of top_k {top_k}")
    if src.device != x.device or dest.device != x.device:
        raise ValueError(f"{what}: the plan is on {src.device}, the rows on {x.device}")


class Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dest, top_k):
        ctx.save_for_backward(src, dest)
        ctx.top_k = top_k
        return gather_rows(x, src, top_k)

    @staticmethod
    def backward(ctx, dxs):
        src, dest = ctx.saved_tensors
        return combine_rows(dxs, dest, None, ctx.top_k), None, None, None


class Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, src, dest, weights, top_k):
        ctx.save_for_backward(y, src, dest, weights)
        ctx.top_k = top_k
        return combine_rows(y, dest, weights, top_k)

    @staticmethod
    def backward(ctx, dout):
        y, src, dest, weights = ctx.saved_tensors
        dy = gather_rows(dout, src, ctx.top_k, weights) if ctx.needs_input_grad[0] else None
        dw = combine_dw(dout, y, dest, ctx.top_k, weights.dtype) if ctx.needs_input_grad[3] else None
        return dy, None, None, dw, None


# ------------------------------------------------------------------------------ torch.compile: custom ops
@torch.library.custom_op("kiln::moe_permute", mutates_args=())
def permute_op(x: torch.Tensor, src: torch.Tensor, dest: torch.Tensor, top_k: int) -> torch.Tensor:
    """(R, d): row r = x[src[r] // top_k], zero where src[r] < 0."""
    return gather_rows(x, src, top_k)


@permute_op.register_fake
def _(x, src, dest, top_k):
    return x.new_empty(src.shape[0], x.shape[1])


@torch.library.custom_op("kiln::moe_unpermute", mutates_args=())
def unpermute_op(
    y: torch.Tensor, src: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor | None, top_k: int
) -> torch.Tensor:
    """(N, d): row n = sum_j (weights[n, j] *) y[dest[n*k + j]], dropped pairs skipped."""
    return combine_rows(y, dest, weights, top_k)


@unpermute_op.register_fake
def _(y, src, dest, weights, top_k):
    return y.new_empty(dest.shape[0] // top_k, y.shape[1])


@torch.library.custom_op("kiln::moe_unpermute_bwd", mutates_args=())
def unpermute_bwd_op(
    dout: torch.Tensor, y: torch.Tensor, src: torch.Tensor, dest: torch.Tensor, weights: torch.Tensor,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dy like y, dweights like weights)."""
    return gather_rows(dout, src, top_k, weights), combine_dw(dout, y, dest, top_k, weights.dtype)


@unpermute_bwd_op.register_fake
def _(dout, y, src, dest, weights, top_k):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


def _permute_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])
    ctx.top_k = inputs[3]


def _permute_backward(ctx, dxs):
    src, dest = ctx.saved_tensors
    return unpermute_op(dxs, src, dest, None, ctx.top_k), None, None, None


def _unpermute_setup(ctx, inputs, output):
    y, src, dest, weights, top_k = inputs
    ctx.save_for_backward(y, src, dest, weights)
    ctx.top_k = top_k


def _unpermute_backward(ctx, dout):
    y, src, dest, weights = ctx.saved_tensors
    if weights is None:  # unweighted: the sum over slots, whose backward is the plain gather
        return permute_op(dout, src, dest, ctx.top_k), None, None, None, None
    dy, dw = unpermute_bwd_op(dout, y, src, dest, weights, ctx.top_k)
    return dy, None, None, dw, None


permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)
unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


# ------------------------------------------------------------------------------------------ public ops
def permute(x: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
    """x (N, d) -> (R, d) expert-sorted rows (zero rows where a capacity leaves them empty)."""
    _check_plan(x, plan.src, plan.dest, plan.top_k, "permute")
    if x.dim() != 2 or x.shape[0] * plan.top_k != plan.dest.shape[0]:
        raise ValueError(f"permute: x must be (N, d) with N * top_k = {plan.dest.shape[0]} pairs, got "
                         f"{tuple(x.shape)} and top_k {plan.top_k}")  # fmt: skip
    if not use_triton(x):
        return permute_ref(x, plan.src, plan.top_k)
    if torch.compiler.is_compiling():
        return permute_op(x, plan.src, plan.dest, plan.top_k)
    if needs_grad(x):
        return Permute.apply(x, plan.src, plan.dest, plan.top_k)
    return gather_rows(x, plan.src, plan.top_k)


def unpermute(y: torch.Tensor, plan: RoutingPlan, weights: torch.Tensor | None) -> torch.Tensor:
    """y (R, d) expert outputs -> (N, d): each token's rows, weighted by weights (N, k) and summed."""
    _check_plan(y, plan.src, plan.dest, plan.top_k, "unpermute")
    if y.dim() != 2 or y.shape[0] != plan.src.shape[0]:
        raise ValueError(f"unpermute: y must be ({plan.src.shape[0]}, d), got {tuple(y.shape)}")
    if weights is not None and (weights.numel() != plan.dest.shape[0] or weights.device != y.device):
        raise ValueError(f"unpermute: weights must hold the {plan.dest.shape[0]} pairs' weights on "
                         f"{y.device}, got {tuple(weights.shape)} on {weights.device}")  # fmt: skip
    if not use_triton(y, weights):
        return unpermute_ref(y, plan.dest, weights, plan.top_k)
    if weights is not None:
        weights = weights.reshape(-1, plan.top_k)
        weights = weights if weights.is_contiguous() else weights.contiguous()
    if torch.compiler.is_compiling():
        return unpermute_op(y, plan.src, plan.dest, weights, plan.top_k)
    if needs_grad(y, weights):
        return Unpermute.apply(y, plan.src, plan.dest, weights, plan.top_k)
    return combine_rows(y, plan.dest, weights, plan.top_k)
