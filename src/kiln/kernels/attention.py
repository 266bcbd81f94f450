"""Scaled dot-product attention for prefill and training: causal, GQA, sliding window, sinks, varlen.

Layout is (batch, seq, heads, head_dim) throughout, as FlashAttention takes it:
- q (B, Tq, Hq, D); k, v (B, Tk, Hk, D) with Hq % Hk == 0 (GQA/MQA: query head h reads K/V head
  h // (Hq // Hk); K/V are never stored repeated outside the reference);
- causal masking aligns the diagonal to the end: query i sits at absolute position i + Tk - Tq, so
  chunked prefill (Tq < Tk) works;
- window W (optional): a query at position p sees keys p - W < j <= p;
- sinks (Hq,) (optional): one learned logit per head that joins the softmax denominator and takes
  probability mass without contributing a value (gpt-oss);
- attn_mask (optional, reference path only): bool (B, 1 or Hq, Tq, Tk), True where attention is
  allowed, combined with the masks above (padded batches);
- varlen: q, k, v packed as (total, H, D) with cu_seqlens (N+1,) int32 document boundaries; each
  document attends only within itself.
Fully masked rows give zeros, not NaN. Float32 math, output in q's dtype.

Forward (FlashAttention-2): per block of BLOCK_M queries, stream K/V blocks of BLOCK_N keys with an
online softmax in base 2 (log2(e) folded into the scale, so exp2 does the work):
    s = q k^T * scale * log2(e);  m' = max(m, rowmax s);  l' = l 2^(m - m') + rowsum 2^(s - m')
    acc' = acc 2^(m - m') + 2^(s - m') v;   o = acc / l;   lse = m + log2 l   (saved for the backward)
A sink joins as a starting state: m = sink * log2(e), l = 1, acc = 0 (a logit whose value is zero).
Key blocks are split into ranges that need no masking (the bulk) and ranges that do (the causal
diagonal, the window's far edge, the ragged end), so the bulk loop runs without any mask arithmetic.

Backward (recomputing P from lse, as in the Triton fused-attention tutorial):
    Delta = rowsum(dO * O)                       (a preprocess kernel)
    P = 2^(s - lse);  dV = P^T dO;  dP = dO V^T;  dS = P (dP - Delta)
    dK = scale dS^T Q (one program per K/V block and K/V head, looping over the group's query heads,
    so GQA needs neither atomics nor repeated K/V);  dQ = scale dS K (one program per Q block)
    dsink_h = -sum_rows exp(sink_h - lse) Delta   (the sink's probability times its zero-value gradient)
The two kernels recompute P, 7 matmuls per (query block, key block) pair where an atomic-dQ design
needs 5; on the H200 a dK/dV kernel reduce-adding dQ in fp32 (TMA bulk reductions) measured slower
(0.8-0.95x), so dQ keeps its own kernel: deterministic, no atomics.

Loads go through masked pointers. `tma=True` (forward) and `tma_bwd=True` (backward, in
`FlashAttention`) stream the tiles through TMA tensor descriptors instead (Hopper; one descriptor
per sequence, whose shape clips ragged ends). On the H200 they made the forward slower (0.92x at
4k, 0.98x at 16k: the descriptors are built per program on the device) and the backward faster at
long MHA sequences (1.03x at 4k, 1.06x at 16k, hd128 causal); both are off by default, the backward's
because only those two points were measured.
The Triton path takes fp16, bf16 and fp32 inputs with head dims 16, 32, 64, 128 and 256, and the
last dim contiguous (other layouts are made contiguous first). Within one sequence, row offsets are
int32: Tq * Hq * D must stay below 2**31. attn_mask, and head dims other than these, take the
reference path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kiln.kernels.dispatch import interpreting, use_triton

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
HEAD_DIMS = (16, 32, 64, 128, 256)


# ----------------------------------------------------------------------------------------- reference
def _attention_dense_ref(q, k, v, causal, softmax_scale, window, sinks, attn_mask):
    # the reference's math is float32 (float64 for float64 inputs) even inside a caller's autocast
    with torch.autocast(q.device.type, enabled=False):
        return _attention_dense_math(q, k, v, causal, softmax_scale, window, sinks, attn_mask)


def _attention_dense_math(q, k, v, causal, softmax_scale, window, sinks, attn_mask):
    B, Tq, Hq, D = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if Hq % Hk:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hk})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(work).transpose(1, 2)  # (B, Hq, Tq, D)
    kf = k.to(work).transpose(1, 2).repeat_interleave(Hq // Hk, dim=1)  # (B, Hq, Tk, D)
    vf = v.to(work).transpose(1, 2).repeat_interleave(Hq // Hk, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale  # (B, Hq, Tq, Tk)
    qpos = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
    kpos = torch.arange(Tk, device=q.device)[None, :]
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    allowed = allowed.expand(B, Hq, Tq, Tk)
    if attn_mask is not None:
        allowed = allowed & attn_mask
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(work).view(1, Hq, 1, 1).expand(B, Hq, Tq, 1)
        s = torch.cat((s, sink), dim=-1)
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(work).min)  # all -inf rows stay finite
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = torch.where(denom > 0, p / denom, torch.zeros_like(p))
    if sinks is not None:
        p = p[..., :-1]
    return (p @ vf).transpose(1, 2).to(q.dtype)  # (B, Tq, Hq, D)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager attention (float32 math, or float64 for float64 inputs); differentiable by autograd."""
    if cu_seqlens is None:
        return _attention_dense_ref(q, k, v, causal, softmax_scale, window, sinks, attn_mask)
    if attn_mask is not None:
        raise ValueError("attn_mask cannot be combined with cu_seqlens: packed documents mask themselves")
    bounds = cu_seqlens.tolist()
    outs = [
        _attention_dense_ref(
            q[None, a:b], k[None, a:b], v[None, a:b], causal, softmax_scale, window, sinks, None
        )[0]
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outs, dim=0)


