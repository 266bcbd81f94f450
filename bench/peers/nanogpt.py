"""A nanoGPT-style GPT (Karpathy's nanoGPT model.py, rewritten here in kiln's words): bench/train.py's
plain-PyTorch peer.

What it is: GPT-2's architecture. Learned position embeddings, pre-norm blocks of LayerNorm -> multi-head
attention (one fused c_attn projection, F.scaled_dot_product_attention, causal) -> LayerNorm -> GELU MLP of
4 x d, a tied head, and nn.Linear everywhere. It uses nanoGPT's `bias=False` option, as a Llama block has no
biases. Init is N(0, 0.02), with the residual projections at 0.02 / sqrt(2 * n_layer). The loss is
F.cross_entropy over the full (B, T, V) logits. It is compiled whole by torch.compile, as nanoGPT's
train.py does. bench/train.py gives it the Llama shape's width, depth, query heads and vocabulary. That puts
it in the same parameter class: its MLP of 8d^2 per block against SwiGLU's 3 * d * ffn, with every head
full-width (no GQA).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class NanoGPTConfig:
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int  # the learned position table's size: the longest sequence

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, counted as kiln.model.ModelConfig.flops_per_token counts them:
        3 x (2 per multiply-add of every matmul weight, the head included, plus causal attention's
        4 * n_head * head_dim per attended key, (T + 1) / 2 keys on average)."""
        d, L = self.n_embd, self.n_layer
        matmul = L * 12 * d * d + self.vocab_size * d
        return 3.0 * (2.0 * matmul + 4 * L * d * (seq_len + 1) / 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): the layout SDPA takes
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=False)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, cfg: NanoGPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=False)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        gen = torch.Generator(device=self.wte.weight.device).manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if p.dim() < 2:  # LayerNorm weights
                p.fill_(1.0)
            else:
                nn.init.normal_(p, 0.0, resid_std if name.endswith("c_proj.weight") else 0.02, generator=gen)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """idx, targets (B, T) -> the mean next-token cross-entropy."""
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Matrices and embeddings decayed, LayerNorm weights not (nanoGPT's rule)."""
        ps = list(self.parameters())
        return [
            {"params": [p for p in ps if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0},
        ]


def build_nanogpt(cfg: NanoGPTConfig, device: torch.device, seed: int = 0) -> NanoGPT:
    """Built on the meta device, allocated on `device` in float32, initialized from `seed`."""
    with torch.device("meta"):
        model = NanoGPT(cfg)
    model.to_empty(device=device)
    model.lm_head.weight = model.wte.weight  # to_empty re-creates parameters: tie again
    model.init_weights(seed)
    return model
