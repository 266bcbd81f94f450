"""The benchmark harness every `bench/<area>.py` runs on: common flags, provenance, ceilings measured in
the run, the timer, and the result file.

    args = bench_parser("norms", __doc__).parse_args()
    run = BenchRun("norms", __file__, args)       # provenance + ceilings now; run.timer, run.device
    ...                                           # cases, timed with run.timer
    run.write(cases=cases)                        # -> bench/results/norms.json (atomic)

`--smoke` runs the same code on the CPU with tiny shapes through Triton's interpreter: the script must
set TRITON_INTERPRET=1 before anything imports triton, so each script checks `"--smoke" in sys.argv`
first thing (this module imports neither torch nor triton at import time). A smoke run writes to a
temporary directory unless --out is given, never over the GPU results in bench/results/.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from kiln.profile.report import format_table, write_json

__all__ = ["BenchRun", "bench_parser", "default_out", "format_table"]


def bench_parser(area: str, doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"bench/{area}.py",
        description=(doc or "").strip().splitlines()[0] if doc else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU through Triton's interpreter (seconds)"
    )
    p.add_argument("--out", help=f"result JSON (default bench/results/{area}.json; a temp dir with --smoke)")
    return p


def default_out(area: str, script_file: str, smoke: bool) -> Path:
    if smoke:
        return Path(tempfile.gettempdir()) / "kiln-bench-smoke" / f"{area}.json"
    return Path(script_file).resolve().parent / "results" / f"{area}.json"


class BenchRun:
    """One benchmark run: its device, timer, provenance and ceilings, and the writer of its result."""

    def __init__(
        self, area: str, script_file: str, args: argparse.Namespace, rounds: int = 5, allow_cpu: bool = False
    ):
        """allow_cpu: a run that measures no time (a quality figure, computed the same on any device) may
        run without a GPU, on the CPU at full size, without the interpreter (kiln's torch references)."""
        import torch

        from kiln.profile.ceilings import measure_ceilings
        from kiln.profile.provenance import provenance
        from kiln.profile.timing import Timer

        self.area = area
        self.smoke = bool(args.smoke)
        if self.smoke and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"bench/{area}.py --smoke: TRITON_INTERPRET=1 must be set before triton is imported"
            )
        cuda = torch.cuda.is_available()
        if not self.smoke and not cuda and not allow_cpu:
            raise SystemExit(f"bench/{area}.py needs a CUDA GPU; pass --smoke to check it on the CPU")
        self.device = torch.device("cuda" if cuda and not self.smoke else "cpu")
        self.timer = Timer(self.smoke, rounds=rounds)
        self.out = Path(args.out) if args.out else default_out(area, script_file, self.smoke)
        self.t0 = time.perf_counter()
        self.meta = {"area": area, "smoke": self.smoke, **provenance()}
        self.ceilings = measure_ceilings(self.device)
        self.meta["ceilings"] = self.ceilings
        self.log(f"{area}: {self.meta['gpu']}, commit {self.meta['commit'][:12]}, ceilings {self.ceilings}")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)

    def write(self, **payload: object) -> Path:
        doc = {**self.meta, "wall_s": round(self.elapsed(), 1), **payload}
        path = write_json(self.out, doc)
        self.log(f"wrote {path}")
        return path
