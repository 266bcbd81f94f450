"""Checkpoints that are never half-written and never overwrite a good one.

A checkpoint directory holds `step_0000100.pt` files and a pointer `LATEST.json` naming the newest
complete one with its size and SHA-256. Writing goes: temporary file -> fsync -> rename to its final
name -> fsync the directory -> then the pointer, the same way. A crash at any moment leaves the
previous pointer and its file intact; a file whose bytes do not match the pointer is reported as
corrupt instead of being loaded.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError

POINTER = "LATEST.json"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_checkpoint(ckpt_dir: str | Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as step_<step>.pt, point LATEST.json at it, keep the newest `keep` files."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = ckpt_dir / f"step_{step:07d}.pt"
    atomic_write_bytes(path, data)
    pointer = {
        "file": path.name,
        "step": step,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    atomic_write_bytes(ckpt_dir / POINTER, json.dumps(pointer, indent=2).encode())
    if keep > 0:
        for old in sorted(ckpt_dir.glob("step_*.pt"))[:-keep]:
            if old.name != path.name:
                old.unlink()
    return path


def latest_pointer(ckpt_dir: str | Path) -> dict | None:
    """The pointer of a checkpoint directory, or None when it holds no checkpoint."""
    p = Path(ckpt_dir) / POINTER
    if not p.exists():
        return None
    try:
        pointer = json.loads(p.read_text())
        pointer["file"], pointer["sha256"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise KilnError(f"{p} is corrupt: it should name the latest checkpoint file") from None
    return pointer


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
    return p / pointer["file"]


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and verify a checkpoint; corrupt or truncated files raise KilnError."""
    file = resolve_checkpoint(path)
    data = file.read_bytes()
    pointer = latest_pointer(file.parent)
    if pointer is not None and pointer["file"] == file.name:
        if (
            len(data) != pointer.get("bytes", len(data))
            or hashlib.sha256(data).hexdigest() != pointer["sha256"]
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
