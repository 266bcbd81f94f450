"""Sweep kiln's decode matmul (M <= 16) against cuBLAS at the Qwen2.5-1.5B layer shapes, on the H200.

    python bench/sweep_matmul_decode.py --out bench/results/matmul_decode.json   # on a CUDA GPU (~90 s)
    python bench/sweep_matmul_decode.py --smoke                                  # CPU, interpreter

Shapes: y = x @ W.T with W (N, K) as nn.Linear, bf16: qkv (K 1536, N 2048), o (1536, 1536), gate_up
(1536, 17920), down (8960, 1536), at M = 1 and M = 16 (then M = 4, to place the rule's switch between
the kernels). For each shape, in one process:
- cuBLAS (F.linear), kiln's routed `linear` (the rule of kernels/matmul_decode.py), the previous tile
  kernel's decode config (block pointers), and every candidate config of the decode kernels ("gemv":
  FMAs, no tl.dot; "dot": the weight as the tensor-core M side; split K with a second, deterministic
  pass), each checked against cuBLAS's output;
- time per call inside a CUDA graph (GPU time, how a decode loop runs them: median over replays of one
  graph of back-to-back calls, as triton.testing.do_bench_cudagraph) with the weight L2-warm, as
  bench/kernels_gemm_ce.py measures; for cuBLAS, the routed path and the best candidates also L2-cold
  (the graph cycles through copies of W larger than the 50 MB L2 together, as a real decode step
  streams 28 layers' weights);
- host microseconds per call of each launch path, next to F.linear's.
Ratios are cuBLAS time / kiln time (> 1: kiln faster); TB/s counts W, x and y once each, against the
4.27 TB/s copy figure of ../shared/PLATFORM.md. A failing case records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
import traceback

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--out", default=None, help="write the results here as JSON")
p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
p.add_argument("--budget", type=float, default=100.0, help="seconds; optional parts stop past this")
ARGS = p.parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from kiln.kernels.dispatch import sm_count, use_backend  # noqa: E402
from kiln.kernels.matmul import _decode_config, linear, matmul, matmul_fwd  # noqa: E402
from kiln.kernels.matmul_decode import DecodeConfig, decode_config, decode_matmul  # noqa: E402
from provenance import git_commit  # noqa: E402

CUDA = not ARGS.smoke
DEV = "cuda" if CUDA else "cpu"
DT = torch.bfloat16 if CUDA else torch.float16  # the interpreter's bf16 dot is broken
COPY_TBPS = 4.27
L2_BYTES = 50 * 2**20
T0 = time.time()
RESULTS: list[dict] = []
SHAPES = [("qkv", 1536, 2048), ("o", 1536, 1536), ("gate_up", 1536, 17920), ("down", 8960, 1536)]
if ARGS.smoke:
    SHAPES = [("qkv", 96, 80), ("down", 200, 48)]


def left() -> float:
    return ARGS.budget - (time.time() - T0)


def graph_us(fn, calls: int = 200, replays: int = 11) -> float:
    """Median microseconds per call of `fn` replayed inside one CUDA graph of `calls` calls."""
    if not CUDA:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del g
    return statistics.median(times)


def record(entry: dict, run) -> dict:
    t = time.time()
    try:
        entry.update(run())
    except Exception as err:  # one broken case must not lose the others
        entry.update(error=repr(err)[:400], traceback=traceback.format_exc()[-1200:])
    entry["wall_s"] = round(time.time() - t, 2)
    RESULTS.append(entry)
    print(json.dumps(entry, default=str)[:300], flush=True)
    return entry


def candidates(M: int, K: int, N: int) -> list[DecodeConfig]:
    """Configs timed beside the rule's: round 1 (bench/results/matmul_decode-round1.json) swept ~250 over
    the gemv and dot kernels; these are its front runners at each shape class and their neighbours."""
    if ARGS.smoke:
        return [DecodeConfig("gemv", 16, 32), DecodeConfig("dot", 16, 32, 2)]
    g, d = "gemv", "dot"
    if M == 1:
        out = [DecodeConfig(g, 4, 256, 1, 2, 3), DecodeConfig(g, 4, 256, 1, 2, 2), DecodeConfig(g, 4, 256, 1, 2, 4),
               DecodeConfig(g, 4, 512, 1, 4, 1), DecodeConfig(g, 4, 512, 1, 4, 3), DecodeConfig(g, 4, 128, 1, 1, 4),
               DecodeConfig(g, 2, 256, 1, 1, 3), DecodeConfig(g, 2, 512, 1, 2, 3), DecodeConfig(g, 2, 1024, 1, 4, 1),
               DecodeConfig(g, 2, 1024, 1, 4, 3), DecodeConfig(g, 8, 256, 1, 4, 3)]  # fmt: skip
        return out + (
            [DecodeConfig(g, 4, 2048, 1, 8, 1), DecodeConfig(g, 2, 2048, 1, 8, 1)] if K > 4096 else []
        )
    if M < 16:  # where FMAs give way to the tensor cores
        return [DecodeConfig(g, 4, 256, 1, 2, 3), DecodeConfig(g, 2, 1024, 1, 4, 1), DecodeConfig(d, 16, 128, 1, 4, 3),
                DecodeConfig(d, 16, 256, 1, 1, 4), DecodeConfig(d, 64, 128, 1, 4, 3)]  # fmt: skip
    if N >= 64 * 132:  # gate_up: enough 64-wide column blocks
        return [DecodeConfig(d, 64, 128, 1, 4, 3), DecodeConfig(d, 64, 64, 1, 4, 4), DecodeConfig(d, 64, 128, 1, 4, 4),
                DecodeConfig(d, 64, 64, 1, 4, 6), DecodeConfig(d, 32, 128, 1, 4, 3), DecodeConfig(d, 128, 64, 1, 4, 4),
                DecodeConfig(d, 64, 256, 1, 4, 2)]  # fmt: skip
    if K <= 4096:  # qkv, o
        return [DecodeConfig(d, 16, 256, 1, 1, 4), DecodeConfig(d, 16, 256, 1, 1, 3), DecodeConfig(d, 16, 256, 1, 1, 5),
                DecodeConfig(d, 16, 128, 1, 1, 6), DecodeConfig(d, 16, 512, 1, 1, 3), DecodeConfig(d, 16, 128, 1, 4, 3),
                DecodeConfig(d, 16, 128, 1, 2, 4), DecodeConfig(d, 16, 256, 2, 1, 4)]  # fmt: skip
    return [DecodeConfig(d, 64, 64, 11, 4, 4), DecodeConfig(d, 64, 64, 8, 4, 4), DecodeConfig(d, 64, 64, 11, 4, 6),
            DecodeConfig(d, 64, 64, 11, 4, 3), DecodeConfig(d, 64, 64, 22, 4, 4), DecodeConfig(d, 64, 128, 10, 4, 3),
            DecodeConfig(d, 64, 128, 8, 4, 3), DecodeConfig(d, 128, 64, 11, 4, 4), DecodeConfig(d, 128, 64, 22, 4, 4),
            DecodeConfig(d, 32, 128, 11, 2, 4), DecodeConfig(d, 32, 64, 11, 1, 6), DecodeConfig(d, 64, 64, 6, 4, 4),
            DecodeConfig(d, 64, 32, 11, 4, 8)]  # fmt: skip


def measure_shape(name: str, M: int, K: int, N: int, sms: int, reserve: float, extras: bool) -> dict:
    """cuBLAS, kiln's routed `linear` (the rule), the previous tile kernel, the candidates while more than
    `reserve` seconds are left; with `extras` the rule's config again with PDL, and cuBLAS and kiln after
    another kernel. Returns a summary."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to(DEV, DT)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEV, DT)
    want = F.linear(x.float(), w.float())
    nbytes = (N * K + M * K + M * N) * x.element_size()
    shape = {"name": name, "M": M, "K": K, "N": N}
    base = {}

    def case(variant, fn, config=None, group="decode"):
        def run():
            with use_backend("triton"):
                err = (fn().float() - want).abs().max().item()
                us = graph_us(fn)
            r = {"us": us, "tbps": nbytes / us / 1e6, "frac_copy": nbytes / us / 1e6 / COPY_TBPS,
                 "max_abs_diff_vs_fp32": err}  # fmt: skip
            if "cublas" in base:
                r["ratio_vs_cublas"] = base["cublas"] / us
            return r

        e = record({"group": group, "shape": shape, "variant": variant, "config": config}, run)
        if "us" in e and variant in ("cublas", "kiln linear (routed)"):
            base[variant.split()[-1].strip("()")] = e["us"]
        return e

    case("cublas", lambda: F.linear(x, w))
    picked = decode_config(M, N, K, sms)
    case("kiln linear (routed)", lambda: linear(x, w), str(picked))
    old = _decode_config(N, K, sms)
    case("kiln previous (tile kernel)", lambda: matmul_fwd(x, w.t(), config=old, tma=False)[0], str(old))
    found = []
    for cfg in candidates(M, K, N):
        if left() < reserve:  # keep time for what comes after
            break
        e = case("candidate", lambda cfg=cfg: decode_matmul(x, w.t(), config=cfg), str(cfg))
        e["programs"] = triton.cdiv(N, cfg.block_n) * cfg.split_k
        bad = e.get("max_abs_diff_vs_fp32", 1.0) > 0.05  # bf16 output of a ~N(0, 1) sum: ulp ~ 0.01
        if "us" in e and not bad:
            found.append((e["us"], cfg))
    found.sort(key=lambda t: t[0])
    summary = {"shape": shape, "config": str(picked), "cublas_us": base.get("cublas"),
               "routed_us": base.get("routed"), "best": [(round(us, 3), str(c)) for us, c in found[:5]],
               "best_cfg": [c for _, c in found[:1]]}  # fmt: skip
    if not extras:
        return summary
    if CUDA and torch.cuda.get_device_capability()[0] >= 9 and left() > reserve - 4:
        # The rule's config launched with PDL: back to back, each call starts while the one before it
        # finishes. A decode step whose other kernels signal early would see this; kiln's do not yet.
        cp = picked._replace(pdl=True)
        case("rule config with pdl (back to back)", lambda: decode_matmul(x, w.t(), config=cp), str(cp))
    # After another kernel: x rewritten in place by an elementwise kernel before each call (as a decode step
    # feeds a GEMM), minus that kernel alone.
    paths = [("cublas", lambda: F.linear(x, w)), ("kiln linear (routed)", lambda: linear(x, w))]
    paths += [(f"candidate {c}", lambda c=c: decode_matmul(x, w.t(), config=c)) for _, c in found[:1]]
    for variant, f in paths:
        if left() < reserve - 6:
            break

        def run(f=f):
            with use_backend("triton"):
                alone = graph_us(lambda: x.mul_(1.0))
                pair = graph_us(lambda: (x.mul_(1.0), f()))
            return {"us": pair - alone, "us_elementwise_alone": alone}

        e = record({"group": "decode_after_other_kernel", "shape": shape, "variant": variant}, run)
        if variant == "cublas" and "us" in e:
            base["cublas_after"] = e["us"]
        elif "us" in e and "cublas_after" in base:
            e["ratio_vs_cublas_same_setting"] = base["cublas_after"] / e["us"]
    return summary


