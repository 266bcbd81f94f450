"""The CUDA C++ ladder measured on one GPU, in one process: `kiln bench cuda` or `python bench/cuda_ladder.py`.

    1. the build of the extension (timed: cold on a fresh machine, seconds when cached);
    2. vector add, three variants, 2**28 floats: GB/s (12 bytes per element) against the device copy
       bandwidth measured at the start of the run (kiln.profile.ceilings);
    3. the memory probes (kiln.kernels.cuda.probes): strided reads, bank conflicts, latency, occupancy;
    4. the SGEMM ladder at 4096^3 and at 1000 x 1027 x 999 against cuBLAS fp32 (TF32 off), each step's
       GFLOP/s, its ratio to cuBLAS and its speedup over the step before, and the last two steps
       autotuned (the fastest of their tile configurations on that shape); the tensor-core kernels at
       4096^3 (and an odd M) against cuBLAS bf16 and torch._scaled_mm (FP8, where the GPU has it);
    5. on Hopper, last, the wgmma + TMA GEMMs (bf16 and FP8), every configuration of
       ladder.WGMMA_CONFIGS, each run in a child process (kiln.profile.cuda_isolated): a configuration
       that faults or hangs is recorded as failed and skipped, the others are still measured.
    6. the verdict on issue 21's two open goals at 4096^3 (the fastest SGEMM >= 0.9x cuBLAS fp32, the
       fastest mma.sync bf16 >= 0.6x cuBLAS bf16), printed last and kept in the JSON as "goals".

The newer kernels (the skewed SGEMM at every ladder.SKEWED_CONFIGS row, the mma.sync configurations
from MMA_IN_PROCESS on) also run in child processes, checked before they are timed, each
beside its cuBLAS peer timed in the same child: one that faults, hangs or is wrong is an error entry.

Every GEMM output is checked against cuBLAS fp32 (bf16/FP8: against the fp32 product of the same
rounded inputs) and its max relative error recorded. Times are medians over rounds of
triton.testing.do_bench, the candidates of a shape interleaved in a fresh random order each round
(kiln.profile.timing). Tables print as Markdown; the JSON goes to --out (default
bench/results/cuda_ladder.json) and the PNGs beside it, in cuda_ladder/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from kiln.errors import KilnError

SGEMM_SHAPES = ((4096, 4096, 4096), (1000, 1027, 999))
TC_SHAPES = ((4096, 4096, 4096), (1000, 1024, 1008))
WGMMA_SHAPES = ((4096, 4096, 4096), (1000, 1024, 1008))
# One worker: start (~10 s: torch, CUDA, the cached build), check and time every configuration (~5 s). A
# hung kernel traps after ~9 s (kiln_hopper::mbar_wait), so the timeout only catches other hangs.
WGMMA_TIMEOUT_S = 90
# mma.sync bf16 configurations 0-4 ran clean on the H200 (d4d0f05) and run in this process; later ones
# (the register-pipelined tiles) run in a child process until a GPU run has shown them sound.
MMA_IN_PROCESS = 5
# issue 21's goals at 4096^3: the fastest kernel of each kind against its cuBLAS peer
GOALS = {"sgemm_vs_cublas_fp32": 0.9, "mma_bf16_vs_cublas_bf16": 0.6}


def _gflops(m: int, n: int, k: int, ms: float) -> float:
    return round(2 * m * n * k / ms / 1e6, 1)


def _rel_err(c, ref) -> float:
    return float((c.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def bench_vector_add(bench, n: int = 1 << 28) -> list[dict]:
    import torch

    from kiln.kernels.cuda.ops import VECTOR_ADD_VARIANTS, vector_add
    from kiln.profile.ceilings import fraction

    a, b = torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
    ref = a + b
    fns = {v: (lambda v=v: vector_add(a, b, v)) for v in VECTOR_ADD_VARIANTS}
    fns["torch a + b"] = lambda: a + b
    times = bench.timer.interleaved(fns, rep_ms=50)
    copy = bench.ceilings.get("copy_TBps")
    rows = []
    for name, t in times.items():
        tbps = 12 * n / t["ms"] / 1e9
        exact = name == "torch a + b" or bool(torch.equal(vector_add(a, b, name), ref))
        rows.append({"variant": name, "ms": round(t["ms"], 4), "TBps": round(tbps, 3),
                     "frac_copy": fraction(tbps, copy), "exact": exact})  # fmt: skip
    return rows


def bench_sgemm(bench, shape: tuple[int, int, int]) -> list[dict]:
    import torch

    from kiln.kernels.cuda.ladder import DOUBLE_BUFFERED_STEP_CONFIG, SGEMM_LADDER, WARPTILE_CONFIGS
    from kiln.kernels.cuda.ops import sgemm, sgemm_double_buffered, sgemm_warptile

    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(k, n, device="cuda", generator=g)
    ref = a @ b
    fns = {s.name: (lambda s=s: sgemm(a, b, s.name)) for s in SGEMM_LADDER}
    # autotuning: the other tile configurations of the warp-tiled step (config 0 is the step itself) and
    # of the double-buffered step (config DOUBLE_BUFFERED_STEP_CONFIG is the step)
    for i in range(1, len(WARPTILE_CONFIGS)):
        fns[f"warptile_config_{i}"] = lambda i=i: sgemm_warptile(a, b, i)
    for i in range(len(WARPTILE_CONFIGS)):
        if i != DOUBLE_BUFFERED_STEP_CONFIG:
            fns[f"double_buffered_config_{i}"] = lambda i=i: sgemm_double_buffered(a, b, i)
    fns["cublas_fp32"] = lambda: a @ b
    times = bench.timer.interleaved(fns, rep_ms=30)
    cublas = times["cublas_fp32"]["ms"]
    rows, prev = [], None
    for i, s in enumerate(SGEMM_LADDER):
        ms = times[s.name]["ms"]
        rows.append({"step": i, "name": s.name, "M": m, "N": n, "K": k, "ms": round(ms, 4),
                     "GFLOPs": _gflops(m, n, k, ms), "vs_cublas": round(cublas / ms, 3),
                     "speedup_vs_prev": round(prev / ms, 2) if prev else None,
                     "max_rel_err": _rel_err(sgemm(a, b, s.name), ref)})  # fmt: skip
        prev = ms
    for name, run_config, own in (
        ("warptiled", sgemm_warptile, 0),
        ("double_buffered", sgemm_double_buffered, DOUBLE_BUFFERED_STEP_CONFIG),
    ):
        configs = {own: times[name]["ms"]}
        configs.update(
            {
                i: times[f"{name.replace('warptiled', 'warptile')}_config_{i}"]["ms"]
                for i in range(len(WARPTILE_CONFIGS))
                if i != own
            }
        )
        best = min(configs, key=configs.get)
        ms = configs[best]
        rows.append({"step": None, "name": f"{name}_autotuned", "M": m, "N": n, "K": k, "ms": round(ms, 4),
                     "GFLOPs": _gflops(m, n, k, ms), "vs_cublas": round(cublas / ms, 3),
                     "config": best, "tiles": WARPTILE_CONFIGS[best].name,
                     "configs_ms": {str(i): round(t, 4) for i, t in configs.items()},
                     "max_rel_err": _rel_err(run_config(a, b, best), ref)})  # fmt: skip
    rows.append(bench_skewed(shape))
    rows.append({"step": None, "name": "cublas_fp32", "M": m, "N": n, "K": k, "ms": round(cublas, 4),
                 "GFLOPs": _gflops(m, n, k, cublas), "vs_cublas": 1.0})  # fmt: skip
    return rows


def bench_skewed(shape: tuple[int, int, int]) -> dict:
    """The skewed SGEMM at every configuration, in child processes, against cuBLAS fp32 timed in the same
    child: one row for the fastest ("skewed_autotuned"), every configuration's figures inside it."""
    from kiln.kernels.cuda.ladder import SKEWED_CONFIGS

    m, n, k = shape
    r = _run_isolated("sgemm_skewed", shape, list(range(len(SKEWED_CONFIGS))))
    peer = r["ms"].get("cublas_fp32")
    ok = {i: r["ms"][f"config_{i}"] for i in range(len(SKEWED_CONFIGS)) if r["ms"].get(f"config_{i}")}
    errs = {i: ev.get("max_rel_err") for i, ev in r["checked"].items()}
    failed = dict(r["failed"])
    for i in range(len(SKEWED_CONFIGS)):
        if i not in ok and i not in failed:
            failed[i] = r["timing_error"] or "wrong result" if i in errs else "not measured"
    row = {"step": None, "name": "skewed_autotuned", "M": m, "N": n, "K": k, "ms": None, "GFLOPs": None,
           "vs_cublas": None, "config": None, "tiles": None, "max_rel_err": None,
           "configs_ms": {str(i): round(t, 4) for i, t in ok.items()},
           "configs_max_rel_err": {str(i): e for i, e in errs.items()},
           "cublas_fp32_ms_same_process": round(peer, 4) if peer else None,
           "failed_configs": {str(i): why for i, why in failed.items()} or None}  # fmt: skip
    if ok:
        best = min(ok, key=ok.get)
        row.update(ms=round(ok[best], 4), GFLOPs=_gflops(m, n, k, ok[best]), config=best,
                   tiles=SKEWED_CONFIGS[best].name, max_rel_err=errs.get(best),
                   vs_cublas=round(peer / ok[best], 3) if peer else None)  # fmt: skip
    return row


