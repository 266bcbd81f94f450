"""The training-checkpoint file format: `step_NNNNNNN.pt` files and the pointer `LATEST.json`.

A checkpoint directory holds `step_0000100.pt` files (a `torch.save` dict with at least "model" and
"config") and a pointer `LATEST.json` naming the newest complete one with its size and SHA-256, plus the
same record for every checkpoint kept beside it ("checkpoints"), so that an older file can be verified too.
Writing goes file -> pointer, each through `atomic_write_bytes`: a crash at any moment leaves the previous
pointer and its file intact. A file whose bytes do not match its record is reported as corrupt, never
loaded. `load_newest_intact` is what a resume uses: the pointer's file, or else the newest older one
that verifies, with a warning for each one passed over.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.io.atomic import atomic_write_bytes

POINTER = "LATEST.json"
_STEP_FILE = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}.pt"


def step_of(path: Path) -> int | None:
    """The step in a `step_NNNNNNN.pt` name, or None for any other name."""
    m = _STEP_FILE.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The step_*.pt files of a directory, oldest step first."""
    files = [p for p in Path(ckpt_dir).glob("step_*.pt") if step_of(p) is not None]
    return sorted(files, key=step_of)


def _record(path: Path, step: int, data: bytes) -> dict[str, Any]:
    return {"file": path.name, "step": step, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def save_checkpoint(ckpt_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as step_<step>.pt, point LATEST.json at it, keep the newest `keep` files up to `step`.

    Files of later steps (left by a run resumed from an earlier checkpoint) are never pruned here.
    """
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = ckpt_dir / checkpoint_name(step)
    atomic_write_bytes(path, data)
    old = _read_pointer(ckpt_dir)
    records = {
        r["file"]: r for r in (old or {}).get("checkpoints", []) if isinstance(r, dict) and "file" in r
    }
    if old is not None and "file" in old and "sha256" in old:
        records.setdefault(old["file"], {k: old.get(k) for k in ("file", "step", "bytes", "sha256")})
    records[path.name] = _record(path, step, data)
    doomed: list[Path] = []
    if keep > 0:
        upto = [p for p in list_checkpoints(ckpt_dir) if step_of(p) <= step]
        doomed = [p for p in upto[:-keep] if p.name != path.name]
    kept = [
        r
        for name, r in records.items()
        if (ckpt_dir / name).exists() and name not in {p.name for p in doomed}
    ]
    pointer = {**records[path.name], "checkpoints": sorted(kept, key=lambda r: r.get("step") or 0)}
    atomic_write_bytes(ckpt_dir / POINTER, json.dumps(pointer, indent=2).encode())
    for p in doomed:  # only once the pointer no longer lists them
        p.unlink(missing_ok=True)
    return path


def _read_pointer(ckpt_dir: Path) -> dict | None:
    p = ckpt_dir / POINTER
    if not p.exists():
        return None
    try:
        pointer = json.loads(p.read_text())
        pointer["file"], pointer["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
        raise KilnError(f"{p} is corrupt: it should name the latest checkpoint file") from None
    return pointer


def latest_pointer(ckpt_dir: str | Path) -> dict | None:
    """The pointer of a checkpoint directory, or None when it holds no checkpoint."""
    return _read_pointer(Path(ckpt_dir))


def checkpoint_records(ckpt_dir: Path) -> dict[str, dict]:
    """file name -> {bytes, sha256} for every checkpoint the pointer vouches for."""
    try:
        pointer = _read_pointer(ckpt_dir)
    except KilnError:
        return {}
    if pointer is None:
        return {}
    out = {r["file"]: r for r in pointer.get("checkpoints", []) if isinstance(r, dict) and "file" in r}
    out[pointer["file"]] = pointer
    return out


def resolve_checkpoint(path: str | Path) -> Path:
    """A run directory, its checkpoints/ directory, or a .pt file -> the .pt file to load."""
    p = Path(path)
    if not p.exists():
        raise KilnError(
            f"checkpoint {p} does not exist: pass a run directory, its checkpoints/ or a .pt file"
        )
    if p.is_file():
        return p
    if (p / "checkpoints").is_dir():
        p = p / "checkpoints"
    pointer = latest_pointer(p)
    if pointer is None:
        raise KilnError(f"no checkpoint in {p}: train first (kiln run), or pass the right directory")
    file = p / pointer["file"]
    if not file.exists():
        others = ", ".join(f.name for f in list_checkpoints(p)) or "none"
        raise KilnError(
            f"{p / POINTER} names {pointer['file']}, which does not exist (deleted?): pass one of the "
            f"checkpoint files that remain ({others}) as a .pt file"
        )
    return file


def read_checkpoint(
    file: Path, map_location: str | torch.device = "cpu", record: dict | None = None
) -> dict[str, Any]:
    """Load one checkpoint file, checked against its pointer record when there is one."""
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise KilnError(f"checkpoint {file} does not exist") from None
    if record is not None and (
        len(data) != record.get("bytes", len(data)) or hashlib.sha256(data).hexdigest() != record["sha256"]
    ):
        raise KilnError(
            f"checkpoint {file} is corrupt or truncated ({len(data)} bytes; its checksum does not match "
            f"{POINTER}): restore it or resume from an earlier copy"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises several types for bad archives
        raise KilnError(
            f"checkpoint {file} cannot be read ({type(e).__name__}): it is corrupt or truncated"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise KilnError(f"{file} is not a kiln checkpoint (no model or config in it)")
    return state


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and verify a checkpoint; corrupt or truncated files raise KilnError."""
    file = resolve_checkpoint(path)
    return read_checkpoint(file, map_location, checkpoint_records(file.parent).get(file.name))


def load_newest_intact(
    ckpt_dir: str | Path, map_location: str | torch.device = "cpu", warn: Callable[[str], None] = print
) -> tuple[dict[str, Any], Path]:
    """(state, file) of the newest checkpoint that loads and verifies; each one passed over is warned about.

    Tried in order: the pointer's file, then every older step file, newest first (checked against the
    pointer's record where it has one, else only by loading). Files newer than the pointer were never
    committed and are not tried. No intact checkpoint at all is a KilnError listing what was wrong.
    """
    ckpt_dir = Path(ckpt_dir)
    problems: list[str] = []
    try:
        pointer = _read_pointer(ckpt_dir)
    except KilnError as e:
        pointer = None
        problems.append(str(e))
    records = checkpoint_records(ckpt_dir)
    files = list_checkpoints(ckpt_dir)
    candidates: list[Path] = []
    if pointer is not None:
        candidates.append(ckpt_dir / pointer["file"])
        files = [f for f in files if step_of(f) < int(pointer["step"])]
    candidates += [f for f in reversed(files) if f not in candidates]
    for file in candidates:
        if not file.exists():
            problems.append(f"{ckpt_dir / POINTER} names {file.name}, which does not exist")
            continue
        try:
            state = read_checkpoint(file, map_location, records.get(file.name))
        except KilnError as e:
            problems.append(str(e))
            continue
        for p in problems:
            warn(f"warning: {p}")
        if problems:
            note = "" if file.name in records else " (no checksum recorded for it: it loaded, so it is used)"
            warn(f"warning: falling back to {file}{note}")
        return state, file
    if not problems:
        raise KilnError(f"no checkpoint in {ckpt_dir}: train first (kiln run), or pass the right directory")
    raise KilnError(f"no intact checkpoint in {ckpt_dir}: " + "; ".join(problems))
