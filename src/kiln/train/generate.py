"""Sampling text from a model during training (the samples `kiln run` writes at its checkpoints)."""

from __future__ import annotations

import torch

from kiln.model.generate import ENDOFTEXT, check_sampling, plan_generation
from kiln.tokenizer import Tokenizer


@torch.no_grad()
def complete(
    model: torch.nn.Module,
    tok: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    device: torch.device,
) -> str:
    """The text the model writes after `prompt`, at most max_new_tokens (capped by the context)."""
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    model.eval()
    plan = plan_generation(tok, prompt, max_new_tokens, model.config.max_seq_len)
    eot = tok.special_tokens.get(ENDOFTEXT)
    x = torch.tensor([plan.ids], dtype=torch.long, device=device)
    out = model.generate(
        x,
        plan.max_new_tokens,
        temperature=temperature,
        top_k=top_k or None,
        top_p=top_p,
        eos_id=eot,
        generator=generator,
    )
    gen = out[0, len(plan.ids) :].tolist()
    if eot is not None and eot in gen:
        gen = gen[: gen.index(eot)]
    return tok.decode(gen)


__all__ = ["complete"]
