"""The CUDA C++ kernels as functions of torch tensors: vector add, the SGEMM ladder, bf16 and FP8
tensor-core GEMMs, each beside the torch computation it is checked against.

    vector_add(a, b, variant)        out = a + b, fp32; variant "one_per_thread" | "grid_stride" | "float4"
    sgemm(a, b, step)                (M, K) @ (K, N) fp32, any shape; step: a name of ladder.SGEMM_LADDER
    sgemm_warptile(a, b, config)     the warp-tiled step at one of ladder.WARPTILE_CONFIGS (autotuning)
    sgemm_double_buffered(a, b, config)  the double-buffered step (the last) at one of the same configs
    sgemm_skewed(a, b, config)       the double-buffered kernel with conflict-free A stores, ladder.SKEWED_CONFIGS
    mma_bf16(a, b, config)           (M, K) @ (K, N) bf16 -> bf16 (fp32 accumulation); K, N % 8 == 0
    mma_fp8(a, bt, scale_a, scale_b) scale_a * scale_b * (M, K) @ (N, K)^T, e4m3 -> bf16; K % 16, N % 8 == 0
    wgmma_bf16(a, bt, config)        (M, K) @ (N, K)^T bf16 -> bf16 on Hopper wgmma + TMA; K, N % 8 == 0
    wgmma_fp8(a, bt, sa, sb, config) the same in e4m3 with per-tensor scales; K % 16, N % 8 == 0

Inputs must be contiguous CUDA tensors of the stated dtype; anything else is a KilnError naming the
problem. The extension is built on the first call (kiln.kernels.cuda.build). The memory probes are in
kiln.kernels.cuda.probes.
"""

from __future__ import annotations

import torch

from kiln.errors import KilnError
from kiln.kernels.cuda.build import load_extension
from kiln.kernels.cuda.ladder import (
    MMA_CONFIGS,
    SKEWED_CONFIGS,
    WARPTILE_CONFIGS,
    WGMMA_DEFAULT,
    config_index,
    step_index,
    wgmma_config_index,
)

VECTOR_ADD_VARIANTS = ("one_per_thread", "grid_stride", "float4")
INT32_MAX = 2**31 - 1  # the kernels index rows and columns with int


