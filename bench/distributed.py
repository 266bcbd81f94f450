"""Distributed training throughput, memory and early-loss parity of every kiln.dist scheme, on 1..N GPUs.

    python bench/distributed.py --suite ws1                   # one GPU: issue 20's figures (~400 s)
    python bench/distributed.py --suite multi --nprocs 8      # 8 GPUs: the scaling run (issue 22)
    python bench/distributed.py --suite multi --nprocs 4 --models 1b --budget 500
    python bench/distributed.py --smoke                       # 2 gloo CPU processes, tiny model (CI)

The script spawns its own processes (one per GPU, NCCL; gloo on the CPU with --smoke): run it with
plain `python`, not under torchrun. Each group of cases runs in one spawned world; a case that fails
takes its world down, is recorded with its error, and the next case starts in a fresh world.

Every case trains the same model from the same one-process initialization (kiln.dist.parallelize's
seed state, built on the CPU) on the same synthetic global batches (arithmetic sequences mod the
vocabulary: learnable, so the loss moves), with kiln's AdamW, warmup + cosine schedule and clipping
at 1.0, bf16 autocast over fp32 master weights as `kiln run` trains on CUDA (FSDP2 gets
MixedPrecisionPolicy(bf16, fp32 reduce) as `kiln run` gives it). A step is kiln.train.loop's
`Trainer.train_step` for every scheme but the pipelines (which `kiln run` does not drive yet: their
step is the same sequence around kiln.dist.pipeline's `Pipeline.step`).

Suites:
- ws1 (issue 20, one GPU, the gpu preset shape 32 x 1024): plain training (kiln run's one-process path),
  the same batch as two accumulated halves (the bf16 noise floor of the loss comparison), DDP and FSDP2
  on a world of 1 (the goal: <= 3% cost), plain with q/k/v and gate/up unmerged (as FSDP2 runs them),
  activation checkpointing selective / full, plain again (drift between the first and last
  measurement), the ~350M and ~1B models at sequence 2048, and last torch.compile (--train.compile).
- multi (issue 22, N GPUs): NCCL collectives from 1 KB to 1 GB (kiln.dist.collectives_bench, as
  `kiln bench collectives`), then per model: the 1-GPU reference on the same global batch (N
  accumulated micro-batches) and its noise floor (2N micro-batches of half the size), DDP, ZeRO-1, ZeRO-2, FSDP2, TP=N, TP=N + SP, PP=N 1F1B, PP=N interleaved
  (recorded "not available" while kiln.dist.pipeline has no interleaved schedule), and the hybrid
  FSDP2 (N/2) x TP 2 + SP; for the MoE model (Mixtral-style, 8 experts top-2) the same (TP splits its
  experts by expert over the tp ranks), and FSDP2 with expert parallel over N and N/2 ranks.

Columns: tokens/s (global, and per GPU), MFU per GPU against the dense bf16 spec (989.5 TFLOP/s) and
against the bf16 matmul rate measured at the start of the run (kiln.profile.ceilings.matmul_flops),
peak memory (the largest rank's torch.cuda.max_memory_allocated) beside kiln.dist.memory's estimate,
the largest |loss difference| over the first --steps steps against the reference case, and scaling
efficiency = tokens/s on N GPUs / (N x the 1-GPU reference's tokens/s). Throughput is the median of
rounds of --round-steps steps after --warmup steps (the first steps compile kernels).

--budget S: no case starts after S seconds; the rest are recorded as skipped. The goals of the issues
(wrapper cost <= 3% at world 1; DDP / FSDP2 scaling >= 90%) are printed and stored under "goals". Results go through the
profile harness's writer with provenance to bench/results/distributed-ws1.json or
distributed-<N>gpu.json (a temporary directory with --smoke unless --out is given).
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before anything imports triton (the harness's rule)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib
import functools
import gc
import json
import statistics
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from kiln.profile.harness import bench_parser, default_out, format_table

SEED = 1337
GIB = 1024**3

# name -> (ModelConfig fields, micro-batch sequences per GPU, sequence length)
MODELS = {
    # the gpu preset's model and batch (src/kiln/configs/gpu.json, vocabulary as its tokenizer's)
    "gpu": (dict(arch="llama", vocab_size=16384, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4,
                 ffn_hidden=2048, max_seq_len=1024), 32, 1024),
    # ~350M: PLATFORM.md's 350M shape with 8 KV heads, so that tp = 8 keeps whole GQA groups
    "350m": (dict(arch="llama", vocab_size=32768, d_model=1024, n_layers=24, n_heads=16, n_kv_heads=8,
                  ffn_hidden=2816, max_seq_len=2048), 8, 2048),
    # ~1.1B: Llama-3.2-1B's blocks (d 2048, 16 layers, 32 / 8 heads, FFN 8192), a 32768 vocabulary, untied
    "1b": (dict(arch="llama", vocab_size=32768, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8,
                ffn_hidden=8192, max_seq_len=2048), 4, 2048),
    # --smoke: seconds on two CPU processes; 4 layers so pp = 2 and 4 split them, 4 / 2 heads for tp = 2
    "tiny": (dict(arch="llama", vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                  ffn_hidden=128, max_seq_len=32), 4, 32),
    # MoE (expert parallel): Mixtral-style, 8 experts top-2, ~1.2B parameters of which ~0.4B active a token.
    # The load-balancing loss is off: each rank computes it over its own micro-batch, so with it on no
    # data-parallel case could match the one-GPU losses (tests/dist/test_parity.py)
    "moe": (dict(arch="mixtral", vocab_size=32768, d_model=1024, n_layers=16, n_heads=16, n_kv_heads=8,
                 ffn_hidden=2816, n_experts=8, n_experts_per_tok=2, router_aux_loss_coef=0.0,
                 max_seq_len=2048), 4, 2048),
    "tiny_moe": (dict(arch="mixtral", vocab_size=512, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                      ffn_hidden=128, n_experts=4, n_experts_per_tok=2, router_aux_loss_coef=0.0,
                      max_seq_len=32), 4, 32),
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One measurement: a scheme on `world` processes. `batch` sequences per micro-batch per
    data-parallel rank, `accum` micro-batches per step (pipelines: accum 1 and the schedule splits the
    rank's rows into parallel.microbatches)."""

    name: str
    model: str
    world: int
    kind: str  # ceilings, plain, ddp1, fsdp1, mesh, pipeline
    batch: int = 0
    accum: int = 1
    parallel: dict = field(default_factory=dict)
    ac: str = "none"
    compile: bool = False
    unmerge: bool = False  # one process: q/k/v and gate/up as separate Linears, as FSDP2 and TP run them
    ref: str | None = None  # the case whose losses and (x world) tokens/s this one is compared to


