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

Two dispatches, chosen by `KernelConfig.moe` (backend "auto": kernels on CUDA, the loop elsewhere):
- "eager", the reference: the N*k (token, expert) pairs are sorted by expert, each expert runs one dense
  matmul over its contiguous slice, and the weighted outputs are scattered back with index_add. The slice
  sizes are read on the host (one sync per layer).
- "kiln": kernels/moe_router.py (top-k, weights, counts, aux loss in one pass), kernels/moe_permute.py
  (expert-sorted rows and the weighted combine back), kernels/moe_gemm.py (one grouped GEMM launch per
  projection over the stacked weights as they are) with kernels/swiglu.py between them; at inference with
  up to 64 tokens (decode), kernels/moe_decode.py instead: weight-streaming kernels (gate/up + SwiGLU,
  down, the weighted combine), no sort. No host sync and
  shapes fixed by N, k and E only, so a decode step can be captured in a CUDA graph. Under autocast the
  rows and the expert weights are cast to the autocast dtype (autocast does not reach custom ops).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.kernels._common import needs_grad
from kiln.kernels.moe_decode import moe_decode, use_decode
from kiln.kernels.moe_gemm import grouped_linear
from kiln.kernels.moe_permute import permute, routing_plan, unpermute
from kiln.kernels.moe_router import route
from kiln.kernels.swiglu import swiglu


def sort_pairs(expert_idx: torch.Tensor, weights: torch.Tensor, n_experts: int):
    """The N*k (token, expert) pairs in expert order (stable: tokens ascending inside an expert):
    (token (N*k,) of each sorted pair, its weight (N*k,), pairs per expert (E,) int64)."""
    k = expert_idx.shape[1]
    flat = expert_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order // k, weights.reshape(-1)[order], torch.bincount(flat, minlength=n_experts)


def sorted_experts(
    xs: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    offsets: torch.Tensor | None = None,
    bounds: list[int] | None = None,
) -> torch.Tensor:
    """Each expert's SwiGLU MLP over its rows of an expert-sorted xs (R, d): rows [offsets[e], offsets[e+1])
    go through expert e of w1 (E, 2I, d), w2 (E, d, I) -> (R, d). Give one of: offsets (E+1,) int32 on the
    device: the grouped GEMM kernels (no host sync); bounds, the same as a host list: the eager loop (one
    dense matmul per expert). Every expert runs, an empty one too, so w1 and w2 always get a gradient (all
    zeros where no row came: data-parallel reductions expect every rank to produce one)."""
    if bounds is None:
        return grouped_linear(swiglu(grouped_linear(xs, w1, offsets), None), w2, offsets)
    outs = [
        F.linear(swiglu(F.linear(xs[lo:hi], w1[e]), None), w2[e])  # (n_e, d)
        for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))
    ]
    return torch.cat(outs)


def combine(y: torch.Tensor, token: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out (N, d) like x: sum over each token's rows of y (R, d), weighted by w (R,) in float32."""
    return torch.zeros_like(x).index_add_(0, token, (y.float() * w[:, None]).to(x.dtype))


class Experts(nn.Module):
    def __init__(self, n_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (N, d); expert_idx, weights (N, k) -> (N, d)."""
        token, w, counts = sort_pairs(expert_idx, weights, self.gate_up_proj.shape[0])
        bounds = [0, *torch.cumsum(counts, 0).tolist()]  # the host sync
        y = sorted_experts(x[token], self.gate_up_proj, self.down_proj, bounds=bounds)
        return combine(y, token, w, x)

    def grouped(
        self,
        x: torch.Tensor,
        expert_idx: torch.Tensor,
        weights: torch.Tensor,
        counts: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The same as forward through the kernels: x (N, d); expert_idx (N, k) int; weights (N, k);
        counts (E,) int32 pairs per expert if known (the router's)."""
        E = self.gate_up_proj.shape[0]
        w1, w2 = self.gate_up_proj, self.down_proj
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x, w1, w2 = x.to(dt), w1.to(dt), w2.to(dt)
        if use_decode(x.shape[0]) and not needs_grad(x, weights, w1, w2):
            # up to 64 tokens at inference: weight-streaming kernels, no sort (kernels/moe_decode.py)
            return moe_decode(x, expert_idx, weights, w1, w2)
        plan = routing_plan(expert_idx, E, counts=counts)  # dropless
        xs = permute(x, plan)  # (N*k, d) expert-sorted
        y = sorted_experts(xs, w1, w2, offsets=plan.offsets)  # (N*k, d)
        return unpermute(y, plan, weights)  # (N, d): weighted sum over each token's k rows


def _like(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out (N, d) in x's shape; x (N, d), the flat-token contract's, gets out itself, not a view of it (FSDP2
    warns about a block that returns a view: an in-place op on it would skip FSDP2's pre-backward hook)."""
    return out if out.shape == x.shape else out.view(x.shape)


class SparseMoE(nn.Module):
    """Router (`gate`, as HF names it) + experts. forward(x (..., d)) returns (out like x, aux loss scalar).

    `capturable`: whether a forward can be recorded in a CUDA graph (no host sync, no data-dependent
    shapes): the kernels' dispatch can (grids sized from static bounds); the eager loop reads the expert
    counts on the host, so it cannot."""

    def __init__(self, d_model: int, hidden: int, n_experts: int, top_k: int, backend: str = "auto"):
        super().__init__()
        self.top_k = top_k
        self.backend = backend  # KernelConfig.moe: "auto", "eager" or "kiln"
        self.gate = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, hidden)

    def _uses_kernels(self, on_cuda: bool) -> bool:
        return self.backend == "kiln" or (self.backend == "auto" and on_cuda)

    @property
    def capturable(self) -> bool:
        return self._uses_kernels(self.gate.weight.is_cuda)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[-1]
        flat = x.reshape(-1, d)
        logits = self.gate(flat)  # (N, E)
        if self._uses_kernels(flat.is_cuda):
            r = route(logits, self.top_k)  # softmax top-k, renormalized; aux on the device
            out = self.experts.grouped(flat, r.expert_idx, r.weights, r.counts)
            return _like(out, x), r.aux_loss
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.experts(flat, top_i, top_w)
        E = probs.shape[-1]
        f = torch.bincount(top_i.reshape(-1), minlength=E).float() / flat.shape[0]  # (E,)
        aux = E * (f * probs.mean(dim=0)).sum()
        return _like(out, x), aux
