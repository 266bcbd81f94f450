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

One launch does q and k: each program takes a block of tokens (one by default), loads their cos/sin
rows once and rotates all Hq query heads and Hk key heads as (tokens, heads, D/2) tiles, every
load issued before the first store. Any strides for B, T and heads are taken as they
are (so (B, H, T, D) tensors passed as `.transpose(1, 2)` views, or q/k sliced out of a fused qkv
projection, are read in place); only the last dim must be contiguous. Position ids must lie in [0, P):
like any indexing kernel, the GPU path does not check this (a check would cost a host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.dispatch import sm_count, use_triton
from kiln.kernels.rmsnorm import FLOAT_DTYPES, cdiv, pow2


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
def _pair_offsets(i, half, INTERLEAVED: tl.constexpr):
    """Offsets within a head of the two members of pair i: (2i, 2i+1) interleaved, (i, i + D/2) half."""
    if INTERLEAVED:
        return 2 * i, 2 * i + 1
    return i, i + half


@triton.jit
def _load_heads(
    X_ptr, tok_b, tok_t, stride_b, stride_t, stride_h, n_heads, half, tok_ok,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Both pair members of every head of a (TOKENS, 1, 1) block of tokens: two (TOKENS, BLOCK_H,
    BLOCK_D) float32 tiles."""
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    i = tl.arange(0, BLOCK_D)[None, None, :]
    mask = tok_ok & (heads < n_heads) & (i < half)
    ia, ib = _pair_offsets(i, half, INTERLEAVED)
    rows = X_ptr + tok_b * stride_b + tok_t * stride_t + heads * stride_h
    # read once: streamed through L2 without displacing the cos/sin tables
    a = tl.load(rows + ia, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    b = tl.load(rows + ib, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
    return a, b


@triton.jit
def _store_heads(
    O_ptr, tok, n_heads, half, tok_ok, a, b,
    INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Store rotated pairs into the contiguous (tokens, n_heads, D) output."""
    heads = tl.arange(0, BLOCK_H)[None, :, None]
    i = tl.arange(0, BLOCK_D)[None, None, :]
    mask = tok_ok & (heads < n_heads) & (i < half)
    ia, ib = _pair_offsets(i, half, INTERLEAVED)
    rows = O_ptr + (tok * n_heads + heads) * (2 * half)
    tl.store(rows + ia, a.to(O_ptr.dtype.element_ty), mask=mask)
    tl.store(rows + ib, b.to(O_ptr.dtype.element_ty), mask=mask)


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
    cos_row_stride,
    sin_row_stride,
    pos_stride_b, pos_stride_t,
    n_tokens, T, n_q_heads, n_k_heads, half,
    HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BACKWARD: tl.constexpr,  # rotate by -angle: the gradient of the forward rotation
    TOKENS: tl.constexpr,  # tokens per program
    BLOCK_QH: tl.constexpr,  # next_power_of_2(Hq)
    BLOCK_KH: tl.constexpr,  # next_power_of_2(Hk)
    BLOCK_D: tl.constexpr,  # next_power_of_2(D / 2)
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64) * TOKENS + tl.arange(0, TOKENS)[:, None, None]  # (TOKENS, 1, 1)
    tok_ok = tok < n_tokens
    b = tok // T
    t = tok % T
    if HAS_POS:
        pos = tl.load(POS_ptr + b * pos_stride_b + t * pos_stride_t, mask=tok_ok, other=0).to(tl.int64)
    else:
        pos = t
    i = tl.arange(0, BLOCK_D)[None, None, :]
    cs_mask = tok_ok & (i < half)
    # cos/sin rows are reused by every sequence of the batch: keep them in L2 against the streamed q/k
    c = tl.load(COS_ptr + pos * cos_row_stride + i, mask=cs_mask, other=0.0, eviction_policy="evict_last")
    s = tl.load(SIN_ptr + pos * sin_row_stride + i, mask=cs_mask, other=0.0, eviction_policy="evict_last")
    c = c.to(tl.float32)  # (TOKENS, 1, BLOCK_D)
    s = s.to(tl.float32)
    if BACKWARD:
        s = -s
    # every load is issued before any store: the q and k traffic of the block overlaps
    qa, qb = _load_heads(
        Q_ptr,
        b,
        t,
        q_stride_b,
        q_stride_t,
        q_stride_h,
        n_q_heads,
        half,
        tok_ok,
        INTERLEAVED,
        BLOCK_QH,
        BLOCK_D,
    )
    ka, kb = _load_heads(
        K_ptr,
        b,
        t,
        k_stride_b,
        k_stride_t,
        k_stride_h,
        n_k_heads,
        half,
        tok_ok,
        INTERLEAVED,
        BLOCK_KH,
        BLOCK_D,
    )
    _store_heads(
        QO_ptr, tok, n_q_heads, half, tok_ok, qa * c - qb * s, qa * s + qb * c, INTERLEAVED, BLOCK_QH, BLOCK_D
    )
    _store_heads(
        KO_ptr, tok, n_k_heads, half, tok_ok, ka * c - kb * s, ka * s + kb * c, INTERLEAVED, BLOCK_KH, BLOCK_D
    )


@triton.jit
def _rotate_rows(
    X_ptr, O_ptr, COS_ptr, SIN_ptr, POS_ptr, blk,
    stride_b, stride_t, stride_h, cos_row_stride, sin_row_stride, pos_stride_b, pos_stride_t,
    n_tokens, T, n_heads, half, sin_sign,
    HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr, TABLE: tl.constexpr, EVICT: tl.constexpr,
    WHOLE_ROWS: tl.constexpr, FLAT: tl.constexpr, TOKS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Rotate block blk of one tensor, as (TOKS, BLOCK_H, D/2) tiles per pair member.
    FLAT: the tensor is (B * T * H) rows of D and the block is TOKS consecutive rows (BLOCK_H = 1), each
    row gathering its own cos/sin; else the block is TOKS tokens with all their heads, cos/sin loaded once
    per token. Either way a program streams one stretch of one tensor (contiguous in dense layouts)."""
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
    if TABLE:
        if HAS_POS:
            pos = tl.load(POS_ptr + b * pos_stride_b + t * pos_stride_t, mask=tok < n_tokens, other=0)
            pos = pos.to(tl.int64)
        else:
            pos = t
        c = tl.load(COS_ptr + pos * cos_row_stride + i, mask=tok_ok, other=0.0).to(tl.float32)
        s = tl.load(SIN_ptr + pos * sin_row_stride + i, mask=tok_ok, other=0.0).to(tl.float32) * sin_sign
    else:  # timing probe only (bench/sweep_rope_sampling.py): what the cos/sin reads cost
        c = tl.full((TOKS, 1, BLOCK_D), 1.0, tl.float32)
        s = tl.zeros((TOKS, 1, BLOCK_D), tl.float32)
    src = X_ptr + b * stride_b + t * stride_t + head * stride_h
    dst = O_ptr + (tok.to(tl.int64) * n_heads + head) * (2 * half)
    if INTERLEAVED and WHOLE_ROWS:
        # one contiguous load of whole rows; the pairs (x[2i], x[2i+1]) split apart in registers
        j = tl.arange(0, 2 * BLOCK_D)[None, None, :]
        row_mask = ok & (j < 2 * half)
        x = tl.load(src + j, mask=row_mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        a, bb = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], BLOCK_D, 2)))
        y = tl.reshape(tl.join(a * c - bb * s, a * s + bb * c), (x.shape[0], x.shape[1], 2 * BLOCK_D))
        tl.store(dst + j, y.to(O_ptr.dtype.element_ty), mask=row_mask, eviction_policy=EVICT)
    else:
        ia, ib = _pair_offsets(i, half, INTERLEAVED)
        a = tl.load(src + ia, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        bb = tl.load(src + ib, mask=mask, other=0.0, eviction_policy=EVICT).to(tl.float32)
        tl.store(dst + ia, (a * c - bb * s).to(O_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICT)
        tl.store(dst + ib, (a * s + bb * c).to(O_ptr.dtype.element_ty), mask=mask, eviction_policy=EVICT)


@triton.jit
def _rope_rows_kernel(
    Q_ptr, K_ptr, QO_ptr, KO_ptr, COS_ptr, SIN_ptr, POS_ptr,
    q_stride_b, q_stride_t, q_stride_h,
    k_stride_b, k_stride_t, k_stride_h,
    cos_row_stride, sin_row_stride, pos_stride_b, pos_stride_t,
    n_tokens, T, n_q_heads, n_k_heads, half, n_q_blocks, n_blocks,
    sin_sign,  # -1 for the backward: the inverse rotation (a runtime value: one compiled kernel for both)
    HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr, TABLE: tl.constexpr, EVICT: tl.constexpr,
    WHOLE_ROWS: tl.constexpr, FLAT: tl.constexpr, TOKS_Q: tl.constexpr, TOKS_K: tl.constexpr, BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr, PERSISTENT: tl.constexpr,
):  # fmt: skip
    """q's blocks, then k's: blocks 0 .. n_q_blocks - 1 rotate q, the rest k. PERSISTENT: a grid of a
    few programs per SM strides over the blocks; else one program per block."""
    start = tl.program_id(0)
    step = tl.num_programs(0) if PERSISTENT else n_blocks
    for blk in range(start, n_blocks, step):
        if blk < n_q_blocks:
            _rotate_rows(
                Q_ptr, QO_ptr, COS_ptr, SIN_ptr, POS_ptr, blk,
                q_stride_b, q_stride_t, q_stride_h, cos_row_stride, sin_row_stride, pos_stride_b, pos_stride_t,
                n_tokens, T, n_q_heads, half, sin_sign,
                HAS_POS, INTERLEAVED, TABLE, EVICT, WHOLE_ROWS, FLAT, TOKS_Q, BLOCK_QH, BLOCK_D,
            )  # fmt: skip
        else:
            _rotate_rows(
                K_ptr, KO_ptr, COS_ptr, SIN_ptr, POS_ptr, blk - n_q_blocks,
                k_stride_b, k_stride_t, k_stride_h, cos_row_stride, sin_row_stride, pos_stride_b, pos_stride_t,
                n_tokens, T, n_k_heads, half, sin_sign,
                HAS_POS, INTERLEAVED, TABLE, EVICT, WHOLE_ROWS, FLAT, TOKS_K, BLOCK_KH, BLOCK_D,
            )  # fmt: skip


# One token per program, 4 warps: on the H200 (B8 T4096 Hq32 Hk8 D128 bf16) 2 or 4 tokens per program and
# 1 or 2 warps were no faster (0.174-0.186 ms against 0.174), so no autotuner (its host cost showed).
TOKENS_PER_PROGRAM = 1
NUM_WARPS = 4


def _check(q, k, cos, sin, position_ids) -> None:
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
            not position_ids.is_cuda
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


def rope_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    backward: bool = False,
    tokens: int = TOKENS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (by -angle if `backward`) in one launch; returns new contiguous tensors."""
    q, k, cos, sin = (_last_contiguous(t) for t in (q, k, cos, sin))
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if B * T == 0:
        return qo, ko
    pos = position_ids if position_ids is not None else q  # a dummy pointer when HAS_POS is off
    pos_strides = (pos.stride(0), pos.stride(1)) if position_ids is not None else (0, 0)
    args = (
        q, k, qo, ko, cos, sin, pos,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), sin.stride(0), *pos_strides,
        B * T, T, Hq, Hk, D // 2,
    )  # fmt: skip
    flags = dict(
        HAS_POS=position_ids is not None, INTERLEAVED=interleaved, BACKWARD=backward,
        BLOCK_QH=pow2(Hq), BLOCK_KH=pow2(Hk),
        BLOCK_D=pow2(D // 2),
    )  # fmt: skip
    _rope_kernel[(cdiv(B * T, tokens),)](*args, **flags, TOKENS=tokens, num_warps=num_warps)
    return qo, ko


def rope_rows_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    interleaved: bool,
    backward: bool = False,
    rows: int = 32,
    num_warps: int = 4,
    persistent: int = 0,
    flat: bool = True,
    num_stages: int = 1,
    table: bool = True,
    evict: str = "",
    whole_rows: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block kernel: q's blocks then k's, about `rows` (token, head) rows per block (flat: exactly
    `rows` rows; else whole tokens, rows // pow2(H) of them); `persistent` > 0 launches that many programs
    per SM, striding over the blocks. `table=False` is a timing probe (wrong output)."""
    q, k, cos, sin = (_last_contiguous(t) for t in (q, k, cos, sin))
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if B * T == 0:
        return qo, ko
    pos = position_ids if position_ids is not None else q
    pos_strides = (pos.stride(0), pos.stride(1)) if position_ids is not None else (0, 0)
    bqh, bkh = (1, 1) if flat else (pow2(Hq), pow2(Hk))
    toks_q, toks_k = max(1, rows // bqh), max(1, rows // bkh)
    if flat:
        n_q_blocks, n_k_blocks = cdiv(B * T * Hq, toks_q), cdiv(B * T * Hk, toks_k)
    else:
        n_q_blocks, n_k_blocks = cdiv(B * T, toks_q), cdiv(B * T, toks_k)
    n_blocks = n_q_blocks + n_k_blocks
    grid = min(n_blocks, persistent * sm_count(q.device)) if persistent else n_blocks
    _rope_rows_kernel[(grid,)](
        q, k, qo, ko, cos, sin, pos,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), sin.stride(0), *pos_strides,
        B * T, T, Hq, Hk, D // 2, n_q_blocks, n_blocks, -1.0 if backward else 1.0,
        HAS_POS=position_ids is not None, INTERLEAVED=interleaved, TABLE=table, EVICT=evict, WHOLE_ROWS=whole_rows,
        FLAT=flat, TOKS_Q=toks_q, TOKS_K=toks_k, BLOCK_QH=bqh, BLOCK_KH=bkh, BLOCK_D=pow2(D // 2),
        PERSISTENT=bool(persistent), num_warps=num_warps, num_stages=num_stages,
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
        return RoPEFunction.apply(q, k, cos, sin, position_ids, interleaved)
    return apply_rope_ref(q, k, cos, sin, position_ids, interleaved)
