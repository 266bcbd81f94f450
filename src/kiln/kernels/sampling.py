"""Token sampling from logits: greedy, temperature, top-k and top-p (nucleus), batched.

sample(logits (B, V), temperature, top_k, top_p, generator) -> ids (B,) int64.
temperature == 0 means greedy (argmax). top_k <= 0 or None disables top-k; top_p >= 1 or None
disables top-p. Top-k is applied before top-p; the token with the highest probability always
survives. Draws use the exponential-race trick (argmax of p / Exp(1)), which needs no host sync
and no cumulative sampling, so a fused kernel can reproduce it.

Two launches, no host sync. At decode batch sizes one program per row would leave most of the GPU idle
(batch 1: one SM of 132), so the vocabulary is split into chunks:
  stage 1, one program per (row, chunk): greedy stores the chunk's max and first argmax; sampling
    stores the chunk's max and sum of exp (an online softmax in two levels), and either its best
    exp(z - m_chunk) / noise (plain temperature) or, when top-k or top-p is on, its KC largest logits
    and their columns (the candidates; `tl.topk` on (key << 32 | column) packed into int64);
  stage 2, one program per row: combines the chunks. With a filter it runs the cut searches below
    over the candidates only (a few thousand values, cache-resident) instead of the whole row.
The candidates are exact whenever they hold every survivor. Let t_c be the largest KC-th value over the
chunks: every logit > t_c is a candidate. A top-k cut (the k-th largest candidate, k <= KC) above t_c
is the true k-th largest and all its survivors are candidates; a top-p cut (alone) above t_c likewise
depends only on values above t_c, with the mass normalised by the row's sum from stage 1. When a cut
is not above t_c (ties across a chunk's KC-th value, or a flat distribution whose nucleus spills past
the candidates), that row's stage-2 program runs the same searches over its whole row instead: the
same answer, slower (about 2 ms at V = 151936 against tens of microseconds).

Cut searches (no sort): each cut is a threshold value found by a 9-ary search over the float32 bit
patterns (ordered as integers): each pass counts against 8 cut points at once, so 32 bits take about
10 passes:
  top-k: the largest t with #{j : z_j >= t} >= k; this is the k-th largest value, so z_j >= t is the
         same set as the reference's `z >= topk(z, k).values[-1]`.
  top-p: the smallest t with mass{i : z_i > t} < top_p; a token survives iff the probability mass
         strictly above it is < top_p, which is the reference's exclusive-cumsum rule on the sorted row
         (tokens of exactly equal logit are kept or dropped together, where the sort would split them).
Then one pass computes the softmax of the survivors and one the argmax of p / noise. With the same
exponential noise, the kernel and `sample_ref` pick the same token (up to ties within float rounding);
`sample` draws the noise exactly as the reference does, so one generator state gives one answer on
both paths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.dispatch import interpreting, use_triton
from kiln.kernels.launch import CachedLaunch, pow2


def sample_ref(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"sample expects logits of shape (batch, vocab), got {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits.float() / temperature
    V = z.shape[-1]
    if top_k is not None and 0 < top_k < V:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z)
    probs = torch.softmax(z, dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)


KEY_POS_INF: tl.constexpr = tl.constexpr(0x7F800000)  # _key(+inf)
KEY_NEG_INF: tl.constexpr = tl.constexpr(-0x7F800001)  # _key(-inf): 0xFF800000 ^ 0x7FFFFFFF as int32


@triton.jit
def _key(x):
    """float32 -> int32 with the same order (flip the magnitude bits of negatives)."""
    b = x.to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _unkey(k):
    b = k.to(tl.int32)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_row(z_row, c, L, temperature, cut):
    """Values of columns c divided by the temperature (as the reference does), -inf below `cut`."""
    z = tl.load(z_row + c, mask=c < L, other=-float("inf")).to(tl.float32) / temperature
    return tl.where(z >= cut, z, -float("inf"))


@triton.jit
def _first_argmax(best, best_i, V):
    """Across lanes: the largest value, and among the lanes holding it the smallest column."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_i, V), axis=0)


