"""FP8 training linear: y = x W^T with all three GEMMs of a linear layer (forward, dX, dW) in FP8.

Math (current scaling: every scale comes from the tensor it scales, in this step):
    forward   y  (M, N) = q(x) (M, K)  @ q(W)^T (K, N)        x, W in e4m3
    dX        dx (M, K) = q(dy) (M, N) @ q(W) (N, K)           dy in e5m2 (tensorwise) or e4m3 (rowwise)
    dW        dW (N, K) = q(dy)^T (N, M) @ q(x) (M, K)
q(t) = fp8(t * (1 / s)) with s = amax / fp8_max (448 for e4m3, 57344 for e5m2), and the value stood for is
q(t) * s. Two granularities:
- "tensorwise": one s per tensor; each tensor is quantized once, into both layouts the two GEMMs that
  read it want (`cast_both`, kiln.kernels.fp8_cast: by a kernel that writes q and its transpose, or as
  a transposed view the GEMM op copies). Gradients in e5m2 (wider range, 2 mantissa bits), as
  TorchTitan/torchao's tensorwise recipe.
- "rowwise": one s per row of the reduction, i.e. every GEMM operand is scaled along the dimension the
  GEMM sums over (x per token for the forward, per channel of K for dW; dy per token for dX, per output
  channel for dW; W per output row for the forward, per input column for dX), so a tensor is quantized
  once per GEMM that reads it. Everything in e4m3: torch._scaled_mm's row-wise path takes e4m3 operands
  (torchao's row-wise recipe does the same).
The weight handed in is the master weight (fp32 or bf16); it is quantized on the fly each step, so the
optimizer never sees FP8. Outputs and gradients leave in the dtype of the call (autocast's, else x's).
Delayed scaling (an amax history) is not implemented.

Two paths, the same scales and the same quantized values:
- CUDA sm_89+ with every dimension a multiple of 16 (cuBLASLt's rule): the `fp8_scaled_mm` op, which is
  torch._scaled_mm (FP8 tensor cores, float32 accumulation; fast accumulation in the forward only, as
  torchao: the gradients' long reductions over tokens keep the exact accumulator) behind a custom op, so
  that torch.compile cannot swap in its own scaled-mm lowering (see the op). Every operand is quantized
  into the layout its GEMM reads (kiln.kernels.fp8_cast's kernels write the transposed layouts), except in
  the "copy" form (KILN_FP8_CAST=copy): there each tensor is quantized in the layout it has, a GEMM that
  reads it transposed passes a view, and the op lays a and b out for cuBLAS with ATen's copy.
- anywhere else (the CPU, odd shapes): emulated, quantize -> dequantize -> matmul in float32, then the
  same rounding to the output dtype. The CPU tests run both: the op on torch's CPU _scaled_mm kernel
  (forced), the emulation as is, each against float64, eager and compiled; the GPU tests and
  bench/fp8_check.py run the op on the H200.
Under torch.compile the Function is `allow_in_graph`: Dynamo puts the call in its graph as it is, and
AOTAutograd traces its forward and backward (as for torchao's float8 Functions), instead of Dynamo
speculating both itself, the machinery behind known silent gradient bugs (requires_grad lost on a traced
Function's outputs: pytorch#129963, #160901). Inductor still fuses the amax, the scaling and the cast to
FP8 into the neighbouring kernels; the GEMMs stay the op's calls.
The curve measured on the H200 at c598f16 (compiled, _scaled_mm inlined) did not train (docs/perf/training.md).
"""

from __future__ import annotations

import torch

from kiln.kernels.fp8_cast import E4M3, E5M2, FP8_MAX, cast_form, fp8_cast, fp8_cast_dual, scaled_cast

MIN_AMAX = 1e-12  # an all-zero tensor or row gets a tiny scale (its q is 0 either way), never 0 / 0
RECIPES = ("tensorwise", "rowwise")


