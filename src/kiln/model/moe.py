"""Sparse mixture-of-experts MLP (Mixtral / Qwen-MoE style), with an eager reference dispatch.

Router: logits = x @ W_g^T (N, E); p = softmax(logits) in float32; each token takes its top-k experts
and their weights renormalized to sum to 1. Expert e is a SwiGLU MLP:
    y_e(x) = down_e(silu(gate_e(x)) * up_e(x)),    out(x) = sum_{e in topk(x)} w_e(x) * y_e(x).
Weights are stacked per expert as transformers 5 stores them: gate_up_proj (E, 2I, d) holding
[gate | up] along dim 1, and down_proj (E, d, I); a grouped-GEMM kernel can take them as they are.

Load-balancing loss (Switch Transformer, as transformers computes it, per layer):
    aux = E * sum_e f_e * P_e,  f_e = (top-k slots routed to e) / N,  P_e = mean over tokens of p_e,
which equals k at perfect balance. The model averages it over layers; `Transformer.loss` adds it times
`router_aux_loss_coef` in training mode.

Dispatch: the N*k (token, expert) pairs are sorted by expert, each expert runs one dense matmul over its
contiguous slice, and the weighted outputs are scattered back with index_add. The slice sizes are read
on the host (one sync per layer): this is the reference path, not the fast one.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.kernels.swiglu import swiglu


class Experts(nn.Module):
    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, d); expert_idx, weights (N, k) -> (N, d)."""
        N, k = expert_idx.shape
        E = self.gate_up_proj.shape[0]
        flat = expert_idx.reshape(-1)  # (N*k,)
        order = torch.argsort(flat, stable=True)
        token = order // k  # the token of each sorted pair
        w = weights.reshape(-1)[order]  # (N*k,)
        counts = torch.bincount(flat, minlength=E).tolist()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = token[start : start + n]
            h = swiglu(F.linear(x[idx], self.gate_up_proj[e]), None)  # (n, I)
            y = F.linear(h, self.down_proj[e])  # (n, d)
            out.index_add_(0, idx, (y.float() * w[start : start + n, None]).to(x.dtype))
            start += n
        return out


class SparseMoE(nn.Module):
    """Router (`gate`, as HF names it) + experts. forward(x (..., d)) returns (out like x, aux loss scalar).

    `capturable`: whether a forward can be recorded in a CUDA graph (no host sync, no data-dependent
    shapes); the eager dispatch reads the expert counts on the host, so it cannot."""

    capturable = False

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[-1]
        flat = x.reshape(-1, d)
        logits = self.gate(flat)  # (N, E)
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.experts(flat, top_i, top_w)
        E = probs.shape[-1]
        f = torch.bincount(top_i.reshape(-1), minlength=E).float() / flat.shape[0]  # (E,)
        aux = E * (f * probs.mean(dim=0)).sum()
        return out.view(x.shape), aux
