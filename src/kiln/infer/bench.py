"""`kiln bench infer`: the engine's latency and throughput on a model, at several batch sizes.

Each point runs B requests of `prompt_len` random token ids, greedy, `output_len` tokens each (EOS
ignored, so every request runs to its length), through `LLMEngine.step` with a host timer; the engine
copies the sampled ids to the host every step, so step boundaries are synchronized:
    time to first token (TTFT): from submission until every request has its first token (prefill);
    decode tok/s = B * (output_len - 1) / (time after prefill)   (one step = one token per request);
    total tok/s = B * output_len / whole time.
A warm-up point runs first (kernel compilation and autotuning stay out of the numbers). Every point
draws its own random prompts (seeded), so no point hits the prefix cache of another.
"""

from __future__ import annotations

import random
import time

from kiln.infer.engine import LLMEngine
from kiln.infer.sampling_params import SamplingParams
from kiln.model.config import ModelConfig


def qwen2_1p5b_config(max_seq_len: int = 4096) -> ModelConfig:
    """The shape of Qwen2.5-1.5B (3.09 GB of bf16 weights), the decode benchmarks' reference model."""
    return ModelConfig(
        arch="qwen2",
        vocab_size=151936,
        d_model=1536,
        n_layers=28,
        n_heads=12,
        n_kv_heads=2,
        ffn_hidden=8960,
        max_seq_len=max_seq_len,
        norm_eps=1e-6,
        rope_theta=1e6,
        tie_embeddings=True,
        qkv_bias=True,
    )


def measure(engine: LLMEngine, batch: int, prompt_len: int, output_len: int, seed: int = 0) -> dict:
    """One point (see the module docstring); the engine must be idle."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [
        engine.add_request([rng.randrange(engine.vocab_size) for _ in range(prompt_len)], params)
        for _ in range(batch)
    ]
    first = None
    steps = 0
    started: set[str] = set()
    while engine.has_unfinished():
        for out in engine.step():
            if out.outputs[0].token_ids:
                started.add(out.request_id)
        steps += 1
        if first is None and len(started) == len(ids):
            first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    decode_s = end - first
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "steps": steps,
        "ttft_s": round(first - t0, 5),
        "decode_tok_s": round(batch * (output_len - 1) / decode_s, 1) if decode_s > 0 else None,
        "total_tok_s": round(batch * output_len / (end - t0), 1),
        "time_s": round(end - t0, 4),
    }


def run(engine: LLMEngine, batches: list[int], prompt_len: int, output_len: int, log=print) -> list[dict]:
    measure(engine, min(batches), prompt_len, min(output_len, 8), seed=-1)  # warm-up
    rows = []
    for i, b in enumerate(batches):
        row = measure(engine, b, prompt_len, output_len, seed=i)
        log(
            f"batch {b:4d}: TTFT {row['ttft_s'] * 1e3:8.1f} ms  decode {row['decode_tok_s']:9.1f} tok/s  "
            f"total {row['total_tok_s']:9.1f} tok/s  ({row['steps']} steps)"
        )
        rows.append(row)
    return rows
