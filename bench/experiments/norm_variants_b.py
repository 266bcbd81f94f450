"""One-off H200 experiment (run at commit 6e35a22; results in bench/results/sweep_norm_variants.json).

    python bench/experiments/norm_variants_b.py OUT.json   # from the repo root, on a CUDA GPU

RMSNorm forward as a persistent row loop (contiguous chunks or grid-stride, 2-8 programs per SM, 2-3
pipeline stages) against kiln's one-row-per-program kernel and Liger: every loop was slower at D = 4096
(143-200 us against 134.4); at D = 1536 the best (56.2 us) did not beat kiln's two-row tiles (51.8 us in
the sweep). Prefill GEMM tile configs against cuBLAS.
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, "bench")
import kernels_norms as kn
from kiln.kernels.matmul import matmul_fwd, tile_config
from kiln.kernels.rmsnorm import rmsnorm_fwd
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import no_grad, run_group


@triton.jit
def rms_loop(
    X, Y, W, RSTD, stride, n_rows, n_cols, rows_per_prog, eps, STAGES: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    start = pid.to(tl.int64) * rows_per_prog
    end = tl.minimum(start + rows_per_prog, n_rows)
    for row in tl.range(start, end, num_stages=STAGES):
        x = tl.load(X + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(Y + row * stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + row, rstd)


@triton.jit
def rms_strided(X, Y, W, RSTD, stride, n_rows, n_cols, eps, STAGES: tl.constexpr, BLOCK: tl.constexpr):
    # grid-stride: program p takes rows p, p + P, p + 2P ... (neighbouring programs stream neighbouring rows)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    for row in tl.range(pid, n_rows, tl.num_programs(0), num_stages=STAGES):
        r = row.to(tl.int64)
        x = tl.load(X + r * stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        tl.store(Y + r * stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)
        tl.store(RSTD + r, rstd)


def main():
    out = run_meta() | {
        "groups": [],
    }
    mk = kn.Inputs("cuda", False)
    M = 32768
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for D in (4096, 1536):
        x, w = mk.randn(M, D), mk.randn(D, scale=0.1) + 1
        y = torch.empty_like(x)
        rs = torch.empty(M, device="cuda")
        B = triton.next_power_of_2(D)
        fns = {"src_default": no_grad(lambda: rmsnorm_fwd(x, w, 1e-6))}
        for per in (2, 4, 8):
            for st in (2, 3):
                for nw in (4, 8):
                    P = sms * per
                    fns[f"loop_p{per}_s{st}_w{nw}"] = lambda P=P, st=st, nw=nw: rms_loop[(P,)](
                        x, y, w, rs, D, M, D, triton.cdiv(M, P), 1e-6, STAGES=st, BLOCK=B, num_warps=nw
                    )
                    fns[f"stride_p{per}_s{st}_w{nw}"] = lambda P=P, st=st, nw=nw: rms_strided[(P,)](
                        x, y, w, rs, D, M, D, 1e-6, STAGES=st, BLOCK=B, num_warps=nw
                    )
        fns["liger"] = no_grad(lambda: kn.LigerRMSNormFunction.apply(x, w, 1e-6))
        out["groups"].append(run_group(f"rmsnorm_{D}_loops", fns, False, 2 * x.numel() * 2))
        del x, y
        torch.cuda.empty_cache()
    cfgs = {
        "p128x256_s3_w8": tile_config(128, 256, 64, 3, 8, persistent=True),
        "p128x256_s4_w8": tile_config(128, 256, 64, 4, 8, persistent=True),
        "p128x256_s3_w8_g16": tile_config(128, 256, 64, 3, 8, group=16, persistent=True),
        "p128x256_s3_w8_g4": tile_config(128, 256, 64, 3, 8, group=4, persistent=True),
        "p128x256_s3_w8_ws": tile_config(128, 256, 64, 3, 8, ws=True, persistent=True),
        "p128x128_s4_w8": tile_config(128, 128, 64, 4, 8, persistent=True),
        "p128x128_s4_w4": tile_config(128, 128, 64, 4, 4, persistent=True),
        "p128x128_s4_w4_ws": tile_config(128, 128, 64, 4, 4, ws=True, persistent=True),
        "n128x256_s3_w8": tile_config(128, 256, 64, 3, 8),
        "n128x128_s4_w4": tile_config(128, 128, 64, 4, 4),
        "p256x128_s3_w8": tile_config(256, 128, 64, 3, 8, persistent=True),
        "p128x256_k128_s2_w8": tile_config(128, 256, 128, 2, 8, persistent=True),
    }
    with torch.no_grad():
        for name, K, N in (("qkv", 1536, 2048), ("o", 1536, 1536), ("down", 8960, 1536)):
            x, w = mk.randn(8192, K), mk.randn(N, K, scale=K**-0.5)
            fns = {c: (lambda cfg=cfg: matmul_fwd(x, w.t(), config=cfg)) for c, cfg in cfgs.items()}
            fns["cublas"] = lambda: F.linear(x, w)
            out["groups"].append(run_group(f"gemm_{name}_M8192", fns, False))
    json.dump(out, open(sys.argv[1], "w"), indent=1)


main()
