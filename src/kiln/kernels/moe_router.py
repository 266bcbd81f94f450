"""Mixture-of-experts router: top-k expert choice, routing weights, expert counts and the router losses,
in one pass over the router logits (N, E), on the device (no host sync), forward and backward.

Scores: "softmax" p = softmax(l) (Mixtral, Qwen-MoE) or "sigmoid" p = sigmoid(l) (DeepSeek-V3). Each
token takes the k experts of largest logit (the same as largest score: both maps are monotone; ties go to
the lower index), sorted by score; weights w_j = p_{e_j}, divided by their sum when `renormalize`.
    counts_e = number of (token, slot) pairs routed to e                     (E,) int32
    aux      = E * sum_e (counts_e / N) * P_e,  P_e = mean_n q_{n,e}          load balancing (Switch)
               q = p for softmax (exactly transformers' load_balancing_loss_func for Mixtral);
               q = p / sum_e p for sigmoid (DeepSeek-V3's normalized scores)
    z        = mean_n logsumexp(l_n)^2                                       router z-loss (ST-MoE)
counts are integers: the loss does not differentiate through the choice (as in every reference).

Backward, per token, with dw (N, k), daux and dz (0-dim tensors, read on the device):
    c_e = daux * E * counts_e / N^2     (d aux / d q_{n,e})
    softmax: dl = p * (D - <p, D>) + R + dz * 2 lse / N * p, with D = c (+ dw scattered to e_j when not
             renormalized) and, when renormalized, R_{e_j} = w_j (dw_j - sum_i w_i dw_i) (the weights are
             then a softmax over the chosen logits)
    sigmoid: dp = scatter_j of (dw_j - sum_i w_i dw_i) / S_k  (renormalized; S_k the chosen scores' sum),
             or of dw_j; plus (c - <q, c>) / S (S = sum_e p); dl = dp * p (1 - p) + the z term above.
The forward also leaves per-program partial sums of q (programs, E) that torch sums into P (a fixed order:
deterministic); counts are int32 atomics (exact). Shapes: logits (N, E) any float dtype, E <= 1024.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kiln.kernels._common import FLOAT_DTYPES, needs_grad
from kiln.kernels.dispatch import interpreting, use_triton
from kiln.kernels.launch import CachedLaunch, cdiv, pow2

SCORINGS = ("softmax", "sigmoid")
MAX_EXPERTS = 1024


class Routing(NamedTuple):
    weights: torch.Tensor  # (N, k) float32 (float64 for float64 logits)
    expert_idx: torch.Tensor  # (N, k) int32, sorted by score
    counts: torch.Tensor  # (E,) int32
    aux_loss: torch.Tensor  # () load-balancing loss
    z_loss: torch.Tensor  # () router z-loss


def _check(logits: torch.Tensor, top_k: int, scoring: str) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"router: logits must be (N, E) with E > 0, got {tuple(logits.shape)}")
    if logits.dtype not in FLOAT_DTYPES and logits.dtype != torch.float64:
        raise TypeError(f"router: logits have dtype {logits.dtype}; expected a float dtype")
    E = logits.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"router: top_k must be in [1, {E}] (the number of experts), got {top_k}")
    if E > MAX_EXPERTS:
        raise ValueError(f"router: {E} experts exceed the kernel's {MAX_EXPERTS} (one row per program)")
    if scoring not in SCORINGS:
        raise ValueError(f"router: scoring {scoring!r} is not one of {', '.join(SCORINGS)}")


def router_ref(
    logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True
) -> Routing:
    """Eager reference, float32 math (float64 for float64 logits); differentiable in logits."""
    _check(logits, top_k, scoring)
    N, E = logits.shape
    lf = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if scoring == "softmax":
        p = q = torch.softmax(lf, -1)
    else:
        p = torch.sigmoid(lf)
        q = p / p.sum(-1, keepdim=True)
    idx = lf.topk(top_k, dim=-1).indices  # (N, k)
    w = p.gather(1, idx)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    counts = torch.zeros(E, dtype=torch.int32, device=logits.device).scatter_add_(
        0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.int32, device=logits.device)
    )
    if N == 0:
        zero = lf.sum() * 0
        return Routing(w, idx.int(), counts, zero, zero)
    aux = E * (counts.to(lf.dtype) / N * q.mean(0)).sum()
    z = torch.logsumexp(lf, -1).pow(2).mean()
    return Routing(w, idx.int(), counts, aux, z)


@triton.jit
def _router_fwd_kernel(
    L_ptr,  # (N, E) logits, rows at l_stride
    W_ptr,  # (N, k) float32 out: routing weights
    I_ptr,  # (N, k) int32 out: experts, by descending score
    Lse_ptr,  # (N,) float32 out: logsumexp of each row (the z-loss)
    Part_ptr,  # (programs, E) float32 out: this program's column sums of q
    Cnt_ptr,  # (E,) int32, zero on entry: pairs per expert (atomics)
    N,
    E,
    l_stride,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rows per program
    BLOCK_E: tl.constexpr,  # pow2 >= E
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    r_ok = rows < N
    c_ok = cols < E
    ok = r_ok[:, None] & c_ok[None, :]
    rows64 = rows.to(tl.int64)
    l = tl.load(L_ptr + rows64[:, None] * l_stride + cols[None, :], mask=ok, other=-float("inf"))
    l = l.to(tl.float32)
    m = tl.max(l, axis=1)
    m = tl.where(r_ok, m, 0.0)  # padding rows: finite, no nan below
    ex = tl.where(ok, tl.exp(l - m[:, None]), 0.0)
    s = tl.sum(ex, axis=1)
    s = tl.where(r_ok, s, 1.0)
    tl.store(Lse_ptr + rows, m + tl.log(s), mask=r_ok)
    if SIGMOID:
        p = tl.where(ok, tl.sigmoid(l), 0.0)
        tot = tl.sum(p, axis=1)
        q = p / tl.where(r_ok, tot, 1.0)[:, None]
    else:
        p = ex / s[:, None]
        q = p
    tl.store(Part_ptr + pid.to(tl.int64) * E + cols, tl.sum(tl.where(ok, q, 0.0), axis=0), mask=c_ok)
    # top-k: k rounds of (max, lowest index holding it, mask it out). With RENORM a first set of rounds
    # sums the chosen scores, so that the stores below write final weights (no store-then-reload).
    wsum = tl.full((BLOCK_N,), 1.0, tl.float32)
    if RENORM:
        v = l
        wsum = tl.zeros((BLOCK_N,), tl.float32)
        for _ in tl.static_range(TOP_K):
            best = tl.max(v, axis=1)
            e = tl.min(tl.where(v == best[:, None], cols[None, :], BLOCK_E), axis=1)
            hit = cols[None, :] == e[:, None]
            wsum += tl.sum(tl.where(hit, p, 0.0), axis=1)
            v = tl.where(hit, -float("inf"), v)
        wsum = tl.where(r_ok, wsum, 1.0)
    v = l
    for j in tl.static_range(TOP_K):
        best = tl.max(v, axis=1)
        # a NaN row matches nowhere: clamp so that the count lands in bounds (its weights are NaN anyway)
        e = tl.minimum(tl.min(tl.where(v == best[:, None], cols[None, :], BLOCK_E), axis=1), E - 1)
        hit = cols[None, :] == e[:, None]
        wj = tl.sum(tl.where(hit, p, 0.0), axis=1)
        tl.store(W_ptr + rows64 * TOP_K + j, wj / wsum, mask=r_ok)
        tl.store(I_ptr + rows64 * TOP_K + j, e, mask=r_ok)
        tl.atomic_add(Cnt_ptr + e, tl.full((BLOCK_N,), 1, tl.int32), mask=r_ok, sem="relaxed")
        v = tl.where(hit, -float("inf"), v)


@triton.jit
def _router_bwd_kernel(
    L_ptr,  # (N, E) logits, rows at l_stride
    W_ptr,  # (N, k) float32 the forward's weights
    I_ptr,  # (N, k) int32 the forward's experts
    DW_ptr,  # (N, k) gradient of the weights, contiguous
    Cnt_ptr,  # (E,) int32 counts
    DAux_ptr,  # () float32 gradient of the aux loss
    DZ_ptr,  # () float32 gradient of the z-loss
    DL_ptr,  # (N, E) out: gradient of the logits, contiguous
    N,
    E,
    l_stride,
    TOP_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    r_ok = rows < N
    c_ok = cols < E
    ok = r_ok[:, None] & c_ok[None, :]
    rows64 = rows.to(tl.int64)
    l = tl.load(L_ptr + rows64[:, None] * l_stride + cols[None, :], mask=ok, other=-float("inf"))
    l = l.to(tl.float32)
    m = tl.where(r_ok, tl.max(l, axis=1), 0.0)
    ex = tl.where(ok, tl.exp(l - m[:, None]), 0.0)
    s = tl.where(r_ok, tl.sum(ex, axis=1), 1.0)
    soft = ex / s[:, None]
    lse = m + tl.log(s)
    inv_n = 1.0 / N  # (N == 1 arrives as a constexpr: no .to())
    cnt = tl.load(Cnt_ptr + cols, mask=c_ok, other=0).to(tl.float32)
    c = tl.load(DAux_ptr).to(tl.float32) * E * cnt * inv_n * inv_n  # (BLOCK_E,) d aux / d q
    dz = tl.load(DZ_ptr).to(tl.float32)
    # the weights' gradient scattered to the experts: (dw_j - sum_i w_i dw_i) when renormalized, else dw_j
    wdw = tl.zeros((BLOCK_N,), tl.float32)
    if RENORM:
        for j in tl.static_range(TOP_K):
            wj = tl.load(W_ptr + rows64 * TOP_K + j, mask=r_ok, other=0.0)
            wdw += wj * tl.load(DW_ptr + rows64 * TOP_K + j, mask=r_ok, other=0.0).to(tl.float32)
    p = soft
    if SIGMOID:
        p = tl.where(ok, tl.sigmoid(l), 0.0)
    g = tl.zeros((BLOCK_N, BLOCK_E), tl.float32)  # per expert: d / d w (less sum w dw), in the chosen lanes
    wg = tl.zeros((BLOCK_N, BLOCK_E), tl.float32)  # the same times w (the renormalized softmax's R)
    chosen = tl.zeros((BLOCK_N,), tl.float32)  # the chosen experts' score sum
    for j in tl.static_range(TOP_K):
        e = tl.load(I_ptr + rows64 * TOP_K + j, mask=r_ok, other=0)
        dwj = tl.load(DW_ptr + rows64 * TOP_K + j, mask=r_ok, other=0.0).to(tl.float32) - wdw
        wj = tl.load(W_ptr + rows64 * TOP_K + j, mask=r_ok, other=0.0)
        hit = cols[None, :] == e[:, None]
        g = tl.where(hit, dwj[:, None], g)
        wg = tl.where(hit, (wj * dwj)[:, None], wg)
        chosen += tl.sum(tl.where(hit, p, 0.0), axis=1)
    if SIGMOID:
        tot = tl.where(r_ok, tl.sum(p, axis=1), 1.0)
        q = p / tot[:, None]
        dp = (c[None, :] - tl.sum(q * c[None, :], axis=1)[:, None]) / tot[:, None]
        if RENORM:
            dp += g / tl.where(r_ok, chosen, 1.0)[:, None]
        else:
            dp += g
        dl = dp * p * (1.0 - p)
    else:
        d = tl.zeros((BLOCK_N, BLOCK_E), tl.float32) + c[None, :]
        if not RENORM:
            d += g
        dl = soft * (d - tl.sum(soft * d, axis=1)[:, None])
        if RENORM:
            dl += wg
    dl += (2.0 * dz * inv_n * lse)[:, None] * soft
    tl.store(DL_ptr + rows64[:, None] * E + cols[None, :], dl.to(DL_ptr.dtype.element_ty), mask=ok)


_fwd_launch = CachedLaunch(_router_fwd_kernel)
_bwd_launch = CachedLaunch(_router_bwd_kernel)


def _rows_per_program(E: int) -> int:
    """About 2048 scores per program (8 rows of 256 experts: the row arrays of the top-k rounds stay in
    registers at 4 warps), at most 64 rows; 4 under the interpreter."""
    return 4 if interpreting() else max(1, min(64, 2048 // pow2(E)))


def router_fwd(logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool):
    """Launcher: (weights (N, k) float32, expert_idx (N, k) int32, counts (E,) int32, lse (N,) float32,
    partial (programs, E) float32 column sums of q)."""
    N, E = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    bn = _rows_per_program(E)
    programs = cdiv(N, bn)
    w = torch.empty(N, top_k, dtype=torch.float32, device=dev)
    idx = torch.empty(N, top_k, dtype=torch.int32, device=dev)
    counts = torch.zeros(E, dtype=torch.int32, device=dev)
    lse = torch.empty(N, dtype=torch.float32, device=dev)
    part = torch.empty(programs, E, dtype=torch.float32, device=dev)
    if N:
        be = max(16, pow2(E))
        _fwd_launch[(programs,)](
            logits, w, idx, lse, part, counts, N, E, logits.stride(0), TOP_K=top_k,
            SIGMOID=scoring == "sigmoid", RENORM=renormalize, BLOCK_N=bn, BLOCK_E=be,
            num_warps=4 if bn * be <= 2048 else 8,
        )  # fmt: skip
    return w, idx, counts, lse, part


def _losses(counts, lse, part, N: int, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, z) from the kernel's counts, row logsumexps and partial sums: a few tiny device ops."""
    if N == 0:
        zero = lse.new_zeros(())
        return zero, zero.clone()
    P = part.sum(0) / N  # (E,) mean q per expert
    aux = (counts.float() * P).sum() * (E / N)
    return aux, lse.square().mean()


