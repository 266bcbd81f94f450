"""Hugging Face config.json <-> ModelConfig, for GPT2LMHeadModel, LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM and MixtralForCausalLM.

Every key of an imported config.json is either mapped, checked to hold the value kiln implements, or
known to be metadata that does not change the model's function (token ids, dtype, dropout rates,
which only act in training and which kiln does not implement). Any other key, or an option kiln does
not implement, is a KilnError naming the key: a checkpoint never loads as a silently different model.
"""

from __future__ import annotations

from typing import Any

from kiln.errors import KilnError
from kiln.model.config import ModelConfig

HF_ARCHS = {
    "GPT2LMHeadModel": "gpt2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
}
ARCH_TO_HF = {v: k for k, v in HF_ARCHS.items()}

# keys that never change the function of the model (metadata, generation defaults, training-only dropout)
_METADATA = {
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "use_cache",
    "initializer_range",
    "output_router_logits",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "attention_dropout",
    "attn_pdrop",
    "embd_pdrop",
    "resid_pdrop",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "tokenizer_class",
    "id2label",
    "label2id",
    "task_specific_params",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "problem_type",
    "pretraining_tp",
    "generation_config",
    "max_length",
    "num_labels",
    "tie_encoder_decoder",
    "is_decoder",
    "add_cross_attention",
}
# keys that must hold exactly this value (anything else is an option kiln does not implement)
_REQUIRED = {
    "gpt2": {
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "add_cross_attention": False,
    },
    "llama": {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
    "mistral": {"hidden_act": "silu"},
    "qwen2": {"hidden_act": "silu"},
    "qwen3": {"attention_bias": False, "hidden_act": "silu"},
    "mixtral": {"hidden_act": "silu", "router_jitter_noise": 0.0},
}
_GPT2_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _rope_fields(hf: dict[str, Any], used: set[str]) -> dict[str, Any]:
    """rope_theta and rope_scaling from either transformers 5's rope_parameters or 4's rope_theta/rope_scaling."""
    used.update({"rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor"})
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    prf = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise KilnError(
            f"config.json: partial_rotary_factor={prf} is not supported (kiln rotates the whole head)"
        )
    kind = params.pop("rope_type", params.pop("type", "default"))
    return {
        "rope_theta": float(theta),
        "rope_scaling": None if kind == "default" else {"rope_type": kind, **params},
    }


def _window(arch: str, hf: dict[str, Any], used: set[str]) -> int | None:
    used.update({"sliding_window", "use_sliding_window", "max_window_layers", "layer_types"})
    window = hf.get("sliding_window")
    if arch in ("mistral", "mixtral"):
        return window
    if not hf.get("use_sliding_window", False):
        return None
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", n) else "full_attention" for i in range(n)
    ]
    if all(t == "sliding_attention" for t in types):
        return window
    if all(t == "full_attention" for t in types):
        return None
    raise KilnError(
        "config.json: layer_types / max_window_layers mix sliding and full attention layers; kiln applies "
        "sliding_window to every layer or none"
    )


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json dict; KilnError for an unsupported architecture or option."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in HF_ARCHS:
        raise KilnError(
            f"config.json: architectures={archs} is not supported: kiln imports one of {sorted(HF_ARCHS)}"
        )
    arch = HF_ARCHS[archs[0]]
    used = set(_METADATA)
    for key, want in _REQUIRED[arch].items():
        used.add(key)
        if key in hf and hf[key] != want and not (want == 0.0 and hf[key] in (0, None)):
            raise KilnError(f"config.json: {key}={hf[key]!r} is not supported by kiln (needs {want!r})")
    if arch == "gpt2":
        used.update(
            {
                "vocab_size",
                "n_embd",
                "n_layer",
                "n_head",
                "n_inner",
                "n_positions",
                "n_ctx",
                "layer_norm_epsilon",
                "activation_function",
                "tie_word_embeddings",
                "reorder_and_upcast_attn",
            }
        )
        act = hf.get("activation_function", "gelu_new")
        if act not in _GPT2_ACTS:
            raise KilnError(
                f"config.json: activation_function={act!r} is not supported: use one of {sorted(_GPT2_ACTS)}"
            )
        if hf.get("tie_word_embeddings", True) is False:
            raise KilnError("config.json: tie_word_embeddings=false is not supported for GPT-2")
        d = hf["n_embd"]
        kw = dict(
            vocab_size=hf["vocab_size"],
            d_model=d,
            n_layers=hf["n_layer"],
            n_heads=hf["n_head"],
            ffn_hidden=hf.get("n_inner") or 4 * d,
            max_seq_len=hf["n_positions"],
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            hidden_act=_GPT2_ACTS[act],
            tie_embeddings=True,
        )
    else:
        used.update(
            {
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "max_position_embeddings",
                "rms_norm_eps",
                "tie_word_embeddings",
                "hidden_act",
            }
        )
        kw = dict(
            vocab_size=hf["vocab_size"],
            d_model=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads"),
            head_dim=hf.get("head_dim"),
            ffn_hidden=hf["intermediate_size"],
            max_seq_len=hf["max_position_embeddings"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            sliding_window=_window(arch, hf, used),
            **_rope_fields(hf, used),
        )
        if arch == "mixtral":
            used.update({"num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"})
            kw.update(
                n_experts=hf["num_local_experts"],
                n_experts_per_tok=hf.get("num_experts_per_tok", 2),
                router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.01),
            )
    unknown = sorted(set(hf) - used)
    if unknown:
        raise KilnError(f"config.json: key(s) {unknown} are not supported by kiln's {archs[0]} import")
    return ModelConfig(arch=arch, **kw)


