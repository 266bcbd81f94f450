"""One-off H200 experiment: cache-eviction hints on the RoPE tables and the RMSNorm forward.

    python bench/experiments/cache_policies.py OUT.json   # from the repo root, on a CUDA GPU

1. RoPE forward, q (8, 4096, 32, 128) and k (8, 4096, 8, 128) bf16: kiln's 8- and 16-row blocks with and
   without `evict_last` on the cos/sin loads (`rope_launch(table_evict=...)`), against torch.compile and
   a copy, interleaved (bench/timing.py).
2. The norms benchmark's RoPE case (bench/kernels_norms.py: every peer, forward and forward + backward)
   with kiln's default, then with the tables loaded `evict_last`.
3. RMSNorm forward at 32768 x 4096 as a stand-alone kernel with eviction hints on the row load, the
   weight load and the output store, against kiln's kernel and Liger's.
"""

import functools
import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "bench")
import kernels_norms as kn  # noqa: E402
from kiln.kernels import rope  # noqa: E402
from kiln.kernels.dispatch import use_backend  # noqa: E402
from kiln.kernels.rmsnorm import rmsnorm_fwd  # noqa: E402
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import no_grad, run_group  # noqa: E402


@triton.jit
def rms_hinted(X, Y, W, RSTD, stride, n_cols, eps, XE: tl.constexpr, WE: tl.constexpr, YE: tl.constexpr,
               BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy=WE).to(tl.float32)
    x = tl.load(X + row * stride + cols, mask=mask, other=0.0, eviction_policy=XE).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(Y + row * stride + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask, eviction_policy=YE)
    tl.store(RSTD + row, rstd)


def main():
    out = run_meta() | {"liger": kn.LIGER, "groups": []}
    mk = kn.Inputs("cuda", False)
    B, T, Hq, Hk, D = kn.FULL["rope"]
    q, k = mk.randn(B, T, Hq, D), mk.randn(B, T, Hk, D)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    ang = torch.outer(torch.arange(T, device="cuda").float(), inv)
    cos, sin = ang.cos(), ang.sin()
    cf, sf = torch.cat((cos, cos), -1).bfloat16(), torch.cat((sin, sin), -1).bfloat16()
    fns = {f"kiln_r{r}_table{'_el' if te else ''}": no_grad(
        lambda r=r, te=te: rope.rope_launch(q, k, cos, sin, None, False, rows=r, table_evict=te))
        for r in (8, 16) for te in ("", "evict_last")}  # fmt: skip
    c = torch.compile(kn.eager_rope, dynamic=False)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    fns["compile"] = no_grad(lambda: c(qt, kt, cf, sf))
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    fns["copy"] = lambda: (qo.copy_(q), ko.copy_(k))
    out["groups"].append(run_group("rope_fwd_table_evict", fns, False, 2 * (q.numel() + k.numel()) * 2))
    del q, k, qo, ko, qt, kt
    torch.cuda.empty_cache()

    launch = rope.rope_launch
    for te in ("", "evict_last"):
        rope.rope_launch = functools.partial(launch, table_evict=te)  # apply_rope looks it up at call time
        bench = kn.Bench(False, 1e9)
        with use_backend("triton"):
            kn.bench_rope(bench, mk, *kn.FULL["rope"])
        out["groups"].append({"group": f"kernels_norms rope case, table_evict={te!r}", "cases": bench.cases})
        torch.cuda.empty_cache()
    rope.rope_launch = launch

    M, N = kn.FULL["norm"]
    x, w = mk.randn(M, N), mk.randn(N, scale=0.1) + 1
    y, rs = torch.empty_like(x), torch.empty(M, device="cuda")
    fns = {"kiln": no_grad(lambda: rmsnorm_fwd(x, w, 1e-6))}
    for xe, we, ye in (("", "", ""), ("evict_first", "", ""), ("", "evict_last", ""), ("", "", "evict_first"),
                       ("evict_first", "evict_last", "evict_first"), ("", "evict_last", "evict_first")):  # fmt: skip
        fns[f"hint_x{xe[6:] or '-'}_w{we[6:] or '-'}_y{ye[6:] or '-'}"] = (
            lambda xe=xe, we=we, ye=ye: rms_hinted[(M,)](x, y, w, rs, N, N, 1e-6, XE=xe, WE=we, YE=ye, BLOCK=N,
                                                         num_warps=8))  # fmt: skip
    fns["liger"] = no_grad(lambda: kn.LigerRMSNormFunction.apply(x, w, 1e-6))
    out["groups"].append(run_group("rmsnorm_4096_hints", fns, False, 2 * x.numel() * 2))
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


main()