def router_bwd(logits, idx, w, counts, dw, daux, dz, scoring: str, renormalize: bool) -> torch.Tensor:
    """Launcher: dlogits (N, E) in logits' dtype."""
    N, E = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dl = torch.empty(N, E, dtype=logits.dtype, device=logits.device)
    if N == 0:
        return dl
    dw = dw.float().contiguous()
    daux = daux.float().reshape(())
    dz = dz.float().reshape(())
    bn = _rows_per_program(E)
    be = max(16, pow2(E))
    _bwd_launch[(cdiv(N, bn),)](
        logits, w, idx, dw, counts, daux, dz, dl, N, E, logits.stride(0), TOP_K=idx.shape[1],
        SIGMOID=scoring == "sigmoid", RENORM=renormalize, BLOCK_N=bn, BLOCK_E=be,
        num_warps=4 if bn * be <= 2048 else 8,
    )  # fmt: skip
    return dl


def _zeros_if_none(t, like):
    return torch.zeros((), dtype=torch.float32, device=like.device) if t is None else t


class Router(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, scoring, renormalize):
        w, idx, counts, lse, part = router_fwd(logits, top_k, scoring, renormalize)
        aux, z = _losses(counts, lse, part, *logits.shape)
        ctx.save_for_backward(logits, idx, w, counts)
        ctx.scoring, ctx.renormalize = scoring, renormalize
        ctx.mark_non_differentiable(idx, counts)
        return w, idx, counts, aux, z

    @staticmethod
    def backward(ctx, dw, _didx, _dcounts, daux, dz):
        logits, idx, w, counts = ctx.saved_tensors
        daux, dz = _zeros_if_none(daux, w), _zeros_if_none(dz, w)
        dw = torch.zeros_like(w) if dw is None else dw
        dl = router_bwd(logits, idx, w, counts, dw, daux, dz, ctx.scoring, ctx.renormalize)
        return dl, None, None, None


