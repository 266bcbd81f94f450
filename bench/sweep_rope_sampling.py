"""Sweep RoPE and sampling kernel variants against their peers on the H200, in one process (< 100 s).

    python bench/sweep_rope_sampling.py --out bench/results/sweep_rope_sampling.json   # CUDA GPU
    python bench/sweep_rope_sampling.py --smoke --out /tmp/sweep.json                  # CPU interpreter

RoPE (q (8, 4096, 32, 128), k (8, 4096, 8, 128) bf16, HF half-rotated pairs): kiln's launch variants
(blocks of flat (token, head) rows or of whole tokens, warps, eviction policy) against eager PyTorch (the HF formula of bench/kernels_norms.py),
torch.compile of it, Liger's rope (if importable) and a plain copy of q and k (the floor). Each is timed
forward, and forward + backward (kiln variants: the forward launch then the inverse-rotation launch,
what RoPEFunction runs; peers: autograd), as GPU time replayed from a CUDA graph (`graph_ms`), with
normal launches (`ms`, triton.testing.do_bench) and as host time per call (`host_ms`).

Sampling (V = 151936, batch 1 and 64, bf16 logits * 4): kiln's chunked two-stage kernels at several chunk
sizes / warps against sample_ref (eager, sort-based) and torch.argmax for greedy; GPU time in CUDA graphs,
do_bench time and host microseconds per call; and whether kiln's token equals the reference's for one
noise draw per row. A failing variant records its error and the sweep goes on; past the time budget the
remaining variants are skipped (recorded as such).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernels_norms import eager_rope  # noqa: E402 - the same HF formula the norms benchmark gives its peers
from kiln.kernels import sampling as S  # noqa: E402
from kiln.kernels.dispatch import use_backend  # noqa: E402
from kiln.kernels.rope import apply_rope, apply_rope_ref, rope_launch  # noqa: E402
from provenance import git_commit  # noqa: E402

COPY_TBPS = 4.27  # PLATFORM.md: H200 device-to-device copy, read + write
T0 = time.perf_counter()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    p.add_argument(
        "--budget",
        default="rope=45,sampling=55",
        help="seconds per section; its later variants are skipped past it",
    )
    p.add_argument("--only", default="rope,sampling")
    return p.parse_args()


ARGS = parse()
SMOKE = ARGS.smoke
DEV = "cpu" if SMOKE else "cuda"


BUDGET = {k: float(v) for k, v in (item.split("=") for item in ARGS.budget.split(","))}
DEADLINE = [float("inf")]  # the running section's end (perf_counter seconds)


def over_budget() -> bool:
    return time.perf_counter() > DEADLINE[0]


def timings(fn: Callable[[], object], host_n: int = 20) -> dict:
    """graph_ms (CUDA-graph replay: GPU time), ms (do_bench: normal launches), host_ms (per call, queued)."""
    fn()  # compile / autotune / warm up outside the timing
    if SMOKE:
        t = time.perf_counter()
        fn()
        return {"ms": round((time.perf_counter() - t) * 1e3, 3)}
    out = {"ms": round(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"), 5)}
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(host_n):
        fn()
    out["host_ms"] = round((time.perf_counter() - t) / host_n * 1e3, 5)
    torch.cuda.synchronize()
    try:
        out["graph_ms"] = round(triton.testing.do_bench_cudagraph(fn, rep=15, return_mode="median"), 5)
    except Exception as e:  # noqa: BLE001 - a peer that cannot be captured keeps its plain time
        out["graph_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def measure(
    results: dict, name: str, fn: Callable[[], object], extra: Callable[[], dict] | None = None
) -> None:
    if over_budget():
        results[name] = {"error": "skipped: time budget"}
        return
    t = time.perf_counter()
    try:
        r = timings(fn)
        if extra is not None:
            r.update(extra())
    except Exception as e:  # noqa: BLE001 - record and go on
        r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    r["wall_s"] = round(time.perf_counter() - t, 2)
    results[name] = r
    print(f"{name:<48} {json.dumps(r)}", flush=True)


def ratios(results: dict, kiln_keys: list[str], peer_keys: list[str], nbytes: int | None = None) -> dict:
    """For each timing kind: the best kiln variant, the best peer, peer / kiln, and TB/s."""
    out = {}
    for kind in ("graph_ms", "ms"):
        k = {n: results[n][kind] for n in kiln_keys if isinstance(results.get(n, {}).get(kind), float)}
        p = {n: results[n][kind] for n in peer_keys if isinstance(results.get(n, {}).get(kind), float)}
        if not k or not p:
            continue
        kb, pb = min(k, key=k.get), min(p, key=p.get)
        row = {
            "best_kiln": kb,
            "kiln": k[kb],
            "best_peer": pb,
            "peer": p[pb],
            "ratio": round(p[pb] / k[kb], 3),
        }
        if nbytes:
            row["kiln_TBps"] = round(nbytes / k[kb] / 1e9, 3)
            row["kiln_frac_copy"] = round(nbytes / k[kb] / 1e9 / COPY_TBPS, 3)
        out[kind] = row
    return out


# ---------------------------------------------------------------- RoPE
ROPE_VARIANTS = {  # name: rope_launch keyword arguments ("default": the launcher's defaults)
    "default": {},
    "r8_w1_noevict": {"rows": 8, "num_warps": 1, "evict": ""},
    "r4_w1": {"rows": 4, "num_warps": 1},
    "r16_w1": {"rows": 16, "num_warps": 1},
    "r16_w2": {"rows": 16, "num_warps": 2},
    "r16_w2_noevict": {"rows": 16, "num_warps": 2, "evict": ""},
    "r32_w2": {"rows": 32, "num_warps": 2},
    "tok1_w2": {"tokens": 1, "num_warps": 2},
    "tok2_w2": {"tokens": 2, "num_warps": 2},
    "tok4_w8": {"tokens": 4, "num_warps": 8},
    "tok4_w8_noevict": {"tokens": 4, "num_warps": 8, "evict": ""},
}


def _err(got: tuple, want: tuple) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(got, want))


def bench_rope() -> dict:
    B, T, Hq, Hk, D = (1, 5, 4, 2, 16) if SMOKE else (8, 4096, 32, 8, 128)
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(B, T, Hq, D, generator=g, device=DEV).bfloat16()
    k = torch.randn(B, T, Hk, D, generator=g, device=DEV).bfloat16()
    dq = torch.randn(B, Hq, T, D, generator=g, device=DEV).bfloat16().transpose(1, 2)
    dk = torch.randn(B, Hk, T, D, generator=g, device=DEV).bfloat16().transpose(1, 2)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    ang = torch.outer(torch.arange(T, device=DEV).float(), inv)  # (T, D/2)
    cos, sin = ang.cos(), ang.sin()
    cos_full = torch.cat((cos, cos), -1).bfloat16()  # (T, D): HF's duplicated-halves table
    sin_full = torch.cat((sin, sin), -1).bfloat16()
    want_q, want_k = apply_rope_ref(q, k, cos, sin)
    e = B * T * (Hq + Hk) * D * 2
    res: dict = {"shape": f"B{B} T{T} Hq{Hq} Hk{Hk} D{D} bf16", "bytes": {"fwd": 2 * e, "fwd+bwd": 4 * e}}
    fwd: dict = {}
    fb: dict = {}

    def as_bthd(f):  # peers compute on (B, H, T, D) views of the same memory
        return lambda q, k: f(q.transpose(1, 2), k.transpose(1, 2))

    peers: dict[str, Callable | None] = {
        "eager": as_bthd(lambda q, k: eager_rope(q, k, cos_full, sin_full)),
        "compile": None if SMOKE else as_bthd(torch.compile(lambda q, k: eager_rope(q, k, cos_full, sin_full))),
    }  # fmt: skip
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        peers["liger"] = as_bthd(lambda q, k: LigerRopeFunction.apply(q, k, cos_full[None], sin_full[None]))
    except Exception as ex:  # noqa: BLE001
        fwd["liger"] = fb["liger"] = {"error": f"unavailable: {type(ex).__name__}: {ex}"[:200]}
    for name, f in peers.items():
        if f is None:
            continue
        # each peer gets its own copies of q and k: Liger rotates its inputs in place
        qp, kp = q.clone(), k.clone()
        measure(fwd, name, lambda f=f, qp=qp, kp=kp: f(qp, kp))
        qg, kg = qp.detach().requires_grad_(), kp.detach().requires_grad_()

        def fwd_bwd(f=f, qg=qg, kg=kg):
            oq, ok = f(qg, kg)
            return torch.autograd.grad((oq, ok), (qg, kg), (dq.transpose(1, 2), dk.transpose(1, 2)))

        measure(fb, name, fwd_bwd)
    measure(fwd, "copy", lambda: (q.clone(), k.clone()))  # the floor: torch's copy of the same bytes
    with use_backend("triton"):  # the public op: autograd Function (fwd+bwd) or the launcher (no grad)
        qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
        measure(fwd, "kiln_apply_rope", lambda: apply_rope(q, k, cos, sin))
        measure(
            fb,
            "kiln_apply_rope",
            lambda: torch.autograd.grad(apply_rope(qg, kg, cos, sin), (qg, kg), (dq, dk)),
        )
    for name, kw in ROPE_VARIANTS.items():
        measure(
            fwd, name, lambda kw=kw: rope_launch(q, k, cos, sin, None, False, **kw),
            lambda kw=kw: {"max_abs_err": _err(rope_launch(q, k, cos, sin, None, False, **kw), (want_q, want_k))},
        )  # fmt: skip
        measure(
            fb, name,
            lambda kw=kw: (rope_launch(q, k, cos, sin, None, False, **kw),
                           rope_launch(dq, dk, cos, sin, None, False, True, **kw)),
        )  # fmt: skip
    # the interleaved layout and position ids on the default and on whole-token blocks
    pos = torch.randint(0, T, (B, T), generator=g, device=DEV)
    want_i = apply_rope_ref(q, k, cos, sin, None, True)
    want_p = apply_rope_ref(q, k, cos, sin, pos, False)
    for name in ("default", "tok4_w8"):
        kw = ROPE_VARIANTS[name]
        measure(
            fwd, f"interleaved_{name}", lambda kw=kw: rope_launch(q, k, cos, sin, None, True, **kw),
            lambda kw=kw: {"max_abs_err": _err(rope_launch(q, k, cos, sin, None, True, **kw), want_i)},
        )  # fmt: skip
        measure(
            fwd, f"positions_{name}", lambda kw=kw: rope_launch(q, k, cos, sin, pos, False, **kw),
            lambda kw=kw: {"max_abs_err": _err(rope_launch(q, k, cos, sin, pos, False, **kw), want_p)},
        )  # fmt: skip
    kiln_fwd = [n for n in fwd if n not in peers and n != "copy" and not n.startswith(("inter", "posi"))]
    res.update(
        fwd=fwd, fwd_bwd=fb,
        summary_fwd=ratios(fwd, kiln_fwd, list(peers), 2 * e),
        summary_fwd_bwd=ratios(fb, [n for n in fb if n not in peers], list(peers), 4 * e),
    )  # fmt: skip
    print("rope fwd:", json.dumps(res["summary_fwd"]), "\nrope fwd+bwd:", json.dumps(res["summary_fwd_bwd"]))
    return res


# ---------------------------------------------------------------- sampling
SAMPLE_MODES = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-k 50 + top-p 0.9": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "top-k 50": {"temperature": 0.8, "top_k": 50},
    "top-p 0.9": {"temperature": 0.8, "top_p": 0.9},
}
SAMPLE_CONFIGS = {  # mode -> launch overrides (chunk, chunk_warps, combine_warps, combine_block, search_block)
    "greedy": [(2048, 4, 4, 0, 0), (4096, 4, 4, 0, 0), (8192, 8, 4, 0, 0)],
    "temperature": [(1024, 4, 4, 0, 0), (1024, 2, 4, 0, 0), (2048, 4, 4, 0, 0)],
    "top-k 50 + top-p 0.9": [
        (2048, 4, 16, 4096, 2048),
        (4096, 8, 16, 4096, 2048),
        (4096, 4, 16, 4096, 2048),
        (8192, 8, 16, 4096, 2048),
        (8192, 16, 16, 2048, 1024),
    ],
    "top-k 50": [(4096, 8, 16, 4096, 2048)],
    "top-p 0.9": [(4096, 8, 16, 4096, 2048)],
}


def bench_sampling() -> dict:
    V = 301 if SMOKE else 151936
    out: dict = {"V": V}
    for B in (1, 2) if SMOKE else (1, 64):
        g = torch.Generator(device=DEV).manual_seed(B)
        logits = (torch.randn(B, V, generator=g, device=DEV) * 4).bfloat16()
        noise = torch.empty(B, V, device=DEV).exponential_(1.0, generator=g)
        for mode, kw in SAMPLE_MODES.items():
            out[f"{mode} B={B}"] = case = _sample_case(logits, noise, mode, kw)
            print(mode, B, json.dumps(case["summary"]), flush=True)
    return out


def _sample_case(logits: torch.Tensor, noise: torch.Tensor, mode: str, kw: dict) -> dict:
    res: dict = {}
    peers = {"eager_ref": lambda: S.sample_ref(logits, **kw)}
    if mode == "greedy":
        peers["torch.argmax"] = lambda: logits.argmax(-1)
    for name, f in peers.items():
        measure(res, name, f)
    # the reference's rule on the same noise: the token kiln must return
    want = S.sample_ref(logits, **kw) if mode == "greedy" else _ref_with_noise(logits, noise, **kw)
    with use_backend("triton"):
        measure(res, "kiln_sample", lambda: S.sample(logits, **kw))
        for chunk, cw, mw, blk, sb in SAMPLE_CONFIGS[mode]:
            over = {"chunk": min(chunk, 128) if SMOKE else chunk, "chunk_warps": cw, "combine_warps": mw,
                    "combine_block": blk or None, "search_block": sb or None}  # fmt: skip

            def run(over=over):
                return S.sample_with_noise(logits, noise if kw["temperature"] else None, **kw, **over)

            def check(run=run):
                return {"matches_ref": int((run() == want).sum()), "rows": logits.shape[0]}

            measure(res, f"c{chunk}_w{cw}_m{mw}" + (f"_b{blk}_s{sb}" if blk else ""), run, check)
    kiln = [n for n in res if n not in peers]
    return {"results": res, "summary": ratios(res, kiln, list(peers))}


def _ref_with_noise(logits, noise, temperature, top_k=None, top_p=None):
    """sample_ref's rule (float32, as it computes) with the given noise."""
    z = logits.float() / temperature
    if top_k:
        z = z.masked_fill(z < torch.topk(z, top_k, dim=-1).values[:, -1:], float("-inf"))
    if top_p is not None and top_p < 1:
        sz, order = torch.sort(z, dim=-1, descending=True)
        p = torch.softmax(sz, -1)
        sz = sz.masked_fill((p.cumsum(-1) - p) >= top_p, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, order, sz)
    return (torch.softmax(z, -1) / noise).argmax(-1)


def main() -> int:
    meta = {
        "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu (interpreter smoke run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(meta), flush=True)
    only = set(ARGS.only.split(","))
    for name, fn in [("rope", bench_rope), ("sampling", bench_sampling)]:
        if name not in only:
            continue
        DEADLINE[0] = time.perf_counter() + BUDGET.get(name, 60.0)
        try:
            meta[name] = fn()
        except Exception as e:  # noqa: BLE001 - keep what was measured
            import traceback

            traceback.print_exc()
            meta[name] = {"error": f"{type(e).__name__}: {e}"}
    meta["wall_s"] = round(time.perf_counter() - T0, 1)
    os.makedirs(os.path.dirname(os.path.abspath(ARGS.out)), exist_ok=True)
    with open(ARGS.out, "w") as f:
        json.dump(meta, f, indent=1)
    print(f"wrote {ARGS.out} in {meta['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
