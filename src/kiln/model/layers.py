"""The pieces of a block: norms, attention, and the dense MLPs. Every op goes through kiln.kernels.

Attribute names match the HF checkpoints (q_proj, o_proj, gate_proj, input_layernorm, ...), so importing
and exporting weights is a rename table (kiln/model/hf.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.kernels.attention import attention
from kiln.kernels.layernorm import layernorm
from kiln.kernels.rmsnorm import rmsnorm
from kiln.kernels.rope import apply_rope
from kiln.kernels.swiglu import swiglu
from kiln.model.cache import KVCache
from kiln.model.config import ModelConfig


class Norm(nn.Module):
    """RMSNorm (weight) or LayerNorm (weight and bias) over the last dim.

    forward(x, residual=None) -> (norm(x + residual), x + residual): the pre-norm block hands the
    residual stream through, so the add fuses into the norm kernel. With residual=None, (norm(x), x).
    Under autocast a sublayer's output (bf16) meets a float32 stream: both are promoted to the wider
    dtype first, so the stream keeps its precision (as `residual + h` would in eager PyTorch).
    """

    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None and residual.dtype != x.dtype:
            wide = torch.promote_types(x.dtype, residual.dtype)
            x, residual = x.to(wide), residual.to(wide)
        if self.bias is None:
            out = rmsnorm(x, self.weight, self.eps, residual)
        else:
            out = layernorm(x, self.weight, self.bias, self.eps, residual)
        return (out, x) if residual is None else out

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Just the norm, no residual (the per-head q/k norms)."""
        return self(x)[0]


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias)


class Attention(nn.Module):
    """Multi-head attention with GQA (K/V heads never repeated), optional q/k norm, window and sinks."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.rope_interleaved = cfg.rope_interleaved
        d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        qkv_bias = cfg.qkv_bias or cfg.has_bias
        self.q_proj = _linear(d, q, qkv_bias)
        self.k_proj = _linear(d, kv, qkv_bias)
        self.v_proj = _linear(d, kv, qkv_bias)
        self.o_proj = _linear(q, d, cfg.has_bias)
        if cfg.qk_norm:
            self.q_norm = Norm(cfg.head_dim, cfg.norm_eps, bias=False)
            self.k_norm = Norm(cfg.head_dim, cfg.norm_eps, bias=False)
        else:
            self.q_norm = self.k_norm = None
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        attn_mask: torch.Tensor | None,
        cache: KVCache | None,
        key_rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x (B, T, d); rope = (cos, sin, index) for the T query positions, or None (learned positions);
        attn_mask bool (B, 1, T, S+T) or None; key_rope: tables for all S+T keys when the cache rotates
        keys itself (streaming)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm.normalize(q), self.k_norm.normalize(k)
        attn = dict(window=self.window, sinks=self.sinks, attn_mask=attn_mask)
        if cache is not None and cache.rotate_keys_in_cache:
            # streaming: keys are stored unrotated, then queries and all keys are rotated at their cache
            # slots; apply_rope rotates a pair of one length, so each side goes as both arguments
            k, v = cache.update(self.layer_idx, k, v)  # (B, S + T, Hk, D)
            if rope is not None:
                q = apply_rope(q, q, *rope[:2], rope[2], interleaved=self.rope_interleaved)[0]
                k = apply_rope(k, k, *key_rope[:2], key_rope[2], interleaved=self.rope_interleaved)[0]
            y = attention(q, k, v, causal=True, **attn)
        else:
            if rope is not None:
                q, k = apply_rope(q, k, *rope[:2], rope[2], interleaved=self.rope_interleaved)
            y = (
                attention(q, k, v, causal=True, **attn)
                if cache is None
                else cache.attend(self.layer_idx, q, k, v, **attn)
            )
        return self.o_proj(y.reshape(B, T, -1))


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): Llama / Qwen / Mistral."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = _linear(d_model, hidden, False)
        self.up_proj = _linear(d_model, hidden, False)
        self.down_proj = _linear(hidden, d_model, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class GeluMLP(nn.Module):
    """down(gelu(up(x))) with biases: GPT-2 (its c_fc is up_proj, its mlp.c_proj is down_proj)."""

    def __init__(self, d_model: int, hidden: int, act: str):
        super().__init__()
        self.approximate = "tanh" if act == "gelu_tanh" else "none"
        self.up_proj = _linear(d_model, hidden, True)
        self.down_proj = _linear(hidden, d_model, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))
