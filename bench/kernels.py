"""Every benchmark of the kernels library (Kernels I) in one command.

    python bench/kernels.py --out-dir bench/results          # on the H200, about 4 minutes
    python bench/kernels.py --smoke --out-dir /tmp/kernels   # tiny shapes on the CPU interpreter

Runs, each in its own process (a CUDA fault in one must not take the other's results with it):
- bench/kernels_norms.py   -> kernels_norms.json: vector add, softmax, RMSNorm, LayerNorm, SwiGLU, RoPE;
- bench/kernels_gemm_ce.py -> kernels-b.json: matmul (square, prefill, decode), cross-entropy, fused
  linear cross-entropy, sampling.
Both time kiln beside its peers in the same process; `--table` of kernels_norms.py prints the README
table. Exit status: non-zero if either benchmark failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PARTS = {
    "norms": ("kernels_norms.py", "kernels_norms.json"),
    "gemm_ce": ("kernels_gemm_ce.py", "kernels-b.json"),
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", required=True, help="directory for the result JSONs")
    p.add_argument("--smoke", action="store_true", help="tiny shapes through the CPU interpreter")
    p.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts: {', '.join(PARTS)}")
    args = p.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    failed = []
    for part in filter(None, args.only.split(",")):
        if part not in PARTS:
            p.error(f"unknown part {part!r}: choose from {', '.join(PARTS)}")
        script, out = PARTS[part]
        cmd = [sys.executable, os.path.join(HERE, script), "--out", os.path.join(args.out_dir, out)]
        cmd += ["--smoke"] if args.smoke else []
        print(f"== {' '.join(cmd)}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(part)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
