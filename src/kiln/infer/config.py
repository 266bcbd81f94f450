"""EngineConfig: the inference engine's settings, one validated dataclass (printed at start)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError
from kiln.model.config import KernelConfig

DECODE_BACKENDS = ("graphs", "compile", "eager")
ASYNC_SCHEDULING = ("auto", "on", "off")
DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    """
    device                  "auto" (CUDA when present), "cpu", "cuda", "cuda:N"
    dtype                   weights and KV cache: "auto" (bf16 on CUDA, fp32 on CPU), "fp32", "bf16", "fp16"
    block_size              tokens per KV-cache page
    num_blocks              KV pages; None: from free device memory x memory_fraction on CUDA (after a
                            profiling forward of the largest step), from cpu_kv_cache_bytes on CPU
    memory_fraction         share of the device memory (free after loading the weights) the engine may use
    cpu_kv_cache_bytes      KV-cache size on CPU when num_blocks is None
    max_num_seqs            sequences in one step at most
    max_num_batched_tokens  tokens in one step at most (prefill chunks + decodes)
    max_model_len           prompt + output per sequence; None: the model's max_seq_len
    enable_prefix_caching   reuse the KV pages of identical full-block prefixes across requests
    chunked_prefill         split prompts longer than the step budget across steps (else they wait)
    seed                    seeds the per-request seeds of requests that give none
    decode_backend          how decode-only steps run on CUDA: "graphs" (one CUDA graph per batch bucket,
                            kiln.infer.cuda_graph), "compile" (torch.compile'd step, then captured the same
                            way), "eager" (no graphs: every kernel launched from Python). On CPU, "graphs"
                            and "compile" run the same padded static-buffer step without a graph.
    max_graph_batch         the largest decode bucket captured; larger decode steps run eagerly
    async_scheduling        schedule and launch step N+1 before step N's sampled ids reach the host, so the
                            host's work (scheduling, input staging, postprocess, detokenizing) overlaps
                            the GPU's (kiln.infer.engine): "on", "off", or "auto" (on for CUDA, off on
                            CPU, where the host runs the kernels itself and nothing could overlap); the
                            outputs are the same token for token either way
    warmup                  on CUDA, tune and compile the attention kernels of every step shape at start
                            (ModelRunner.warm_up: seconds, once per process; Triton's disk cache shortens
                            later starts); off: each tunes at its first use, inside a served step
    kernels                 the model's per-op kernel choice (kiln.model.config.KernelConfig)
    """

    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 28
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    chunked_prefill: bool = True
    seed: int = 0
    decode_backend: str = "graphs"
    max_graph_batch: int = 256
    async_scheduling: str = "auto"
    warmup: bool = True
    kernels: KernelConfig = field(default_factory=KernelConfig)

    def __post_init__(self) -> None:
        if isinstance(self.kernels, dict):
            self.kernels = KernelConfig(**self.kernels)
        if isinstance(self.async_scheduling, bool):  # a bool from Python code reads as on / off
            self.async_scheduling = "on" if self.async_scheduling else "off"
        if self.async_scheduling not in ASYNC_SCHEDULING:
            raise KilnError(
                f"engine async_scheduling {self.async_scheduling!r} is not one of {', '.join(ASYNC_SCHEDULING)}"
            )
        if self.dtype not in DTYPES:
            raise KilnError(f"engine dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.decode_backend not in DECODE_BACKENDS:
            raise KilnError(
                f"engine decode_backend {self.decode_backend!r} is not one of {', '.join(DECODE_BACKENDS)}"
            )
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "cpu_kv_cache_bytes",
            "max_graph_batch",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise KilnError(f"engine {name} must be a positive integer, got {v!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise KilnError(f"engine num_blocks must be a positive integer or None, got {self.num_blocks!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise KilnError(f"engine max_model_len must be positive, got {self.max_model_len}")
        if not (0.0 < self.memory_fraction <= 1.0) or not math.isfinite(self.memory_fraction):
            raise KilnError(f"engine memory_fraction must be in (0, 1], got {self.memory_fraction}")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise KilnError(
                f"engine device {self.device!r} is not a device: use auto, cpu, cuda or cuda:N"
            ) from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise KilnError(
                f"engine device {self.device!r}: CUDA is not available on this machine: use --device cpu"
            )
        return dev

    def resolve_async(self, device: torch.device) -> bool:
        """Whether the engine overlaps its host work with the device (async_scheduling "auto": on CUDA)."""
        if self.async_scheduling == "auto":
            return device.type == "cuda"
        return self.async_scheduling == "on"

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        dt = DTYPES[self.dtype]
        if dt is None:
            dt = torch.bfloat16 if device.type == "cuda" else torch.float32
        return dt