@dataclass(frozen=True)
class Settings:
    steps: int
    warmup: int
    round_steps: int
    dtype: str  # bf16 (autocast, fp32 master weights) or fp32
    lr: float
    lr_warmup: int
    case_timeout_s: float


# ---- data --------------------------------------------------------------------------------------------------
class SyntheticBatches:
    """The loader a Trainer reads: this rank's (batch, T) slice of each step's global batch.

    The global batch of a step is `rows` sequences of arithmetic progressions mod V (random start and
    stride per row, from the step's seed), the same for every scheme. Micro-batch m of data-parallel
    rank r reads rows [(m * dp + r) * batch, + batch): equal slices, so the mean over micro-batches and
    ranks is the mean over the global batch, whatever the split."""

    def __init__(self, vocab: int, seq: int, batch: int, accum: int, dp_rank: int, dp_size: int):
        self.vocab, self.seq, self.batch, self.accum = vocab, seq, batch, accum
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.rows = batch * accum * dp_size
        self.calls = 0
        self._step, self._tokens = -1, None

    def global_batch(self, step: int):

        if step != self._step:
            g = torch.Generator().manual_seed(SEED + step)
            start = torch.randint(0, self.vocab, (self.rows, 1), generator=g)
            stride = torch.randint(1, 64, (self.rows, 1), generator=g)
            self._tokens = (start + stride * torch.arange(self.seq + 1)) % self.vocab  # (rows, T + 1)
            self._step = step
        return self._tokens

    def next_batch(self):
        step, micro = divmod(self.calls, self.accum)
        self.calls += 1
        lo = (micro * self.dp_size + self.dp_rank) * self.batch
        t = self.global_batch(step)[lo : lo + self.batch]
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()


