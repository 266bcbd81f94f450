"""Matrix multiply with a fused epilogue: C = act(A @ B + bias).

Shapes: A (M, K), B (K, N), bias (N,) or None -> C (M, N) in A's dtype. `linear(x, weight, bias, act)`
is the nn.Linear form: x (..., K), weight (N, K) -> (..., N), i.e. B = weight.T, read in place.
Activations: "none", "relu", "silu", "gelu" (erf), "gelu_tanh". Backward:
    dpre = dC * act'(pre),   dA = dpre @ B.T,   dB = A.T @ dpre,   dbias = dpre.sum(0)
where pre = A @ B + bias; with an activation the forward also stores pre (one extra write) so the
backward need not recompute the GEMM. dA and dB run through the same kernel on transposed views.

The kernel: each program computes one (BLOCK_M, BLOCK_N) tile of C, accumulating in float32 over K.
Tiles are visited in groups of GROUP_M rows of tiles so that programs running at the same time share
A's row panels and B's column panels in L2 (the grouped ordering of Triton's matmul tutorial). Tiles
are read through TMA tensor descriptors when every operand qualifies (unit stride in one of the two
dims, 16-byte aligned base and other stride: what the Hopper copy engine requires), else through block
pointers, which take any strides. Either operand may be K-major or MN-major (a transposed view), so
nn.Linear weights and the backward's transposes are read without copies. Configs are autotuned per
(M, N, K). Decode shapes (M <= 16 rows) go to kernels/matmul_decode.py (weight-streaming kernels, a fixed
rule, a lean launch) unless the caller passes a config or tma, or needs an epilogue only this kernel has
(stored pre-activation, accumulate, row statistics); those get small-M tiles here (`_decode_config`).

Dtypes: float16 and bfloat16 (float32 accumulation); float32 too (IEEE, or TF32 when
torch.backends.cuda.matmul.allow_tf32 is on). Not done: split-K, persistent scheduling, FP8/int inputs
(the quantized matmuls build on this kernel).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels import matmul_decode
from kiln.kernels._common import apply_activation, grouped_tile, needs_grad, tma_scratch
from kiln.kernels.dispatch import interpreting, sm_count, use_triton
from kiln.kernels.launch import CachedLaunch, cdiv

ACTIVATIONS = ("none", "relu", "silu", "gelu", "gelu_tanh")


def _act_ref(x: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "none":
        return x
    if activation == "relu":
        return F.relu(x)
    if activation == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if activation == "gelu_tanh" else "none")


def matmul_ref(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"
) -> torch.Tensor:
    """Eager reference: float32 math (float64 if given float64), result in a's dtype."""
    wide = torch.float64 if a.dtype == torch.float64 else torch.float32
    c = a.to(wide) @ b.to(wide)
    if bias is not None:
        c = c + bias.to(wide)
    return _act_ref(c, activation).to(a.dtype)


def tile_config(
    bm, bn, bk, stages, warps, group=8, ws=False, persistent=False, split_k=1, flatten=False, epi_split=1
) -> triton.Config:
    """A launch config for `matmul_fwd(config=...)`: tile sizes, pipeline stages, warps, group size,
    warp specialization, persistent tile loop (`flatten`: pipelined as one loop with each tile's K loop,
    so a tile's epilogue overlaps the next tile's first loads), the number of programs sharing one
    tile's K range, and the pieces C's TMA store is split into (`epi_split` 2: half the shared memory
    to stage it, room for another pipeline stage)."""
    meta = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "WARP_SPEC": ws,
            "PERSISTENT": persistent, "SPLIT_K": split_k, "FLATTEN": flatten, "EPI_SPLIT": epi_split}  # fmt: skip
    return triton.Config(meta, num_stages=stages, num_warps=warps)


