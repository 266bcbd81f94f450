"""kiln's linear against cuBLAS (F.linear) at every decode row count, Qwen2.5-1.5B layer shapes, bf16.

    python bench/matmul_decode_rows.py --out rows.json     # on a CUDA GPU, ~30 s

GPU time in CUDA graphs (triton.testing.do_bench_cudagraph, median), for M in 1, 2, 4, 8, 12, 16 rows
and the four projections (weights (N, K) as nn.Linear holds them); each result is checked against
cuBLAS's. The config kiln's rule picked is recorded beside each figure.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton

from kiln.kernels.dispatch import sm_count
from kiln.kernels.matmul import linear
from kiln.kernels.matmul_decode import decode_config
from provenance import git_commit

SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (K, N) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", generator=g).div_(K**0.5).bfloat16()
        for M in (1, 2, 4, 8, 12, 16):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            want = F.linear(x, w)
            got = linear(x, w)
            err = float((got.float() - want.float()).abs().max())
            kiln_us = triton.testing.do_bench_cudagraph(lambda x=x, w=w: linear(x, w), rep=20) * 1e3
            cublas_us = triton.testing.do_bench_cudagraph(lambda x=x, w=w: F.linear(x, w), rep=20) * 1e3
            row = {
                "shape": name, "M": M, "K": K, "N": N,
                "config": str(decode_config(M, N, K, sm_count(x.device))),
                "kiln_us": round(kiln_us, 2), "cublas_us": round(cublas_us, 2),
                "ratio": round(cublas_us / kiln_us, 3), "max_abs_diff_vs_cublas": err,
                "tbps": round(N * K * 2 / kiln_us / 1e6, 3),
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(short=True),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "timing": "do_bench_cudagraph median, GPU time",
    }
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