def cold(name: str, M: int, K: int, N: int, configs: list[DecodeConfig]) -> None:
    """L2-cold: the graph cycles through R copies of W (R * |W| >= 4x L2), each call a different one."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M, K, generator=gen).to(DEV, DT)
    wbytes = N * K * x.element_size()
    R = min(64, max(2, triton.cdiv(4 * L2_BYTES, wbytes))) if CUDA else 2
    ws = [(torch.randn(N, K, generator=gen) / K**0.5).to(DEV, DT) for _ in range(min(R, 3))]
    ws = [ws[i % len(ws)].clone() for i in range(R)]  # distinct memory, few random draws
    nbytes = (N * K + M * K + M * N) * x.element_size()
    shape = {"name": name, "M": M, "K": K, "N": N, "weight_copies": R}
    paths = {"cublas": lambda wi: F.linear(x, wi), "kiln linear (routed)": lambda wi: linear(x, wi)}
    for cfg in configs:
        paths[f"candidate {cfg}"] = lambda wi, cfg=cfg: decode_matmul(x, wi.t(), config=cfg)
    base = {}
    for variant, f in paths.items():

        def run(f=f):
            with use_backend("triton"):
                us = graph_us(lambda: [f(wi) for wi in ws], calls=max(1, 200 // R)) / R
            r = {"us": us, "tbps": nbytes / us / 1e6, "frac_copy": nbytes / us / 1e6 / COPY_TBPS}
            if "cublas" in base:
                r["ratio_vs_cublas"] = base["cublas"] / us
            return r

        e = record({"group": "decode_l2_cold", "shape": shape, "variant": variant}, run)
        if variant == "cublas" and "us" in e:
            base["cublas"] = e["us"]
    ws.clear()
    if CUDA:
        torch.cuda.empty_cache()


def row_major_b(M: int, K: int, N: int, sms: int) -> None:
    """matmul(x, B) with B (K, N) row-major (not the nn.Linear layout): cuBLAS vs kiln's routed matmul."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(M, K, generator=gen).to(DEV, DT)
    b = (torch.randn(K, N, generator=gen) / K**0.5).to(DEV, DT)
    want = x.float() @ b.float()
    shape = {"name": f"M={M} row-major B", "M": M, "K": K, "N": N}
    config = str(decode_config(M, N, K, sms, False))
    base = {}
    for variant, f in [
        ("cublas", lambda: torch.matmul(x, b)),
        ("kiln matmul (routed)", lambda: matmul(x, b)),
    ]:

        def run(f=f):
            with use_backend("triton"):
                err = (f().float() - want).abs().max().item()
                us = graph_us(f)
            r = {"us": us, "max_abs_diff_vs_fp32": err}
            if "cublas" in base:
                r["ratio_vs_cublas"] = base["cublas"] / us
            return r

        e = record({"group": "decode_row_major_b", "shape": shape, "variant": variant, "config": config}, run)
        if variant == "cublas" and "us" in e:
            base["cublas"] = e["us"]


