"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, optionally after a fused residual add.

Shapes: x (..., D), weight (D,). With `residual` (same shape and dtype as x), the op first forms
h = x + residual (in x's dtype, as the eager add does) and returns (norm(h), h): the new residual
stream, as pre-norm blocks need it. The math is done in float32 (float64 for float64 inputs, which the
tests use as the oracle) and the output cast back to x's dtype.

Forward, per row h of length D:   rstd = 1 / sqrt(sum(h^2) / D + eps),   y = h * rstd * w.
Backward, with g = dy * w:         dh = rstd * (g - h * rstd^2 * sum(g * h) / D)   (+ dh_out, the
                                   gradient reaching the returned residual h),
                                   dw = sum over rows of dy * h * rstd.
Both x and residual receive dh.

The Triton path keeps a whole row in registers (BLOCK = next_power_of_2(D), D <= 65536); in the
forward a program takes one row, or for short rows (D <= 2048) a (rows, BLOCK) tile of several; it
saves rstd (one float32 per row) for the backward. The backward runs a few programs per SM, each over
a contiguous chunk of rows, accumulating its dw partial sum in registers; the (programs, D) float32
partials are summed afterwards, so dw costs no atomics. The last dim must be contiguous (other layouts
are copied to contiguous rows first); x may be fp32, fp16 or bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.dispatch import sm_count, use_triton
from kiln.kernels.launch import CachedLaunch, cdiv, pow2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROW = 65536  # a longer row would not fit in one program's registers


def rmsnorm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    acc = torch.promote_types(x.dtype, torch.float32)  # float32 math (float64 for a float64 oracle)
    hf = h.to(acc)
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    y = (y * weight.to(acc)).to(x.dtype)
    return y if residual is None else (y, h)


@triton.jit
def _rmsnorm_fwd_kernel(
    X_ptr,  # (n_rows, D) input rows, last dim contiguous
    R_ptr,  # (n_rows, D) residual rows (read only if HAS_RESIDUAL)
    H_ptr,  # (n_rows, D) out: x + residual (written only if HAS_RESIDUAL)
    Y_ptr,  # (n_rows, D) out: normalized rows
    W_ptr,  # (D,) weight
    RSTD_ptr,  # (n_rows,) out: float32 1/rms per row, for the backward
    x_row_stride,  # elements between rows of X (and of R, H, Y: see launcher)
    r_row_stride,
    y_row_stride,
    n_rows,
    n_cols,  # D
    eps,  # float
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,  # rows per program, as one (ROWS, BLOCK) tile: the weight is read once for all
    BLOCK: tl.constexpr,  # next_power_of_2(D): the whole row in one block
):
    # (ROWS, 1) rows in int64: row * stride can pass 2**31
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    mask = (rows < n_rows) & (cols < n_cols)
    # the weight (an L2 hit) is loaded first so that its latency overlaps the rows', not the reduction's
    w = tl.load(W_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    h = tl.load(X_ptr + rows * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R_ptr + rows * r_row_stride + cols, mask=mask, other=0.0)
        # add in float32 and round once to the input dtype: what the eager bf16/fp16 add does
        h = (h.to(tl.float32) + r.to(tl.float32)).to(X_ptr.dtype.element_ty)
        tl.store(H_ptr + rows * y_row_stride + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / n_cols + eps)[:, None]  # (ROWS, 1)
    tl.store(Y_ptr + rows * y_row_stride + cols, (hf * rstd * w).to(Y_ptr.dtype.element_ty), mask=mask)
    tl.store(RSTD_ptr + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rmsnorm_bwd_kernel(
    DY_ptr,  # (n_rows, D) gradient of y
    H_ptr,  # (n_rows, D) the normalized input h (x, or x + residual) saved by the forward
    DH_ptr,  # (n_rows, D) gradient reaching the returned residual h (read only if HAS_DH)
    W_ptr,  # (D,) weight
    RSTD_ptr,  # (n_rows,) float32, saved by the forward
    DX_ptr,  # (n_rows, D) out: gradient of h (= of x, = of residual)
    DW_ptr,  # (n_programs, D) out: float32 per-program partial sums of dw
    dy_row_stride,
    h_row_stride,
    dh_row_stride,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_DH: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipelining depth of the row loop
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    # num_stages > 1 lets the compiler prefetch the next rows' loads while this row reduces
    for row in tl.range(row_start, row_end, num_stages=STAGES):
        dy = tl.load(DY_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(H_ptr + row * h_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD_ptr + row)
        g = dy * w
        dx = rstd * (g - h * (rstd * rstd * tl.sum(g * h, axis=0) / n_cols))
        if HAS_DH:
            dx += tl.load(DH_ptr + row * dh_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX_ptr + row * n_cols + cols, dx.to(DX_ptr.dtype.element_ty), mask=mask)
        dw += dy * (h * rstd)
    tl.store(DW_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


@triton.jit
def _sum_partials_kernel(
    P_ptr,  # (n_rows, D) float32 partial sums, rows contiguous
    Q_ptr,  # (n_rows, D) a second set (read only if HAS_Q: LayerNorm's bias partials)
    OUT_P,  # (D,) out: column sums of P, in the output dtype
    OUT_Q,  # (D,) out: column sums of Q
    n_rows,
    n_cols,
    HAS_Q: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # one program per BLOCK_C columns, summing down all rows in a fixed order: deterministic, and one
    # launch instead of torch's sum + cast per output (two ops each on the backward's host path)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    acc_p = tl.zeros((BLOCK_C,), dtype=tl.float32)
    acc_q = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        offs = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
        ok = (rows < n_rows)[:, None] & col_ok[None, :]
        acc_p += tl.sum(tl.load(P_ptr + offs, mask=ok, other=0.0), axis=0)
        if HAS_Q:
            acc_q += tl.sum(tl.load(Q_ptr + offs, mask=ok, other=0.0), axis=0)
    tl.store(OUT_P + cols, acc_p.to(OUT_P.dtype.element_ty), mask=col_ok)
    if HAS_Q:
        tl.store(OUT_Q + cols, acc_q.to(OUT_Q.dtype.element_ty), mask=col_ok)


_fwd_launch = CachedLaunch(_rmsnorm_fwd_kernel)
_bwd_launch = CachedLaunch(_rmsnorm_bwd_kernel)
_sum_launch = CachedLaunch(_sum_partials_kernel)


def sum_partials(
    p: torch.Tensor, dtype: torch.dtype, q: torch.Tensor | None = None, q_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Column sums of the backward's (programs, D) float32 partials, cast to `dtype` (and of `q`)."""
    n_rows, D = p.shape
    out_p = torch.empty(D, dtype=dtype, device=p.device)
    out_q = None if q is None else torch.empty(D, dtype=q_dtype or dtype, device=p.device)
    # narrow column blocks, tall row tiles: 128 programs for D = 4096, each summing its 264 partial rows
    # (2 per SM) in 3 steps. With 128-column blocks and 16-row steps it took 18-28 us on the H200, not ~5.
    block_c = 32
    _sum_launch[(cdiv(D, block_c),)](
        p, p if q is None else q, out_p, out_p if out_q is None else out_q, n_rows, D,
        HAS_Q=q is not None, BLOCK_R=128, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out_p, out_q


# The backward's row loop: on the H200 (32768 x 4096 bf16, 2026-11-29) three pipeline stages with two
# programs per SM measured best for both norms (RMSNorm 0.222 ms, LayerNorm 0.233 ms; one stage: 0.250
# and 0.277; one program per SM: 0.35 and 0.40, Liger's choice). 8 and 16 warps tied. Fixed rather than
# autotuned: the autotuner's per-call host cost showed up in the forward+backward timings.
ROW_LOOP_STAGES = 3
PROGRAMS_PER_SM = 2
# The forward's tile: rows of at least this many elements get a program each, shorter ones share one
# (and its weight load), with the warps of one row. H200, 32768 rows bf16 (bench/sweep_memory_bound.py,
# interleaved with Liger): D = 4096, one row in 8 warps 133.7 us (2 or 4 rows 134.6-135.6, Liger 132.5-
# 135.5 across runs); D = 1536, two rows in 4 warps 51.8 us (one row 52.7, Liger 62.4).
FWD_ROW_ELEMS = 4096


def fwd_rows(block: int, tile: int = FWD_ROW_ELEMS) -> int:
    """Rows per program of a norm's forward: as many rows of `block` as fill `tile` elements, at least 1."""
    return max(1, tile // block)


def row_warps(block: int) -> int:
    """num_warps for a kernel holding one row of `block` elements: about 16 elements per thread."""
    return max(1, min(32, block // 512))


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """`t` as a (rows, n_cols) view with a contiguous last dim, copying only when it has to."""
    if t.dim() == 2 and t.stride(1) == 1:  # rows already: no new view (each is host time on the hot path)
        return t
    t2 = t.reshape(-1, n_cols)
    return t2 if t2.stride(-1) == 1 or t2.shape[-1] == 1 else t2.contiguous()


def shaped(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """`t` (contiguous rows) viewed as `shape`: itself when it has that shape already."""
    return t if t.shape == shape else t.view(shape)


def programs_per_device(device: torch.device, per_sm: int) -> int:
    """How many persistent programs a backward launches: `per_sm` per SM on CUDA, 4 on the interpreter."""
    return sm_count(device) * per_sm if device.type == "cuda" else 4


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an op on `tensors` (else the launcher is called without a Function)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def check_rows(name: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: x has dtype {x.dtype}; the kernel takes float32, float16 or bfloat16")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name}: x must have a non-empty last dim, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"{name}: weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},)")
    if x.shape[-1] > MAX_ROW:
        raise ValueError(
            f"{name}: rows of {x.shape[-1]} elements exceed the kernel's {MAX_ROW} (one row per program)"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"{name}: residual must match x in shape and dtype, got {tuple(residual.shape)} {residual.dtype} "
            f"vs {tuple(x.shape)} {x.dtype}"
        )
    for t in (weight, residual):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: all tensors must be on one device, got {x.device} and {t.device}")


def rmsnorm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    num_warps: int | None = None,
    rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward. Returns (y, h, rstd) as (n_rows, D) rows; h is x's rows without a residual.
    rows: rows per program (a power of two; default `fwd_rows`)."""
    check_rows("rmsnorm", x, weight, residual)
    D = x.shape[-1]
    x2 = as_rows(x, D)
    r2 = None if residual is None else as_rows(residual, D)
    n_rows = x2.shape[0]
    y = torch.empty((n_rows, D), dtype=x.dtype, device=x.device)
    h = x2 if r2 is None else torch.empty_like(y)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    if n_rows == 0:
        return y, h, rstd
    block = pow2(D)
    rows = rows or fwd_rows(block)
    _fwd_launch[(cdiv(n_rows, rows),)](
        x2, x2 if r2 is None else r2, h, y, weight, rstd,
        x2.stride(0), 0 if r2 is None else r2.stride(0), D,
        n_rows, D, eps,
        HAS_RESIDUAL=r2 is not None, ROWS=rows, BLOCK=block, num_warps=num_warps or row_warps(block),
    )  # fmt: skip
    return y, h, rstd


def rmsnorm_bwd(
    dy: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dh: torch.Tensor | None = None,
    num_warps: int | None = None,
    programs_per_sm: int = PROGRAMS_PER_SM,
    stages: int = ROW_LOOP_STAGES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward over (n_rows, D) rows. Returns (dx rows in h's dtype, dw in weight's dtype)."""
    n_rows, D = h.shape
    dy2 = as_rows(dy, D)
    dh2 = None if dh is None else as_rows(dh, D)
    dx = torch.empty((n_rows, D), dtype=h.dtype, device=h.device)
    n_prog = max(1, min(n_rows, programs_per_device(h.device, programs_per_sm)))
    dw_partial = torch.empty((n_prog, D), dtype=torch.float32, device=h.device)
    if n_rows == 0:
        return dx, torch.zeros_like(weight)
    block = pow2(D)
    _bwd_launch[(n_prog,)](
        dy2, h, dy2 if dh2 is None else dh2, weight, rstd, dx, dw_partial,
        dy2.stride(0), h.stride(0), 0 if dh2 is None else dh2.stride(0),
        n_rows, D, cdiv(n_rows, n_prog),
        HAS_DH=dh2 is not None, STAGES=stages, BLOCK=block, num_warps=num_warps or row_warps(block),
    )  # fmt: skip
    return dx, sum_partials(dw_partial, weight.dtype)[0]


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros to read
        y, h, rstd = rmsnorm_fwd(x, weight, eps, residual)
        ctx.save_for_backward(h, weight, rstd)
        ctx.shape = x.shape
        ctx.has_residual = residual is not None
        y = shaped(y, x.shape)
        return y if residual is None else (y, shaped(h, x.shape))

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h)
        dx, dw = rmsnorm_bwd(dy, h, weight, rstd, dh)
        dx = shaped(dx, ctx.shape)
        return dx, dw, (dx if ctx.has_residual else None), None


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's last dim; with `residual`, returns (norm(x + residual), x + residual)."""
    if not use_triton(x, weight, residual):
        return rmsnorm_ref(x, weight, eps, residual)
    if needs_grad(x, weight, residual):
        return RMSNormFunction.apply(x, weight, residual, eps)
    # inference: the launcher alone (autograd.Function.apply costs ~25 us of host time per call)
    y, h, _ = rmsnorm_fwd(x, weight, eps, residual)
    return shaped(y, x.shape) if residual is None else (shaped(y, x.shape), shaped(h, x.shape))
