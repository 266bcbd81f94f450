"""The training loop: micro-batches, gradient accumulation, clipping, schedule, eval, checkpoints, logs.

It takes its model and optimizer from builder functions, and its parallel behaviour from a
`kiln.dist.strategy.Strategy` (gradient sync under accumulation, the forward/backward context,
clipping by the global norm across the mesh, loss reduction, the data-parallel rank the loader reads
as); without one, `parallelize(model, env)` wraps the model (DDP under torchrun). It reads its rank
from torchrun's variables; only rank 0 logs and writes files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kiln.config import to_dict
from kiln.data.loader import TokenLoader
from kiln.dist.parallel_dims import ParallelConfig, ParallelDims
from kiln.dist.strategy import Strategy
from kiln.errors import KilnError
from kiln.train.checkpoint import (
    check_finite,
    check_finite_sharded,
    prune_sharded,
    resolve_format,
    save_checkpoint,
    sharded_name,
)
from kiln.train.config import RunConfig
from kiln.train.env import DistEnv
from kiln.train.evaluate import evaluate
from kiln.train.kernels import resolve_kernels
from kiln.train.metrics import MetricsLog, format_step, memory_gib, plot_losses
from kiln.train.optim import WarmupCosine


def default_parallelize(model: torch.nn.Module, env: DistEnv, device: torch.device) -> torch.nn.Module:
    """One process: the model as is. Several (torchrun): PyTorch DDP over the process group."""
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for the forward pass; None runs in fp32."""
    if dtype == "fp32" or (dtype == "auto" and device.type != "cuda"):
        return None
    return torch.bfloat16


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list | tuple) else x


