"""One-off H200 experiment: why a norm's forward+backward costs more host time while the GPU is busy.

    python bench/experiments/host_busy.py OUT.json   # from the repo root, on a CUDA GPU (~30 s)

On the H200's host kiln's LayerNorm forward+backward took 276 us per call with an idle GPU and 552 us with
a busy one (RMSNorm 246 / 333, F.layer_norm 110 / 168). Here: host time per call, idle and busy, for
variants that drop one part at a time (the bias, the weight's gradient, the autograd Function), and a
torch.profiler table of the busy case (CPU self time per op).
"""

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench")
from kiln.kernels import layernorm as LN  # noqa: E402
from kiln.kernels import rmsnorm as RN  # noqa: E402
from provenance import run_meta  # noqa: E402


def calls_us(fn, busy: bool, n=100, reps=5) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        if busy:
            torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time queued ahead of the calls
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(out), 2)


def table(fn, busy: bool, n=50) -> str:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if busy:
            torch.cuda._sleep(200_000_000)
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50)


def main():
    dev = torch.device("cuda")
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn_like(w, requires_grad=True)
    g = torch.randn_like(x)
    cases = {
        "kiln ln x,w,b": lambda: torch.autograd.grad(LN.layernorm(x, w, b), (x, w, b), g),
        "kiln ln x,w (no bias)": lambda: torch.autograd.grad(LN.layernorm(x, w, None), (x, w), g),
        "kiln ln grad x only": lambda: torch.autograd.grad(LN.layernorm(x, w, b), (x,), g),
        "kiln rms x,w": lambda: torch.autograd.grad(RN.rmsnorm(x, w), (x, w), g),
        "kiln rms grad x only": lambda: torch.autograd.grad(RN.rmsnorm(x, w), (x,), g),
        "F.layer_norm x,w,b": lambda: torch.autograd.grad(F.layer_norm(x, (4096,), w, b), (x, w, b), g),
        "kiln ln .backward()": lambda: LN.layernorm(x, w, b).backward(g),
    }
    out = run_meta() | {"idle_us": {}, "busy_us": {}, "tables": {}}
    for name, fn in cases.items():
        out["idle_us"][name] = calls_us(fn, False)
        out["busy_us"][name] = calls_us(fn, True)
        print(f"{name:28s} idle {out['idle_us'][name]:8.1f}  busy {out['busy_us'][name]:8.1f}", flush=True)
    for name in ("kiln ln x,w,b", "kiln rms x,w"):
        for busy in (False, True):
            t = table(cases[name], busy)
            out["tables"][f"{name} {'busy' if busy else 'idle'}"] = t
            print(f"== {name} {'busy' if busy else 'idle'}\n{t}", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
