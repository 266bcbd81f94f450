"""`kiln quantize --model PATH --scheme int8|int4-g128|fp8 --out DIR`: a quantized model directory.

PATH is any model source kiln reads (an HF checkpoint directory, a kiln model directory, a training run or
checkpoint). Round-to-nearest by default; `--method gptq --calib FILE` calibrates on a text file (the
model's tokenizer encodes it; --calib-tokens of it in --calib-seq-len windows). The output directory
(kiln.quant.apply) loads in the inference engine (`kiln bench infer`, `kiln serve`, `LLM(DIR)`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.io.atomic import atomic_write_bytes
from kiln.model.checkpoint import load_source, tokenizer_dir
from kiln.quant.apply import quantize_model, save_quantized
from kiln.quant.gptq_format import save_gptq
from kiln.quant.scheme import SCHEME_NAMES, QuantScheme
from kiln.tokenizer import Tokenizer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# files beside the weights that belong with the model: its tokenizer and HF's generation settings
COPIED = ("kiln_tokenizer.json", "tokenizer.tiktoken", "tokenizer.json", "tokenizer_config.json", "vocab.json",
          "merges.txt", "chat_template.jinja", "generation_config.json")  # fmt: skip


def calibration_batches(
    text_file: Path, tok: Tokenizer, tokens: int, seq_len: int, batch: int = 8
) -> list[torch.Tensor]:
    """The first `tokens` ids of the file in (batch, seq_len) windows (the last batch may be smaller)."""
    try:
        text = text_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KilnError(
            f"--calib {text_file} does not exist: give a UTF-8 text file to calibrate on"
        ) from None
    except UnicodeDecodeError:
        raise KilnError(f"--calib {text_file} is not UTF-8 text") from None
    ids = tok.encode_ordinary(text)[:tokens]
    n = len(ids) // seq_len
    if n == 0:
        raise KilnError(
            f"--calib {text_file} has {len(ids)} tokens, fewer than one window of --calib-seq-len {seq_len}: "
            "give more text or a shorter window"
        )
    windows = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    return list(windows.split(batch))


def _quantize(args: argparse.Namespace, extra: list[str]) -> int:
    scheme = QuantScheme.parse(
        args.scheme,
        asymmetric=args.asymmetric,
        method=args.method,
        act_order=args.act_order,
        head=not args.no_head,
    )
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise KilnError(f"{out} exists and is not a directory: give a directory for the quantized model")
    if out.exists() and any(out.iterdir()) and not args.force:
        raise KilnError(f"{out} exists and is not empty: choose another directory or pass --force")
    if not Path(args.model).exists():
        raise KilnError(f"--model {args.model} does not exist: give a model directory or a training run")
    if args.calib_seq_len <= 0 or args.calib_tokens <= 0:
        raise KilnError("--calib-tokens and --calib-seq-len must be positive")
    if scheme.method == "gptq" and args.calib is None:
        raise KilnError("--method gptq calibrates on text: pass --calib FILE")
    if args.calib is not None and scheme.method != "gptq":
        raise KilnError("--calib is used by GPTQ only: add --method gptq, or drop --calib")
    if args.format == "gptq" and (scheme.kind != "int4" or scheme.head):
        raise KilnError("--format gptq holds int4 with the LM head in float: use --scheme int4-gN --no-head")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    model, kind = load_source(args.model, device, torch.float32)
    model.eval()
    tok_dir = tokenizer_dir(args.model)
    calib = None
    if scheme.method == "gptq":
        if tok_dir is None:
            raise KilnError(
                f"GPTQ needs the model's tokenizer to encode --calib, and none is with {args.model}"
            )
        calib = [b.to(device) for b in calibration_batches(Path(args.calib), Tokenizer.load(tok_dir),
                                                             args.calib_tokens, args.calib_seq_len)]  # fmt: skip
    names = quantize_model(model, scheme, calib, log=lambda s: print(s, file=sys.stderr))
    if args.format == "gptq":
        save_gptq(model, scheme.group_size, not scheme.asymmetric, out, DTYPES[args.dtype])
    else:
        save_quantized(model, scheme, out, DTYPES[args.dtype])
    # the tokenizer and generation settings, from the tokenizer's directory or else beside the weights
    where = [d for d in (tok_dir, Path(args.model)) if d is not None and d.is_dir()]
    for f in COPIED:
        found = next((d / f for d in where if (d / f).is_file()), None)
        if found is not None:
            atomic_write_bytes(out / f, found.read_bytes())
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(
        f"quantized {args.model} ({kind}, {model.config.arch}) with {scheme.name} ({scheme.method}"
        f"{', act-order' if scheme.act_order else ''}{', asymmetric' if scheme.asymmetric else ''}): "
        f"{len(names)} linears{' incl. the head' if 'lm_head' in names else ''} -> {out} "
        f"({size / 1e6:.1f} MB, {time.perf_counter() - t0:.1f} s)"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="quantize a model's linears to int8, int4 or fp8",
        description="Writes a quantized model directory (model.json, model.safetensors, quant_config.json, the "
        "tokenizer) that the inference engine loads. Schemes: int8 (per output channel), int4-g32/64/128 "
        "(groups along K, symmetric or --asymmetric), fp8 (e4m3 weights per channel, activations per row).",
    )
    p.add_argument(
        "--model", required=True, help="HF checkpoint dir, kiln model dir, or training run / checkpoint"
    )
    p.add_argument("--scheme", required=True, choices=SCHEME_NAMES)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--method", choices=("rtn", "gptq"), default="rtn", help="round-to-nearest or GPTQ")
    p.add_argument("--calib", help="GPTQ calibration text file (UTF-8)")
    p.add_argument("--calib-tokens", type=int, default=65536, help="tokens of --calib to use")
    p.add_argument("--calib-seq-len", type=int, default=512, help="window length of the calibration batches")
    p.add_argument("--act-order", action="store_true", help="GPTQ: columns in decreasing Hessian diagonal")
    p.add_argument("--asymmetric", action="store_true", help="int4: a zero point per group")
    p.add_argument("--no-head", action="store_true", help="keep the LM head in float")
    p.add_argument(
        "--format",
        choices=("kiln", "gptq"),
        default="kiln",
        help="kiln's quantized directory, or an HF GPTQ checkpoint (int4, float head) other tools read",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the float tensors")
    p.add_argument("--device", help="where to quantize (default: cuda when present)")
    p.add_argument("--force", action="store_true", help="write into a non-empty output directory")
    p.set_defaults(func=_quantize)
