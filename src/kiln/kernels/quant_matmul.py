"""Weight-only quantized matmul: y = x @ dequant(Wq).T + bias, with INT8 or INT4 weights and float activations.

Formats (W is an nn.Linear weight (N, K): N output channels, K inputs):
- int8: qweight int8 (N, K), symmetric per output channel: W[n, k] = q[n, k] * s[n], q in [-127, 127];
  scales (N, 1).
- int4: groups of G (32, 64 or 128) consecutive k in one row share a scale and, when asymmetric, a zero
  point: W[n, k] = (q[n, k] - z[n, k // G]) * s[n, k // G], q in [0, 15]; symmetric has z = 8 implied
  (q - 8 in [-8, 7]). scales (N, K / G); zeros uint8 (N, K / G) or None. Two int4 per byte:
      qweight uint8 (N, K / 2), byte [n, j] = q[n, 2j] | q[n, 2j + 1] << 4
  Rows stay K-contiguous (the nn.Linear layout), so a program streaming BLOCK_N rows of W loads 16-byte
  vectors along K, and unpacking is two bit operations with no shuffle: the low nibbles of a tile meet
  x's even columns and the high nibbles its odd ones, so a tile's products are
      sum_j (lo[n, j] - z) * x[2j] + (hi[n, j] - z) * x[2j + 1].
  (The same nibble order as GPTQ's int32 words, read byte by byte, with the matrix transposed.)
Scales are stored in a 16-bit float dtype or float32 and applied in float32.

Kernels, over float16, bfloat16 (on GPU) and float32 activations, float32 accumulation:
- decode (M <= 16 rows, kernels/matmul_decode.py's two forms and its deterministic split-K sum):
  "gemv" for one row, FMAs over a (BLOCK_N, BLOCK_K) tile of W dequantized in float32 (int4: the tile as
  (BLOCK_N, sub-tiles, packed bytes) so a tile may span several groups, one scale per sub-tile);
  "dot" for 2 to 16 rows, W the tensor-core M side: acc (BLOCK_N, 16) += deq(W) (BLOCK_N, BLOCK_K) @ x.T.
  "fma" (one row) and "mma" (1-16 rows): kernels/quant_decode.py's forms, which read W as int32 words
  and dequantize by bit operations instead of conversion instructions (see there).
- prefill ("tile"): C tiles (BLOCK_M, BLOCK_N) in grouped order, W dequantized in registers into x's dtype
  before tl.dot (int4: (q - z) * s, one group per K step, so BLOCK_K <= G; int8: the integers, exact in
  16-bit floats, with the per-channel scale applied once to the float32 tile at the end).
Launch configs are fixed rules of the shape (no autotuner: every call is one lookup and one or two
launches, safe inside a CUDA graph capture).

Not done: activation quantization (kernels/fp8_matmul.py does FP8 weight + activation), backward.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kiln.kernels._common import env_form, grouped_tile
from kiln.kernels._common import pdl as use_pdl
from kiln.kernels.dispatch import interpreting, sm_count, use_triton
from kiln.kernels.launch import CachedLaunch, cdiv
from kiln.kernels.matmul_decode import (
    DECODE_MAX_M,
    PRELOAD_MAX_WEIGHT,
    DecodeConfig,
    _split_sum_kernel,
    _store,
    table_rows,
)
from kiln.kernels.quant_decode import MAGIC, _wq_fma_kernel, _wq_mma_kernel, word_view

BITS = (4, 8)
DECODE_FORMS = ("gemv", "dot", "fma", "mma")
GROUP_SIZES = (32, 64, 128)


# ------------------------------------------------------------------------------------------ reference
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) integers in [0, 15] (K even) -> (N, K / 2) uint8, byte j = q[:, 2j] | q[:, 2j + 1] << 4."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of columns, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """(N, K / 2) uint8 -> (N, K) uint8 in [0, 15], the inverse of pack_int4."""
    lo, hi = packed & 15, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def dequantize_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int
) -> torch.Tensor:
    """The float32 weight (N, K) that a quantized one stands for (the module docstring's formulas)."""
    if bits == 8:
        return qweight.float() * scales.float().reshape(-1, 1)
    q = unpack_int4(qweight).float()  # (N, K)
    N, K = q.shape
    z = 8.0 if zeros is None else zeros.float().repeat_interleave(group_size, dim=1)
    s = scales.float().repeat_interleave(group_size, dim=1)
    return (q - z) * s


def wq_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager reference: x (..., K) @ dequant(W).T (+ bias) in float32 (float64 for float64 x), in x's dtype."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    w = dequantize_weight(qweight, scales, zeros, bits, group_size).to(wide)
    y = x.to(wide) @ w.T
    if bias is not None:
        y = y + bias.to(wide)
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _wq_decode_kernel(
    X_ptr,  # (M, K) activations: x[m, k] at X_ptr + m * stride_xm + k * stride_xk
    Q_ptr,  # int8 (N, K) or packed int4 uint8 (N, K / 2), rows K-contiguous, row stride stride_qn
    S_ptr,  # (N, K / GROUP) scales (int8: (N, 1)), row stride stride_sn
    Z_ptr,  # uint8 (N, K / GROUP) zero points, read when HAS_ZERO
    Y_ptr,  # (M, N) contiguous output; with SPLIT_K > 1 a float32 (SPLIT_K, M, N) partial-sum buffer
    Bias_ptr,  # (N,), read when HAS_BIAS (and SPLIT_K == 1)
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_sn,
    k_split,  # K range of one split: a multiple of BLOCK_K (K when SPLIT_K == 1)
    BITS: tl.constexpr,  # 8 or 4
    GROUP: tl.constexpr,  # int4 group size (int8: unused)
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT: tl.constexpr,  # False: FMAs over one row (M == 1); True: tl.dot with x.T as a 16-wide side
    PRECISION: tl.constexpr,  # tl.dot input_precision ("ieee" for float32 activations)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # int4 with DOT: <= GROUP (one group per K step)
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    q_rows = Q_ptr + offs_n.to(tl.int64)[:, None] * stride_qn  # (BLOCK_N, 1)
    s_rows = S_ptr + offs_n.to(tl.int64) * stride_sn  # (BLOCK_N,)
    z_rows = Z_ptr + offs_n.to(tl.int64) * stride_sn
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    offs_m = tl.arange(0, 16)
    pair = tl.arange(0, 2)  # int4: the two columns of a byte
    if not DOT:
        if BITS == 8:
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                q = tl.load(q_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0)
                x = tl.load(X_ptr + offs_k * stride_xk, mask=offs_k < K, other=0.0)
                acc += q.to(tl.float32) * x.to(tl.float32)[None, :]
            # per output channel: the scale leaves the K sum
            y = tl.sum(acc, axis=1) * tl.load(s_rows, mask=n_ok, other=0.0).to(tl.float32)
        else:
            # The tile as (BLOCK_N, SUB, HALF): SUB sub-tiles of TILE_G = min(BLOCK_K, GROUP) columns, each
            # inside one group, of HALF = TILE_G / 2 packed bytes.
            TILE_G: tl.constexpr = BLOCK_K if BLOCK_K < GROUP else GROUP
            SUB: tl.constexpr = BLOCK_K // TILE_G
            HALF: tl.constexpr = TILE_G // 2
            sub = tl.arange(0, SUB)
            j = tl.arange(0, HALF)
            acc3 = tl.zeros((BLOCK_N, SUB, HALF), dtype=tl.float32)
            for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
                pk = (
                    k0 // 2 + sub[:, None] * HALF + j[None, :]
                )  # (SUB, HALF): bytes, i.e. columns 2pk, 2pk + 1
                k_ok = pk < K // 2  # (masks and addresses in bytes: contiguous, so the loads are vectors)
                b = tl.load(
                    q_rows[:, :, None] + pk[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0
                )
                g = (k0 + sub * TILE_G) // GROUP  # (SUB,) group of each sub-tile
                g_ok = n_ok[:, None] & ((k0 + sub * TILE_G) < K)[None, :]
                s = tl.load(s_rows[:, None] + g[None, :], mask=g_ok, other=0.0).to(
                    tl.float32
                )  # (BLOCK_N, SUB)
                if HAS_ZERO:
                    z = tl.load(z_rows[:, None] + g[None, :], mask=g_ok, other=0).to(tl.float32)
                else:
                    z = tl.full((BLOCK_N, SUB), 8.0, tl.float32)
                # x's column pairs (2j, 2j + 1) in one load of adjacent elements, split in registers
                xx = tl.load(X_ptr + (2 * pk[:, :, None] + pair[None, None, :]) * stride_xk, mask=k_ok[:, :, None],
                             other=0.0)  # fmt: skip
                xe, xo = tl.split(xx.to(tl.float32))  # (SUB, HALF) each
                lo = (b & 15).to(tl.float32) - z[:, :, None]
                hi = (b >> 4).to(tl.float32) - z[:, :, None]
                acc3 += (lo * xe[None, :, :] + hi * xo[None, :, :]) * s[:, :, None]
            y = tl.sum(tl.sum(acc3, axis=2), axis=1)
        row0 = tl.zeros((1, 1), dtype=tl.int32)  # the one row
        _store(y[None, :], row0, offs_n[None, :], pid_k, Y_ptr, Bias_ptr, M, N, HAS_BIAS, "none", SPLIT_K)
    else:
        x_cols = X_ptr + offs_m[None, :] * stride_xm  # (1, 16): x.T's columns
        m_ok = (offs_m < M)[None, :]
        acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        if BITS == 8:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                q = tl.load(q_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0)
                xt = tl.load(
                    x_cols + offs_k[:, None] * stride_xk, mask=m_ok & (offs_k < K)[:, None], other=0.0
                )
                acc = tl.dot(
                    q.to(xt.dtype), xt, acc, input_precision=PRECISION
                )  # integers: exact in x's dtype
            acc = acc * tl.load(s_rows, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        else:
            HALF_K: tl.constexpr = BLOCK_K // 2
            j = tl.arange(0, HALF_K)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                pk = k0 // 2 + j  # (HALF_K,) bytes: columns 2pk and 2pk + 1
                k_ok = pk < K // 2
                b = tl.load(q_rows + pk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
                g = k0 // GROUP
                s = tl.load(s_rows + g, mask=n_ok, other=0.0).to(tl.float32)[:, None]  # (BLOCK_N, 1)
                if HAS_ZERO:
                    z = tl.load(z_rows + g, mask=n_ok, other=0).to(tl.float32)[:, None]
                else:
                    z = 8.0
                xx = tl.load(x_cols[:, :, None] + (2 * pk[:, None, None] + pair[None, None, :]) * stride_xk,
                             mask=(m_ok & k_ok[:, None])[:, :, None], other=0.0)  # fmt: skip
                xe, xo = tl.split(xx)  # (HALF_K, 16) each: x.T's even and odd rows
                lo = (((b & 15).to(tl.float32) - z) * s).to(xe.dtype)  # dequantized in registers
                hi = (((b >> 4).to(tl.float32) - z) * s).to(xe.dtype)
                acc = tl.dot(lo, xe, acc, input_precision=PRECISION)
                acc = tl.dot(hi, xo, acc, input_precision=PRECISION)
        _store(acc, offs_m[None, :], offs_n[:, None], pid_k, Y_ptr, Bias_ptr, M, N, HAS_BIAS, "none", SPLIT_K)


@triton.jit
def _wq_tile_kernel(
    X_ptr,  # (M, K) activations: x[m, k] at X_ptr + m * stride_xm + k * stride_xk
    Q_ptr,  # int8 (N, K) or packed int4 uint8 (N, K / 2), rows K-contiguous, row stride stride_qn
    S_ptr,  # (N, K / GROUP) scales (int8: (N, 1)), row stride stride_sn
    Z_ptr,  # uint8 (N, K / GROUP) zero points, read when HAS_ZERO
    Y_ptr,  # (M, N) contiguous output
    Bias_ptr,  # (N,), read when HAS_BIAS
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_qn,
    stride_sn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZERO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # int4: <= GROUP, so one K step lies in one group
    GROUP_M: tl.constexpr,  # tile rows visited together (A's panels shared in L2)
    STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    off_m, off_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_ok = (offs_m < M)[:, None]
    n_ok = offs_n < N
    x_rows = X_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (BLOCK_M, 1)
    q_cols = Q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn  # (1, BLOCK_N): W.T's columns
    s_cols = S_ptr + offs_n.to(tl.int64) * stride_sn
    z_cols = Z_ptr + offs_n.to(tl.int64) * stride_sn
    pair = tl.arange(0, 2)  # int4: the two columns of a byte
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BITS == 8:
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            x = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=m_ok & k_ok[None, :], other=0.0)
            q = tl.load(
                q_cols + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0
            )  # (BLOCK_K, BLOCK_N)
            acc = tl.dot(x, q.to(x.dtype), acc, input_precision=PRECISION)
        acc = acc * tl.load(s_cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    else:
        HALF_K: tl.constexpr = BLOCK_K // 2
        j = tl.arange(0, HALF_K)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            pk = k0 // 2 + j  # (HALF_K,) bytes: columns 2pk and 2pk + 1
            k_ok = pk < K // 2
            b = tl.load(q_cols + pk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)  # (HALF_K, BN)
            g = k0 // GROUP
            s = tl.load(s_cols + g, mask=n_ok, other=0.0).to(tl.float32)[None, :]  # (1, BLOCK_N)
            if HAS_ZERO:
                z = tl.load(z_cols + g, mask=n_ok, other=0).to(tl.float32)[None, :]
            else:
                z = 8.0
            xx = tl.load(x_rows[:, :, None] + (2 * pk[None, :, None] + pair[None, None, :]) * stride_xk,
                         mask=(m_ok & k_ok[None, :])[:, :, None], other=0.0)  # fmt: skip
            xe, xo = tl.split(xx)  # (BLOCK_M, HALF_K) each: x's even and odd columns
            lo = (((b & 15).to(tl.float32) - z) * s).to(xe.dtype)  # dequantized in registers
            hi = (((b >> 4).to(tl.float32) - z) * s).to(xe.dtype)
            acc = tl.dot(xe, lo, acc, input_precision=PRECISION)
            acc = tl.dot(xo, hi, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y = Y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y, acc.to(Y_ptr.dtype.element_ty), mask=m_ok & n_ok[None, :])


_decode_launch = CachedLaunch(_wq_decode_kernel)
_fma_launch = CachedLaunch(_wq_fma_kernel)
_mma_launch = CachedLaunch(_wq_mma_kernel)
_tile_launch = CachedLaunch(_wq_tile_kernel)
_sum_launch = CachedLaunch(_split_sum_kernel)


# ------------------------------------------------------------------------------------------ configs
# Measured winners of `bench/quant.py --case decode-sweep` on the H200, by (format, rows, N, K), format one
# of "int8", "int4-g<G>", "int4-g<G>-asym"; rows 1, 4 (for 2-4 rows) or 16 (for 5-16). The sweep prints
# these entries ("table" in bench/results/quant_sweep.json) where a candidate beat the rule below by more
# than 2%; a shape not listed takes the rule.
# Swept at 3963b92; the entries the sweeps at 9ddd50d (the fma loop's new form) and 465e463 printed merged in
# (bench/results/quant_sweep.json, the 9ddd50d one in bench/results/archive/); the one-row int4 entries
# from the sweeps of the fma form's one-scale-a-row K steps at d3a752d and c422f60, and the 4- and 16-row
# int4 entries from the sweep of the mma form's byte-at-a-time tiles at 0f76385 (bench/results/archive/
# quant_sweep-{d3a752d,c422f60,0f76385}.json).
DECODE_TABLE: dict[tuple[str, int, int, int], DecodeConfig] = {
    ("int4-g128", 1, 17920, 1536): DecodeConfig("fma", 16, 128, 1, 2, 4),
    ("int4-g128", 1, 151936, 1536): DecodeConfig("fma", 32, 256, 1, 2, 3),
    ("int4-g128", 1, 1536, 8960): DecodeConfig("fma", 16, 256, 4, 4, 3),
    ("int4-g128", 1, 2048, 1536): DecodeConfig("fma", 8, 512, 1, 4, 3),
    ("int4-g128", 1, 1536, 1536): DecodeConfig("fma", 8, 512, 1, 4, 3),
    ("int4-g128", 4, 1536, 1536): DecodeConfig("mma", 32, 128, 4, 4, 3),
    ("int4-g128", 4, 2048, 1536): DecodeConfig("mma", 32, 128, 4, 4, 3),
    ("int4-g128", 4, 17920, 1536): DecodeConfig("mma", 64, 64, 1, 4, 4),
    ("int4-g128", 4, 151936, 1536): DecodeConfig("mma", 64, 64, 1, 4, 4),
    ("int4-g128", 4, 1536, 8960): DecodeConfig("mma", 32, 128, 8, 4, 3),
    ("int4-g128", 16, 1536, 1536): DecodeConfig("mma", 32, 128, 4, 4, 3),
    ("int4-g128", 16, 2048, 1536): DecodeConfig("mma", 32, 128, 4, 4, 3),
    ("int4-g128", 16, 17920, 1536): DecodeConfig("mma", 64, 64, 1, 4, 4),
    ("int4-g128", 16, 151936, 1536): DecodeConfig("mma", 64, 64, 1, 4, 4),
    ("int4-g128", 16, 1536, 8960): DecodeConfig("mma", 32, 128, 8, 4, 3),
    ("int4-g128-asym", 1, 1536, 1536): DecodeConfig("fma", 8, 512, 1, 4, 3),
    ("int4-g128-asym", 1, 2048, 1536): DecodeConfig("fma", 8, 512, 1, 4, 3),
    ("int4-g128-asym", 1, 17920, 1536): DecodeConfig("fma", 16, 256, 1, 2, 3),
    ("int4-g128-asym", 1, 151936, 1536): DecodeConfig("fma", 32, 128, 1, 2, 3),
    ("int4-g128-asym", 1, 1536, 8960): DecodeConfig("fma", 16, 256, 4, 4, 3),
    ("int4-g128-asym", 4, 1536, 1536): DecodeConfig("mma", 32, 128, 4, 4, 3),
    ("int4-g128-asym", 4, 2048, 1536): DecodeConfig("mma", 32, 128, 4, 4, 3),
    ("int4-g128-asym", 4, 17920, 1536): DecodeConfig("mma", 64, 128, 1, 4, 3),
    ("int4-g128-asym", 4, 151936, 1536): DecodeConfig("mma", 64, 64, 1, 4, 4),
    ("int4-g128-asym", 4, 1536, 8960): DecodeConfig("mma", 32, 128, 8, 4, 3),
    ("int4-g128-asym", 16, 1536, 1536): DecodeConfig("mma", 32, 128, 4, 4, 3),
    ("int4-g128-asym", 16, 2048, 1536): DecodeConfig("mma", 32, 128, 4, 4, 3),
    ("int4-g128-asym", 16, 17920, 1536): DecodeConfig("mma", 64, 128, 1, 4, 3),
    ("int4-g128-asym", 16, 151936, 1536): DecodeConfig("mma", 64, 64, 1, 4, 4),
    ("int4-g128-asym", 16, 1536, 8960): DecodeConfig("mma", 32, 128, 8, 4, 3),
    # int8 qkv, o and down on the fma form: a tie with the gemv rule timed alone (c4a5609 sweep), but the
    # fma form launches with PDL and the gemv form does not: the engine at batch 1 1.101x -> 1.234x bf16
    ("int8", 1, 2048, 1536): DecodeConfig("fma", 8, 512, 1, 4, 3),
    ("int8", 1, 1536, 1536): DecodeConfig("fma", 8, 512, 1, 4, 3),
    ("int8", 1, 1536, 8960): DecodeConfig("fma", 8, 512, 2, 4, 3),
    ("int8", 1, 17920, 1536): DecodeConfig("fma", 16, 256, 1, 2, 3),
    ("int8", 1, 151936, 1536): DecodeConfig("fma", 16, 256, 1, 2, 3),
    ("int8", 4, 1536, 1536): DecodeConfig("dot", 32, 128, 4, 4, 3),
    ("int8", 4, 2048, 1536): DecodeConfig("dot", 32, 128, 4, 4, 3),
    ("int8", 4, 17920, 1536): DecodeConfig("dot", 16, 256, 1, 1, 4),
    ("int8", 4, 151936, 1536): DecodeConfig("dot", 16, 256, 1, 1, 4),
    ("int8", 16, 1536, 1536): DecodeConfig("dot", 32, 128, 4, 4, 3),
    ("int8", 16, 2048, 1536): DecodeConfig("dot", 32, 128, 4, 4, 3),
    ("int8", 16, 17920, 1536): DecodeConfig("dot", 16, 256, 1, 1, 4),
    ("int8", 16, 151936, 1536): DecodeConfig("dot", 16, 256, 1, 1, 4),
    ("int8", 16, 1536, 8960): DecodeConfig("dot", 16, 256, 4, 1, 4),
}


def decode_format(bits: int, group: int, asymmetric: bool) -> str:
    """The format's name in DECODE_TABLE and the sweep: "int8", "int4-g128", "int4-g32-asym", ..."""
    return "int8" if bits == 8 else f"int4-g{group}{'-asym' if asymmetric else ''}"


@functools.lru_cache(maxsize=256)
def wq_decode_config(
    M: int, N: int, K: int, bits: int, group: int, sms: int, asymmetric: bool = False
) -> DecodeConfig:
    """The decode launch config: DECODE_TABLE's entry for the shape when it has one, else
    the tile rule of kernels/matmul_decode.py (its H200 sweep for bf16 weights),
    with one row's K steps widened so that a program's load per step stays near what the bf16 rule streams
    (int8: the same bytes at twice the columns; int4: 512 and 2048 columns, as wide as the groups' sub-tiles
    allow without a mostly-masked last step at K = 1536 and 8960). That fallback was not swept for the
    quantized kernels; `bench/quant.py --case decode-sweep` measures it against every form."""
    if interpreting():  # small tiles: ragged tiles and several K steps in the CPU tests
        return DecodeConfig("gemv", 16, 64 if bits == 4 else 32) if M == 1 else DecodeConfig("dot", 16, 32)
    swept = DECODE_TABLE.get((decode_format(bits, group, asymmetric), table_rows(M), N, K))
    if swept is not None:
        return swept
    if M == 1:
        return DecodeConfig("gemv", 4, 512, 1, 2, 3) if K <= 4096 else DecodeConfig("gemv", 2, 2048, 1, 4, 1)
    bk = 128 if bits == 8 else min(128, group)
    tiles = cdiv(N, 64)
    if tiles >= sms:
        return DecodeConfig("dot", 64, bk, 1, 4, 3)
    if K <= 4096:
        return DecodeConfig("dot", 16, bk, 1, 4, 3)
    return DecodeConfig("dot", 64, bk, max(2, round(2 * sms / tiles)), 4, 4)


@functools.cache
def preload_switch() -> bool:
    """KILN_QUANT_PREW (read once): "on" (the default, `preload`) or "off", for A/B timing of whole steps.
    Measured on the H200 (bench/quant.py's engine, two processes each way, 3918cda): batch 1 int4-g128
    979.6 / 980.5 tok/s with it against 967.3 / 965.2 without (1.014x), int8 943.7 / 943.2 against
    940.7 / 940.9 (1.003x); the same bits either way."""
    return env_form("KILN_QUANT_PREW", ("on", "off")) == "on"


def preload(M: int, N: int, K: int, config: DecodeConfig) -> bool:
    """Whether a decode launch without an explicit config loads its first K step's words before its
    programmatic-launch wait (DecodeConfig.pre_k = block_k): the fma form at one row, K unsplit, for weights
    of at most matmul_decode.PRELOAD_MAX_WEIGHT values (the q/k/v and o projections at the Qwen2.5-1.5B
    shape), as the bf16 gemv loads its whole slice (matmul_decode.preload_weight), so that the norm or
    decode attention before it may let it be scheduled early (QuantLinear.reads_early). KILN_QUANT_PREW=off
    turns it off; never in the interpreter (the CPU tests pass pre_k explicitly)."""
    return (
        M == 1
        and config.kernel == "fma"
        and config.split_k == 1
        and N * K <= PRELOAD_MAX_WEIGHT
        and not interpreting()
        and preload_switch()
    )


def wq_swiglu_fusable(x: torch.Tensor, N: int, K: int, bits: int, group: int, asymmetric: bool) -> bool:
    """Whether `wq_matmul_fwd(x, ..., epilogue="swiglu")` takes this one-row call of an (N, K) [gate | up]
    weight: its default decode config is the fma form with K unsplit and an even BLOCK_N (N even), on the
    Triton path (fixed per shape: a captured CUDA graph's choice never changes)."""
    if x.dim() != 2 or x.shape[0] != 1 or not use_triton(x):
        return False
    return _glu_ok(wq_decode_config(1, N, K, bits, group, sm_count(x.device), asymmetric), N)


def _glu_ok(config: DecodeConfig, N: int) -> bool:
    """Whether a decode launch of config takes the SwiGLU epilogue: the fma form, K unsplit, gate and up rows
    in pairs (an even N and BLOCK_N)."""
    return config.kernel == "fma" and config.split_k == 1 and N % 2 == 0 and config.block_n % 2 == 0


@functools.lru_cache(maxsize=256)
def wq_tile_config(M: int, N: int, bits: int, group: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) of the prefill kernel: a fixed rule (no autotuner, so a
    call inside a CUDA graph capture never benchmarks), tensor-core tiles of Hopper's usual sizes; BLOCK_K
    at most the int4 group."""
    if interpreting():
        return 32, 32, 32, 1, 4
    bk = 64 if bits == 8 else min(64, group)
    if M <= 64:
        return 64, 64, bk, 4, 4
    return 128, 128, bk, 4, 8


# ------------------------------------------------------------------------------------------ launcher
def check_quantized(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group_size: int
) -> tuple[int, int]:
    """(N, K) of a quantized weight, after checking its tensors against the format (ValueError/TypeError)."""
    if bits not in BITS:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if qweight.dim() != 2 or scales.dim() != 2:
        raise ValueError(
            f"qweight and scales must be 2-D, got {tuple(qweight.shape)} and {tuple(scales.shape)}"
        )
    N = qweight.shape[0]
    if bits == 8:
        K = qweight.shape[1]
        if qweight.dtype != torch.int8 or scales.shape != (N, 1) or zeros is not None:
            raise ValueError(
                f"int8 weights: qweight int8 (N, K), scales (N, 1), no zero points; got {qweight.dtype} "
                f"{tuple(qweight.shape)}, scales {tuple(scales.shape)}, zeros {'given' if zeros is not None else None}"
            )
    else:
        K = 2 * qweight.shape[1]
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")
        if qweight.dtype != torch.uint8 or K % group_size or scales.shape != (N, K // group_size):
            raise ValueError(
                f"int4 weights: qweight uint8 (N, K / 2) with K a multiple of the group size {group_size}, scales "
                f"(N, K / {group_size}); got {qweight.dtype} {tuple(qweight.shape)}, scales {tuple(scales.shape)}"
            )
        if zeros is not None and (zeros.dtype != torch.uint8 or zeros.shape != scales.shape):
            raise ValueError(
                f"zeros must be uint8 {tuple(scales.shape)}, got {zeros.dtype} {tuple(zeros.shape)}"
            )
    if (
        qweight.stride(1) != 1
        or scales.stride(1) != 1
        or (zeros is not None and zeros.stride() != scales.stride())
    ):
        raise ValueError(
            "qweight, scales and zeros must have unit stride along K (zeros laid out like scales)"
        )
    if not scales.is_floating_point():
        raise TypeError(f"scales must be floating point, got {scales.dtype}")
    return N, K


class _Plan(NamedTuple):
    """How wq_matmul_fwd runs one layout of arguments: which kernel, its grid and constexprs."""

    N: int
    decode: bool
    form: str  # decode: "gemv"/"dot" (_wq_decode_kernel), "fma" or "mma" (kernels/quant_decode.py)
    grid: tuple[int, ...]
    split: int  # decode K slices (> 1: a float32 partial-sum buffer and the second kernel)
    k_split: int
    meta: dict


# Plans by argument layout: the checks and the config rule run once per layout, and a call with a layout
# seen before only allocates and launches (a decode step calls this ~200 times: its host time is the step's
# when not replayed from a CUDA graph). Cleared if it ever grows past _MAX_PLANS (ever-changing shapes).
_PLANS: dict[tuple, _Plan] = {}
_MAX_PLANS = 4096


def _plan(x, qweight, scales, zeros, bits, group_size, bias, config, glu=False) -> _Plan:
    """The checks (clear errors for a bad format or bad x) and choices for one layout of arguments."""
    N, K = check_quantized(qweight, scales, zeros, bits, group_size)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be (M, {K}) for this weight, got {tuple(x.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if bias is not None and (bias.shape != (N,) or bias.device != x.device):
        raise ValueError(
            f"bias must have shape ({N},) on {x.device}, got {tuple(bias.shape)} on {bias.device}"
        )
    if qweight.device != x.device or scales.device != x.device:
        raise ValueError(f"x is on {x.device} but the quantized weight on {qweight.device}")
    M = x.shape[0]
    # float32 activations stay float32 in tl.dot (16-bit ones multiply exactly anyway)
    common = dict(
        BITS=bits, GROUP=group_size if bits == 4 else 1, HAS_ZERO=zeros is not None, PRECISION="ieee"
    )
    decode = isinstance(config, DecodeConfig) or (config is None and M <= DECODE_MAX_M)
    if decode:
        if config is None:
            config = wq_decode_config(M, N, K, bits, group_size, sm_count(x.device), zeros is not None)
            if preload(M, N, K, config):
                config = config._replace(pre_k=config.block_k)
        form = config.kernel
        if form not in DECODE_FORMS:
            raise ValueError(f"decode kernel must be one of {DECODE_FORMS}, got {form!r}")
        rows = {"gemv": 1, "fma": 1}.get(form, DECODE_MAX_M)
        if M > rows:
            raise ValueError(f"decode config {config} cannot take {M} rows ({form}: at most {rows})")
        if bits == 4 and form in ("dot", "mma") and (group_size % config.block_k or config.block_k < 32):
            raise ValueError(
                f"int4 {form} decode needs BLOCK_K >= 32 dividing the group {group_size}: {config}"
            )
        if form in ("fma", "mma"):
            per_word = 32 // bits
            if word_view(qweight) is None:
                raise ValueError(
                    f"the {form} decode form reads qweight as int32 words: its rows must be whole, 4-byte "
                    f"aligned words (K a multiple of {4 * per_word}); use the gemv/dot forms for this weight"
                )
            least = 2 * per_word if form == "fma" else 32  # whole words; tl.dot's K side
            if config.block_k < least or config.block_k & (config.block_k - 1):
                raise ValueError(f"{form} decode needs BLOCK_K a power of two >= {least}: {config}")
        split, k_split = 1, K
        if config.split_k > 1:  # whole BLOCK_K steps per slice; a slice that would find no K is dropped
            k_split = cdiv(cdiv(K, config.split_k), config.block_k) * config.block_k
            split = cdiv(K, k_split)
        if config.pre_k and (form != "fma" or config.pre_k != config.block_k or split > 1):
            raise ValueError(
                f"pre_k (the first K step before the programmatic-launch wait) is for the fma form, unsplit, "
                f"and must equal block_k: {config}"
            )
        has_bias = bias is not None and split == 1
        tiles = dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, STAGES=config.stages,
                     num_warps=config.warps)  # fmt: skip
        if form in ("fma", "mma"):
            # programmatic dependent launch, as kiln's bf16 decode kernels (its switch, KILN_PDL=0 for A/B
            # timing): scheduled while the kernel before runs, waiting for it in the prologue, and letting
            # the next kernel (the split-K sum, the norm after o_proj, ...) be scheduled in turn
            pdl = use_pdl(x)
            tiles.update(PDL=pdl, launch_pdl=pdl)
        if glu and not _glu_ok(config, N):
            raise ValueError(
                f"the SwiGLU epilogue runs on the fma form with K unsplit, an even N and BLOCK_N: {config}, N = {N} "
                "(wq_swiglu_fusable says where)"
            )
        if form == "fma":
            # bf16 x read as int32 pairs where it is contiguous and 4-byte aligned (the key holds both)
            pairs = x.dtype == torch.bfloat16 and x.stride(1) == 1 and K % 2 == 0 and x.data_ptr() % 4 == 0
            meta = dict(BITS=bits, GROUP=common["GROUP"], HAS_ZERO=zeros is not None, HAS_BIAS=has_bias,
                        ASM=not interpreting(), X_PAIRS=pairs, PRE=config.pre_k > 0, GLU=glu, **tiles)  # fmt: skip
        elif form == "mma":
            magic, sh = MAGIC[x.dtype]
            meta = dict(BITS=bits, GROUP=common["GROUP"], HAS_ZERO=zeros is not None, HAS_BIAS=has_bias,
                        MAGIC=magic, SH=sh, PRECISION="ieee", ASM=not interpreting(), **tiles)  # fmt: skip
        else:
            meta = dict(common, HAS_BIAS=has_bias, DOT=form == "dot", **tiles)
        # with GLU a block holds BLOCK_N / 2 features of N / 2: as many blocks (both even)
        return _Plan(N, True, form, (cdiv(N, config.block_n), split), split, k_split, meta)
    bm, bn, bk, stages, warps = config if config is not None else wq_tile_config(M, N, bits, group_size)
    if bits == 4 and (group_size % bk or bk < 32):
        raise ValueError(f"int4 tiles need BLOCK_K >= 32 dividing the group {group_size}, got {bk}")
    meta = dict(common, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, STAGES=stages,
                num_warps=warps)  # fmt: skip
    return _Plan(N, False, "tile", (cdiv(M, bm) * cdiv(N, bn),), 1, K, meta)


def wq_matmul_fwd(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    config: DecodeConfig | tuple[int, int, int, int, int] | None = None,
    epilogue: str = "none",
) -> torch.Tensor:
    """Launcher: x (M, K) -> (M, N) in x's dtype. Decode kernels for M <= 16, the tile kernel above.
    config: a DecodeConfig (forces the decode kernels) or a tile tuple (forces the tile kernel).
    epilogue="swiglu": W is a merged [gate | up] projection (N = 2F) and the call returns swiglu of its output,
    (M, F), the bits of this call followed by kiln's SwiGLU kernel, in one launch: the fma form at one row, K
    unsplit (`wq_swiglu_fusable`; anything else is refused)."""
    if epilogue not in ("none", "swiglu"):
        raise ValueError(f"epilogue must be 'none' or 'swiglu', got {epilogue!r}")
    glu = epilogue == "swiglu"
    key = (
        x.shape, x.stride(), x.dtype, x.device, qweight.shape, qweight.stride(), qweight.dtype, qweight.device,
        scales.shape, scales.stride(), scales.dtype, scales.device,
        None if zeros is None else (zeros.shape, zeros.stride(), zeros.dtype),
        None if bias is None else (bias.shape, bias.dtype, bias.device), bits, group_size, config,
        x.data_ptr() % 4, glu,
    )  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(x, qweight, scales, zeros, bits, group_size, bias, config, glu)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    M, K = x.shape
    N = plan.N
    y = torch.empty((M, N // 2 if glu else N), device=x.device, dtype=x.dtype)
    if M == 0:
        return y
    z = scales if zeros is None else zeros
    b = y if bias is None else bias
    if not plan.decode:
        _tile_launch[plan.grid](x, qweight, scales, z, y, b, M, N, K, x.stride(0), x.stride(1), qweight.stride(0),
                                scales.stride(0), **plan.meta)  # fmt: skip
        return y
    split = plan.split
    dst = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else y
    if plan.form in ("fma", "mma"):
        words = qweight.view(torch.int32)  # (N, K / 8) or (N, K / 4): checked by _plan (word_view)
        launch = _fma_launch if plan.form == "fma" else _mma_launch
        launch[plan.grid](x, words, scales, z, dst, b, M, N, K, x.stride(0), x.stride(1), words.stride(0),
                          scales.stride(0), plan.k_split, **plan.meta)  # fmt: skip
    else:
        _decode_launch[plan.grid](x, qweight, scales, z, dst, b, M, N, K, x.stride(0), x.stride(1),
                                  qweight.stride(0), scales.stride(0), plan.k_split, **plan.meta)  # fmt: skip
    if split > 1:
        pdl = plan.meta.get("PDL", False)  # the main kernel let it be scheduled early: it waits here
        _sum_launch[(cdiv(M * N, 1024),)](dst, y, b, M * N, N, HAS_BIAS=bias is not None, ACTIVATION="none",
                                          SPLIT_K=split, BLOCK=1024, PDL=pdl, launch_pdl=pdl)  # fmt: skip
    return y


# ------------------------------------------------------------------------------ torch.compile: custom op
@torch.library.custom_op("kiln::wq_matmul", mutates_args=())
def wq_matmul_op(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x (M, K) @ dequant(W).T + bias -> (M, N); opaque to torch.compile, forward only."""
    return wq_matmul_fwd(x, qweight, scales, zeros, bits, group_size, bias)


@wq_matmul_op.register_fake
def _(x, qweight, scales, zeros, bits, group_size, bias):
    N, _ = check_quantized(qweight, scales, zeros, bits, group_size)
    return x.new_empty((x.shape[0], N))


def wq_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """nn.Linear with a quantized weight: x (..., K) -> (..., N). The reference on CPU tensors, Triton on
    CUDA (kiln.kernels.dispatch's switch)."""
    if not use_triton(x, qweight):
        return wq_matmul_ref(x, qweight, scales, zeros, bits, group_size, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        y = wq_matmul_op(x2, qweight, scales, zeros, bits, group_size, bias)
    else:
        y = wq_matmul_fwd(x2, qweight, scales, zeros, bits, group_size, bias)
    return y.view(*lead, y.shape[-1])
