"""Fused linear + cross-entropy: the training head's loss without ever holding all (N, V) logits.

linear_cross_entropy(hidden (N, H), weight (V, H), targets (N,), bias (V,) or None) is the loss of
cross_entropy.py applied to logits = hidden @ weight.T + bias (same ignore_index, label smoothing and
reductions). With dz = dloss/dlogits its gradients are
    dhidden = dz @ weight,   dweight = dz.T @ hidden,   dbias = dz.sum(0).

The tokens go in chunks of about `Plan.chunk_bytes` of logits. Per chunk c (rows r):
    z = hidden[r] @ weight.T            (c, V)  cuBLAS (or kiln's matmul, which also emits row statistics)
    z <- scale * dloss/dz               in place, by cross_entropy.py's row kernel (loss and lse on the way)
    dhidden[r] = z @ weight             (c, H)
    dweight (+)= z.T @ hidden[r]        (V, H)  accumulated in dweight's dtype, as Liger does
so the extra memory is one chunk of logits beside the gradients themselves. A chunk can be cut into
`Plan.overlap` parts whose loss kernels run on a second CUDA stream while the GEMMs of the next part go
on (the loss kernel is bound by memory, the GEMMs by the tensor cores; no faster on the H200, see PLAN).
For "mean"/"sum" the gradients are formed in the forward (one pass, as Liger does) and scaled by the
incoming gradient in the backward on the device, without a host sync (a no-op kernel when it is 1);
for "none" the backward recomputes the chunks with each token's incoming gradient.

Not done: targets outside [0, V) other than ignore_index are not checked on the GPU (a host sync);
they read an arbitrary logit. hidden and weight may have any strides torch.matmul accepts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import triton
import triton.language as tl

from kiln.kernels._common import needs_grad
from kiln.kernels.cross_entropy import (
    _check,
    _launch,
    _reduce,
    _row_scale,
    cross_entropy_one_pass,
    cross_entropy_ref,
)
from kiln.kernels.dispatch import interpreting, sm_count, use_triton
from kiln.kernels.launch import cdiv
from kiln.kernels.matmul import matmul_fwd, tile_config

GEMMS = ("cublas", "kiln")


def linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy_ref(logits, targets, ignore_index, label_smoothing, reduction)


@dataclasses.dataclass(frozen=True)
class Plan:
    """How the fused op schedules its work (the math is the same for every plan).

    chunk_bytes: logits per token chunk; the chunk rows are a multiple of 128 (GEMM tiles) split evenly,
        so a chunk may pass this by up to 127 rows.
    logits_gemm / dweight_gemm: "cublas" (torch.matmul) or "kiln" (kiln.kernels.matmul, persistent
        128x256 tiles; for the logits it also emits per-tile row max / sum exp, so the loss kernel skips
        its first pass over the row). dhidden's GEMM, (c, V) @ (V, H), has too few output tiles for one
        program per tile and is always cuBLAS's, which splits K.
    row_programs: programs of the loss kernel, striding over rows (None: one per row). Fewer rows in
        flight (132 x 304 KiB at V = 151936) can stay in L2 between the kernel's two passes over a row.
    row_block, row_warps: the loss kernel's vocabulary columns per step and warps (None: its defaults,
        4096 and 8); wider steps keep more bytes in flight per program, which fewer programs need.
    overlap: parts per chunk; > 1 runs each part's loss kernel on a side stream, overlapping the GEMMs
        (measured no faster on the H200; kept to measure elsewhere).
    gemm_priority: run the GEMMs on a high-priority stream, so their blocks go first when both kernels
        wait for multiprocessors (only with overlap > 1).
    one_pass: the loss kernel reads the logits once and writes U = exp(z - m) against a per-row
        reference m instead of dloss/dz (which needs the logsumexp first, so a second read); the GEMMs
        take U and the row factor c = scale * exp(m - lse) is applied to their small operand or result
        (cross_entropy.py's one-pass kernel). bfloat16 and float32 only: float16's range cannot hold U.
    """

    chunk_bytes: int = 480 * 2**20
    logits_gemm: str = "cublas"
    dweight_gemm: str = "cublas"
    row_programs: int | None = None
    row_block: int | None = None
    row_warps: int | None = None
    overlap: int = 1
    gemm_priority: bool = False
    one_pass: bool = True

    def __post_init__(self):
        if self.logits_gemm not in GEMMS or self.dweight_gemm not in GEMMS:
            raise ValueError(f"logits_gemm and dweight_gemm must be in {GEMMS}")
        knobs = (self.chunk_bytes, self.overlap, self.row_programs, self.row_block, self.row_warps)
        if any(v is not None and v < 1 for v in knobs):
            raise ValueError(f"chunk_bytes, overlap and the row kernel's settings must be positive: {self}")
        if self.one_pass and self.logits_gemm != "cublas":
            raise ValueError(
                "logits_gemm='kiln' (row statistics for the two-pass kernel) needs one_pass=False"
            )
        if self.row_block is not None and self.row_block & (self.row_block - 1):
            raise ValueError(f"row_block must be a power of two, got {self.row_block}")


# 8192 x 151936 bf16 logits (2.3 GiB) go in 5 chunks of 1664 or 1536 tokens (at most 482 MiB of logits):
# the peak stays under 1 GiB beside dweight (445 MiB) and dhidden. Final H200 run (bench/kernels_gemm_ce.py,
# 6 rounds in shuffled order, median ms, forward + backward): one-pass 5 chunks 17.86 (0.93 GiB), one-pass
# 6 chunks 18.15 (0.86), two-pass 5 chunks 18.10, two-pass 6 chunks 18.58; torch.compile 18.04 (2.78 GiB).
# Round 1 (bench/sweep_linear_ce.py): 7 or 8 chunks, kiln's GEMMs for dweight or the logits, and the loss
# kernels overlapped with the GEMMs on a second stream were all slower; the GEMMs run near the 700 W cap
# (1.5 GHz of 1.98 under load), so concurrent work only moves around. Details in docs/kernels/linear_ce.md.
PLAN = Plan()


def _gemm_config() -> triton.Config:
    """The fixed (not autotuned) tile config of kiln's fused GEMMs: autotuning would run the accumulating
    GEMM several times over dweight, and the row statistics' layout depends on BLOCK_N."""
    if interpreting():
        return tile_config(32, 32, 32, 1, 4, 4, persistent=True)
    return tile_config(128, 256, 64, 3, 8, persistent=True)


def split_rows(start: int, end: int, parts: int, unit: int = 128) -> list[tuple[int, int]]:
    """[start, end) in at most `parts` ranges of whole `unit`s of rows (GEMM tiles), sizes within one
    unit of each other; unit 1 when the rows are too few for one unit per part."""
    n = end - start
    if n <= 0:
        return []
    unit = unit if n >= unit * parts else 1
    units = -(-n // unit)
    parts = min(parts, units)
    bounds = []
    for i in range(parts):
        stop = min(end, start + (units // parts + (i < units % parts)) * unit)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunk_bounds(N: int, V: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Token chunks: the fewest that keep one chunk's (rows, V) logits near chunk_bytes."""
    return split_rows(0, N, max(1, -(-N * V * itemsize // chunk_bytes)))


@functools.cache
def _stream(device_index: int, priority: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device_index, priority=priority)


def _on(stream: torch.cuda.Stream | None):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _mark(stream: torch.cuda.Stream | None) -> torch.cuda.Event | None:
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
    if stream is not None and event is not None:
        stream.wait_event(event)


def _handoff(src: torch.cuda.Stream | None, dst: torch.cuda.Stream | None) -> None:
    """Make `dst` wait for what `src` has queued so far (nothing to do on one stream)."""
    if src is not None and dst is not None and src != dst:
        dst.wait_stream(src)


def linear_cross_entropy_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    eps: float,
    scale: torch.Tensor | None,
    want: tuple[bool, bool, bool],
    plan: Plan = PLAN,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-row loss (N,) float32, and the gradients of (hidden, weight, bias) that `want` asks for,
    already multiplied by `scale` (0-d or (N,) float32). `scale` None: no gradients at all."""
    N, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    grads = scale is not None and any(want)
    loss = torch.empty(N, device=dev, dtype=torch.float32)
    lse = torch.empty(N, device=dev, dtype=torch.float32)
    dh = hidden.new_empty(N, H) if grads and want[0] else None
    dw = weight.new_empty(V, H) if grads and want[1] else None
    db = torch.zeros(V, device=dev, dtype=torch.float32) if grads and want[2] else None
    targets = targets.contiguous()
    scale = scale.float().reshape(-1) if grads else None
    one_pass = grads and plan.one_pass and hidden.dtype != torch.float16
    if one_pass:  # per row: c (the factor U is scaled by) and, with smoothing, k = scale * eps / V
        cfac = torch.empty(N, device=dev, dtype=torch.float32)
        k = (scale.expand(N) * (targets != ignore_index) * (eps / V)) if eps > 0 else None
        wsum = weight.sum(0, dtype=torch.float32) if k is not None and dh is not None else None  # (H,)
    chunks = chunk_bounds(N, V, hidden.element_size(), plan.chunk_bytes)
    rows = max((e - s for s, e in chunks), default=0)
    buf = hidden.new_empty(rows, V)  # every chunk's logits, then its dloss/dz (or U), in turn
    cfg = _gemm_config()
    n_parts = cdiv(V, cfg.kwargs["BLOCK_N"])
    stats = None
    if plan.logits_gemm == "kiln":  # (3, rows, n_parts) per-tile row max / sum exp / sum, reused
        stats = torch.empty(3 * rows * n_parts, device=dev, dtype=torch.float32)
    # Streams: the GEMMs on `gemm_s`, the loss kernels on `ce_s`; both None (the current stream) unless
    # the plan overlaps them on a GPU. Tensors used on them are allocated here, before, on the caller's
    # stream, which waits for both at the end: the allocator cannot hand their memory out early.
    main = gemm_s = ce_s = None
    if plan.overlap > 1 and hidden.is_cuda:
        main = torch.cuda.current_stream(dev)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        gemm_s = _stream(index, -1) if plan.gemm_priority else main
        ce_s = _stream(index, 0)
        _handoff(main, gemm_s)
        _handoff(main, ce_s)
    for c0, c1 in chunks:
        parts = split_rows(c0, c1, plan.overlap)
        done = []  # per part: its loss kernel has finished (events; None on one stream)
        for p0, p1 in parts:
            z = buf[p0 - c0 : p1 - c0]  # (part rows, V)
            st = None if stats is None else stats[3 * (p0 - c0) * n_parts : 3 * (p1 - c0) * n_parts]
            with _on(gemm_s):
                _logits(hidden[p0:p1], weight, bias, z, None if st is None else st.view(3, -1, n_parts), cfg)
            with _on(ce_s):  # the loss, and the gradient in place, once the part's logits are there
                _handoff(gemm_s, ce_s)
                s = None if not grads else scale if scale.numel() == 1 else scale[p0:p1]
                if one_pass:
                    cross_entropy_one_pass(z, targets[p0:p1], loss[p0:p1], lse[p0:p1], cfac[p0:p1], s,
                                           ignore_index, eps, plan.row_programs, plan.row_block,
                                           plan.row_warps)  # fmt: skip
                else:
                    _launch(z, targets[p0:p1], loss[p0:p1], lse[p0:p1], z if grads else None, s,
                            ignore_index, eps, forward=True, programs=plan.row_programs,
                            stats=None if st is None else st.view(3, -1, n_parts), block=plan.row_block,
                            warps=plan.row_warps)  # fmt: skip
                done.append(_mark(ce_s))
        with _on(gemm_s):  # z holds dloss/dz (or U) now, part by part; the next chunk's logits wait for these
            for (p0, p1), ev in zip(parts, done):
                _wait(gemm_s, ev)
                if dh is not None:
                    torch.matmul(buf[p0 - c0 : p1 - c0], weight, out=dh[p0:p1])  # (p, H) = (p, V) @ (V, H)
                    if one_pass:  # dh = c * (U @ W) - k * sum_j W_j (the GEMM's result scaled in float32)
                        dh[p0:p1].mul_(cfac[p0:p1, None])
                        if k is not None:
                            dh[p0:p1] -= k[p0:p1, None] * wsum
            h = hidden[c0:c1]
            if one_pass:  # dweight += U.T @ (c * h): c folded into the small operand, (c, H), one kernel
                h = torch.mul(
                    h, cfac[c0:c1, None], out=torch.empty_like(h, memory_format=torch.contiguous_format)
                )
            if dw is not None:
                _dweight(buf[: c1 - c0], h, dw, accumulate=c0 > 0, gemm=plan.dweight_gemm, cfg=cfg)
            if db is not None:
                if one_pass:  # db += U.T @ c
                    db += torch.matmul(cfac[c0:c1].to(buf.dtype), buf[: c1 - c0]).float()
                else:
                    db += buf[: c1 - c0].sum(0, dtype=torch.float32)
    if main is not None:
        _handoff(gemm_s, main)
        _handoff(ce_s, main)
    if one_pass and k is not None:  # smoothing's -eps/V on every logit: a rank-one term for dweight and dbias
        if dw is not None:
            dw -= (k @ hidden.float()).to(dw.dtype)  # every row of dweight gets -sum_i k_i h_i
        if db is not None:
            db -= k.sum()
    return loss, dh, dw, db


def _logits(h, weight, bias, z, stats, cfg) -> None:
    """z (c, V) = h (c, H) @ weight.T (+ bias); with `stats`, kiln's GEMM also writes row statistics."""
    if stats is not None:
        matmul_fwd(h, weight.t(), bias, out=z, row_stats=stats, config=cfg)
    elif bias is None:
        torch.matmul(h, weight.t(), out=z)
    else:
        torch.addmm(bias.to(z.dtype), h, weight.t(), out=z)  # bias broadcast over the rows


def _dweight(z, h, dw, accumulate: bool, gemm: str, cfg) -> None:
    """dw (V, H) (+)= z.T (V, c) @ h (c, H), rounded to dweight's dtype after each chunk."""
    if gemm == "kiln":
        matmul_fwd(z.t(), h, out=dw, accumulate=accumulate, config=cfg)
    elif accumulate:
        dw.addmm_(z.t(), h)
    else:
        torch.matmul(z.t(), h, out=dw)


@triton.jit
def _scale_kernel(
    X_ptr,  # contiguous tensor of n elements, scaled in place
    G_ptr,  # one float32: the factor
    n,
    BLOCK: tl.constexpr,
):
    # Read the factor on the device: when it is 1 (loss.backward() of the loss itself) nothing is read or
    # written, which skips a pass over dweight (445 MiB at 151936 x 1536 bf16) without a host sync.
    g = tl.load(G_ptr)
    if g != 1.0:
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK).to(tl.int64)
            x = tl.load(X_ptr + offs, mask=offs < n)
            tl.store(X_ptr + offs, (x.to(tl.float32) * g).to(X_ptr.dtype.element_ty), mask=offs < n)


def scale_(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x *= g in place, g a float32 0-d tensor on x's device; free when g == 1."""
    if not x.is_contiguous():
        raise ValueError("scale_ takes a contiguous tensor")
    n = x.numel()
    if n == 0:
        return x
    block = 64 if interpreting() else 4096
    programs = min(cdiv(n, block), 4 if interpreting() else 8 * sm_count(x.device))
    _scale_kernel[(programs,)](x, g.float().reshape(1), n, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return x


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, plan):
        n_valid = (targets != ignore_index).sum()
        want = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[3],
        )
        early = reduction != "none" and any(want)
        # mean/sum: the gradient of each token is the same multiple of dloss/dz, so it is formed now (one
        # pass instead of recomputing the logits) and scaled by the incoming gradient in the backward.
        scale = _row_scale(torch.ones((), device=hidden.device), n_valid, reduction) if early else None
        loss, dh, dw, db = linear_cross_entropy_chunks(
            hidden, weight, targets, bias, ignore_index, label_smoothing, scale, want, plan
        )
        ctx.early, ctx.spent = early, False
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.args = (ignore_index, label_smoothing, reduction, want, plan)
        if early:
            ctx.save_for_backward(dh, dw, db)
        else:
            ctx.save_for_backward(hidden, weight, targets, bias, n_valid)
        return _reduce(loss, n_valid, reduction)

    @staticmethod
    def backward(ctx, grad_out):
        ignore_index, label_smoothing, reduction, want, plan = ctx.args
        if ctx.early:
            if ctx.spent:
                raise RuntimeError(
                    "linear_cross_entropy scales its saved gradients in place, so it cannot be "
                    "backpropagated twice (retain_graph=True): call it again for a second backward"
                )
            ctx.spent = True
            # In place, on the device: no second copy of dweight, no host sync to test grad_out == 1.
            dh, dw, db = (None if t is None else scale_(t, grad_out) for t in ctx.saved_tensors)
        else:
            hidden, weight, targets, bias, n_valid = ctx.saved_tensors
            scale = _row_scale(grad_out, n_valid, reduction)
            _, dh, dw, db = linear_cross_entropy_chunks(
                hidden, weight, targets, bias, ignore_index, label_smoothing, scale, want, plan
            )
        if db is not None:
            db = db.to(ctx.bias_dtype)
        return dh, dw, None, db, None, None, None, None


# ------------------------------------------------------------------------------ torch.compile: custom ops
# Under torch.compile the public op calls these instead of LinearCrossEntropy (Dynamo cannot trace the
# launches), with the default PLAN (a Plan is not a custom-op argument). As in eager, "mean"/"sum" form
# the gradients in the forward; the registered backward multiplies them by the incoming gradient out of
# place (traced, so the compiler fuses it; eager scales in place and skips the pass when it is 1).
# "none" recomputes the chunks in the backward with each token's incoming gradient.
def _want_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return t if t is not None else like.new_empty(0)


@torch.library.custom_op("kiln::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    want_hidden: bool,
    want_weight: bool,
    want_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss reduced as `reduction` asks, dhidden (N, H), dweight (V, H), dbias (V,) float32): the
    gradients of the loss itself (incoming gradient 1), formed for "mean"/"sum" where wanted, else
    empty."""
    want = (want_hidden, want_weight, bias is not None and want_bias)
    n_valid = (targets != ignore_index).sum()
    early = reduction != "none" and any(want)
    scale = _row_scale(torch.ones((), device=hidden.device), n_valid, reduction) if early else None
    loss, dh, dw, db = linear_cross_entropy_chunks(
        hidden, weight, targets, bias, ignore_index, label_smoothing, scale, want
    )
    return (
        _reduce(loss, n_valid, reduction),
        _want_empty(dh, hidden),
        _want_empty(dw, weight),
        _want_empty(db, loss),
    )


@linear_cross_entropy_fwd_op.register_fake
def _(hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, want_hidden, want_weight,
      want_bias):  # fmt: skip
    _check_inputs(hidden, weight, targets, bias, label_smoothing, reduction)
    early = reduction != "none"
    (N, H), V = hidden.shape, weight.shape[0]
    loss = hidden.new_empty(N if reduction == "none" else (), dtype=torch.float32)
    return (
        loss,
        hidden.new_empty((N, H) if early and want_hidden else 0),
        weight.new_empty((V, H) if early and want_weight else 0),
        hidden.new_empty(V if early and want_bias and bias is not None else 0, dtype=torch.float32),
    )


@torch.library.custom_op("kiln::linear_cross_entropy_bwd", mutates_args=())
def linear_cross_entropy_bwd_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    grad_loss: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    want_hidden: bool,
    want_weight: bool,
    want_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none"'s backward: the chunks again, each token's dloss/dz scaled by grad_loss (N,).
    Returns (dhidden, dweight, dbias float32), empty where not wanted."""
    want = (want_hidden, want_weight, bias is not None and want_bias)
    _, dh, dw, db = linear_cross_entropy_chunks(
        hidden, weight, targets, bias, ignore_index, label_smoothing, grad_loss.float(), want
    )
    return _want_empty(dh, hidden), _want_empty(dw, weight), _want_empty(db, grad_loss.float())


@linear_cross_entropy_bwd_op.register_fake
def _(hidden, weight, targets, bias, grad_loss, ignore_index, label_smoothing, want_hidden, want_weight,
      want_bias):  # fmt: skip
    (N, H), V = hidden.shape, weight.shape[0]
    return (
        hidden.new_empty((N, H) if want_hidden else 0),
        weight.new_empty((V, H) if want_weight else 0),
        hidden.new_empty(V if want_bias and bias is not None else 0, dtype=torch.float32),
    )


def _lce_setup(ctx, inputs, output):
    hidden, weight, targets, bias, ignore_index, label_smoothing, reduction, *want = inputs
    ctx.args = (ignore_index, label_smoothing, *want)
    ctx.reduction, ctx.bias_dtype = reduction, None if bias is None else bias.dtype
    if reduction != "none":
        ctx.save_for_backward(*output[1:])
    else:
        ctx.save_for_backward(hidden, weight, targets, bias)


def _lce_backward(ctx, grad_loss, _ddh, _ddw, _ddb):
    want = ctx.args[2:]
    if ctx.reduction != "none":
        g = grad_loss.float()  # 0-d: every gradient is the loss's own times it (as scale_ computes it)
        dh, dw, db = ((t.float() * g).to(t.dtype) for t in ctx.saved_tensors)
    else:
        hidden, weight, targets, bias = ctx.saved_tensors
        dh, dw, db = linear_cross_entropy_bwd_op(hidden, weight, targets, bias, grad_loss, *ctx.args)
    dh, dw = (dh if want[0] else None), (dw if want[1] else None)
    db = db.to(ctx.bias_dtype) if ctx.bias_dtype is not None and want[2] else None
    return dh, dw, None, db, None, None, None, None, None, None


linear_cross_entropy_fwd_op.register_autograd(_lce_backward, setup_context=_lce_setup)


def _check_inputs(hidden, weight, targets, bias, label_smoothing, reduction) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"expected hidden (N, H) and weight (V, H), got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden is {hidden.dtype} but weight is {weight.dtype}: cast one of them")
    _check(hidden, targets, label_smoothing, reduction, "hidden (N, H)")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    plan: Plan = PLAN,
) -> torch.Tensor:
    if not use_triton(hidden, weight, targets, bias):
        return linear_cross_entropy_ref(
            hidden, weight, targets, bias, ignore_index, label_smoothing, reduction
        )
    _check_inputs(hidden, weight, targets, bias, label_smoothing, reduction)
    if torch.compiler.is_compiling():
        if plan != PLAN:
            raise ValueError(
                "linear_cross_entropy: under torch.compile only the default plan runs (a Plan is not a "
                f"custom-op argument); got {plan}: call it eagerly to use another plan"
            )
        want = (needs_grad(hidden), needs_grad(weight), needs_grad(bias))
        args = (hidden, weight, targets, bias, ignore_index, float(label_smoothing), reduction, *want)
        return linear_cross_entropy_fwd_op(*args)[0]
    return LinearCrossEntropy.apply(
        hidden, weight, targets, bias, ignore_index, float(label_smoothing), reduction, plan
    )
