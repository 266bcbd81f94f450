"""Sampling text from a trained model, and loading one from a checkpoint for `kiln generate`."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.io.checkpoint import load_checkpoint, resolve_checkpoint
from kiln.model import build_model
from kiln.tokenizer import Tokenizer
from kiln.train.config import config_from_dict


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
    """The text the model writes after `prompt` (documents start with <|endoftext|>, as in training)."""
    model.eval()
    ids = [tok.eot_id] + tok.encode_ordinary(prompt)
    max_len = model.config.max_seq_len
    if len(ids) >= max_len:
        ids = [tok.eot_id] + ids[-(max_len // 2) :]  # keep room to generate
    new = min(max_new_tokens, max_len - len(ids))
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out = model.generate(
        x, new, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=tok.eot_id, generator=generator
    )
    gen = out[0, len(ids) :].tolist()
    if tok.eot_id in gen:
        gen = gen[: gen.index(tok.eot_id)]
    return tok.decode(gen)


def load_for_generation(checkpoint: str | Path, device: torch.device) -> tuple[torch.nn.Module, Tokenizer]:
    """Model and tokenizer of a run: `checkpoint` is the run directory, its checkpoints/ or a .pt file."""
    file = resolve_checkpoint(checkpoint)
    state = load_checkpoint(file, map_location="cpu")
    cfg = config_from_dict(state["config"])
    run_dir = file.parent.parent if file.parent.name == "checkpoints" else file.parent
    tok_dir = run_dir / "tokenizer"
    if not tok_dir.exists():
        raise KilnError(f"no tokenizer beside the checkpoint (expected {tok_dir})")
    tok = Tokenizer.load(tok_dir)
    model = build_model(cfg.model, device=device, dtype=torch.float32, seed=0)
    model.load_state_dict(state["model"])
    return model, tok