# ------------------------------------------------------------------------------------ autotune space
def _configs(space, interpreted):
    """triton.Configs from (BLOCK_M, BLOCK_N, num_warps, num_stages, head_dims) rows.

    The interpreter gets the one (BLOCK_M, BLOCK_N) in `interpreted`: unequal, as on the GPU, so the CPU
    tests cover the block-range arithmetic where query and key blocks differ in size."""
    if interpreting():
        bm, bn = interpreted
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "DIMS": dims}, num_warps=w, num_stages=s)
        for bm, bn, w, s, dims in space
    ]


def _prune(configs, named_args, **kwargs):
    """The configs meant for this head dim (their `DIMS` tag), as new Configs without the tag."""
    hd = kwargs.get("HEAD_DIM", named_args.get("HEAD_DIM"))
    kept = [c for c in configs if hd in c.kwargs.get("DIMS", (hd,))] or configs[:1]
    return [
        triton.Config(
            {k: v for k, v in c.kwargs.items() if k != "DIMS"}, num_warps=c.num_warps, num_stages=c.num_stages
        )
        for c in kept
    ]


def _bench(fn, quantiles):
    # Short autotuning runs: the default (25 ms warm-up, 100 ms measure per config) costs seconds per key.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_SMALL, _MID, _BIG = (16, 32, 64), (128,), (256,)
# Few configs per head dim: each costs a compile (seconds) the first time a kernel variant runs.
# From the H200 runs: 64-row forward blocks with 4 warps won at every point of the grid (more programs
# share an SM, so one's softmax overlaps another's matmuls); the rest are the runners-up.
_FWD_SPACE = [
    (64, 64, 4, 3, _SMALL),
    (64, 64, 4, 4, _SMALL),
    (64, 64, 4, 3, _MID),
    (64, 64, 4, 4, _MID),
    (64, 32, 4, 3, _MID),
    (128, 64, 8, 3, _MID),
    (64, 64, 4, 2, _BIG),
    (128, 64, 8, 2, _BIG),
]
# dK/dV: BLOCK_M is the query block streamed, BLOCK_N the key block a program owns (dK, dV accumulators
# of BLOCK_N x D fp32 each live in registers, which bounds BLOCK_N x D per warp).
_DKDV_SPACE = [
    (32, 128, 4, 3, _SMALL),
    (64, 128, 8, 3, _SMALL),
    (64, 128, 8, 2, _MID),
    (64, 64, 4, 3, _MID),
    (32, 64, 4, 2, _BIG),
    (64, 64, 8, 2, _BIG),
]
# dQ: BLOCK_M is the query block a program owns, BLOCK_N the key block streamed.
_DQ_SPACE = [
    (128, 64, 8, 3, _SMALL),
    (128, 32, 4, 3, _SMALL),
    (128, 64, 8, 2, _MID),
    (64, 64, 4, 3, _MID),
    (64, 32, 4, 2, _BIG),
    (64, 64, 8, 2, _BIG),
]
_KEY = ["HEAD_DIM", "CAUSAL", "WINDOW", "LEN_KEY", "GQA_KEY"]


