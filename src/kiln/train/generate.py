"""Sampling text from a trained model, and loading one for `kiln generate`.

`check_sampling` is the one validation of sampling arguments: `kiln generate` calls it before loading
anything, and any other front end (the inference engine's `kiln generate`) calls the same function so
the same values are refused with the same messages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.model.checkpoint import describe_source, load_source, tokenizer_dir
from kiln.tokenizer import Tokenizer

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


def load_for_generation(checkpoint: str | Path, device: torch.device) -> tuple[torch.nn.Module, Tokenizer]:
    """Model and tokenizer from any model source `kiln generate` takes.

    `checkpoint`: a run directory, its checkpoints/ directory or a step_*.pt file (tokenizer: the run's
    tokenizer/), a kiln model directory (model.json + model.safetensors) or a Hugging Face directory
    (config.json + safetensors); the last two hold their tokenizer beside the weights, as `kiln convert`
    writes them.
    """
    path = Path(checkpoint)
    if not path.exists():
        raise KilnError(
            f"--checkpoint {path} does not exist: pass a run directory, a checkpoint .pt file, "
            "or a model directory written by `kiln convert`"
        )
    tok_dir = tokenizer_dir(path)  # before the weights load: a missing tokenizer fails fast
    if tok_dir is None:
        describe_source(path)  # when `path` is no model at all, that is the message
        raise KilnError(
            f"no tokenizer for {path} (a run keeps it in RUN_DIR/tokenizer/, a model directory beside the "
            "weights): convert the model again with `kiln convert` from its run, which copies the tokenizer, "
            "or put tokenizer.json and tokenizer_config.json beside the weights"
        )
    tok = Tokenizer.load(tok_dir)
    model, _ = load_source(path, device, torch.float32)
    if tok.n_vocab > model.config.vocab_size:
        raise KilnError(
            f"the tokenizer in {tok_dir} has {tok.n_vocab} ids but the model only {model.config.vocab_size}: "
            "they do not belong together"
        )
    return model, tok


__all__ = ["Plan", "check_sampling", "complete", "load_for_generation", "plan_generation"]
