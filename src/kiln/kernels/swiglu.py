"""SwiGLU: silu(gate) * up, the gated MLP activation of Llama/Qwen/Mixtral.

Shapes: gate and up (..., H) as two tensors, or one fused tensor (..., 2H) holding [gate | up]
along the last dim (pass up=None). Float32 math (float64 for float64 inputs, the tests' oracle),
output in the input dtype.

Forward:  out = g * sigmoid(g) * u.
Backward: du = dout * g * sigmoid(g),   dg = dout * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))).
Nothing but the inputs is saved; the backward recomputes sigmoid (cheaper than storing it).

The kernel is elementwise over (rows, H) with each operand's own row stride, so the fused layout is
just two column views of one tensor (gate = cols [0, H), up = cols [H, 2H)) and its gradient is
written into one (..., 2H) tensor the same way: no chunk copies, no concatenation. Rows split into
BLOCK-wide column tiles on a 1D grid (rows can pass the 65535 limit of grid axis 1). When every
operand is contiguous the whole tensor is one long row, so no tile is wasted on a ragged row end.

Decode-sized batches take `swiglu_linear` (the end of this file): the SwiGLU computed in the prologue of
the down projection's decode matmul, with swiglu then matmul as its reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels._common import (
    FLOAT_DTYPES,
    MAX_ROW,
    fp8_quantize,
    fp8_row_scale,
    needs_grad,
    pdl,
    pdl_prologue,
    row_warps,
)
from kiln.kernels.dispatch import use_triton
from kiln.kernels.fp8_matmul import FP8, Fp8Rows, quantize_fp8, quantize_fp8_ref
from kiln.kernels.launch import CachedLaunch, cdiv, pow2
from kiln.kernels.matmul import matmul_ref
from kiln.kernels.matmul_decode import DECODE_MAX_M, decode_matmul

BLOCK = 1024  # elements per program: 8 per thread at 4 warps, 16-byte loads in bf16


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    acc = torch.promote_types(gate.dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(gate.dtype)


@triton.jit
def _swiglu_fwd_kernel(
    G_ptr,  # (n_rows, H) gate, last dim contiguous
    U_ptr,  # (n_rows, H) up
    O_ptr,  # (n_rows, H) out
    g_row_stride,
    u_row_stride,
    o_row_stride,
    n_cols,  # H
    n_col_blocks,  # cdiv(H, BLOCK)
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
):
    pdl_prologue(PDL)
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    out = _silu_mul(G_ptr + row * g_row_stride, U_ptr + row * u_row_stride, cols, mask)
    tl.store(O_ptr + row * o_row_stride + cols, out.to(O_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(G_row, U_row, cols, mask):
    """float32 silu(g) * u at the columns `cols` of one row (0 where masked)."""
    g = tl.load(G_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_row + cols, mask=mask, other=0.0).to(tl.float32)
    return g * tl.sigmoid(g) * u


@triton.jit
def _swiglu_fp8_kernel(
    G_ptr,  # (n_rows, H) gate, last dim contiguous
    U_ptr,  # (n_rows, H) up
    Q_ptr,  # (n_rows, H) out: float8e4nv, contiguous
    S_ptr,  # (n_rows,) out: float32 per-row scales
    g_row_stride,
    u_row_stride,
    n_cols,  # H
    BLOCK: tl.constexpr,  # >= H: the whole row in registers
    PDL: tl.constexpr,
):
    """One row a program, held in registers: silu(g) * u rounded to the input dtype (what swiglu stores),
    its amax, and the row stored quantized with its scale (quantize_fp8's arithmetic: the bits of the two
    kernels). One pass over gate and up; a second pass (a row past registers) would read them again."""
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    a = _silu_mul(G_ptr + row * g_row_stride, U_ptr + row * u_row_stride, cols, ok)
    a = a.to(G_ptr.dtype.element_ty).to(tl.float32)
    scale, inv = fp8_row_scale(tl.max(tl.abs(a), axis=0))
    tl.store(S_ptr + row, scale)
    tl.store(Q_ptr + row * n_cols + cols, fp8_quantize(a, inv), mask=ok)


@triton.jit
def _swiglu_bwd_kernel(
    DO_ptr,  # (n_rows, H) gradient of out
    G_ptr,  # (n_rows, H) gate
    U_ptr,  # (n_rows, H) up
    DG_ptr,  # (n_rows, H) out: gradient of gate
    DU_ptr,  # (n_rows, H) out: gradient of up
    do_row_stride,
    g_row_stride,
    u_row_stride,
    dg_row_stride,
    du_row_stride,
    n_cols,
    n_col_blocks,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    do = tl.load(DO_ptr + row * do_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DU_ptr + row * du_row_stride + cols, (do * silu).to(DU_ptr.dtype.element_ty), mask=mask)
    dg = do * u * (sig + silu * (1.0 - sig))
    tl.store(DG_ptr + row * dg_row_stride + cols, dg.to(DG_ptr.dtype.element_ty), mask=mask)


_fwd_launch = CachedLaunch(_swiglu_fwd_kernel)
_fp8_launch = CachedLaunch(_swiglu_fp8_kernel)
_bwd_launch = CachedLaunch(_swiglu_bwd_kernel)


def _flat(*ts: torch.Tensor) -> list[torch.Tensor] | None:
    """All of `ts` as one long row each (1, numel) if every one is contiguous, else None."""
    if all(t.is_contiguous() for t in ts):
        return [t.view(1, -1) for t in ts]
    return None


def _launch_grid(n_rows: int, n_cols: int, block: int) -> tuple[int, int]:
    n_col_blocks = cdiv(n_cols, block)
    return n_rows * n_col_blocks, n_col_blocks


def _split(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) as (n_rows, H) views with a contiguous last dim; the fused form splits by columns."""
    if gate.dtype not in FLOAT_DTYPES:
        raise TypeError(f"swiglu: gate has dtype {gate.dtype}; the kernel takes float32, float16 or bfloat16")
    if up is None:
        if gate.dim() == 0 or gate.shape[-1] % 2:
            raise ValueError(
                f"swiglu: the fused tensor's last dim must be even (2H), got {tuple(gate.shape)}"
            )
        H = gate.shape[-1] // 2
        x = gate.reshape(-1, 2 * H)
        x = x if x.stride(-1) == 1 else x.contiguous()
        return x[:, :H], x[:, H:]
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(
            f"swiglu: gate and up must match in shape, dtype and device, got {tuple(gate.shape)} {gate.dtype} "
            f"{gate.device} and {tuple(up.shape)} {up.dtype} {up.device}"
        )
    H = gate.shape[-1]
    g, u = gate.reshape(-1, H), up.reshape(-1, H)
    return (g if g.stride(-1) == 1 else g.contiguous()), (u if u.stride(-1) == 1 else u.contiguous())


