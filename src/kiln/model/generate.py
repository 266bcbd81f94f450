"""Autoregressive generation with a KV cache: one prefill pass over the prompt, then one token per pass.

Left-padded batches: pass attention_mask (B, T) with 0 on the pads; positions then count only real
tokens (cumsum of the mask - 1), as transformers' generate does, so a padded row generates exactly what
it would alone. Streaming (StreamingLLM): `streaming=(n_sink, window)` keeps the first n_sink tokens and
the last `window` in the cache, so generation can run far past the training length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.sampling import sample
from kiln.model.cache import ContiguousKVCache, StreamingKVCache


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    streaming: tuple[int, int] | None = None,
) -> torch.Tensor:
    """input_ids (B, T) -> (B, T + n) with n <= max_new_tokens new tokens.

    temperature 0 is greedy; top_k / top_p filter before sampling (kiln.kernels.sampling.sample). With
    eos_id, a row that has produced it keeps producing eos_id, and generation stops early once every row
    has (so n < max_new_tokens then). generator makes sampling reproducible.
    """
    cfg = model.config
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, seq) with seq >= 1, got {tuple(input_ids.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    B, T = input_ids.shape
    dev = input_ids.device
    if streaming is not None:
        n_sink, window = streaming
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("streaming generation does not take padded batches: generate each row alone")
        attention_mask = None
        cache = StreamingKVCache(cfg.n_layers, n_sink, window)
    else:
        if cfg.arch == "gpt2" and T + max_new_tokens > cfg.max_seq_len:
            raise ValueError(
                f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds GPT-2's {cfg.max_seq_len} learned "
                "positions: shorten them, or pass streaming=(n_sink, window)"
            )
        cache = ContiguousKVCache(
            cfg.n_layers, B, T + max_new_tokens, cfg.n_kv_heads, cfg.head_dim, model.head_weight.dtype, dev
        )
    position_ids = None
    if attention_mask is not None:
        attention_mask = attention_mask.to(device=dev, dtype=torch.long)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    was_training = model.training
    model.eval()
    try:
        out = [input_ids]
        if max_new_tokens == 0:
            return input_ids
        h, _ = model.hidden_states(input_ids, position_ids, attention_mask, cache)
        logits = F.linear(h[:, -1], model.head_weight)  # (B, V)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        for step in range(max_new_tokens):
            nxt = sample(logits, temperature, top_k, top_p, generator)  # (B,)
            if eos_id is not None:
                nxt = torch.where(finished, torch.full_like(nxt, eos_id), nxt)
                finished |= nxt == eos_id
            out.append(nxt[:, None])
            if step == max_new_tokens - 1 or (eos_id is not None and bool(finished.all())):
                break
            if attention_mask is not None:
                attention_mask = torch.cat((attention_mask, attention_mask.new_ones(B, 1)), dim=1)
                position_ids = position_ids[:, -1:] + 1
            h, _ = model.hidden_states(nxt[:, None], position_ids, attention_mask, cache)
            logits = F.linear(h[:, -1], model.head_weight)
        return torch.cat(out, dim=1)
    finally:
        model.train(was_training)
