"""A training run's checkpoint policy over kiln.io's file format: which one a resume takes, what happens
to later ones, and the check that no checkpoint holds non-finite parameters.

The format itself (step_*.pt + LATEST.json, atomic writes, verification) is `kiln.io.checkpoint`, which
model/ and infer/ read too.
"""

from __future__ import annotations

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
    return moved


def check_finite(model: torch.nn.Module | dict[str, torch.Tensor], step: int) -> None:
    """Refuse to checkpoint non-finite parameters (one host sync; checkpoints are rare). `model` may be
    a state dict (a sharded run's gathered state)."""
    tensors = model.values() if isinstance(model, dict) else model.parameters()
    finite = torch.stack([torch.isfinite(p).all() for p in tensors]).all()
    if not bool(finite):
        raise KilnError(
            f"the parameters are not finite at step {step}: no checkpoint was written (LATEST.json still "
            "names the last good one). Lower train.lr or raise train.warmup_steps, then --resume"
        )


__all__ = ["choose_resume_checkpoint", "set_aside_later", "check_finite", "save_checkpoint"]
