"""SwiGLU: silu(gate) * up, the gated MLP activation of Llama/Qwen/Mixtral.

Shapes: gate and up (..., H) as two tensors, or one fused tensor (..., 2H) holding [gate | up]
along the last dim (pass up=None). Float32 math, output in the input dtype.

Only the eager reference lives here so far; the Triton kernel plugs in behind `swiglu`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    if up is None:
        gate, up = gate.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    return swiglu_ref(gate, up)
