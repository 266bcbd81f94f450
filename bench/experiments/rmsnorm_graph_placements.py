"""H200 experiment: is the norms suite's CUDA-graph ratio for the RMSNorm forward (kiln 0.983-0.995x
Liger over three runs at 176d0fc-f5ffb34) a property of the kernels or of where each graph's output lands?
Into the same preallocated outputs the two kernels tie in graph time (`rmsnorm_same_buffer-6165157.json`:
129.91/129.69/128.78 us against Liger's 129.98/129.03/129.28).

Each op (32768 x 4096 bf16, inference path, as bench/kernels_norms.py times it) is captured and timed
with do_bench_cudagraph ROUNDS times, alternating; before each capture the allocator's cache is emptied
and a spacer of random size is kept, so that each graph's output gets a new address. The medians and
spreads of the two sets compare the kernels over placements.

    python bench/experiments/rmsnorm_graph_placements.py OUT.json   # on a CUDA GPU, ~30 s
"""

import json
import random
import statistics
import sys

import torch
import triton

sys.path.insert(0, "bench")
import kernels_norms as kn  # noqa: E402
from kiln.kernels import rmsnorm as RN  # noqa: E402
from kiln.kernels.dispatch import use_backend  # noqa: E402
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import no_grad  # noqa: E402

EPS = 1e-6
ROUNDS = 10


def main():
    mk = kn.Inputs("cuda", False)
    M, D = 32768, 4096
    x, w = mk.randn(M, D), mk.randn(D, scale=0.1) + 1
    fns = {
        "kiln": no_grad(lambda: RN.rmsnorm(x, w, EPS)),
        "liger": no_grad(lambda: kn.LigerRMSNormFunction.apply(x, w, EPS)),
    }
    rng = random.Random(0)
    times = {n: [] for n in fns}
    spacers = []
    with use_backend("triton"):
        for f in fns.values():
            f()
        for i in range(ROUNDS):
            for name in sorted(fns, reverse=bool(i % 2)):
                torch.cuda.empty_cache()
                spacers.append(torch.empty(rng.randrange(1, 96) << 20, dtype=torch.uint8, device="cuda"))
                times[name].append(triton.testing.do_bench_cudagraph(fns[name], rep=20, return_mode="median"))
    out = run_meta() | {
        "graph_ms": {n: [round(t, 5) for t in ts] for n, ts in times.items()},
        "median_ms": {n: round(statistics.median(ts), 5) for n, ts in times.items()},
        "min_ms": {n: round(min(ts), 5) for n, ts in times.items()},
        "max_ms": {n: round(max(ts), 5) for n, ts in times.items()},
    }
    out["median_ratio_kiln_vs_liger"] = round(out["median_ms"]["liger"] / out["median_ms"]["kiln"], 4)
    print(json.dumps({k: out[k] for k in ("median_ms", "min_ms", "max_ms", "median_ratio_kiln_vs_liger")}))
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
