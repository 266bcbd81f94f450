"""Grouped GEMM for mixture-of-experts: every expert's matmul in one launch, rows grouped by expert.

Shapes: x (R, K) holds the routed rows sorted by expert (kernels/moe_permute.py), expert e owning rows
[offsets[e], offsets[e+1]) with offsets (E+1,) int32, monotone, offsets[0] = 0, offsets[E] = R (the
permute's output; the launcher cannot check it without a host sync, the reference does). Weights are
stacked per expert as the model stores them, w (E, N, K) (gate_up_proj (E, 2I, d), down_proj (E, d, I)):

    grouped_linear(x, w, offsets)[r] = x[r] @ w[e].T          for offsets[e] <= r < offsets[e+1]

Backward (the nn.Linear one, per expert):
    dx[rows of e] = dy[rows of e] @ w[e]              the same forward kernel, B = w[e] read in place
    dw[e]         = dy[rows of e].T @ x[rows of e]    a second kernel, one (BLOCK_N, BLOCK_K) tile of one
                                                      expert's dw per program, looping over its rows;
                                                      an expert with no rows gets an exact zero.

The tile scheduler (no host sync, CUDA-graph safe): the grid is sized from static bounds only. Expert e
needs cdiv(n_e, BLOCK_M) row tiles, and sum_e cdiv(n_e, BLOCK_M) <= cdiv(R, BLOCK_M) + E, so the launch
has (cdiv(R, BLOCK_M) + E) x cdiv(N, BLOCK_N) programs whatever the routing. Each program loads the E + 1
offsets (one vector load from L2), takes the inclusive cumsum of the per-expert tile counts and finds its
(expert, row tile) by counting the experts whose tiles end at or before its own index; programs past the
last tile return at once. The grid is walked in groups of GROUP_M row tiles per column of tiles (Triton's
matmul tutorial) so that programs running together share an expert's weight panel in L2.

Dtypes: bfloat16 / float16 with float32 accumulation on the GPU; float32 (IEEE, or TF32 when
torch.backends.cuda.matmul.allow_tf32 is on) too, which is what the interpreter tests use (its bf16 dot
is wrong, PLATFORM.md). Operands are read through plain pointers with masks (any strides); for large
experts in 16-bit dtypes on sm_90+ (`mm_config`, `dw_config`) through TMA descriptors instead: a persistent
forward / dx kernel and a dw kernel whose descriptors cover one expert's rows (docs/perf/moe.md).
`grouped_swiglu(x, gate_up_proj, offsets)` fuses the activation into the gate/up GEMM: each program holds
a gate tile and the matching up tile (columns n and I + n of w[e]) and writes silu(gate) * up (R, I), so
the (R, 2I) products are neither written nor read back at inference; with autograd it also stores them
for the backward (`swiglu_grad`: the SwiGLU backward of kernels/swiglu.py, at the same rounding points,
then the grouped dx and dw of the pair). bench/moe.py measures it against the two-kernel path; the model
runs the two-kernel path until the H200 says the fused one pays.
Not done: TMA for the fused SwiGLU and for small experts, split over rows for the dw of a hot expert.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels._common import needs_grad, tma_scratch
from kiln.kernels.dispatch import interpreting, sm_count, use_triton
from kiln.kernels.launch import CachedLaunch, cdiv, pow2

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def grouped_linear_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Eager reference: a loop over experts (reads the offsets on the host), float32 math (float64 for
    float64), result in x's dtype. Rows outside [offsets[0], offsets[E]) are zero."""
    _check(x, w, offsets)
    bounds = offsets.tolist()
    _check_bounds(bounds, x.shape[0])
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32
    # every expert, an empty one too, so that w gets a gradient (zeros) even when no row came, as the
    # kernels' backward gives it (expert parallel: a rank may receive no rows at all)
    out = [x[lo:hi].to(wide) @ w[e].to(wide).T for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))]
    return torch.cat(out).to(x.dtype) if out else x.new_zeros(x.shape[0], w.shape[1])


