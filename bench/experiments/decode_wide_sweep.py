"""Experiment: the decode matmul's wide tiles (17-128 rows), and its one-row gemv tiles, against cuBLAS at
the engine's decode buckets.

    python bench/experiments/decode_wide_sweep.py --out /tmp/decode_wide_sweep.json   # H200, ~4 min
    python bench/experiments/decode_wide_sweep.py --smoke                             # CPU: the plumbing

Qwen2.5-1.5B's four block projections (qkv 1536 -> 2048 with its bias, o 1536 -> 1536, gate_up 1536 -> 17920,
down 8960 -> 1536), bf16, at --rows (the engine's 32 / 64 / 128-sequence graph buckets). One candidate is
cuBLAS (F.linear: what the model runs past 16 rows), kiln's rule (matmul_decode.wide_config) or one of a grid
of dot-kernel configs (64 / 128 / 32 weight rows a program, 64 / 128-deep K steps, warps, stages, K split so
that the programs number about 1-4 an SM). Each candidate is a CUDA graph of --layers calls over as many
copies of the weight (a decode step's worth: every call finds its weight out of L2, as in a step), replayed
after a read-only 512 MB flush, candidates interleaved in --rounds rounds in a fresh random order (the
method of decode_attn_sweep.py). Every output is checked against cuBLAS's. Figures: us a call, weight TB/s
and the fraction of the copy bandwidth measured in the run.

`--rows 1` times the one-row gemv kernel instead, over GEMV_GRID's tiles of gate_up and down (the two
projections that stream their weight in the step; qkv and o load theirs before their programmatic-launch
wait): the rule was chosen from L2-warm timings (docs/perf/matmul_decode.md), these calls stream from HBM.
The best of each is what `KILN_DECODE_GEMV_LONG` / `_WIDE` (kernels/matmul_decode.py) take for whole-step
A/B runs.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from kiln.kernels.dispatch import sm_count
from kiln.kernels.launch import cdiv
from kiln.kernels.matmul_decode import DecodeConfig, decode_config, decode_matmul
from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser, format_table
from kiln.profile.timing import capture_graph, flushed_graph_ms

SHAPES = {"qkv": (1536, 2048, True), "o": (1536, 1536, False), "gate_up": (1536, 17920, False),
          "down": (8960, 1536, False)}  # fmt: skip  # name: (K, N, bias)
# (weight rows a program, K step, warps, stages)
TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3), (32, 128, 4, 3)]
SPLITS = (1, 2, 4, 8, 16)
# one row: (columns a program, K step, warps, stages) of the gemv kernel, by projection (the rule's first)
GEMV_GRID = {
    "down": [(2, 1024, 4, 1), (2, 1024, 4, 2), (2, 1024, 4, 3), (2, 512, 2, 3), (2, 512, 4, 3), (2, 512, 2, 4),
             (2, 2048, 8, 2), (2, 256, 2, 4), (1, 1024, 4, 2), (1, 2048, 4, 2), (1, 512, 2, 3), (1, 1024, 2, 3),
             (4, 512, 4, 3), (4, 1024, 4, 2), (4, 256, 2, 4), (4, 512, 2, 3)],
    "gate_up": [(4, 256, 2, 3), (4, 256, 2, 4), (8, 256, 4, 3), (4, 512, 4, 2), (2, 512, 2, 3), (8, 128, 2, 4),
                (4, 128, 1, 4), (2, 256, 1, 4), (4, 512, 2, 3), (2, 1024, 4, 2)],
}  # fmt: skip


def grid(name: str, M: int, K: int, N: int, sms: int) -> list[DecodeConfig]:
    """The configs tried at (M, K, N): at one row GEMV_GRID's gemv tiles of the projection; else every dot
    tile whose stages fit the shared memory, at each split K that leaves >= 2 K steps a split and gives
    between half and four programs an SM (the split count 1 always)."""
    if M == 1:
        return [DecodeConfig("gemv", bn, bk, 1, w, s, True) for bn, bk, w, s in GEMV_GRID.get(name, [])]
    out = []
    for bn, bk, w, s in TILES:
        if (bn + max(16, M)) * bk * 2 * s > 200 * 1024:  # W and x.T tiles of every stage, bf16
            continue
        for sk in SPLITS:
            programs = cdiv(N, bn) * sk
            if sk == 1 or (cdiv(K, bk) >= 2 * sk and sms // 2 <= programs <= 4 * sms):
                out.append(DecodeConfig("dot", bn, bk, sk, w, s, True))
    return out


def sweep_shape(run, args, name: str, K: int, N: int, has_bias: bool, M: int, copy, dtype) -> list[dict]:
    dev, cuda = run.device, run.device.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(M + N)
    ws = [torch.randn(N, K, device=dev, generator=g, dtype=torch.float32).div_(K**0.5).to(dtype)
          for _ in range(args.layers)]  # fmt: skip
    bias = torch.randn(N, device=dev, generator=g).to(dtype) if has_bias else None
    x = torch.randn(M, K, device=dev, generator=g).to(dtype)
    want = F.linear(x.float(), ws[0].float(), None if bias is None else bias.float())
    sms = sm_count(dev)
    cands: dict[str, DecodeConfig | None] = {"cublas": None, "rule": decode_config(M, N, K, sms)}
    smoke = [DecodeConfig("gemv" if M == 1 else "dot", 16, 32, 1 if M == 1 else 2, 4, 2 if M == 1 else 1)]
    for c in grid(name, M, K, N, sms) if not run.smoke else smoke:
        cands[str(c).replace(" ", "_")] = c
    graphs, meta = {}, {}
    for key, cfg in cands.items():
        if key == "cublas":
            calls = [lambda w=w: F.linear(x, w, bias) for w in ws]
        else:
            calls = [lambda w=w, c=cfg: decode_matmul(x, w.t(), bias, config=c) for w in ws]
        try:
            err = float((calls[0]().float() - want).abs().max())
            graphs[key] = capture_graph(calls, cuda)
            meta[key] = dict(config=str(cfg) if cfg else "cuBLAS", max_abs_err=err)
        except Exception as e:  # noqa: BLE001 - one failing candidate must not end the run
            run.log(f"  {name} M={M} {key}: {type(e).__name__}: {str(e)[:200]}")
    ms = flushed_graph_ms(graphs, args.rounds, args.reps, cuda)
    rows = []
    for key, t in ms.items():
        us = t * 1e3 / args.layers if t else None
        tbps = N * K * x.element_size() / (us * 1e-6) / 1e12 if us else None
        rows.append(dict(shape=name, M=M, K=K, N=N, candidate=key, **meta[key],
                         us=round(us, 2) if us else None, TBps=round(tbps, 3) if tbps else None,
                         frac_copy=fraction(tbps, copy)))  # fmt: skip
    timed = [r for r in rows if r["us"]]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        cub = next((r["us"] for r in timed if r["candidate"] == "cublas"), None)
        for r in rows:
            r["vs_cublas"] = round(cub / r["us"], 3) if cub and r["us"] else None
        run.log(f"{name} M={M}: cuBLAS {cub} us, rule {ms.get('rule') and round(ms['rule'] * 1e3 / args.layers, 2)}"
                f" us, best {best['candidate']} {best['us']} us ({best['frac_copy']} of copy)")  # fmt: skip
    return rows


def main() -> int:
    ap = bench_parser("decode_wide_sweep", __doc__)
    ap.add_argument("--rows", default="32,64,128")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    run = BenchRun("decode_wide_sweep", __file__, args)
    cuda = run.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float16  # the interpreter's bf16 tl.dot is wrong (PLATFORM.md)
    rows_list = [int(m) for m in args.rows.split(",")]
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    if run.smoke:
        rows_list, args.layers, args.rounds = [1 if rows_list == [1] else 20], 2, 1
        shapes = {"qkv": (48, 40, True), "down": (96, 24, False)}
    copy = run.ceilings.get("copy_TBps")
    rows = []
    for M in rows_list:
        for name, (K, N, has_bias) in shapes.items():
            rows += sweep_shape(run, args, name, K, N, has_bias, M, copy, dtype)
            run.write(partial=True, rows=rows)
    best = []
    for M in rows_list:
        for name in shapes:
            timed = [r for r in rows if r["M"] == M and r["shape"] == name and r["us"]]
            if timed:
                b = min(timed, key=lambda r: r["us"])
                rule = next((r for r in timed if r["candidate"] == "rule"), {})
                cub = next((r for r in timed if r["candidate"] == "cublas"), {})
                best.append(dict(shape=name, M=M, cublas_us=cub.get("us"), rule_us=rule.get("us"),
                                 rule_vs_cublas=rule.get("vs_cublas"), best=b["candidate"], best_us=b["us"],
                                 best_vs_cublas=b.get("vs_cublas"), best_frac_copy=b["frac_copy"]))  # fmt: skip
    run.log(format_table(best, [(k, k) for k in ("shape", "M", "cublas_us", "rule_us", "rule_vs_cublas", "best",
                                                 "best_us", "best_vs_cublas", "best_frac_copy")]))  # fmt: skip
    run.write(rows=rows, best=best, layers=args.layers, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