def swiglu_fwd(g: torch.Tensor, u: torch.Tensor, block: int = BLOCK, num_warps: int = 4) -> torch.Tensor:
    """silu(g) * u over (n_rows, H) views; returns a contiguous (n_rows, H) tensor."""
    out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if out.numel() == 0:
        return out
    flat = _flat(g, u)
    g2, u2, o2 = (*flat, out.view(1, -1)) if flat else (g, u, out)
    n_prog, n_col_blocks = _launch_grid(g2.shape[0], g2.shape[1], block)
    _fwd_launch[(n_prog,)](
        g2, u2, o2, g2.stride(0), u2.stride(0), o2.stride(0), g2.shape[1], n_col_blocks,
        BLOCK=block, num_warps=num_warps, PDL=pdl(g2), launch_pdl=pdl(g2),
    )  # fmt: skip
    return out


def swiglu_bwd(
    dout: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor,
    dg: torch.Tensor,
    du: torch.Tensor,
    block: int = BLOCK,
    num_warps: int = 4,
) -> None:
    """Write the gradients of gate and up into the (n_rows, H) views dg and du."""
    if dout.numel() == 0:
        return
    dout = dout.reshape(g.shape)
    dout = dout if dout.stride(-1) == 1 else dout.contiguous()
    ts = _flat(dout, g, u, dg, du) or (dout, g, u, dg, du)
    n_prog, n_col_blocks = _launch_grid(ts[0].shape[0], ts[0].shape[1], block)
    _bwd_launch[(n_prog,)](
        *ts, *(t.stride(0) for t in ts), ts[0].shape[1], n_col_blocks, BLOCK=block, num_warps=num_warps
    )


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        g, u = _split(gate, up)
        ctx.save_for_backward(g, u)
        ctx.gate_shape = gate.shape
        ctx.fused = up is None
        return swiglu_fwd(g, u).view(*gate.shape[:-1], g.shape[-1])

    @staticmethod
    def backward(ctx, dout):
        g, u = ctx.saved_tensors
        H = g.shape[-1]
        if ctx.fused:
            dx = torch.empty((g.shape[0], 2 * H), dtype=g.dtype, device=g.device)
            swiglu_bwd(dout, g, u, dx[:, :H], dx[:, H:])
            return dx.view(ctx.gate_shape), None
        dg, du = torch.empty_like(g), torch.empty_like(u)
        swiglu_bwd(dout, g, u, dg, du)
        return dg.view(ctx.gate_shape), du.view(ctx.gate_shape)


