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

Under tensor parallel the experts are split by expert over the tp ranks instead (`TensorParallelExperts`,
kiln.dist.tp's plan for a MoE block): there every rank holds all the block's tokens (the tp group reads
the same rows), so no token moves. Each rank runs its own experts on the pairs routed to them and weights
them; the partial outputs are summed over tp by the plan (an all-reduce, or a reduce-scatter under
sequence parallel), as a row-parallel projection's are. Backward needs the matching sums: the tokens and
the routing weights go through `_SumGrad` (identity forward, an all-reduce of the gradient backward), so
the stream and the router, which every rank holds whole, get the whole gradient on every rank; an expert's
gradient is whole on its rank already (it saw every token).
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


class _SumGrad(torch.autograd.Function):
    """Identity forward; the gradient summed over `group` backward (Megatron's "f")."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _Sum(torch.autograd.Function):
    """The sum over `group` forward; identity backward (Megatron's "g": the gradient of the summed,
    replicated output is the same on every rank already)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        t = t.contiguous().clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


def sum_over(t: torch.Tensor, group) -> torch.Tensor:
    """A partial (N, d) output summed over `group`, differentiably (module docstring)."""
    return _Sum.apply(t, group)


def _experts_weights(module: Experts, grad_scale: float, dtype: torch.dtype | None):
    """A split module's own experts (E / ranks, ...) as plain tensors, gradients scaled by grad_scale,
    in `dtype` (autocast's, for the kernels) or as stored."""
    out = []
    for p in (module.gate_up_proj, module.down_proj):
        w = p.to_local() if isinstance(p, DTensor) else p
        w = w if grad_scale == 1.0 else _ScaleGrad.apply(w, grad_scale)
        out.append(w if dtype is None else w.to(dtype))
    return out[0], out[1]


def _kernels_dtype(x: torch.Tensor, kernels: bool) -> torch.dtype | None:
    """autocast's dtype where the kernels run under it (autocast does not reach their custom ops)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if kernels and torch.is_autocast_enabled(dev) else None


def _run_local(xs, w1, w2, bounds: list[int], kernels: bool) -> torch.Tensor:
    """sorted_experts over rows sorted by local expert: the grouped kernels (offsets on the device) or
    the eager loop."""
    if kernels:
        offsets = torch.tensor(bounds, dtype=torch.int32, device=xs.device)
        return sorted_experts(xs, w1, w2, offsets=offsets)
    return sorted_experts(xs, w1, w2, bounds=bounds)


class _SplitExperts(Experts):
    """`Experts` whose stacked weights are split by expert (Shard(0)) over `mesh`, a 1-D mesh: the same
    parameter names and the same forward / grouped contract, so SparseMoE calls it unchanged; both
    entries run the subclass's `_run(x, expert_idx, weights, kernels)` (kernels: the grouped GEMM for the
    local experts, else the eager loop)."""

    def __init__(self, experts: Experts, mesh):
        nn.Module.__init__(self)
        self.mesh = mesh
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            setattr(self, name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]), p.requires_grad))

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self._run(x, expert_idx, weights, kernels=False)

    def grouped(self, x, expert_idx, weights, counts=None) -> torch.Tensor:
        return self._run(x, expert_idx, weights, kernels=True)


class TensorParallelExperts(_SplitExperts):
    """Split over the tp ranks, whose tokens are the same on every rank: returns this rank's partial
    output (its experts' weighted rows); the caller sums it over tp."""

    def _run(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, kernels: bool):
        dtype = _kernels_dtype(x, kernels)
        if dtype is not None:
            x = x.to(dtype)
        group, rank = self.mesh.get_group(), self.mesh.get_local_rank()
        w1, w2 = _experts_weights(self, 1.0, dtype)
        local = w1.shape[0]
        x, weights = _SumGrad.apply(x, group), _SumGrad.apply(weights, group)
        token, w, counts = sort_pairs(expert_idx, weights, self.gate_up_proj.shape[0])
        # this rank's experts own one contiguous run of the expert-sorted pairs
        ends = torch.cumsum(counts, 0).tolist()  # the host sync
        start = ends[rank * local - 1] if rank else 0
        bounds = [0] + [e - start for e in ends[rank * local : (rank + 1) * local]]
        mine = slice(start, start + bounds[-1])
        y = _run_local(x[token[mine]], w1, w2, bounds, kernels)
        return combine(y, token[mine], w[mine], x)


class ExpertParallelExperts(_SplitExperts):
    """Split over the ep ranks, each routing its own tokens: the all-to-all dispatch (module docstring)."""

    def _run(self, x: torch.Tensor, expert_idx: torch.Tensor, weights: torch.Tensor, kernels: bool):
        """x (N, d) this rank's tokens; expert_idx, weights (N, k) over the E global experts -> (N, d)."""
        dtype = _kernels_dtype(x, kernels)
        if dtype is not None:
            x = x.to(dtype)
        group, ep = self.mesh.get_group(), self.mesh.size()
        w1, w2 = _experts_weights(self, 1.0 / ep, dtype)  # gradients scaled by 1 / ep (module docstring)
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
        y = _run_local(rows[by_expert], w1, w2, bounds, kernels)
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
