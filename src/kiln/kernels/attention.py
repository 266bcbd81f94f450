"""Scaled dot-product attention for prefill and training: causal, GQA, sliding window, sinks, varlen.

The public op and its autograd Function. The pieces live in three modules:
- kiln.kernels.attention_ref: the semantics (layout (B, T, H, D), GQA, causal alignment to the end,
  window, sinks, attn_mask, varlen cu_seqlens) and the eager float32/float64 reference;
- kiln.kernels.attention_fwd: the FlashAttention-2 forward kernel (online softmax in base 2, lse saved);
- kiln.kernels.attention_bwd: the backward kernels (dK/dV and dQ, recomputing P from lse).
The sink's gradient is formed here from the backward's Delta:
    dsink_h = -sum_rows exp(sink_h - lse) Delta   (the sink's probability times its zero-value gradient)
`tma=True` (forward) and `tma_bwd=True` (backward) in `FlashAttention` load through TMA tensor
descriptors (see the two kernel modules for what they measured on the H200; both off by default).
The Triton path takes fp16, bf16 and fp32 inputs with head dims 16, 32, 64, 128 and 256, and the
last dim contiguous (other layouts are made contiguous first). attn_mask, and head dims other than
these, take the reference path.
"""

from __future__ import annotations

import math

import torch

from kiln.kernels.attention_bwd import attention_bwd
from kiln.kernels.attention_fwd import attention_fwd, tuning_lengths
from kiln.kernels.attention_ref import HEAD_DIMS, LN2, LOG2E, attention_ref
from kiln.kernels.dispatch import use_triton

__all__ = [
    "LOG2E",
    "FlashAttention",
    "attention",
    "attention_bwd",
    "attention_fwd",
    "attention_ref",
    "tuning_lengths",
]