# The row routines below loop over a row of L values: the logits row itself (scaled by the temperature),
# or a row's candidates from stage 1 (already scaled: temperature 1). Every loop keeps per-lane partial
# results and reduces across lanes once, after the loop: a cross-warp reduction per block would cost
# more than the block's loads (cache-resident after the first pass).
@triton.jit
def _max_sumexp(z_row, L, temperature, cut, BLOCK: tl.constexpr):
    """(max, sum exp(z - max)) over the survivors of `cut`: one online pass, per lane, then combined."""
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), -3.0e38, tl.float32)  # finite: a lane of only -inf gives exp(m - m) = 1, not nan
    s = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, L, BLOCK):
        z = _scaled_row(z_row, start + cols, L, temperature, cut)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_all = tl.max(m, axis=0)
    return m_all, tl.sum(s * tl.exp(m - m_all), axis=0)


@triton.jit
def _topk_cut(
    z_row, L, temperature, top_k, BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, SPLITS: tl.constexpr
):
    """The k-th largest value of the row: the largest t with #{z >= t} >= top_k."""
    cols = tl.arange(0, BLOCK)
    search_cols = tl.arange(0, SEARCH_BLOCK)
    k_lo = tl.full((BLOCK,), KEY_POS_INF, tl.int32)
    k_hi = tl.full((BLOCK,), KEY_NEG_INF, tl.int32)
    for start in range(0, L, BLOCK):
        c = start + cols
        k = _key(_scaled_row(z_row, c, L, temperature, -float("inf")))
        k_lo = tl.minimum(k_lo, tl.where(c < L, k, KEY_POS_INF))
        k_hi = tl.maximum(k_hi, k)
    lo = tl.min(k_lo, axis=0).to(tl.int64)  # the key of the row's minimum
    hi = tl.max(k_hi, axis=0).to(tl.int64) + 1  # one past the key of its maximum
    # invariant: #{z >= lo} >= top_k > #{z >= hi}; each pass tries SPLITS cut points at once
    splits = tl.arange(0, SPLITS) + 1
    while hi - lo > 1:
        t = lo + ((hi - lo) * splits + SPLITS) // (SPLITS + 1)  # (SPLITS,) increasing, in (lo, hi]
        t32 = t.to(tl.int32)  # keys and cut points all lie in int32
        hits = tl.zeros((SEARCH_BLOCK, SPLITS), tl.int32)
        for start in range(0, L, SEARCH_BLOCK):
            k = _key(_scaled_row(z_row, start + search_cols, L, temperature, -float("inf")))
            hits += (k[:, None] >= t32[None, :]).to(tl.int32)  # padding is -inf: never a hit
        ok = tl.sum(hits, axis=0) >= top_k  # true for a prefix of the cut points
        lo = tl.max(tl.where(ok, t, lo), axis=0)
        hi = tl.min(tl.where(ok, hi, t), axis=0)
    return _unkey(lo)


@triton.jit
def _topp_cut(
    z_row, L, temperature, cut, top_p, m, s, SEARCH_BLOCK: tl.constexpr, SPLITS: tl.constexpr
):  # fmt: skip
    """The smallest t with mass{z > t} < top_p among the survivors of `cut`, probabilities exp(z - m) / s."""
    search_cols = tl.arange(0, SEARCH_BLOCK)
    lo = tl.full((), KEY_NEG_INF, tl.int64)  # invariant: mass above lo >= top_p > mass above hi
    hi = _key(m).to(tl.int64)
    splits = tl.arange(0, SPLITS) + 1
    while hi - lo > 1:
        t = lo + ((hi - lo) * splits + SPLITS) // (SPLITS + 1)
        tf = _unkey(t)
        mass = tl.zeros((SEARCH_BLOCK, SPLITS), tl.float32)
        for start in range(0, L, SEARCH_BLOCK):
            z = _scaled_row(z_row, start + search_cols, L, temperature, cut)
            mass += tl.where(z[:, None] > tf[None, :], tl.exp(z - m)[:, None], 0.0)
        ok = tl.sum(mass, axis=0) / s < top_p  # true for a suffix of the cut points
        hi = tl.min(tl.where(ok, t, hi), axis=0)
        lo = tl.max(tl.where(ok, lo, t), axis=0)
    return _unkey(hi)