def bench_tensor_cores(bench, shape: tuple[int, int, int]) -> list[dict]:
    import torch

    from kiln.errors import KilnError
    from kiln.kernels.cuda.ladder import MMA_CONFIGS
    from kiln.kernels.cuda.ops import mma_bf16, mma_fp8

    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(k, n, device="cuda", generator=g).bfloat16()
    ref = a.float() @ b.float()
    fns = {"mma_bf16": lambda: mma_bf16(a, b), "cublas_bf16": lambda: a @ b}
    # the other tile configurations of the bf16 kernel (config 0 is mma_bf16 itself): checked first; one
    # that raises or is wrong is recorded and not timed
    config_errs, config_fail = {}, {}
    for i in range(1, MMA_IN_PROCESS):
        try:
            config_errs[i] = _rel_err(mma_bf16(a, b, i), ref)
        except (KilnError, RuntimeError) as e:
            config_fail[i] = str(e)[-300:]
            continue
        if config_errs[i] < 2e-2:
            fns[f"mma_bf16_config_{i}"] = lambda i=i: mma_bf16(a, b, i)
        else:
            config_fail[i] = "wrong result"
    fp8 = torch.cuda.get_device_capability() >= (8, 9)
    if fp8:
        a8 = (a.float() / 4).to(torch.float8_e4m3fn)
        bt8 = (b.float().t().contiguous() / 4).to(torch.float8_e4m3fn)
        sa = torch.tensor(4.0, device="cuda")  # per-tensor scales, 0-dim as _scaled_mm takes them
        sb = torch.tensor(4.0, device="cuda")
        ref8 = (a8.float() @ bt8.float().t()) * 16
        fns["mma_fp8"] = lambda: mma_fp8(a8, bt8, sa, sb)
        if m % 16 == 0:  # _scaled_mm's own shape rule
            fns["scaled_mm_fp8"] = lambda: torch._scaled_mm(a8, bt8.t(), sa, sb, out_dtype=torch.bfloat16)
    times = bench.timer.interleaved(fns, rep_ms=30)
    peers = {"mma_bf16": "cublas_bf16", "mma_fp8": "scaled_mm_fp8"}
    errs = {"mma_bf16": _rel_err(mma_bf16(a, b), ref), "cublas_bf16": _rel_err(a @ b, ref)}
    if fp8:
        errs["mma_fp8"] = _rel_err(mma_fp8(a8, bt8, sa, sb), ref8)
    for i in range(1, MMA_IN_PROCESS):
        peers[f"mma_bf16_config_{i}"] = "cublas_bf16"
        errs[f"mma_bf16_config_{i}"] = config_errs.get(i)
    rows = []
    for name, t in times.items():
        peer = times.get(peers.get(name, ""), {}).get("ms")
        rows.append({"name": name, "M": m, "N": n, "K": k, "ms": round(t["ms"], 4),
                     "TFLOPs": round(_gflops(m, n, k, t["ms"]) / 1e3, 1),
                     "vs_peer": round(peer / t["ms"], 3) if peer else None,
                     "max_rel_err": errs.get(name)})  # fmt: skip
    # the configurations not yet run on a GPU, in child processes, each against cuBLAS bf16 timed there
    new = list(range(MMA_IN_PROCESS, len(MMA_CONFIGS)))
    r = _run_isolated("mma_bf16", shape, new) if new else {"ms": {}, "checked": {}, "failed": {}}
    child_peer = r["ms"].get("cublas_bf16")
    for i in new:
        ms, err = r["ms"].get(f"config_{i}"), r["checked"].get(i, {}).get("max_rel_err")
        error = r["failed"].get(i) or (None if ms else r.get("timing_error") or "wrong result")
        if error:
            config_fail[i] = error
        rows.append({"name": f"mma_bf16_config_{i}", "M": m, "N": n, "K": k,
                     "ms": round(ms, 4) if ms else None,
                     "TFLOPs": round(_gflops(m, n, k, ms) / 1e3, 1) if ms else None,
                     "vs_peer": round(child_peer / ms, 3) if ms and child_peer else None,
                     "max_rel_err": err, "child_process": True,
                     "peer_ms_same_process": round(child_peer, 4) if child_peer else None,
                     "error": error})  # fmt: skip
    # the bf16 kernel autotuned: the configuration with the best ratio to cuBLAS bf16 on this shape (the
    # ratio, because the child processes time their own cuBLAS)
    ratios = {0: times["cublas_bf16"]["ms"] / times["mma_bf16"]["ms"]}
    ratios.update({i: times["cublas_bf16"]["ms"] / times[f"mma_bf16_config_{i}"]["ms"]
                   for i in config_errs if i not in config_fail})  # fmt: skip
    ratios.update({i: child_peer / r["ms"][f"config_{i}"] for i in new
                   if i not in config_fail and child_peer and r["ms"].get(f"config_{i}")})  # fmt: skip
    best = max(ratios, key=ratios.get)
    best_row = next(x for x in rows if x["name"] == ("mma_bf16" if best == 0 else f"mma_bf16_config_{best}"))
    rows.append({"name": "mma_bf16_autotuned", "M": m, "N": n, "K": k, "ms": best_row["ms"],
                 "TFLOPs": best_row["TFLOPs"], "vs_peer": round(ratios[best], 3),
                 "max_rel_err": best_row["max_rel_err"],
                 "config": best, "tiles": MMA_CONFIGS[best].name,
                 "failed_configs": {str(i): why for i, why in config_fail.items()} or None})  # fmt: skip
    return rows


