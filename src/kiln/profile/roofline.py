"""`kiln profile roofline`: every op of the catalog (kiln.profile.ops) timed at its benchmark shape and
placed on the roofline of the measured ceilings (kiln.profile.ceilings).

For an op with F FLOPs and B bytes (the catalog's counting), timed at t seconds:
    arithmetic intensity  AI = F / B                                  (FLOP per byte)
    achieved rate         F / t  (and B / t)
    bound                 t_bound = max(F / peak[roof], B / bandwidth), i.e. the rate min(peak, AI * bw)
    % of bound            100 * t_bound / t
where bandwidth is the memory roof (the larger of the measured DRAM read and copy rates) and peak the
measured matmul rate of the op's roof dtype (the fp32 SIMT rate for elementwise ops). An op left of the
ridge point (peak / bandwidth) is bound by memory, right of it by compute.

Timing: kiln.profile.timing's do_bench median (L2 flushed before every call), one op after another.
On a CPU there is nothing to time: `--smoke` runs every op's call once, at tiny shapes, through Triton's
interpreter, and reports the counting with no rates (a check that the calls run; the CI tests use it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kiln.errors import KilnError


def bound_seconds(flops: float, nbytes: float, roof: str, values: dict) -> tuple[float | None, str | None]:
    """(the roofline's lower bound on the time, "memory" or "compute"), (None, None) without ceilings."""
    from kiln.profile.ceilings import memory_bandwidth, peak_flops

    bw, peak = memory_bandwidth(values), peak_flops(values, roof)
    if not bw or not peak:
        return None, None
    t_mem, t_flop = nbytes / bw, flops / peak
    return (t_mem, "memory") if t_mem >= t_flop else (t_flop, "compute")


def op_row(op, ms: float | None, values: dict) -> dict:
    """The table row of one op: its counting, its time and its place against the ceilings."""
    flops, nbytes = op.flops(), op.bytes()
    row = {"op": op.name, "shape": op.shape_str(), "dtype": op.dtype, "roof": op.roof,
           "GFLOP": round(flops / 1e9, 4), "MB": round(nbytes / 1e6, 3),
           "AI": round(flops / nbytes, 3) if nbytes else None, "ms": None if ms is None else round(ms, 5)}  # fmt: skip
    if ms:
        row["TFLOPs"] = round(flops / ms / 1e9, 3)
        row["TBps"] = round(nbytes / ms / 1e9, 3)
        t_bound, kind = bound_seconds(flops, nbytes, op.roof, values)
        if t_bound is not None:
            row["bound"] = kind
            row["pct_of_bound"] = round(100 * t_bound / (ms / 1e3), 1)
    return row


def plot_roofline(points: list[dict], values: dict, path: Path, title: str) -> Path:
    """Log-log roofline: points {"label", "AI", "TFLOPs"} over the memory roofs (read, copy) and the
    compute roofs (one per matmul dtype measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6.5))
    pts = [p for p in points if p.get("AI") and p.get("TFLOPs")]
    ais = [p["AI"] for p in pts] or [1.0]
    lo, hi = min(min(ais) / 3, 0.05), max(max(ais) * 3, 2000)
    xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    peaks = {k[7:-7]: v for k, v in values.items() if k.startswith("matmul_") and v}
    bws = {"DRAM read": values.get("dram_read_TBps"), "DRAM copy": values.get("dram_copy_TBps"),
           "L2 read": values.get("l2_read_TBps")}  # fmt: skip
    top = max(peaks.values(), default=None)
    for (name, bw), style in zip(bws.items(), ("-", "--", ":")):
        if bw and top:
            ax.plot(
                xs,
                [min(x * bw, top) for x in xs],
                style,
                color="black",
                lw=1.2,
                label=f"{name} {bw:.2f} TB/s",
            )
    for name, peak in sorted(peaks.items(), key=lambda kv: kv[1]):
        ax.axhline(peak, color="grey", lw=0.8, ls="-.")
        ax.text(hi, peak, f" {name} {peak:.0f}", va="center", fontsize=8)
    groups = list(dict.fromkeys(p.get("group") for p in pts if p.get("label") is None))
    for i, p in enumerate(pts):
        if p.get("label") is None:  # one unlabeled dot per kernel, coloured by its group (op)
            g = groups.index(p.get("group"))
            first = all(q.get("group") != p.get("group") for q in pts[:i] if q.get("label") is None)
            ax.scatter(p["AI"], p["TFLOPs"], s=12, zorder=3, color=f"C{g % 10}", marker="os^v"[g // 10 % 4],
                       label=p.get("group") if first else None)  # fmt: skip
            continue
        ax.scatter(p["AI"], p["TFLOPs"], s=30, zorder=3, color=f"C{i % 10}")
        # staggered offsets: ops at the same intensity (the big matmuls) do not print over each other
        ax.annotate(
            p["label"],
            (p["AI"], p["TFLOPs"]),
            fontsize=7,
            xytext=(3, 3 - 10 * (i % 3)),
            textcoords="offset points",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    if top or groups:
        ax.legend(loc="lower right", fontsize=7, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


COLUMNS = [("op", "op"), ("shape", "shape"), ("dtype", "dtype"), ("AI", "FLOP/B"), ("ms", "ms"),
           ("TFLOPs", "TFLOP/s"), ("TBps", "TB/s"), ("bound", "bound"), ("pct_of_bound", "% of bound")]  # fmt: skip


def run(names: list[str] | None, out: Path, smoke: bool, refresh: bool = False) -> dict:
    """Time the catalog's ops (or `names` of them), write roofline.json and roofline.png under `out`."""
    import torch

    from kiln.profile.ops import catalog
    from kiln.profile.provenance import provenance
    from kiln.profile.report import format_table, write_json
    from kiln.profile.timing import Timer

    ops = catalog(smoke)
    known = [op.name for op in ops]
    if names:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise KilnError(f"unknown op(s) {', '.join(unknown)}: choose from {', '.join(known)}")
        ops = [op for op in ops if op.name in names]
    if smoke:
        from kiln.kernels.dispatch import interpreting

        if not interpreting():
            raise KilnError(
                "kiln profile roofline --smoke runs the Triton kernels through the CPU interpreter: set "
                "TRITON_INTERPRET=1 in the environment before starting kiln"
            )
        device, values, ceil_doc = torch.device("cpu"), {}, None
    else:
        if not torch.cuda.is_available():
            raise KilnError(
                "kiln profile roofline times kernels on a CUDA GPU; on a CPU, `--smoke` (with "
                "TRITON_INTERPRET=1) runs every op's call once at tiny shapes and prints the counting"
            )
        from kiln.profile.ceilings import load_or_measure_ceilings

        device = torch.device("cuda")
        ceil_doc = load_or_measure_ceilings(device, refresh, log=print)
        values = ceil_doc["values"]
    timer = Timer(smoke=smoke, rep_ms=50)
    out.mkdir(parents=True, exist_ok=True)
    head = {
        **provenance(),
        "smoke": smoke,
        "ceilings": values,
        "ceilings_source": ceil_doc and ceil_doc["cache_path"],
    }
    rows, skipped = [], {}
    from kiln.kernels.dispatch import use_backend

    for op in ops:
        if op.roof == "fp8" and (smoke or torch.cuda.get_device_capability(device) < (8, 9)):
            skipped[op.name] = "FP8 needs a GPU of capability >= 8.9"
            continue
        fn = None
        with use_backend("triton" if smoke else "auto"):
            try:
                fn = op.build(device)
                ms = timer.ms(fn)
            except Exception as e:  # recorded with the op, the others still run
                skipped[op.name] = f"{type(e).__name__}: {e}"[:300]
                continue
            finally:
                del fn  # the op's inputs (up to GBs) go before the next op's
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        rows.append(op_row(op, None if smoke else ms, values))
        print(f"  {op.name}: {rows[-1].get('ms')} ms", flush=True)
        write_json(out / "roofline.json", {**head, "rows": rows, "skipped": skipped, "partial": True})
    print(format_table(rows, COLUMNS))
    for name, why in skipped.items():
        print(f"  skipped {name}: {why}")
    png = plot_roofline(
        [{"label": r["op"], "AI": r["AI"], "TFLOPs": r.get("TFLOPs")} for r in rows],
        values,
        out / "roofline.png",
        f"kiln kernels on the roofline ({provenance()['gpu']})",
    )
    doc = {**head, "rows": rows, "skipped": skipped, "png": str(png)}
    path = write_json(out / "roofline.json", doc)
    print(f"wrote {path} and {png}")
    return doc


def main(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.ops.split(",") if n.strip()] if args.ops else None
    run(names, Path(args.out), args.smoke, args.refresh)
    return 0
