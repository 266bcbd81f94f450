"""`kiln profile decode`: one engine decode step taken apart kernel by kernel.

    kiln profile decode --shape qwen2.5-1.5b --batch 64 --context 1024 --graphs on --out DIR
    kiln profile decode --shape qwen2.5-1.5b --quant int4-g128 --context 256 --out DIR

1. Build the engine (kiln.infer) on the model (random weights for --shape, or --model PATH; --quant
   quantizes it first, as `kiln quantize` does with round to nearest, and the quantized projections are
   counted at their packed bytes), with
   max_num_seqs = the graph bucket = --batch, and fill --batch sequences of random tokens to --context
   (prefill, then a few warm-up decode steps: greedy, every sequence decoding).
2. Run `--steps` engine steps under torch.profiler (CPU + CUDA activity), each inside a record_function
   range, with every module's forward named (kiln.profile.naming). With graphs on, first one eager run
   of the captured step function for the same bucket (DecodeGraphs._step) names the kernels the replay
   runs (kiln.profile.attribution.align). The Chrome trace is saved beside the results (gzipped).
3. The step of median wall time is attributed (kiln.profile.attribution): one row per kernel (layer, op,
   time, FLOPs and bytes from the op catalog's counting for that op at this batch and context (the op's
   longest kernel carries its counts, e.g. a split-K GEMV's sum kernel carries none), achieved bandwidth,
   % of its roofline bound, share of the step), then the host and idle rows. The attributed share (named
   kernels + the host/idle rows) and the remainder are printed.
4. Writes decode_<tag>.json (everything), .csv (per kernel), _ops.png (the step stacked by op) and
   _roofline.png (every kernel at its intensity), and prints a per-op summary, the top kernels and a
   summary paragraph: the step's time, the bandwidth floor (bytes of the step's ops / the measured memory
   roof) and what the gap is made of.

On a CPU the same command profiles the reference path: rows are module ranges (exclusive CPU time),
with the same FLOP/byte accounting and no roofline (the CI tests run it on a tiny model).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import math
import statistics
import time
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.profile import attribution as attr
from kiln.profile import ops as O

SHAPES = ("qwen2.5-1.5b",)  # the names `kiln profile decode --shape` takes (kiln.profile.cli)
PROMPT_MARGIN = 4  # decode steps before the profiled ones (the first token comes from the prefill)
STEP_TOKENS = 8192  # the engine's token budget per step (prefill chunks)


# ------------------------------------------------------------------------------------ model and engine
def shape_config(name: str, max_seq_len: int):
    """The ModelConfig of a named shape: qwen2.5-1.5b = HF Qwen/Qwen2.5-1.5B's config.json (d 1536, 28
    layers, 12/2 heads, head_dim 128, ffn 8960, vocab 151936, tie_word_embeddings true, qkv bias)."""
    from kiln.infer.bench import qwen2_1p5b_config

    if name != "qwen2.5-1.5b":
        raise KilnError(f"unknown --shape {name!r}: choose one of {', '.join(SHAPES)}")
    return qwen2_1p5b_config(max_seq_len)


def max_len(batch: int, context: int, steps: int) -> int:
    """Positions a sequence may reach: the context, the warm-up and profiled steps, and one token per
    prefill step (sequences that finish their prefill first decode while the others prefill)."""
    prefill_steps = math.ceil(batch * context / STEP_TOKENS) + 1
    return context + 2 * steps + 2 * PROMPT_MARGIN + prefill_steps  # steps timed, then profiled


def build_engine(model, batch: int, context: int, graphs: bool, steps: int):
    """An engine whose decode steps run `batch` sequences (one graph bucket of exactly `batch`)."""
    from kiln.infer.config import EngineConfig
    from kiln.infer.engine import LLMEngine

    device = next(model.parameters()).device
    max_len_ = max_len(batch, context, steps)
    bs = 16
    cfg = EngineConfig(
        device=str(device), dtype={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(model.head_weight.dtype, "fp32"),
        block_size=bs, num_blocks=batch * math.ceil(max_len_ / bs) + 4, max_num_seqs=batch,
        max_num_batched_tokens=max(STEP_TOKENS, batch), max_model_len=max_len_, enable_prefix_caching=False,
        decode_backend="graphs" if graphs else "eager", max_graph_batch=batch,
        # one step = one host range ending in its ids' copy (attribute_step relies on it): no overlap
        async_scheduling="off",
    )  # fmt: skip
    return LLMEngine(model, None, cfg, log=None)


def fill(engine, batch: int, context: int, steps: int, seed: int = 0) -> None:
    """Add `batch` greedy requests of random prompts and step until each has decoded PROMPT_MARGIN
    tokens; the profiled steps then see a context of about `context` keys."""
    from kiln.infer.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompt_len = max(1, context - PROMPT_MARGIN)
    # no sequence may finish before the profiled steps end: the batch would shrink under them
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        ids = torch.randint(0, engine.vocab_size, (prompt_len,), generator=g).tolist()
        engine.add_request(ids, params)
    seqs = [s for r in engine.requests.values() for s in r.seqs]
    for _ in range(100000):
        if all(s.num_output_tokens >= PROMPT_MARGIN for s in seqs):
            return
        engine.step()
    raise KilnError("the engine did not reach the decode phase (a scheduling problem, not a profiling one)")


# ------------------------------------------------------------------------------------------ accounting
def accounting(model, batch: int, context: int, block_size: int = 16):
    """(layer, op, scope) -> (flops, bytes, roof) of that op at this step's shape, or None (not counted)."""
    cfg = model.config
    dt = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(model.head_weight.dtype, "fp32")
    B, d, V = batch, cfg.d_model, cfg.vocab_size
    Hq, Hk, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    modules = dict(model.named_modules())
    rope = O.RoPE("rope", tokens=B, heads_q=Hq, heads_k=Hk, head_dim=D, dtype=dt)
    kvw = O.PagedKVWrite("kv_write", tokens=B, kv_heads=Hk, head_dim=D, dtype=dt)
    att = O.DecodeAttention("attention", batch=B, context=context, heads=Hq, kv_heads=Hk, head_dim=D,
                            block_size=block_size, dtype=dt)  # fmt: skip
    swi = O.SwiGLU("swiglu", rows=B, hidden=cfg.ffn_hidden, dtype=dt)

    def count(*ops_):
        return sum(o.flops() for o in ops_), sum(o.bytes() for o in ops_), ops_[0].roof

    def fn(layer: str, op: str, scope: str | None):
        if op == "embed":
            return count(O.Embedding("embed", rows=B, d=d, dtype=dt))
        if op == "norm":
            residual = not (scope or "").endswith("layers.0.input_layernorm")
            return count(O.RMSNorm("norm", rows=B, cols=d, residual=residual, dtype=dt))
        if op == "lm_head":  # a quantized head is a QuantLinear module (Transformer.quantized_head); a float
            # head is the tied embedding or an nn.Linear: (V, d) in the model's dtype either way
            head = linear_op("lm_head", modules.get("lm_head"), B, dt)
            return count(head or O.Linear("lm_head", m=B, n=V, k=d, dtype=dt))
        if op == "argmax":
            return count(O.Argmax("argmax", rows=B, vocab=V, dtype=dt))
        if op in ("rope", "kv_write", "attention", "swiglu"):
            return count({"rope": rope, "kv_write": kvw, "attention": att, "swiglu": swi}[op])
        if op == "self_attn":  # the CPU's module range: rope, cache write and attention together
            return count(rope, kvw, att)
        if op == "mlp" and cfg.arch != "gpt2" and not cfg.n_experts:
            return count(swi)
        m = modules.get(scope or "")
        if op in ("qkv_proj", "gate_up_proj") and linear_op(op, m, B, dt) is None:
            # a projection launched by its parent with its neighbours in its epilogue: the fused q/k/v + RoPE +
            # K/V write kernel (kiln.kernels.rope.qkv_rope) in the attention's range, gate_up with the SwiGLU
            # (MergedLinear.swiglu_decode, QuantLinear.swiglu_decode) in the MLP's
            linear = linear_op(op, modules.get(f"{scope}.{op}"), B, dt)
            if linear is not None:
                return count(linear, rope, kvw) if op == "qkv_proj" else count(linear, swi)
        linear = linear_op(op, m, B, dt)
        return count(linear) if linear is not None else None

    return fn


