"""Cross-entropy over a vocabulary: one Triton kernel for the loss, its gradient, or both at once.

cross_entropy(logits (N, V), targets (N,)): per-token loss
    loss_i = lse(z_i) - (1 - eps) * z_i[t_i] - eps * mean_j(z_ij)      (label smoothing eps; eps = 0 is plain CE)
    dloss_i/dz_ij = softmax(z_i)_j - eps / V - (1 - eps) * [j == t_i]
tokens whose target == ignore_index contribute nothing (loss 0, gradient 0) and are not counted in the mean.
reduction: "mean" (over non-ignored tokens), "sum", or "none" (per token, float32).

The Triton path: one program per row streams the vocabulary in blocks, keeping an online logsumexp
(running max and rescaled sum), so a 151936-wide row never has to fit on chip. The forward reads the
logits once and saves only lse (N floats); the backward reads them once more and writes the gradient.
The fused linear + cross-entropy (kiln.kernels.linear_cross_entropy, which imports this module) runs the same
kernel on chunks of logits, writing the gradient in place of them, or a one-pass variant that writes
U = exp(z - m) against a per-row reference m and a row factor c with scale * dloss/dz = c * U (one read
and one write of the logits instead of two reads and a write; see _one_pass_kernel).

Not done: targets outside [0, V) other than ignore_index are not checked on the GPU (that would need a
host sync); they read an arbitrary logit. Logits may have any strides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels.dispatch import interpreting, use_triton
from kiln.kernels.launch import pow2

REDUCTIONS = ("mean", "sum", "none")


def cross_entropy_ref(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    return F.cross_entropy(
        logits.float(),
        targets,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    )


@triton.jit
def _cross_entropy_kernel(
    Z_ptr,  # logits (N, V), any dtype; element (i, j) at Z_ptr + i * z_row_stride + j * z_col_stride
    z_row_stride,
    z_col_stride,
    T_ptr,  # targets (N,) int, contiguous
    Loss_ptr,  # (N,) float32, written when FORWARD
    Lse_ptr,  # (N,) float32 logsumexp: written when FORWARD, read when not
    G_ptr,  # gradient (N, V), may be Z_ptr itself (in place); written when WRITE_GRAD
    g_row_stride,
    g_col_stride,
    S_ptr,  # float32 gradient scale per row at S_ptr + i * s_stride (s_stride 0: one scalar for all)
    s_stride,
    Stats_ptr,  # (3, N, n_parts) float32 per-block row max / sum exp / sum from the GEMM that made Z
    n_parts,
    stats_plane,  # N * n_parts
    N,  # rows
    V,  # vocabulary size
    ignore_index,
    eps,  # label smoothing
    FORWARD: tl.constexpr,  # compute loss and lse (else read lse)
    FROM_STATS: tl.constexpr,  # the forward combines Stats instead of a pass over the row
    PARTS: tl.constexpr,  # power of two >= n_parts
    WRITE_GRAD: tl.constexpr,  # write scale * dloss/dz
    SMOOTH: tl.constexpr,  # eps > 0: also needs sum_j z_j
    BLOCK: tl.constexpr,  # vocabulary columns per step
):
    # Programs stride over the rows: grid N gives one row each; a smaller grid keeps fewer rows in
    # flight, so a row read by the first pass may still be in L2 for the gradient pass.
    for r in range(tl.program_id(0), N, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)  # int64: row * stride overflows int32 at 8192 x 151936
        z_row = Z_ptr + row * z_row_stride
        t = tl.load(T_ptr + row).to(tl.int64)
        valid = t != ignore_index
        cols = tl.arange(0, BLOCK)
        if FORWARD:
            if FROM_STATS:
                p = tl.arange(0, PARTS)
                at = Stats_ptr + row * n_parts + p
                p_max = tl.load(at, mask=p < n_parts, other=-3.0e38)
                p_sum = tl.load(at + stats_plane, mask=p < n_parts, other=0.0)
                m = tl.max(p_max, axis=0)
                s = tl.sum(p_sum * tl.exp(p_max - m), axis=0)
                if SMOOTH:
                    z_sum = tl.sum(tl.load(at + 2 * stats_plane, mask=p < n_parts, other=0.0), axis=0)
            else:
                # Online logsumexp with one scalar max per block: one exp per element (the SFU is the
                # bottleneck next to HBM on the H200 if every lane keeps its own running max).
                m = -3.0e38  # finite, so a block of only -inf (masked vocabulary) gives exp(0), not nan
                s = 0.0
                z_sum = 0.0
                for start in range(0, V, BLOCK):
                    c = start + cols
                    mask = c < V
                    z = tl.load(z_row + c * z_col_stride, mask=mask, other=-float("inf")).to(tl.float32)
                    m_new = tl.maximum(m, tl.max(z, axis=0))
                    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
                    m = m_new
                    if SMOOTH:
                        z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
            lse = m + tl.log(s)
            z_t = tl.load(z_row + t * z_col_stride, mask=valid, other=0.0).to(tl.float32)
            loss = lse - (1.0 - eps) * z_t
            if SMOOTH:
                loss -= eps * z_sum / V
            tl.store(Loss_ptr + row, tl.where(valid, loss, 0.0))
            tl.store(Lse_ptr + row, lse)
        else:
            lse = tl.load(Lse_ptr + row)
        if WRITE_GRAD:
            scale = tl.where(valid, tl.load(S_ptr + row * s_stride), 0.0)
            g_row = G_ptr + row * g_row_stride
            for start in range(0, V, BLOCK):
                c = start + cols
                mask = c < V
                z = tl.load(z_row + c * z_col_stride, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(z - lse) - eps / V
                g = tl.where(c == t, g - (1.0 - eps), g)
                tl.store(g_row + c * g_col_stride, (g * scale).to(G_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, targets: torch.Tensor, label_smoothing: float, reduction: str, what: str) -> None:
    """Checks shared by both ops; `x` is the logits (N, V) or the hidden states (N, H)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if x.dim() != 2 or targets.dim() != 1 or targets.shape[0] != x.shape[0]:
        raise ValueError(
            f"expected {what} and targets (N,), got {tuple(x.shape)} and {tuple(targets.shape)}: "
            "flatten the leading dimensions first"
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{what} must be float32, float16 or bfloat16, got {x.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 or int32 class indices, got {targets.dtype}")
    if targets.device != x.device:
        raise ValueError(f"targets are on {targets.device} but {what} on {x.device}")


def _launch_config(V: int, block: int | None = None, warps: int | None = None) -> tuple[int, int]:
    """(BLOCK, num_warps): 4096-wide steps over big vocabularies, one step for small ones; the fused
    linear CE may ask for other widths (wider steps keep more bytes in flight per program)."""
    block = min(pow2(V), 64 if interpreting() else block or 4096)
    return block, warps or (max(8, min(32, block // 512)) if block >= 2048 else 4)


def cross_entropy_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    grad: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launcher: per-row loss (N,) and lse (N,), float32. With `grad` (may be `logits` itself,
    for in-place) and `scale` (a 0-d or (N,) float32 tensor), also writes scale * dloss/dlogits."""
    N, V = logits.shape
    targets = targets.contiguous()
    loss = torch.empty(N, device=logits.device, dtype=torch.float32)
    lse = torch.empty(N, device=logits.device, dtype=torch.float32)
    _launch(logits, targets, loss, lse, grad, scale, ignore_index, label_smoothing, forward=True)
    return loss, lse


def cross_entropy_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Backward launcher: scale * dloss/dlogits from the saved lse, into `out` (default a new tensor)."""
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) if out is None else out
    _launch(logits, targets.contiguous(), lse, lse, grad, scale, ignore_index, label_smoothing, forward=False)
    return grad


def _launch(logits, targets, loss, lse, grad, scale, ignore_index, eps, forward: bool, programs=None,
            stats=None, block=None, warps=None) -> None:  # fmt: skip
    N, V = logits.shape
    if N == 0:
        return
    parts = 1 if stats is None else stats.shape[2]
    block, warps = _launch_config(V, block, warps)
    write = grad is not None
    g = grad if write else logits
    s = scale.float().reshape(-1) if write else lse
    _cross_entropy_kernel[(N if programs is None else max(1, min(N, programs)),)](
        logits, logits.stride(0), logits.stride(1), targets, loss, lse,
        g, g.stride(0), g.stride(1), s, 0 if s.numel() == 1 else s.stride(0),
        lse if stats is None else stats, parts, N * parts, N, V, ignore_index, float(eps),
        FORWARD=forward, FROM_STATS=stats is not None, PARTS=pow2(parts),
        WRITE_GRAD=write, SMOOTH=eps > 0, BLOCK=block, num_warps=warps,
    )  # fmt: skip


@triton.jit
def _one_pass_kernel(
    Z_ptr,  # (N, V) logits, unit column stride; overwritten with U (same dtype)
    z_row_stride,
    T_ptr,  # targets (N,) int, contiguous
    Loss_ptr,  # (N,) float32 out
    Lse_ptr,  # (N,) float32 out
    C_ptr,  # (N,) float32 out: the row factor c, so that scale * dloss/dz_j = c * U_j (- scale * eps / V)
    S_ptr,  # float32 gradient scale per row at S_ptr + i * s_stride (s_stride 0: one scalar for all)
    s_stride,
    N,
    V,
    ignore_index,
    eps,  # label smoothing
    margin,  # largest z - m written before the reference moves up (U <= exp(margin))
    SMOOTH: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One read and one write of the row, instead of a read for the logsumexp and a read + write for the
    # gradient: U_j = exp(z_j - m) needs only a reference m near the row's max, not lse. c = scale *
    # exp(m - lse) is known at the end and applied outside (to the GEMMs' small operand or result), and
    # U at the target is rewritten last as (p_t - (1 - eps)) * exp(lse - m), formed in float32 (no
    # cancellation in bf16). m starts at the larger of the first block's max and the target's logit; a
    # block more than `margin` above it (rare) moves m up and rescales the blocks already written.
    for r in range(tl.program_id(0), N, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        z_row = Z_ptr + row * z_row_stride
        t = tl.load(T_ptr + row).to(tl.int64)
        valid = t != ignore_index
        cols = tl.arange(0, BLOCK)
        z_t = tl.load(z_row + t, mask=valid, other=0.0).to(tl.float32)
        first = tl.load(z_row + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m = tl.maximum(tl.max(first, axis=0), tl.where(valid, z_t, -3.0e38))
        m = tl.maximum(m, -3.0e38)  # finite even if the first block is all -inf
        s = 0.0
        z_sum = 0.0
        for start in range(0, V, BLOCK):
            c = start + cols
            mask = c < V
            z = tl.load(z_row + c, mask=mask, other=-float("inf")).to(tl.float32)
            top = tl.max(z, axis=0)
            if top > m + margin:  # rare: move the reference up, rescale what is written so far
                shrink = tl.exp(m - top)
                tl.debug_barrier()  # the earlier blocks' stores (other threads) before reading them back
                for back in range(0, start, BLOCK):
                    b = back + cols
                    u_old = tl.load(z_row + b, mask=b < V, other=0.0).to(tl.float32)
                    tl.store(z_row + b, (u_old * shrink).to(Z_ptr.dtype.element_ty), mask=b < V)
                s = s * shrink
                m = top
            u = tl.exp(z - m)
            s += tl.sum(u, axis=0)
            if SMOOTH:
                z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
            tl.store(z_row + c, tl.where(valid, u, 0.0).to(Z_ptr.dtype.element_ty), mask=mask)
        lse = m + tl.log(s)
        loss = lse - (1.0 - eps) * z_t
        if SMOOTH:
            loss -= eps * z_sum / V
        scale = tl.load(S_ptr + row * s_stride)
        u_t = tl.exp(z_t - m) - (1.0 - eps) * tl.exp(lse - m)
        tl.debug_barrier()  # U[t] was stored by the block loop; this store must land after it
        tl.store(z_row + t, u_t.to(Z_ptr.dtype.element_ty), mask=valid)
        tl.store(Loss_ptr + row, tl.where(valid, loss, 0.0))
        tl.store(Lse_ptr + row, lse)
        tl.store(C_ptr + row, tl.where(valid, scale * tl.exp(m - lse), 0.0))


# U = exp(z - m) <= exp(20) = 4.9e8, and c = scale * exp(m - lse) >= scale * exp(-20) / V: both far inside
# the range of bf16 and float32, so neither U nor c * hidden lose precision to overflow or subnormals.
ONE_PASS_MARGIN = 20.0


def cross_entropy_one_pass(z, targets, loss, lse, cfac, scale, ignore_index, eps, programs=None, block=None,
                           warps=None) -> None:  # fmt: skip
    """Launcher of the one-pass kernel: loss, lse and the row factor cfac (each (N,) float32) of the
    logits z (N, V), which it overwrites with U; `scale` a 0-d or (N,) float32 tensor."""
    N, V = z.shape
    if N == 0:
        return
    if z.stride(1) != 1:
        raise ValueError("the one-pass loss kernel needs logits with unit column stride")
    block, warps = _launch_config(V, block, warps)
    programs = N if programs is None else max(1, min(N, programs))
    _one_pass_kernel[(programs,)](
        z, z.stride(0), targets, loss, lse, cfac, scale, 0 if scale.numel() == 1 else scale.stride(0),
        N, V, ignore_index, float(eps), ONE_PASS_MARGIN, SMOOTH=eps > 0, BLOCK=block, num_warps=warps,
    )  # fmt: skip


def _reduce(loss: torch.Tensor, n_valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    total = loss.sum()
    return total / n_valid if reduction == "mean" else total


def _row_scale(grad_out: torch.Tensor, n_valid: torch.Tensor, reduction: str) -> torch.Tensor:
    """The factor each row's dloss/dz is multiplied by: 0-d for mean/sum, (N,) for none."""
    g = grad_out.float()
    return g / n_valid if reduction == "mean" else g


class CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, label_smoothing, reduction):
        loss, lse = cross_entropy_rows(logits, targets, ignore_index, label_smoothing)
        n_valid = (targets != ignore_index).sum()
        ctx.save_for_backward(logits, targets, lse, n_valid)
        ctx.args = (ignore_index, label_smoothing, reduction)
        return _reduce(loss, n_valid, reduction)

    @staticmethod
    def backward(ctx, grad_out):
        logits, targets, lse, n_valid = ctx.saved_tensors
        ignore_index, label_smoothing, reduction = ctx.args
        scale = _row_scale(grad_out, n_valid, reduction)
        # A new tensor, not in place: the caller may still hold the logits (the model returns them).
        grad = cross_entropy_grad(logits, targets, lse, scale, ignore_index, label_smoothing)
        return grad, None, None, None, None


# ------------------------------------------------------------------------------ torch.compile: custom ops
# Under torch.compile the public op calls these instead of CrossEntropy (Dynamo cannot trace the launch):
# opaque to the compiler, fake functions for shapes, the backward registered (docs/perf/compile.md).
@torch.library.custom_op("kiln::cross_entropy_fwd", mutates_args=())
def cross_entropy_fwd_op(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row loss (N,) float32, lse (N,) float32)."""
    return cross_entropy_rows(logits, targets, ignore_index, label_smoothing)


@cross_entropy_fwd_op.register_fake
def _(logits, targets, ignore_index, label_smoothing):
    _check(logits, targets, label_smoothing, "none", "logits (N, V)")
    return tuple(logits.new_empty(logits.shape[0], dtype=torch.float32) for _ in range(2))


@torch.library.custom_op("kiln::cross_entropy_bwd", mutates_args=())
def cross_entropy_bwd_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    scale: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """scale * dloss/dlogits, a new contiguous (N, V) tensor; scale 0-d or (N,) float32."""
    return cross_entropy_grad(logits, targets, lse, scale, ignore_index, label_smoothing)


@cross_entropy_bwd_op.register_fake
def _(logits, targets, lse, scale, ignore_index, label_smoothing):
    return logits.new_empty(logits.shape)


def _cross_entropy_setup(ctx, inputs, output):
    logits, targets, ignore_index, label_smoothing = inputs
    ctx.save_for_backward(logits, targets, output[1])
    ctx.args = (ignore_index, label_smoothing)


def _cross_entropy_backward(ctx, dloss, _dlse):
    logits, targets, lse = ctx.saved_tensors
    return cross_entropy_bwd_op(logits, targets, lse, dloss.float(), *ctx.args), None, None, None


cross_entropy_fwd_op.register_autograd(_cross_entropy_backward, setup_context=_cross_entropy_setup)


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    if not use_triton(logits, targets):
        return cross_entropy_ref(logits, targets, ignore_index, label_smoothing, reduction)
    _check(logits, targets, label_smoothing, reduction, "logits (N, V)")
    if torch.compiler.is_compiling():
        # the per-row losses from the op, reduced here (traced): the backward gets each row's gradient
        loss, _ = cross_entropy_fwd_op(logits, targets, ignore_index, float(label_smoothing))
        return _reduce(loss, (targets != ignore_index).sum(), reduction)
    return CrossEntropy.apply(logits, targets, ignore_index, float(label_smoothing), reduction)
