"""FlashAttention forward in Triton, and the block arithmetic the backward shares.

Semantics, shapes and masks are kiln.kernels.attention_ref's. FlashAttention-2: per block of BLOCK_M
queries, stream K/V blocks of BLOCK_N keys with an online softmax in base 2 (log2(e) folded into the
scale, so exp2 does the work):
    s = q k^T * scale * log2(e);  m' = max(m, rowmax s);  l' = l 2^(m - m') + rowsum 2^(s - m')
    acc' = acc 2^(m - m') + 2^(s - m') v;   o = acc / l;   lse = m + log2 l   (saved for the backward)
A sink joins as a starting state: m = sink * log2(e), l = 1, acc = 0 (a logit whose value is zero).
Key blocks are split into ranges that need no masking (the bulk) and ranges that do (the causal
diagonal, the window's far edge, the ragged end), so the bulk loop runs without any mask arithmetic.
Varlen, window and sinks are constexpr switches: the plain causal/full kernel compiles without them.

Loads go through masked pointers, or with `tma=True` through TMA tensor descriptors (Hopper; one
descriptor per sequence, whose shape clips ragged ends). On the H200 TMA measured 0.92-0.98x of the
pointer loads in one session and 1.02-1.03x in the next (64 x 64 blocks), so it stays off by default.
Triton 3.6's warp specialization of the bulk loop (`tl.range(..., warp_specialize=True)`) compiles
for this kernel but was 12-35% slower (with pointer or TMA loads, 64- or 128-row blocks); it is not
used. Inputs: fp16, bf16, fp32, head dims 16..256, last dim contiguous; within one sequence row
offsets are int32 (Tq * Hq * D < 2**31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import tma_scratch
from kiln.kernels.attention_ref import LOG2E
from kiln.kernels.dispatch import interpreting
from kiln.kernels.launch import cdiv, pow2


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
# From the H200 runs: 64-row forward blocks with 4 warps win up to 4k (more programs share an SM, so
# one's softmax overlaps another's matmuls: 428 TFLOP/s at 4 x 4096 hd128 causal against 415 for
# 128 x 128 blocks, 404 for 128 x 64); at 16k 128 x 128 blocks with 8 warps and 3 stages win (516
# against 493). 4 stages lost (307 at 4k).
_FWD_SPACE = [
    (64, 64, 4, 3, _SMALL),
    (64, 64, 4, 4, _SMALL),
    (64, 64, 4, 3, _MID),
    (64, 32, 4, 3, _MID),
    (128, 128, 8, 3, _MID),
    (128, 64, 8, 3, _MID),
    (64, 64, 4, 2, _BIG),
    (128, 64, 8, 2, _BIG),
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
    for n0 in tl.range(start, end, BLOCK_N):
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


# Triton specializes an int argument on its value class (== 1, divisible by 16) and compiles one binary per
# class. The lengths (and the LSE strides that follow Tq) change with every packed prefill step, so each
# class would be compiled the first time a served step happens to hit it (seconds, inside a step); they
# only bound masks and address the (B, Hq, Tq) LSE rows, where the specialization buys nothing.
_UNSPECIALIZED = ["Tq", "Tk", "window", "stride_lb", "stride_lh"]


@triton.autotune(_configs(_FWD_SPACE, (64, 32)), key=_KEY + ["TMA"], prune_configs_by={"early_config_prune": _prune},
                 do_bench=_bench)
@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _attn_fwd_kernel(
    Q, K, V, O, LSE,  # q (B, Tq, Hq, D); k, v (B, Tk, Hk, D); o like q; lse (B, Hq, Tq) fp32, log2 units
    SINKS, CU_SEQLENS,  # sinks (Hq,) or a dummy; cu_seqlens (B+1,) int32 when VARLEN (then B = documents)
    CU_SEQLENS_K,  # (B+1,) int32 key bounds when KV_BOUNDS (keys = a cached prefix + the new rows), else a dummy
    stride_qb, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh, stride_lb, stride_lh,  # element strides; the last dim is contiguous
    Hq, group, Tq, Tk, window, qk_scale,  # group = Hq // Hk; qk_scale = softmax scale * log2(e)
    LEN_KEY, GQA_KEY,  # autotuning keys only (a length bucket, the group size)
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr, SINK: tl.constexpr,
    VARLEN: tl.constexpr, KV_BOUNDS: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Heaviest (last, under causal masking) query blocks first: a shorter tail at the end of the grid.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    row0, Tq, Tk = _doc_bounds(CU_SEQLENS, b, Tq, Tk, VARLEN)
    krow0 = row0
    if KV_BOUNDS:  # this document's keys: its cached prefix, then its Tq new rows (causal aligns to the end)
        krow0 = tl.load(CU_SEQLENS_K + b)
        Tk = tl.load(CU_SEQLENS_K + b + 1) - krow0
    m0 = pid_m * BLOCK_M
    if m0 >= Tq:
        return
    bb = b.to(tl.int64) * (1 - VARLEN)  # varlen packs documents in one batch row
    row0 = row0.to(tl.int64)
    krow0 = krow0.to(tl.int64)
    q_base = Q + bb * stride_qb + row0 * stride_qt + h * stride_qh
    k_base = K + bb * stride_kb + krow0 * stride_kt + (h // group) * stride_kh
    v_base = V + bb * stride_vb + krow0 * stride_vt + (h // group) * stride_vh
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
# fmt: on


# ------------------------------------------------------------------------------------------ launcher
_LEN_KEY_CAP = 8192


def _len_key(n: int) -> int:
    """Autotuning length bucket: the next power of two, capped (long sequences share a config)."""
    return min(pow2(max(n, 1)), _LEN_KEY_CAP)


def tuning_lengths(max_len: int) -> list[int]:
    """One query length per autotuning bucket a call of at most `max_len` rows (the longest document) can
    fall in: calling the forward once at each tunes and compiles every config it will use, e.g. at an
    inference engine's start rather than in the first served step that reaches a new bucket."""
    return [1 << i for i in range(_len_key(max_len).bit_length())]