# ---- one case, on every rank of its world ------------------------------------------------------------------
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _build(case: Case, s: Settings, rank: int, world: int, device):
    """(model, strategy, pipeline or None) for `case`, built as `kiln run` builds it."""
    import torch.nn as nn

    from kiln.dist.parallel_dims import ParallelConfig, ParallelDims
    from kiln.dist.parallelize import LossModule, checkpoint_blocks, load_full_state, parallelize_pipeline
    from kiln.dist.strategy import Strategy, build_parallel
    from kiln.dist.tp import unmerge_projections
    from kiln.model import ModelConfig, build_model
    from kiln.model.transformer import Transformer

    mcfg = ModelConfig(**MODELS[case.model][0])
    param_dtype = torch.bfloat16 if s.dtype == "bf16" else None
    pcfg = ParallelConfig(**case.parallel, activation_checkpoint=case.ac)
    one = ParallelDims(1, 1, 1, 1, 0, False, "1f1b", 1)
    if case.kind == "mesh":  # kiln run under torchrun: kiln.dist.strategy.build_parallel
        model, strategy = build_parallel(mcfg, pcfg, rank, world, device, SEED, param_dtype)
        return model, strategy, None
    if case.kind == "pipeline":  # as build_parallel would, through parallelize_pipeline
        dims = ParallelDims.resolve(pcfg, world, mcfg)
        mesh = dims.build_mesh(device.type)
        full = build_model(mcfg, device="cpu", seed=SEED).state_dict()
        with torch.device("meta"):
            model = Transformer(mcfg)
        stage, pipe = parallelize_pipeline(model, dims, pcfg, mesh, device, full, param_dtype)
        return stage, Strategy(stage, dims, mesh, rank), pipe
    # one process: kiln run's path (the model as is), initialized on the CPU so that it starts from the
    # same weights as the sharded cases (a CUDA generator draws other numbers from the same seed)
    if case.kind in ("plain", "ddp1"):
        model = build_model(mcfg, device="cpu", seed=SEED).to(device)
        # kiln run applies parallel.activation_checkpoint through parallelize (several processes); on one
        # process the bench applies the same function to the same blocks
        if case.unmerge:
            unmerge_projections(model)
        checkpoint_blocks(model.model.layers, case.ac)
        if case.kind == "plain":
            return model, None, None  # the Trainer wraps it as kiln run does (LossModule, no wrapper)
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped: nn.Module = DDP(
            LossModule(model), device_ids=[device.index] if device.type == "cuda" else None
        )
    elif case.kind == "fsdp1":
        # FSDP2 over a mesh of one rank: ParallelDims refuses dp_shard = 1 for zero 3 (nothing to shard),
        # so these are parallelize's FSDP2 calls on a one-rank mesh, in its order
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        full = build_model(mcfg, device="cpu", seed=SEED).state_dict()
        with torch.device("meta"):
            model = Transformer(mcfg)
        unmerge_projections(model)
        wrapped = LossModule(model)
        checkpoint_blocks(model.model.layers, case.ac)
        mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("dp_shard",))
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        for block in model.model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(wrapped, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
        wrapped.to_empty(device=device)
        load_full_state(model, full)
        del full
        one = ParallelDims(1, 1, 1, 1, 3, False, "1f1b", 1)
    else:
        raise ValueError(f"unknown case kind {case.kind!r}")
    strategy = Strategy(wrapped, one, None, rank)
    # take the multi-process path on one rank (loss all-reduce; FSDP2's norm over DTensor shards), so
    # the cost measured is the cost the schemes pay on N
    strategy.distributed = True
    return model, strategy, None


def _pipeline_step(pipe, strategy, stage, optimizer, scheduler, loader, device, amp):
    """Trainer.train_step's sequence for a pipeline: the schedule runs forward and backward over the
    micro-batches, then global-norm clipping, the loss average, the optimizer and the schedule."""
    x, y = loader.next_batch()
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    with torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext():
        loss = pipe.step(x, y)
    strategy.clip_grad_norm_(stage.parameters(), 1.0)
    strategy.reduce_loss(loss)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return loss


def run_case(case: Case, s: Settings, rank: int, world: int, device, tmp: str) -> dict:
    """Train case for s.steps steps; rank 0 returns its figures (other ranks return {})."""
    import torch.distributed as dist

    from kiln.dist.memory import estimate
    from kiln.dist.parallel_dims import ParallelConfig, ParallelDims
    from kiln.errors import KilnError
    from kiln.model import ModelConfig
    from kiln.train.config import RunConfig, TokenizerConfig, TrainConfig
    from kiln.train.env import DistEnv
    from kiln.train.loop import Trainer
    from kiln.train.optim import OptimConfig, WarmupCosine, build_optimizer

    if case.kind == "ceilings":  # the bf16 matmul rate and copy bandwidth of this run's GPU (rank 0's)
        from kiln.profile.ceilings import measure_ceilings

        return measure_ceilings(device) if rank == 0 else {}
    if case.kind == "collectives":  # kiln.dist.collectives_bench on this world (`kiln bench collectives`)
        from kiln.dist import collectives_bench as cb

        smoke = device.type != "cuda"
        sizes = cb.sizes_between(1 << 10, 64 << 10, factor=8) if smoke else cb.sizes_between(1 << 10, 1 << 30)
        rows = cb.measure(sizes, device, rounds=2 if smoke else 3, smoke=smoke)
        if rank != 0:
            return {}
        rows, fits = cb.summarize(rows)
        return {"p": world, "fits": fits, "cases": rows}
    t_setup = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    spec, _, seq = MODELS[case.model]
    mcfg = ModelConfig(**spec)
    amp = torch.bfloat16 if s.dtype == "bf16" else None
    tc = TrainConfig(steps=s.steps, batch_size=case.batch, seq_len=seq, grad_accum=case.accum, lr=s.lr,
                     warmup_steps=s.lr_warmup, grad_clip=1.0, dtype=s.dtype, compile=case.compile,
                     seed=SEED, log_interval=s.steps, eval_interval=s.steps, ckpt_interval=s.steps)  # fmt: skip
    ocfg = OptimConfig(tc.lr, tc.weight_decay, tc.beta1, tc.beta2, tc.eps)
    try:
        model, strategy, pipe = _build(case, s, rank, world, device)
    except (KeyError, NotImplementedError, KilnError) as e:
        # every rank fails alike while building (no collective yet), so the world can go on
        if case.parallel.get("pp_schedule") != "interleaved_1f1b":
            raise
        why = f"kiln.dist.pipeline builds no interleaved 1F1B schedule ({type(e).__name__}: {e})"
        return {"status": "not available", "why": why} if rank == 0 else {}
    if strategy is None:
        optimizer = build_optimizer(model, ocfg)
    else:  # after sharding: the optimizer holds the shards (ZeRO-1 shards its state)
        optimizer = strategy.build_optimizer(model, lambda m: build_optimizer(m, ocfg))
    dims = strategy.dims if strategy is not None else ParallelDims(1, 1, 1, 1, 0, False, "1f1b", 1)
    dp_rank = strategy.dp_rank if strategy is not None else 0
    loader = SyntheticBatches(mcfg.vocab_size, seq, case.batch, case.accum, dp_rank, dims.dp)
    trainer = None
    if pipe is None:
        cfg = RunConfig(out_dir=tmp, device=str(device), tokenizer=TokenizerConfig(vocab_size=mcfg.vocab_size),
                        model=mcfg, train=tc, parallel=ParallelConfig(**case.parallel, activation_checkpoint=case.ac))  # fmt: skip
        env = DistEnv(rank, rank, world)
        trainer = Trainer(cfg, model, optimizer, loader, [], None, device, env, Path(tmp), progress=False,
                          strategy=strategy)  # fmt: skip
        step = trainer.train_step
    else:
        scheduler = WarmupCosine(optimizer, tc.lr, tc.warmup_steps, tc.steps, tc.min_lr_ratio)
        step = functools.partial(
            _pipeline_step, pipe, strategy, model, optimizer, scheduler, loader, device, amp
        )

    _sync(device)
    setup_s = time.perf_counter() - t_setup
    losses, rounds = [], []
    t0 = t_round = time.perf_counter()
    warmup_s = None
    for i in range(s.steps):
        if i == s.warmup:
            _sync(device)
            t_round = time.perf_counter()
            warmup_s = t_round - t0
        out = step()
        losses.append((out[0] if isinstance(out, tuple) else out).detach().float().reshape(()))
        done = i + 1 - s.warmup
        if done > 0 and done % s.round_steps == 0:
            _sync(device)
            now = time.perf_counter()
            rounds.append((now - t_round) / s.round_steps)
            t_round = now
    losses = [float(v) for v in torch.stack(losses).cpu()]
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    peaks = [None] * world
    dist.all_gather_object(peaks, peak)
    est_dims = dims
    if case.kind == "fsdp1":
        est_dims = ParallelDims(1, 1, 1, 1, 3, False, "1f1b", 1)
    est = estimate(mcfg, est_dims, case.batch if pipe is None else case.batch // dims.microbatches, seq,
                   case.ac, 2 if amp is not None else 4)  # fmt: skip
    if case.compile:
        torch._dynamo.reset()
    # free the case before the next: DDP's reducer holds the process group (kiln.train.run frees it first)
    del trainer, model, optimizer, strategy, pipe, step
    gc.collect()
    if rank != 0:
        return {}
    step_s = statistics.median(rounds) if rounds else None
    tokens_per_step = loader.rows * seq
    tps = tokens_per_step / step_s if step_s else None
    return {
        "scheme": dims.describe() if case.kind in ("mesh", "pipeline") else case.kind,
        "global_batch": loader.rows,
        "seq_len": seq,
        "tokens_per_step": tokens_per_step,
        "params": sum(v for v in mcfg.param_counts().values()),
        "flops_per_token": mcfg.flops_per_token(seq),
        "setup_s": round(setup_s, 2),
        "warmup_s": round(warmup_s, 2) if warmup_s is not None else None,
        "step_ms": round(step_s * 1e3, 3) if step_s else None,
        "rounds_ms": [round(r * 1e3, 3) for r in rounds],
        "tokens_per_s": round(tps, 1) if tps else None,
        "tokens_per_s_per_gpu": round(tps / world, 1) if tps else None,
        "peak_mem_gib": round(max(peaks), 3) if peak is not None else None,
        "peak_mem_gib_per_rank": [round(p, 3) for p in peaks] if peak is not None else None,
        "est_mem_gib": round(est["total"] / GIB, 3),
        "losses": losses,
    }


def _write_json(path: str, doc: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def worker(rank: int, world: int, backend: str, tmp: str, cases: list[Case], s: Settings, deadline: float):
    """One spawned rank: join the world, run the cases in order; rank 0 writes <i>.json per case. An
    error writes err.<rank> and ends the process (the parent restarts the rest in a new world)."""
    import torch.distributed as dist

    # the host's cores are shared by the ranks (each builds the full CPU init state at start-up)
    torch.set_num_threads(1 if backend == "gloo" else max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{tmp}/init", rank=rank, world_size=world,
                            timeout=timedelta(seconds=s.case_timeout_s))  # fmt: skip
    i = 0
    try:
        for i, case in enumerate(cases):
            go = [time.time() < deadline]
            dist.broadcast_object_list(go, src=0)  # rank 0's clock decides, so every rank stops together
            if not go[0]:
                break
            result = run_case(case, s, rank, world, device, tmp)
            if rank == 0:
                _write_json(os.path.join(tmp, f"{i}.json"), result)
            dist.barrier()
    except BaseException as e:  # noqa: BLE001 (recorded for the parent, then this world ends)
        msg = f"{type(e).__name__}: {e}".strip()
        tail = traceback.format_exc().strip().splitlines()[-12:]
        _write_json(os.path.join(tmp, f"err.{rank}"), {"case": i, "error": msg[:2000], "traceback": tail})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)  # no teardown: other ranks may wait in a collective; the parent ends them
    dist.destroy_process_group()


def _key(case: Case) -> str:
    return case.name if case.model == "-" else f"{case.model}/{case.name}"


def run_world(cases: list[Case], world: int, backend: str, s: Settings, deadline: float, log,
              results: dict, progress) -> None:  # fmt: skip
    """Run `cases` on `world` spawned ranks into `results` {case key: result}, calling progress() after
    each. A failed case is recorded with its error and the rest go on in a new world; cases not started
    before the deadline are left out (skipped)."""
    import torch.multiprocessing as mp

    todo = list(cases)
    while todo:
        if time.time() >= deadline:
            break
        with tempfile.TemporaryDirectory(prefix="kiln-distbench-") as tmp:
            log(f"world of {world} ({backend}): {', '.join(f'{c.model}/{c.name}' for c in todo)}")
            ctx = mp.start_processes(worker, args=(world, backend, tmp, todo, s, deadline), nprocs=world,
                                     join=False, start_method="spawn")  # fmt: skip
            failure, seen, last = None, 0, time.time()
            try:
                while True:
                    try:
                        if ctx.join(timeout=1.0):
                            break
                    except Exception as e:  # a rank exited with an error: join ended the others
                        failure = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]
                        break
                    while seen < len(todo) and os.path.exists(os.path.join(tmp, f"{seen}.json")):
                        with open(os.path.join(tmp, f"{seen}.json")) as f:
                            results[_key(todo[seen])] = json.load(f)
                        log(f"  done {_key(todo[seen])}")
                        progress()  # the result file is rewritten after every case: a killed run keeps them
                        seen, last = seen + 1, time.time()
                    if time.time() - last > s.case_timeout_s:
                        failure = (
                            f"timeout: no case finished within {s.case_timeout_s:.0f} s (--case-timeout)"
                        )
                        break
            finally:  # a timeout, or this process stopped (SIGTERM, Ctrl-C): no rank outlives it
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
            done = 0
            for k, case in enumerate(todo):
                path = os.path.join(tmp, f"{k}.json")
                if not os.path.exists(path):
                    break
                with open(path) as f:
                    results[_key(case)] = json.load(f)
                done = k + 1
            errs = []
            for r in range(world):
                path = os.path.join(tmp, f"err.{r}")
                if os.path.exists(path):
                    with open(path) as f:
                        errs.append({"rank": r, **json.load(f)})
            if done == len(todo) or not (failure or errs):
                break  # all done, or the rest not started before the deadline (skipped)
            case = todo[done]
            first = min(errs, key=lambda e: e["rank"]) if errs else None
            err = {"status": "error", "error": first["error"] if first else failure,
                   "traceback": first["traceback"] if first else None,
                   "ranks_with_error": [e["rank"] for e in errs]}  # fmt: skip
            results[_key(case)] = err
            log(f"  error {_key(case)}: {err['error'][:300]}")
            progress()
            todo = todo[done + 1 :]