def _scale(tf: torch.Tensor, dtype: torch.dtype, dim: int | None) -> torch.Tensor:
    """The float32 scale(s) of tf for `dtype`: amax / fp8_max over all of tf (dim None) or along dim."""
    amax = tf.abs().amax() if dim is None else tf.abs().amax(dim=dim, keepdim=True)
    return amax.clamp_min(MIN_AMAX) / FP8_MAX[dtype]


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """t (R, C) float -> (q (R, C) in `dtype`, float32 scale s) with t ~= q * s.

    dim None: one scale, shape (); dim 1: one per row, (R, 1); dim 0: one per column, (1, C) (the dim
    reduced over for the amax, kept as size 1 so the scale broadcasts against t). q keeps t's layout:
    every tensor is quantized where it lies, and a GEMM that reads it transposed takes a view."""
    tf = t.float()
    s = _scale(tf, dtype, dim)
    return scaled_cast(tf, s, dtype), s  # times 1 / s, the cast kernels' math


def cast_both(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (R, C), qt (C, R), s ()): t quantized tensorwise into both layouts, the values of
    quantize(t, dtype, None). qt is contiguous from the cast kernel, or a transposed view of q in the
    "copy" form (kiln.kernels.fp8_cast; the GEMM op then lays it out)."""
    form = cast_form()
    if form == "copy":
        q, s = quantize(t, dtype, None)
        return q, q.t(), s
    s = _scale(t.float(), dtype, None)
    q, qt = fp8_cast_dual(t, s, dtype == E5M2, form)
    return q, qt, s


def quantize_rows(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q (R, C) contiguous, s (R, 1)): t (R, C), of any strides, quantized per row, the values of
    quantize(t, dtype, 1). On t.t() it writes the transposed layout scaled along t's columns."""
    s = _scale(t.float(), dtype, 1)
    return fp8_cast(t, s, dtype == E5M2), s


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


def _mm_dtype(out_dtype: torch.dtype) -> torch.dtype:
    # the row-wise kernel writes bf16 only; a float32 caller gets bf16 rounded then widened (both paths)
    return torch.bfloat16 if out_dtype == torch.float32 else out_dtype


# The FP8 GEMM on torch._scaled_mm as an op opaque to torch.compile. Inlined, inductor lowers _scaled_mm
# itself: it may autotune its own Triton scaled-mm templates against cuBLAS (even without max-autotune)
# and it writes the transposed FP8 copies the GEMMs need from its generated Triton kernels, neither of
# which the eager path (nor any CPU test) exercises. Behind this op the compiled step runs exactly the
# eager GEMMs: inductor still fuses each amax, scale and cast into the neighbouring kernels, and the
# operands reach cuBLAS in the layouts laid out here by ATen's copy.
@torch.library.custom_op("kiln::fp8_scaled_mm", mutates_args=())
def fp8_scaled_mm(
    a: torch.Tensor, s_a: torch.Tensor, b: torch.Tensor, s_b: torch.Tensor, out_dtype: torch.dtype, fast: bool
) -> torch.Tensor:
    """(a * s_a) (M, K) @ (b * s_b) (K, N) -> (M, N) in out_dtype on torch._scaled_mm. a, b FP8 in any
    layout (views welcome: a is made row-major and b column-major here, no copy where they already are);
    s_a () or (M, 1), s_b () or (1, N) float32 dequantization scales (q * s is the value)."""
    a = a.contiguous()
    b = b.t().contiguous().t()  # column-major (K, N): stride (1, K)
    # row scales with unit strides in both dims (a transposed (N, 1) view counts as contiguous but keeps
    # stride N on its size-1 dim, which _scaled_mm refuses); no copy
    s_a, s_b = s_a.reshape(-1).view(s_a.shape), s_b.reshape(-1).view(s_b.shape)
    y = torch._scaled_mm(a, b, scale_a=s_a, scale_b=s_b, out_dtype=_mm_dtype(out_dtype), use_fast_accum=fast)
    return y.to(out_dtype)


@fp8_scaled_mm.register_fake
def _(a, s_a, b, s_b, out_dtype, fast):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _mm(a_q, s_a, b_q, s_b, out_dtype: torch.dtype, fast: bool, gpu: bool) -> torch.Tensor:
    """(a_q * s_a) (M, K) @ (b_q * s_b) (K, N) -> (M, N) in out_dtype, operands in any layout. gpu: the
    fp8_scaled_mm op (torch._scaled_mm); else the float32 emulation, rounded through bf16 as _scaled_mm's
    output is."""
    if gpu:
        return fp8_scaled_mm(a_q, s_a, b_q, s_b, out_dtype, fast)
    with torch.autocast(a_q.device.type, enabled=False):  # the emulation's matmul stays float32
        y = (a_q.float() * s_a) @ (b_q.float() * s_b)
    return y.to(_mm_dtype(out_dtype)).to(out_dtype)


