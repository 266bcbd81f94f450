"""Reading GPTQ checkpoints written by other tools (AutoGPTQ / GPTQModel / optimum: the HF "gptq" format).

An HF directory whose config.json has quantization_config {"quant_method": "gptq", "bits": 4,
"group_size": G, ...} stores, for each quantized linear `p` (W (N, K)):
    p.qweight  int32 (K / 8, N)      eight 4-bit values along K per word: bits 4j..4j+3 of word [i, n] = q[8i + j, n]
    p.qzeros   int32 (K / G, N / 8)  eight zero points along N per word, the same nibble order
    p.scales   float16 (K / G, N)
    p.g_idx    int32 (K,)            the group of each input column (k // G unless act-order reordered it)
    p.bias     optional
with W[n, k] = (q[k, n] - z[g, n]) * s[g, n], g = g_idx[k]. The original ("gptq", v1) format stores each zero
point minus one (checkpoint_format "gptq_v2" does not). kiln's int4 layout is the same nibble order along K
with the matrix transposed (kiln.kernels.quant_matmul), so reading one is unpacking, transposing and
repacking; q/k/v and gate/up are merged as kiln holds them. Scales stay float16 (exact).

Supported: llama / mistral / qwen2 / qwen3 (the architectures whose HF names are kiln's), 4 bits, groups
of 32, 64 or 128 contiguous along K (g_idx == k // G; act-order checkpoints whose g_idx permutes groups
are refused: kiln's kernels read groups contiguously). Everything not quantized (embeddings, norms, an
untied float head) loads as in an HF directory.

`save_gptq` writes a kiln int4 model the same way (v1 zero points, `sym` true for symmetric int4, whose
zero point 8 is then explicit), the LM head in float as the GPTQ convention has it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from kiln.errors import KilnError
from kiln.io.atomic import atomic_write_bytes, atomic_write_text
from kiln.kernels.quant_matmul import GROUP_SIZES, pack_int4, unpack_int4
from kiln.model.hf import read_hf_dir
from kiln.model.hf_config import config_from_hf, config_to_hf
from kiln.model.linear import MergedLinear
from kiln.model.quant_linear import QuantLinear, replace_linears
from kiln.model.transformer import Transformer

ARCHS = ("llama", "mistral", "qwen2", "qwen3")  # HF names = kiln names (kiln.model.hf)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble j of a word at bits 4j


def gptq_config(path: str | Path) -> dict | None:
    """The quantization_config of an HF directory's config.json when it is a GPTQ one, else None."""
    f = Path(path) / "config.json"
    if not f.is_file():
        return None
    try:
        qc = json.loads(f.read_text()).get("quantization_config")
    except (json.JSONDecodeError, AttributeError):
        return None
    return qc if isinstance(qc, dict) and qc.get("quant_method") == "gptq" else None


