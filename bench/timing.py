"""Interleaved timing for benchmarks whose contenders are within a few percent of each other.

`triton.testing.do_bench` times one function at a time, so a contender measured later in a run meets a
different GPU clock, temperature and host load than one measured earlier; on the H200 the same kernel's
median moved by 1-2% between back-to-back measurements, as much as the gaps being ranked. Here every
contender is measured in each of several rounds, in a fresh random order per round, each time with
do_bench (L2 flushed before every call, so each call reads from HBM), and its time is the median over
the rounds.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable

import triton


def interleaved_ms(
    fns: dict[str, Callable[[], object]], rounds: int = 5, rep: int = 20, seed: int = 0
) -> dict[str, dict[str, float | list[float]]]:
    """{name: {"ms": median over rounds, "rounds": [each round's do_bench median]}} (fns warmed up)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(triton.testing.do_bench(fns[name], warmup=2, rep=rep, return_mode="median"))
    return {n: {"ms": statistics.median(t), "rounds": [round(v, 5) for v in t]} for n, t in times.items()}
