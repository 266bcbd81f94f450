"""Sweep the fused linear cross-entropy's schedule: where its time goes, and which plan is fastest under 1 GiB.

    python bench/sweep_linear_ce.py --out bench/results/sweep_linear_ce.json     # on the H200, < 100 s
    python bench/sweep_linear_ce.py --smoke                                      # CPU, interpreter

Case: 8192 tokens x 1536 hidden x 151936 vocabulary, bf16, forward + backward of the mean loss
(torch.autograd.grad of hidden and weight), as bench/kernels_gemm_ce.py measures it. Three parts:
1. breakdown: each step of one chunk timed alone (CUDA events) at several chunk sizes: the logits GEMM,
   the loss + in-place gradient kernel, the dhidden GEMM, the dweight GEMM written (beta 0) or
   accumulated (beta 1, cuBLAS addmm or kiln's matmul), the backward's scaling pass over dweight, and the
   full-size GEMMs a non-chunked implementation (torch.compile) runs; plus whether cuBLAS honours
   torch's SM carveout (which the overlap-with-carveout variants rely on).
2. variants: whole forward+backward calls of every plan, timed round-robin (several rounds, each variant
   in every round, so drifting clocks hit all alike), with the peak memory above what existed before the
   call (torch.cuda.max_memory_allocated, as kernels_gemm_ce.py measures it) and the largest difference of
   the gradients from the default plan's.
3. peers in the same rotation: eager, torch.compile and Liger Kernel (if importable).
A failing case records its error and the run goes on.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--out", default=None, help="write the results here as JSON")
p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
p.add_argument("--rounds", type=int, default=4, help="round-robin rounds over the variants")
ARGS = p.parse_args()
if ARGS.smoke:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from kiln.kernels import linear_cross_entropy as lce  # noqa: E402
from kiln.kernels.cross_entropy import _launch  # noqa: E402
from kiln.kernels.dispatch import use_backend  # noqa: E402
from kiln.kernels.linear_cross_entropy import Plan, chunk_bounds  # noqa: E402
from kiln.kernels.matmul import matmul_fwd, tile_config  # noqa: E402
from provenance import git_commit  # noqa: E402

DEV = "cpu" if ARGS.smoke else "cuda"
T, H, V = (64, 32, 300) if ARGS.smoke else (8192, 1536, 151936)
DT = torch.float16 if ARGS.smoke else torch.bfloat16  # the interpreter's bf16 dot is broken
FLOPS = 3 * 2 * T * H * V  # logits, dhidden, dweight
GOAL = {"peak_gib": 1.0, "ms": 19.6}
T0 = time.time()
BUDGET_S = 85.0  # past this after two rounds, stop the rotation
BREAKDOWN_S = 45.0  # past this, skip the remaining breakdown steps
OUT: dict = {"breakdown": [], "variants": {}, "peers": {}, "errors": []}


def now_s() -> float:
    return time.time() - T0


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def batch_ms(fn, reps: int) -> float:
    """Mean milliseconds of fn() over `reps` back-to-back calls (CUDA events around the batch)."""
    if DEV == "cpu":
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def peak_gib(fn) -> float | None:
    """Peak memory fn() allocates on top of what exists already (kernels_gemm_ce.py's definition)."""
    if DEV == "cpu":
        return None
    sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def guarded(what: str, fn):
    try:
        return fn()
    except Exception as err:  # one broken case must not lose the others
        OUT["errors"].append(
            {"case": what, "error": repr(err)[:400], "traceback": traceback.format_exc()[-1200:]}
        )
        print(f"ERROR {what}: {err!r}"[:300], flush=True)
        return None


# ---------------------------------------------------------------- inputs
gen = torch.Generator(device=DEV).manual_seed(0)
h = torch.randn(T, H, device=DEV, dtype=DT, generator=gen).requires_grad_()
W = (torch.randn(V, H, device=DEV, dtype=DT, generator=gen) * 0.02).requires_grad_()
y = torch.randint(0, V, (T,), device=DEV, generator=gen)
LOGITS_BYTES = T * V * h.element_size()


def budget(chunks: int) -> int:
    """chunk_bytes that gives `chunks` token chunks here."""
    return -(-LOGITS_BYTES // chunks)


# ---------------------------------------------------------------- 1. breakdown
# (programs, BLOCK, warps) of the loss kernel: None programs = one per row.
CE_CONFIGS = [(None, 4096, 8), (None, 8192, 16), (132, 16384, 16), (132, 16384, 32), (264, 16384, 16),
              (132, 8192, 16), (264, 8192, 8), (132, 32768, 32), (396, 8192, 16)]  # fmt: skip
LOSS = torch.empty(T, device=DEV)
LSE = torch.empty(T, device=DEV)
SCALE = torch.full((), 1.0 / T, device=DEV)


def chunk_steps(c: int, z, dh, dw, cfg) -> dict:
    """The steps of one chunk of c rows, as (fn, flops or None for the memory-bound loss kernel)."""
    hc, w = h.detach()[:c], W.detach()
    loss, lse = torch.empty(c, device=DEV), torch.empty(c, device=DEV)
    scale = torch.full((), 1.0 / T, device=DEV)
    f = 2 * c * V * H
    return {
        "logits = h @ W.T (cuBLAS)": (lambda: torch.matmul(hc, w.t(), out=z), f),
        "loss + grad in place (CE kernel)": (
            lambda: _launch(z, y[:c], loss, lse, z, scale, -100, 0.0, forward=True),
            None,
        ),
        "dhidden = dz @ W (cuBLAS)": (lambda: torch.matmul(z, w, out=dh[:c]), f),
        "dhidden = dz @ W (kiln 128x256 split-K 2)": (
            lambda: matmul_fwd(z, w, out=dh[:c], config=tile_config(128, 256, 64, 3, 8, split_k=2)),
            f,
        ),
        "dhidden = dz @ W (kiln 128x128 split-K 2)": (
            lambda: matmul_fwd(z, w, out=dh[:c], config=tile_config(128, 128, 64, 4, 8, split_k=2)),
            f,
        ),
        "dhidden = dz @ W (kiln 128x256 split-K 4)": (
            lambda: matmul_fwd(z, w, out=dh[:c], config=tile_config(128, 256, 64, 3, 8, split_k=4)),
            f,
        ),
        "dweight = dz.T @ h (cuBLAS, beta 0)": (lambda: torch.matmul(z.t(), hc, out=dw), f),
        "dweight += dz.T @ h (cuBLAS addmm, beta 1)": (lambda: dw.addmm_(z.t(), hc), f),
        "dweight += dz.T @ h (kiln matmul, accumulate)": (
            lambda: matmul_fwd(z.t(), hc, out=dw, accumulate=True, config=cfg),
            f,
        ),
    }


def time_step(name: str, fn, reps: int, **row) -> None:
    if now_s() > BREAKDOWN_S:  # leave the time to the whole-call variants
        OUT["errors"].append({"case": name, "error": f"skipped: past {BREAKDOWN_S} s"})
        return

    def run():
        with torch.no_grad(), use_backend("triton"):
            fn()
            ms = statistics.median(batch_ms(fn, reps) for _ in range(2))
        out = {"step": name, **{k: v for k, v in row.items() if v is not None}, "ms": ms}
        if out.get("flops"):
            out["tflops"] = out.pop("flops") / ms / 1e9
        if out.get("bytes"):
            out["tbps"] = out["bytes"] / ms / 1e9
        OUT["breakdown"].append(out)
        print(json.dumps(out), flush=True)

    guarded(f"breakdown {name} {row}", run)


def breakdown() -> None:
    cfg = lce._gemm_config()
    reps = 2 if DEV == "cpu" else 8
    sizes = sorted({chunk_bounds(T, V, 2, budget(n))[0][1] for n in (8, 6, 5)} | {T})  # first chunk's rows
    dw = torch.empty(V, H, device=DEV, dtype=DT)
    dh = torch.empty(T, H, device=DEV, dtype=DT)
    for c in sizes:
        z = torch.empty(c, V, device=DEV, dtype=DT)
        with torch.no_grad():
            torch.matmul(
                h.detach()[:c], W.detach().t(), out=z
            )  # real logits for the loss kernel's first call
        for name, (fn, flops) in chunk_steps(c, z, dh, dw, cfg).items():
            nbytes = None if flops else 3 * c * V * z.element_size()  # read, read, write of the logits
            time_step(name, fn, reps, rows=c, flops=flops, bytes=nbytes)
        if (
            c == chunk_bounds(T, V, 2, budget(5))[0][1]
        ):  # the loss kernel with fewer programs (rows in flight fit L2) and wider steps
            for programs, block, warps in CE_CONFIGS:

                def ce(c=c, z=z, programs=programs, block=block, warps=warps):
                    _launch(z, y[:c], LOSS[:c], LSE[:c], z, SCALE, -100, 0.0, forward=True, programs=programs,
                            block=block, warps=warps)  # fmt: skip

                name = f"loss + grad in place, programs={programs} block={block} warps={warps}"
                time_step(name, ce, reps, rows=c, bytes=3 * c * V * z.element_size())
        del z
    # The backward's pass over dweight: multiply by the incoming gradient (before), or a kernel that reads
    # the gradient on the device and does nothing when it is 1 (now).
    one = torch.ones((), device=DEV)
    half = torch.full((), 0.5, device=DEV)
    nbytes = 2 * dw.numel() * dw.element_size()
    time_step("dweight *= grad_out (torch mul_)", lambda: dw.mul_(one), reps, bytes=nbytes)
    time_step("dweight *= grad_out 1 (kiln scale_, skips)", lambda: lce.scale_(dw, one), reps)
    time_step("dweight *= grad_out 0.5 (kiln scale_)", lambda: lce.scale_(dw, half), reps, bytes=nbytes)
    if DEV == "cuda":  # does cuBLAS honour torch's SM carveout? (16 of 132 SMs kept should cost ~12%)
        c = sizes[0]
        z = torch.empty(c, V, device=DEV, dtype=DT)
        for k in (0, 16, 32):

            def carved(k=k, z=z, c=c):
                torch._C._set_sm_carveout_experimental(k or None)
                try:
                    torch.matmul(h.detach()[:c], W.detach().t(), out=z)
                finally:
                    torch._C._set_sm_carveout_experimental(None)

            time_step(f"logits GEMM with SM carveout {k}", carved, reps, rows=c, flops=2 * c * V * H)


# ---------------------------------------------------------------- 2. variants
def mul_scale(t, g):  # the scaling the backward did before scale_: always one pass over dweight
    return t.mul_(g.float())


class Variant:
    """A fused call under one plan; `old_scale`: the backward scales with mul_; `carveout`: SMs kept
    from cuBLAS during the call (the loss kernel on a side stream gets them)."""

    def __init__(self, plan: Plan, old_scale: bool = False, carveout: int = 0):
        self.plan, self.old_scale, self.carveout = plan, old_scale, carveout

    def __call__(self):
        saved = lce.scale_
        if self.old_scale:
            lce.scale_ = mul_scale
        if self.carveout:
            torch._C._set_sm_carveout_experimental(self.carveout)
        try:
            with use_backend("triton"):
                return torch.autograd.grad(lce.linear_cross_entropy(h, W, y, plan=self.plan), (h, W))
        finally:
            lce.scale_ = saved
            if self.carveout:
                torch._C._set_sm_carveout_experimental(None)


def variants() -> dict:
    mib = 2**20
    P = functools.partial(Plan, one_pass=False)  # round 1's variants: the two-pass loss kernel
    v = {
        "current (6 chunks, 440 MiB, mul_ scale)": Variant(P(440 * mib), old_scale=True),
        "6 chunks 440 MiB": Variant(P(440 * mib)),
        "5 chunks": Variant(P(budget(5))),
        "7 chunks": Variant(P(budget(7))),
        "8 chunks": Variant(P(budget(8))),
        "4 chunks (over 1 GiB)": Variant(P(budget(4))),
        "5 chunks dweight=kiln": Variant(P(budget(5), dweight_gemm="kiln")),
        "6 chunks dweight=kiln": Variant(P(440 * mib, dweight_gemm="kiln")),
        "5 chunks logits=kiln": Variant(P(budget(5), logits_gemm="kiln")),
        "5 chunks row_programs=528": Variant(P(budget(5), row_programs=528)),
        "5 chunks row_programs=1056": Variant(P(budget(5), row_programs=1056)),
        "5 chunks row 132x16384/16w": Variant(P(budget(5), row_programs=132, row_block=16384, row_warps=16)),
        "5 chunks row 264x16384/16w": Variant(P(budget(5), row_programs=264, row_block=16384, row_warps=16)),
        "5 chunks row 132x8192/16w": Variant(P(budget(5), row_programs=132, row_block=8192, row_warps=16)),
        "5 chunks row 132x32768/32w": Variant(P(budget(5), row_programs=132, row_block=32768, row_warps=32)),
        "5 chunks row all x8192/16w": Variant(P(budget(5), row_block=8192, row_warps=16)),
        "6 chunks row 132x16384/16w": Variant(P(440 * mib, row_programs=132, row_block=16384, row_warps=16)),
        "5 chunks overlap 2 row 132x16384/16w": Variant(
            P(budget(5), overlap=2, row_programs=132, row_block=16384, row_warps=16)
        ),
        "5 chunks overlap 2 priority row 132x16384/16w": Variant(
            P(budget(5), overlap=2, gemm_priority=True, row_programs=132, row_block=16384, row_warps=16)
        ),
        "5 chunks overlap 2": Variant(P(budget(5), overlap=2)),
        "5 chunks overlap 3": Variant(P(budget(5), overlap=3)),
        "5 chunks overlap 4": Variant(P(budget(5), overlap=4)),
        "5 chunks overlap 2 priority": Variant(P(budget(5), overlap=2, gemm_priority=True)),
        "5 chunks overlap 3 priority": Variant(P(budget(5), overlap=3, gemm_priority=True)),
        "6 chunks overlap 2": Variant(P(440 * mib, overlap=2)),
        "6 chunks overlap 2 priority": Variant(P(440 * mib, overlap=2, gemm_priority=True)),
        "5 chunks overlap 2 dweight=kiln": Variant(P(budget(5), overlap=2, dweight_gemm="kiln")),
    }
    v["one-pass 6 chunks"] = Variant(Plan(440 * mib, one_pass=True))
    v["one-pass 5 chunks"] = Variant(Plan(budget(5), one_pass=True))
    v["one-pass 6 chunks 8192-wide steps"] = Variant(
        Plan(440 * mib, one_pass=True, row_block=8192, row_warps=16)
    )
    if DEV == "cuda":
        v["5 chunks overlap 2 carveout 8 (CE 64 programs)"] = Variant(
            P(budget(5), overlap=2, row_programs=64), carveout=8
        )
        v["5 chunks overlap 2 carveout 16 (CE 128 programs)"] = Variant(
            P(budget(5), overlap=2, row_programs=128), carveout=16
        )
        v["5 chunks overlap 3 carveout 8 priority (CE 64 programs)"] = Variant(
            P(budget(5), overlap=3, row_programs=64, gemm_priority=True), carveout=8
        )
    return v


def peers() -> dict:
    out = {"eager": lambda: torch.autograd.grad(F.cross_entropy(F.linear(h, W).float(), y), (h, W))}
    if DEV == "cuda":
        comp = torch.compile(lambda h, W, y: F.cross_entropy(F.linear(h, W).float(), y))
        out["torch.compile"] = lambda: torch.autograd.grad(comp(h, W, y), (h, W))
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        lflce = LigerFusedLinearCrossEntropyLoss()
        out["liger"] = lambda: torch.autograd.grad(lflce(W, h, y), (h, W))
    except Exception as err:
        OUT["peers"]["liger"] = {"error": f"not importable: {err!r}"[:200]}
    return out


def rotation() -> None:
    cases = {f"kiln: {k}": v for k, v in variants().items()}
    cases.update({f"peer: {k}": v for k, v in peers().items()})
    base = cases["kiln: 6 chunks 440 MiB"]  # two-pass, round 1's default
    ref = guarded("reference gradients", lambda: [g.detach().clone() for g in base()])
    info: dict[str, dict] = {}
    for name, fn in cases.items():  # warm up (compile, autotune), memory, agreement with the default

        def first(fn=fn, name=name):
            t = time.time()
            grads = fn()
            sync()
            row = {"first_call_s": round(time.time() - t, 2), "peak_gib": peak_gib(fn)}
            if ref is not None:
                row["max_abs_diff_dhidden"] = (grads[0].float() - ref[0].float()).abs().max().item()
                row["max_abs_diff_dweight"] = (grads[1].float() - ref[1].float()).abs().max().item()
            del grads
            info[name] = row

        guarded(f"first call {name}", lambda first=first: first())
    live = [n for n in cases if n in info]
    times: dict[str, list[float]] = {n: [] for n in live}
    reps = 1 if DEV == "cpu" else 4
    for r in range(ARGS.rounds):
        if r >= 2 and now_s() > BUDGET_S:
            OUT["rounds_cut_at"] = r
            break
        for n in live:
            ms = guarded(f"round {r} {n}", lambda n=n: batch_ms(cases[n], reps))
            if ms is not None:
                times[n].append(ms)
        print(f"round {r} done at {now_s():.1f} s", flush=True)
    for n in live:
        row = info[n]
        if times[n]:
            row["ms"] = statistics.median(times[n])
            row["ms_min"] = min(times[n])
            row["ms_rounds"] = times[n]
            row["tflops"] = FLOPS / row["ms"] / 1e9
            row["fraction_of_ceiling"] = row["tflops"] / 735.0
        kind, key = n.split(": ", 1)
        (OUT["variants"] if kind == "kiln" else OUT["peers"])[key] = row
    comp = OUT["peers"].get("torch.compile", {}).get("ms")
    for row in OUT["variants"].values():
        if "ms" in row:
            row["ratio_vs_torch_compile"] = comp / row["ms"] if comp else None  # > 1: kiln faster
            row["meets_goal"] = (row["ms"] <= GOAL["ms"]) and (row["peak_gib"] or 0) <= GOAL["peak_gib"]
    ok = {k: r for k, r in OUT["variants"].items() if "ms" in r and (r["peak_gib"] or 0) <= GOAL["peak_gib"]}
    if ok:
        best = min(ok, key=lambda k: ok[k]["ms"])
        OUT["best_under_1GiB"] = {"variant": best, **{k: ok[best][k] for k in ("ms", "peak_gib")}}


def meta() -> dict:
    commit = git_commit()
    smi = None
    if DEV == "cuda":
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu",
                 "--format=csv"], capture_output=True, text=True, timeout=10,
            ).stdout.strip()  # fmt: skip
        except Exception as err:
            smi = repr(err)
    return {
        "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "commit": commit, "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "shape": {"T": T, "H": H, "V": V, "dtype": str(DT)}, "goal": GOAL,
        "timing": "CUDA events around batches of calls; variants round-robin, median over rounds",
        "nvidia_smi": smi,
    }  # fmt: skip


def main() -> None:
    OUT["meta"] = meta()
    guarded("breakdown", breakdown)
    if DEV == "cuda":
        torch.cuda.empty_cache()
    guarded("rotation", rotation)
    OUT["meta"]["nvidia_smi_after"] = meta()["nvidia_smi"]
    OUT["meta"]["total_s"] = round(now_s(), 1)
    if ARGS.out:
        os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
        with open(ARGS.out, "w") as f:
            json.dump(OUT, f, indent=1, default=str)
    for k, r in {**OUT["variants"], **OUT["peers"]}.items():
        print(f"{k:60s} {r.get('ms', float('nan')):8.2f} ms  peak {r.get('peak_gib')}  {r.get('error', '')}")
    print(f"best under 1 GiB: {OUT.get('best_under_1GiB')}; {len(OUT['errors'])} errors, {now_s():.1f} s")


if __name__ == "__main__":
    main()
