"""What the training loop asks of the parallel layout: gradient sync, clipping, loss reduction, data rank.

The loop (kiln.train.loop) is written once; a `Strategy` answers its questions for the mesh:
- `sync(last)`: gradient synchronization only on the last micro-batch of an accumulated step
  (DDP's `no_sync`; FSDP2's `set_requires_gradient_sync`);
- `context()`: what forward and backward run under (`loss_parallel` with tensor parallel);
- `clip_grad_norm_`: the global gradient norm over every shard on every rank (DTensor shards summed
  over the mesh dims they are sharded on, never over the ones they are replicated on), then the
  same clip coefficient torch.nn.utils.clip_grad_norm_ applies;
- `reduce_loss`: the step's loss averaged over the data-parallel ranks (tp ranks hold the same value);
- `dp_rank` / `dp_size`: how the loader slices each global batch (data-parallel ranks only: the ranks
  of one tp group read the same micro-batch);
- `pipeline`: under pp > 1, the kiln.dist.pipeline.Pipeline that runs a step's forward and backward
  (the loop hands it the step's rows instead of running micro-batches itself).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from kiln.dist.loss import loss_context
from kiln.dist.parallel_dims import ParallelDims


def reduce_partial_grads(params) -> None:
    """Finish gradients that DTensor left as pending sums (Partial: e.g. a replicated norm weight under
    sequence parallel, each rank holding the sum over its own tokens) by reducing them to Replicate,
    so the norm, the clipping and the optimizer all see the true gradient."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(
                placements=[Replicate() if pl.is_partial() else pl for pl in g.placements]
            )


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum of x^2 over every element of `tensors`, in float32: one multi-tensor norm kernel per chunk of
    tensors (torch._foreach_norm), not three launches per tensor (a ~150-parameter model's step paid
    ~450 launches of host time for its norm)."""
    norms = torch._foreach_norm([t if t.dtype == torch.float32 else t.float() for t in tensors], 2.0)
    return torch.stack(norms).pow(2).sum()


def scale_grads_(grads: list[torch.Tensor], coef: torch.Tensor) -> None:
    """grads *= coef in place, one multi-tensor kernel per (device, dtype) group."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[(g.device, g.dtype)].append(g)
    for (device, dtype), gs in groups.items():
        torch._foreach_mul_(gs, coef.to(device, dtype))


def global_grad_norm(params, pp_group=None) -> torch.Tensor:
    """The 2-norm of all gradients of `params` as one vector over the whole model, on every rank.

    Plain tensors count as they are (replicated, or whole on this rank). A DTensor's local squares are
    summed over each mesh dim where it is sharded (Shard, including FSDP2's strided shards); grads of
    replicated placements are already equal across that dim. `pp_group`: pipeline stages hold disjoint
    parameters, so their sums add up over it."""
    plain: list[torch.Tensor] = []
    by_layout: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            by_layout[(g.device_mesh, tuple(g.placements))].append(g.to_local())
        else:
            plain.append(g)
    dev = next(iter(plain or [t for ts in by_layout.values() for t in ts]), torch.zeros(())).device
    total = torch.zeros((), device=dev, dtype=torch.float32)
    if plain:
        total = total + _sum_of_squares(plain)
    for (mesh, placements), locals_ in by_layout.items():
        sq = _sum_of_squares(locals_).reshape(1)
        for mesh_dim, placement in enumerate(placements):
            # sharded: Shard, or FSDP2's _StridedShard over a TP-sharded dim (not a Shard subclass, and
            # its is_shard() is False in torch 2.13); partial grads were reduced before
            if not placement.is_replicate():
                dist.all_reduce(sq, group=mesh.get_group(mesh_dim))
        total = total + sq[0]
    if pp_group is not None:
        total = total.reshape(1)
        dist.all_reduce(total, group=pp_group)
        total = total[0]
    return total.sqrt()


