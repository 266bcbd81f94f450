"""Risky CUDA kernel variants measured in child processes, so that one bad variant is recorded and skipped
instead of ending the benchmark.

Why a child process: a kernel that faults (illegal address, a trap) leaves the CUDA context unusable for
the rest of the process, and a pipeline that deadlocks never returns. The parent runs a worker over a
list of variants; the worker prints one JSON line per event, flushed:

    {"event": "start", "variant": v}                         about to run v (check first, then time)
    {"event": "checked", "variant": v, "max_rel_err": e}      v ran and was compared with the oracle
    {"event": "timed", "ms": {name: ms, ...}}                 every checked variant and the peer, interleaved

A worker that dies or outlives `timeout_s` blames the variant it had started and not finished; the parent
records it as failed and starts a new worker over the variants after it. The loop ends when every variant
is checked or failed. The timing is that of a worker that ran every checked variant: the last one when
nothing failed, else one more worker over the checked variants alone (so that all of them are timed
together, interleaved with the peer).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Sequence


def parse_events(stdout: str) -> list[dict]:
    """The worker's JSON event lines (anything else a worker prints, e.g. a build log, is skipped)."""
    events = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{") and '"event"' in line:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def run_isolated(
    variants: Sequence[int],
    command: Callable[[list[int]], list[str]],
    timeout_s: float,
    max_workers: int = 8,
    env: dict[str, str] | None = None,
) -> dict:
    """{"checked": {v: event}, "failed": {v: reason}, "ms": {name: ms} or {}, "timing_error": str | None}.

    command(vs) is the argv of a worker over variants vs (run with environment env, default this one's). At most max_workers workers are started (each
    failure removes one variant, so len(variants) + 1 always suffices; the cap bounds a pathological run).
    """
    checked: dict[int, dict] = {}
    failed: dict[int, str] = {}
    remaining = list(variants)
    workers = 0

    def one_worker(vs: list[int]) -> tuple[dict, bool, str, int | None]:
        """(ms of its timing line or {}, clean exit, why it ended + stderr tail, the variant it died in)"""
        nonlocal workers
        workers += 1
        proc = subprocess.Popen(
            command(vs), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
            why = f"worker exited with status {proc.returncode}"
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            why = f"worker timed out after {timeout_s:.0f} s (hang)"
        started, ms = None, {}
        for ev in parse_events(out):
            if ev["event"] == "start":
                started = ev["variant"]
            elif ev["event"] == "checked":
                checked[ev["variant"]] = ev
                started = None
            elif ev["event"] == "timed":
                ms = ev["ms"]
        tail = " | ".join(err.strip().splitlines()[-3:])[-600:]
        return ms, proc.returncode == 0, f"{why}: {tail}", started

    ms: dict[str, float] = {}
    timing_error = None
    while remaining and workers < max_workers:
        ms, clean, why, started = one_worker(remaining)
        if all(v in checked for v in remaining):
            if not (clean and ms):
                ms, timing_error = {}, f"{why} (while timing)"
            break
        if started is None:  # died before its first variant (import, build, inputs): nothing to blame
            for v in remaining:
                if v not in checked:
                    failed[v] = f"{why} (before running it)"
            break
        failed[started] = why
        remaining = [v for v in remaining if v not in checked and v not in failed]
    for v in remaining:
        if v not in checked and v not in failed:
            failed[v] = "not run: too many failed workers"
    if failed and checked and timing_error is None:  # time every checked variant together
        ms, clean, why, _ = one_worker(sorted(checked))
        if not (clean and ms):
            ms, timing_error = {}, f"{why} (while timing)"
    return {"checked": checked, "failed": failed, "ms": ms, "timing_error": timing_error}