# ------------------------------------------------------------------------------ torch.compile: custom ops
# Under torch.compile the public op calls these instead of SwiGLUFunction (Dynamo cannot trace the
# launch): opaque to the compiler, fake functions for shapes, the backward registered.
@torch.library.custom_op("kiln::swiglu_fwd", mutates_args=())
def swiglu_fwd_op(gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """silu(gate) * up, (..., H) contiguous; up None: gate is the fused (..., 2H) [gate | up]."""
    g, u = _split(gate, up)
    return swiglu_fwd(g, u).view(*gate.shape[:-1], g.shape[-1])


@swiglu_fwd_op.register_fake
def _(gate, up):
    g, _ = _split(gate, up)
    return gate.new_empty((*gate.shape[:-1], g.shape[-1]))


@torch.library.custom_op("kiln::swiglu_bwd", mutates_args=())
def swiglu_bwd_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate like gate, dup like up); with the fused form, (d of the fused tensor, an empty tensor)."""
    g, u = _split(gate, up)
    H = g.shape[-1]
    if up is None:
        dx = torch.empty((g.shape[0], 2 * H), dtype=g.dtype, device=g.device)
        swiglu_bwd(dout, g, u, dx[:, :H], dx[:, H:])
        return dx.view(gate.shape), gate.new_empty(0)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    swiglu_bwd(dout, g, u, dg, du)
    return dg.view(gate.shape), du.view(gate.shape)


@swiglu_bwd_op.register_fake
def _(dout, gate, up):
    return gate.new_empty(gate.shape), gate.new_empty(gate.shape if up is not None else 0)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dout):
    gate, up = ctx.saved_tensors
    dg, du = swiglu_bwd_op(dout, gate, up)
    return dg, (du if up is not None else None)


swiglu_fwd_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up; with up=None, gate is the fused (..., 2H) [gate | up] tensor."""
    if not use_triton(gate, up):
        return swiglu_ref(gate, up)
    if torch.compiler.is_compiling():
        return swiglu_fwd_op(gate, up)
    if needs_grad(gate, up):
        return SwiGLUFunction.apply(gate, up)
    g, u = _split(gate, up)
    return swiglu_fwd(g, u).view(*gate.shape[:-1], g.shape[-1])


def swiglu_fp8_ref(gate: torch.Tensor, up: torch.Tensor | None = None) -> Fp8Rows:
    """The two ops swiglu_fp8 fuses: the SwiGLU reference, then quantize_fp8's reference per row."""
    a = swiglu_ref(gate, up)
    return Fp8Rows(*quantize_fp8_ref(a.reshape(-1, a.shape[-1]), per_row=True), a.dtype)


def swiglu_fp8(gate: torch.Tensor, up: torch.Tensor | None = None) -> Fp8Rows:
    """silu(gate) * up with each row quantized to FP8 (its own scale): the activation before an FP8 down
    projection (kiln.kernels.fp8_matmul.fp8_linear takes the Fp8Rows as they come), as (n_rows, H) rows. The
    bits of quantize_fp8(swiglu(gate, up)), without the (n_rows, H) activation in memory or the quantize
    launch. Inference only (no gradient)."""
    if not use_triton(gate, up):
        return swiglu_fp8_ref(gate, up)
    if needs_grad(gate, up):
        raise ValueError("swiglu_fp8 is for inference: its FP8 output has no gradient")
    g, u = _split(gate, up)
    n_rows, H = g.shape
    if H > MAX_ROW:  # past a row in registers: the two kernels
        return Fp8Rows(*quantize_fp8(swiglu_fwd(g, u), per_row=True), g.dtype)
    q = torch.empty((n_rows, H), dtype=FP8, device=g.device)
    scales = torch.empty((n_rows, 1), dtype=torch.float32, device=g.device)
    if n_rows and H:
        block = pow2(H)
        _fp8_launch[(n_rows,)](
            g, u, q, scales, g.stride(0), u.stride(0), H, BLOCK=block, num_warps=row_warps(block),
            PDL=pdl(g), launch_pdl=pdl(g),
        )  # fmt: skip
    return Fp8Rows(q, scales, g.dtype)


