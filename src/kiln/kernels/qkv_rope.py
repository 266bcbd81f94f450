"""The decode step's q/k/v projection with RoPE and the paged K/V write in its epilogue, for one token.

Shapes: x (1, d) the normed hidden state; W (N, d) the merged qkv weight, N = (Hq + 2 Hk) D, rows
[0, Hq D) q, then k, then v; bias (N,) or None; cos, sin (R, D/2) and rows (1,) the token's table row;
k_cache, v_cache (num_blocks, PAGE, Hk, D); slots (1,) the token's cache slot (< 0: write nothing).
Returns q (1, Hq, D) rotated; k (rotated) and v land in the caches.

Why: at batch 1 the projection (kiln.kernels.matmul_decode's one-row gemv) and `rope_kv_write` are two
kernels in a chain of ten a layer, and the second is one program doing ~2 us of latency (Qwen2.5-1.5B
shape, H200). Here each program of the projection owns whole rotation pairs of one head, so it can rotate
them and store them where they go: the second kernel and the (1, N) round trip disappear.

The kernel: the one-row gemv (same tiles, loads and float32 accumulation order per output as
`decode_matmul` with the config it picks at these shapes, so the projection's values are the same bits),
over a permuted set of W's rows: program p takes PAIRS rotation pairs (i, i + D/2) of head h (half-rotated
layout; (2i, 2i + 1) interleaved), i.e. 2 PAIRS rows of W. Epilogue: + bias, rounded to x's dtype (the
projection's output rounding), then in float32 (a, b) -> (a cos - b sin, a sin + b cos) for q and k heads
(rope_kv_write's math), rounded, stored into q or the caches; v heads are stored as they are.
Reference: `qkv_rope_ref` = matmul_ref + split + rope_kv_write_ref, the ops the model runs without it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import pdl, pdl_prologue
from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import CachedLaunch
from kiln.kernels.matmul import matmul_ref
from kiln.kernels.rope import rope_kv_write_ref

PAIRS = 2  # rotation pairs per program: 4 rows of W, the one-row gemv's BLOCK_N at these shapes
BLOCK_K = 256  # the gemv's K step for K <= 4096 (matmul_decode.decode_config)
WARPS, STAGES = 2, 3
MAX_K = 4096  # beyond it the gemv takes other tiles: the fused kernel is not offered there


def qkv_rope_ref(
    x, weight, bias, cos, sin, rows, k_cache, v_cache, slots, n_heads, n_kv_heads, interleaved=False
):
    """The unfused ops: the projection (float32 math, rounded to x's dtype), split into q, k, v heads, then
    rope_kv_write's reference (rotate q and k, write k and v into their slots). Returns q (1, Hq, D)."""
    D = k_cache.shape[-1]
    qkv = matmul_ref(x, weight.t(), bias)  # (1, N)
    q, k, v = qkv.split([n_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)
    return rope_kv_write_ref(
        q.reshape(1, n_heads, D), k.reshape(1, n_kv_heads, D), v.reshape(1, n_kv_heads, D), cos, sin, rows,
        k_cache, v_cache, slots, interleaved,
    )  # fmt: skip


# fmt: off
@triton.jit
def _qkv_rope_kernel(
    X, W, BIAS,  # x (1, K) with element stride stride_xk; W (N, K) K-contiguous, row stride stride_wn; bias (N,)
    Q_OUT,  # (1, Hq, D) contiguous
    COS, SIN, ROWS,  # (R, D/2) tables, row stride stride_cos / stride_sin; rows (1,)
    K_CACHE, V_CACHE, SLOTS,  # (num_blocks, PAGE_SIZE, Hk, D) caches; slots (1,), < 0: padding
    K, stride_xk, stride_wn, stride_cos, stride_sin,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    Hq, Hk, D, half,  # half = D / 2, a multiple of PAIRS
    HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    per_head = half // PAIRS
    h = pid // per_head  # the head: q heads, then k heads, then v heads
    jp = (pid % per_head) * PAIRS + tl.arange(0, PAIRS)  # (PAIRS,) pair indices within the head
    if INTERLEAVED:
        col_a, col_b = 2 * jp, 2 * jp + 1
    else:
        col_a, col_b = jp, jp + half
    # rows of W in (pair, member) order: (2 PAIRS,), so the row sums reshape to (PAIRS, 2) and split
    cols = tl.reshape(tl.join(col_a, col_b), (2 * PAIRS,))
    n = h * D + cols
    w_rows = W + n.to(tl.int64)[:, None] * stride_wn  # (2 PAIRS, 1)
    acc = tl.zeros((2 * PAIRS, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
        x = tl.load(X + offs_k * stride_xk, mask=offs_k < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)  # (2 PAIRS,)
    if HAS_BIAS:
        y += tl.load(BIAS + n).to(tl.float32)
    y = y.to(Q_OUT.dtype.element_ty).to(tl.float32)  # the projection's output, as the unfused path stores it
    a, b = tl.split(tl.reshape(y, (PAIRS, 2)))  # (PAIRS,) each: the pairs' first and second members
    row = tl.load(ROWS).to(tl.int64)
    c = tl.load(COS + row * stride_cos + jp).to(tl.float32)
    s = tl.load(SIN + row * stride_sin + jp).to(tl.float32)
    rotate = h < Hq + Hk  # v heads are stored unrotated
    first = tl.where(rotate, a * c - b * s, a)
    second = tl.where(rotate, a * s + b * c, b)
    if h < Hq:
        out = Q_OUT + h * D
        tl.store(out + col_a, first.to(Q_OUT.dtype.element_ty))
        tl.store(out + col_b, second.to(Q_OUT.dtype.element_ty))
    else:
        slot = tl.load(SLOTS).to(tl.int64)
        if slot >= 0:  # a padding row writes nothing
            page = slot // PAGE_SIZE
            pos = slot % PAGE_SIZE
            if h < Hq + Hk:
                out = K_CACHE + page * stride_kcp + pos * stride_kct + (h - Hq) * stride_kch
            else:
                out = V_CACHE + page * stride_vcp + pos * stride_vct + (h - Hq - Hk) * stride_vch
            tl.store(out + col_a, first.to(K_CACHE.dtype.element_ty))
            tl.store(out + col_b, second.to(K_CACHE.dtype.element_ty))
# fmt: on


_qkv_rope_launch = CachedLaunch(_qkv_rope_kernel)


def qkv_rope_supported(x: torch.Tensor, weight: torch.Tensor, k_cache: torch.Tensor, n_heads: int) -> bool:
    """Whether `qkv_rope` takes these shapes: one token, K <= MAX_K (the gemv tiles it reproduces), a
    K-contiguous weight of (Hq + 2 Hk) D rows, D / 2 a multiple of PAIRS, one dtype for x, W and the caches."""
    D, Hk = k_cache.shape[-1], k_cache.shape[-2]
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.shape[1] <= MAX_K
        and weight.shape == ((n_heads + 2 * Hk) * D, x.shape[1])
        and weight.stride(1) == 1
        and D % (2 * PAIRS) == 0
        and k_cache.stride(-1) == 1
        and x.dtype == weight.dtype == k_cache.dtype
    )


def qkv_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    n_heads: int,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """q (1, Hq, D) = RoPE(x @ W[:Hq D].T + b); RoPE(k) and v written into the caches at `slots` (in place).
    Shapes as the module docstring; the caller checks `qkv_rope_supported` (the model falls back to the
    projection + `rope_kv_write` elsewhere). Triton on CUDA or in the interpreter; the reference elsewhere."""
    if not qkv_rope_supported(x, weight, k_cache, n_heads):
        raise ValueError(
            f"qkv_rope: unsupported shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} (stride "
            f"{weight.stride()}), cache {tuple(k_cache.shape)}, {n_heads} q heads: check qkv_rope_supported"
        )
    Hk, D = k_cache.shape[-2], k_cache.shape[-1]
    if not use_triton(x, weight, k_cache, v_cache):
        return qkv_rope_ref(
            x, weight, bias, cos, sin, rows, k_cache, v_cache, slots, n_heads, Hk, interleaved
        )
    if v_cache.shape != k_cache.shape or v_cache.stride(-1) != 1 or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"qkv_rope: v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}"
        )
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))  # rows of D/2 load as vectors
    q = torch.empty((1, n_heads, D), device=x.device, dtype=x.dtype)
    use_pdl = pdl(x)
    grid = ((n_heads + 2 * Hk) * (D // 2) // PAIRS,)
    _qkv_rope_launch[grid](
        x, weight, weight if bias is None else bias, q, cos, sin, rows, k_cache, v_cache, slots,
        x.shape[1], x.stride(1), weight.stride(0), cos.stride(0), sin.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], n_heads, Hk, D, D // 2,
        HAS_BIAS=bias is not None, INTERLEAVED=interleaved, PAGE_SIZE=k_cache.shape[1], PAIRS=PAIRS,
        BLOCK_K=BLOCK_K, STAGES=STAGES, PDL=use_pdl, num_warps=WARPS, launch_pdl=use_pdl,
    )  # fmt: skip
    return q