# Persistent 128x256: one program per SM looping over tiles, the tile loop flattened into the K loop so
# that one tile's epilogue overlaps the next tile's first loads, in groups of 8 tile rows, C stored in two
# 128x128 halves so that the 32 KB saved for staging it buys a fourth pipeline stage. On the H200
# (bench/experiments/gemm_o.py -> bench/results/sweep_gemm_subtile.json; do_bench, L2 flushed, interleaved
# with cuBLAS), against the previous 3-stage whole-tile store with groups of 4: O projection 58.2 against
# 58.9 us (cuBLAS 55.7), QKV 74.9 / 75.4 (72.0), gate/up 685.5 / 700.9 (677.7), down 312.7 / 315.1
# (309.8), 4096^3 193.6 / 194.5 (189.7), 8192^3 1602 / 1618 (1654). Before flattening (sweep_gemm_flatten
# .json) the short-K (1536) projections ran at 0.91x, the epilogue a bubble per tile.
_PERSISTENT_FLAT = tile_config(128, 256, 64, 4, 8, group=8, persistent=True, flatten=True, epi_split=2)
# The same tiles without flattening, for epilogues that store more than C (the pre-activation for the
# backward, C's old value for accumulate, row statistics): flattened, the training forward's
# silu(x @ W.T + b) with its stored pre-activation asked for 245784 bytes of shared memory, over the
# H200's 232448 (bench/results/kernels_gemm_ce.json, commit 7415a00).
_PERSISTENT_128x256 = tile_config(128, 256, 64, 3, 8, persistent=True)


def _configs() -> list[triton.Config]:
    if interpreting():  # the interpreter cannot benchmark: exactly one config
        return [tile_config(32, 32, 32, 1, 4, 4)]
    return [
        _PERSISTENT_128x256,  # the others cover problems with fewer tiles than SMs
        tile_config(128, 128, 64, 4, 8, persistent=True),
        tile_config(128, 128, 64, 4, 4),
        tile_config(64, 128, 64, 4, 4),
    ]


def _prune(configs, named_args, **kwargs):
    """The persistent 128x256 config whenever its tiles fill the GPU: it won on every such shape measured,
    and short autotuning runs (dominated by launch overhead on small GEMMs) can pick worse ones."""
    if len(configs) == 1:
        return configs
    M, N = named_args["M"], named_args["N"]
    if cdiv(M, 128) * cdiv(N, 256) >= named_args["num_programs"]:
        return configs[:1]
    return configs


def pick_config(M: int, N: int, K: int, sms: int, plain: bool = True) -> triton.Config | None:
    """The config a launch of this kernel without an explicit one uses, or None for the autotuner: decode
    shapes by rule (those that do not go to kernels/matmul_decode.py), and problems whose 128x256 tiles
    fill the GPU get those tiles without the autotuner's per-call cost (flattened when the epilogue is
    `plain`: C alone, with at most a bias and an activation)."""
    if M <= 16:
        return _decode_config(N, K, sms)
    if not interpreting() and cdiv(M, 128) * cdiv(N, 256) >= sms:
        return _PERSISTENT_FLAT if plain else _PERSISTENT_128x256
    return None


def _decode_config(N: int, K: int, sms: int) -> triton.Config:
    """This kernel's tiles for the decode GEMMs (M <= 16) that kernels/matmul_decode.py does not take.
    Weight streams; tiles chosen from a sweep under CUDA graphs on the H200 at M = 1 (round 2 of
    bench/kernels_gemm_ce.py): with few output tiles and a long K (the 8960 -> 1536 down projection) K is
    split 8 ways (9.3 us, cuBLAS 10.0); otherwise 16x64 tiles over all of K (1536 -> 2048: 5.4 us, cuBLAS
    4.3; 1536 -> 17920: 19.4 us, cuBLAS 17.0)."""
    if cdiv(N, 64) < sms and K >= 4096:
        return tile_config(16, 128, 128, 4, 4, 1, split_k=8)
    return tile_config(16, 64, 256, 4, 4, 1)


def _bench(fn, quantiles):
    # Shorter than autotune's default (25 + 100 ms per config): enough to rank configs, keeps tuning cheap.
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


