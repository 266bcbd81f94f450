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

`rmsnorm_fp8` (inference, before an FP8 linear): the same forward kernel quantizes each normalized row to
FP8 e4m3 in registers (scale = the row's amax / 448, kiln.kernels.fp8_matmul's arithmetic) and stores the
FP8 row and its scale instead of the 16-bit row: the bits of rmsnorm followed by quantize_fp8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import (
    COUNTERS,
    PROGRAMS_PER_SM,
    ROW_LOOP_STAGES,
    as_rows,
    backward_programs,
    check_rows,
    fp8_quantize,
    fp8_row_scale,
    fwd_rows,
    needs_grad,
    pdl,
    pdl_first,
    pdl_prologue,
    row_warps,
    shaped,
    sum_partial_rows,
    sum_rows_step,
    zero_counters,
)
from kiln.kernels.dispatch import use_triton
from kiln.kernels.fp8_matmul import FP8, Fp8Rows, quantize_fp8_ref
from kiln.kernels.launch import CachedLaunch, cdiv, pow2
from kiln.kernels.matmul import matmul_ref
from kiln.kernels.matmul_decode import split_sum_ref


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


def rmsnorm_split_ref(
    partials: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm_split's reference: x = round(partials[0] + ... + partials[S - 1] + bias) in residual's dtype
    (kiln.kernels.matmul_decode's split-K sum, slices added in order), then the add + RMSNorm reference:
    (norm(x + residual), x + residual)."""
    return rmsnorm_ref(split_sum_ref(partials, bias, residual.dtype), weight, eps, residual, offset)


def norm_fused_ref(
    x: torch.Tensor,
    b1: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    b2: torch.Tensor,
    bias1: torch.Tensor | None = None,
    bias2: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence that kiln.kernels.matmul_decode splits between two decode matmuls (the residual_sumsq
    epilogue and the rmsnorm prologue), as three references: y = x @ b1 + bias1 (kiln's matmul reference),
    (z, h) = the add + RMSNorm reference above of (y, residual), out = z @ b2 + bias2. Returns (h, out): the
    new residual stream and the second product, rounded at the dtype's points (float32 math; float64
    inputs give the float64 oracle)."""
    y = matmul_ref(x, b1, bias1)
    z, h = rmsnorm_ref(y, norm_weight, eps, residual=residual, offset=norm_offset)
    return h, matmul_ref(z, b2, bias2)


@triton.jit
def _rmsnorm_fwd_kernel(
    X_ptr,  # (n_rows, D) input rows, last dim contiguous
    R_ptr,  # (n_rows, D) residual rows (read only if HAS_RESIDUAL)
    H_ptr,  # (n_rows, D) out: x + residual (written only if HAS_RESIDUAL)
    Y_ptr,  # (n_rows, D) out: normalized rows (float8e4nv with FP8)
    S_ptr,  # (n_rows,) out with FP8: float32 per-row scales of Y (else unused)
    W_ptr,  # (D,) weight
    RSTD_ptr,  # (n_rows + COUNTERS,) out: float32 1/rms per row, for the backward, then its counters
    B_ptr,  # (D,) the split matmul's bias, read when SPLIT and HAS_BIAS
    x_row_stride,  # elements between rows of X (and of R, H, Y: see launcher)
    r_row_stride,
    y_row_stride,
    split_stride,  # SPLIT: elements between two slices of X (n_rows x D)
    n_rows,
    n_cols,  # D
    eps,  # float
    offset,  # float, added to the weight
    HAS_RESIDUAL: tl.constexpr,
    FOR_BACKWARD: tl.constexpr,  # save rstd and zero the backward's counters (inference saves nothing)
    FP8: tl.constexpr,  # quantize each output row to e4m3 with its own scale (rmsnorm_fp8; inference)
    ROWS: tl.constexpr,  # rows per program, as one (ROWS, BLOCK) tile: the weight is read once for all
    BLOCK: tl.constexpr,  # next_power_of_2(D): the whole row in one block
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
    FIRST: tl.constexpr = False,  # signal the next kernel before waiting (kiln.kernels._common.pdl_first)
    SPLIT: tl.constexpr = 0,  # > 0: X holds SPLIT float32 slices of split-K partial sums (rmsnorm_split)
    HAS_BIAS: tl.constexpr = False,  # SPLIT: add B's bias to the sum
):
    pdl_prologue(PDL, FIRST)
    # (ROWS, 1) rows in int64: row * stride can pass 2**31
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]  # (1, BLOCK)
    # Masked even where every row and column is in bounds: unmasked loads measured 0.3% slower on the
    # H200 (32768 x 4096 bf16, each kernel into the same outputs: bench/experiments/rmsnorm_same_buffer.py)
    mask = (rows < n_rows) & (cols < n_cols)
    # the weight (an L2 hit): the compiler issues its loads after the row's, during the reduction
    w = tl.load(W_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
    dt = H_ptr.dtype.element_ty  # x's dtype (with SPLIT: the split matmul's output dtype)
    if SPLIT > 0:
        # x = round(P[0] + ... + P[SPLIT - 1] + bias): kiln.kernels.matmul_decode's split-K sum, elementwise
        # in its order, so the same bits as its sum kernel's output
        h = tl.load(X_ptr + rows * x_row_stride + cols, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            h += tl.load(X_ptr + s * split_stride + rows * x_row_stride + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            h += tl.load(B_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        h = h.to(dt)
    else:
        h = tl.load(X_ptr + rows * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R_ptr + rows * r_row_stride + cols, mask=mask, other=0.0)
        # add in float32 and round once to the input dtype: what the eager bf16/fp16 add does
        h = (h.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(H_ptr + rows * y_row_stride + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / n_cols + eps)[:, None]  # (ROWS, 1)
    # round(h * rstd) to the output dtype, then a float32 multiply by (offset + w). The run-time offset
    # keeps that multiply in float32: without it the compiler fuses round-multiply-round into a packed
    # bf16 multiply (the same values), and that form ran 1.1% slower on the H200 (32768 x 4096 bf16,
    # bench/experiments/rmsnorm_liger_math.py: 134.9 against 133.4 us; the float32 form ties Liger's).
    y = ((hf * rstd).to(dt) * w).to(dt)  # dt: the output dtype (Y's, but for FP8)
    y_offs = rows * y_row_stride + cols
    if FP8:  # the rounded row, then quantize_fp8's per-row arithmetic on it
        scale, inv = fp8_row_scale(tl.max(tl.abs(y.to(tl.float32)), axis=1))  # (ROWS,)
        tl.store(S_ptr + rows, scale[:, None], mask=rows < n_rows)
        y = fp8_quantize(y.to(tl.float32), inv[:, None])
        # 8-byte stores, 8 values a thread as the 16-bit loads: left to itself the compiler gives the 1-byte
        # store 16-byte vectors and lays the whole tile out for them, which changes the order in which rstd's
        # sum adds (other bits than rmsnorm's) and converts h's layout for its store through shared memory
        y_offs = tl.max_contiguous(tl.multiple_of(y_offs, [1, 8]), [1, 8])
    tl.store(Y_ptr + y_offs, y, mask=mask)
    if FOR_BACKWARD:
        tl.store(RSTD_ptr + rows, rstd, mask=rows < n_rows)
        zero_counters(RSTD_ptr + n_rows)  # the backward's counters, after the n_rows rstd values


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


def rmsnorm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    num_warps: int | None = None,
    rows: int | None = None,
    for_backward: bool = True,
    offset: float = 0.0,
    scales: torch.Tensor | None = None,
    signal_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward. Returns (y, h, rstd) with y and h as (n_rows, D) rows (h is x's rows without a
    residual) and rstd the (n_rows + COUNTERS,) float32 statistics the backward takes: 1/rms per row,
    then its zeroed counters (None when not `for_backward`: inference writes y and h alone).
    rows: rows per program (a power of two; default `fwd_rows`). scales: an (n_rows, 1) float32 tensor to
    take y's per-row FP8 scales; y is then float8_e4m3fn (rmsnorm_fp8). signal_first: the kernel after this
    one may be scheduled before this one waits for its predecessor (pdl_prologue's FIRST, where
    kiln.kernels._common.pdl_first("norm") allows it): for a next kernel that reads its weight early."""
    check_rows("rmsnorm", x, weight, residual)
    D = x.shape[-1]
    x2 = as_rows(x, D)
    r2 = None if residual is None else as_rows(residual, D)
    n_rows = x2.shape[0]
    y = torch.empty((n_rows, D), dtype=x.dtype if scales is None else FP8, device=x.device)
    h = x2 if r2 is None else torch.empty((n_rows, D), dtype=x.dtype, device=x.device)
    rstd = (
        torch.empty(n_rows + COUNTERS.value, dtype=torch.float32, device=x.device) if for_backward else None
    )
    if n_rows == 0:
        return y, h, rstd
    block = pow2(D)
    rows = rows or fwd_rows(block)
    _fwd_launch[(cdiv(n_rows, rows),)](
        x2, x2 if r2 is None else r2, h, y, x2 if scales is None else scales, weight,
        x2 if rstd is None else rstd, weight, x2.stride(0), 0 if r2 is None else r2.stride(0), D, 0,
        n_rows, D, eps, offset,
        HAS_RESIDUAL=r2 is not None, FOR_BACKWARD=for_backward, FP8=scales is not None,
        ROWS=rows, BLOCK=block, num_warps=num_warps or row_warps(block), PDL=pdl(x2), launch_pdl=pdl(x2),
        FIRST=signal_first and pdl_first("norm"),
    )  # fmt: skip
    return y, h, rstd


def rmsnorm_split_fwd(
    partials: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward on split-K partials (rmsnorm_split): (y, h), both (n_rows, D) in residual's dtype."""
    S, n_rows, D = partials.shape
    y = torch.empty((n_rows, D), dtype=residual.dtype, device=residual.device)
    h = torch.empty_like(y)
    if n_rows == 0:
        return y, h
    block = pow2(D)
    rows = fwd_rows(block)
    _fwd_launch[(cdiv(n_rows, rows),)](
        partials, residual, h, y, partials, weight, partials, weight if bias is None else bias,
        D, residual.stride(0), D, n_rows * D, n_rows, D, eps, offset,
        HAS_RESIDUAL=True, FOR_BACKWARD=False, FP8=False, ROWS=rows, BLOCK=block, num_warps=row_warps(block),
        PDL=pdl(residual), launch_pdl=pdl(residual), SPLIT=S,
        HAS_BIAS=bias is not None,
    )  # fmt: skip
    return y, h


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


# ------------------------------------------------------------------------------ torch.compile: custom ops
# Dynamo cannot trace a Triton launch through CachedLaunch (nor Triton's own launch path): under
# torch.compile the public op calls these custom ops instead, which the compiler keeps as opaque calls,
# with fake functions for output shapes and a registered backward (docs/perf/compile.md). Eager calls
# keep the autograd.Function above, which costs less host time per call than the dispatcher.
@torch.library.custom_op("kiln::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor | None,
    eps: float,
    offset: float,
    for_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y like x, h = x + residual like x, rstd (n_rows + COUNTERS,) float32). h is empty without a
    residual (it would be x itself, and an op's output may not alias its input); rstd is empty unless
    `for_backward`."""
    y, h, rstd = rmsnorm_fwd(x, weight, eps, residual, for_backward=for_backward, offset=offset)
    h = h.view(x.shape) if residual is not None else x.new_empty(0)
    return y.view(x.shape), h, rstd if rstd is not None else x.new_empty(0, dtype=torch.float32)


@rmsnorm_fwd_op.register_fake
def _(x, weight, residual, eps, offset, for_backward):
    check_rows("rmsnorm", x, weight, residual)
    n_rows = x.numel() // x.shape[-1]
    rstd = x.new_empty(n_rows + COUNTERS.value if for_backward else 0, dtype=torch.float32)
    return x.new_empty(x.shape), x.new_empty(x.shape if residual is not None else 0), rstd


@torch.library.custom_op("kiln::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd_op(
    dy: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dh: torch.Tensor | None,
    offset: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx like h, dw like weight) for h shaped like x. The backward's counters in rstd are left zero, as
    the forward made them, so rstd is read, not changed."""
    D = h.shape[-1]
    dx, dw = rmsnorm_bwd(dy, as_rows(h, D), weight, rstd, dh, offset=offset)
    return dx.view(h.shape), dw


@rmsnorm_bwd_op.register_fake
def _(dy, h, weight, rstd, dh, offset):
    return h.new_empty(h.shape), torch.empty_like(weight)


def _rmsnorm_setup(ctx, inputs, output):
    x, weight, residual, _, offset, _ = inputs
    ctx.has_residual, ctx.offset = residual is not None, offset
    ctx.save_for_backward(output[1] if residual is not None else x, weight, output[2])


def _rmsnorm_backward(ctx, dy, dh, _drstd):
    h, weight, rstd = ctx.saved_tensors
    dx, dw = rmsnorm_bwd_op(dy, h, weight, rstd, dh if ctx.has_residual else None, ctx.offset)
    return dx, dw, (dx if ctx.has_residual else None), None, None, None


rmsnorm_fwd_op.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup)


def rmsnorm_fp8_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[Fp8Rows, torch.Tensor]:
    """The two ops rmsnorm_fp8 fuses: the RMSNorm reference, then quantize_fp8's reference per row."""
    out = rmsnorm_ref(x, weight, eps, residual, offset)
    y, h = out if residual is not None else (out, x)
    y2 = y.reshape(-1, x.shape[-1])
    return Fp8Rows(*quantize_fp8_ref(y2, per_row=True), x.dtype), h


def rmsnorm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
) -> tuple[Fp8Rows, torch.Tensor]:
    """(rows of norm(x + residual) quantized per row to FP8, x + residual): the RMSNorm before an FP8 linear
    (kiln.kernels.fp8_matmul.fp8_linear takes the Fp8Rows as they come). The kernel rounds the normalized
    row to x's dtype, as rmsnorm returns it, and quantizes it as quantize_fp8 does, in registers: the bits
    of quantize_fp8(rmsnorm(...)), one launch and one pass over the rows less. Without residual, h is x.
    Inference only (no gradient); the rows are x's (n_rows, D) with n_rows = x.numel() // D."""
    if not use_triton(x, weight, residual):
        return rmsnorm_fp8_ref(x, weight, eps, residual, offset)
    if needs_grad(x, weight, residual):
        raise ValueError("rmsnorm_fp8 is for inference: its FP8 output has no gradient")
    n_rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    scales = torch.empty((n_rows, 1), dtype=torch.float32, device=x.device)
    y, h, _ = rmsnorm_fwd(x, weight, eps, residual, for_backward=False, offset=float(offset), scales=scales)
    return Fp8Rows(y, scales, x.dtype), (x if residual is None else shaped(h, x.shape))


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    offset: float = 0.0,
    *,
    signal_first: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x's last dim; with `residual`, returns (norm(x + residual), x + residual). The weight
    used is offset + weight (offset 1.0 for Gemma-style zero-centred weights). signal_first (inference,
    rmsnorm_fwd): the next kernel, one that loads its weight before its programmatic-launch wait, may be
    scheduled before this one waits."""
    if not use_triton(x, weight, residual):
        return rmsnorm_ref(x, weight, eps, residual, offset)
    if torch.compiler.is_compiling():
        y, h, _ = rmsnorm_fwd_op(x, weight, residual, eps, float(offset), needs_grad(x, weight, residual))
        return y if residual is None else (y, h)
    if needs_grad(x, weight, residual):
        return RMSNormFunction.apply(x, weight, residual, eps, float(offset))
    # inference: the launcher alone (autograd.Function.apply costs ~25 us of host time per call)
    y, h, _ = rmsnorm_fwd(
        x, weight, eps, residual, for_backward=False, offset=float(offset), signal_first=signal_first
    )
    return shaped(y, x.shape) if residual is None else (shaped(y, x.shape), shaped(h, x.shape))


def rmsnorm_split(
    partials: torch.Tensor,
    bias: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    offset: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The add + RMSNorm of a split-K matmul's output, its sum done here (inference): partials (S, N, D)
    float32, the slices kiln.kernels.matmul_decode's decode matmul leaves with `defer_sum` (its bias not
    added), bias (D,) or None, residual (N, D). Returns (norm(x + residual), x + residual) with x the
    matmul's output, round(sum of the slices in order + bias) in residual's dtype: x and the new stream
    are the bits of the decode matmul's sum kernel followed by `rmsnorm`, in one launch instead of two.
    The normalized rows: rstd's float32 sum may run in another order than rmsnorm's (its loads are float32
    here), a bf16 ulp at most."""
    S, N, D = partials.shape if partials.dim() == 3 else (0, 0, 0)
    if partials.dtype != torch.float32 or S < 1 or residual.shape != (N, D) or weight.shape != (D,):
        raise ValueError(
            f"rmsnorm_split: partials must be float32 (S >= 1, N, D) with residual (N, D) and weight (D,), got "
            f"{partials.dtype} {tuple(partials.shape)}, residual {tuple(residual.shape)}, weight {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"rmsnorm_split: bias must be ({D},), got {tuple(bias.shape)}")
    if not use_triton(residual, weight) or torch.compiler.is_compiling():
        return rmsnorm_split_ref(partials, bias, weight, eps, residual, offset)
    if not (partials.is_contiguous() and residual.is_contiguous()):
        raise ValueError("rmsnorm_split: partials and residual must be contiguous")
    return rmsnorm_split_fwd(partials, bias, weight, eps, residual, float(offset))
