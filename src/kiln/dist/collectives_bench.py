"""Timing collectives on the ranks at hand: the library's all_reduce, reduce_scatter, all_gather and
all_to_all (expert parallel's token exchange) and
kiln's ring and recursive-doubling all-reduce (kiln.dist.collectives), over message sizes, with nccl-tests'
bus bandwidth and the alpha-beta model fitted to the times (kiln.dist.cost_model).

Run under torchrun (RANK / WORLD_SIZE in the environment: `measure_launched`) or from one process that
spawns `nprocs` ranks itself (`spawn`: gloo on CPU, NCCL with one GPU per rank). Used by
`bench/collectives.py` and `kiln bench collectives`.

Timing: float32 tensors of n bytes; for each size, one warm-up call then `rounds` blocks of `iters` calls
between barriers; a block's time is the slowest rank's (the collective is done when its last rank is),
a size's time the median block over rounds, divided by iters. n is the all-reduce's tensor, the
reduce-scatter's whole input, the all-gather's whole output and what one rank sends in the all-to-all
(nccl-tests' convention).
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.dist.collectives import recursive_doubling_all_reduce, ring_all_reduce
from kiln.dist.cost_model import OPS, busbw, fit_alpha_beta
from kiln.errors import KilnError


def sizes_between(lo: int, hi: int, factor: int = 4) -> list[int]:
    """Message sizes in bytes lo, lo * factor, ... up to hi (`measure` rounds each down to whole floats
    per rank)."""
    if lo < 4 or hi < lo:
        raise KilnError(f"message sizes need 4 <= min <= max bytes, got {lo} .. {hi}")
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= factor
    if len(out) < 2:  # the alpha-beta fit needs two sizes
        raise KilnError(
            f"message sizes {lo} .. {hi} bytes give one size: make the maximum at least {factor}x the minimum"
        )
    return out


def _iters(nbytes: int, smoke: bool) -> int:
    # ~64 MB moved per block, 2..50 calls: enough calls that small messages beat the timer's noise
    return 2 if smoke else max(2, min(50, (64 << 20) // nbytes))


def _call(op: str, x: torch.Tensor, out: torch.Tensor) -> None:
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "reduce_scatter":
        # the *_tensor names are deprecated from torch 2.13 in favour of *_single (the H200 has 2.11)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(out, x)
    elif op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x)  # (output, input)
    elif op == "all_to_all":
        dist.all_to_all_single(out, x)  # (output, input): n / p bytes to each rank
    elif op == "ring_all_reduce":
        ring_all_reduce(x)
    else:
        recursive_doubling_all_reduce(x)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(sizes: list[int], device: torch.device, rounds: int = 3, smoke: bool = False) -> list[dict]:
    """Time every op at every size on the initialized default group; every rank returns the same rows:
    {"op", "p", "bytes", "iters", "seconds"} (seconds per call)."""
    p, rank = dist.get_world_size(), dist.get_rank()
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4 // p * p  # reduce-scatter / all-gather split n evenly: round down to p floats
        nbytes = numel * 4
        for op in OPS:
            # the all-gather's output and the reduce-scatter's input are the n bytes; the other side n / p
            # (the all-to-all sends and receives n)
            big = torch.full((numel,), float(rank + 1), device=device)
            small = torch.empty(numel if op == "all_to_all" else numel // p, device=device)
            x, out = (small, big) if op == "all_gather" else (big, small)
            iters = _iters(nbytes, smoke)
            _call(op, x, out)  # warm-up: connections, buffers
            blocks = []
            for _ in range(rounds):
                _sync(device)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    _call(op, x, out)
                _sync(device)
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # on the device: NCCL reduces no CPU tensor
                blocks.append(float(took) / iters)
            rows.append(
                {"op": op, "p": p, "bytes": nbytes, "iters": iters, "seconds": statistics.median(blocks)}
            )
    return rows


def summarize(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """Add busbw and the fitted model's prediction to every row; return (rows, fits) with one fit
    {"op", "p", "alpha_us", "beta_GBps"} per op."""
    fits = []
    for op in OPS:
        mine = [r for r in rows if r["op"] == op]
        if not mine:
            continue
        p = mine[0]["p"]
        model = fit_alpha_beta(op, p, [r["bytes"] for r in mine], [r["seconds"] for r in mine])
        fits.append({"op": op, "p": p, "alpha_us": model.alpha * 1e6,
                     "beta_GBps": model.beta / 1e9 if math.isfinite(model.beta) else None})  # fmt: skip
        for r in mine:
            pred = model.predict(r["bytes"])
            r["us"] = r["seconds"] * 1e6
            r["busbw_GBps"] = busbw(op, p, r["bytes"], r["seconds"]) / 1e9
            r["model_us"] = pred * 1e6
            r["model_err"] = pred / r["seconds"] - 1.0
    return rows, fits


def _device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _spawned(rank: int, world: int, init: str, backend: str, sizes: list[int], smoke: bool, out: str) -> None:
    torch.set_num_threads(1)  # one core per rank: ranks must not fight over the cores they share
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))  # fmt: skip
    try:
        rows = measure(sizes, _device(backend, rank), rounds=2 if smoke else 3, smoke=smoke)
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 1 else "gloo"


def spawn(nprocs: int, sizes: list[int], backend: str | None = None, smoke: bool = False) -> list[dict]:
    """Start nprocs ranks (gloo processes on CPU; NCCL with one GPU each), measure, return rank 0's rows."""
    backend = backend or default_backend()
    if nprocs < 2:
        raise KilnError(f"timing collectives needs 2 or more ranks, got --nprocs {nprocs}")
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise KilnError(
            f"NCCL needs one GPU per rank: {nprocs} ranks asked, {torch.cuda.device_count()} GPUs; "
            "lower --nprocs or use --backend gloo"
        )
    with tempfile.TemporaryDirectory(prefix="kiln-collectives-") as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(
            _spawned, args=(nprocs, os.path.join(tmp, "init"), backend, sizes, smoke, out), nprocs=nprocs
        )
        return torch.load(out)


def measure_launched(sizes: list[int], smoke: bool = False) -> list[dict] | None:
    """Under torchrun: join the group from the environment, measure; rank 0 gets the rows, others None."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    try:
        rows = measure(sizes, _device(backend, int(os.environ.get("LOCAL_RANK", 0))), smoke=smoke)
        return rows if dist.get_rank() == 0 else None
    finally:
        dist.destroy_process_group()
