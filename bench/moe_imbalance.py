"""MoE load imbalance on the H200 (issue 19): tokens per expert and time per expert under Zipf and balanced
routing, each expert's work timed alone with kiln's kernels, against the grouped layer's one launch per GEMM.

    python bench/moe_imbalance.py          # on a CUDA GPU (~1 min expected): bench/results/ gets
                                           # moe_imbalance.json and moe_imbalance.png
    python bench/moe_imbalance.py --smoke  # the smoke shapes on the CPU through the interpreter (~10 s)
    python bench/moe_imbalance.py --replot bench/results/moe_imbalance.json   # the PNG again (CPU)

For each shape of bench/moe.py (Mixtral-8x7B, Qwen3-30B-A3B-like, DeepSeek-V2-Lite-like; routed experts
only, DeepSeek's shared expert is the same dense work under any routing) at --tokens (4096) tokens, with
"balanced" and "zipf" routing (bench/moe.py's make_routing):
- tokens per expert: the routing's bincount (its (token, slot) pairs per expert);
- time per expert: expert e's rows, already in the expert-sorted order the kernels see (kiln's permute),
  through gate/up GEMM, SwiGLU and down GEMM for that expert alone: kiln's grouped_linear with offsets
  [0, n_e] (one expert, so mm_config picks its tiles for n_e rows) and kiln's swiglu. An empty expert's
  time is 0 (nothing launched). TFLOP/s per expert: 2 * n_e * (d * 2I + I * d) / time;
- the same work for all experts at once, one launch per GEMM ("grouped_gemms_us": what the per-expert
  sum compares with), and the whole kiln grouped layer ("grouped_layer_us": bench/moe.py's grouped path,
  routing plan, permute, GEMMs, SwiGLU, weighted combine);
- what imbalance costs: the layer at the largest expert's rate (all FLOPs / its TFLOP/s) and the balanced
  routing's grouped time beside the Zipf one ("zipf_vs_balanced_layer": > 1 is the cost).
Timing (GPU): every expert's work, the grouped GEMMs and the layer are each captured in a CUDA graph (GPU
time only: a small expert's work is shorter than the host's launches) and replayed after a read-only
512 MB L2 flush (as in a layer, where each expert's weights come from HBM), all interleaved over ROUNDS
rounds in a fresh random order, REPS replays a round, timed with CUDA events: the median of the
ROUNDS x REPS samples (kiln.profile.timing.flushed_graph_ms). --smoke: one perf_counter call each (the
numbers mean nothing; the script runs end to end).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from kiln.io.atomic import atomic_write_png
from kiln.kernels.dispatch import use_backend
from kiln.kernels.moe_gemm import grouped_linear
from kiln.kernels.moe_permute import permute, routing_plan
from kiln.kernels.swiglu import swiglu
from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser
from kiln.profile.timing import capture_graph, flushed_graph_ms
from moe import SHAPES, SMOKE_SHAPES, Bench, kiln_grouped_experts, layer_flops, make_routing

# the smoke run adds a 16-expert shape: 24 Zipf pairs over 16 experts leave some empty, the case to check
SMOKE = {**SMOKE_SHAPES, "tiny-16e": (16, 2, 32, 16, 0)}
ROUTINGS = ("balanced", "zipf")  # balanced first: the Zipf case quotes its time
ROUNDS, REPS = 4, 5  # 20 samples per figure; ~130 graphs (Qwen3-like) x 20 x ~0.2 ms each: well under 1 s


def expert_work(xs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """gate/up GEMM, SwiGLU, down GEMM over expert-sorted rows xs (R, d) with w1 (E, 2I, d), w2 (E, d, I):
    all experts in one launch per GEMM, or one expert when E == 1 and offsets == [0, R]."""
    return grouped_linear(swiglu(grouped_linear(xs, w1, offsets), None), w2, offsets)


def time_all(run: BenchRun, fns: dict) -> dict[str, float]:
    """{name: ms}: CUDA-graph replays after an L2 flush, interleaved (module docstring); on the CPU one
    perf_counter call each."""
    if run.smoke:
        return {name: run.timer.ms(fn) for name, fn in fns.items()}
    graphs = {name: capture_graph([fn], cuda=True) for name, fn in fns.items()}
    return flushed_graph_ms(graphs, rounds=ROUNDS, reps=REPS, cuda=True)


def imbalance_case(b: Bench, shape: str, tokens: int, routing: str, weights) -> dict:
    E, k, d, inter, _ = (SMOKE if b.smoke else SHAPES)[shape]
    w1, w2 = weights
    x = b.randn(tokens, d)
    idx, w = make_routing(tokens, E, k, routing, b.dev, b.gen)
    plan = routing_plan(idx, E)
    counts = torch.bincount(idx.reshape(-1), minlength=E).tolist()  # (E,) pairs per expert
    bounds = plan.offsets.tolist()  # (E + 1,) one host sync, outside the timing
    xs = permute(x, plan)  # (N*k, d) the rows as the grouped GEMMs see them, expert by expert
    fns = {
        "layer": lambda: kiln_grouped_experts(x, idx, w, w1, w2),
        "gemms": lambda: expert_work(xs, w1, w2, plan.offsets),
    }
    for e in range(E):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:  # an empty expert launches nothing: its time is 0
            offs = torch.tensor([0, hi - lo], dtype=torch.int32, device=b.dev)
            fns[e] = functools.partial(expert_work, xs[lo:hi], w1[e : e + 1], w2[e : e + 1], offs)
    ms = time_all(b.run, fns)
    us = [round(ms[e] * 1e3, 3) if e in ms else 0.0 for e in range(E)]
    tflops = [round(layer_flops(n, d, inter) / t / 1e6, 2) if t else None for n, t in zip(counts, us)]
    total = layer_flops(tokens * k, d, inter)
    gemms_us, layer_us = ms["gemms"] * 1e3, ms["layer"] * 1e3
    big = max(range(E), key=counts.__getitem__)  # the most rows: the fullest tiles, the rate to aim at
    entry = dict(
        shape=shape, routing=routing, tokens=tokens, E=E, k=k, d=d, I=inter,
        tokens_per_expert=counts, time_per_expert_us=us, TFLOPs_per_expert=tflops,
        max_over_mean_tokens=round(max(counts) * E / (tokens * k), 3), empty_experts=counts.count(0),
        sum_per_expert_us=round(sum(us), 3), grouped_gemms_us=round(gemms_us, 3),
        grouped_layer_us=round(layer_us, 3), grouped_gemms_TFLOPs=round(total / gemms_us / 1e6, 2),
        grouped_gemms_frac_matmul=fraction(total / gemms_us / 1e6, b.run.ceilings.get("bf16_matmul_TFLOPs")),
        largest_expert=big, largest_expert_TFLOPs=tflops[big],
        at_largest_expert_rate_us=round(total / tflops[big] / 1e6, 3) if tflops[big] else None,
        sum_over_grouped_gemms=round(sum(us) / gemms_us, 3),
    )  # fmt: skip
    b.run.log(f"{shape:<17} {routing:<8} max/mean {entry['max_over_mean_tokens']:<6} "
              f"empty {counts.count(0):<3} per-expert sum {sum(us):9.1f} us  "
              f"grouped GEMMs {gemms_us:9.1f} us  layer {layer_us:9.1f} us  "
              f"largest expert {tflops[big]} TFLOP/s")  # fmt: skip
    return entry


def expert_weights(b: Bench, E: int, d: int, inter: int):
    """gate_up_proj (E, 2I, d) and down_proj (E, d, I), as bench/moe.py's make_weights (no shared expert)."""
    return b.randn(E, 2 * inter, d, scale=d**-0.5), b.randn(E, d, inter, scale=inter**-0.5)