def _emit(**event) -> None:
    print(json.dumps(event), flush=True)


def isolated_worker(kind: str, shape: str, variants: list[int]) -> int:
    """The child process of _run_isolated: checks each configuration of one kernel against the fp32 (SGEMM:
    float64) product of the same inputs, then times the correct ones and the peer interleaved; events on
    stdout (cuda_isolated). kind: "bf16" / "fp8" (wgmma), "mma_bf16", "sgemm_skewed"."""
    import torch

    from kiln.kernels.cuda.ops import mma_bf16, sgemm_skewed, wgmma_bf16, wgmma_fp8
    from kiln.profile.timing import Timer

    m, n, k = (int(v) for v in shape.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g)
    bt = torch.randn(n, k, device="cuda", generator=g)
    tol = 2e-2  # bf16 / e4m3 output rounding (2**-8 relative) and accumulation order
    if kind == "sgemm_skewed":
        b = bt.t().contiguous()  # (K, N)
        ref = a.double() @ b.double()
        run = lambda v: sgemm_skewed(a, b, v)  # noqa: E731
        peers = {"cublas_fp32": lambda: a @ b}  # TF32 off: torch's default, recorded by the parent
        tol = 1e-3  # the GPU tests' bound for every SGEMM step
    elif kind == "mma_bf16":
        a16, b16 = a.bfloat16(), bt.t().contiguous().bfloat16()  # (M, K) @ (K, N)
        ref = a16.float() @ b16.float()
        run = lambda v: mma_bf16(a16, b16, v)  # noqa: E731
        peers = {"cublas_bf16": lambda: a16 @ b16}
    elif kind == "bf16":
        a, bt = a.bfloat16(), bt.bfloat16()
        ref = a.float() @ bt.float().t()
        run = lambda v: wgmma_bf16(a, bt, v)  # noqa: E731
        peers = {"cublas_bf16": lambda: a @ bt.t()}
    else:
        a8, bt8 = (a / 4).to(torch.float8_e4m3fn), (bt / 4).to(torch.float8_e4m3fn)
        sa = sb = torch.tensor(4.0, device="cuda")
        ref = (a8.float() @ bt8.float().t()) * 16
        run = lambda v: wgmma_fp8(a8, bt8, sa, sb, v)  # noqa: E731
        peers = {}
        if m % 16 == 0 and n % 16 == 0:  # _scaled_mm's own shape rule
            peers["scaled_mm_fp8"] = lambda: torch._scaled_mm(a8, bt8.t(), sa, sb, out_dtype=torch.bfloat16)
    fns = {}
    for v in variants:
        _emit(event="start", variant=v)
        c = run(v)
        torch.cuda.synchronize()
        err = _rel_err(c, ref)
        _emit(event="checked", variant=v, max_rel_err=err)
        if err < tol:  # a wrong kernel is reported, not timed
            fns[f"config_{v}"] = lambda v=v: run(v)
    fns.update(peers)
    times = Timer(smoke=False, rounds=3).interleaved(fns, rep_ms=30)
    _emit(event="timed", ms={name: t["ms"] for name, t in times.items()})
    return 0