@triton.jit
def _race(
    z_row, I_row, noise_row, L, V, temperature, cut, m, s, INDIRECT: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """The exponential race over the survivors of `cut`: argmax_j (exp(z_j - m) / s) / noise_j, as a vocabulary
    column. INDIRECT: the row holds candidates, whose columns are in I_row."""
    cols = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), -1.0, tl.float32)
    best_i = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, L, BLOCK):
        c = start + cols
        z = _scaled_row(z_row, c, L, temperature, cut)
        if INDIRECT:
            col = tl.load(I_row + c, mask=c < L, other=V)
        else:
            col = c
        ok = (c < L) & (col < V)  # a chunk's padding candidates carry columns >= V
        e = tl.load(noise_row + col, mask=ok, other=1.0)
        r = tl.where(ok, (tl.exp(z - m) / s) / e, -1.0)
        better = r > best
        best_i = tl.where(better, col, best_i)
        best = tl.where(better, r, best)
    return _first_argmax(best, best_i, V)


@triton.jit
def _sample_row(
    z_row, I_row, noise_row, L, V, temperature, top_k, top_p, m_all, s_all,
    TOP_K: tl.constexpr, TOP_P: tl.constexpr, GIVEN_NORM: tl.constexpr, INDIRECT: tl.constexpr,
    BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, SPLITS: tl.constexpr,
):  # fmt: skip
    """Top-k cut, then top-p cut, then the race, over one row. Returns (column, top-k cut, top-p cut).
    GIVEN_NORM: top-p (without top-k) normalises by the row's (m_all, s_all), not by this row's values."""
    cut = -float("inf")
    cut_k = -float("inf")
    cut_p = -float("inf")
    if TOP_K:
        cut_k = _topk_cut(z_row, L, temperature, top_k, BLOCK, SEARCH_BLOCK, SPLITS)
        cut = cut_k
    if TOP_P:
        if GIVEN_NORM and not TOP_K:
            m, s = m_all, s_all
        else:
            m, s = _max_sumexp(z_row, L, temperature, cut, BLOCK)
        cut_p = _topp_cut(z_row, L, temperature, cut, top_p, m, s, SEARCH_BLOCK, SPLITS)
        cut = cut_p
    m, s = _max_sumexp(z_row, L, temperature, cut, BLOCK)
    return _race(z_row, I_row, noise_row, L, V, temperature, cut, m, s, INDIRECT, BLOCK), cut_k, cut_p


@triton.jit
def _workspace(Work_ptr, n_part, KC: tl.constexpr):
    """The stage-1 -> stage-2 workspace, one float32 buffer (one allocation per call: host time matters
    at decode): per (row, chunk) its max, sum of exp, best ratio and a column (int32); then per row the
    candidates' values and columns, (B, NCHUNK * KC) each."""
    n_cand = n_part * KC
    cand = Work_ptr + 4 * n_part
    return (
        Work_ptr, Work_ptr + n_part, Work_ptr + 2 * n_part,
        (Work_ptr + 3 * n_part).to(tl.pointer_type(tl.int32), bitcast=True),
        cand, (cand + n_cand).to(tl.pointer_type(tl.int32), bitcast=True),
    )  # fmt: skip


def _workspace_words(B: int, n_chunks: int, kc: int, candidates: bool) -> int:
    n_part = B * n_chunks
    return 4 * n_part + (2 * n_part * kc if candidates else 0)


