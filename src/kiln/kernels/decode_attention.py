"""Decode attention over a paged KV cache: split-KV (flash-decoding), GQA-aware, with an LSE reduction.

One new query token per sequence attends to everything its sequence has cached:
    q (B, Hq, D); k_cache, v_cache (num_blocks, block_size, Hk, D); block_table (B, max_blocks) int32;
    seq_lens (B,) int32 (the query is the last cached token, at position seq_lens[b] - 1)
(the cache layout is documented in kiln.kernels.paged_kv, whose kernel writes it). Returns (B, Hq, D)
in q's dtype. Options: softmax_scale, a sliding window W (keys L - W <= j < L), and sinks (Hq,) logits
joining the softmax denominator, as in kiln.kernels.attention.

Kernel 1 splits each sequence's keys into `num_splits` chunks: program (b, kv head, split) streams its
chunk once and serves all Hq / Hk query heads of the group from it (the group is the M dim of the
dots, padded to 16), so each K/V byte is read once. Token t's row is found through the block table
per row, so a tile spans any number of pages (row offsets in int32 where the cache's offsets fit and the
config says ADDR32: fewer registers, the same loads; SPLIT_CONFIGS has the sm_90 figures). Each program writes a partial output normalized by its
own sum, and the log2-sum-exp of its chunk:
    o_s = sum_j 2^(s_j - lse_s) v_j,   lse_s = log2 sum_j 2^(s_j)      (s in log2 units)
and they are combined: o = sum_s 2^(lse_s - m) o_s / (sum_s 2^(lse_s - m) + 2^(sink - m)), in one of two
forms (`form`; DEFAULT_FORM, two_pass: on the H200 at c598f16 whole decode steps with one_pass ran 6.9%
slower at batch 1 and 0.8% at batch 16, docs/perf/attention.md; KILN_DECODE_FORM overriding it):
- "two_pass": kernel 2, one program per (b, query head), combines them. With PDL (sm_90+) it is scheduled
  while kernel 1 runs and waits in its prologue for kernel 1 to complete, so its launch is hidden; the
  kernel boundary (kernel 1 drained, its writes flushed, kernel 2 released) and kernel 2's own L2 round
  trips are not.
- "one_pass": no kernel 2. Each program of a (b, kv head), having stored its partials, adds 1 to that
  pair's int32 counter (acq_rel, gpu scope); the one that reads splits - 1 (every program counts, the
  empty splits too) arrived last: it zeroes the counter for the next launch and combines the group's
  partials of the splits holding keys, read back from memory in split order, so the bits do not depend
  on which program arrived last. No program ever waits for another (no spinning, so no deadlock however
  programs are scheduled, and nothing for PDL's early-scheduled next kernel to starve). The cost moves
  into the tail of each group's slowest split: an atomic's round trip, then the combine of Hq / Hk heads
  on one program (B x Hk combining programs instead of B x Hq).
  Memory ordering on NVIDIA GPUs (PTX memory model): every thread of the program stores its partials;
  bar.sync (tl.debug_barrier) orders those stores before thread 0's atom.acq_rel.gpu (Triton issues a
  scalar atomic from one thread); a release is cumulative, so it publishes the stores the barrier
  ordered before it: the pattern of CUTLASS's semaphore and generic barrier (__syncthreads, then one
  thread's release). The last program's atomic reads the value the other programs' releases wrote, so
  it acquires them; Triton broadcasts its result through shared memory and a bar.sync, which orders all
  its threads' loads after the acquire. Those loads are ld.global.cg (from L2: an SM's L1 is not
  coherent and may hold a line of the same address from an earlier launch, the partial buffers being
  reused by the caching allocator). The reset is a plain store: nothing reads the counter again in this
  launch, and the next launch in the stream starts after this one completes (with PDL its prologue
  waits for that). The interpreter runs programs one at a time in grid order (b, then kv head, then
  split), so every store is visible to the programs after it and the highest split always arrives last;
  the ordering is exercised only on the GPU (tests marked gpu, one comparing 20 calls bit for bit).
  The counter buffer: `split_counters` (kept per device by this module; why that is safe under CUDA
  graphs, and when it is not with several streams, is said there).

The split COUNT is fixed on the host (so the grid is fixed and the launch needs no device-to-host sync:
CUDA-graph friendly): enough (b, kv head, split) programs to fill the GPU a few times over, at most one
split per CHUNK_ALIGN keys of the block table's capacity. The CHUNK each split covers is derived on the
device from the live context, per sequence: chunk_b = align(cdiv(live_b, splits), BLOCK_N), live_b =
seq_lens[b] (or the window). Every split of every sequence gets an equal share of its live keys, and
splits past the end of a short sequence store nothing but an empty log-sum-exp (-inf; in the one-pass
form not even that): the reduction reads a split's partial output only where the split held keys. Until
2026-12-02 the chunk came from the capacity too (chunk = capacity / splits): with a block table sized for
4k tokens and a few hundred live keys, the first one or two splits did all the work while the others sat
empty (H200: 7.6 us a layer at batch 1, 16.4 us at batch 64, docs/perf/inference.md).
Where one split suffices (B x Hk programs fill the GPU, or the capacity is a single chunk), the split
kernel writes the final output itself (sinks included) and the reduction is not launched.

The split count and the tile config are fixed (`split_plan`), not autotuned: the engine captures its
decode graphs with padding rows of one key each, so a tuner timing those launches chose among configs by
noise. The plan: about one program an SM in 64-key tiles whose chunk's page indices are loaded once before
its loop (PRELOAD: gathered from registers per tile), so that no load in the loop feeds the K/V addresses
and the pipeliner keeps num_stages - 1 tiles of K and V in flight where a per-tile table load leaves it
one (bitwise the same output as the per-tile loads). In whole decode steps on the H200 (Qwen2.5-1.5B,
1k-token contexts, docs/perf/attention.md) it ran 1.03-1.065x the steps of the plan before it (about 4
programs an SM in 32-key tiles with per-tile table loads, KILN_DECODE_PRELOAD=off) at 16-128 sequences and
tied at one. Fewer and longer chunks without PRELOAD had won in isolation at 64-256 sequences and lost 5% in
whole steps: only whole steps decide the plan.

EARLY (`_common.early_loads`: KILN_DECODE_EARLY=off turns it off; not with TMA pages): each program loads its
chunk's first tile before its programmatic-launch wait, so the chain key count -> page index -> K/V rows
runs while the kernel before it (the RoPE + K/V write) still runs; after the wait it loads q and the
newest key's row only, and folds the tile in as the loop's first (the same tiles, masks and sums: the same
bits). The launcher takes it where no chunk exceeds max(BLOCK_N, CHUNK_ALIGN) keys (capacity <= splits x
that: the split count is bound by the capacity, not by the programs an SM), so a split is its early tile
and at most one more: batch 1-4 at a 1280-key table (10 splits of up to two 64-key tiles), batch 1 up to
~8k keys. On the H200 (bench/experiments/decode_forms.py, Qwen2.5-1.5B at 1k-token contexts, 7 rounds of
graph replays) the batch-1 step went 1.286 -> 1.250 ms (1.029x). Taken at every batch, it cost 1.5% at 16
and 64 sequences (1.746 -> 1.773, 2.192 -> 2.226 ms), where chunks are 4-8 tiles and the loop's pipeline
restarts after the peeled tile. The contract this rests on: every key of a sequence but its newest
(position seq_lens[b] - 1) was written before the previous kernel in the stream started, and seq_lens and
the block table too; a decode step
writes one key a sequence, in the kernel right before this one (with PDL, each kernel's dependents start
only after its own wait has returned, so everything two launches back is complete). Nothing is stored
before the wait (a buffer this launch writes may have been read by the previous kernel). The tile held in
registers across the wait costs BLOCK_N x D / threads registers a thread (PLAN_PRELOAD: 95 -> 165, one
program an SM either way).

Measured on the H200 and not kept (bench/sweep_attention.py, batch 1 x 64k): split counts of 1-8
programs per SM (4 is best there; fewer cannot keep enough loads in flight per SM), page indices loaded a
tile ahead (up to 16% slower: the compiler already pipelines the table load with the K/V loads), and
the reduction as a programmatic dependent launch (no gain within noise at that 80-us size; PDL on every
decode kernel later took the batch-1 step from 1.43 to 1.34 ms, docs/perf/inference.md). The reduction in
the last program of each (sequence, KV head), held back before by the worry that it serializes the
combine of a group's heads on one SM, is the one-pass form (2026-12-02): not yet timed on the H200.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kiln.kernels._common import early_loads, env_form, griddep, pdl, pdl_first, pdl_prologue, tma_scratch
from kiln.kernels.attention import LOG2E, attention_ref
from kiln.kernels.dispatch import interpreting, sm_count, use_triton
from kiln.kernels.launch import cdiv, pow2

CHUNK_ALIGN = 128  # at most one split per this many keys of the block table's capacity
MAX_SPLITS = 128  # the reduction holds (splits, D) partials of one head in registers
# (b, kv head, split) programs per SM that the split count aims at. H200 sweep at batch 1 x 64k: 1 per
# SM 43% of the copy bandwidth, 2: 66%, 3: 73%, 4: 77%, 6: 66%, 8: 74% (tiles of 64 keys, 3 stages).
PER_SM = 4
# The two forms of a multi-split launch (module doc). two_pass stays the default until the H200 has timed
# both (bench/attention.py decode rows, kiln_two_pass_* against kiln_one_pass_*); KILN_DECODE_FORM in the
# environment overrides it for A/B timing of whole decode steps (default_form).
FORMS = ("two_pass", "one_pass")
DEFAULT_FORM = "two_pass"
# one_pass's counters, per device: (device type, index) -> the buffers handed out, the current one last
# (split_counters says why none is ever freed)
_COUNTERS: dict[tuple[str, int | None], list[torch.Tensor]] = {}


# ----------------------------------------------------------------------------------------- reference
def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Sequence b's first n cached rows (n, Hk, D), gathered through its block table."""
    bs = cache.shape[1]
    pages = block_table[b, : cdiv(n, bs)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:n]