def linear_op(name: str, m, rows: int, dt: str) -> O.Op | None:
    """The catalog op of linear module m at `rows` rows: a float Linear, or a QuantLinear's int8 / int4 (its
    packed weight, scales and zero points) or FP8 weight; None if m is not a linear."""
    from kiln.model.linear import Linear
    from kiln.model.quant_linear import QuantLinear

    if isinstance(m, QuantLinear):
        n, k = m.out_features, m.in_features
        if m.kind == "fp8":
            return O.FP8Linear(name, m=rows, n=n, k=k, dtype=dt)
        return O.QuantLinear(name, m=rows, n=n, k=k, bits=m.bits, group=m.group_size if m.bits == 4 else 128,
                             zeros=m.asymmetric, bias=m.bias is not None, dtype=dt)  # fmt: skip
    if isinstance(m, Linear):
        return O.Linear(name, m=rows, n=m.out_features, k=m.in_features, bias=m.bias is not None, dtype=dt)
    return None


def weight_and_kv_bytes(model, batch: int, context: int) -> tuple[int, int]:
    """(bytes of the weights, each tensor once (parameters, and a quantized model's packed weights, scales
    and zero points, which are buffers), bytes of the K and V a step reads)."""
    cfg = model.config
    w = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    kv = 2 * cfg.n_layers * batch * context * cfg.n_kv_heads * cfg.head_dim * model.head_weight.element_size()
    return w, kv


