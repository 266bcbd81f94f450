"""Decode-sized matmul (M <= 16 rows): C = act(A @ B + bias), read as one stream of B.

Shapes: A (M, K) with M <= DECODE_MAX_M, B (K, N), bias (N,) or None -> C (M, N) in A's dtype. B is
usually an nn.Linear weight W (N, K) seen as W.T (K-contiguous), but any strides work.

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
  the work of one row.
With SPLIT_K > 1 each of SPLIT_K programs per column block sums one slice of K into a float32
(SPLIT_K, M, N) buffer (no atomics, no zeroed workspace), and a second kernel adds the slices in a fixed
order (deterministic), adds the bias and applies the activation.

Prologue "swiglu" (the gated MLP's down projection): A is the gate_up projection's output (M, 2K)
holding [gate | up], and each program forms its x tile as silu(gate) * up while it loads it, rounded to
A's dtype as the separate kiln.kernels.swiglu kernel would round it (so the fused and unfused products
agree). Every column block recomputes its K range of x: at one row that is N / BLOCK_N recomputations of
a few KB held in L2, for one launch and one (M, K) round trip less (kiln.kernels.swiglu.swiglu_linear).

Which kernel and tiles: `decode_config`, a fixed rule from a sweep on the H200 (bench/sweep_matmul_decode.py,
docs/kernels/matmul_decode.md); no autotuner, so a call costs one config lookup and one or two launches.
Dtypes: float16, bfloat16 (float32 accumulation) and float32. Forward only: `kiln.kernels.matmul`
routes here from its launcher and keeps the autograd Function.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kiln.kernels._common import apply_activation, griddep
from kiln.kernels._common import pdl as use_pdl
from kiln.kernels.dispatch import interpreting, sm_count
from kiln.kernels.launch import CachedLaunch, cdiv

DECODE_MAX_M = 16  # the dot kernel's x.T tile is 16 wide: one column block covers every row


class DecodeConfig(NamedTuple):
    """A launch config: kernel ("gemv" or "dot"), tiles, K split, warps, pipeline stages, and `pdl`: launch
    the main kernel with programmatic dependent launch (Hopper+), so that it may start while the kernel
    before it in the stream finishes, waiting for it (griddepcontrol.wait) before its first load. That
    pays only after kernels that signal early (griddepcontrol.launch_dependents), as these do: off by
    default, since the ops around a decode GEMM do not yet."""

    kernel: str
    block_n: int
    block_k: int
    split_k: int = 1
    warps: int = 4
    stages: int = 1
    pdl: bool = False

    def __str__(self) -> str:
        pdl = " pdl" if self.pdl else ""
        return f"{self.kernel} BN={self.block_n} BK={self.block_k} SK={self.split_k} w={self.warps} s={self.stages}{pdl}"


@functools.lru_cache(maxsize=256)
def decode_config(M: int, N: int, K: int, sms: int, k_major: bool = True) -> DecodeConfig:
    """The config a call without an explicit one uses: a pure function of the shape, the SM count and
    whether W is K-contiguous (the nn.Linear layout; the gemv's 16-byte loads run along K).

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
    if M == 1 and k_major:
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
    return DecodeConfig("dot", 64, 64, max(2, round(2 * sms / tiles)), 4, 4, True)


@triton.jit
def _load_x(ptrs, mask, up_offset, SWIGLU: tl.constexpr):
    """A tile of x at `ptrs`; with SWIGLU, x = silu(gate) * up where gate is at ptrs and up at ptrs +
    up_offset, computed in float32 and rounded to the input dtype (the separate swiglu kernel's output)."""
    # one return after a constexpr if/else: the compiler visits every return that follows a static branch
    if SWIGLU:
        g = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(ptrs + up_offset, mask=mask, other=0.0).to(tl.float32)
        x = (g * tl.sigmoid(g) * u).to(ptrs.dtype.element_ty)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def _gemv_kernel(
    X_ptr,  # (M, K): x[m, k] at X_ptr + m * stride_xm + k * stride_xk
    W_ptr,  # (N, K): w[n, k] at W_ptr + n * stride_wn + k * stride_wk (B = W.T)
    Y_ptr,  # (M, N) contiguous output; with SPLIT_K > 1 a float32 (SPLIT_K, M, N) partial-sum buffer
    Bias_ptr,  # (N,), read when HAS_BIAS (and SPLIT_K == 1)
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    k_split,  # K range of one split: a multiple of BLOCK_K (K when SPLIT_K == 1)
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SWIGLU: tl.constexpr,  # x = silu(X[:, :K]) * X[:, K:2K] (the prologue, module doc)
    BLOCK_M: tl.constexpr,  # next power of two >= M (rows of x held per program)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    STAGES: tl.constexpr,  # > 1: the K loop's loads go through shared memory STAGES - 1 steps ahead (cp.async)
    PDL: tl.constexpr,  # launched with programmatic dependent launch: wait for the previous kernel here
    GRIDDEP: tl.constexpr,  # sm_90+: let the next kernel (the split-K sum) launch while this one runs
):
    if PDL:
        gdc_wait()  # everything the previous kernel wrote (x, even W) is visible after this
    if GRIDDEP:
        gdc_launch_dependents()  # a dependent waits for this grid's completion itself (gdc_wait)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    w_rows = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    x_rows = X_ptr + offs_m[:, None] * stride_xm  # (BLOCK_M, 1)
    n_ok = (offs_n < N)[:, None]
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    # Splits start at multiples of BLOCK_K, so masking against K (not k_hi) is exact, and K's divisibility
    # (specialized by Triton when K % 16 == 0) keeps the loads 16 bytes wide. Products accumulate
    # elementwise across the loop and are summed over K once at the end: the loop is loads and FMAs.
    if BLOCK_M == 1:  # one row: 2-D tiles in the layout W is loaded in (no shuffle through shared memory)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_ok & (offs_k < K)[None, :], other=0.0)
            x = _load_x(X_ptr + offs_k * stride_xk, offs_k < K, K * stride_xk, SWIGLU)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)[None, :]  # (1, BLOCK_N)
    else:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_ok & (offs_k < K)[None, :], other=0.0)
            x = _load_x(x_rows + offs_k[None, :] * stride_xk, (offs_m < M)[:, None] & (offs_k < K)[None, :],
                        K * stride_xk, SWIGLU)  # fmt: skip
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # (BLOCK_M, BLOCK_N, BLOCK_K)
        y = tl.sum(acc3, axis=2)  # (BLOCK_M, BLOCK_N)
    _store(y, offs_m[:, None], offs_n[None, :], pid_k, Y_ptr, Bias_ptr, M, N, HAS_BIAS, ACTIVATION, SPLIT_K)


