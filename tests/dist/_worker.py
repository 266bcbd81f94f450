"""The schemes under test, run in spawned gloo processes, and the one-process reference they must match.

`train(scheme)` is the training loop's step (kiln.train.loop.Trainer.train_step) reduced to what the
strategy decides: micro-batch gradient sync, forward/backward context, global-norm clipping, loss
averaging and the data-parallel slice of each global batch. Every scheme trains the same tiny model
from the same full initialization on the same global batches; rank 0 saves its per-step losses and the
gathered final parameters for the test to compare with the one-process run.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.pipelining.schedules as pp_schedules
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from kiln.dist.checkpoint import load_sharded, save_sharded
from kiln.dist.collectives import recursive_doubling_all_reduce, ring_all_reduce
from kiln.dist.expert_parallel import ExpertParallelExperts, TensorParallelExperts
from kiln.dist.parallel_dims import ParallelConfig, ParallelDims
from kiln.dist.parallelize import LossModule, parallelize, parallelize_pipeline
from kiln.dist.strategy import Strategy
from kiln.model import ModelConfig, build_model
from kiln.model.config import KernelConfig
from kiln.train.optim import OptimConfig, build_optimizer

# 8 query and 4 KV heads: tp up to 4 keeps whole GQA groups per rank
MODEL = dict(arch="llama", vocab_size=64, d_model=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=64,
             max_seq_len=16)  # fmt: skip
STEPS, GLOBAL_BATCH, SEQ, ACCUM = 10, 8, 16, 2
OPT = OptimConfig(lr=3e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
CLIP = 0.5  # low enough that clipping acts on most steps, so the global norm is exercised


@dataclass
class Scheme:
    name: str
    parallel: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    resume_as: Scheme | None = None  # stop half-way with a sharded checkpoint, resume as this scheme
    delay: bool = False  # the last rank sleeps DELAY_S before each of its collectives
    export: bool = False  # save a sharded checkpoint at the end, as <name>.dcp in the output directory
    kernels: dict = field(default_factory=dict)  # KernelConfig fields (e.g. moe="kiln": the grouped path)

    @property
    def reference_key(self) -> tuple:
        """Schemes with equal keys train the same one-process reference."""
        return tuple(sorted(self.model.items())), tuple(sorted(self.kernels.items()))


DELAY_S = 0.003
# Where the schemes' collectives start from Python, by module: torch.distributed (the loop's clipping and
# loss reduction, FSDP2's all-gathers and reduce-scatters, ZeRO-1's broadcasts), the functional
# collectives (DTensor's TP/SP redistributions) and the pipeline schedules' point-to-point batches.
# DDP's bucketed all-reduce starts in C++: a comm hook delays it instead (see train).
DELAYED = {
    dist: ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
           "reduce_scatter_tensor", "broadcast", "batch_isend_irecv", "all_gather_object", "all_to_all_single"),
    funcol: ("all_reduce", "all_gather_single", "all_gather_tensor", "reduce_scatter_single",
             "reduce_scatter_tensor", "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd",
             "all_to_all_single_autograd"),
    pp_schedules: ("_batch_p2p",),
}  # fmt: skip


@contextlib.contextmanager
def delayed_collectives(seconds: float, calls: list[int]) -> Iterator[None]:
    """Sleep `seconds` before every collective started through DELAYED (this process only); calls[0]
    counts them, so the test knows the delays happened."""

    def delayed(fn):
        def call(*args, **kwargs):
            calls[0] += 1
            time.sleep(seconds)
            return fn(*args, **kwargs)

        return call

    saved = [
        (mod, name, getattr(mod, name))
        for mod, names in DELAYED.items()
        for name in names
        if hasattr(mod, name)
    ]
    try:
        for mod, name, fn in saved:
            setattr(mod, name, delayed(fn))
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def model_config(scheme: Scheme) -> ModelConfig:
    return ModelConfig(**{**MODEL, **scheme.model})


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: (ACCUM, GLOBAL_BATCH, SEQ) inputs and targets."""
    # arithmetic sequences mod V (a random start and stride 1-3 per row): learnable within 10 steps,
    # so the comparison covers a model whose loss moves
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, MODEL["vocab_size"], (ACCUM, GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (ACCUM, GLOBAL_BATCH, 1), generator=g)
    t = (start + stride * torch.arange(SEQ + 1)) % MODEL["vocab_size"]
    return t[..., :-1], t[..., 1:]


def _gather(model: torch.nn.Module, pipelined: bool = False) -> dict[str, torch.Tensor]:
    out = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    if pipelined:  # each stage holds its own layers: merge every rank's part
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, out)
        out = {k: v for part in parts for k, v in part.items()}
    return out


def train(scheme: Scheme, rank: int = 0, world: int = 1, steps=range(STEPS), load=None, save=None) -> dict:
    """Train `steps` (default all 10); returns {"losses": [...], "params": {name: full tensor}}.
    load / save: a sharded checkpoint directory to start from / to write at the end. With scheme.delay the
    last rank sleeps before each collective; "delayed_calls" counts them."""
    calls = [0]
    delayed = scheme.delay and world > 1 and rank == world - 1
    with delayed_collectives(DELAY_S, calls) if delayed else contextlib.nullcontext():
        result = _train(scheme, rank, world, steps, load, save, calls if delayed else None)
    if world > 1:
        total = torch.tensor([calls[0]])
        dist.all_reduce(total)
        result["delayed_calls"] = int(total)
    return result