@triton.jit
def _noop_kernel(X_ptr):
    tl.store(X_ptr, tl.load(X_ptr) + 1.0)


def host_overhead(sms: int) -> None:
    """Host microseconds per call of each launch path at the qkv decode shape (the GPU never waits)."""
    if not CUDA:
        return
    x = torch.randn(1, 1536, device=DEV, dtype=DT)
    w = torch.randn(2048, 1536, device=DEV, dtype=DT)
    z = torch.zeros(1, device=DEV)
    old = _decode_config(2048, 1536, sms)
    cfg = decode_config(1, 2048, 1536, sms)
    paths = {
        "F.linear": lambda: F.linear(x, w),
        "kiln linear (routed)": lambda: linear(x, w),
        "kiln matmul_fwd (routed)": lambda: matmul_fwd(x, w.t()),
        "decode_matmul (explicit config)": lambda: decode_matmul(x, w.t(), config=cfg),
        "previous: matmul_fwd (tile kernel, fixed config, block pointers)": lambda: matmul_fwd(
            x, w.t(), config=old, tma=False
        ),
        "trivial Triton kernel (1 pointer arg)": lambda: _noop_kernel[(1,)](z),
    }
    for variant, fn in paths.items():

        def run(fn=fn):
            with use_backend("triton"):
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
                best = []
                for _ in range(3):
                    t = time.perf_counter()
                    for _ in range(300):
                        fn()
                    best.append((time.perf_counter() - t) / 300 * 1e6)
                    torch.cuda.synchronize()
            return {"host_us_per_call": min(best), "host_us_all": best}

        record({"group": "host_overhead", "shape": {"M": 1, "K": 1536, "N": 2048}, "variant": variant}, run)