# ------------------------------------------------------------------------------------------- profiling
def profile_steps(engine, model, steps: int, trace_path: Path) -> tuple[list[dict], dict]:
    """Run `steps` engine steps (and, with graphs, one named eager reference) under torch.profiler;
    returns the trace's events and {"bucket"}."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from kiln.profile.naming import module_scopes

    cuda = engine.device.type == "cuda"
    graphs = engine.runner.graphs if cuda else None
    batch = sum(1 for r in engine.requests.values() for s in r.seqs if not s.is_finished)
    bucket = graphs.bucket(batch) if graphs is not None else None
    # the same number of steps without the profiler first: its own host cost per op is in the profiled ones
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()  # ends with the sampled ids' copy to the host: a sync
        walls.append((time.perf_counter() - t) * 1e6)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof, module_scopes(model):
        if bucket is not None:
            torch.cuda.synchronize()
            with record_function(attr.REFERENCE), torch.inference_mode():
                graphs._step(bucket)  # the captured function, eagerly: the same kernels, named
                torch.cuda.synchronize()  # inside the range: its kernels all lie within it
        for _ in range(steps):
            with record_function(attr.STEP):
                engine.step()
        if cuda:
            torch.cuda.synchronize()
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    raw = trace_path.with_name(f".{trace_path.name}.tmp.json")
    prof.export_chrome_trace(str(raw))
    events = attr.load_trace(raw)
    # kept gzipped (Perfetto and chrome://tracing open .json.gz): the trace of an eager step is MBs
    with gzip.open(trace_path, "wb") as f:
        f.write(raw.read_bytes())
    raw.unlink()
    info = {
        "bucket": bucket,
        "graphs": graphs is not None,
        "unprofiled_step_us": round(statistics.median(walls), 2),
    }
    return events, info


def attribute_step(events: list[dict], cuda: bool, graphs: bool) -> dict:
    """The median step's rows (see kiln.profile.attribution) and the other steps' wall times."""
    steps = attr.ranges(events, attr.STEP)
    if not steps:
        raise KilnError("the profile holds no step range: the profiler recorded nothing")
    walls = []
    for s in steps:
        t0, t1 = float(s["ts"]), float(s["ts"]) + float(s["dur"])
        if cuda:
            acts = attr.gpu_activities(events, t0, t1 + 1e6)
            acts = [a for a in acts if a.ts <= t1]  # launched by this step (its host range ends after a sync)
            t1 = max([t1] + [a.end for a in acts])
        walls.append(t1 - t0)
    pick = sorted(range(len(steps)), key=lambda i: walls[i])[len(steps) // 2]
    s = steps[pick]
    t0 = float(s["ts"])
    t1 = t0 + walls[pick]
    info: dict = {"step_walls_us": [round(w, 2) for w in walls], "picked": pick}
    if not cuda:
        rows, other = attr.cpu_rows(events, s)
        return {"rows": rows, "other": other, "wall_us": walls[pick], **info}
    acts = attr.gpu_activities(events, t0, t1)
    attr.name_by_launch(events, acts)
    if graphs:
        refs = attr.ranges(events, attr.REFERENCE)
        if not refs:
            raise KilnError("graphs on, but the profile holds no reference run to name the replay's kernels")
        r0, r1 = float(refs[0]["ts"]), float(refs[0]["ts"]) + float(refs[0]["dur"])
        ref = attr.gpu_activities(events, r0, r1 + 1e6)
        ref = [a for a in ref if a.ts <= r1 and a.cat == "kernel"]
        attr.name_by_launch(events, ref)
        for a in acts:
            if a.cat == "kernel":  # one graph launch carries them all: named by alignment only
                a.scope, a.named = None, False
        info["alignment"] = attr.align(acts, ref)
    rows, other = attr.gpu_rows(acts, t0, t1)
    return {"rows": rows, "other": other, "wall_us": t1 - t0, **info}


def fill_counts(rows: list[dict], count, values: dict) -> None:
    """Add flops, bytes, TB/s and % of bound to the rows: the op's counts go to its longest kernel."""
    from kiln.profile.roofline import bound_seconds

    groups: dict = {}
    for r in rows:
        if r["layer"] in ("?", "io"):
            continue
        # one op instance: its module range and op (a layer's two norms are two instances; a split-K
        # GEMV's two kernels, or decode attention's split and reduce kernels, are one)
        groups.setdefault((r["layer"], r["op"], r["scope"]), []).append(r)
    for (layer, op, _), rs in groups.items():
        main = max(rs, key=lambda r: r["us"])
        c = count(layer, op, main["scope"])
        if c is None:
            continue
        flops, nbytes, roof = c
        main.update(flops=flops, bytes=nbytes, roof=roof)
        if main["us"] > 0:
            main["GBps"] = round(nbytes / main["us"] / 1e3, 2)
            t_bound, kind = bound_seconds(flops, nbytes, roof, values)
            if t_bound is not None:
                main["bound_us"] = round(t_bound * 1e6, 3)
                main["pct_of_bound"] = round(100 * t_bound * 1e6 / main["us"], 1)


