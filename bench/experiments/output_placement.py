"""One-off H200 experiment: does where the output lands move a memory-bound kernel by as much as the gap
between kiln's RMSNorm forward and Liger's (about 1% of GPU time)?

    python bench/experiments/output_placement.py OUT.json   # from the repo root, on a CUDA GPU (~1 minute)

The same kiln kernel (32768 x 4096 bf16, inference path) writes into five different preallocated 256 MB
output buffers, and once into a fresh allocation per call (what `rmsnorm` does), interleaved with Liger;
do_bench with the L2 flushed, and CUDA-graph time for each.
"""

import json
import sys

import torch

sys.path.insert(0, "bench")
import kernels_norms as kn  # noqa: E402
from kiln.kernels import rmsnorm as RN  # noqa: E402
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import no_grad, run_group  # noqa: E402

EPS = 1e-6


def main():
    mk = kn.Inputs("cuda", False)
    M, D = 32768, 4096
    x, w = mk.randn(M, D), mk.randn(D, scale=0.1) + 1
    fns = {
        "kiln": no_grad(lambda: RN.rmsnorm(x, w, EPS)),
        "liger": kn.liger(no_grad(lambda: kn.LigerRMSNormFunction.apply(x, w, EPS))),
    }
    buffers, gaps = [], []
    for i in range(5):
        buffers.append(torch.empty(M, D, dtype=x.dtype, device="cuda"))
        gaps.append(torch.empty((i + 1) * (48 << 20), dtype=torch.uint8, device="cuda"))  # kept: apart

        def into(y=buffers[-1]):
            RN._fwd_launch[(M,)](
                x, x, y, y, w, y, D, 0, D, M, D, EPS, 0.0,
                HAS_RESIDUAL=False, FOR_BACKWARD=False, ROWS=1, BLOCK=D, num_warps=8,
            )  # fmt: skip

        fns[f"kiln_into_buffer{i}"] = into
    ref = RN.rmsnorm(x, w, EPS)
    fns["kiln_into_buffer0"]()
    out = run_meta() | {"max_abs_diff_buffer0_vs_rmsnorm": float((buffers[0] - ref).abs().max())}
    out["group"] = run_group("rmsnorm_fwd_placement", fns, False, 2 * x.numel() * 2)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
