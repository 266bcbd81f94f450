"""parallelize(model, dims, cfg): a kiln Transformer made ready for its mesh, in TorchTitan's order.

    tensor / sequence parallel  ->  expert parallel  ->  activation checkpointing  ->  torch.compile per block
    ->  FSDP2 / DDP

The order matters: TP turns parameters into DTensors on the tp mesh, which FSDP2 then shards again
over the data-parallel mesh (2D parameters); checkpointing and compile wrap each block's forward
*inside* FSDP's per-block hooks, so a block's parameters are gathered once for its forward and once
for its backward (its recomputation included).

The model comes in built on the meta device (no memory, no init work) and leaves materialized on
`device` and initialized from `full_state`, the one-process initialization (every rank builds the
same full CPU state from the same seed; each rank keeps only its shards). That makes a sharded run
start from exactly the weights a single process would, so losses can be compared step by step, and
makes the init independent of the mesh (as TorchTitan's seed checkpoints do).

Data parallel, by `dims.zero`:
- 3 (FSDP2): fully_shard per block and on the root; parameters resharded after forward.
- 2 (ZeRO-2): the same with reshard_after_forward=False: parameters stay gathered from forward to
  backward (no second all-gather), gradients and optimizer state stay sharded.
- 1 (ZeRO-1): DDP, with the optimizer state sharded by ZeroRedundancyOptimizer (kiln.dist.strategy).
- 0: DDP (bucketed all-reduce overlapped with backward; no_sync under gradient accumulation).
dp_replicate > 1 with dp_shard > 1 is HSDP: fully_shard over the 2D (replicate, shard) mesh.
Expert parallel (ep > 1, kiln.dist.expert_parallel): each MoE block's experts, split by expert over the
"ep" dim of `dims.expert_mesh(mesh)`, get their own fully_shard over its "efsdp" dim (with dp_replicate:
HSDP over (dp_replicate, efsdp)) before the block's, which then leaves them alone (FSDP2 skips parameters
a nested fully_shard manages).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from kiln.dist.loss import VocabParallelLoss
from kiln.dist.parallel_dims import ParallelConfig, ParallelDims
from kiln.dist.tp import apply_tp, unmerge_projections
from kiln.errors import KilnError


class LossModule(nn.Module):
    """forward(inputs, targets) -> mean loss: the unit DDP/FSDP wrap (they hook forward)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x, y)


def checkpoint_blocks(blocks: nn.ModuleList, mode: str) -> None:
    """Recompute block activations in backward: "full" every block, "selective" every other block
    (half the saved activations for about half the recompute). The block's forward is wrapped in
    place (no wrapper module), so parameter names stay the HF names."""
    if mode == "none":
        return
    for i, block in enumerate(blocks):
        if mode == "selective" and i % 2:
            continue
        forward = block.forward

        @functools.wraps(forward)
        def recomputed(*args, _forward=forward, **kwargs):
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        block.forward = recomputed


def dp_mesh(mesh, dims: ParallelDims, shard: str = "dp_shard"):
    """The mesh FSDP2 shards over: dp_shard, or (dp_replicate, dp_shard) for HSDP (the experts under
    expert parallel: efsdp of the expert mesh in place of dp_shard)."""
    return mesh["dp_replicate", shard] if dims.dp_replicate > 1 else mesh[shard]


def expert_parallel(model: nn.Module, dims: ParallelDims, mesh):
    """Split the MoE experts over the ep ranks (ep > 1); returns the expert mesh (None when ep == 1)."""
    if dims.ep == 1:
        return None
    from kiln.dist.expert_parallel import apply_ep

    expert_mesh = dims.expert_mesh(mesh)
    apply_ep(model, expert_mesh["ep"])
    return expert_mesh


