"""Decode-sized matmul (M <= 16 rows, and up to 128 in the dot form): C = act(A @ B + bias), read as one
stream of B.

Shapes: A (M, K) with M <= DECODE_WIDE_M, B (K, N), bias (N,) or None -> C (M, N) in A's dtype. B is
usually an nn.Linear weight W (N, K) seen as W.T (K-contiguous), but any strides work. kiln's matmul routes
M <= DECODE_MAX_M here; wider calls (the engine's 32-128 sequence decode buckets, where cuBLAS streams the
weights at 1.1-3.3 TB/s: docs/perf/matmul_decode.md) come from the model's Linear when KILN_DECODE_ROWS
says so.

At decode the weight is read once and each of its elements used M times: qkv of Qwen2.5-1.5B at M = 1 is
6.3 MB for 6.3 MFLOP. Such a GEMM is bound by how fast the weight streams in, and at a few microseconds by
latency: what counts is spreading W over every SM with many loads in flight, not tensor-core tiles (a
16-row tile is 15/16 padding at M = 1). Two kernels, both over a grid (cdiv(N, BLOCK_N), SPLIT_K):

- "gemv": each program owns BLOCK_N output columns, i.e. BLOCK_N rows of W, and walks its K range in
  BLOCK_K chunks with float32 FMAs and a row sum, no tl.dot:
      acc[m, n] += sum_k x[m, k] * w[n, k]        x (BLOCK_M, BLOCK_K), w (BLOCK_N, BLOCK_K)
  A small BLOCK_N (4-32) gives N / BLOCK_N programs: several per SM even for N = 1536.
- "dot" (the swapped form): W is the tensor-core M side, x.T the 16-wide N side:
      acc (BLOCK_N, 16) += W tile (BLOCK_N, BLOCK_K) @ x.T (BLOCK_K, 16)
  and the tile is written back transposed into C (M, N). For M up to 16, where FMAs would cost M times
  the work of one row, and for 17-128 rows with x.T as wide as M's next power of two: W stays the
  128-row-or-fewer M side, so every W element is still loaded once, and the batch rides the wgmma N side.
With SPLIT_K > 1 each of SPLIT_K programs per column block sums one slice of K into a float32
(SPLIT_K, M, N) buffer (no atomics, no zeroed workspace), and a second kernel adds the slices in a fixed
order (deterministic), adds the bias and applies the activation.

Prologue "swiglu" (the gated MLP's down projection): A is the gate_up projection's output (M, 2K)
holding [gate | up], and each program forms its x tile as silu(gate) * up while it loads it, rounded to
A's dtype as the separate kiln.kernels.swiglu kernel would round it (so the fused and unfused products
agree). Every column block recomputes its K range of x: at one row that is N / BLOCK_N recomputations of
a few KB held in L2, for one launch and one (M, K) round trip less (kiln.kernels.swiglu.swiglu_linear).

Add + RMSNorm split across two matmuls (a pre-norm block's o / down projection, then qkv / gate_up),
recomputing nothing: epilogue "residual_sumsq" on the first, h = round(r + round(act(x @ W.T + bias)))
(kiln's add + RMSNorm kernel's rounding) stored as the new stream, and sum(h^2) over each program's
columns (float32, from the rounded h) stored into a (M, n_col_blocks) buffer, each entry by one program
(no atomics, deterministic; with split K the sum kernel, whose programs own whole column blocks, does
this). Prologue "rmsnorm" on the second: each program sums the (M, n) partials in a fixed order, rstd =
rsqrt(sum / K + eps), and forms its x tile as round(round(h * rstd) * (offset + gamma)) as it loads it (the
norm kernel's rounding points). The separate norm launch goes; its (M, d) round trip becomes a few KB of
partials read from L2 by every program of the second matmul. kiln.kernels.rmsnorm.norm_fused_ref is the
sequence it replaces.

Epilogue "swiglu" (the gated MLP's gate_up projection): W (2F, K) holds the gate rows [0, F) and the up rows
[F, 2F), and C = swiglu(A @ W.T + bias) (M, F) = silu(gate) * up, recomputing nothing: a program owns
BLOCK_N / 2 features f and loads both their rows, interleaved (block row r is W row f0 + r // 2 + (r % 2) F),
so that its (rows, BLOCK_N) result splits into gate and up by a reshape to (..., BLOCK_N / 2, 2). gate and
up are rounded to C's dtype where the unfused gate_up output is stored (after the bias), then silu(gate) *
up is computed in float32 and rounded as the separate kiln.kernels.swiglu kernel computes it: the same
bits as swiglu(decode_matmul(a, b, bias)) with the same config, with one launch and the (M, 2F) round trip
less. The SwiGLU prologue of the down projection (above) instead recomputes a row's SwiGLU in every column
block. No split K with it (the sum kernel would have to own a feature's gate and up columns together):
the rule picks none for it.

The weight before the programmatic-launch wait (`DecodeConfig.pre_k`, gemv at one row): W is not written
by the kernel before (the contract of every caller: it is a parameter), so a program may request its first
pre_k columns (all of K where pre_k >= K) before griddepcontrol.wait, and only x after it. The launcher
takes it for the small projections (`preload_weight`: qkv and o at the Qwen2.5-1.5B shape, whose programs
are all resident while the kernel before runs; 1.012x whole steps at batch 1 on the H200,
docs/perf/matmul_decode.md). The preloaded columns are summed at once, not step by step: other bits than
the loop's, within float32 accumulation.

Which kernel and tiles: `decode_config`, a fixed rule from a sweep on the H200 (bench/sweep_matmul_decode.py,
docs/kernels/matmul_decode.md); no autotuner, so a call costs one config lookup and one or two launches.
Dtypes: float16, bfloat16 (float32 accumulation) and float32. Forward only: `kiln.kernels.matmul`
routes here from its launcher and keeps the autograd Function.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.kernels._common import apply_activation, env_form, griddep
from kiln.kernels._common import pdl as use_pdl
from kiln.kernels.dispatch import interpreting, sm_count
from kiln.kernels.launch import CachedLaunch, cdiv, pow2

DECODE_MAX_M = 16  # kiln's matmul routes up to this many rows here (the gemv and 16-wide dot tiles)
DECODE_WIDE_M = 128  # the dot kernel's x.T tile is at most this wide: one column block covers every row


def table_rows(M: int) -> int:
    """The row count a swept decode table (quant_matmul.DECODE_TABLE, fp8_matmul.FP8_DECODE_TABLE) keys M
    by: 1, 4 for 2-4 rows, 16 for 5-16."""
    return 1 if M == 1 else 4 if M <= 4 else 16


class DecodeConfig(NamedTuple):
    """A launch config: kernel ("gemv" or "dot"), tiles, K split, warps, pipeline stages, and `pdl`: launch
    the main kernel with programmatic dependent launch (Hopper+), so that it may start while the kernel
    before it in the stream finishes, waiting for it (griddepcontrol.wait) before its first load. That
    pays only after kernels that signal early (griddepcontrol.launch_dependents), as these do: off by
    default, since the ops around a decode GEMM do not yet. The quantized and FP8 decode kernels
    (kernels/quant_decode.py, fp8_matmul) take these configs too but ignore `pdl`: they launch with it
    wherever kiln.kernels._common.pdl says (KILN_PDL=0 turns it off)."""

    kernel: str
    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = 4
    stages: int = 1
    pdl: bool = False
    pre_k: int = 0  # gemv at one row: W's first pre_k columns (a power of two) loaded before the PDL wait

    def __str__(self) -> str:
        pdl = " pdl" if self.pdl else ""
        pre = f" pre={self.pre_k}" if self.pre_k else ""
        return f"{self.kernel} BN={self.block_n} BK={self.block_k} SK={self.split_k} w={self.warps} s={self.stages}{pdl}{pre}"


def split_sum_ref(partials: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The output of a split-K decode matmul from its float32 slices (S, M, N) (`decode_matmul(...,
    defer_sum=True)`): added in slice order, + bias, rounded to `dtype`, as the sum kernel does (no
    activation). The reference of the kernels that take the slices (rmsnorm_split, rope_kv_write_split)."""
    acc = partials[0].clone()
    for p in partials[1:]:
        acc += p
    if bias is not None:
        acc += bias.to(acc.dtype)
    return acc.to(dtype)


