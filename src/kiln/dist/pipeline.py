"""Pipeline parallel: the model split into stages by layers, run by torch.distributed.pipelining schedules.

With p pipeline ranks and v stages per rank (v = 1 for GPipe and 1F1B, v >= 2 for interleaved 1F1B)
the L layers make n = p v stages of L / n blocks; stage s runs on pipeline rank s mod p (rank r holds
stages r, r + p, ...: Megatron's interleaving). The first stage holds the token embedding, the last the
final norm and the head. The blocks stay keyed by their global index (`model.layers.5.` on stage 1 of 2
for a 10-layer model: a ModuleDict), so a rank's parameter names are the HF names and checkpoints stay
keyed by them; a `RankPart` holds all of one rank's stages under those names (the module the optimizer,
the clipping and the checkpoints see), and each `Stage` is a view of its own blocks (what a
`PipelineStage` runs).

Between stages travel (b, T, d) tensors: the stream `h` and the residual it adds to (kiln's blocks
pass both, so the add fuses into the next norm); each stage rebuilds the dense attention metadata and
RoPE tables from (b, T). The last stage's output goes to `loss_fn` (kiln's fused linear + cross-entropy
with the head; under tensor parallel the vocab-parallel loss on the column-split head), the schedule
scales gradients by 1 / micro-batches, so a step's gradient is the mean over the step's tokens as in one
process. A MoE model's stages also pass on the sum of their blocks' load-balancing losses so far (a (1,)
float32 tensor with its gradient path to every router): the last stage's loss adds router_aux_loss_coef
x their mean over layers, as Transformer.loss does, so a pipelined MoE step is the one-process step (the
micro-batches are its accumulation chunks, each with its own aux).

Schedules: GPipe (all forwards, then all backwards: m micro-batches keep m activations), 1F1B (at most
p in flight) and interleaved 1F1B (v stages per rank, each hop 1/v of the work, so the warm-up and
cool-down shrink by v). The idle share of a step, the bubble, is (p - 1) / (v m + p - 1).

Evaluation runs forward only, outside the schedules: each stage receives (h, residual) from the rank of
the previous stage, runs its blocks and sends on; the last stage's summed loss is broadcast over the
pipeline (`Pipeline.eval_loss_sum`), so every rank returns the same figure.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kiln.kernels.linear_cross_entropy import linear_cross_entropy
from kiln.model.attn_metadata import AttnMetadata


def bubble_fraction(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    """Idle share of a pipeline step: (p - 1) / (v m + p - 1) (v = 1: GPipe and 1F1B)."""
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def _holder(decoder: nn.Module, layers: dict[str, nn.Module], first: bool, last: bool) -> nn.Module:
    """A parameter holder named like the Decoder (`embed_tokens`, `layers.<i>`, `norm`) over `layers`."""
    m = nn.Module()
    m.embed_tokens = decoder.embed_tokens if first else None
    m.embed_positions = decoder.embed_positions if first else None  # gpt2's learned positions
    m.layers = nn.ModuleDict(layers)
    m.norm = decoder.norm if last else None
    return m


class Stage(nn.Module):
    """Blocks [lo, hi) of a Transformer (with the embedding on the first stage, norm and head on the
    last). forward(tokens (b, T)) on the first stage, forward(h, residual (b, T, d)) on the others;
    returns (h, residual) or, on the last stage, the final-norm output (b, T, d); a MoE model's stages
    take and return the aux-loss sum after those (None in: zero so far). Its modules are the
    Transformer's own (shared, not copied). `tp_mesh`: the head is split by vocabulary over it (the
    loss is then the vocab-parallel one and must run under `loss_parallel`)."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool, tp_mesh=None):
        super().__init__()
        decoder = model.model
        self.model = _holder(decoder, {str(i): decoder.layers[i] for i in range(lo, hi)}, first, last)
        self.rope = decoder.rope  # not a module: tables computed per call
        self.lm_head = model.lm_head if last else None
        self.first, self.last, self.lo, self.hi = first, last, lo, hi
        self.tp_mesh = tp_mesh
        self.moe = bool(model.config.n_experts)
        self.aux_coef, self.n_layers = model.config.router_aux_loss_coef, model.config.n_layers

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, aux: torch.Tensor | None = None):
        if self.first:
            B, T = x.shape
            h = self.model.embed_tokens(x.reshape(-1))  # (N, d)
        else:
            B, T = x.shape[:2]
            h, residual = x.reshape(B * T, -1), residual.reshape(B * T, -1)
        positions = torch.arange(T, device=h.device).expand(B, T)
        rope = self.rope(positions) if self.rope is not None else None
        if self.first and self.model.embed_positions is not None:
            h = h + self.model.embed_positions(positions.reshape(-1))
        meta = AttnMetadata.dense(B, T)
        aux = torch.zeros(1, device=h.device) if aux is None else aux
        for layer in self.model.layers.values():
            h, residual, layer_aux = layer(h, residual, rope, meta)
            if layer_aux is not None:
                aux = aux + layer_aux.float()
        if self.last:
            h, _ = self.model.norm(h, residual)
            return (h.view(B, T, -1), aux) if self.moe else h.view(B, T, -1)
        out = (h.view(B, T, -1), residual.view(B, T, -1))
        return (*out, aux) if self.moe else out

    def param_groups(self, weight_decay: float) -> list[dict]:
        return _param_groups(self, weight_decay)

    def loss(self, out, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        """The last stage's loss_fn: next-token loss of one micro-batch (b, T, d) vs (b, T) (-100
        ignored), the mean or the sum over its targets. A MoE model's `out` is (h, aux sum): in training
        mode the loss adds router_aux_loss_coef x the mean over layers, as Transformer.loss."""
        aux = None
        if self.moe:
            out, aux = out
        loss = self._next_token_loss(out, targets, reduction)
        if aux is not None and self.aux_coef and self.lm_head.training:
            scale = self.aux_coef if reduction == "mean" else self.aux_coef * (targets != -100).sum()
            loss = loss + scale * (aux[0] / self.n_layers)
        return loss

    def _next_token_loss(self, out: torch.Tensor, targets: torch.Tensor, reduction: str) -> torch.Tensor:
        h, y = out.reshape(-1, out.shape[-1]), targets.reshape(-1)
        w = self.lm_head.weight  # (V, d), or this rank's (V / tp, d) rows under tensor parallel
        dev = h.device.type
        if torch.is_autocast_enabled(dev):  # as Transformer.loss: the head's matmul in 16 bits
            dt = torch.get_autocast_dtype(dev)
            h, w = h.to(dt), w.to(dt)
        if self.tp_mesh is None:
            return linear_cross_entropy(h, w, y, reduction=reduction)
        from torch.distributed.tensor import DTensor, Replicate

        # kiln.dist.loss's vocab-parallel loss: (N, V / tp) logits, softmax statistics over tp
        h = DTensor.from_local(h, self.tp_mesh, [Replicate()], run_check=False)
        loss = F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100, reduction=reduction)
        return loss.to_local() if isinstance(loss, DTensor) else loss


