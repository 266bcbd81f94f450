"""Where a measurement came from: device, library versions, commit and date, stored with every result.

The commit is the one the caller names in $KILN_COMMIT when set (a GPU machine may get a copy of the
working tree whose `.git` is stale or absent), else git's HEAD of the current directory's checkout, else
"unknown". `dirty` says whether tracked files differed from that commit when the run started.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str:
    """The commit measured: $KILN_COMMIT, else HEAD of the checkout around the current directory."""
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    return _git("rev-parse", "HEAD") or "unknown"


def git_dirty() -> bool | None:
    """True when tracked files differ from HEAD (None: not a git checkout, or $KILN_COMMIT given)."""
    if os.environ.get("KILN_COMMIT"):
        return None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else bool(status)


def provenance() -> dict:
    """The fields every result starts with. Imports torch and triton (call it after choosing the
    interpreter, see `kiln.profile.harness`)."""
    import torch
    import triton

    cuda = torch.cuda.is_available()
    cpu = "none (CPU, Triton interpreter)" if os.environ.get("TRITON_INTERPRET") == "1" else "none (CPU)"
    return {
        "gpu": torch.cuda.get_device_name() if cuda else cpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "commit": git_commit(),
        "dirty": git_dirty(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "argv": sys.argv[1:],
        # the kernel-form switches in force (KILN_DECODE_FORM, KILN_FP8_CAST, ...), so a figure names them
        "switches": {
            k: v for k, v in sorted(os.environ.items()) if k.startswith("KILN_") and k != "KILN_COMMIT"
        },
    }