# ------------------------------------------------------------------------------------ Triton kernels
# fmt: off
# (Kernel signatures keep one line per group of related arguments, each with its comment.)
@triton.jit
def _doc_bounds(CU_SEQLENS, b, Tq, Tk, VARLEN: tl.constexpr):
    """(first packed row, Tq, Tk) of document b; dense batches start at row 0 of their own slice."""
    if VARLEN:
        start = tl.load(CU_SEQLENS + b)
        n = tl.load(CU_SEQLENS + b + 1) - start
        return start, n, n
    else:
        return b * 0, Tq, Tk


@triton.jit
def _key_ranges(m0, Tq, Tk, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                WINDOW: tl.constexpr):
    """Key ranges [lo, full_lo) masked, [full_lo, full_hi) unmasked, [full_hi, hi) masked for the
    query block starting at row m0 (absolute positions are row + Tk - Tq); multiples of BLOCK_N."""
    pmin = m0 + Tk - Tq
    pmax = pmin + BLOCK_M - 1
    lo = 0
    hi = Tk
    full_lo = 0
    full_hi = Tk // BLOCK_N * BLOCK_N
    if CAUSAL:  # keys past the last row's position are never seen; below the first row's, always
        hi = tl.minimum(Tk, pmax + 1)
        full_hi = tl.minimum(full_hi, tl.maximum(pmin + 1, 0) // BLOCK_N * BLOCK_N)
    if WINDOW:  # keys at or before pmin - W are never seen; after pmax - W, always
        lo = tl.maximum(pmin - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(pmax - window + 1, 0), BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_ranges(n0, Tq, Tk, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr):
    """Query-row ranges (masked, unmasked, masked) that see the key block starting at n0."""
    off = Tk - Tq
    lo = 0
    hi = Tq
    full_lo = 0
    full_hi = Tq // BLOCK_M * BLOCK_M
    if CAUSAL:  # rows with position >= n0 see some key; those >= n0 + BLOCK_N - 1 see all of them
        lo = tl.maximum(n0 - off, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - off, 0), BLOCK_M) * BLOCK_M
    if WINDOW:  # rows with position < n0 + BLOCK_N - 1 + W see some key; those < n0 + W see all
        hi = tl.minimum(Tq, n0 + BLOCK_N - 1 + window - off)
        full_hi = tl.minimum(full_hi, tl.maximum(n0 + window - off, 0) // BLOCK_M * BLOCK_M)
    if n0 + BLOCK_N > Tk:  # a ragged key block is masked for every row
        full_hi = 0
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def _allowed(qpos, kpos, Tk, window, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Mask of allowed (query, key) pairs; qpos and kpos broadcast against each other."""
    ok = kpos < Tk
    if CAUSAL:
        ok = ok & (kpos <= qpos)
    if WINDOW:
        ok = ok & (kpos > qpos - window)
    return ok


@triton.jit
def _load_rows(src, row0, n_rows, stride_t, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, MASK: tl.constexpr,
               TMA: tl.constexpr):
    """Rows [row0, row0 + ROWS) of a (n_rows, HEAD_DIM) matrix: a TMA load through a tensor descriptor
    (out-of-range rows read as zero), or pointer loads from base `src` (masked only when MASK)."""
    if TMA:
        return src.load([row0, 0])
    else:
        rows = row0 + tl.arange(0, ROWS)
        ptrs = src + rows[:, None] * stride_t + tl.arange(0, HEAD_DIM)[None, :]
        if MASK:
            return tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, start, end, qpos, Tk, window, qk_scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
               WINDOW: tl.constexpr, TMA: tl.constexpr):
    """Online softmax over key blocks [start, end): acc (BLOCK_M, D), l_i and m_i (BLOCK_M,) updated."""
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        k = _load_rows(k_src, n0, Tk, stride_kt, HEAD_DIM, BLOCK_N, MASK, TMA)  # (BLOCK_N, D)
        qk = tl.dot(q, tl.trans(k))  # (BLOCK_M, BLOCK_N); times qk_scale it is in log2 units
        if MASK:
            s = tl.where(_allowed(qpos[:, None], (n0 + offs_n)[None, :], Tk, window, CAUSAL, WINDOW),
                         qk * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # m_i starts finite, so m_new is finite
            p = tl.math.exp2(s - m_new[:, None])
        else:  # the scale goes into the max and one fused multiply-add per score
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_rows(v_src, n0, Tk, stride_vt, HEAD_DIM, BLOCK_N, MASK, TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.autotune(_configs(_FWD_SPACE, (64, 32)), key=_KEY + ["TMA"], prune_configs_by={"early_config_prune": _prune},
                 do_bench=_bench)
@triton.jit
def _attn_fwd_kernel(
    Q, K, V, O, LSE,  # q (B, Tq, Hq, D); k, v (B, Tk, Hk, D); o like q; lse (B, Hq, Tq) fp32, log2 units
    SINKS, CU_SEQLENS,  # sinks (Hq,) or a dummy; cu_seqlens (B+1,) int32 when VARLEN (then B = documents)
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,  # element strides; the last dim is contiguous
    Hq, group, Tq, Tk, window, qk_scale,  # group = Hq // Hk; qk_scale = softmax scale * log2(e)
    LEN_KEY, GQA_KEY,  # autotuning keys only (a length bucket, the group size)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SINK: tl.constexpr,
    VARLEN: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Heaviest (last, under causal masking) query blocks first: a shorter tail at the end of the grid.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    row0, Tq, Tk = _doc_bounds(CU_SEQLENS, b, Tq, Tk, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= Tq:
        return
    bb = b.to(tl.int64) * (1 - VARLEN)  # varlen packs documents in one batch row
    row0 = row0.to(tl.int64)
    q_base = Q + bb * stride_qb + row0 * stride_qt + h * stride_qh
    k_base = K + bb * stride_kb + row0 * stride_kt + (h // group) * stride_kh
    v_base = V + bb * stride_vb + row0 * stride_vt + (h // group) * stride_vh
    o_base = O + bb * stride_ob + row0 * stride_ot + h * stride_oh
    if TMA:  # one (rows, D) descriptor per matrix: its shape clips the ragged ends of this sequence
        q_src = tl.make_tensor_descriptor(q_base, [Tq, HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM])
        k_src = tl.make_tensor_descriptor(k_base, [Tk, HEAD_DIM], [stride_kt, 1], [BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_base, [Tk, HEAD_DIM], [stride_vt, 1], [BLOCK_N, HEAD_DIM])
    else:
        q_src = q_base
        k_src = k_base
        v_src = v_base

    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Tq
    q = _load_rows(q_src, m0, Tq, stride_qt, HEAD_DIM, BLOCK_M, True, TMA)  # (BLOCK_M, D), kept in registers
    qpos = offs_m + Tk - Tq
    if SINK:  # the sink starts the running softmax as a logit whose value is zero
        m_i = tl.zeros([BLOCK_M], tl.float32) + tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        l_i = tl.zeros([BLOCK_M], tl.float32) + 1.0
    else:  # a finite start: fully masked rows then give p = 0 instead of NaN
        m_i = tl.zeros([BLOCK_M], tl.float32) - 1.0e30
        l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    lo, full_lo, full_hi, hi = _key_ranges(m0, Tq, Tk, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, lo, full_lo, qpos, Tk, window,
                               qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, WINDOW, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, full_lo, full_hi, qpos, Tk,
                               window, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL, WINDOW, TMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_src, v_src, stride_kt, stride_vt, full_hi, hi, qpos, Tk, window,
                               qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, WINDOW, TMA)

    has = l_i > 0.0
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("inf"))  # +inf: P = 0 in backward
    if TMA:
        o_desc = tl.make_tensor_descriptor(o_base, [Tq, HEAD_DIM], [stride_ot, 1], [BLOCK_M, HEAD_DIM])
        o_desc.store([m0, 0], acc.to(O.dtype.element_ty))
    else:
        o_ptrs = o_base + offs_m[:, None] * stride_ot + tl.arange(0, HEAD_DIM)[None, :]
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bb * stride_lb + h * stride_lh + row0 + offs_m, lse, mask=row_ok)


@triton.jit
def _attn_bwd_preprocess_kernel(
    O, DO, DELTA,  # o, do (B, T, H, D); delta (B, H, T) fp32 = rowsum(do * o)
    stride_ob, stride_ot, stride_oh, stride_dob, stride_dot, stride_doh, stride_db, stride_dh,
    H, T, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_m[:, None] < T
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dot + offs_d[None, :], mask=ok,
                 other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b * stride_db + h * stride_dh + offs_m, delta, mask=offs_m < T)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qt, stride_dot, start, end, kpos,
                    Tq, Tk, window, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASK: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOW: tl.constexpr, TMA: tl.constexpr):
    """Accumulate dK, dV (BLOCK_N, D) of one key block over query blocks [start, end), computed transposed
    (keys by queries) so no operand needs a transpose in registers."""
    offs_m = tl.arange(0, BLOCK_M)
    for m0 in range(start, end, BLOCK_M):
        rows = m0 + offs_m  # (BLOCK_M,)
        q = _load_rows(q_src, m0, Tq, stride_qt, HEAD_DIM, BLOCK_M, MASK, TMA)
        do = _load_rows(do_src, m0, Tq, stride_dot, HEAD_DIM, BLOCK_M, MASK, TMA)
        if MASK:
            lse = tl.load(lse_base + rows, mask=rows < Tq, other=0.0)
            delta = tl.load(delta_base + rows, mask=rows < Tq, other=0.0)
        else:
            lse = tl.load(lse_base + rows)
            delta = tl.load(delta_base + rows)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASK:
            ok = _allowed((rows + Tk - Tq)[None, :], kpos[:, None], Tk, window, CAUSAL, WINDOW) & (rows[None, :] < Tq)
            p_t = tl.where(ok, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.autotune(_configs(_DKDV_SPACE, (32, 64)), key=_KEY + ["TMA"], prune_configs_by={"early_config_prune": _prune},
                 do_bench=_bench)
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS,  # dk, dv like k, v; lse, delta (B, Hq, Tq) fp32
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    Hk, group, Tq, Tk, window, qk_scale, sm_scale, LEN_KEY, GQA_KEY,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)  # the first key blocks see the most queries under causal masking: heaviest first
    pid_bh = tl.program_id(1)
    b = pid_bh // Hk
    hk = pid_bh % Hk
    row0, Tq, Tk = _doc_bounds(CU_SEQLENS, b, Tq, Tk, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= Tk:
        return
    bb = b.to(tl.int64) * (1 - VARLEN)
    row0 = row0.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n[:, None] < Tk
    k = _load_rows(K + bb * stride_kb + row0 * stride_kt + hk * stride_kh, n0, Tk, stride_kt, HEAD_DIM, BLOCK_N,
                   True, False)
    v = _load_rows(V + bb * stride_vb + row0 * stride_vt + hk * stride_vh, n0, Tk, stride_vt, HEAD_DIM, BLOCK_N,
                   True, False)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)

    lo, full_lo, full_hi, hi = _query_ranges(n0, Tq, Tk, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    for g in range(group):  # the query heads sharing this K/V head accumulate into one dK, dV
        h = hk * group + g
        q_src = Q + bb * stride_qb + row0 * stride_qt + h * stride_qh
        do_src = DO + bb * stride_dob + row0 * stride_dot + h * stride_doh
        if TMA:
            q_src = tl.make_tensor_descriptor(q_src, [Tq, HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM])
            do_src = tl.make_tensor_descriptor(do_src, [Tq, HEAD_DIM], [stride_dot, 1], [BLOCK_M, HEAD_DIM])
        lse_base = LSE + bb * stride_lb + h * stride_lh + row0
        delta_base = DELTA + bb * stride_lb + h * stride_lh + row0
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qt, stride_dot, lo,
                                 full_lo, offs_n, Tq, Tk, window, qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL, WINDOW,
                                 TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qt, stride_dot,
                                 full_lo, full_hi, offs_n, Tq, Tk, window, qk_scale, HEAD_DIM, BLOCK_M, False, CAUSAL,
                                 WINDOW, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_base, delta_base, stride_qt, stride_dot,
                                 full_hi, hi, offs_n, Tq, Tk, window, qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL,
                                 WINDOW, TMA)
    dk_ptrs = DK + bb * stride_dkb + row0 * stride_dkt + hk * stride_dkh + offs_n[:, None] * stride_dkt
    dv_ptrs = DV + bb * stride_dvb + row0 * stride_dvt + hk * stride_dvh + offs_n[:, None] * stride_dvt
    tl.store(dk_ptrs + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok)
    tl.store(dv_ptrs + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=col_ok)


@triton.jit
def _bwd_dq_inner(dq, q, do, lse, delta, k_src, v_src, stride_kt, stride_vt, start, end, qpos, Tk, window,
                  qk_scale, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOW: tl.constexpr, TMA: tl.constexpr):
    """Accumulate dQ (BLOCK_M, D) of one query block over key blocks [start, end)."""
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        k = _load_rows(k_src, n0, Tk, stride_kt, HEAD_DIM, BLOCK_N, MASK, TMA)
        v = _load_rows(v_src, n0, Tk, stride_vt, HEAD_DIM, BLOCK_N, MASK, TMA)
        s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(s - lse[:, None])
        if MASK:
            p = tl.where(_allowed(qpos[:, None], (n0 + offs_n)[None, :], Tk, window, CAUSAL, WINDOW), p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.autotune(_configs(_DQ_SPACE, (64, 32)), key=_KEY + ["TMA"], prune_configs_by={"early_config_prune": _prune},
                 do_bench=_bench)
@triton.jit
def _attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_SEQLENS,  # dq like q
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh, stride_dqb, stride_dqt, stride_dqh,
    Hq, group, Tq, Tk, window, qk_scale, sm_scale, LEN_KEY, GQA_KEY,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest query blocks first, as in the forward
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    row0, Tq, Tk = _doc_bounds(CU_SEQLENS, b, Tq, Tk, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= Tq:
        return
    bb = b.to(tl.int64) * (1 - VARLEN)
    row0 = row0.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Tq
    q = _load_rows(Q + bb * stride_qb + row0 * stride_qt + h * stride_qh, m0, Tq, stride_qt, HEAD_DIM, BLOCK_M,
                   True, False)
    do = _load_rows(DO + bb * stride_dob + row0 * stride_dot + h * stride_doh, m0, Tq, stride_dot, HEAD_DIM,
                    BLOCK_M, True, False)
    lse = tl.load(LSE + bb * stride_lb + h * stride_lh + row0 + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bb * stride_lb + h * stride_lh + row0 + offs_m, mask=row_ok, other=0.0)
    k_src = K + bb * stride_kb + row0 * stride_kt + (h // group) * stride_kh
    v_src = V + bb * stride_vb + row0 * stride_vt + (h // group) * stride_vh
    if TMA:
        k_src = tl.make_tensor_descriptor(k_src, [Tk, HEAD_DIM], [stride_kt, 1], [BLOCK_N, HEAD_DIM])
        v_src = tl.make_tensor_descriptor(v_src, [Tk, HEAD_DIM], [stride_vt, 1], [BLOCK_N, HEAD_DIM])
    qpos = offs_m + Tk - Tq
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    lo, full_lo, full_hi, hi = _key_ranges(m0, Tq, Tk, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_src, v_src, stride_kt, stride_vt, lo, full_lo, qpos, Tk, window,
                       qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, WINDOW, TMA)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_src, v_src, stride_kt, stride_vt, full_lo, full_hi, qpos, Tk,
                       window, qk_scale, HEAD_DIM, BLOCK_N, False, CAUSAL, WINDOW, TMA)
    dq = _bwd_dq_inner(dq, q, do, lse, delta, k_src, v_src, stride_kt, stride_vt, full_hi, hi, qpos, Tk, window,
                       qk_scale, HEAD_DIM, BLOCK_N, True, CAUSAL, WINDOW, TMA)
    dq_ptrs = DQ + bb * stride_dqb + row0 * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt
    tl.store(dq_ptrs + tl.arange(0, HEAD_DIM)[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])
# fmt: on


# ------------------------------------------------------------------------------------------ launchers
def _len_key(n: int) -> int:
    """Autotuning length bucket: the next power of two, capped (long sequences share a config)."""
    return min(triton.next_power_of_2(max(n, 1)), 8192)


def _as_4d(x: torch.Tensor, varlen: bool) -> torch.Tensor:
    x = x[None] if varlen else x
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q, k, v, sinks, cu_seqlens):
    varlen = cu_seqlens is not None
    want = 3 if varlen else 4
    layout = "(total, H, D) with cu_seqlens" if varlen else "(B, T, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"attention: {name} must be {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"attention: q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"attention: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(
            f"attention: query heads ({q.shape[-2]}) must be a multiple of key/value heads ({k.shape[-2]})"
        )
    if sinks is not None and sinks.shape != (q.shape[-2],):
        raise ValueError(f"attention: sinks must be (Hq,) = ({q.shape[-2]},), got {tuple(sinks.shape)}")
    if varlen and (cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise ValueError("attention: cu_seqlens must be a 1-D int32 tensor of document boundaries")


def _tma_allocator(size: int, alignment: int, stream) -> torch.Tensor:
    # Scratch for tensor descriptors built on the device (128 bytes per descriptor per program).
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA tensor descriptors can address these (B, T, H, D) tensors: Hopper or newer, 16-byte
    aligned base and strides (a descriptor's requirement)."""
    if not tensors[0].is_cuda or torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors
    )


def attention_fwd(q, k, v, causal, sm_scale, window, sinks, cu_seqlens, max_seqlen, tma=False):
    """Triton forward. q (B, Tq, Hq, D) or (total, Hq, D) with cu_seqlens. Returns (o like q, lse (B, Hq, Tq)).

    tma: load through tensor descriptors (TMA); None picks them where `_tma_ok` allows. Off by default:
    on the H200 the pointer loads were faster (0.92x at 4k, 0.98x at 16k for TMA), the descriptors
    being built per program on the device."""
    varlen = cu_seqlens is not None
    q4, k4, v4 = _as_4d(q, varlen), _as_4d(k, varlen), _as_4d(v, varlen)
    B, Tq, Hq, D = q4.shape
    Tk, Hk = k4.shape[1], k4.shape[2]
    o = torch.empty(q4.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Tq), dtype=torch.float32, device=q.device)
    tma = _tma_ok(q4, k4, v4, o) if tma is None else tma
    if tma and q.is_cuda:
        triton.set_allocator(_tma_allocator)
    n_prog = len(cu_seqlens) - 1 if varlen else B
    rows = max_seqlen if varlen else Tq
    cu = cu_seqlens.to(torch.int32) if varlen else q4  # a dummy pointer when dense
    grid = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), n_prog * Hq)  # noqa: E731
    # fmt: off
    _attn_fwd_kernel[grid](
        q4, k4, v4, o, lse, sinks if sinks is not None else q4, cu,
        *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o.stride()[:3], lse.stride(0), lse.stride(1),
        Hq, Hq // Hk, Tq, Tk, window or 0, sm_scale * LOG2E, _len_key(rows), Hq // Hk,
        HEAD_DIM=D, CAUSAL=causal, WINDOW=window is not None, SINK=sinks is not None, VARLEN=varlen, TMA=tma,
    )
    # fmt: on
    return (o[0] if varlen else o), lse


