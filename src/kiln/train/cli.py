"""`kiln run`: the main job (`kiln generate` runs through the engine: kiln.infer.cli)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import textwrap
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.train.config import PRESETS, RESUMABLE, RunConfig, resolve_config, resume_config


def _run(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.train.run import run

    overrides = list(extra)
    if args.data is not None:
        overrides.append(f"--data.path={args.data}")
    if args.out is not None:
        overrides.append(f"--out_dir={args.out}")
    if args.device is not None:
        overrides.append(f"--device={args.device}")
    _check_out(args.out)
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
    _check_out(cfg.out_dir)
    if cfg.data.path is not None and not Path(cfg.data.path).exists():  # before the run directory is made
        raise KilnError(
            f"data path {cfg.data.path} does not exist: pass --data PATH to a text/JSONL/parquet file or a directory"
        )
    run(
        cfg,
        resume=resume,
        progress=not args.no_progress,
        stop_at=args.stop_at,
        overwrite=args.overwrite,
        resume_from=args.resume_from,
    )
    return 0


def _check_out(out: str | None) -> None:
    if out is not None and Path(out).exists() and not Path(out).is_dir():
        raise KilnError(f"--out {out} is an existing file, not a directory: choose a directory for the run")


def _preset(args: argparse.Namespace) -> str:
    if args.preset:
        return args.preset
    dev = args.device or "auto"
    return "gpu" if dev.startswith("cuda") or (dev == "auto" and torch.cuda.is_available()) else "cpu"


def config_help(width: int = 100) -> str:
    """The config keys `kiln run` takes, section by section (read from RunConfig itself), and where the
    presets are."""
    import textwrap
    from importlib import resources

    top, lines = [], []
    for f in dataclasses.fields(RunConfig):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            keys = ", ".join(g.name for g in dataclasses.fields(f.default_factory) if g.init)
            lines += textwrap.wrap(
                keys, width, initial_indent=f"  {f.name + ':':<11}", subsequent_indent=" " * 13
            )
        else:
            top.append(f.name)
    presets = resources.files("kiln.configs")
    return "\n".join(
        [
            "config: the preset <- --config FILE (JSON, the same sections) <- --section.key=VALUE overrides",
            "(e.g. --train.steps=100 --model.n_layers=2); unknown keys are errors. Sections and keys:",
            f"  {'(top)':<11}{', '.join(top)}",
            *lines,
            *textwrap.wrap(
                f"presets: {', '.join(PRESETS)}, the files {presets}/{{{','.join(PRESETS)}}}.json, each a full "
                "example of these sections. The resolved config is printed at the start of a run and saved "
                "in RUN_DIR/config.json.",
                width,
            ),
        ]
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="the whole pipeline: corpus -> tokenizer -> shards -> training -> samples",
        description=textwrap.fill(
            "Run the main job. Any config key can be overridden with --section.key=value "
            "(e.g. --train.steps=100 --model.n_layers=2). With --resume (or --resume-from) the run's saved "
            "config.json is the base (then --config FILE, then overrides), and only these settings may change: "
            + ", ".join(RESUMABLE)
            + "; a change to any other (data, tokenizer, model, batch, optimizer, seeds) is refused.",
            100,
        ),
        epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--preset", choices=PRESETS, help="config preset (default: gpu on CUDA machines, else cpu)"
    )
    p.add_argument(
        "--config", help="a JSON file merged over the preset (with --resume: over the run's config.json)"
    )
    p.add_argument(
        "--data",
        help="a text file (split into documents at blank lines, each 2-8 KB), a directory (one document per "
        "UTF-8 text file; binary and non-UTF-8 files skipped with a note), a JSONL file ('text' field) or "
        "parquet file ('text' column) (default: the bundled corpus)",
    )
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