@functools.lru_cache(maxsize=256)
def decode_config(
    M: int, N: int, K: int, sms: int, k_major: bool = True, split_ok: bool = True
) -> DecodeConfig:
    """The config a call without an explicit one uses: a pure function of the shape, the SM count and
    whether W is K-contiguous (the nn.Linear layout; the gemv's 16-byte loads run along K). split_ok=False
    (the swiglu epilogue, which takes no split K): the long-K tile over all of K instead of split. The rule
    splits only at 2-16 rows, K > 4096 and fewer 64-wide column blocks than SMs (N < 8448 on the H200): a
    gate_up with d > 4096 and F < 4224 would take it, which the Llama / Qwen / Mistral shapes (F > 2.5 d) are not.

    From the H200 sweep (docs/kernels/matmul_decode.md has the numbers), GPU time in CUDA graphs:
    - one row: FMAs over 4 columns per program (N / 4 programs, 3 to 34 per SM at the Qwen2.5-1.5B
      shapes), 2 warps and 256-wide K steps through a 3-deep cp.async pipeline; a long K (the 8960-deep
      down projection) streams best with 2 columns per program and 1024-wide steps;
    - 2 to 16 rows, tensor cores: with enough 64-wide column blocks to fill the GPU (gate_up) 64x128 tiles
      over all of K; with few columns and a short K (qkv, o) 16-wide blocks over all of K (one warp at
      16 rows, four below);
      with few columns and a long K (down) 64-wide blocks with K split so that about two programs run
      per SM, the slices summed by the second kernel. One row of a W that is not K-contiguous (a
      row-major B) takes these too: the dot kernel's tiles load along whichever dim is contiguous.
    All launch with programmatic dependent launch (kiln.kernels._common.pdl) except the gate_up tile at
    2-16 rows, where it measured slower (0.99x against 1.15x cuBLAS): inside the engine's CUDA-graphed
    decode step every kiln kernel before them now signals early, which is where PDL pays.
    """
    if interpreting():  # small tiles: the CPU tests cover ragged tiles and several K steps
        return DecodeConfig("gemv" if M == 1 and k_major else "dot", 16, 32)
    if M > DECODE_MAX_M:
        return wide_config(M, N, K, sms, split_ok)
    if M == 1 and k_major:
        kind = "long" if K > 4096 else "wide" if N * K > PRELOAD_MAX_WEIGHT else None
        override = gemv_override(kind) if kind else None
        if override is not None:
            return override
        return (
            DecodeConfig("gemv", 4, 256, 1, 2, 3, True)
            if K <= 4096
            else DecodeConfig("gemv", 2, 1024, 1, 4, 1, True)
        )
    tiles = cdiv(N, 64)
    if tiles >= sms:
        return DecodeConfig("dot", 64, 128, 1, 4, 3)
    if K <= 4096:
        # one warp over 256-wide K steps at exactly 16 rows (1.04-1.05x cuBLAS); below 16 rows that tile
        # measured 6.3 us (0.69x) and four warps over 128-wide steps 4.2-4.4 us (1.00-1.50x)
        return (
            DecodeConfig("dot", 16, 256, 1, 1, 4, True)
            if M == 16
            else DecodeConfig("dot", 16, 128, 1, 4, 3, True)
        )
    return DecodeConfig("dot", 64, 64, max(2, round(2 * sms / tiles)) if split_ok else 1, 4, 4, True)


# preload_weight's bounds: W of at most this many elements (the Qwen2.5-1.5B qkv, 3.1M, and o, 2.4M; not
# gate_up, 27.5M, or down, 13.8M), K at most this deep (its slice: BLOCK_N x pow2(K) / threads values a thread,
# 4 x 2048 / 64 = 128 at the one-row rule's tiles)
PRELOAD_MAX_WEIGHT = 4 * 1024 * 1024
PRELOAD_MAX_K = 2048


def preload_weight(N: int, K: int) -> bool:
    """Whether a one-row gemv without an explicit config loads its whole W slice before its
    programmatic-launch wait (DecodeConfig.pre_k = pow2(K)): the small projections, whose few hundred
    programs are all resident while the kernel before them (a norm, decode attention's reduction) runs,
    so their weight streams under it and only x follows the wait; a large one's programs are not resident
    yet, and the registers would halve those that are (measured: 0.97x with gate_up preloaded too, 2026-12-02,
    docs/LOG.md). KILN_DECODE_PREW=off turns it off (read once), for A/B timing of whole steps. Not in the
    interpreter, whose rule keeps small tiles so that the CPU tests walk the K loop (they pass pre_k
    explicitly)."""
    return not interpreting() and preload_switch() and N * K <= PRELOAD_MAX_WEIGHT and K <= PRELOAD_MAX_K


