"""Decode speed of kiln's engine against `model.generate` (kiln's dense loop) and transformers' `generate`,
on a random-init Qwen2.5-1.5B-shaped model (3.09 GB of bf16 weights), with the weight-bandwidth roofline
measured in the same run.

    python bench/infer.py --out bench/results/infer.json [--batches 1,64] [--prompt 128] [--new 128]
    python bench/infer.py --smoke          # CPU, a tiny model: checks the script end to end

Each figure: greedy, `new` tokens after a `prompt`-token random prompt, B sequences. decode tok/s =
B * (new - 1) / (time after the first token); TTFT = time to the first token of every sequence. The
roofline at batch B is (copy bandwidth) / (weight bytes) steps per second, times B tokens (each step
reads every weight once; the KV cache is small next to them at these lengths).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kiln.infer import bench
from kiln.infer.engine import LLM
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model
from provenance import run_meta


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_generate(fn, dev) -> float:
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t


def dense_loop(model, B, prompt, new, dev) -> dict:
    """kiln's model.generate (a dense (B, T) loop with a contiguous cache): TTFT from a 1-token run."""
    ids = torch.randint(0, model.config.vocab_size, (B, prompt), device=dev)
    model.generate(ids, 2, temperature=0.0)  # warm-up
    ttft = timed_generate(lambda: model.generate(ids, 1, temperature=0.0), dev)
    total = timed_generate(lambda: model.generate(ids, new, temperature=0.0), dev)
    return {"ttft_s": round(ttft, 5), "decode_tok_s": round(B * (new - 1) / (total - ttft), 1)}


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny model, a few tokens")
    ap.add_argument("--out")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.smoke:
        cfg = ModelConfig(arch="qwen2", vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                          ffn_hidden=64, max_seq_len=64, qkv_bias=True, tie_embeddings=True)  # fmt: skip
        batches, args.prompt, args.new = [1, 4], 8, 4
    else:
        cfg = bench.qwen2_1p5b_config(max_seq_len=args.prompt + args.new + 16)
    model = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {**run_meta(), "model": "random-init Qwen2.5-1.5B shape" if not args.smoke else "tiny (smoke)"}
    result.update(weight_GB=round(weight_bytes / 1e9, 3), prompt=args.prompt, new=args.new)
    copy_bw = None
    if dev.type == "cuda":
        from kiln.profile.ceilings import copy_bandwidth

        copy_bw = copy_bandwidth(dev)
        result["copy_TBps"] = round(copy_bw / 1e12, 3)
    llm = LLM(
        model,
        device=str(dev),
        max_num_seqs=max(batches),
        memory_fraction=0.3,
        num_blocks=None if dev.type == "cuda" else 64,
    )
    rows = []
    bench.measure(llm.engine, 1, args.prompt, 8, seed=-1)  # warm-up: other prompts, no prefix hits (compiles and autotunes the kernels)
    for B in batches:
        row = {"batch": B}
        e = bench.measure(llm.engine, B, args.prompt, args.new, seed=B)
        row["engine"] = {"ttft_s": e["ttft_s"], "decode_tok_s": e["decode_tok_s"]}
        row["model_generate"] = dense_loop(model, B, args.prompt, args.new, dev)
        if dev.type == "cuda" and not args.no_hf:
            row["hf_generate"] = hf_generate(cfg, B, args.prompt, args.new, dev, dtype)
        row["engine_vs_model_generate"] = round(
            row["engine"]["decode_tok_s"] / row["model_generate"]["decode_tok_s"], 3
        )
        if "hf_generate" in row:
            row["engine_vs_hf"] = round(row["engine"]["decode_tok_s"] / row["hf_generate"]["decode_tok_s"], 3)
        if copy_bw:
            roof = copy_bw / weight_bytes * B
            row["roofline_tok_s"] = round(roof, 1)
            row["engine_fraction_of_roofline"] = round(row["engine"]["decode_tok_s"] / roof, 4)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["points"] = rows
    print(f"{'batch':>6} {'engine tok/s':>13} {'generate':>10} {'HF':>10} {'eng/gen':>8} {'roofline':>9}")
    for r in rows:
        hf = r.get("hf_generate", {}).get("decode_tok_s", float("nan"))
        print(
            f"{r['batch']:>6} {r['engine']['decode_tok_s']:>13.1f} {r['model_generate']['decode_tok_s']:>10.1f} "
            f"{hf:>10.1f} {r['engine_vs_model_generate']:>8.2f} {r.get('roofline_tok_s', float('nan')):>9.1f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