def _check_exportable(cfg: ModelConfig) -> None:
    hf_name = ARCH_TO_HF[cfg.arch]

    def no(field: str, why: str) -> KilnError:
        return KilnError(f"cannot export model.{field}={getattr(cfg, field)!r} as {hf_name}: {why}")

    if cfg.attn_sinks:
        raise no("attn_sinks", "no exported architecture has learned sink logits")
    if cfg.rope_type == "ntk":
        raise no("rope_scaling", "transformers has no static NTK rope type (use 'dynamic' or 'yarn')")
    if cfg.arch == "gpt2":
        if cfg.n_kv_heads != cfg.n_heads or cfg.head_dim * cfg.n_heads != cfg.d_model:
            raise no("n_kv_heads", "GPT-2 has n_kv_heads == n_heads and head_dim == d_model / n_heads")
        if cfg.sliding_window is not None:
            raise no("sliding_window", "GPT-2 attends to the whole context")
        if not cfg.tie_embeddings:
            raise no("tie_embeddings", "GPT2LMHeadModel ties its head to the token embedding")
    if cfg.n_experts and cfg.arch != "mixtral":
        raise no(
            "n_experts", "of the exported classes only MixtralForCausalLM has experts (set arch='mixtral')"
        )
    if cfg.qk_norm != (cfg.arch == "qwen3"):
        raise no("qk_norm", "only Qwen3 has per-head q/k RMSNorm, and it always has it")
    if cfg.arch != "gpt2" and cfg.qkv_bias != (cfg.arch == "qwen2"):
        raise no("qkv_bias", "only Qwen2 has q/k/v biases (and always has them)")
    if cfg.arch == "llama" and cfg.sliding_window is not None:
        raise no("sliding_window", "LlamaForCausalLM has no sliding window (export as mistral)")


def config_to_hf(cfg: ModelConfig, dtype_name: str = "float32") -> dict[str, Any]:
    """config.json dict for `cfg`; KilnError when the HF class cannot express it."""
    _check_exportable(cfg)
    hf_name = ARCH_TO_HF[cfg.arch]
    if cfg.arch == "gpt2":
        return {
            "architectures": [hf_name],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.ffn_hidden,
            "n_positions": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps,
            "activation_function": "gelu_new" if cfg.hidden_act == "gelu_tanh" else "gelu",
            "attn_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "resid_pdrop": 0.0,
            "tie_word_embeddings": True,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "dtype": dtype_name,
        }
    hf: dict[str, Any] = {
        "architectures": [hf_name],
        "model_type": cfg.arch,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "dtype": dtype_name,
        # transformers 4 names; transformers 5 reads them into rope_parameters
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None if cfg.rope_scaling is None else dict(cfg.rope_scaling),
    }
    if cfg.arch == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    if cfg.arch in ("mistral", "mixtral"):
        hf["sliding_window"] = cfg.sliding_window
    if cfg.arch in ("qwen2", "qwen3"):
        sliding = cfg.sliding_window is not None
        hf.update(
            use_sliding_window=sliding,
            sliding_window=cfg.sliding_window,
            max_window_layers=0 if sliding else cfg.n_layers,
            layer_types=[("sliding_attention" if sliding else "full_attention")] * cfg.n_layers,
        )
        if cfg.arch == "qwen3":
            hf["attention_bias"] = False
    if cfg.arch == "mixtral":
        hf.update(
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.n_experts_per_tok,
            router_aux_loss_coef=cfg.router_aux_loss_coef,
            router_jitter_noise=0.0,
        )
    return hf
