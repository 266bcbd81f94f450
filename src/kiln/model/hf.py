"""Hugging Face checkpoint directories (config.json + safetensors, sharded or not) in and out.

kiln's parameter names are the Llama-family HF names, so for llama / mistral / qwen2 / qwen3 the weight
table is the identity. The other two need small, explicit conversions:
- Mixtral: the hub's per-expert block_sparse_moe.experts.E.{w1,w3,w2} <-> kiln's stacked
  mlp.experts.gate_up_proj (E, 2I, d) = [w1; w3] and mlp.experts.down_proj (E, d, I) = w2
  (transformers 5's own stacked names are accepted on import too);
- GPT-2: transformer.{wte,wpe,h.N.{ln_1,attn.c_attn,attn.c_proj,ln_2,mlp.c_fc,mlp.c_proj},ln_f}; its
  Conv1D weights are stored (in, out), so they are transposed, and c_attn is split into q, k, v.
Models with the original interleaved RoPE layout are exported by permuting the head dim of q and k
(and their biases and norms) into the half-rotated layout HF uses: q.k is unchanged by a permutation
applied to both.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.errors import KilnError
from kiln.model.config import ModelConfig
from kiln.model.hf_config import config_from_hf, config_to_hf
from kiln.model.transformer import Transformer
from kiln.tokenizer import Tokenizer
from kiln.tokenizer.formats import save_hf

_GPT2_RENAME = {
    "wte.weight": "model.embed_tokens.weight",
    "wpe.weight": "model.embed_positions.weight",
    "ln_f.weight": "model.norm.weight",
    "ln_f.bias": "model.norm.bias",
}
_GPT2_LAYER = {  # HF suffix -> (kiln suffix, transpose)
    "ln_1.weight": ("input_layernorm.weight", False),
    "ln_1.bias": ("input_layernorm.bias", False),
    "ln_2.weight": ("post_attention_layernorm.weight", False),
    "ln_2.bias": ("post_attention_layernorm.bias", False),
    "attn.c_proj.weight": ("self_attn.o_proj.weight", True),
    "attn.c_proj.bias": ("self_attn.o_proj.bias", False),
    "mlp.c_fc.weight": ("mlp.up_proj.weight", True),
    "mlp.c_fc.bias": ("mlp.up_proj.bias", False),
    "mlp.c_proj.weight": ("mlp.down_proj.weight", True),
    "mlp.c_proj.bias": ("mlp.down_proj.bias", False),
}


# ---- weights: HF names -> kiln names ---------------------------------------------------------------------
def _gpt2_in(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in hf.items():
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight":
            continue  # tied to wte
        if name in _GPT2_RENAME:
            out[_GPT2_RENAME[name]] = t
            continue
        m = re.fullmatch(r"h\.(\d+)\.(.+)", name)
        if m is None:
            raise KilnError(f"unexpected GPT-2 tensor {name!r} in the checkpoint")
        i, rest = m.groups()
        p = f"model.layers.{i}."
        if rest in ("attn.bias", "attn.masked_bias"):
            continue  # causal-mask buffers some old checkpoints carry
        if rest in ("attn.c_attn.weight", "attn.c_attn.bias"):
            kind = rest.rsplit(".", 1)[1]
            t = t.t() if kind == "weight" else t  # (d, 3d) -> (3d, d)
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3, dim=0)):
                out[f"{p}self_attn.{proj}.{kind}"] = part.contiguous()
            continue
        if rest not in _GPT2_LAYER:
            raise KilnError(f"unexpected GPT-2 tensor {name!r} in the checkpoint")
        new, transpose = _GPT2_LAYER[rest]
        out[p + new] = t.t().contiguous() if transpose else t
    return out


def _mixtral_in(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, experts = {}, {}
    for name, t in hf.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight", name)
        if m is not None:
            experts[(int(m[1]), int(m[2]), m[3])] = t
        else:
            out[name.replace(".block_sparse_moe.", ".mlp.")] = t
    E = cfg.n_experts
    for i in range(cfg.n_layers):
        if not any((i, 0, w) in experts for w in ("w1", "w2", "w3")):
            continue  # stored in transformers 5's stacked form, already under its kiln name
        try:
            gate_up = [
                torch.cat((experts.pop((i, e, "w1")), experts.pop((i, e, "w3"))), dim=0) for e in range(E)
            ]
            down = [experts.pop((i, e, "w2")) for e in range(E)]
        except KeyError as err:
            raise KilnError(
                f"Mixtral checkpoint is missing expert weight (layer, expert, w) = {err.args[0]}"
            ) from None
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(gate_up)
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(down)
    if experts:
        raise KilnError(
            f"unexpected Mixtral expert tensors {sorted(experts)[:4]} (more experts than num_local_experts?)"
        )
    return out


def state_from_hf(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """kiln state dict from HF tensors. Tied checkpoints may carry lm_head.weight: it is dropped."""
    if cfg.arch == "gpt2":
        return _gpt2_in(cfg, hf)
    out = _mixtral_in(cfg, hf) if cfg.arch == "mixtral" else dict(hf)
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


# ---- weights: kiln names -> HF names ---------------------------------------------------------------------
def _half_rotated(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Permute q/k head dims from the interleaved RoPE layout to the half-rotated one."""
    D = cfg.head_dim
    perm = torch.cat((torch.arange(0, D, 2), torch.arange(1, D, 2)))  # new[j] = old[perm[j]]
    out = dict(state)
    for name, t in state.items():
        if re.search(r"self_attn\.[qk]_proj\.(weight|bias)$", name):
            heads = t.shape[0] // D
            out[name] = t.reshape(heads, D, *t.shape[1:])[:, perm].reshape(t.shape)
        elif re.search(r"self_attn\.[qk]_norm\.weight$", name):
            out[name] = t[perm]
    return out