def _run_isolated(kind: str, shape: tuple[int, int, int], variants: list[int]) -> dict:
    """isolated_worker over `variants` of kernel `kind` on one shape, in child processes (run_isolated)."""
    import kiln
    from kiln.profile.cuda_isolated import run_isolated

    key = "x".join(map(str, shape))
    env = dict(os.environ)  # the child imports the same kiln as this process
    src_root = str(Path(kiln.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src_root, env.get("PYTHONPATH")) if p)

    def command(vs: list[int]) -> list[str]:
        return [sys.executable, "-m", "kiln.profile.cuda_ladder", "--worker", kind, key,
                ",".join(map(str, vs))]  # fmt: skip

    return run_isolated(variants, command, timeout_s=WGMMA_TIMEOUT_S, env=env)


def bench_wgmma(
    bench, kind: str, shape: tuple[int, int, int], skip: dict[int, str] | None = None
) -> list[dict]:
    """Every wgmma configuration of one kind ("bf16" or "fp8") on one shape, in child processes; the
    configurations in `skip` (config -> why) are not run (they faulted or hung on an earlier shape)."""
    from kiln.kernels.cuda.ladder import WGMMA_CONFIGS

    m, n, k = shape
    skip = skip or {}
    todo = [i for i in range(len(WGMMA_CONFIGS)) if i not in skip]
    r = _run_isolated(kind, shape, todo)
    r["failed"].update({i: f"skipped: failed on an earlier shape ({why[:200]})" for i, why in skip.items()})
    peer_name = "cublas_bf16" if kind == "bf16" else "scaled_mm_fp8"
    peer = r["ms"].get(peer_name)
    rows = []
    for i, cfg in enumerate(WGMMA_CONFIGS):
        ms = r["ms"].get(f"config_{i}")
        err = r["checked"].get(i, {}).get("max_rel_err")
        error = r["failed"].get(i) or (None if ms or err is None else (r["timing_error"] or "wrong result"))
        rows.append({"name": f"wgmma_{kind}", "config": i, "tiles": cfg.name, "M": m, "N": n, "K": k,
                     "ms": round(ms, 4) if ms else None,
                     "TFLOPs": round(_gflops(m, n, k, ms) / 1e3, 1) if ms else None,
                     "vs_peer": round(peer / ms, 3) if ms and peer else None,
                     "max_rel_err": err, "error": error})  # fmt: skip
    if peer:
        rows.append({"name": peer_name, "config": None, "tiles": None, "M": m, "N": n, "K": k,
                     "ms": round(peer, 4), "TFLOPs": round(_gflops(m, n, k, peer) / 1e3, 1), "vs_peer": 1.0,
                     "max_rel_err": None, "error": None})  # fmt: skip
    return rows