@functools.cache
def preload_switch() -> bool:
    return env_form("KILN_DECODE_PREW", ("on", "off")) == "on"


@functools.cache
def gemv_override(kind: str) -> DecodeConfig | None:
    """A one-row gemv config from the environment (read once), in place of decode_config's rule, for A/B
    timing of whole decode steps (bench/experiments/decode_forms.py) without a code change:
    KILN_DECODE_GEMV_LONG=BN:BK:W:S for K > 4096 (the down projection), KILN_DECODE_GEMV_WIDE=BN:BK:W:S for
    K <= 4096 with a weight too large to preload (gate_up); BN columns a program, BK a K step (powers of
    two), W warps, S pipeline stages. None where unset."""
    var = f"KILN_DECODE_GEMV_{kind.upper()}"
    spec = os.environ.get(var, "").strip()
    if not spec:
        return None
    nums = spec.split(":")
    ok = len(nums) == 4 and all(n.isdigit() and int(n) > 0 for n in nums)
    if not ok or any(int(n) & (int(n) - 1) for n in nums[:3]):
        raise ValueError(
            f"{var} must be BN:BK:W:S (positive integers, the first three powers of two), got {spec!r}"
        )
    bn, bk, w, s = map(int, nums)
    return DecodeConfig("gemv", bn, bk, 1, w, s, True)


