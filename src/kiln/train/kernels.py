"""The kernel choice of a training run: `KernelConfig` with "auto" resolved for the shape being trained.

attention "auto" -> "kiln" or "sdpa" by a measurement at start (on CUDA): one forward + backward of
causal attention at the run's shape, (B, T, n_heads, head_dim) queries and (B, T, n_kv_heads, head_dim)
keys/values in the autocast dtype, through exactly the calls the model makes (kiln's FlashAttention, or
F.scaled_dot_product_attention with enable_gqa, which picks cuDNN / flash / efficient itself). The faster
wins, so kiln never trains slower than SDPA would at that shape; the times are logged with the choice.
Elsewhere "auto" is "kiln": on the CPU both paths are eager reference code and kiln's is the one the
tests pin; with attention sinks or a sliding window the SDPA path does not apply (kiln.model.layers).
Under torch.compile the choice is made before tracing (the layer reads it as a constant).
"""

from __future__ import annotations

import dataclasses
import statistics

import torch
import torch.nn.functional as F

from kiln.kernels.attention import attention
from kiln.model.config import KernelConfig, ModelConfig


def _time_ms(fn, iters: int) -> float:
    """Median CUDA-event milliseconds of fn() over `iters` calls (after one untimed call)."""
    fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_attention(cfg: ModelConfig, batch_size: int, seq_len: int, device: torch.device,
                      dtype: torch.dtype = torch.bfloat16, iters: int = 5) -> dict[str, float]:  # fmt: skip
    """{"kiln_ms", "sdpa_ms"}: forward + backward of one layer's causal attention at the shape. CUDA only."""
    if device.type != "cuda":
        raise ValueError("measure_attention times CUDA kernels")
    g = torch.Generator(device=device).manual_seed(0)
    B, T, Hq, Hk, D = batch_size, seq_len, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g).requires_grad_()

    q, k, v = rand(B, T, Hq, D), rand(B, T, Hk, D), rand(B, T, Hk, D)  # the layer's (B, T, H, D) views
    dy = torch.randn(B, T, Hq, D, device=device, dtype=dtype, generator=g)

    def kiln():
        attention(q, k, v, causal=True).backward(dy)

    def sdpa():  # Attention._dense's SDPA call
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        y.transpose(1, 2).backward(dy)

    # two alternating rounds each, so a clock change mid-measurement does not favour one side
    kiln_ms, sdpa_ms = [], []
    for _ in range(2):
        kiln_ms.append(_time_ms(kiln, iters))
        sdpa_ms.append(_time_ms(sdpa, iters))
    return {"kiln_ms": round(min(kiln_ms), 4), "sdpa_ms": round(min(sdpa_ms), 4)}


def resolve_kernels(kernels: KernelConfig, cfg: ModelConfig, batch_size: int, seq_len: int,
                    device: torch.device, dtype: torch.dtype | None) -> tuple[KernelConfig, str]:  # fmt: skip
    """(the KernelConfig to train with, "auto" resolved; one line saying what was chosen and why).
    dtype: the autocast dtype (None: float32)."""
    if kernels.attention != "auto":
        return kernels, f"attention {kernels.attention} (as configured)"
    if device.type != "cuda":
        choice, why = "kiln", f"auto on {device.type}: kiln (both paths are reference code there)"
    elif cfg.attn_sinks or cfg.sliding_window is not None:
        choice, why = "kiln", "auto: kiln (sinks / a sliding window: the SDPA path does not apply)"
    else:
        t = measure_attention(cfg, batch_size, seq_len, device, dtype or torch.float32)
        choice = "sdpa" if t["sdpa_ms"] < t["kiln_ms"] else "kiln"
        why = (
            f"auto: {choice} (forward + backward at B={batch_size} T={seq_len}: "
            f"kiln {t['kiln_ms']:.3f} ms, sdpa {t['sdpa_ms']:.3f} ms)"
        )
    return dataclasses.replace(kernels, attention=choice), why