def _check(t: torch.Tensor, name: str, dtype: torch.dtype, dim: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise KilnError(f"{name} must be a torch.Tensor, not {type(t).__name__}")
    if t.device.type != "cuda":
        raise KilnError(
            f"{name} is on {t.device}; kiln's CUDA kernels take CUDA tensors (move it with .cuda())"
        )
    if t.dtype != dtype:
        raise KilnError(f"{name} is {t.dtype}; this kernel takes {dtype} (convert it with .to({dtype}))")
    if dim is not None and t.dim() != dim:
        raise KilnError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise KilnError(f"{name} must be contiguous (call .contiguous() first)")


def _aligned16(*ts: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in ts)


def _matmul_shapes(a: torch.Tensor, b: torch.Tensor, b_is_nk: bool = False) -> tuple[int, int, int]:
    m, k = a.shape
    n, kb = (b.shape[0], b.shape[1]) if b_is_nk else (b.shape[1], b.shape[0])
    if k != kb:
        what = "(N, K)" if b_is_nk else "(K, N)"
        raise KilnError(
            f"inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (expected {what})"
        )
    if min(m, n, k) < 1 or max(m, n, k) > INT32_MAX or m * k > 2**62:
        raise KilnError(f"matmul sizes must be in 1..{INT32_MAX}, got M={m} N={n} K={k}")
    if a.device != b.device:
        raise KilnError(f"a is on {a.device} and b on {b.device}; put them on one device")
    return m, n, k


def vector_add(a: torch.Tensor, b: torch.Tensor, variant: str = "float4") -> torch.Tensor:
    """a + b for fp32 CUDA tensors of one shape; exactly torch's a + b (one fp32 add per element)."""
    _check(a, "a", torch.float32)
    _check(b, "b", torch.float32)
    if a.shape != b.shape or a.device != b.device:
        raise KilnError(f"a {tuple(a.shape)} on {a.device} and b {tuple(b.shape)} on {b.device} differ")
    if variant not in VECTOR_ADD_VARIANTS:
        raise KilnError(
            f"unknown vector add variant {variant!r}; choose one of {', '.join(VECTOR_ADD_VARIANTS)}"
        )
    out = torch.empty_like(a)
    if variant == "float4" and not _aligned16(a, b, out):
        raise KilnError(
            "the float4 vector add needs 16-byte aligned tensors (a slice may not be): use .clone()"
        )
    load_extension().vector_add(a, b, out, VECTOR_ADD_VARIANTS.index(variant))
    return out


def _sgemm_launch(kernel: str, idx: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """c (M, N) = a (M, K) @ b (K, N), fp32, by the extension's `kernel` at index `idx` (a ladder step or a
    tile configuration, checked by the caller)."""
    _check(a, "a", torch.float32, 2)
    _check(b, "b", torch.float32, 2)
    m, n, _ = _matmul_shapes(a, b)
    c = torch.empty(m, n, dtype=torch.float32, device=a.device)
    getattr(load_extension(), kernel)(idx, a, b, c)
    return c


def sgemm(a: torch.Tensor, b: torch.Tensor, step: str | int = "warptiled") -> torch.Tensor:
    """a (M, K) @ b (K, N) in fp32 by one kernel of the SGEMM ladder (kiln.kernels.cuda.ladder)."""
    return _sgemm_launch("sgemm", step_index(step), a, b)


def sgemm_warptile(a: torch.Tensor, b: torch.Tensor, config: int) -> torch.Tensor:
    """a (M, K) @ b (K, N) in fp32 by the warp-tiled kernel at tile configuration
    ladder.WARPTILE_CONFIGS[config] (what the benchmark's autotuning searches)."""
    return _sgemm_launch("sgemm_warptile", config_index(config, WARPTILE_CONFIGS, "warp-tile"), a, b)


def sgemm_double_buffered(a: torch.Tensor, b: torch.Tensor, config: int) -> torch.Tensor:
    """a (M, K) @ b (K, N) in fp32 by the double-buffered kernel (the ladder's last step) at tile
    configuration ladder.WARPTILE_CONFIGS[config]."""
    return _sgemm_launch("sgemm_double_buffered", config_index(config, WARPTILE_CONFIGS, "warp-tile"), a, b)


def sgemm_skewed(a: torch.Tensor, b: torch.Tensor, config: int = 0) -> torch.Tensor:
    """a (M, K) @ b (K, N) in fp32 by the double-buffered kernel with the rows of A's transposed shared
    tile skewed (conflict-free stores), at tile configuration ladder.SKEWED_CONFIGS[config]."""
    return _sgemm_launch("sgemm_skewed", config_index(config, SKEWED_CONFIGS, "skewed SGEMM"), a, b)


def _capability_at_least(device: torch.device, need: tuple[int, int], what: str) -> None:
    cap = torch.cuda.get_device_capability(device)
    if cap < need:
        raise KilnError(
            f"{what} needs compute capability {need[0]}.{need[1]}+, this GPU is {cap[0]}.{cap[1]}"
        )


def mma_bf16(a: torch.Tensor, b: torch.Tensor, config: int = 0) -> torch.Tensor:
    """a (M, K) @ b (K, N) in bf16 on tensor cores (mma.sync, ldmatrix, swizzled shared memory,
    cp.async pipeline, or TMA from a producer warpgroup where the config says tma) at tile configuration
    ladder.MMA_CONFIGS[config]; fp32 accumulation, bf16 result (what torch's bf16 matmul returns)."""
    idx = config_index(config, MMA_CONFIGS, "mma")
    _check(a, "a", torch.bfloat16, 2)
    _check(b, "b", torch.bfloat16, 2)
    m, n, k = _matmul_shapes(a, b)
    if k % 8 or n % 8:
        raise KilnError(
            f"mma_bf16 needs K and N divisible by 8 (16-byte rows for cp.async), got K={k} N={n}: pad them"
        )
    _capability_at_least(a.device, (8, 0), "mma_bf16 (bf16 mma.sync)")
    if MMA_CONFIGS[idx].tma and torch.cuda.get_device_capability(a.device) != (9, 0):
        cap = torch.cuda.get_device_capability(a.device)
        raise KilnError(
            f"mma config {idx} is fed by TMA (Hopper only, compute capability 9.0); this GPU is {cap[0]}.{cap[1]}: "
            "choose a config without tma"
        )
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if not _aligned16(a, b, c):
        raise KilnError("mma_bf16 needs 16-byte aligned tensors (a slice may not be): use .clone()")
    load_extension().mma_bf16(idx, a, b, c)
    return c


def _check_scales(a: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> None:
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        _check(s, name, torch.float32)
        if s.device != a.device:
            raise KilnError(f"{name} is on {s.device} and a on {a.device}; put them on one device")
        if s.numel() != 1:
            raise KilnError(f"{name} must hold one value (per-tensor scaling), got shape {tuple(s.shape)}")


def mma_fp8(a: torch.Tensor, bt: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """scale_a * scale_b * a (M, K) @ bt (N, K)^T with e4m3 operands on tensor cores, bf16 result: what
    `torch._scaled_mm(a, bt.t(), scale_a, scale_b, out_dtype=torch.bfloat16)` computes. Scales are
    1-element fp32 CUDA tensors (per-tensor scaling)."""
    _check(a, "a", torch.float8_e4m3fn, 2)
    _check(bt, "bt", torch.float8_e4m3fn, 2)
    _check_scales(a, scale_a, scale_b)
    m, n, k = _matmul_shapes(a, bt, b_is_nk=True)
    if k % 16 or n % 8:
        raise KilnError(f"mma_fp8 needs K divisible by 16 and N by 8, got K={k} N={n}: pad them")
    _capability_at_least(a.device, (8, 9), "mma_fp8 (e4m3 mma.sync)")
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if not _aligned16(a, bt, c):
        raise KilnError("mma_fp8 needs 16-byte aligned tensors (a slice may not be): use .clone()")
    load_extension().mma_fp8(a, bt, scale_a, scale_b, c)
    return c


def _wgmma_checks(a: torch.Tensor, bt: torch.Tensor, dtype: torch.dtype, k_mult: int, what: str):
    _check(a, "a", dtype, 2)
    _check(bt, "bt", dtype, 2)
    m, n, k = _matmul_shapes(a, bt, b_is_nk=True)
    if k % k_mult or n % 8:
        raise KilnError(
            f"{what} needs K divisible by {k_mult} (16-byte rows for TMA) and N by 8, got K={k} N={n}: pad them"
        )
    if torch.cuda.get_device_capability(a.device) != (9, 0):
        cap = torch.cuda.get_device_capability(a.device)
        raise KilnError(
            f"{what} runs on Hopper only (wgmma and TMA, compute capability 9.0); this GPU is {cap[0]}.{cap[1]}: "
            "use mma_bf16 / mma_fp8"
        )
    c = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if not _aligned16(a, bt, c):
        raise KilnError(f"{what} needs 16-byte aligned tensors (a slice may not be): use .clone()")
    return c


def wgmma_bf16(a: torch.Tensor, bt: torch.Tensor, config: int = WGMMA_DEFAULT) -> torch.Tensor:
    """a (M, K) @ bt (N, K)^T in bf16 on Hopper warpgroup MMA fed by TMA (ladder.WGMMA_CONFIGS[config]),
    fp32 accumulation, bf16 result: what `a @ bt.t()` (F.linear(a, bt)) returns. bt is K-major, the layout
    of an nn.Linear weight."""
    idx = wgmma_config_index(config)
    c = _wgmma_checks(a, bt, torch.bfloat16, 8, "wgmma_bf16")
    load_extension().wgmma_bf16(idx, a, bt, c)
    return c


def wgmma_fp8(
    a: torch.Tensor,
    bt: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    config: int = WGMMA_DEFAULT,
) -> torch.Tensor:
    """scale_a * scale_b * a (M, K) @ bt (N, K)^T with e4m3 operands on Hopper wgmma + TMA, bf16 result:
    what `torch._scaled_mm(a, bt.t(), scale_a, scale_b, out_dtype=torch.bfloat16)` computes."""
    idx = wgmma_config_index(config)
    _check(a, "a", torch.float8_e4m3fn, 2)
    _check(bt, "bt", torch.float8_e4m3fn, 2)
    _check_scales(a, scale_a, scale_b)
    c = _wgmma_checks(a, bt, torch.float8_e4m3fn, 16, "wgmma_fp8")
    load_extension().wgmma_fp8(idx, a, bt, scale_a, scale_b, c)
    return c
