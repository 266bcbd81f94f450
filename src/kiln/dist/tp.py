"""Tensor (and sequence) parallel plans for kiln's blocks, on DTensor's `parallelize_module`.

Megatron's split, as TorchTitan writes it for Llama:
- attention: q, k and v column-wise (each rank computes n_heads / tp query heads and n_kv_heads / tp
  key/value heads: whole GQA groups, so no head ever crosses ranks), o_proj row-wise (one all-reduce);
- MLP: gate and up column-wise, down row-wise (one all-reduce);
- MoE MLP: the experts split by expert over tp (whole experts, kiln.dist.expert_parallel's
  TensorParallelExperts), the router replicated; every rank routes all the tokens, runs its experts on the
  pairs routed to them, and the partial outputs are summed (one all-reduce, as down's);
- the token embedding row-wise over the vocabulary (a vocab-parallel embedding: each rank looks up its
  rows, the partial sums are reduced), the head column-wise over the vocabulary, and the loss computed
  on vocab-sharded logits under `loss_parallel` (full logits never exist on one rank).

kiln stores q/k/v and gate/up merged (`MergedLinear`, one weight (q + 2 kv, d)). A column-wise split
of the merged rows would hand rank 0 all of q and rank 1 k and v; so for tensor parallel (and FSDP,
whose dim-0 shards would cut the same way and whose DTensor parameters cannot serve the merged
layer's per-part state-dict views) the projections are unmerged into separate Linears under their HF
names (`MergedLinear.unmerge`). The cost is three GEMMs (and a concatenation) in place of one;
the gain is that every parameter is a plain HF-named leaf, so sharded checkpoints move between
meshes by name.

Qwen2's q/k/v biases are split with their columns; o_proj's bias is added once after the reduction
(RowwiseParallel). Qwen3's per-head q/k norms see local heads: their (head_dim,) weight is a
replicated DTensor, so its gradient, which each rank computes from its own heads, is summed over tp.

With sequence parallel the residual stream and the norms are split by tokens (dim 0 of kiln's flat
(N, d) activations): the column-wise inputs are all-gathered once per sublayer and the row-wise
outputs reduce-scattered, which moves the same bytes as the all-reduce and divides the norms'
activation memory by tp. kiln's Norm takes (x, residual) and returns both; `SequenceParallelNorm` is
the style for that signature (PyTorch's `SequenceParallel` passes one input).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)

from kiln.dist.expert_parallel import TensorParallelExperts, sum_over
from kiln.kernels.dispatch import use_backend
from kiln.model.linear import Linear, MergedLinear
from kiln.model.moe import SparseMoE


class _KilnLinear:
    """PyTorch's Colwise/RowwiseParallel accept nn.Linear only; kiln's Linear has the same parameters
    (weight (out, in), bias (out,)) and forward (F.linear), so it takes the same partition and the
    same input/output layouts (the parents' own functions)."""

    desired_for_linear: tuple[Placement, ...] | None = None

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, Linear):
            return super()._apply(module, device_mesh)
        if self.desired_for_linear is not None:
            self.desired_input_layouts = self.desired_for_linear
        return distribute_module(
            module,
            device_mesh,
            self._partition_linear_fn,
            functools.partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            functools.partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class Colwise(_KilnLinear, ColwiseParallel):
    """ColwiseParallel for kiln's Linear (weight split by output rows)."""


class Rowwise(_KilnLinear, RowwiseParallel):
    """RowwiseParallel for kiln's Linear (weight split by input columns; the input is sharded on its
    last dim, as RowwiseParallel requires of a linear)."""

    desired_for_linear = (Shard(-1),)


def unmerge_projections(model: nn.Module, shards: int = 1) -> None:
    """Every MergedLinear of `model` becomes one Linear per part (see the module docstring)."""
    for owner in list(model.modules()):
        for attr, child in list(owner.named_children()):
            if isinstance(child, MergedLinear):
                child.unmerge(owner, attr, shards)


def use_reference_kernels(module: nn.Module) -> None:
    """Run `module`'s forward (and so its recomputation) on kiln's eager reference ops, which DTensor
    can dispatch; the Triton launchers take plain tensors only."""
    forward = module.forward

    @functools.wraps(forward)
    def reference_forward(*args, **kwargs):
        with use_backend("reference"):
            return forward(*args, **kwargs)

    module.forward = reference_forward


def _replicate_params(name: str, module: nn.Module, mesh) -> None:
    for p_name, p in list(module.named_parameters(recurse=False)):
        module.register_parameter(p_name, nn.Parameter(distribute_tensor(p.data, mesh, [Replicate()])))


class SequenceParallelNorm(ParallelStyle):
    """kiln's Norm on token-sharded inputs: forward(x, residual) with both (N, d) split over dim 0.

    The weight (and bias) are replicated DTensors (their gradients, partial per rank, are summed by
    DTensor); plain inputs are taken as this rank's token shard; the outputs stay Shard(0) DTensors for
    the next sublayer's all-gather. kiln's Triton norm kernels do not take DTensors, so the module runs
    its eager reference ops (on every device)."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def inputs(mod, args, mesh):
            out = []
            for a in args:
                if isinstance(a, DTensor) and tuple(a.placements) != (Shard(0),):
                    a = a.redistribute(placements=[Shard(0)])  # Replicate -> Shard: a local slice
                elif isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
                    a = DTensor.from_local(a, mesh, [Shard(0)], run_check=False)
                out.append(a)
            return tuple(out)

        module = distribute_module(module, mesh, _replicate_params, inputs, None)
        use_reference_kernels(module)
        return module


class HeadShardedNorm(ParallelStyle):
    """A per-head norm (Qwen3's q_norm / k_norm) on (N, heads / tp, head_dim) local heads: the weight
    is a replicated DTensor, the input this rank's heads (Shard(1)), the output local again."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        def inputs(mod, args, mesh):
            x = args[0]
            return (DTensor.from_local(x, mesh, [Shard(1)], run_check=False), *args[1:])

        def outputs(mod, out, mesh):
            return tuple(o.to_local() if isinstance(o, DTensor) else o for o in out)

        module = distribute_module(module, mesh, _replicate_params, inputs, outputs)
        use_reference_kernels(module)
        return module


class ExpertsOverTP(ParallelStyle):
    """A SparseMoE block under tensor parallel (module docstring): experts split by expert over tp,
    the router's weight a plain (replicated) parameter. Under sequence parallel the tokens come as
    Shard(0) and are all-gathered on the way in, and the summed output leaves reduce-scattered to
    Shard(0) for the next norm; else both are plain replicated tensors."""

    def __init__(self, sequence_parallel: bool):
        super().__init__()
        self.sequence_parallel = sequence_parallel

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        module.experts = TensorParallelExperts(module.experts, mesh)
        group = mesh.get_group()

        def inputs(mod, args):
            x = args[0]
            if isinstance(x, DTensor):  # sequence parallel: this rank's tokens -> all of them
                x = x.redistribute(placements=[Replicate()]).to_local()
            return (x, *args[1:])

        def outputs(mod, args, out):
            h, aux = out
            if self.sequence_parallel:  # the sum, each rank keeping its token shard
                h = funcol.reduce_scatter_tensor_autograd(h.contiguous(), "sum", 0, group)
                return DTensor.from_local(h, mesh, [Shard(0)], run_check=False), aux
            return sum_over(h, group), aux

        # hooks, not distribute_module, which would make the router's weight a replicated DTensor: it
        # stays a plain parameter, as the experts' plain local slices meet plain tokens
        module.register_forward_pre_hook(inputs)
        module.register_forward_hook(outputs)
        return module


def block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of one (unmerged) Block, relative to the block."""
    sp = sequence_parallel
    # Row-wise outputs: reduce-scattered to token shards under SP (kept as DTensors for the next norm),
    # else all-reduced to plain replicated tensors.
    row = Rowwise(output_layouts=Shard(0), use_local_output=False) if sp else Rowwise()
    plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": Colwise(),
        "self_attn.k_proj": Colwise(),
        "self_attn.v_proj": Colwise(),
        "self_attn.o_proj": row,
    }
    moe = isinstance(block.mlp, SparseMoE)
    if moe:
        plan["mlp"] = ExpertsOverTP(sp)
    else:
        plan.update({"mlp.gate_proj": Colwise(), "mlp.up_proj": Colwise(), "mlp.down_proj": row})
    if sp:
        plan["input_layernorm"] = SequenceParallelNorm()
        plan["post_attention_layernorm"] = SequenceParallelNorm()
        # one all-gather of the normed tokens per sublayer, shared by q/k/v (and by gate/up); the other
        # arguments (rope tables, metadata, caches) pass untouched
        plan["self_attn"] = PrepareModuleInput(
            input_layouts=(Shard(0), None, None, None, None),
            desired_input_layouts=(Replicate(), None, None, None, None),
            use_local_output=True,
        )
        if not moe:  # (ExpertsOverTP gathers its own input)
            plan["mlp"] = PrepareModuleInput(
                input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
    if block.self_attn.q_norm is not None:
        plan["self_attn.q_norm"] = HeadShardedNorm()
        plan["self_attn.k_norm"] = HeadShardedNorm()
    return plan


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool) -> None:
    """Shard a kiln Transformer (built, on any device including meta) over `tp_mesh` in place."""
    tp = tp_mesh.size()
    unmerge_projections(model, tp)
    decoder = model.model
    for block in decoder.layers:
        attn = block.self_attn
        # the attention code views its projections as (N, heads, head_dim): local heads from here on
        attn.n_heads //= tp
        attn.n_kv_heads //= tp
        parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
    top: dict[str, ParallelStyle] = {
        # vocab-parallel embedding: weight Shard(0) by vocabulary rows; partial lookups reduced
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(),
            output_layouts=Shard(0) if sequence_parallel else Replicate(),
            use_local_output=not sequence_parallel,
        ),
    }
    if sequence_parallel:
        top["model.norm"] = SequenceParallelNorm()
    if model.lm_head is not None:
        # the head's weight (V, d) is split by vocabulary rows; kiln.dist.loss multiplies by it
        top["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(model, tp_mesh, top)