@triton.jit
def _sample_chunk_kernel(
    Z_ptr,  # logits (B, V), unit stride along V
    z_stride,
    Noise_ptr,  # (B, V) float32 Exp(1) draws, unit stride along V (read only by plain temperature)
    noise_stride,
    Work_ptr,  # float32 workspace, see _workspace
    V,
    temperature,
    GREEDY: tl.constexpr,
    CANDIDATES: tl.constexpr,
    CHUNK: tl.constexpr,  # columns per program (a power of two, <= 65536)
    KC: tl.constexpr,  # candidates kept per chunk (a power of two <= CHUNK)
    PACK16: tl.constexpr,  # 16-bit logits: candidates picked from 32-bit packed words
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    PartM_ptr, PartS_ptr, PartR_ptr, PartI_ptr, CandZ_ptr, CandI_ptr = _workspace(
        Work_ptr, tl.num_programs(0) * n_chunks, KC
    )
    c = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Z_ptr + row * z_stride + c, mask=c < V, other=-float("inf")).to(tl.float32)
    part = row * n_chunks + chunk
    if GREEDY:
        best = tl.max(x, axis=0)
        tl.store(PartM_ptr + part, best)
        tl.store(PartI_ptr + part, tl.min(tl.where(x == best, c, V), axis=0))
    else:
        z = x / temperature
        m = tl.maximum(tl.max(z, axis=0), -3.0e38)  # finite: a chunk of only -inf sums to 0, not nan
        p = tl.exp(z - m)
        tl.store(PartM_ptr + part, m)
        tl.store(PartS_ptr + part, tl.sum(p, axis=0))
        if CANDIDATES:
            slot = row * n_chunks * KC + chunk * KC + tl.arange(0, KC)
            if PACK16:
                # 16-bit logits: their bits ordered as integers (the order of z: dividing by the temperature
                # keeps distinct 16-bit values distinct) in the high half of an int32, 0xFFFF - the column
                # within the chunk in the low half; a sorting network on 32-bit words costs half of 64-bit
                bits = tl.load(
                    Z_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + row * z_stride + c,
                    mask=c < V,
                    other=0,
                ).to(tl.int32)
                key = tl.where(c < V, tl.where(bits < 0, bits ^ 0x7FFF, bits), -32768)  # padding sorts last
                top = tl.topk((key << 16) | (0xFFFF - (c - chunk * CHUNK)), KC)  # (KC,) descending
                col = chunk * CHUNK + 0xFFFF - (top & 0xFFFF)
                cz = tl.load(Z_ptr + row * z_stride + col, mask=col < V, other=-float("inf")).to(tl.float32)
                tl.store(CandZ_ptr + slot, cz / temperature)
                tl.store(CandI_ptr + slot, col)
            else:
                # z's key in the high word, 0x7FFFFFFF - column in the low one: descending order is by value,
                # then by column; padding (-inf) sorts last
                packed = (_key(z).to(tl.int64) << 32) | (0x7FFFFFFF - c).to(tl.int64)
                top = tl.topk(packed, KC)  # (KC,) descending
                tl.store(CandZ_ptr + slot, _unkey((top >> 32).to(tl.int32)))
                tl.store(CandI_ptr + slot, (0x7FFFFFFF - (top & 0x7FFFFFFF)).to(tl.int32))
        else:
            e = tl.load(Noise_ptr + row * noise_stride + c, mask=c < V, other=1.0)
            r = tl.where(c < V, p / e, -1.0)
            best = tl.max(r, axis=0)
            tl.store(PartR_ptr + part, best)
            tl.store(PartI_ptr + part, tl.min(tl.where(r == best, c, V), axis=0))


