"""Ceilings measured on the device at hand, instead of datasheet numbers typed into the code.

MFU is reported against the dense bf16 matmul rate that cuBLAS reaches on this GPU, measured once at
the start of a run (a fraction of a second), so it reads the same way on any CUDA machine. Benchmarks
state their bandwidth against the device-to-device copy measured in the same run (`measure_ceilings`):
on the H200 the copy measured 4.27 TB/s (read + write) and the matmul 632-777 TFLOP/s across machines,
which is why neither figure is a constant here.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def matmul_flops(
    device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 4096, iters: int = 20
) -> float:
    """Achieved FLOP/s of an n x n x n matmul (median of `iters` timed runs after warm-up). CUDA only."""
    if device.type != "cuda":
        raise ValueError("matmul_flops measures a CUDA device; on CPU kiln reports no MFU")
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int = 2**31, iters: int = 20) -> float:
    """Achieved device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        raise ValueError("copy_bandwidth measures a CUDA device")
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def measure_ceilings(device: torch.device) -> dict:
    """{"copy_TBps", "bf16_matmul_TFLOPs", "matmul_n"} measured now on a CUDA device; None values (and a
    note) on any other device, where a benchmark's fractions of a ceiling are not computed."""
    if device.type != "cuda":
        return {"copy_TBps": None, "bf16_matmul_TFLOPs": None, "note": f"not measured on {device.type}"}
    n = 4096
    return {
        "copy_TBps": round(copy_bandwidth(device) / 1e12, 3),
        "bf16_matmul_TFLOPs": round(matmul_flops(device, torch.bfloat16, n) / 1e12, 1),
        "matmul_n": n,
    }


def fraction(value: float | None, ceiling: float | None) -> float | None:
    """value / ceiling rounded to 3 places, None when either is unknown (a CPU smoke run)."""
    if not value or not ceiling:
        return None
    return round(value / ceiling, 3)