def _tensor_core_bars(key: str, rows: list[dict], wgmma: dict) -> list[tuple[str, float, bool]]:
    """(label, TFLOP/s, is_peer) for one shape's tensor-core rungs: mma.sync bf16 as first written and its
    fastest configuration, wgmma's fastest in bf16 and FP8 (their own sections), the FP8 mma.sync, and the
    peers. A kernel that was not measured has no bar."""
    by = {r.get("name"): r for r in rows if r.get("TFLOPs") is not None}

    def best(section: str) -> float | None:
        ts = [
            r["TFLOPs"] for r in wgmma.get(section, []) if r.get("TFLOPs") and r.get("name") != "cublas_bf16"
        ]
        return max(ts) if ts else None

    tuned = by.get("mma_bf16_autotuned", {})
    bars = [("mma.sync bf16", by.get("mma_bf16", {}).get("TFLOPs"), False),
            (f"mma.sync bf16 best (config {tuned.get('config')})", tuned.get("TFLOPs"), False),
            ("wgmma bf16 best", best(f"bf16 {key}"), False),
            ("cuBLAS bf16", by.get("cublas_bf16", {}).get("TFLOPs"), True),
            ("mma.sync FP8", by.get("mma_fp8", {}).get("TFLOPs"), False),
            ("wgmma FP8 best", best(f"fp8 {key}"), False),
            ("_scaled_mm FP8", by.get("scaled_mm_fp8", {}).get("TFLOPs"), True)]  # fmt: skip
    return [(label, t, peer) for label, t, peer in bars if t is not None]


