"""Experiment: whole decode steps in the forms the environment switches select, side by side.

    python bench/experiments/decode_forms.py --out /tmp/decode_forms.json   # H200, ~1 min
    python bench/experiments/decode_forms.py --smoke                        # CPU: the plumbing only

A setting is "base" or switches joined by "+", e.g. "KILN_DECODE_QKV=separate+KILN_DECODE_SWIGLU=separate".
One random-init Qwen2.5-1.5B-shape model (bf16), one engine (CUDA graphs, async scheduling) per setting in
--settings, each built after its switches are set (they are read once: their caches are cleared; the
graphs capture them). Per engine: steady decode at each
batch in --batches (--prompt-token prompts; kiln.infer.bench.steady_decode), then the bucket's graph
replayed back to back in --rounds interleaved rounds over the engines (order reversed every round; median).
Agreement: each engine's greedy tokens for a few prompts against the first setting's (recorded, not fatal: a
form that sums in another order may flip a bf16 near-tie of the random model).
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
from kiln.kernels import _common as kernels_common
from kiln.kernels import decode_attention, matmul_decode
from kiln.model import config as model_config
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model
from kiln.profile.harness import BenchRun, bench_parser, format_table

BLOCK = 16
# switch -> (module, its read-once function)
SWITCHES = {
    "KILN_DECODE_QKV": (model_config, "decode_qkv"),
    "KILN_DECODE_NORM": (model_config, "decode_norm"),
    "KILN_DECODE_SWIGLU": (model_config, "decode_swiglu"),
    "KILN_DECODE_SUM": (model_config, "decode_sum"),
    "KILN_DECODE_BLOCK": (model_config, "decode_block"),
    "KILN_DECODE_ROWS": (model_config, "decode_rows"),
    "KILN_DECODE_FORM": (decode_attention, "default_form"),
    "KILN_DECODE_PRELOAD": (decode_attention, "_preload_switch"),
    "KILN_DECODE_EARLY": (kernels_common, "early_loads"),
    "KILN_DECODE_PREW": (matmul_decode, "preload_switch"),
    "KILN_DECODE_GEMV_LONG": (matmul_decode, "gemv_override"),
    "KILN_DECODE_GEMV_WIDE": (matmul_decode, "gemv_override"),
    "KILN_DECODE_ALIGN": (decode_attention, "chunk_align"),
    "KILN_PDL_FIRST": (kernels_common, "_pdl_first_set"),
}


def apply(setting: str) -> None:
    """Set the switches of `setting` (every other known one unset) and clear their read-once caches."""
    pairs = dict(p.split("=", 1) for p in setting.split("+")) if setting != "base" else {}
    for name, (module, fn) in SWITCHES.items():
        if name in pairs:
            os.environ[name] = pairs[name]
        else:
            os.environ.pop(name, None)
        if hasattr(module, fn):
            getattr(module, fn).cache_clear()
    matmul_decode.decode_config.cache_clear()  # it caches the rule's answers, gemv_override's among them


def main() -> int:
    ap = bench_parser("decode_forms", __doc__)
    ap.add_argument("--settings", default="base,KILN_DECODE_QKV=norm")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--replays", type=int, default=40)
    args = ap.parse_args()
    run = BenchRun("decode_forms", __file__, args)
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
        apply(s)
        llm = LLM(model, log=log, device=str(dev), dtype="bf16" if dev.type == "cuda" else "fp32",
                  block_size=BLOCK, num_blocks=blocks, max_num_seqs=max_seqs, max_graph_batch=max_seqs,
                  max_num_batched_tokens=8192, decode_backend="graphs", enable_prefix_caching=False)  # fmt: skip
        llm.engine.async_scheduling = True
        row = {"setting": s}
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
                ms = bench.graph_replay_ms(engines[s].engine, B, args.replays)[1]
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
