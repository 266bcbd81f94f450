"""`kiln bench infer` and bench/infer.py: the engine's latency, steady-state decode and throughput, the
workloads they run, the percentile summary, and the per-step cost model behind the % of roofline.

Every measurement drives `LLMEngine.step` with a host timer. The engine copies the sampled ids to the host
once per step, so step boundaries are synchronized and wall time between them is the step's time.

- `measure` (latency): B requests of `prompt_len` random ids, greedy, `output_len` tokens each (EOS
  ignored): time to first token (TTFT, submission until every request has its first token) and
  decode tok/s = B * (output_len - 1) / (time after the first token), one step = one token per request.
- `steady_decode`: B requests prefilled, `warm_steps` decode steps, then `timed_steps` timed decode steps
  in which every request runs (the batch stays B): tok/s = B * timed_steps / their time, and the mean
  context (keys per sequence) of those steps, for the cost model.
- `throughput` (nano-vllm's benchmark): every request of a `workload` submitted at once and run to its
  end; output tok/s = output tokens / wall time; per request TTFT (the engine's RequestOutput.metrics),
  the gaps between its tokens as the driver saw them (ITL: one token per step) and its mean time per
  output token (TPOT).
- `decode_step_cost`: the bytes a decode step reads and the FLOPs it does, from the model's shape.

Random prompts are drawn per point from a seed, so no point hits the prefix cache of another.
"""

from __future__ import annotations

import random
import time

import torch

from kiln.infer.engine import LLMEngine
from kiln.infer.sampling_params import SamplingParams
from kiln.model.config import ModelConfig

# nano-vllm's bench.py: 256 sequences, input and output lengths uniform in [100, 1024], EOS ignored,
# temperature 0.6; its README reports 1434 output tok/s for Qwen3-0.6B on a laptop RTX 4070 (vLLM 1362)
NANO_VLLM = {"requests": 256, "min_len": 100, "max_len": 1024, "temperature": 0.6}
NANO_VLLM_PUBLISHED = {
    "model": "Qwen3-0.6B",
    "gpu": "RTX 4070 laptop",
    "nano_vllm_tok_s": 1434,
    "vllm_tok_s": 1362,
}


# ---- model shapes ------------------------------------------------------------------------------------------
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


def qwen3_0p6b_config(max_seq_len: int = 4096) -> ModelConfig:
    """The shape of Qwen3-0.6B (1.19 GB of bf16 weights, 0.31 GB of them the tied head): nano-vllm's
    throughput model. head_dim 128 with d_model 1024 and 16 heads: the attention is wider than the stream."""
    return ModelConfig(
        arch="qwen3",
        vocab_size=151936,
        d_model=1024,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        ffn_hidden=3072,
        max_seq_len=max_seq_len,
        norm_eps=1e-6,
        rope_theta=1e6,
        tie_embeddings=True,
        qk_norm=True,
    )


SHAPES = {"qwen2.5-1.5b": qwen2_1p5b_config, "qwen3-0.6b": qwen3_0p6b_config}