# ------------------------------------------------------------------------------------------------ the plot
def plot(path: Path, doc: dict) -> Path:
    """One row per shape: (a) tokens per expert and (b) time per expert, experts sorted by their token
    count (most first), Zipf as bars and balanced as a line; the sums and grouped times in (b)'s legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    cases = [c for c in doc["cases"] if "tokens_per_expert" in c]  # a failed case has an error instead
    shapes = list(dict.fromkeys(c["shape"] for c in cases))
    fig, axes = plt.subplots(len(shapes), 2, figsize=(14, 4.2 * max(len(shapes), 1)), squeeze=False)
    for row, shape in zip(axes, shapes):
        ax_n, ax_t = row
        mine = [c for c in cases if c["shape"] == shape]
        for c in mine:
            order = sorted(range(c["E"]), key=lambda e: -c["tokens_per_expert"][e])  # each routing its own
            xs = range(c["E"])
            n = [c["tokens_per_expert"][e] for e in order]
            t = [c["time_per_expert_us"][e] for e in order]
            label = (f"{c['routing']}: sum of experts {c['sum_per_expert_us']:,.0f} us\ngrouped GEMMs "
                     f"{c['grouped_gemms_us']:,.0f} us, layer {c['grouped_layer_us']:,.0f} us")  # fmt: skip
            if c.get("at_largest_expert_rate_us"):
                label += f"\nat the largest expert's rate {c['at_largest_expert_rate_us']:,.0f} us"
            if c["routing"] == "zipf":  # bars: the hot head and the long (or empty) tail
                ax_n.bar(xs, n, width=0.85, alpha=0.6, color="tab:red", label=c["routing"])
                ax_t.bar(xs, t, width=0.85, alpha=0.6, color="tab:red", label=label)
            else:
                kw = dict(drawstyle="steps-mid", linewidth=1.8, color="tab:blue")
                ax_n.plot(xs, n, label=c["routing"], **kw)
                ax_t.plot(xs, t, label=label, **kw)
        c = mine[-1]
        head = f"{shape}: {c['E']} experts, top-{c['k']}, d {c['d']}, I {c['I']}, {c['tokens']} tokens"
        cost = (
            f"; Zipf layer = {c['zipf_vs_balanced_layer']}x balanced" if "zipf_vs_balanced_layer" in c else ""
        )
        ax_n.set(title=f"{head}\n(a) tokens per expert", ylabel="tokens (routed pairs)")
        ax_t.set(title=f"(b) time per expert, its work alone (0: empty){cost}", ylabel="time per expert (us)")
        for ax in row:
            ax.set_xlabel("experts, sorted by their tokens (most first)")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
            ax.set_ylim(bottom=0)
    commit = (doc.get("commit") or "unknown")[:12]
    fig.suptitle(f"MoE load imbalance: {doc.get('gpu')}, commit {commit}, {doc.get('date', '')}", fontsize=11)
    fig.tight_layout()
    atomic_write_png(path, fig, dpi=110)
    return path


def replot(json_path: str) -> int:
    path = Path(json_path)
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--replot {path}: cannot read a result JSON ({e}); give the file "
                         "bench/moe_imbalance.py wrote") from None  # fmt: skip
    if doc.get("area") != "moe_imbalance":
        raise SystemExit(f"--replot {path}: not a bench/moe_imbalance.py result (area {doc.get('area')!r})")
    print(plot(path.with_suffix(".png"), doc))
    return 0


def main() -> int:
    ap = bench_parser("moe_imbalance", __doc__)
    ap.add_argument("--tokens", type=int, help="tokens per layer call (default 4096; 12 with --smoke)")
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG beside a result JSON from its figures "
                    "(no GPU; e.g. when a run's PNG did not come back) and exit")  # fmt: skip
    args = ap.parse_args()
    if args.replot:
        return replot(args.replot)
    run = BenchRun("moe_imbalance", __file__, args)
    b = Bench(run)
    tokens = args.tokens or (12 if b.smoke else 4096)
    cases = []
    with use_backend("triton"), torch.no_grad():  # the smoke run takes the kernels through the interpreter
        for shape, (E, _, d, inter, _) in (SMOKE if b.smoke else SHAPES).items():
            weights = expert_weights(b, E, d, inter)
            for routing in ROUTINGS:
                try:
                    cases.append(imbalance_case(b, shape, tokens, routing, weights))
                except Exception as e:  # noqa: BLE001 - record the case's failure and go on
                    cases.append(
                        dict(shape=shape, routing=routing, error=f"{type(e).__name__}: {str(e)[:300]}")
                    )
                    run.log(f"{shape} {routing} failed: {type(e).__name__}: {e}")
            bal, zipf = cases[-2].get("grouped_layer_us"), cases[-1].get("grouped_layer_us")
            if bal and zipf:  # > 1: what Zipf routing costs the layer against equal counts
                cases[-1].update(balanced_grouped_layer_us=bal, zipf_vs_balanced_layer=round(zipf / bal, 3))
            del weights
            if not b.smoke:
                torch.cuda.empty_cache()  # the graphs' pools: the next shape's weights need the room
    png = run.out.with_suffix(".png")
    path = run.write(
        tokens=tokens, routings=list(ROUTINGS), rounds=ROUNDS, reps=REPS, png=png.name, cases=cases,
        method=("one perf_counter call each (the interpreter: the times mean nothing)" if b.smoke else
                "CUDA-graph replays after a 512 MB L2 flush, CUDA events, median of rounds x reps")
        + "; per expert: its sorted rows through grouped_linear (offsets [0, n_e]), swiglu, grouped_linear",
    )  # fmt: skip
    doc = json.loads(path.read_text())
    try:  # the JSON is written first: a PNG that fails is redrawn later with --replot
        run.log(f"wrote {plot(png, doc)}")
    except Exception as e:  # noqa: BLE001
        run.log(f"the plot failed ({type(e).__name__}: {e}); redraw it with --replot {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
