"""Expert parallel: a MoE layer's experts split over the ranks of an `ep` mesh axis, tokens sent to them
all-to-all.

Each of the ep ranks holds E / ep whole experts: its parameters are DTensors `Shard(0)` on mesh["ep"]
(rank r: experts r * E / ep .. (r + 1) * E / ep - 1), so checkpoints, `full_tensor()` and the gradient
norm see the whole (E, ...) tensors. The ep ranks are data-parallel ranks (ep lies inside dp_shard): each
routes its own tokens, and one layer's forward is

    route (the model's router, on this rank's N tokens) -> sort the N*k (token, expert) pairs by expert,
    which sorts them by destination rank too -> all-to-all of the per-expert counts (so each rank knows
    what it will receive) -> one host sync for the split sizes -> all-to-all of the rows ->
    regroup the received rows by local expert -> the experts (kiln.model.moe.sorted_experts: the eager
    loop, or the grouped GEMM kernels) -> back to arrival order -> all-to-all back ->
    weighted sum into each token (the routing weights are applied at home, so the router's gradient
    never crosses ranks).

The all-to-alls are the functional collectives' autograd version: backward runs them in reverse.

Gradients. Each rank's loss is the mean over its own tokens and the step's loss the mean over the dp
ranks, so a weight's gradient is (1 / dp) * sum over ranks of d(loss_r). A non-expert weight gets that
from FSDP2's average over dp_shard. An expert's gradient on its rank already holds the sum over the ep
group's tokens (the all-to-all brought them); FSDP2 of the experts averages over the efsdp (and
dp_replicate) ranks only, dp / ep of them, so the expert weights' gradients are scaled by 1 / ep on the
way in (`_ScaleGrad`) and the product is the global mean, whatever FSDP2's reduce does with its own
divisor.

Not capturable in a CUDA graph (the split sizes are read on the host each layer, as TorchTitan's and
Megatron's dropless all-to-all dispatch do): for training and evaluation, not the decode engine.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kiln.model.moe import Experts, SparseMoE, combine, sort_pairs, sorted_experts


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


class ExpertParallelExperts(Experts):
    """`Experts` whose stacked weights are split by expert over `mesh` (1-D, the ep axis); the same
    parameter names and the same forward / grouped contract, so SparseMoE calls it unchanged."""

    def __init__(self, experts: Experts, mesh):
        nn.Module.__init__(self)
        self.mesh = mesh
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            setattr(self, name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]), p.requires_grad))

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self._dispatch(x, expert_idx, weights, kernels=False)

    def grouped(self, x, expert_idx, weights, counts=None) -> torch.Tensor:
        return self._dispatch(x, expert_idx, weights, kernels=True)

    def _local_weights(self, dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's experts (E / ep, ...), their gradients scaled by 1 / ep (module docstring)."""
        scale = 1.0 / self.mesh.size()
        out = []
        for p in (self.gate_up_proj, self.down_proj):
            w = _ScaleGrad.apply(p.to_local() if isinstance(p, DTensor) else p, scale)
            out.append(w if dtype is None else w.to(dtype))
        return out[0], out[1]

    def _dispatch(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, kernels: bool):
        """x (N, d) this rank's tokens; expert_idx, weights (N, k) over the E global experts -> (N, d)."""
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if kernels and torch.is_autocast_enabled(dev) else None
        if dtype is not None:  # autocast does not reach the kernels' custom ops (as Experts.grouped)
            x = x.to(dtype)
        w1, w2 = self._local_weights(dtype)
        group, ep = self.mesh.get_group(), self.mesh.size()
        E = self.gate_up_proj.shape[0]
        local = E // ep
        token, w, counts = sort_pairs(expert_idx, weights, E)  # sorted by expert = by destination rank
        # got[s * local + j]: the pairs rank s sends to this rank's expert j
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=group)
        got = got.view(ep, local)
        sizes = torch.cat([counts.view(ep, local).sum(1), got.sum(1), got.sum(0)]).tolist()  # the host sync
        send, recv, per_expert = sizes[:ep], sizes[ep : 2 * ep], sizes[2 * ep :]
        rows = funcol.all_to_all_single_autograd(x[token], recv, send, group)  # (R, d) by source, then expert
        # arrival order is (source rank, local expert): a stable sort by local expert groups each expert's
        # rows, sources in rank order
        experts = torch.arange(local, device=x.device).repeat(ep)  # (ep * local,): j for every source
        expert_of_row = experts.repeat_interleave(got.reshape(-1), output_size=sum(recv))  # sized: no sync
        by_expert = torch.argsort(expert_of_row, stable=True)
        bounds = [0]
        for n in per_expert:
            bounds.append(bounds[-1] + n)
        if kernels:
            offsets = torch.tensor(bounds, dtype=torch.int32, device=x.device)
            y = sorted_experts(rows[by_expert], w1, w2, offsets=offsets)
        else:
            y = sorted_experts(rows[by_expert], w1, w2, bounds=bounds)
        arrival = torch.empty_like(by_expert)
        arrival[by_expert] = torch.arange(by_expert.numel(), device=x.device)
        back = funcol.all_to_all_single_autograd(y[arrival], send, recv, group)  # (N*k, d) in sorted order
        return combine(back, token, w, x)


def apply_ep(model: nn.Module, ep_mesh) -> None:
    """Split every MoE block's experts over `ep_mesh` (in place, before FSDP2; the model may be on the
    meta device)."""
    for block in model.model.layers:
        if isinstance(block.mlp, SparseMoE):
            block.mlp.experts = ExpertParallelExperts(block.mlp.experts, ep_mesh)
