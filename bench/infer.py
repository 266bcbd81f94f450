"""Decode speed of kiln's engine against `model.generate` (kiln's dense loop) and transformers' `generate`,
on a random-init Qwen2.5-1.5B-shaped model (3.09 GB of bf16 weights), with the weight-bandwidth roofline
measured in the same run.

    python bench/infer.py [--batches 1,64] [--prompt 128] [--new 128]   # -> bench/results/infer.json
    python bench/infer.py --smoke          # CPU, a tiny model: checks the script end to end

Each figure: greedy, `new` tokens after a `prompt`-token random prompt, B sequences. decode tok/s =
B * (new - 1) / (time after the first token); TTFT = time to the first token of every sequence. Both
loops are bound by the host at these sizes, so the engine and `model.generate` are timed alternately,
`--rounds` times each, and the medians are reported (the spread of each goes into the JSON). The
roofline at batch B is (copy bandwidth) / (weight bytes) steps per second, times B tokens (each step
reads every weight once; the KV cache is small next to them at these lengths).
"""

from __future__ import annotations

import json
import os
import sys
import time

if "--smoke" in sys.argv:  # before triton is imported (the harness's rule)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from kiln.infer import bench
from kiln.infer.engine import LLM
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model
from kiln.profile.harness import BenchRun, bench_parser, format_table


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_generate(fn, dev) -> float:
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t


def dense_loop(model, B, prompt, new, dev, seed) -> dict:
    """kiln's model.generate (a dense (B, T) loop with a contiguous cache): TTFT from a 1-token run."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (B, prompt), generator=g).to(dev)
    ttft = timed_generate(lambda: model.generate(ids, 1, temperature=0.0), dev)
    total = timed_generate(lambda: model.generate(ids, new, temperature=0.0), dev)
    return {"ttft_s": round(ttft, 5), "decode_tok_s": round(B * (new - 1) / (total - ttft), 1)}


def median_of(runs: list[dict]) -> dict:
    """The run with the median decode rate, with every round's rate beside it."""
    ranked = sorted(runs, key=lambda r: r["decode_tok_s"])
    return {**ranked[len(ranked) // 2], "rounds_tok_s": [r["decode_tok_s"] for r in runs]}


def hf_generate(cfg: ModelConfig, B, prompt, new, dev, dtype) -> dict:
    import transformers

    hf_cfg = transformers.Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta, tie_word_embeddings=True,
        rms_norm_eps=cfg.norm_eps,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(dev):
        m = transformers.Qwen2ForCausalLM(hf_cfg).to(dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (B, prompt), device=dev)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        m.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
        ttft = timed_generate(lambda: m.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), dev)
        total = timed_generate(lambda: m.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw), dev)
    return {"ttft_s": round(ttft, 5), "decode_tok_s": round(B * (new - 1) / (total - ttft), 1)}


def main() -> None:
    ap = bench_parser("infer", __doc__)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of engine and model.generate")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    run = BenchRun("infer", __file__, args)
    dev = run.device
    batches = [int(b) for b in args.batches.split(",")]
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if run.smoke:
        cfg = ModelConfig(arch="qwen2", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_hidden=64, max_seq_len=64, qkv_bias=True, tie_embeddings=True)  # fmt: skip
        batches, args.prompt, args.new, args.rounds = [1, 4], 8, 4, 2
    else:
        cfg = bench.qwen2_1p5b_config(max_seq_len=args.prompt + args.new + 16)
    model = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    copy_tbps = run.ceilings.get("copy_TBps")
    llm = LLM(model, device=str(dev), max_num_seqs=max(batches), memory_fraction=0.3, log=run.log,
              num_blocks=None if dev.type == "cuda" else 64)  # fmt: skip
    rows = []
    for B in batches:
        # warm-up of both at this batch size (kernel autotuning per shape), other prompts: no prefix hits
        bench.measure(llm.engine, B, args.prompt, 8, seed=-B)
        dense_loop(model, B, args.prompt, 8, dev, seed=-B)
        engine_runs, dense_runs = [], []
        for r in range(args.rounds):
            e = bench.measure(llm.engine, B, args.prompt, args.new, seed=1000 * B + r)
            engine_runs.append({"ttft_s": e["ttft_s"], "decode_tok_s": e["decode_tok_s"]})
            dense_runs.append(dense_loop(model, B, args.prompt, args.new, dev, seed=1000 * B + r))
        row = {"batch": B, "engine": median_of(engine_runs), "model_generate": median_of(dense_runs)}
        if dev.type == "cuda" and not args.no_hf:
            row["hf_generate"] = hf_generate(cfg, B, args.prompt, args.new, dev, dtype)
        eng = row["engine"]["decode_tok_s"]
        row["engine_vs_model_generate"] = round(eng / row["model_generate"]["decode_tok_s"], 3)
        if "hf_generate" in row:
            row["engine_vs_hf"] = round(eng / row["hf_generate"]["decode_tok_s"], 3)
        if copy_tbps:
            roof = copy_tbps * 1e12 / weight_bytes * B
            row["roofline_tok_s"] = round(roof, 1)
            row["engine_fraction_of_roofline"] = round(eng / roof, 4)
        rows.append(row)
        run.log(json.dumps(row))
    table = [
        {
            "batch": r["batch"],
            "engine": r["engine"]["decode_tok_s"],
            "generate": r["model_generate"]["decode_tok_s"],
            "hf": r.get("hf_generate", {}).get("decode_tok_s"),
            "ratio": r["engine_vs_model_generate"],
            "roofline": r.get("roofline_tok_s"),
        }
        for r in rows
    ]
    cols = [("batch", "batch"), ("engine", "engine tok/s"), ("generate", "model.generate"), ("hf", "HF generate"),
            ("ratio", "engine / generate"), ("roofline", "roofline tok/s")]  # fmt: skip
    print(format_table(table, cols))
    model_name = "tiny (smoke)" if run.smoke else "random-init Qwen2.5-1.5B shape"
    run.write(model=model_name, weight_GB=round(weight_bytes / 1e9, 3), prompt=args.prompt, new=args.new,
              cases=rows)  # fmt: skip


if __name__ == "__main__":
    main()