@triton.jit
def _sample_combine_kernel(
    Z_ptr,  # logits (B, V): the whole row, read only when the candidates miss a survivor
    z_stride,
    Noise_ptr,  # (B, V) float32 Exp(1) draws
    noise_stride,
    Work_ptr,  # float32 workspace written by stage 1, see _workspace
    Out_ptr,  # (B,) int64 token ids
    V,
    n_chunks,
    temperature,
    top_k,  # used when TOP_K: 0 < top_k <= KC
    top_p,  # used when TOP_P: 0 < top_p < 1
    GREEDY: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    CANDIDATES: tl.constexpr,  # stage 1 wrote candidates; else a filter searches the whole row
    KC: tl.constexpr,
    CHUNKS: tl.constexpr,  # next_power_of_2(n_chunks)
    BLOCK: tl.constexpr,  # columns per step of the plain passes
    SEARCH_BLOCK: tl.constexpr,  # columns per step of the threshold searches, which hold SPLITS per column
    SPLITS: tl.constexpr,  # cut points tried per search pass: the range shrinks (SPLITS + 1)-fold per pass
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    PartM_ptr, PartS_ptr, PartR_ptr, PartI_ptr, CandZ_ptr, CandI_ptr = _workspace(
        Work_ptr, tl.num_programs(0) * n_chunks, KC
    )
    ch = tl.arange(0, CHUNKS)
    ch_ok = ch < n_chunks
    part = row * n_chunks + ch
    if GREEDY:
        best = tl.load(PartM_ptr + part, mask=ch_ok, other=-float("inf"))
        idx = tl.load(PartI_ptr + part, mask=ch_ok, other=V)
        tl.store(Out_ptr + row, _first_argmax(best, idx, V).to(tl.int64))  # chunks are in column order
    elif not (TOP_K or TOP_P):
        # plain temperature: the best ratio of each chunk, rescaled to the row's max (s is common to all)
        m_c = tl.load(PartM_ptr + part, mask=ch_ok, other=-3.0e38)
        r = tl.load(PartR_ptr + part, mask=ch_ok, other=-1.0) * tl.exp(m_c - tl.max(m_c, axis=0))
        idx = tl.load(PartI_ptr + part, mask=ch_ok, other=V)
        tl.store(Out_ptr + row, _first_argmax(tl.where(ch_ok, r, -1.0), idx, V).to(tl.int64))
    else:
        z_row = Z_ptr + row * z_stride
        noise_row = Noise_ptr + row * noise_stride
        full = True
        tok = tl.zeros((), tl.int32)
        if CANDIDATES:
            m_c = tl.load(PartM_ptr + part, mask=ch_ok, other=-3.0e38)
            m_all = tl.max(m_c, axis=0)  # the row's softmax normaliser, for top-p without top-k
            s_all = tl.sum(tl.load(PartS_ptr + part, mask=ch_ok, other=0.0) * tl.exp(m_c - m_all), axis=0)
            L = n_chunks * KC
            cz_row = CandZ_ptr + row * L
            # t_c: every logit above the largest KC-th candidate of a chunk is a candidate
            t_c = tl.max(tl.load(cz_row + ch * KC + (KC - 1), mask=ch_ok, other=-float("inf")), axis=0)
            tok, cut_k, cut_p = _sample_row(
                cz_row, CandI_ptr + row * L, noise_row, L, V, 1.0, top_k, top_p, m_all, s_all,
                TOP_K, TOP_P, True, True, BLOCK, SEARCH_BLOCK, SPLITS,
            )  # fmt: skip
            cut = cut_k if TOP_K else cut_p  # a top-k cut above t_c makes the top-p one exact too
            full = _key(cut) <= _key(t_c)  # then a survivor may lie outside the candidates
        if full:
            tok, cut_k, cut_p = _sample_row(
                z_row, z_row, noise_row, V, V, temperature, top_k, top_p, 0.0, 1.0,
                TOP_K, TOP_P, False, False, BLOCK, SEARCH_BLOCK, SPLITS,
            )  # fmt: skip
        tl.store(Out_ptr + row, tok.to(tl.int64))


def _check(logits: torch.Tensor, temperature: float, top_p: float | None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"sample expects logits of shape (batch, vocab), got {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_p is not None and top_p <= 0:
        raise ValueError(f"top_p must be in (0, 1] (1 or None disables it), got {top_p}")


# Launch configuration (H200, V = 151936; bench/sweep_rope_sampling.py measured the alternatives in round 1,
# GPU time in CUDA graphs): greedy 2.8 us at batch 1 and 7.3 us at 64 with 2048 columns a program (1024-8192
# within 10%); plain temperature 3.8 / 20.9 us with 1024 (2048: 4.2 / 21.9); with a filter, the combine's
# searches over NCHUNK * KC candidates dominate at batch 1: 4096 columns (2432 candidates) 64 us against
# 75 us with 2048 and 103 us with 1024.
CHUNK = {"greedy": 2048, "temperature": 1024, "filter": 4096}  # stage-1 columns per program
CHUNK_WARPS = {"greedy": 4, "temperature": 4, "filter": 8}
KC = 64  # candidates per chunk: top_k up to KC costs nothing extra; larger k raises it to pow2(k)
KC_MAX = 1024  # past this top_k the candidates would not fit a chunk's registers: the whole-row path
COMBINE_WARPS = 4  # greedy and plain temperature: the combine reads a few hundred partials
SEARCH_WARPS = 16  # with a filter: (4096 columns x 8 cut points) counters per search step, 64 a thread
COMBINE_BLOCK = 4096  # the combine's step over candidates (and over the whole row when it falls back)
# search steps hold (SEARCH_BLOCK, 8) counters: 2048 x 8 in 16 warps is 32 a thread, no spills (4096 spilled)
SEARCH_BLOCK = 2048


def sample_with_noise(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    **config: int,
) -> torch.Tensor:
    """Launcher: the token each row draws given its Exp(1) noise (B, V) float32 (unused when greedy).
    `config` overrides the launch configuration of _launch (the sweep and the tests)."""
    _check(logits, temperature, top_p)
    if temperature != 0 and (noise is None or noise.shape != logits.shape or noise.dtype != torch.float32):
        raise ValueError(f"noise must be a float32 tensor of shape {tuple(logits.shape)}")
    for name, t in (("logits", logits), ("noise", noise)):
        if t is not None and t.stride(1) != 1 and t.shape[1] > 1:
            raise ValueError(f"{name} must have unit stride along the vocabulary, got strides {t.stride()}")
    return _launch(logits, noise, temperature, top_k, top_p, **config)


_chunk_launch = CachedLaunch(_sample_chunk_kernel)
_combine_launch = CachedLaunch(_sample_combine_kernel)


def _launch(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    chunk: int | None = None,
    kc: int | None = None,
    chunk_warps: int | None = None,
    combine_warps: int | None = None,
    combine_block: int | None = None,
    search_block: int | None = None,
) -> torch.Tensor:
    """The two launches, on checked inputs (chunk, kc and the blocks are powers of two)."""
    B, V = logits.shape
    out = torch.empty(B, device=logits.device, dtype=torch.int64)
    if B == 0:
        return out
    greedy = temperature == 0
    use_k = not greedy and top_k is not None and 0 < top_k < V
    use_p = not greedy and top_p is not None and top_p < 1.0
    kc = kc or max(KC, pow2(top_k) if use_k else 1)
    # the candidates need k <= kc <= chunk; past KC_MAX the combine searches the whole row directly
    candidates = (use_k or use_p) and kc <= KC_MAX
    mode = "greedy" if greedy else "filter" if use_k or use_p else "temperature"
    chunk = max(min(chunk or CHUNK[mode], pow2(V), 65536), kc if candidates else 1)
    n_chunks = -(-V // chunk)
    work = torch.empty(
        _workspace_words(B, n_chunks, kc, candidates), device=logits.device, dtype=torch.float32
    )
    noise = logits if noise is None else noise  # a placeholder pointer when greedy
    temp = float(temperature) if not greedy else 1.0
    if greedy or candidates or not use_k:  # (a large top-k without candidates needs no stage 1)
        _chunk_launch[(B, n_chunks)](
            logits, logits.stride(0), noise, noise.stride(0), work, V, temp,
            GREEDY=greedy, CANDIDATES=candidates, CHUNK=chunk, KC=kc, PACK16=logits.element_size() == 2,
            num_warps=chunk_warps or CHUNK_WARPS[mode],
        )  # fmt: skip
    cap = pow2(V if not candidates else n_chunks * kc)
    if interpreting():  # small steps: the CPU tests cover several of them
        cap = min(cap, 128)
    block = min(combine_block or COMBINE_BLOCK, cap)
    _combine_launch[(B,)](
        logits, logits.stride(0), noise, noise.stride(0), work, out,
        V, n_chunks, temp, int(top_k) if use_k else 0, float(top_p) if use_p else 1.0,
        GREEDY=greedy, TOP_K=use_k, TOP_P=use_p, CANDIDATES=candidates, KC=kc, CHUNKS=pow2(n_chunks),
        BLOCK=block, SEARCH_BLOCK=min(search_block or SEARCH_BLOCK, block), SPLITS=8,
        num_warps=combine_warps or (SEARCH_WARPS if use_k or use_p else COMBINE_WARPS),
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------ torch.compile: custom op
# Under torch.compile the public op calls this (Dynamo cannot trace the launches): opaque to the compiler,
# a fake function for the (B,) int64 tokens. The noise is drawn outside it, in the traced code.
@torch.library.custom_op("kiln::sample", mutates_args=())
def sample_op(
    logits: torch.Tensor,
    noise: torch.Tensor | None,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
) -> torch.Tensor:
    """The token each row draws given its Exp(1) noise (unused, and may be None, when greedy)."""
    return _launch(logits, noise, temperature, top_k, top_p)


@sample_op.register_fake
def _(logits, noise, temperature, top_k, top_p):
    _check(logits, temperature, top_p)
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    if not use_triton(logits):
        return sample_ref(logits, temperature, top_k, top_p, generator)
    _check(logits, temperature, top_p)
    noise = None
    if temperature > 0:
        # The same draw as sample_ref (a float32 tensor shaped like the logits), so one generator state
        # gives the same token on both paths; on the device, so no host sync.
        noise = torch.empty(logits.shape, device=logits.device, dtype=torch.float32)
        noise.exponential_(1.0, generator=generator)
    if logits.stride(1) != 1 and logits.shape[1] > 1:
        raise ValueError(f"logits must have unit stride along the vocabulary, got strides {logits.stride()}")
    if torch.compiler.is_compiling():
        return sample_op(logits, noise, float(temperature), top_k, None if top_p is None else float(top_p))
    return _launch(logits, noise, temperature, top_k, top_p)