def wide_config(M: int, N: int, K: int, sms: int, split_ok: bool = True) -> DecodeConfig:
    """decode_config's rule past DECODE_MAX_M rows (17-128): the dot kernel, W's 64-row blocks as the wgmma
    M side and x.T (K, pow2(M)) as its N side, 4 warps, from the H200 sweep at 32, 64 and 128 rows
    (bench/experiments/decode_wide_sweep.py, docs/perf/matmul_decode.md). With a block per SM or more
    (gate_up) all of K in 128-deep steps, 64-deep past 32 rows (x.T's tile doubles); with fewer blocks than
    SMs (qkv, o, down) K split 4 ways, 128-deep steps through 4 stages, the slices summed by the second
    kernel. At 32-64 rows this ran 1.0-1.13x cuBLAS; at 128 cuBLAS was faster everywhere (1.09-1.30x), which
    is why the model takes it only up to KILN_DECODE_ROWS rows."""
    if cdiv(N, 64) >= sms:
        return (
            DecodeConfig("dot", 64, 128, 1, 4, 3, True)
            if M <= 32
            else DecodeConfig("dot", 64, 64, 1, 4, 4, True)
        )
    split = max(1, min(4, cdiv(K, 128) // 2)) if split_ok else 1
    return DecodeConfig("dot", 64, 128, split, 4, 4, True)


@triton.jit
def _load_x(
    ptrs, mask, up_offset, SWIGLU: tl.constexpr, RMSNORM: tl.constexpr, g_ptrs, g_mask, rstd, norm_offset
):
    """A tile of x at `ptrs`; with SWIGLU, x = silu(gate) * up where gate is at ptrs and up at ptrs +
    up_offset, computed in float32 and rounded to the input dtype (the separate swiglu kernel's output).
    With RMSNORM, x = round(round(h * rstd) * (norm_offset + gamma)) for h at ptrs and gamma at g_ptrs
    (broadcastable to the tile), rounded where kiln's RMSNorm kernel rounds (kernels/rmsnorm.py)."""
    # one return after a constexpr if/else: the compiler visits every return that follows a static branch
    if SWIGLU:
        g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(ptrs + up_offset, mask=mask, other=0.0).to(tl.float32)
        x = (g * tl.sigmoid(g) * u).to(ptrs.dtype.element_ty)
    elif RMSNORM:
        h = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(g_ptrs, mask=g_mask, other=0.0).to(tl.float32) + norm_offset
        normed = (h * rstd).to(ptrs.dtype.element_ty)  # the norm kernel's first rounding (HF's)
        x = (normed.to(tl.float32) * w).to(ptrs.dtype.element_ty)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _w_block_rows(pid_n, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """(BLOCK_N,) the W rows a column block loads and (BLOCK_N,) which of them exist. With GLU (the swiglu
    epilogue) N = 2F and the block holds features f0 .. f0 + BLOCK_N / 2 - 1, gate and up interleaved:
    block row r is W row f0 + r // 2 + (r % 2) * F, so that the result reshapes to (..., BLOCK_N / 2, 2)."""
    r = tl.arange(0, BLOCK_N)
    if GLU:
        F = N // 2
        f = pid_n * (BLOCK_N // 2) + r // 2  # the feature of each block row
        rows = f + (r % 2) * F
        ok = f < F  # an up row past 2F and a gate row past F alike (F itself is an up row's start)
    else:
        rows = pid_n * BLOCK_N + r
        ok = rows < N
    return rows, ok


@triton.jit
def _swiglu_epilogue(acc, m, n, n_ok, f, Y_ptr, Bias_ptr, M, F, HAS_BIAS: tl.constexpr, AXIS_N: tl.constexpr):
    """The swiglu epilogue: acc the float32 product over a block's W rows n (gate, up interleaved along
    AXIS_N: (BLOCK_M, BLOCK_N) or (BLOCK_N, BLOCK_M)), n_ok which rows exist, broadcastable to acc; m, f
    the rows and features of the (BLOCK_M, BLOCK_N / 2) or (BLOCK_N / 2, BLOCK_M) output, into Y (M, F).
    h = round(acc + bias) is what the unfused matmul stores, and silu(gate) * up in float32 of its rounded
    gate and up, rounded, what kiln.kernels.swiglu's kernel stores."""
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    h = acc.to(Y_ptr.dtype.element_ty)
    if AXIS_N == 1:  # (BLOCK_M, BLOCK_N) -> (BLOCK_M, BLOCK_N / 2, 2): (gate, up) pairs on the last axis
        pairs = tl.reshape(h, (h.shape[0], h.shape[1] // 2, 2))
    else:  # (BLOCK_N, BLOCK_M) -> (BLOCK_N / 2, 2, BLOCK_M) -> (BLOCK_N / 2, BLOCK_M, 2)
        pairs = tl.permute(tl.reshape(h, (h.shape[0] // 2, 2, h.shape[1])), (0, 2, 1))
    gate, up = tl.split(pairs)
    g = gate.to(tl.float32)
    y = g * tl.sigmoid(g) * up.to(tl.float32)  # kiln.kernels.swiglu's expression, in its order
    tl.store(Y_ptr + m * F + f, y.to(Y_ptr.dtype.element_ty), mask=(m < M) & (f < F))


@triton.jit
def _row_rstd(SS_ptr, offs_m, M, n_ss, K, eps, BLOCK_M: tl.constexpr, SS_BLOCK: tl.constexpr):
    """(BLOCK_M,) float32 1 / sqrt(sum(h^2) / K + eps) per row, from the producer's (M, n_ss) partial sums
    of squares: SS_BLOCK partials per step, summed elementwise across steps and then across the tile, a
    fixed order, so every program of the launch (and every launch) gets the same bits."""
    acc = tl.zeros((BLOCK_M, SS_BLOCK), dtype=tl.float32)
    rows = SS_ptr + offs_m[:, None] * n_ss
    for s0 in range(0, n_ss, SS_BLOCK):
        offs_s = s0 + tl.arange(0, SS_BLOCK)
        acc += tl.load(
            rows + offs_s[None, :], mask=(offs_m < M)[:, None] & (offs_s < n_ss)[None, :], other=0.0
        )
    # / K then + eps then rsqrt, as the norm kernel (K: the normalized width, a run-time int there too)
    return tl.rsqrt(tl.sum(acc, axis=1) / K + eps)


@triton.jit
def _gemv_kernel(
    X_ptr,  # (M, K): x[m, k] at X_ptr + m * stride_xm + k * stride_xk
    W_ptr,  # (N, K): w[n, k] at W_ptr + n * stride_wn + k * stride_wk (B = W.T)
    Y_ptr,  # (M, N) contiguous output ((M, N / 2) with GLU); with SPLIT_K > 1 a float32 (SPLIT_K, M, N) buffer
    Bias_ptr,  # (N,), read when HAS_BIAS (and SPLIT_K == 1)
    R_ptr,  # (M, N) contiguous residual, read when RESIDUAL (may be Y_ptr: each element read, then written)
    SS_ptr,  # (M, n_ss) float32: RESIDUAL's output (partial sums of squares), RMSNORM's input
    G_ptr,  # (K,) the norm weight gamma, read when RMSNORM
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    k_split,  # K range of one split: a multiple of BLOCK_K (K when SPLIT_K == 1)
    n_ss,  # columns of SS: RESIDUAL: cdiv(N, BLOCK_N); RMSNORM: the producer's column blocks
    eps,  # float: RMSNORM's epsilon
    norm_offset,  # float: RMSNORM's weight is norm_offset + gamma (1.0 for Gemma-style weights)
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SWIGLU: tl.constexpr,  # x = silu(X[:, :K]) * X[:, K:2K] (the prologue, module doc)
    RMSNORM: tl.constexpr,  # x = rmsnorm(X) with rstd from SS's partials (the prologue, module doc)
    RESIDUAL: tl.constexpr,  # Y = R + act(X @ W.T + bias), and its partial sums of squares into SS
    GLU: tl.constexpr,  # Y (M, N / 2) = swiglu(X @ W.T + bias) of W's [gate | up] rows (the epilogue, module doc)
    SS_BLOCK: tl.constexpr,  # RMSNORM: partials per step of the rstd sum (a power of two)
    BLOCK_M: tl.constexpr,  # next power of two >= M (rows of x held per program)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,  # > 1: the K loop's loads go through shared memory STAGES - 1 steps ahead (cp.async)
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the previous kernel here
    GRIDDEP: tl.constexpr,  # sm_90+: let the next kernel (the split-K sum) launch while this one runs
    PRE_K: tl.constexpr = 0,  # > 0 (one row): W's first PRE_K columns of the K range loaded before the wait
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, n_in = _w_block_rows(pid_n, N, BLOCK_N, GLU)  # (BLOCK_N,): W rows, and which exist
    offs_m = tl.arange(0, BLOCK_M)
    w_rows = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    x_rows = X_ptr + offs_m[:, None] * stride_xm  # (BLOCK_M, 1)
    n_ok = n_in[:, None]
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    if PRE_K > 0:
        # W is not written by the previous kernel (decode_matmul's contract), so its first PRE_K columns are
        # requested now, while a programmatic dependent launch still waits for that kernel: their HBM
        # latency and bytes pass under its tail instead of following it
        offs_pre = k_lo + tl.arange(0, PRE_K)
        w_pre = tl.load(
            w_rows + offs_pre[None, :] * stride_wk, mask=n_ok & (offs_pre < k_hi)[None, :], other=0.0
        )
    if PDL:
        gdc_wait()  # everything the previous kernel wrote (x, the residual stream) is visible after this
    if GRIDDEP:
        gdc_launch_dependents()  # a dependent waits for this grid's completion itself (gdc_wait)
    if RMSNORM:  # the row's whole norm statistic, before the K loop: a few KB of partials from L2
        rstd = _row_rstd(SS_ptr, offs_m, M, n_ss, K, eps, BLOCK_M, SS_BLOCK)  # (BLOCK_M,)
    else:
        rstd = tl.zeros((BLOCK_M,), dtype=tl.float32)  # unused
    # RESIDUAL: the stream's (BLOCK_M, BLOCK_N) tile is loaded now, so that its L2 latency passes under the
    # K loop instead of following it in the epilogue
    r = _load_residual(R_ptr, offs_m[:, None], offs_n[None, :], M, N, RESIDUAL)
    # Splits start at multiples of BLOCK_K, so masking against K (not k_hi) is exact, and K's divisibility
    # (specialized by Triton when K % 16 == 0) keeps the loads 16 bytes wide. Products accumulate
    # elementwise across the loop and are summed over K once at the end: the loop is loads and FMAs.
    if BLOCK_M == 1:  # one row: 2-D tiles in the layout W is loaded in (no shuffle through shared memory)
        r1 = tl.sum(rstd, axis=0)  # the one row's rstd as a scalar
        k_start = k_lo
        y_pre = tl.zeros((BLOCK_N,), dtype=tl.float32)
        if PRE_K > 0:  # the preloaded columns first; the loop takes the rest (none where PRE_K covers K)
            x_pre = _load_x(X_ptr + offs_pre * stride_xk, offs_pre < k_hi, K * stride_xk, SWIGLU, RMSNORM,
                            G_ptr + offs_pre, offs_pre < k_hi, r1, norm_offset)  # fmt: skip
            y_pre = tl.sum(w_pre.to(tl.float32) * x_pre.to(tl.float32)[None, :], axis=1)
            k_start = k_lo + PRE_K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_ok & (offs_k < K)[None, :], other=0.0)
            x = _load_x(X_ptr + offs_k * stride_xk, offs_k < K, K * stride_xk, SWIGLU, RMSNORM, G_ptr + offs_k,
                        offs_k < K, r1, norm_offset)  # fmt: skip
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = (tl.sum(acc, axis=1) + y_pre)[None, :]  # (1, BLOCK_N)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_ok & (offs_k < K)[None, :], other=0.0)
            x = _load_x(x_rows + offs_k[None, :] * stride_xk, (offs_m < M)[:, None] & (offs_k < K)[None, :],
                        K * stride_xk, SWIGLU, RMSNORM, G_ptr + offs_k[None, :], (offs_k < K)[None, :],
                        rstd[:, None], norm_offset)  # fmt: skip
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # (BLOCK_M, BLOCK_N, BLOCK_K)
        y = tl.sum(acc3, axis=2)  # (BLOCK_M, BLOCK_N)
    if GLU:  # (BLOCK_M, BLOCK_N / 2) of the (M, N / 2) output
        offs_f = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        _swiglu_epilogue(y, offs_m[:, None], offs_n[None, :], n_in[None, :], offs_f[None, :], Y_ptr, Bias_ptr, M,
                         N // 2, HAS_BIAS, 1)  # fmt: skip
    else:
        _store_decode(y, offs_m[:, None], offs_n[None, :], pid_n, pid_k, Y_ptr, Bias_ptr, r, SS_ptr, M, N, n_ss,
                      HAS_BIAS, ACTIVATION, SPLIT_K, RESIDUAL, 1)  # fmt: skip


# M only bounds masks (and, times N, the split slices' offsets): as a specialized int, every row count
# that is not a multiple of 16 would compile its own binary, e.g. the first 20-token prefill on the wide
# tiles, whose 32- and 64-row buckets the engine's graph capture compiled at start
@triton.jit(do_not_specialize=["M"])
def _dot_kernel(
    X_ptr,  # (M, K): x[m, k] at X_ptr + m * stride_xm + k * stride_xk, M <= 16
    W_ptr,  # (N, K): w[n, k] at W_ptr + n * stride_wn + k * stride_wk (B = W.T)
    Y_ptr,  # (M, N) contiguous output ((M, N / 2) with GLU); with SPLIT_K > 1 a float32 (SPLIT_K, M, N) buffer
    Bias_ptr,  # (N,), read when HAS_BIAS (and SPLIT_K == 1)
    R_ptr,  # (M, N) contiguous residual, read when RESIDUAL (may be Y_ptr: each element read, then written)
    SS_ptr,  # (M, n_ss) float32: RESIDUAL's output (partial sums of squares), RMSNORM's input
    G_ptr,  # (K,) the norm weight gamma, read when RMSNORM
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    k_split,  # K range of one split: a multiple of BLOCK_K (K when SPLIT_K == 1)
    n_ss,  # columns of SS: RESIDUAL: cdiv(N, BLOCK_N); RMSNORM: the producer's column blocks
    eps,  # float: RMSNORM's epsilon
    norm_offset,  # float: RMSNORM's weight is norm_offset + gamma (1.0 for Gemma-style weights)
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SWIGLU: tl.constexpr,  # x = silu(X[:, :K]) * X[:, K:2K] (the prologue, module doc)
    RMSNORM: tl.constexpr,  # x = rmsnorm(X) with rstd from SS's partials (the prologue, module doc)
    RESIDUAL: tl.constexpr,  # Y = R + act(X @ W.T + bias), and its partial sums of squares into SS
    GLU: tl.constexpr,  # Y (M, N / 2) = swiglu(X @ W.T + bias) of W's [gate | up] rows (the epilogue, module doc)
    SS_BLOCK: tl.constexpr,  # RMSNORM: partials per step of the rstd sum (a power of two)
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" or "tf32" (float32 inputs only)
    BLOCK_M: tl.constexpr,  # 16: the narrowest tl.dot side
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the previous kernel here
    GRIDDEP: tl.constexpr,  # sm_90+: let the next kernel (the split-K sum) launch while this one runs
):
    if PDL:
        gdc_wait()
    if GRIDDEP:
        gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n, n_in = _w_block_rows(pid_n, N, BLOCK_N, GLU)  # (BLOCK_N,): W rows, and which exist
    offs_m = tl.arange(0, BLOCK_M)
    w_rows = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    x_cols = X_ptr + offs_m[None, :] * stride_xm  # (1, BLOCK_M): x.T's columns
    n_ok = n_in[:, None]
    m_ok = (offs_m < M)[None, :]
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    if RMSNORM:  # the rows' whole norm statistics, before the K loop: a few KB of partials from L2
        # (1, BLOCK_M): one per column of x.T
        rstd = _row_rstd(SS_ptr, offs_m, M, n_ss, K, eps, BLOCK_M, SS_BLOCK)[None, :]
    else:
        rstd = tl.zeros((1, BLOCK_M), dtype=tl.float32)  # unused
    r = _load_residual(R_ptr, offs_m[None, :], offs_n[:, None], M, N, RESIDUAL)  # (BLOCK_N, BLOCK_M): acc's
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_ok & (offs_k < K)[None, :], other=0.0)
        xt = _load_x(x_cols + offs_k[:, None] * stride_xk, m_ok & (offs_k < K)[:, None], K * stride_xk, SWIGLU,
                     RMSNORM, G_ptr + offs_k[:, None], (offs_k < K)[:, None], rstd, norm_offset)  # fmt: skip
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
    # Written as it lies, (n, m) -> C[m, n]: no transpose through shared memory.
    if GLU:  # (BLOCK_N / 2, BLOCK_M) of the (M, N / 2) output
        offs_f = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        _swiglu_epilogue(acc, offs_m[None, :], offs_n[:, None], n_in[:, None], offs_f[:, None], Y_ptr, Bias_ptr,
                         M, N // 2, HAS_BIAS, 0)  # fmt: skip
    else:
        _store_decode(acc, offs_m[None, :], offs_n[:, None], pid_n, pid_k, Y_ptr, Bias_ptr, r, SS_ptr, M, N,
                      n_ss, HAS_BIAS, ACTIVATION, SPLIT_K, RESIDUAL, 0)  # fmt: skip


@triton.jit
def _store(acc, m, n, pid_k, Y_ptr, Bias_ptr, M, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
           SPLIT_K: tl.constexpr):  # fmt: skip
    """float32 acc -> C[m, n] with bias and activation, or into split pid_k's partial slice. m and n are row
    and column indices broadcastable to acc's shape ((BLOCK_M, 1) and (1, BLOCK_N), or transposed). Shared
    with the quantized and FP8 decode kernels."""
    mask = (m < M) & (n < N)
    at = m * N + n
    if SPLIT_K > 1:
        tl.store(Y_ptr + pid_k.to(tl.int64) * M * N + at, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
        acc = apply_activation(acc, ACTIVATION)
        tl.store(Y_ptr + at, acc.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_decode(acc, m, n, pid_n, pid_k, Y_ptr, Bias_ptr, r, SS_ptr, M, N, n_ss, HAS_BIAS: tl.constexpr,
                  ACTIVATION: tl.constexpr, SPLIT_K: tl.constexpr, RESIDUAL: tl.constexpr, AXIS_N: tl.constexpr):  # fmt: skip
    """_store, or with RESIDUAL (and no split: the split-K sum does it then) the residual add and the
    partial sums of squares; AXIS_N is acc's column axis, r the residual's tile."""
    if RESIDUAL and SPLIT_K == 1:
        _residual_epilogue(acc, m, n, pid_n, Y_ptr, Bias_ptr, r, SS_ptr, M, N, n_ss, HAS_BIAS, ACTIVATION,
                           AXIS_N)  # fmt: skip
    else:
        _store(acc, m, n, pid_k, Y_ptr, Bias_ptr, M, N, HAS_BIAS, ACTIVATION, SPLIT_K)


@triton.jit
def _load_residual(R_ptr, m, n, M, N, RESIDUAL: tl.constexpr):
    """The residual's tile at rows m, columns n (broadcastable index tensors), or an unused zero."""
    if RESIDUAL:
        r = tl.load(R_ptr + m * N + n, mask=(m < M) & (n < N), other=0.0)
    else:
        r = tl.zeros((1, 1), dtype=tl.float32)
    return r


@triton.jit
def _residual_epilogue(acc, m, n, pid_n, Y_ptr, Bias_ptr, r, SS_ptr, M, N, n_ss, HAS_BIAS: tl.constexpr,
                       ACTIVATION: tl.constexpr, AXIS_N: tl.constexpr):  # fmt: skip
    """The residual add of kiln's add + RMSNorm kernel, after the matmul's own epilogue: y = act(acc +
    bias) rounded to Y's dtype (what the matmul stores), h = round(y + r) computed in float32 (what the
    norm kernel stores as the new stream) into Y; and sum(h^2) over this program's columns, from the
    rounded h as the norm kernel reads it, into SS[m, pid_n]: one float32 per row, written by this program
    alone (no atomics). r: the residual's tile, shaped like acc."""
    mask = (m < M) & (n < N)
    at = m * N + n
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    y = apply_activation(acc, ACTIVATION).to(Y_ptr.dtype.element_ty)
    h = (y.to(tl.float32) + r.to(tl.float32)).to(Y_ptr.dtype.element_ty)
    tl.store(Y_ptr + at, h, mask=mask)
    hf = tl.where(mask, h.to(tl.float32), 0.0)
    ss = tl.sum(hf * hf, axis=AXIS_N, keep_dims=True)  # shaped like m: (BLOCK_M, 1) or (1, BLOCK_M)
    tl.store(SS_ptr + m * n_ss + pid_n, ss, mask=m < M)


@triton.jit
def _split_sum_kernel(
    P_ptr,  # (SPLIT_K, M, N) float32 partial sums, contiguous
    Y_ptr,  # (M, N) contiguous output
    Bias_ptr,  # (N,), read when HAS_BIAS
    MN,  # M * N
    N,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the partial sums here
):
    if PDL:
        gdc_wait()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.load(P_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):  # a fixed order: the same bits on every run
        acc += tl.load(P_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    acc = apply_activation(acc, ACTIVATION)
    tl.store(Y_ptr + offs, acc.to(Y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_residual_kernel(
    P_ptr,  # (SPLIT_K, M, N) float32 partial sums, contiguous
    Y_ptr,  # (M, N) contiguous output: R + act(sum + bias)
    Bias_ptr,  # (N,), read when HAS_BIAS
    R_ptr,  # (M, N) contiguous residual (may be Y_ptr)
    SS_ptr,  # (M, n_ss) float32 out: partial sums of squares of Y, one per row and program
    M,
    N,
    n_ss,  # cdiv(N, BLOCK_S)
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # next power of two >= M
    BLOCK_S: tl.constexpr,  # columns per program
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the partial sums here
):
    """The split-K sum with the residual epilogue: a (BLOCK_M, BLOCK_S) tile per program, so that each
    program owns whole column blocks of every row (its partial sums of squares). Slices added in the
    same order as _split_sum_kernel: the same bits as that kernel followed by kiln's add + RMSNorm."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)[:, None]
    n = pid * BLOCK_S + tl.arange(0, BLOCK_S)[None, :]
    mask = (m < M) & (n < N)
    r = tl.load(R_ptr + m * N + n, mask=mask, other=0.0)
    acc = tl.load(P_ptr + m * N + n, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(P_ptr + s * M * N + m * N + n, mask=mask, other=0.0)
    _residual_epilogue(acc, m, n, pid, Y_ptr, Bias_ptr, r, SS_ptr, M, N, n_ss, HAS_BIAS, ACTIVATION, 1)


# Launched through their compiled handles after the first call (host time: kernels/launch.py).
_gemv_launch = CachedLaunch(_gemv_kernel)
_dot_launch = CachedLaunch(_dot_kernel)
_sum_launch = CachedLaunch(_split_sum_kernel)
_residual_sum_launch = CachedLaunch(_split_residual_kernel)


# Partial sums of squares per step of the consumer's rstd sum: at most this many (rows x partials) floats
# in flight per program (16-64 registers a thread at 2-4 warps, released before the K loop); the rule's
# producers write 96-768 partials a row, so one step covers them at every row count it gives.
SS_TILE = 4096
PROLOGUES = ("none", "swiglu", "rmsnorm")
EPILOGUES = ("none", "residual_sumsq", "swiglu")


def _residual_sum_tile(M: int) -> int:
    """Columns per program of the split-K sum with the residual epilogue: ~1024 elements per program."""
    return max(64, 1024 // pow2(M))


def decode_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    prologue: str = "none",
    epilogue: str = "none",
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    sumsq: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_offset: float = 0.0,
    defer_sum: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launcher: act(a @ b + bias) into `out` (a contiguous (M, N) tensor) or a new tensor.

    Inputs are taken as checked by `kiln.kernels.matmul` (2-D, one dtype and device, M <= DECODE_MAX_M,
    M, N, K > 0); only what this path adds is checked here. config: skip the rule (tests, the sweep).
    prologue "swiglu": `a` is (M, 2K) [gate | up] and the product is act(swiglu(a) @ b + bias) (module doc).
    prologue "rmsnorm": the product is act(rmsnorm(a) @ b + bias), with `norm_weight` (K,), `eps`,
    `norm_offset` as kiln's rmsnorm takes them and `sumsq` the (M, n) float32 partial sums of squares of
    the rows of `a` that the "residual_sumsq" epilogue of the matmul producing `a` returned.
    epilogue "residual_sumsq": returns (h, sumsq) with h = residual + act(a @ b + bias) (M, N) (`out` may
    be `residual` itself: updated in place) and sumsq (M, n) float32 its partial sums of squares per
    column block, for the next matmul's "rmsnorm" prologue.
    epilogue "swiglu": b (K, 2F) is a gate/up projection (columns [0, F) gate, [F, 2F) up) and the result
    is swiglu(a @ b + bias) (M, F), the same bits as kiln.kernels.swiglu.swiglu(decode_matmul(a, b, bias),
    None) with the same config (module doc); no activation, no split K (ValueError), config.block_n
    counts b's columns (2 per output feature).
    defer_sum: where the config splits K, return the float32 (split, M, N) partial sums without the sum
    kernel, for a consumer that adds them and the bias itself (kiln.kernels.rmsnorm.rmsnorm_split,
    kiln.kernels.rope.rope_kv_write_split); a config that does not split is a ValueError, as are a bias, an
    activation, `out`, a prologue or an epilogue with it.
    """
    M, K = a.shape
    N = b.shape[1]
    if M > DECODE_WIDE_M:
        raise ValueError(f"decode_matmul takes at most {DECODE_WIDE_M} rows, got {M}")
    if prologue not in PROLOGUES:
        raise ValueError(f"decode_matmul: unknown prologue {prologue!r}: one of {', '.join(PROLOGUES)}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"decode_matmul: unknown epilogue {epilogue!r}: one of {', '.join(EPILOGUES)}")
    swiglu, rmsnorm, has_residual = prologue == "swiglu", prologue == "rmsnorm", epilogue == "residual_sumsq"
    glu = epilogue == "swiglu"
    if swiglu:
        if K != 2 * b.shape[0]:
            raise ValueError(
                f"decode_matmul: the swiglu prologue takes a (M, 2K) = (M, {2 * b.shape[0]}), got {K}"
            )
        K = b.shape[0]
    _check_norm_args(a, K, rmsnorm, norm_weight, sumsq, eps)
    _check_residual_args(a, N, has_residual, residual, out)
    if config is None:
        config = decode_config(M, N, K, sm_count(a.device), b.stride(0) == 1, split_ok=not glu)
        if M == 1 and config.kernel == "gemv" and config.split_k == 1 and preload_weight(N, K):
            config = config._replace(pre_k=pow2(K))
    if config.pre_k and (config.kernel != "gemv" or M != 1 or config.pre_k & (config.pre_k - 1)
                         or (config.pre_k < K and config.pre_k % config.block_k)):  # fmt: skip
        raise ValueError(
            f"decode_matmul: pre_k={config.pre_k} needs the gemv kernel at one row and a power of two, a "
            f"multiple of block_k={config.block_k} where it is below K={K} (the loop resumes at a whole "
            f"step), got {config} at M={M}"
        )
    _check_swiglu_args(a, N, glu, activation, config, out)
    if config.kernel == "gemv" and M > DECODE_MAX_M:
        raise ValueError(f"the gemv decode kernel takes at most {DECODE_MAX_M} rows, got {M}: use 'dot'")
    if defer_sum and (
        bias is not None
        or activation != "none"
        or out is not None
        or prologue != "none"
        or epilogue != "none"
    ):
        raise ValueError(
            "decode_matmul: defer_sum returns the bare partial sums: no bias (the consumer adds it), activation, "
            "out, prologue or epilogue"
        )
    if defer_sum:  # no (M, N) output: `c` only stands in as an unused pointer
        c = a
    else:
        c = torch.empty((M, N // 2 if glu else N), device=a.device, dtype=a.dtype) if out is None else out
    split, k_split, dst = 1, K, c
    if config.split_k > 1:
        # Whole BLOCK_K steps per split, so every split but the last covers k_split exactly; a split that
        # would find no K left is dropped.
        k_split = cdiv(cdiv(K, config.split_k), config.block_k) * config.block_k
        split = cdiv(K, k_split)
        dst = torch.empty((split, M, N), device=a.device, dtype=torch.float32) if split > 1 else c
    if defer_sum and split == 1:
        raise ValueError(f"decode_matmul: defer_sum needs a config that splits K, got {config} at K={K}")
    grid = (cdiv(N, config.block_n), split)
    ss, n_ss, ss_block = _sumsq_buffers(a, M, N, config, split, has_residual, sumsq)
    (sxm, sxk), (sbk, sbn) = a.stride(), b.stride()  # B (K, N) = W.T: W's row stride is sbn
    res = c if residual is None else residual
    gamma = b if norm_weight is None else norm_weight  # a valid pointer when unused
    args = (a, b, dst, c if bias is None else bias, res, ss, gamma, M, N, K, sxm, sxk, sbn, sbk, k_split, n_ss,
            float(eps), float(norm_offset))  # fmt: skip  # K: of b
    has_bias = bias is not None and split == 1
    act = activation if split == 1 else "none"
    fused = dict(
        SWIGLU=swiglu, RMSNORM=rmsnorm, RESIDUAL=has_residual and split == 1, GLU=glu, SS_BLOCK=ss_block
    )
    # Hopper: the main kernel lets its dependents launch early, and the split-K sum is launched as one
    # (programmatic dependent launch), so its launch overlaps the main kernel instead of following it.
    can_signal = a.is_cuda and griddep(a.device.index)
    pdl = config.pdl and can_signal and use_pdl(a)  # use_pdl: KILN_PDL=0 turns it off for A/B timing
    # Constexprs by keyword: CachedLaunch keys keywords by value but positional ints by Triton's value
    # classes (== 1, divisible by 16), which would let SPLIT_K = 2 and 4 share one binary.
    if config.kernel == "gemv":
        _gemv_launch[grid](*args, HAS_BIAS=has_bias, ACTIVATION=act, **fused, BLOCK_M=pow2(M),
                           BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, STAGES=config.stages,
                           PRE_K=config.pre_k, PDL=pdl, GRIDDEP=can_signal, num_warps=config.warps,
                           launch_pdl=pdl)  # fmt: skip
    elif config.kernel == "dot":
        precision = "tf32" if a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"
        _dot_launch[grid](*args, HAS_BIAS=has_bias, ACTIVATION=act, **fused, PRECISION=precision, BLOCK_M=max(16, pow2(M)),
                          BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, PDL=pdl, GRIDDEP=can_signal,
                          num_warps=config.warps, num_stages=config.stages, launch_pdl=pdl)  # fmt: skip
    else:
        raise ValueError(f"unknown decode kernel {config.kernel!r}: 'gemv' or 'dot'")
    if defer_sum:
        return dst
    if split > 1 and has_residual:
        block_s = _residual_sum_tile(M)
        _residual_sum_launch[(n_ss,)](dst, c, c if bias is None else bias, res, ss, M, N, n_ss,
                                      HAS_BIAS=bias is not None, ACTIVATION=activation, SPLIT_K=split,
                                      BLOCK_M=pow2(M), BLOCK_S=block_s, PDL=can_signal, launch_pdl=can_signal)  # fmt: skip
    elif split > 1:
        block = 1024
        _sum_launch[(cdiv(M * N, block),)](dst, c, c if bias is None else bias, M * N, N, HAS_BIAS=bias is not None,
                                            ACTIVATION=activation, SPLIT_K=split, BLOCK=block, PDL=can_signal,
                                            launch_pdl=can_signal)  # fmt: skip
    return (c, ss) if has_residual else c


def _sumsq_buffers(a, M, N, config, split, has_residual, sumsq) -> tuple[torch.Tensor, int, int]:
    """(the SS tensor the kernels take, its columns n_ss, the consumer's SS_BLOCK). The producer writes one
    partial per row and program that owns whole columns: the main kernel's column blocks, or the split-K
    sum's when K is split; the consumer reads however many the tensor holds (a host-side shape, fixed for
    a CUDA graph)."""
    if has_residual:
        n_ss = cdiv(N, config.block_n if split == 1 else _residual_sum_tile(M))
        return torch.empty((M, n_ss), device=a.device, dtype=torch.float32), n_ss, 1
    if sumsq is not None:
        n_ss = sumsq.shape[1]
        rows = pow2(M) if config.kernel == "gemv" else DECODE_MAX_M
        return sumsq, n_ss, min(pow2(n_ss), max(1, SS_TILE // rows))
    return a, 1, 1  # unused: a valid pointer


def _check_norm_args(a, K, rmsnorm, norm_weight, sumsq, eps) -> None:
    """The rmsnorm prologue's arguments, or that none was given without it (nothing silently ignored)."""
    if not rmsnorm:
        if norm_weight is not None or sumsq is not None:
            raise ValueError("decode_matmul: norm_weight and sumsq are arguments of prologue='rmsnorm'")
        return
    M = a.shape[0]
    if norm_weight is None or sumsq is None:
        raise ValueError(
            "decode_matmul: prologue='rmsnorm' needs norm_weight (K,) and sumsq, the (M, n) float32 partial "
            "sums of squares returned by the producing matmul's epilogue='residual_sumsq'"
        )
    if (norm_weight.shape != (K,) or not norm_weight.is_floating_point() or norm_weight.device != a.device
            or norm_weight.stride(0) != 1):  # fmt: skip
        raise ValueError(
            f"decode_matmul: norm_weight must be a contiguous float ({K},) tensor on {a.device}, got "
            f"{tuple(norm_weight.shape)} {norm_weight.dtype} on {norm_weight.device} (stride {norm_weight.stride()})"
        )
    if (sumsq.dim() != 2 or sumsq.shape[0] != M or sumsq.shape[1] < 1 or sumsq.dtype != torch.float32
            or not sumsq.is_contiguous() or sumsq.device != a.device):  # fmt: skip
        raise ValueError(
            f"decode_matmul: sumsq must be a contiguous ({M}, n) float32 tensor on {a.device} (the producer's "
            f"partial sums of squares), got {tuple(sumsq.shape)} {sumsq.dtype} on {sumsq.device}"
        )
    if not eps >= 0:
        raise ValueError(f"decode_matmul: eps must be >= 0, got {eps}")


def _check_swiglu_args(a, N, glu, activation, config, out) -> None:
    """The swiglu epilogue's requirements: b's 2F columns in gate/up pairs, a block of whole pairs, one K
    slice (the split-K sum kernel takes flat runs of columns, not a feature's gate and up), no activation
    (the SwiGLU is the activation), and `out` (M, F)."""
    if not glu:
        return
    M = a.shape[0]
    if N % 2:
        raise ValueError(
            f"decode_matmul: epilogue='swiglu' takes b (K, 2F) with gate and up columns, got N = {N} (odd)"
        )
    if activation != "none":
        raise ValueError(
            f"decode_matmul: epilogue='swiglu' takes no activation (it is the activation), got {activation!r}"
        )
    if config.split_k > 1:
        raise ValueError(
            f"decode_matmul: epilogue='swiglu' does not split K (the split-K sum does not see a feature's gate "
            f"and up together), got config {config}"
        )
    if config.block_n < 2:
        raise ValueError(
            f"decode_matmul: epilogue='swiglu' needs block_n >= 2 (a gate and an up row), got {config}"
        )
    if out is not None and (out.shape != (M, N // 2) or out.dtype != a.dtype or not out.is_contiguous()
                            or out.device != a.device):  # fmt: skip
        raise ValueError(
            f"decode_matmul: out must be a contiguous ({M}, {N // 2}) {a.dtype} tensor on {a.device} with "
            f"epilogue='swiglu', got {tuple(out.shape)} {out.dtype} on {out.device}"
        )


def _check_residual_args(a, N, has_residual, residual, out) -> None:
    """The residual_sumsq epilogue's arguments, or that none was given without it."""
    if not has_residual:
        if residual is not None:
            raise ValueError("decode_matmul: residual is an argument of epilogue='residual_sumsq'")
        return
    M = a.shape[0]
    if residual is None:
        raise ValueError(
            "decode_matmul: epilogue='residual_sumsq' needs residual, the (M, N) stream it adds to"
        )
    if out is not None and out.data_ptr() == a.data_ptr():  # other programs still read a while one writes
        raise ValueError("decode_matmul: out may be the residual (updated in place) but not the input a")
    for name, t in (("residual", residual), ("out", out)):
        if t is not None and (t.shape != (M, N) or t.dtype != a.dtype or not t.is_contiguous()
                              or t.device != a.device):  # fmt: skip
            raise ValueError(
                f"decode_matmul: {name} must be a contiguous ({M}, {N}) {a.dtype} tensor on {a.device}, got "
                f"{tuple(t.shape)} {t.dtype} on {t.device}"
            )