# ================================================================================================
# Decode: `swiglu_linear`
#
# The gated MLP's second half for decode-sized batches: y = swiglu(gate_up) @ W^T + bias in one kernel.
#
# Shapes: gate_up (M, 2F) holding [gate | up] along the last dim (the merged gate/up projection's output),
# M <= kiln.kernels.matmul_decode.DECODE_MAX_M rows; weight (N, F) as in nn.Linear (the down projection);
# bias (N,) or None -> (M, N) in gate_up's dtype.
#
# Math: x = silu(gate) * up in float32, rounded to the input dtype (what kiln.kernels.swiglu returns), then
# x @ W^T + bias with float32 accumulation: the reference is those two ops (`swiglu_linear_ref`). The kernel
# is kiln.kernels.matmul_decode's gemv / dot weight stream with the swiglu as its prologue: each program
# forms its tile of x from gate_up as it loads it, so the (M, F) activation never goes through memory and
# the step loses a launch per layer (the separate SwiGLU kernel took 1.3-1.8 us a layer on the H200 at
# batch 1, docs/perf/inference.md). Inference only (no gradient); larger batches take the separate kernels.


def swiglu_linear_ref(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """The two ops the kernel fuses: kiln's swiglu reference, then its matmul reference."""
    return matmul_ref(swiglu_ref(gate_up), weight.t(), bias)


# ------------------------------------------------------------------------------ torch.compile: custom op
# Under torch.compile the public op calls this (Dynamo cannot trace the launch): opaque to the compiler,
# a fake function for the output's shape. Inference only: no gradient.
@torch.library.custom_op("kiln::swiglu_linear", mutates_args=())
def swiglu_linear_op(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return decode_matmul(gate_up, weight.t(), bias, prologue="swiglu")


@swiglu_linear_op.register_fake
def _(gate_up, weight, bias):
    return gate_up.new_empty((gate_up.shape[0], weight.shape[0]))


def swiglu_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """swiglu(gate_up) @ weight.T + bias for gate_up (M, 2F), weight (N, F); see the comment above swiglu_linear_ref."""
    if gate_up.dim() != 2 or weight.dim() != 2 or gate_up.shape[1] != 2 * weight.shape[1]:
        raise ValueError(
            f"swiglu_linear: gate_up must be (M, 2F) and weight (N, F), got {tuple(gate_up.shape)} and "
            f"{tuple(weight.shape)}"
        )
    M, N = gate_up.shape[0], weight.shape[0]
    if gate_up.dtype not in (torch.float16, torch.bfloat16, torch.float32) or weight.dtype != gate_up.dtype:
        raise TypeError(
            f"swiglu_linear: gate_up and weight must share a float dtype, got {gate_up.dtype}, {weight.dtype}"
        )
    if bias is not None and (bias.shape != (N,) or bias.dtype != gate_up.dtype):
        raise ValueError(
            f"swiglu_linear: bias must be ({N},) {gate_up.dtype}, got {tuple(bias.shape)} {bias.dtype}"
        )
    for t in (weight, bias):
        if t is not None and t.device != gate_up.device:
            raise ValueError(
                f"swiglu_linear: all tensors must be on one device, got {gate_up.device} and {t.device}"
            )
    if not use_triton(gate_up, weight, bias):
        return swiglu_linear_ref(gate_up, weight, bias)
    if not 0 < M <= DECODE_MAX_M or N == 0:
        raise ValueError(
            f"swiglu_linear: the fused kernel takes 1 to {DECODE_MAX_M} rows and a non-empty weight, got "
            f"{M} rows and {tuple(weight.shape)}: use swiglu then linear for larger batches"
        )
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    if torch.compiler.is_compiling():
        return swiglu_linear_op(gate_up, weight, bias)
    return decode_matmul(gate_up, weight.t(), bias, prologue="swiglu")
