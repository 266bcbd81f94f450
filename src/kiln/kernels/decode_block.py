"""One token's pre-norm decoder block in one launch: the batch-1 decode step as one kernel per layer.

    h_mid = h + o_proj(attention(rope(qkv_proj(rmsnorm(h)))))       (k, v written into the paged cache)
    h_out = h_mid + down_proj(silu(gate) * up),  [gate | up] = gate_up_proj(rmsnorm(h_mid))

Shapes: h (1, d) the residual stream; W_qkv ((Hq + 2 Hk) D, d) with an optional bias, W_o (d, Hq D),
W_gate_up (2F, d) holding [gate | up], W_down (d, F), all K-contiguous (nn.Linear's layout); norm weights
(d,); cos, sin (R, D/2) rotary tables and rows (1,) the token's row; k_cache, v_cache (pages, PAGE, Hk, D);
slots (1,) the token's cache slot (< 0: write nothing); block_table (1, max_pages); seq_lens (1,) keys
including this token. Returns h_out (1, d) in h's dtype. Llama / Qwen2 / Mistral blocks: RMSNorm, RoPE, a
gated MLP, no q/k norm, no attention sinks, no output biases (`decode_block_supported` says which).

Why: at one token the step streams 3.1 GB of weights (Qwen2.5-1.5B shape) through ten kernels a layer, and
each boundary costs ~2 us of launch, drain and ramp-up while its work is 1.5-14 us (H200,
docs/perf/inference.md: 43 us a layer against 22 us of weight reads at the copy rate). Here PER_SM
persistent programs an SM run the five phases of the block, separated by grid-wide barriers instead of
kernel boundaries:

  0  rstd of h; each program owns PAIRS rotation pairs of one q, k or v head (2 PAIRS rows of W_qkv), forms
     them over K as the one-row gemv does, adds the bias, rotates q and k and stores q to a scratch row or
     k and v into their cache slot (kiln.kernels.rope's epilogue, shared with `qkv_rope`)
  1  split-KV decode attention: program (kv head, split) for splits x Hk programs, split s over the 64-key
     tiles s, s + splits, ... (kiln.kernels.decode_attention's tile); the last split of a kv head to arrive
     at its counter combines the group's partials (the one-pass form's reduction) into the attention output
  2  W_o: each program owns cdiv(d, P) rows, adds the residual: h_mid
  3  rstd of h_mid; each program owns cdiv(F, P) features (their gate and up rows interleaved), SwiGLU in
     the epilogue (kiln.kernels.swiglu's expression)
  4  W_down: cdiv(d, P) rows a program, adds h_mid: h_out

Every weight phase is one K loop over the program's rows with `STAGES` tiles of W in flight (cp.async); no
program owns more than one row block, so the loads are balanced to a row. With PRELOAD_TILES each phase's
first tile is loaded into registers right after the program arrives at the barrier ahead of the phase, so it
is on its way while the slowest program finishes.

Measured on the H200 (docs/perf/inference.md, "One launch a block at batch 1"): a tie at best with the
separate kernels (0.98-1.00x at the defaults, whole decoder replays), so the model takes it only with
KILN_DECODE_BLOCK=fused. The four barriers cost 0.75-1.5 us each and one or two programs an SM stream the
large projections at ~3.5 TB/s, where the separate gemv's thousands of small programs reach 3.8.

Rounding follows the separate kernels: the normalized input is rounded where kiln's RMSNorm kernel rounds
it, every projection's output is rounded to the stream's dtype before its epilogue, the residual adds and
SwiGLU round as kiln's add + RMSNorm and SwiGLU kernels do. The float32 sums run in another order than
kiln's decode matmuls (other tiles), so results agree with the separate kernels to bf16 rounding, not bit
for bit.

The grid barrier (GPU, all five phases in one launch): every program arrives at an int32 counter with a
release atomic after a bar.sync (its threads' stores ordered before it, as the one-pass decode attention
does) and spins on acquire reads until all P programs have arrived at this barrier (targets P, 2P, ..., 4P);
data another program wrote is then read with ld.global.cg (L2, never a stale L1 line). After the last phase
each program arrives once more, and the one that makes the count 5P resets it to zero: every other program
has left its last spin by then, so the reset cannot strand one. An arrival's release orders every earlier
access of its program before it, loads included, so a tile meant to load across a barrier is issued after
the arrival. The launch is cooperative (`launch_cooperative_grid`): the driver refuses a grid whose programs
cannot all be resident at once ("too many blocks in cooperative launch"), rather than letting a barrier
wait forever. P is PER_SM times the SM count.

The interpreter runs programs one after another, so a barrier would wait forever: there the launcher runs
the phases as five launches of the same kernel (FIRST = LAST = phase), with the kernel boundary as the
barrier. The GPU tests compare the one-launch form with the five-launch form bit for bit, and both with the
reference.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels._common import rope_pair_tables, rope_pairs_store
from kiln.kernels.attention import LOG2E
from kiln.kernels.decode_attention import (
    _combine_splits,
    _online_tile,
    _paged_kv,
    _paged_tile,
    combine_step,
    decode_attention_ref,
    offsets_fit_int32,
    split_counters,
)
from kiln.kernels.dispatch import interpreting, sm_count, use_triton
from kiln.kernels.launch import CachedLaunch, cdiv, pow2
from kiln.kernels.paged_kv import paged_kv_write_ref

PHASES = 5
_STAMPS = tl.constexpr(10)  # timeline stamps a program: before and after each phase's work
STAMPS = _STAMPS.value
TILE = 8192  # real W elements a program loads per K step (16 KB of bf16): STAGES of them in flight
STAGES = 4
WARPS = 4
PER_SM = 2  # programs an SM (all resident at once: the barriers need it)
PRELOAD_TILES = True  # each weight phase's first tile loaded into registers before the barrier ahead of it
ATTN_BLOCK_N = 64  # keys per attention tile (a split's chunk is whole tiles)
# Programs of an interpreted launch (CPU tests): more than the test models' q/k/v heads, fewer than their
# rows, so that every phase has programs owning several rows and programs owning none.
INTERPRET_PROGRAMS = 12


def block_programs(device: torch.device) -> int:
    """Programs of a launch: PER_SM an SM on a GPU (read at the call, so that a sweep may set it)."""
    return PER_SM * sm_count(device) if device.type == "cuda" else INTERPRET_PROGRAMS


# ----------------------------------------------------------------------------------------- reference
def decode_block_ref(
    h, norm1, w_qkv, b_qkv, w_o, norm2, w_gate_up, w_down, eps, cos, sin, rows, k_cache, v_cache, slots,
    block_table, seq_lens, n_heads, *, window=None, interleaved=False,
) -> torch.Tensor:  # fmt: skip
    """The block in plain torch, in the model's order and at the separate kernels' rounding points (float32
    math, or float64 for a float64 oracle); writes k and v into the caches like the kernel. (Written out here:
    a kernel module takes no helper from another op's module, tests/kernels/test_imports.py.)"""
    Hk, D = k_cache.shape[-2], k_cache.shape[-1]
    acc = torch.promote_types(h.dtype, torch.float32)
    rnd = lambda t: t.to(h.dtype).to(acc)  # noqa: E731 - a stored activation's rounding
    lin = lambda x, w, b=None: rnd(F.linear(x, w.to(acc), None if b is None else b.to(acc)))  # noqa: E731

    def rmsnorm(x, w):  # kiln's RMSNorm: round(round(x * rstd) * w)
        return rnd(rnd(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w.to(acc))

    def rotate(x):  # (heads, D) at the token's table row, as rope_kv_write rotates it
        c, s = cos[rows[0]].to(acc), sin[rows[0]].to(acc)
        a, b = (x[:, 0::2], x[:, 1::2]) if interleaved else x.chunk(2, dim=-1)
        first, second = a * c - b * s, a * s + b * c
        out = torch.stack((first, second), -1).flatten(-2) if interleaved else torch.cat((first, second), -1)
        return rnd(out)

    x = h.to(acc)
    q, k, v = lin(rmsnorm(x, norm1), w_qkv, b_qkv)[0].split([n_heads * D, Hk * D, Hk * D])
    q, k = rotate(q.view(n_heads, D)), rotate(k.view(Hk, D))
    paged_kv_write_ref(k_cache, v_cache, k[None], v.view(1, Hk, D), slots)
    y = decode_attention_ref(q[None].to(h.dtype), k_cache, v_cache, block_table, seq_lens, window=window)
    mid = rnd(lin(y.reshape(1, -1).to(acc), w_o) + x)
    gate, up = lin(rmsnorm(mid, norm2), w_gate_up).chunk(2, dim=-1)
    a = rnd(gate * torch.sigmoid(gate) * up)
    return rnd(lin(a, w_down) + mid).to(h.dtype)


# ------------------------------------------------------------------------------------ Triton kernel
# fmt: off
@triton.jit
def _rstd(X, n, eps, BLOCK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of the (n,) vector at X, read from L2 (another program may have written
    it)."""
    acc = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, n, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += x * x
    return tl.rsqrt(tl.sum(acc, 0) / n + eps)


@triton.jit
def _normed(X, G, offs, ok, rstd):
    """A chunk of rmsnorm(x) as kiln's RMSNorm kernel rounds it: round(round(x * rstd) * gamma), float32."""
    x = tl.load(X + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    dt = X.dtype.element_ty
    return ((x * rstd).to(dt).to(tl.float32) * g).to(dt).to(tl.float32)


@triton.jit
def _w_tile(w_rows, r_ok, k0, K, BK: tl.constexpr):
    """The (R, BK) tile of W's rows at w_rows (R,) pointers (r_ok: which exist) from column k0."""
    offs = k0 + tl.arange(0, BK)
    return tl.load(w_rows[:, None] + offs[None, :], mask=r_ok[:, None] & (offs < K)[None, :], other=0.0)


@triton.jit
def _x_chunk(X, G, rstd, k0, K, NORM: tl.constexpr, BK: tl.constexpr):
    """(BK,) float32 of the (K,) vector at X from column k0 (from L2), normalized with gamma G when NORM."""
    offs = k0 + tl.arange(0, BK)
    ok = offs < K
    if NORM:
        x = _normed(X, G, offs, ok, rstd)
    else:
        x = tl.load(X + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    return x


@triton.jit
def _rows_dot(w_rows, r_ok, X, G, rstd, K, w0, NORM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr,
              STAGES: tl.constexpr, PRE: tl.constexpr, LOOP: tl.constexpr = True):
    """(R,) float32 sum_k W[r, k] x[k] for the rows at w_rows (R,) pointers (r_ok: which exist), x the (K,)
    vector at X (from L2), normalized on the fly with gamma G and rstd when NORM. One K loop, STAGES tiles of
    (R, BK) in flight. PRE: w0 is the first tile, loaded by the caller ahead of time (before a barrier)."""
    acc = tl.zeros((R, BK), tl.float32)
    k_first = 0
    if PRE:
        acc += w0.to(tl.float32) * _x_chunk(X, G, rstd, 0, K, NORM, BK)[None, :]
        k_first = BK
    if LOOP:  # else K fits the preloaded tile: no loop, so no pipeline buffers for one
        for k0 in tl.range(k_first, K, BK, num_stages=STAGES):
            acc += _w_tile(w_rows, r_ok, k0, K, BK).to(tl.float32) * _x_chunk(X, G, rstd, k0, K, NORM, BK)[None, :]
    return tl.sum(acc, 1)


@triton.jit
def _stamp(TIMES, k, TIMING: tl.constexpr):
    """With TIMING, the global timer (ns) into this program's slot k of TIMES (programs, STAMPS) int64: where
    the phases' time goes (bench/experiments/decode_block_sweep.py --timeline)."""
    if TIMING:
        pid = tl.program_id(0)
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                      pack=1)
        tl.store(TIMES + pid * _STAMPS + k, t)


@triton.jit
def _arrive(BAR):
    """This program's arrival at the grid barrier (module doc: the ordering). A release orders every earlier
    access of the program's, loads included, before it: a weight tile meant to load across the barrier is
    issued after the arrival, not before, or the arrival would wait for it."""
    tl.debug_barrier()
    tl.atomic_add(BAR, 1, sem="release", scope="gpu")


@triton.jit
def _wait(BAR, target):
    """Spin until the grid's programs have arrived `target` times in all (acquire loads: what they stored
    before arriving is visible after)."""
    seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _grid_sync(BAR, target):
    """Arrive and wait: the barrier with nothing to load across it."""
    _arrive(BAR)
    _wait(BAR, target)


@triton.jit
def _sync_with_tile(BAR, target, w_rows, r_ok, K, BK: tl.constexpr, PRE: tl.constexpr):
    """The barrier ahead of a weight phase: arrive, then (PRE) issue the phase's first (R, BK) tile of the rows
    at w_rows, then wait; returns the tile (0.0 without PRE) for _rows_dot's w0."""
    _arrive(BAR)
    w0 = 0.0
    if PRE:
        w0 = _w_tile(w_rows, r_ok, 0, K, BK)
    _wait(BAR, target)
    return w0


@triton.jit
def _decode_block_kernel(
    H, H_MID, H_OUT,  # (d,) the stream in; after attention (scratch); out
    G1, W_QKV, B_QKV, W_O, G2, W_GU, W_D,  # norm weights (d,), projections (N, K) K-contiguous, bias (N,)
    COS, SIN, ROWS, K_CACHE, V_CACHE, SLOTS, TABLE, SEQ_LENS,
    Q_BUF, O_PART, LSE_PART, ATTN, ACT,  # scratch: q (Hq D); partials (Hq, splits, D), (Hq, splits) fp32; (Hq D); (F)
    COUNTERS,  # int32, zero on entry and left zero: [0] the grid barrier, [1 + hk] kv head hk's splits
    TIMES,  # TIMING: (programs, STAMPS) int64 timestamps (else unused)
    eps, qk_scale, window, capacity,  # capacity: the block table's keys (pages x PAGE_SIZE)
    d, F, Hq, Hk, splits, rows_o, feats, rows_d,
    stride_qkv, stride_o, stride_gu, stride_d, stride_cos, stride_sin,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr,
    WINDOW: tl.constexpr, ADDR32: tl.constexpr,
    PAIRS: tl.constexpr, BK_QKV: tl.constexpr, R_O: tl.constexpr, BK_O: tl.constexpr,
    R_GU: tl.constexpr, BK_GU: tl.constexpr, R_D: tl.constexpr, BK_D: tl.constexpr, BK_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, GROUP_P: tl.constexpr, SPLIT_STEP: tl.constexpr, STAGES: tl.constexpr,
    TIMING: tl.constexpr,  # stamp the global timer before and after each phase's work
    PRELOAD: tl.constexpr,  # load each weight phase's first tile before the barrier ahead of it
    QKV_ONE_STEP: tl.constexpr,  # BK_QKV covers all of d
    FIRST: tl.constexpr, LAST: tl.constexpr,  # the phases this launch runs (grid barriers between them)
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    half = HEAD_DIM // 2
    # Each phase's rows of this program, known up front: a phase's first tile loads a barrier early.
    per_head = half // PAIRS
    qkv_ok = pid < (Hq + 2 * Hk) * per_head
    h = pid // per_head  # q heads, then k heads, then v heads
    jp = (pid % per_head) * PAIRS + tl.arange(0, PAIRS)  # (PAIRS,) pair indices within the head
    if INTERLEAVED:
        col_a, col_b = 2 * jp, 2 * jp + 1
    else:
        col_a, col_b = jp, jp + half
    n_qkv = h * HEAD_DIM + tl.reshape(tl.join(col_a, col_b), (2 * PAIRS,))  # W rows, (pair, member) order
    i_o = tl.arange(0, R_O)
    r_o = pid * rows_o + i_o
    ok_o = (i_o < rows_o) & (r_o < d)
    i_gu = tl.arange(0, R_GU)  # block row i: feature f0 + i // 2, its gate (even i) or up (odd) row
    f_gu = pid * feats + i_gu // 2
    ok_gu = (i_gu // 2 < feats) & (f_gu < F)
    n_gu = f_gu + (i_gu % 2) * F
    i_d = tl.arange(0, R_D)
    r_d = pid * rows_d + i_d
    ok_d = (i_d < rows_d) & (r_d < d)
    dt = H.dtype.element_ty
    w_qkv = W_QKV + n_qkv.to(tl.int64) * stride_qkv
    w_o = W_O + r_o.to(tl.int64) * stride_o
    w_gu = W_GU + n_gu.to(tl.int64) * stride_gu
    w_d = W_D + r_d.to(tl.int64) * stride_d
    # ---- 0: rmsnorm + q/k/v projection + bias + RoPE + K/V write
    if FIRST <= 0 and LAST >= 0:
        _stamp(TIMES, 0, TIMING)
        if qkv_ok:
            w0 = 0.0
            if PRELOAD:  # W's first tile in flight while the stream's norm loads
                w0 = _w_tile(w_qkv, n_qkv >= 0, 0, d, BK_QKV)
            c, s, slot = rope_pair_tables(COS, SIN, ROWS, stride_cos, stride_sin, SLOTS, jp)
            rstd = _rstd(H, d, eps, BK_NORM)
            y = _rows_dot(w_qkv, n_qkv >= 0, H, G1, rstd, d, w0, True, 2 * PAIRS, BK_QKV, STAGES, PRELOAD,
                          not PRELOAD or not QKV_ONE_STEP)
            if HAS_BIAS:
                y += tl.load(B_QKV + n_qkv).to(tl.float32)
            rope_pairs_store(y, h, col_a, col_b, Hq, Hk, Q_BUF + h * HEAD_DIM, c, s, slot, K_CACHE, V_CACHE,
                              stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch, PAGE_SIZE, PAIRS)
    _stamp(TIMES, 1, TIMING)
    w0_o = 0.0
    if FIRST < 1 and LAST >= 1:  # o's first tile loads while the attention programs run
        w0_o = _sync_with_tile(COUNTERS, P, w_o, ok_o, Hq * HEAD_DIM, BK_O, PRELOAD and LAST >= 2)
    _stamp(TIMES, 2, TIMING)
    # ---- 1: split-KV attention; the last split of each kv head combines the group's partials
    if FIRST <= 1 and LAST >= 1:
        if pid < Hk * splits:
            hk = pid // splits
            split = pid % splits
            group = Hq // Hk
            offs_h = tl.arange(0, BLOCK_H)
            offs_d = tl.arange(0, HEAD_DIM)
            hq = hk * group + offs_h
            h_ok = offs_h < group
            # Split s owns the BLOCK_N-key tiles s, s + splits, ... of the table: its first tile's page
            # indices and K/V depend on no load but the table's, so they are in flight with the key count
            # and q.
            n_keys = tl.load(SEQ_LENS)
            q = tl.load(Q_BUF + hq[:, None] * HEAD_DIM + offs_d[None, :], mask=h_ok[:, None], other=0.0,
                        cache_modifier=".cg")
            t = split * BLOCK_N + tl.arange(0, BLOCK_N)
            in_table = t < capacity
            page = tl.load(TABLE + t // PAGE_SIZE, mask=in_table, other=0)
            k, v = _paged_kv(K_CACHE, V_CACHE, page, t, in_table, offs_d, hk, stride_kcp, stride_kct, stride_kch,
                             stride_vcp, stride_vct, stride_vch, PAGE_SIZE, ADDR32)
            first = 0
            if WINDOW:
                first = tl.maximum(n_keys - window, 0)
            m_i = tl.zeros([BLOCK_H], tl.float32) - 1.0e30
            l_i = tl.zeros([BLOCK_H], tl.float32)
            acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
            m_i, l_i, acc = _online_tile(q, k, v, (t < n_keys) & (t >= first), m_i, l_i, acc, qk_scale)
            for n0 in range((split + splits) * BLOCK_N, n_keys, splits * BLOCK_N):  # past splits x BLOCK_N keys
                t = n0 + tl.arange(0, BLOCK_N)
                t_ok = (t < n_keys) & (t >= first)
                page = tl.load(TABLE + t // PAGE_SIZE, mask=t_ok, other=0)
                m_i, l_i, acc = _paged_tile(q, K_CACHE, V_CACHE, page, t, t_ok, offs_d, hk, m_i, l_i, acc, qk_scale,
                                            stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
                                            PAGE_SIZE, ADDR32)
            has = l_i > 0.0
            acc = acc / tl.where(has, l_i, 1.0)[:, None]
            lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            # every split stores (an empty one 0 and -inf), so the combine reads a prefix of splits
            tl.store(O_PART + (hq[:, None] * splits + split) * HEAD_DIM + offs_d[None, :], acc, mask=h_ok[:, None])
            tl.store(LSE_PART + hq * splits + split, lse, mask=h_ok)
            tl.debug_barrier()
            counter = COUNTERS + 1 + hk
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == splits - 1:
                tl.store(counter, 0)  # every split has arrived: zero for the next layer's launch
                n_live = tl.minimum(splits, tl.cdiv(n_keys, BLOCK_N))  # splits that may hold keys: a prefix
                _combine_splits(O_PART, LSE_PART, O_PART, ATTN, 0, hk * group, group, n_live,
                                0, splits * HEAD_DIM, HEAD_DIM, 0, splits, 0, HEAD_DIM,
                                HEAD_DIM, GROUP_P, SPLIT_STEP, False)
    _stamp(TIMES, 3, TIMING)
    if FIRST < 2 and LAST >= 2:
        _grid_sync(COUNTERS, 2 * P)
    _stamp(TIMES, 4, TIMING)
    # ---- 2: o projection + the residual add: h_mid
    if FIRST <= 2 and LAST >= 2:
        y = _rows_dot(w_o, ok_o, ATTN, ATTN, 0.0, Hq * HEAD_DIM, w0_o, False, R_O, BK_O, STAGES,
                      PRELOAD and FIRST < 1)
        res = tl.load(H + r_o, mask=ok_o, other=0.0).to(tl.float32)
        tl.store(H_MID + r_o, (y.to(dt).to(tl.float32) + res).to(dt), mask=ok_o)
    _stamp(TIMES, 5, TIMING)
    w0_gu = 0.0
    if FIRST < 3 and LAST >= 3:
        w0_gu = _sync_with_tile(COUNTERS, 3 * P, w_gu, ok_gu, d, BK_GU, PRELOAD)
    _stamp(TIMES, 6, TIMING)
    # ---- 3: rmsnorm + gate/up projection + SwiGLU
    if FIRST <= 3 and LAST >= 3:
        rstd = _rstd(H_MID, d, eps, BK_NORM)
        y = _rows_dot(w_gu, ok_gu, H_MID, G2, rstd, d, w0_gu, True, R_GU, BK_GU, STAGES, PRELOAD and FIRST < 3)
        gate, up = tl.split(tl.reshape(y.to(dt), (R_GU // 2, 2)))  # the projection's stored gate and up
        g = gate.to(tl.float32)
        a = g * tl.sigmoid(g) * up.to(tl.float32)  # kiln.kernels.swiglu's expression, in its order
        i = tl.arange(0, R_GU // 2)
        tl.store(ACT + pid * feats + i, a.to(dt), mask=(i < feats) & (pid * feats + i < F))
    _stamp(TIMES, 7, TIMING)
    w0_d = 0.0
    if FIRST < 4 and LAST >= 4:
        w0_d = _sync_with_tile(COUNTERS, 4 * P, w_d, ok_d, F, BK_D, PRELOAD)
    _stamp(TIMES, 8, TIMING)
    # ---- 4: down projection + the residual add: h_out
    if FIRST <= 4 and LAST >= 4:
        y = _rows_dot(w_d, ok_d, ACT, ACT, 0.0, F, w0_d, False, R_D, BK_D, STAGES, PRELOAD and FIRST < 4)
        res = tl.load(H_MID + r_d, mask=ok_d, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(H_OUT + r_d, (y.to(dt).to(tl.float32) + res).to(dt), mask=ok_d)
    _stamp(TIMES, 9, TIMING)
    if FIRST < LAST:  # depart: the program that completes the count resets it (module doc)
        tl.debug_barrier()
        if tl.atomic_add(COUNTERS, 1, sem="acq_rel", scope="gpu") == (LAST - FIRST + 1) * P - 1:
            tl.store(COUNTERS, 0)
# fmt: on


_block_launch = CachedLaunch(_decode_block_kernel)


# ------------------------------------------------------------------------------------------ launcher
class BlockPlan(NamedTuple):
    """The launch's fixed shape: programs, attention splits per kv head, and each phase's rows a program (real
    and padded to a power of two) and K step."""

    programs: int
    splits: int
    pairs: int
    bk_qkv: int
    rows_o: int
    r_o: int
    bk_o: int
    feats: int
    r_gu: int
    bk_gu: int
    rows_d: int
    r_d: int
    bk_d: int


def _step(rows: int, K: int, tile: int) -> int:
    """A K step for `rows` real rows of a tile of about `tile` real elements: a power of two, at least 16, at
    most K's next power of two."""
    return max(16, min(pow2(K), pow2(tile // rows + 1) // 2))


def block_plan(
    d: int, F: int, Hq: int, Hk: int, D: int, capacity: int, programs: int, tile: int = TILE
) -> BlockPlan:
    """Rows per program of each phase from the program count. Splits: one per ATTN_BLOCK_N-key tile of the
    table's capacity, at most programs // Hk (a split strides over the tiles past splits x ATTN_BLOCK_N keys).
    Pairs per q/k/v program: the fewest (a power of two dividing D/2) that cover the (Hq + 2 Hk) D / 2 pairs
    with the programs. K steps: `tile` real elements a step; q/k/v's whole K in one step up to twice that (its
    preloaded first step is then all of its rows)."""
    half = D // 2
    pairs = min(half, pow2(cdiv((Hq + 2 * Hk) * half, programs)))
    splits = max(1, min(programs // Hk, cdiv(capacity, ATTN_BLOCK_N)))
    rows_o, feats, rows_d = cdiv(d, programs), cdiv(F, programs), cdiv(d, programs)
    return BlockPlan(
        programs, splits, pairs, pow2(d) if 2 * pairs * pow2(d) <= 2 * tile else _step(2 * pairs, d, tile),
        rows_o, pow2(rows_o), _step(rows_o, Hq * D, tile),
        feats, pow2(2 * feats), _step(2 * feats, d, tile),
        rows_d, pow2(rows_d), _step(rows_d, F, tile),
    )  # fmt: skip


def decode_block_supported(
    h: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    k_cache: torch.Tensor, n_heads: int,
) -> bool:  # fmt: skip
    """Whether `decode_block` takes these shapes: one token; K-contiguous weights of the block's shapes; one
    dtype for the stream, weights and caches; D / 2 even; the q/k/v heads (at a whole head a program) and the
    kv heads fit the launch's programs."""
    if h.dim() != 2 or h.shape[0] != 1 or k_cache.dim() != 4:
        return False
    d, (Hk, D) = h.shape[1], k_cache.shape[2:]
    F2 = w_gate_up.shape[0]
    programs = block_programs(h.device)
    ws = (w_qkv, w_o, w_gate_up, w_down)
    return (
        n_heads % Hk == 0
        and D % 4 == 0
        and w_qkv.shape == ((n_heads + 2 * Hk) * D, d)
        and w_o.shape == (d, n_heads * D)
        and F2 % 2 == 0
        and w_gate_up.shape == (F2, d)
        and w_down.shape == (d, F2 // 2)
        and all(w.stride(1) == 1 for w in ws)
        and k_cache.stride(-1) == 1
        and all(w.dtype == h.dtype for w in ws)
        and k_cache.dtype == h.dtype
        and n_heads + 2 * Hk <= programs
        and Hk <= programs
    )


def decode_block(
    h, norm1, w_qkv, b_qkv, w_o, norm2, w_gate_up, w_down, eps, cos, sin, rows, k_cache, v_cache, slots,
    block_table, seq_lens, n_heads, *, window=None, interleaved=False, phased=None, tile=None, stages=None,
    timeline=None,
) -> torch.Tensor:  # fmt: skip
    """h_out (1, d) of the block (module doc); k and v land in the caches. Triton on CUDA or in the
    interpreter, the reference elsewhere. phased: run the five phases as five launches (the interpreter's
    form; default: there only). tile, stages: the K loops' tile size and depth (default TILE and STAGES, read
    at the call, as WARPS, PER_SM and PRELOAD_TILES are, so that a sweep may set them). timeline: a
    (programs, STAMPS) int64 tensor that the one-launch form fills with the global timer before and after
    each phase's work (an experiment's probe)."""
    if not decode_block_supported(h, w_qkv, w_o, w_gate_up, w_down, k_cache, n_heads):
        raise ValueError(
            f"decode_block: unsupported shapes h {tuple(h.shape)}, w_qkv {tuple(w_qkv.shape)}, w_o "
            f"{tuple(w_o.shape)}, w_gate_up {tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)}, cache "
            f"{tuple(k_cache.shape)}, {n_heads} q heads: check decode_block_supported"
        )
    if not use_triton(h, w_qkv, k_cache, v_cache):
        return decode_block_ref(h, norm1, w_qkv, b_qkv, w_o, norm2, w_gate_up, w_down, eps, cos, sin, rows,
                                k_cache, v_cache, slots, block_table, seq_lens, n_heads, window=window,
                                interleaved=interleaved)  # fmt: skip
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(
            f"decode_block: v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}"
        )
    tile, stages = tile or TILE, stages or STAGES
    phased = interpreting() if phased is None else phased
    d = h.shape[1]
    Hk, D = k_cache.shape[2:]
    F = w_down.shape[1]
    page = k_cache.shape[1]
    plan = block_plan(d, F, n_heads, Hk, D, block_table.shape[1] * page, block_programs(h.device), tile)
    S = plan.splits
    dev, dt = h.device, h.dtype
    work = torch.empty(2 * d + 2 * n_heads * D + F, device=dev, dtype=dt)
    mid, out, q_buf, attn, act = work.split([d, d, n_heads * D, n_heads * D, F])
    parts = torch.empty(n_heads * S * (D + 1), device=dev, dtype=torch.float32)
    o_part, lse_part = parts.split([n_heads * S * D, n_heads * S])
    counters = split_counters(dev, 1 + Hk)
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    h = h.contiguous()
    group = n_heads // Hk
    args = (
        h, mid, out, norm1, w_qkv, w_qkv if b_qkv is None else b_qkv, w_o, norm2, w_gate_up, w_down,
        cos, sin, rows, k_cache, v_cache, slots, block_table, seq_lens,
        q_buf, o_part, lse_part, attn, act, counters, counters if timeline is None else timeline,
        eps, LOG2E / math.sqrt(D), window or 0, block_table.shape[1] * page,
        d, F, n_heads, Hk, S, plan.rows_o, plan.feats, plan.rows_d,
        w_qkv.stride(0), w_o.stride(0), w_gate_up.stride(0), w_down.stride(0), cos.stride(0), sin.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
    )  # fmt: skip
    meta = dict(
        HEAD_DIM=D, PAGE_SIZE=page, HAS_BIAS=b_qkv is not None, INTERLEAVED=interleaved, WINDOW=window is not None,
        ADDR32=offsets_fit_int32(k_cache, v_cache), PAIRS=plan.pairs, BK_QKV=plan.bk_qkv, R_O=plan.r_o,
        BK_O=plan.bk_o, R_GU=plan.r_gu, BK_GU=plan.bk_gu, R_D=plan.r_d, BK_D=plan.bk_d,
        BK_NORM=min(pow2(d), 2048), BLOCK_N=ATTN_BLOCK_N, BLOCK_H=max(16, pow2(group)), GROUP_P=pow2(group),
        SPLIT_STEP=max(1, combine_step(group, D) * WARPS // 4),  # combine_step's tile is for 4 warps
        STAGES=stages, TIMING=timeline is not None, PRELOAD=PRELOAD_TILES, QKV_ONE_STEP=plan.bk_qkv >= d,
        num_warps=WARPS,
    )  # fmt: skip
    grid = (plan.programs,)
    if phased:
        for p in range(PHASES):
            _block_launch[grid](*args, FIRST=p, LAST=p, **meta)
    else:
        _block_launch[grid](*args, FIRST=0, LAST=PHASES - 1, launch_cooperative_grid=True, **meta)
    return out.view(1, d)
