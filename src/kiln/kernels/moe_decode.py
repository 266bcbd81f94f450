"""Decode-sized mixture-of-experts FFN: the routed experts of a few tokens as weight streams, in two forms.

Shapes: x (T, d) tokens, expert_idx (T, k) int32/int64, weights (T, k) float (the router's), gate_up_proj
w1 (E, 2I, d) holding [gate | up] along dim 1, down_proj w2 (E, d, I), as the model stores them:

    h[t*k + j]   = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T)            e = expert_idx[t, j]     (T*k, I)
    out[t]       = sum_j weights[t, j] * (h[t*k + j] @ w2[e].T)                                 (T, d)

Why a separate path: at decode a layer's active experts are a few MB to a few hundred MB of weights for a
few MFLOP, and the prefill path (routing plan, permute, grouped GEMM, SwiGLU, grouped GEMM, unpermute) is
about fifteen kernels, most of them a few microseconds of launch and tail latency each: on the H200 the
Qwen3-30B-A3B-like layer (8 experts x 9.4 MB) at batch 1 took 64.5 us in a CUDA graph for 75.5 MB, 28% of
the copy bandwidth. Here it is two or three kernels, no sort, no permutation.

The "pairs" form, two kernels, one weight stream per (token, expert) pair:
- `_up_kernel`, grid (T*k pairs, cdiv(I, BLOCK_N)): each program reads the pair's expert id on the device,
  BLOCK_N gate rows and the matching BLOCK_N up rows of that expert, and the pair's token row; float32
  FMAs over BLOCK_K-wide steps (kernels/matmul_decode.py's one-row gemv: small BLOCK_N so that even one
  token spreads its experts over every SM), then silu(gate) * up, with gate and up rounded to x's dtype
  first as the two-kernel path stores them. The pair index is the fastest grid dimension, so pairs that
  share an expert (batch > 1) read the same weight rows at the same time: the second read hits L2.
- `_down_kernel`, grid (T, cdiv(d, BLOCK_N)): each program owns BLOCK_N output columns of one token and
  walks its k pairs' h rows and down_proj rows as one flattened (slot, K step) loop (one pipeline, not k
  short ones), the routing weight folded into h: out[t, n] = sum_j sum_i w2[e_j, n, i] * (w_j * h_j[i]).
  Every output element is written once, in a fixed order: deterministic, no atomics, no zeroed buffer.
Measured on the H200 (docs/perf/moe.md) it misses 80% of copy in two places: Zipf routing at batch 8-16
(several tokens on one hot expert: every pair streams that expert again, from L2 at best) and one or two
tokens with k 6-8 small experts (the down kernel's d / 4 programs each walk k * I weights serially).

The "experts" form, three kernels, each distinct expert's weights streamed once for all its tokens:
- `_up_experts_kernel`, grid (T*k slots, cdiv(I, BLOCK_N)): a program whose slot is not the first slot in flat
  order holding its expert (the leader) returns after one load of all T*k ids (<= 64 x 8) and a compare (where
  E < T*k the grid is (E, ...) instead, program e serving expert e: `by_expert_grid`, fewer programs with
  nothing to do); the leader gathers the tokens routed to its expert, ROWS (16-64) at a time, and streams each
  weight tile once into tl.dot against their rows (W tile (BLOCK_N, BLOCK_K) @ x.T (BLOCK_K, ROWS), the rows a
  pass lacks masked to zero), writing h for each of those pairs.
- `_down_experts_kernel`, grid (T*k slots or E, cdiv(d, BLOCK_N)): the same leaders; each pair's weighted
  down projection w_pair * (h_pair @ w2[e].T) over BLOCK_N columns into a float32 buffer (T*k, d).
- `_combine_kernel`, grid (T, cdiv(d, 256)): out[t] = sum_j partial[t*k + j], j in order: deterministic,
  no atomics.
At one and two tokens (and in float64, which tl.dot does not take) a pass holds one row: the pairs form's
up kernel (each pair streams its expert; at one token each is its expert's only one under a top-k
router) and `_down_pair_kernel`, grid (T*k, cdiv(d, BLOCK_N)): k times the pairs form's down programs,
each I deep instead of k * I.
Up to I = 2048 (`preload_down`) that kernel loads its whole weight slice before its programmatic-launch
wait and the up kernel is launched with PDL too, so the down weights stream while gate/up finishes: on
the H200 at 109775b Qwen3-like one token went from 0.729 to 0.801 of the copy rate.
The leader needs no sort and no host sync either: the ids are compared on the device, the grid is fixed.
A token that lists an expert twice (no top-k router does) is served by one pass per occurrence.

Which form: `moe_decode_fwd(..., form=)`, "auto" being the experts form, with one row a pass up to two
tokens (`expert_rows`: its docstring has the H200 measurements; bench/moe.py --case quick times both forms).
No host sync, the grids depend on T, k, d and I only: CUDA-graph safe. Tiles: `decode_tiles`, the dense
gemv's rule measured on the H200 (4 columns, 256-wide steps, 3-stage pipeline; long K: 2 columns,
1024-wide steps), and for the experts form's tl.dot kernels `expert_tiles`; bench/moe.py sweeps others.
Forward only (inference): the model takes this path when no gradient is needed and there are at most 64
tokens (`use_decode`, measured against the grouped GEMM: its docstring).
float32 accumulation; float32 / float16 / bfloat16 (the CPU tests run float32 and float16 through the
interpreter). Differences to the prefill path: out is summed in float32 without rounding each pair's down
projection to x's dtype first (one rounding less). Expert ids must lie in [0, E): not checked (a check is
a host sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kiln.kernels._common import FLOAT_DTYPES, needs_grad, pdl, pdl_prologue
from kiln.kernels.dispatch import interpreting, use_triton
from kiln.kernels.launch import CachedLaunch, cdiv, pow2


class DecodeTiles(NamedTuple):
    """One kernel's launch config: output columns per program, K step, warps, pipeline stages."""

    block_n: int
    block_k: int
    warps: int
    stages: int