def _param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Transformer.param_groups' rule: decay matrices and embeddings, not vectors."""
    named = list(module.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
    ]


class RankPart(nn.Module):
    """All the stages of one pipeline rank under the Transformer's names (`model.embed_tokens`,
    `model.layers.<i>`, `model.norm`, `lm_head`: only those this rank holds): the module whose
    parameters this rank trains and checkpoints. `stages` are views of it, in schedule order."""

    def __init__(self, model: nn.Module, stages: list[Stage]):
        super().__init__()
        layers = {k: v for s in stages for k, v in s.model.layers.items()}
        first, last = stages[0].first, stages[-1].last
        self.model = _holder(model.model, layers, first, last)
        self.lm_head = model.lm_head if last else None
        self.config = model.config  # the whole model's (kiln convert rebuilds the whole model from it)
        object.__setattr__(self, "stages", stages)  # views, not children: no second name per parameter

    def param_groups(self, weight_decay: float) -> list[dict]:
        return _param_groups(self, weight_decay)


def split_stages(model: nn.Module, pp_rank: int, pp: int, stages_per_rank: int = 1, tp_mesh=None) -> RankPart:
    """This pipeline rank's stages of a (meta-device) Transformer: stages pp_rank, pp_rank + pp, ... of
    pp x stages_per_rank; n_layers divides by that (ParallelDims)."""
    n = pp * stages_per_rank
    per = model.config.n_layers // n
    stages = [
        Stage(model, s * per, (s + 1) * per, s == 0, s == n - 1, tp_mesh) for s in range(pp_rank, n, pp)
    ]
    return RankPart(model, stages)


