"""Where a benchmark result came from: the commit it measured.

The GPU machine gets a copy of the working tree whose `.git` can be stale (runs there reported the
session's first commit for later ones), so the commit given by the caller in $KILN_COMMIT wins; else
git's HEAD; else "unknown" (a copy without git history).
"""

from __future__ import annotations

import os
import subprocess


def git_commit(short: bool = False) -> str:
    if os.environ.get("KILN_COMMIT"):
        return os.environ["KILN_COMMIT"]
    cmd = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        out = subprocess.run(
            cmd, cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out if out and out != "HEAD" else "unknown"


def run_meta() -> dict:
    """The fields every result JSON starts with: device, library versions, commit, UTC date."""
    import time

    import torch
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
