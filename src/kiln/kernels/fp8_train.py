"""FP8 training linear: y = x W^T with all three GEMMs of a linear layer (forward, dX, dW) in FP8.

Math (current scaling: every scale comes from the tensor it scales, in this step):
    forward   y  (M, N) = q(x) (M, K)  @ q(W)^T (K, N)        x, W in e4m3
    dX        dx (M, K) = q(dy) (M, N) @ q(W) (N, K)           dy in e5m2 (tensorwise) or e4m3 (rowwise)
    dW        dW (N, K) = q(dy)^T (N, M) @ q(x) (M, K)
q(t) = fp8(t / s) with s = amax / fp8_max (448 for e4m3, 57344 for e5m2), and the value stood for is
q(t) * s. Two granularities:
- "tensorwise": one s per tensor; each tensor is quantized once and its FP8 copy reused (transposed)
  by the GEMMs that read it. Gradients in e5m2 (wider range, 2 mantissa bits), as TorchTitan/torchao's
  tensorwise recipe.
- "rowwise": one s per row of the reduction, i.e. every GEMM operand is scaled along the dimension the
  GEMM sums over (x per token for the forward, per channel of K for dW; dy per token for dX, per output
  channel for dW; W per output row for the forward, per input column for dX), so a tensor is quantized
  once per GEMM that reads it. Everything in e4m3: torch._scaled_mm's row-wise path takes e4m3 operands
  (torchao's row-wise recipe does the same).
The weight handed in is the master weight (fp32 or bf16); it is quantized on the fly each step, so the
optimizer never sees FP8. Outputs and gradients leave in the dtype of the call (autocast's, else x's).
Delayed scaling (an amax history) is not implemented.

Two paths, the same scales and the same quantized values:
- CUDA sm_89+ with every dimension a multiple of 16 (cuBLASLt's rule): torch._scaled_mm, FP8 tensor cores,
  float32 accumulation (fast accumulation in the forward only, as torchao: the gradients' long reductions
  over tokens keep the exact accumulator).
- anywhere else (the CPU, odd shapes): emulated, quantize -> dequantize -> matmul in float32, then the
  same rounding to the output dtype. The CPU tests check the autograd plumbing there; the GPU test checks
  the _scaled_mm path against it.
Under torch.compile the Function is traced: inductor fuses the amax, the scaling and the cast to FP8 into
the neighbouring kernels (no custom op needed: everything inside is ATen).
"""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
MIN_AMAX = 1e-12  # an all-zero tensor or row gets a tiny scale (its q is 0 either way), never 0 / 0
RECIPES = ("tensorwise", "rowwise")


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) float -> (q (R, C) in `dtype`, float32 scale s) with t ~= q * s.

    dim None: one scale, shape (); dim 1: one per row, (R, 1); dim 0: one per column, (1, C) (the dim
    reduced over for the amax, kept as size 1 so the scale broadcasts against t)."""
    tf = t.float()
    amax = tf.abs().amax() if dim is None else tf.abs().amax(dim=dim, keepdim=True)
    s = amax.clamp_min(MIN_AMAX) / FP8_MAX[dtype]
    fmax = FP8_MAX[dtype]
    return (tf / s).clamp(-fmax, fmax).to(dtype), s


@torch.compiler.assume_constant_result
def _scaled_mm_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def use_scaled_mm(*tensors: torch.Tensor) -> bool:
    """Whether the GEMMs run on torch._scaled_mm: CUDA tensors on an sm_89+ GPU, every dim % 16 == 0."""
    if not all(t.is_cuda for t in tensors):
        return False
    if any(d % 16 for t in tensors for d in t.shape):
        return False
    return _scaled_mm_ok(tensors[0].device.index or 0)


def _mm(a_q, s_a, b_q, s_b, out_dtype: torch.dtype, fast: bool, gpu: bool) -> torch.Tensor:
    """(a_q * s_a) (M, K) @ (b_q * s_b) (K, N) -> (M, N) in out_dtype. a_q row-major; s_a () or (M, 1),
    s_b () or (1, N). gpu: torch._scaled_mm (b_q must then be column-major); else float32 emulation."""
    if gpu:
        a_q = a_q.contiguous()  # row-major a (a no-op for the operands built here)
        # the row-wise kernel writes bf16 only; a float32 caller gets bf16 rounded then widened, the same
        # rounding the emulated path applies below
        mm_dtype = torch.bfloat16 if out_dtype == torch.float32 else out_dtype
        y = torch._scaled_mm(a_q, b_q, scale_a=s_a, scale_b=s_b, out_dtype=mm_dtype, use_fast_accum=fast)
        return y.to(out_dtype)
    with torch.autocast(a_q.device.type, enabled=False):  # the emulation's matmul stays float32
        y = (a_q.float() * s_a) @ (b_q.float() * s_b)
    mm_dtype = torch.bfloat16 if out_dtype == torch.float32 else out_dtype
    return y.to(mm_dtype).to(out_dtype)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """The same (R, C) values laid out column-major (stride (1, R)): _scaled_mm's layout for b."""
    return t.t().contiguous().t()


