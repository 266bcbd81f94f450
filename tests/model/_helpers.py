"""Helpers for the model tests: small random-init transformers models at odd sizes, and a logits check."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

# odd sizes (the issue's): 3 layers, 5 heads sharing 1 KV head, hidden 80, vocab 1000
COMMON = dict(
    vocab_size=1000,
    hidden_size=80,
    intermediate_size=136,
    num_hidden_layers=3,
    num_attention_heads=5,
    num_key_value_heads=1,
    max_position_embeddings=96,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def hf_model(arch: str, **overrides):
    """A random-init transformers causal LM of `arch` in eval mode, float32, seeded."""
    T = transformers
    torch.manual_seed(0)
    if arch == "gpt2":
        kw = dict(
            vocab_size=1000,
            n_embd=80,
            n_layer=3,
            n_head=5,
            n_positions=96,
            n_inner=136,
            bos_token_id=None,
            eos_token_id=None,
        )
        kw.update(overrides)
        model = T.GPT2LMHeadModel(T.GPT2Config(**kw))
    else:
        kw = dict(COMMON)
        kw.update(overrides)
        cls = {
            "llama": (T.LlamaConfig, T.LlamaForCausalLM),
            "mistral": (T.MistralConfig, T.MistralForCausalLM),
            "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
            "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
            "mixtral": (T.MixtralConfig, T.MixtralForCausalLM),
        }[arch]
        model = cls[1](cls[0](**kw))
    return randomize_vectors(model).eval()


@torch.no_grad()
def randomize_vectors(model):
    """transformers' init leaves norms at 1 and biases at 0; random ones test that they are loaded."""
    for name, p in model.named_parameters():
        if p.dim() == 1:
            is_scale = name.endswith("weight") and ("norm" in name or ".ln_" in name)
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if is_scale else 0.1 * torch.randn_like(p))
    return model


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> None:
    """max |got - want| <= rel * max |want| (the issue's bound for fp32)."""
    assert got.shape == want.shape, (got.shape, want.shape)
    err = (got.float() - want.float()).abs()
    scale = want.float().abs().max().item()
    worst = err.max().item()
    where = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    assert worst <= rel * scale, (
        f"max abs error {worst:.3g} at {where} > {rel} x scale {scale:.3g} (mean {err.mean():.3g})"
    )
