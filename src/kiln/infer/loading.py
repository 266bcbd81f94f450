"""Loading a model, its tokenizer and its end-of-sequence ids for inference, from any source kiln reads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.model.checkpoint import load_for_generation, load_source, tokenizer_dir
from kiln.model.transformer import Transformer
from kiln.quant.apply import is_quantized_dir, load_quantized
from kiln.quant.gptq_format import gptq_config, load_gptq
from kiln.tokenizer import Tokenizer


def eos_ids(path: str | Path | None, tokenizer: Tokenizer | None) -> list[int]:
    """End ids from generation_config.json / config.json (HF) in `path`, else the tokenizer's
    <|endoftext|>, else none."""
    path = Path(path) if path is not None else None
    for name in ("generation_config.json", "config.json"):
        f = path / name if path is not None and path.is_dir() else None
        if f is not None and f.is_file():
            try:
                eos = json.loads(f.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                continue
            if isinstance(eos, int):
                return [eos]
            if isinstance(eos, list) and eos:
                return [int(e) for e in eos]
    if tokenizer is not None and "<|endoftext|>" in tokenizer.special_tokens:
        return [tokenizer.special_tokens["<|endoftext|>"]]
    return []


def load_for_inference(
    path: str | Path, device: torch.device, dtype: torch.dtype
) -> tuple[Transformer, Tokenizer | None]:
    """(model on `device` in `dtype`, its tokenizer or None) from an HF checkpoint directory, a kiln model
    directory, a quantized model directory (`kiln quantize`) or GPTQ checkpoint, or a `kiln run` directory / checkpoint."""
    if not Path(path).exists():
        raise KilnError(
            f"{path} does not exist: give an HF checkpoint directory, a kiln model directory or a run"
        )
    if is_quantized_dir(path):  # `kiln quantize` output: QuantLinears in place of the float linears
        model = load_quantized(path, device, dtype)
    elif gptq_config(path) is not None:  # a GPTQ checkpoint written by another tool
        model = load_gptq(path, device, dtype)
    else:
        model, _ = load_source(path, device=device, dtype=dtype)
    tok_dir = tokenizer_dir(path)
    tok = Tokenizer.load(tok_dir) if tok_dir is not None else None  # none: prompts as token ids only
    return model, tok


def load_generation_source(
    path: str | Path, device: torch.device, dtype: torch.dtype
) -> tuple[Transformer, Tokenizer]:
    """`kiln generate`'s model and tokenizer: every source `kiln.model.checkpoint.load_for_generation` reads
    (runs, checkpoints, kiln and HF directories), and quantized (`kiln quantize`) or GPTQ directories, whose
    tokenizer lies beside the weights."""
    if Path(path).is_dir() and (is_quantized_dir(path) or gptq_config(path) is not None):
        model, tok = load_for_inference(path, device, dtype)
        if tok is None:
            raise KilnError(
                f"no tokenizer beside the weights in {path}: `kiln quantize` copies its source's tokenizer; "
                "put tokenizer.json and tokenizer_config.json there"
            )
        return model, tok
    return load_for_generation(path, device, dtype)
