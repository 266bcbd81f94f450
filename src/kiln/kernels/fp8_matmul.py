"""FP8 (e4m3) matmul with per-tensor or per-row scales, and the quantize kernel that makes its inputs.

Quantize: x (M, K) float -> q = fp8(x / s) with s = amax / 448 (448: e4m3's largest finite value), either
one s for the tensor (per-tensor) or one per row (per-row, "per token" for activations, "per output
channel" for a weight W (N, K)). The value stood for is q * s.
Matmul: C (M, N) = (q_a (M, K) @ q_b (N, K).T) * s_a[m] * s_b[n] (+ bias), products of e4m3 values summed
in float32 by Hopper's FP8 tensor cores, both scales applied once to the float32 tile. B is an nn.Linear
weight (N, K), K-contiguous: both tl.dot operands K-major, the layout FP8 wgmma takes (as
torch._scaled_mm takes B column-major). The output is bfloat16 (or float16 / float32).

Decode (M <= 16, `config=DecodeConfig("dot", BLOCK_N, BLOCK_K, split_k, warps, stages)`, or by
FP8_DECODE_TABLE's entry for the shape): the weight is the tensor-core M side, acc (BLOCK_N, 16) = B tile @
A tile.T, over cdiv(N, BLOCK_N) x split_k programs, the K slices summed in a fixed order by
matmul_decode's second kernel. The tile kernel's 64 x 128 tiles give N = 1536 only 12 programs on 132
SMs at decode, each walking all of K.

`fp8_linear(x, w_q, w_scale, bias)` quantizes the activations per row on the fly and runs the matmul:
FP8 weight + activation inference (the tile config is a fixed rule, no autotuner: safe in CUDA graphs).
At decode sizes with a swept decode config the decode kernel quantizes x itself (QUANT_A: one scale per
row and K slice, the per-row scale where K is not split), so a decode step's projection is one launch
(two with a K split), not a quantize launch more.
Accumulation: Hopper's FP8 tensor cores keep their running sum at reduced precision (about 14 bits, as the
DeepSeek-V3 report measured on H800), and on sm_90 Triton lets a dot's whole K range accumulate there. At
K = 8960 the tensor-descriptor tiles left 3-6 outputs in 3M beyond bf16's tolerance of torch._scaled_mm
(cuBLAS promotes partial sums to float32), and the 128 x 128 block-pointer tiles 1 in 6.3M in one of four
H200 runs of test_matmul_matches_scaled_mm (its inputs are unseeded). Promoting every K step (tl.dot's
max_num_imprecise_acc=BLOCK_K) measured 1.2-2.4x slower on the H200 (8b5c90a,
bench/results/archive/quant_fp8_prefill-8b5c90a.json), so the kernels keep the tensor cores'
accumulation, as Triton's FP8 tutorial and cuBLAS's fast-accumulation mode do.
FP8 needs sm_89+. Triton's CPU interpreter converts float32 to FP8 wrongly where rounding carries, so CPU
tests check the quantize math through the reference, run the matmul kernels in the interpreter on operands
quantized by torch (the decode kernel's own quantization on activations on the e4m3 grid, exact), and the
GPU tests compare with torch._scaled_mm and with quantize + matmul.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kiln.kernels._common import fp8_quantize, fp8_row_scale, grouped_tile, pdl_prologue, tma_scratch
from kiln.kernels._common import pdl as use_pdl
from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import CachedLaunch, cdiv, pow2
from kiln.kernels.matmul_decode import DECODE_MAX_M, DecodeConfig, _split_sum_kernel, _store, table_rows

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row gets this scale (its q is 0 either way), never a division by zero


class Fp8Rows(NamedTuple):
    """Activations already quantized per row, as quantize_fp8(x) returns them: q (M, K) float8_e4m3fn and
    scale (M, 1) float32, with dtype the activations' own dtype (the linear's output dtype). A producer that
    quantizes its own output rows (kiln.kernels.rmsnorm.rmsnorm_fp8, kiln.kernels.swiglu.swiglu_fp8) hands
    this to fp8_linear, which then runs the matmul alone: no quantize launch, no pass over x."""

    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


# ------------------------------------------------------------------------------------------ reference
def quantize_fp8_ref(x: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q (M, K) float8_e4m3fn, float32 scales (M, 1) per row or (1, 1) per tensor)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True) if per_row else xf.abs().amax().reshape(1, 1)
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_matmul_ref(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(a_q * a_scale) @ (b_q * b_scale).T (+ bias) in float32, in out_dtype. a_q (M, K), b_q (N, K);
    scales (M, 1) / (1, 1) and (N, 1) / (1, 1)."""
    c = (a_q.float() * a_scale.float()) @ (b_q.float() * b_scale.float()).T
    if bias is not None:
        c = c + bias.float()
    return c.to(out_dtype)