def state_to_hf(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF tensors (contiguous, unshared) from a kiln state dict."""
    if cfg.rope_interleaved:
        state = _half_rotated(cfg, state)
    out = {}
    if cfg.arch == "gpt2":
        back = {v: k for k, v in _GPT2_RENAME.items()}
        layer_back = {v[0]: (k, v[1]) for k, v in _GPT2_LAYER.items()}
        for i in range(cfg.n_layers):
            p = f"model.layers.{i}."
            for kind in ("weight", "bias"):
                qkv = torch.cat([state[f"{p}self_attn.{x}_proj.{kind}"] for x in "qkv"], dim=0)
                out[f"transformer.h.{i}.attn.c_attn.{kind}"] = qkv.t() if kind == "weight" else qkv
        for name, t in state.items():
            if name in back:
                out["transformer." + back[name]] = t
                continue
            m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
            if m and m[2] in layer_back:
                hf_name, transpose = layer_back[m[2]]
                out[f"transformer.h.{m[1]}.{hf_name}"] = t.t() if transpose else t
    elif cfg.arch == "mixtral":
        for name, t in state.items():
            m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)", name)
            if m is None:
                out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
                continue
            p = f"model.layers.{m[1]}.block_sparse_moe.experts"
            for e in range(t.shape[0]):
                if m[2] == "down_proj":
                    out[f"{p}.{e}.w2.weight"] = t[e]
                else:
                    w1, w3 = t[e].chunk(2, dim=0)
                    out[f"{p}.{e}.w1.weight"], out[f"{p}.{e}.w3.weight"] = w1, w3
    else:
        out = dict(state)
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


# ---- directories -----------------------------------------------------------------------------------------
def read_hf_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, {name: CPU tensor}) of an HF checkpoint directory."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise KilnError(f"{path} is not a Hugging Face checkpoint directory: no config.json")
    hf_cfg = json.loads(cfg_file.read_text())
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise KilnError(
            f"{path} has no model.safetensors or model.safetensors.index.json (kiln reads safetensors only; "
            "re-save .bin checkpoints with transformers' save_pretrained)"
        )
    tensors = {}
    for f in files:
        with safe_open(str(path / f), framework="pt") as fh:
            for k in fh.keys():
                tensors[k] = fh.get_tensor(k)
    return hf_cfg, tensors


def from_pretrained(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Transformer:
    """A kiln Transformer from an HF checkpoint directory (see kiln.model.hf_config for the classes)."""
    hf_cfg, tensors = read_hf_dir(path)
    cfg = config_from_hf(hf_cfg)
    state = state_from_hf(cfg, tensors)
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise KilnError(
            f"{path}: checkpoint does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name, p in model.state_dict().items():
        if state[name].shape != p.shape:
            raise KilnError(
                f"{path}: {name} has shape {tuple(state[name].shape)}, config implies {tuple(p.shape)}"
            )
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


def save_pretrained(
    model: Transformer,
    path: str | Path,
    max_shard_bytes: int = 5 * 2**30,
    dtype: torch.dtype | None = None,
    tokenizer: Tokenizer | None = None,
    chat_template: str | None = None,
) -> None:
    """Write config.json + safetensors (sharded with model.safetensors.index.json above max_shard_bytes)
    that transformers' from_pretrained loads as the same model. KilnError if the HF class cannot
    express the config (sinks, static NTK rope, ...).

    With `tokenizer`, also its tokenizer.json + tokenizer_config.json (model_max_length = the model's
    context, eos <|endoftext|> when it has one, `chat_template` if given), so AutoTokenizer loads the
    same directory and encodes as kiln does."""
    cfg = model.config
    state = {k: v.to("cpu") for k, v in model.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    dtype_name = str(next(iter(state.values())).dtype).removeprefix("torch.")
    hf_cfg = config_to_hf(cfg, dtype_name)
    tensors = state_to_hf(cfg, state)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata=meta)
    else:
        n = len(shards)
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            fname = f"model-{i:05d}-of-{n:05d}.safetensors"
            save_file(shard, str(path / fname), metadata=meta)
            weight_map.update(dict.fromkeys(shard, fname))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        save_hf(tokenizer, path, chat_template=chat_template, model_max_length=cfg.max_seq_len)
