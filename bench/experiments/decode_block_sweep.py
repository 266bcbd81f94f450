"""Experiment: the decoder's layers at one token, each block as one kernel (kiln.kernels.decode_block) against
its separate kernels, and the fused kernel's K-loop tiles, as CUDA-graph replays side by side.

    python bench/experiments/decode_block_sweep.py --out /tmp/decode_block_sweep.json   # H200, ~1 min
    python bench/experiments/decode_block_sweep.py --smoke                              # CPU: the plumbing

One random-init Qwen2.5-1.5B-shape model (bf16, kiln's kernels), one sequence with --contexts keys cached in
a paged cache (16-token pages, scattered, a table sized for --capacity tokens). Per context, one graph per
variant of `model.model(...)` (embedding, the 28 blocks, the final norm; no head, no sampling): "separate"
(KILN_DECODE_BLOCK unset) and "fused T/S/W/M/R" for each tile T in --tiles, K-loop depth S in
--stages, W warps with M programs an SM in --shapes and R in --preload (1: each weight phase's first tile
loaded before the barrier ahead of it). The graphs
are replayed --replays times back to back in --rounds interleaved rounds (order reversed every round;
median). Bytes per step: the blocks' weights and the K/V read, against the copy bandwidth measured in the
run. Agreement: each variant's final hidden state against the separate form's (max abs difference, beside
that output's std). --timeline takes fused variants apart phase by phase (the kernel's timer probe).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import statistics

import torch

from kiln.infer import bench
from kiln.kernels import decode_block as block_kernel
from kiln.kernels.dispatch import use_backend
from kiln.model import config as model_config
from kiln.model.attn_metadata import AttnMetadata
from kiln.model.config import KernelConfig, ModelConfig
from kiln.model.transformer import build_model
from kiln.profile.harness import BenchRun, bench_parser, format_table

PAGE = 16


def step_inputs(cfg: ModelConfig, n: int, capacity: int, device, dtype):
    """tokens, positions, meta and per-layer caches of a one-token decode step after n - 1 cached keys."""
    g = torch.Generator().manual_seed(n)
    width = -(-capacity // PAGE)
    table = torch.randperm(width, generator=g)[None].to(torch.int32)
    caches = [
        tuple(
            (torch.randn(width, PAGE, cfg.n_kv_heads, cfg.head_dim, generator=g) * 0.5).to(device, dtype)
            for _ in range(2)
        )
        for _ in range(cfg.n_layers)
    ]
    pos = n - 1
    meta = AttnMetadata(
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=device),
        max_seqlen_q=1,
        slot_mapping=torch.tensor([int(table[0, pos // PAGE]) * PAGE + pos % PAGE], device=device),
        block_tables=table.to(device),
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        decode=True,
    )
    tokens = torch.randint(0, cfg.vocab_size, (1,), generator=g).to(device)
    return tokens, torch.tensor([pos], device=device), meta, caches


def set_variant(name: str) -> None:
    """KILN_DECODE_BLOCK and the fused kernel's knobs for variant `name`: "separate", or "fused T/S/W/M/R"
    (tile, stages, warps, programs an SM, preload)."""
    if name == "separate":
        os.environ.pop("KILN_DECODE_BLOCK", None)
    else:
        os.environ["KILN_DECODE_BLOCK"] = "fused"
        tile, stages, warps, per_sm, preload = (int(x) for x in name.split()[1].split("/"))
        block_kernel.TILE, block_kernel.STAGES = tile, stages
        block_kernel.WARPS, block_kernel.PER_SM, block_kernel.PRELOAD_TILES = warps, per_sm, bool(preload)
    model_config.decode_block.cache_clear()


PHASE_NAMES = ("qkv", "attention", "o", "gate_up", "down")


def timeline(model, tokens, pos, meta, caches, variant: str, replays: int = 5) -> dict:
    """Where a fused step's time goes: the layers' kernels captured in one CUDA graph with the timeline probe
    on (Block.forward_fused(timeline=...)), replayed; per phase the median over layers and replays of its span (first
    program in to last out), the slowest and the median program's work, and the barrier after it (last
    arrival to the median release); the launch gap between layers; a layer's whole time."""
    set_variant(variant)
    dec = model.model
    L, dev = len(dec.layers), tokens.device
    P = block_kernel.block_programs(dev)
    times = torch.zeros(L, P, block_kernel.STAMPS, dtype=torch.int64, device=dev)

    def layers():
        h = dec.embed_tokens(tokens)
        rope = dec.rope(pos[None])
        for i, layer in enumerate(dec.layers):
            h = layer.forward_fused(h, rope, meta, caches[i], timeline=times[i])

    with torch.no_grad():
        layers()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layers()
    runs = []
    for _ in range(replays):
        g.replay()
        torch.cuda.synchronize()
        runs.append(times.double().cpu() / 1000.0)  # us
    med = statistics.median
    out = {"variant": variant, "programs": P}
    for k, name in enumerate(PHASE_NAMES):
        start, end = 2 * k, 2 * k + 1
        span, slow, typical, barrier = [], [], [], []
        for t in runs:
            for lt in t:
                work = lt[:, end] - lt[:, start]
                span.append(float(lt[:, end].max() - lt[:, start].min()))
                slow.append(float(work.max()))
                typical.append(float(work.median()))
                if k + 1 < len(PHASE_NAMES):
                    barrier.append(float(lt[:, end + 1].median() - lt[:, end].max()))
        out[name] = {"span_us": round(med(span), 2), "slowest_us": round(med(slow), 2),
                     "median_us": round(med(typical), 2),
                     "barrier_after_us": round(med(barrier), 2) if barrier else None}  # fmt: skip
    gaps = [float(t[i + 1][:, 0].min() - t[i][:, 9].max()) for t in runs for i in range(L - 1)]
    whole = [float(lt[:, 9].max() - lt[:, 0].min()) for t in runs for lt in t]
    out["gap_between_layers_us"] = round(med(gaps), 2)
    out["layer_us"] = round(med(whole), 2)
    return out


