"""`kiln run`: the whole pipeline, corpus -> tokenizer -> token shards -> training -> samples.

A run directory holds everything one run makes:
    .lock              held (fcntl.flock) by the one process writing the run; see kiln.io.lock
    config.json        the resolved config
    stages.json        the data/tokenizer configs the tokenizer and shards were made with (reuse check)
    tokenizer/         the trained BPE tokenizer
    data/              train/val token shards and meta.json
    checkpoints/       step_*.pt and LATEST.json
    metrics.jsonl      one record per log interval and per validation
    loss.png           train and validation loss curves
    summary.json       final figures and the time each stage took
Stages whose outputs exist with the same settings are reused, so `--resume` and re-runs skip them.
A fresh run refuses a directory that holds an earlier run's training outputs unless told `--overwrite`;
`--resume` refuses any change to a setting the checkpoint depends on (train/config.py: RESUMABLE).
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from kiln.config import format_config, to_dict
from kiln.data.corpus import load_documents
from kiln.data.loader import TokenLoader
from kiln.data.pysources import held_out, load_python_corpus
from kiln.data.shards import load_meta, prepare_shards, read_shard, split_documents
from kiln.dist.hang import collective_errors
from kiln.errors import KilnError
from kiln.io.atomic import atomic_write_text
from kiln.io.checkpoint import POINTER, latest_pointer, list_checkpoints
from kiln.io.lock import DirLock
from kiln.model import build_model
from kiln.tokenizer import Tokenizer, train_bpe
from kiln.train.checkpoint import choose_resume_checkpoint, set_aside_later
from kiln.train.config import RunConfig, resume_changes
from kiln.train.env import DistEnv, dist_env, init_distributed, resolve_device
from kiln.train.evaluate import token_byte_lengths, unigram_bpb
from kiln.train.generate import complete
from kiln.train.loop import Trainer, autocast_dtype
from kiln.train.optim import OptimConfig, build_optimizer


def _say(env: DistEnv, msg: str) -> None:
    if env.is_main:
        print(msg, flush=True)


def stage_settings(cfg: RunConfig) -> dict:
    """The settings the tokenizer and shards depend on, as stages.json records them (the reuse check)."""
    data = to_dict(cfg.data)
    if not data.get("min_zlib_bpb"):  # added later: off, it must not make older runs' stages differ
        data.pop("min_zlib_bpb", None)
    return {"data": data, "tokenizer": to_dict(cfg.tokenizer)}


def prepare_tokenizer_and_data(
    cfg: RunConfig, run_dir: Path, progress: bool = True, resume: bool = False
) -> None:
    """Stages 1-3 (rank 0): read the corpus, train the tokenizer, write the shards, or reuse them.

    A resumed run only reuses: its checkpoints were trained on these ids, so a missing or different
    tokenizer is an error, never a rebuild.
    """
    env = DistEnv()
    stages = stage_settings(cfg)
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
    if resume:
        raise KilnError(
            f"cannot resume {run_dir}: its tokenizer and token shards are missing or were made with other "
            f"settings than its checkpoints ({stages_path}); restore them, or start a new run"
        )
    # the old outputs are about to change: forget their settings first, so that a crash part-way can
    # never pair a new tokenizer with the old stages.json
    stages_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    corpus = None
    if cfg.data.packages is not None:
        _say(
            env,
            f"[1/5] reading Python sources: the stdlib, pydoc_data, {', '.join(cfg.data.packages) or '-'}",
        )
        names, docs, corpus = load_python_corpus(cfg.data.packages, cfg.data.max_bytes, cfg.data.min_zlib_bpb)
        is_val = [held_out(n, cfg.data.val_fraction) for n in names]
        if all(is_val) or not any(is_val):
            raise KilnError(
                f"data.val_fraction={cfg.data.val_fraction} holds out {sum(is_val)} of {len(docs)} files: each "
                "split needs one at least; raise data.max_bytes, or change data.val_fraction"
            )
        _say(
            env,
            f"      corpus list sha256 {corpus['list_sha256'][:16]}, text sha256 {corpus['text_sha256'][:16]}",
        )
        if "dropped_files" in corpus:
            _say(
                env,
                f"      left out {corpus['dropped_files']} files ({corpus['dropped_bytes'] / 1e6:.1f} MB) that zlib "
                f"compresses below data.min_zlib_bpb={corpus['min_zlib_bpb']} bits per byte",
            )
    else:
        src = cfg.data.path or "the bundled corpus (Python stdlib sources + pydoc_data)"
        _say(env, f"[1/5] reading {src}")
        docs = load_documents(cfg.data.path, cfg.data.max_bytes)
        is_val = split_documents(len(docs), cfg.data.val_fraction, cfg.data.seed)
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    _say(env, f"      {len(docs)} documents, {n_bytes / 1e6:.1f} MB ({time.perf_counter() - t0:.1f}s)")

    t0 = time.perf_counter()
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
    meta = prepare_shards(
        docs,
        tok,
        data_dir,
        cfg.data.val_fraction,
        cfg.data.seed,
        progress=progress,
        is_val=is_val,
        corpus=corpus,
    )
    tr, va = meta["splits"]["train"], meta["splits"]["val"]
    _say(
        env,
        f"      train {tr['tokens']:,} tokens ({tr['docs']} docs), val {va['tokens']:,} tokens ({va['docs']} docs), "
        f"{tr['bytes'] / max(1, tr['tokens']):.2f} bytes/token ({time.perf_counter() - t0:.1f}s)",
    )
    atomic_write_text(stages_path, json.dumps(stages, indent=2))


def _shard_paths(data_dir: Path, meta: dict, split: str) -> list[Path]:
    return [data_dir / name for name in meta["splits"][split]["shards"]]


# what an earlier attempt at a run leaves besides its reusable stages (tokenizer/, data/, stages.json)
OUTPUTS = ("checkpoints", "metrics.jsonl", "summary.json", "loss.png", "config.json")


def _earlier_outputs(run_dir: Path) -> list[Path]:
    found = [run_dir / name for name in OUTPUTS if (run_dir / name).exists()]
    ckpts = run_dir / "checkpoints"
    if ckpts in found and not any(ckpts.iterdir()):
        found.remove(ckpts)
    # config.json alone is the trace of an attempt that failed before training: not worth a refusal
    return [] if [p.name for p in found] == ["config.json"] else found


def run(
    cfg: RunConfig,
    resume: bool = False,
    progress: bool = True,
    stop_at: int | None = None,
    overwrite: bool = False,
    resume_from: str | None = None,
) -> dict:
    """Run the pipeline; returns the summary (also written to summary.json).

    stop_at: leave after this step with a checkpoint, as a job that runs out of its time slot would;
    `--resume` continues exactly where it stopped. resume_from: a step number or a .pt file to resume
    from instead of the newest intact checkpoint (implies resume). overwrite: a fresh run first deletes
    an earlier run's outputs in the directory (its reusable tokenizer and shards stay).
    """
    resume = resume or resume_from is not None
    if resume and overwrite:
        raise KilnError("--resume and --overwrite contradict each other: pass one")
    if stop_at is not None and stop_at < 0:
        raise KilnError(f"--stop-at must be a step number >= 0, got {stop_at}")
    env = dist_env()
    if not env.distributed:
        # one process: the parallel.* sizes are checked as torchrun's ranks check them (before anything is
        # written), so that --parallel.tp=2 without torchrun is an error naming the launch, not a silent
        # one-process run
        from kiln.dist.parallel_dims import ParallelDims

        ParallelDims.resolve(cfg.parallel, 1, cfg.model)
    device = resolve_device(cfg.device, env)
    run_dir = Path(cfg.out_dir)
    ckpt_dir = run_dir / "checkpoints"
    if resume and not (ckpt_dir / POINTER).exists() and not list_checkpoints(ckpt_dir):
        raise KilnError(f"nothing to resume: {ckpt_dir} holds no checkpoint (run without --resume to start)")
    # one writer per run directory: rank 0, the only rank that writes, holds the lock for the whole run
    # (released on return, or by the kernel when the process dies)
    lock = DirLock(run_dir) if env.is_main else None
    if lock is not None:
        lock.acquire()
        if lock.previous is not None:
            print(
                f"warning: taking over the stale lock of process {lock.previous[0]} in {run_dir} "
                "(it is no longer running)",
                flush=True,
            )
    try:
        init_distributed(env, device, cfg.parallel.hang_timeout_s if env.distributed else None)
        # a failed collective becomes one error line naming the rank (only a distributed run has them)
        guard = collective_errors(env.rank, cfg.parallel.hang_timeout_s) if env.distributed else nullcontext()
        with guard:
            return _run(cfg, env, device, run_dir, resume, progress, stop_at, overwrite, resume_from)
    finally:
        if lock is not None:
            lock.release()


def _check_resume(cfg: RunConfig, env: DistEnv, ckpt: dict, file: Path, stop_at: int | None) -> str | None:
    """Refuse a resume that would change what the checkpoint means; a message when nothing is left to do."""
    _, refused = resume_changes(ckpt["config"], cfg)
    sharded = bool(ckpt.get("sharded"))
    if sharded:  # dcp shards reshard onto any mesh: the parallel layout may change, the data may not
        refused = [c for c in refused if not c[0].startswith("parallel.")]
    if refused:
        changes = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in refused)
        raise KilnError(
            f"--resume cannot change settings the checkpoint {file.name} was trained with ({changes}). "
            "Drop those overrides to continue the run, or start a new one (another --out, or --overwrite) "
            "to use them"
        )
    world = ckpt.get("world_size")
    if sharded:
        from kiln.dist.parallel_dims import ParallelDims

        dp = ParallelDims.resolve(cfg.parallel, env.world_size).dp
        if int(ckpt["dp_size"]) != dp:
            raise KilnError(
                f"{file.name} was written with {ckpt['dp_size']} data-parallel rank(s) and this resume has {dp}: "
                "the global batch and each rank's data would change; change the mesh keeping the "
                "data-parallel size (parallel.dp_replicate x parallel.dp_shard), or start a new run"
            )
    elif world is not None and int(world) != env.world_size:
        raise KilnError(
            f"{file.name} was written by {world} process(es) and this resume has {env.world_size}: the global "
            f"batch and each rank's data would change; resume with {world} process(es) (torchrun "
            f"--nproc_per_node={world}), or start a new run"
        )
    step = int(ckpt["step"])
    if cfg.train.steps < step:
        raise KilnError(
            f"train.steps={cfg.train.steps} is below the checkpoint's step {step}: to continue pass "
            f"--train.steps above {step}; to go back, --resume-from an earlier checkpoint"
        )
    if cfg.train.steps == step:
        return f"the run in {cfg.out_dir} already finished at step {step}: nothing to do (raise --train.steps to go on)"
    if stop_at is not None and stop_at < step:
        raise KilnError(f"--stop-at {stop_at} is before the checkpoint's step {step}")
    if stop_at == step:
        return f"the run in {cfg.out_dir} is already at step {step} (--stop-at {stop_at}): nothing to do"
    return None


def _run(
    cfg: RunConfig,
    env: DistEnv,
    device: torch.device,
    run_dir: Path,
    resume: bool,
    progress: bool,
    stop_at: int | None,
    overwrite: bool,
    resume_from: str | None,
) -> dict:
    ckpt_dir = run_dir / "checkpoints"
    ckpt = ckpt_file = None
    if resume:  # every rank reads the same files and takes the same decisions
        ckpt, ckpt_file = choose_resume_checkpoint(ckpt_dir, resume_from, device, lambda m: _say(env, m))
        if ckpt.get("sharded"):  # a dcp checkpoint: its shards are the directory beside the .pt
            shards = ckpt_file.parent / ckpt["sharded"]
            if not (shards / ".metadata").is_file():
                raise KilnError(
                    f"{ckpt_file.name} names the sharded checkpoint {shards}, which is missing or incomplete: "
                    "restore it, or --resume-from an earlier step"
                )
            if not env.distributed:
                raise KilnError(
                    f"{ckpt_file.name} is a sharded (dcp) checkpoint: resume it under torchrun (any mesh with "
                    f"the same data-parallel size), or export it with `kiln convert {shards} OUT`"
                )
            ckpt["sharded"] = str(shards)
        done = _check_resume(cfg, env, ckpt, ckpt_file, stop_at)
        if done is not None:
            _say(env, done)
            if env.distributed:
                torch.distributed.destroy_process_group()
            try:
                return json.loads((run_dir / "summary.json").read_text())
            except (OSError, ValueError):  # stopped before its end, so no summary yet
                return {"steps": int(ckpt["step"])}
    elif env.is_main:
        earlier = _earlier_outputs(run_dir)
        if earlier and not overwrite:
            try:
                pointer = latest_pointer(ckpt_dir) if ckpt_dir.is_dir() else None
            except KilnError:  # a corrupt pointer: the file list below says enough
                pointer = None
            what = f"checkpoint at step {pointer['step']}" if pointer else ", ".join(p.name for p in earlier)
            raise KilnError(
                f"{run_dir} already holds a run ({what}): pass --resume to continue it, --overwrite to "
                "delete it and start over, or choose another --out"
            )
        for p in earlier:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        if earlier:
            print(f"--overwrite: deleted {', '.join(p.name for p in earlier)} in {run_dir}", flush=True)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if resume:
            allowed, refused = resume_changes(ckpt["config"], cfg)
            moved = [c for c in refused if ckpt.get("sharded") and c[0].startswith("parallel.")]
            for key, old, new in allowed + moved:
                print(f"resume: {key} changed from {old!r} to {new!r}", flush=True)
        atomic_write_text(run_dir / "config.json", format_config(cfg) + "\n")
        print(f"kiln run -> {run_dir} on {device} ({env.world_size} process(es))")
        print(format_config(cfg), flush=True)

    t0 = time.perf_counter()
    if env.is_main:  # other ranks wait for rank 0 to write the tokenizer and shards, then read them
        prepare_tokenizer_and_data(cfg, run_dir, progress, resume)
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
    # the model and how it spreads over the processes (kiln.dist): the loader slices each global batch
    # by data-parallel rank only (the ranks of one tensor-parallel group read the same rows)
    torch.manual_seed(tc.seed)
    strategy = None
    if env.distributed:
        from kiln.dist.strategy import build_parallel

        param_dtype = torch.bfloat16 if autocast_dtype(tc.dtype, device) is not None else None
        model, strategy = build_parallel(
            cfg.model, cfg.parallel, env.rank, env.world_size, device, tc.seed, param_dtype
        )
        _say(env, f"      parallel: {strategy.dims.describe()}")
        from kiln.dist.memory import estimate, format_estimate

        est = estimate(cfg.model, strategy.dims, tc.batch_size, tc.seq_len, cfg.parallel.activation_checkpoint,
                       2 if param_dtype is not None else 4)  # fmt: skip
        _say(env, f"      per-rank memory, estimated: {format_estimate(est)}")
        dp_rank, dp_size = strategy.dp_rank, strategy.dp_size
    else:
        model = build_model(cfg.model, device=device, dtype=torch.float32, seed=tc.seed)
        dp_rank, dp_size = 0, 1
    train_loader = TokenLoader(
        _shard_paths(data_dir, meta, "train"),
        tc.batch_size,
        tc.seq_len,
        seed=tc.seed,
        rank=dp_rank,
        world_size=dp_size,
    )
    # the validation set is the first eval_batches global batches; each rank evaluates its slice
    val_loader = TokenLoader(
        _shard_paths(data_dir, meta, "val"),
        tc.batch_size,
        tc.seq_len,
        shuffle=False,
        rank=dp_rank,
        world_size=dp_size,
    )
    val_batches = [val_loader.next_batch() for _ in range(min(tc.eval_batches, val_loader.batches_per_epoch))]
    byte_lengths = token_byte_lengths(tok)
    # the unigram baseline on the same (global) validation windows
    whole_val = TokenLoader(
        _shard_paths(data_dir, meta, "val"), tc.batch_size * dp_size, tc.seq_len, shuffle=False
    )
    baseline = unigram_bpb(
        (read_shard(p) for p in _shard_paths(data_dir, meta, "train")),
        torch.cat([whole_val.next_batch()[1].flatten() for _ in val_batches]).numpy(),
        byte_lengths,
    )

    ocfg = OptimConfig(
        tc.lr,
        tc.weight_decay,
        tc.beta1,
        tc.beta2,
        tc.eps,
        tc.optimizer,
        tc.muon_lr,
        tc.muon_momentum,
        tc.muon_ns_steps,
        tc.muon_weight_decay,
        tc.embed_lr,
    )
    if tc.optimizer == "muon" and strategy is not None and (strategy.sharded or strategy.zero1):
        # Newton-Schulz needs each whole matrix: a shard's polar factor is not a slice of the whole one's
        raise KilnError(
            "train.optimizer=muon needs whole matrices on every rank: run it on one process or with plain "
            "data parallelism (no FSDP, tensor parallelism or ZeRO-1), or use train.optimizer=adamw"
        )
    if strategy is not None:  # after sharding: the optimizer holds the shards (ZeRO-1 shards its state)
        optimizer = strategy.build_optimizer(model, lambda m: build_optimizer(m, ocfg))
    else:
        optimizer = build_optimizer(model, ocfg)
    peak = None
    if device.type == "cuda":
        from kiln.profile.ceilings import matmul_flops

        peak = matmul_flops(device)
    n_params = sum(p.numel() for p in model.parameters())
    _say(
        env,
        f"[4/5] training a {cfg.model.arch} model of {n_params / 1e6:.2f}M parameters for {tc.steps} steps "
        f"({tc.batch_size * tc.seq_len * tc.grad_accum * dp_size:,} tokens/step); "
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
        strategy=strategy,
    )
    if resume:
        trainer.load_state_dict(ckpt)
        del ckpt
        _say(env, f"      resumed from step {trainer.state.step} ({ckpt_file})")
        if env.is_main:
            for moved in set_aside_later(ckpt_dir, trainer.state.step):
                print(f"      set aside the later checkpoint {moved.name} (kept, not used)", flush=True)
    elif stop_at == 0:
        trainer.save()  # the untrained state, so that --resume starts from exactly here
    t0 = time.perf_counter()
    last = trainer.fit(stop_at)
    timings["train_s"] = time.perf_counter() - t0

    samples = []
    want_samples = bool(cfg.sample.prompts) and cfg.sample.max_new_tokens > 0
    if want_samples and strategy is not None and strategy.gathers:
        # sample from whole weights: every rank joins the gather, rank 0 builds a one-process model
        full, _ = strategy.full_state(model, None)
        if env.is_main:
            model = build_model(cfg.model, device=device, dtype=torch.float32, seed=tc.seed)
            model.load_state_dict(full)
        del full
    if env.is_main and want_samples:
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
        "corpus": meta.get("corpus"),  # the Python-sources corpus's fingerprint (data.packages), else None
        # train.target_val_bpb / max_time_s: why the run stopped early ("target", "time", or None), and the
        # training seconds (compile included, evaluation and checkpoints not) at its last evaluation
        "target_val_bpb": tc.target_val_bpb,
        "stop": last.get("stop"),
        "train_time_s": last.get("train_time_s"),
        "device": str(device),
        "timings": timings,
        "samples": samples,
    }
    if env.is_main:
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        val = (
            f"val bpb {summary['val_bpb']:.4f}"
            if summary["val_bpb"] is not None
            else f"no validation yet at step {trainer.state.step} (train.eval_interval={tc.eval_interval})"
        )
        print(
            f"done: {val} (unigram {baseline:.4f}); total {timings['total_s']:.0f}s; outputs in {run_dir}",
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
