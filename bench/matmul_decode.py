"""kiln's linear against cuBLAS (F.linear) at every decode row count, Qwen2.5-1.5B layer shapes, bf16.

    python bench/matmul_decode.py             # on a CUDA GPU, ~30 s -> bench/results/matmul_decode.json
    python bench/matmul_decode.py --smoke     # tiny shapes on the CPU through the interpreter (fp16)

GPU time in CUDA graphs (triton.testing.do_bench_cudagraph, median over rounds that visit kiln and cuBLAS
in a fresh random order, kiln.profile.timing), for M in 1, 2, 4, 8, 12, 16 rows and the four projections
(weights (N, K) as nn.Linear holds them); each result is checked against cuBLAS's. The unit is the weight
bytes streamed per second, against the copy bandwidth measured in the run; the config kiln's rule picked is
recorded beside each figure.

The MLP's second half at the same row counts (`swiglu_down` cases): the SwiGLU fused into the down
projection's prologue (kiln.kernels.swiglu.swiglu_linear, what the model runs at <= 16 rows) against
kiln's separate swiglu kernel then kiln's decode matmul (what it ran before), and against swiglu then
cuBLAS; the unit is the same weight stream (the (M, 2F) activations are a few hundred KB at most).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from kiln.kernels.dispatch import sm_count, use_backend
from kiln.kernels.matmul import linear
from kiln.kernels.matmul_decode import DecodeConfig, decode_config, decode_matmul
from kiln.kernels.swiglu import swiglu, swiglu_linear
from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser, format_table

SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536)}
ROWS = (1, 2, 4, 8, 12, 16)
SMOKE_SHAPES = {"qkv": (32, 48), "down": (96, 32)}
SMOKE_ROWS = (1, 3, 16)


def main() -> int:
    args = bench_parser("matmul_decode", __doc__).parse_args()
    run = BenchRun("matmul_decode", __file__, args)
    dev = run.device
    # the interpreter's bf16 tl.dot is wrong (PLATFORM.md): the smoke run checks fp16
    dtype = torch.float16 if run.smoke else torch.bfloat16
    shapes, row_counts = (SMOKE_SHAPES, SMOKE_ROWS) if run.smoke else (SHAPES, ROWS)
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    with use_backend("triton"):
        for name, (K, N) in shapes.items():
            w = torch.randn(N, K, device=dev, generator=g).div_(K**0.5).to(dtype)
            for M in row_counts:
                x = torch.randn(M, K, device=dev, generator=g).to(dtype)
                want = F.linear(x.float(), w.float())
                got = linear(x, w)
                err = float((got.float() - want).abs().max())
                t = run.timer.interleaved(
                    {"kiln": lambda x=x, w=w: linear(x, w), "cublas": lambda x=x, w=w: F.linear(x, w)},
                    graph=True,
                )
                kiln_us, cublas_us = t["kiln"]["ms"] * 1e3, t["cublas"]["ms"] * 1e3
                tbps = N * K * w.element_size() / kiln_us / 1e6
                row = {
                    "shape": name, "M": M, "K": K, "N": N,
                    "config": str(decode_config(M, N, K, sm_count(x.device))),
                    "kiln_us": round(kiln_us, 2), "cublas_us": round(cublas_us, 2),
                    "ratio": round(cublas_us / kiln_us, 3), "max_abs_diff_vs_fp32": err,
                    "tbps": round(tbps, 3), "frac_copy": fraction(tbps, run.ceilings["copy_TBps"]),
                }  # fmt: skip
                rows.append(row)
                run.log(
                    f"{name} M={M}: kiln {row['kiln_us']} us, cuBLAS {row['cublas_us']} us, {row['ratio']}x"
                )
        rows += swiglu_down_cases(run, shapes["down"], row_counts[:2] if run.smoke else row_counts, dtype, g)
    cols = [("shape", "shape"), ("M", "rows"), ("kiln_us", "kiln us"), ("cublas_us", "cuBLAS us"),
            ("ratio", "ratio"), ("tbps", "TB/s"), ("frac_copy", "of copy"), ("separate_us", "separate kiln us"),
            ("fused_over_separate", "separate / fused")]  # fmt: skip
    print(format_table(rows, cols))
    run.write(timing="do_bench_cudagraph median over interleaved rounds, GPU time", cases=rows)
    return 0


# At one row the rule gives the down projection 2 columns per program (768 programs), each recomputing the
# SwiGLU over all 8960 K values: these spread the same weight stream over as many programs with more columns
# and split K, so each program recomputes a quarter or half as much (the split-K sum adds a PDL launch).
FUSED_ONE_ROW_ALTERNATIVES = (
    DecodeConfig("gemv", 8, 1024, 4, 4, 1, True),
    DecodeConfig("gemv", 4, 1024, 2, 4, 1, True),
    DecodeConfig("gemv", 4, 512, 2, 2, 3, True),
)


def swiglu_down_cases(run, down, row_counts, dtype, g) -> list[dict]:
    """swiglu(gate_up) @ W_down^T: fused (kiln) vs kiln's swiglu then kiln's decode matmul ("separate") vs
    swiglu then cuBLAS; checked against float32."""
    F_, N = down  # the down projection's (K, N): K is the FFN width
    dev = run.device
    w = torch.randn(N, F_, device=dev, generator=g).div_(F_**0.5).to(dtype)
    out = []
    for M in row_counts:
        gate_up = torch.randn(M, 2 * F_, device=dev, generator=g).to(dtype)
        want = F.linear(swiglu(gate_up.float()), w.float())
        err = float((swiglu_linear(gate_up, w).float() - want).abs().max())
        fns = {
            "fused": lambda a=gate_up: swiglu_linear(a, w),
            "separate": lambda a=gate_up: linear(swiglu(a), w),
            "cublas": lambda a=gate_up: F.linear(swiglu(a), w),
        }
        if M == 1 and not run.smoke:  # fewer column blocks recompute the SwiGLU (the rule's: 2 columns each)
            for cfg in FUSED_ONE_ROW_ALTERNATIVES:
                fns[str(cfg)] = lambda a=gate_up, c=cfg: decode_matmul(a, w.t(), config=c, prologue="swiglu")
        t = run.timer.interleaved(fns, graph=True)
        us = {k: v["ms"] * 1e3 for k, v in t.items()}
        tbps = N * F_ * w.element_size() / us["fused"] / 1e6
        row = {
            "shape": "swiglu_down", "M": M, "K": F_, "N": N,
            "config": str(decode_config(M, N, F_, sm_count(dev))),
            "kiln_us": round(us["fused"], 2), "separate_us": round(us["separate"], 2),
            "cublas_us": round(us["cublas"], 2), "ratio": round(us["cublas"] / us["fused"], 3),
            "fused_over_separate": round(us["separate"] / us["fused"], 3), "max_abs_diff_vs_fp32": err,
            "tbps": round(tbps, 3), "frac_copy": fraction(tbps, run.ceilings["copy_TBps"]),
            "alternatives_us": {k: round(v, 2) for k, v in us.items() if k not in ("fused", "separate", "cublas")},
        }  # fmt: skip
        out.append(row)
        run.log(
            f"swiglu_down M={M}: fused {row['kiln_us']} us, separate kiln {row['separate_us']} us "
            f"({row['fused_over_separate']}x), swiglu + cuBLAS {row['cublas_us']} us"
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