class LossModule(torch.nn.Module):
    """forward(inputs, targets) -> mean loss: the unit that DDP/FSDP/compile wrap (they hook forward)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x, y)


# a logged loss this many times the first step's means the run is diverging (a warning line);
# a fresh model's loss is about ln(vocab), so 1.5x is far worse than guessing uniformly
DIVERGENCE_FACTOR = 1.5


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken (skipped ones included: their data was consumed)
    tokens: int = 0  # tokens consumed, all ranks
    skipped: int = 0  # steps whose update was skipped for a non-finite loss or gradient
    start_loss: float | None = None  # the first step's train loss (the divergence check's reference)


class Trainer:
    def __init__(
        self,
        cfg: RunConfig,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_loader: TokenLoader,
        val_batches: list[tuple[torch.Tensor, torch.Tensor]],
        byte_lengths: torch.Tensor,
        device: torch.device,
        env: DistEnv,
        run_dir: Path,
        parallelize: Callable = default_parallelize,
        peak_flops: float | None = None,
        progress: bool = True,
        strategy: Strategy | None = None,
    ):
        self.cfg, self.tc = cfg, cfg.train
        self.model = model  # the module whose parameters train: checkpoints and eval use it
        if strategy is None:  # DDP over the whole world (or one process), as parallel's defaults say
            wrapped = parallelize(LossModule(model), env, device)
            dims = ParallelDims.resolve(ParallelConfig(), env.world_size)
            strategy = Strategy(wrapped, dims, None, env.rank)
        self.strategy = strategy
        one_process = not env.distributed
        self.wrapped = strategy.wrapped  # what the forward/backward runs through
        self.ckpt_format = resolve_format(self.tc.checkpoint_format, strategy.gathers)
        pipe = strategy.pipeline
        rows = self.tc.batch_size * self.tc.grad_accum
        if pipe is not None and rows % pipe.dims.microbatches:
            raise KilnError(
                f"train.batch_size x train.grad_accum = {rows} rows per data-parallel rank do not split into "
                f"parallel.microbatches={pipe.dims.microbatches} equal pipeline micro-batches: make the rows "
                "a multiple of the micro-batches"
            )
        self.optimizer = optimizer
        self.scheduler = WarmupCosine(
            optimizer,
            self.tc.lr,
            self.tc.warmup_steps,
            self.tc.steps,
            self.tc.min_lr_ratio,
            self.tc.schedule,
            self.tc.cooldown_frac,
        )
        self.train_loader, self.val_batches, self.byte_lengths = train_loader, val_batches, byte_lengths
        self.device, self.env, self.run_dir = device, env, run_dir
        self.amp = autocast_dtype(self.tc.dtype, device)
        self.peak_flops = peak_flops
        self.flops_per_token = cfg.model.flops_per_token(self.tc.seq_len)
        self.progress = progress and env.is_main
        self.state = TrainState()
        self.metrics = MetricsLog(run_dir / "metrics.jsonl" if env.is_main else None)
        self._prepare_model(model, one_process)
        if self.tc.compile and getattr(model, "rope", None) is not None:
            # fill RoPE's per-device frequency memo first: traced empty, its guard fails on the second call
            # and the whole model compiles twice
            model.rope(torch.zeros((1, 1), dtype=torch.long, device=device))
        self.loss_fn = torch.compile(self.wrapped) if self.tc.compile else self.wrapped
        # fused AdamW takes the GradScaler's `found_inf` flag and skips its update on the device, so a bad
        # step costs no host sync; other optimizers need the flag on the host (free on the CPU, which has
        # no queue of work to stall)
        self.device_skip = bool(optimizer.defaults.get("fused")) and getattr(
            optimizer, "_step_supports_amp_scaling", False
        )

    def _prepare_model(self, model: torch.nn.Module, one_process: bool) -> None:
        """The run's kernel choice (cfg.kernels, "auto" resolved for this shape) set on the model, and in one
        process the activation checkpointing of parallel.activation_checkpoint (kiln.dist applies it under
        torchrun) and the memory estimate; both reported on rank 0."""
        cfg, tc = self.cfg, self.tc
        kernels = cfg.kernels
        dims = self.strategy.dims
        split = not one_process and dims is not None and (dims.tp > 1 or dims.pp > 1)
        sharded = not one_process and self.strategy.sharded
        if kernels.linear in ("fp8", "fp8_rowwise") and (split or sharded):
            raise KilnError(
                f"kernels.linear={kernels.linear} is built for one process and DDP: tensor, pipeline and "
                "sharded data parallel runs need kernels.linear=auto"
            )
        if split and kernels.attention == "auto":  # heads split or blocks staged: not measured there
            kernels = dataclasses.replace(kernels, attention="kiln")
            why = "auto under tensor / pipeline parallel: kiln (not measured there)"
        else:
            kernels, why = resolve_kernels(
                kernels, cfg.model, tc.batch_size, tc.seq_len, self.device, self.amp
            )
        if not one_process and torch.distributed.is_initialized() and self.device.type == "cuda":
            # every rank must take the same path: SDPA only where every rank measured it faster
            vote = torch.tensor([kernels.attention == "sdpa"], dtype=torch.int32, device=self.device)
            torch.distributed.all_reduce(vote, op=torch.distributed.ReduceOp.MIN)
            if kernels.attention == "sdpa" and not int(vote):
                kernels = dataclasses.replace(kernels, attention="kiln")
                why += "; kiln, as another rank measured kiln faster"
        if hasattr(model, "set_kernels"):
            model.set_kernels(kernels)
        self.kernels = kernels
        lines = [f"      kernels: linear {kernels.linear}, {why}"]
        if one_process:
            from kiln.dist.memory import estimate, format_estimate
            from kiln.dist.parallelize import checkpoint_blocks

            ac = cfg.parallel.activation_checkpoint
            if ac != "none":
                checkpoint_blocks(model.model.layers, ac)
            dims = ParallelDims.resolve(ParallelConfig(), 1)
            est = estimate(cfg.model, dims, tc.batch_size, tc.seq_len, ac, 2 if self.amp is not None else 4)
            lines.append(f"      activation checkpointing: {ac}; memory, estimated: {format_estimate(est)}")
        if self.env.is_main:
            print("\n".join(lines), flush=True)

    # ---- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole training state; a collective under a sharded strategy (call it on every rank)."""
        model_sd, optim_sd = self.strategy.full_state(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd, **self.progress_state()}

    def progress_state(self) -> dict:
        """Everything but the model and optimizer: step, schedule, data position, RNG, config."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "loader": self.train_loader.state_dict(),
            "step": self.state.step,
            "tokens": self.state.tokens,
            "skipped": self.state.skipped,
            "start_loss": self.state.start_loss,
            "world_size": self.env.world_size,
            "dp_size": self.strategy.dp_size,
            "rng": rng_state(self.device),
            "config": to_dict(self.cfg),
        }

    def load_state_dict(self, ckpt: dict) -> None:
        """`ckpt`: a full checkpoint, or a dcp one's state with "sharded" the path of its shards."""
        try:
            if ckpt.get("sharded"):  # every rank reads its own shards, resharded onto this mesh
                from kiln.dist.checkpoint import load_sharded

                load_sharded(ckpt["sharded"], self.model, self.optimizer)
            else:
                self.strategy.load_full_state(self.model, self.optimizer, ckpt["model"], ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise KilnError(
                f"the checkpoint does not fit this model/optimizer: {str(e).splitlines()[0]}"
            ) from None
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.train_loader.load_state_dict(ckpt["loader"])
        self.state = TrainState(
            step=int(ckpt["step"]),
            tokens=int(ckpt["tokens"]),
            skipped=int(ckpt.get("skipped", 0)),
            start_loss=ckpt.get("start_loss"),
        )
        set_rng_state(ckpt["rng"], self.device)
        self.metrics.truncate_after(self.state.step)

    def save(self) -> None:
        if self.ckpt_format == "dcp":
            self._save_sharded()
            return
        if self.strategy.gathers or self.strategy.zero1:  # gathering the state takes every rank
            state = self.state_dict()
            if self.env.is_main:
                check_finite(state["model"], self.state.step)
                save_checkpoint(
                    self.run_dir / "checkpoints", self.state.step, state, self.tc.keep_checkpoints
                )
            return
        if self.env.is_main:
            check_finite(self.model, self.state.step)
            save_checkpoint(
                self.run_dir / "checkpoints", self.state.step, self.state_dict(), self.tc.keep_checkpoints
            )

    def _save_sharded(self) -> None:
        """Every rank writes its shards to step_N.dcp (atomic); then rank 0 commits step_N.pt (the rest
        of the state, naming the directory) and LATEST.json, and prunes as the full format does."""
        from kiln.dist.checkpoint import save_sharded

        step, ckpt_dir = self.state.step, self.run_dir / "checkpoints"
        check_finite_sharded(self.model, step)
        shards = ckpt_dir / sharded_name(step)
        if self.env.is_main:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            if shards.exists() and not shards.with_suffix(".pt").exists():
                shutil.rmtree(shards)  # written by an attempt that died before committing it: never loaded
        save_sharded(shards, self.model, self.optimizer)
        if self.env.is_main:
            state = {"model": None, "optimizer": None, "sharded": shards.name, **self.progress_state()}
            save_checkpoint(ckpt_dir, step, state, self.tc.keep_checkpoints)
            prune_sharded(ckpt_dir)

    # ---- steps ---------------------------------------------------------------------------------------------
    def _autocast(self):
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro-batches.

        Returns device tensors (mean loss, grad norm, ok), read by the caller only when it logs. ok is
        False when the loss or the gradient norm is not finite: then the update is skipped (parameters and
        optimizer state untouched) while the step, schedule and data still advance.
        """
        self.model.train()
        total = torch.zeros((), device=self.device)
        pipe = self.strategy.pipeline
        if pipe is not None:
            # the step's grad_accum micro-batches, concatenated (rows, T): the schedule cuts them into its
            # own micro-batches and runs forward and backward over them; the mean loss comes back on
            # every pipeline rank
            xs, ys = zip(*(self.train_loader.next_batch() for _ in range(self.tc.grad_accum)))
            x, y = torch.cat(xs).to(self.device), torch.cat(ys).to(self.device)
            with self._autocast():  # the pipeline enters loss_parallel itself under tp
                total = pipe.step(x, y)
        for micro in range(self.tc.grad_accum if pipe is None else 0):
            x, y = self.train_loader.next_batch()
            if self.device.type == "cuda":  # from pageable memory a copy can wait on the stream: pin first
                x, y = x.pin_memory(), y.pin_memory()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            last = micro == self.tc.grad_accum - 1
            # gradients sync on the last micro-batch only (DDP's no_sync, FSDP2's requires_gradient_sync);
            # the strategy's context covers forward and backward (loss_parallel under tensor parallel)
            with self.strategy.sync(last), self.strategy.context():
                with self._autocast():
                    loss = self.loss_fn(x, y) / self.tc.grad_accum
                loss.backward()
            total += loss.detach()
        # the global norm over every shard on every rank; a non-finite norm makes the clipped grads NaN:
        # skipped below. grad_clip 0 only measures
        grad_norm = self.strategy.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip)
        # before the check, so that every rank takes the same decision
        self.strategy.reduce_loss(total)
        ok = torch.isfinite(grad_norm) & torch.isfinite(total)  # grad_norm: the same on every rank
        if self.device_skip:
            self.optimizer.found_inf = (~ok).float()  # fused AdamW: 1.0 skips the whole update
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        elif bool(ok):  # the host needs the flag here (see __init__)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.state.step += 1
        self.state.tokens += self.tc.batch_size * self.tc.seq_len * self.tc.grad_accum * self.strategy.dp_size
        return total, grad_norm.detach(), ok

    def validate(self) -> dict[str, float]:
        self.model.eval()

        def summed(x, y):
            with self._autocast():
                if self.strategy.pipeline is not None:  # forward stage after stage; the sum on every rank
                    return self.strategy.pipeline.eval_loss_sum(x, y)
                if self.strategy.sharded:  # the parameters are shards: go through the parallel loss
                    with torch.no_grad(), self.strategy.context():
                        n = (y != -100).sum()
                        return torch.where(n > 0, self.wrapped(x, y).float() * n, 0.0)
                return self.model.loss(x, y, reduction="sum").float()

        return evaluate(summed, self.val_batches, self.byte_lengths, self.device)

    def _log(self, bar: tqdm, line: str) -> None:
        """One log line on rank 0: above the progress bar when there is one, else plain stdout."""
        if self.progress:
            bar.write(line)
        elif self.env.is_main:
            print(line, flush=True)

    def _warn(self, bar: tqdm, line: str) -> None:
        if self.env.is_main:
            self._log(bar, f"warning: {line}")

    # ---- the loop ------------------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> dict:
        """Train to train.steps (or to `stop_at`, checkpointing there); returns the last log records."""
        tc = self.tc
        end = tc.steps if stop_at is None else min(stop_at, tc.steps)
        bar = tqdm(
            total=tc.steps,
            initial=self.state.step,
            desc="train",
            unit="step",
            disable=not self.progress,
            dynamic_ncols=True,
        )
        last = {}
        busy, tok0 = 0.0, self.state.tokens  # seconds spent in train steps since the last log line
        # device-side tallies since the last log line, read only when a line is written (no sync per step)
        dev = self.device
        loss_sum = torch.zeros((), device=dev)  # summed loss of the steps that were applied
        n_ok = torch.zeros((), dtype=torch.long, device=dev)
        n_bad = torch.zeros((), dtype=torch.long, device=dev)
        bad_run = torch.zeros((), dtype=torch.long, device=dev)  # consecutive skipped steps, now
        max_run = torch.zeros((), dtype=torch.long, device=dev)  # the longest such run since it was read
        seen_bad = 0  # skipped steps already reported
        gnorm = torch.zeros((), device=dev)
        # training time (compile included, evaluation and checkpoints not) for train.target_val_bpb and
        # train.max_time_s: the clock of a speed run, counted within this process
        t_fit, paused, stop = time.perf_counter(), 0.0, None
        while self.state.step < end and stop is None:
            t_step = time.perf_counter()
            loss, gnorm, ok = self.train_step()
            if self.state.start_loss is None and bool(ok):  # one sync, on the run's first step only
                self.state.start_loss = float(loss)  # the untrained model's loss: the divergence reference
            loss_sum += torch.where(ok, loss, 0.0)
            n_ok += ok
            n_bad += ~ok
            bad_run = (bad_run + 1) * (~ok)
            max_run = torch.maximum(max_run, bad_run)
            step = self.state.step
            bar.update(1)
            log_now = step % tc.log_interval == 0 or step == tc.steps
            eval_now = step % tc.eval_interval == 0 or step == tc.steps
            ckpt_now = step % tc.ckpt_interval == 0 or step == end
            if not self.device_skip or log_now or eval_now or ckpt_now:
                # one sync; every step on the host-skip path, where train_step has synced already
                bad, longest = int(n_bad), int(max_run)
                if bad > seen_bad:
                    self.state.skipped += bad - seen_bad
                    self._warn(
                        bar,
                        f"step {step}: non-finite loss or gradient norm; {bad - seen_bad} update(s) skipped "
                        f"({self.state.skipped} in this run)",
                    )
                    seen_bad = bad
                if longest >= tc.max_bad_steps:
                    bar.close()
                    raise KilnError(
                        f"{longest} consecutive steps (up to step {step}) had a non-finite loss or gradient: "
                        f"stopping (train.max_bad_steps={tc.max_bad_steps}). No update was applied from them "
                        "and no checkpoint holds them; lower train.lr, check the data, or continue from an "
                        "earlier checkpoint with --resume-from STEP"
                    )
            if log_now:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                busy += time.perf_counter() - t_step
                tps = (self.state.tokens - tok0) / max(busy, 1e-9)
                mfu = None
                if self.peak_flops:
                    mfu = tps / self.env.world_size * self.flops_per_token / self.peak_flops
                good, skipped = int(n_ok), int(n_bad)
                rec = {
                    "kind": "train",
                    "step": step,
                    "total_steps": tc.steps,
                    "loss": float(loss_sum) / good if good else None,  # None: every step was skipped
                    "lr": self.scheduler.lr,
                    "grad_norm": float(gnorm),
                    "skipped": skipped,
                    "skipped_total": self.state.skipped,
                    "tokens_per_s": tps,
                    "mfu": mfu,
                    "mem_gib": memory_gib(self.device),
                    "tokens": self.state.tokens,
                    "time": time.time(),
                }
                start = self.state.start_loss
                if rec["loss"] is not None and start is not None:
                    if rec["loss"] > DIVERGENCE_FACTOR * start:
                        rec["diverging"] = True
                        self._warn(
                            bar,
                            f"step {step}: loss {rec['loss']:.3f} is far above its start "
                            f"{start:.3f} (more than {DIVERGENCE_FACTOR}x): the run is "
                            "diverging; lower train.lr",
                        )
                self.metrics.write(rec)
                self._log(bar, format_step(rec))
                if rec["loss"] is not None:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}")
                busy, tok0 = 0.0, self.state.tokens
                loss_sum.zero_(), n_ok.zero_(), n_bad.zero_()
                seen_bad = 0
                last.update(rec)
            else:
                busy += time.perf_counter() - t_step
            if eval_now:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                t_eval = time.perf_counter()
                train_time = t_eval - t_fit - paused
                val = self.validate()
                rec = {
                    "kind": "val",
                    "step": step,
                    **val,
                    "train_time_s": train_time,
                    "tokens": self.state.tokens,
                }
                if tc.target_val_bpb is not None and val["val_bpb"] <= tc.target_val_bpb:
                    stop = rec["stop"] = "target"
                elif tc.max_time_s is not None and train_time >= tc.max_time_s:
                    stop = rec["stop"] = "time"
                self.metrics.write(rec)
                self._log(
                    bar,
                    f"step {step:>6d}/{tc.steps} | val loss {val['val_loss']:.4f} | val bpb {val['val_bpb']:.4f}",
                )
                last.update(rec)
                if stop is not None:
                    why = (
                        f"reached train.target_val_bpb={tc.target_val_bpb}"
                        if stop == "target"
                        else f"train.max_time_s={tc.max_time_s} spent"
                    )
                    self._log(
                        bar, f"step {step:>6d}/{tc.steps} | stop: {why} after {train_time:.1f}s of training"
                    )
                paused += time.perf_counter() - t_eval
            ckpt_now = ckpt_now or stop is not None
            if ckpt_now:
                t_ckpt = time.perf_counter()
                self.save()
                if self.env.is_main:
                    plot_losses(
                        self.run_dir / "metrics.jsonl",
                        self.run_dir / "loss.png",
                        f"kiln run: {self.run_dir.name}",
                    )
                paused += time.perf_counter() - t_ckpt
        bar.close()
        return last