class Strategy:
    """One process, or DDP / ZeRO / FSDP2 / TP / PP over a DeviceMesh (`dims`, `mesh`; None: one process).

    `wrapped` is the loss module the loop runs (from kiln.dist.parallelize); under pipeline parallel,
    this rank's stages (a kiln.dist.pipeline.RankPart) and `pipeline` their schedule."""

    def __init__(self, wrapped: nn.Module, dims: ParallelDims | None = None, mesh=None, rank: int = 0,
                 pipeline=None):  # fmt: skip
        self.wrapped, self.dims, self.mesh, self.pipeline = wrapped, dims, mesh, pipeline
        self.rank = rank
        self.distributed = dims is not None and dims.world_size > 1
        self.dp_rank = dims.dp_rank(rank) if dims is not None else 0
        self.dp_size = dims.dp if dims is not None else 1

    # ---- the step --------------------------------------------------------------------------------------
    def sync(self, last: bool):
        """The context of one micro-batch's forward and backward: gradients sync on the last only."""
        if not self.distributed or self.dims.dp == 1:
            return contextlib.nullcontext()
        if hasattr(self.wrapped, "set_requires_gradient_sync"):  # FSDP2
            self.wrapped.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if hasattr(self.wrapped, "no_sync") and not last:  # DDP
            return self.wrapped.no_sync()
        return contextlib.nullcontext()

    def context(self):
        """What forward and backward run under: `loss_parallel` when the head is vocab-parallel."""
        if self.dims is not None and self.dims.tp > 1:
            return loss_context()
        return contextlib.nullcontext()

    def clip_grad_norm_(self, params, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` by the global norm (as torch.nn.utils.clip_grad_norm_, across the mesh);
        max_norm <= 0 only measures. Returns the norm before clipping."""
        params = [p for p in params if p.grad is not None]
        reduce_partial_grads(params)
        pp_group = self.mesh["pp"].get_group() if self.dims is not None and self.dims.pp > 1 else None
        if not self.distributed or (
            pp_group is None and not any(isinstance(p.grad, DTensor) for p in params)
        ):
            if max_norm > 0:
                return torch.nn.utils.clip_grad_norm_(params, max_norm)
            return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
        norm = global_grad_norm(params, pp_group)
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            scale_grads_([p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params], coef)
        return norm

    def reduce_loss(self, total: torch.Tensor) -> torch.Tensor:
        """The step's mean loss over data-parallel ranks, in place (tp ranks hold equal values, so the
        world average is the dp average)."""
        if self.distributed:
            dist.all_reduce(total, op=dist.ReduceOp.AVG)
        return total

    # ---- state ------------------------------------------------------------------------------------------
    @property
    def zero1(self) -> bool:
        return self.dims is not None and self.dims.zero == 1 and self.distributed

    @property
    def sharded(self) -> bool:
        """Whether parameters are DTensors (FSDP2 or TP): whole tensors exist only after a gather."""
        return any(isinstance(p, DTensor) for p in self.wrapped.parameters())

    @property
    def gathers(self) -> bool:
        """Whether the whole model exists only after a collective (sharded, or split into stages)."""
        return self.pipeline is not None or self.sharded

    def full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> tuple[dict, dict | None]:
        """(model state, optimizer state), whole, on the CPU for sharded models: a collective every rank
        calls. The model state is what one process's would be (HF names, whole tensors), so it loads in
        one process; the optimizer state of a sharded model is keyed by parameter name
        (`get_state_dict`), which `load_full_state` reads back on the same layout. With ZeRO-1 the
        optimizer state is consolidated on rank 0 (None elsewhere). Under pipeline parallel the stages'
        states are merged on rank 0 (None, None elsewhere)."""
        if self.pipeline is not None:
            return self._pipeline_full_state(model, optimizer)
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

            opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
            if optimizer is None:
                from torch.distributed.checkpoint.state_dict import get_model_state_dict

                return get_model_state_dict(model, options=opts), None
            return get_state_dict(model, optimizer, options=opts)
        if optimizer is not None and hasattr(optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer
            optimizer.consolidate_state_dict(to=0)
            return model.state_dict(), optimizer.state_dict() if dist.get_rank() == 0 else None
        return model.state_dict(), optimizer.state_dict() if optimizer is not None else None

    def load_full_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict
    ):
        """The inverse of `full_state`: every rank passes the whole state and keeps its shards."""
        if self.pipeline is not None:
            from kiln.dist.parallelize import load_full_state

            own = model.state_dict().keys()
            missing = sorted(own - model_sd.keys())
            if missing:
                raise KeyError(f"the checkpoint has no {missing[0]} (and {len(missing) - 1} more)")
            load_full_state(model, {k: v for k, v in model_sd.items() if k in own})
            optimizer.load_state_dict(_optim_state_by_index(model, optimizer, optim_sd))
            return
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

            set_state_dict(
                model,
                optimizer,
                model_state_dict=model_sd,
                optim_state_dict=optim_sd,
                options=StateDictOptions(full_state_dict=True),
            )
            return
        model.load_state_dict(model_sd)
        optimizer.load_state_dict(optim_sd)

    def _pipeline_full_state(self, model: nn.Module, optimizer) -> tuple[dict | None, dict | None]:
        """Each stage's whole state (DTensors gathered over dp and tp), sent by one rank per stage (the
        first of its dp and tp groups: rank 0's pipeline group) to rank 0, which merges them: the
        parameter names are the HF names, disjoint across stages."""
        model_sd = {k: _whole(v) for k, v in model.state_dict().items()}
        optim_sd = _optim_state_by_name(model, optimizer) if optimizer is not None else None
        c = self.dims.coords(self.rank)
        if c["dp_replicate"] or c["dp_shard"] or c["tp"]:
            return None, None
        parts = [None] * self.dims.pp if self.rank == 0 else None
        dist.gather_object((model_sd, optim_sd), parts, dst=0, group=self.mesh["pp"].get_group())
        if self.rank != 0:
            return None, None
        merged_model = {k: v for m, _ in parts for k, v in m.items()}
        if optimizer is None:
            return merged_model, None
        merged = {"state": {}, "param_groups": [dict(g, params=[]) for g in parts[0][1]["param_groups"]]}
        for _, o in parts:
            merged["state"].update(o["state"])
            for g, part_group in zip(merged["param_groups"], o["param_groups"]):
                g["params"] += part_group["params"]
        return merged_model, merged

    # ---- optimizer ---------------------------------------------------------------------------------------
    def build_optimizer(self, model: nn.Module, build) -> torch.optim.Optimizer:
        """`build(model)` -> the optimizer; with zero=1, the same optimizer with its state sharded over
        the data-parallel group by ZeroRedundancyOptimizer (one param group per parameter set)."""
        if not self.zero1:
            return build(model)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ref = build(model)  # read its class, groups and defaults; it holds no state yet
        # only the hyperparameters the builder set; flags such as AdamW's decoupled_weight_decay are
        # the class's own and its constructor does not take them all back
        keep = ("lr", "betas", "eps", "momentum", "amsgrad", "maximize")
        defaults = {k: v for k, v in ref.defaults.items() if k in keep}
        groups = ref.param_groups
        zero = ZeroRedundancyOptimizer(
            groups[0]["params"],
            optimizer_class=type(ref),
            process_group=self.mesh["dp_replicate"].get_group(),
            parameters_as_bucket_view=False,
            **{**defaults, "weight_decay": groups[0]["weight_decay"]},
        )
        for g in groups[1:]:
            zero.add_param_group({"params": g["params"], "weight_decay": g["weight_decay"]})
        return zero


def _whole(v):
    """A state value as a whole CPU tensor (DTensors gathered: a collective over their mesh)."""
    if isinstance(v, DTensor):
        v = v.full_tensor()
    return v.detach().cpu() if isinstance(v, torch.Tensor) else v


def _ordered_names(model: nn.Module, optimizer) -> list[str]:
    """The parameter names in the optimizer's order (its state_dict's integer keys index this list)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


def _optim_state_by_name(model: nn.Module, optimizer) -> dict:
    """optimizer.state_dict() keyed by parameter name, with whole tensors (get_state_dict's layout)."""
    names = _ordered_names(model, optimizer)
    sd = optimizer.state_dict()
    state = {names[i]: {k: _whole(v) for k, v in st.items()} for i, st in sd["state"].items()}
    groups = [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def _optim_state_by_index(model: nn.Module, optimizer, by_name: dict) -> dict:
    """The inverse for this rank's parameters: whole tensors of a merged state back to this rank's
    shards (each rank slices its own: no communication) and to the optimizer's integer keys."""
    from torch.distributed.tensor import distribute_tensor

    names = _ordered_names(model, optimizer)
    params = dict(model.named_parameters())
    state = {}
    for i, name in enumerate(names):
        if name not in by_name["state"]:
            continue
        p = params[name]
        st = {}
        for k, v in by_name["state"][name].items():
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.shape == p.shape:
                v = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            st[k] = v
        state[i] = st
    own = optimizer.state_dict()["param_groups"]
    groups = [dict(saved, params=g["params"]) for saved, g in zip(by_name["param_groups"], own)]
    return {"state": state, "param_groups": groups}


def build_parallel(model_cfg, cfg, rank: int, world_size: int, device: torch.device, seed: int,
                   param_dtype: torch.dtype | None = None):  # fmt: skip
    """A kiln run's model and strategy under torchrun: the dims checked against the world and the
    model, one DeviceMesh, the model built on the meta device and parallelized, then initialized from
    the one-process init of `seed` (kiln.dist.parallelize). Returns (model, strategy)."""
    from kiln.dist.parallel_dims import ParallelDims
    from kiln.dist.parallelize import parallelize, parallelize_pipeline
    from kiln.model import build_model
    from kiln.model.transformer import Transformer

    dims = ParallelDims.resolve(cfg, world_size, model_cfg)
    mesh = dims.build_mesh(device.type)
    full = build_model(model_cfg, device="cpu", seed=seed).state_dict()
    with torch.device("meta"):
        model = Transformer(model_cfg)
    if dims.pp > 1:  # this rank's stages: the module that trains is the stages' part of the model
        part, pipe = parallelize_pipeline(model, dims, cfg, mesh, device, full, param_dtype)
        return part, Strategy(part, dims, mesh, rank, pipeline=pipe)
    wrapped = parallelize(model, dims, cfg, mesh, device, full, param_dtype)
    del full
    return model, Strategy(wrapped, dims, mesh, rank)