def decode_attention_ref(
    q, k_cache, v_cache, block_table, seq_lens, *, softmax_scale=None, window=None, sinks=None
) -> torch.Tensor:
    """Gathers each sequence's cache and runs the prefill reference with one (last-position) query."""
    out = torch.zeros_like(q)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        k = gather_kv(k_cache, block_table, b, n)[None]  # (1, n, Hk, D)
        v = gather_kv(v_cache, block_table, b, n)[None]
        qb = q[b][None, None].to(k.dtype)  # (1, 1, Hq, D): causal aligns it to position n - 1
        o = attention_ref(qb, k, v, causal=True, softmax_scale=softmax_scale, window=window, sinks=sinks)
        out[b] = o[0, 0].to(q.dtype)
    return out


# ------------------------------------------------------------------------------------ Triton kernels
# The split kernel's configs that the sweeps time (bench/attention.py, bench/experiments/decode_attn_sweep.py):
# (BLOCK_N, num_warps, num_stages, ADDR32, TMA, PRELOAD), with the registers a thread each takes compiled for sm_90a at
# the Qwen2.5-1.5B launch (12 / 2 heads x 128, page 16, bf16), two_pass / one_pass form (ptxas -v at the
# launch's own specialization: tests/kernels/test_decode_sm90.py; none spills; the table in
# docs/perf/attention.md), before EARLY (module doc), which adds up to BLOCK_N x D / threads (64 at 64 keys
# and 4 warps). At <= 128 registers 4 programs of 4 warps fit an SM; 8 warps at <= 80 fit 3.
# The TMA configs (a tile is one page; used where BLOCK_N is the page size) load each page's K and V rows of
# the head as one tensor-descriptor copy, which the pipeliner buffers (num_stages - 2) deep where the pointer
# forms hold one tile: measured slower on the H200 at every point of the sweep (16-key tiles; 0.6-0.9x).
SPLIT_CONFIGS = (
    (64, 4, 3, False, False, False),  # 123 / 126
    (64, 4, 4, False, False, False),  # 123 / 126 (as 3 stages: K/V are single-buffered either way)
    (128, 8, 3, False, False, False),  # 95 / 93
    (64, 4, 3, True, False, False),  # 112 / 117
    (128, 8, 3, True, False, False),  # 76 / 80
    (32, 4, 3, True, False, False),  # 80 / 112: split_plan's (PLAN_CONFIG)
    (16, 4, 4, False, True, False),  # 80 / 128
    (16, 4, 6, False, True, False),  # 85 / 108
    (16, 4, 8, False, True, False),  # 85
    (16, 2, 6, False, True, False),  # 123 / 196
    (32, 4, 6, False, True, False),  # (page 32)
    (32, 4, 3, True, False, True),  # 72 (two_pass; 38 KB of shared memory: 2 K/V tiles)
    (32, 4, 4, True, False, True),  # 72 (54 KB: 3 tiles)
    (32, 4, 5, True, False, True),
    (64, 4, 3, True, False, True),  # 95 (72 KB: 2 tiles): PLAN_PRELOAD
    (64, 4, 4, True, False, True),  # 95 (104 KB: 3 tiles)
    (128, 8, 3, True, False, True),  # 90 (140 KB)
)
# split_plan's config (module doc): int32 row offsets where they fit, 32-key tiles, 4 warps, 3 stages
PLAN_CONFIG = dict(BLOCK_N=32, num_warps=4, num_stages=3, ADDR32=True, TMA=False, PRELOAD=False)
# split_plan's default: about one program an SM (PRELOAD_PER_SM) in 64-key tiles with the chunk's page indices
# loaded before the loop, 3 stages (2 K/V tiles in flight, 72 KB of shared memory): the best paged form at
# 8-128 sequences of 1k-4k keys in isolation (decode_preload_sweep.json) and 1.03-1.065x whole steps at 16-128
# sequences (decode_forms_wide.json); 4 an SM in 32-key tiles with 4 stages measured 0.97-1.03x
# (docs/perf/attention.md). KILN_DECODE_PRELOAD=off: PLAN_CONFIG at PER_SM, the plan before it.
PLAN_PRELOAD = dict(PLAN_CONFIG, BLOCK_N=64, PRELOAD=True)
PRELOAD_PER_SM = 1
PRELOAD_PAGES = 64  # PRELOAD's page vector: one window of up to 63 pages (1008 keys of 16-key pages)


