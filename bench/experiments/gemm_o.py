"""One-off H200 experiment: tile configs for the short-K prefill GEMMs (Qwen2.5-1.5B O projection 8192 x
1536 x 1536 and QKV 8192 x 1536 -> 2048), against cuBLAS, interleaved; do_bench, CUDA-graph and host time.

    python bench/experiments/gemm_o.py OUT.json [quick]   # from the repo root, on a CUDA GPU (~1 minute)

quick: only cuBLAS and kiln's `linear` (the default config), for the host path.
"""

import json
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "bench")
import kernels_norms as kn  # noqa: E402
from kiln.kernels.matmul import linear, matmul_fwd, tile_config  # noqa: E402
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import run_group  # noqa: E402

CONFIGS = {
    "flat128x256_g4_s3_w8": tile_config(128, 256, 64, 3, 8, group=4, persistent=True, flatten=True),
    "flat128x256_g8_s3_w8": tile_config(128, 256, 64, 3, 8, group=8, persistent=True, flatten=True),
    "flat128x256_g4_s3_w8_e2": tile_config(
        128, 256, 64, 3, 8, group=4, persistent=True, flatten=True, epi_split=2
    ),
    "flat128x256_g4_s4_w8_e2": tile_config(
        128, 256, 64, 4, 8, group=4, persistent=True, flatten=True, epi_split=2
    ),
    "flat128x256_g8_s4_w8_e2": tile_config(
        128, 256, 64, 4, 8, group=8, persistent=True, flatten=True, epi_split=2
    ),
    "flat256x128_g4_s4_w8_e2": tile_config(
        256, 128, 64, 4, 8, group=4, persistent=True, flatten=True, epi_split=2
    ),
}
# the other prefill shapes get the current default and the subtiled candidates only
OTHERS = ("flat128x256_g4_s3_w8", "flat128x256_g4_s4_w8_e2", "flat128x256_g8_s4_w8_e2")


def main():
    out = run_meta() | {"groups": [], "errors": []}
    mk = kn.Inputs("cuda", False)
    shapes = (("o", 8192, 1536, 1536), ("qkv", 8192, 1536, 2048), ("gate_up", 8192, 1536, 17920),
              ("down", 8192, 8960, 1536), ("sq4096", 4096, 4096, 4096), ("sq8192", 8192, 8192, 8192))  # fmt: skip
    for name, M, K, N in shapes if sys.argv[2:] != ["quick"] else shapes[:2]:
        x, w = mk.randn(M, K), mk.randn(N, K, scale=K**-0.5)
        ref = F.linear(x, w)
        fns = {"cublas": lambda x=x, w=w: F.linear(x, w), "kiln_linear": lambda x=x, w=w: linear(x, w)}
        for cname, cfg in CONFIGS.items() if sys.argv[2:] != ["quick"] else ():
            if name not in ("o", "qkv") and cname not in OTHERS:
                continue
            f = lambda x=x, w=w, cfg=cfg: matmul_fwd(x, w.t(), config=cfg)[0]  # noqa: E731
            try:
                err = float((f().float() - ref.float()).abs().max())
                if err > 0.05 * float(ref.float().abs().max()):
                    out["errors"].append(f"{name} {cname}: max abs err {err}")
                    continue
                fns[cname] = f
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"{name} {cname}: {type(e).__name__}: {str(e)[:300]}")
        with torch.no_grad():
            g = run_group(f"gemm_{name}_M{M}", fns, False)
        g["tflops"] = {
            n: round(2 * M * N * K / r["ms"] / 1e9, 1) for n, r in g["results"].items() if "ms" in r
        }
        out["groups"].append(g)
        with open(sys.argv[1], "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
