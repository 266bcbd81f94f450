"""Rotary position embedding applied to q and k.

Shapes: q (B, T, Hq, D), k (B, T, Hk, D); cos and sin (P, D/2) tables indexed by position
(the model owns their frequencies, including every scaling variant); position_ids (B, T) or None
for 0..T-1 (packed sequences restart their ids; decoding passes the cache offset). Two pair layouts:
- half-rotated (HF Llama, `interleaved=False`): pairs are (x[i], x[i + D/2]);
- interleaved (the original RoFormer/GPT-J form, `interleaved=True`): pairs are (x[2i], x[2i+1]).
Each pair (a, b) becomes (a cos - b sin, a sin + b cos). Float32 math (float64 for float64 inputs,
the tests' oracle), outputs in the input dtype.

Backward: the rotation is orthogonal, so the gradient is the inverse rotation of dq and dk
(sin -> -sin), the same kernel run again. cos and sin are constants: they get no gradient (the Triton
path refuses tables that require one).

One launch does q and k: the grid is q's blocks then k's, so each program streams one stretch of one
tensor (contiguous for dense layouts). By default a block is a few (token, head) rows of D, each row
gathering its cos/sin row (the tables are small and, loaded `evict_last`, stay in L2 while q and k stream
past them); `tokens=` makes a block whole tokens with all their heads instead, cos/sin loaded once per
token. Half-rotated pairs load as two (rows, D/2) tiles; interleaved pairs load as whole rows split into
(x[2i], x[2i+1]) in registers (two stride-2 loads ran 13x slower on the H200). Any strides for B, T and heads are taken as they are (so (B, H, T, D)
tensors passed as `.transpose(1, 2)` views, or q/k sliced out of a fused qkv projection, are read in
place); only the last dim must be contiguous. Position ids must lie in [0, P): like any indexing kernel,
the GPU path does not check this (a check would cost a host sync).

Decode steps take `rope_kv_write` (near the end of this file): q and k rotated and k, v written into their
paged cache slots by one kernel, with apply_rope + kiln.kernels.paged_kv.paged_kv_write as its reference;
and, at one token, `qkv_rope` (the end): the q/k/v projection with that rotation and write in its epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels._common import (
    FLOAT_DTYPES,
    early_loads,
    needs_grad,
    pdl,
    pdl_first,
    pdl_prologue,
    rope_pair_tables,
    rope_pairs_store,
)
from kiln.kernels.dispatch import use_triton
from kiln.kernels.launch import CachedLaunch, cdiv, pow2
from kiln.kernels.matmul import matmul_ref
from kiln.kernels.matmul_decode import PRELOAD_MAX_K, PRELOAD_MAX_WEIGHT, preload_weight, split_sum_ref
from kiln.kernels.paged_kv import paged_kv_write_ref


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # x (B, T, H, D); cos/sin (B, T, 1, D/2)
    xf = x.to(cos.dtype)
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        out = torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.to(x.dtype)


def apply_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T = q.shape[:2]
    if position_ids is None:
        position_ids = torch.arange(T, device=q.device).expand(B, T)
    acc = torch.promote_types(q.dtype, torch.float32)  # float32 math (float64 for a float64 oracle)
    c = cos.to(acc)[position_ids].unsqueeze(2)  # (B, T, 1, D/2)
    s = sin.to(acc)[position_ids].unsqueeze(2)
    return _rotate(q, c, s, interleaved), _rotate(k, c, s, interleaved)


@triton.jit
def _rotate_block(
    X_ptr, O_ptr, COS_ptr, SIN_ptr, POS_ptr, blk,
    stride_b, stride_t, stride_h, cos_row_stride, sin_row_stride, pos_stride_b, pos_stride_t,
    n_tokens, T, n_heads, half, sin_sign,
    HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr, EVICT: tl.constexpr, TABLE_EVICT: tl.constexpr,
    FLAT: tl.constexpr, TOKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rotate block blk of one tensor, as (TOKS, BLOCK_H, D/2) tiles per pair member.
    FLAT: the tensor is (B * T * H) rows of D and the block is TOKS consecutive rows (BLOCK_H = 1), each
    row gathering its own cos/sin; else the block is TOKS tokens with all their heads, cos/sin loaded once
    per token. Every load is issued before the first store."""
    # index math in int32 (B * T * H < 2**31), byte offsets in int64
    if FLAT:
        r = tl.arange(0, TOKS)[:, None, None] + blk * TOKS  # (TOKS, 1, 1) = token * H + head
        tok = r // n_heads
        head = r % n_heads
        ok = tok < n_tokens
    else:
        tok = tl.arange(0, TOKS)[:, None, None] + blk * TOKS  # (TOKS, 1, 1)
        head = tl.arange(0, BLOCK_H)[None, :, None]  # (1, BLOCK_H, 1)
        ok = (tok < n_tokens) & (head < n_heads)
    b = (tok // T).to(tl.int64)
    t = (tok % T).to(tl.int64)
    head = head.to(tl.int64)
    i = tl.arange(0, BLOCK_D)[None, None, :]
    tok_ok = (tok < n_tokens) & (i < half)
    mask = ok & (i < half)
    pos = t
    if HAS_POS:
        pos = tl.load(POS_ptr + b * pos_stride_b + t * pos_stride_t, mask=tok < n_tokens, other=0)
        pos = pos.to(tl.int64)
    # (TOKS, 1, BLOCK_D): a few KB of table per program, read from L1/L2: evict_last keeps the tables in L2
    # while q and k stream through it (without the hint they were evicted and re-read from HBM: 2.5% slower)
    c = tl.load(COS_ptr + pos * cos_row_stride + i, mask=tok_ok, other=0.0, eviction_policy=TABLE_EVICT)
    s = tl.load(SIN_ptr + pos * sin_row_stride + i, mask=tok_ok, other=0.0, eviction_policy=TABLE_EVICT)
    c = c.to(tl.float32)
    s = s.to(tl.float32) * sin_sign
    src = X_ptr + b * stride_b + t * stride_t + head * stride_h
    dst = O_ptr + (tok.to(tl.int64) * n_heads + head) * (2 * half)
    if INTERLEAVED:
        # one contiguous load of whole rows; the pairs (x[2i], x[2i+1]) split apart in registers
        j = tl.arange(0, 2 * BLOCK_D)[None, None, :]
        row_mask = ok & (j < 2 * half)
        x = tl.load(src + j, mask=row_mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        a, bb = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], BLOCK_D, 2)))
        y = tl.reshape(tl.join(a * c - bb * s, a * s + bb * c), (x.shape[0], x.shape[1], 2 * BLOCK_D))
        tl.store(dst + j, y.to(O_ptr.dtype.element_ty), mask=row_mask, eviction_policy=EVICT)
    else:  # half-rotated: the pairs (x[i], x[i + D/2]) are two contiguous half rows
        a = tl.load(src + i, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        bb = tl.load(src + i + half, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        tl.store(dst + i, (a * c - bb * s).to(O_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICT)
        tl.store(
            dst + i + half, (a * s + bb * c).to(O_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICT
        )


@triton.jit
def _rope_kernel(
    Q_ptr,  # (B, T, Hq, D) any strides but the last
    K_ptr,  # (B, T, Hk, D)
    QO_ptr,  # (B, T, Hq, D) out, contiguous
    KO_ptr,  # (B, T, Hk, D) out, contiguous
    COS_ptr,  # (P, D/2)
    SIN_ptr,  # (P, D/2)
    POS_ptr,  # (B, T) integer positions (read only if HAS_POS)
    q_stride_b, q_stride_t, q_stride_h,
    k_stride_b, k_stride_t, k_stride_h,
    cos_row_stride, sin_row_stride, pos_stride_b, pos_stride_t,
    n_tokens, T, n_q_heads, n_k_heads, half,
    n_q_blocks,  # programs 0 .. n_q_blocks - 1 rotate q, the rest k
    sin_sign,  # -1 for the backward: the inverse rotation (a runtime value: one compiled kernel for both)
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    EVICT: tl.constexpr,  # eviction policy of q/k and their outputs ("": none, the measured default)
    TABLE_EVICT: tl.constexpr,  # eviction policy of the cos/sin rows ("evict_last": keep them in L2)
    FLAT: tl.constexpr,  # blocks of TOKS_* (token, head) rows; else of TOKS_* whole tokens
    TOKS_Q: tl.constexpr,
    TOKS_K: tl.constexpr,
    BLOCK_QH: tl.constexpr,  # 1 when FLAT, else next_power_of_2(Hq)
    BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_power_of_2(D / 2)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
):  # fmt: skip
    pdl_prologue(PDL)
    blk = tl.program_id(0)
    if blk < n_q_blocks:
        _rotate_block(
            Q_ptr, QO_ptr, COS_ptr, SIN_ptr, POS_ptr, blk,
            q_stride_b, q_stride_t, q_stride_h, cos_row_stride, sin_row_stride, pos_stride_b, pos_stride_t,
            n_tokens, T, n_q_heads, half, sin_sign, HAS_POS, INTERLEAVED, EVICT, TABLE_EVICT, FLAT, TOKS_Q, BLOCK_QH,
            BLOCK_D,
        )  # fmt: skip
    else:
        _rotate_block(
            K_ptr, KO_ptr, COS_ptr, SIN_ptr, POS_ptr, blk - n_q_blocks,
            k_stride_b, k_stride_t, k_stride_h, cos_row_stride, sin_row_stride, pos_stride_b, pos_stride_t,
            n_tokens, T, n_k_heads, half, sin_sign, HAS_POS, INTERLEAVED, EVICT, TABLE_EVICT, FLAT, TOKS_K, BLOCK_KH,
            BLOCK_D,
        )  # fmt: skip


# H200, q (8, 4096, 32, 128) + k (8 heads) bf16. bench/sweep_rope_sampling.py (last session): blocks of
# 8-16 rows in 1-2 warps ran within 1% of torch's own copy of q and k; whole-token blocks (32-128 rows, 2-8
# warps) 1-3% slower; the first kernel (one token, q and k together, 4 warps) 0.173 ms; persistent grids
# 0.184-0.191 ms. bench/sweep_memory_bound.py (interleaved with torch.compile, L2 flushed before each call):
# 16 rows in one warp 168.9 us, 8 rows 169.2, 32 rows 172.4-173.6, 4 rows 203.5; evict_first on q/k and the
# outputs cost 7-11 us under the flush (it was the previous default); loading each block's cos/sin row once
# when the block lies within one token (scalar token indices) changed nothing (169.0 against 169.0).
# What did: `evict_last` on the cos/sin loads (bench/experiments/cache_policies.py): the streamed q/k lines
# were evicting the 2 MB of tables from L2, so rows re-read them from HBM. With the hint 16-row blocks take
# 164.9 us (160.8 GPU time), torch.compile 168.1 (163.1), torch's copy of q and k 166.1 (161.0).
ROWS = 16
NUM_WARPS = 1
EVICT = ""
TABLE_EVICT = "evict_last"


def _check(q, k, cos, sin, position_ids, values: bool = True) -> None:
    """Shapes, dtypes and devices; with `values`, also position ids' range on the CPU (no host sync on the
    GPU; fake tensors under torch.compile have no values)."""
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"apply_rope: q and k must be (B, T, H, D) with the same B, T and D, got {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    D = q.shape[-1]
    if D % 2:
        raise ValueError(f"apply_rope: head dim must be even, got {D}")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype:
        raise TypeError(
            f"apply_rope: q and k must share a float dtype (fp32/fp16/bf16), got {q.dtype}, {k.dtype}"
        )
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != D // 2:
        raise ValueError(
            f"apply_rope: cos and sin must be (P, D/2) = (P, {D // 2}), got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("apply_rope: the Triton path treats cos/sin as constants; pass them detached")
    if position_ids is not None:
        if position_ids.shape != q.shape[:2] or position_ids.dtype.is_floating_point:
            raise ValueError(
                f"apply_rope: position_ids must be integer (B, T) = {tuple(q.shape[:2])}, got "
                f"{tuple(position_ids.shape)} {position_ids.dtype}"
            )
        if (
            values
            and not position_ids.is_cuda
            and position_ids.numel()
            and (int(position_ids.min()) < 0 or int(position_ids.max()) >= cos.shape[0])
        ):
            raise ValueError(
                f"apply_rope: position_ids must lie in [0, {cos.shape[0]}) (the rows of cos/sin)"
            )
    for t in (k, cos, sin, position_ids):
        if t is not None and t.device != q.device:
            raise ValueError(f"apply_rope: all tensors must be on one device, got {q.device} and {t.device}")


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


_rope_launch = CachedLaunch(_rope_kernel)


def rope_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    backward: bool = False,
    rows: int = ROWS,
    num_warps: int = NUM_WARPS,
    tokens: int | None = None,
    evict: str = EVICT,
    table_evict: str = TABLE_EVICT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (by -angle if `backward`) in one launch; returns new contiguous tensors.
    Blocks of `rows` (token, head) rows (powers of two), or with `tokens`, of that many whole q tokens (and
    as many k tokens as fill the same tile)."""
    q, k, cos, sin = (_last_contiguous(t) for t in (q, k, cos, sin))
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    n = B * T
    if n == 0:
        return qo, ko
    if tokens is None:  # flat rows
        bqh = bkh = 1
        toks_q = toks_k = rows
        n_q_blocks, n_k_blocks = cdiv(n * Hq, rows), cdiv(n * Hk, rows)
    else:  # whole tokens: k blocks hold as many heads x tokens as q blocks
        bqh, bkh = pow2(Hq), pow2(Hk)
        toks_q, toks_k = tokens, max(1, tokens * bqh // bkh)
        n_q_blocks, n_k_blocks = cdiv(n, toks_q), cdiv(n, toks_k)
    pos = position_ids if position_ids is not None else q  # a dummy pointer when HAS_POS is off
    pos_strides = (pos.stride(0), pos.stride(1)) if position_ids is not None else (0, 0)
    _rope_launch[(n_q_blocks + n_k_blocks,)](
        q, k, qo, ko, cos, sin, pos,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), sin.stride(0), *pos_strides,
        n, T, Hq, Hk, D // 2, n_q_blocks, -1.0 if backward else 1.0,
        HAS_POS=position_ids is not None, INTERLEAVED=interleaved, EVICT=evict, TABLE_EVICT=table_evict,
        FLAT=tokens is None,
        TOKS_Q=toks_q, TOKS_K=toks_k, BLOCK_QH=bqh, BLOCK_KH=bkh, BLOCK_D=pow2(D // 2), num_warps=num_warps,
        PDL=pdl(q), launch_pdl=pdl(q),
    )  # fmt: skip
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids, interleaved):
        _check(q, k, cos, sin, position_ids)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.interleaved = interleaved
        return rope_launch(q, k, cos, sin, position_ids, interleaved)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, position_ids = ctx.saved_tensors
        dq, dk = rope_launch(dq, dk, cos, sin, position_ids, ctx.interleaved, backward=True)
        return dq, dk, None, None, None, None


# ------------------------------------------------------------------------------ torch.compile: custom op
# Under torch.compile the public op calls this instead of RoPEFunction (Dynamo cannot trace the launch):
# opaque to the compiler, a fake function for shapes, and the backward (the inverse rotation) registered.
@torch.library.custom_op("kiln::rope", mutates_args=())
def rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated (by -angle if `backward`), as new contiguous tensors."""
    _check(q, k, cos, sin, position_ids)
    return rope_launch(q, k, cos, sin, position_ids, interleaved, backward=backward)


@rope_op.register_fake
def _(q, k, cos, sin, position_ids, interleaved, backward):
    _check(q, k, cos, sin, position_ids, values=False)
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rope_setup(ctx, inputs, output):
    _, _, cos, sin, position_ids, interleaved, backward = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.interleaved, ctx.backward = interleaved, backward


def _rope_backward(ctx, dq, dk):
    cos, sin, position_ids = ctx.saved_tensors
    dq, dk = rope_op(dq, dk, cos, sin, position_ids, ctx.interleaved, not ctx.backward)
    return dq, dk, None, None, None, None, None


rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


def apply_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, T, Hq, D) and k (B, T, Hk, D) by the angles of cos/sin (P, D/2) at position_ids."""
    if use_triton(q, k, cos, sin, position_ids):
        if torch.compiler.is_compiling():
            return rope_op(q, k, cos, sin, position_ids, interleaved, False)
        if needs_grad(q, k):
            return RoPEFunction.apply(q, k, cos, sin, position_ids, interleaved)
        _check(q, k, cos, sin, position_ids)
        return rope_launch(q, k, cos, sin, position_ids, interleaved)
    return apply_rope_ref(q, k, cos, sin, position_ids, interleaved)


# ================================================================================================
# Decode: `rope_kv_write`
#
# RoPE and the paged K/V write in one kernel, for decode steps: q rotated, k rotated into its cache slot,
# v copied into its slot.
#
# Shapes: q (N, Hq, D), k and v (N, Hk, D) (any strides but a contiguous last dim: the views the fused qkv
# projection's output is cut into); cos and sin (R, D/2) tables with rows (N,) picking each token's row
# (kiln.model.rope.RotaryTables gives both); the caches (num_blocks, block_size, Hk, D) and slots (N,) int64
# as in kiln.kernels.paged_kv (a negative slot is a padding row: its q is rotated, nothing is written).
# Returns the rotated q as a new contiguous (N, Hq, D) tensor; k and v land only in the caches (decode
# attention reads every key, the new one included, from there).
#
# Math: each pair (a, b) of q and k (half-rotated (x[i], x[i + D/2]), or interleaved (x[2i], x[2i+1]),
# kiln.kernels.rope) becomes (a cos - b sin, a sin + b cos) in float32; outputs in the input dtype (the
# caches' dtype for k and v), exactly what kiln.kernels.rope.apply_rope followed by
# kiln.kernels.paged_kv.paged_kv_write produce, which is the reference (`rope_kv_write_ref`).
#
# Why: in a decode step these were two launches per layer (RoPE, then the K/V write: 2 x 28 kernels of
# 1.3-1.8 us each on the H200 at batch 1, docs/perf/inference.md) moving a few KB each. One program per
# token does all of it: its cos/sin row is loaded once, q and k are rotated in registers, and k never
# makes the round trip through a rotated copy in memory. Inference only: no gradient.


def rope_kv_write_ref(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved=False) -> torch.Tensor:
    """apply_rope on (q, k) as one row of N tokens, then the paged write of (rotated k, v): the two ops
    the kernel replaces, as the model ran them."""
    q_rot, k_rot = apply_rope_ref(q[None], k[None], cos, sin, rows[None], interleaved)
    paged_kv_write_ref(k_cache, v_cache, k_rot[0], v, slots)
    return q_rot[0].contiguous()


def rope_kv_write_split_ref(
    partials, bias, n_heads, cos, sin, rows, k_cache, v_cache, slots, interleaved=False
):
    """rope_kv_write_split's reference: the q/k/v projection's output from its split-K partials (S, N, (Hq + 2 Hk)
    D), added in slice order with the bias and rounded to the caches' dtype (kiln.kernels.matmul_decode's sum
    kernel), split into q, k, v, then rope_kv_write_ref."""
    Hk, D = k_cache.shape[2], k_cache.shape[3]
    qkv = split_sum_ref(partials, bias, k_cache.dtype)
    q, k, v = qkv.split([n_heads * D, Hk * D, Hk * D], dim=1)
    N = q.shape[0]
    return rope_kv_write_ref(q.reshape(N, n_heads, D), k.reshape(N, Hk, D), v.reshape(N, Hk, D), cos, sin, rows,
                             k_cache, v_cache, slots, interleaved)  # fmt: skip


@triton.jit
def _load_summed(P, mask, PB, SPLIT: tl.constexpr, split_stride, HAS_BIAS: tl.constexpr, dt):
    """The values at P, or with SPLIT > 0 a split-K matmul's output there: P points into the first of SPLIT
    float32 slices of partial sums, split_stride elements apart, added in slice order, + the bias at PB
    (HAS_BIAS), rounded to dt: kiln.kernels.matmul_decode's sum kernel, elementwise, the same bits."""
    if SPLIT > 0:
        x = tl.load(P, mask=mask, other=0.0)
        for k in tl.static_range(1, SPLIT):
            x += tl.load(P + k * split_stride, mask=mask, other=0.0)
        if HAS_BIAS:
            x += tl.load(PB, mask=mask, other=0.0).to(tl.float32)
        x = x.to(dt)
    else:
        x = tl.load(P, mask=mask, other=0.0)
    return x


@triton.jit
def _rotate_heads(X, c, s, offs_h, n_heads, half, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr, XB, SPLIT: tl.constexpr, split_stride, HAS_BIAS: tl.constexpr,
                  dt):  # fmt: skip
    """Rotate the (BLOCK_H, D) rows at X + offs_h[:, None] (head row pointers; heads >= n_heads masked)
    by c, s (1, BLOCK_D) float32: returns (first, second, mask), where for half-rotated pairs first and
    second are the (BLOCK_H, BLOCK_D) halves of the output row, and for interleaved pairs first is the
    whole (BLOCK_H, 2 BLOCK_D) row (second unused). SPLIT > 0: the rows are a split-K matmul's output
    (_load_summed; XB the bias's row pointers, like X's)."""
    # one return after a constexpr if/else (the two layouts return tiles of different shapes, and the
    # compiler visits every return that follows a static branch)
    h_ok = offs_h[:, None] < n_heads
    if INTERLEAVED:
        j = tl.arange(0, 2 * BLOCK_D)[None, :]
        mask = h_ok & (j < 2 * half)
        x = _load_summed(X + j, mask, XB + j, SPLIT, split_stride, HAS_BIAS, dt).to(tl.float32)  # whole rows
        a, b = tl.split(tl.reshape(x, (BLOCK_H, BLOCK_D, 2)))
        first = tl.reshape(tl.join(a * c - b * s, a * s + b * c), (BLOCK_H, 2 * BLOCK_D))
        second = first
    else:
        i = tl.arange(0, BLOCK_D)[None, :]
        mask = h_ok & (i < half)
        a = _load_summed(X + i, mask, XB + i, SPLIT, split_stride, HAS_BIAS, dt).to(tl.float32)  # x[i]
        b = _load_summed(X + i + half, mask, XB + i + half, SPLIT, split_stride, HAS_BIAS, dt).to(tl.float32)
        first = a * c - b * s
        second = a * s + b * c
    return first, second, mask


@triton.jit
def _store_rotated(O, first, second, mask, half, INTERLEAVED: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store _rotate_heads' output at the row pointers O (BLOCK_H, 1)."""
    if INTERLEAVED:
        tl.store(O + tl.arange(0, 2 * BLOCK_D)[None, :], first.to(O.dtype.element_ty), mask=mask)
    else:
        i = tl.arange(0, BLOCK_D)[None, :]
        tl.store(O + i, first.to(O.dtype.element_ty), mask=mask)
        tl.store(O + i + half, second.to(O.dtype.element_ty), mask=mask)


# fmt: off
@triton.jit
def _rope_kv_write_kernel(
    Q, K, V,  # q (N, Hq, D), k and v (N, Hk, D): any token and head strides, D contiguous (SPLIT: slice 0's)
    Q_OUT,  # (N, Hq, D) contiguous: the rotated q
    COS, SIN, ROWS,  # cos, sin (R, D/2); rows (N,): each token's table row
    K_CACHE, V_CACHE, SLOTS,  # caches (num_blocks, PAGE_SIZE, Hk, D); slots (N,) int64, < 0: padding
    BQ, BK, BV,  # SPLIT and HAS_BIAS: the q/k/v projection's bias at q's, k's and v's first column
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_cos, stride_sin, stride_rows,
    stride_kcp, stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch,
    split_stride,  # SPLIT: elements between two slices of the partial sums
    Hq, Hk, half,  # half = D / 2
    PAGE_SIZE: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,  # next powers of two >= Hq, Hk
    BLOCK_D: tl.constexpr,  # next power of two >= D / 2
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
    EARLY: tl.constexpr = False,  # the table row, cos / sin and slot read before the PDL wait (launcher doc)
    FIRST: tl.constexpr = False,  # signal the next kernel before waiting (kiln.kernels._common.pdl_first)
    SPLIT: tl.constexpr = 0,  # > 0: q, k, v are a split-K projection's float32 partials (rope_kv_write_split)
    HAS_BIAS: tl.constexpr = False,  # SPLIT: add the projection's bias to the sum
):
    if not EARLY:
        pdl_prologue(PDL, FIRST)
    dt = Q_OUT.dtype.element_ty  # SPLIT: the projection's output dtype, what its sum kernel rounds to
    i = tl.program_id(0)  # one token: all its q, k and v heads
    i64 = i.to(tl.int64)
    row = tl.load(ROWS + i64 * stride_rows).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    c = tl.load(COS + row * stride_cos + d, mask=d < half, other=0.0).to(tl.float32)  # (1, BLOCK_D)
    s = tl.load(SIN + row * stride_sin + d, mask=d < half, other=0.0).to(tl.float32)
    slot = tl.load(SLOTS + i64).to(tl.int64)
    if EARLY:
        pdl_prologue(PDL, FIRST)
    qh = tl.arange(0, BLOCK_QH)[:, None]
    q1, q2, q_mask = _rotate_heads(Q + i64 * stride_qn + qh * stride_qh, c, s, tl.arange(0, BLOCK_QH), Hq,
                                   half, INTERLEAVED, BLOCK_QH, BLOCK_D, BQ + qh * stride_qh, SPLIT, split_stride,
                                   HAS_BIAS, dt)
    _store_rotated(Q_OUT + (i64 * Hq + qh) * (2 * half), q1, q2, q_mask, half, INTERLEAVED, BLOCK_D)
    if slot >= 0:  # a padding row writes nothing
        page = slot // PAGE_SIZE
        pos = slot % PAGE_SIZE
        kh = tl.arange(0, BLOCK_KH)[:, None]
        k1, k2, k_mask = _rotate_heads(K + i64 * stride_kn + kh * stride_kh, c, s, tl.arange(0, BLOCK_KH), Hk,
                                       half, INTERLEAVED, BLOCK_KH, BLOCK_D, BK + kh * stride_kh, SPLIT,
                                       split_stride, HAS_BIAS, dt)
        _store_rotated(K_CACHE + page * stride_kcp + pos * stride_kct + kh * stride_kch, k1, k2, k_mask, half,
                       INTERLEAVED, BLOCK_D)
        j = tl.arange(0, 2 * BLOCK_D)[None, :]
        v_mask = (kh < Hk) & (j < 2 * half)
        v = _load_summed(V + i64 * stride_vn + kh * stride_vh + j, v_mask, BV + kh * stride_vh + j, SPLIT,
                         split_stride, HAS_BIAS, dt)
        tl.store(V_CACHE + page * stride_vcp + pos * stride_vct + kh * stride_vch + j,
                 v.to(V_CACHE.dtype.element_ty), mask=v_mask)
# fmt: on


_rope_kv_launch = CachedLaunch(_rope_kv_write_kernel)


def rope_kv_write_triton(
    q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved, early: bool = False
) -> torch.Tensor:
    """The kernel on checked inputs; returns the rotated q (N, Hq, D). early: read the table rows, cos / sin
    and the slots before the programmatic-launch wait, so that the chain row -> cos / sin overlaps the
    kernel before (the q/k/v projection, which writes none of them). The caller vouches that the kernel
    launched right before this one does not write them: true of the model's eager and CUDA-graph steps
    (the tables are made once a step, before layer 0); not promised under torch.compile, whose
    scheduler may place the kernel that makes them anywhere before their first use (the custom op passes
    False)."""
    q, k, v, cos, sin = (_last_contiguous(t) for t in (q, k, v, cos, sin))
    return _launch(q, k, v, None, cos, sin, rows, k_cache, v_cache, slots, interleaved, early, q.dtype)


def rope_kv_write_split_triton(partials, bias, n_heads, cos, sin, rows, k_cache, v_cache, slots, interleaved,
                               early: bool = False) -> torch.Tensor:  # fmt: skip
    """The kernel on a split-K q/k/v projection's partials (checked by rope_kv_write_split): q, k, v are
    column ranges of slice 0, the kernel adds the other slices and the bias as it loads them."""
    D = k_cache.shape[3]
    sizes = [n_heads * D, k_cache.shape[2] * D, k_cache.shape[2] * D]
    q, k, v = (t.unflatten(1, (-1, D)) for t in partials[0].split(sizes, dim=1))
    biases = None if bias is None else bias.split(sizes)
    return _launch(q, k, v, biases, _last_contiguous(cos), _last_contiguous(sin), rows, k_cache, v_cache, slots,
                   interleaved, early, k_cache.dtype, split=partials.shape[0], split_stride=partials[0].numel())  # fmt: skip


def _launch(q, k, v, biases, cos, sin, rows, k_cache, v_cache, slots, interleaved, early, dtype, split=0,
            split_stride=0) -> torch.Tensor:  # fmt: skip
    """One launch of the kernel over q (N, Hq, D), k and v (N, Hk, D) views (split > 0: of slice 0 of the
    partials, `split_stride` elements between slices; biases (q's, k's, v's) or None): the rotated q in
    `dtype`."""
    N, Hq, D = q.shape
    Hk = k.shape[1]
    q_out = torch.empty((N, Hq, D), dtype=dtype, device=q.device)
    if N == 0:
        return q_out
    use_pdl = pdl(q)
    # one token per program: Hq + 2 Hk rows of D (16 x 128 at Qwen2.5-1.5B), 4 warps; decode steps are a
    # few hundred tokens at most, so the grid is small and each program's loads all issue at once
    _rope_kv_launch[(N,)](
        q, k, v, q_out, cos, sin, rows, k_cache, v_cache, slots, *(biases or (q, k, v)),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0), rows.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], split_stride, Hq, Hk, D // 2,
        PAGE_SIZE=k_cache.shape[1], INTERLEAVED=interleaved, BLOCK_QH=pow2(Hq), BLOCK_KH=pow2(Hk),
        BLOCK_D=pow2(D // 2), PDL=use_pdl, EARLY=early, FIRST=pdl_first("rope"), SPLIT=split,
        HAS_BIAS=biases is not None and split > 0, num_warps=4, launch_pdl=use_pdl,
    )  # fmt: skip
    return q_out


# ------------------------------------------------------------------------------ torch.compile: custom op
# Under torch.compile the public op calls this (Dynamo cannot trace the launch): it writes the caches in
# place, declared so (the compiler orders it against the decode attention that reads them).
@torch.library.custom_op("kiln::rope_kv_write", mutates_args=("k_cache", "v_cache"))
def rope_kv_write_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    return rope_kv_write_triton(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved)


@rope_kv_write_op.register_fake
def _(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved):
    return q.new_empty(q.shape)


def _check_rope_kv(q, k, v, cos, sin, rows, k_cache, v_cache, slots) -> None:
    if (
        q.dim() != 3
        or k.dim() != 3
        or k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[2] != k.shape[2]
    ):
        raise ValueError(
            f"rope_kv_write: q must be (N, Hq, D) and k, v (N, Hk, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    N, Hq, D = q.shape
    if D % 2:
        raise ValueError(f"rope_kv_write: head dim must be even, got {D}")
    if q.dtype not in FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"rope_kv_write: q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] != D // 2:
        raise ValueError(
            f"rope_kv_write: cos and sin must be (R, D/2) = (R, {D // 2}), got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if rows.shape != (N,) or rows.dtype.is_floating_point:
        raise ValueError(f"rope_kv_write: rows must be integer ({N},), got {tuple(rows.shape)} {rows.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"rope_kv_write: caches must be (num_blocks, block_size, {k.shape[1]}, {D}), got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if slots.shape != (N,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"rope_kv_write: slots must be ({N},) int32/int64, got {tuple(slots.shape)} {slots.dtype}"
        )
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("rope_kv_write: the caches' last dim must be contiguous")
    for t in (k, v, cos, sin, rows, k_cache, v_cache, slots):
        if t.device != q.device:
            raise ValueError(
                f"rope_kv_write: all tensors must be on one device, got {q.device} and {t.device}"
            )


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate q and k by cos/sin at `rows`, write rotated k and v into the caches at `slots` (in place);
    returns the rotated q (N, Hq, D). See the comment above rope_kv_write_ref. Unless KILN_DECODE_EARLY=off,
    rows, cos, sin and slots are read before the programmatic-launch wait (rope_kv_write_triton): the
    kernel launched right before this call (the decode step's q/k/v projection) must not write them."""
    _check_rope_kv(q, k, v, cos, sin, rows, k_cache, v_cache, slots)
    if not use_triton(q, k, v, cos, sin, k_cache, v_cache):
        return rope_kv_write_ref(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved)
    if torch.compiler.is_compiling():
        return rope_kv_write_op(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved)
    return rope_kv_write_triton(q, k, v, cos, sin, rows, k_cache, v_cache, slots, interleaved, early_loads())


def rope_kv_write_split(
    partials: torch.Tensor,
    bias: torch.Tensor | None,
    n_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """rope_kv_write of a q/k/v projection left as its split-K partial sums (inference; kiln.model.linear's
    SplitSum): partials (S, N, (Hq + 2 Hk) D) float32 as kiln.kernels.matmul_decode leaves them with
    `defer_sum` (bias not added), bias ((Hq + 2 Hk) D,) or None. The kernel adds the slices in order and the
    bias, rounds to the caches' dtype (the projection's sum kernel, the same bits), then rotates and writes
    as rope_kv_write: one launch instead of two. Returns the rotated q (N, Hq, D)."""
    Hk, D = k_cache.shape[2], k_cache.shape[3]
    width = (n_heads + 2 * Hk) * D
    if partials.dim() != 3 or partials.dtype != torch.float32 or partials.shape[2] != width:
        raise ValueError(
            f"rope_kv_write_split: partials must be float32 (S, N, {width}) for {n_heads} q heads and {Hk} K/V "
            f"heads of {D}, got {partials.dtype} {tuple(partials.shape)}"
        )
    if bias is not None and bias.shape != (width,):
        raise ValueError(f"rope_kv_write_split: bias must be ({width},), got {tuple(bias.shape)}")
    if (
        not partials.is_contiguous()
        or slots.shape != (partials.shape[1],)
        or rows.shape != (partials.shape[1],)
    ):
        raise ValueError(
            f"rope_kv_write_split: contiguous partials and one slot and one table row per token "
            f"({partials.shape[1]}), got slots {tuple(slots.shape)}, rows {tuple(rows.shape)}"
        )
    if not use_triton(partials, cos, sin, k_cache, v_cache) or torch.compiler.is_compiling():
        return rope_kv_write_split_ref(
            partials, bias, n_heads, cos, sin, rows, k_cache, v_cache, slots, interleaved
        )
    return rope_kv_write_split_triton(partials, bias, n_heads, cos, sin, rows, k_cache, v_cache, slots, interleaved,
                                      early_loads())  # fmt: skip


# ================================================================================================
# qkv_rope: the decode step's q/k/v projection with RoPE and the paged K/V write in its epilogue, one token.
#
# Shapes: x (1, d) the normed hidden state; W (N, d) the merged qkv weight, N = (Hq + 2 Hk) D, rows
# [0, Hq D) q, then k, then v; bias (N,) or None; cos, sin (R, D/2) and rows (1,) the token's table row;
# k_cache, v_cache (num_blocks, PAGE, Hk, D); slots (1,) the token's cache slot (< 0: write nothing).
# Returns q (1, Hq, D) rotated; k (rotated) and v land in the caches.
#
# Why: at batch 1 the projection (kiln.kernels.matmul_decode's one-row gemv) and `rope_kv_write` are two
# kernels in a chain of ten a layer, and the second is one program doing ~2 us of latency (Qwen2.5-1.5B
# shape, H200). Here each program of the projection owns whole rotation pairs of one head, so it can rotate
# them and store them where they go: the second kernel and the (1, N) round trip disappear.
#
# The kernel: the one-row gemv (same tiles, loads and float32 accumulation order per output as
# `decode_matmul` with the config it picks at these shapes, so the projection's values are the same bits),
# over a permuted set of W's rows: program p takes QKV_PAIRS rotation pairs (i, i + D/2) of head h (half-rotated
# layout; (2i, 2i + 1) interleaved), i.e. 2 QKV_PAIRS rows of W. Epilogue: + bias, rounded to x's dtype (the
# projection's output rounding), then in float32 (a, b) -> (a cos - b sin, a sin + b cos) for q and k heads
# (rope_kv_write's math), rounded, stored into q or the caches; v heads are stored as they are.
# Where the gemv loads its whole W slice before the programmatic-launch wait (`matmul_decode.preload_weight`:
# Qwen2.5-1.5B's q/k/v), so does this kernel (PRE_K), with the token's tables (EARLY): it then mirrors that
# form's one-shot sum, and the norm before it may signal it early as it signals the separate projection.
# Reference: `qkv_rope_ref` = matmul_ref + split + rope_kv_write_ref, the ops the model runs without it.
# ================================================================================================

QKV_PAIRS = 2  # rotation pairs per program: 4 rows of W, the one-row gemv's BLOCK_N at these shapes
QKV_BLOCK_K = 256  # the gemv's K step for K <= 4096 (matmul_decode.decode_config)
QKV_WARPS, QKV_STAGES = 2, 3
QKV_MAX_K = 4096  # beyond it the gemv takes other tiles: the fused kernel is not offered there


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


@triton.jit
def _add_rmsnorm_row(x, offs, K, R, G, H_OUT, eps, store_h, HAS_RESIDUAL: tl.constexpr):
    """kiln's add + RMSNorm (kernels/rmsnorm.py, offset 0) of one row held whole (offs: pow2 >= K columns):
    h = round(x + r), stored by the program with store_h; rstd from h's rounded values; returns
    round(round(h * rstd) * gamma), the values rmsnorm returns. rstd's float32 sum runs over this kernel's
    layout, not the norm kernel's, so its last bits (and now and then one bf16 ulp of an element) may differ."""
    ok = offs < K
    h = x
    if HAS_RESIDUAL:
        r = tl.load(R + offs, mask=ok, other=0.0)
        h = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # one rounding, as the eager add
        tl.store(H_OUT + offs, h, mask=ok & store_h)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / K + eps)
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    return ((hf * rstd).to(x.dtype) * g).to(x.dtype)


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
    R, G, H_OUT,  # NORM: the residual row (1, K) (read with HAS_RESIDUAL), the norm weight (K,), out: x + r (1, K)
    eps,  # NORM: the RMSNorm's epsilon (float)
    HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAIRS: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (kiln.kernels._common.pdl)
    NORM: tl.constexpr = False,  # x is the block's input: add + RMSNorm it first (needs PRE_K: the whole row)
    HAS_RESIDUAL: tl.constexpr = False,  # NORM: h = x + r, stored into H_OUT by program 0 (else h = x)
    PRE_K: tl.constexpr = 0,  # > 0: a power of two >= K; the whole W slice loaded before the PDL wait, no K loop
    EARLY: tl.constexpr = False,  # the table row, cos / sin and slot read before the PDL wait (rope_kv_write's)
    FIRST: tl.constexpr = False,  # signal the next kernel before waiting (kiln.kernels._common.pdl_first)
):
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
    if PRE_K > 0:
        # W is not written by the kernel before (the norm), nor by the one before that: its whole slice is
        # requested now, as the one-row gemv's preload (matmul_decode.preload_weight) requests it, so that the
        # norm may let this kernel be scheduled early (Linear.reads_early) and the bytes stream under it
        offs_pre = tl.arange(0, PRE_K)
        w_pre = tl.load(w_rows + offs_pre[None, :], mask=(offs_pre < K)[None, :], other=0.0)
    if EARLY:  # made once a step before layer 0 (rope_kv_write_triton's contract)
        c, s, slot = rope_pair_tables(COS, SIN, ROWS, stride_cos, stride_sin, SLOTS, jp)
    # FIRST: decode attention's split kernel after this one reads only the key count, block tables and older
    # cache rows before its wait (never this token's key, which this kernel writes)
    pdl_prologue(PDL, FIRST)
    if not EARLY:
        c, s, slot = rope_pair_tables(COS, SIN, ROWS, stride_cos, stride_sin, SLOTS, jp)  # before the K loop
    if PRE_K > 0:  # the gemv's preloaded sum, in its order: the same bits as that projection
        x_pre = tl.load(X + offs_pre * stride_xk, mask=offs_pre < K, other=0.0)
        if NORM:
            x_pre = _add_rmsnorm_row(x_pre, offs_pre, K, R, G, H_OUT, eps, pid == 0, HAS_RESIDUAL)
        y = tl.sum(w_pre.to(tl.float32) * x_pre.to(tl.float32)[None, :], axis=1)  # (2 PAIRS,)
    else:
        acc = tl.zeros((2 * PAIRS, BLOCK_K), dtype=tl.float32)
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)
            x = tl.load(X + offs_k * stride_xk, mask=offs_k < K, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)  # (2 PAIRS,)
    if HAS_BIAS:
        y += tl.load(BIAS + n).to(tl.float32)
    rope_pairs_store(y, h, col_a, col_b, Hq, Hk, Q_OUT + h * D, c, s, slot, K_CACHE, V_CACHE, stride_kcp,
                      stride_kct, stride_kch, stride_vcp, stride_vct, stride_vch, PAGE_SIZE, PAIRS)


# fmt: on


_qkv_rope_launch = CachedLaunch(_qkv_rope_kernel)


def qkv_rope_supported(x: torch.Tensor, weight: torch.Tensor, k_cache: torch.Tensor, n_heads: int) -> bool:
    """Whether `qkv_rope` takes these shapes: one token, K <= QKV_MAX_K (the gemv tiles it reproduces), a
    K-contiguous weight of (Hq + 2 Hk) D rows, D / 2 a multiple of QKV_PAIRS, one dtype for x, W and the caches."""
    D, Hk = k_cache.shape[-1], k_cache.shape[-2]
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.shape[1] <= QKV_MAX_K
        and weight.shape == ((n_heads + 2 * Hk) * D, x.shape[1])
        and weight.stride(1) == 1
        and D % (2 * QKV_PAIRS) == 0
        and k_cache.stride(-1) == 1
        and x.dtype == weight.dtype == k_cache.dtype
    )


def qkv_rope_norm_supported(weight: torch.Tensor) -> bool:
    """Whether the fused norm (`qkv_rope(..., norm_weight=)`) takes this (N, K) q/k/v weight: the form
    holds a program's whole W slice in registers, as the one-row gemv's preload does, so the same bounds
    (matmul_decode.PRELOAD_MAX_K, PRELOAD_MAX_WEIGHT; Qwen2.5-1.5B's 2048 x 1536 is within them)."""
    N, K = weight.shape
    return K <= PRELOAD_MAX_K and N * K <= PRELOAD_MAX_WEIGHT


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
    pre_k: int | None = None,
    early: bool | None = None,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """q (1, Hq, D) = RoPE(x @ W[:Hq D].T + b); RoPE(k) and v written into the caches at `slots` (in place).
    Shapes as the module docstring; the caller checks `qkv_rope_supported` (the model falls back to the
    projection + `rope_kv_write` elsewhere). Triton on CUDA or in the interpreter; the reference elsewhere.

    norm_weight (K,): x is the block's input and the projection takes its add + RMSNorm first, as
    `rmsnorm(x, norm_weight, eps, residual)` forms it, inside the kernel (every program normalizes the
    whole row it loads anyway; needs the preloaded form, pre_k > 0). Returns (q, h): h = x + residual, the
    new residual stream (x itself without a residual). rstd's float32 sum may differ from the norm
    kernel's in its last bits (the two sum the row in other orders). Triton only (CUDA, or the interpreter):
    where the reference backend runs, rmsnorm and then this op are the form to call.

    pre_k: 0, or a power of two >= K: the whole W slice of a program is loaded before the programmatic-launch
    wait and summed at once, as the one-row gemv does where `matmul_decode.preload_weight` holds (the default
    then, pow2(K), so that the kernel keeps the separate projection's bits and takes the norm's early signal
    as that projection does: Linear.reads_early); else the gemv's K loop. early: the table row, cos / sin
    and the slot read before the wait too (default `early_loads()`, as rope_kv_write: the caller vouches that
    neither the kernel before nor the one before that writes them; the model's eager and CUDA-graph steps
    make them before layer 0, and never run this kernel under torch.compile)."""
    if not qkv_rope_supported(x, weight, k_cache, n_heads):
        raise ValueError(
            f"qkv_rope: unsupported shapes x {tuple(x.shape)}, weight {tuple(weight.shape)} (stride "
            f"{weight.stride()}), cache {tuple(k_cache.shape)}, {n_heads} q heads: check qkv_rope_supported"
        )
    Hk, D = k_cache.shape[-2], k_cache.shape[-1]
    K = x.shape[1]
    if pre_k is None:
        pre_k = pow2(K) if preload_weight(weight.shape[0], K) else 0
    if pre_k and (pre_k < K or pre_k & (pre_k - 1)):
        raise ValueError(f"qkv_rope: pre_k must be 0 or a power of two >= K = {K}, got {pre_k}")
    norm = norm_weight is not None
    if norm:
        _check_qkv_norm(x, norm_weight, residual, pre_k)
    elif residual is not None:
        raise ValueError("qkv_rope: residual is an argument of the fused norm (norm_weight)")
    if not use_triton(x, weight, k_cache, v_cache):
        if norm:  # the model takes the fused norm only where Triton runs (Attention.takes_input_norm)
            raise ValueError(
                "qkv_rope: the fused norm (norm_weight) runs on Triton (CUDA, or the interpreter with the "
                "'triton' kernel backend); elsewhere call rmsnorm, then qkv_rope"
            )
        return qkv_rope_ref(
            x, weight, bias, cos, sin, rows, k_cache, v_cache, slots, n_heads, Hk, interleaved
        )
    if v_cache.shape != k_cache.shape or v_cache.stride(-1) != 1 or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"qkv_rope: v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)}"
        )
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))  # rows of D/2 load as vectors
    q = torch.empty((1, n_heads, D), device=x.device, dtype=x.dtype)
    h = x if residual is None else torch.empty_like(x)  # the new stream
    use_pdl = pdl(x)
    grid = ((n_heads + 2 * Hk) * (D // 2) // QKV_PAIRS,)
    _qkv_rope_launch[grid](
        x, weight, weight if bias is None else bias, q, cos, sin, rows, k_cache, v_cache, slots,
        x.shape[1], x.stride(1), weight.stride(0), cos.stride(0), sin.stride(0),
        *k_cache.stride()[:3], *v_cache.stride()[:3], n_heads, Hk, D, D // 2,
        x if residual is None else residual, x if norm_weight is None else norm_weight, h, float(eps),
        HAS_BIAS=bias is not None, INTERLEAVED=interleaved, PAGE_SIZE=k_cache.shape[1], PAIRS=QKV_PAIRS,
        BLOCK_K=QKV_BLOCK_K, STAGES=QKV_STAGES, PDL=use_pdl, NORM=norm, HAS_RESIDUAL=residual is not None,
        PRE_K=pre_k,
        EARLY=early_loads() if early is None else early, FIRST=pdl_first("qkv"), num_warps=QKV_WARPS,
        launch_pdl=use_pdl,
    )  # fmt: skip
    return (q, h) if norm else q


def _check_qkv_norm(x, norm_weight, residual, pre_k) -> None:
    """The fused norm's arguments: a contiguous x row, a (K,) contiguous weight of x's dtype and device, a
    residual like x, and the preloaded form (the kernel normalizes the whole row it loads at once)."""
    K = x.shape[1]
    if not pre_k:
        raise ValueError("qkv_rope: the fused norm (norm_weight) needs the preloaded form, pre_k > 0")
    if x.stride(1) != 1:
        raise ValueError("qkv_rope: the fused norm takes a contiguous x row")
    if (norm_weight.shape != (K,) or norm_weight.dtype != x.dtype or norm_weight.device != x.device
            or not norm_weight.is_contiguous()):  # fmt: skip
        raise ValueError(
            f"qkv_rope: norm_weight must be a contiguous ({K},) {x.dtype} tensor on {x.device}, got "
            f"{tuple(norm_weight.shape)} {norm_weight.dtype} on {norm_weight.device}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                 or residual.device != x.device or not residual.is_contiguous()):  # fmt: skip
        raise ValueError(f"qkv_rope: residual must be a contiguous tensor like x {tuple(x.shape)} {x.dtype}")
