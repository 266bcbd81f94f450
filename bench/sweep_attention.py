"""Attention config sweep on the H200: decode split/tile/launch variants, GQA backward variants, forward
and backward block configs; peers (SDPA flash / cuDNN, dense SDPA decode) measured in the same run.

    python bench/sweep_attention.py --out /tmp/sweep_attention.json          # the H200 (< 100 s)
    python bench/sweep_attention.py --smoke --out /tmp/sweep_attention.json  # CPU, interpreter, tiny

Every variant is one explicit config (no autotuning) passed through the launchers' `config` hooks;
"default" rows run the shipped path (autotuned). The many kernels compile first in parallel worker
processes (Triton's on-disk cache), then the main process measures one variant after another: decode
replayed from a CUDA graph (split + reduction kernels, as an engine runs it), prefill with do_bench.
A failing variant (a compile error, say) is recorded and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "src"))

from attention import PEAK_COPY_TBPS, Bench, git_commit  # noqa: E402  (bench/attention.py)


def cfg(bm, bn, w, s, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, **kw)


def dec(bn, w, s, per_sm, align=16, **kw):
    return dict(BLOCK_N=bn, num_warps=w, num_stages=s, per_sm=per_sm, align=align, **kw)


# Decode at batch 1 x 64k (goal: 85% of copy bandwidth): split count (programs per SM), tile, warps,
# stages, page indices a tile ahead, the reduction as a programmatic dependent launch.
DECODE_B1 = [
    ("default", None),
    *[(f"per_sm{p}_n64w4s3", dec(64, 4, 3, p)) for p in (1, 2, 3, 4, 6, 8)],
    ("per_sm4_align128_n64w4s3", dec(64, 4, 3, 4, 128)),
    *[
        (f"per_sm{p}_n{bn}w{w}s{s}", dec(bn, w, s, p))
        for p in (1, 2, 4)
        for bn, w, s in ((32, 4, 4), (64, 4, 2), (64, 4, 5), (64, 8, 3), (128, 4, 2), (128, 8, 3), (32, 2, 3))
    ],
    # (round 1 also measured page indices loaded a tile ahead and the reduction as a programmatic
    # dependent launch: no gain, 0.0829 -> 0.0853-0.0984 and 0.0835 ms; both were removed)
]
DECODE_B64 = [
    ("default", None),
    *[(f"per_sm{p}_n64w4s3", dec(64, 4, 3, p)) for p in (1, 2, 4)],
    ("per_sm4_align128_n64w4s3", dec(64, 4, 3, 4, 128)),
    ("per_sm2_n128w8s3", dec(128, 8, 3, 2)),
]
# Backward: (dK/dV config incl. FLAT / HEAVY_FIRST, dQ config). "old" = the previous session's loop
# per head in the L2-friendly grid order with its autotuner's usual pick.
DQ0 = cfg(128, 64, 8, 2)
BWD_VARIANTS = [
    ("default", None, None),
    ("old_n128", cfg(64, 128, 8, 3, FLAT=False, HEAVY_FIRST=False), DQ0),
    ("flat_n128", cfg(64, 128, 8, 3, FLAT=True, HEAVY_FIRST=False), DQ0),
    ("heavy_n128", cfg(64, 128, 8, 3, FLAT=False, HEAVY_FIRST=True), DQ0),
    ("flat_heavy_n128", cfg(64, 128, 8, 3, FLAT=True, HEAVY_FIRST=True), DQ0),
    ("flat_heavy_n128s2", cfg(64, 128, 8, 2, FLAT=True, HEAVY_FIRST=True), DQ0),
    ("flat_heavy_n128s4", cfg(64, 128, 8, 4, FLAT=True, HEAVY_FIRST=True), DQ0),
    ("flat_heavy_m32n128w4", cfg(32, 128, 4, 3, FLAT=True, HEAVY_FIRST=True), DQ0),
    ("flat_heavy_n64w4", cfg(64, 64, 4, 3, FLAT=True, HEAVY_FIRST=True), DQ0),
    ("flat_n64w4", cfg(64, 64, 4, 3, FLAT=True, HEAVY_FIRST=False), DQ0),
    ("flat_heavy_m128n64w8", cfg(128, 64, 8, 2, FLAT=True, HEAVY_FIRST=True), DQ0),
    ("dq_m64n64w4s3", cfg(64, 128, 8, 3, FLAT=True, HEAVY_FIRST=True), cfg(64, 64, 4, 3)),
    ("dq_m128n64w8s3", cfg(64, 128, 8, 3, FLAT=True, HEAVY_FIRST=True), cfg(128, 64, 8, 3)),
    ("dq_m128n128w8s2", cfg(64, 128, 8, 3, FLAT=True, HEAVY_FIRST=True), cfg(128, 128, 8, 2)),
    ("dq_m64n128w4s2", cfg(64, 128, 8, 3, FLAT=True, HEAVY_FIRST=True), cfg(64, 128, 4, 2)),
    ("dq_m128n32w4s4", cfg(64, 128, 8, 3, FLAT=True, HEAVY_FIRST=True), cfg(128, 32, 4, 4)),
    # the Triton tutorial's blocks (32 x 128 dK/dV, 128 x 32 dQ, 4 warps, 5 stages)
    ("tutorial_flat_heavy", cfg(32, 128, 4, 5, FLAT=True, HEAVY_FIRST=True), cfg(128, 32, 4, 5)),
    ("flat_heavy_m32n128w4s4", cfg(32, 128, 4, 4, FLAT=True, HEAVY_FIRST=True), DQ0),
    # TMA loads in both kernels (round 1 also warp-specialized the unmasked loops: 4-6% slower)
    ("tma_flat_heavy", cfg(64, 128, 8, 3, FLAT=True, HEAVY_FIRST=True, TMA=True), {**DQ0, "TMA": True}),
]
FWD_VARIANTS = [
    ("default", None),
    ("m64n64w4s3", cfg(64, 64, 4, 3)),
    ("m64n64w4s4", cfg(64, 64, 4, 4)),
    ("m128n64w8s3", cfg(128, 64, 8, 3)),
    ("m128n64w8s4", cfg(128, 64, 8, 4)),
    ("m128n128w8s2", cfg(128, 128, 8, 2)),
    ("m128n128w8s3", cfg(128, 128, 8, 3)),
    ("m64n128w4s3", cfg(64, 128, 4, 3)),
    ("m128n64w8s3_maxnreg", cfg(128, 64, 8, 3, maxnreg=240)),
    # through TMA descriptors (round 1 also warp-specialized the bulk loop, with and without TMA: it
    # compiled, and lost 12-35%; the switch was removed)
    ("m64n64w4s3_tma", cfg(64, 64, 4, 3, TMA=True)),
    ("m128n64w8s3_tma", cfg(128, 64, 8, 3, TMA=True)),
    ("m128n128w8s3_tma", cfg(128, 128, 8, 3, TMA=True)),
]
# Prefill points: the GQA backward below SDPA-flash (goal 2), the marginal MHA one, an MHA of the GQA
# case's FLOPs (Hq 32 = Hk 32, the per-FLOP control), the hd128 causal goal points for goal 3.
BWD_CASES = [
    dict(B=16, T=1024, Hq=32, Hk=8),
    dict(B=8, T=2048, Hq=32, Hk=8),
    dict(B=4, T=4096, Hq=32, Hk=8),
    dict(B=2, T=8192, Hq=32, Hk=8),
    dict(B=16, T=1024, Hq=16, Hk=16),
    dict(B=16, T=1024, Hq=32, Hk=32),
    dict(B=4, T=4096, Hq=16, Hk=16),
]
FWD_CASES = [dict(B=4, T=4096, Hq=16, Hk=16), dict(B=1, T=16384, Hq=16, Hk=16)]


def tasks(smoke: bool) -> list[tuple]:
    """(kind, case, name, variant) for everything the run measures, in measuring order."""
    if smoke:
        p = dict(B=1, T=40, Hq=4, Hk=2, D=16)
        small = [("default", None), ("n16", dec(16, 4, 1, 2))]
        return (
            [("decode", dict(B=1, L=70, Hq=8, Hk=2, D=16, page=16), n, v) for n, v in small]
            + [("bwd", p, n, (a, b)) for n, a, b in BWD_VARIANTS[:1]]
            + [("bwd", p, "flat", (cfg(32, 64, 4, 1, FLAT=True, HEAVY_FIRST=True), cfg(64, 32, 4, 1)))]
            + [("fwd", p, "m64n32", cfg(64, 32, 4, 1)), ("fwd", p, "m64n32_tma", cfg(64, 32, 4, 1, TMA=True))]
        )
    out = [("decode", dict(B=1, L=65536, Hq=64, Hk=8, D=128, page=16), n, v) for n, v in DECODE_B1]
    out += [("decode", dict(B=64, L=4096, Hq=64, Hk=8, D=128, page=16), n, v) for n, v in DECODE_B64]

    def bwd(c):
        full = c["T"] <= 2048 and c["Hq"] != c["Hk"] or c in (BWD_CASES[4], BWD_CASES[6])
        variants = BWD_VARIANTS if full else [BWD_VARIANTS[i] for i in (0, 1, 2, 3, 4, 8, 9)]
        return [("bwd", {**c, "D": 128}, n, (a, b)) for n, a, b in variants]

    # goal 2's short sequences, then the forward, then the long backward points (time budget order)
    for i in (0, 1, 4, 5):
        out += bwd(BWD_CASES[i])
    for c in FWD_CASES:
        out += [("fwd", {**c, "D": 128}, n, v) for n, v in FWD_VARIANTS]
    for i in (2, 3, 6):
        out += bwd(BWD_CASES[i])
    return out


# ------------------------------------------------------------------------------------------ inputs
def decode_inputs(c, dev, dtype):
    import torch

    g = torch.Generator(device=dev).manual_seed(0)
    blocks = -(-c["L"] // c["page"])
    pool = c["B"] * blocks
    table = torch.randperm(pool, device=dev, generator=g).view(c["B"], blocks).to(torch.int32)
    kc = torch.randn(pool, c["page"], c["Hk"], c["D"], device=dev, dtype=dtype, generator=g)
    vc = torch.randn_like(kc)
    q = torch.randn(c["B"], c["Hq"], c["D"], device=dev, dtype=dtype, generator=g)
    lens = torch.full((c["B"],), c["L"], dtype=torch.int32, device=dev)
    return q, kc, vc, table, lens


def prefill_inputs(c, dev, dtype):
    import torch

    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(c["B"], c["T"], c["Hq"], c["D"], device=dev, dtype=dtype, generator=g)
    k = torch.randn(c["B"], c["T"], c["Hk"], c["D"], device=dev, dtype=dtype, generator=g)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    return q, k, v, do


def runner(kind, c, variant, inputs):
    """A no-argument callable running one variant on prepared inputs."""
    from kiln.kernels.attention import attention_bwd, attention_fwd
    from kiln.kernels.decode_attention import decode_attention_triton

    if kind == "decode":
        q, kc, vc, table, lens = inputs
        return lambda: decode_attention_triton(
            q, kc, vc, table, lens, c["D"] ** -0.5, None, None, None, variant
        )
    q, k, v, do, o, lse = inputs
    scale = c["D"] ** -0.5
    if kind == "fwd":
        knobs = dict(variant or {})
        tma = knobs.pop("TMA", False)
        return lambda: attention_fwd(q, k, v, True, scale, None, None, None, 0, tma, knobs or None)
    dkdv, dq = (dict(x) if x else None for x in variant)
    tma = any(x.pop("TMA", False) for x in (dkdv, dq) if x)  # one switch for both kernels
    return lambda: attention_bwd(do, q, k, v, o, lse, True, scale, None, None, 0, tma, dkdv, dq)


class Inputs:
    """Inputs per case, built once (the forward's o and lse for the backward)."""

    def __init__(self, dev, dtype):
        self.dev, self.dtype, self.cache = dev, dtype, {}

    def get(self, kind, c):
        key = ("decode" if kind == "decode" else "prefill", tuple(sorted(c.items())))
        if key not in self.cache:
            if len(self.cache) > 3:  # bound the memory held
                self.cache.pop(next(iter(self.cache)))
            if kind == "decode":
                self.cache[key] = decode_inputs(c, self.dev, self.dtype)
            else:
                from kiln.kernels.attention import attention_fwd

                q, k, v, do = prefill_inputs(c, self.dev, self.dtype)
                o, lse = attention_fwd(q, k, v, True, c["D"] ** -0.5, None, None, None, 0)
                self.cache[key] = (q, k, v, do, o, lse)
        return self.cache[key]


# ------------------------------------------------------------------------------------ compile workers
_WORKER_INPUTS = None


def _warm(task) -> str | None:
    """In a worker: run one variant once (its kernels compile into Triton's on-disk cache)."""
    global _WORKER_INPUTS  # noqa: PLW0603 - one per worker process, never shared
    import torch

    cuda = torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET")
    if _WORKER_INPUTS is None:
        _WORKER_INPUTS = Inputs(*(("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)))
    kind, c, _, variant = task
    try:
        fn = runner(kind, c, variant, _WORKER_INPUTS.get(kind, c))
        fn()
        if cuda and kind == "decode":  # measured from a CUDA graph: capture it here first
            Bench(True).graph_ms(fn)
        if cuda:
            torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001 - recorded by the main process when it measures
        return f"{type(e).__name__}: {str(e)[:200]}"


def _risky(task) -> bool:
    """Variants whose compile or graph capture may break the process (warp specialization, programmatic
    dependent launch): tried in a pool of their own first, and measured only where that succeeded."""
    parts = task[3] if isinstance(task[3], tuple) else (task[3],)
    return any(isinstance(v, dict) and bool(v.get("WS") or v.get("PDL")) for v in parts)


def precompile(all_tasks, workers: int, bench: Bench) -> list[str | None]:
    """Compile every task in worker processes (defaults too: a worker autotuning one compiles its whole
    config space). Returns per task None or the error its worker met."""
    errors: list[str | None] = [None] * len(all_tasks)
    ctx = get_context("spawn")
    # One task per distinct compile: prefill kernels specialize on group == 1 (MHA) or not; decode's
    # split count (per_sm, align) is a runtime argument.
    first: dict[tuple, int] = {}
    keys = []
    for i, (kind, c, _, v) in enumerate(all_tasks):
        knobs = {k: x for k, x in v.items() if k not in ("per_sm", "align")} if isinstance(v, dict) else v
        keys.append((kind, c.get("Hq") == c.get("Hk"), str(knobs)))
        first.setdefault(keys[-1], i)
    safe = [i for i in first.values() if not _risky(all_tasks[i])]
    risky = [i for i in first.values() if _risky(all_tasks[i])]
    pools = [ProcessPoolExecutor(workers, mp_context=ctx)]
    futures = {i: pools[0].submit(_warm, all_tasks[i]) for i in safe}
    for i in risky:  # each in a process of its own: a crash takes nothing else with it
        pools.append(ProcessPoolExecutor(1, mp_context=ctx))
        futures[i] = pools[-1].submit(_warm, all_tasks[i])
    for i, f in futures.items():
        try:
            errors[i] = f.result()
        except Exception as e:  # noqa: BLE001 - a crashed worker (BrokenProcessPool)
            errors[i] = f"worker died: {type(e).__name__}"
    for pool in pools:
        pool.shutdown()
    errors = [errors[first[key]] for key in keys]  # a compile's outcome holds for every task sharing it
    bench.log(f"precompiled {len(first)} variants in {workers} workers ({sum(map(bool, errors))} failed)")
    return errors


# ------------------------------------------------------------------------------------------ peers
def peers(kind, c, inputs, rec, bench):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if kind == "decode":
        q, kc, vc, table, _ = inputs
        B, L, Hk, D = c["B"], c["L"], c["Hk"], c["D"]
        k = kc[table.long()].reshape(B, -1, Hk, D)[:, :L].transpose(1, 2).contiguous()
        v = vc[table.long()].reshape(B, -1, Hk, D)[:, :L].transpose(1, 2).contiguous()

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

        bench.measure(rec, "sdpa_dense_ms", sdpa, graph=True)
        return
    q, k, v, do, _, _ = inputs
    qt, kt, vt, dot = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v, do))
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        with sdpa_kernel(backend):
            f = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qt, kt, vt, is_causal=True, enable_gqa=c["Hq"] != c["Hk"]
            )
            if kind == "fwd":
                bench.measure(rec, f"{name}_ms", f)
            else:
                o = f()
                bench.measure(
                    rec,
                    f"{name}_ms",
                    lambda o=o: torch.autograd.grad(o, (qt, kt, vt), dot, retain_graph=True),
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1))
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import datetime

    import torch
    import triton

    from kiln.kernels.dispatch import sm_count

    cuda = torch.cuda.is_available() and not args.smoke
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    bench = Bench(cuda)
    all_tasks = tasks(args.smoke)
    result = {
        "area": "attention-sweep",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter, smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sm_count": sm_count(torch.device(dev)),
        "ceilings": {"copy_TBps_platform": PEAK_COPY_TBPS},
        "rows": [],
    }
    if cuda:
        x = torch.empty(2**29, dtype=torch.bfloat16, device=dev)
        y = torch.empty_like(x)
        result["ceilings"]["copy_TBps_measured"] = round(
            2 * x.numel() * 2 / bench.ms(lambda: y.copy_(x)) / 1e9, 3
        )
        del x, y
    compile_errors = precompile(all_tasks, args.workers, bench)
    inputs = Inputs(dev, dtype)
    seen_peer = set()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for (kind, c, name, variant), compile_error in zip(all_tasks, compile_errors):
        rec = {"kind": kind, **c, "variant": name, "config": str(variant)}
        result["rows"].append(rec)
        out.write_text(json.dumps(result, indent=1))  # after every row: a crash keeps what was measured
        if bench.elapsed() > 92.0:
            rec["skipped"] = "time budget"
            continue
        if compile_error and (_risky((kind, c, name, variant)) or compile_error.startswith("worker died")):
            rec["error"] = f"compile: {compile_error}"
            continue
        try:
            data = inputs.get(kind, c)
            ms = bench.measure(rec, "ms", runner(kind, c, variant, data), graph=kind == "decode")
            nbytes = 2 * c["B"] * c.get("L", 0) * c["Hk"] * c["D"] * 2  # decode: K and V read once, bf16
            flops = 2.0 * c["B"] * c["Hq"] * c.get("T", 0) ** 2 * c["D"] * (2.5 if kind == "bwd" else 1.0)
            if ms and kind == "decode":
                from kiln.kernels.decode_attention import num_splits_for

                rec["TBps"] = round(nbytes / ms / 1e9, 3)
                rec["frac_copy_platform"] = round(rec["TBps"] / PEAK_COPY_TBPS, 3)
                v = variant or {}
                rec["splits"] = num_splits_for(
                    c["B"], c["Hk"], c["L"], result["sm_count"], v.get("per_sm", 4), v.get("align", 128)
                )
            elif ms:  # causal: half of 4 B H T^2 D, the backward 2.5x the forward
                rec["TFLOPs"] = round(flops / ms / 1e9, 1)
            key = (kind, tuple(sorted(c.items())))
            if cuda and key not in seen_peer:
                seen_peer.add(key)
                peers(kind, c, data, rec, bench)
                for peer in ("flash", "cudnn"):
                    if rec.get(f"{peer}_ms") and ms:
                        rec[f"{peer}_TFLOPs"] = round(flops / rec[f"{peer}_ms"] / 1e9, 1)
                if rec.get("sdpa_dense_ms"):
                    rec["sdpa_dense_TBps"] = round(nbytes / rec["sdpa_dense_ms"] / 1e9, 3)
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        bench.log(
            f"{kind} {c} {name}: {rec.get('ms')} ms {rec.get('TBps') or rec.get('TFLOPs')} {rec.get('ms_error', '')}"
        )
    result["wall_s"] = round(bench.elapsed(), 1)
    out.write_text(json.dumps(result, indent=1))
    bench.log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