class Pipeline:
    """One rank's stages and their schedule. `step(x, y)` runs a training step's forward and backward
    over the micro-batches and returns the step's mean loss on every rank of the pipeline."""

    def __init__(self, part: RankPart, dims, group, device: torch.device):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self.part, self.group, self.dims, self.device = part, group, dims, device
        self.pp_rank = dist.get_rank(group)
        self.n_stages = dims.pp * dims.stages_per_rank
        self.indices = list(range(self.pp_rank, self.n_stages, dims.pp))
        self.pipe_stages = [
            PipelineStage(stage, i, self.n_stages, device, group=group)
            for stage, i in zip(part.stages, self.indices)
        ]
        # every rank passes a loss_fn (torch reads "has a backward" from it); only the last stage calls it
        loss_fn = part.stages[-1].loss
        if dims.pp_schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(
                self.pipe_stages, n_microbatches=dims.microbatches, loss_fn=loss_fn
            )
        else:
            cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[dims.pp_schedule]
            self.schedule = cls(self.pipe_stages[0], n_microbatches=dims.microbatches, loss_fn=loss_fn)
        self.has_first, self.has_last = part.stages[0].first, part.stages[-1].last
        self.last_rank = dist.get_global_rank(group, dims.pp - 1)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y (rows, T) with rows a multiple of the micro-batches (only the first stage reads x, only
        the last y). Returns the mean of the micro-batches' losses, on every pipeline rank."""
        with self._loss_context():
            losses = self._run(x, y)
        loss = (
            torch.stack([v.detach() for v in losses]).mean() if losses else torch.zeros((), device=x.device)
        )
        dist.broadcast(loss, self.last_rank, group=self.group)  # every stage logs the same loss
        return loss

    def _loss_context(self):
        """loss_parallel over forward and backward when the head is split by vocabulary (tp > 1)."""
        if self.dims.tp > 1:
            from kiln.dist.loss import loss_context

            return loss_context()
        return contextlib.nullcontext()

    def _run(self, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        if self.has_first and self.has_last:
            self.schedule.step(x, target=y, losses=losses)
        elif self.has_first:
            self.schedule.step(x)
        elif self.has_last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        return losses

    @torch.no_grad()
    def eval_loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward only, stage after stage over point-to-point sends: the summed loss of the targets of
        (B, T) `y` that are not -100, as a float32 scalar on every pipeline rank."""
        B, T = x.shape
        total = torch.zeros((), device=x.device, dtype=torch.float32)
        for local, s in enumerate(self.indices):
            stage = self.part.stages[local]
            # stage s - 1 and s + 1 run on the neighbouring pipeline ranks (pp > 1)
            prev = dist.get_global_rank(self.group, (s - 1) % self.dims.pp)
            nxt = dist.get_global_rank(self.group, (s + 1) % self.dims.pp)
            out = stage(x) if stage.first else stage(*self._recv(B, T, prev))
            if stage.last:
                n = (y != -100).sum()
                with self._loss_context():
                    total = torch.where(n > 0, stage.loss(out, y, reduction="sum").float(), 0.0)
            else:
                # (h, residual), float32 on the wire whatever autocast made of them (the receiver's dtype);
                # a MoE stage's aux sum stays home (evaluation adds no aux loss)
                for t in out[:2]:
                    dist.send(t.float().contiguous(), nxt, group=self.group)
        dist.broadcast(total, self.last_rank, group=self.group)
        return total

    def _recv(self, B: int, T: int, src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, residual) (B, T, d) float32 from the rank of the previous stage."""
        out = []
        for _ in range(2):
            t = torch.empty(B, T, self.part.config.d_model, device=self.device, dtype=torch.float32)
            dist.recv(t, src, group=self.group)
            out.append(t)
        return out[0], out[1]