def attention_bwd(do, q, k, v, o, lse, causal, sm_scale, window, cu_seqlens, max_seqlen, tma=False):
    """Triton backward: (dq, dk, dv, delta) with delta = rowsum(do * o) shaped like lse.

    tma: stream Q/dO (dK/dV kernel) and K/V (dQ kernel) through tensor descriptors; None: where allowed
    (see the module docstring for what it measured)."""
    varlen = cu_seqlens is not None
    q4, k4, v4, o4, do4 = (_as_4d(t, varlen) for t in (q, k, v, o, do))
    B, Tq, Hq, D = q4.shape
    Tk, Hk = k4.shape[1], k4.shape[2]
    n_prog = len(cu_seqlens) - 1 if varlen else B
    rows, cols = (max_seqlen, max_seqlen) if varlen else (Tq, Tk)
    cu = cu_seqlens.to(torch.int32) if varlen else q4
    delta = torch.empty_like(lse)
    dq = torch.empty(q4.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k4.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v4.shape, dtype=v.dtype, device=v.device)
    tma = _tma_ok(q4, k4, v4, do4) if tma is None else tma
    if tma and q.is_cuda:
        triton.set_allocator(_tma_allocator)
    flags = dict(HEAD_DIM=D, CAUSAL=causal, WINDOW=window is not None, VARLEN=varlen, TMA=tma)
    strides = (
        *q4.stride()[:3],
        *k4.stride()[:3],
        *v4.stride()[:3],
        *do4.stride()[:3],
        lse.stride(0),
        lse.stride(1),
    )
    scalars = (Tq, Tk, window or 0, sm_scale * LOG2E, sm_scale, _len_key(rows), Hq // Hk)
    grid_kv = lambda meta: (triton.cdiv(cols, meta["BLOCK_N"]), n_prog * Hk)  # noqa: E731
    grid_q = lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]), n_prog * Hq)  # noqa: E731
    # fmt: off
    _attn_bwd_preprocess_kernel[(triton.cdiv(Tq, 64), B * Hq)](
        o4, do4, delta, *o4.stride()[:3], *do4.stride()[:3], delta.stride(0), delta.stride(1), Hq, Tq,
        HEAD_DIM=D, BLOCK_M=64,
    )
    _attn_bwd_dkdv_kernel[grid_kv](
        q4, k4, v4, do4, lse, delta, dk, dv, cu, *strides, *dk.stride()[:3], *dv.stride()[:3],
        Hk, Hq // Hk, *scalars, **flags,
    )
    _attn_bwd_dq_kernel[grid_q](
        q4, k4, v4, do4, lse, delta, dq, cu, *strides, *dq.stride()[:3], Hq, Hq // Hk, *scalars, **flags,
    )
    # fmt: on
    if varlen:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv, delta


