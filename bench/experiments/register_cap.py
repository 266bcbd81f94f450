"""One-off H200 experiment: a register cap on the norm forwards (results in bench/results/register_cap.json).

Ran at commit 52c74d2, whose norm launchers took `maxnreg`; the option was removed afterwards because the
cap made every kernel slower (RMSNorm 4096: 135.1 us capped at 32 against 134.3 uncapped and Liger's 132.5;
LayerNorm 634.9 against 133.3: spills), so this script needs that commit.

    python bench/experiments/register_cap.py OUT.json   # from the repo root, on a CUDA GPU

kiln's RMSNorm forward at D = 4096 (one row of 16 elements a thread in 8 warps) compiles to 40 registers a
thread, Liger's to 38: both fit 6 programs (48 warps) on an SM. Capped at 32 (`maxnreg=32`; ptxas spills
one value, 8 bytes of stack) 8 programs fit: a third more rows in flight. Timed interleaved against Liger
(bench/timing.py) for RMSNorm at D = 4096 and 1536, RMSNorm + residual and LayerNorm at 4096; then the
norms benchmark's RMSNorm case (bench/kernels_norms.py, every peer, forward and forward + backward) with
kiln's launcher as it is and with the cap.
"""

import functools
import json
import sys

import torch

sys.path.insert(0, "bench")
import kernels_norms as kn  # noqa: E402
from kiln.kernels import rmsnorm  # noqa: E402
from kiln.kernels.dispatch import use_backend  # noqa: E402
from kiln.kernels.layernorm import layernorm_fwd  # noqa: E402
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import no_grad, run_group  # noqa: E402

EPS = 1e-6


def main():
    out = run_meta() | {"liger": kn.LIGER, "groups": []}
    mk = kn.Inputs("cuda", False)
    M = kn.FULL["norm"][0]
    for D in (4096, 1536):
        x, w = mk.randn(M, D), mk.randn(D, scale=0.1) + 1
        fns = {f"kiln_cap{c or '-'}": no_grad(lambda c=c: rmsnorm.rmsnorm_fwd(x, w, EPS, maxnreg=c))
               for c in (None, 32, 48)}  # fmt: skip
        fns["liger"] = no_grad(lambda: kn.LigerRMSNormFunction.apply(x, w, EPS))
        out["groups"].append(run_group(f"rmsnorm_{D}", fns, False, 2 * x.numel() * 2))
        del x
        torch.cuda.empty_cache()
    D = kn.FULL["norm"][1]
    x, r, w, b = mk.randn(M, D), mk.randn(M, D), mk.randn(D, scale=0.1) + 1, mk.randn(D, scale=0.1)
    fns = {
        f"kiln_cap{c or '-'}": no_grad(lambda c=c: rmsnorm.rmsnorm_fwd(x, w, EPS, r, maxnreg=c))
        for c in (None, 32)
    }
    fns["liger"] = no_grad(lambda: kn.LigerFusedAddRMSNormFunction.apply(x, r, w, EPS))
    out["groups"].append(run_group("rmsnorm_residual_4096", fns, False, 4 * x.numel() * 2))
    fns = {
        f"kiln_cap{c or '-'}": no_grad(lambda c=c: layernorm_fwd(x, w, b, EPS, maxnreg=c))
        for c in (None, 32, 48)
    }
    fns["liger"] = no_grad(lambda: kn.LigerLayerNormFunction.apply(x, w, b, EPS))
    out["groups"].append(run_group("layernorm_4096", fns, False, 2 * x.numel() * 2))
    del x, r
    torch.cuda.empty_cache()
    launch = rmsnorm.rmsnorm_fwd
    for cap in (None, 32):
        # rmsnorm() and its autograd Function look rmsnorm_fwd up at call time
        rmsnorm.rmsnorm_fwd = functools.partial(launch, maxnreg=cap)
        bench = kn.Bench(False, 1e9)
        with use_backend("triton"):
            kn.bench_rmsnorm(bench, mk, *kn.FULL["norm"])
        out["groups"].append({"group": f"kernels_norms rmsnorm case, maxnreg={cap}", "cases": bench.cases})
        torch.cuda.empty_cache()
    rmsnorm.rmsnorm_fwd = launch
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


main()
