"""Quantized linears: the model's Linear / MergedLinear with the weight stored in INT8, INT4 or FP8.

`QuantLinear` holds buffers instead of a float weight (N = out_features, K = in_features):
- "int8": qweight int8 (N, K), scales (N, 1): per-output-channel symmetric;
- "int4": qweight uint8 (N, K / 2) (two per byte, kiln.kernels.quant_matmul's layout), scales (N, K / G),
  zeros uint8 (N, K / G) when asymmetric (symmetric: the zero point 8 is implied);
- "fp8": qweight (N, K) e4m3 bits held as uint8 (a Module.to(dtype) casts every floating-point tensor,
  float8 included; uint8 it leaves alone, and the forward views the bits as float8 for free), scales (N, 1);
  activations are quantized per row at run time (kiln.kernels.fp8_matmul), by the RMSNorm or SwiGLU kernel
  that produces them where `takes_fp8_rows` says so (the model passes Fp8Rows), else by fp8_linear.
Scales are float values representable in bfloat16 (kiln.quant rounds them before quantizing), so casting
the model to bfloat16, float16 or float32 leaves them exact. The bias stays a float parameter.

A merged projection (q/k/v, gate/up) stays merged: `parts` and `split` as in MergedLinear, its buffers under
the merged name (`...qkv_proj.qweight`). `replace_linears` swaps every Linear of a model (and the LM head,
tied or not) for what a function returns: quantization by module replacement (gpt-fast), with the
Transformer unchanged but for its head, which calls a quantized `lm_head` module when there is one.
The forward is shape-only Python around one or two kernel launches: no host syncs, so it records into a
CUDA graph like the float linears.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from kiln.kernels.dispatch import sm_count, use_triton
from kiln.kernels.fp8_matmul import FP8, Fp8Rows, fp8_linear, fp8_linear_takes_rows
from kiln.kernels.quant_matmul import (
    GROUP_SIZES,
    preload,
    wq_decode_config,
    wq_linear,
    wq_matmul_fwd,
    wq_swiglu_fusable,
)
from kiln.model.linear import Linear, MergedLinear

KINDS = ("int8", "int4", "fp8")


class QuantLinear(nn.Module):
    """y = x W^T + b with W quantized (module docstring). Buffers are allocated empty on the current
    default device (a meta-device model for loading) and filled by `load_state_dict` or `set_quantized`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        kind: str,
        group_size: int = 0,
        asymmetric: bool = False,
        parts: dict[str, int] | None = None,
    ):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"quantized linear kind must be one of {KINDS}, got {kind!r}")
        if kind == "int4" and (group_size not in GROUP_SIZES or in_features % group_size):
            raise ValueError(
                f"int4 needs a group size in {GROUP_SIZES} dividing in_features={in_features}, got {group_size}"
            )
        if asymmetric and kind != "int4":
            raise ValueError("zero points (asymmetric) exist for int4 only")
        if parts is not None and sum(parts.values()) != out_features:
            raise ValueError(f"parts {parts} do not add up to out_features={out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.kind, self.group_size, self.asymmetric = kind, group_size if kind == "int4" else 0, asymmetric
        self.parts = dict(parts) if parts is not None else None
        N, K = out_features, in_features
        if kind == "int4":
            self.register_buffer("qweight", torch.empty(N, K // 2, dtype=torch.uint8))
            self.register_buffer("scales", torch.empty(N, K // group_size, dtype=torch.bfloat16))
            zeros = torch.empty(N, K // group_size, dtype=torch.uint8) if asymmetric else None
            self.register_buffer("zeros", zeros)
        else:
            self.register_buffer(
                "qweight", torch.empty(N, K, dtype=torch.int8 if kind == "int8" else torch.uint8)
            )
            self.register_buffer("scales", torch.empty(N, 1, dtype=torch.bfloat16))
            self.register_buffer("zeros", None)
        self.bias = nn.Parameter(torch.empty(N), requires_grad=False) if bias else None

    @property
    def bits(self) -> int:
        return 4 if self.kind == "int4" else 8

    def set_quantized(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> None:  # fmt: skip
        """Fill the buffers (shapes and dtypes as allocated; fp8 weights may come as float8)."""
        if self.kind == "fp8" and qweight.dtype == FP8:
            qweight = qweight.view(torch.uint8)
        for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
            have = getattr(self, name)
            if (t is None) != (have is None):
                raise ValueError(f"{name}: expected {'a tensor' if have is not None else 'none'}")
            if t is not None:
                if t.shape != have.shape or (name != "scales" and t.dtype != have.dtype):
                    raise ValueError(
                        f"{name}: expected {have.dtype} {tuple(have.shape)}, got {t.dtype} {tuple(t.shape)}"
                    )
                setattr(self, name, t.to(have.device) if have.device.type != "meta" else t)
        if (bias is None) != (self.bias is None):
            raise ValueError("bias: given for a linear without one, or missing")
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """x (..., K) -> (..., N); an FP8 linear also takes Fp8Rows (M, K) (see takes_fp8_rows) -> (M, N)."""
        bias = self._bias_like(x)
        if self.kind == "fp8":
            return fp8_linear(x, self.qweight.view(FP8), self.scales, bias)
        return wq_linear(x, self.qweight, self.scales, self.zeros, self.bits, self.group_size, bias)

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether the producer of this linear's input (a norm or the SwiGLU, whose own input is x (N, any))
        should quantize its output rows and hand them over as Fp8Rows: an FP8 linear on a flat (N, K) token
        stream whose fp8_linear would otherwise quantize them in a launch of its own (prefill, and decode
        shapes without a swept decode config: kiln.kernels.fp8_matmul.fp8_linear_takes_rows)."""
        return self.kind == "fp8" and x.dim() == 2 and fp8_linear_takes_rows(x, self.qweight)

    def reads_early(self, x: torch.Tensor) -> bool:
        """Whether this projection of x (a flat (tokens, features) step) is of one token and loads its
        first K step's weights before its programmatic-launch wait (kiln.kernels.quant_matmul.preload;
        KILN_QUANT_PREW=off turns it off), so that the kernel ahead of it may let it be scheduled early (as
        Linear.reads_early). Ahead of projections that read nothing early, that early signal cost 6% at
        batch 1 (docs/perf/inference.md)."""
        if self.kind == "fp8" or x.dim() != 2 or x.shape[0] != 1 or torch.compiler.is_compiling():
            return False
        if not use_triton(x, self.qweight):
            return False
        N, K = self.out_features, self.in_features
        config = wq_decode_config(1, N, K, self.bits, self.group_size, sm_count(x.device), self.asymmetric)
        return preload(1, N, K, config)

    def swiglu_fusable(self, x: torch.Tensor) -> bool:
        """Whether swiglu_decode(x) runs for this one-token step: an int8 / int4 gate/up projection (two parts
        of one size) whose decode config at one row is the fma form with K unsplit
        (kiln.kernels.quant_matmul.wq_swiglu_fusable), outside torch.compile."""
        sizes = list(self.parts.values()) if self.parts is not None else []
        return (
            self.kind != "fp8"
            and len(sizes) == 2
            and sizes[0] == sizes[1]
            and not torch.compiler.is_compiling()
            and wq_swiglu_fusable(
                x, self.out_features, self.in_features, self.bits, self.group_size, self.asymmetric
            )
        )

    def swiglu_decode(self, x: torch.Tensor) -> torch.Tensor:
        """swiglu(self(x)) (1, F) with the SwiGLU in the quantized decode matmul's epilogue (where
        swiglu_fusable(x)): the bits of self(x) followed by kiln's SwiGLU kernel, one launch."""
        return wq_matmul_fwd(x, self.qweight, self.scales, self.zeros, self.bits, self.group_size,
                             self._bias_like(x), epilogue="swiglu")  # fmt: skip

    def _bias_like(self, x: torch.Tensor) -> torch.Tensor | None:
        """The bias in x's dtype (a float32 bias under 16-bit activations is cast), or None."""
        bias = self.bias
        return bias if bias is None or bias.dtype == x.dtype else bias.to(x.dtype)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.parts is None:
            raise ValueError("split() is for merged projections (built with parts)")
        return tuple(y.split(list(self.parts.values()), dim=-1))

    def weight_bytes(self) -> int:
        """Bytes a forward reads for the weight: quantized values, scales and zero points."""
        return sum(
            t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros) if t is not None
        )

    def extra_repr(self) -> str:
        g = (
            f", group={self.group_size}{', asymmetric' if self.asymmetric else ''}"
            if self.kind == "int4"
            else ""
        )
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, {self.kind}{g}"


def quant_linear_like(
    module: nn.Module, kind: str, group_size: int = 0, asymmetric: bool = False
) -> QuantLinear:
    """An empty QuantLinear of `module`'s shape (a kiln Linear / MergedLinear / nn.Linear), on the device
    and meta-ness of its weight."""
    parts = module.parts if isinstance(module, MergedLinear) else None
    with torch.device(module.weight.device):
        return QuantLinear(
            module.in_features,
            module.out_features,
            module.bias is not None,
            kind,
            group_size,
            asymmetric,
            parts,
        )


def replace_linears(
    model: nn.Module, make: Callable[[str, nn.Module], nn.Module | None], head: bool = True
) -> list[str]:
    """Swap each linear of a kiln Transformer for `make(name, module)` (None keeps it) and return the
    names replaced. With `head`, the LM head too: `make("lm_head", module)` gets the untied nn.Linear, or
    for a tied model a bias-free nn.Linear view sharing the embedding's storage (the embedding itself is
    left in place for the token lookup: a step reads one row of it per token)."""
    done = []
    targets = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear)]
    for name, module in targets:
        new = make(name, module)
        if new is not None:
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)
            done.append(name)
    if head:
        old = model.lm_head
        if old is None:  # tied: the head is the token embedding
            emb = model.model.embed_tokens.weight
            old = nn.Linear(emb.shape[1], emb.shape[0], bias=False, device="meta")
            old.weight = emb  # the same Parameter: a view for `make` to read, nothing copied
        if isinstance(old, nn.Linear):
            new = make("lm_head", old)
            if new is not None:
                model.lm_head = new
                done.append("lm_head")
    return done
