"""Benchmark kiln's memory-bound kernels against their peers, on the H200, in one process.

    python bench/norms.py                        # on a CUDA GPU (~2 minutes) -> bench/results/norms.json
    python bench/norms.py --smoke                # tiny shapes on the CPU through the interpreter (seconds)
    python bench/norms.py --table bench/results/norms.json   # the docs/perf/kernels.md table

Ops: vector add, softmax (one block and the online multi-block path), RMSNorm (plain and with the fused
residual add), LayerNorm, SwiGLU (split and fused gate/up), RoPE on q and k; forward and
forward+backward at LLM shapes in bf16. Peers measured in the same run: eager PyTorch (the textbook
composition of ops), torch.compile of that, the fused PyTorch op where one exists (F.rms_norm,
F.layer_norm, torch.softmax, torch.add) and Liger Kernel (imported if installed; else "unavailable").

Every time is the median over 5 rounds of triton.testing.do_bench (L2 flushed before each call), each
round visiting the implementations of a case in a fresh random order (kiln.profile.timing), so that none is
favoured by where it falls in the run. Bandwidth is the op's useful bytes (each input
read once, each output written once; weights and tables are ignored) over that time, the same byte
count for every implementation, so TB/s ratios are time ratios; "frac_copy" divides by the device copy
bandwidth of the device's ceilings (kiln.profile.ceilings, measured once per device and cached). Forward runs under no_grad;
forward+backward is one forward with grad plus torch.autograd.grad of every input with a fixed
upstream gradient (no .grad accumulation). A failing case records its error and the run goes on; the
run skips torch.compile peers once it passes its time budget. kiln's outputs are checked against the
eager peer on the benchmark shapes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from kiln.kernels.dispatch import use_backend
from kiln.kernels.layernorm import layernorm, layernorm_bwd, layernorm_fwd
from kiln.kernels.rmsnorm import rmsnorm, rmsnorm_bwd, rmsnorm_fwd, rmsnorm_ref
from kiln.kernels.rope import apply_rope, rope_launch
from kiln.kernels.softmax import softmax, softmax_fwd
from kiln.kernels.swiglu import swiglu, swiglu_fwd
from kiln.kernels.vector_add import vector_add, vector_add_launch
from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser
from kiln.profile.report import read_json
from kiln.profile.timing import Timer

EPS = 1e-6

try:
    import liger_kernel
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.softmax import LigerSoftmaxFunction
    from liger_kernel.ops.swiglu import LigerFusedGateUpSiLUMulFunction, LigerSiLUMulFunction

    LIGER = getattr(liger_kernel, "__version__", "installed")
except Exception as e:  # noqa: BLE001 - any import failure means the peer is unavailable
    LIGER = f"unavailable: {type(e).__name__}: {e}"


# ---- eager peers: the textbook compositions, also what torch.compile is given ----
def eager_rmsnorm(x, w):
    return rmsnorm_ref(x, w, EPS)


def eager_add_rmsnorm(x, r, w):
    h = x + r
    return rmsnorm_ref(h, w, EPS), h


def add_rms_norm(x, r, w):
    h = x + r
    return F.rms_norm(h, (h.shape[-1],), w, EPS), h


def eager_layernorm(x, w, b):
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    var = (xf - mu).pow(2).mean(-1, keepdim=True)
    return ((xf - mu) * torch.rsqrt(var + EPS) * w.float() + b.float()).to(x.dtype)


def eager_softmax(x):
    xf = x.float()
    e = torch.exp(xf - xf.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)).to(x.dtype)


def eager_swiglu(g, u):
    return F.silu(g) * u


def eager_swiglu_fused(x):
    g, u = x.chunk(2, -1)
    return F.silu(g) * u


def eager_rope(q, k, cos, sin):
    # HF Llama: q, k (B, H, T, D); cos, sin (T, D) duplicated halves
    def rot(x):
        x1, x2 = x.chunk(2, -1)
        return torch.cat((-x2, x1), -1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


def _round(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


def fwd_bwd(f: Callable, inputs: list[torch.Tensor], grads: list[torch.Tensor]) -> Callable[[], object]:
    """One forward with grad and the gradient of every input, without accumulating into .grad."""

    def run():
        out = f(*inputs)
        outs = list(out) if isinstance(out, tuple | list) else [out]
        return torch.autograd.grad(outs, inputs, grads[: len(outs)])

    return run


def no_grad(f: Callable, inputs: list[torch.Tensor]) -> Callable[[], object]:
    def run():
        with torch.no_grad():
            return f(*inputs)

    return run


def max_err(a, b) -> float:
    a = a if isinstance(a, tuple | list) else (a,)
    b = b if isinstance(b, tuple | list) else (b,)
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


class Bench:
    def __init__(self, timer: Timer, copy_tbps: float | None, budget_s: float):
        self.smoke = timer.smoke
        self.timer = timer
        self.copy_tbps = copy_tbps
        self.budget_s = budget_s
        self.t0 = time.perf_counter()
        self.cases: list[dict] = []
        self.tuning: dict[str, dict[str, float | str]] = {}

    def over_budget(self) -> bool:
        return time.perf_counter() - self.t0 > self.budget_s

    def case(
        self,
        op: str,
        shape: str,
        nbytes: dict[str, int],
        impls: dict[str, Callable | None],
        inputs: list[torch.Tensor],
        grads: list[torch.Tensor],
        modes: tuple[str, ...] = ("fwd", "fwd+bwd"),
    ) -> None:
        """Time every implementation in each mode; impls map a name to f(*inputs) (None: not available)."""
        # kiln against the eager formula on the pristine inputs, before anything runs: Liger's RoPE rotates
        # q and k in place, so after its timing calls the shared inputs hold other values
        err = None
        if "eager" in impls and impls.get("kiln"):
            try:
                with torch.no_grad():
                    ins = [t.detach().clone() for t in inputs]
                    err = max_err(impls["kiln"](*ins), impls["eager"](*ins))
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
        for mode in modes:
            res: dict[str, dict] = {}
            runs: dict[str, Callable[[], object]] = {}
            for name, f in impls.items():
                if name == "compile" and (self.smoke or self.over_budget()):
                    res[name] = {"error": "skipped: smoke run" if self.smoke else "skipped: time budget"}
                    continue
                if f is None:
                    res[name] = {"error": LIGER if name == "liger" else "not available"}
                    continue
                try:
                    if mode == "fwd":
                        run = no_grad(f, [t.detach() for t in inputs])
                    else:
                        run = fwd_bwd(f, [t.detach().requires_grad_() for t in inputs], grads)
                    run()  # compile / autotune / warm up outside the timing
                    runs[name] = run
                except Exception as e:  # noqa: BLE001 - record and go on
                    res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            # every implementation timed in each of several rounds, in random order (kiln.profile.timing)
            for name, ms in self.timer.interleaved(runs).items():
                tbps = nbytes[mode] / ms["ms"] / 1e9
                res[name] = {
                    "ms": round(ms["ms"], 4),
                    "TBps": round(tbps, 3),
                    "frac_copy": fraction(tbps, self.copy_tbps),
                }
                if "rounds" in ms:
                    res[name]["rounds_ms"] = ms["rounds"]
            for name, run in runs.items():
                try:
                    res[name]["host_ms"] = _round(self.timer.host(run))
                    res[name]["graph_ms"] = _round(self.timer.graph(run))
                except Exception as e:  # noqa: BLE001 - a peer that cannot be captured keeps its plain time
                    res[name]["graph_ms"] = f"{type(e).__name__}: {str(e)[:200]}"
            peers = {k: v["ms"] for k, v in res.items() if k != "kiln" and "ms" in v}
            entry = {"op": op, "mode": mode, "shape": shape, "bytes": nbytes[mode], "results": res}
            if peers and "ms" in res.get("kiln", {}):
                best = min(peers, key=peers.get)
                entry.update(best_peer=best, ratio=round(peers[best] / res["kiln"]["ms"], 3))
            graphs = {k: v["graph_ms"] for k, v in res.items() if isinstance(v.get("graph_ms"), float)}
            if "kiln" in graphs and len(graphs) > 1:
                gbest = min((k for k in graphs if k != "kiln"), key=graphs.get)
                entry.update(graph_best_peer=gbest, graph_ratio=round(graphs[gbest] / graphs["kiln"], 3))
            if mode == "fwd":
                entry["kiln_max_abs_err_vs_eager"] = err
            self.cases.append(entry)
            self.print(entry)

    def tune(self, key: str, variants: dict[str, Callable[[], object]]) -> None:
        """Time launcher variants (num_warps, blocks) of one kiln kernel, to pick the defaults from."""
        out: dict[str, float | str] = {}
        if self.smoke:  # one variant checks the launch path; the others only cost interpreter time
            variants = dict(list(variants.items())[:1])
        for name, fn in variants.items():
            try:
                fn()
                out[name] = round(self.timer.ms(fn), 4)
            except Exception as e:  # noqa: BLE001
                out[name] = f"{type(e).__name__}: {str(e)[:200]}"
        self.tuning[key] = out
        print(f"tune {key}: {out}", flush=True)

    @staticmethod
    def print(e: dict) -> None:
        cells = [
            f"{k}={v['TBps']:.2f}TB/s({v['ms']:.3f}ms)" if "ms" in v else f"{k}=ERR"
            for k, v in e["results"].items()
        ]
        tail = f" ratio={e['ratio']} vs {e['best_peer']}" if "ratio" in e else ""
        if "graph_ratio" in e:
            tail += f" | graph ratio={e['graph_ratio']} vs {e['graph_best_peer']}"
        print(f"{e['op']:<18} {e['mode']:<8} {' '.join(cells)}{tail}", flush=True)


def liger(f: Callable) -> Callable | None:
    """The Liger peer f, or None when Liger is not installed."""
    return None if LIGER.startswith("unavailable") else f


class Inputs:
    """Random bf16 inputs on one device, from one seeded generator."""

    def __init__(self, device: str, smoke: bool):
        self.device = device
        self.smoke = smoke
        self.gen = torch.Generator(device=device).manual_seed(0)

    def randn(self, *shape, scale=1.0, dtype=torch.bfloat16):
        return (scale * torch.randn(*shape, generator=self.gen, device=self.device)).to(dtype)

    def compiled(self, f):
        """torch.compile(f), compiled at its first call (never in a smoke run)."""
        return None if self.smoke else torch.compile(f, dynamic=False)


def bench_rmsnorm(bench: Bench, mk: Inputs, M: int, N: int) -> None:
    x, dy = mk.randn(M, N), mk.randn(M, N)
    w = mk.randn(N, scale=0.1) + 1
    e = M * N * 2
    bench.case(
        "rmsnorm", f"{M}x{N} bf16", {"fwd": 2 * e, "fwd+bwd": 5 * e},
        {
            "kiln": lambda x, w: rmsnorm(x, w, EPS),
            "eager": eager_rmsnorm,
            "F.rms_norm": lambda x, w: F.rms_norm(x, (N,), w, EPS),
            "liger": liger(lambda x, w: LigerRMSNormFunction.apply(x, w, EPS)),
            "compile": mk.compiled(eager_rmsnorm),
        },
        [x, w], [dy],
    )  # fmt: skip
    y, h, rstd = rmsnorm_fwd(x, w, EPS)
    bench.tune(
        "rmsnorm_fwd",
        {f"w{nw}": (lambda nw=nw: rmsnorm_fwd(x, w, EPS, num_warps=nw)) for nw in (4, 8, 16, 32)},
    )
    bench.tune(
        "rmsnorm_bwd",
        {"default": lambda: rmsnorm_bwd(dy, h, w, rstd)}
        | {f"w{nw}_p{p}_s{s}": (lambda nw=nw, p=p, s=s: rmsnorm_bwd(dy, h, w, rstd, None, nw, p, s))
           for nw in (8, 16) for p in (1, 2, 3, 4) for s in (1, 3, 4)},
    )  # fmt: skip


def bench_rmsnorm_residual(bench: Bench, mk: Inputs, M: int, N: int) -> None:
    x, r, dy = mk.randn(M, N), mk.randn(M, N), mk.randn(M, N)
    w = mk.randn(N, scale=0.1) + 1
    e = M * N * 2
    bench.case(
        "rmsnorm+residual", f"{M}x{N} bf16",
        {"fwd": 4 * e, "fwd+bwd": 8 * e},  # fwd: read x, r; write y, h. bwd: read dy, dh, h; write dx
        {
            "kiln": lambda x, r, w: rmsnorm(x, w, EPS, r),
            "eager": eager_add_rmsnorm,
            "F.rms_norm": add_rms_norm,
            "liger": liger(lambda x, r, w: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS)),
            "compile": mk.compiled(eager_add_rmsnorm),
        },
        [x, r, w], [dy, dy],
    )  # fmt: skip


def bench_layernorm(bench: Bench, mk: Inputs, M: int, N: int) -> None:
    x, dy = mk.randn(M, N), mk.randn(M, N)
    w, b = mk.randn(N, scale=0.1) + 1, mk.randn(N, scale=0.1)
    e = M * N * 2
    bench.case(
        "layernorm", f"{M}x{N} bf16", {"fwd": 2 * e, "fwd+bwd": 5 * e},
        {
            "kiln": lambda x, w, b: layernorm(x, w, b, EPS),
            "eager": eager_layernorm,
            "F.layer_norm": lambda x, w, b: F.layer_norm(x, (N,), w, b, EPS),
            "liger": liger(lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)),
            "compile": mk.compiled(eager_layernorm),
        },
        [x, w, b], [dy],
    )  # fmt: skip
    y, h, stats = layernorm_fwd(x, w, b, EPS)
    bench.tune(
        "layernorm_bwd",
        {"default": lambda: layernorm_bwd(dy, h, w, b.dtype, stats)}
        | {f"w{nw}_p{p}_s{s}": (lambda nw=nw, p=p, s=s: layernorm_bwd(dy, h, w, b.dtype, stats, None, nw, p, s))
           for nw in (8, 16) for p in (1, 2, 3, 4) for s in (1, 3, 4)},
    )  # fmt: skip


def bench_softmax(bench: Bench, mk: Inputs, label: str, M: int, N: int) -> None:
    x, dy = mk.randn(M, N, scale=3.0), mk.randn(M, N)
    e = M * N * 2
    bench.case(
        label, f"{M}x{N} bf16", {"fwd": 2 * e, "fwd+bwd": 5 * e},
        {
            "kiln": softmax,
            "eager": eager_softmax,
            "torch.softmax": lambda x: torch.softmax(x, -1),
            "liger": liger(lambda x: LigerSoftmaxFunction.apply(x)),
            "compile": mk.compiled(eager_softmax),
        },
        [x], [dy],
    )  # fmt: skip
    bench.tune(
        f"{label}_fwd", {f"w{nw}": (lambda nw=nw: softmax_fwd(x, num_warps=nw)) for nw in (4, 8, 16, 32)}
    )


def bench_swiglu(bench: Bench, mk: Inputs, M: int, H: int, fused: bool) -> None:
    do = mk.randn(M, H)
    e = M * H * 2
    if fused:
        inputs = [mk.randn(M, 2 * H, scale=2.0)]
        impls = {
            "kiln": swiglu,
            "eager": eager_swiglu_fused,
            "liger": liger(lambda x: LigerFusedGateUpSiLUMulFunction.apply(x)),
            "compile": mk.compiled(eager_swiglu_fused),
        }
    else:
        inputs = [mk.randn(M, H, scale=2.0), mk.randn(M, H, scale=2.0)]
        impls = {
            "kiln": swiglu,
            "eager": eager_swiglu,
            "liger": liger(lambda g, u: LigerSiLUMulFunction.apply(g, u)),
            "compile": mk.compiled(eager_swiglu),
        }
    label = "swiglu_fused" if fused else "swiglu"
    bench.case(label, f"{M}x{H} bf16", {"fwd": 3 * e, "fwd+bwd": 8 * e}, impls, inputs, [do])
    if not fused:
        g, u = inputs
        bench.tune(
            "swiglu_fwd",
            {f"b{bl}_w{nw}": (lambda bl=bl, nw=nw: swiglu_fwd(g, u, bl, nw))
             for bl, nw in [(512, 2), (1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)]},
        )  # fmt: skip


def bench_rope(bench: Bench, mk: Inputs, B: int, T: int, Hq: int, Hk: int, D: int) -> None:
    # kiln takes q (B, T, Hq, D), k (B, T, Hk, D); the peers take (B, H, T, D) views of the same memory
    q, k = mk.randn(B, T, Hq, D), mk.randn(B, T, Hk, D)
    dq, dk = mk.randn(B, Hq, T, D).transpose(1, 2), mk.randn(B, Hk, T, D).transpose(1, 2)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=mk.device).float() / D))
    ang = torch.outer(torch.arange(T, device=mk.device).float(), inv)  # (T, D/2)
    cos, sin = ang.cos(), ang.sin()
    cos_full = torch.cat((cos, cos), -1).bfloat16()  # (T, D): HF's duplicated-halves table
    sin_full = torch.cat((sin, sin), -1).bfloat16()
    crope = mk.compiled(eager_rope)

    def as_bthd(f):  # peers compute on (B, H, T, D) views; hand back (B, T, H, D) views to compare
        return lambda q, k: tuple(t.transpose(1, 2) for t in f(q.transpose(1, 2), k.transpose(1, 2)))

    e = B * T * (Hq + Hk) * D * 2
    bench.case(
        "rope", f"B{B} T{T} Hq{Hq} Hk{Hk} D{D} bf16", {"fwd": 2 * e, "fwd+bwd": 4 * e},
        {
            "kiln": lambda q, k: apply_rope(q, k, cos, sin),
            "eager": as_bthd(lambda q, k: eager_rope(q, k, cos_full, sin_full)),
            "liger": liger(as_bthd(lambda q, k: LigerRopeFunction.apply(q, k, cos_full[None], sin_full[None]))),
            "compile": crope and as_bthd(lambda q, k: crope(q, k, cos_full, sin_full)),
        },
        [q, k], [dq, dk],
    )  # fmt: skip
    bench.tune(
        "rope_fwd",
        {"default": lambda: rope_launch(q, k, cos, sin, None, False)}
        | {f"t{n}_w{nw}": (lambda n=n, nw=nw: rope_launch(q, k, cos, sin, None, False, tokens=n, num_warps=nw))
           for n in (1, 2, 4) for nw in (1, 2, 4)},
    )  # fmt: skip


def bench_vector_add(bench: Bench, mk: Inputs, n: int) -> None:
    a, b = mk.randn(n, dtype=torch.float32), mk.randn(n, dtype=torch.float32)
    bench.case(
        "vector_add", f"{n} fp32", {"fwd": 3 * n * 4},
        {"kiln": vector_add, "torch.add": torch.add, "eager": lambda x, y: x + y},
        [a, b], [], modes=("fwd",),
    )  # fmt: skip
    bench.tune(
        "vector_add_fwd",
        {f"b{bl}_w{nw}": (lambda bl=bl, nw=nw: vector_add_launch(a, b, bl, nw))
         for bl, nw in [(1024, 4), (2048, 4), (4096, 8), (8192, 8)]},
    )  # fmt: skip


def run(bench: Bench, device: str, sizes: dict, only: set[str] | None = None) -> None:
    """Every case (or those named in `only`), the goal cases first: torch.compile peers are skipped
    once the time budget is spent."""
    mk = Inputs(device, bench.smoke)
    steps = {
        "rmsnorm": lambda: bench_rmsnorm(bench, mk, *sizes["norm"]),
        "swiglu": lambda: bench_swiglu(bench, mk, *sizes["swiglu"], fused=False),
        "rope": lambda: bench_rope(bench, mk, *sizes["rope"]),
        "layernorm": lambda: bench_layernorm(bench, mk, *sizes["norm"]),
        "softmax": lambda: bench_softmax(bench, mk, "softmax", *sizes["norm"]),
        "rmsnorm+residual": lambda: bench_rmsnorm_residual(bench, mk, *sizes["norm"]),
        "swiglu_fused": lambda: bench_swiglu(bench, mk, *sizes["swiglu"], fused=True),
        "softmax_online": lambda: bench_softmax(bench, mk, "softmax_online", *sizes["softmax_long"]),
        "vector_add": lambda: bench_vector_add(bench, mk, sizes["add"]),
    }
    unknown = (only or set()) - steps.keys()
    if unknown:
        raise SystemExit(f"unknown case(s) {sorted(unknown)}: choose from {', '.join(steps)}")
    for name, step in steps.items():
        if only and name not in only:
            continue
        try:
            step()
        except Exception as e:  # noqa: BLE001 - a broken case must not cost the others
            import traceback

            traceback.print_exc()
            bench.cases.append({"error": f"{type(e).__name__}: {str(e)[:300]}"})
        if device == "cuda":
            torch.cuda.empty_cache()


FULL = {"add": 2**28, "norm": (32768, 4096), "softmax_long": (4096, 151936), "swiglu": (32768, 8960),
        "rope": (8, 4096, 32, 8, 128)}  # fmt: skip
SMOKE = {
    "add": 3000,
    "norm": (8, 96),
    "softmax_long": (2, 20000),
    "swiglu": (4, 80),
    "rope": (1, 3, 4, 2, 16),
}


def pct(frac: float | None) -> str:
    return "-" if frac is None else f"{100 * frac:.0f}%"


def markdown_table(result: dict) -> str:
    """The README table of a result JSON: op, mode, kiln, best peer, ratio, percent of the copy; plus the
    CUDA-graph (GPU-only) ratio."""
    rows = [
        "| op | shape | mode | kiln TB/s (ms) | best peer TB/s (ms) | ratio | kiln % of copy | GPU-only ratio (CUDA graph) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        if "ratio" not in c:
            continue
        k, p = c["results"]["kiln"], c["results"][c["best_peer"]]
        graph = f"{c['graph_ratio']:.3f} vs {c['graph_best_peer']}" if "graph_ratio" in c else "n/a"
        rows.append(
            f"| {c['op']} | {c['shape']} | {c['mode']} | {k['TBps']:.2f} ({k['ms']:.3f}) | {c['best_peer']} "
            f"{p['TBps']:.2f} ({p['ms']:.3f}) | {c['ratio']:.3f} | {pct(k.get('frac_copy'))} | {graph} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("norms", __doc__)
    p.add_argument("--table", metavar="JSON", help="print the docs table of a result file and exit")
    p.add_argument("--only", default="", help="comma-separated cases to run (default: all)")
    p.add_argument(
        "--budget", type=float, default=110.0, help="seconds after which torch.compile peers are skipped"
    )
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table(read_json(args.table)))
        return 0
    run_ = BenchRun("norms", __file__, args)
    bench = Bench(run_.timer, run_.ceilings["copy_TBps"], args.budget)
    error = None
    with use_backend("triton"):
        try:
            run(
                bench,
                run_.device.type,
                SMOKE if args.smoke else FULL,
                set(filter(None, args.only.split(","))) or None,
            )
        except Exception as e:  # noqa: BLE001 - keep what was measured
            import traceback

            traceback.print_exc()
            error = f"{type(e).__name__}: {e}"
    run_.write(liger=LIGER, error=error, cases=bench.cases, tuning=bench.tuning)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
