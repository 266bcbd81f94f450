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

The add + RMSNorm split across two matmuls (`norm_fused` cases, at 1, 4 and 16 rows): o_proj + add & norm
+ qkv, and down_proj + add & norm + gate_up, each timed as one sequence in a CUDA graph: "separate" = kiln's
decode matmul, kiln's add + RMSNorm kernel, kiln's decode matmul (what the model runs); "fused" = the
matmul with the residual_sumsq epilogue, then the matmul with the rmsnorm prologue (two kernels). Beside
them each kernel alone (plain and fused producer, the norm, plain and fused consumer), to see which side
the time goes to; at 16 rows also the fused pair on the 4-warp 16 x 128 tile (the rule's 1-warp 16 x 256
tile needs 255 registers with the rmsnorm prologue), and at one row the fused pair with a producer of twice
the columns per program (half the partials each consumer program reads). Outputs checked: the fused stream
equal bit for bit to the separate one, both outputs against float32.

    python bench/matmul_decode.py --case norm_fused   # only these: -> bench/results/matmul_decode-norm_fused.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from kiln.kernels.dispatch import sm_count, use_backend
from kiln.kernels.matmul import linear
from kiln.kernels.matmul_decode import DecodeConfig, decode_config, decode_matmul
from kiln.kernels.rmsnorm import norm_fused_ref, rmsnorm
from kiln.kernels.swiglu import swiglu, swiglu_linear
from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser, format_table

SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536)}
ROWS = (1, 2, 4, 8, 12, 16)
SMOKE_SHAPES = {"qkv": (32, 48), "down": (96, 32)}
SMOKE_ROWS = (1, 3, 16)
CASES = ("all", "linear", "swiglu_down", "norm_fused")
# (producer K, d_model, consumer N, consumer bias): o_proj -> qkv (Qwen's qkv has a bias), down -> gate_up
NORM_PAIRS = {"o+qkv": (1536, 1536, 2048, True), "down+gate_up": (8960, 1536, 17920, False)}
NORM_ROWS = (1, 4, 16)
SMOKE_NORM_PAIRS = {"o+qkv": (48, 40, 24, True), "down+gate_up": (96, 40, 64, False)}
NORM_EPS = 1e-6  # Qwen2.5's rms_norm_eps


def main() -> int:
    parser = bench_parser("matmul_decode", __doc__)
    parser.add_argument("--case", choices=CASES, default="all", help="which case set to run (default: all)")
    args = parser.parse_args()
    if args.case != "all" and args.out is None and not args.smoke:  # a part does not replace the whole file
        args.out = str(Path(__file__).resolve().parent / "results" / f"matmul_decode-{args.case}.json")
    run = BenchRun("matmul_decode", __file__, args)
    dev = run.device
    # the interpreter's bf16 tl.dot is wrong (PLATFORM.md): the smoke run checks fp16
    dtype = torch.float16 if run.smoke else torch.bfloat16
    shapes, row_counts = (SMOKE_SHAPES, SMOKE_ROWS) if run.smoke else (SHAPES, ROWS)
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    with use_backend("triton"):
        for name, (K, N) in shapes.items() if args.case in ("all", "linear") else ():
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
        if args.case in ("all", "swiglu_down"):
            rows += swiglu_down_cases(
                run, shapes["down"], row_counts[:2] if run.smoke else row_counts, dtype, g
            )
        if args.case in ("all", "norm_fused"):
            rows += norm_fused_cases(run, SMOKE_NORM_PAIRS if run.smoke else NORM_PAIRS, dtype, g)
    cols = [("shape", "shape"), ("M", "rows"), ("kiln_us", "kiln us"), ("cublas_us", "cuBLAS us"),
            ("ratio", "ratio"), ("tbps", "TB/s"), ("frac_copy", "of copy"), ("separate_us", "separate kiln us"),
            ("fused_over_separate", "separate / fused")]  # fmt: skip
    print(format_table(rows, cols))
    run.write(
        timing="do_bench_cudagraph median over interleaved rounds, GPU time", case=args.case, cases=rows
    )
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


# At 16 rows the rule gives o and qkv a one-warp 16 x 256 tile, on which the rmsnorm prologue needs 255
# registers (sm_90 compile; 142 plain, no spills either way): the four-warp tile the rule gives 2-15 rows
# (qkv 96 registers fused, o 40), for both kernels of the fused pair.
NORM_FUSED_ALT_16 = DecodeConfig("dot", 16, 128, 1, 4, 3, True)


