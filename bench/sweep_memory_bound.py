"""Sweep the launch variants of the kernels that tie their best peer, against those peers, interleaved.

    python bench/sweep_memory_bound.py --out bench/results/sweep_memory_bound.json   # CUDA GPU, ~2 min
    python bench/sweep_memory_bound.py --smoke --out /tmp/sweep.json                 # CPU interpreter

Groups (bf16, the shapes of bench/kernels_norms.py and kernels_gemm_ce.py):
- rmsnorm / layernorm / rmsnorm+residual forward at 32768 x 4096 (and RMSNorm at 32768 x 1536, the
  Qwen2.5-1.5B width): rows per program (one (rows, D) tile, the weight read once for all) x warps,
  against Liger and torch.compile;
- RoPE forward on q (8, 4096, 32, 128), k (8, 4096, 8, 128): flat row blocks, rows x warps x eviction
  policy, against torch.compile, Liger and a copy;
- SwiGLU 32768 x 8960 forward + backward against torch.compile, and the backward kernel's block x warps;
- prefill GEMMs of a Qwen2.5-1.5B layer at 8192 tokens (qkv, o, gate_up, down) through `linear`,
  against F.linear (cuBLAS): do_bench time, CUDA-graph time and host time per call.
Every group is timed with bench/timing.interleaved_ms (rounds in random order, L2 flushed before each
call, median over rounds); CUDA-graph time once per contender. A failing contender records its error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernels_norms as kn  # noqa: E402 - the eager peers and Liger imports of the norms benchmark
from kiln.kernels.dispatch import use_backend  # noqa: E402
from kiln.kernels.layernorm import layernorm_fwd  # noqa: E402
from kiln.kernels.matmul import linear  # noqa: E402
from kiln.kernels.rmsnorm import rmsnorm_fwd  # noqa: E402
from kiln.kernels.rope import rope_launch  # noqa: E402
from kiln.kernels.swiglu import swiglu, swiglu_bwd  # noqa: E402
from provenance import run_meta  # noqa: E402
from timing import interleaved_ms  # noqa: E402

EPS = 1e-6


def run_group(
    name: str, fns: dict[str, Callable[[], object] | None], smoke: bool, nbytes: int = 0, rounds: int = 5
) -> dict:
    """Warm up every contender, then time them interleaved (`rounds`); graph and host time once each."""
    ok: dict[str, Callable[[], object]] = {}
    res: dict[str, dict] = {}
    for n, f in fns.items():
        if f is None:
            res[n] = {"error": "unavailable"}
            continue
        try:
            f()
            ok[n] = f
        except Exception as e:  # noqa: BLE001 - record and go on
            res[n] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    if smoke:
        return {"group": name, "results": res | {n: {"ran": True} for n in ok}}
    for n, r in interleaved_ms(ok, rounds).items():
        res[n] = {"ms": round(r["ms"], 5), "rounds": r["rounds"]}
        if nbytes:
            res[n]["TBps"] = round(nbytes / r["ms"] / 1e9, 3)
    for n, f in ok.items():
        try:
            res[n]["graph_ms"] = round(triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median"), 5)
        except Exception as e:  # noqa: BLE001 - a peer that cannot be captured keeps its plain time
            res[n]["graph_ms"] = f"{type(e).__name__}: {str(e)[:120]}"
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            f()
        res[n]["host_ms"] = round((time.perf_counter() - t) / 20 * 1e3, 4)
        torch.cuda.synchronize()
    ranked = sorted((r["ms"], n) for n, r in res.items() if "ms" in r)
    out = {"group": name, "results": res, "ranking": [n for _, n in ranked]}
    print(f"{name}: " + ", ".join(f"{n} {ms * 1e3:.1f}us" for ms, n in ranked), flush=True)
    return out


def no_grad(f: Callable[[], object]) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return f()

    return run


def rmsnorm_group(mk: kn.Inputs, M: int, D: int, rows: tuple, warps: tuple, smoke: bool) -> dict:
    x, w = mk.randn(M, D), mk.randn(D, scale=0.1) + 1
    fns = {f"kiln_r{r}_w{nw}": no_grad(lambda r=r, nw=nw: rmsnorm_fwd(x, w, EPS, None, nw, r))
           for r in rows for nw in warps}  # fmt: skip
    fns["liger"] = kn.liger(no_grad(lambda: kn.LigerRMSNormFunction.apply(x, w, EPS)))
    c = mk.compiled(kn.eager_rmsnorm)
    fns["compile"] = c and no_grad(lambda: c(x, w))
    return run_group(f"rmsnorm_{D}", fns, smoke, 2 * x.numel() * 2)


def norms(mk: kn.Inputs, M: int, smoke: bool) -> list[dict]:
    groups = [rmsnorm_group(mk, M, 4096 if not smoke else 96, (1, 2, 4), (4, 8, 16), smoke),
              rmsnorm_group(mk, M, 1536 if not smoke else 48, (1, 2, 4, 8), (4, 8, 16), smoke)]  # fmt: skip
    D = 4096 if not smoke else 96
    x, r_, w, b = mk.randn(M, D), mk.randn(M, D), mk.randn(D, scale=0.1) + 1, mk.randn(D, scale=0.1)
    fns = {f"kiln_r{r}_w{nw}": no_grad(lambda r=r, nw=nw: layernorm_fwd(x, w, b, EPS, None, nw, r))
           for r in (1, 2, 4) for nw in (4, 8, 16)}  # fmt: skip
    fns["liger"] = kn.liger(no_grad(lambda: kn.LigerLayerNormFunction.apply(x, w, b, EPS)))
    c = mk.compiled(kn.eager_layernorm)
    fns["compile"] = c and no_grad(lambda c=c: c(x, w, b))
    groups.append(run_group("layernorm_4096", fns, smoke, 2 * x.numel() * 2))
    fns = {f"kiln_r{r}_w{nw}": no_grad(lambda r=r, nw=nw: rmsnorm_fwd(x, w, EPS, r_, nw, r))
           for r in (1, 2) for nw in (8, 16)}  # fmt: skip
    fns["liger"] = kn.liger(no_grad(lambda: kn.LigerFusedAddRMSNormFunction.apply(x, r_, w, EPS)))
    groups.append(run_group("rmsnorm_residual_4096", fns, smoke, 4 * x.numel() * 2))
    return groups


def rope(mk: kn.Inputs, smoke: bool) -> dict:
    B, T, Hq, Hk, D = (8, 4096, 32, 8, 128) if not smoke else (1, 3, 4, 2, 16)
    q, k = mk.randn(B, T, Hq, D), mk.randn(B, T, Hk, D)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=mk.device).float() / D))
    ang = torch.outer(torch.arange(T, device=mk.device).float(), inv)  # (T, D/2)
    cos, sin = ang.cos(), ang.sin()
    cos_full, sin_full = torch.cat((cos, cos), -1).bfloat16(), torch.cat((sin, sin), -1).bfloat16()
    fns: dict[str, Callable[[], object] | None] = {}
    for evict in ("", "evict_first"):
        for rows, nw in ((4, 1), (8, 1), (16, 1), (16, 2), (32, 2), (32, 4)):
            name = f"kiln_r{rows}_w{nw}{'_ef' if evict else ''}"
            fns[name] = no_grad(
                lambda rows=rows, nw=nw, evict=evict: rope_launch(
                    q, k, cos, sin, None, False, rows=rows, num_warps=nw, evict=evict
                )
            )
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)  # the peers take (B, H, T, D) views of the same memory
    c = mk.compiled(kn.eager_rope)
    fns["compile"] = c and no_grad(lambda: c(qt, kt, cos_full, sin_full))
    fns["liger"] = kn.liger(
        no_grad(lambda: kn.LigerRopeFunction.apply(qt, kt, cos_full[None], sin_full[None]))
    )
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    fns["copy"] = lambda: (qo.copy_(q), ko.copy_(k))
    return run_group("rope_fwd", fns, smoke, 2 * (q.numel() + k.numel()) * 2)


def swiglu_group(mk: kn.Inputs, smoke: bool) -> list[dict]:
    M, H = (32768, 8960) if not smoke else (4, 80)
    g, u, do = mk.randn(M, H, scale=2.0), mk.randn(M, H, scale=2.0), mk.randn(M, H)
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()

    def fb(f):
        return lambda: torch.autograd.grad(f(gr, ur), (gr, ur), do)

    c = mk.compiled(kn.eager_swiglu)
    both = run_group("swiglu_fwd_bwd", {"kiln": fb(swiglu), "compile": c and fb(c)}, smoke, 8 * g.numel() * 2)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    bwd = {f"kiln_bwd_b{bl}_w{nw}": (lambda bl=bl, nw=nw: swiglu_bwd(do, g, u, dg, du, bl, nw))
           for bl, nw in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (512, 2))}  # fmt: skip
    return [both, run_group("swiglu_bwd", bwd, smoke, 5 * g.numel() * 2)]


def gemms(mk: kn.Inputs, smoke: bool) -> list[dict]:
    out = []
    M = 8192 if not smoke else 32
    for name, K, N in (
        ("qkv", 1536, 2048),
        ("o", 1536, 1536),
        ("gate_up", 1536, 17920),
        ("down", 8960, 1536),
    ):
        if smoke:
            K, N = 32, 48
        x, w = mk.randn(M, K), mk.randn(N, K, scale=K**-0.5)
        with torch.no_grad():
            out.append(run_group(f"gemm_{name}_M{M}", {"kiln": lambda x=x, w=w: linear(x, w),
                                                      "cublas": lambda x=x, w=w: F.linear(x, w)}, smoke))  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--only", default="norms,rope,swiglu,gemm")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    mk = kn.Inputs(device, args.smoke)
    M = 32768 if not args.smoke else 8
    res = run_meta() | {"liger": kn.LIGER, "groups": [], "errors": []}
    steps = {"norms": lambda: norms(mk, M, args.smoke), "rope": lambda: [rope(mk, args.smoke)],
             "swiglu": lambda: swiglu_group(mk, args.smoke), "gemm": lambda: gemms(mk, args.smoke)}  # fmt: skip
    t0 = time.perf_counter()
    with use_backend("triton"):
        for name in args.only.split(","):
            try:
                res["groups"] += steps[name]()
            except Exception as e:  # noqa: BLE001 - keep the other groups
                traceback.print_exc()
                res["errors"].append(f"{name}: {type(e).__name__}: {e}")
            if device == "cuda":
                torch.cuda.empty_cache()
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            with open(args.out, "w") as f:  # after every group: a run cut short keeps what it measured
                json.dump(res, f, indent=1)
    print(f"wrote {args.out} in {res['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
