"""Experiment: MoE decode where issue 19's 80%-of-copy line is still missed: 2 tokens, and 32-64 tokens
(the grouped path's side of `use_decode`), with the experts form's two grids.

    python bench/experiments/moe_decode_batch.py --out /tmp/moe_decode_batch.json   # H200, ~3 min
    python bench/experiments/moe_decode_batch.py --smoke                            # CPU: the plumbing

Shapes and routings are bench/moe.py's (the DeepSeek-like shape with its shared expert as one more slot of
the routed kernels, as a decode step would run it). All forward, CUDA-graph replays, GB/s over the active
experts' weights against a device copy of the same bytes (bench/moe.py's decode case). Per batch:
- 2-4 tokens: the pairs form, the experts form with one row a pass (the pairs form's weight streams with
  the one-row down kernel's preload) and with 16-row tl.dot passes, at its default and narrower tiles.
- 8 and 16 tokens: the experts form over slots and over experts (`by_expert_grid`'s two sides).
- 32-64 tokens: the grouped path (routing plan, permute, grouped GEMM, SwiGLU, grouped GEMM, combine)
  at mm_config's default (and other tiles with --grouped-tiles), with the SwiGLU fused into the gate/up
  GEMM, and the experts form over slots and over experts at several tl.dot tiles.
Then a kernel-by-kernel profile (torch.profiler, eager calls) of the grouped path and the experts form
(default: 64 tokens under Zipf routing on the Qwen3-like shape; `--profile-case`): where the time goes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/moe.py

import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.moe_decode import DecodeTiles, add_shared_slots, moe_decode_fwd
from kiln.kernels.moe_gemm import grouped_mm, mm_config
from kiln.kernels.moe_permute import permute, routing_plan, unpermute
from kiln.kernels.swiglu import swiglu
from kiln.profile.harness import BenchRun, bench_parser
from moe import (
    SHAPES,
    SMOKE_SHAPES,
    Bench,
    decode_inputs,
    fwd,
    in_turn,
    kiln_experts,
    kiln_fused_experts,
    kiln_grouped_experts,
    make_routing,
    make_weights,
    same_size_copy,
    weight_copies,
)

TOKENS = (2, 3, 4, 8, 16, 32, 48, 64)
# the grouped GEMM's tiles beside mm_config's (16, 64, 128, 4, 4) at a few rows per expert (--grouped-tiles)
GROUPED_UP = [(16, 128, 128, 4, 4), (16, 64, 256, 4, 3), (32, 64, 128, 4, 4), (16, 64, 128, 8, 4)]
GROUPED_DOWN = [(16, 128, 128, 4, 4), (16, 32, 128, 4, 4)]
# the experts form's tl.dot tiles (for both kernels); 64 rows a pass hold (BLOCK_N, ROWS) accumulators and
# (BLOCK_N, BLOCK_K) gate and up tiles a stage: (128, 128, 8, 3) needs 240 KB of shared memory there
EXPERT_TILES = [DecodeTiles(32, 128, 4, 3), DecodeTiles(64, 128, 8, 3), DecodeTiles(128, 128, 8, 3),
                DecodeTiles(64, 64, 4, 4)]  # fmt: skip
# at 2-4 tokens a few experts are active: narrower column blocks give their weights more programs; and the
# default's width with less shared memory: 3 programs an SM instead of 2 (sm_90 ptxas: 110.6 KB and 160
# registers at (64, 128, 4, 3); 73.7 KB at (64, 64, 4, 4) and (64, 128, 4, 2)), so that Qwen3-like's 24
# experts x 12 column blocks (288 up programs) run in one wave of 396 rather than 264 + 24
SMALL_TILES = [DecodeTiles(32, 128, 4, 3), DecodeTiles(16, 128, 4, 3), DecodeTiles(32, 64, 4, 4),
               DecodeTiles(32, 256, 4, 2), DecodeTiles(64, 64, 4, 4), DecodeTiles(64, 128, 4, 2)]  # fmt: skip
EXPERT_TILES_64 = [DecodeTiles(64, 64, 4, 4), DecodeTiles(32, 64, 4, 4), DecodeTiles(64, 64, 4, 3),
                   DecodeTiles(128, 64, 8, 3), DecodeTiles(128, 64, 4, 4)]  # fmt: skip


def grouped(up_cfg=None, down_cfg=None):
    """The grouped path (bench/moe.py's kiln_grouped_experts) with explicit launch configs for the gate/up
    and the down GEMM (None: default)."""

    def f(x, idx, w, w1, w2):
        plan = routing_plan(idx, w1.shape[0])
        gu = grouped_mm(permute(x, plan), w1.transpose(1, 2), plan.offsets, config=up_cfg)[0]
        y = grouped_mm(swiglu(gu, None), w2.transpose(1, 2), plan.offsets, config=down_cfg)[0]
        return unpermute(y, plan, w)

    return f


def form(name, **kw):
    def f(x, idx, w, w1, w2):
        return moe_decode_fwd(x, idx, w, w1, w2, form=name, **kw)

    return f


def variants(T: int, smoke: bool, grouped_tiles: bool) -> dict:
    if T <= 4:
        impls = {"pairs": form("pairs"), "experts_one_row": form("experts", rows=1)}
        impls["experts_rows16"] = form("experts", rows=16)
        tiles = [] if smoke else SMALL_TILES
        impls |= {f"experts_rows16{tuple(t)}": form("experts", rows=16, config=(t, t)) for t in tiles}
        return impls
    impls = {
        "experts_slots": form("experts", by_expert=False),
        "experts_by_expert": form("experts", by_expert=True),
    }
    if T < 32:
        return impls
    impls |= {"grouped": kiln_grouped_experts, "grouped_fused": kiln_fused_experts}
    if smoke:
        return impls
    if grouped_tiles:
        impls |= {f"grouped_up{c}": grouped(up_cfg=c) for c in GROUPED_UP}
        impls |= {f"grouped_down{c}": grouped(down_cfg=c) for c in GROUPED_DOWN}
    tiles = EXPERT_TILES if T <= 32 else EXPERT_TILES_64
    impls |= {f"experts_by_expert{tuple(t)}": form("experts", by_expert=True, config=(t, t)) for t in tiles}
    return impls


def case(b: Bench, shape: str, T: int, routing: str, weights, grouped_tiles: bool = False) -> None:
    E, _, d, inter, _ = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    w1, w2, _, slots = weights
    x, idx, w, active, nbytes = decode_inputs(b, shape, T, routing)  # nbytes: the shared expert's too
    if slots is not None:  # the shared expert as more slots of the routed kernels (every token holds it)
        idx, w = add_shared_slots(idx, w, E, slots[0].shape[0] - E)
        w1, w2 = slots
    impls = {"kiln": kiln_experts} | variants(T, b.smoke, grouped_tiles)
    # each variant over copies of the weights the L2 cannot hold together (bench/moe.py's decode case)
    copies = [(c[3] if slots is not None else c[:2]) for c in weight_copies(b, weights, nbytes)]
    fns = {n: in_turn([fwd(f, [x, idx, w, *c]) for c in copies]) for n, f in impls.items()}
    fns["copy"] = same_size_copy(b, nbytes, len(copies))
    diffs = {}
    with torch.no_grad():  # every variant against the model's dispatch (a failing one: b.time records it)
        ref = kiln_experts(x, idx, w, w1, w2).float()
        for n, f in impls.items():
            try:
                diffs[n] = float((f(x, idx, w, w1, w2).float() - ref).abs().max())
            except Exception as e:  # noqa: BLE001
                diffs[n] = f"{type(e).__name__}"
    counts = torch.bincount(idx.reshape(-1), minlength=w1.shape[0])
    entry = dict(case="decode", shape=shape, tokens=T, routing=routing, active_experts=active,
                 max_tokens_per_expert=int(counts[:E].max()), weight_bytes=nbytes, weight_copies=len(copies),
                 grouped_default_up=str(mm_config(T * idx.shape[1], w1.shape[0], False, 2 * inter, d)),
                 max_abs_diff_vs_kiln=diffs)  # fmt: skip
    b.record(entry, b.time(fns, graph=True), nbytes=nbytes * len(copies))


def profile(b: Bench, shape: str, T: int, routing: str, weights, iters: int = 20) -> None:
    """Kernel by kernel (torch.profiler over eager calls): us per call of each kernel, for the grouped path,
    the experts form (its default grid) and the pairs form, beside a device copy of the active experts'
    bytes (the routed experts only)."""
    E, k, d, inter, _ = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    w1, w2, _, _ = weights
    x = b.randn(T, d)
    idx, w = make_routing(T, E, k, routing, b.dev, b.gen)
    active = int(torch.unique(idx).numel())
    src = torch.empty(active * 3 * inter * d * w1.element_size() // 2, dtype=torch.uint8, device=b.dev)
    dst = torch.empty_like(src)
    out = dict(case="profile", shape=shape, tokens=T, routing=routing, iters=iters, active_experts=active,
               results={})  # fmt: skip
    for name, f in (
        ("grouped", kiln_grouped_experts),
        ("experts", form("experts")),
        ("pairs", form("pairs")),
        ("copy", lambda *a: dst.copy_(src)),
    ):
        run = fwd(f, [x, idx, w, w1, w2])
        run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                run()
            torch.cuda.synchronize()
        rows = []
        for ev in prof.key_averages():
            us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            if us:
                rows.append(dict(kernel=ev.key[:90], calls=ev.count / iters, us=round(us / iters, 2)))
        rows.sort(key=lambda r: -r["us"])
        out["results"][name] = rows
        b.run.log(
            f"profile {shape} {T} {routing} {name}: "
            + "; ".join(f"{r['kernel'][:40]} {r['us']}" for r in rows)
        )
    b.cases.append(out)


def main() -> int:
    ap = bench_parser("moe_decode_batch", __doc__)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="decode batches, comma-separated")
    ap.add_argument("--grouped-tiles", action="store_true", help="also the grouped GEMM at other tiles")
    ap.add_argument("--no-profile", action="store_true", help="skip the kernel-by-kernel profile")
    ap.add_argument(
        "--profile-case",
        default="qwen3-30b-a3b:64:zipf",
        help="SHAPE:TOKENS:ROUTING of the profile (KILN_PDL=0 in the environment gives each "
        "kernel's own time: with programmatic dependent launch a kernel's span includes its wait)",
    )
    ap.add_argument(
        "--warm", action="store_true", help="one weight copy replayed L2-warm (bench/moe.py --warm)"
    )
    args = ap.parse_args()
    run = BenchRun("moe_decode_batch", __file__, args, rounds=3)
    b = Bench(run)
    b.warm = args.warm
    run.meta["decode_weights"] = (
        "one copy, L2-warm" if args.warm else "rotated copies (bench/moe.py weight_copies)"
    )
    shapes = list(SMOKE_SHAPES if b.smoke else SHAPES)
    tokens = (2, 32) if b.smoke else tuple(int(t) for t in args.tokens.split(","))
    with use_backend("triton"):
        weights = {s: make_weights(b, s) for s in shapes}
        for T in tokens:
            for shape in shapes:
                for routing in ("balanced", "zipf"):
                    case(b, shape, T, routing, weights[shape], args.grouped_tiles)
        if not b.smoke and not args.no_profile:
            shape, T, routing = args.profile_case.split(":")
            profile(b, shape, int(T), routing, weights[shape])
    run.write(cases=b.cases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