# ---- workloads ---------------------------------------------------------------------------------------------
def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `prompt_len` ids uniform in [0, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs, both lengths uniform in [lo, hi] (nano-vllm's benchmark with
    lo=100, hi=1024). Drawn in bench/serve.py's order (prompt length, its ids, output length), so the same
    seed gives the same requests there."""
    if not 1 <= lo <= hi:
        raise ValueError(f"workload lengths need 1 <= lo <= hi, got lo={lo}, hi={hi}")
    rng = random.Random(seed)
    return [
        ([rng.randrange(vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi)) for _ in range(n)
    ]


def blocks_needed(requests: list[tuple[list[int], int]], block_size: int) -> int:
    """KV pages that hold every request at its full length at once (no preemption)."""
    return sum(-(-(len(p) + m) // block_size) for p, m in requests)


def percentiles(xs: list[float]) -> dict:
    """{"n", "mean", "p50", "p90", "p99", "max"} of xs (nearest rank, as bench/serve.py); None values
    when xs is empty."""
    if not xs:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]

    return {
        "n": len(s),
        "mean": round(sum(s) / len(s), 6),
        "p50": round(q(0.5), 6),
        "p90": round(q(0.9), 6),
        "p99": round(q(0.99), 6),
        "max": round(s[-1], 6),
    }


# ---- the cost model ----------------------------------------------------------------------------------------
def decode_step_cost(cfg: ModelConfig, batch: int, mean_context: float, itemsize: int = 2) -> dict:
    """Bytes read and FLOPs of one decode step of `batch` sequences with `mean_context` keys each.

    bytes: every weight once (the tied head's V x d matrix once: the embedding lookup reads only B rows of
    it; an untied embedding table is not counted for the same reason), plus each sequence's K and V over
    all layers at its context. Activations (a few MB) are left out. FLOPs: 2 per weight multiply-add per
    token (active_matmul_params, the head included) plus attention's QK^T and PV, 4 * L * Hq * hd per key.
    """
    counts = cfg.param_counts()
    weights = cfg.num_params() - (0 if cfg.tie_embeddings else counts["embedding"])
    weight_bytes = weights * itemsize
    kv_bytes = batch * mean_context * 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize
    flops = batch * (
        2.0 * cfg.active_matmul_params() + 4.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * mean_context
    )
    return {
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_bytes,
        "bytes": weight_bytes + kv_bytes,
        "flops": flops,
    }


def step_bound(cost: dict, copy_Bps: float | None, matmul_flops: float | None) -> dict:
    """The per-step time bound: max(bytes / copy bandwidth, FLOPs / matmul rate), both measured in the run;
    None without them (a CPU run)."""
    if not copy_Bps or not matmul_flops:
        return {"bound_s": None, "bytes_s": None, "flops_s": None, "bound_by": None}
    bytes_s, flops_s = cost["bytes"] / copy_Bps, cost["flops"] / matmul_flops
    return {
        "bound_s": max(bytes_s, flops_s),
        "bytes_s": bytes_s,
        "flops_s": flops_s,
        "bound_by": "bytes" if bytes_s >= flops_s else "flops",
    }


# ---- measurements ------------------------------------------------------------------------------------------
def measure(engine: LLMEngine, batch: int, prompt_len: int, output_len: int, seed: int = 0) -> dict:
    """One latency point (see the module docstring); the engine must be idle."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(batch, prompt_len, engine.vocab_size, seed)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
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


def steady_decode(
    engine: LLMEngine, batch: int, prompt_len: int, warm_steps: int, timed_steps: int, seed: int = 0
) -> dict:
    """Decode tok/s of `batch` sequences at ~prompt_len context (see the module docstring); the engine must
    be idle, and is left idle (the requests are aborted after the timed steps)."""
    budget = engine.scheduler.config.max_num_batched_tokens
    max_tokens = steady_tokens(batch, prompt_len, warm_steps, timed_steps, budget)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_prompts(batch, prompt_len, engine.vocab_size, seed)]
    n_out = dict.fromkeys(ids, 0)
    try:
        while min(n_out.values()) == 0:
            for out in engine.step():
                n_out[out.request_id] = len(out.outputs[0].token_ids)
        for _ in range(warm_steps):
            for out in engine.step():
                n_out[out.request_id] = len(out.outputs[0].token_ids)
        start_out = dict(n_out)
        step_s = []
        for i in range(timed_steps):
            t = time.perf_counter()
            outs = engine.step()
            step_s.append(time.perf_counter() - t)
            if len(outs) != batch or any(o.finished for o in outs):
                raise RuntimeError(
                    f"steady_decode: timed step {i} ran {len(outs)} of {batch} sequences (a preemption or "
                    f"an early finish): give the engine more KV blocks or fewer steps"
                )
            for out in outs:
                n_out[out.request_id] = len(out.outputs[0].token_ids)
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
    total = sum(step_s)
    # a step feeding a sequence's k-th output token attends prompt_len + k keys
    mean_context = prompt_len + sum(start_out.values()) / batch + (timed_steps + 1) / 2
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "warm_steps": warm_steps,
        "timed_steps": timed_steps,
        "mean_context": round(mean_context, 1),
        "tok_s": round(batch * timed_steps / total, 1),
        "step_ms": percentiles([s * 1e3 for s in step_s]),
    }


