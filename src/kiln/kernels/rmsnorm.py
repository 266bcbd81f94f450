"""RMSNorm: y = round(x / sqrt(mean(x^2) + eps)) * (offset + w), optionally after a fused residual add.

Shapes: x (..., D), weight (D,). With `residual` (same shape and dtype as x), the op first forms
h = x + residual (in x's dtype, as the eager add does) and returns (norm(h), h): the new residual
stream, as pre-norm blocks need it. The math is done in float32 (float64 for float64 inputs, which the
tests use as the oracle) and the output cast back to x's dtype. The normalized row is rounded to x's
dtype before the weight multiply, as Hugging Face's Llama/Qwen RMSNorm does (`weight * h.to(dtype)`), so
bf16 outputs match theirs. `offset` (a float, default 0) is added to the weight: 1.0 gives the
zero-centred weights of Gemma-style checkpoints, which store w - 1.

Forward, per row h of length D:   rstd = 1 / sqrt(sum(h^2) / D + eps),
                                   y = round(h * rstd) * (offset + w).
Backward, with g = dy * (offset + w): dh = rstd * (g - h * rstd^2 * sum(g * h) / D)   (+ dh_out, the
                                   gradient reaching the returned residual h),
                                   dw = sum over rows of dy * h * rstd  (the rounding passes gradients
                                   straight through, as autograd's cast does).
Both x and residual receive dh.

The Triton path keeps a whole row in registers (BLOCK = next_power_of_2(D), D <= 65536); in the
forward a program takes one row, or for short rows (D <= 2048) a (rows, BLOCK) tile of several; it
saves rstd (one float32 per row) for the backward, followed by COUNTERS zeroed int32 counters. The
backward runs a few programs per SM, each over a contiguous chunk of rows, accumulating its dw partial
sum in registers and storing it as one row of a (programs, D) float32 array; the partial rows are then
summed in the same launch, by the programs that finish last (`sum_partial_rows`): the last of each
group of GROUP programs sums its group's rows, the last group's summer sums the group sums. Every sum
runs in program order, so dw is deterministic; the counters deciding who sums are the forward's, left
zeroed again (so two backwards through one forward run one after the other, as autograd runs them, not
concurrently on two streams). One launch, no atomics on the data. The last dim must be contiguous (other layouts are
copied to contiguous rows first); x may be fp32, fp16 or bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.dispatch import sm_count, use_triton
from kiln.kernels.launch import CachedLaunch, cdiv, pow2

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROW = 65536  # a longer row would not fit in one program's registers
# The backward's final sums (`sum_partial_rows`): programs per first-level group, and the int32 counters
# the forward zeroes after its statistics (counter 0 for the groups, 1 + g for group g's programs).
GROUP = tl.constexpr(16)
COUNTERS = tl.constexpr(128)
MAX_PROGRAMS = GROUP.value * (COUNTERS.value - 1)


def rmsnorm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    acc = torch.promote_types(x.dtype, torch.float32)  # float32 math (float64 for a float64 oracle)
    hf = h.to(acc)
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)  # HF's rounding
    y = (normed.to(acc) * (weight.to(acc) + offset)).to(x.dtype)
    return y if residual is None else (y, h)


@triton.jit
def _rmsnorm_fwd_kernel(
    X_ptr,  # (n_rows, D) input rows, last dim contiguous
    R_ptr,  # (n_rows, D) residual rows (read only if HAS_RESIDUAL)
    H_ptr,  # (n_rows, D) out: x + residual (written only if HAS_RESIDUAL)
    Y_ptr,  # (n_rows, D) out: normalized rows
    W_ptr,  # (D,) weight
    RSTD_ptr,  # (n_rows + COUNTERS,) out: float32 1/rms per row, for the backward, then its counters
    x_row_stride,  # elements between rows of X (and of R, H, Y: see launcher)
    r_row_stride,
    y_row_stride,
    n_rows,
    n_cols,  # D
    eps,  # float
    offset,  # float, added to the weight
    HAS_RESIDUAL: tl.constexpr,
    FOR_BACKWARD: tl.constexpr,  # save rstd and zero the backward's counters (inference saves nothing)
    ROWS: tl.constexpr,  # rows per program, as one (ROWS, BLOCK) tile: the weight is read once for all
    BLOCK: tl.constexpr,  # next_power_of_2(D): the whole row in one block
):
    # (ROWS, 1) rows in int64: row * stride can pass 2**31
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    # Masked even where every row and column is in bounds: unmasked loads measured 0.3% slower on the
    # H200 (32768 x 4096 bf16, each kernel into the same outputs: bench/experiments/rmsnorm_same_buffer.py)
    mask = (rows < n_rows) & (cols < n_cols)
    # the weight (an L2 hit): the compiler issues its loads after the row's, during the reduction
    w = tl.load(W_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
    h = tl.load(X_ptr + rows * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R_ptr + rows * r_row_stride + cols, mask=mask, other=0.0)
        # add in float32 and round once to the input dtype: what the eager bf16/fp16 add does
        h = (h.to(tl.float32) + r.to(tl.float32)).to(X_ptr.dtype.element_ty)
        tl.store(H_ptr + rows * y_row_stride + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / n_cols + eps)[:, None]  # (ROWS, 1)
    # round(h * rstd) to the output dtype, then a float32 multiply by (offset + w). The run-time offset
    # keeps that multiply in float32: without it the compiler fuses round-multiply-round into a packed
    # bf16 multiply (the same values), and that form ran 1.1% slower on the H200 (32768 x 4096 bf16,
    # bench/experiments/rmsnorm_liger_math.py: 134.9 against 133.4 us; the float32 form ties Liger's).
    normed = (hf * rstd).to(Y_ptr.dtype.element_ty)
    tl.store(Y_ptr + rows * y_row_stride + cols, (normed * w).to(Y_ptr.dtype.element_ty), mask=mask)
    if FOR_BACKWARD:
        tl.store(RSTD_ptr + rows, rstd, mask=rows < n_rows)
        zero_counters(RSTD_ptr + n_rows)  # the backward's counters, after the n_rows rstd values


@triton.jit
def zero_counters(at):
    """Program 0 zeroes the COUNTERS int32 counters at `at` (a float32 pointer into a norm's saved
    statistics). A masked store rather than a branch: the branch cost the LayerNorm forward 10 registers
    (64 -> 74 per thread at 8 warps, 4 -> 3 programs per SM; 0.1405 against 0.1334 ms on the H200)."""
    c = tl.arange(0, COUNTERS)
    tl.store(
        at.to(tl.pointer_type(tl.int32)) + c,
        tl.zeros((COUNTERS,), tl.int32),
        mask=(c < COUNTERS) & (tl.program_id(0) == 0),
    )


@triton.jit
def sum_partial_rows(
    P_ptr,  # (n_programs, D) float32 partial rows, one per program of this launch (row pid: this one's)
    Q_ptr,  # a second set (LayerNorm's db), summed alongside when HAS_Q
    OUT_P,  # (D,) out: the column sums of P, in OUT_P's dtype
    OUT_Q,
    CNT_ptr,  # float32 pointer to COUNTERS int32 counters, zero on entry and left zero
    n_cols,
    HAS_Q: tl.constexpr,
    SUM_ROWS: tl.constexpr,  # partial rows loaded per step (a (SUM_ROWS, BLOCK) tile)
    BLOCK: tl.constexpr,
):
    """Called by every program of a backward once its partial rows are stored: the last program of each
    GROUP to get here sums the group's rows (in program order) into the group's first row; the last
    group to finish sums those rows (in order) into OUT. Counter 0 counts finished groups, counter
    1 + g the finished programs of group g; each is reset by the program that saw it complete."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cnt = CNT_ptr.to(tl.pointer_type(tl.int32))
    group = pid // GROUP
    first = group * GROUP
    size = tl.minimum(n_prog - first, GROUP)
    tl.debug_barrier()  # every thread's partial stores happen before this program's release below
    if tl.atomic_add(cnt + 1 + group, 1, sem="acq_rel") == size - 1:
        tl.store(cnt + 1 + group, 0)  # all of the group has counted: reset for the next backward
        sum_rows(P_ptr, Q_ptr, P_ptr + first * n_cols, Q_ptr + first * n_cols, first, size, 1, n_cols,
                  HAS_Q, SUM_ROWS, BLOCK)  # fmt: skip
        n_groups = tl.cdiv(n_prog, GROUP)
        tl.debug_barrier()
        if tl.atomic_add(cnt, 1, sem="acq_rel") == n_groups - 1:
            tl.store(cnt, 0)
            sum_rows(P_ptr, Q_ptr, OUT_P, OUT_Q, 0, n_groups, GROUP, n_cols, HAS_Q, SUM_ROWS, BLOCK)


