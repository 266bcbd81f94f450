"""RoPE frequency tables: the inverse frequencies and attention scaling of every scaling variant.

For rotary dim D (= head_dim) and base b, the default inverse frequencies are
    inv_freq[i] = 1 / b^(2i / D),  i = 0 .. D/2 - 1,
and position p rotates pair i by the angle p * inv_freq[i]. The variants change inv_freq (and, for YaRN,
multiply cos and sin by an attention factor):
- linear (position interpolation): inv_freq / factor;
- ntk (static NTK-aware): base b * factor^(D / (D - 2)), for all lengths;
- dynamic (dynamic NTK): base b * (factor * s / M - (factor - 1))^(D / (D - 2)) where s = max(seq_len, M),
  M = max_seq_len; unchanged up to M, so short sequences keep the trained frequencies;
- yarn: per-frequency blend of interpolation and extrapolation by a linear ramp between the
  beta_fast / beta_slow correction dims, and attention factor 0.1 * ln(factor) + 1 (or from mscale);
- llama3: low frequencies (wavelength > L / low_freq_factor) divided by factor, high ones kept, a
  smooth blend between, L = original_max_position_embeddings.
The fp32 op order follows transformers' rope initialization functions, so the tables are bit-equal to
them (tests/model/test_rope.py). The rotation itself is `kiln.kernels.rope.apply_rope`.
"""

from __future__ import annotations

import math

import torch

from kiln.model.config import ModelConfig


def _default_inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (
        base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim)
    )


def _yarn(cfg: ModelConfig, rs: dict, dim: int, base: float, device) -> tuple[torch.Tensor, float]:
    factor = rs["factor"]
    original = rs.get("original_max_position_embeddings", cfg.max_seq_len)
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(n_rot: float) -> float:
        # the rotary dim whose wavelength makes n_rot turns over the original context
        return (dim * math.log(original / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_weight = 1 - ramp  # (D/2,) 1 = keep the original frequency
    return interpolation * (1 - extra_weight) + extrapolation * extra_weight, float(attention_factor)


def _llama3(cfg: ModelConfig, rs: dict, dim: int, base: float, device) -> torch.Tensor:
    inv_freq = _default_inv_freq(base, dim, device)
    factor, lo, hi = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old_len = rs.get("original_max_position_embeddings", cfg.max_seq_len)
    low_wavelen, high_wavelen = old_len / lo, old_len / hi
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_frequencies(
    cfg: ModelConfig, seq_len: int | torch.Tensor | None = None, device: torch.device | str | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq (head_dim/2,) float32, attention_scaling) for `cfg`; `seq_len` matters only for "dynamic"
    (an int, or a 0-d tensor so that the forward pass needs no host sync)."""
    dim, base = cfg.head_dim, float(cfg.rope_theta)
    kind = cfg.rope_type
    rs = cfg.rope_scaling or {}
    if kind == "default":
        return _default_inv_freq(base, dim, device), 1.0
    if kind == "linear":
        return _default_inv_freq(base, dim, device) / rs["factor"], 1.0
    if kind == "ntk":
        return _default_inv_freq(base * rs["factor"] ** (dim / (dim - 2)), dim, device), 1.0
    if kind == "dynamic":
        factor, M = rs["factor"], cfg.max_seq_len
        if seq_len is None:
            seq_len = M
        if isinstance(seq_len, torch.Tensor):
            s = torch.maximum(seq_len, torch.tensor(M, dtype=seq_len.dtype, device=seq_len.device))
        else:
            s = max(int(seq_len), M)
        scaled_base = base * ((factor * s / M) - (factor - 1)) ** (dim / (dim - 2))
        exps = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        return 1.0 / (scaled_base**exps), 1.0
    if kind == "yarn":
        return _yarn(cfg, rs, dim, base, device)
    if kind == "llama3":
        return _llama3(cfg, rs, dim, base, device), 1.0
    raise AssertionError(f"unhandled rope type {kind!r}")  # ModelConfig validated it


class RotaryTables:
    """Computes cos/sin for the positions of one forward pass, shared by every layer.

    Tables are built per call only for the positions in use: angles (B, T, D/2) = positions * inv_freq
    (the fp32 product transformers forms too), flattened to (B*T, D/2) tables that `apply_rope` indexes
    with arange(B*T) (one row of T when the positions are one row expanded over the batch). That keeps the model free of dtype-sensitive buffers and of host syncs.
    """

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._static: dict[torch.device, tuple[torch.Tensor, float]] = {}  # memo per device

    def _freqs(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        dev = position_ids.device
        if self.cfg.rope_type == "dynamic":
            return rope_frequencies(self.cfg, position_ids.max() + 1, dev)
        if dev not in self._static:
            self._static[dev] = rope_frequencies(self.cfg, None, dev)
        return self._static[dev]

    def __call__(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """position_ids (B, T) -> cos, sin (R, D/2) float32 and the index (B, T) into their rows."""
        inv_freq, scale = self._freqs(position_ids)
        B, T = position_ids.shape
        shared = B > 1 and position_ids.stride(0) == 0  # one row expanded over the batch (the default)
        pos = position_ids[:1] if shared else position_ids
        ang = pos.float().unsqueeze(-1) * inv_freq  # (B or 1, T, D/2)
        cos, sin = ang.cos(), ang.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        rows = torch.arange(pos.numel(), device=pos.device).view(pos.shape)
        index = rows.expand(B, T) if shared else rows
        return cos.view(-1, cos.shape[-1]), sin.view(-1, sin.shape[-1]), index
