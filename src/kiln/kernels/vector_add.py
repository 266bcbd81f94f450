"""Vector add, out = x + y: the teaching kernel, and the simplest memory-bound roofline.

Shapes: x and y of one shape, dtype (fp32, fp16 or bf16) and device. Inputs that are not contiguous
are copied to contiguous first (the kernel walks one flat array). Backward: dx = dy = dout.

The kernel: program p owns elements [p * BLOCK, (p + 1) * BLOCK); the last program masks the tail.
Each thread of a 4-warp program handles BLOCK / 128 consecutive elements, so with BLOCK = 1024 a
thread moves 8 elements: one 16-byte vector load per operand in bf16/fp16, two in fp32.

Bytes and roofline: every element is read twice and written once, so an add of N elements of s
bytes moves 3 * N * s bytes and does N flops, an arithmetic intensity of 1 / (3 s) flop/byte (1/12
in fp32): far below the H200's ridge point (~735e12 / 4.27e12 ~ 170 flop/byte for bf16 matmul), so
the time is bytes / bandwidth. Against the measured 4.27 TB/s device copy (PLATFORM.md), N = 2**28
fp32 elements (3 * 2**28 * 4 = 3.22 GB) take at least 3.22e9 / 4.27e12 = 0.75 ms; a kernel is at
its roofline when it reaches that, and "percent of copy" in the benchmark is that fraction.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import FLOAT_DTYPES
from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import CachedLaunch, cdiv

BLOCK = 1024


def vector_add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y


@triton.jit
def _add_kernel(
    X_ptr,  # (n,) first operand, contiguous
    Y_ptr,  # (n,) second operand
    O_ptr,  # (n,) out
    n,  # number of elements
    BLOCK: tl.constexpr,  # elements per program
):
    start = tl.program_id(0).to(tl.int64) * BLOCK  # int64: n can pass 2**31
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X_ptr + offs, mask=mask)
    y = tl.load(Y_ptr + offs, mask=mask)
    # float32 add, one rounding: what torch does for bf16/fp16 (and the interpreter's bf16 add is broken)
    tl.store(O_ptr + offs, (x.to(tl.float32) + y.to(tl.float32)).to(O_ptr.dtype.element_ty), mask=mask)


_add_launch = CachedLaunch(_add_kernel)


def vector_add_launch(
    x: torch.Tensor, y: torch.Tensor, block: int = BLOCK, num_warps: int = 4
) -> torch.Tensor:
    """Check the operands and launch one program per BLOCK elements."""
    if x.shape != y.shape or x.dtype != y.dtype or x.device != y.device:
        raise ValueError(
            f"vector_add: x and y must match in shape, dtype and device, got {tuple(x.shape)} {x.dtype} "
            f"{x.device} and {tuple(y.shape)} {y.dtype} {y.device}"
        )
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"vector_add: dtype {x.dtype} is not supported; use float32, float16 or bfloat16")
    x, y = x.contiguous(), y.contiguous()
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _add_launch[(cdiv(n, block),)](x, y, out, n, BLOCK=block, num_warps=num_warps)
    return out


class VectorAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return vector_add_launch(x, y)

    @staticmethod
    def backward(ctx, dout):
        return dout, dout


# ------------------------------------------------------------------------------ torch.compile: custom op
# Under torch.compile the public op calls this (Dynamo cannot trace the launch): opaque to the compiler,
# a fake function for the shape, the (identity) backward registered.
@torch.library.custom_op("kiln::vector_add", mutates_args=())
def vector_add_op(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return vector_add_launch(x, y)


@vector_add_op.register_fake
def _(x, y):
    if x.shape != y.shape or x.dtype != y.dtype or x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"vector_add: x and y must match in shape and float dtype, got {x.shape} {y.shape}")
    return x.new_empty(x.shape)


vector_add_op.register_autograd(lambda ctx, dout: (dout, dout))


def vector_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y for two tensors of one shape and dtype."""
    if use_triton(x, y):
        return vector_add_op(x, y) if torch.compiler.is_compiling() else VectorAddFunction.apply(x, y)
    return vector_add_ref(x, y)
