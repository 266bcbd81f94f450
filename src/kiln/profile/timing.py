"""Timing for benchmarks: medians with triton.testing.do_bench, candidates interleaved, GPU-only time from
CUDA graphs, and host time per call.

Why interleave: `do_bench` times one function at a time, so a candidate measured later in a run meets a
different GPU clock, temperature and host load than one measured earlier; on the H200 the same kernel's
median moved by 1-2% between back-to-back measurements, as much as the gaps being ranked. `interleaved`
times every candidate in each of several rounds, in a fresh random order per round, and reports the
median over the rounds.

A smoke timer (`Timer(smoke=True)`, the benchmarks' `--smoke` on the CPU) calls each function once and
returns its wall time: the script runs end to end, the numbers mean nothing (and cost one interpreted
call each, which is what keeps a smoke run to seconds).
triton is imported inside the methods, so importing this module does not fix Triton's interpreter choice.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable


class Timer:
    """Milliseconds per call, by do_bench on a GPU (L2 flushed before every call) or once on the CPU."""

    def __init__(self, smoke: bool, warmup_ms: int = 10, rep_ms: int = 50, rounds: int = 5, seed: int = 0):
        self.smoke = smoke
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.rounds = rounds
        self.seed = seed

    def _once(self, fn: Callable[[], object]) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def ms(self, fn: Callable[[], object], rep_ms: int | None = None) -> float:
        """Median ms of fn() (do_bench: warm-up, then calls for about `rep_ms`, each after an L2 flush)."""
        if self.smoke:
            return self._once(fn)
        import triton.testing

        rep = self.rep_ms if rep_ms is None else rep_ms
        return triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=rep, return_mode="median")

    def interleaved(
        self, fns: dict[str, Callable[[], object]], rep_ms: int = 20, graph: bool = False
    ) -> dict[str, dict]:
        """{name: {"ms": median over rounds, "rounds": [each round's median]}}; each fn is called once
        first (compile, autotune) outside the timing. graph: each round replays fn from a CUDA graph
        (GPU time), else do_bench with ordinary launches."""
        if self.smoke:
            return {name: {"ms": self._once(fn), "rounds": []} for name, fn in fns.items()}
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {name: [] for name in fns}
        order = list(fns)
        rng = random.Random(self.seed)
        for _ in range(self.rounds):
            rng.shuffle(order)
            for name in order:
                fn = fns[name]
                times[name].append(self.graph(fn, rep_ms=rep_ms) if graph else self.ms(fn, rep_ms=rep_ms))
        return {n: {"ms": statistics.median(t), "rounds": [round(v, 5) for v in t]} for n, t in times.items()}

    def graph(self, fn: Callable[[], object], rep_ms: int = 20) -> float | None:
        """Median ms of fn() replayed from a CUDA graph: the GPU time without the host's launch and
        autograd overhead (do_bench_cudagraph). None in a smoke run."""
        if self.smoke:
            return None
        import triton.testing

        fn()  # compile and autotune outside the capture
        return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")

    def host(self, fn: Callable[[], object], n: int = 30) -> float | None:
        """Host (CPU) ms per call, launches queued without waiting for the GPU. None in a smoke run."""
        if self.smoke:
            return None
        import torch

        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n * 1e3
        torch.cuda.synchronize()
        return host


def ratio(peer_ms: float | None, kiln_ms: float | None) -> float | None:
    """peer time / kiln time (> 1: kiln faster), None when either is missing."""
    if not peer_ms or not kiln_ms:
        return None
    return round(peer_ms / kiln_ms, 4)


def capture_graph(calls: list[Callable[[], object]], cuda: bool):
    """Run `calls` once (compiles, allocations), then capture them in order into one CUDA graph; None off
    CUDA (the calls have run once, which is what a smoke run checks)."""
    for c in calls:
        c()
    if not cuda:
        return None
    import torch

    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph


def flushed_graph_ms(graphs: dict, rounds: int, reps: int, cuda: bool, seed: int = 0) -> dict:
    """{name: median ms} of each graph's replay, each replay after a read-only 512 MB L2 flush (the L2 then
    holds none of the replay's data and no dirty lines, as in a step whose other kernels stream through it),
    the graphs interleaved over `rounds` in a fresh random order, `reps` replays each a round. Off CUDA
    every figure is None."""
    if not cuda:
        return {k: None for k in graphs}
    import torch

    flush = torch.ones(2**28, dtype=torch.bfloat16, device="cuda")  # 512 MB, read by a sum
    times: dict = {k: [] for k in graphs}
    order = list(graphs)
    rng = random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for k in order:
            ev = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(reps)
            ]
            for a, b in ev:
                flush.sum()
                a.record()
                graphs[k].replay()
                b.record()
            torch.cuda.synchronize()
            times[k] += [a.elapsed_time(b) for a, b in ev]
    return {k: statistics.median(v) for k, v in times.items()}