def graph_replay_ms(engine: LLMEngine, batch: int, n: int) -> tuple[int | None, float | None]:
    """(bucket, ms per step) of the decode graph that serves `batch` sequences, replayed n times back to back
    on the static inputs the last step left (the GPU's own time for the step, no host work); (None, None)
    without CUDA graphs (the CPU, decode_backend="eager") or for n <= 0."""
    graphs = engine.runner.graphs
    if n <= 0 or graphs is None or not graphs.use_graphs:
        return None, None
    B = graphs.bucket(batch)
    g = graphs.graphs[B]
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    return B, start.elapsed_time(end) / n


def steady_tokens(batch: int, prompt_len: int, warm_steps: int, timed_steps: int, step_budget: int) -> int:
    """The output length `steady_decode` gives each request: the warm and timed steps, plus one step per
    prefill chunk (sequences prefilled in earlier chunks decode while later ones prefill), plus slack, so no
    request finishes inside the timed window. The slack of 4: one step more of prefill than the estimate
    (the decodes of the first prompts take some of each step's budget), and, with asynchronous
    scheduling, a step launched one ahead of what the engine has reported."""
    return warm_steps + timed_steps + -(-batch * prompt_len // step_budget) + 4


def drive(
    engine: LLMEngine, requests: list[tuple[list[int], int]], temperature: float, seed: int = 0
) -> dict:
    """Submit every (prompt, output length) request at once, EOS ignored, and step the engine until all
    finish. Returns the wall time and, per request, its output length, the engine's metrics and the
    host-side gaps between its tokens."""
    params = [
        SamplingParams(max_tokens=m, temperature=temperature, ignore_eos=True, seed=seed + i)
        for i, (_, m) in enumerate(requests)
    ]
    t0 = time.perf_counter()
    ids = [engine.add_request(p, sp) for (p, _), sp in zip(requests, params)]
    seen: dict[str, int] = dict.fromkeys(ids, 0)
    last: dict[str, float] = {}
    gaps: dict[str, list[float]] = {r: [] for r in ids}
    done = {}
    steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        steps += 1
        for out in outs:
            rid = out.request_id
            n = len(out.outputs[0].token_ids)
            if n > seen[rid]:
                if rid in last:  # one gap per step that brought tokens (one token per decode step)
                    gaps[rid].append(now - last[rid])
                last[rid], seen[rid] = now, n
            if out.finished:
                done[rid] = out
    wall = time.perf_counter() - t0
    return {
        "time_s": wall,
        "steps": steps,
        "requests": [
            {"output_tokens": seen[r], "metrics": dict(done[r].metrics), "itl_s": gaps[r]} for r in ids
        ],
    }


def throughput(
    engine: LLMEngine, requests: list[tuple[list[int], int]], temperature: float, seed: int = 0
) -> dict:
    """nano-vllm's throughput figure and the latency percentiles of one `drive` (module docstring)."""
    run = drive(engine, requests, temperature, seed)
    reqs = run["requests"]
    n_out = sum(r["output_tokens"] for r in reqs)
    n_in = sum(len(p) for p, _ in requests)
    wall = run["time_s"]
    return {
        "requests": len(requests),
        "input_tokens": n_in,
        "output_tokens": n_out,
        "steps": run["steps"],
        "time_s": round(wall, 6),  # to the microsecond: a short run's rate is computed from it to 0.1%
        "output_tok_s": round(n_out / wall, 1),
        "total_tok_s": round((n_in + n_out) / wall, 1),
        "ttft_s": percentiles([r["metrics"]["ttft_s"] for r in reqs if "ttft_s" in r["metrics"]]),
        "itl_s": percentiles([g for r in reqs for g in r["itl_s"]]),
        "tpot_s": percentiles([r["metrics"]["tpot_s"] for r in reqs if "tpot_s" in r["metrics"]]),
        "e2e_s": percentiles([r["metrics"]["e2e_s"] for r in reqs if "e2e_s" in r["metrics"]]),
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
