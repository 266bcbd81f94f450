"""`kiln convert SRC OUT` (HF <-> kiln, both ways) and `kiln model summary CONFIG|DIR`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.model.checkpoint import describe_source, load_source, save_model_dir, tokenizer_dir
from kiln.model.config import ModelConfig
from kiln.model.hf import save_pretrained
from kiln.model.hf_config import ARCH_TO_HF
from kiln.tokenizer import Tokenizer, formats

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def _bytes(text: str) -> int:
    t = text.strip().upper()
    num = t.rstrip("KMGIB")
    unit = t[len(num) :]
    try:
        value = float(num)
    except ValueError:
        value = -1
    if unit not in _UNITS or value <= 0:
        raise KilnError(f"--shard-size {text!r} is not a size: write e.g. 5GB, 500MB or 2000000000")
    return int(value * _UNITS[unit])


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def _source_tokenizer(src: str, vocab_size: int) -> tuple[Tokenizer | None, str | None]:
    """The tokenizer (and chat template) that goes with model source `src`, to write beside the converted
    weights; None, with a note on stderr, when there is none kiln can read."""
    where = tokenizer_dir(src)
    if where is None:
        print(
            f"kiln: note: no tokenizer found with {src}: only the weights are written "
            "(`kiln generate` needs a tokenizer beside them)",
            file=sys.stderr,
        )
        return None, None
    try:
        tok = Tokenizer.load(where)
        template = formats.load_chat_template(where)
    except KilnError as e:
        print(f"kiln: note: the tokenizer in {where} is not written with the model: {e}", file=sys.stderr)
        return None, None
    if tok.n_vocab > vocab_size:
        raise KilnError(
            f"the tokenizer in {where} has {tok.n_vocab} ids but the model's vocabulary only {vocab_size}: "
            "they do not belong together"
        )
    return tok, template


def _convert(args: argparse.Namespace, extra: list[str]) -> int:
    dtype = DTYPES[args.dtype] if args.dtype else None
    out = Path(args.out)  # checked before the (possibly long) load
    if out.exists() and not out.is_dir():
        raise KilnError(f"{out} exists and is not a directory: give a directory for the converted model")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise KilnError(f"{out} exists and is not empty: choose another directory or pass --force")
    shard_bytes = _bytes(args.shard_size)
    model, kind = load_source(args.src, "cpu", dtype or torch.float32)
    to = args.to or ("kiln" if kind == "hf" else "hf")
    tok, template = _source_tokenizer(args.src, model.config.vocab_size)
    if to == "hf":
        save_pretrained(model, out, max_shard_bytes=shard_bytes, tokenizer=tok, chat_template=template)
        fmt = f"Hugging Face {ARCH_TO_HF[model.config.arch]}"
    else:
        save_model_dir(model, out)
        if tok is not None:
            # kiln's files and HF's tokenizer.json + tokenizer_config.json, as a run's tokenizer/ holds them
            tok.save(out, chat_template=template, model_max_length=model.config.max_seq_len)
        fmt = "kiln model directory"
    if tok is not None:
        fmt += f", with its tokenizer ({tok.n_vocab} ids)"
    n = sum(p.numel() for p in model.parameters())
    dt = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(
        f"converted {args.src} ({kind}, {model.config.arch}, {_human(n)} parameters, {dt}) -> {out} ({fmt})"
    )
    return 0


def summary_text(cfg: ModelConfig, source: str = "") -> str:
    """The report `kiln model summary` prints."""
    counts = cfg.param_counts()
    total = sum(counts.values())
    kv = f"{cfg.n_kv_heads} KV heads" + (
        f", GQA {cfg.n_heads // cfg.n_kv_heads}:1" if cfg.n_kv_heads != cfg.n_heads else ""
    )
    if cfg.n_experts:
        mlp = f"MoE {cfg.n_experts} SwiGLU experts, top-{cfg.n_experts_per_tok}, hidden {cfg.ffn_hidden}"
    elif cfg.arch == "gpt2":
        mlp = f"GELU ({cfg.hidden_act}) MLP, hidden {cfg.ffn_hidden}"
    else:
        mlp = f"SwiGLU MLP, hidden {cfg.ffn_hidden}"
    if cfg.uses_rope:
        pos = f"RoPE theta {cfg.rope_theta:g} ({cfg.rope_type}{', interleaved' if cfg.rope_interleaved else ''})"
    else:
        pos = f"learned positions ({cfg.max_seq_len})"
    extras = [
        x
        for x, on in (
            ("q/k/v bias", cfg.qkv_bias),
            ("q/k RMSNorm", cfg.qk_norm),
            (f"sliding window {cfg.sliding_window}", cfg.sliding_window),
            ("attention sinks", cfg.attn_sinks),
            ("biases", cfg.has_bias),
        )
        if on
    ]
    lines = [
        f"model: {cfg.arch} ({ARCH_TO_HF[cfg.arch]} layout)" + (f" from {source}" if source else ""),
        f"  d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads ({kv}), head_dim {cfg.head_dim}, "
        f"vocab {cfg.vocab_size}, context {cfg.max_seq_len}",
        f"  {'LayerNorm' if cfg.has_bias else 'RMSNorm'} eps {cfg.norm_eps:g} | {pos} | {mlp} | "
        f"{'tied' if cfg.tie_embeddings else 'untied'} head" + (" | " + ", ".join(extras) if extras else ""),
        "parameters",
    ]
    for name, n in counts.items():
        name = "experts+router" if name == "mlp" and cfg.n_experts else name
        lines.append(f"  {name:<16}{n:>16,}  {100 * n / total:5.1f}%")
    lines.append(f"  {'total':<16}{total:>16,}  (non-embedding {cfg.num_params(non_embedding=True):,})")
    if cfg.n_experts:
        lines.append(f"  active per token (matmul weights): {cfg.active_matmul_params():,}")
    T = cfg.max_seq_len
    f = cfg.flops_per_token(T)
    dense = 6.0 * cfg.active_matmul_params()
    lines.append(
        f"training FLOPs per token at seq {T}: {f:.4g} (weights {dense:.4g} + attention {f - dense:.4g}); "
        f"inference forward {f / 3:.4g}"
    )
    b16, b32 = cfg.kv_bytes_per_token(torch.bfloat16), cfg.kv_bytes_per_token(torch.float32)
    lines.append(
        f"KV cache per token: {b16:,} B in bf16 ({b32:,} B in fp32); a full {T}-token context: "
        f"{_human(b16 * T, 'B')} in bf16"
    )
    return "\n".join(lines)


def _summary(args: argparse.Namespace, extra: list[str]) -> int:
    cfg, kind = describe_source(args.source)
    print(summary_text(cfg, f"{args.source} ({kind})"))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a model between Hugging Face and kiln formats",
        description="HF checkpoint dir -> kiln model dir, or kiln model dir / training checkpoint / sharded DCP "
        "checkpoint (kiln.dist.checkpoint.save_sharded) -> HF dir "
        "(config.json + safetensors, sharded with an index above --shard-size). The source's tokenizer (a "
        "run's tokenizer/, or the one beside the weights) is written beside the converted weights: HF's "
        "tokenizer.json + tokenizer_config.json, plus kiln's own files in a kiln model dir.",
    )
    p.add_argument(
        "src", help="HF checkpoint dir, kiln model dir, training run / checkpoint, or sharded DCP dir"
    )
    p.add_argument("out", help="output directory")
    p.add_argument("--to", choices=("hf", "kiln"), help="output format (default: the other one)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast the weights (default: float32)")
    p.add_argument(
        "--shard-size", default="5GB", help="largest safetensors shard for HF output (default 5GB)"
    )
    p.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    p.set_defaults(func=_convert)

    m = sub.add_parser("model", help="inspect model configs")
    msub = m.add_subparsers(dest="model_command", required=True)
    s = msub.add_parser(
        "summary",
        help="architecture, parameters by part, FLOPs and KV bytes per token",
        description="CONFIG|DIR: an HF dir or config.json, a kiln model dir or model.json, a run dir, "
        "checkpoint or run config, or a preset name.",
    )
    s.add_argument("source", metavar="CONFIG|DIR")
    s.set_defaults(func=_summary)