class FP8Linear(torch.autograd.Function):
    """x (M, K), weight (N, K) -> x W^T (M, N) in out_dtype; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, recipe: str, out_dtype: torch.dtype):
        gpu = use_scaled_mm(x, weight)
        rowwise = recipe == "rowwise"
        xq, xs = quantize(x, E4M3, 1 if rowwise else None)  # (M, K), (M, 1) or ()
        wq, ws = quantize(weight, E4M3, 1 if rowwise else None)  # (N, K), (N, 1) or ()
        # b = W^T (K, N): the transposed view of a row-major (N, K) is column-major as _scaled_mm wants
        y = _mm(xq, xs, wq.t(), ws.view(1, -1) if rowwise else ws, out_dtype, fast=True, gpu=gpu)
        if rowwise:  # the backward GEMMs reduce over other dims: they re-quantize the masters
            ctx.save_for_backward(x, weight)
        else:  # tensorwise: the FP8 copies serve again, half the bytes kept for backward
            ctx.save_for_backward(xq, xs, wq, ws)
        ctx.recipe, ctx.gpu, ctx.x_dtype, ctx.w_dtype = recipe, gpu, x.dtype, weight.dtype
        ctx.out_dtype = out_dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        gpu, dt = ctx.gpu, ctx.out_dtype
        if ctx.recipe == "rowwise":
            x, weight = ctx.saved_tensors
            dyq, dys = quantize(dy, E4M3, 1)  # (M, N), per token: dX reduces over N
            wq, ws = quantize(weight, E4M3, 0)  # (N, K), per input column (1, K): dX reduces over N
            dx = _mm(dyq, dys, _col_major(wq) if gpu else wq, ws, dt, fast=False, gpu=gpu)
            dyq_t, dys_t = quantize(dy.t(), E4M3, 1)  # (N, M) per output channel: dW reduces over M
            xq, xs = quantize(x, E4M3, 0)  # (M, K), per column (1, K)
            dyq_t = dyq_t.contiguous()
            dw = _mm(dyq_t, dys_t, _col_major(xq) if gpu else xq, xs, dt, fast=False, gpu=gpu)
        else:
            xq, xs, wq, ws = ctx.saved_tensors
            dyq, dys = quantize(dy, E5M2, None)
            dx = _mm(dyq, dys, _col_major(wq) if gpu else wq, ws, dt, fast=False, gpu=gpu)
            dw = _mm(dyq.t().contiguous(), dys, _col_major(xq) if gpu else xq, xs, dt, fast=False, gpu=gpu)
        return dx.to(ctx.x_dtype), dw.to(ctx.w_dtype), None, None


def fp8_train_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, recipe: str = "tensorwise"
) -> torch.Tensor:
    """nn.Linear's x (..., K) -> (..., N) with the GEMMs in FP8 (module docstring). The output dtype is
    autocast's when autocast is on for x's device, else x's; the bias is added in that dtype."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not one of {', '.join(RECIPES)}")
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_train_linear: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    dev = x.device.type
    out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    lead = x.shape[:-1]
    y = FP8Linear.apply(x.reshape(-1, x.shape[-1]), weight, recipe, out_dtype)
    if bias is not None:
        y = y + bias.to(out_dtype)
    return y.view(*lead, weight.shape[0])
