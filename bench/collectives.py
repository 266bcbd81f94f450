"""Time collectives over message sizes: bus bandwidth and the alpha-beta model fitted to the times.

    python bench/collectives.py                          # spawns 2 gloo ranks on CPU (or one NCCL rank per GPU)
    python bench/collectives.py --nprocs 4 --max-bytes 64M
    torchrun --nproc-per-node 8 bench/collectives.py     # the ranks torchrun started (NCCL on GPUs)
    python bench/collectives.py --smoke                  # 2 gloo ranks, 3 small sizes (seconds)

Ops: the library's all_reduce, reduce_scatter, all_gather and all_to_all, and kiln's ring and recursive-doubling
all-reduce over batch_isend_irecv (kiln.dist.collectives), float32, sizes from --min-bytes to
--max-bytes by factors of 4 (default 1 KB .. 64 MB with gloo, 1 KB .. 1 GB with NCCL). Each time is the
slowest rank's, median over rounds (kiln.dist.collectives_bench). busbw follows nccl-tests
(all-reduce 2(p-1)/p, reduce-scatter and all-gather (p-1)/p times n / t). Per op, T = a alpha + b n / beta
(a, b: kiln.dist.cost_model; for the ring all-reduce a = 2(p-1), b = 2(p-1)/p) is fitted by least squares
of the relative error, and the model's time printed beside each measurement.

The harness's parser, output path and table printer are shared with the other scripts; its BenchRun is
not used, because this bench runs on several processes and is meaningful on the CPU too (gloo), where
BenchRun refuses anything but --smoke. The JSON carries the same provenance and ceilings keys.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from kiln.profile.harness import bench_parser, default_out, format_table

COLUMNS = [("op", "op"), ("bytes", "bytes"), ("iters", "iters"), ("us", "time us"), ("model_us", "model us"),
           ("model_err", "model/meas-1"), ("busbw_GBps", "busbw GB/s")]  # fmt: skip
FIT_COLUMNS = [("op", "op"), ("p", "p"), ("alpha_us", "alpha us"), ("beta_GBps", "beta GB/s")]


def parse_bytes(text: str) -> int:
    """'1K' -> 1024, '64M' -> 2**26, '1G' -> 2**30, '4096' -> 4096."""
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    try:
        return int(text[:-1] if mult > 1 else text) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 4096, 1K, 64M, 1G)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nprocs", type=int, default=None, help="ranks to spawn (default 2 on CPU, every GPU)")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with 2+ GPUs, else gloo")
    p.add_argument("--min-bytes", type=parse_bytes, default=None, help="smallest message (default 1K)")
    p.add_argument("--max-bytes", type=parse_bytes, default=None, help="largest (default 64M gloo, 1G nccl)")


def run(args: argparse.Namespace, script_file: str) -> dict | None:
    """Measure (spawning ranks unless under torchrun), print the tables, write the JSON; rank 0's result."""
    import torch

    from kiln.dist import collectives_bench as cb
    from kiln.profile.ceilings import measure_ceilings
    from kiln.profile.provenance import provenance
    from kiln.profile.report import write_json

    t0 = time.perf_counter()
    launched = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    backend = args.backend or ("nccl" if launched and torch.cuda.is_available() else cb.default_backend())
    if args.smoke:
        backend = "gloo"
        sizes = cb.sizes_between(args.min_bytes or 1 << 10, args.max_bytes or 64 << 10, factor=8)
    else:
        top = 1 << 30 if backend == "nccl" else 64 << 20
        sizes = cb.sizes_between(args.min_bytes or 1 << 10, args.max_bytes or top)
    if launched:
        rows = cb.measure_launched(sizes, smoke=args.smoke)
        if rows is None:
            return None
    else:
        nprocs = args.nprocs or (torch.cuda.device_count() if backend == "nccl" else 2)
        rows = cb.spawn(nprocs, sizes, backend, smoke=args.smoke)
    rows, fits = cb.summarize(rows)
    device = torch.device("cuda" if backend == "nccl" else "cpu")
    doc = {"area": "collectives", "smoke": bool(args.smoke), **provenance(), "backend": backend,
           "p": rows[0]["p"], "ceilings": measure_ceilings(device), "fits": fits, "cases": rows,
           "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    print(f"collectives: {backend}, {doc['p']} ranks, {doc['gpu']}, commit {doc['commit'][:12]}")
    print(format_table(fits, FIT_COLUMNS))
    print()
    print(format_table(rows, COLUMNS))
    out = args.out or default_out("collectives", script_file, args.smoke)
    print(f"wrote {write_json(out, doc)}")
    return doc


def main() -> int:
    p = bench_parser("collectives", __doc__)
    add_arguments(p)
    run(p.parse_args(), __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
