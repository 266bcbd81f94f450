"""Where a process runs: its rank in a torchrun job, and its device.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; a plain `python`/`kiln` process is rank 0 of 1.
Only rank 0 logs and writes files.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from kiln.errors import KilnError


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def dist_env() -> DistEnv:
    """Read the torchrun variables; absent means a single process."""
    try:
        return DistEnv(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )
    except ValueError as e:
        raise KilnError(f"bad torchrun environment variable: {e}") from None


def resolve_device(name: str, env: DistEnv | None = None) -> torch.device:
    """'auto' -> cuda:LOCAL_RANK when CUDA is present, else cpu; 'cpu', 'cuda', 'cuda:N' as given."""
    env = env or DistEnv()
    if name == "auto":
        return torch.device(f"cuda:{env.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise KilnError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KilnError(
            f"device {name!r} was asked for, but CUDA is not available on this machine: use --device cpu"
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device(f"cuda:{env.local_rank}")
    return dev


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float | None = None) -> None:
    """Join the torchrun process group (NCCL on CUDA, gloo on CPU); a no-op for one process.
    timeout_s: how long any collective may wait before it fails (kiln.dist.hang); None: torch's default."""
    if not env.distributed or torch.distributed.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s is not None else {}
    torch.distributed.init_process_group(backend="nccl" if device.type == "cuda" else "gloo", **kwargs)
