"""The inference benchmark suite: kiln's engine (CUDA graphs) against its own eager and compiled decode,
a gpt-fast-style compiled static-cache decoder and transformers' `generate`, on random-init Qwen2.5-1.5B
and Qwen3-0.6B shapes, in one process on the H200, with the copy bandwidth and matmul rate measured in the
same run (kiln.profile.ceilings). Method and results: docs/perf/inference.md.

    python bench/infer.py                    # H200, ~9 min (4.5 without --throughput-peers) -> bench/results/infer.json
    python bench/infer.py --parts latency    # one part (latency, steady, throughput; comma-separated)
    python bench/infer.py --smoke            # CPU, tiny models, every part and peer end to end (CI)

1. latency: batch 1, 128-token prompt, 512 greedy tokens: decode tok/s, ms per token, TTFT, and the % of
   the roofline: copy bandwidth / (bytes one step reads: every weight, the tied head once, + the KV cache at
   the mean context of the decode steps).
2. steady: decode at batch 1, 8, 32, 64, 128 after a 1024-token prompt: tok/s over `--timed-steps` steps
   after `--warm-steps`, and the % of the per-step bound max(bytes / copy bandwidth, FLOPs / matmul rate)
   (kiln.infer.bench.decode_step_cost at the measured mean context).
3. throughput (nano-vllm's benchmark): 256 requests, input and output lengths uniform in 100-1024 (seed 0),
   EOS ignored, temperature 0.6, all submitted at once: output tok/s, TTFT / ITL / TPOT p50 and p99, peak
   memory, on Qwen3-0.6B and Qwen2.5-1.5B shapes; graphs and eager engines run one after the other, each
   alone on the GPU with the model's weights (so the peak is its own). The static-batch peers
   (--throughput-peers) take the same requests as one left-padded batch decoded to the longest output: the
   gpt-fast-style decoder all of them, transformers' `generate` the first --hf-requests (its eager steps
   are slow), beside the engine on the same first requests.
4. peers: kiln with decode_backend="eager" and "compile" (the compile engine captures every bucket up to
   --compile-batch with a torch.compile each, so it runs at batch 1 unless asked); the gpt-fast-style
   decoder (bench/peers/gptfast.py, batch 1, a copy of the same weights); transformers' `generate` (eager,
   SDPA, the same weights; --hf-compile adds its static cache + torch.compile). Greedy tokens of every
   decoder are compared with kiln's over the first steps of one prompt (bf16 near-ties are recorded, not
   fatal; a smoke run in float32 must agree exactly).

Configs compared in a part run in interleaved rounds (--rounds, order reversed every round) and report the
median round; transformers runs once per point (it is 10-50x slower: noise does not move a ratio), over
128 new tokens in the latency part (its host-bound rate is flat over these contexts). Every
engine step ends in the engine's one device-to-host copy (the sampled ids), so host timers see whole steps.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gc
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.infer import bench
from kiln.infer.engine import LLM
from kiln.infer.sampling_params import SamplingParams
from kiln.model.config import ModelConfig
from kiln.model.transformer import build_model
from kiln.profile.harness import BenchRun, bench_parser, format_table
from peers import hf as hf_peer
from peers.gptfast import GptFastDecoder

PARTS = ("latency", "steady", "throughput")
THROUGHPUT_PEERS = ("gpt-fast", "hf")  # static-batch peers of the throughput part
BLOCK = 16


@dataclass
class Plan:
    """The sizes of every part (the H200 run's defaults, or the smoke run's tiny ones)."""

    models: dict[str, ModelConfig]  # throughput shapes by name; the first of "main" runs latency/steady
    main: str
    latency_prompt: int = 128
    latency_new: int = 512
    steady_batches: tuple[int, ...] = (1, 8, 32, 64, 128)
    steady_prompt: int = 1024
    warm_steps: int = 16
    timed_steps: int = 64
    hf_steps: int = 32
    hf_latency_new: int = 128  # transformers' batch-1 run: ~17 tok/s, and its rate is flat in context here
    requests: int = 256
    min_len: int = 100
    max_len: int = 1024
    agree_steps: int = 8
    step_budget: int = 8192  # the engine's max_num_batched_tokens (its default)
    throughput_models: tuple[str, ...] = ("qwen3-0.6b", "qwen2.5-1.5b")
    throughput_peers: tuple[str, ...] = ("gpt-fast", "hf")
    # transformers' static batch takes the workload's first requests only: its eager steps are slow
    hf_requests: int = 64


def make_plan(args, smoke: bool) -> Plan:
    if smoke:
        # init_std 0.5: with the default 0.02 this tiny tied model repeats its last prompt token, and the
        # float32 agreement check below would pass whatever the decoders computed
        tiny = dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                    max_seq_len=96, tie_embeddings=True, rope_theta=1e6, init_std=0.5)  # fmt: skip
        models = {
            "tiny-qwen2": ModelConfig(arch="qwen2", qkv_bias=True, **tiny),
            "tiny-qwen3": ModelConfig(arch="qwen3", qk_norm=True, head_dim=16, **tiny),
        }
        # one throughput model (the qwen3 shape: q/k norm) and one round: seconds on a loaded 2-core machine
        args.rounds = 1
        return Plan(models=models, main="tiny-qwen2", latency_prompt=8, latency_new=4, steady_batches=(1, 3),
                    steady_prompt=12, warm_steps=1, timed_steps=2, hf_steps=2, hf_latency_new=4, requests=4, min_len=4,
                    max_len=8, agree_steps=4, step_budget=64, throughput_models=("tiny-qwen3",),
                    hf_requests=3)  # fmt: skip
    names = [n.strip() for n in args.throughput_models.split(",") if n.strip()]
    peers = [n.strip() for n in args.throughput_peers.split(",") if n.strip()]
    if set(peers) - set(THROUGHPUT_PEERS):
        raise SystemExit(
            f"bench/infer.py: --throughput-peers takes {', '.join(THROUGHPUT_PEERS)}, got {peers}"
        )
    unknown = [n for n in names if n not in bench.SHAPES]
    if unknown:
        raise SystemExit(
            f"bench/infer.py: unknown --throughput-models {unknown}: choose from {list(bench.SHAPES)}"
        )
    plan = Plan(models={}, main="qwen2.5-1.5b", steady_batches=tuple(args.steady_batches),
                steady_prompt=args.steady_prompt, warm_steps=args.warm_steps, timed_steps=args.timed_steps,
                hf_steps=args.hf_steps, requests=args.requests, min_len=args.min_len,
                max_len=args.max_len, throughput_models=tuple(names), throughput_peers=tuple(peers),
                hf_requests=args.hf_requests)  # fmt: skip
    ctx = max(
        plan.latency_prompt + plan.latency_new, 2 * plan.max_len, plan.steady_prompt + _steady_new(plan)
    )
    for n in [plan.main, *names]:
        plan.models[n] = bench.SHAPES[n](max_seq_len=_round_up(ctx + BLOCK, BLOCK))
    return plan


def _steady_new(plan: Plan) -> int:
    return bench.steady_tokens(max(plan.steady_batches), plan.steady_prompt, plan.warm_steps, plan.timed_steps,
                               plan.step_budget)  # fmt: skip


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---- engines --------------------------------------------------------------------------------------------
def make_engine(model, dev, backend: str, max_seqs: int, blocks: int, plan: Plan, log) -> tuple[LLM, float]:
    """An engine over `model` with exactly `blocks` KV pages (no memory profiling); returns it and its
    start-up seconds (graph capture, compiles)."""
    t = time.perf_counter()
    llm = LLM(model, log=log, device=str(dev), dtype="bf16" if dev.type == "cuda" else "fp32",
              block_size=BLOCK, num_blocks=blocks, max_num_seqs=max_seqs, max_graph_batch=max_seqs,
              max_num_batched_tokens=plan.step_budget, decode_backend=backend)  # fmt: skip
    return llm, round(time.perf_counter() - t, 1)


def free(compiled: bool = False) -> None:
    """Return the memory of dropped objects to the driver (the caller deletes its references first);
    compiled: also drop torch.compile's caches, whose guards and CUDA-graph pools keep compiled models alive."""
    if compiled:
        torch.compiler.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def interleave(fns: dict[str, Callable[[int], dict]], rounds: int, key: str) -> dict[str, dict]:
    """Run every fn once per round, in an order reversed every round; per name, the round with the median
    `key` and every round's value. A fn that raises is recorded as {"error": ...} and left out after."""
    runs: dict[str, list[dict]] = {n: [] for n in fns}
    errors: dict[str, str] = {}
    order = list(fns)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            if name in errors:
                continue
            try:
                runs[name].append(fns[name](r))
            except Exception as e:  # a peer's failure is a recorded result, not the end of the run
                errors[name] = f"{type(e).__name__}: {e}"[:400]
    out = {}
    for name, rs in runs.items():
        if name in errors:
            out[name] = {"error": errors[name]}
            continue
        ranked = sorted(rs, key=lambda x: x[key])
        out[name] = {**ranked[(len(ranked) - 1) // 2], "rounds": [x[key] for x in rs]}
    return out


def attempt(what: str, fn: Callable[[], object], errors: dict, log) -> object | None:
    """fn(), or None with the error recorded under `what` (a peer that fails must not end the run)."""
    try:
        return fn()
    except Exception as e:
        errors[what] = f"{type(e).__name__}: {e}"[:400]
        log(f"{what}: {errors[what]}")
        return None


def _itemsize(engines: dict[str, LLM]) -> int:
    return next(iter(engines.values())).engine.runner.dtype.itemsize  # weights and KV cache (bf16: 2)


def ratio(a, b) -> float | None:
    return round(a / b, 3) if a and b else None


def pct(x, roof) -> float | None:
    return round(100 * x / roof, 1) if x and roof else None


# ---- parts ----------------------------------------------------------------------------------------------
def latency_part(name, cfg, engines, gf, hf, plan, ceil, args, skipped, log) -> list[dict]:
    P, n = plan.latency_prompt, plan.latency_new
    V = cfg.vocab_size
    dev = next(iter(engines.values())).engine.device
    fns: dict[str, Callable[[int], dict]] = {}
    for cname, llm in engines.items():
        # warm-up: this prompt length's prefill kernels (a failure drops the config, recorded)
        if (
            attempt(f"latency/{cname}", lambda e=llm.engine: bench.measure(e, 1, P, 8, seed=-1), skipped, log)
            is None
        ):
            continue

        def kiln_round(r, eng=llm.engine):
            m = bench.measure(eng, 1, P, n, seed=r)
            return {"tok_s": m["decode_tok_s"], "ttft_s": m["ttft_s"]}

        fns[cname] = kiln_round
    if gf is not None:

        def gf_round(r):
            prompt = torch.tensor(bench.random_prompts(1, P, V, seed=r), device=dev)
            _, t = gf.generate(prompt, n)
            return {"tok_s": round((n - 1) / t["decode_s"], 1), "ttft_s": round(t["ttft_s"], 5)}

        fns["gpt-fast"] = gf_round
    res = interleave(fns, args.rounds, "tok_s")
    prompt = torch.tensor(bench.random_prompts(1, P, V, seed=0), device=dev)
    if hf is not None:
        res["hf"] = attempt(
            "latency/hf", lambda: hf_peer.decode_rate(hf, prompt, plan.hf_latency_new - 1), skipped, log
        ) or {"error": skipped.get("latency/hf")}
        if args.hf_compile:

            def hf_static():
                hf_peer.timed_generate(hf, prompt, 8, static=True)  # the compile, outside the timing
                return hf_peer.decode_rate(hf, prompt, plan.hf_latency_new - 1, static=True)

            what = "latency/hf-static-compile"
            res["hf-static-compile"] = attempt(what, hf_static, skipped, log) or {"error": skipped.get(what)}
    # decode steps feed tokens 1 .. n-1: contexts P+1 .. P+n-1
    cost = bench.decode_step_cost(cfg, 1, P + n / 2, itemsize=_itemsize(engines))
    roof = ceil["copy_Bps"] / cost["bytes"] if ceil["copy_Bps"] else None
    kiln = res.get("kiln", {}).get("tok_s")
    rows = []
    for cname, r in res.items():
        tok_s = r.get("tok_s")
        rows.append({
            "part": "latency", "model": name, "config": cname, "batch": 1, "prompt_len": P,
            "new_tokens": plan.hf_latency_new if cname.startswith("hf") else n,
            "tok_s": tok_s, "ms_per_token": round(1e3 / tok_s, 3) if tok_s else None,
            "ttft_ms": round(r["ttft_s"] * 1e3, 2) if r.get("ttft_s") else None, "rounds_tok_s": r.get("rounds"),
            "step_GB": round(cost["bytes"] / 1e9, 4), "roofline_tok_s": round(roof, 1) if roof else None,
            "pct_roofline": pct(tok_s, roof), "kiln_over_this": ratio(kiln, tok_s), "error": r.get("error"),
        })  # fmt: skip
        log(f"latency {cname}: {tok_s} tok/s ({rows[-1]['pct_roofline']}% of {rows[-1]['roofline_tok_s']})")
    return rows


def steady_part(name, cfg, engines, compile_batch, gf, hf, plan, ceil, args, skipped, log) -> list[dict]:
    P, V = plan.steady_prompt, cfg.vocab_size
    dev = next(iter(engines.values())).engine.device
    rows = []
    for B in plan.steady_batches:
        fns: dict[str, Callable[[int], dict]] = {}
        for cname, llm in engines.items():
            if cname == "kiln-compile" and B > compile_batch:
                continue

            def kiln_round(r, eng=llm.engine, B=B):
                return bench.steady_decode(eng, B, P, plan.warm_steps, plan.timed_steps, seed=1000 * B + r)

            fns[cname] = kiln_round
        if gf is not None and B == gf.batch:

            def gf_round(r, B=B):
                prompt = torch.tensor(bench.random_prompts(B, P, V, seed=1000 * B + r), device=dev)
                _, t = gf.generate(prompt, 1 + plan.timed_steps)
                return {"tok_s": round(B * plan.timed_steps / t["decode_s"], 1)}

            fns["gpt-fast"] = gf_round
        res = interleave(fns, args.rounds, "tok_s")
        if hf is not None:
            prompt = torch.tensor(bench.random_prompts(B, P, V, seed=1000 * B), device=dev)
            res["hf"] = attempt(f"steady/hf/{B}", lambda p=prompt: hf_peer.decode_rate(hf, p, plan.hf_steps),
                                skipped, log) or {"error": skipped.get(f"steady/hf/{B}")}  # fmt: skip
            free()
        ctx = res.get("kiln", {}).get("mean_context") or P + plan.warm_steps + plan.timed_steps / 2
        cost = bench.decode_step_cost(cfg, B, ctx, itemsize=_itemsize(engines))
        bound = bench.step_bound(cost, ceil["copy_Bps"], ceil["matmul_flops"])
        bound_tok_s = B / bound["bound_s"] if bound["bound_s"] else None
        kiln = res.get("kiln", {}).get("tok_s")
        for cname, r in res.items():
            tok_s = r.get("tok_s")
            rows.append({
                "part": "steady", "model": name, "config": cname, "batch": B, "prompt_len": P,
                "mean_context": ctx, "tok_s": tok_s, "rounds_tok_s": r.get("rounds"),
                "step_ms_p50": (r.get("step_ms") or {}).get("p50"), "step_GB": round(cost["bytes"] / 1e9, 4),
                "step_GFLOP": round(cost["flops"] / 1e9, 2), "bound_by": bound["bound_by"],
                "bound_tok_s": round(bound_tok_s, 1) if bound_tok_s else None, "pct_bound": pct(tok_s, bound_tok_s),
                "kiln_over_this": ratio(kiln, tok_s), "error": r.get("error"),
            })  # fmt: skip
        log(f"steady batch {B}: " + ", ".join(f"{c} {r.get('tok_s')}" for c, r in res.items()))
    return rows


def throughput_part(name, cfg, plan, dev, dtype, errors, log) -> list[dict]:
    """The workload through a graphs engine, then an eager one, each alone with the model on the device; then
    the static-batch peers (static_peer_row)."""
    model = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
    reqs = bench.workload(plan.requests, plan.min_len, plan.max_len, cfg.vocab_size, seed=0)
    warm = bench.workload(min(16, plan.requests), plan.min_len, plan.max_len, cfg.vocab_size, seed=1)
    warm = [(p, min(m, 8)) for p, m in warm]  # prefill shapes like the run's, a few decode steps
    blocks = bench.blocks_needed(reqs, BLOCK) + plan.requests
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    k_hf = min(plan.hf_requests, len(reqs)) if "hf" in plan.throughput_peers else 0
    rows = []
    for backend, cname in (("graphs", "kiln"), ("eager", "kiln-eager")):
        llm, startup = make_engine(model, dev, backend, plan.requests, blocks, plan, log)
        bench.drive(llm.engine, warm, bench.NANO_VLLM["temperature"], seed=10_000)
        start = None
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated() / 2**30  # weights + KV cache + graph pool
        r = bench.throughput(llm.engine, reqs, bench.NANO_VLLM["temperature"])
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
        kv = llm.engine.runner.num_blocks * llm.engine.runner.bytes_per_block / 2**30
        rows.append({
            "part": "throughput", "model": name, "config": cname, "startup_s": startup, **r,
            "peak_GiB": round(peak, 2) if peak else None, "allocated_at_start_GiB": round(start, 2) if start else None,
            "weights_GiB": round(weights / 2**30, 2),
            "kv_cache_GiB": round(kv, 2), "kv_blocks": llm.engine.runner.num_blocks,
        })  # fmt: skip
        log(f"throughput {name} {cname}: {r['output_tok_s']} output tok/s, TTFT p50 {r['ttft_s']['p50']} s, "
            f"ITL p50 {r['itl_s']['p50']} s")  # fmt: skip
        if cname == "kiln" and 0 < k_hf < len(reqs):  # the engine on transformers' share of the workload
            r = bench.throughput(llm.engine, reqs[:k_hf], bench.NANO_VLLM["temperature"])
            rows.append({"part": "throughput", "model": name, "config": cname, **r})
            log(f"throughput {name} {cname}, first {k_hf} requests: {r['output_tok_s']} output tok/s")
        del llm
        free()
    for peer in plan.throughput_peers:
        sub = reqs[:k_hf] if peer == "hf" else reqs
        row = attempt(f"throughput/{name}/{peer}", lambda p=peer, q=sub: static_peer_row(p, model, q, dev, log),
                      errors, log)  # fmt: skip
        if row is not None:
            rows.append({"part": "throughput", "model": name, **row})
        free(compiled=peer == "gpt-fast")
    kiln = {row["requests"]: row["output_tok_s"] for row in rows if row["config"] == "kiln"}
    for row in rows:
        row["kiln_over_this"] = ratio(kiln.get(row["requests"]), row["output_tok_s"])
    return rows


def static_peer_row(peer: str, model, reqs: list[tuple[list[int], int]], dev, log) -> dict:
    """A static-batch peer on `reqs` as one batch: the prompts left-padded to the longest, every row decoded
    for the longest output (greedy; the sampled engine's tokens do not change its work). Output tok/s counts
    each request's own output tokens over the batch's whole time (the extra steps of the shorter requests
    are what static batching costs: `padded_tokens`); every request's first token comes after the one
    prefill (TTFT), and each later one after a step of the batch (ITL)."""
    prompts = [p for p, _ in reqs]
    n = max(m for _, m in reqs)
    own = sum(m for _, m in reqs)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    if peer == "gpt-fast":
        dec = GptFastDecoder.from_kiln(model, batch=len(reqs), max_len=max(map(len, prompts)) + n)
        if dev.type == "cuda":
            dec.compile_decode()
            dec.generate_padded(prompts, 4, chunk=64)  # the compile and graph capture, outside the timing
        startup = time.perf_counter() - t
        _, times = dec.generate_padded(prompts, n, chunk=64)
        ttft, total = times["ttft_s"], times["ttft_s"] + times["decode_s"]
        config = "gpt-fast-static"
    else:
        hf = hf_peer.hf_from_kiln(model)
        startup = time.perf_counter() - t
        _, times = hf_peer.static_batch(hf, prompts, n)
        ttft, total = times["ttft_s"], times["total_s"]
        config = "hf-static"
    itl = (total - ttft) / max(n - 1, 1)
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    row = {
        "config": config, "startup_s": round(startup, 1), "requests": len(reqs),
        "input_tokens": sum(map(len, prompts)), "output_tokens": own, "padded_tokens": len(reqs) * n - own,
        "steps": n, "time_s": round(total, 3), "output_tok_s": round(own / total, 1),
        "ttft_s": bench.percentiles([ttft] * len(reqs)), "itl_s": bench.percentiles([itl] * (n - 1)),
        "peak_GiB": round(peak, 2) if peak else None,
    }  # fmt: skip
    log(f"throughput {config} ({len(reqs)} requests, one static batch): {row['output_tok_s']} output tok/s")
    return row


def agreement(model, engines, gf, hf, cfg, plan, dev, strict: bool) -> dict:
    """Greedy tokens of every decoder on one prompt and how many leading tokens equal kiln's; and the peers'
    logits at the prompt's last position against kiln's model (a random model's greedy tokens can be
    degenerate: with the default init std, a tied head mostly predicts the input token again)."""
    prompt = bench.random_prompts(1, plan.latency_prompt, cfg.vocab_size, seed=7)[0]
    k = plan.agree_steps
    params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
    t = torch.tensor([prompt], device=dev)
    decoders = {
        c: (lambda llm=llm: llm.generate(prompt, params)[0].outputs[0].token_ids)
        for c, llm in engines.items()
    }
    if gf is not None:
        decoders["gpt-fast"] = lambda: gf.generate(t, k)[0][0].tolist()
    if hf is not None:
        decoders["hf"] = lambda: hf_peer.timed_generate(hf, t, k)[0][0].tolist()
    tokens, errors = {}, {}
    for c, fn in decoders.items():
        try:
            tokens[c] = fn()
        except Exception as e:  # recorded; the decoder's own part records its failure too
            errors[c] = f"{type(e).__name__}: {e}"[:400]
    with torch.no_grad():
        want = model(t)[0, -1].float()  # (V,) kiln's dense forward
        peer_logits = {}
        if gf is not None:
            peer_logits["gpt-fast"] = gf(t, torch.arange(t.shape[1], device=dev))[0, -1].float()
        if hf is not None:
            peer_logits["hf"] = hf(t).logits[0, -1].float()
        top2 = want.topk(2).values
        logits = {
            "kiln_std": round(float(want.std()), 4),
            "kiln_top2_margin": round(float(top2[0] - top2[1]), 4),
            "max_abs_diff": {c: float((x - want).abs().max()) for c, x in peer_logits.items()},
        }
    ref = tokens.get("kiln", [])
    agree = {
        c: next((i for i, (a, b) in enumerate(zip(ref, toks)) if a != b), min(len(ref), len(toks)))
        for c, toks in tokens.items()
    }
    if strict and (
        errors or min(agree.values()) < k or max(logits["max_abs_diff"].values(), default=0) > 1e-3
    ):
        raise RuntimeError(
            f"float32 decoders disagree with kiln: tokens {tokens}, logits {logits}, errors {errors}"
        )
    return {"steps": k, "tokens": tokens, "equal_prefix": agree, "logits": logits, "errors": errors}


# ---- the run --------------------------------------------------------------------------------------------
def parse_args():
    ap = bench_parser("infer", __doc__)
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per comparison (median)")
    ap.add_argument(
        "--steady-batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 64, 128]
    )
    ap.add_argument("--steady-prompt", type=int, default=1024)
    ap.add_argument("--warm-steps", type=int, default=16)
    ap.add_argument("--timed-steps", type=int, default=64)
    ap.add_argument("--hf-steps", type=int, default=32, help="decode steps timed for transformers per batch")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--throughput-models", default="qwen3-0.6b,qwen2.5-1.5b")
    ap.add_argument("--throughput-peers", default=",".join(THROUGHPUT_PEERS),
                    help="static-batch peers of the throughput workload (comma-separated; '' for none)")  # fmt: skip
    ap.add_argument("--hf-requests", type=int, default=64,
                    help="transformers' static batch: this many of the workload's first requests, beside kiln on them")  # fmt: skip
    ap.add_argument("--compile-batch", type=int, default=1,
                    help="largest batch of the compile engine (one torch.compile per bucket 1, 2, 4, ...)")  # fmt: skip
    ap.add_argument("--no-gptfast", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--hf-compile", action="store_true",
                    help="also transformers with a static cache (auto-compiled) at batch 1 (a minute+ compile)")  # fmt: skip
    args = ap.parse_args()
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = sorted(set(args.parts) - set(PARTS))
    if bad or args.rounds < 1:
        ap.error(f"--parts takes {', '.join(PARTS)} (got {bad}); --rounds >= 1")
    return args


def main() -> int:
    args = parse_args()
    run = BenchRun("infer", __file__, args)
    dev, log = run.device, run.log
    if run.smoke:
        # the CPU machines' 2 cores are shared: under load, OpenMP's worker hand-offs made each tiny batched
        # matmul take ~17 ms instead of ~0.5 (measured on the smoke's model); one thread keeps it to seconds
        torch.set_num_threads(1)
    plan = make_plan(args, run.smoke)
    ceil = {
        "copy_Bps": run.ceilings["copy_TBps"] * 1e12 if run.ceilings.get("copy_TBps") else None,
        "matmul_flops": run.ceilings["bf16_matmul_TFLOPs"] * 1e12 if run.ceilings.get("bf16_matmul_TFLOPs") else None,
    }  # fmt: skip
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}  # a part that raised: its traceback; the run goes on and exits 1
    rows: list[dict] = []
    startup: dict[str, float] = {}
    agree = None

    def save(done: bool) -> None:
        # after every part too: a run cut short (a time cap, a dead machine) keeps what it measured
        run.write(
            complete=done,
            models={n: c.to_dict() for n, c in plan.models.items()},
            main_model=plan.main,
            plan={k: v for k, v in vars(plan).items() if k != "models"},
            weights="random init (kiln's init, seed 0); speed does not depend on the values",
            startup_s=startup,
            agreement=agree,
            skipped=skipped,
            nano_vllm_published=bench.NANO_VLLM_PUBLISHED,
            failed=failed,
            cases=rows,
        )

    def part(label: str, fn: Callable[[], list[dict]]) -> None:
        try:
            rows.extend(fn())
        except Exception:
            failed[label] = traceback.format_exc()[-3000:]
            log(f"{label} FAILED:\n{failed[label]}")
        save(done=False)

    cfg = plan.models[plan.main]
    if "latency" in args.parts or "steady" in args.parts:
        model = build_model(cfg, device=dev, dtype=dtype, seed=0).eval()
        need = [
            B * -(-(plan.steady_prompt + bench.steady_tokens(B, plan.steady_prompt, plan.warm_steps,
                                                             plan.timed_steps, plan.step_budget)) // BLOCK)
            for B in plan.steady_batches
        ]  # fmt: skip
        blocks = max(need + [-(-(plan.latency_prompt + plan.latency_new) // BLOCK)]) + 2 * max(
            plan.steady_batches
        )
        max_seqs = max(plan.steady_batches)
        engines = {}
        for backend, cname, seqs in (("graphs", "kiln", max_seqs), ("eager", "kiln-eager", max_seqs),
                                     ("compile", "kiln-compile", args.compile_batch)):  # fmt: skip
            got = attempt(f"engine/{cname}", lambda b=backend, s=seqs: make_engine(model, dev, b, s, blocks, plan, log),
                          skipped, log)  # fmt: skip
            if got is not None:
                engines[cname], startup[cname] = got
        gf = hf = None
        if not args.no_gptfast:
            max_len = _round_up(
                max(plan.latency_prompt + plan.latency_new, plan.steady_prompt + plan.timed_steps + 1), BLOCK
            )

            def start_gf():
                peer = GptFastDecoder.from_kiln(model, 1, max_len)
                if dev.type == "cuda":  # on the CPU an Inductor compile alone outlasts the smoke budget
                    peer.compile_decode()
                t = time.perf_counter()
                warm = torch.tensor(
                    bench.random_prompts(1, plan.latency_prompt, cfg.vocab_size, -1), device=dev
                )
                peer.generate(warm, 8)
                peer.generate(warm, 8)
                startup["gpt-fast"] = round(time.perf_counter() - t, 1)
                return peer

            gf = attempt("peer/gpt-fast", start_gf, skipped, log)
        else:
            skipped["peer/gpt-fast"] = "--no-gptfast"
        if not args.no_hf:
            hf = attempt("peer/hf", lambda: hf_peer.hf_from_kiln(model), skipped, log)
        else:
            skipped["peer/hf"] = "--no-hf"
        if not args.hf_compile:
            skipped["latency/hf-static-compile"] = (
                "not run without --hf-compile: transformers' compile takes a minute or more, and on 2026-11-29 its "
                "static cache under torch.compile(mode='reduce-overhead') failed on the H200 ('accessing tensor "
                "output of CUDAGraphs that has been overwritten', PLATFORM.md)"
            )
        if args.compile_batch < max_seqs:
            skipped["steady/kiln-compile"] = (
                f"the compile engine runs batches <= --compile-batch {args.compile_batch}: it compiles and "
                "captures every bucket 1, 2, 4, ... up to its largest, one torch.compile each"
            )
        skipped["steady/gpt-fast"] = "batch 1 only: its static cache is compiled for one batch size"
        if "kiln" not in engines:
            failed["engine/kiln"] = skipped.pop("engine/kiln")
        else:

            def agree_part():
                nonlocal agree
                agree = agreement(model, engines, gf, hf, cfg, plan, dev, strict=dtype == torch.float32)
                log(
                    f"agreement over {agree['steps']} greedy steps (equal leading tokens): {agree['equal_prefix']}"
                )
                return []

            part("agreement", agree_part)
            if "latency" in args.parts:
                part(
                    "latency",
                    lambda: latency_part(plan.main, cfg, engines, gf, hf, plan, ceil, args, skipped, log),
                )
            if "steady" in args.parts:
                part("steady", lambda: steady_part(plan.main, cfg, engines, args.compile_batch, gf, hf, plan, ceil,
                                                   args, skipped, log))  # fmt: skip
        del engines, gf, hf, model
        free(compiled=True)
    if "throughput" in args.parts:
        skipped["throughput/kiln-compile"] = (
            "the compile engine is not run on the throughput workload: it would compile 9 buckets"
        )
        for name in plan.throughput_models:  # each model alone on the device: its peak memory is its own
            part(
                f"throughput/{name}",
                lambda n=name: throughput_part(n, plan.models[n], plan, dev, dtype, skipped, log),
            )
            free()
    print_tables(rows)
    save(done=True)
    if failed:
        log(f"parts that failed (tracebacks in the JSON's 'failed'): {', '.join(failed)}")
    return 1 if failed else 0


def print_tables(rows: list[dict]) -> None:
    lat = [r for r in rows if r["part"] == "latency"]
    if lat:
        print(format_table(lat, [("config", "batch 1"), ("tok_s", "tok/s"), ("ms_per_token", "ms/token"),
                                 ("ttft_ms", "TTFT ms"), ("pct_roofline", "% roofline"),
                                 ("kiln_over_this", "kiln / this")]))  # fmt: skip
    steady = [r for r in rows if r["part"] == "steady"]
    if steady:
        table = []
        for B in sorted({r["batch"] for r in steady}):
            by = {r["config"]: r for r in steady if r["batch"] == B}
            k = by.get("kiln", {})
            table.append({
                "batch": B, "bound": k.get("bound_tok_s"), "kiln": k.get("tok_s"), "pct": k.get("pct_bound"),
                **{c: by[c].get("tok_s") for c in ("kiln-eager", "kiln-compile", "gpt-fast", "hf") if c in by},
                "vs_eager": by.get("kiln-eager", {}).get("kiln_over_this"), "vs_hf": by.get("hf", {}).get("kiln_over_this"),
            })  # fmt: skip
        print(format_table(table, [("batch", "batch"), ("bound", "bound tok/s"), ("kiln", "kiln"),
                                   ("pct", "% bound"), ("kiln-eager", "eager"), ("kiln-compile", "compile"),
                                   ("gpt-fast", "gpt-fast"), ("hf", "HF"), ("vs_eager", "kiln / eager"),
                                   ("vs_hf", "kiln / HF")]))  # fmt: skip
    tp = [r for r in rows if r["part"] == "throughput"]
    if tp:
        flat = [{**r, **{f"{m}_{p}": (r[m + "_s"][p] * 1e3 if r[m + "_s"][p] is not None else None)
                         for m in ("ttft", "itl") for p in ("p50", "p99")}} for r in tp]  # fmt: skip
        print(format_table(flat, [("model", "model"), ("config", "config"), ("requests", "requests"),
                                  ("output_tok_s", "output tok/s"),
                                  ("ttft_p50", "TTFT p50 ms"), ("ttft_p99", "TTFT p99 ms"),
                                  ("itl_p50", "ITL p50 ms"), ("itl_p99", "ITL p99 ms"), ("peak_GiB", "peak GiB"),
                                  ("kiln_over_this", "kiln / this")]))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
