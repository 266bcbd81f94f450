"""Ceilings measured on the device at hand, instead of datasheet numbers typed into the code.

`kiln profile ceilings` (and `load_or_measure_ceilings(device)`, which the roofline, the decode breakdown
and every bench/<area>.py read) measures, each with its method stored beside the value:

- dram_copy_TBps     torch copy_ of a 2 GiB bf16 tensor into another; bytes read + bytes written.
- dram_read_TBps     a Triton kernel that sums 2 GiB of float32 (one partial sum per program): bytes read.
- l2_read_TBps       the same kernel over a buffer of a quarter of the L2 (device property), 64 passes,
                     loads with .cg (L2, not L1); the first call loads it, the timed calls find it in L2.
- smem_TBps          a CUDA C kernel compiled by NVRTC (torch.cuda._compile_kernel): 4 blocks of 256 threads
                     per SM, each thread 4096 x 8 conflict-free 16-byte reads of a 32 KiB shared buffer;
                     bytes read. (Triton has no explicit shared memory; a Triton layout-conversion probe
                     hung Triton 3.6's sm_90 compiler.)
- matmul_<dtype>_TFLOPs  8192^3 matmul, 2 * n^3 FLOPs: fp32 with TF32 off (the SIMT rate), tf32, bf16,
                     fp16 through torch.matmul (cuBLAS), fp8 (e4m3, per-tensor scales, bf16 out) through
                     torch._scaled_mm where the device has FP8 (capability >= 8.9).
- launch_triton_host_us  host time per launch of an empty Triton kernel, 2000 launches back to back
                     (what an eager decode step pays per kernel); launch_torch_host_us the same for a
                     one-element torch add_; launch_gpu_period_us the GPU time per kernel of those Triton
                     launches (events around them: the host is the limit when it is larger than the GPU's).
- graph_kernel_us    GPU time per kernel when 500 empty kernels replay from one CUDA graph.
- h2d_pinned_GBps    copy of 256 MiB from pinned host memory to the device.
- spec_dram_TBps     not measured: 2 (double data rate) x memory clock x bus width from the device
                     properties, where torch exposes them (None otherwise); spec_smem_TBps: 128 bytes per
                     cycle per SM x SMs x SM clock. The datasheet figures the measured ones sit under.

Times are medians over repeats between CUDA events, after a warm-up. The whole measurement takes well
under 30 s on an H200. A probe that fails stores None and its error, and the rest still run.

The result is cached per device and torch version under $XDG_CACHE_HOME/kiln/ceilings (default
~/.cache/kiln/ceilings), written atomically; `--refresh` measures again. The older helpers
(`copy_bandwidth`, `matmul_flops`, `measure_ceilings`) stay for the benchmarks: measure_ceilings now reads
the cached ceilings, so a machine measures once and every bench/<area>.py reports against the same
figures. On the H200 the copy measured 4.27 TB/s and the bf16 matmul 632-777 TFLOP/s across machines
(PLATFORM.md), which is why no figure is a constant here.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.errors import KilnError

MATMUL_N = 8192
MATMUL_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
SCHEMA = 1


# ---------------------------------------------------------------------------------------------- timing
def _median_ms(fn: Callable[[], object], iters: int = 10, warmup: int = 2, inner: int = 1) -> float:
    """Median over `iters` of the GPU time of `inner` back-to-back calls, divided by `inner` (ms)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


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
    return 2 * n**3 / (_median_ms(lambda: a @ b, iters, 3) / 1e3)


