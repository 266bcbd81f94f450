"""Where the host time of a kernel call goes, on a CUDA machine: launch paths and kiln's norm ops.

    python bench/host_overhead.py                      # on a CUDA GPU -> bench/results/host_overhead.json
    python bench/host_overhead.py --traces traces/     # also torch.profiler traces of fwd+bwd
    python bench/host_overhead.py --smoke              # CPU, interpreter, 2 calls each: checks the script

Every figure is host (CPU) microseconds per call, launches queued without waiting for the GPU
(median of 7 batches of 200 calls, on small tensors so the GPU never throttles the queue), plus a
cProfile of kiln's RMSNorm forward+backward to show which Python frames the time sits in.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels import layernorm as LN
from kiln.kernels import rmsnorm as RN
from kiln.kernels.dispatch import use_backend
from kiln.profile.harness import BenchRun, bench_parser


@triton.jit
def _one_ptr(X):
    tl.store(X + tl.program_id(0), 1.0)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, n=200, reps=7, warmup=20) -> float:
    """Median over `reps` batches of host microseconds per call, `n` calls queued per batch."""
    for _ in range(warmup):
        fn()
    sync()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        sync()
    return round(statistics.median(out), 2)


def traces(folder: str, dev: torch.device) -> None:
    """Chrome traces (torch.profiler, CPU + CUDA) of 5 forward+backward calls at 32768 x 4096 bf16,
    each after an L2 flush as triton.testing.do_bench does: they show when each kernel is launched
    on the host and when it runs on the GPU, i.e. whether the GPU waits for the host."""
    import os

    os.makedirs(folder, exist_ok=True)
    x = torch.randn(32768, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn_like(w, requires_grad=True)
    g = torch.randn_like(x)
    flush = torch.empty(256 << 20, dtype=torch.int8, device=dev)
    cases = {
        "kiln_rmsnorm": (lambda: RN.rmsnorm(x, w), (x, w)),
        "kiln_layernorm": (lambda: LN.layernorm(x, w, b), (x, w, b)),
    }
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        cases["liger_rmsnorm"] = (lambda: LigerRMSNormFunction.apply(x, w, 1e-6), (x, w))
        cases["liger_layernorm"] = (lambda: LigerLayerNormFunction.apply(x, w, b, 1e-6), (x, w, b))
    except Exception:  # noqa: BLE001 - the peer is optional
        pass
    from torch.profiler import ProfilerActivity, profile

    for name, (f, inputs) in cases.items():
        for _ in range(5):
            torch.autograd.grad(f(), inputs, g)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                flush.zero_()
                torch.autograd.grad(f(), inputs, g)
            torch.cuda.synchronize()
        prof.export_chrome_trace(f"{folder}/{name}.json")


def main() -> int:
    ap = bench_parser("host_overhead", __doc__)
    ap.add_argument("--traces", help="folder for torch.profiler traces of fwd+bwd at 32768 x 4096 (CUDA)")
    args = ap.parse_args()
    run = BenchRun("host_overhead", __file__, args)
    dev = run.device
    # GPU: small tensors, so the GPU never throttles the queue; smoke: tiny ones and 2 calls per figure
    M, D = (4, 64) if run.smoke else (64, 4096)
    calls = dict(n=1, reps=2, warmup=1) if run.smoke else {}

    def per_call(fn):
        return per_call_us(fn, **calls)

    res: dict[str, float | str] = {}
    x = torch.randn(M, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.randn(D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn_like(w, requires_grad=True)
    g = torch.randn_like(x)
    buf = torch.empty(1024, device=dev)

    res["torch.empty"] = per_call(lambda: torch.empty(M, D, device=dev, dtype=torch.bfloat16))
    res["torch.add"] = per_call(lambda: torch.add(g, g))
    res["triton 1-arg launch"] = per_call(lambda: _one_ptr[(1,)](buf))
    if not run.smoke:  # the interpreter returns no compiled kernel to launch by hand
        compiled = _one_ptr[(1,)](buf)
        res["triton 1-arg CompiledKernel[grid]"] = per_call(lambda: compiled[(1, 1, 1)](buf))
        stream = torch.cuda.current_stream().cuda_stream
        res["triton 1-arg CompiledKernel[grid] stream given"] = per_call(
            lambda: compiled[(1, 1, 1)](buf, stream=stream)
        )

    # the RMSNorm forward kernel alone, arguments prepared
    y = torch.empty_like(x)
    rstd = torch.empty(M + RN.COUNTERS.value, device=dev)  # rstd per row, then the counters
    # S_ptr (FP8 scales) and B_ptr (a split input's bias) unused: y and w
    kargs = (x, x, x, y, y, w, rstd, w, D, 0, D, 0, M, D, 1e-6, 0.0)
    # in the kernel's order: the compiled kernel below takes them positionally
    consts = dict(
        HAS_RESIDUAL=False,
        FOR_BACKWARD=True,
        FP8=False,
        ROWS=1,
        BLOCK=D,
        PDL=False,
        FIRST=False,
        SPLIT=0,
        HAS_BIAS=False,
    )
    res["rmsnorm fwd kernel launch"] = per_call(
        lambda: RN._rmsnorm_fwd_kernel[(M,)](*kargs, **consts, num_warps=8)
    )
    if not run.smoke:
        ck = RN._rmsnorm_fwd_kernel[(M,)](*kargs, **consts, num_warps=8)
        res["rmsnorm fwd CompiledKernel[grid]"] = per_call(
            lambda: ck[(M, 1, 1)](*kargs, *consts.values(), stream=stream)
        )
    with use_backend("triton"):
        prof_text = kiln_calls(res, per_call, x, r, w, b, g, run.smoke)
    if args.traces:
        traces(args.traces, dev)
    for k, v in res.items():
        print(f"{k:50s} {v}")
    print(prof_text)
    run.write(host_us_per_call=res, profile_rmsnorm_fwd_bwd=prof_text)
    return 0


def kiln_calls(res: dict, per_call_us, x, r, w, b, g, smoke: bool) -> str:
    """Host us per call of kiln's norm ops and their torch peers into res; returns a cProfile of kiln's
    RMSNorm forward+backward (500 calls; 2 in a smoke run)."""
    D = x.shape[-1]
    with torch.no_grad():
        res["kiln rmsnorm_fwd launcher"] = per_call_us(lambda: RN.rmsnorm_fwd(x, w, 1e-6))
        res["kiln rmsnorm (no grad)"] = per_call_us(lambda: RN.rmsnorm(x, w))
        res["F.rms_norm (no grad)"] = per_call_us(lambda: F.rms_norm(x, (D,), w, 1e-6))
    _, h, rs = RN.rmsnorm_fwd(x.detach(), w.detach(), 1e-6)
    res["kiln rmsnorm_bwd launcher"] = per_call_us(lambda: RN.rmsnorm_bwd(g, h, w.detach(), rs))
    res["dw_partial.sum(0).to(bf16)"] = per_call_us(
        lambda: torch.empty(264, D, device=x.device).sum(0).to(torch.bfloat16)
    )

    def grad(fn, inputs):
        return lambda: torch.autograd.grad(fn(), inputs, g)

    res["kiln rmsnorm fwd+bwd"] = per_call_us(grad(lambda: RN.rmsnorm(x, w), (x, w)))
    res["F.rms_norm fwd+bwd"] = per_call_us(grad(lambda: F.rms_norm(x, (D,), w, 1e-6), (x, w)))
    res["kiln rmsnorm+residual fwd+bwd"] = per_call_us(
        lambda: torch.autograd.grad(RN.rmsnorm(x, w, residual=r), (x, r, w), (g, g))
    )
    res["kiln layernorm fwd+bwd"] = per_call_us(grad(lambda: LN.layernorm(x, w, b), (x, w, b)))
    res["F.layer_norm fwd+bwd"] = per_call_us(grad(lambda: F.layer_norm(x, (D,), w, b), (x, w, b)))

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, d):
            return d

    res["autograd.Function identity fwd+bwd"] = per_call_us(grad(lambda: Identity.apply(x), (x,)))
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        res["liger rmsnorm fwd+bwd"] = per_call_us(
            grad(lambda: LigerRMSNormFunction.apply(x, w, 1e-6), (x, w))
        )
    except Exception as e:  # noqa: BLE001 - the peer is optional
        res["liger"] = f"unavailable: {e}"

    prof = cProfile.Profile()
    f = grad(lambda: RN.rmsnorm(x, w), (x, w))
    prof.enable()
    for _ in range(2 if smoke else 500):
        f()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    return s.getvalue()


if __name__ == "__main__":
    sys.exit(main())
