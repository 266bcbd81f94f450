"""Autoregressive generation with a KV cache: one prefill pass over the prompt, then one token per pass;
and the checks and prompt planning every generation front end shares (`check_sampling`, `plan_generation`:
`kiln generate` through the engine, and the samples `kiln run` writes during training).

Left-padded batches: pass attention_mask (B, T) with 0 on the pads; positions then count only real
tokens (cumsum of the mask - 1), as transformers' generate does, so a padded row generates exactly what
it would alone. Streaming (StreamingLLM): `streaming=(n_sink, window)` keeps the first n_sink tokens and
the last `window` in the cache, so generation can run far past the training length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.kernels.sampling import sample
from kiln.model.cache import ContiguousKVCache, StreamingKVCache
from kiln.tokenizer import Tokenizer


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


# ---- the arguments of a generation request (the `kiln generate` front ends share them) -----------------
ENDOFTEXT = "<|endoftext|>"


def check_sampling(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None, n: int = 1
) -> None:
    """KilnError naming the first out-of-range value (and its `kiln generate` flag).

    temperature >= 0 and finite (0 = greedy); top_k >= 1, or 0/None (off); top_p in (0, 1] or None
    (1 or None = off); n >= 1; max_new_tokens >= 0. Out-of-range values would otherwise sample from
    NaN probabilities (top_p 0, temperature nan) and print token 0 (NUL bytes) with exit status 0.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise KilnError(f"temperature (--temperature) must be a number, got {temperature!r}")
    if not math.isfinite(temperature) or temperature < 0:
        raise KilnError(
            f"temperature (--temperature) must be a finite number >= 0 (0 = greedy), got {temperature}"
        )
    if top_p is not None and not (0.0 < top_p <= 1.0):  # also refuses nan
        raise KilnError(f"top_p (--top-p) must be in (0, 1] (1 turns it off), got {top_p}")
    if top_k is not None and top_k < 0:
        raise KilnError(f"top_k (--top-k) must be >= 1, or 0 to turn it off, got {top_k}")
    if n < 1:
        raise KilnError(f"n (--n) is the number of samples and must be >= 1, got {n}")
    if max_new_tokens < 0:
        raise KilnError(f"max_new_tokens (--max-new-tokens) must be >= 0, got {max_new_tokens}")


@dataclass
class Plan:
    """The ids fed to the model and how many tokens fit after them."""

    ids: list[int]  # [eot] + prompt ids, cut from the left when the prompt fills the context
    max_new_tokens: int  # the request, capped at what the context leaves
    prompt_cut: int  # prompt ids dropped from the left (0: none)


def plan_generation(tok: Tokenizer, prompt: str, max_new_tokens: int, max_len: int) -> Plan:
    """Documents start with <|endoftext|> in training, so generation does too (when the tokenizer has
    it). A prompt that leaves less than half the context is cut to its last max_len // 2 ids."""
    eot = tok.special_tokens.get(ENDOFTEXT)
    prompt_ids = tok.encode_ordinary(prompt)
    head = [] if eot is None else [eot]
    if not head and not prompt_ids:
        raise KilnError(f"this tokenizer has no {ENDOFTEXT} to start from: give a --prompt")
    cut = 0
    if len(head) + len(prompt_ids) >= max_len:
        keep = max_len // 2
        cut = len(prompt_ids) - keep
        prompt_ids = prompt_ids[-keep:]
    ids = head + prompt_ids
    return Plan(ids, min(max_new_tokens, max_len - len(ids)), cut)