# ------------------------------------------------------------------------------------------ checks
def _check(q, k, v, sinks, cu_seqlens, cu_seqlens_k=None):
    varlen = cu_seqlens is not None
    want = 3 if varlen else 4
    layout = "(total, H, D) with cu_seqlens" if varlen else "(B, T, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != want:
            raise ValueError(f"attention: {name} must be {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"attention: q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if cu_seqlens_k is not None and (not varlen or cu_seqlens_k.shape != cu_seqlens.shape):
        raise ValueError("attention: cu_seqlens_k must come with cu_seqlens, one bound per document")
    same_rows = cu_seqlens_k is not None or k.shape[0] == q.shape[0]
    if k.shape != v.shape or not same_rows or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"attention: incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-2] % k.shape[-2]:
        raise ValueError(
            f"attention: query heads ({q.shape[-2]}) must be a multiple of key/value heads ({k.shape[-2]})"
        )
    if sinks is not None and sinks.shape != (q.shape[-2],):
        raise ValueError(f"attention: sinks must be (Hq,) = ({q.shape[-2]},), got {tuple(sinks.shape)}")
    if varlen and (cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise ValueError("attention: cu_seqlens must be a 1-D int32 tensor of document boundaries")


# ----------------------------------------------------------------------------------- autograd Function
class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k, v, sinks, cu_seqlens, max_seqlen, causal, sm_scale, window, tma=False, tma_bwd=False
    ):
        o, lse = attention_fwd(q, k, v, causal, sm_scale, window, sinks, cu_seqlens, max_seqlen, tma)
        ctx.save_for_backward(q, k, v, o, lse, sinks, cu_seqlens)
        ctx.args = (causal, sm_scale, window, max_seqlen, tma_bwd)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks, cu_seqlens = ctx.saved_tensors
        causal, sm_scale, window, max_seqlen, tma = ctx.args
        dq, dk, dv, delta = attention_bwd(
            do, q, k, v, o, lse, causal, sm_scale, window, cu_seqlens, max_seqlen, tma
        )
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # The sink's probability exp(sink - lse) times its logit gradient (0 - Delta), summed over rows.
            p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse * LN2)  # (B, Hq, Tq)
            dsinks = (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None, None, None


# ------------------------------------------------------------------------------ torch.compile: custom ops
# Dynamo cannot trace the autotuned Triton launches: under torch.compile the public op calls these
# instead, opaque to the compiler, with fake functions for shapes and the backward registered. The
# sink's gradient is plain tensor math in the registered backward (traced, so the compiler fuses it).
@torch.library.custom_op("kiln::attention_fwd", mutates_args=())
def attention_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    causal: bool,
    sm_scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o like q, lse (B, Hq, Tq) float32; (1, Hq, total) with cu_seqlens). max_seqlen: the longest
    document with cu_seqlens (any upper bound is correct: programs past a document's end exit)."""
    return attention_fwd(q, k, v, causal, sm_scale, window, sinks, cu_seqlens, max_seqlen)


@attention_fwd_op.register_fake
def _(q, k, v, sinks, cu_seqlens, max_seqlen, causal, sm_scale, window):
    _check(q, k, v, sinks, cu_seqlens)
    lse = (1, q.shape[1], q.shape[0]) if cu_seqlens is not None else (q.shape[0], q.shape[2], q.shape[1])
    return q.new_empty(q.shape), q.new_empty(lse, dtype=torch.float32)


@torch.library.custom_op("kiln::attention_bwd", mutates_args=())
def attention_bwd_op(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    max_seqlen: int,
    causal: bool,
    sm_scale: float,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq like q, dk like k, dv like v, delta like lse)."""
    return attention_bwd(do, q, k, v, o, lse, causal, sm_scale, window, cu_seqlens, max_seqlen)


@attention_bwd_op.register_fake
def _(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, sm_scale, window):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), torch.empty_like(lse)


def _attention_setup(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens, max_seqlen, causal, sm_scale, window = inputs
    ctx.save_for_backward(q, k, v, *output, sinks, cu_seqlens)
    ctx.args = (max_seqlen, causal, sm_scale, window)


def _attention_backward(ctx, do, _dlse):
    q, k, v, o, lse, sinks, cu_seqlens = ctx.saved_tensors
    dq, dk, dv, delta = attention_bwd_op(do, q, k, v, o, lse, cu_seqlens, *ctx.args)
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[3]:  # as FlashAttention.backward
        p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse * LN2)  # (B, Hq, Tq)
        dsinks = (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)
    return dq, dk, dv, dsinks, None, None, None, None, None


attention_fwd_op.register_autograd(_attention_backward, setup_context=_attention_setup)


# ------------------------------------------------------------------------------------------ public op
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention over (B, T, H, D) tensors (or packed (total, H, D) with cu_seqlens); see the module doc.

    max_seqlen: with cu_seqlens, the longest document's length if the caller knows it on the host (it
    sizes the grid). Omitted, eager calls read it from cu_seqlens (a device-to-host sync); compiled
    calls use the total token count instead, an upper bound (no sync; extra programs exit at once).
    cu_seqlens_k: separate key bounds (keys = each document's cached prefix + its new rows,
    `attention_ref`'s doc); forward only (inference): no gradient flows through that form."""
    if window is not None and window < 1:
        raise ValueError(f"attention: window must be >= 1 (keys p - W < j <= p), got {window}")
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"attention: softmax_scale must be positive, got {softmax_scale}")
    triton_ok = attn_mask is None and q.shape[-1] in HEAD_DIMS and q.numel() > 0 and k.numel() > 0
    if triton_ok and use_triton(q, k, v, sinks, cu_seqlens):
        _check(q, k, v, sinks, cu_seqlens, cu_seqlens_k)
        scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
        if cu_seqlens is None:
            max_seqlen = 0
        elif max_seqlen is None:
            # under torch.compile a read of device memory would be a graph break (and a sync)
            compiling = torch.compiler.is_compiling()
            max_seqlen = q.shape[0] if compiling else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        if cu_seqlens_k is not None:
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
                raise ValueError(
                    "attention: cu_seqlens_k (a cached prefix) is forward-only; run under no_grad"
                )
            o, _ = attention_fwd(
                q, k, v, causal, scale, window, sinks, cu_seqlens, max_seqlen, cu_seqlens_k=cu_seqlens_k
            )
            return o
        if torch.compiler.is_compiling():
            return attention_fwd_op(q, k, v, sinks, cu_seqlens, max_seqlen, causal, scale, window)[0]
        return FlashAttention.apply(q, k, v, sinks, cu_seqlens, max_seqlen, causal, scale, window)
    return attention_ref(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window=window, sinks=sinks, attn_mask=attn_mask,
        cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k,
    )  # fmt: skip