def unpack_words(w: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their eight 4-bit values (uint8), expanded along `dim` (value j of a word at 8i + j)."""
    nib = (w.unsqueeze(-1) >> _SHIFTS) & 15  # (..., 8)
    if dim == 0:  # (R, C) words -> (8R, C)
        return nib.permute(0, 2, 1).reshape(-1, w.shape[1]).to(torch.uint8)
    return nib.reshape(w.shape[0], -1).to(torch.uint8)  # (R, C) -> (R, 8C)


def pack_words(q: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of unpack_words: 4-bit values (any int dtype) -> int32 words along `dim`."""
    q = q.to(torch.int64)
    if dim == 0:
        q = q.reshape(-1, 8, q.shape[1]).permute(0, 2, 1)  # (R, C, 8)
    else:
        q = q.reshape(q.shape[0], -1, 8)
    words = (q << _SHIFTS.to(torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def from_gptq_tensors(t: dict[str, torch.Tensor], group: int, v1: bool) -> dict[str, torch.Tensor]:
    """One linear's GPTQ tensors (qweight, qzeros, scales, g_idx) -> kiln's {"qweight", "scales", "zeros"}."""
    q = unpack_words(t["qweight"], 0)  # (K, N)
    K, N = q.shape
    g_idx = t.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(K) // group):
        raise KilnError(
            "this GPTQ checkpoint reorders groups (act-order / desc_act with g_idx): kiln's kernels read "
            "groups contiguously along K; quantize the float model with `kiln quantize --method gptq --act-order`"
        )
    z = (unpack_words(t["qzeros"], 1)[:, :N].to(torch.int16) + (1 if v1 else 0)) & 15  # (K / G, N)
    return {
        "qweight": pack_int4(q.T),
        "scales": t["scales"].T.contiguous(),
        "zeros": z.T.contiguous().to(torch.uint8),
    }


def to_gptq_tensors(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> dict:
    """kiln int4 tensors (with zero points) -> GPTQ v1 tensors (tests, and writing checkpoints other tools read)."""
    q = unpack_int4(qweight)  # (N, K)
    N, K = q.shape
    return {
        "qweight": pack_words(q.T, 0),
        "qzeros": pack_words((zeros.T.to(torch.int16) - 1) & 15, 1),
        "scales": scales.T.to(torch.float16).contiguous(),
        "g_idx": (torch.arange(K) // group).to(torch.int32),
    }


def load_gptq(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16
) -> Transformer:
    """A kiln Transformer with QuantLinears from a GPTQ checkpoint directory (module docstring)."""
    qc = gptq_config(path)
    if qc is None:
        raise KilnError(f"{path} is not a GPTQ checkpoint (no quantization_config with quant_method gptq)")
    bits, group = qc.get("bits"), qc.get("group_size")
    if bits != 4 or group not in GROUP_SIZES:
        raise KilnError(
            f"{path}: GPTQ with {bits} bits, group size {group}; kiln reads 4 bits in groups of {GROUP_SIZES}"
        )
    v1 = qc.get("checkpoint_format", "gptq") == "gptq"
    hf_cfg, tensors = read_hf_dir(path)
    cfg = config_from_hf({k: v for k, v in hf_cfg.items() if k != "quantization_config"})  # read above
    if cfg.arch not in ARCHS:
        raise KilnError(f"{path}: GPTQ checkpoints of {cfg.arch} are not supported (only {', '.join(ARCHS)})")
    with torch.device("meta"):
        model = Transformer(cfg)
        quantized = {}

        def make(name: str, module):
            parts = (
                module.parts
                if isinstance(module, MergedLinear)
                else {name.rsplit(".", 1)[1]: module.out_features}
            )
            parent = name.rsplit(".", 1)[0]
            if f"{parent}.{next(iter(parts))}.qweight" not in tensors:
                return None  # a linear the tool left in float
            quantized[name] = [f"{parent}.{p}" for p in parts]
            return QuantLinear(module.in_features, module.out_features, module.bias is not None, "int4", group,
                               asymmetric=True, parts=module.parts if isinstance(module, MergedLinear) else None)  # fmt: skip

        replace_linears(model, make, head=False)
    state: dict[str, torch.Tensor] = {}
    for name, sources in quantized.items():
        parts = []
        for src in sources:
            keys = [k for k in ("qweight", "qzeros", "scales", "g_idx") if f"{src}.{k}" in tensors]
            parts.append(from_gptq_tensors({k: tensors.pop(f"{src}.{k}") for k in keys}, group, v1))
        for k in ("qweight", "scales", "zeros"):
            state[f"{name}.{k}"] = torch.cat([p[k] for p in parts]).to(device)
        biases = [tensors.pop(f"{src}.bias", None) for src in sources]
        if all(b is not None for b in biases):
            state[f"{name}.bias"] = torch.cat(biases).to(device, dtype)
    for k, v in tensors.items():
        state[k] = v.to(device, dtype) if v.is_floating_point() else v.to(device)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise KilnError(f"{path}: GPTQ tensors do not match the model: {str(e).splitlines()[0]}") from None
    return model


def save_gptq(
    model: Transformer, group: int, symmetric: bool, out: str | Path, dtype: torch.dtype = torch.float16
) -> None:
    """Write a kiln model quantized to int4 (head left in float) as an HF GPTQ directory: config.json with
    its quantization_config and model.safetensors (float tensors in `dtype`), each file atomic."""
    cfg = model.config
    if cfg.arch not in ARCHS or cfg.rope_interleaved:
        raise KilnError(
            f"GPTQ export covers {', '.join(ARCHS)} with HF's RoPE layout; this model is {cfg.arch}"
            f"{' with interleaved RoPE' if cfg.rope_interleaved else ''}: write kiln's format instead"
        )
    if model.quantized_head:
        raise KilnError(
            "the GPTQ convention keeps the LM head in float: quantize with --no-head for --format gptq"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    quantized = set()
    for name, m in model.named_modules():
        if not isinstance(m, QuantLinear):
            continue
        if m.kind != "int4" or m.group_size != group:
            raise KilnError(f"{name} is {m.kind}: GPTQ checkpoints hold int4 in groups of {group}")
        quantized.add(name)
        parent = name.rsplit(".", 1)[0]
        zeros = m.zeros if m.zeros is not None else torch.full_like(m.scales, 8, dtype=torch.uint8)
        start = 0
        for part, size in (m.parts or {name.rsplit(".", 1)[1]: m.out_features}).items():
            rows = slice(start, start + size)
            start += size
            t = to_gptq_tensors(m.qweight[rows].cpu(), m.scales[rows].cpu(), zeros[rows].cpu(), group)
            state.update({f"{parent}.{part}.{k}": v for k, v in t.items()})
            if m.bias is not None:
                state[f"{parent}.{part}.bias"] = m.bias[rows].detach().cpu().to(dtype)
    for k, v in model.state_dict().items():
        if k.rsplit(".", 1)[0] not in quantized:
            state[k] = v.detach().cpu().to(dtype).contiguous() if v.is_floating_point() else v.cpu()
    hf_cfg = config_to_hf(cfg, str(dtype).removeprefix("torch."))
    hf_cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                     "sym": symmetric, "checkpoint_format": "gptq"}  # fmt: skip
    atomic_write_bytes(out / "model.safetensors", safetensors_bytes(state, metadata={"format": "pt"}))
    atomic_write_text(out / "config.json", json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