def _as_4d(x: torch.Tensor, varlen: bool) -> torch.Tensor:
    x = x[None] if varlen else x
    return x if x.stride(-1) == 1 else x.contiguous()


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether TMA tensor descriptors can address these (B, T, H, D) tensors: Hopper or newer, 16-byte
    aligned base and strides (a descriptor's requirement)."""
    if not tensors[0].is_cuda or torch.cuda.get_device_capability(tensors[0].device)[0] < 9:
        return False
    return all(
        t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors
    )


def launch(kernel, grid, args, flags, config):
    """kernel[grid](*args, **flags), autotuned; or, with `config` (a dict of BLOCK_M, BLOCK_N,
    num_warps, num_stages and any kernel switch), that one config with no autotuning (sweeps)."""
    if config is None:
        kernel[grid](*args, **flags)
    else:
        kernel.fn[grid](*args, **{**flags, **config})


def attention_fwd(
    q,
    k,
    v,
    causal,
    sm_scale,
    window,
    sinks,
    cu_seqlens,
    max_seqlen,
    tma=False,
    config=None,
    cu_seqlens_k=None,
):
    """Triton forward. q (B, Tq, Hq, D) or (total, Hq, D) with cu_seqlens. Returns (o like q, lse (B, Hq, Tq)).

    cu_seqlens_k (varlen only): separate key bounds, k and v packed as (total_k, Hk, D); document b's
    queries are the last rows of its keys (prefill over a cached prefix). None: keys = queries' rows.

    tma: load through tensor descriptors (TMA); None picks them where `_tma_ok` allows. Off by default:
    on the H200 the pointer loads were faster (0.92x at 4k, 0.98x at 16k for TMA), the descriptors
    being built per program on the device. config: see `launch`."""
    varlen = cu_seqlens is not None
    q4, k4, v4 = _as_4d(q, varlen), _as_4d(k, varlen), _as_4d(v, varlen)
    B, Tq, Hq, D = q4.shape
    Tk, Hk = k4.shape[1], k4.shape[2]
    o = torch.empty(q4.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((B, Hq, Tq), dtype=torch.float32, device=q.device)
    tma = _tma_ok(q4, k4, v4, o) if tma is None else tma
    if tma and q.is_cuda:
        triton.set_allocator(tma_scratch)
    n_prog = len(cu_seqlens) - 1 if varlen else B
    rows = max_seqlen if varlen else Tq
    cu = cu_seqlens.to(torch.int32) if varlen else q4  # a dummy pointer when dense
    kv_bounds = varlen and cu_seqlens_k is not None
    cu_k = cu_seqlens_k.to(torch.int32) if kv_bounds else cu
    grid = lambda meta: (cdiv(rows, meta["BLOCK_M"]), n_prog * Hq)  # noqa: E731
    # fmt: off
    args = (
        q4, k4, v4, o, lse, sinks if sinks is not None else q4, cu, cu_k,
        *q4.stride()[:3], *k4.stride()[:3], *v4.stride()[:3], *o.stride()[:3], lse.stride(0), lse.stride(1),
        Hq, Hq // Hk, Tq, Tk, window or 0, sm_scale * LOG2E, _len_key(rows), Hq // Hk,
    )
    flags = dict(HEAD_DIM=D, CAUSAL=causal, WINDOW=window is not None, SINK=sinks is not None, VARLEN=varlen,
                 KV_BOUNDS=kv_bounds, TMA=tma)
    launch(_attn_fwd_kernel, grid, args, flags, config)
    # fmt: on
    return (o[0] if varlen else o), lse
