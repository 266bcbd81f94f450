"""Softmax along one dim: y_i = exp(x_i - max(x)) / sum_j exp(x_j - max(x)).

Shapes: x (..., N) for dim=-1 (another dim is moved last first, which copies). Float32 math (float64
for float64 inputs, the tests' oracle), output in x's dtype. Backward, per row:
dx = y * (dy - sum(dy * y)); only y is saved.

Two kernels per direction, one row per program:
- one block (N <= max_block): the whole row lives in registers; one read of x, one write of y.
- online, multi-block (longer rows): pass 1 walks the row in blocks keeping a running max m and a
  running sum s rescaled whenever the max grows (s <- s * exp(m_old - m_new) + sum(exp(x - m_new)),
  Milakov & Gimelshein 2018); pass 2 reads the row again and writes exp(x - m) / s. The backward's
  pass 1 accumulates sum(dy * y), pass 2 writes dx. Rows of -inf give NaN, as torch.softmax does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import FLOAT_DTYPES, as_rows, needs_grad, row_warps, shaped
from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import CachedLaunch, pow2

MAX_BLOCK = 16384  # the longest row kept whole in registers; longer rows take the online kernel
ONLINE_BLOCK = 4096  # block the online kernel walks a long row in


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    e = torch.exp(xf - xf.amax(dim, keepdim=True))
    return (e / e.sum(dim, keepdim=True)).to(x.dtype)


@triton.jit
def _softmax_fwd_kernel(
    X_ptr,  # (n_rows, N) input rows, last dim contiguous
    Y_ptr,  # (n_rows, N) out, contiguous
    x_row_stride,
    n_cols,  # N
    BLOCK: tl.constexpr,  # the whole row if ONE_BLOCK, else the step of the online walk
    ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X_ptr + row * x_row_stride
    y_row = Y_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        mask = cols < n_cols
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(y_row + cols, (e / tl.sum(e, axis=0)).to(Y_ptr.dtype.element_ty), mask=mask)
    else:
        m = tl.full((), -float("inf"), tl.float32)  # running max
        s = tl.full((), 0.0, tl.float32)  # running sum of exp(x - m)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # where the max is still -inf every term so far is exp(-inf) = 0: keep s at 0, not NaN
            scale = tl.where(m_new == -float("inf"), 0.0, tl.exp(m - m_new))
            p = tl.where(x == -float("inf"), 0.0, tl.exp(x - m_new))
            s = s * scale + tl.sum(p, axis=0)
            m = m_new
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
            tl.store(y_row + start + cols, (tl.exp(x - m) / s).to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_kernel(
    DY_ptr,  # (n_rows, N) gradient of y, last dim contiguous
    Y_ptr,  # (n_rows, N) the forward's output, contiguous
    DX_ptr,  # (n_rows, N) out, contiguous
    dy_row_stride,
    n_cols,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    dy_row = DY_ptr + row * dy_row_stride
    y_row = Y_ptr + row * n_cols
    dx_row = DX_ptr + row * n_cols
    cols = tl.arange(0, BLOCK)
    if ONE_BLOCK:
        mask = cols < n_cols
        dy = tl.load(dy_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_row + cols, mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(dy * y, axis=0))
        tl.store(dx_row + cols, dx.to(DX_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            acc += dy * y
        dot = tl.sum(acc, axis=0)
        for start in range(0, n_cols, BLOCK):
            mask = start + cols < n_cols
            dy = tl.load(dy_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + start + cols, (y * (dy - dot)).to(DX_ptr.dtype.element_ty), mask=mask)


_fwd_launch = CachedLaunch(_softmax_fwd_kernel)
_bwd_launch = CachedLaunch(_softmax_bwd_kernel)


def _plan(n_cols: int, max_block: int, online_block: int) -> tuple[int, bool]:
    """(BLOCK, ONE_BLOCK) for rows of n_cols."""
    whole = pow2(n_cols)
    if whole <= max_block:
        return whole, True
    return online_block, False


def softmax_fwd(
    x: torch.Tensor,
    max_block: int = MAX_BLOCK,
    online_block: int = ONLINE_BLOCK,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Softmax over x's last dim; returns (n_rows, N) rows. Rows longer than max_block go online."""
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"softmax: x has dtype {x.dtype}; the kernel takes float32, float16 or bfloat16")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"softmax: x must have a non-empty last dim, got shape {tuple(x.shape)}")
    N = x.shape[-1]
    x2 = as_rows(x, N)
    y = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0:
        return y
    block, one = _plan(N, max_block, online_block)
    _fwd_launch[(x2.shape[0],)](
        x2, y, x2.stride(0), N, BLOCK=block, ONE_BLOCK=one, num_warps=num_warps or row_warps(block)
    )
    return y


def softmax_bwd(
    dy: torch.Tensor,
    y: torch.Tensor,
    max_block: int = MAX_BLOCK,
    online_block: int = ONLINE_BLOCK,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Gradient of softmax given dy and the forward's (n_rows, N) output rows y."""
    n_rows, N = y.shape
    dy2 = as_rows(dy, N)
    dx = torch.empty_like(y)
    if n_rows == 0:
        return dx
    block, one = _plan(N, max_block, online_block)
    _bwd_launch[(n_rows,)](
        dy2, y, dx, dy2.stride(0), N, BLOCK=block, ONE_BLOCK=one, num_warps=num_warps or row_warps(block)
    )
    return dx


class SoftmaxFunction(torch.autograd.Function):
    """Softmax over the last dim."""

    @staticmethod
    def forward(ctx, x):
        y = softmax_fwd(x)
        ctx.save_for_backward(y)
        ctx.shape = x.shape
        return shaped(y, x.shape)

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return shaped(softmax_bwd(dy, y), ctx.shape)


# ------------------------------------------------------------------------------ torch.compile: custom ops
# Under torch.compile the public op calls these instead of SoftmaxFunction (Dynamo cannot trace the
# launch): opaque to the compiler, fake functions for shapes, the backward registered.
@torch.library.custom_op("kiln::softmax_fwd", mutates_args=())
def softmax_fwd_op(x: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim, a new contiguous tensor shaped like x."""
    return softmax_fwd(x).view(x.shape)


@softmax_fwd_op.register_fake
def _(x):
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"softmax: x has dtype {x.dtype}; the kernel takes float32, float16 or bfloat16")
    return x.new_empty(x.shape)


@torch.library.custom_op("kiln::softmax_bwd", mutates_args=())
def softmax_bwd_op(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of softmax's input, given dy and its output y (both shaped like x)."""
    return softmax_bwd(dy, as_rows(y, y.shape[-1])).view(y.shape)


@softmax_bwd_op.register_fake
def _(dy, y):
    return y.new_empty(y.shape)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    return softmax_bwd_op(dy, y)


softmax_fwd_op.register_autograd(_softmax_backward, setup_context=_softmax_setup)


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax of x along `dim`."""
    if not use_triton(x):
        return softmax_ref(x, dim)
    last = dim in (-1, x.dim() - 1)
    xl = x if last else x.movedim(dim, -1)
    if torch.compiler.is_compiling():
        y = softmax_fwd_op(xl)
        return y if last else y.movedim(-1, dim)
    y = SoftmaxFunction.apply(xl) if needs_grad(xl) else shaped(softmax_fwd(xl), xl.shape)
    return y if last else y.movedim(-1, dim)
