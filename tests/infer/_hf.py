"""Random-init Hugging Face checkpoints of each family kiln serves, saved for the engine to load: smaller
than tests/model's (two layers, a 512-id vocabulary), and seeded per test."""

from __future__ import annotations

import pytest
import torch

from ..model._helpers import randomize_vectors

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # q/k norm
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 7}),  # window < sequence
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def hf_causal_lm(arch: str, seed: int = 0):
    """A float32 random-init transformers model of `arch`, in eval mode, with random norms and biases."""
    torch.manual_seed(seed)
    T = transformers
    if arch == "gpt2":
        cfg = T.GPT2Config(
            vocab_size=512,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=None,
            eos_token_id=None,
        )
        model = T.GPT2LMHeadModel(cfg)
    else:
        cfg_name, cls_name, extra = ARCHS[arch]
        model = getattr(T, cls_name)(getattr(T, cfg_name)(**BASE, **extra))
    return randomize_vectors(model).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n new tokens of transformers' greedy generate (no EOS: exactly n)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()
