"""`kiln run` and `kiln generate`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.train.config import PRESETS, RESUMABLE, resolve_config, resume_config


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.train.run import run

    overrides = list(extra)
    if args.data is not None:
        overrides.append(f"--data.path={args.data}")
    if args.out is not None:
        overrides.append(f"--out_dir={args.out}")
    if args.device is not None:
        overrides.append(f"--device={args.device}")
    resume = args.resume or args.resume_from is not None
    if resume:
        # the run's own saved config <- --config FILE <- overrides; run() then refuses any change the
        # checkpoint cannot take (RESUMABLE lists what may change). --preset only names the default --out.
        preset_out = resolve_config(_preset(args)).out_dir
        run_dir = Path(args.out or preset_out)
        saved = run_dir / "config.json"
        if not saved.exists():
            raise KilnError(f"nothing to resume in {run_dir} (no config.json): pass --out RUN_DIR")
        try:
            saved_cfg = json.loads(saved.read_text())
        except json.JSONDecodeError as e:
            raise KilnError(f"{saved} is not valid JSON ({e}): restore it to resume") from None
        cfg = resume_config(saved_cfg, args.config, overrides)
    else:
        cfg = resolve_config(_preset(args), args.config, overrides)
    run(
        cfg,
        resume=resume,
        progress=not args.no_progress,
        stop_at=args.stop_at,
        overwrite=args.overwrite,
        resume_from=args.resume_from,
    )
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
        "(e.g. --train.steps=100 --model.n_layers=2). With --resume (or --resume-from) the run's saved "
        "config.json is the base (then --config FILE, then overrides), and only these settings may change: "
        + ", ".join(RESUMABLE)
        + "; a change to any other (data, tokenizer, model, batch, optimizer, seeds) is refused.",
    )
    p.add_argument(
        "--preset", choices=PRESETS, help="config preset (default: gpu on CUDA machines, else cpu)"
    )
    p.add_argument(
        "--config", help="a JSON file merged over the preset (with --resume: over the run's config.json)"
    )
    p.add_argument("--data", help="text file, directory, JSONL or parquet (default: the bundled corpus)")
    p.add_argument("--out", help="run directory (default: the preset's out_dir)")
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its newest intact checkpoint"
    )
    p.add_argument(
        "--resume-from",
        metavar="STEP|FILE",
        help="resume from this checkpoint (a step number or a .pt file) instead of the newest intact one; "
        "later checkpoints are set aside as step_N.pt.superseded",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a directory that holds an earlier run: delete its checkpoints, metrics, "
        "loss.png, summary and config first (its tokenizer and shards are reused when their settings match)",
    )
    p.add_argument(
        "--stop-at",
        type=int,
        metavar="STEP",
        help="stop after this step (checkpointed; 0: before training); continue later with --resume",
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