def op_summary(rows: list[dict], other: list[dict], wall: float) -> list[dict]:
    """Per op: kernels, time, share of the step, bytes, achieved GB/s, % of the bound (sum of bounds /
    sum of times), then the host/idle rows."""
    by: dict = {}
    for r in rows:
        g = by.setdefault(
            r["op"], {"op": r["op"], "kernels": 0, "us": 0.0, "bytes": 0, "flops": 0, "bound_us": 0.0}
        )
        g["kernels"] += 1
        g["us"] += r["us"]
        g["bytes"] += r.get("bytes") or 0
        g["flops"] += r.get("flops") or 0
        g["bound_us"] += r.get("bound_us") or 0.0
    out = sorted(by.values(), key=lambda g: -g["us"])
    for g in out:
        g["share_pct"] = round(100 * g["us"] / wall, 2)
        g["GBps"] = round(g["bytes"] / g["us"] / 1e3, 1) if g["us"] and g["bytes"] else None
        g["pct_of_bound"] = round(100 * g["bound_us"] / g["us"], 1) if g["us"] and g["bound_us"] else None
        g["us"] = round(g["us"], 2)
        g["bound_us"] = round(g["bound_us"], 2) or None
    for o in other:
        out.append(
            {"op": o["op"], "kernels": None, "us": o["us"], "share_pct": round(100 * o["us"] / wall, 2)}
        )
    return out


