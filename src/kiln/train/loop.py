"""The training loop: micro-batches, gradient accumulation, clipping, schedule, eval, checkpoints, logs.

It takes its model and optimizer from builder functions, and a `parallelize(model, env)` step that
later work (FSDP, tensor parallel, compile) replaces without touching the loop. It reads its rank
from torchrun's variables; only rank 0 logs and writes files.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kiln.config import to_dict
from kiln.data.loader import TokenLoader
from kiln.errors import KilnError
from kiln.train.checkpoint import save_checkpoint
from kiln.train.config import RunConfig
from kiln.train.env import DistEnv
from kiln.train.evaluate import evaluate
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


@dataclass
class TrainState:
    step: int = 0  # optimizer steps taken
    tokens: int = 0  # tokens consumed, all ranks


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
    ):
        self.cfg, self.tc = cfg, cfg.train
        self.model = model  # the plain module: checkpoints and eval use it
        self.wrapped = parallelize(LossModule(model), env, device)  # what the forward/backward runs through
        self.optimizer = optimizer
        self.scheduler = WarmupCosine(
            optimizer, self.tc.lr, self.tc.warmup_steps, self.tc.steps, self.tc.min_lr_ratio
        )
        self.train_loader, self.val_batches, self.byte_lengths = train_loader, val_batches, byte_lengths
        self.device, self.env, self.run_dir = device, env, run_dir
        self.amp = autocast_dtype(self.tc.dtype, device)
        self.peak_flops = peak_flops
        self.flops_per_token = cfg.model.flops_per_token(self.tc.seq_len)
        self.progress = progress and env.is_main
        self.state = TrainState()
        self.metrics = MetricsLog(run_dir / "metrics.jsonl" if env.is_main else None)
        self.loss_fn = torch.compile(self.wrapped) if self.tc.compile else self.wrapped

    # ---- state ---------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "loader": self.train_loader.state_dict(),
            "step": self.state.step,
            "tokens": self.state.tokens,
            "rng": rng_state(self.device),
            "config": to_dict(self.cfg),
        }

    def load_state_dict(self, ckpt: dict) -> None:
        try:
            self.model.load_state_dict(ckpt["model"])
            self.optimizer.load_state_dict(ckpt["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise KilnError(
                f"the checkpoint does not fit this model/optimizer: {str(e).splitlines()[0]}"
            ) from None
        self.scheduler.load_state_dict(ckpt["scheduler"])
        self.train_loader.load_state_dict(ckpt["loader"])
        self.state = TrainState(step=int(ckpt["step"]), tokens=int(ckpt["tokens"]))
        set_rng_state(ckpt["rng"], self.device)
        self.metrics.truncate_after(self.state.step)

    def save(self) -> None:
        if self.env.is_main:
            save_checkpoint(
                self.run_dir / "checkpoints", self.state.step, self.state_dict(), self.tc.keep_checkpoints
            )

    # ---- steps ---------------------------------------------------------------------------------------------
    def _autocast(self):
        if self.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp)

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over grad_accum micro-batches; returns (mean loss, grad norm)."""
        self.model.train()
        total = torch.zeros((), device=self.device)
        for micro in range(self.tc.grad_accum):
            x, y = self.train_loader.next_batch()
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            last = micro == self.tc.grad_accum - 1
            # DDP all-reduces gradients only on the last micro-batch; no_sync covers forward and backward
            sync = contextlib.nullcontext() if last or not self.env.distributed else self.wrapped.no_sync()
            with sync:
                with self._autocast():
                    loss = self.loss_fn(x, y) / self.tc.grad_accum
                loss.backward()
            total += loss.detach()
        if self.tc.grad_clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tc.grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.norm() for p in self.model.parameters() if p.grad is not None])
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.env.distributed:
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.AVG)
        self.state.step += 1
        self.state.tokens += self.tc.batch_size * self.tc.seq_len * self.tc.grad_accum * self.env.world_size
        return float(total), float(grad_norm)

    def validate(self) -> dict[str, float]:
        self.model.eval()

        def summed(x, y):
            with self._autocast():
                return self.model.loss(x, y, reduction="sum").float()

        return evaluate(summed, self.val_batches, self.byte_lengths, self.device)

    def _log(self, bar: tqdm, line: str) -> None:
        """One log line on rank 0: above the progress bar when there is one, else plain stdout."""
        if self.progress:
            bar.write(line)
        elif self.env.is_main:
            print(line, flush=True)

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
        losses: list[float] = []  # step losses since the last log line (the line reports their mean)
        while self.state.step < end:
            t_step = time.perf_counter()
            loss, gnorm = self.train_step()
            losses.append(loss)
            if not torch.isfinite(torch.tensor(loss)):
                raise KilnError(
                    f"loss became {loss} at step {self.state.step}: lower train.lr or check the data"
                )
            step = self.state.step
            bar.update(1)
            if step % tc.log_interval == 0 or step == tc.steps:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                busy += time.perf_counter() - t_step
                tps = (self.state.tokens - tok0) / max(busy, 1e-9)
                mfu = None
                if self.peak_flops:
                    mfu = tps / self.env.world_size * self.flops_per_token / self.peak_flops
                rec = {
                    "kind": "train",
                    "step": step,
                    "total_steps": tc.steps,
                    "loss": sum(losses) / len(losses),
                    "lr": self.scheduler.lr,
                    "grad_norm": gnorm,
                    "tokens_per_s": tps,
                    "mfu": mfu,
                    "mem_gib": memory_gib(self.device),
                    "tokens": self.state.tokens,
                    "time": time.time(),
                }
                self.metrics.write(rec)
                self._log(bar, format_step(rec))
                bar.set_postfix(loss=f"{rec['loss']:.3f}")
                busy, tok0, losses = 0.0, self.state.tokens, []
                last.update(rec)
            else:
                busy += time.perf_counter() - t_step
            if step % tc.eval_interval == 0 or step == tc.steps:
                val = self.validate()
                rec = {"kind": "val", "step": step, **val}
                self.metrics.write(rec)
                self._log(
                    bar,
                    f"step {step:>6d}/{tc.steps} | val loss {val['val_loss']:.4f} | val bpb {val['val_bpb']:.4f}",
                )
                last.update(rec)
            if step % tc.ckpt_interval == 0 or step == end:
                self.save()
                if self.env.is_main:
                    plot_losses(
                        self.run_dir / "metrics.jsonl",
                        self.run_dir / "loss.png",
                        f"kiln run: {self.run_dir.name}",
                    )
        bar.close()
        return last
