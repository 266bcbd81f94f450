"""Printing and storing benchmark results: a Markdown table printer and an atomic JSON writer."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """A Markdown table: one row per dict, columns as (key, header); missing values print as '-'."""
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | os.PathLike, doc: dict) -> Path:
    """Write doc as indented JSON through a temporary file, fsync and rename: a reader (or a run killed
    half-way) sees the old file or the new one, never a truncated mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_json(path: str | os.PathLike) -> dict:
    with open(path) as f:
        return json.load(f)