@torch.compiler.allow_in_graph
class FP8Linear(torch.autograd.Function):
    """x (M, K), weight (N, K) -> x W^T (M, N) in out_dtype; see the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, recipe: str, out_dtype: torch.dtype):
        gpu = use_scaled_mm(x, weight)
        if recipe == "rowwise":
            xq, xs = quantize(x, E4M3, 1)  # (M, K), (M, 1)
            wq, ws = quantize(weight, E4M3, 1)  # (N, K), (N, 1)
            # b = W^T (K, N): a transposed view; its scales, one per output channel, as a row (1, N)
            y = _mm(xq, xs, wq.t(), ws.view(1, -1), out_dtype, fast=True, gpu=gpu)
            ctx.save_for_backward(x, weight)  # the backward GEMMs reduce over other dims: re-quantized there
        else:
            # x (M, K) for this GEMM and x^T (K, M) for dW; W (N, K), read here as the column-major W^T,
            # and W^T (K, N), read by dX as the column-major W
            xq, xq_t, xs = cast_both(x, E4M3)
            wq, wq_t, ws = cast_both(weight, E4M3)
            y = _mm(xq, xs, wq.t(), ws, out_dtype, fast=True, gpu=gpu)
            ctx.save_for_backward(xq_t, xs, wq_t, ws)  # FP8: half the bytes of x and W kept for backward
        ctx.recipe, ctx.gpu, ctx.x_dtype, ctx.w_dtype = recipe, gpu, x.dtype, weight.dtype
        ctx.out_dtype = out_dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        gpu, dt = ctx.gpu, ctx.out_dtype
        if ctx.recipe == "rowwise":
            x, weight = ctx.saved_tensors
            # dX (M, K) = dy (M, N) @ W (N, K) reduces over N: dy per token (M, 1), W per input column (1, K).
            # dW (N, K) = dy^T (N, M) @ x (M, K) reduces over M: dy per output channel, x per input column.
            dyq, dys = quantize(dy, E4M3, 1)
            # "copy": each quantized where it lies, and the op copies b (and dW's a) into its layout
            if cast_form() == "copy":
                wq, ws = quantize(weight, E4M3, 0)
                dx = _mm(dyq, dys, wq, ws, dt, fast=False, gpu=gpu)
                dyq_c, dys_c = quantize(dy, E4M3, 0)  # per column of dy (1, N), read transposed as (N, 1)
                xq, xs = quantize(x, E4M3, 0)
                dw = _mm(dyq_c.t(), dys_c.view(-1, 1), xq, xs, dt, fast=False, gpu=gpu)
            else:  # each cast from the transposed view, per row of it, into the layout its GEMM reads
                wq_t, ws_t = quantize_rows(weight.t(), E4M3)  # (K, N), (K, 1): read as the column-major W
                dx = _mm(dyq, dys, wq_t.t(), ws_t.view(1, -1), dt, fast=False, gpu=gpu)
                dyq_t, dys_t = quantize_rows(dy.t(), E4M3)  # (N, M), (N, 1)
                xq_t, xs_t = quantize_rows(x.t(), E4M3)  # (K, M), (K, 1): read as the column-major x
                dw = _mm(dyq_t, dys_t, xq_t.t(), xs_t.view(1, -1), dt, fast=False, gpu=gpu)
        else:
            xq_t, xs, wq_t, ws = ctx.saved_tensors  # (K, M), (K, N)
            dyq, dyq_t, dys = cast_both(dy, E5M2)  # (M, N), (N, M), one scale
            dx = _mm(dyq, dys, wq_t.t(), ws, dt, fast=False, gpu=gpu)  # (M, N) @ (N, K)
            dw = _mm(dyq_t, dys, xq_t.t(), xs, dt, fast=False, gpu=gpu)  # (N, M) @ (M, K)
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