def plot(out_dir: Path, result: dict) -> list[str]:
    """The PNGs: the SGEMM ladder (GFLOP/s per step against cuBLAS fp32) and the tensor-core rungs (TFLOP/s
    against cuBLAS bf16 and torch._scaled_mm) per shape, and one per probe."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig, name):
        path = out_dir / f"{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))

    for key, rows in result["sgemm"].items():
        # the ladder, then the autotuned kernels (a kernel whose every configuration failed has no bar)
        steps = [r for r in rows if r["name"] != "cublas_fp32" and r.get("GFLOPs") is not None]
        cublas = next((r["GFLOPs"] for r in rows if r["name"] == "cublas_fp32"), None)
        if cublas is None:  # the section failed (an error row): nothing to plot
            continue
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.bar([r["name"] for r in steps], [r["GFLOPs"] for r in steps], color="tab:blue")
        ax.axhline(cublas, color="tab:red", ls="--", label=f"cuBLAS fp32 {cublas:.0f}")
        ax.set_ylabel("GFLOP/s")
        ax.set_title(f"SGEMM ladder, {key}")
        ax.legend()
        ax.tick_params(axis="x", rotation=30)
        save(fig, f"sgemm_{key}")
    for key, rows in result.get("tensor_cores", {}).items():
        bars = _tensor_core_bars(key, rows, result.get("wgmma", {}))
        if not bars:
            continue
        fig, ax = plt.subplots(figsize=(8, 4))
        colors = ["tab:red" if peer else "tab:blue" for _, _, peer in bars]
        ax.bar([name for name, _, _ in bars], [t for _, t, _ in bars], color=colors)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"tensor cores, {key} (red: cuBLAS bf16 / torch._scaled_mm)")
        ax.tick_params(axis="x", rotation=30)
        save(fig, f"tensor_cores_{key}")
    p = result["probes"]
    series = [("strided_reads", "stride", "GBps", "global read GB/s (useful bytes)", False),
              ("bank_conflicts", "stride", "slowdown", "shared-memory time vs stride 1", False),
              ("latency", "bytes", "ns", "ns per dependent load", True),
              ("occupancy", "regs", "GBps", "streaming read GB/s", False)]  # fmt: skip
    for name, x, y, ylabel, logx in series:
        rows = p[name]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r[x] for r in rows], [r[y] for r in rows], marker="o")
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_xlabel(x if name != "occupancy" else "registers per thread")
        ax.set_ylabel(ylabel)
        ax.set_title(name.replace("_", " "))
        ax.grid(alpha=0.3)
        save(fig, name)
    return written


def run(out: str | None, script_file: str) -> Path:
    """The whole benchmark; returns the JSON's path. KilnError before any work without a CUDA toolchain."""
    from kiln.kernels.cuda.build import load_extension
    from kiln.profile.harness import BenchRun, format_table

    t0 = time.perf_counter()
    load_extension()  # the toolchain check and the build come first, timed on their own
    build_s = round(time.perf_counter() - t0, 1)
    from kiln.kernels.cuda import probes

    bench = BenchRun("cuda_ladder", script_file, argparse.Namespace(smoke=False, out=out), rounds=3)
    bench.log(f"extension ready in {build_s} s")
    import torch

    # cuBLAS fp32 is the ladder's peer only while TF32 is off (torch's default): recorded, not changed
    result: dict = {"build_s": build_s, "cublas_fp32_allows_tf32": torch.backends.cuda.matmul.allow_tf32}
    result["vector_add"] = bench_vector_add(bench)
    print(
        format_table(result["vector_add"], [(c, c) for c in ("variant", "ms", "TBps", "frac_copy", "exact")])
    )
    result["probes"] = {}
    for name, fn in (("strided_reads", probes.strided_reads), ("bank_conflicts", probes.bank_conflicts),
                     ("latency", probes.latency), ("occupancy", probes.occupancy)):  # fmt: skip
        rows = fn()
        result["probes"][name] = rows
        bench.log(name)
        print(format_table(rows, [(c, c) for c in rows[0]]))
    result["sgemm"], result["tensor_cores"] = {}, {}
    cols = ("step", "name", "ms", "GFLOPs", "vs_cublas", "speedup_vs_prev", "max_rel_err")
    # a section that raises (a kernel fault poisons this process's CUDA context) is recorded as one error
    # row and the run goes on to write its JSON: the sections before it keep their figures
    for shape in SGEMM_SHAPES:
        key = "x".join(map(str, shape))
        result["sgemm"][key] = _section(bench_sgemm, bench, shape)
        bench.log(f"sgemm {key}")
        print(format_table(result["sgemm"][key], [(c, c) for c in cols]))
    for shape in TC_SHAPES:
        key = "x".join(map(str, shape))
        result["tensor_cores"][key] = _section(bench_tensor_cores, bench, shape)
        bench.log(f"tensor cores {key}")
        tc_cols = ("name", "ms", "TFLOPs", "vs_peer", "max_rel_err", "config", "tiles", "error")
        print(format_table(result["tensor_cores"][key], [(c, c) for c in tc_cols]))
    # the mma.sync instruction's own rate: the ceiling of every mma.sync GEMM above on this GPU (new, so an
    # error is recorded rather than ending the run before the JSON is written)
    try:
        result["mma_sync_peak"] = probes.mma_sync_peak()
    except RuntimeError as e:
        result["mma_sync_peak"] = {"error": str(e)[-300:]}
    bench.log(f"mma.sync peak (registers only): {result['mma_sync_peak']}")
    # last: kernels that could fault or hang run in child processes (a fault would end this one)
    result["wgmma"] = {}
    if torch.cuda.get_device_capability() == (9, 0):
        cols = ("name", "config", "tiles", "ms", "TFLOPs", "vs_peer", "max_rel_err", "error")
        for kind in ("bf16", "fp8"):
            failed: dict[int, str] = {}  # a configuration that faults or hangs is not run again
            for shape in WGMMA_SHAPES:
                key = f"{kind} " + "x".join(map(str, shape))
                result["wgmma"][key] = bench_wgmma(bench, kind, shape, skip=failed)
                failed.update({r["config"]: r["error"] for r in result["wgmma"][key]
                               if r["config"] is not None and r["error"] and "worker" in r["error"]})  # fmt: skip
                bench.log(f"wgmma {key}")
                print(format_table(result["wgmma"][key], [(c, c) for c in cols]))
    else:
        bench.log("wgmma: skipped (needs compute capability 9.0)")
    result["goals"] = goals(result)
    result["plots"] = plot(Path(bench.out).parent / "cuda_ladder", result)
    path = bench.write(**result)
    print(verdict(result["goals"]))
    return path


