"""Token sampling from logits: greedy, temperature, top-k and top-p (nucleus), batched.

sample(logits (B, V), temperature, top_k, top_p, generator) -> ids (B,) int64.
temperature == 0 means greedy (argmax). top_k <= 0 or None disables top-k; top_p >= 1 or None
disables top-p. Top-k is applied before top-p; the token with the highest probability always
survives. Draws use the exponential-race trick (argmax of p / Exp(1)), which needs no host sync
and no cumulative sampling, so a fused kernel can reproduce it.

Only the eager reference lives here so far; the Triton kernel plugs in behind `sample`.
"""

from __future__ import annotations

import torch


def sample_ref(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"sample expects logits of shape (batch, vocab), got {tuple(logits.shape)}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits.float() / temperature
    V = z.shape[-1]
    if top_k is not None and 0 < top_k < V:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps at least one)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sorted_z)
    probs = torch.softmax(z, dim=-1)
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / noise).argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    return sample_ref(logits, temperature, top_k, top_p, generator)