def main() -> int:
    ap = bench_parser("decode_block_sweep", __doc__)
    ap.add_argument("--contexts", default="384,1100")
    ap.add_argument("--capacity", type=int, default=4096)
    ap.add_argument("--tiles", default="8192,16384")
    ap.add_argument("--stages", default="4")
    ap.add_argument("--shapes", default="4/2,8/1", help="warps/programs an SM, comma-separated")
    ap.add_argument("--preload", default="1", help="1: each weight phase's first tile before its barrier")
    ap.add_argument("--timeline", default="", help="fused variants (T/S/W/M/R) to take apart phase by phase")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    run = BenchRun("decode_block_sweep", __file__, args)
    dev, log = run.device, run.log
    cuda = dev.type == "cuda"
    if run.smoke:
        cfg = ModelConfig(arch="qwen2", qkv_bias=True, vocab_size=256, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=2, ffn_hidden=64, max_seq_len=256, tie_embeddings=True)  # fmt: skip
        args.contexts, args.capacity, args.tiles, args.stages, args.shapes = "9", 64, "4096", "2", "4/2"
        args.rounds, args.replays = 1, 1
    else:
        cfg = bench.qwen2_1p5b_config(max_seq_len=args.capacity)
    dtype = torch.bfloat16 if cuda else torch.float32
    kernels = (
        KernelConfig(linear="kiln") if run.smoke else None
    )  # "auto" takes kiln's decode matmul on CUDA only
    model = build_model(cfg, device=dev, dtype=dtype, seed=0, kernels=kernels).eval()
    variants = ["separate"] + [
        f"fused {t}/{s}/{w}/{r}"
        for t in args.tiles.split(",")
        for s in args.stages.split(",")
        for w in args.shapes.split(",")
        for r in args.preload.split(",")
    ]
    block_params = sum(p.numel() for layer in model.model.layers for p in layer.parameters())
    copy = run.ceilings.get("copy_TBps")
    rows, timelines = [], []
    for n in (int(c) for c in args.contexts.split(",")):
        tokens, pos, meta, caches = step_inputs(cfg, n, args.capacity, dev, dtype)
        kv_bytes = 2 * cfg.n_layers * n * cfg.n_kv_heads * cfg.head_dim * 2
        step_bytes = block_params * 2 + kv_bytes
        graphs, outs = {}, {}
        for v in variants:
            set_variant(v)
            with (
                torch.no_grad(),
                use_backend("triton"),
            ):  # the smoke run's interpreter takes kiln's kernels too
                try:
                    outs[v] = model.model(tokens, pos, meta, caches)[0].float().clone()
                    if cuda:
                        torch.cuda.synchronize()
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            model.model(tokens, pos, meta, caches)
                        graphs[v] = g
                except Exception as e:  # a tile that does not fit: recorded, the others go on
                    log(f"context {n}, {v}: failed: {type(e).__name__}: {str(e)[:300]}")
                    rows.append({"context": n, "variant": v, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        times = {v: [] for v in graphs}
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                if v not in graphs:
                    continue
                g = graphs[v]
                g.replay()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(args.replays):
                    g.replay()
                end.record()
                end.synchronize()
                times[v].append(start.elapsed_time(end) / args.replays)
        base = statistics.median(times["separate"]) if times.get("separate") else None
        ref = outs.get("separate")
        for v in outs:
            ms = statistics.median(times[v]) if times.get(v) else None
            tbps = step_bytes / (ms * 1e-3) / 1e12 if ms else None
            rows.append({
                "context": n, "variant": v, "ms": None if ms is None else round(ms, 4),
                "rounds_ms": [round(t, 4) for t in times.get(v, [])],
                "vs_separate": round(base / ms, 4) if ms and base else None,
                "us_per_layer": None if ms is None else round(1000 * ms / cfg.n_layers, 2),
                "TBps": None if tbps is None else round(tbps, 3),
                "of_copy": None if tbps is None or not copy else round(tbps / copy, 3),
                "max_abs_diff": round(float((outs[v] - ref).abs().max()), 5),
                "out_std": round(float(ref.std()), 4),
            })  # fmt: skip
        log(f"context {n}: {step_bytes / 1e9:.3f} GB a step")
        for v in filter(None, args.timeline.split(",")):
            if cuda:
                tl_row = timeline(model, tokens, pos, meta, caches, f"fused {v}")
                timelines.append({"context": n, **tl_row})
                log(f"context {n}, timeline of fused {v}: {tl_row}")
    set_variant("separate")
    cols = ["context", "variant", "ms", "vs_separate", "us_per_layer", "TBps", "of_copy", "max_abs_diff"]
    log(format_table([r for r in rows if "error" not in r], [(c, c) for c in cols]))
    run.write(
        contexts=args.contexts,
        capacity=args.capacity,
        block_params=block_params,
        rows=rows,
        timelines=timelines,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
