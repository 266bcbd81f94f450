"""Host time of a training step: plain, FSDP2 at world size 1, plain again (cProfile of 10 steps each).

    python bench/dist_host_profile.py gpu bench/results/distributed     # on a GPU: the gpu preset shape
    python bench/dist_host_profile.py tiny /tmp                          # the CPU (gloo), the tiny model

Builds each case as bench/distributed.py does (its `_build`, `Settings`, `MODELS`), steps kiln's Trainer,
and writes `fsdp_prof_<model>_<case>.txt` per case: the step time measured without the profiler (10 steps
between syncs), then cProfile's top entries by own time and by cumulative time over 10 more steps. When
the profiled host time per step is about the step time, the step is bound by the host, and a wrapper's
Python (FSDP2's hooks) adds to it one for one. docs/distributed.md reads the H200 run.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import distributed as bench  # noqa: E402  (bench/distributed.py: the cases' builders)
from kiln.dist.parallel_dims import ParallelConfig  # noqa: E402
from kiln.model import ModelConfig  # noqa: E402
from kiln.train.config import RunConfig, TokenizerConfig, TrainConfig  # noqa: E402
from kiln.train.env import DistEnv  # noqa: E402
from kiln.train.loop import Trainer  # noqa: E402
from kiln.train.optim import OptimConfig, build_optimizer  # noqa: E402


def profile_case(kind: str, model_name: str, dev: torch.device, out: Path) -> str:
    spec, b, seq = bench.MODELS[model_name]
    mcfg = ModelConfig(**spec)
    s = bench.Settings(steps=30, warmup=5, round_steps=5, dtype="bf16" if dev.type == "cuda" else "fp32",
                       lr=3e-4, lr_warmup=2, case_timeout_s=100)  # fmt: skip
    model, strategy, _ = bench._build(bench.Case(kind, model_name, 1, kind, b), s, 0, 1, dev)
    ocfg = OptimConfig(3e-4, 0.1, 0.9, 0.95, 1e-8)
    if strategy is None:
        optimizer = build_optimizer(model, ocfg)
    else:
        optimizer = strategy.build_optimizer(model, lambda m: build_optimizer(m, ocfg))
    loader = bench.SyntheticBatches(mcfg.vocab_size, seq, b, 1, 0, 1)
    tc = TrainConfig(steps=100, batch_size=b, seq_len=seq, lr=3e-4, warmup_steps=2, grad_clip=1.0, dtype=s.dtype,
                     seed=1, log_interval=100, eval_interval=100, ckpt_interval=100)  # fmt: skip
    tmp = tempfile.mkdtemp()
    cfg = RunConfig(out_dir=tmp, device=str(dev), tokenizer=TokenizerConfig(vocab_size=mcfg.vocab_size),
                    model=mcfg, train=tc, parallel=ParallelConfig())  # fmt: skip
    trainer = Trainer(cfg, model, optimizer, loader, [], None, dev, DistEnv(0, 0, 1), Path(tmp), progress=False,
                      strategy=strategy)  # fmt: skip
    for _ in range(5):  # warm-up: kernels compile, the allocator settles
        trainer.train_step()
    bench._sync(dev)
    t = time.perf_counter()
    for _ in range(10):
        trainer.train_step()
    bench._sync(dev)
    step = (time.perf_counter() - t) / 10
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    for _ in range(10):
        trainer.train_step()
    host = (time.perf_counter() - t) / 10  # before the sync: the host's own time per step (with cProfile's)
    bench._sync(dev)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumtime").print_stats(40)
    line = f"{model_name} {kind}: step {step * 1e3:.2f} ms, profiled host {host * 1e3:.2f} ms"
    (out / f"fsdp_prof_{model_name}_{kind}.txt").write_text(line + "\n" + text.getvalue())
    return line


def main() -> None:
    model_name = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    out = Path(sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    if model_name not in bench.MODELS:
        raise SystemExit(f"unknown model {model_name!r}: choose from {', '.join(bench.MODELS)}")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        for kind in ("plain", "fsdp1", "plain"):
            print(profile_case(kind, model_name, dev, out), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
