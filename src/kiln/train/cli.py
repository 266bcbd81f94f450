"""`kiln run` and `kiln generate`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kiln.config import merge, parse_overrides
from kiln.errors import KilnError
from kiln.train.config import PRESETS, config_from_dict, resolve_config


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.train.run import run

    overrides = list(extra)
    if args.data is not None:
        overrides.append(f"--data.path={args.data}")
    if args.out is not None:
        overrides.append(f"--out_dir={args.out}")
    if args.device is not None:
        overrides.append(f"--device={args.device}")
    if args.resume:
        # the run's own saved config, with only the explicit overrides on top
        preset_out = resolve_config(_preset(args)).out_dir
        run_dir = Path(args.out or preset_out)
        saved = run_dir / "config.json"
        if not saved.exists():
            raise KilnError(f"nothing to resume in {run_dir} (no config.json): pass --out RUN_DIR")
        cfg = config_from_dict(merge(json.loads(saved.read_text()), parse_overrides(overrides)))
    else:
        cfg = resolve_config(_preset(args), args.config, overrides)
    run(cfg, resume=args.resume, progress=not args.no_progress, stop_at=args.stop_at)
    return 0


def _preset(args: argparse.Namespace) -> str:
    if args.preset:
        return args.preset
    dev = args.device or "auto"
    return "gpu" if dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available()) else "cpu"


def _generate(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.train.env import resolve_device
    from kiln.train.generate import complete, load_for_generation

    device = resolve_device(args.device or "auto")
    model, tok = load_for_generation(args.checkpoint, device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    for _ in range(args.n):
        text = complete(
            model,
            tok,
            args.prompt,
            args.max_new_tokens,
            args.temperature,
            args.top_k or None,
            args.top_p,
            gen,
            device,
        )
        print(args.prompt + text)
        if args.n > 1:
            print("---")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="the whole pipeline: corpus -> tokenizer -> shards -> training -> samples",
        description="Run the main job. Any config key can be overridden with --section.key=value "
        "(e.g. --train.steps=100 --model.n_layers=2).",
    )
    p.add_argument(
        "--preset", choices=PRESETS, help="config preset (default: gpu on CUDA machines, else cpu)"
    )
    p.add_argument("--config", help="a JSON file merged over the preset")
    p.add_argument("--data", help="text file, directory, JSONL or parquet (default: the bundled corpus)")
    p.add_argument("--out", help="run directory (default: the preset's out_dir)")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its latest checkpoint"
    )
    p.add_argument(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="stop after this step (checkpointed); continue later with --resume",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")
    p.set_defaults(func=_run, accepts_overrides=True)

    g = sub.add_parser("generate", help="sample text from a checkpoint")
    g.add_argument("--checkpoint", required=True, help="run directory, its checkpoints/ or a .pt file")
    g.add_argument("--prompt", default="", help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--top-k", type=int, default=50, help="0 disables")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--n", type=int, default=1, help="number of samples")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", help="auto (default), cpu, cuda")
    g.set_defaults(func=_generate)