@triton.jit
def sum_rows(P_ptr, Q_ptr, OUT_P, OUT_Q, start, count, step, n_cols, HAS_Q: tl.constexpr,
              SUM_ROWS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """OUT = sum of rows start, start + step, ... (count of them) of P (and Q), in that order."""
    cols = tl.arange(0, BLOCK)[None, :]
    acc_p = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_q = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, count, SUM_ROWS):
        k = i + tl.arange(0, SUM_ROWS)[:, None]
        offs = (start + k * step).to(tl.int64) * n_cols + cols
        ok = (k < count) & (cols < n_cols)
        # .cg: from L2, where the other programs' rows are (this SM's L1 is not coherent with theirs)
        acc_p += tl.sum(tl.load(P_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        if HAS_Q:
            acc_q += tl.sum(tl.load(Q_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
    c = tl.arange(0, BLOCK)
    tl.store(OUT_P + c, acc_p.to(OUT_P.dtype.element_ty), mask=c < n_cols)
    if HAS_Q:
        tl.store(OUT_Q + c, acc_q.to(OUT_Q.dtype.element_ty), mask=c < n_cols)


@triton.jit
def _rmsnorm_bwd_kernel(
    DY_ptr,  # (n_rows, D) gradient of y
    H_ptr,  # (n_rows, D) the normalized input h (x, or x + residual) saved by the forward
    DH_ptr,  # (n_rows, D) gradient reaching the returned residual h (read only if HAS_DH)
    W_ptr,  # (D,) weight
    RSTD_ptr,  # (n_rows + COUNTERS,) float32, saved by the forward: 1/rms per row, then the counters
    DX_ptr,  # (n_rows, D) out: gradient of h (= of x, = of residual)
    DW_ptr,  # (n_programs, D) float32 scratch: per-program partial sums of dw
    DW_OUT,  # (D,) out: dw in the weight's dtype
    dy_row_stride,
    h_row_stride,
    dh_row_stride,
    n_rows,
    n_cols,
    rows_per_program,
    offset,  # float, added to the weight
    HAS_DH: tl.constexpr,
    STAGES: tl.constexpr,  # software-pipelining depth of the row loop
    SUM_ROWS: tl.constexpr,  # partial rows per step of the final sums
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
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
    sum_partial_rows(DW_ptr, DW_ptr, DW_OUT, DW_OUT, RSTD_ptr + n_rows, n_cols, False, SUM_ROWS, BLOCK)


_fwd_launch = CachedLaunch(_rmsnorm_fwd_kernel)
_bwd_launch = CachedLaunch(_rmsnorm_bwd_kernel)


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


def backward_programs(n_rows: int, device: torch.device, per_sm: int) -> int:
    """How many persistent programs a backward launches: `per_sm` per SM on CUDA (4 * per_sm on the
    interpreter, as if it had 4 SMs), at most one per row and at most what the counters cover."""
    per_device = (sm_count(device) if device.type == "cuda" else 4) * per_sm
    return max(1, min(n_rows, per_device, MAX_PROGRAMS))


def sum_rows_step(block: int, sums: int = 1) -> int:
    """Partial rows per step of the backward's final sums of `sums` arrays: (rows, block) float32 tiles
    of at most 16384 values in all, 64 per thread at a row's warps (`row_warps`). Compiled for sm_90 at
    D = 4096, 8 warps: RMSNorm's backward at 4 rows takes 106 registers, LayerNorm's (dw and db) 118 at
    2 rows and 140 at 4, past the 128 that two programs per SM allow (its backward then ran at 0.277 ms
    against 0.232 on the H200)."""
    return max(1, min(4, 16384 // (block * sums)))


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
    for_backward: bool = True,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward. Returns (y, h, rstd) with y and h as (n_rows, D) rows (h is x's rows without a
    residual) and rstd the (n_rows + COUNTERS,) float32 statistics the backward takes: 1/rms per row,
    then its zeroed counters (None when not `for_backward`: inference writes y and h alone).
    rows: rows per program (a power of two; default `fwd_rows`)."""
    check_rows("rmsnorm", x, weight, residual)
    D = x.shape[-1]
    x2 = as_rows(x, D)
    r2 = None if residual is None else as_rows(residual, D)
    n_rows = x2.shape[0]
    y = torch.empty((n_rows, D), dtype=x.dtype, device=x.device)
    h = x2 if r2 is None else torch.empty_like(y)
    rstd = (
        torch.empty(n_rows + COUNTERS.value, dtype=torch.float32, device=x.device) if for_backward else None
    )
    if n_rows == 0:
        return y, h, rstd
    block = pow2(D)
    rows = rows or fwd_rows(block)
    _fwd_launch[(cdiv(n_rows, rows),)](
        x2, x2 if r2 is None else r2, h, y, weight, y if rstd is None else rstd,
        x2.stride(0), 0 if r2 is None else r2.stride(0), D,
        n_rows, D, eps, offset,
        HAS_RESIDUAL=r2 is not None, FOR_BACKWARD=for_backward,
        ROWS=rows, BLOCK=block, num_warps=num_warps or row_warps(block),
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
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward over (n_rows, D) rows, with `rstd` the forward's statistics (and counters).
    Returns (dx rows in h's dtype, dw in weight's dtype)."""
    n_rows, D = h.shape
    if n_rows == 0:
        return torch.empty_like(h), torch.zeros_like(weight)
    dy2 = as_rows(dy, D)
    dh2 = None if dh is None else as_rows(dh, D)
    dx = torch.empty((n_rows, D), dtype=h.dtype, device=h.device)
    n_prog = backward_programs(n_rows, h.device, programs_per_sm)
    dw_partial = torch.empty((n_prog, D), dtype=torch.float32, device=h.device)
    dw = torch.empty_like(weight)
    block = pow2(D)
    _bwd_launch[(n_prog,)](
        dy2, h, dy2 if dh2 is None else dh2, weight, rstd, dx, dw_partial, dw,
        dy2.stride(0), h.stride(0), 0 if dh2 is None else dh2.stride(0),
        n_rows, D, cdiv(n_rows, n_prog), offset,
        HAS_DH=dh2 is not None, STAGES=stages, SUM_ROWS=sum_rows_step(block), BLOCK=block,
        num_warps=num_warps or row_warps(block),
    )  # fmt: skip
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, residual, eps, offset):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros to read
        y, h, rstd = rmsnorm_fwd(x, weight, eps, residual, offset=offset)
        ctx.save_for_backward(h, weight, rstd)
        ctx.shape, ctx.offset = x.shape, offset
        ctx.has_residual = residual is not None
        y = shaped(y, x.shape)
        return y if residual is None else (y, shaped(h, x.shape))

    @staticmethod
    def backward(ctx, dy, dh=None):
        h, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(h)
        dx, dw = rmsnorm_bwd(dy, h, weight, rstd, dh, offset=ctx.offset)
        dx = shaped(dx, ctx.shape)
        return dx, dw, (dx if ctx.has_residual else None), None, None


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's last dim; with `residual`, returns (norm(x + residual), x + residual). The weight
    used is offset + weight (offset 1.0 for Gemma-style zero-centred weights)."""
    if not use_triton(x, weight, residual):
        return rmsnorm_ref(x, weight, eps, residual, offset)
    if needs_grad(x, weight, residual):
        return RMSNormFunction.apply(x, weight, residual, eps, float(offset))
    # inference: the launcher alone (autograd.Function.apply costs ~25 us of host time per call)
    y, h, _ = rmsnorm_fwd(x, weight, eps, residual, for_backward=False, offset=float(offset))
    return shaped(y, x.shape) if residual is None else (shaped(y, x.shape), shaped(h, x.shape))