# ---- the suites --------------------------------------------------------------------------------------------
def ws1_cases(models: list[str], smoke: bool = False) -> list[Case]:
    """Issue 20 on one GPU: the overhead of the wrappers, compile and checkpointing, on the gpu preset
    shape (or the first model given), then plain training of each further model."""
    first, *rest = models
    b = MODELS[first][1]
    out = [
        Case("plain", first, 1, "plain", b),
        # the bf16 noise floor of the loss comparison: the same global batch in two halves (another
        # summation order, the same math)
        Case("plain_split", first, 1, "plain", b // 2, accum=2, ref="plain"),
        Case("ddp_ws1", first, 1, "ddp1", b, ref="plain"),
        Case("fsdp2_ws1", first, 1, "fsdp1", b, ref="plain"),
        # FSDP2 runs q/k/v and gate/up unmerged (kiln.dist.tp): this separates that cost from FSDP2's own
        Case("plain_unmerged", first, 1, "plain", b, unmerge=True, ref="plain"),
        Case("ac_selective", first, 1, "plain", b, ac="selective", ref="plain"),
        Case("ac_full", first, 1, "plain", b, ac="full", ref="plain"),
        Case("plain_again", first, 1, "plain", b, ref="plain"),
    ]
    out += [Case("plain", m, 1, "plain", MODELS[m][1]) for m in rest]
    if smoke:  # an inductor compile takes minutes on the CPU (multi_cases says so in not_run)
        return out
    # last: the one case that can take minutes (an inductor compile), so that it delays nothing
    return out + [Case("compile", first, 1, "plain", b, compile=True, ref="plain")]


def multi_cases(model: str, n: int, smoke: bool = False) -> tuple[list[Case], list[Case], dict[str, str]]:
    """(cases on 1 GPU, cases on n GPUs, {case: why not run}) for one model. Global batch: n micro-batches
    of the model's per-GPU batch b; the 1-GPU reference accumulates them. --smoke adds the ws1 suite's
    one-process wrappers on the same batch, so that one CPU run covers every code path but compile."""
    from kiln.dist.parallel_dims import ParallelConfig, ParallelDims
    from kiln.errors import KilnError
    from kiln.model import ModelConfig

    spec, b, _ = MODELS[model]
    mcfg = ModelConfig(**spec)
    # the reference, and the bf16 noise floor of the loss comparison: the same global batch in micro-batches
    # of half the size (another summation order, the same math)
    one = [Case("plain_1gpu", model, 1, "plain", b, accum=n),
           Case("plain_1gpu_split", model, 1, "plain", b // 2, accum=2 * n, ref="plain_1gpu")]  # fmt: skip
    why_not = {}
    if smoke and not mcfg.n_experts:
        one += [Case("ddp_ws1", model, 1, "ddp1", b, n, ref="plain_1gpu"),
                Case("fsdp2_ws1", model, 1, "fsdp1", b, n, ref="plain_1gpu"),
                Case("ac_full", model, 1, "plain", b, n, ac="full", ref="plain_1gpu")]  # fmt: skip
        why_not["compile"] = "not run with --smoke (an inductor compile takes minutes on the CPU)"
    g = n * b  # global batch, sequences
    schemes = [
        ("ddp", "mesh", {"dp_replicate": n}, b, 1),
        ("zero1", "mesh", {"dp_replicate": n, "zero": 1}, b, 1),
        ("zero2", "mesh", {"dp_replicate": 1, "dp_shard": n, "zero": 2}, b, 1),
        ("fsdp2", "mesh", {"dp_replicate": 1, "dp_shard": n}, b, 1),
        (f"tp{n}", "mesh", {"dp_replicate": 1, "tp": n}, b, n),
        (f"tp{n}_sp", "mesh", {"dp_replicate": 1, "tp": n, "sequence_parallel": True}, b, n),
        # 2 micro-batches per stage: bubble (p - 1) / (m + p - 1)
        (f"pp{n}_1f1b", "pipeline", {"dp_replicate": 1, "pp": n, "pp_schedule": "1f1b", "microbatches": 2 * n}, g, 1),
        (f"pp{n}_interleaved", "pipeline",
         {"dp_replicate": 1, "pp": n, "pp_schedule": "interleaved_1f1b", "microbatches": 2 * n}, g, 1),
    ]  # fmt: skip
    if mcfg.n_experts:  # and expert parallel over N and N/2 ranks of dp_shard
        schemes += [(f"fsdp2_ep{e}", "mesh", {"dp_replicate": 1, "dp_shard": n, "ep": e}, b, 1)
                    for e in sorted({n, n // 2}) if e > 1]  # fmt: skip
    if n >= 4 and n % 2 == 0:
        schemes.append(
            (
                f"fsdp{n // 2}_x_tp2_sp",
                "mesh",
                {"dp_replicate": 1, "dp_shard": n // 2, "tp": 2, "sequence_parallel": True},
                b,
                2,
            )  # fmt: skip
        )
    cases = []
    if n < 4 or n % 2:
        why_not["hybrid"] = f"the hybrid FSDP2 (N/2) x TP 2 needs an even N >= 4, got {n}"
    for name, kind, par, batch, accum in schemes:
        try:
            ParallelDims.resolve(ParallelConfig(**par), n, mcfg)
        except KilnError as e:  # e.g. layers not divisible by pp: recorded, not run
            why_not[name] = str(e)
            continue
        cases.append(Case(name, model, n, kind, batch, accum, par, ref="plain_1gpu"))
    return one, cases, why_not


def summarize(
    results: dict, cases: list[Case], ceilings: dict, spec_tflops: float, final: bool
) -> list[dict]:
    """One row per case: its figures, MFU, loss difference and scaling against its reference. A case
    without a result was skipped (final) or has not run yet."""
    measured = (ceilings or {}).get("bf16_matmul_TFLOPs")
    missing = {"status": "skipped", "why": "--budget reached"} if final else {"status": "not run yet"}
    rows = []
    for c in cases:
        key = _key(c)
        r = {"case": c.name, "model": c.model, "gpus": c.world, "ac": c.ac, "compile": c.compile,
             "parallel": c.parallel, **results.get(key, missing)}  # fmt: skip
        r.setdefault("status", "ok")
        if r["status"] == "ok" and r.get("tokens_per_s") and measured:  # MFU on GPUs only
            per_gpu_flops = r["tokens_per_s_per_gpu"] * r["flops_per_token"]
            r["mfu_spec"] = round(per_gpu_flops / (spec_tflops * 1e12), 4)
            r["mfu_measured"] = round(per_gpu_flops / (measured * 1e12), 4)
        ref = results.get(f"{c.model}/{c.ref}") if c.ref else None
        if r["status"] == "ok" and ref and ref.get("losses"):
            k = min(len(ref["losses"]), len(r["losses"]))
            diffs = [abs(a - b) for a, b in zip(r["losses"][:k], ref["losses"][:k])]
            r["loss_max_abs_diff"] = max(diffs)
            r["loss_max_abs_diff_first10"] = max(diffs[:10])
            if ref.get("tokens_per_s") and r.get("tokens_per_s"):
                r["vs_ref"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 4)
                r["scaling_efficiency"] = round(r["tokens_per_s"] / (c.world * ref["tokens_per_s"]), 4)
        rows.append(r)
    return rows


def goals(rows: list[dict], cuda: bool) -> list[str]:
    """The issues' goals read off the rows: DDP / FSDP2 at world 1 cost <= 3% against plain (issue 20),
    with the drift of plain against itself beside it; DDP / FSDP2 scaling >= 90% on N (issue 22)."""
    if not cuda:
        return ["goals: not judged on the CPU (--smoke times Python and gloo, not the schemes)"]
    out = []
    for r in rows:
        if r["status"] != "ok" or r.get("vs_ref") is None:
            continue
        if r["case"] in ("ddp_ws1", "fsdp2_ws1", "plain_again", "plain_unmerged"):
            cost = 1 - r["vs_ref"]
            goal = (
                " (goal <= 3%: " + ("met" if cost <= 0.03 else "missed") + ")" if "ws1" in r["case"] else ""
            )
            out.append(f"{r['model']}/{r['case']}: {100 * cost:+.1f}% cost against plain{goal}")
        if r["case"] in ("ddp", "fsdp2"):
            eff = r["scaling_efficiency"]
            met = "met" if eff >= 0.9 else "missed"
            out.append(
                f"{r['model']}/{r['case']} on {r['gpus']}: scaling {100 * eff:.1f}% (goal >= 90%: {met})"
            )
    return out


COLUMNS = [("model", "model"), ("case", "case"), ("gpus", "GPUs"), ("tokens_per_s", "tok/s"),
           ("tokens_per_s_per_gpu", "tok/s/GPU"), ("mfu_spec", "MFU spec"), ("mfu_measured", "MFU meas"),
           ("peak_mem_gib", "peak GiB"), ("est_mem_gib", "est GiB"), ("vs_ref", "vs ref"),
           ("scaling_efficiency", "scaling"), ("loss_max_abs_diff", "max abs dloss"), ("status", "status")]  # fmt: skip


def main() -> int:
    p = bench_parser("distributed", __doc__)
    p.add_argument(
        "--suite", choices=("ws1", "multi"), help="default: multi with --smoke or several GPUs, else ws1"
    )
    p.add_argument(
        "--nprocs", type=int, help="GPUs (processes) for the multi suite (default: every GPU; 2 with --smoke)"
    )
    p.add_argument(
        "--models", help="comma-separated: gpu, 350m, 1b, moe (default: ws1 gpu,350m,1b; multi 350m,1b,moe)"
    )
    p.add_argument("--steps", type=int, help="steps per case (default 50; 6 with --smoke)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 10; 2 with --smoke)")
    p.add_argument("--round-steps", type=int, help="steps per timed round (default 10; 2 with --smoke)")
    p.add_argument(
        "--dtype", choices=("bf16", "fp32"), help="default: bf16 autocast on GPU, fp32 with --smoke"
    )
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--budget", type=float, help="seconds after which no case starts (default: ws1 400, multi 540)"
    )
    p.add_argument(
        "--case-timeout",
        type=float,
        help="seconds one case may take before its world is ended (ws1 180, multi 300)",
    )
    p.add_argument("--spec-tflops", type=float, default=989.5, help="dense bf16 spec for MFU (H100/H200 SXM)")
    p.add_argument("--no-collectives", action="store_true", help="multi suite: skip the collectives sweep")
    p.add_argument(
        "--only", help="comma-separated parts of case names to run (e.g. fsdp,tp); the references always run"
    )
    args = p.parse_args()  # fmt: skip
    return run(args)


def run(args) -> int:
    import signal

    # `timeout` sends SIGTERM: leave through SystemExit, so that run_world ends the ranks it started
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    from kiln.profile.provenance import provenance
    from kiln.profile.report import write_json

    t_start = time.time()
    smoke = bool(args.smoke)
    cuda = torch.cuda.is_available() and not smoke
    if not smoke and not cuda:
        raise SystemExit("bench/distributed.py needs CUDA GPUs; pass --smoke to check it on the CPU")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        raise SystemExit("bench/distributed.py spawns its own processes: run it with python, not torchrun")
    gpus = torch.cuda.device_count() if cuda else 0
    backend = "nccl" if cuda else "gloo"
    suite = args.suite or ("multi" if smoke or gpus > 1 else "ws1")
    n = args.nprocs or (2 if smoke else gpus)
    if suite == "multi" and (n < 2 or (cuda and n > gpus)):
        raise SystemExit(f"--suite multi needs 2 or more processes, one GPU each: --nprocs {n}, {gpus} GPUs")
    default_models = "tiny,tiny_moe" if smoke else ("gpu,350m,1b" if suite == "ws1" else "350m,1b,moe")
    models = [m.strip() for m in (args.models or default_models).split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise SystemExit(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    s = Settings(
        steps=args.steps or (6 if smoke else 50),
        warmup=args.warmup if args.warmup is not None else (2 if smoke else 10),
        round_steps=args.round_steps or (2 if smoke else 10),
        dtype=args.dtype or ("fp32" if smoke else "bf16"),
        lr=args.lr,
        lr_warmup=2 if smoke else 10,
        case_timeout_s=args.case_timeout or (180.0 if suite == "ws1" else 300.0),
    )
    if s.steps <= s.warmup:
        raise SystemExit(f"--steps ({s.steps}) must exceed --warmup ({s.warmup})")
    budget = args.budget or (400.0 if suite == "ws1" else 540.0)
    deadline = t_start + budget

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    log(f"distributed bench: suite {suite}, {backend}, models {models}, {s}")
    meta = {"area": "distributed", "smoke": smoke, **provenance(), "suite": suite, "backend": backend,
            "settings": asdict(s), "budget_s": budget, "spec_bf16_TFLOPs": args.spec_tflops}  # fmt: skip
    ceil = Case("ceilings", "-", 1, "ceilings")
    coll = Case("collectives", "-", n, "collectives")
    results: dict[str, dict] = {}
    not_run: dict[str, str] = {}
    name = "distributed-ws1" if suite == "ws1" else f"distributed-{n}gpu"
    out = args.out or default_out(name, __file__, smoke)
    if suite == "ws1":
        plan = [(1, [ceil, *ws1_cases(models, smoke)])]
        if smoke:
            not_run[f"{models[0]}/compile"] = (
                "not run with --smoke (an inductor compile takes minutes on the CPU)"
            )
    else:
        # NCCL busbw 1 KB .. 1 GB first, in the first n-process world (1 KB .. 64 KB on gloo with --smoke)
        plan = []
        for i, m in enumerate(models):
            one, many, why = multi_cases(m, n, smoke)
            not_run.update({f"{m}/{k}": v for k, v in why.items()})
            plan.append((1, [ceil, *one] if i == 0 else one))
            plan.append((n, [coll, *many] if i == 0 and not args.no_collectives else many))
    if args.only:  # the cases asked for, their references, the ceilings and the collectives
        parts = [w.strip() for w in args.only.split(",") if w.strip()]
        refs = {c.ref for _, group in plan for c in group}

        def wanted(c: Case) -> bool:
            return c.model == "-" or c.name in refs or any(w in c.name for w in parts)

        plan = [(world, [c for c in group if wanted(c)]) for world, group in plan]
    cases = [c for _, group in plan for c in group if c.model != "-"]

    def write(final: bool) -> list[dict]:
        """The result file, rewritten after every case (atomic): a run killed half-way keeps what it did."""
        ceilings = results.get("ceilings") or {"note": "not measured"}
        rows = summarize(results, cases, ceilings, args.spec_tflops, final)
        doc = {**meta, "complete": final, "ceilings": ceilings, "gpus": 1 if suite == "ws1" else n,
               "collectives": results.get("collectives") or results.get("-/collectives"), "cases": rows,
               "goals": goals(rows, cuda), "not_run": not_run, "wall_s": round(time.time() - t_start, 1)}  # fmt: skip
        write_json(out, doc)
        return rows

    for world, group in plan:
        run_world(group, world, backend, s, deadline, log, results, lambda: write(False))
    rows = write(True)
    print(format_table(rows, COLUMNS))
    for line in goals(rows, cuda):
        print(line)
    for k, v in not_run.items():
        print(f"not run: {k}: {v}")
    for r in rows:
        if r["status"] != "ok":
            print(f"{r['status']}: {r['model']}/{r['case']}: {r.get('error') or r.get('why')}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