def meta() -> dict:
    commit = git_commit()
    return {
        "gpu": torch.cuda.get_device_name() if CUDA else "cpu (Triton interpreter)",
        "sms": sm_count(torch.device(DEV)), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "commit": commit,
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "timing": "median over 11 replays of a CUDA graph of 200 back-to-back calls (GPU us per call)",
        "ceiling": f"copy {COPY_TBPS} TB/s",
    }  # fmt: skip


def main() -> None:
    info = meta()
    sms = info["sms"]
    summary = []
    for M in (1, 16):  # the goal's shapes: every extra
        for name, K, N in SHAPES:
            summary.append(
                measure_shape(f"{name} M={M}", M, K, N, sms, reserve=50 if M == 1 else 30, extras=True)
            )
    for M in (2, 4, 8):  # the rule between them: FMAs or tensor cores
        for name, K, N in SHAPES:
            if left() > 25:
                summary.append(measure_shape(f"{name} M={M}", M, K, N, sms, reserve=25, extras=False))
    host_overhead(sms)
    for M in (1, 16):  # qkv's shape
        row_major_b(M, *((96, 80) if ARGS.smoke else (1536, 2048)), sms)
    for s in summary[: 2 * len(SHAPES)]:  # L2-cold: cuBLAS, the rule, and the fastest candidate if another
        sh = s["shape"]
        best = [c for c in s.get("best_cfg", []) if str(c) != s["config"]]
        if left() > 5:
            try:
                cold(sh["name"], sh["M"], sh["K"], sh["N"], best)
            except Exception as err:
                RESULTS.append({"group": "decode_l2_cold", "shape": sh, "error": repr(err)[:400]})
    info["total_s"] = round(time.time() - T0, 1)
    doc = {"meta": info, "summary": summary, "cases": RESULTS}
    for s in summary:
        s.pop("best_cfg", None)
        print(s, flush=True)
    if ARGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
        with open(ARGS.out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    print(f"{len(RESULTS)} cases, {sum('error' in r for r in RESULTS)} errors, {info['total_s']} s")


if __name__ == "__main__":
    main()
