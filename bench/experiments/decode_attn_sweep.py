"""Experiment: decode attention's split count and tile config at an engine's decode shapes, as a step runs it.

    python bench/experiments/decode_attn_sweep.py --out /tmp/decode_attn_sweep.json   # H200, ~2 min
    python bench/experiments/decode_attn_sweep.py --smoke                             # CPU: the plumbing

Qwen2.5-1.5B's attention (12 query / 2 KV heads of 128, bf16, pages of 16, a block table --width tokens
wide as a captured graph passes) at each batch in --batches, every sequence --contexts keys long. One
candidate = a split count (`per_sm` (sequence, KV head, split) programs an SM) x a split-kernel config
(decode_attention.SPLIT_CONFIGS, the TMA and PRELOAD ones included; --configs keeps some by name, e.g.
64x4w3s_addr32_preload; --head-major also times each on head-major pages); each is a CUDA graph of --layers calls over as many
separate caches (a decode step's worth), replayed after a read-only 512 MB flush (the L2 then holds no
K/V and no dirty lines, as in a step, whose weights stream through L2 between layers), candidates
interleaved in --rounds rounds in a fresh random order. Beside them, in the same rounds:
- `default`: decode_attention as the engine calls it (decode_attention.split_plan's count and config; before
  the fixed plan, an autotuner's pick, tuned on the engine's one-key padding rows: `autotuned_padding` in
  the results of that code, and `autotuned_live` tuned on the workload);
- `sdpa_dense`: SDPA over dense contiguous (B, Hk, L, D) copies of the same caches (the peer).
Figures: us a layer, K/V TB/s, and the fraction of the copy bandwidth measured in the run.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import itertools

import torch

from kiln.kernels import decode_attention as dec
from kiln.kernels.dispatch import use_backend
from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser, format_table
from kiln.profile.timing import capture_graph, flushed_graph_ms

HQ, HK, D, PAGE = 12, 2, 128, 16


def caches(B: int, L: int, width: int, layers: int, dev, dtype, seed: int = 0):
    """`layers` (k, v) page pools, one block table (B, width / PAGE) of shuffled pages (the live ones first),
    the query and the lengths."""
    g = torch.Generator(device=dev).manual_seed(seed)
    live = -(-L // PAGE)
    pool = B * live + 1
    table = torch.zeros(B, width // PAGE, dtype=torch.int32, device=dev)
    table[:, :live] = (
        torch.randperm(pool - 1, device=dev, generator=g)[: B * live].view(B, live).to(torch.int32)
    )
    kv = [
        tuple(torch.randn(pool, PAGE, HK, D, device=dev, dtype=dtype, generator=g) for _ in range(2))
        for _ in range(layers)
    ]
    q = torch.randn(B, HQ, D, device=dev, dtype=dtype, generator=g)
    return q, kv, table, torch.full((B,), L, dtype=torch.int32, device=dev)


def name(per_sm: int, cfg: tuple) -> str:
    n, w, s, a, t, pl = cfg
    return (
        f"ps{per_sm}_{n}x{w}w{s}s"
        + ("_addr32" if a else "")
        + ("_tma" if t else "")
        + ("_preload" if pl else "")
    )


def sweep_batch(run, args, B: int, L: int, per_sms: list, configs: list, copy, dtype) -> list[dict]:
    """Every candidate at batch B, L keys a sequence (module doc), timed interleaved: one row each."""
    dev, cuda = run.device, run.device.type == "cuda"
    scale = D**-0.5
    rows = []
    q, kv, table, lens = caches(B, L, args.width, args.layers, dev, dtype)
    kv_bytes = 2 * B * L * HK * D * q.element_size()  # a layer's K and V
    graphs, meta = {}, {}
    layouts = {"": kv}
    if args.head_major:  # the same values in (pages, Hk, page, D) buffers, viewed as (pages, page, Hk, D)
        layouts["hm_"] = [tuple(c.transpose(1, 2).contiguous().transpose(1, 2) for c in pair) for pair in kv]
    for (prefix, kvs), per_sm, cfg in itertools.product(layouts.items(), per_sms, configs):
        splits = dec.num_splits_for(B, HK, args.width, dec.sm_count(dev), per_sm)
        n, w, s, a, t, pl = cfg
        if (t and n != PAGE) or (prefix and t):
            continue
        c = dict(BLOCK_N=n, num_warps=w, num_stages=s, ADDR32=a, TMA=t, PRELOAD=pl)
        calls = [
            lambda k=k, v=v, c=c, sp=splits: dec.decode_attention_triton(
                q, k, v, table, lens, scale, None, None, sp, c
            )
            for k, v in kvs
        ]
        key = prefix + name(per_sm, cfg)
        try:
            graphs[key] = capture_graph(calls, cuda)
            meta[key] = dict(per_sm=per_sm, splits=splits, config=c)
        except Exception as e:  # noqa: BLE001 - one failing candidate must not end the run
            run.log(f"  B={B} {key}: {type(e).__name__}: {str(e)[:200]}")
    splits, plan = dec.split_plan(B, HK, args.width, dec.sm_count(dev))
    calls = [lambda k=k, v=v: dec.decode_attention(q, k, v, table, lens) for k, v in kv]
    with use_backend("triton"):
        graphs["default"] = capture_graph(calls, cuda)
    meta["default"] = dict(splits=splits, config=plan)
    if cuda:
        dense = [
            tuple(c[table[:, : -(-L // PAGE)].long()].reshape(B, -1, HK, D)[:, : L]
                  .transpose(1, 2).contiguous() for c in pair)
            for pair in kv
        ]  # fmt: skip
        qd = q[:, :, None]
        sdpa = [lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(qd, k, v, enable_gqa=True)
                for k, v in dense]  # fmt: skip
        graphs["sdpa_dense"] = capture_graph(sdpa, cuda)
        meta["sdpa_dense"] = {}
    ms = flushed_graph_ms(graphs, args.rounds, args.reps, cuda)
    for key, t in ms.items():
        us = t * 1e3 / args.layers if t else None
        tbps = kv_bytes / (us * 1e-6) / 1e12 if us else None
        rows.append(dict(B=B, context=L, candidate=key, **meta[key],
                         us_per_layer=round(us, 2) if us else None, TBps=round(tbps, 3) if tbps else None,
                         frac_copy=fraction(tbps, copy)))  # fmt: skip
    best = min(
        (r for r in rows if r["B"] == B and r["us_per_layer"]),
        key=lambda r: r["us_per_layer"],
        default=None,
    )
    run.log(f"B={B} L={L}: best {best and best['candidate']} {best and best['us_per_layer']} us/layer; "
            f"default {ms.get('default')}, "
            f"sdpa {ms.get('sdpa_dense')} ms for {args.layers} layers")  # fmt: skip
    return rows


def main() -> int:
    ap = bench_parser("decode_attn_sweep", __doc__)
    ap.add_argument("--batches", default="1,8,32,64,128")
    ap.add_argument("--contexts", default="1024", help="live keys a sequence, comma-separated")
    ap.add_argument("--configs", default="", help="config names to keep (e.g. 32x4w3s_addr32); all if empty")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--per-sm", default="1,2,3,4,6,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-tokens", type=int, default=262144, help="skip batch x context above this")
    ap.add_argument("--head-major", action="store_true", help="also time each candidate on head-major pages")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    run = BenchRun("decode_attn_sweep", __file__, args)
    cuda = run.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = [int(b) for b in args.batches.split(",")]
    per_sms = [int(p) for p in args.per_sm.split(",")]
    configs = list(dec.SPLIT_CONFIGS)
    if args.configs:
        keep = args.configs.split(",")
        configs = [c for c in configs if name(0, c).split("_", 1)[1] in keep]
    contexts = [int(c) for c in args.contexts.split(",")]
    if run.smoke:
        batches, per_sms, args.layers, contexts, args.width = [2], [1, 4], 2, [40], 128
        configs = [c for c in configs if c[0] in (16, 32)][:2]
    copy = run.ceilings.get("copy_TBps")
    rows = []
    for L in contexts:
        for B in [b for b in batches if b * L <= args.max_tokens]:
            rows += sweep_batch(run, args, B, L, per_sms, configs, copy, dtype)
        if cuda:
            torch.cuda.empty_cache()
    cols = [(c, c) for c in ("B", "candidate", "splits", "us_per_layer", "TBps", "frac_copy")]
    print(format_table([r for r in rows if not r["candidate"].startswith("ps") or r["us_per_layer"]], cols))
    run.write(rows=rows, args=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