def decode_k_split(K: int, split_k: int, block_k: int) -> int:
    """The K range of one slice of the FP8 decode kernel at split_k: whole BLOCK_K steps (K when not split);
    cdiv(K, result) slices run, so a slice that would find no K is dropped."""
    return K if split_k <= 1 else cdiv(cdiv(K, split_k), block_k) * block_k


def fp8_decode_linear_ref(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: DecodeConfig,
    out_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """What fp8_decode_linear computes: x (M, K) quantized per (row, K slice) of `config`'s split, each
    slice's float64 product with the dequantized weight, summed (+ bias). With one slice this is
    quantize_fp8_ref per row + fp8_matmul_ref; with several, a finer quantization, which differs from the
    per-row one by the two roundings' noise (a few % of the output's max at K = 8960), not by bf16's."""
    K = x.shape[1]
    k_split = decode_k_split(K, config.split_k, config.block_k)
    w = w_q.double() * w_scale.double()
    y = torch.zeros(x.shape[0], w_q.shape[0], dtype=torch.float64, device=x.device)
    for k0 in range(0, K, k_split):
        q, s = quantize_fp8_ref(x[:, k0 : k0 + k_split], per_row=True)
        y += (q.double() * s.double()) @ w[:, k0 : k0 + k_split].T
    if bias is not None:
        y += bias.double()
    return y.to(out_dtype)


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def _quantize_kernel(
    X_ptr,  # (M, K) float input, row stride stride_xm, unit stride along K
    Q_ptr,  # (M, K) float8e4nv output, contiguous
    S_ptr,  # float32 scales: (M,) written here when PER_ROW, else (1,) read (the tensor's scale)
    K,
    stride_xm,
    PER_ROW: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = X_ptr + row * stride_xm
    if PER_ROW:  # first pass: the row's amax, hence its scale
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)))
        scale, inv = fp8_row_scale(tl.max(amax, axis=0))
        tl.store(S_ptr + row, scale)
    else:
        inv = 1.0 / tl.load(S_ptr)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        tl.store(Q_ptr + row * K + offs, fp8_quantize(x, inv), mask=offs < K)


