"""FlashAttention backward in Triton: dQ, dK, dV (the sink's gradient is formed in kiln.kernels.attention).

Recomputing P from the forward's lse, as in the Triton fused-attention tutorial:
    Delta = rowsum(dO * O)                       (a preprocess kernel)
    P = 2^(s - lse);  dV = P^T dO;  dP = dO V^T;  dS = P (dP - Delta)
    dK = scale dS^T Q (one program per K/V block and K/V head, looping over the group's query heads,
    so GQA needs neither atomics nor repeated K/V);  dQ = scale dS K (one program per Q block)
The two kernels recompute P, 7 matmuls per (query block, key block) pair where an atomic-dQ design
needs 5; on the H200 a dK/dV kernel reduce-adding dQ in fp32 (TMA bulk reductions) measured slower
(0.8-0.95x), so dQ keeps its own kernel: deterministic, no atomics.

Under GQA a dK/dV program does `group` times the work of an MHA one, so its causal critical path (the
first key block, which every query sees) is `group` times longer. Two switches address that:
FLAT streams the group's (head, query block) pairs through one loop, one software pipeline per
program instead of three per head; HEAVY_FIRST orders the grid key-block-major so the longest
programs start first and the short ones fill the tail. Measured on the H200 (GQA 32q/8kv hd128
causal, whole backward): B16 x 1024 1.66 ms with neither, 1.46 FLAT, 1.64 HEAVY_FIRST, 1.39 both;
B2 x 8192 8.30, 7.95, 7.83, 7.46. (MHA is unchanged within 1-3%: a group of one.)

`tma_bwd=True` streams Q/dO (dK/dV kernel, one 3-D descriptor for all heads) and K/V (dQ kernel)
through TMA tensor descriptors; off by default: with the FLAT loop it measured 0.96-0.98x of the
pointer loads (hd128 causal, 1k-4k). Warp-specializing the unmasked loops (Triton 3.6
`warp_specialize=True`, with TMA) compiled and lost another 4-6%; it is not used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import tma_scratch
from kiln.kernels.attention_fwd import (
    _BIG,
    _KEY,
    _MID,
    _SMALL,
    _allowed,
    _as_4d,
    _bench,
    _configs,
    _doc_bounds,
    _key_ranges,
    _len_key,
    _load_rows,
    _prune,
    _tma_ok,
    launch,
)
from kiln.kernels.attention_ref import LOG2E
from kiln.kernels.launch import cdiv

# dK/dV: BLOCK_M is the query block streamed, BLOCK_N the key block a program owns (dK, dV accumulators
# of BLOCK_N x D fp32 each live in registers, which bounds BLOCK_N x D per warp). At hd128 on the H200
# 64 x 128 with 8 warps and 3 stages won at every swept point (2 or 4 stages: 2-6% slower; 64 x 64
# with 4 warps 10-20% slower; 32-row query blocks with 4 warps, the Triton tutorial's, 2-3x slower).
_DKDV_SPACE = [
    (32, 128, 4, 3, _SMALL),
    (64, 128, 8, 3, _SMALL),
    (64, 128, 8, 3, _MID),
    (64, 128, 8, 2, _MID),
    (32, 64, 4, 2, _BIG),
    (64, 64, 8, 2, _BIG),
]
# The dK/dV kernel's loop structure and grid order (see the module doc): both on, from the H200 sweep
# (GQA 32q/8kv hd128 causal, B16 x 1024: 1.39 ms against 1.66 for a loop per head in L2 order).
DKDV_SWITCHES = dict(FLAT=True, HEAVY_FIRST=True)
# dQ: BLOCK_M is the query block a program owns, BLOCK_N the key block streamed. At hd128, 3 stages
# beat 2 by 7-10% (GQA 1k: 1.29 against 1.39 ms for the whole backward); 128 x 128 is the runner-up.
_DQ_SPACE = [
    (128, 64, 8, 3, _SMALL),
    (128, 32, 4, 3, _SMALL),
    (128, 64, 8, 3, _MID),
    (128, 128, 8, 2, _MID),
    (64, 32, 4, 2, _BIG),
    (64, 64, 8, 2, _BIG),
]


# ------------------------------------------------------------------------------------ Triton kernels
# fmt: off
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
def _load_head_rows(src, h, row0, n_rows, stride_t, stride_h, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
                    MASK: tl.constexpr, TMA: tl.constexpr):
    """Rows [row0, row0 + ROWS) of head h of a (n_rows, H, HEAD_DIM) matrix: through a 3-D tensor
    descriptor (TMA), or pointers from base `src` (masked only when MASK)."""
    if TMA:
        return src.load([row0, h, 0]).reshape([ROWS, HEAD_DIM])
    else:
        return _load_rows(src + h * stride_h, row0, n_rows, stride_t, HEAD_DIM, ROWS, MASK, False)


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, stride_qt, stride_qh, stride_dot, stride_doh,
                    stride_lh, h0, n_heads, start, end, kpos, Tq, Tk, window, qk_scale, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    TMA: tl.constexpr):
    """Accumulate dK, dV (BLOCK_N, D) of one key block over query blocks [start, end) of query heads
    h0 .. h0 + n_heads - 1, all in one loop (one software pipeline). Computed transposed (keys by
    queries) so no operand needs a transpose in registers.
    The (head, block) pair is carried from one iteration to the next, not divided out of the loop
    index: with an empty range that division is by zero, undefined behaviour the compiler may reason
    from. (The dividing version hit an illegal address on the H200 exactly where the first range is
    empty, non-causal GQA; this form has no runtime division at all.)"""
    offs_m = tl.arange(0, BLOCK_M)
    h = h0
    m0 = start
    for _ in tl.range(0, n_heads * tl.cdiv(end - start, BLOCK_M)):
        rows = m0 + offs_m  # (BLOCK_M,)
        q = _load_head_rows(q_src, h, m0, Tq, stride_qt, stride_qh, HEAD_DIM, BLOCK_M, MASK, TMA)
        do = _load_head_rows(do_src, h, m0, Tq, stride_dot, stride_doh, HEAD_DIM, BLOCK_M, MASK, TMA)
        if MASK:
            lse = tl.load(lse_src + h * stride_lh + rows, mask=rows < Tq, other=0.0)
            delta = tl.load(delta_src + h * stride_lh + rows, mask=rows < Tq, other=0.0)
        else:
            lse = tl.load(lse_src + h * stride_lh + rows)
            delta = tl.load(delta_src + h * stride_lh + rows)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale  # (BLOCK_N, BLOCK_M)
        p_t = tl.math.exp2(s_t - lse[None, :])
        if MASK:
            ok = _allowed((rows + Tk - Tq)[None, :], kpos[:, None], Tk, window, CAUSAL, WINDOW) & (rows[None, :] < Tq)
            p_t = tl.where(ok, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))  # (BLOCK_N, BLOCK_M)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
        m0 += BLOCK_M
        wrap = m0 >= end  # past this head's last block: the next head's first
        h = tl.where(wrap, h + 1, h)
        m0 = tl.where(wrap, start, m0)
    return dk, dv


@triton.autotune(_configs(_DKDV_SPACE, (32, 64)), key=_KEY + ["TMA"], prune_configs_by={"early_config_prune": _prune},
                 do_bench=_bench)
@triton.jit
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_SEQLENS,  # dk, dv like k, v; lse, delta (B, Hq, Tq) fp32
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_dob, stride_dot, stride_doh, stride_lb, stride_lh,
    stride_dkb, stride_dkt, stride_dkh, stride_dvb, stride_dvt, stride_dvh,
    Hq, Hk, group, Tq, Tk, window, qk_scale, sm_scale, LEN_KEY, GQA_KEY,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, VARLEN: tl.constexpr,
    TMA: tl.constexpr,
    FLAT: tl.constexpr,  # one loop over the group's (head, query block) pairs; else a loop per head
    HEAVY_FIRST: tl.constexpr,  # grid (B * Hk, key blocks): every first key block (the longest) starts first
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    if HEAVY_FIRST:
        pid_n = tl.program_id(1)
        pid_bh = tl.program_id(0)
    else:  # key blocks of one (b, kv head) side by side: they share their Q/dO stream in L2
        pid_n = tl.program_id(0)
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
    q_src = Q + bb * stride_qb + row0 * stride_qt  # (Tq, Hq, D) of this sequence
    do_src = DO + bb * stride_dob + row0 * stride_dot
    if TMA:  # 3-D descriptors (rows, heads, D): one per program serves every head of the group
        q_src = tl.make_tensor_descriptor(q_src, [Tq, Hq, HEAD_DIM], [stride_qt, stride_qh, 1],
                                          [BLOCK_M, 1, HEAD_DIM])
        do_src = tl.make_tensor_descriptor(do_src, [Tq, Hq, HEAD_DIM], [stride_dot, stride_doh, 1],
                                           [BLOCK_M, 1, HEAD_DIM])
    lse_src = LSE + bb * stride_lb + row0
    delta_src = DELTA + bb * stride_lb + row0

    lo, full_lo, full_hi, hi = _query_ranges(n0, Tq, Tk, window, BLOCK_M, BLOCK_N, CAUSAL, WINDOW)
    if FLAT:
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, stride_qt, stride_qh, stride_dot,
                                 stride_doh, stride_lh, hk * group, group, lo, full_lo, offs_n, Tq, Tk, window,
                                 qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL, WINDOW, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, stride_qt, stride_qh, stride_dot,
                                 stride_doh, stride_lh, hk * group, group, full_lo, full_hi, offs_n, Tq, Tk, window,
                                 qk_scale, HEAD_DIM, BLOCK_M, False, CAUSAL, WINDOW, TMA)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, stride_qt, stride_qh, stride_dot,
                                 stride_doh, stride_lh, hk * group, group, full_hi, hi, offs_n, Tq, Tk, window,
                                 qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL, WINDOW, TMA)
    else:
        for g in range(group):  # the query heads sharing this K/V head accumulate into one dK, dV
            h = hk * group + g
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, stride_qt, stride_qh,
                                     stride_dot, stride_doh, stride_lh, h, 1, lo, full_lo, offs_n, Tq, Tk, window,
                                     qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL, WINDOW, TMA)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, stride_qt, stride_qh,
                                     stride_dot, stride_doh, stride_lh, h, 1, full_lo, full_hi, offs_n, Tq, Tk,
                                     window, qk_scale, HEAD_DIM, BLOCK_M, False, CAUSAL, WINDOW, TMA)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_src, do_src, lse_src, delta_src, stride_qt, stride_qh,
                                     stride_dot, stride_doh, stride_lh, h, 1, full_hi, hi, offs_n, Tq, Tk, window,
                                     qk_scale, HEAD_DIM, BLOCK_M, True, CAUSAL, WINDOW, TMA)
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
    for n0 in tl.range(start, end, BLOCK_N):
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


# ------------------------------------------------------------------------------------------ launcher
def attention_bwd(
    do,
    q,
    k,
    v,
    o,
    lse,
    causal,
    sm_scale,
    window,
    cu_seqlens,
    max_seqlen,
    tma=False,
    dkdv_config=None,
    dq_config=None,
):
    """Triton backward: (dq, dk, dv, delta) with delta = rowsum(do * o) shaped like lse.

    tma: stream Q/dO (dK/dV kernel) and K/V (dQ kernel) through tensor descriptors; None: where allowed
    (see the module docstring for what it measured). dkdv_config, dq_config: one explicit config per
    kernel instead of autotuning (sweeps; see attention_fwd.launch); dkdv_config may set FLAT and
    HEAVY_FIRST."""
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
        triton.set_allocator(tma_scratch)
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

    def grid_kv(meta):
        n_blocks = cdiv(cols, meta["BLOCK_N"])
        return (n_prog * Hk, n_blocks) if meta["HEAVY_FIRST"] else (n_blocks, n_prog * Hk)

    grid_q = lambda meta: (cdiv(rows, meta["BLOCK_M"]), n_prog * Hq)  # noqa: E731
    # fmt: off
    _attn_bwd_preprocess_kernel[(cdiv(Tq, 64), B * Hq)](
        o4, do4, delta, *o4.stride()[:3], *do4.stride()[:3], delta.stride(0), delta.stride(1), Hq, Tq,
        HEAD_DIM=D, BLOCK_M=64,
    )
    launch(_attn_bwd_dkdv_kernel, grid_kv,
           (q4, k4, v4, do4, lse, delta, dk, dv, cu, *strides, *dk.stride()[:3], *dv.stride()[:3], Hq, Hk,
            Hq // Hk, *scalars), {**flags, **DKDV_SWITCHES}, dkdv_config)
    launch(_attn_bwd_dq_kernel, grid_q,
           (q4, k4, v4, do4, lse, delta, dq, cu, *strides, *dq.stride()[:3], Hq, Hq // Hk, *scalars), flags,
           dq_config)
    # fmt: on
    if varlen:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv, delta
