"""Experiment: the one-row decode gemv with W's first columns loaded before its PDL wait (DecodeConfig.pre_k).

    python bench/experiments/decode_preload.py --out /tmp/decode_preload.json   # H200, ~1-2 min
    python bench/experiments/decode_preload.py --smoke                          # CPU: the plumbing only

One random-init Qwen2.5-1.5B-shape model (bf16), one engine (CUDA graphs, async scheduling) per variant in
--settings (VARIANTS: the one-row configs of kiln.kernels.matmul_decode.decode_config, patched before the
engine captures its graphs). Per engine: steady decode at each
batch in --batches (--prompt-token prompts; kiln.infer.bench.steady_decode), then the bucket's graph
replayed back to back in --rounds interleaved rounds over the engines (order reversed every round; median).
Agreement: each engine's greedy tokens for a few prompts against the first setting's (recorded, not fatal:
the preload sums K in another order, so bf16 near-ties of a random model may go the other way).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import statistics

import torch

from kiln.infer import bench
from kiln.infer.engine import LLM
from kiln.infer.sampling_params import SamplingParams
from kiln.kernels import matmul_decode
from kiln.kernels.matmul_decode import DecodeConfig
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model
from kiln.profile.harness import BenchRun, bench_parser, format_table

BLOCK = 16
RULE = matmul_decode.decode_config
# variant -> (config for K <= 4096, config for a longer K) at one row of a K-major weight; None: the rule's
VARIANTS = {
    "base": (None, None),
    "pre_a": (DecodeConfig("gemv", 4, 256, 1, 4, 3, True, 2048), DecodeConfig("gemv", 2, 1024, 1, 4, 1, True, 4096)),
    "pre_b": (DecodeConfig("gemv", 4, 256, 1, 2, 3, True, 1024), DecodeConfig("gemv", 2, 1024, 1, 4, 1, True, 2048)),
    "pre_c": (DecodeConfig("gemv", 4, 256, 1, 4, 3, True, 2048), None),
    "pre_d": (None, DecodeConfig("gemv", 2, 1024, 1, 4, 1, True, 4096)),
}  # fmt: skip


def patched_rule(variant: str):
    short, long = VARIANTS[variant]

    def rule(M, N, K, sms, k_major=True):
        cfg = RULE(M, N, K, sms, k_major)
        if M == 1 and k_major and cfg.kernel == "gemv":
            return (short if K <= 4096 else long) or cfg
        return cfg

    return rule


def replay_ms(llm: LLM, batch: int, n: int) -> float | None:
    graphs = llm.engine.runner.graphs
    if graphs is None or not graphs.use_graphs:
        return None
    g = graphs.graphs[graphs.bucket(batch)]
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def main() -> int:
    ap = bench_parser("decode_preload", __doc__)
    ap.add_argument("--settings", default=",".join(VARIANTS))
    ap.add_argument("--batches", default="1")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=40)
    args = ap.parse_args()
    run = BenchRun("decode_preload", __file__, args)
    dev, log = run.device, run.log
    settings = args.settings.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if run.smoke:
        cfg = ModelConfig(arch="qwen2", qkv_bias=True, vocab_size=256, d_model=32, n_layers=2, n_heads=4,
                          n_kv_heads=2, ffn_hidden=64, max_seq_len=256, tie_embeddings=True, rope_theta=1e6)  # fmt: skip
        args.prompt, args.rounds, args.replays = 16, 1, 2
    else:
        cfg = bench.qwen2_1p5b_config(max_seq_len=args.prompt + 256)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
    max_seqs = max(batches)
    blocks = max_seqs * -(-(args.prompt + 200) // BLOCK) + 2 * max_seqs
    prompts = bench.random_prompts(4, 32, cfg.vocab_size, seed=3)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engines, rows = {}, []
    for s in settings:
        matmul_decode.decode_config = patched_rule(s)  # decode_matmul looks the rule up at every call
        llm = LLM(model, log=log, device=str(dev), dtype="bf16" if dev.type == "cuda" else "fp32",
                  block_size=BLOCK, num_blocks=blocks, max_num_seqs=max_seqs, max_graph_batch=max_seqs,
                  max_num_batched_tokens=8192, decode_backend="graphs", enable_prefix_caching=False)  # fmt: skip
        llm.engine.async_scheduling = True
        row = {"setting": s, "configs": [str(c) if c else "rule" for c in VARIANTS[s]]}
        for B in batches:
            r = bench.steady_decode(llm.engine, B, args.prompt, 8, 32 if not run.smoke else 2, seed=0)
            row[f"b{B}_tok_s"] = round(r["tok_s"], 1)
        row["tokens"] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        engines[s] = llm
        rows.append(row)
        log(f"{s}: built, " + ", ".join(f"b{B} {row[f'b{B}_tok_s']} tok/s" for B in batches))
    times = {(s, B): [] for s in settings for B in batches}
    for r in range(args.rounds):
        order = settings if r % 2 == 0 else settings[::-1]
        for s in order:
            for B in batches:
                ms = replay_ms(engines[s], B, args.replays)
                if ms is not None:
                    times[(s, B)].append(ms)
    ref = rows[0]["tokens"]
    for row in rows:
        s = row["setting"]
        row["same_tokens_as_first"] = row["tokens"] == ref
        for B in batches:
            ts = times[(s, B)]
            row[f"b{B}_replay_ms"] = round(statistics.median(ts), 4) if ts else None
            row[f"b{B}_replay_rounds"] = [round(t, 4) for t in ts]
            base = times[(settings[0], B)]
            row[f"b{B}_vs_first"] = round(statistics.median(base) / statistics.median(ts), 4) if ts else None
        del row["tokens"]
    log(format_table(rows, [("setting", "setting")] + [(f"b{B}_{k}", f"b{B} {k}") for B in batches
                                                       for k in ("tok_s", "replay_ms", "vs_first")]
                     + [("same_tokens_as_first", "same tokens")]))  # fmt: skip
    run.write(settings=settings, batches=batches, prompt=args.prompt, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