def copy_bandwidth(device: torch.device, nbytes: int = 2**31, iters: int = 20) -> float:
    """Achieved device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        raise ValueError("copy_bandwidth measures a CUDA device")
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / (_median_ms(lambda: dst.copy_(src), iters, 3) / 1e3)


# ------------------------------------------------------------------------------------------ the probes
def read_bandwidth(device: torch.device, nbytes: int, passes: int = 1, l2: bool = False) -> float:
    """Bytes/s read by kiln.profile.probe_kernels._read_kernel over an nbytes float32 buffer, `passes`
    times (l2: loads bypass L1, the buffer fits the L2)."""
    from kiln.profile.probe_kernels import _read_kernel

    chunk, block = (1 << 12, 1024) if l2 else (1 << 16, 2048)
    programs = max(1, nbytes // 4 // chunk)
    x = torch.ones(programs * chunk, device=device, dtype=torch.float32)
    out = torch.empty(programs, device=device, dtype=torch.float32)

    def run():
        _read_kernel[(programs,)](
            x, out, x.numel(), CHUNK=chunk, PASSES=passes, BLOCK=block, CG=l2, num_warps=4 if l2 else 8
        )

    ms = _median_ms(run, iters=10, warmup=3)
    return passes * x.numel() * 4 / (ms / 1e3)


def smem_bandwidth(device: torch.device, iters: int = 4096, blocks_per_sm: int = 4) -> float:
    """Shared-memory read bytes per second of the NVRTC probe (kiln.profile.probe_kernels.SMEM_READ_SOURCE):
    blocks_per_sm x SMs blocks of 256 threads, each thread `iters` x 8 conflict-free 16-byte loads."""
    from kiln.profile.probe_kernels import SMEM_READ_SOURCE, SMEM_READ_THREADS, SMEM_READS_PER_ITER

    kernel = torch.cuda._compile_kernel(SMEM_READ_SOURCE, "kiln_smem_read")
    blocks = blocks_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    out = torch.empty(blocks * SMEM_READ_THREADS, device=device, dtype=torch.float32)

    def run():
        kernel(grid=(blocks, 1, 1), block=(SMEM_READ_THREADS, 1, 1), args=[out, iters])

    ms = _median_ms(run, iters=10)
    return blocks * SMEM_READ_THREADS * iters * SMEM_READS_PER_ITER * 16 / (ms / 1e3)


def dtype_matmul_tflops(device: torch.device, name: str, n: int = MATMUL_N) -> float | None:
    """TFLOP/s of an n^3 matmul in `name` (MATMUL_DTYPES); None for fp8 where the device has none.
    fp32 and tf32 set torch.backends.cuda.matmul.allow_tf32 for the measurement and restore it."""
    g = torch.Generator(device=device).manual_seed(0)
    if name == "fp8":
        if torch.cuda.get_device_capability(device) < (8, 9):
            return None
        a = (torch.randn(n, n, device=device, generator=g) / 4).to(torch.float8_e4m3fn)
        bt = (torch.randn(n, n, device=device, generator=g) / 4).to(torch.float8_e4m3fn)  # (N, K)
        one = torch.tensor(1.0, device=device)
        fn = lambda: torch._scaled_mm(a, bt.t(), one, one, out_dtype=torch.bfloat16)  # noqa: E731
        return 2 * n**3 / (_median_ms(fn, iters=10) / 1e3) / 1e12
    dt = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    a = torch.randn(n, n, device=device, dtype=dt, generator=g)
    b = torch.randn(n, n, device=device, dtype=dt, generator=g)
    saved = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        return 2 * n**3 / (_median_ms(lambda: a @ b, iters=10) / 1e3) / 1e12
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def launch_latency(device: torch.device, n: int = 2000, graph_kernels: int = 500) -> dict:
    """Host us per launch (Triton, torch), GPU us per kernel for eager launches and inside a CUDA graph."""
    from kiln.profile.probe_kernels import _noop_kernel

    x = torch.zeros(1, device=device)

    def launch():
        _noop_kernel[(1,)](x)

    def host_us(fn):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        dt = time.perf_counter() - t
        torch.cuda.synchronize()
        return dt / n * 1e6

    res = {"triton_host_us": host_us(launch), "torch_host_us": host_us(lambda: x.add_(1))}
    res["gpu_period_us"] = _median_ms(launch, iters=5, warmup=1, inner=n) * 1e3
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        launch()  # compiled and warm before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(graph_kernels):
            launch()
    res["graph_kernel_us"] = _median_ms(graph.replay, iters=10, warmup=2) * 1e3 / graph_kernels
    return res


def h2d_bandwidth(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Bytes/s of a pinned host -> device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return nbytes / (_median_ms(lambda: dst.copy_(src, non_blocking=True), iters=5) / 1e3)


def spec_smem_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of shared memory by the datasheet rule: 128 bytes per cycle per SM x SMs x SM clock (the
    rule torch.cuda._device_limits uses), None when the clock is not exposed."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "clock_rate", None)
    return 128 * props.multi_processor_count * clock_khz * 1e3 if clock_khz else None


def spec_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of the DRAM datasheet figure from the device properties (2 x memory clock x bus width),
    None when this torch build does not expose them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8


METHODS = {
    "dram_copy_TBps": "torch copy_ of 2 GiB bf16; (read + write) bytes / median time",
    "dram_read_TBps": "Triton sum of 2 GiB float32, one partial per program; bytes read / median time",
    "l2_read_TBps": "Triton sum over a quarter of the L2 (device property), 64 passes, .cg loads (no L1); "
    "bytes read / median time, the buffer loaded into L2 by the warm-up",
    "smem_TBps": "CUDA C via NVRTC: 4 blocks x 256 threads per SM, 4096 x 8 conflict-free 16-byte "
    "shared-memory reads per thread; bytes read / median time",
    "matmul_fp32_TFLOPs": f"torch.matmul {MATMUL_N}^3 fp32, TF32 off (SIMT); 2 n^3 / median time",
    "matmul_tf32_TFLOPs": f"torch.matmul {MATMUL_N}^3 fp32 with TF32 allowed",
    "matmul_bf16_TFLOPs": f"torch.matmul {MATMUL_N}^3 bf16 (cuBLAS)",
    "matmul_fp16_TFLOPs": f"torch.matmul {MATMUL_N}^3 fp16 (cuBLAS)",
    "matmul_fp8_TFLOPs": f"torch._scaled_mm {MATMUL_N}^3 e4m3 x e4m3, per-tensor scales, bf16 out "
    "(capability >= 8.9, else None)",
    "launch_triton_host_us": "host time per launch, 2000 empty Triton kernels back to back",
    "launch_torch_host_us": "host time per launch, 2000 one-element torch add_ back to back",
    "launch_gpu_period_us": "GPU time per kernel (events) over 2000 eager Triton launches",
    "graph_kernel_us": "GPU time per kernel, 500 empty Triton kernels replayed from one CUDA graph",
    "h2d_pinned_GBps": "256 MiB pinned host -> device copy_",
    "spec_dram_TBps": "not measured: 2 x memory clock x bus width (device properties), where exposed",
    "spec_smem_TBps": "not measured: 128 bytes per cycle per SM x SMs x SM clock (device properties)",
}


def measure_all(device: torch.device, log: Callable[[str], None] | None = None) -> dict:
    """Every ceiling (METHODS) measured now on a CUDA device: {"values", "methods", "errors", "notes", ...}."""
    if device.type != "cuda":
        raise KilnError(f"ceilings are measured on a CUDA device; this is {device.type}")
    from kiln.profile.provenance import provenance

    props = torch.cuda.get_device_properties(device)
    values: dict[str, float | None] = {}
    errors: dict[str, str] = {}
    notes: dict[str, object] = {}
    t0 = time.perf_counter()

    def probe(keys: tuple[str, ...], fn: Callable[[], tuple]) -> None:
        t = time.perf_counter()
        try:
            out = fn()
            for k, v in zip(keys, out):
                values[k] = None if v is None else round(float(v), 4)
        except Exception as e:  # one failed probe leaves the others: recorded, never hidden
            for k in keys:
                values[k] = None
                errors[k] = f"{type(e).__name__}: {e}"[:500]
        if log:
            log(f"  {', '.join(keys)}: {time.perf_counter() - t:.1f} s")

    l2_bytes = max(1 << 20, props.L2_cache_size // 4) if getattr(props, "L2_cache_size", 0) else 8 << 20
    notes["l2_cache_bytes"] = getattr(props, "L2_cache_size", None)
    notes["l2_probe_bytes"] = l2_bytes
    probe(("dram_copy_TBps",), lambda: (copy_bandwidth(device) / 1e12,))
    probe(("dram_read_TBps",), lambda: (read_bandwidth(device, 2**31) / 1e12,))
    probe(("l2_read_TBps",), lambda: (read_bandwidth(device, l2_bytes, passes=64, l2=True) / 1e12,))
    probe(("smem_TBps",), lambda: (smem_bandwidth(device) / 1e12,))
    for name in MATMUL_DTYPES:
        probe((f"matmul_{name}_TFLOPs",), lambda name=name: (dtype_matmul_tflops(device, name),))

    def launches():
        r = launch_latency(device)
        return r["triton_host_us"], r["torch_host_us"], r["gpu_period_us"], r["graph_kernel_us"]

    probe(
        ("launch_triton_host_us", "launch_torch_host_us", "launch_gpu_period_us", "graph_kernel_us"), launches
    )
    probe(("h2d_pinned_GBps",), lambda: (h2d_bandwidth(device) / 1e9,))
    spec = spec_bandwidth(device)
    values["spec_dram_TBps"] = None if spec is None else round(spec / 1e12, 4)
    smem_spec = spec_smem_bandwidth(device)
    values["spec_smem_TBps"] = None if smem_spec is None else round(smem_spec / 1e12, 4)
    return {
        "schema": SCHEMA,
        **provenance(),
        "device_name": props.name,
        "capability": list(torch.cuda.get_device_capability(device)),
        "sm_count": props.multi_processor_count,
        "measure_s": round(time.perf_counter() - t0, 1),
        "values": values,
        "methods": METHODS,
        "errors": errors,
        "notes": notes,
    }


# ------------------------------------------------------------------------------------------- the cache
def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln" / "ceilings"


def cache_path(device_name: str, directory: str | os.PathLike | None = None) -> Path:
    """<cache dir>/<device name>-<torch version>.json, the name reduced to [A-Za-z0-9._-]."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{device_name}-{torch.__version__}")
    return Path(directory or cache_dir()) / f"{stem}.json"