@triton.jit
def _dot_kernel(
    X_ptr,  # (M, K): x[m, k] at X_ptr + m * stride_xm + k * stride_xk, M <= 16
    W_ptr,  # (N, K): w[n, k] at W_ptr + n * stride_wn + k * stride_wk (B = W.T)
    Y_ptr,  # (M, N) contiguous output; with SPLIT_K > 1 a float32 (SPLIT_K, M, N) partial-sum buffer
    Bias_ptr,  # (N,), read when HAS_BIAS (and SPLIT_K == 1)
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    k_split,  # K range of one split: a multiple of BLOCK_K (K when SPLIT_K == 1)
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
    SWIGLU: tl.constexpr,  # x = silu(X[:, :K]) * X[:, K:2K] (the prologue, module doc)
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
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    w_rows = W_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # (BLOCK_N, 1)
    x_cols = X_ptr + offs_m[None, :] * stride_xm  # (1, BLOCK_M): x.T's columns
    n_ok = (offs_n < N)[:, None]
    m_ok = (offs_m < M)[None, :]
    k_lo = pid_k * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :] * stride_wk, mask=n_ok & (offs_k < K)[None, :], other=0.0)
        xt = _load_x(
            x_cols + offs_k[:, None] * stride_xk, m_ok & (offs_k < K)[:, None], K * stride_xk, SWIGLU
        )
        acc = tl.dot(w, xt, acc, input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
    # Written as it lies, (n, m) -> C[m, n]: no transpose through shared memory.
    _store(acc, offs_m[None, :], offs_n[:, None], pid_k, Y_ptr, Bias_ptr, M, N, HAS_BIAS, ACTIVATION, SPLIT_K)


@triton.jit
def _store(acc, m, n, pid_k, Y_ptr, Bias_ptr, M, N, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
           SPLIT_K: tl.constexpr):  # fmt: skip
    """float32 acc -> C[m, n] with bias and activation, or into split pid_k's partial slice. m and n are
    row and column indices broadcastable to acc's shape ((BLOCK_M, 1) and (1, BLOCK_N), or transposed)."""
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


# Launched through their compiled handles after the first call (host time: kernels/launch.py).
_gemv_launch = CachedLaunch(_gemv_kernel)
_dot_launch = CachedLaunch(_dot_kernel)
_sum_launch = CachedLaunch(_split_sum_kernel)


def decode_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    prologue: str = "none",
) -> torch.Tensor:
    """Launcher: act(a @ b + bias) into `out` (a contiguous (M, N) tensor) or a new tensor.

    Inputs are taken as checked by `kiln.kernels.matmul` (2-D, one dtype and device, M <= DECODE_MAX_M,
    M, N, K > 0); only what this path adds is checked here. config: skip the rule (tests, the sweep).
    prologue "swiglu": `a` is (M, 2K) [gate | up] and the product is act(swiglu(a) @ b + bias) (module doc).
    """
    M, K = a.shape
    N = b.shape[1]
    if M > DECODE_MAX_M:
        raise ValueError(f"decode_matmul takes at most {DECODE_MAX_M} rows, got {M}")
    if prologue not in ("none", "swiglu"):
        raise ValueError(f"decode_matmul: unknown prologue {prologue!r}: 'none' or 'swiglu'")
    swiglu = prologue == "swiglu"
    if swiglu:
        if K != 2 * b.shape[0]:
            raise ValueError(
                f"decode_matmul: the swiglu prologue takes a (M, 2K) = (M, {2 * b.shape[0]}), got {K}"
            )
        K = b.shape[0]
    if config is None:
        config = decode_config(M, N, K, sm_count(a.device), b.stride(0) == 1)
    c = torch.empty((M, N), device=a.device, dtype=a.dtype) if out is None else out
    split, k_split, dst = 1, K, c
    if config.split_k > 1:
        # Whole BLOCK_K steps per split, so every split but the last covers k_split exactly; a split that
        # would find no K left is dropped.
        k_split = cdiv(cdiv(K, config.split_k), config.block_k) * config.block_k
        split = cdiv(K, k_split)
        dst = torch.empty((split, M, N), device=a.device, dtype=torch.float32) if split > 1 else c
    grid = (cdiv(N, config.block_n), split)
    (sxm, sxk), (sbk, sbn) = a.stride(), b.stride()  # B (K, N) = W.T: W's row stride is sbn
    args = (a, b, dst, c if bias is None else bias, M, N, K, sxm, sxk, sbn, sbk, k_split)  # K: of b
    has_bias = bias is not None and split == 1
    act = activation if split == 1 else "none"
    # Hopper: the main kernel lets its dependents launch early, and the split-K sum is launched as one
    # (programmatic dependent launch), so its launch overlaps the main kernel instead of following it.
    can_signal = a.is_cuda and griddep(a.device.index)
    pdl = config.pdl and can_signal and use_pdl(a)  # use_pdl: KILN_PDL=0 turns it off for A/B timing
    # Constexprs by keyword: CachedLaunch keys keywords by value but positional ints by Triton's value
    # classes (== 1, divisible by 16), which would let SPLIT_K = 2 and 4 share one binary.
    if config.kernel == "gemv":
        _gemv_launch[grid](*args, HAS_BIAS=has_bias, ACTIVATION=act, SWIGLU=swiglu, BLOCK_M=1 << (M - 1).bit_length(),
                           BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, STAGES=config.stages,
                           PDL=pdl, GRIDDEP=can_signal, num_warps=config.warps, launch_pdl=pdl)  # fmt: skip
    elif config.kernel == "dot":
        precision = "tf32" if a.dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"
        _dot_launch[grid](*args, HAS_BIAS=has_bias, ACTIVATION=act, SWIGLU=swiglu, PRECISION=precision, BLOCK_M=16,
                          BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, PDL=pdl, GRIDDEP=can_signal,
                          num_warps=config.warps, num_stages=config.stages, launch_pdl=pdl)  # fmt: skip
    else:
        raise ValueError(f"unknown decode kernel {config.kernel!r}: 'gemv' or 'dot'")
    if split > 1:
        block = 1024
        _sum_launch[(cdiv(M * N, block),)](dst, c, c if bias is None else bias, M * N, N, HAS_BIAS=bias is not None,
                                            ACTIVATION=activation, SPLIT_K=split, BLOCK=block, PDL=can_signal,
                                            launch_pdl=can_signal)  # fmt: skip
    return c