def preload_pages(block_n: int, page_size: int) -> int:
    """The page indices a PRELOAD window loads at once: PRELOAD_PAGES, or more where a window of those
    would hold fewer than two tiles (small pages); a power of two."""
    return max(PRELOAD_PAGES, pow2(2 * cdiv(block_n, page_size) + 1))


def offsets_fit_int32(*caches: torch.Tensor) -> bool:
    """Whether every element offset of each (pages, page size, Hk, D) cache, from its first element, fits
    int32, so the split kernel may build its K/V row offsets in int32 (ADDR32). Unrolled: it runs on every
    launch (~1.5 us for two caches, a third of a generator's cost)."""
    for c in caches:
        (p, r, h, d), (sp, sr, sh, sd) = c.shape, c.stride()
        if (p - 1) * sp + (r - 1) * sr + (h - 1) * sh + (d - 1) * sd >= 2**31:
            return False
    return True


def tma_pages_ok(cache: torch.Tensor) -> bool:
    """Whether a (pages, page size, Hk, D) cache can be read a page of one head at a time through a tensor
    descriptor over its (pages x page size, D) rows of that head: pages contiguous in rows, D contiguous,
    the row stride and the base 16-byte aligned, a power-of-two page size of 8..256 rows (a TMA box)."""
    p, r, h, d = cache.shape
    sp, sr, sh, sd = cache.stride()
    size = cache.element_size()
    return (
        sd == 1
        and sp == r * sr
        and (sr * size) % 16 == 0
        and (sh * size) % 16 == 0
        and cache.data_ptr() % 16 == 0
        and 8 <= r <= 256
        and r & (r - 1) == 0
    )