def decode_tiles(K: int) -> DecodeTiles:
    """The tiles of a weight stream of depth K (d for the gate/up kernel, I for the down kernel): the one-row
    rule of kernels/matmul_decode.py's H200 sweep (docs/kernels/matmul_decode.md), whose kernel these
    loops copy: 4 columns per program, 2 warps, 256-wide K steps through a 3-stage cp.async pipeline up to
    K = 4096; past that 2 columns, 4 warps, 1024-wide steps, no pipeline. The interpreter: small tiles, so
    the CPU tests cover ragged columns and several K steps."""
    if interpreting():
        return DecodeTiles(4, 16, 1, 1)
    return DecodeTiles(4, 256, 2, 3) if K <= 4096 else DecodeTiles(2, 1024, 4, 1)


DECODE_MAX_TOKENS = 64  # the most tokens the model sends through these kernels (use_decode)


def use_decode(n_tokens: int) -> bool:
    """Whether the model's MoE block takes this path (with no gradient needed): up to 64 tokens, one
    64-row pass of the experts form. Measured on the H200 (CUDA-graph replays, docs/perf/moe.md): at
    4b6649a (bench/moe.py --case quick) the decode kernels beat the grouped GEMM at 8 and 16 tokens
    (Mixtral-like 1.01-1.04 of the copy rate against 0.94-0.96, DeepSeek-like 16 tokens 0.87-0.94 against
    0.73-0.85), but not at 64, where the experts form's grid still had a program row per slot and its
    16-row tiles (Qwen3-like 0.72-0.74 against the grouped GEMM's 0.76-0.82). With a row per expert
    (`by_expert_grid`) and its 32-64-row tiles (`expert_tiles`), at 4beb6db (bench/experiments/
    moe_decode_batch.py) the experts form beat the grouped path at 32, 48 and 64 tokens on every shape and
    routing: 0.84-1.04 against 0.69-0.96 (the grouped path also sorts: 27 us of its ~290 at Qwen3-like 64
    tokens). Past 64 tokens a hot expert takes a second pass: unmeasured, the grouped path stays."""
    return 0 < n_tokens <= DECODE_MAX_TOKENS


def moe_decode_ref(
    x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Eager reference, pair by pair: float32 math (float64 for float64), gate and up rounded to x's dtype
    before the SiLU as the kernels round them, the result in x's dtype."""
    _check(x, expert_idx, weights, w1, w2)
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    T, k = expert_idx.shape
    I = w2.shape[2]
    out = torch.zeros(T, x.shape[1], dtype=wide, device=x.device)
    for t in range(T):
        for j in range(k):
            e = int(expert_idx[t, j])
            gu = (x[t].to(wide) @ w1[e].to(wide).T).to(x.dtype).to(wide)  # (2I,)
            h = (torch.nn.functional.silu(gu[:I]) * gu[I:]).to(x.dtype).to(wide)
            out[t] += weights[t, j].to(wide) * (w2[e].to(wide) @ h)
    return out.to(x.dtype)


def _check(x, expert_idx, weights, w1, w2) -> None:
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"moe_decode expects x (T, d), w1 (E, 2I, d), w2 (E, d, I), got {tuple(x.shape)}, "
            f"{tuple(w1.shape)}, {tuple(w2.shape)}"
        )
    E, two_i, d = w1.shape
    if x.shape[1] != d or two_i % 2 or w2.shape != (E, d, two_i // 2):
        raise ValueError(
            f"moe_decode: w1 must be (E, 2I, d) = [gate | up] and w2 (E, d, I) for x's d = {x.shape[1]}, got "
            f"w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)}"
        )
    if expert_idx.dim() != 2 or expert_idx.shape[0] != x.shape[0] or weights.shape != expert_idx.shape:
        raise ValueError(
            f"moe_decode: expert_idx and weights must both be (T, k) with T = {x.shape[0]} tokens, got "
            f"{tuple(expert_idx.shape)} and {tuple(weights.shape)}"
        )
    if expert_idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"moe_decode: expert_idx must be int32 or int64, got {expert_idx.dtype}")
    if (
        x.dtype != w1.dtype
        or x.dtype != w2.dtype
        or (x.dtype not in FLOAT_DTYPES and x.dtype != torch.float64)
    ):
        raise TypeError(
            f"moe_decode takes x, w1 and w2 of one float dtype, got {x.dtype}, {w1.dtype}, {w2.dtype}"
        )
    devs = {t.device for t in (x, expert_idx, weights, w1, w2)}
    if len(devs) != 1:
        raise ValueError(f"moe_decode: every tensor must be on one device, got {sorted(map(str, devs))}")


