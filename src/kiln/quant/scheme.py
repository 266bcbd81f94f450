"""A quantization scheme: what `kiln quantize --scheme` names and what quant_config.json records.

Names: "int8" (weight-only, per output channel), "int4-g32" / "int4-g64" / "int4-g128" (weight-only,
groups of G along K; "int4" alone is g128), "fp8" (e4m3 weights per output channel, activations per row
at run time). Options: asymmetric int4 (zero points), the method ("rtn" round-to-nearest, or "gptq" for
int4 and int8), act-order for GPTQ, and whether the LM head is quantized (on by default: the tied
151936 x 1536 head of Qwen2.5-1.5B is 15% of its bf16 weight bytes).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from kiln.errors import KilnError
from kiln.kernels.quant_matmul import GROUP_SIZES

KINDS = ("int8", "int4", "fp8")
METHODS = ("rtn", "gptq")
SCHEME_NAMES = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "fp8")


@dataclass(frozen=True)
class QuantScheme:
    kind: str  # "int8", "int4" or "fp8"
    group_size: int = 0  # int4: 32, 64 or 128; else 0
    asymmetric: bool = False  # int4 only: a zero point per group
    method: str = "rtn"  # "rtn" or "gptq"
    act_order: bool = False  # gptq: columns in decreasing Hessian diagonal order
    head: bool = True  # quantize the LM head (tied or not)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise KilnError(f"quantization kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.kind == "int4" and self.group_size not in GROUP_SIZES:
            raise KilnError(f"int4 group size must be one of {GROUP_SIZES}, got {self.group_size}")
        if self.kind != "int4" and (self.group_size or self.asymmetric):
            raise KilnError(f"{self.kind} has no groups or zero points (group_size=0, asymmetric=False)")
        if self.method not in METHODS:
            raise KilnError(f"quantization method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method == "gptq" and self.kind == "fp8":
            raise KilnError("GPTQ is for the integer schemes (int8, int4-gN); fp8 uses round-to-nearest")
        if self.act_order and self.method != "gptq":
            raise KilnError("act-order is a GPTQ option: add --method gptq")

    @classmethod
    def parse(cls, name: str, **options) -> QuantScheme:
        """ "int8" | "int4" | "int4-g{32,64,128}" | "fp8", plus the other fields as keywords."""
        m = re.fullmatch(r"int4(?:-g(\d+))?", name)
        if m:
            return cls("int4", int(m.group(1) or 128), **options)
        if name in ("int8", "fp8"):
            return cls(name, **options)
        raise KilnError(f"unknown quantization scheme {name!r}: choose one of {', '.join(SCHEME_NAMES)}")

    @property
    def name(self) -> str:
        return f"int4-g{self.group_size}" if self.kind == "int4" else self.kind

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QuantScheme:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise KilnError(f"unknown quantization config keys: {', '.join(sorted(unknown))}")
        return cls(**d)