# fmt: off
@triton.jit
def _combine_splits(
    O_PART, LSE_PART, SINKS, OUT, b64, h0, group, n_live,  # query heads h0 .. h0 + group - 1 of sequence b64
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    HEAD_DIM: tl.constexpr, GROUP_P: tl.constexpr, SPLIT_STEP: tl.constexpr, SINK: tl.constexpr,
):
    """The one-pass form's reduction, run by the last split program of a (sequence, KV head): the group's
    partials of splits 0 .. n_live - 1, read back from memory in split order (the result does not depend on
    which program runs it), combined as kernel 2 does, SPLIT_STEP splits a step with a running max (one
    L2 round trip a step: lse and partial outputs load together). GROUP_P >= group heads; a
    (GROUP_P, SPLIT_STEP, HEAD_DIM) fp32 tile stays within ~64 registers a thread."""
    offs_g = tl.arange(0, GROUP_P)
    h = h0 + offs_g
    g_ok = offs_g < group
    lse_rows = LSE_PART + b64 * stride_lb + h * stride_lh  # (GROUP_P,) pointers to each head's split 0
    o_rows = O_PART + b64 * stride_ob + h * stride_oh
    offs_c = tl.arange(0, SPLIT_STEP)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.zeros([GROUP_P], tl.float32) - 1.0e30  # finite: no live split gives weights 0, not NaN
    denom = tl.zeros([GROUP_P], tl.float32)
    if SINK:  # the sink joins the denominator: start from it, 2^(sink - m) = 1
        m = tl.maximum(m, tl.load(SINKS + h, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634)
        denom += 1.0
    acc = tl.zeros([GROUP_P, HEAD_DIM], tl.float32)
    for s0 in range(0, n_live, SPLIT_STEP):  # fixed order: the sum is bitwise the same on every call
        s = s0 + offs_c
        ok = g_ok[:, None] & (s < n_live)[None, :]  # (GROUP_P, SPLIT_STEP)
        # .cg: from L2, where the other programs' released stores are (module doc)
        lse = tl.load(lse_rows[:, None] + s[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(o_rows[:, None, None] + s[None, :, None] * stride_os + offs_d[None, None, :],
                    mask=ok[:, :, None], other=0.0, cache_modifier=".cg")  # (GROUP_P, SPLIT_STEP, D)
        m_new = tl.maximum(m, tl.max(lse, 1))
        alpha = tl.math.exp2(m - m_new)
        w = tl.math.exp2(lse - m_new[:, None])  # masked splits weigh 2^-inf = 0
        denom = denom * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 1)
        m = m_new
    out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]  # no keys and no sink: 0
    tl.store(OUT + b64 * stride_outb + h[:, None] * stride_outh + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=g_ok[:, None])


@triton.jit
def _online_tile(q, k, v, t_ok, m_i, l_i, acc, qk_scale):
    """One tile of the online softmax: q (BLOCK_H, D), k and v (N, D) with t_ok (N,) marking live keys;
    the running max m_i, sum l_i (BLOCK_H,) and output acc (BLOCK_H, D), all in log2 units."""
    s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_H, N)
    s = tl.where(t_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _paged_ptrs(K_CACHE, V_CACHE, page, t, offs_d, hk, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
                stride_vh, PAGE_SIZE: tl.constexpr, ADDR32: tl.constexpr):  # fmt: skip
    """Pointers (N, D) to the K and V rows of the keys t (N,) found through their pages (N,) int32."""
    if ADDR32:
        # (BLOCK_N,) int32 row offsets from the head's base; the (BLOCK_N, D) offsets stay int32 and only the
        # final address is 64-bit: the pipelined loop holds 32-bit offsets for the next tile, not 64-bit
        # pointers (sm_90a: 123 -> 112 registers at 64 keys / 4 warps, 95 -> 76 at 128 / 8)
        k_off = page * stride_kp + (t % PAGE_SIZE) * stride_kt
        v_off = page * stride_vp + (t % PAGE_SIZE) * stride_vt
        k_ptrs = K_CACHE + hk * stride_kh + (k_off[:, None] + offs_d[None, :])  # (BLOCK_N, D)
        v_ptrs = V_CACHE + hk * stride_vh + (v_off[:, None] + offs_d[None, :])
    else:  # int64 row pointers, any cache size: the kernel as it was before ADDR32 (the old configs)
        page64 = page.to(tl.int64)
        k_rows = K_CACHE + page64 * stride_kp + (t % PAGE_SIZE) * stride_kt + hk * stride_kh
        v_rows = V_CACHE + page64 * stride_vp + (t % PAGE_SIZE) * stride_vt + hk * stride_vh
        k_ptrs = k_rows[:, None] + offs_d[None, :]
        v_ptrs = v_rows[:, None] + offs_d[None, :]
    return k_ptrs, v_ptrs


@triton.jit
def _paged_kv(K_CACHE, V_CACHE, page, t, t_ok, offs_d, hk, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
              stride_vh, PAGE_SIZE: tl.constexpr, ADDR32: tl.constexpr):  # fmt: skip
    """K and V (N, D) of the keys t (N,) found through their pages (N,) int32; rows not t_ok load zeros."""
    k_ptrs, v_ptrs = _paged_ptrs(K_CACHE, V_CACHE, page, t, offs_d, hk, stride_kp, stride_kt, stride_kh, stride_vp,
                                 stride_vt, stride_vh, PAGE_SIZE, ADDR32)
    k = tl.load(k_ptrs, mask=t_ok[:, None], other=0.0)  # (BLOCK_N, D)
    v = tl.load(v_ptrs, mask=t_ok[:, None], other=0.0)
    return k, v


@triton.jit
def _paged_tile(q, K_CACHE, V_CACHE, page, t, t_ok, offs_d, hk, m_i, l_i, acc, qk_scale, stride_kp, stride_kt,
                stride_kh, stride_vp, stride_vt, stride_vh, PAGE_SIZE: tl.constexpr, ADDR32: tl.constexpr):  # fmt: skip
    """One tile of keys t (BLOCK_N,) found through their pages (BLOCK_N,) int32: load K and V, fold them
    into the running (m_i, l_i, acc)."""
    k, v = _paged_kv(K_CACHE, V_CACHE, page, t, t_ok, offs_d, hk, stride_kp, stride_kt, stride_kh, stride_vp,
                     stride_vt, stride_vh, PAGE_SIZE, ADDR32)
    return _online_tile(q, k, v, t_ok, m_i, l_i, acc, qk_scale)


@triton.jit
def _decode_split_kernel(
    Q, K_CACHE, V_CACHE, BLOCK_TABLE, SEQ_LENS,  # q (B, Hq, D); caches (pages, PAGE_SIZE, Hk, D); see paged_kv
    O_PART, LSE_PART,  # o_part (B, Hq, splits, D), lse_part (B, Hq, splits) fp32, log2 units (not SINGLE)
    SINKS, OUT,  # SINGLE or ONE_PASS: sinks (Hq,) or a dummy, out (B, Hq, D) in q's dtype
    COUNTERS,  # ONE_PASS: (>= B * Hk,) int32, zero on entry, left zero; counter b * Hk + hk (else a dummy)
    stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh, stride_bt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    group, window, splits, qk_scale,  # splits: the grid's third dim, fixed on the host
    cache_rows,  # pages x PAGE_SIZE: the rows of the TMA path's per-head descriptors
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, WINDOW: tl.constexpr,
    SINGLE: tl.constexpr,  # one split: normalize (with the sinks) and write the final output here
    ONE_PASS: tl.constexpr,  # several splits, the last to finish per (b, kv head) combines them (module doc)
    GROUP_P: tl.constexpr, SPLIT_STEP: tl.constexpr,  # ONE_PASS's combine tile: heads, splits a step
    SINK: tl.constexpr, PDL: tl.constexpr,
    FITS32: tl.constexpr,  # every cache element offset fits int32 (offsets_fit_int32, on the host)
    BLOCK_N: tl.constexpr,
    ADDR32: tl.constexpr,  # a config's choice: K/V row offsets in int32 where FITS32 (same loads, fewer registers)
    TMA_OK: tl.constexpr,  # TMA asked for and the caches TMA-readable a page at a time (tma_pages_ok, on the host)
    TMA: tl.constexpr,  # a config's choice where TMA_OK: a tile is one page, by TMA (BLOCK_N aligns chunks only)
    PRELOAD: tl.constexpr,  # a config's choice: a window's page indices loaded before its K/V loop (not TMA)
    MAX_PAGES: tl.constexpr,  # PRELOAD: the page indices loaded at once (preload_pages: fixed per config)
    EARLY: tl.constexpr = False,  # the first tile before the programmatic-launch wait (not TMA; module doc)
    FIRST: tl.constexpr = False,  # signal the next kernel before waiting (kiln.kernels._common.pdl_first)
):
    hk = tl.program_id(1)
    if TMA and TMA_OK:  # built before the wait: they depend on no earlier kernel
        # (page x PAGE_SIZE rows, D) of this KV head; a page's rows are contiguous (tma_pages_ok)
        k_desc = tl.make_tensor_descriptor(K_CACHE + hk * stride_kh, [cache_rows, HEAD_DIM], [stride_kt, 1],
                                           [PAGE_SIZE, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V_CACHE + hk * stride_vh, [cache_rows, HEAD_DIM], [stride_vt, 1],
                                           [PAGE_SIZE, HEAD_DIM])
    if not EARLY:
        pdl_prologue(PDL, FIRST)
    b = tl.program_id(0)
    split = tl.program_id(2)
    n = tl.load(SEQ_LENS + b)
    first = 0
    if WINDOW:
        first = tl.maximum(n - window, 0)
    # this sequence's chunk, from its live keys (not the table's capacity): whole BLOCK_N tiles, so only
    # the last tile of the last non-empty split is ragged
    chunk = tl.cdiv(tl.cdiv(n - first, splits), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, n)

    offs_h = tl.arange(0, BLOCK_H)  # query heads of this group, padded to BLOCK_H >= 16 for tl.dot
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    h = hk * group + offs_h
    h_ok = offs_h < group
    b64 = b.to(tl.int64)
    table = BLOCK_TABLE + b64 * stride_bt
    start = lo  # the first key of the tile loop
    if EARLY:
        # The chunk's first tile, loaded before the programmatic-launch wait (module doc, "EARLY"): the key
        # count, its pages and every key but the newest were written before the previous kernel (the one
        # that writes the newest key) started, so these loads overlap it. Only row n - 1 waits.
        t0 = lo + offs_n  # (BLOCK_N,): the tile the loop would take first, with its mask
        t0_ok = t0 < hi
        page0 = tl.load(table + t0 // PAGE_SIZE, mask=t0_ok, other=0)
        k0_ptrs, v0_ptrs = _paged_ptrs(K_CACHE, V_CACHE, page0, t0, offs_d, hk, stride_kp, stride_kt, stride_kh,
                                       stride_vp, stride_vt, stride_vh, PAGE_SIZE, ADDR32 and FITS32)
        old = (t0_ok & (t0 < n - 1))[:, None]
        k0 = tl.load(k0_ptrs, mask=old, other=0.0)  # (BLOCK_N, D)
        v0 = tl.load(v0_ptrs, mask=old, other=0.0)
        start = lo + BLOCK_N
        pdl_prologue(PDL, FIRST)
    if not SINGLE and not ONE_PASS:
        if hi <= lo:  # past the live keys: the reduction reads this split's lse only, as "empty"
            tl.store(LSE_PART + b64 * stride_lb + h * stride_lh + split, tl.full([BLOCK_H], float("-inf"),
                     tl.float32), mask=h_ok)
            return
    # ONE_PASS: an empty split (hi <= lo) still runs to its arrival at the counter, with its q load, loop and
    # partial stores predicated off (no early return: the last program to arrive may be an empty one)
    live = h_ok & (hi > lo)
    q = tl.load(Q + b64 * stride_qb + h[:, None] * stride_qh + offs_d[None, :], mask=live[:, None], other=0.0)
    m_i = tl.zeros([BLOCK_H], tl.float32) - 1.0e30  # finite, so an empty split gives l = 0, not NaN
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
    if EARLY:  # the newest key's row, now written, into the first tile; then the tile as the loop's first
        new = (t0_ok & (t0 >= n - 1))[:, None]
        k0 = tl.where(new, tl.load(k0_ptrs, mask=new, other=0.0), k0)
        v0 = tl.where(new, tl.load(v0_ptrs, mask=new, other=0.0), v0)
        m_i, l_i, acc = _online_tile(q, k0, v0, t0_ok, m_i, l_i, acc, qk_scale)
    if TMA and TMA_OK:  # one page a tile, from the page holding lo (BLOCK_N aligns the chunks only)
        offs_p = tl.arange(0, PAGE_SIZE)
        for p in range(lo // PAGE_SIZE, tl.cdiv(hi, PAGE_SIZE)):
            page = tl.load(table + p)
            t = p * PAGE_SIZE + offs_p
            t_ok = (t >= lo) & (t < hi)
            k = k_desc.load([page * PAGE_SIZE, 0])  # (PAGE_SIZE, D)
            # rows past the live keys hold whatever the page held (NaN bits too): zero them, as the
            # pointer forms' masked loads do, so that p = 0 times them stays 0
            v = tl.where(t_ok[:, None], v_desc.load([page * PAGE_SIZE, 0]), 0.0)
            m_i, l_i, acc = _online_tile(q, k, v, t_ok, m_i, l_i, acc, qk_scale)
    else:
        if PRELOAD:
            # the page indices of a window of the chunk, loaded once: the K/V addresses then depend on no
            # load inside the window's loop, so the pipeliner keeps num_stages - 1 tiles of K and V in flight
            # (with the table loaded per tile it spends its stages on that load and holds one K/V tile).
            # Windows are whole tiles spanning at most MAX_PAGES pages, so the tiles, their masks and the
            # sums are those of the plain loop: the same bits. One window covers a chunk of up to
            # (MAX_PAGES - 1) pages; a longer one restarts the pipeline once a window.
            WINDOW_KEYS = (MAX_PAGES - 1) * PAGE_SIZE // BLOCK_N * BLOCK_N
            offs_p = tl.arange(0, MAX_PAGES)
            for w0 in range(start, hi, WINDOW_KEYS):
                w_hi = tl.minimum(w0 + WINDOW_KEYS, hi)
                p0 = w0 // PAGE_SIZE
                pages = tl.load(table + p0 + offs_p, mask=p0 + offs_p < tl.cdiv(w_hi, PAGE_SIZE), other=0)
                for n0 in range(w0, w_hi, BLOCK_N):
                    t = n0 + offs_n  # (BLOCK_N,) token positions
                    t_ok = t < w_hi
                    page = tl.gather(pages, tl.where(t_ok, t // PAGE_SIZE - p0, 0), 0)  # (BLOCK_N,) int32
                    m_i, l_i, acc = _paged_tile(q, K_CACHE, V_CACHE, page, t, t_ok, offs_d, hk, m_i, l_i, acc,
                                                qk_scale, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
                                                stride_vh, PAGE_SIZE, ADDR32 and FITS32)  # fmt: skip
        else:
            for n0 in range(start, hi, BLOCK_N):
                t = n0 + offs_n  # (BLOCK_N,) token positions; each row found through its page
                t_ok = t < hi
                page = tl.load(table + t // PAGE_SIZE, mask=t_ok, other=0)  # (BLOCK_N,) int32
                m_i, l_i, acc = _paged_tile(q, K_CACHE, V_CACHE, page, t, t_ok, offs_d, hk, m_i, l_i, acc,
                                            qk_scale, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt,
                                            stride_vh, PAGE_SIZE, ADDR32 and FITS32)  # fmt: skip
    if SINGLE:  # o = acc 2^(m_i - m) / (l_i 2^(m_i - m) + 2^(sink - m)), m = max(m_i, sink)
        denom = l_i
        if SINK:
            sink = tl.load(SINKS + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            m = tl.maximum(m_i, sink)
            scale = tl.math.exp2(m_i - m)
            acc = acc * scale[:, None]
            denom = l_i * scale + tl.math.exp2(sink - m)
        out = acc / tl.where(denom > 0.0, denom, 1.0)[:, None]  # no keys and no sink: 0
        tl.store(OUT + b64 * stride_outb + h[:, None] * stride_outh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=h_ok[:, None])
    else:
        has = l_i > 0.0
        acc = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_ptrs = O_PART + b64 * stride_ob + h[:, None] * stride_oh + split * stride_os + offs_d[None, :]
        tl.store(o_ptrs, acc, mask=live[:, None])
        tl.store(LSE_PART + b64 * stride_lb + h * stride_lh + split, lse, mask=live)
        if ONE_PASS:
            # Arrive at this (b, kv head)'s counter; the program that arrives last (every split counts,
            # empty ones too: `splits` arrivals) combines all partials. Memory ordering (module doc): the
            # barrier orders every thread's partial stores above before thread 0's release-acquire atomic;
            # the last program's acquire (its result broadcast to all threads through shared memory and a
            # barrier) orders its partial loads after every other program's release, and those loads read
            # L2 (.cg), never a stale L1 line.
            tl.debug_barrier()
            counter = COUNTERS + b * tl.num_programs(1) + hk
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == splits - 1:
                tl.store(counter, 0)  # every split has arrived: zero for the next launch (graph replays too)
                n_live = tl.cdiv(n - first, tl.maximum(chunk, 1))  # splits holding keys: 0 .. n_live - 1
                _combine_splits(O_PART, LSE_PART, SINKS, OUT, b64, hk * group, group, n_live,
                                stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
                                HEAD_DIM, GROUP_P, SPLIT_STEP, SINK)


@triton.jit
def _decode_reduce_kernel(
    O_PART, LSE_PART, SINKS, OUT,  # partials as above; sinks (Hq,) or a dummy; out (B, Hq, D)
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outb, stride_outh,
    Hq, num_splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, SINK: tl.constexpr, PDL: tl.constexpr,
    FIRST: tl.constexpr = False,  # signal the next kernel before waiting (kiln.kernels._common.pdl_first)
):
    pdl_prologue(PDL, FIRST)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse = tl.load(LSE_PART + b * stride_lb + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
    live = s_ok & (lse > float("-inf"))  # empty splits stored no partial output: not read
    o = tl.load(O_PART + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
                mask=live[:, None], other=0.0)  # (BLOCK_S, D)
    m = tl.maximum(tl.max(lse, 0), -1.0e30)
    if SINK:
        sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    w = tl.where(live, tl.math.exp2(lse - m), 0.0)  # empty splits weigh 0
    denom = tl.sum(w, 0)
    if SINK:
        denom += tl.math.exp2(sink - m)
    out = tl.sum(w[:, None] * o, 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(OUT + b * stride_outb + h * stride_outh + offs_d, out.to(OUT.dtype.element_ty))
# fmt: on


# ------------------------------------------------------------------------------------------ launcher
def num_splits_for(
    batch: int, kv_heads: int, capacity: int, sm_count: int, per_sm: int = PER_SM, align: int = CHUNK_ALIGN
) -> int:
    """The split count: about `per_sm` (b, kv head, split) programs per SM, at most one split per `align`
    keys of the capacity (a block table's pages x page size, or the window). Host values only: fixed for
    a captured graph. Each program sizes its own chunk from its sequence's live keys (module doc).
    (8 per SM measured slower on the H200: 3.12 against 3.27 TB/s at batch 1 x 64k.)"""
    want = min(MAX_SPLITS, max(1, cdiv(per_sm * sm_count, batch * kv_heads)))
    return max(1, min(want, cdiv(max(capacity, 1), align)))


def split_plan(
    batch: int, kv_heads: int, capacity: int, sm_count: int, align: int = CHUNK_ALIGN
) -> tuple[int, dict]:
    """(split count, split-kernel config) of a launch (module doc): about PRELOAD_PER_SM programs an SM in
    PLAN_PRELOAD's tiles (with KILN_DECODE_PRELOAD=off, PER_SM in PLAN_CONFIG's). Host values only (fixed
    for a captured graph)."""
    per_sm = PRELOAD_PER_SM if _preload_switch() else PER_SM
    return num_splits_for(batch, kv_heads, capacity, sm_count, per_sm, align), plan_config()


@functools.cache
def chunk_align() -> int:
    """The keys of block-table capacity a split stands for (num_splits_for's `align`): CHUNK_ALIGN, or
    KILN_DECODE_ALIGN from the environment (read once), for A/B timing of whole decode steps. At 64 a batch-1
    split of a 1280-key table is its one early tile (20 splits), where 128 leaves it a second tile loaded
    after the wait."""
    return int(env_form("KILN_DECODE_ALIGN", ("128", "64", "256"), str(CHUNK_ALIGN)))


@functools.cache
def _preload_switch() -> bool:
    return env_form("KILN_DECODE_PRELOAD", ("on", "off")) == "on"


def plan_config() -> dict:
    """split_plan's config: PLAN_PRELOAD, or PLAN_CONFIG where KILN_DECODE_PRELOAD=off (read once, as
    KILN_DECODE_FORM is), for A/B timing of whole decode steps."""
    return dict(PLAN_PRELOAD if _preload_switch() else PLAN_CONFIG)


@functools.cache
def default_form() -> str:
    """The form of a call that names none: DEFAULT_FORM, or KILN_DECODE_FORM from the environment (read
    once, as KILN_PDL is: `KILN_DECODE_FORM=one_pass python bench/infer.py ...` times whole decode steps in
    the other form without a code change)."""
    return env_form("KILN_DECODE_FORM", FORMS, DEFAULT_FORM)


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 counters on `device`, zero between one-pass launches (each launch zeroes the ones it
    counted on), for `decode_attention(form="one_pass")`. Allocated on first use, outside any CUDA-graph
    capture, and kept for the process's lifetime: a graph captured with a buffer replays with its address,
    so a buffer replaced by a larger one stays alive too (a few KB each, at most one per power of two).
    Shared by every one-pass call on the device: safe while those calls are ordered on one stream, or on
    streams that wait for each other (kiln's engine runs one step at a time); two one-pass calls running
    at once on two streams would mix their counts (module doc)."""
    kept = _COUNTERS.setdefault((device.type, device.index), [])
    if kept and kept[-1].numel() >= n:
        return kept[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            f"decode_attention(form='one_pass'): its {n} split counters on {device} do not exist yet, and "
            "a CUDA-graph capture cannot allocate and zero them; run the same call once before capturing "
            "(a warm-up: it also compiles the kernel)"
        )
    kept.append(torch.zeros(max(1024, pow2(n)), dtype=torch.int32, device=device))
    return kept[-1]


def combine_step(group: int, head_dim: int) -> int:
    """Splits per step of the one-pass combine: a (pow2(group), step, head_dim) fp32 tile of at most 8192
    values (64 registers a thread at 4 warps, 32 at 8), at least one split."""
    return max(1, 8192 // (pow2(group) * head_dim))


def decode_attention_triton(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    softmax_scale,
    window,
    sinks,
    num_splits,
    config=None,
    form=None,
    signal_first=False,
):
    """config (sweeps): a dict of the split kernel's BLOCK_N, num_warps, num_stages (ADDR32 and TMA False where
    absent; ADDR32 compiles the int64 form where the offsets do not fit, TMA the pointer form where the caches
    are not TMA-readable), and/or `per_sm` and `align` for the split count, each used instead of split_plan's,
    and/or EARLY (True / False in place of the rule: where no chunk exceeds max(BLOCK_N, align) keys, unless
    KILN_DECODE_EARLY is off; never with TMA pages).
    form: see `decode_attention` (checked there; None: default_form())."""
    B, Hq, D = q.shape
    _, page_size, Hk, _ = k_cache.shape
    capacity = block_table.shape[1] * page_size
    if window is not None:
        capacity = min(capacity, window)
    config = dict(config or {})
    per_sm, align = config.pop("per_sm", None), config.pop("align", None) or chunk_align()
    early = config.pop("EARLY", None)
    splits, plan = split_plan(B, Hk, capacity, sm_count(q.device), align)
    if per_sm is not None:
        splits = num_splits_for(B, Hk, capacity, sm_count(q.device), per_sm, align)
    config = dict(dict(ADDR32=False, TMA=False, PRELOAD=False), **config) if "BLOCK_N" in config else plan
    if num_splits is not None:  # an explicit count (tests use it to exercise the reduction)
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"decode_attention: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
        splits = num_splits
    # a constexpr of the config and page size only: no block table or capacity compiles a new kernel (a
    # served step must reuse what the engine's warm-up and graph capture compiled)
    max_pages = preload_pages(config["BLOCK_N"], page_size) if config["PRELOAD"] else 1
    if early is None:  # EARLY where no chunk exceeds max(BLOCK_N, align) keys (module doc)
        early = early_loads() and capacity <= splits * max(config["BLOCK_N"], align)
    single = splits == 1
    one_pass = (default_form() if form is None else form) == "one_pass" and not single
    group = Hq // Hk
    use_pdl = pdl(q)
    out = torch.empty_like(q)
    if single:  # no partials: the split kernel writes `out` (the partial arguments are dummies)
        o_part, lse_part = out[:, :, None], out[:, :, 0]
    else:
        o_part = torch.empty((B, Hq, splits, D), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((B, Hq, splits), dtype=torch.float32, device=q.device)
    sink_arg = sinks if sinks is not None else q
    counters = split_counters(q.device, B * Hk) if one_pass else seq_lens  # else a dummy, never touched
    # fmt: off
    # TMA, where a config asks for it: Hopper on (sm_90+, as griddepcontrol), or the interpreter (which runs it
    # for the tests); checked only then, so the default launch pays nothing and compiles one TMA_OK value
    tma_ok = config["TMA"] and (interpreting() or q.is_cuda and griddep(q.device.index or 0)) and \
        tma_pages_ok(k_cache) and tma_pages_ok(v_cache)
    if tma_ok and q.is_cuda:
        triton.set_allocator(tma_scratch)  # descriptors built on the device (a context variable, read at launch)
    _decode_split_kernel[(B, Hk, splits)](
        q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, sink_arg, out, counters,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_table.stride(0),
        *o_part.stride()[:3], lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        group, window or 0, splits, softmax_scale * LOG2E, k_cache.shape[0] * page_size,
        HEAD_DIM=D, PAGE_SIZE=page_size, BLOCK_H=max(16, pow2(group)), WINDOW=window is not None,
        SINGLE=single, ONE_PASS=one_pass, GROUP_P=pow2(group),
        SPLIT_STEP=min(pow2(splits), combine_step(group, D)), SINK=sinks is not None, PDL=use_pdl,
        FITS32=offsets_fit_int32(k_cache, v_cache), TMA_OK=tma_ok, MAX_PAGES=max_pages,
        EARLY=early and not tma_ok, FIRST=pdl_first("split"), launch_pdl=use_pdl, **config,
    )
    if single or one_pass:
        return out
    _decode_reduce_kernel[(B, Hq)](
        o_part, lse_part, sink_arg, out,
        *o_part.stride()[:3], lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        Hq, splits, HEAD_DIM=D, BLOCK_S=pow2(splits), SINK=sinks is not None, PDL=use_pdl,
        FIRST=signal_first and pdl_first("reduce"), num_warps=8 if splits * D >= 4096 else 4, launch_pdl=use_pdl,
    )
    # fmt: on
    return out


# ------------------------------------------------------------------------------------------ public op
# ------------------------------------------------------------------------------ torch.compile: custom op
# Under torch.compile the public op calls this (Dynamo cannot trace the Triton launches): opaque to the
# compiler, a fake function for the output's shape. Inference only: no gradient.
@torch.library.custom_op("kiln::decode_attention", mutates_args=())
def decode_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    softmax_scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    num_splits: int | None,
    form: str | None = None,
) -> torch.Tensor:
    """decode_attention_triton on checked inputs (q with a contiguous last dim): (B, Hq, D) like q. The
    one-pass form's counters are left as it found them (zero), so the op declares no mutation."""
    return decode_attention_triton(q, k_cache, v_cache, block_table, seq_lens, softmax_scale, window, sinks,
                                   num_splits, form=form)  # fmt: skip


@decode_attention_op.register_fake
def _(q, k_cache, v_cache, block_table, seq_lens, softmax_scale, window, sinks, num_splits, form=None):
    return torch.empty_like(q)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int | None = None,
    form: str | None = None,
    signal_first: bool = False,
) -> torch.Tensor:
    """One decode step of attention for B sequences over the paged cache; see the module doc. (B, Hq, D).
    form: "two_pass" (a split kernel, then a reduction kernel) or "one_pass" (the last split program of
    each (sequence, KV head) reduces); None takes default_form() (DEFAULT_FORM unless KILN_DECODE_FORM
    says otherwise). Both give the same values up to summation order; a launch of one split, or the
    reference path, has no reduction and ignores the choice. Where chunks are short (EARLY, module doc)
    every key but each sequence's newest is read before the programmatic-launch wait: the kernel launched
    right before this call may write the newest keys (a decode step's K/V write), not older ones.
    signal_first: the kernel after this call, one that loads its weight before its programmatic-launch wait
    (the o projection's one-row gemv), may be scheduled before the reduction waits for the split kernel
    (kiln.kernels._common.pdl_first); ignored under torch.compile."""
    if form is not None and form not in FORMS:
        raise ValueError(
            f"decode_attention: form must be one of {FORMS} (or None for the default), got {form!r}"
        )
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"decode_attention: q must be (B, Hq, D) and caches (num_blocks, block_size, Hk, D), got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    B, Hq, D = q.shape
    Hk = k_cache.shape[2]
    if k_cache.shape[3] != D or Hq % Hk:
        raise ValueError(
            f"decode_attention: q {tuple(q.shape)} does not fit caches of (.., .., {Hk}, {k_cache.shape[3]})"
        )
    if block_table.dim() != 2 or block_table.shape[0] != B or seq_lens.shape != (B,):
        raise ValueError(
            f"decode_attention: block_table must be ({B}, max_blocks) and seq_lens ({B},), got "
            f"{tuple(block_table.shape)} and {tuple(seq_lens.shape)}"
        )
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise TypeError("decode_attention: block_table and seq_lens must be int32")
    if sinks is not None and sinks.shape != (Hq,):
        raise ValueError(f"decode_attention: sinks must be ({Hq},), got {tuple(sinks.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"decode_attention: window must be >= 1, got {window}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if use_triton(q, k_cache, v_cache) and D in (16, 32, 64, 128, 256):
        q = q if q.stride(-1) == 1 else q.contiguous()
        seq_lens = seq_lens.contiguous()  # the kernel reads seq_lens[b] at b (a column view would not be)
        block_table = block_table if block_table.stride(-1) == 1 else block_table.contiguous()
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("decode_attention: the caches' last dim must be contiguous")
        if torch.compiler.is_compiling():
            args = (q, k_cache, v_cache, block_table, seq_lens, scale, window, sinks, num_splits, form)
            return decode_attention_op(*args)
        return decode_attention_triton(
            q, k_cache, v_cache, block_table, seq_lens, scale, window, sinks, num_splits, form=form,
            signal_first=signal_first,
        )  # fmt: skip
    return decode_attention_ref(
        q, k_cache, v_cache, block_table, seq_lens, softmax_scale=scale, window=window, sinks=sinks
    )