def norm_fused_cases(run, pairs, dtype, g) -> list[dict]:
    """(producer + add & norm + consumer): separate kiln kernels (matmul, add + RMSNorm, matmul) against
    the split form (residual_sumsq epilogue, rmsnorm prologue), each sequence whole in a CUDA graph."""
    dev, out = run.device, []
    for pair, (K1, d, N2, has_bias) in pairs.items():
        w1 = torch.randn(d, K1, device=dev, generator=g).div_(K1**0.5).to(dtype)
        w2 = torch.randn(N2, d, device=dev, generator=g).div_(d**0.5).to(dtype)
        gamma = (1 + 0.1 * torch.randn(d, device=dev, generator=g)).to(dtype)
        b2 = torch.randn(N2, device=dev, generator=g).to(dtype) if has_bias else None
        for M in (1, 3, 16) if run.smoke else NORM_ROWS:
            x = torch.randn(M, K1, device=dev, generator=g).to(dtype)
            h = torch.randn(M, d, device=dev, generator=g).to(dtype)
            out.append(_norm_fused_case(run, pair, x, h, w1, gamma, w2, b2))
    return out


def _norm_fused_case(run, pair, x, h, w1, gamma, w2, b2) -> dict:
    """One pair at one row count: the two sequences, each kernel alone, and the checks."""
    M, K1 = x.shape
    N2, d = w2.shape

    def separate():
        z, h_new = rmsnorm(linear(x, w1), gamma, NORM_EPS, residual=h)
        return h_new, linear(z, w2, b2)

    def fused(c1=None, c2=None):
        h_new, ss = decode_matmul(x, w1.t(), config=c1, epilogue="residual_sumsq", residual=h)
        y = decode_matmul(h_new, w2.t(), b2, config=c2, prologue="rmsnorm", norm_weight=gamma, sumsq=ss,
                          eps=NORM_EPS)  # fmt: skip
        return h_new, y

    h_sep, y_sep = separate()
    h_fus, y_fus = fused()
    ref = norm_fused_ref(x.float(), w1.float().t(), h.float(), gamma.float(), w2.float().t(), None,
                         None if b2 is None else b2.float(), NORM_EPS)[1]  # fmt: skip
    # the inputs each kernel sees in its sequence, for timing it alone
    y_mid = linear(x, w1)
    z_mid, h_mid = rmsnorm(y_mid, gamma, NORM_EPS, residual=h)
    ss_mid = decode_matmul(x, w1.t(), epilogue="residual_sumsq", residual=h)[1]
    fns = {
        "separate": separate,
        "fused": fused,
        "producer": lambda: linear(x, w1),
        "producer_fused": lambda: decode_matmul(x, w1.t(), epilogue="residual_sumsq", residual=h),
        "norm": lambda: rmsnorm(y_mid, gamma, NORM_EPS, residual=h),
        "consumer": lambda: linear(z_mid, w2, b2),
        "consumer_fused": lambda: decode_matmul(
            h_mid, w2.t(), b2, prologue="rmsnorm", norm_weight=gamma, sumsq=ss_mid, eps=NORM_EPS
        ),
    }
    if M == 16 and not run.smoke and pair == "o+qkv":
        fns["fused_alt"] = lambda: fused(NORM_FUSED_ALT_16, NORM_FUSED_ALT_16)
    if M == 1 and not run.smoke:
        # every consumer program reads all the producer's partials (384 a row after o, 768 after down at one
        # row: 1.5-3 KB from L2, as much as its x tile): a producer with twice the columns per program
        # writes half as many (and streams its weight over half as many programs)
        rule = decode_config(M, d, K1, sm_count(x.device))
        fewer = rule._replace(block_n=2 * rule.block_n)
        fns["fused_half_partials"] = lambda: fused(fewer, None)
    t = run.timer.interleaved(fns, graph=True)
    us = {k: None if v["ms"] is None else round(v["ms"] * 1e3, 2) for k, v in t.items()}
    row = {
        "shape": f"norm_fused {pair}", "M": M, "K": K1, "N": N2, "d": d,
        "config_producer": str(decode_config(M, d, K1, sm_count(x.device))),
        "config_consumer": str(decode_config(M, N2, d, sm_count(x.device))),
        "partials_per_row": ss_mid.shape[1],
        "kiln_us": us["fused"], "separate_us": us["separate"],
        "fused_over_separate": None if us["fused"] is None else round(us["separate"] / us["fused"], 3),
        "saved_us": None if us["fused"] is None else round(us["separate"] - us["fused"], 2),
        "parts_us": {k: v for k, v in us.items() if k not in ("fused", "separate")},
        "stream_bits_equal": bool(torch.equal(h_fus, h_sep)),
        "max_abs_diff_fused_vs_fp32": float((y_fus.float() - ref).abs().max()),
        "max_abs_diff_separate_vs_fp32": float((y_sep.float() - ref).abs().max()),
    }  # fmt: skip
    run.log(
        f"norm_fused {pair} M={M}: separate {row['separate_us']} us, fused {row['kiln_us']} us "
        f"({row['fused_over_separate']}x), parts {row['parts_us']}, stream equal {row['stream_bits_equal']}"
    )
    return row


if __name__ == "__main__":
    sys.exit(main())