@triton.jit
def _fp8_tile_kernel(
    A_ptr,  # (M, K) float8e4nv, row stride stride_am, K-contiguous
    B_ptr,  # (N, K) float8e4nv, row stride stride_bn, K-contiguous
    SA_ptr,  # scales of A (any float dtype, applied in float32): (M,) when ROW_A, else (1,)
    SB_ptr,  # scales of B: (N,) when ROW_B, else (1,)
    C_ptr,  # (M, N) contiguous output
    Bias_ptr,  # (N,), read when HAS_BIAS
    M,
    N,
    K,
    stride_am,
    stride_bn,
    ROW_A: tl.constexpr,
    ROW_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
    TMA: tl.constexpr,  # tiles through tensor descriptors (Hopper's TMA copies) instead of block pointers
):
    pid = tl.program_id(0)
    off_m, off_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TMA:  # out-of-range rows and columns of a tile read as zero, as the block pointers' padding does
        a_desc = tl.make_tensor_descriptor(A_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(B_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        for k in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
            a = a_desc.load([off_m, k * BLOCK_K])
            b = b_desc.load([off_n, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
    else:
        a_blk = tl.make_block_ptr(A_ptr, (M, K), (stride_am, 1), (off_m, 0), (BLOCK_M, BLOCK_K), (1, 0))
        b_blk = tl.make_block_ptr(B_ptr, (N, K), (stride_bn, 1), (off_n, 0), (BLOCK_N, BLOCK_K), (1, 0))
        for _ in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
            a = tl.load(a_blk, boundary_check=(0, 1), padding_option="zero")
            b = tl.load(b_blk, boundary_check=(0, 1), padding_option="zero")
            acc = tl.dot(a, b.T, acc)  # (BLOCK_M, BLOCK_N), both operands K-major
            a_blk = tl.advance(a_blk, (0, BLOCK_K))
            b_blk = tl.advance(b_blk, (0, BLOCK_K))
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    if ROW_A:
        acc *= tl.load(SA_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    else:
        acc *= tl.load(SA_ptr).to(tl.float32)
    if ROW_B:
        acc *= tl.load(SB_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    else:
        acc *= tl.load(SB_ptr).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(Bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c = C_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c, acc.to(C_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_decode_kernel(
    A_ptr,  # (M, K) activations, M <= 16, row stride stride_am, K-contiguous: float8e4nv, or float (QUANT_A)
    B_ptr,  # (N, K) float8e4nv weight, row stride stride_bn, K-contiguous
    SA_ptr,  # scales of A: (M,) when ROW_A, else (1,); not read with QUANT_A
    SB_ptr,  # scales of B: (N,) when ROW_B, else (1,)
    C_ptr,  # (M, N) contiguous output; with SPLIT_K > 1 a float32 (SPLIT_K, M, N) partial-sum buffer
    Bias_ptr,  # (N,), read when HAS_BIAS (and SPLIT_K == 1)
    M,
    N,
    K,
    stride_am,
    stride_bn,
    k_split,  # K range of one split: a multiple of BLOCK_K (K when SPLIT_K == 1)
    ROW_A: tl.constexpr,
    ROW_B: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,
    QUANT_A: tl.constexpr,
    PDL: tl.constexpr = False,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
):
    """Decode (M <= 16): the weight is the tensor-core M side, acc (BLOCK_N, 16) = B tile @ A tile.T
    (both K-major, as FP8 wgmma takes them), over a grid (cdiv(N, BLOCK_N), SPLIT_K) that K splits fill.
    QUANT_A: A is the float activations, quantized here as _quantize_kernel does per row, but over this
    program's K range: a first pass takes each row's amax there, and each tile is scaled, clamped and cast
    as it is loaded. One scale per (row, K slice), applied to the slice's partial sum; with one slice it is
    the per-row scale, and the result is the bits of quantize_fp8 + this kernel. This saves the quantize
    launch (and its pass over x) at every decode step's projection; x is a few KB, read twice from L2."""
    pdl_prologue(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 16)
    n_ok = offs_n < N
    m_ok = offs_m < M
    b_rows = B_ptr + offs_n.to(tl.int64)[:, None] * stride_bn  # (BLOCK_N, 1)
    a_rows = A_ptr + offs_m[:, None] * stride_am  # (16, 1)
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    if QUANT_A:  # this K range's amax per row, hence its scale (as _quantize_kernel's)
        amax = tl.zeros((16,), dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
        sa, inv = fp8_row_scale(amax)  # (16,)
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        b = tl.load(b_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANT_A:
            a = fp8_quantize(a.to(tl.float32), inv[:, None])
        acc = tl.dot(b, a.T, acc)  # (BLOCK_N, 16)
    if QUANT_A:
        acc *= sa[None, :]
    elif ROW_A:
        acc *= tl.load(SA_ptr + offs_m, mask=m_ok, other=0.0).to(tl.float32)[None, :]
    else:
        acc *= tl.load(SA_ptr).to(tl.float32)
    if ROW_B:
        acc *= tl.load(SB_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    else:
        acc *= tl.load(SB_ptr).to(tl.float32)
    # scales applied to each K slice's partial (the sum is linear); written as it lies, (n, m) -> C[m, n]
    _store(acc, offs_m[None, :], offs_n[:, None], pid_k, C_ptr, Bias_ptr, M, N, HAS_BIAS, "none", SPLIT_K)


_quantize_launch = CachedLaunch(_quantize_kernel)
_tile_launch = CachedLaunch(_fp8_tile_kernel)
_decode_launch = CachedLaunch(_fp8_decode_kernel)
_sum_launch = CachedLaunch(_split_sum_kernel)


# ------------------------------------------------------------------------------------------ launchers
def quantize_fp8(
    x: torch.Tensor, per_row: bool = True, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) float -> (q (M, K) float8_e4m3fn, float32 scales (M, 1) or (1, 1)), as quantize_fp8_ref.
    per_row=False takes the tensor's amax on the device (no host sync), or a given (1, 1) `scale`
    (a static activation scale)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_fp8 takes a 2-D tensor with unit stride along K, got {tuple(x.shape)}")
    if not use_triton(x):
        if scale is None:
            return quantize_fp8_ref(x, per_row)
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale
    M, K = x.shape
    q = torch.empty((M, K), device=x.device, dtype=FP8)
    if per_row:
        s = torch.empty((M, 1), device=x.device, dtype=torch.float32)
    elif scale is None:
        s = (x.abs().amax().float() / FP8_MAX).clamp_min(MIN_SCALE).reshape(1, 1)
    else:
        s = scale.float().reshape(1, 1)
    if M:
        _quantize_launch[(M,)](
            x, q, s, K, x.stride(0), PER_ROW=per_row, BLOCK=min(pow2(K), 1024), num_warps=4
        )
    return q, s


# Measured winners of `bench/quant.py --case decode-sweep` on the H200 at 1, 4 (2-4) and 16 (5-16) rows, by
# (rows, N, K): a tile tuple or a DecodeConfig for the decode kernel (with which fp8_linear quantizes x inside
# it). The sweep prints these entries where a candidate beat the rule (fp8_linear's own choice) by more than
# 2%; other shapes take fp8_tile_config.
# Swept at 3963b92; the entries the sweep at 9ddd50d printed (the decode kernel quantizing x itself)
# merged in (bench/results/archive/quant_sweep-9ddd50d.json; the 465e463 sweep agrees). The sweep at 4b6649a
# (quant_sweep.json), the first against fp8_linear itself, moved the head at 4 and 16 rows to the tile
# kernel (68.5 us against 77.4 / 82.3); its other entries differed from the table's only in pdl=False,
# which an isolated kernel's timing cannot weigh (the launch overlap it buys is in the step): not taken.
FP8_DECODE_TABLE: dict[tuple[int, int, int], tuple[int, int, int, int, int] | DecodeConfig] = {
    (1, 1536, 1536): DecodeConfig("dot", 64, 128, 4, 4, 3),
    (1, 1536, 8960): DecodeConfig("dot", 64, 256, 8, 4, 3),
    (1, 2048, 1536): DecodeConfig("dot", 64, 128, 4, 4, 3),
    (1, 17920, 1536): DecodeConfig("dot", 64, 256, 1, 4, 3),
    (1, 151936, 1536): DecodeConfig("dot", 64, 256, 1, 4, 3),
    (4, 1536, 1536): DecodeConfig("dot", 64, 128, 4, 4, 3),
    (4, 1536, 8960): DecodeConfig("dot", 64, 256, 8, 4, 3),
    (4, 2048, 1536): DecodeConfig("dot", 64, 128, 4, 4, 3),
    (4, 17920, 1536): DecodeConfig("dot", 64, 256, 1, 4, 3),
    (4, 151936, 1536): (64, 64, 128, 4, 4),
    (16, 1536, 1536): DecodeConfig("dot", 64, 128, 4, 4, 3),
    (16, 1536, 8960): DecodeConfig("dot", 64, 256, 8, 4, 3),
    (16, 2048, 1536): DecodeConfig("dot", 64, 128, 4, 4, 3),
    (16, 17920, 1536): DecodeConfig("dot", 64, 256, 1, 4, 3),
    (16, 151936, 1536): (64, 64, 128, 4, 4),
}


def fp8_table_entry(M: int, N: int, K: int) -> tuple[int, int, int, int, int] | DecodeConfig | None:
    """The swept FP8_DECODE_TABLE entry for M rows of an (N, K) weight, or None (past DECODE_MAX_M rows, or
    a shape the sweep did not cover)."""
    return FP8_DECODE_TABLE.get((table_rows(M), N, K)) if 0 < M <= DECODE_MAX_M else None


# Prefill tiles by (N, K), for M > 64 rows: (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps, tma), the winners of
# `bench/quant.py --case fp8-prefill` on the H200 at 2048 rows that beat the rule below by more than 2%.
# The first sweep (ea25b6b, bench/results/archive/quant_fp8_prefill-ea25b6b.json) found the rule's
# 128 x 256 x 128 best or tied on every Qwen2.5-1.5B projection, so it holds no entry.
FP8_PREFILL_TABLE: dict[tuple[int, int], tuple[int, int, int, int, int, bool]] = {}


def fp8_tile_config(M: int, N: int, K: int = 0) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps[, tma]): FP8_PREFILL_TABLE's entry past 64 rows, else a fixed
    rule. From 1024 rows 128 x 256 x 128 tiles in 8 warps through 3 stages of block-pointer loads (on the
    H200 at 2048 rows: 1.01-1.08x the 128 x 128 tiles of Triton's FP8 tutorial, 0.96-1.06x
    torch._scaled_mm per projection; tensor descriptors tied or lost). Between 65 and 1023 rows (a decode
    step of 65-128 sequences, a short prefill) the tutorial's 128 x 128 tiles stay: half as wide, twice the
    programs where a few row tiles leave SMs idle (not measured there). 64-row tiles for short M."""
    if M <= 64:
        return 64, 128, 128, 4, 4
    return FP8_PREFILL_TABLE.get((N, K), (128, 256, 128, 3, 8) if M >= 1024 else (128, 128, 128, 3, 8))


def fp8_matmul(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    b_q: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    config: tuple[int, ...] | DecodeConfig | None = None,
) -> torch.Tensor:
    """C (M, N) = (a_q @ b_q.T) * a_scale * b_scale (+ bias): a_q (M, K), b_q (N, K) float8_e4m3fn, scales
    float32 (M, 1) or (1, 1), and (N, 1) or (1, 1). config: a tile tuple (BLOCK_M, BLOCK_N, BLOCK_K,
    stages, warps[, tma]) (tma: tensor descriptors, on CUDA where the operands' alignment allows), or a
    DecodeConfig("dot", BLOCK_N, BLOCK_K, split_k, warps, stages) for the decode kernel (M <= 16: the
    weight as the tensor-core M side, K split across programs)."""
    if a_q.dtype != FP8 or b_q.dtype != FP8:
        raise TypeError(f"fp8_matmul takes float8_e4m3fn operands, got {a_q.dtype} and {b_q.dtype}")
    if a_q.dim() != 2 or b_q.dim() != 2 or a_q.shape[1] != b_q.shape[1]:
        raise ValueError(
            f"fp8_matmul expects A (M, K) and B (N, K), got {tuple(a_q.shape)}, {tuple(b_q.shape)}"
        )
    M, K = a_q.shape
    N = b_q.shape[0]
    if a_scale.numel() not in (1, M) or b_scale.numel() not in (1, N):
        raise ValueError(
            f"scales must have 1 or M={M} (A) and 1 or N={N} (B) elements, got {a_scale.numel()}, {b_scale.numel()}"
        )
    if not use_triton(a_q, b_q):
        return fp8_matmul_ref(a_q, a_scale.reshape(-1, 1), b_q, b_scale.reshape(-1, 1), bias, out_dtype)
    if a_q.stride(1) != 1 or b_q.stride(1) != 1:
        raise ValueError("fp8_matmul needs both operands K-contiguous (B as an nn.Linear weight (N, K))")
    c = torch.empty((M, N), device=a_q.device, dtype=out_dtype)
    if M == 0 or N == 0:
        return c
    if config is None:
        config = fp8_table_entry(M, N, K)
    if isinstance(config, DecodeConfig):
        return _fp8_decode(a_q, a_scale, b_q, b_scale, bias, c, config)
    bm, bn, bk, stages, warps, *tma = config or fp8_tile_config(M, N, K)
    tma = bool(tma and tma[0]) and a_q.is_cuda and _tma_ok(a_q) and _tma_ok(b_q)
    if tma:
        triton.set_allocator(tma_scratch)  # a context variable in triton, read at launch (per thread)
    _tile_launch[(cdiv(M, bm) * cdiv(N, bn),)](
        a_q, b_q, a_scale, b_scale, c, c if bias is None else bias, M, N, K, a_q.stride(0),
        b_q.stride(0), ROW_A=a_scale.numel() == M and M > 1, ROW_B=b_scale.numel() == N and N > 1,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, STAGES=stages, TMA=tma,
        num_warps=warps,
    )  # fmt: skip
    return c


def _tma_ok(t: torch.Tensor) -> bool:
    """A K-contiguous FP8 operand a tensor descriptor can read: 16-byte aligned base and row stride."""
    return t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0


def _fp8_decode(
    a_q, a_scale, b_q, b_scale, bias, c, config: DecodeConfig, quant_a: bool = False
) -> torch.Tensor:
    """fp8_matmul through _fp8_decode_kernel into c (M, N): checks and launches. quant_a: a_q is the float
    activations, quantized in the kernel per (row, K slice) (its docstring); a_scale is not read."""
    M, K = a_q.shape
    N = b_q.shape[0]
    if config.kernel != "dot" or M > DECODE_MAX_M or config.block_k < 32 or config.block_n < 16:
        raise ValueError(
            f"the FP8 decode kernel takes DecodeConfig('dot', BLOCK_N >= 16, BLOCK_K >= 32, ...) and at most "
            f"{DECODE_MAX_M} rows, got {config} for {M} rows"
        )
    k_split = decode_k_split(K, config.split_k, config.block_k)
    split = cdiv(K, k_split)
    dst = torch.empty((split, M, N), device=c.device, dtype=torch.float32) if split > 1 else c
    b = c if bias is None else bias
    pdl = use_pdl(a_q)  # programmatic dependent launch, as kiln's bf16 decode kernels (KILN_PDL=0: off)
    _decode_launch[(cdiv(N, config.block_n), split)](
        a_q, b_q, b_scale if quant_a else a_scale, b_scale, dst, b, M, N, K, a_q.stride(0), b_q.stride(0),
        k_split, ROW_A=not quant_a and a_scale.numel() == M and M > 1, ROW_B=b_scale.numel() == N and N > 1,
        HAS_BIAS=bias is not None and split == 1, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=split, STAGES=config.stages, QUANT_A=quant_a, PDL=pdl, num_warps=config.warps, launch_pdl=pdl,
    )  # fmt: skip
    if split > 1:
        _sum_launch[(cdiv(M * N, 1024),)](dst, c, b, M * N, N, HAS_BIAS=bias is not None, ACTIVATION="none",
                                          SPLIT_K=split, BLOCK=1024, PDL=pdl, launch_pdl=pdl)  # fmt: skip
    return c


def fp8_decode_linear(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, config: DecodeConfig
) -> torch.Tensor:
    """x (M, K) float, M <= 16 -> (M, N) in x's dtype: the decode kernel at `config`, quantizing x itself
    per (row, K slice) as it loads it (_fp8_decode_kernel's QUANT_A), so there is no quantize launch."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"fp8_decode_linear takes x (M, K) with unit stride along K, got {tuple(x.shape)}")
    c = torch.empty((x.shape[0], w_q.shape[0]), device=x.device, dtype=x.dtype)
    return _fp8_decode(x, None, w_q, w_scale, bias, c, config, quant_a=True)


def fp8_linear_decode_config(M: int, N: int, K: int) -> DecodeConfig | None:
    """The swept decode config with which fp8_linear quantizes x (M, K) inside the decode kernel for an
    (N, K) weight (on Triton, x K-contiguous), or None: then it quantizes per row and calls fp8_matmul."""
    config = fp8_table_entry(M, N, K)
    return config if isinstance(config, DecodeConfig) else None


def fp8_linear_takes_rows(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether a producer whose input is x (..., any) should quantize its output rows itself and hand
    fp8_linear Fp8Rows for the (N, K) weight w_q: fp8_linear would otherwise quantize them in a launch of its
    own, i.e. x's rows run on Triton, eagerly (a traced call takes the custom op, which takes float x), at
    a shape with no swept decode config (those quantize x inside the decode kernel, at no launch). x's rows
    are its leading dims; K is the weight's. Shapes and flags only: fixed for a captured CUDA graph."""
    M = x.numel() // max(x.shape[-1], 1)
    return (
        M > 0
        and not torch.compiler.is_compiling()
        and use_triton(x, w_q)
        and fp8_linear_decode_config(M, w_q.shape[0], w_q.shape[1]) is None
    )


def _fp8_linear_2d(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (M, K) -> (M, N) through FP8 activations: at decode sizes with a swept decode config,
    fp8_decode_linear (no quantize launch); else quantize_fp8 per row, then fp8_matmul."""
    M, K = x.shape
    config = fp8_linear_decode_config(M, w_q.shape[0], K)
    if config is not None and use_triton(x, w_q) and x.stride(1) == 1:
        return fp8_decode_linear(x, w_q, w_scale, bias, config)
    a_q, a_scale = quantize_fp8(x, per_row=True)
    return fp8_matmul(a_q, a_scale, w_q, w_scale, bias, x.dtype)


@torch.library.custom_op("kiln::fp8_linear", mutates_args=())
def fp8_linear_op(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (M, K) -> (M, N) through per-row FP8 activations; opaque to torch.compile, forward only."""
    return _fp8_linear_2d(x, w_q, w_scale, bias)


@fp8_linear_op.register_fake
def _(x, w_q, w_scale, bias):
    return x.new_empty((x.shape[0], w_q.shape[0]))


def fp8_linear(
    x: torch.Tensor | Fp8Rows, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """nn.Linear with an FP8 weight (w_q (N, K) float8_e4m3fn, w_scale (N, 1) or (1, 1)) and activations
    quantized per row on the fly: x (..., K) -> (..., N) in x's dtype. x may come quantized already
    (Fp8Rows (M, K), from a producer that quantized its rows): then the matmul alone runs, (M, N)."""
    if isinstance(x, Fp8Rows):
        return fp8_matmul(x.q, x.scale, w_q, w_scale, bias, x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if torch.compiler.is_compiling():
        y = fp8_linear_op(x2, w_q, w_scale, bias)
    else:
        y = _fp8_linear_2d(x2, w_q, w_scale, bias)
    return y.view(*lead, w_q.shape[0])