def _section(fn, bench, shape: tuple[int, int, int]) -> list[dict]:
    """fn(bench, shape)'s rows, or one row naming the error it raised (CUDA errors arrive as RuntimeError)."""
    try:
        return fn(bench, shape)
    except RuntimeError as e:
        return [{"name": "error", "error": f"{fn.__name__} {shape}: {str(e)[-400:]}"}]


def goals(result: dict) -> dict:
    """Issue 21's open goals at 4096^3 from a result: the fastest row of each kind against its peer."""
    key = "4096x4096x4096"
    sgemm = [r for r in result["sgemm"].get(key, []) if r["name"] != "cublas_fp32" and r.get("vs_cublas")]
    mma = [
        r
        for r in result["tensor_cores"].get(key, [])
        if r["name"].startswith("mma_bf16") and r.get("vs_peer")
    ]
    out = {}
    for goal, rows, col in (
        ("sgemm_vs_cublas_fp32", sgemm, "vs_cublas"),
        ("mma_bf16_vs_cublas_bf16", mma, "vs_peer"),
    ):
        # on a tie (an autotuned row repeats its best configuration's figure) the row naming its config
        best = max(rows, key=lambda r: (r[col], r.get("config") is not None), default=None)
        out[goal] = {"goal": GOALS[goal], "best": best[col] if best else None,
                     "kernel": best["name"] if best else None, "config": best.get("config") if best else None,
                     "tiles": best.get("tiles") if best else None, "ms": best["ms"] if best else None,
                     "met": bool(best and best[col] >= GOALS[goal])}  # fmt: skip
    # configurations that faulted, hung or were wrong (kept in the autotuned rows), by kernel
    for goal, name, kind in (
        ("sgemm_vs_cublas_fp32", "skewed_autotuned", "sgemm"),
        ("mma_bf16_vs_cublas_bf16", "mma_bf16_autotuned", "tensor_cores"),
    ):
        row = next((r for r in result[kind].get(key, []) if r["name"] == name), None)
        out[goal]["failed_configs"] = (row or {}).get("failed_configs") or {}
    # how far mma.sync itself goes: its rate on registers over cuBLAS bf16's at 4096^3 bounds every
    # mma.sync GEMM; below the goal, the goal is out of this instruction's reach on this GPU
    peak = (result.get("mma_sync_peak") or {}).get("TFLOPs")
    cublas = next((r for r in result["tensor_cores"].get(key, []) if r["name"] == "cublas_bf16"), None)
    if peak and cublas and cublas.get("TFLOPs"):
        out["mma_bf16_vs_cublas_bf16"]["instruction_ceiling_TFLOPs"] = peak
        out["mma_bf16_vs_cublas_bf16"]["instruction_ceiling_vs_cublas"] = round(peak / cublas["TFLOPs"], 3)
    return out


