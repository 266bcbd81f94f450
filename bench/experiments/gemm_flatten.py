"""One-off H200 experiment (run at commit 583f539; results in bench/results/sweep_gemm_flatten.json).

    python bench/experiments/gemm_flatten.py OUT.json   # from the repo root, on a CUDA GPU

The persistent 128x256 GEMM with its tile loop flattened into the K loop (`tile_config(flatten=True)`),
group sizes 8 and 4, against the unflattened loop and cuBLAS on the Qwen2.5-1.5B prefill GEMMs at 8192
tokens and on 4096^3 / 8192^3, interleaved (bench/timing.py); checks each result against cuBLAS. The
flattened 128x256 tiles in groups of 4 became the default for plain epilogues.
"""

import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "bench")
import kernels_norms as kn
from kiln.kernels.matmul import matmul_fwd, tile_config
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import run_group


def main():
    out = run_meta() | {
        "groups": [],
        "errors": {},
    }
    mk = kn.Inputs("cuda", False)
    cfgs = {
        "p128x256_s3_w8": tile_config(128, 256, 64, 3, 8, persistent=True),
        "p128x256_s3_w8_flat": tile_config(128, 256, 64, 3, 8, persistent=True, flatten=True),
        "p128x256_s4_w8_flat": tile_config(128, 256, 64, 4, 8, persistent=True, flatten=True),
        "p128x256_s3_w8_g4_flat": tile_config(128, 256, 64, 3, 8, group=4, persistent=True, flatten=True),
        "p128x256_s3_w8_g4": tile_config(128, 256, 64, 3, 8, group=4, persistent=True),
        "p128x128_s4_w8_flat": tile_config(128, 128, 64, 4, 8, persistent=True, flatten=True),
    }
    shapes = (
        ("qkv", 8192, 1536, 2048),
        ("o", 8192, 1536, 1536),
        ("gate_up", 8192, 1536, 17920),
        ("down", 8192, 8960, 1536),
        ("sq4096", 4096, 4096, 4096),
        ("sq8192", 8192, 8192, 8192),
    )
    with torch.no_grad():
        for name, M, K, N in shapes:
            x, w = mk.randn(M, K), mk.randn(N, K, scale=K**-0.5)
            ref = F.linear(x, w).float()
            fns = {}
            for c, cfg in cfgs.items():
                try:
                    err = (matmul_fwd(x, w.t(), config=cfg)[0].float() - ref).abs().max().item()
                    out["errors"][f"{name} {c}"] = err
                    fns[c] = lambda cfg=cfg: matmul_fwd(x, w.t(), config=cfg)
                except Exception as e:
                    out["errors"][f"{name} {c}"] = f"{type(e).__name__}: {str(e)[:200]}"
            fns["cublas"] = lambda: F.linear(x, w)
            out["groups"].append(run_group(f"gemm_{name}", fns, False))
            json.dump(out, open(sys.argv[1], "w"), indent=1)
    print(json.dumps(out["errors"]))


main()