def load_or_measure_ceilings(
    device: torch.device | str = "cuda",
    refresh: bool = False,
    directory: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """The ceilings of `device` (measure_all's document, plus "cache_path" and "cached": whether it was
    read from the cache): read from the per-device cache, or measured and cached (atomic write) when
    absent, unreadable, of another schema, or when `refresh`. KilnError on a device that is not CUDA."""
    from kiln.profile.report import read_json, write_json

    device = torch.device(device)
    if device.type != "cuda":
        raise KilnError(
            f"ceilings are measured on a CUDA device; this is {device.type} (run on a GPU machine)"
        )
    path = cache_path(torch.cuda.get_device_name(device), directory)
    if not refresh and path.exists():
        try:
            doc = read_json(path)
            if doc.get("schema") == SCHEMA and isinstance(doc.get("values"), dict):
                return {**doc, "cache_path": str(path), "cached": True}
        except (OSError, ValueError):
            pass  # a damaged cache is measured again and replaced
    doc = measure_all(device, log)
    write_json(path, doc)
    return {**doc, "cache_path": str(path), "cached": False}


# --------------------------------------------------------------------------------- reading the figures
def memory_bandwidth(values: dict) -> float | None:
    """Bytes/s of the memory roof: the larger of the DRAM read and copy rates (kernels that mostly read
    reach the read figure; the copy counts read + write)."""
    vs = [values.get("dram_read_TBps"), values.get("dram_copy_TBps")]
    vs = [v for v in vs if v]
    return max(vs) * 1e12 if vs else None


def peak_flops(values: dict, roof: str) -> float | None:
    """FLOP/s of the compute roof named by an op's `roof` (kiln.profile.ops): the measured matmul rate
    of that dtype."""
    v = values.get(f"matmul_{roof}_TFLOPs")
    return v * 1e12 if v else None


UNITS = {"TBps": "TB/s", "GBps": "GB/s", "TFLOPs": "TFLOP/s", "us": "us"}


def ceilings_rows(doc: dict) -> list[dict]:
    """One row per ceiling: name, value, unit, method (the printed table and the docs)."""
    rows = []
    for key, method in doc["methods"].items():
        name, _, unit = key.rpartition("_")
        v = doc["values"].get(key)
        rows.append({"ceiling": name, "value": v, "unit": UNITS.get(unit, unit),
                     "method": method if v is not None or key not in doc["errors"] else doc["errors"][key]})  # fmt: skip
    return rows


# ---------------------------------------------------------------------------- the benchmarks' summary
def measure_ceilings(device: torch.device) -> dict:
    """{"copy_TBps", "bf16_matmul_TFLOPs", ...} for a benchmark run: on CUDA from the cached ceilings
    (load_or_measure_ceilings), with every value under "all"; None values (and a note) on any other
    device, where a benchmark's fractions of a ceiling are not computed."""
    if device.type != "cuda":
        return {"copy_TBps": None, "bf16_matmul_TFLOPs": None, "note": f"not measured on {device.type}"}
    doc = load_or_measure_ceilings(device)
    v = doc["values"]
    return {
        "copy_TBps": v.get("dram_copy_TBps"),
        "read_TBps": v.get("dram_read_TBps"),
        "bf16_matmul_TFLOPs": v.get("matmul_bf16_TFLOPs"),
        "matmul_n": MATMUL_N,
        "source": doc["cache_path"],
        "measured": doc["date"],
        "all": v,
    }


def fraction(value: float | None, ceiling: float | None) -> float | None:
    """value / ceiling rounded to 3 places, None when either is unknown (a CPU smoke run)."""
    if not value or not ceiling:
        return None
    return round(value / ceiling, 3)