def verdict(g: dict) -> str:
    """The goals as lines to print last: MET / MISSED, the ratio, the kernel and configuration."""
    lines = ["", "VERDICT (issue 21, 4096^3):"]
    for goal, v in g.items():
        what = f"{v['kernel']} config {v['config']} ({v['tiles']})" if v["kernel"] else "no kernel measured"
        best = f"{v['best']:.3f}x" if v["best"] is not None else "-"
        lines.append(
            f"  {goal}: {'MET' if v['met'] else 'MISSED'}  best {best} (goal {v['goal']}x) by {what}"
        )
        for config, why in v.get("failed_configs", {}).items():
            lines.append(f"    config {config} failed: {why[:160]}")
        if "instruction_ceiling_vs_cublas" in v:
            lines.append(
                f"    mma.sync on registers alone: {v['instruction_ceiling_TFLOPs']} TFLOP/s = "
                f"{v['instruction_ceiling_vs_cublas']:.3f}x cuBLAS bf16 (no mma.sync GEMM can pass it)"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None, script_file: str | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/cuda_ladder.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/cuda_ladder.json", help="the result JSON (PNGs beside it)")
    p.add_argument("--worker", nargs=3, metavar=("KIND", "MxNxK", "CONFIGS"), help=argparse.SUPPRESS)
    p.add_argument("--replot", metavar="JSON", help="redraw the PNGs beside a result JSON from its figures "
                   "(no GPU; e.g. when a run's PNGs did not come back) and exit")  # fmt: skip
    args = p.parse_args(argv)
    if args.replot:
        path = Path(args.replot)
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise KilnError(
                f"--replot {path}: cannot read a result JSON ({e}); give the file bench/cuda_ladder.py wrote"
            ) from None
        for png in plot(path.parent / path.stem, result):
            print(png)
        return 0
    if args.worker:  # the child process of _run_isolated
        kind, shape, configs = args.worker
        return isolated_worker(kind, shape, [int(v) for v in configs.split(",")])
    run(args.out, script_file or __file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
