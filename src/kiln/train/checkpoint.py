"""A training run's checkpoint policy over kiln.io's file format: which one a resume takes, what happens
to later ones, and the check that no checkpoint holds non-finite parameters.

The format itself (step_*.pt + LATEST.json, atomic writes, verification) is `kiln.io.checkpoint`, which
model/ and infer/ read too.

Two checkpoint formats (`train.checkpoint_format`):
- full: step_N.pt holds the whole state (a sharded or pipelined run gathers it on rank 0 first);
- dcp: each rank writes its own shards into the directory step_N.dcp (kiln.dist.checkpoint, atomic:
  written as step_N.dcp.tmp, renamed), then rank 0 writes step_N.pt, which holds the rest of the
  training state (step, schedule, loader, RNG, config) and names the directory under "sharded". The
  .pt file is what LATEST.json points to and checksums, so a crash before it is written leaves an
  uncommitted directory that is never loaded (and is replaced by the next save of that step).
auto (the default) is dcp when the model exists whole only after a collective (FSDP2, TP, PP) and
full otherwise (one process, DDP, ZeRO-1).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.io.checkpoint import (
    checkpoint_name,
    checkpoint_records,
    list_checkpoints,
    load_newest_intact,
    read_checkpoint,
    save_checkpoint,
    step_of,
)

SET_ASIDE = ".superseded"
FORMATS = ("auto", "full", "dcp")


def sharded_name(step: int) -> str:
    """The directory of a dcp checkpoint beside its step_N.pt: step_N.dcp."""
    return checkpoint_name(step)[: -len(".pt")] + ".dcp"


def resolve_format(fmt: str, gathers: bool) -> str:
    """The format a run writes: `gathers` says whether its model exists whole only after a collective."""
    if fmt == "auto":
        return "dcp" if gathers else "full"
    if fmt == "dcp" and not gathers:
        raise KilnError(
            "train.checkpoint_format=dcp writes each rank's shards of a sharded or pipelined model "
            "(parallel.dp_shard, tp or pp > 1); this run holds the whole model on every rank: use "
            "train.checkpoint_format=full (or auto)"
        )
    return fmt


def prune_sharded(ckpt_dir: Path) -> None:
    """Delete the step_N.dcp directories whose step_N.pt is gone (pruned by keep_checkpoints)."""
    for d in ckpt_dir.glob("step_*.dcp"):
        if d.is_dir() and not (ckpt_dir / (d.name[: -len(".dcp")] + ".pt")).exists():
            shutil.rmtree(d)


def choose_resume_checkpoint(
    ckpt_dir: Path,
    resume_from: str | None,
    map_location: str | torch.device,
    warn: Callable[[str], None],
) -> tuple[dict[str, Any], Path]:
    """(state, file) to resume from: `resume_from` (a step number or a .pt file) or the newest intact one."""
    if resume_from is None:
        return load_newest_intact(ckpt_dir, map_location, warn)
    if resume_from.isdigit():
        file = ckpt_dir / checkpoint_name(int(resume_from))
        if not file.is_file():
            steps = ", ".join(str(step_of(f)) for f in list_checkpoints(ckpt_dir)) or "none"
            raise KilnError(
                f"--resume-from {resume_from}: {ckpt_dir} has no checkpoint of step {int(resume_from)} "
                f"(it has steps: {steps})"
            )
    else:
        file = Path(resume_from)
        if not file.is_file():
            raise KilnError(
                f"--resume-from {resume_from}: no such file; pass a step number or a checkpoint .pt file"
            )
    return read_checkpoint(file, map_location, checkpoint_records(file.parent).get(file.name)), file


def set_aside_later(ckpt_dir: Path, step: int) -> list[Path]:
    """Rename the checkpoints of steps after `step` to step_N.pt.superseded: a run resumed from an earlier
    checkpoint would otherwise overwrite them; renamed, they are kept but never loaded or pruned."""
    moved = []
    for f in list_checkpoints(ckpt_dir):
        if step_of(f) > step:
            dest = f.with_name(f.name + SET_ASIDE)
            f.replace(dest)
            moved.append(dest)
            shards = ckpt_dir / sharded_name(step_of(f))
            if shards.is_dir():  # a dcp checkpoint's directory goes aside with its .pt (as the .pt
                aside = shards.with_name(shards.name + SET_ASIDE)  # does, replacing an older copy)
                shutil.rmtree(aside, ignore_errors=True)
                shards.replace(aside)
    return moved


def check_finite(model: torch.nn.Module | dict[str, torch.Tensor], step: int) -> None:
    """Refuse to checkpoint non-finite parameters (one host sync; checkpoints are rare). `model` may be
    a state dict (a sharded run's gathered state)."""
    tensors = model.values() if isinstance(model, dict) else model.parameters()
    finite = torch.stack([torch.isfinite(p).all() for p in tensors]).all()
    if not bool(finite):
        raise not_finite_error(step)


def check_finite_sharded(model: torch.nn.Module, step: int) -> None:
    """check_finite over every rank's shards (a collective: the same decision on every rank)."""
    from torch.distributed.tensor import DTensor

    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    finite = torch.stack([torch.isfinite(p).all() for p in local]).all().float().reshape(1)
    torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
    if not bool(finite[0]):
        raise not_finite_error(step)


def not_finite_error(step: int) -> KilnError:
    return KilnError(
        f"the parameters are not finite at step {step}: no checkpoint was written (LATEST.json still "
        "names the last good one). Lower train.lr or raise train.warmup_steps, then --resume"
    )


__all__ = [
    "choose_resume_checkpoint",
    "set_aside_later",
    "check_finite",
    "check_finite_sharded",
    "save_checkpoint",
    "resolve_format",
    "sharded_name",
    "prune_sharded",
]