def summary_text(res: dict) -> str:
    """The computed paragraph: the step, the floor, and what the gap is made of."""
    wall, floor = res["wall_us"], res.get("floor_us")
    kern = res["kernel_us"]
    parts = [f"The step takes {wall:.1f} us ({res['device']}, batch {res['batch']}, context {res['context']}, "
             f"graphs {'on' if res['graphs'] else 'off'})."]  # fmt: skip
    if floor:
        parts.append(
            f"The bandwidth floor is {floor:.1f} us ({res['step_bytes'] / 1e9:.3f} GB moved by the step's ops, "
            f"of which weights {res['weight_bytes'] / 1e9:.3f} GB and K/V {res['kv_bytes'] / 1e9:.3f} GB, at "
            f"{res['memory_TBps']:.2f} TB/s): the step runs at {100 * floor / wall:.1f}% of it."
        )
        gap = wall - floor
        excess = sorted(
            ((g["op"], g["us"] - (g.get("bound_us") or 0.0)) for g in res["ops"] if g.get("kernels")),
            key=lambda kv: -kv[1],
        )
        top = ", ".join(f"{op} {us:.1f} us" for op, us in excess[:4] if us > 0)
        other = {o["op"]: o["us"] for o in res["other"]}
        parts.append(
            f"The {gap:.1f} us gap is made of: kernels running above their own bound "
            f"{kern - res['kernel_bound_us']:.1f} us (most in {top}); idle gaps between GPU work "
            f"{other.get('idle gaps between GPU work', 0):.1f} us; host time before the first GPU work "
            f"{other.get('host before first GPU work', 0):.1f} us and after the last "
            f"{other.get('host after last GPU work', 0):.1f} us."
        )
    else:
        parts.append(f"Module ranges take {kern:.1f} us of it (CPU reference path: no roofline).")
    parts.append(
        f"Attributed: {res['attributed_pct']:.1f}% of the step (remainder {res['remainder_us']:.1f} us). "
        f"Without the profiler the same step takes {res['unprofiled_step_us']:.1f} us (median of "
        f"{res['steps_profiled']} steps, host clock)."
    )
    return " ".join(parts)


ROW_COLS = [("idx", "#"), ("layer", "layer"), ("op", "op"), ("kernel", "kernel"), ("us", "us"),
            ("share_pct", "% step"), ("GBps", "GB/s"), ("pct_of_bound", "% bound")]  # fmt: skip
OP_COLS = [("op", "op"), ("kernels", "kernels"), ("us", "us"), ("share_pct", "% step"), ("GBps", "GB/s"),
           ("pct_of_bound", "% bound")]  # fmt: skip