# ----------------------------------------------------------------------------------- autograd Function
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, sinks, cu_seqlens, max_seqlen, causal, sm_scale, window, tma=False, tma_bwd=False
    ):
        o, lse = attention_fwd(q, k, v, causal, sm_scale, window, sinks, cu_seqlens, max_seqlen, tma)
        ctx.save_for_backward(q, k, v, o, lse, sinks, cu_seqlens)
        ctx.args = (causal, sm_scale, window, max_seqlen, tma_bwd)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks, cu_seqlens = ctx.saved_tensors
        causal, sm_scale, window, max_seqlen, tma = ctx.args
        dq, dk, dv, delta = attention_bwd(
            do, q, k, v, o, lse, causal, sm_scale, window, cu_seqlens, max_seqlen, tma
        )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # The sink's probability exp(sink - lse) times its logit gradient (0 - Delta), summed over rows.
            p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse * LN2)  # (B, Hq, Tq)
            dsinks = (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


# ------------------------------------------------------------------------------------------ public op
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over (B, T, H, D) tensors (or packed (total, H, D) with cu_seqlens); see the module doc."""
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be >= 1 (keys p - W < j <= p), got {window}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"attention: softmax_scale must be positive, got {softmax_scale}")
    triton_ok = attn_mask is None and q.shape[-1] in HEAD_DIMS and q.numel() > 0 and k.numel() > 0
    if triton_ok and use_triton(q, k, v, sinks, cu_seqlens):
        _check(q, k, v, sinks, cu_seqlens)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens is not None else 0
        return FlashAttention.apply(q, k, v, sinks, cu_seqlens, max_seqlen, causal, scale, window)
    return attention_ref(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, sinks=sinks, attn_mask=attn_mask,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