# ------------------------------------------------------------------------------ torch.compile: custom ops
@torch.library.custom_op("kiln::moe_router", mutates_args=())
def router_op(
    logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights (N, k) float32, expert_idx (N, k) int32, counts (E,) int32, aux (), z ())."""
    w, idx, counts, lse, part = router_fwd(logits, top_k, scoring, renormalize)
    return (w, idx, counts, *_losses(counts, lse, part, *logits.shape))


@router_op.register_fake
def _(logits, top_k, scoring, renormalize):
    _check(logits, top_k, scoring)
    N, E = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    i32 = dict(dtype=torch.int32, device=logits.device)
    return (torch.empty(N, top_k, **f32), torch.empty(N, top_k, **i32), torch.empty(E, **i32),
            torch.empty((), **f32), torch.empty((), **f32))  # fmt: skip


@torch.library.custom_op("kiln::moe_router_bwd", mutates_args=())
def router_bwd_op(
    logits: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, dw: torch.Tensor,
    daux: torch.Tensor, dz: torch.Tensor, scoring: str, renormalize: bool,
) -> torch.Tensor:  # fmt: skip
    """dlogits (N, E) like logits."""
    return router_bwd(logits, idx, w, counts, dw, daux, dz, scoring, renormalize)


@router_bwd_op.register_fake
def _(logits, idx, w, counts, dw, daux, dz, scoring, renormalize):
    return logits.new_empty(logits.shape)


def _router_setup(ctx, inputs, output):
    logits, _, scoring, renormalize = inputs
    w, idx, counts, _, _ = output
    ctx.save_for_backward(logits, idx, w, counts)
    ctx.scoring, ctx.renormalize = scoring, renormalize


def _router_backward(ctx, dw, _didx, _dcounts, daux, dz):
    logits, idx, w, counts = ctx.saved_tensors
    daux, dz = _zeros_if_none(daux, w), _zeros_if_none(dz, w)
    dw = torch.zeros_like(w) if dw is None else dw
    return router_bwd_op(logits, idx, w, counts, dw, daux, dz, ctx.scoring, ctx.renormalize), None, None, None


router_op.register_autograd(_router_backward, setup_context=_router_setup)


def route(logits: torch.Tensor, top_k: int, scoring: str = "softmax", renormalize: bool = True) -> Routing:
    """Top-k routing of logits (N, E): weights, experts, counts, aux and z losses (module docstring)."""
    _check(logits, top_k, scoring)
    if not use_triton(logits) or logits.dtype == torch.float64:
        return router_ref(logits, top_k, scoring, renormalize)
    if torch.compiler.is_compiling():
        return Routing(*router_op(logits, top_k, scoring, renormalize))
    if needs_grad(logits):
        return Routing(*Router.apply(logits, top_k, scoring, renormalize))
    w, idx, counts, lse, part = router_fwd(logits, top_k, scoring, renormalize)
    return Routing(w, idx, counts, *_losses(counts, lse, part, *logits.shape))
