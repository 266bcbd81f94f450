"""Eager reference attention: the semantics every attention kernel of kiln matches.

Layout is (batch, seq, heads, head_dim) throughout, as FlashAttention takes it:
- q (B, Tq, Hq, D); k, v (B, Tk, Hk, D) with Hq % Hk == 0 (GQA/MQA: query head h reads K/V head
  h // (Hq // Hk); K/V are never stored repeated outside this reference);
- causal masking aligns the diagonal to the end: query i sits at absolute position i + Tk - Tq, so
  chunked prefill (Tq < Tk) works;
- window W (optional): a query at position p sees keys p - W < j <= p;
- sinks (Hq,) (optional): one learned logit per head that joins the softmax denominator and takes
  probability mass without contributing a value (gpt-oss);
- attn_mask (optional): bool (B, 1 or Hq, Tq, Tk), True where attention is allowed, combined with the
  masks above (padded batches);
- varlen: q, k, v packed as (total, H, D) with cu_seqlens (N+1,) int32 document boundaries; each
  document attends only within itself. With cu_seqlens_k as well, k and v are packed by their own
  boundaries (total_k, Hk, D): document b's keys are a prefix (e.g. cached) followed by its new rows,
  and its queries sit at the end of them (the causal alignment above), as in chunked prefill.
Fully masked rows give zeros, not NaN. Float32 math (float64 for float64 inputs), output in q's dtype.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
HEAD_DIMS = (16, 32, 64, 128, 256)


# ----------------------------------------------------------------------------------------- reference
def _attention_dense_ref(q, k, v, causal, softmax_scale, window, sinks, attn_mask):
    # the reference's math is float32 (float64 for float64 inputs) even inside a caller's autocast
    with torch.autocast(q.device.type, enabled=False):
        return _attention_dense_math(q, k, v, causal, softmax_scale, window, sinks, attn_mask)


def _attention_dense_math(q, k, v, causal, softmax_scale, window, sinks, attn_mask):
    B, Tq, Hq, D = q.shape
    Tk, Hk = k.shape[1], k.shape[2]
    if Hq % Hk:
        raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hk})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf = q.to(work).transpose(1, 2)  # (B, Hq, Tq, D)
    kf = k.to(work).transpose(1, 2).repeat_interleave(Hq // Hk, dim=1)  # (B, Hq, Tk, D)
    vf = v.to(work).transpose(1, 2).repeat_interleave(Hq // Hk, dim=1)
    s = (qf @ kf.transpose(-1, -2)) * scale  # (B, Hq, Tq, Tk)
    qpos = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
    kpos = torch.arange(Tk, device=q.device)[None, :]
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    allowed = allowed.expand(B, Hq, Tq, Tk)
    if attn_mask is not None:
        allowed = allowed & attn_mask
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.to(work).view(1, Hq, 1, 1).expand(B, Hq, Tq, 1)
        s = torch.cat((s, sink), dim=-1)
    m = s.amax(-1, keepdim=True).clamp_min(torch.finfo(work).min)  # all -inf rows stay finite
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = torch.where(denom > 0, p / denom, torch.zeros_like(p))
    if sinks is not None:
        p = p[..., :-1]
    return (p @ vf).transpose(1, 2).to(q.dtype)  # (B, Tq, Hq, D)


def attention_ref(
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
    cu_seqlens_k: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eager attention (float32 math, or float64 for float64 inputs); differentiable by autograd."""
    if cu_seqlens is None:
        if cu_seqlens_k is not None:
            raise ValueError("cu_seqlens_k needs cu_seqlens (packed queries)")
        return _attention_dense_ref(q, k, v, causal, softmax_scale, window, sinks, attn_mask)
    if attn_mask is not None:
        raise ValueError("attn_mask cannot be combined with cu_seqlens: packed documents mask themselves")
    qb = cu_seqlens.tolist()
    kb = qb if cu_seqlens_k is None else cu_seqlens_k.tolist()
    if len(kb) != len(qb):
        raise ValueError(f"cu_seqlens_k has {len(kb)} bounds, cu_seqlens {len(qb)}")
    outs = [
        _attention_dense_ref(
            q[None, a:b], k[None, c:d], v[None, c:d], causal, softmax_scale, window, sinks, None
        )[0]
        for a, b, c, d in zip(qb[:-1], qb[1:], kb[:-1], kb[1:])
    ]
    return torch.cat(outs, dim=0) if outs else q.new_zeros(q.shape)