def shard_block(block: nn.Module, mesh, expert_mesh, dims: ParallelDims, mp, reshard: bool) -> None:
    """FSDP2 of one block over `mesh`; under expert parallel its experts first get their own fully_shard
    over the expert mesh's efsdp (HSDP with dp_replicate), which the block's then leaves alone."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if expert_mesh is not None and hasattr(block.mlp, "experts"):
        experts = block.mlp.experts
        fully_shard(
            experts, mesh=dp_mesh(expert_mesh, dims, "efsdp"), mp_policy=mp, reshard_after_forward=reshard
        )
        # the kernels' dispatch calls experts.grouped(...), not forward: gather around it too
        register_fsdp_forward_method(experts, "grouped")
    fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)


@torch.no_grad()
def load_full_state(model: nn.Module, full_state: dict[str, torch.Tensor]) -> None:
    """Copy a full (one-process) state dict into a possibly sharded model: each DTensor takes its
    local shard of the full tensor (every rank holds the full tensor, so no communication)."""
    own = model.state_dict(keep_vars=True)
    missing = sorted(own.keys() - full_state.keys())
    unexpected = sorted(full_state.keys() - own.keys())
    if missing or unexpected:
        raise KilnError(
            f"the full state does not fit the parallelized model: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    for name, p in own.items():
        src = full_state[name]
        if isinstance(p, DTensor):
            shard = distribute_tensor(src.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(shard.to_local())
        else:
            p.copy_(src)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    cfg: ParallelConfig,
    mesh,
    device: torch.device,
    full_state: dict[str, torch.Tensor],
    param_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard `model` (a Transformer on the meta device) for `mesh`; returns the loss module the loop
    runs (forward(x, y) -> mean loss). `model` itself stays the module whose parameters are trained.
    param_dtype: FSDP2's compute dtype (bf16 mixed precision; gradients are reduced in float32)."""
    if dims.pp > 1:
        raise KilnError("parallel.pp > 1 goes through parallelize_pipeline")
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], dims.sequence_parallel)
        loss: nn.Module = VocabParallelLoss(model, mesh["tp"])
    else:
        if dims.fsdp:
            unmerge_projections(model)  # FSDP's dim-0 shards must not cut across q/k/v (see kiln.dist.tp)
        loss = LossModule(model)
    expert_mesh = expert_parallel(model, dims, mesh)
    checkpoint_blocks(model.model.layers, cfg.activation_checkpoint)
    if cfg.compile_blocks:
        for block in model.model.layers:
            block.compile()
    if dims.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        reshard = dims.zero == 3
        m = dp_mesh(mesh, dims)
        for block in model.model.layers:
            shard_block(block, m, expert_mesh, dims, mp, reshard)
        # the root: embedding, final norm and head; gathered for the whole step anyway
        fully_shard(loss, mesh=m, mp_policy=mp, reshard_after_forward=False)
    loss.to_empty(device=device)
    load_full_state(model, full_state)
    if not dims.fsdp and dims.dp_replicate > 1:
        if dims.tp > 1:
            raise KilnError(
                "data parallel by whole replicas (parallel.dp_replicate) with tensor parallel needs sharded "
                "data parallel here: use parallel.dp_shard for the data-parallel size (FSDP2 x TP)"
            )
        from torch.nn.parallel import DistributedDataParallel as DDP

        loss = DDP(
            loss,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=mesh["dp_replicate"].get_group(),
        )
    return loss


def parallelize_pipeline(model: nn.Module, dims: ParallelDims, cfg: ParallelConfig, mesh, device: torch.device,
                         full_state: dict[str, torch.Tensor], param_dtype: torch.dtype | None = None):  # fmt: skip
    """This rank's pipeline stages of `model` (meta device): tensor parallel inside each stage when
    tp > 1 (applied to the whole model first, then split by layers; expert parallel likewise), sharded
    over the data-parallel mesh when dp_shard > 1, initialized from `full_state`. Returns (kiln.dist.pipeline.RankPart: the
    module whose parameters this rank trains, kiln.dist.pipeline.Pipeline)."""
    from kiln.dist.pipeline import Pipeline, split_stages

    tp_mesh = mesh["tp"] if dims.tp > 1 else None
    if tp_mesh is not None:
        apply_tp(model, tp_mesh, sequence_parallel=False)  # ParallelDims refuses SP with pp
    else:
        # HF-named leaves on every scheme: the optimizer state and the checkpoints are keyed alike
        # whether or not FSDP2 shards the stage (see kiln.dist.tp)
        unmerge_projections(model)
    expert_mesh = expert_parallel(model, dims, mesh)  # before the split: the stages share the model's modules
    part = split_stages(model, mesh["pp"].get_local_rank(), dims.pp, dims.stages_per_rank, tp_mesh)
    for stage in part.stages:
        checkpoint_blocks(list(stage.model.layers.values()), cfg.activation_checkpoint)
    if dims.fsdp:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        m = dp_mesh(mesh, dims)
        for block in part.model.layers.values():
            shard_block(block, m, expert_mesh, dims, mp, dims.zero == 3)
        # each stage is what its PipelineStage calls, so each is an FSDP root over what its blocks do
        # not hold (the embedding on the first, the norm and head on the last)
        for stage in part.stages:
            fully_shard(stage, mesh=m, mp_policy=mp, reshard_after_forward=False)
    part.to_empty(device=device)
    own = part.state_dict().keys()
    load_full_state(part, {k: v for k, v in full_state.items() if k in own})
    return part, Pipeline(part, dims, mesh["pp"].get_group(), device)
