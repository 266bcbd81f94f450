"""Memory-hierarchy probes on the GPU (kernels in csrc/probes.cu): each sweeps one parameter and returns
one row per point, measured now.

    strided_reads(strides)        global-memory read bandwidth vs stride (coalescing)
    bank_conflicts(strides)       shared-memory read rate vs stride, and stride 33 (the padded fix of 32)
    latency(sizes)                pointer-chasing latency vs working-set size (L1 -> L2 -> DRAM)
    occupancy()                   streaming bandwidth vs registers per thread (and resident warps per SM)
    mma_sync_peak()               the bf16 mma.sync instruction's rate on registers (csrc/mma_kernels.cuh)

Times are medians of triton.testing.do_bench (L2 flushed before each call) except the latency probe,
which counts clock64 cycles inside the kernel and also times two chase lengths with CUDA events (their
difference cancels the launch and the untimed warm-up).
"""

from __future__ import annotations

import math

import torch

from kiln.kernels.cuda.build import load_extension

THREADS = 256  # every probe kernel's block size (csrc/probes.cu)


def _ms(fn, rep: int = 30) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def _sms() -> int:
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def strided_reads(strides=range(1, 33), n: int = 1 << 24) -> list[dict]:
    """Reads n floats, x[i * stride], for each stride: useful GB/s (n * 4 bytes over the time) and the
    fraction of each 32-byte sector that is used, max(1 / stride, 1 / 8) (stride 1: every byte; >= 8: 1/8)."""
    ext = load_extension()
    strides = list(strides)
    x = torch.rand(n * max(strides), device="cuda")
    grid = _sms() * 8
    out = torch.empty(grid * THREADS, device="cuda")
    rows = []
    for s in strides:
        ms = _ms(lambda s=s: ext.strided_read(x, out, n, s, grid))
        rows.append({"stride": s, "ms": round(ms, 4), "GBps": round(n * 4 / ms / 1e6, 1),
                     "sector_use": round(max(1 / s, 1 / 8), 3)})  # fmt: skip
    return rows


def bank_conflicts(strides=(*range(1, 33), 33), iters: int = 4096) -> list[dict]:
    """Shared-memory reads at word lane * stride: GB/s, the slowdown against stride 1, and the
    conflict degree the bank model predicts, gcd(stride, 32) (32 banks of 4 bytes)."""
    ext = load_extension()
    grid = _sms() * 8
    out = torch.empty(grid * THREADS, device="cuda")
    rows = []
    for s in strides:
        ms = _ms(lambda s=s: ext.smem_bank(out, s, grid, iters))
        rows.append({"stride": s, "ms": round(ms, 4), "GBps": round(grid * THREADS * iters * 4 / ms / 1e6, 1),
                     "predicted_ways": math.gcd(s, 32), "note": "padded 32x33 tile" if s == 33 else ""})  # fmt: skip
    for r in rows:
        r["slowdown"] = round(r["ms"] / rows[0]["ms"], 2)
    return rows


def _chain(n_bytes: int, line: int = 128, seed: int = 0) -> torch.Tensor:
    """A uint32 array of n_bytes whose words at multiples of line/4 form one random cycle through every
    line: next[slot] = the index of the next slot. Random order defeats the prefetchers; one word per
    128-byte line means every step touches a new line."""
    words = line // 4
    slots = max(n_bytes // line, 2)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(slots, generator=g, dtype=torch.int64) * words
    nxt = torch.zeros(slots * words, dtype=torch.int64)
    nxt[perm] = torch.roll(perm, -1)
    return nxt.to(torch.int32).cuda()  # read as uint32 by the kernel; indices stay below 2**31


def _chase_ms(ext, nxt, warm: int, iters: int, cycles, sink) -> float:
    """Milliseconds of one pointer-chase launch, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    ext.pointer_chase(nxt, warm, iters, cycles, sink)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def latency(sizes=tuple(1 << p for p in range(12, 29)), iters: int = 4096) -> list[dict]:
    """Dependent-load latency for working sets of `sizes` bytes: cycles per load (clock64) and ns per
    load (CUDA events: time of 2 * iters steps minus time of iters steps, over iters)."""
    ext = load_extension()
    cycles = torch.zeros(1, dtype=torch.int64, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    rows = []
    for size in sizes:
        nxt = _chain(size)
        slots = max(size // 128, 2)
        warm = min(slots, 1 << 18)  # a full lap brings a cache-sized set in; past 32 MiB only part of one

        _chase_ms(ext, nxt, warm, iters, cycles, sink)  # first touch of the pages
        t1 = min(_chase_ms(ext, nxt, warm, iters, cycles, sink) for _ in range(3))
        t2 = min(_chase_ms(ext, nxt, warm, 2 * iters, cycles, sink) for _ in range(3))  # leaves its cycles
        rows.append({"bytes": size, "KiB": size // 1024, "cycles": round(int(cycles.item()) / (2 * iters), 1),
                     "ns": round((t2 - t1) * 1e6 / iters, 1)})  # fmt: skip
    return rows


def occupancy(n_bytes: int = 1 << 28) -> list[dict]:
    """A streaming read of n_bytes with R ballast registers per thread, for each R the kernel was built
    with: registers per thread, spilled bytes, resident warps per SM (occupancy) and GB/s."""
    ext = load_extension()
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    max_warps = props.max_threads_per_multi_processor // 32
    x = torch.rand(n_bytes // 4, device="cuda")
    rows = []
    for variant, ballast in enumerate(ext.occupancy_ballast()):
        regs, local, blocks = ext.occupancy_info(variant)
        grid = max(blocks, 1) * props.multi_processor_count  # one full wave; the kernel grid-strides
        out = torch.empty(grid * THREADS, device="cuda")
        ms = _ms(lambda v=variant, g=grid, o=out: ext.occupancy_read(v, x, o, g))
        warps = blocks * THREADS // 32
        rows.append({"ballast": ballast, "regs": regs, "spill_bytes": local, "warps_per_sm": warps,
                     "occupancy": round(warps / max_warps, 3), "GBps": round(n_bytes / ms / 1e6, 1)})  # fmt: skip
    return rows


def mma_sync_peak(iters: int = 4096, blocks_per_sm: int = 4) -> dict:
    """TFLOP/s of bf16 mma.sync m16n8k16 with no memory traffic (kernel mma_peak): blocks_per_sm blocks of
    8 warps on every SM, each warp iters x chains independent mma on registers. The ceiling of the
    mma.sync GEMMs on this GPU. Checks that every mma ran (each thread's sum is chains * 4 * iters * 16)."""
    ext = load_extension()
    chains = ext.mma_peak_chains()
    grid = _sms() * blocks_per_sm
    out = torch.empty(grid * THREADS, device="cuda")
    ms = _ms(lambda: ext.mma_peak(iters, grid, out))
    expected = float(chains * 4 * iters * 16)
    exact = bool((out == expected).all())
    flops = grid * (THREADS // 32) * iters * chains * 2 * 16 * 8 * 16
    return {"TFLOPs": round(flops / ms / 1e9, 1), "ms": round(ms, 4), "iters": iters, "chains": chains,
            "warps_per_sm": blocks_per_sm * THREADS // 32, "exact": exact}  # fmt: skip