def _train(scheme: Scheme, rank: int, world: int, steps, load, save, calls: list[int] | None) -> dict:
    cfg = model_config(scheme)
    kernels = KernelConfig(**scheme.kernels)
    full = build_model(cfg, seed=7, kernels=kernels)
    pipe = None  # the one-process initialization, on every rank
    if world == 1:
        model, wrapped = full, LossModule(full)
        strategy = Strategy(wrapped)
    else:
        pcfg = ParallelConfig(**scheme.parallel)
        dims = ParallelDims.resolve(pcfg, world, cfg)
        mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = type(full)(cfg, kernels)
        if dims.pp > 1:
            model, pipe = parallelize_pipeline(
                model, dims, pcfg, mesh, torch.device("cpu"), full.state_dict()
            )
            wrapped = model
        else:
            wrapped = parallelize(model, dims, pcfg, mesh, torch.device("cpu"), full.state_dict())
        if calls is not None and isinstance(wrapped, DistributedDataParallel):

            def hook(group, bucket):  # DDP's own all-reduce of the bucket, after the delay
                calls[0] += 1
                time.sleep(DELAY_S)
                return allreduce_hook(group, bucket)

            wrapped.register_comm_hook(wrapped.process_group, hook)
        strategy = Strategy(wrapped, dims, mesh, rank)
    optimizer = strategy.build_optimizer(model, lambda m: build_optimizer(m, OPT))
    per_rank = GLOBAL_BATCH // strategy.dp_size
    lo = strategy.dp_rank * per_rank
    if load is not None:
        start = load_sharded(load, model, optimizer, {"step": 0})["step"]
        assert start == steps[0], (start, steps)
    losses, norms = [], []  # norms: the global gradient norm before clipping (AdamW alone would hide a
    for step in steps:  # gradient off by a constant factor: its update is scale-invariant)
        xs, ys = batches(step)
        total = torch.zeros(())
        if pipe is not None:  # the accumulation chunks become the pipeline's micro-batches, in order
            x, y = xs[:, lo : lo + per_rank].reshape(-1, SEQ), ys[:, lo : lo + per_rank].reshape(-1, SEQ)
            total = pipe.step(x, y)
        for micro in range(ACCUM if pipe is None else 0):
            x, y = xs[micro, lo : lo + per_rank], ys[micro, lo : lo + per_rank]
            with strategy.sync(micro == ACCUM - 1), strategy.context():
                loss = wrapped(x, y) / ACCUM
                loss.backward()
            total += loss.detach()
        norms.append(float(strategy.clip_grad_norm_(model.parameters(), CLIP)))
        strategy.reduce_loss(total)  # pipeline ranks hold the same loss: the world mean is the dp mean
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
    if save is not None:
        save_sharded(save, model, optimizer, {"step": steps[-1] + 1})
    # which blocks ran their experts split over ranks (so an ep or tp scheme cannot pass as plain FSDP2)
    return {
        "losses": losses,
        "grad_norms": norms,
        "params": _gather(model, pipe is not None),
        "ep_blocks": sum(isinstance(m, ExpertParallelExperts) for m in model.modules()),
        "tp_expert_blocks": sum(isinstance(m, TensorParallelExperts) for m in model.modules()),
    }


def check_collectives(rank: int, world: int) -> dict:
    """kiln's ring and recursive-doubling all-reduce against dist.all_reduce, on the whole world and on
    3 of its ranks (a world that is not a power of two), over sizes that do not divide evenly (and
    one smaller than the group). Returns {(algorithm, group size, shape, dtype): max abs error}."""
    errors = {}
    groups = [(None, world)]
    if world > 3:  # every rank takes part in creating the group of 3
        groups.append((dist.new_group([0, 1, 2]), 3))
    for group, members in groups:
        if rank >= members:
            continue
        for shape in [(1,), (2,), (5,), (1000,), (3, 7)]:
            for dtype in (torch.float64, torch.int64):
                g = torch.Generator().manual_seed(17 * rank + len(shape) + shape[0])
                x = torch.randn(shape, generator=g, dtype=torch.float64) * 100
                x = x.to(dtype)
                want = x.clone()
                dist.all_reduce(want, group=group)
                for name, fn in (
                    ("ring", ring_all_reduce),
                    ("recursive_doubling", recursive_doubling_all_reduce),
                ):
                    got = fn(x.clone(), group=group)
                    errors[(name, members, shape, str(dtype))] = (got - want).abs().max().item()
    return errors


def worker(rank: int, world: int, init_file: str, out_dir: str, schemes: list[Scheme]) -> None:
    """One spawned rank: join the group, run each scheme in turn, rank 0 saves the results."""
    os.environ.setdefault("KILN_KERNELS", "reference")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    try:
        errors = check_collectives(rank, world)
        if rank == 0:
            torch.save(errors, os.path.join(out_dir, "collectives.pt"))
        for scheme in schemes:
            t0 = time.perf_counter()
            if scheme.resume_as is not None:  # half the steps, a sharded checkpoint, the rest on another mesh
                ckpt = os.path.join(out_dir, f"{scheme.name}.dcp")
                half = STEPS // 2
                first = train(scheme, rank, world, range(half), save=ckpt)
                result = train(scheme.resume_as, rank, world, range(half, STEPS), load=ckpt)
                for key in ("losses", "grad_norms"):
                    result[key] = first[key] + result[key]
            else:
                save = os.path.join(out_dir, f"{scheme.name}.dcp") if scheme.export else None
                result = train(scheme, rank, world, save=save)
            result["seconds"] = time.perf_counter() - t0
            if rank == 0:
                torch.save(result, os.path.join(out_dir, f"{scheme.name}.pt"))
            dist.barrier()
    finally:
        dist.destroy_process_group()
