"""Decode-sized mixture-of-experts FFN: the routed experts of a few tokens as two weight streams.

Shapes: x (T, d) tokens, expert_idx (T, k) int32/int64, weights (T, k) float (the router's), gate_up_proj
w1 (E, 2I, d) holding [gate | up] along dim 1, down_proj w2 (E, d, I), as the model stores them:

    h[t*k + j]   = silu(x[t] @ gate_e.T) * (x[t] @ up_e.T)            e = expert_idx[t, j]     (T*k, I)
    out[t]       = sum_j weights[t, j] * (h[t*k + j] @ w2[e].T)                                 (T, d)

Why a separate path: at decode a layer's active experts are a few MB to a few hundred MB of weights for a
few MFLOP, and the prefill path (routing plan, permute, grouped GEMM, SwiGLU, grouped GEMM, unpermute) is
about fifteen kernels, most of them a few microseconds of launch and tail latency each: on the H200 the
Qwen3-30B-A3B-like layer (8 experts x 9.4 MB) at batch 1 took 64.5 us in a CUDA graph for 75.5 MB, 28% of
the copy bandwidth. Here it is two kernels, no sort, no permutation:

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

No host sync, the grids depend on T, k, d and I only: CUDA-graph safe. Tiles: `decode_tiles`, the dense
gemv's rule measured on the H200 (4 columns, 256-wide steps, 3-stage pipeline; long K: 2 columns,
1024-wide steps); bench/moe.py sweeps others. Forward only (inference): the model takes this path when
no gradient is needed and there are no more pairs than experts (`use_decode`); with more pairs the same
weights would be streamed once per pair instead of once per expert, and the grouped GEMM wins.
float32 accumulation; float32 / float16 / bfloat16 (the CPU tests run float32 through the interpreter).
Differences to the prefill path: out is summed in float32 without rounding each pair's down projection to
x's dtype first (one rounding less). Expert ids must lie in [0, E): not checked (a check is a host sync).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kiln.kernels._common import FLOAT_DTYPES, needs_grad
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


def use_decode(n_tokens: int, top_k: int, n_experts: int) -> bool:
    """Whether the model's MoE block takes this path (with no gradient needed): when the T*k pairs are no
    more than the experts. Each pair streams its expert's weights, so pairs sharing an expert cost L2
    reads the grouped GEMM would not make; below E pairs most pairs have an expert of their own."""
    return 0 < n_tokens * top_k <= n_experts


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
):
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


_up_launch = CachedLaunch(_up_kernel)
_down_launch = CachedLaunch(_down_kernel)


def moe_decode_fwd(
    x: torch.Tensor,
    expert_idx: torch.Tensor,
    weights: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    config: tuple[DecodeTiles, DecodeTiles] | None = None,
) -> torch.Tensor:
    """Launcher: out (T, d) in x's dtype. config: (up tiles, down tiles), default `decode_tiles` of d and I."""
    _check(x, expert_idx, weights, w1, w2)
    T, k = expert_idx.shape
    E, two_i, d = w1.shape
    I = two_i // 2
    out = torch.empty(T, d, dtype=x.dtype, device=x.device)
    if T == 0 or d == 0:
        return out
    if I == 0 or k == 0:
        return out.zero_()
    up, down = config or (decode_tiles(d), decode_tiles(I))
    idx = expert_idx.reshape(-1)  # (T*k,): views of contiguous (T, k); a strided one is copied
    wts = weights.reshape(-1)
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    _up_launch[(T * k, cdiv(I, up.block_n))](
        x, idx, w1, h, I, d, x.stride(0), x.stride(1), w1.stride(0), w1.stride(1), w1.stride(2), TOPK=k,
        BLOCK_N=up.block_n, BLOCK_K=up.block_k, STAGES=up.stages, num_warps=up.warps,
    )  # fmt: skip
    _down_launch[(T, cdiv(d, down.block_n))](
        h, idx, wts, w2, out, I, d, w2.stride(0), w2.stride(1), w2.stride(2), TOPK=k, TOPK_P2=max(2, pow2(k)),
        BLOCK_N=down.block_n, BLOCK_K=down.block_k, STAGES=down.stages, num_warps=down.warps,
    )  # fmt: skip
    return out


# ------------------------------------------------------------------------------ torch.compile: custom op
@torch.library.custom_op("kiln::moe_decode", mutates_args=())
def moe_decode_op(
    x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """out (T, d): the routed experts of T decode tokens (module docstring); forward only."""
    return moe_decode_fwd(x, expert_idx, weights, w1, w2)


@moe_decode_op.register_fake
def _(x, expert_idx, weights, w1, w2):
    _check(x, expert_idx, weights, w1, w2)
    return x.new_empty(x.shape)


def moe_decode(
    x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The routed experts' weighted sum for a few tokens (forward only: gradients are not tracked; the
    model calls it without autograd). x (T, d), expert_idx / weights (T, k), w1 (E, 2I, d), w2 (E, d, I)."""
    if needs_grad(x, weights, w1, w2):
        raise RuntimeError(
            "moe_decode is forward only (inference): call it under torch.no_grad(), or take the grouped "
            "path (kiln.model.moe.Experts.grouped) when gradients are needed"
        )
    if not use_triton(x, w1, w2):
        return moe_decode_ref(x, expert_idx, weights, w1, w2)
    if torch.compiler.is_compiling():
        return moe_decode_op(x, expert_idx, weights, w1, w2)
    return moe_decode_fwd(x, expert_idx, weights, w1, w2)