@triton.jit
def _epilogue(
    acc, off_m, off_n, C_ptr, Bias_ptr, Pre_ptr, Stats_ptr, c_desc, M, N, stats_plane,
    TMA: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, STORE_PRE: tl.constexpr,
    ACCUMULATE: tl.constexpr, ROW_STATS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """float32 tile -> C: (C's old value), bias, (pre-activation for the backward), (row statistics),
    activation, one rounding."""
    if ACCUMULATE:  # straight into registers (a descriptor load would need another tile of shared memory)
        c_old = tl.make_block_ptr(C_ptr, (M, N), (N, 1), (off_m, off_n), (BLOCK_M, BLOCK_N), (1, 0))
        acc += tl.load(c_old, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if ROW_STATS:
        # Per row of this tile, over its BLOCK_N columns of the rounded output (what a reader of C sees):
        # max, sum exp(c - max) and sum c, at Stats_ptr[(s, m, n_tile)], a (3, M, cdiv(N, BLOCK_N)) array.
        # A cross-entropy over C then needs no pass of its own to find each row's logsumexp.
        v = acc.to(C_ptr.dtype.element_ty).to(tl.float32)
        v = tl.where((offs_n < N)[None, :], v, -float("inf"))
        t_max = tl.maximum(tl.max(v, axis=1), -3.0e38)  # finite even for a row of -inf (no nan below)
        t_sum = tl.sum(tl.exp(v - t_max[:, None]), axis=1)
        t_z = tl.sum(tl.where((offs_n < N)[None, :], v, 0.0), axis=1)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        at = Stats_ptr + offs_m.to(tl.int64) * tl.cdiv(N, BLOCK_N) + off_n // BLOCK_N
        tl.store(at, t_max, mask=offs_m < M)
        tl.store(at + stats_plane, t_sum, mask=offs_m < M)
        tl.store(at + 2 * stats_plane, t_z, mask=offs_m < M)
    if STORE_PRE:
        pre_blk = tl.make_block_ptr(Pre_ptr, (M, N), (N, 1), (off_m, off_n), (BLOCK_M, BLOCK_N), (1, 0))
        tl.store(pre_blk, acc.to(Pre_ptr.dtype.element_ty), boundary_check=(0, 1))
    acc = apply_activation(acc, ACTIVATION)
    if TMA:
        if c_desc.block_shape[1] == BLOCK_N:
            c_desc.store([off_m, off_n], acc.to(C_ptr.dtype.element_ty))
        else:  # the tile in two column halves: half the shared memory to stage the store (EPI_SPLIT)
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c_desc.store([off_m, off_n], left.to(C_ptr.dtype.element_ty))
            c_desc.store([off_m, off_n + BLOCK_N // 2], right.to(C_ptr.dtype.element_ty))
    else:
        c_blk = tl.make_block_ptr(C_ptr, (M, N), (N, 1), (off_m, off_n), (BLOCK_M, BLOCK_N), (1, 0))
        tl.store(c_blk, acc.to(C_ptr.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _tile(
    pid, A_ptr, B_ptr, C_ptr, Bias_ptr, Pre_ptr, Stats_ptr, Work_ptr, a_desc, b_desc, c_desc, M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stats_plane,
    A_KMAJOR: tl.constexpr, B_KMAJOR: tl.constexpr, TMA: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, STORE_PRE: tl.constexpr, ACCUMULATE: tl.constexpr, ROW_STATS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, WARP_SPEC: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Program `pid`'s share of C: a (BLOCK_M, BLOCK_N) tile, or with SPLIT_K a 1 / SPLIT_K slice of its
    K range, the last slice to finish applying the epilogue to the sum."""
    tile = pid // SPLIT_K
    off_m, off_n = grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_tiles = tl.cdiv(K, BLOCK_K)
    k_first = 0
    k_last = k_tiles
    if SPLIT_K > 1:
        per_split = tl.cdiv(k_tiles, SPLIT_K)
        k_first = (pid % SPLIT_K) * per_split
        k_last = min(k_first + per_split, k_tiles)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:
        for k in tl.range(k_first, k_last, warp_specialize=WARP_SPEC):
            off_k = k * BLOCK_K
            if A_KMAJOR:
                a = a_desc.load([off_m, off_k])
            else:
                a = a_desc.load([off_k, off_m]).T
            if B_KMAJOR:
                b = b_desc.load([off_n, off_k]).T
            else:
                b = b_desc.load([off_k, off_n])
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    else:
        a_blk = tl.make_block_ptr(A_ptr, (M, K), (stride_am, stride_ak), (off_m, k_first * BLOCK_K),
                                  (BLOCK_M, BLOCK_K), order=(1, 0) if A_KMAJOR else (0, 1))  # fmt: skip
        b_blk = tl.make_block_ptr(B_ptr, (K, N), (stride_bk, stride_bn), (k_first * BLOCK_K, off_n),
                                  (BLOCK_K, BLOCK_N), order=(0, 1) if B_KMAJOR else (1, 0))  # fmt: skip
        for _ in range(k_first, k_last):
            a = tl.load(a_blk, boundary_check=(0, 1), padding_option="zero")
            b = tl.load(b_blk, boundary_check=(0, 1), padding_option="zero")
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_blk = tl.advance(a_blk, (0, BLOCK_K))
            b_blk = tl.advance(b_blk, (BLOCK_K, 0))

    if SPLIT_K > 1:
        # Partial sums meet in a zeroed float32 workspace (M, N) followed by one int32 counter per tile.
        # The program that finishes last reads the total, clears its tile and counter (so the workspace
        # is zero again for the next launch: autotuning reruns it) and writes C.
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
        work = Work_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.atomic_add(work, acc, mask=mask, sem="relaxed")
        counter = Work_ptr.to(tl.pointer_type(tl.int32)) + M * N + tile  # M <= 16 here: no int32 overflow
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            acc = tl.load(work, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(work, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), mask=mask)
            tl.store(counter, 0)
            _epilogue(acc, off_m, off_n, C_ptr, Bias_ptr, Pre_ptr, Stats_ptr, c_desc, M, N, stats_plane, TMA,
                      HAS_BIAS, ACTIVATION, STORE_PRE, ACCUMULATE, ROW_STATS, BLOCK_M, BLOCK_N)  # fmt: skip
    else:
        _epilogue(acc, off_m, off_n, C_ptr, Bias_ptr, Pre_ptr, Stats_ptr, c_desc, M, N, stats_plane, TMA,
                  HAS_BIAS, ACTIVATION, STORE_PRE, ACCUMULATE, ROW_STATS, BLOCK_M, BLOCK_N)  # fmt: skip


@triton.jit
def _matmul_kernel(
    A_ptr,  # (M, K): element (m, k) at A_ptr + m * stride_am + k * stride_ak
    B_ptr,  # (K, N): element (k, n) at B_ptr + k * stride_bk + n * stride_bn
    C_ptr,  # (M, N) output, contiguous
    Bias_ptr,  # (N,), read when HAS_BIAS
    Pre_ptr,  # (M, N) pre-activation output, contiguous, written when STORE_PRE
    Stats_ptr,  # (3, M, cdiv(N, BLOCK_N)) float32 per-tile row statistics, written when ROW_STATS
    Work_ptr,  # zeroed float32 (M * N + tiles) split-K workspace, used when SPLIT_K > 1 (left zeroed)
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    num_programs,  # grid size when PERSISTENT (the SM count)
    stats_plane,  # M * cdiv(N, BLOCK_N): the stride between the three planes of Stats
    A_KMAJOR: tl.constexpr,  # stride_ak == 1 (row-major A); with TMA and not A_KMAJOR, stride_am == 1
    B_KMAJOR: tl.constexpr,  # stride_bk == 1 (B = an nn.Linear weight, transposed); with TMA else stride_bn == 1
    TMA: tl.constexpr,  # read and write tiles through tensor descriptors
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    STORE_PRE: tl.constexpr,
    ACCUMULATE: tl.constexpr,  # C += A @ B (C's old value read in the epilogue)
    ROW_STATS: tl.constexpr,  # also write per-tile row max / sum exp / sum (for a fused cross-entropy)
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" or "tf32" (float32 inputs only)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # rows of tiles visited together for L2 reuse
    WARP_SPEC: tl.constexpr,  # producer/consumer warp specialization of the loop (Hopper+)
    PERSISTENT: tl.constexpr,  # a grid of num_programs programs loops over the tiles; else one tile each
    SPLIT_K: tl.constexpr,  # programs per tile, each over 1 / SPLIT_K of K (not with PERSISTENT)
    FLATTEN: tl.constexpr = False,  # PERSISTENT: pipeline the tile loop and the K loop as one loop
    EPI_SPLIT: tl.constexpr = 1,  # TMA: store C in 1 or 2 column pieces (2: half the staging memory)
):
    if TMA:
        # Descriptors are laid out with the unit-stride dim last, as TMA requires; MN-major tiles are
        # transposed in shared memory (free for wgmma on 16-bit types).
        if A_KMAJOR:
            a_desc = tl.make_tensor_descriptor(A_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        else:
            a_desc = tl.make_tensor_descriptor(A_ptr, [K, M], [stride_ak, 1], [BLOCK_K, BLOCK_M])
        if B_KMAJOR:
            b_desc = tl.make_tensor_descriptor(B_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(B_ptr, [K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N])
        c_desc = tl.make_tensor_descriptor(C_ptr, [M, N], [N, 1], [BLOCK_M, BLOCK_N // EPI_SPLIT])
    else:
        a_desc, b_desc, c_desc = A_ptr, B_ptr, C_ptr  # unused
    if PERSISTENT:
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN):
            _tile(tile, A_ptr, B_ptr, C_ptr, Bias_ptr, Pre_ptr, Stats_ptr, Work_ptr, a_desc, b_desc, c_desc,
                  M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stats_plane, A_KMAJOR, B_KMAJOR, TMA,
                  HAS_BIAS, ACTIVATION, STORE_PRE, ACCUMULATE, ROW_STATS, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
                  GROUP_M, WARP_SPEC, 1)  # fmt: skip
    else:
        _tile(tl.program_id(0), A_ptr, B_ptr, C_ptr, Bias_ptr, Pre_ptr, Stats_ptr, Work_ptr, a_desc, b_desc,
              c_desc, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stats_plane, A_KMAJOR, B_KMAJOR,
              TMA, HAS_BIAS, ACTIVATION, STORE_PRE, ACCUMULATE, ROW_STATS, PRECISION, BLOCK_M, BLOCK_N,
              BLOCK_K, GROUP_M, WARP_SPEC, SPLIT_K)  # fmt: skip


_matmul_autotuned = triton.autotune(
    configs=_configs(), key=["M", "N", "K", "A_KMAJOR", "B_KMAJOR", "TMA"], prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
)(_matmul_kernel)  # fmt: skip


# Fixed-config launches through the compiled handle: Triton's own launch path cost ~55 us of host time
# per prefill GEMM on the H200's host (bench/host_overhead.py), more than a 1536-wide GEMM's GPU time at
# a few thousand tokens. Device-side tensor descriptors still get their scratch: the compiled kernel's
# launcher asks triton's allocator for it on every launch.
_matmul_launch = CachedLaunch(_matmul_kernel)


def _tma_ok(t: torch.Tensor, unit_dim: int) -> bool:
    """TMA needs unit stride in `unit_dim`, the other stride and the base address 16-byte aligned."""
    other = t.stride(1 - unit_dim) * t.element_size()
    return t.stride(unit_dim) == 1 and other % 16 == 0 and other > 0 and t.data_ptr() % 16 == 0


@dataclass(slots=True)
class _Plan:
    """How matmul_fwd runs one layout of arguments (everything but the tensors' contents and addresses)."""

    kind: str  # "decode" (kernels/matmul_decode.py), "empty" (a zero-size dim), or "tiles" (this kernel)
    M: int
    N: int
    store_pre: bool
    split: bool  # split-K: needs a zeroed workspace
    programs: int  # the SM count: a persistent grid's size
    tma: bool  # tensor descriptors (needs the scratch allocator)
    config: triton.Config | None  # None: the autotuner picks
    flags: dict[str, Any]  # constexpr keywords, with a fixed config's tile sizes and launch options
    grid: tuple[int] | None  # for a fixed config
    run: Callable[[tuple], Any] | None = None  # a fixed config's launch, bound at the first call


# matmul_fwd's plans by argument layout: the checks and choices of a call are made once per layout, and a
# call with a layout seen before only allocates and launches (its Python took 15.6 us of host time per
# prefill GEMM on the H200's host, as long as the C launch itself, against 18.5 us for all of F.linear).
# A memo of a pure function of its key, like Triton's own kernel cache; cleared if it ever grows past
# _MAX_PLANS layouts (a run with ever-changing shapes).
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def matmul_fwd(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    store_pre: bool = False,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    row_stats: torch.Tensor | None = None,
    config: triton.Config | None = None,
    tma: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launcher: (C, pre) with pre the pre-activation (only when store_pre).

    out: a contiguous (M, N) tensor to write C into; accumulate: C = out + A @ B (needs out).
    row_stats: a float32 (3, M, cdiv(N, BLOCK_N)) tensor for per-tile row max / sum exp / sum; needs an
    explicit `config` (its BLOCK_N fixes the layout) and no activation. config: skip the autotuner.
    tma: force tensor descriptors (True) or block pointers (False); default: descriptors when allowed.
    """
    # every property the plan depends on, and all that Triton specializes the launch on (dtypes, 16-byte
    # alignment, the ints' values): a plan's bound launch is only reused for an identical layout
    key = (
        a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, b.device,
        a.data_ptr() & 15, b.data_ptr() & 15,
        None if bias is None else (bias.shape, bias.dtype, bias.device, bias.data_ptr() & 15),
        None if out is None else (out.shape, out.dtype, out.stride(), out.data_ptr() & 15),
        None if row_stats is None else (row_stats.shape, row_stats.dtype, row_stats.data_ptr() & 15),
        activation, store_pre, accumulate, config, tma,
        a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(a, b, bias, activation, store_pre, out, accumulate, row_stats, config, tma)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    if plan.kind == "decode":  # decode-sized: a weight stream, its own kernels (kernels/matmul_decode.py)
        return matmul_decode.decode_matmul(a, b, bias, activation, out=out), None
    if plan.kind == "empty":  # nothing to tile: the reference gives the right empty/zero result
        pre = matmul_ref(a, b, bias) if plan.store_pre else None
        c = matmul_ref(a, b, bias, activation)
        if out is not None:
            c = out.add_(c) if accumulate else out.copy_(c)
        return c, pre
    M, N = plan.M, plan.N
    c = a.new_empty(M, N) if out is None else out
    pre = a.new_empty(M, N) if plan.store_pre else None
    if plan.tma and a.is_cuda:
        triton.set_allocator(tma_scratch)  # a context variable in triton, read at launch (per thread)
    # Split-K workspace (the kernel leaves it zeroed): M x N partial sums, then one counter per tile (at
    # most cdiv(M, 16) * cdiv(N, 16) tiles, as BLOCK_M and BLOCK_N are at least 16).
    work = torch.zeros(M * N + cdiv(M, 16) * cdiv(N, 16), device=a.device) if plan.split else c
    args = (a, b, c, c if bias is None else bias, c if pre is None else pre, c if row_stats is None else row_stats,
            work, M, N, a.shape[1], a.stride(0), a.stride(1), b.stride(0), b.stride(1), plan.programs,
            0 if row_stats is None else row_stats.shape[1] * row_stats.shape[2])  # fmt: skip
    if plan.config is None:
        programs = plan.programs

        def grid(meta):
            tiles = cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
            return (min(tiles, programs) if meta["PERSISTENT"] else tiles * meta["SPLIT_K"],)

        _matmul_autotuned[grid](*args, **plan.flags)
    elif (
        plan.run is None
    ):  # a fixed config, bypassing the autotuner (prefill-sized problems, fused CE, tests)
        plan.run = _matmul_launch.bind(plan.grid, args, plan.flags)
    else:  # the key holds every property Triton specializes on (the fresh C, pre and work are aligned)
        plan.run(args)
    return c, pre


def _check_operands(a, b, bias, activation) -> None:
    """Clear errors for bad operands (shapes, dtypes, devices, activation): metadata only."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul expects A (M, K) and B (K, N), got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in (torch.float16, torch.bfloat16, torch.float32) or b.dtype != a.dtype:
        raise TypeError(
            f"matmul takes two float16, bfloat16 or float32 tensors of one dtype, got {a.dtype}, {b.dtype}"
        )
    if bias is not None and (bias.shape != (b.shape[1],) or bias.device != a.device):
        raise ValueError(f"bias must have shape ({b.shape[1]},) on {a.device}, got {tuple(bias.shape)}")
    if a.device != b.device:
        raise ValueError(f"A is on {a.device} but B on {b.device}")


def _plan(a, b, bias, activation, store_pre, out, accumulate, row_stats, config, tma) -> _Plan:
    """matmul_fwd's checks (clear errors for bad arguments) and choices, for one layout of arguments."""
    _check_operands(a, b, bias, activation)
    M, K = a.shape
    N = b.shape[1]
    if out is not None and (out.shape != (M, N) or out.dtype != a.dtype or out.stride() != (N, 1)):
        raise ValueError(f"out must be a contiguous ({M}, {N}) {a.dtype} tensor")
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into `out`: pass out")
    if row_stats is not None and (config is None or activation != "none"):
        raise ValueError(
            "row_stats needs an explicit config (its BLOCK_N fixes the layout) and no activation"
        )
    store_pre = store_pre and activation != "none"
    none = dict(
        M=M, N=N, store_pre=store_pre, split=False, programs=0, tma=False, config=None, flags={}, grid=None
    )
    if (config is None and tma is None and 0 < M <= matmul_decode.DECODE_MAX_M and N > 0 and K > 0
            and not store_pre and not accumulate and row_stats is None):  # fmt: skip
        return _Plan("decode", **none)
    if M == 0 or N == 0 or K == 0:
        return _Plan("empty", **none)
    # Any strides work through block pointers; unit stride along K (or along M / N) picks the tile layout.
    a_kmajor, b_kmajor = a.stride(1) == 1, b.stride(0) == 1
    # a fresh C is contiguous and 16-byte aligned: its rows need a multiple of 16 bytes
    c_ok = _tma_ok(out, 1) if out is not None else N * a.element_size() % 16 == 0
    allowed = _tma_ok(a, 1 if a_kmajor else 0) and _tma_ok(b, 0 if b_kmajor else 1) and c_ok
    if tma and not allowed:
        raise ValueError("tma=True but the operands' strides or alignment do not allow tensor descriptors")
    programs = sm_count(a.device)
    if config is None:
        config = pick_config(M, N, K, programs, plain=not (store_pre or accumulate or row_stats is not None))
        if M <= 16:  # block pointers: 10-30% faster than descriptors on decode weight streams (same sweep)
            tma = False if tma is None else tma
    use_tma = allowed if tma is None else tma
    precision = "tf32" if a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    flags = dict(A_KMAJOR=a_kmajor, B_KMAJOR=b_kmajor, TMA=use_tma, HAS_BIAS=bias is not None,
                 ACTIVATION=activation, STORE_PRE=store_pre, ACCUMULATE=accumulate,
                 ROW_STATS=row_stats is not None, PRECISION=precision)  # fmt: skip
    grid = None
    if config is not None:
        meta = config.kwargs
        tiles = cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"])
        grid = (min(tiles, programs) if meta["PERSISTENT"] else tiles * meta["SPLIT_K"],)
        flags |= dict(**meta, num_warps=config.num_warps, num_stages=config.num_stages)
    split = config is not None and config.kwargs["SPLIT_K"] > 1
    return _Plan("tiles", M, N, store_pre, split, programs, use_tma, config, flags, grid)


def _act_grad(grad: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    """dC * act'(pre): torch's own backward kernels for the activation (float32 math inside, one pass,
    the result in grad's dtype), the ones eager autograd runs."""
    grad = grad.to(pre.dtype)
    if activation == "relu":
        return torch.ops.aten.threshold_backward(grad, pre, 0)
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, pre)
    return torch.ops.aten.gelu_backward(
        grad, pre, approximate="tanh" if activation == "gelu_tanh" else "none"
    )


class Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, bias, activation):
        need_pre = activation != "none" and any(ctx.needs_input_grad[:3])
        c, pre = matmul_fwd(a, b, bias, activation, store_pre=need_pre)
        ctx.save_for_backward(a, b, pre)
        ctx.activation, ctx.has_bias = activation, bias is not None
        return c

    @staticmethod
    def backward(ctx, grad_c):
        a, b, pre = ctx.saved_tensors
        d = grad_c if ctx.activation == "none" else _act_grad(grad_c, pre, ctx.activation)
        da = matmul_fwd(d, b.t())[0] if ctx.needs_input_grad[0] else None  # (M, K) = (M, N) @ (N, K)
        db = matmul_fwd(a.t(), d)[0] if ctx.needs_input_grad[1] else None  # (K, N) = (K, M) @ (M, N)
        dbias = (
            d.sum(0, dtype=torch.float32).to(d.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        )
        return da, db, dbias, None


# ------------------------------------------------------------------------------ torch.compile: custom op
# Under torch.compile the public op calls this instead of Matmul (Dynamo cannot trace the launch): opaque
# to the compiler, a fake function for shapes, and a backward of two more calls of the op itself.
@torch.library.custom_op("kiln::matmul", mutates_args=())
def matmul_op(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str, store_pre: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(act(a @ b + bias) (M, N) contiguous, the pre-activation (M, N) if `store_pre` and there is an
    activation, else empty)."""
    c, pre = matmul_fwd(a, b, bias, activation, store_pre=store_pre)
    return c, pre if pre is not None else a.new_empty(0)


@matmul_op.register_fake
def _(a, b, bias, activation, store_pre):
    _check_operands(a, b, bias, activation)
    M, N = a.shape[0], b.shape[1]
    return a.new_empty((M, N)), a.new_empty((M, N) if store_pre and activation != "none" else 0)


def _matmul_setup(ctx, inputs, output):
    a, b, bias, activation, _ = inputs
    ctx.save_for_backward(a, b, output[1])
    ctx.activation, ctx.has_bias = activation, bias is not None


def _matmul_backward(ctx, grad_c, _dpre):
    a, b, pre = ctx.saved_tensors
    d = grad_c if ctx.activation == "none" else _act_grad(grad_c, pre, ctx.activation)
    da = matmul_op(d, b.t(), None, "none", False)[0] if ctx.needs_input_grad[0] else None
    db = matmul_op(a.t(), d, None, "none", False)[0] if ctx.needs_input_grad[1] else None
    dbias = d.sum(0, dtype=torch.float32).to(d.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return da, db, dbias, None, None


matmul_op.register_autograd(_matmul_backward, setup_context=_matmul_setup)


def matmul(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"
) -> torch.Tensor:
    """act(a @ b + bias) for a (M, K), b (K, N), bias (N,)."""
    if not use_triton(a, b, bias):
        return matmul_ref(a, b, bias, activation)
    if torch.compiler.is_compiling():
        store_pre = activation != "none" and needs_grad(a, b, bias)  # the backward's act'(pre)
        return matmul_op(a, b, bias, activation, store_pre)[0]
    if torch.is_grad_enabled() and (
        a.requires_grad or b.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return Matmul.apply(a, b, bias, activation)
    return matmul_fwd(a, b, bias, activation)[0]  # inference: no autograd node, less launch overhead


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"
) -> torch.Tensor:
    """act(x @ weight.T + bias) for x (..., K), weight (N, K) as in nn.Linear; weight is read in place."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear expects x (..., K) and weight (N, K), got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.dim() == 2:  # (tokens, K) already: no views (a decode step's host time is mostly such calls)
        return matmul(x, weight.t(), bias, activation)
    lead = x.shape[:-1]
    try:
        x2 = x.view(-1, x.shape[-1])
    except RuntimeError as err:
        raise ValueError(
            f"x {tuple(x.shape)} with strides {x.stride()} cannot be viewed as (tokens, K) without a copy: "
            "pass x.contiguous()"
        ) from err
    return matmul(x2, weight.t(), bias, activation).view(*lead, weight.shape[0])
