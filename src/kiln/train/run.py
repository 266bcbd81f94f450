"""`kiln run`: the whole pipeline, corpus -> tokenizer -> token shards -> training -> samples.

A run directory holds everything one run makes:
    config.json        the resolved config
    stages.json        the data/tokenizer configs the tokenizer and shards were made with (reuse check)
    tokenizer/         the trained BPE tokenizer
    data/              train/val token shards and meta.json
    checkpoints/       step_*.pt and LATEST.json
    metrics.jsonl      one record per log interval and per validation
    loss.png           train and validation loss curves
    summary.json       final figures and the time each stage took
Stages whose outputs exist with the same settings are reused, so `--resume` and re-runs skip them.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch

from kiln.config import format_config, to_dict
from kiln.data.corpus import load_documents
from kiln.data.loader import TokenLoader
from kiln.data.shards import load_meta, prepare_shards, read_shard, split_documents
from kiln.errors import KilnError
from kiln.model import build_model
from kiln.tokenizer import Tokenizer, train_bpe
from kiln.train.checkpoint import latest_pointer, load_checkpoint
from kiln.train.config import RunConfig
from kiln.train.env import DistEnv, dist_env, init_distributed, resolve_device
from kiln.train.evaluate import token_byte_lengths, unigram_bpb
from kiln.train.generate import complete
from kiln.train.loop import Trainer
from kiln.train.optim import OptimConfig, build_optimizer


def _say(env: DistEnv, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


def prepare_tokenizer_and_data(cfg: RunConfig, run_dir: Path, progress: bool = True) -> None:
    """Stages 1-3 (rank 0): read the corpus, train the tokenizer, write the shards, or reuse them."""
    env = DistEnv()
    stages = {"data": to_dict(cfg.data), "tokenizer": to_dict(cfg.tokenizer)}
    stages_path = run_dir / "stages.json"
    tok_dir, data_dir = run_dir / "tokenizer", run_dir / "data"
    done = (
        stages_path.exists()
        and json.loads(stages_path.read_text()) == stages
        and (data_dir / "meta.json").exists()
    )
    if done:
        _say(env, f"[1-3/5] reusing the tokenizer and token shards in {run_dir}")
        return
    t0 = time.perf_counter()
    src = cfg.data.path or "the bundled corpus (Python stdlib sources + pydoc_data)"
    _say(env, f"[1/5] reading {src}")
    docs = load_documents(cfg.data.path, cfg.data.max_bytes)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    _say(env, f"      {len(docs)} documents, {n_bytes / 1e6:.1f} MB ({time.perf_counter() - t0:.1f}s)")

    t0 = time.perf_counter()
    is_val = split_documents(len(docs), cfg.data.val_fraction, cfg.data.seed)
    train_docs = [d for d, v in zip(docs, is_val) if not v]
    budget = cfg.tokenizer.train_bytes
    sample, seen = [], 0
    for d in train_docs:  # the tokenizer never sees validation text
        if budget is not None and seen >= budget:
            break
        sample.append(d)
        seen += len(d.encode("utf-8"))
    _say(
        env,
        f"[2/5] training a byte-level BPE tokenizer to {cfg.tokenizer.vocab_size} tokens on {seen / 1e6:.1f} MB",
    )
    tok = train_bpe(
        sample,
        vocab_size=cfg.tokenizer.vocab_size,
        pattern=cfg.tokenizer.pattern,
        special_tokens=tuple(cfg.tokenizer.special_tokens),
        progress=progress,
    )
    tok.save(tok_dir)
    _say(env, f"      done in {time.perf_counter() - t0:.1f}s -> {tok_dir}")

    t0 = time.perf_counter()
    _say(
        env,
        f"[3/5] tokenizing into shards ({cfg.data.val_fraction:.0%} of documents held out for validation)",
    )
    meta = prepare_shards(docs, tok, data_dir, cfg.data.val_fraction, cfg.data.seed, progress=progress)
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    _say(
        env,
        f"      train {tr['tokens']:,} tokens ({tr['docs']} docs), val {va['tokens']:,} tokens ({va['docs']} docs), "
        f"{tr['bytes'] / max(1, tr['tokens']):.2f} bytes/token ({time.perf_counter() - t0:.1f}s)",
    )
    stages_path.write_text(json.dumps(stages, indent=2))


def _shard_paths(data_dir: Path, meta: dict, split: str) -> list[Path]:
    return [data_dir / name for name in meta["splits"][split]["shards"]]


def run(cfg: RunConfig, resume: bool = False, progress: bool = True, stop_at: int | None = None) -> dict:
    """Run the pipeline; returns the summary (also written to summary.json).

    stop_at: leave after this step with a checkpoint, as a job that runs out of its time slot would;
    `--resume` continues exactly where it stopped.
    """
    env = dist_env()
    device = resolve_device(cfg.device, env)
    init_distributed(env, device)
    run_dir = Path(cfg.out_dir)
    ckpt_dir = run_dir / "checkpoints"
    pointer = latest_pointer(ckpt_dir) if ckpt_dir.exists() else None
    if resume and pointer is None:
        raise KilnError(f"nothing to resume: {ckpt_dir} holds no checkpoint (run without --resume to start)")
    if not resume and pointer is not None:
        raise KilnError(
            f"{run_dir} already holds a run (checkpoint at step {pointer['step']}): pass --resume to continue it, "
            f"or choose another --out"
        )
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(format_config(cfg) + "\n")
        print(f"kiln run -> {run_dir} on {device} ({env.world_size} process(es))")
        print(format_config(cfg), flush=True)

    t0 = time.perf_counter()
    if env.is_main:  # other ranks wait for rank 0 to write the tokenizer and shards, then read them
        prepare_tokenizer_and_data(cfg, run_dir, progress)
    if env.distributed:
        torch.distributed.barrier()
    tok = Tokenizer.load(run_dir / "tokenizer")
    timings["data_and_tokenizer_s"] = time.perf_counter() - t0
    if tok.n_vocab != cfg.model.vocab_size:
        raise KilnError(
            f"the tokenizer has {tok.n_vocab} tokens but model.vocab_size is {cfg.model.vocab_size}"
        )
    data_dir = run_dir / "data"
    meta = load_meta(data_dir)
    tc = cfg.train
    train_loader = TokenLoader(
        _shard_paths(data_dir, meta, "train"),
        tc.batch_size,
        tc.seq_len,
        seed=tc.seed,
        rank=env.rank,
        world_size=env.world_size,
    )
    # the validation set is the first eval_batches global batches; each rank evaluates its slice
    val_loader = TokenLoader(
        _shard_paths(data_dir, meta, "val"),
        tc.batch_size,
        tc.seq_len,
        shuffle=False,
        rank=env.rank,
        world_size=env.world_size,
    )
    val_batches = [val_loader.next_batch() for _ in range(min(tc.eval_batches, val_loader.batches_per_epoch))]
    byte_lengths = token_byte_lengths(tok)
    # the unigram baseline on the same (global) validation windows
    whole_val = TokenLoader(
        _shard_paths(data_dir, meta, "val"), tc.batch_size * env.world_size, tc.seq_len, shuffle=False
    )
    baseline = unigram_bpb(
        (read_shard(p) for p in _shard_paths(data_dir, meta, "train")),
        torch.cat([whole_val.next_batch()[1].flatten() for _ in val_batches]).numpy(),
        byte_lengths,
    )

    torch.manual_seed(tc.seed)
    model = build_model(cfg.model, device=device, dtype=torch.float32, seed=tc.seed)
    optimizer = build_optimizer(model, OptimConfig(tc.lr, tc.weight_decay, tc.beta1, tc.beta2, tc.eps))
    peak = None
    if device.type == "cuda":
        from kiln.profile.ceilings import matmul_flops

        peak = matmul_flops(device)
    n_params = sum(p.numel() for p in model.parameters())
    _say(
        env,
        f"[4/5] training a {cfg.model.arch} model of {n_params / 1e6:.2f}M parameters for {tc.steps} steps "
        f"({tc.batch_size * tc.seq_len * tc.grad_accum * env.world_size:,} tokens/step); "
        f"unigram baseline {baseline:.3f} bits/byte"
        + (f"; MFU vs measured bf16 matmul {peak / 1e12:.0f} TFLOP/s" if peak else ""),
    )
    trainer = Trainer(
        cfg,
        model,
        optimizer,
        train_loader,
        val_batches,
        byte_lengths,
        device,
        env,
        run_dir,
        peak_flops=peak,
        progress=progress,
    )
    if resume:
        ckpt = load_checkpoint(ckpt_dir, map_location=device)
        trainer.load_state_dict(ckpt)
        _say(env, f"      resumed from step {trainer.state.step} ({ckpt_dir / pointer['file']})")
    t0 = time.perf_counter()
    last = trainer.fit(stop_at)
    timings["train_s"] = time.perf_counter() - t0

    samples = []
    if env.is_main and cfg.sample.prompts and cfg.sample.max_new_tokens > 0:
        _say(env, "[5/5] samples")
        sc = cfg.sample
        gen = torch.Generator(device=device).manual_seed(sc.seed)
        for prompt in sc.prompts:
            text = complete(
                model, tok, prompt, sc.max_new_tokens, sc.temperature, sc.top_k, sc.top_p, gen, device
            )
            samples.append({"prompt": prompt, "completion": text})
            print(f"--- prompt {prompt!r}\n{prompt}{text}\n", flush=True)
    timings["total_s"] = time.perf_counter() - t_start
    summary = {
        "steps": trainer.state.step,
        "tokens": trainer.state.tokens,
        "params": n_params,
        "final_train_loss": last.get("loss"),
        "val_loss": last.get("val_loss"),
        "val_bpb": last.get("val_bpb"),
        "unigram_val_bpb": baseline,
        "device": str(device),
        "timings": timings,
        "samples": samples,
    }
    if env.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(
            f"done: val bpb {summary['val_bpb']:.4f} (unigram {baseline:.4f}); "
            f"total {timings['total_s']:.0f}s; outputs in {run_dir}",
            flush=True,
        )
    if env.distributed:
        # DDP's reducer holds the process group: free it first. Left to run()'s return, the reducer's
        # destructor tears the gloo group down while holding the GIL its threads wait for (a hang).
        del trainer
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return summary
