"""Asynchronous scheduling on the H200: steady-state decode with the engine's host work serial with the GPU
(async_scheduling off) and overlapped with it (on), in the same run, on the same engine and graphs.

    python bench/infer_overlap.py            # H200, ~3-4 min -> bench/results/infer_overlap.json
    python bench/infer_overlap.py --smoke    # CPU, a tiny model, every step of the script (seconds)

Random-init Qwen2.5-1.5B shape (bf16, CUDA graphs, the engine's defaults otherwise). For each batch B in
--batches (1, 8, 64, 128): B random --prompt-token (1024) prompts are prefilled, --warm-steps decode steps
run, then --timed-steps are timed with every sequence running (kiln.infer.bench.steady_decode), once with
async_scheduling off and once on, in --rounds interleaved rounds (order reversed every round; median
round). The switch is flipped on one engine between runs (it is read every step), so both modes share
the KV cache, the captured graphs and the allocator state.

Beside them, the GPU's own time for the step: B's bucket graph replayed back to back (--replays times,
CUDA events), on the static inputs the last timed step left (it rewrites those K/V slots with the same
values). tok/s at that time is what a host that costs nothing would give; step_ms - replay_ms is the host
time the GPU waited for. Agreement: greedy and seeded sampled requests (logprobs on) run off, on, off; the
second and third passes both prefill over the prefix cache the first filled, and are compared (bf16: a
batch's last steps differ by the rows of sequences that have just ended, so the bucket can differ; any
mismatch is recorded with its request, not fatal); the first against the third is the prefix cache's own
bf16 effect, the baseline to read it against.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import time

import torch

from kiln.infer import bench
from kiln.infer.engine import LLM
from kiln.infer.sampling_params import SamplingParams
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model
from kiln.profile.harness import BenchRun, bench_parser, format_table

BLOCK = 16


def parse_args():
    ap = bench_parser("infer_overlap", __doc__)
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    ap.add_argument("--batches", type=ints, default=[1, 8, 64, 128])
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (the decode context)")
    ap.add_argument("--warm-steps", type=int, default=16)
    ap.add_argument("--timed-steps", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replays", type=int, default=50, help="back-to-back graph replays timed per batch")
    args = ap.parse_args()
    if args.rounds < 1 or not args.batches or min(args.batches) < 1:
        ap.error("--rounds >= 1 and --batches of positive integers")
    if args.smoke:
        args.batches, args.prompt, args.warm_steps, args.timed_steps = [1, 3], 12, 1, 3
        args.rounds, args.replays = 1, 0
    return args


def model_config(args, smoke: bool, budget: int) -> ModelConfig:
    steps = bench.steady_tokens(max(args.batches), args.prompt, args.warm_steps, args.timed_steps, budget)
    ctx = -(-(args.prompt + steps + BLOCK) // BLOCK) * BLOCK
    if smoke:
        return ModelConfig(arch="qwen2", qkv_bias=True, vocab_size=256, d_model=32, n_layers=2, n_heads=4,
                           n_kv_heads=2, ffn_hidden=64, max_seq_len=ctx, tie_embeddings=True,
                           rope_theta=1e6, init_std=0.5)  # fmt: skip
    return bench.qwen2_1p5b_config(max_seq_len=ctx)


def agreement(llm: LLM, vocab: int, smoke: bool) -> dict:
    """Tokens with async_scheduling off and on, for greedy and seeded sampled requests (logprobs on)."""
    n, new = (4, 6) if smoke else (16, 48)
    prompts = bench.random_prompts(n, 8 if smoke else 64, vocab, seed=7)
    params = [
        SamplingParams(max_tokens=new - (i % 5), temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=2)
        for i in range(n)
    ]
    eng = llm.engine
    # three passes, off / on / off: the first one fills the prefix cache, so the second and third both
    # prefill over cached prefixes (another attention path, other bf16 rounding than the cold first pass);
    # on vs the third pass is the async comparison, the first vs the third the prefix cache's own effect
    passes = []
    for mode in (False, True, False):
        eng.async_scheduling = mode
        passes.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])

    def compare(x: list, y: list) -> tuple[int, list[int]]:
        same = [a == b for a, b in zip(x, y)]
        first_diff = [
            next((k for k, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))
            for a, b, s in zip(x, y, same)
            if not s
        ]
        return sum(same), first_diff

    identical, first_diff = compare(passes[1], passes[2])
    cached, cached_diff = compare(passes[0], passes[2])
    return {"requests": n, "identical": identical, "mismatch_first_index": first_diff,
            "sync_cold_vs_sync_cached_identical": cached, "sync_cold_vs_cached_first_index": cached_diff}  # fmt: skip


def main() -> int:
    args = parse_args()
    run = BenchRun("infer_overlap", __file__, args)
    dev, log = run.device, run.log
    if run.smoke:
        torch.set_num_threads(1)  # the shared 2-core CPU machines (bench/infer.py's reason)
    budget = 64 if run.smoke else 8192
    cfg = model_config(args, run.smoke, budget)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
    max_seqs = max(args.batches)
    steps = bench.steady_tokens(max_seqs, args.prompt, args.warm_steps, args.timed_steps, budget)
    blocks = max_seqs * -(-(args.prompt + steps) // BLOCK) + 2 * max_seqs
    t = time.perf_counter()
    llm = LLM(model, log=log, device=str(dev), dtype="bf16" if dev.type == "cuda" else "fp32",
              block_size=BLOCK, num_blocks=blocks, max_num_seqs=max_seqs, max_graph_batch=max_seqs,
              max_num_batched_tokens=budget, decode_backend="graphs")  # fmt: skip
    startup_s = round(time.perf_counter() - t, 1)
    eng = llm.engine
    rows = []
    for B in args.batches:
        runs: dict[str, list[dict]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                eng.async_scheduling = mode == "on"
                runs[mode].append(
                    bench.steady_decode(eng, B, args.prompt, args.warm_steps, args.timed_steps, seed=r)
                )
                if eng.has_unfinished() or eng.block_manager.num_free_blocks != blocks:
                    raise RuntimeError(
                        f"batch {B} {mode}: the engine was not left idle with every block free"
                    )
        bucket, gpu_ms = bench.graph_replay_ms(llm.engine, B, args.replays)
        row: dict = {"batch": B, "bucket": bucket, "replay_ms": None if gpu_ms is None else round(gpu_ms, 4)}
        for mode, rs in runs.items():
            med = sorted(rs, key=lambda x: x["tok_s"])[(len(rs) - 1) // 2]
            step_ms = med["step_ms"]["p50"]
            row[mode] = {
                "tok_s": med["tok_s"],
                "rounds_tok_s": [x["tok_s"] for x in rs],
                "step_ms": med["step_ms"],
                "mean_context": med["mean_context"],
                # the time per step the GPU was not running this step's kernels
                "host_gap_ms": None if gpu_ms is None else round(step_ms - gpu_ms, 4),
            }
        row["kernel_tok_s"] = None if gpu_ms is None else round(B / gpu_ms * 1e3, 1)
        row["speedup"] = round(row["on"]["tok_s"] / row["off"]["tok_s"], 3)
        rows.append(row)
        log(f"batch {B}: off {row['off']['tok_s']} tok/s, on {row['on']['tok_s']} tok/s "
            f"(x{row['speedup']}), graph replay {row['replay_ms']} ms -> {row['kernel_tok_s']} tok/s")  # fmt: skip
        run.write(complete=False, model=cfg.to_dict(), args=vars(args), startup_s=startup_s, cases=rows)
    agree = agreement(llm, cfg.vocab_size, run.smoke)
    log(f"agreement off vs on: {agree['identical']} of {agree['requests']} requests identical")
    eng.async_scheduling = eng.config.resolve_async(eng.device)
    run.write(complete=True, model=cfg.to_dict(), args=vars(args), startup_s=startup_s, cases=rows,
              agreement=agree)  # fmt: skip
    flat = [
        {
            "batch": r["batch"],
            "off": r["off"]["tok_s"],
            "on": r["on"]["tok_s"],
            "speedup": f"{r['speedup']:.2f}x",
            "off_ms": r["off"]["step_ms"]["p50"],
            "on_ms": r["on"]["step_ms"]["p50"],
            "replay_ms": r["replay_ms"],
            "kernel_tok_s": r["kernel_tok_s"],
            "of_replay": f"{100 * r['on']['tok_s'] / r['kernel_tok_s']:.0f}%" if r["kernel_tok_s"] else None,
        }
        for r in rows
    ]
    print(format_table(flat, [("batch", "batch"), ("off", "off tok/s"), ("on", "on tok/s"),
                              ("speedup", "on/off"), ("off_ms", "off step ms p50"), ("on_ms", "on step ms p50"),
                              ("replay_ms", "graph replay ms"), ("kernel_tok_s", "replay tok/s"),
                              ("of_replay", "on / replay")]))  # fmt: skip
    mismatched = agree["requests"] - agree["identical"]
    if run.smoke and mismatched:  # float32 on the CPU: the two modes must agree exactly
        log(f"smoke: {mismatched} requests differ between async off and on")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
