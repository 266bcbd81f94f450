"""`kiln bench infer`: the inference engine's latency and throughput (kiln.infer.bench)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from kiln.errors import KilnError


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _bench_infer(args: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from kiln.infer import bench
    from kiln.infer.config import EngineConfig
    from kiln.infer.engine import LLM
    from kiln.model.config import KernelConfig
    from kiln.model.transformer import build_model

    engine = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(args.batch_sizes),
        max_num_batched_tokens=max(args.max_num_batched_tokens, max(args.batch_sizes)),
        kernels=KernelConfig(linear=args.linear, attention="kiln"),
    )
    cfg = EngineConfig(**engine)
    if args.model:
        llm = LLM(args.model, **engine)
        what = args.model
    else:  # random weights of a reference shape: speed does not depend on the values
        device = cfg.resolve_device()
        mcfg = bench.qwen2_1p5b_config(max_seq_len=args.prompt_len + args.output_len)
        model = build_model(mcfg, device=device, dtype=cfg.resolve_dtype(device), seed=0)
        llm = LLM(model, **engine)
        what = "random-init Qwen2.5-1.5B shape"
    need = args.prompt_len + args.output_len
    if need > llm.engine.max_model_len:
        raise KilnError(
            f"--prompt-len + --output-len = {need} exceeds the model's context of {llm.engine.max_model_len}"
        )
    print(f"kiln bench infer: {what}, prompt {args.prompt_len}, output {args.output_len} tokens")
    rows = bench.run(llm.engine, args.batch_sizes, args.prompt_len, args.output_len)
    if args.out:
        meta = {
            "model": what,
            "device": torch.cuda.get_device_name() if llm.engine.device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        Path(args.out).write_text(json.dumps({**meta, "points": rows}, indent=2) + "\n")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure kiln (the inference engine: `kiln bench infer`)")
    areas = p.add_subparsers(dest="area", required=True)
    b = areas.add_parser(
        "infer",
        help="the engine's TTFT and decode/total tokens per second at several batch sizes",
        description="Greedy decoding of random prompts through the engine. Without --model, a random-init "
        "model of the Qwen2.5-1.5B shape (speed does not depend on the weights).",
    )
    b.add_argument("--model", help="HF directory, kiln model directory or run (default: a reference shape)")
    b.add_argument("--batch-sizes", type=_ints, default=[1, 8, 64], help="comma-separated (default 1,8,64)")
    b.add_argument("--prompt-len", type=_positive, default=128)
    b.add_argument("--output-len", type=_positive, default=128)
    b.add_argument("--max-num-batched-tokens", type=_positive, default=8192)
    b.add_argument("--linear", choices=("auto", "torch", "kiln"), default="auto", help="matmul backend")
    b.add_argument("--device", default="auto")
    b.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    b.add_argument("--out", help="write the points as JSON here")
    b.set_defaults(func=_bench_infer)