def plot_ops(res: dict, path: Path) -> Path:
    """One horizontal bar, the step, stacked by op (kernels) and the host/idle rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 2.8))
    left = 0.0
    for i, g in enumerate(res["ops"]):
        ax.barh([0], [g["us"]], left=left, color=f"C{i % 10}" if g.get("kernels") else "lightgrey",
                hatch=None if g.get("kernels") else "//", edgecolor="white", label=f"{g['op']} {g['us']:.0f} us")  # fmt: skip
        left += g["us"]
    ax.set_yticks([])
    ax.set_xlabel("us")
    ax.set_title(res["title"], fontsize=9)
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_configs(results: list[dict], path: Path) -> Path:
    """One bar per configuration, stacked by op as a share of its step (the step's time in the label),
    one colour per op across the bars: how the composition moves with batch and graphs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(g["op"] for r in results for g in r["ops"]))
    fig, ax = plt.subplots(figsize=(12, max(3.0, 1.5 + 0.6 * len(results))))
    labels = [
        f"b{r['batch']} graphs {'on' if r['graphs'] else 'off'}: {r['wall_us']:.0f} us" for r in results
    ]
    for i, op in enumerate(ops):
        shares = [next((g["share_pct"] for g in r["ops"] if g["op"] == op), 0.0) for r in results]
        lefts = [
            sum(next((g["share_pct"] for g in r["ops"] if g["op"] == o), 0.0) for o in ops[:i])
            for r in results
        ]
        host = any(g["op"] == op and not g.get("kernels") for r in results for g in r["ops"])
        ax.barh(labels, shares, left=lefts, color=plt.get_cmap("tab20")(i % 20), hatch="//" if host else None,
                edgecolor="white", label=op)  # fmt: skip
    ax.set_xlabel("% of the step")
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.set_title(
        f"{results[0]['model']} decode step by op, context {results[0]['context']} ({results[0]['device']})"
    )
    ax.legend(ncol=2 if len(ops) > 12 else 1, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def write_csv(rows: list[dict], path: Path) -> Path:
    keys = ["idx", "layer", "op", "scope", "kernel", "cat", "start_us", "us", "dur_us", "share_pct", "flops", "bytes",
            "GBps", "roof", "bound_us", "pct_of_bound"]  # fmt: skip
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    tmp.replace(path)
    return path


def run(
    model, name: str, batch: int, context: int, graphs: bool, out: Path, steps: int = 5, refresh: bool = False
) -> dict:
    """Profile and attribute one decode step of `model` (see the module doc); returns the result."""
    from kiln.profile.provenance import provenance
    from kiln.profile.report import format_table, write_json

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    if batch < 1 or context < 2:
        raise KilnError(f"--batch must be >= 1 and --context >= 2, got {batch} and {context}")
    values, ceil_src = {}, None
    if cuda:
        from kiln.profile.ceilings import load_or_measure_ceilings, memory_bandwidth

        doc = load_or_measure_ceilings(device, refresh, log=print)
        values, ceil_src = doc["values"], doc["cache_path"]
    tag = f"{name}_b{batch}_c{context}_graphs{'on' if graphs else 'off'}"
    engine = build_engine(model, batch, context, graphs, steps)
    fill(engine, batch, context, steps)
    events, info = profile_steps(engine, model, steps, out / f"trace_{tag}.json.gz")
    block_size = engine.config.block_size
    del engine  # its KV cache and graphs go before the next configuration is built
    res = attribute_step(events, cuda, info["graphs"])
    wall = res["wall_us"]
    ctx = context  # keys at the first profiled step (prompt + decoded tokens); later ones have a few more
    rows_batch = info["bucket"] or batch
    count = accounting(model, rows_batch, ctx, block_size)
    rows, other = res["rows"], res["other"]
    fill_counts(rows, count, values)
    for r in rows:
        r["share_pct"] = round(100 * r["us"] / wall, 2)
    named_us = sum(r["us"] for r in rows if r["layer"] != "?")
    other_us = sum(o["us"] for o in other)
    kernel_us = sum(r["us"] for r in rows)
    remainder = wall - kernel_us - other_us
    unattributed = sum(r["us"] for r in rows if r["layer"] == "?")
    for r in (*rows, *other):  # the sums above from exact times; the rows report them to 0.001 us
        r["us"] = round(r["us"], 3)
    w_bytes, kv_bytes = weight_and_kv_bytes(model, rows_batch, ctx)
    step_bytes = sum(r.get("bytes") or 0 for r in rows)
    bw = memory_bandwidth(values) if cuda else None
    result = {
        **provenance(), "model": name, "device": provenance()["gpu"], "batch": batch, "bucket": info["bucket"],
        "context": ctx, "graphs": info["graphs"], "steps_profiled": steps, "wall_us": round(wall, 2),
        "kernel_us": round(kernel_us, 2), "kernel_bound_us": round(sum(r.get("bound_us") or 0 for r in rows), 2),
        "attributed_pct": round(100 * (named_us + other_us) / wall, 2),
        "unattributed_us": round(unattributed, 2), "remainder_us": round(remainder + unattributed, 2),
        "weight_bytes": w_bytes, "kv_bytes": kv_bytes, "step_bytes": step_bytes,
        "memory_TBps": bw / 1e12 if bw else None, "floor_us": round(step_bytes / bw * 1e6, 2) if bw else None,
        "ceilings": values, "ceilings_source": ceil_src,
        "step_walls_us": res["step_walls_us"], "unprofiled_step_us": info["unprofiled_step_us"],
        "alignment": res.get("alignment"),
        "title": f"{name} decode step, batch {batch}, context {ctx}, graphs {'on' if graphs else 'off'} "
                 f"({provenance()['gpu']})",
        "other": other,
    }  # fmt: skip
    result["ops"] = op_summary(rows, other, wall)
    result["summary"] = summary_text(result)
    result["rows"] = rows
    out.mkdir(parents=True, exist_ok=True)
    print(format_table(result["ops"], OP_COLS))
    top = sorted(rows, key=lambda r: -r["us"])[:15]
    # cuBLAS kernel names run to 200 characters: the terminal gets their start, the CSV/JSON all of it
    print(format_table([{**r, "kernel": r["kernel"][:60]} for r in top], ROW_COLS))
    print(result["summary"])
    result["csv"] = str(write_csv(rows, out / f"decode_{tag}.csv"))
    result["ops_png"] = str(plot_ops(result, out / f"decode_{tag}_ops.png"))
    if cuda:
        from kiln.profile.roofline import plot_roofline

        pts = [{"label": None, "group": r["op"], "AI": r["flops"] / r["bytes"] if r.get("bytes") else None,
                "TFLOPs": r["flops"] / r["us"] / 1e6 if r.get("flops") else None} for r in rows]  # fmt: skip
        result["roofline_png"] = str(
            plot_roofline(pts, values, out / f"decode_{tag}_roofline.png", result["title"])
        )
    path = write_json(out / f"decode_{tag}.json", result)
    print(f"wrote {path}, {result['csv']}, {result['ops_png']}")
    return result


# ------------------------------------------------------------------------------------------------- CLI
def _int_list(text: str, flag: str) -> list[int]:
    try:
        vals = [int(t) for t in str(text).split(",") if t.strip()]
    except ValueError:
        raise KilnError(f"{flag} takes integers separated by commas, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise KilnError(f"{flag} takes positive integers, got {text!r}")
    return vals


def quant_scheme(name: str | None):
    """--quant's QuantScheme (None without it); a bad name is a KilnError naming the schemes."""
    if not name:
        return None
    from kiln.quant import QuantScheme

    return QuantScheme.parse(name)


def quantize_for_profile(model, scheme, name: str) -> str:
    """Quantize `model` in place with `scheme` (round to nearest: the weights are random or already
    trained, and the step's kernels, not the quality, are what is profiled); returns the profile's name
    with the scheme's. A model that is already quantized is an error (its scheme is the checkpoint's)."""
    from kiln.model.quant_linear import QuantLinear
    from kiln.quant import quantize_model

    if any(isinstance(m, QuantLinear) for m in model.modules()):
        raise KilnError(f"--quant {scheme.name}: the model is already quantized; profile it without --quant")
    quantize_model(model, scheme)
    return f"{name}-{scheme.name}"


def main(args: argparse.Namespace) -> int:
    """Every (batch, graphs) combination of the comma lists, on one model built once; each writes its
    own files, and decode_summary.md gathers the per-op tables and paragraphs."""
    import gc

    from kiln.profile.report import format_table

    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise KilnError("--device cuda: CUDA is not available on this machine: use --device cpu")
    if args.steps < 1:
        raise KilnError(f"--steps must be >= 1, got {args.steps}")
    if args.context < 2:
        raise KilnError(f"--context must be >= 2, got {args.context}")
    scheme = quant_scheme(args.quant)
    batches = _int_list(args.batch, "--batch")
    modes = [m.strip() for m in str(args.graphs).split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        raise KilnError(f"--graphs takes on, off or on,off, got {args.graphs!r}")
    cuda = device.type == "cuda"
    if not cuda and "on" in modes:
        print("kiln profile decode: no CUDA graphs on a CPU: the eager reference path is profiled")
        modes = ["off"]
    dtype = torch.bfloat16 if cuda else torch.float32
    n_pos = max(max_len(b, args.context, args.steps) for b in batches)
    if args.shape:
        from kiln.model.transformer import build_model

        model = build_model(shape_config(args.shape, n_pos), device=device, dtype=dtype)
        name = args.shape
    else:
        from kiln.infer.loading import load_for_inference

        model, _ = load_for_inference(args.model, device, dtype)
        name = Path(args.model).resolve().name
        if model.config.max_seq_len < n_pos:
            raise KilnError(
                f"--context {args.context} needs {n_pos} positions; the model has {model.config.max_seq_len}: "
                "lower --context"
            )
    if scheme is not None:
        name = quantize_for_profile(model, scheme, name)
    out = Path(args.out)
    lines, results = [], []
    for b in batches:
        for mode in modes:
            res = run(model, name, b, args.context, mode == "on", out, args.steps, args.refresh)
            lines += [f"## {res['title']}", "", format_table(res["ops"], OP_COLS), "", res["summary"], ""]
            _write_text(out / "decode_summary.md", "\n".join(lines))  # after each: a timeout keeps the rest
            results.append(
                {k: res[k] for k in ("model", "batch", "graphs", "wall_us", "context", "device", "ops")}
            )
            del res
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    png = plot_configs(results, out / "decode_configs.png")
    print(f"wrote {out / 'decode_summary.md'} and {png}")
    return 0


def _write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