@triton.jit
def _up_kernel(
    X_ptr,  # (T, d): x[t, c] at X_ptr + t * stride_xt + c * stride_xc
    Idx_ptr,  # (T * TOPK,) contiguous: the expert of pair p = t * TOPK + j
    W_ptr,  # (E, 2I, d): w1[e, n, c] at W_ptr + e * stride_we + n * stride_wn + c * stride_wc
    H_ptr,  # (T * TOPK, I) out, contiguous: silu(gate) * up per pair
    I,
    D,
    stride_xt,
    stride_xc,
    stride_we,
    stride_wn,
    stride_wc,
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # rows of gate (and of up) per program
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,  # > 1: the K loop's loads go through shared memory STAGES - 1 steps ahead
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (the experts form, one row)
):
    pdl_prologue(PDL)
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < I)[:, None]
    e = tl.load(Idx_ptr + p).to(tl.int64)
    x_row = X_ptr + (p // TOPK).to(tl.int64) * stride_xt
    g_rows = W_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    u_rows = g_rows + I * stride_wn  # the up rows: I further on (I * d < 2**31)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # products accumulate elementwise and are summed over K once at the end: the loop is loads and FMAs
    for k0 in tl.range(0, D, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < D
        x = tl.load(x_row + offs_k * stride_xc, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        m = n_ok & k_ok[None, :]
        wg = tl.load(g_rows + offs_k[None, :] * stride_wc, mask=m, other=0.0)
        wu = tl.load(u_rows + offs_k[None, :] * stride_wc, mask=m, other=0.0)
        acc_g += wg.to(tl.float32) * x
        acc_u += wu.to(tl.float32) * x
    # rounded to the output dtype before the SiLU, as the grouped GEMM's stored products are
    g = tl.sum(acc_g, axis=1).to(H_ptr.dtype.element_ty).to(tl.float32)  # (BLOCK_N,)
    u = tl.sum(acc_u, axis=1).to(H_ptr.dtype.element_ty).to(tl.float32)
    h = g * tl.sigmoid(g) * u
    tl.store(H_ptr + p.to(tl.int64) * I + offs_n, h.to(H_ptr.dtype.element_ty), mask=offs_n < I)


@triton.jit
def _down_kernel(
    H_ptr,  # (T * TOPK, I) contiguous: the up kernel's output
    Idx_ptr,  # (T * TOPK,) contiguous expert ids
    Wt_ptr,  # (T * TOPK,) contiguous routing weights (any float dtype; used in float32)
    W_ptr,  # (E, d, I): w2[e, n, i] at W_ptr + e * stride_we + n * stride_wn + i * stride_wi
    Y_ptr,  # (T, d) out, contiguous
    I,
    D,
    stride_we,
    stride_wn,
    stride_wi,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,  # pow2 >= max(TOPK, 2): the width of the slots' vector loads
    BLOCK_N: tl.constexpr,  # output columns (rows of w2[e]) per program
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < D)[:, None]
    slots = tl.arange(0, TOPK_P2)
    pair0 = t.to(tl.int64) * TOPK
    es = tl.load(Idx_ptr + pair0 + slots, mask=slots < TOPK, other=0).to(tl.int64)  # (TOPK_P2,)
    ws = tl.load(Wt_ptr + pair0 + slots, mask=slots < TOPK, other=0.0).to(tl.float32)
    w_rows = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1), expert added per slot
    k_steps = tl.cdiv(I, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    # one loop over (slot, K step): a single pipeline across the k experts; the slot's expert and weight
    # are picked out of registers (no load feeds another load's address inside the loop)
    for it in tl.range(0, TOPK * k_steps, num_stages=STAGES):
        j = it // k_steps
        offs_k = (it - j * k_steps) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < I
        e = tl.sum(tl.where(slots == j, es, 0), axis=0)
        wj = tl.sum(tl.where(slots == j, ws, 0.0), axis=0)
        h = tl.load(H_ptr + (pair0 + j) * I + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_rows + e * stride_we + offs_k[None, :] * stride_wi, mask=n_ok & k_ok[None, :], other=0.0
        )
        acc += w.to(tl.float32) * (h * wj)[None, :]
    y = tl.sum(acc, axis=1)  # (BLOCK_N,)
    tl.store(Y_ptr + t.to(tl.int64) * D + offs_n, y.to(Y_ptr.dtype.element_ty), mask=offs_n < D)


# ------------------------------------------------------------------------- the "experts" form (deduped)
@triton.jit
def _leader_occurrences(
    Idx_ptr, p, T, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, T_P2: tl.constexpr, BY_EXPERT: tl.constexpr
):
    """(e, n_occ): program p's expert, and how many passes it makes. Over slots (BY_EXPERT false): slot
    p's expert, 0 passes unless p is the first slot in flat order holding e (the leader, which serves every
    pair of e). Over experts (BY_EXPERT): expert p itself, 0 passes if no token holds it. Else the most
    times one token holds e (1 from a top-k router; more only when a token lists an expert twice). All T*k
    ids in one 2-D load (<= 64 x 8 at decode) and a compare: no sort, no host sync."""
    toks = tl.arange(0, T_P2)[:, None]
    js = tl.arange(0, TOPK_P2)[None, :]
    ids = tl.load(Idx_ptr + toks * TOPK + js, mask=(toks < T) & (js < TOPK), other=-1)  # (T_P2, TOPK_P2)
    if BY_EXPERT:
        e = p
    else:
        e = tl.load(Idx_ptr + p)
    hit = ids == e
    most = tl.max(tl.sum(hit.to(tl.int32), axis=1), axis=0)
    if not BY_EXPERT:
        first = tl.min(tl.min(tl.where(hit, toks * TOPK + js, T_P2 * TOPK_P2), axis=1), axis=0)
        most = tl.where(first == p, most, 0)
    return e.to(tl.int64), most


@triton.jit
def _chunk_pairs(Idx_ptr, e, c, o, T, TOPK: tl.constexpr, TOPK_P2: tl.constexpr, ROWS: tl.constexpr):
    """Tokens c*ROWS .. c*ROWS + ROWS - 1 as rows: each row's pair index t*k + j where j is the token's
    o-th slot holding expert e, and whether the row has one (ROWS,) each."""
    toks = c * ROWS + tl.arange(0, ROWS)
    js = tl.arange(0, TOPK_P2)[None, :]
    ids = tl.load(Idx_ptr + toks[:, None] * TOPK + js, mask=(toks < T)[:, None] & (js < TOPK), other=-1)
    hit = ids == e  # (ROWS, TOPK_P2)
    sel = hit & (tl.cumsum(hit.to(tl.int32), axis=1) == o + 1)  # the o-th hit of each token
    j = tl.sum(tl.where(sel, js, 0), axis=1)
    return toks.to(tl.int64) * TOPK + j, tl.sum(sel.to(tl.int32), axis=1) > 0


@triton.jit
def _up_experts_kernel(
    X_ptr,  # (T, d): x[t, c] at X_ptr + t * stride_xt + c * stride_xc
    Idx_ptr,  # (T * TOPK,) contiguous expert ids
    W_ptr,  # (E, 2I, d): w1[e, n, c] at W_ptr + e * stride_we + n * stride_wn + c * stride_wc
    H_ptr,  # (T * TOPK, I) out, contiguous: silu(gate) * up per pair
    T,
    I,
    D,
    stride_xt,
    stride_xc,
    stride_we,
    stride_wn,
    stride_wc,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,  # pow2 >= max(TOPK, 2)
    T_P2: tl.constexpr,  # pow2 >= max(T, 2)
    ROWS: tl.constexpr,  # tokens per pass (16-64): x.T's columns, the MMA's N side
    BY_EXPERT: tl.constexpr,  # grid axis 0 over experts (E < T*k: fewer programs) instead of slots
    PRECISION: tl.constexpr,  # tl.dot input_precision ("ieee" or "tf32" for float32; fp16 / bf16 ignore it)
    BLOCK_N: tl.constexpr,  # rows of gate (and of up) per program
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kernels/_common.py pdl_prologue)
):
    pdl_prologue(PDL)
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < I)[:, None]
    e, n_occ = _leader_occurrences(Idx_ptr, p, T, TOPK, TOPK_P2, T_P2, BY_EXPERT)
    g_rows = W_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    u_rows = g_rows + I * stride_wn
    # passes: each occurrence (1 from a top-k router) and each ROWS tokens; a pass none of whose tokens
    # holds e reads nothing (k_end = 0). With T <= ROWS and a top-k router: one pass, the weights read once.
    for o in range(0, n_occ):
        for c in range(0, tl.cdiv(T, ROWS)):
            pair, row_ok = _chunk_pairs(Idx_ptr, e, c, o, T, TOPK, TOPK_P2, ROWS)  # (ROWS,)
            x_cols = X_ptr + (pair // TOPK)[None, :] * stride_xt  # (1, ROWS): x.T's columns
            k_end = tl.where(tl.max(row_ok.to(tl.int32), axis=0) > 0, D, 0)
            # (BLOCK_N, ROWS) += W tile (BLOCK_N, BLOCK_K) @ x.T (BLOCK_K, ROWS), kernels/matmul_decode.py's
            # dot kernel (measured on the H200 at 2-16 rows): each weight element meets up to ROWS tokens,
            # which FMAs would pay ROWS times on the CUDA cores (16 bf16 rows at 4.3 TB/s of weights is ~70
            # TFLOP/s of FMA, about the H200's whole fp32 rate); the tensor cores take it for free, and the
            # rows a pass lacks are zeros that cost no memory traffic (masked loads)
            acc_g = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
            for k0 in tl.range(0, k_end, BLOCK_K, num_stages=STAGES):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < D
                xt = tl.load(
                    x_cols + offs_k[:, None] * stride_xc, mask=k_ok[:, None] & row_ok[None, :], other=0.0
                )
                m = n_ok & k_ok[None, :]
                wg = tl.load(g_rows + offs_k[None, :] * stride_wc, mask=m, other=0.0)
                wu = tl.load(u_rows + offs_k[None, :] * stride_wc, mask=m, other=0.0)
                acc_g = tl.dot(wg, xt, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(wu, xt, acc_u, input_precision=PRECISION)
            # rounded to the output dtype before the SiLU, as the pairs form and the grouped GEMM round them
            g = acc_g.to(H_ptr.dtype.element_ty).to(tl.float32)
            u = acc_u.to(H_ptr.dtype.element_ty).to(tl.float32)
            h = g * tl.sigmoid(g) * u
            # written as it lies, (n, row) -> h[pair, n]: no transpose through shared memory
            tl.store(H_ptr + pair[None, :] * I + offs_n[:, None], h.to(H_ptr.dtype.element_ty),
                     mask=n_ok & row_ok[None, :])  # fmt: skip


@triton.jit
def _down_experts_kernel(
    H_ptr,  # (T * TOPK, I) contiguous: the up kernel's output
    Idx_ptr,  # (T * TOPK,) contiguous expert ids
    Wt_ptr,  # (T * TOPK,) contiguous routing weights (any float dtype; used in float32)
    W_ptr,  # (E, d, I): w2[e, n, i] at W_ptr + e * stride_we + n * stride_wn + i * stride_wi
    P_ptr,  # (T * TOPK, d) float32 out, contiguous: each pair's weighted down projection
    T,
    I,
    D,
    stride_we,
    stride_wn,
    stride_wi,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    T_P2: tl.constexpr,
    ROWS: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output columns (rows of w2[e]) per program
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    p = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < D)[:, None]
    e, n_occ = _leader_occurrences(Idx_ptr, p, T, TOPK, TOPK_P2, T_P2, BY_EXPERT)
    w_rows = W_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    for o in range(0, n_occ):
        for c in range(0, tl.cdiv(T, ROWS)):
            pair, row_ok = _chunk_pairs(Idx_ptr, e, c, o, T, TOPK, TOPK_P2, ROWS)  # (ROWS,)
            h_cols = H_ptr + pair[None, :] * I  # (1, ROWS): h.T's columns
            k_end = tl.where(tl.max(row_ok.to(tl.int32), axis=0) > 0, I, 0)
            acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
            for k0 in tl.range(0, k_end, BLOCK_K, num_stages=STAGES):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < I
                ht = tl.load(h_cols + offs_k[:, None], mask=k_ok[:, None] & row_ok[None, :], other=0.0)
                w = tl.load(w_rows + offs_k[None, :] * stride_wi, mask=n_ok & k_ok[None, :], other=0.0)
                acc = tl.dot(w, ht, acc, input_precision=PRECISION)  # (BLOCK_N, ROWS)
            # the routing weight after the K sum (constant over K): h enters the MMA as stored
            wt = tl.load(Wt_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)  # (ROWS,)
            tl.store(
                P_ptr + pair[None, :] * D + offs_n[:, None], acc * wt[None, :], mask=n_ok & row_ok[None, :]
            )


@triton.jit
def _down_pair_kernel(
    H_ptr,  # (T * TOPK, I) contiguous: the up kernel's output
    Idx_ptr,  # (T * TOPK,) contiguous expert ids
    Wt_ptr,  # (T * TOPK,) contiguous routing weights
    W_ptr,  # (E, d, I): w2[e, n, i] at W_ptr + e * stride_we + n * stride_wn + i * stride_wi
    P_ptr,  # (T * TOPK, d) float32 out, contiguous
    I,
    D,
    stride_we,
    stride_wn,
    stride_wi,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    PDL: tl.constexpr,
    PRELOAD: tl.constexpr = False,  # read the whole (BLOCK_N, I) weight slice before waiting for h
    I_P2: tl.constexpr = 16,  # pow2 >= I (PRELOAD's slice width)
):
    """One row per pass (one or two tokens, or a dtype without tl.dot): program (pair, column block) computes
    its pair's weighted down projection over I alone, the FMA gemv of the pairs form's kernels: k times the
    pairs form's down programs, each k times shorter. PRELOAD: the expert id and the weights are not written
    by the up kernel, so the program loads its whole weight slice before its programmatic-launch wait, while
    the up kernel still streams gate/up (it must then be launched with PDL itself, so that this one is
    scheduled before it ends); only h waits."""
    p = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < D)[:, None]
    if PRELOAD:
        # the router that wrote the ids ran before the up kernel, which waited for it before letting
        # this kernel be scheduled: reading them (and the weights) before our own wait is safe
        e = tl.load(Idx_ptr + p).to(tl.int64)
        offs_k = tl.arange(0, I_P2)
        k_ok = offs_k < I
        w_rows = W_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
        w = tl.load(w_rows + offs_k[None, :] * stride_wi, mask=n_ok & k_ok[None, :], other=0.0)
        pdl_prologue(PDL)
        h = tl.load(H_ptr + p * I + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * h[None, :], axis=1)
    else:
        pdl_prologue(PDL)
        e = tl.load(Idx_ptr + p).to(tl.int64)
        w_rows = W_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, I, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            h = tl.load(H_ptr + p * I + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + offs_k[None, :] * stride_wi, mask=n_ok & k_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * h[None, :]
        y = tl.sum(acc, axis=1)
    y = y * tl.load(Wt_ptr + p).to(tl.float32)  # (BLOCK_N,)
    tl.store(P_ptr + p * D + offs_n, y, mask=offs_n < D)


@triton.jit
def _combine_kernel(
    P_ptr,  # (T * TOPK, d) float32, contiguous: the pairs' weighted down projections
    Y_ptr,  # (T, d) out, contiguous
    D,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = sum_j P[t*k + j], j = 0 .. k-1 in that order: deterministic, no atomics."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < D
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(P_ptr + (t * TOPK + j) * D + offs, mask=ok, other=0.0)
    tl.store(Y_ptr + t * D + offs, acc.to(Y_ptr.dtype.element_ty), mask=ok)


_up_launch = CachedLaunch(_up_kernel)
_down_launch = CachedLaunch(_down_kernel)
_up_experts_launch = CachedLaunch(_up_experts_kernel)
_down_experts_launch = CachedLaunch(_down_experts_kernel)
_down_pair_launch = CachedLaunch(_down_pair_kernel)
_combine_launch = CachedLaunch(_combine_kernel)


FORMS = ("auto", "pairs", "experts")
DOT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # tl.dot's inputs (float64 takes FMAs)


def expert_rows(n_tokens: int, dtype: torch.dtype) -> int:
    """Tokens per pass of the experts form (the form `form="auto"` takes at every batch): one row (FMAs,
    the pairs form's weight streams with the one-row down kernel's preload) up to 2 tokens, else pow2(T)
    within [16, 64] for tl.dot (16 is its narrowest side; past 64 tokens a hot expert is read once per 64).

    Measured on the H200 (CUDA-graph replays, fractions of the copy rate, docs/perf/moe.md). One token, at
    c598f16: the one-row experts form over the pairs form 1.04-1.09x at every shape. 2 tokens, at 4beb6db
    (bench/experiments/moe_decode_batch.py): one row 0.818-1.064 on the three shapes and both routings,
    the pairs form 0.804-1.032, 16-row passes 0.760-1.033. 3 tokens: 16-row passes 0.808-1.073, the
    pairs form 0.781-1.055, one row 0.785-1.083 (16-row passes have the best worst case: Zipf routing puts
    several tokens on one expert, which they read once). 4-64 tokens, at 4b6649a and 4beb6db: the
    experts form wins under Zipf routing (1.08-1.56x the pairs form at 4-16) and gives up 0-9% under
    balanced routing: the better worst case, and the host cannot see the routing without a sync."""
    if n_tokens <= 2 or dtype not in DOT_DTYPES:
        return 1
    return min(max(16, pow2(n_tokens)), 64)


def expert_tiles(K: int, rows: int) -> DecodeTiles:
    """The experts form's tiles for a weight stream of depth K: the pairs form's at one row; with tl.dot
    64-wide column blocks, 4 warps, and 128-wide K steps through 3 stages for 16-row passes, 64-wide
    through 4 for 32 and 64 rows. The H200 sweep at c598f16 (bench/moe.py --case quick, Qwen3-like batch
    16 under Zipf routing, CUDA-graph replays) measured 64 columns at 0.762 (up) and 0.801 (down) of the
    copy rate against 0.666 for kernels/matmul_decode.py's 16-column rule, which this form first
    borrowed: a weight tile meets up to 16 rows of x, so wider blocks cost no extra x traffic and halve
    the programs' ramp-up per byte; there 64-wide K steps were a tie (0.945 / 0.941 against 0.944). At
    32-64 rows (4beb6db, bench/experiments/moe_decode_batch.py, over experts) the (64, 64, 4, 4) tiles
    took Qwen3-like 64 tokens from 0.829 to 0.879 (balanced) and 0.804 to 0.856 (Zipf), DeepSeek-like
    0.846 to 0.890 and 0.835 to 0.915, Mixtral-like 0.981 to 0.996: the (64, ROWS) accumulators of 64 rows
    leave fewer registers to 128-wide steps. Interpreted: small tiles (ragged columns, several K steps)."""
    if rows == 1:
        return decode_tiles(K)
    if interpreting():
        return DecodeTiles(16, 16, 1, 1)
    return DecodeTiles(64, 128, 4, 3) if rows <= 16 else DecodeTiles(64, 64, 4, 4)


def shared_mlp_as_experts(gate_up: torch.Tensor, down: torch.Tensor, inter: int):
    """A shared SwiGLU MLP, gate_up (2F, d) (gate rows then up rows, the model's layout) and down (d, F),
    as F / inter experts of `inter` features: (n, 2 * inter, d) and (n, d, inter). SwiGLU acts feature by
    feature, so feature group j's down projection is a partial sum of the MLP's output: the n experts at
    weight 1 sum to it."""
    F2, d = gate_up.shape
    F = F2 // 2
    if F2 % 2 or F % inter or down.shape != (d, F):
        raise ValueError(
            f"shared_mlp_as_experts: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} must be "
            f"(2F, d) and (d, F) with F a multiple of the routed experts' {inter} features"
        )
    n = F // inter
    gate, up = gate_up.view(2, n, inter, d).unbind(0)
    return torch.cat([gate, up], 1).contiguous(), down.view(d, n, inter).permute(1, 0, 2).contiguous()


def stack_shared_experts(w1: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor):
    """(w1, w2) with S shared experts appended as experts E .. E+S-1: the shared-experts fusion of SGLang's
    DeepSeek path, done once when weights are loaded. s1 (S, 2I, d) / s2 (S, d, I) (or one expert without
    the leading dim) must have the routed experts' I; a shared MLP of n * I features is n experts of I (its
    gate/up rows and down columns split into n groups: the n partial outputs sum to the whole). Then
    `add_shared_slots` routes every token to them and a decode step streams them in the same launches."""
    if s1.dim() == 2:
        s1, s2 = s1[None], s2[None]
    if s1.shape[1:] != w1.shape[1:] or s2.shape[1:] != w2.shape[1:]:
        raise ValueError(
            f"stack_shared_experts: shared experts {tuple(s1.shape)} / {tuple(s2.shape)} must have the routed "
            f"experts' shapes {tuple(w1.shape[1:])} / {tuple(w2.shape[1:])} (split a wider shared MLP into "
            "experts of the routed I)"
        )
    return torch.cat([w1, s1.to(w1.dtype)]), torch.cat([w2, s2.to(w2.dtype)])


def add_shared_slots(
    expert_idx: torch.Tensor, weights: torch.Tensor, n_routed: int, n_shared: int, shared_weights=None
):
    """Each token's (T, k) routing with the S shared experts (ids n_routed .. n_routed+S-1, stacked by
    `stack_shared_experts`) as S more slots: (T, k+S) ids and weights. shared_weights (T, S): a per-token
    gate (Qwen2-MoE's sigmoid shared-expert gate); None: 1 (DeepSeek's shared experts)."""
    T = expert_idx.shape[0]
    ids = torch.arange(n_routed, n_routed + n_shared, device=expert_idx.device, dtype=expert_idx.dtype)
    sw = weights.new_ones(T, n_shared) if shared_weights is None else shared_weights.to(weights.dtype)
    return torch.cat([expert_idx, ids.expand(T, n_shared)], 1), torch.cat([weights, sw], 1)


def moe_decode_fwd(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    config: tuple[DecodeTiles, DecodeTiles] | None = None,
    form: str = "auto",
    rows: int | None = None,
    preload: bool | None = None,
    by_expert: bool | None = None,
) -> torch.Tensor:
    """Launcher: out (T, d) in x's dtype. form: "pairs" (two kernels, each (token, expert) pair streams its
    expert), "experts" (each distinct expert streamed once for all its tokens: three kernels) or "auto" (the
    experts form: `expert_rows`). config: (up tiles, down tiles), default `decode_tiles` of d and I (pairs) or
    `expert_tiles` (experts). rows: the experts form's tokens per pass (default `expert_rows`; 1 or a power of
    two >= 16 for tl.dot). preload: the experts form at one row reads the down weights before waiting for the
    up kernel (default `preload_down`). by_expert: the experts form's tl.dot kernels take one program row per
    expert instead of one per slot (default `by_expert_grid`)."""
    _check(x, expert_idx, weights, w1, w2)
    if form not in FORMS:
        raise ValueError(f"moe_decode: form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    T, k = expert_idx.shape
    E, two_i, d = w1.shape
    I = two_i // 2
    out = torch.empty(T, d, dtype=x.dtype, device=x.device)
    if T == 0 or d == 0:
        return out
    if I == 0 or k == 0:
        return out.zero_()
    if form == "auto":  # the experts form at every batch (expert_rows has the measurements)
        form = "experts"
    idx = expert_idx.reshape(-1)  # (T*k,): views of contiguous (T, k); a strided one is copied
    wts = weights.reshape(-1)
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    if form == "experts":
        _experts(x, idx, wts, w1, w2, h, out, T, k, config, rows, preload, by_expert)
        return out
    if rows is not None or by_expert is not None:
        raise ValueError("moe_decode: rows and by_expert apply to form='experts' only")
    up, down = config or (decode_tiles(d), decode_tiles(I))
    _up_launch[(T * k, cdiv(I, up.block_n))](
        x, idx, w1, h, I, d, x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2), TOPK=k,
        BLOCK_N=up.block_n, BLOCK_K=up.block_k, STAGES=up.stages, num_warps=up.warps,
    )  # fmt: skip
    _down_launch[(T, cdiv(d, down.block_n))](
        h, idx, wts, w2, out, I, d, w2.stride(0), w2.stride(1), w2.stride(2), TOPK=k, TOPK_P2=max(2, pow2(k)),
        BLOCK_N=down.block_n, BLOCK_K=down.block_k, STAGES=down.stages, num_warps=down.warps,
    )  # fmt: skip
    return out


def preload_down(I: int) -> bool:
    """Whether the experts form's one-row down kernel loads its whole weight slice before waiting for the
    up kernel (`_down_pair_kernel`'s PRELOAD): where the slice fits a program's registers, I <= 2048
    (BLOCK_N x I / threads values each: 4 x 2048 / 64 = 128 at the default tiles)."""
    return I <= 2048


def by_expert_grid(n_slots: int, n_experts: int) -> bool:
    """Whether the experts form's tl.dot kernels give each expert a program row (else each slot, whose
    non-leaders return at once): where there are fewer experts than slots, T*k > E (Qwen3-like from 17
    tokens, Mixtral-like from 5). Each expert is served by one program row either way, with the same
    passes in the same order: the two grids give the same bits."""
    return n_experts < n_slots


def _experts(x, idx, wts, w1, w2, h, out, T, k, config, rows, preload, by_expert) -> None:
    """The experts form's three launches (module docstring): up into h, down into float32 partials per
    pair, the combine into out. One row per pass (one or two tokens, or float64): the pairs form's up kernel
    (each pair streams its expert) and a down kernel per pair."""
    d, I = x.shape[1], h.shape[1]
    rows = expert_rows(T, x.dtype) if rows is None else rows
    if rows < 1 or rows & (rows - 1) or (rows > 1 and (rows < 16 or x.dtype not in DOT_DTYPES)):
        raise ValueError(
            f"moe_decode: rows must be 1, or a power of two >= 16 with a float16 / bfloat16 / float32 x "
            f"(tl.dot), got {rows} for {x.dtype}"
        )
    up, down = config or (expert_tiles(d, rows), expert_tiles(I, rows))
    part = torch.empty(T * k, d, dtype=torch.float32, device=x.device)  # every element written once
    # programmatic dependent launch (sm_90+, as kernels/decode_attention.py's split and combine): each of
    # this form's kernels (all but the pairs form's up kernel at one row) is scheduled while its predecessor
    # runs and waits for it in its prologue, so the third launch (the combine) adds no launch gap.
    # KILN_PDL=0 turns it off (A/B timing).
    use_pdl = pdl(x)
    if rows == 1:
        preload = preload_down(I) if preload is None else preload
        up_pdl = use_pdl and preload  # the down kernel's preload needs it scheduled before the up kernel ends
        _up_launch[(T * k, cdiv(I, up.block_n))](
            x, idx, w1, h, I, d, x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2), TOPK=k,
            BLOCK_N=up.block_n, BLOCK_K=up.block_k, STAGES=up.stages, PDL=up_pdl, num_warps=up.warps,
            launch_pdl=up_pdl,
        )  # fmt: skip
        _down_pair_launch[(T * k, cdiv(d, down.block_n))](
            h, idx, wts, w2, part, I, d, w2.stride(0), w2.stride(1), w2.stride(2), BLOCK_N=down.block_n,
            BLOCK_K=down.block_k, STAGES=down.stages, PDL=use_pdl, PRELOAD=preload, I_P2=max(16, pow2(I)),
            num_warps=down.warps, launch_pdl=use_pdl,
        )  # fmt: skip
    else:
        if min(up.block_n, up.block_k, down.block_n, down.block_k) < 16:
            raise ValueError(f"moe_decode: tl.dot tiles need block_n and block_k >= 16, got {up} and {down}")
        precision = "tf32" if x.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"
        E = w1.shape[0]
        by_expert = by_expert_grid(T * k, E) if by_expert is None else by_expert
        meta = dict(TOPK=k, TOPK_P2=max(2, pow2(k)), T_P2=max(2, pow2(T)), ROWS=rows, BY_EXPERT=by_expert,
                    PRECISION=precision)  # fmt: skip
        programs = E if by_expert else T * k
        _up_experts_launch[(programs, cdiv(I, up.block_n))](
            x, idx, w1, h, T, I, d, x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2), **meta,
            BLOCK_N=up.block_n, BLOCK_K=up.block_k, STAGES=up.stages, PDL=use_pdl, num_warps=up.warps,
            launch_pdl=use_pdl,
        )  # fmt: skip
        _down_experts_launch[(programs, cdiv(d, down.block_n))](
            h, idx, wts, w2, part, T, I, d, w2.stride(0), w2.stride(1), w2.stride(2), **meta,
            BLOCK_N=down.block_n, BLOCK_K=down.block_k, STAGES=down.stages, PDL=use_pdl, num_warps=down.warps,
            launch_pdl=use_pdl,
        )  # fmt: skip
    # 256 columns per program (2 warps, 16-byte loads): at one token d / 256 programs (8 at d = 2048), each
    # k loads deep; the partials (k * d * 4 bytes, 64 KB for Qwen3-like) were just written, in L2
    block = min(256, pow2(d))
    _combine_launch[(T, cdiv(d, block))](
        part, out, d, TOPK=k, BLOCK=block, PDL=use_pdl, num_warps=2, launch_pdl=use_pdl
    )


# ------------------------------------------------------------------------------ torch.compile: custom op
@torch.library.custom_op("kiln::moe_decode", mutates_args=())
def moe_decode_op(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    form: str = "auto",
) -> torch.Tensor:
    """out (T, d): the routed experts of T decode tokens (module docstring); forward only."""
    return moe_decode_fwd(x, expert_idx, weights, w1, w2, form=form)


@moe_decode_op.register_fake
def _(x, expert_idx, weights, w1, w2, form="auto"):
    _check(x, expert_idx, weights, w1, w2)
    if form not in FORMS:
        raise ValueError(f"moe_decode: form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    return x.new_empty(x.shape)


def moe_decode(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    form: str = "auto",
) -> torch.Tensor:
    """The routed experts' weighted sum for a few tokens (forward only: gradients are not tracked; the
    model calls it without autograd). x (T, d), expert_idx / weights (T, k), w1 (E, 2I, d), w2 (E, d, I);
    form "auto" / "pairs" / "experts" (`moe_decode_fwd`; the reference ignores it: one math)."""
    if needs_grad(x, weights, w1, w2):
        raise RuntimeError(
            "moe_decode is forward only (inference): call it under torch.no_grad(), or take the grouped "
            "path (kiln.model.moe.Experts.grouped) when gradients are needed"
        )
    if form not in FORMS:
        raise ValueError(f"moe_decode: form must be one of {', '.join(map(repr, FORMS))}, got {form!r}")
    if not use_triton(x, w1, w2):
        return moe_decode_ref(x, expert_idx, weights, w1, w2)
    if torch.compiler.is_compiling():
        return moe_decode_op(x, expert_idx, weights, w1, w2, form)
    return moe_decode_fwd(x, expert_idx, weights, w1, w2, form=form)