def _check_bounds(bounds: list[int], rows: int) -> None:
    if bounds[0] != 0 or bounds[-1] != rows or any(b < a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(
            f"grouped_linear: offsets must rise from 0 to the {rows} rows of x, got {bounds[:8]}"
            f"{'...' if len(bounds) > 8 else ''}"
        )


def grouped_swiglu_ref(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of grouped_linear_ref's (R, 2I) [gate | up] products (rounded to x's dtype first,
    as the two-kernel path stores them), float32 math (float64 for float64), x's dtype."""
    gate, up = grouped_linear_ref(x, w, offsets).chunk(2, dim=-1)
    acc = torch.promote_types(x.dtype, torch.float32)
    return (F.silu(gate.to(acc)) * up.to(acc)).to(x.dtype)


def _check(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[2]:
        raise ValueError(
            f"grouped_linear expects x (R, K) and stacked weights w (E, N, K), got {tuple(x.shape)} and "
            f"{tuple(w.shape)}"
        )
    if offsets.shape != (w.shape[0] + 1,) or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"grouped_linear: offsets must be an int32 or int64 ({w.shape[0] + 1},) tensor (E + 1 row "
            f"boundaries), got {tuple(offsets.shape)} {offsets.dtype}"
        )
    if x.dtype != w.dtype or (x.dtype not in DTYPES and x.dtype != torch.float64):
        raise TypeError(f"grouped_linear takes x and w of one float dtype, got {x.dtype} and {w.dtype}")
    if x.device != w.device or offsets.device != x.device:
        raise ValueError(f"grouped_linear: x, w and offsets must share a device, got {x.device}, "
                         f"{w.device}, {offsets.device}")  # fmt: skip


@triton.jit
def _expert_of_tile(Offs_ptr, t, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """(expert, first row, end row) of row tile `t` of the grouped problem; expert == E past the last tile.
    Offs_ptr: (E + 1,) int32 row offsets. Expert e's tiles are [T_e - c_e, T_e) with c_e = cdiv(n_e,
    BLOCK_M) and T the inclusive cumsum of c: t belongs to the first expert whose T_e exceeds it."""
    ei = tl.arange(0, BLOCK_E)
    lo = tl.load(Offs_ptr + ei, mask=ei < E, other=0)
    hi = tl.load(Offs_ptr + 1 + ei, mask=ei < E, other=0)
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M  # (BLOCK_E,) 0 for the padding lanes
    e = tl.sum((tl.cumsum(n_tiles, 0) <= t).to(tl.int32), 0)
    first_tile = tl.sum(tl.where(ei < e, n_tiles, 0), 0)
    e_safe = tl.minimum(e, E - 1)  # e == E: past the last tile (the caller skips it)
    row0 = tl.load(Offs_ptr + e_safe) + (t - first_tile) * BLOCK_M
    row_end = tl.load(Offs_ptr + e_safe + 1)
    return e, row0, row_end


@triton.jit
def _grouped_mm_kernel(
    A_ptr,  # (R, K): element (r, k) at A_ptr + r * stride_ar + k * stride_ak
    B_ptr,  # (E, K, N): element (e, k, n) at B_ptr + e * stride_be + k * stride_bk + n * stride_bn
    C_ptr,  # (R, N) out, contiguous
    Pre_ptr,  # (R, 2N) out, contiguous: [gate | up] before the activation, written when STORE_PRE
    Offs_ptr,  # (E + 1,) int32 row offsets of the experts
    N,  # output columns (with SWIGLU: I, and B holds 2I columns [gate | up])
    K,
    E,
    m_tiles,  # static bound on the row tiles: cdiv(R, BLOCK_M) + E
    stride_ar,
    stride_ak,
    stride_be,
    stride_bk,
    stride_bn,
    SWIGLU: tl.constexpr,  # C = silu(A @ B[:, :N]) * (A @ B[:, N:]): two accumulators per tile
    STORE_PRE: tl.constexpr,  # SWIGLU: also store both products (the backward's input)
    PRECISION: tl.constexpr,  # tl.dot input_precision for float32 inputs: "ieee" or "tf32"
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,  # pow2 >= E: the width of the offsets' vector load
    GROUP_M: tl.constexpr,  # row tiles visited together down a column of tiles (L2 reuse of B's panel)
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    t = first_m + (pid % per_group) % group_rows
    tn = (pid % per_group) // group_rows
    e, row0, row_end = _expert_of_tile(Offs_ptr, t, E, BLOCK_M, BLOCK_E)
    if e < E:
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        r_ok = rows < row_end
        c_ok = cols < N
        a_ptrs = A_ptr + rows[:, None] * stride_ar
        b_ptrs = B_ptr + e.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # SWIGLU only (else unused)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(a_ptrs + ks[None, :].to(tl.int64) * stride_ak, mask=r_ok[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip
            b_at = b_ptrs + ks[:, None].to(tl.int64) * stride_bk
            b = tl.load(b_at, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            if SWIGLU:  # the up half: the same columns N further on
                bu = tl.load(b_at + N * stride_bn, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
                acc_up = tl.dot(a, bu, acc_up, input_precision=PRECISION)
        ok = r_ok[:, None] & c_ok[None, :]
        if SWIGLU:
            if STORE_PRE:
                pre = Pre_ptr + rows[:, None] * (2 * N) + cols[None, :]
                tl.store(pre, acc.to(Pre_ptr.dtype.element_ty), mask=ok)
                tl.store(pre + N, acc_up.to(Pre_ptr.dtype.element_ty), mask=ok)
            # silu of the rounded gate times the rounded up: what kernels/swiglu.py computes from stored
            # products, so the fused and the two-kernel paths agree to the last bit of the products
            g = acc.to(C_ptr.dtype.element_ty).to(tl.float32)
            u = acc_up.to(C_ptr.dtype.element_ty).to(tl.float32)
            acc = g * tl.sigmoid(g) * u
        c_ptrs = C_ptr + rows[:, None] * N + cols[None, :]
        tl.store(c_ptrs, acc.to(C_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _grouped_mm_tma_kernel(
    A_ptr,  # (R, K): a[r, k] at A_ptr + r * stride_ar + k (unit column stride, 16-byte aligned rows)
    B_ptr,  # B_KMAJOR: w (E, N, K) contiguous, C = A @ w[e].T (the forward); else (E, K, N) contiguous,
    #         C = A @ w[e] (the dx backward, w the forward's (E, N_fwd, K_fwd), so K = N_fwd here)
    C_ptr,  # (R, N) out, contiguous
    Offs_ptr,  # (E + 1,) int32 row offsets of the experts
    R,
    N,
    K,
    E,
    m_tiles,  # static bound on the row tiles: cdiv(R, BLOCK_M) + E
    stride_ar,
    num_programs,  # the grid's size (the SM count): each program loops over every num_programs-th tile
    B_KMAJOR: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input_precision for float32 inputs: "ieee" or "tf32"
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """The persistent Hopper form of _grouped_mm_kernel: operand tiles through TMA descriptors into the
    wgmma pipeline, one program per SM walking the static bound of (row tile, column tile) pairs. A tile
    whose rows run past its expert's end reads the next expert's rows (TMA cannot clip per expert): they
    only make rows that are not stored. B's descriptor spans all experts, (E*N, K) or (E*K, N): columns
    past N (forward) likewise land in unstored columns, while reduction steps past K are zero-filled
    (K is the descriptor's last dim) in the forward, and the launcher asks K % BLOCK_K == 0 for the dx
    form, whose reduction runs down the rows of w[e]."""
    a_desc = tl.make_tensor_descriptor(A_ptr, [R, K], [stride_ar, 1], [BLOCK_M, BLOCK_K])
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(B_ptr, [E * N, K], [K, 1], [BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(B_ptr, [E * K, N], [N, 1], [BLOCK_K, BLOCK_N])
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), m_tiles * tiles_n, num_programs):
        first_m = (tile // per_group) * GROUP_M
        group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
        t = first_m + (tile % per_group) % group_rows
        tn = (tile % per_group) // group_rows
        e, row0, row_end = _expert_of_tile(Offs_ptr, t, E, BLOCK_M, BLOCK_E)
        if e < E:
            col0 = tn * BLOCK_N
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, k_steps):
                a = a_desc.load([row0, kk * BLOCK_K])  # (BLOCK_M, BLOCK_K)
                if B_KMAJOR:
                    b = b_desc.load([e * N + col0, kk * BLOCK_K]).T  # (BLOCK_K, BLOCK_N), transposed in smem
                else:
                    b = b_desc.load([e * K + kk * BLOCK_K, col0])
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
            rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
            cols = col0 + tl.arange(0, BLOCK_N)
            tl.store(C_ptr + rows[:, None] * N + cols[None, :], acc.to(C_ptr.dtype.element_ty),
                     mask=(rows < row_end)[:, None] & (cols < N)[None, :])  # fmt: skip


@triton.jit
def _grouped_dw_kernel(
    DY_ptr,  # (R, N) gradient of the output: element (r, n) at DY_ptr + r * stride_dyr + n * stride_dyn
    X_ptr,  # (R, K) the forward's input: element (r, k) at X_ptr + r * stride_xr + k * stride_xk
    DW_ptr,  # (E, N, K) out, contiguous: dw[e] = dy[rows of e].T @ x[rows of e]
    Offs_ptr,  # (E + 1,) int32 row offsets
    N,
    K,
    stride_dyr,
    stride_dyn,
    stride_xr,
    stride_xk,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows of the expert reduced per step
):
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    e = pid // (tiles_n * tiles_k)
    tile = pid % (tiles_n * tiles_k)
    ns = (tile // tiles_k) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (tile % tiles_k) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = ns < N
    k_ok = ks < K
    start = tl.load(Offs_ptr + e)
    end = tl.load(Offs_ptr + e + 1)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(start, end, BLOCK_R):
        rs = (r0 + tl.arange(0, BLOCK_R)).to(tl.int64)
        r_ok = rs < end
        dyt = tl.load(DY_ptr + rs[None, :] * stride_dyr + ns[:, None] * stride_dyn,
                      mask=n_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
        x = tl.load(X_ptr + rs[:, None] * stride_xr + ks[None, :] * stride_xk,
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(dyt, x, acc, input_precision=PRECISION)
    out = DW_ptr + e.to(tl.int64) * N * K + ns[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(out, acc.to(DW_ptr.dtype.element_ty), mask=n_ok[:, None] & k_ok[None, :])


@triton.jit
def _grouped_dw_tma_kernel(
    DY_ptr,  # (R, N) contiguous, rows 16-byte aligned
    X_ptr,  # (R, K) contiguous, rows 16-byte aligned
    DW_ptr,  # (E, N, K) out, contiguous
    Offs_ptr,  # (E + 1,) int32 row offsets
    N,
    K,
    PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """_grouped_dw_kernel through TMA: each program builds descriptors over its expert's rows alone (base
    at row offsets[e], n_e rows), so the reduction's last step past the expert's end is zero-filled by
    the copy engine rather than masked; dy's tile is transposed in shared memory for wgmma."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_k = tl.cdiv(K, BLOCK_K)
    e = pid // (tiles_n * tiles_k)
    tile = pid % (tiles_n * tiles_k)
    n0 = (tile // tiles_k) * BLOCK_N
    k0 = (tile % tiles_k) * BLOCK_K
    start = tl.load(Offs_ptr + e)
    rows = tl.load(Offs_ptr + e + 1) - start
    # an empty expert still gets valid (1-row) descriptors; its loop runs zero times: an exact zero
    dy_desc = tl.make_tensor_descriptor(DY_ptr + start.to(tl.int64) * N, [tl.maximum(rows, 1), N], [N, 1],
                                        [BLOCK_R, BLOCK_N])  # fmt: skip
    x_desc = tl.make_tensor_descriptor(X_ptr + start.to(tl.int64) * K, [tl.maximum(rows, 1), K], [K, 1],
                                       [BLOCK_R, BLOCK_K])  # fmt: skip
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for r0 in range(0, rows, BLOCK_R):
        dyt = dy_desc.load([r0, n0]).T  # (BLOCK_N, BLOCK_R)
        x = x_desc.load([r0, k0])  # (BLOCK_R, BLOCK_K)
        acc = tl.dot(dyt, x, acc, input_precision=PRECISION)
    ns = n0 + tl.arange(0, BLOCK_N)
    ks = k0 + tl.arange(0, BLOCK_K)
    out = DW_ptr + e.to(tl.int64) * N * K + ns[:, None].to(tl.int64) * K + ks[None, :]
    tl.store(out, acc.to(DW_ptr.dtype.element_ty), mask=(ns < N)[:, None] & (ks < K)[None, :])


@triton.jit
def _swiglu_grad_kernel(
    DH_ptr,  # (R, I) gradient of h = silu(gate) * up, contiguous
    Pre_ptr,  # (R, 2I) [gate | up], contiguous
    DPre_ptr,  # (R, 2I) out: [dgate | dup]
    I,
    n_col_blocks,
    BLOCK: tl.constexpr,
):
    """dup = dh * silu(g);  dgate = dh * u * sigmoid(g) * (1 + g * (1 - sigmoid(g))): kernels/swiglu.py's
    backward on the fused GEMM's stored products (kept here: kernel modules share helpers only through
    _common)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // n_col_blocks
    cols = (pid % n_col_blocks) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    dh = tl.load(DH_ptr + row * I + cols, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(Pre_ptr + row * 2 * I + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(Pre_ptr + row * 2 * I + I + cols, mask=ok, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DPre_ptr + row * 2 * I + cols, (dh * u * (sig + silu * (1.0 - sig))).to(DPre_ptr.dtype.element_ty),
             mask=ok)  # fmt: skip
    tl.store(DPre_ptr + row * 2 * I + I + cols, (dh * silu).to(DPre_ptr.dtype.element_ty), mask=ok)


_mm_launch = CachedLaunch(_grouped_mm_kernel)
_mm_tma_launch = CachedLaunch(_grouped_mm_tma_kernel)
_dw_launch = CachedLaunch(_grouped_dw_kernel)
_dw_tma_launch = CachedLaunch(_grouped_dw_tma_kernel)
_swiglu_grad_launch = CachedLaunch(_swiglu_grad_kernel)


def _precision(dtype: torch.dtype) -> str:
    return "tf32" if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32 else "ieee"


# The persistent TMA kernel's tiles for large experts: 128x256 (the non-persistent pointer kernel measured
# 582 TFLOP/s at 128x256 against 544 at 128x128 on Mixtral's gate/up at 4k tokens, bench/results/moe.json
# "tune"), 3 stages (144 KB of shared memory), as kernels/matmul.py's persistent 128x256 config.
TMA_BIG = (128, 256, 64, 8, 3, "tma")


def mm_config(R: int, E: int, swiglu: bool = False, N: int = 0, K: int = 0) -> tuple[int | str, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the forward / dx kernel, with a sixth element
    "tma" for the persistent TMA kernel. BLOCK_M follows the mean rows per expert (decode: a few rows per
    expert, a 128-row tile would be mostly padding; there 64-wide columns give more programs over few
    experts' weights); the fused SwiGLU holds two accumulators, so half the columns. Large experts (N or
    K of 4096 or more, 256+ rows each: Mixtral-8x7B's prefill) take the persistent TMA kernel's 128x256
    tiles (the launcher falls back to the pointer kernel at those tiles for float32, and where the
    operands or the GPU do not allow descriptors). Under the
    interpreter, 16-row tiles and 64-wide columns: few programs (each costs milliseconds there)."""
    if interpreting():
        return 16, 64, 64, 4, 1
    mean = R / max(E, 1)
    if mean <= 16:
        return 16, 64, 128, 4, 4
    if mean <= 64:
        return 64, 64 if swiglu else 128, 64, 4, 4
    if not swiglu and mean >= 256 and max(N, K) >= 4096:
        return TMA_BIG
    return 128, 64 if swiglu else 128, 64, 8, 3


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _tma_operands(a: torch.Tensor, b: torch.Tensor, block_k: int) -> bool | None:
    """B_KMAJOR (True / False) if a (R, K) and b (E, K, N) can be read through the TMA kernel's
    descriptors, else None: a with unit column stride and 16-byte aligned rows; b a contiguous w (E, N, K)
    seen transposed (the forward) or a contiguous (E, K, N) (dx, whose reduction down w[e]'s rows needs
    K % block_k == 0); 16-byte aligned bases; 16-bit or float32 elements; sm_90+ (or the interpreter)."""
    if a.is_cuda:
        if _capability(a.device.index if a.device.index is not None else torch.cuda.current_device())[0] < 9:
            return None
    elif not interpreting():
        return None
    es = a.element_size()
    E, K, N = b.shape
    if a.stride(1) != 1 or (a.stride(0) * es) % 16 or a.data_ptr() % 16 or b.data_ptr() % 16:
        return None
    if b.stride() == (N * K, 1, K) and (K * es) % 16 == 0:
        return True
    if b.stride() == (K * N, N, 1) and (N * es) % 16 == 0 and K % block_k == 0:
        return False
    return None


def grouped_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    config: tuple[int, ...] | None = None,
    swiglu: bool = False,
    store_pre: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launcher: (C, pre). C (R, N) with C[rows of e] = a[rows of e] @ b[e]; a (R, K) and b (E, K, N),
    any strides (the forward passes w.transpose(1, 2), the dx backward w itself). swiglu: b holds 2I
    columns [gate | up] and C (R, I) = silu(a @ gate) * (a @ up), with pre (R, 2I) the two products
    when store_pre (else None). config: mm_config's tuple (default: mm_config's choice for this shape,
    the TMA kernel where its operands allow it)."""
    R, K = a.shape
    E, _, N = b.shape
    if swiglu:
        N //= 2
    c = torch.empty(R, N, dtype=a.dtype, device=a.device)
    pre = torch.empty(R, 2 * N, dtype=a.dtype, device=a.device) if swiglu and store_pre else None
    if R == 0 or N == 0:
        return c, pre
    if K == 0:
        if pre is not None:
            pre.zero_()
        return c.zero_(), pre
    offs = offsets if offsets.dtype == torch.int32 else offsets.to(torch.int32)
    if config is None:
        config = mm_config(R, E, swiglu, N, K)
        if config == TMA_BIG and (a.element_size() != 2 or _tma_operands(a, b, TMA_BIG[2]) is None):
            config = TMA_BIG[:5]  # the same tiles through pointers (and float32 never through TMA by default)
    bm, bn, bk, warps, stages = config[:5]
    m_tiles = cdiv(R, bm) + E
    if len(config) > 5 and config[5] == "tma":
        kmajor = _tma_operands(a, b, bk)
        if swiglu or kmajor is None:
            raise ValueError(
                "grouped_mm: the TMA config needs the plain GEMM (no swiglu), a with unit column stride and "
                "16-byte aligned rows, b a contiguous w (E, N, K) seen transposed or a contiguous (E, K, N) "
                "with K a multiple of BLOCK_K, on an sm_90+ GPU: pass a 5-element config instead"
            )
        if a.is_cuda:
            triton.set_allocator(tma_scratch)  # a context variable in triton, read at launch
        tiles = m_tiles * cdiv(N, bn)
        programs = min(tiles, sm_count(a.device))
        _mm_tma_launch[(programs,)](
            a, b, c, offs, R, N, K, E, m_tiles, a.stride(0), programs, B_KMAJOR=kmajor,
            PRECISION=_precision(a.dtype), BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=max(16, pow2(E)), GROUP_M=8, num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return c, pre
    grid = (m_tiles * cdiv(N, bn),)
    _mm_launch[grid](
        a, b, c, c if pre is None else pre, offs, N, K, E, m_tiles, a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), b.stride(2), SWIGLU=swiglu, STORE_PRE=pre is not None, PRECISION=_precision(a.dtype),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=max(16, pow2(E)), GROUP_M=8, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return c, pre


# dw's tiles through TMA for large experts (the rule of mm_config's TMA_BIG): (BLOCK_N, BLOCK_K, BLOCK_R,
# num_warps, num_stages, "tma"); the pointer kernel's 128x128x64 measured 452 TFLOP/s on Mixtral's gate/up
# at 4k tokens, 128x256 450 (bench/results/moe.json "tune")
DW_TMA = (128, 256, 64, 8, 3, "tma")


def dw_config(R: int, E: int, N: int, K: int) -> tuple[int | str, ...]:
    """grouped_dw's default: the TMA kernel for large experts (mean rows >= 256, N or K >= 4096), else the
    pointer kernel's 128x128 tiles over 64-row steps; small tiles under the interpreter."""
    if interpreting():
        return 64, 64, 16, 4, 1
    if R / max(E, 1) >= 256 and max(N, K) >= 4096:
        return DW_TMA
    return 128, 128, 64, 8, 3


def _dw_tma_ok(dy: torch.Tensor, x: torch.Tensor) -> bool:
    """Descriptors over each expert's rows need contiguous dy and x with 16-byte rows and bases (so that
    every expert's first row is aligned too), on an sm_90+ GPU or the interpreter."""
    if dy.is_cuda:
        if (
            _capability(dy.device.index if dy.device.index is not None else torch.cuda.current_device())[0]
            < 9
        ):
            return False
    elif not interpreting():
        return False
    es = x.element_size()
    return (
        dy.is_contiguous() and x.is_contiguous() and (dy.shape[1] * es) % 16 == 0 and (x.shape[1] * es) % 16 == 0
        and dy.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0
    )  # fmt: skip


def grouped_dw(
    dy: torch.Tensor,
    x: torch.Tensor,
    offsets: torch.Tensor,
    E: int,
    config: tuple[int | str, ...] | None = None,
) -> torch.Tensor:
    """Launcher: dw (E, N, K) contiguous, dw[e] = dy[rows of e].T @ x[rows of e]; dy (R, N), x (R, K).
    config: (BLOCK_N, BLOCK_K, BLOCK_R, num_warps, num_stages), a sixth element "tma" for the TMA kernel
    (default: dw_config's, the TMA kernel falling back to the same tiles through pointers where the
    operands or the GPU do not allow descriptors)."""
    R, N = dy.shape
    K = x.shape[1]
    dw = torch.empty(E, N, K, dtype=x.dtype, device=x.device)
    if N == 0 or K == 0 or E == 0:
        return dw
    if R == 0:
        return dw.zero_()
    offs = offsets if offsets.dtype == torch.int32 else offsets.to(torch.int32)
    if config is None:
        config = dw_config(R, E, N, K)
        if len(config) > 5 and (x.element_size() != 2 or not _dw_tma_ok(dy, x)):
            config = config[:5]  # the same tiles through pointers (float32 never through TMA by default)
    bn, bk, br, warps, stages = config[:5]
    grid = (E * cdiv(N, bn) * cdiv(K, bk),)
    if len(config) > 5 and config[5] == "tma":
        if not _dw_tma_ok(dy, x):
            raise ValueError(
                "grouped_dw: the TMA config needs contiguous dy and x with 16-byte aligned rows on an sm_90+ "
                "GPU: pass a 5-element config instead"
            )
        if dy.is_cuda:
            triton.set_allocator(tma_scratch)
        _dw_tma_launch[grid](
            dy, x, dw, offs, N, K, PRECISION=_precision(x.dtype), BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=br,
            num_warps=warps, num_stages=stages,
        )  # fmt: skip
        return dw
    _dw_launch[grid](
        dy, x, dw, offs, N, K, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1),
        PRECISION=_precision(x.dtype), BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=br, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    return dw


def _fwd(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    _check(x, w, offsets)
    return grouped_mm(x, w.transpose(1, 2), offsets)[0]


def _bwd(dy, x, w, offsets, need_dx: bool, need_dw: bool):
    dy = dy if dy.dtype == x.dtype else dy.to(x.dtype)
    dx = grouped_mm(dy, w, offsets)[0] if need_dx else None  # (R, K) = dy (R, N) @ w[e] (N, K)
    dw = grouped_dw(dy, x, offsets, w.shape[0]) if need_dw else None
    return dx, dw


class GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        ctx.save_for_backward(x, w, offsets)
        return _fwd(x, w, offsets)

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dx, dw = _bwd(dy, x, w, offsets, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None


# ------------------------------------------------------------------------------ torch.compile: custom ops
@torch.library.custom_op("kiln::grouped_linear", mutates_args=())
def grouped_linear_op(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y (R, N): y[rows of e] = x[rows of e] @ w[e].T, w (E, N, K) stacked expert weights."""
    return _fwd(x, w, offsets)


@grouped_linear_op.register_fake
def _(x, w, offsets):
    _check(x, w, offsets)
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("kiln::grouped_linear_bwd", mutates_args=())
def grouped_linear_bwd_op(
    dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx like x, dw (E, N, K) contiguous)."""
    return _bwd(dy, x, w, offsets, True, True)


@grouped_linear_bwd_op.register_fake
def _(dy, x, w, offsets):
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    dx, dw = grouped_linear_bwd_op(dy, x, w, offsets)
    return dx, dw, None


grouped_linear_op.register_autograd(_backward, setup_context=_setup)


# ------------------------------------------------------------------ the gate/up GEMM with SwiGLU fused in
def _check_swiglu(x, w, offsets) -> None:
    _check(x, w, offsets)
    if w.shape[1] % 2:
        raise ValueError(f"grouped_swiglu: w must hold [gate | up] rows (2I), got {w.shape[1]} rows")


def swiglu_grad(dh: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Launcher: dpre (R, 2I) = [dgate | dup] in pre's dtype from dh (R, I) (cast to pre's dtype, as the
    backward receives it) and the stored [gate | up] products pre (R, 2I) contiguous; float32 math, one
    rounding per element. The backward's first step, public so that the GPU test can check each rounding
    point of the fused backward on its own (docs/perf/moe.md)."""
    paired = pre.dim() == 2 and pre.shape[1] % 2 == 0 and pre.is_contiguous()
    if not paired or dh.shape != (pre.shape[0], pre.shape[1] // 2):
        raise ValueError(
            f"swiglu_grad expects contiguous [gate | up] products pre (R, 2I) and dh (R, I), got pre "
            f"{tuple(pre.shape)} (contiguous: {pre.is_contiguous()}) and dh {tuple(dh.shape)}"
        )
    R, I = pre.shape[0], pre.shape[1] // 2
    dh = dh.to(pre.dtype).contiguous()
    dpre = torch.empty_like(pre)
    if dpre.numel():
        block = min(1024, max(16, pow2(I)))
        ncb = cdiv(I, block)
        _swiglu_grad_launch[(R * ncb,)](dh, pre, dpre, I, ncb, BLOCK=block, num_warps=4)
    return dpre


def _swiglu_bwd(dh, pre, x, w, offsets, need_dx: bool, need_dw: bool):
    """d[gate | up] from the stored products, then the grouped dx and dw."""
    return _bwd(swiglu_grad(dh, pre), x, w, offsets, need_dx, need_dw)


class GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        _check_swiglu(x, w, offsets)
        h, pre = grouped_mm(x, w.transpose(1, 2), offsets, swiglu=True, store_pre=True)
        ctx.save_for_backward(pre, x, w, offsets)
        return h

    @staticmethod
    def backward(ctx, dh):
        pre, x, w, offsets = ctx.saved_tensors
        dx, dw = _swiglu_bwd(dh, pre, x, w, offsets, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None


@torch.library.custom_op("kiln::grouped_swiglu", mutates_args=())
def grouped_swiglu_op(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, store_pre: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h (R, I), the (R, 2I) [gate | up] products if store_pre else an empty tensor)."""
    _check_swiglu(x, w, offsets)
    h, pre = grouped_mm(x, w.transpose(1, 2), offsets, swiglu=True, store_pre=store_pre)
    return h, pre if pre is not None else x.new_empty(0)


@grouped_swiglu_op.register_fake
def _(x, w, offsets, store_pre):
    _check_swiglu(x, w, offsets)
    I = w.shape[1] // 2
    return x.new_empty(x.shape[0], I), x.new_empty((x.shape[0], 2 * I) if store_pre else 0)


@torch.library.custom_op("kiln::grouped_swiglu_bwd", mutates_args=())
def grouped_swiglu_bwd_op(
    dh: torch.Tensor, pre: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx like x, dw (E, 2I, K) contiguous)."""
    return _swiglu_bwd(dh, pre, x, w, offsets, True, True)


@grouped_swiglu_bwd_op.register_fake
def _(dh, pre, x, w, offsets):
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _swiglu_setup(ctx, inputs, output):
    x, w, offsets, _ = inputs
    ctx.save_for_backward(output[1], x, w, offsets)


def _swiglu_backward(ctx, dh, _dpre):
    pre, x, w, offsets = ctx.saved_tensors
    dx, dw = grouped_swiglu_bwd_op(dh, pre, x, w, offsets)
    return dx, dw, None, None


grouped_swiglu_op.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def grouped_swiglu(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate_e.T) * (x @ up_e.T) per expert in one launch: x (R, K), w (E, 2I, K) = [gate | up]
    stacked as gate_up_proj, -> (R, I). With autograd the products are stored for the backward."""
    if not use_triton(x, w):
        return grouped_swiglu_ref(x, w, offsets)
    if torch.compiler.is_compiling():
        return grouped_swiglu_op(x, w, offsets, needs_grad(x, w))[0]
    if needs_grad(x, w):
        return GroupedSwiGLU.apply(x, w, offsets)
    _check_swiglu(x, w, offsets)
    return grouped_mm(x, w.transpose(1, 2), offsets, swiglu=True)[0]


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-expert nn.Linear over expert-sorted rows: x (R, K), w (E, N, K), offsets (E + 1,) -> (R, N)."""
    if not use_triton(x, w):
        return grouped_linear_ref(x, w, offsets)
    if torch.compiler.is_compiling():
        return grouped_linear_op(x, w, offsets)
    if needs_grad(x, w):
        return GroupedLinear.apply(x, w, offsets)
    return _fwd(x, w, offsets)
