"""Atomic file writes: a temporary file -> fsync -> rename over the final name -> fsync the directory.

A crash at any moment leaves either the old file or the new one, never a mix. The temporary name is unique
per write (pid + random suffix), so two writers never share one, and a failed write (a full disk) removes
its temporary file and raises one KilnError that names the path, instead of an OSError traceback.
"""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

from kiln.errors import KilnError


def temp_name(path: Path) -> Path:
    """A hidden sibling of `path` that no other write, in this process or another, uses."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:  # nor fsync on them; the rename itself is still atomic
        pass
    finally:
        os.close(fd)


def write_error(path: Path, e: OSError) -> KilnError:
    """The one message for a failed write; a full disk says so and what to do."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return KilnError(
            f"cannot write {path}: the disk is full ({e.strerror}); nothing was replaced. "
            "Free some space, then continue with `kiln run --resume`"
        )
    return KilnError(f"cannot write {path}: {e.strerror or e}")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace `path` with `data` all at once; on any OSError the old file is untouched and no temp is left."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise write_error(path, e) from None
    fsync_dir(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_png(path: str | Path, fig, dpi: int = 120) -> None:
    """Render a matplotlib figure to PNG in memory and replace `path` with it at once; the figure is closed
    (a plot half-written by a crash would otherwise replace a good one)."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format="png")
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def append_text(path: str | Path, text: str) -> None:
    """Append `text` whole or not at all: a failed append (a full disk) is cut back to the old length."""
    path = Path(path)
    data = text.encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        start = os.fstat(fd).st_size  # one writer per run directory (the run lock), so nobody moves it
        view = memoryview(data)
        while view:  # os.write may write part of a large buffer
            view = view[os.write(fd, view) :]
    except OSError as e:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise write_error(path, e) from None
    finally:
        os.close(fd)
