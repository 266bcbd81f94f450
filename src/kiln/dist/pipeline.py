"""Pipeline parallel: the model split into stages by layers, run by torch.distributed.pipelining schedules.

Stage s of p holds blocks [s L/p, (s+1) L/p), the first stage also the token embedding, the last the
final norm and the head. The blocks stay keyed by their global index (`model.layers.5.` on stage 1 of
2 for a 10-layer model: the Decoder's ModuleList becomes a ModuleDict), so a stage's parameter names
are the HF names and checkpoints stay keyed by them.

Between stages travel (b, T, d) tensors: the stream `h` and the residual it adds to (kiln's blocks
pass both, so the add fuses into the next norm); each stage rebuilds the dense attention metadata and
RoPE tables from (b, T). The last stage's output goes to `loss_fn` (kiln's fused linear + cross-
entropy with the head), the schedule scales gradients by 1 / micro-batches, so a step's gradient is
the mean over the step's tokens as in one process.

Schedules: GPipe (all forwards, then all backwards: m micro-batches keep m activations) and 1F1B (at
most p in flight). Both idle a bubble of (p - 1) / (m + p - 1) of the step. A tied head cannot be
split from its embedding across stages (refused in ParallelDims); interleaved 1F1B (several stages
per rank) is not built.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from kiln.kernels.linear_cross_entropy import linear_cross_entropy
from kiln.model.attn_metadata import AttnMetadata


def bubble_fraction(pp: int, microbatches: int) -> float:
    """Idle share of a GPipe / 1F1B step: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (microbatches + pp - 1)


class Stage(nn.Module):
    """Blocks [lo, hi) of a Transformer (with the embedding on the first stage, norm and head on the
    last). forward(tokens (b, T)) on the first stage, forward(h, residual (b, T, d)) on the others;
    returns (h, residual) or, on the last stage, the final-norm output (b, T, d)."""

    def __init__(self, model: nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        decoder = model.model
        decoder.layers = nn.ModuleDict({str(i): decoder.layers[i] for i in range(lo, hi)})
        if not first:
            decoder.embed_tokens = None
        if not last:
            decoder.norm = None
        self.model = decoder
        self.lm_head = model.lm_head if last else None
        self.first, self.last = first, last

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.first:
            B, T = x.shape
            h = self.model.embed_tokens(x.reshape(-1))  # (N, d)
        else:
            B, T = x.shape[:2]
            h, residual = x.reshape(B * T, -1), residual.reshape(B * T, -1)
        positions = torch.arange(T, device=h.device).expand(B, T)
        rope = self.model.rope(positions) if self.model.rope is not None else None
        meta = AttnMetadata.dense(B, T)
        for layer in self.model.layers.values():
            h, residual, _ = layer(h, residual, rope, meta)
        if self.last:
            h, _ = self.model.norm(h, residual)
            return h.view(B, T, -1)
        return h.view(B, T, -1), residual.view(B, T, -1)

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Transformer.param_groups' rule on this stage: decay matrices and embeddings, not vectors."""
        named = list(self.named_parameters())
        return [
            {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
        ]

    def loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The last stage's loss_fn: mean next-token loss of one micro-batch (b, T, d) vs (b, T)."""
        return linear_cross_entropy(out.reshape(-1, out.shape[-1]), self.lm_head.weight, targets.reshape(-1))


def split_stage(model: nn.Module, stage: int, n_stages: int) -> Stage:
    """This rank's stage of a (meta-device) Transformer; n_layers divides by n_stages (ParallelDims)."""
    per = model.config.n_layers // n_stages
    return Stage(model, stage * per, (stage + 1) * per, stage == 0, stage == n_stages - 1)


class Pipeline:
    """One rank's stage and its schedule. `step(x, y)` runs a training step's forward and backward over
    the micro-batches and returns the step's mean loss on every rank of the pipeline."""

    def __init__(self, stage: Stage, loss_module: nn.Module, index: int, dims, group, device: torch.device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.stage, self.index, self.group, self.dims = stage, index, group, dims
        self.pipe_stage = PipelineStage(loss_module, index, dims.pp, device, group=group)
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[dims.pp_schedule]
        self.schedule = cls(self.pipe_stage, n_microbatches=dims.microbatches, loss_fn=stage.loss)
        self.last_rank = dist.get_global_rank(group, dims.pp - 1)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if self.stage.first and self.stage.last:
            self.schedule.step(x, target=y, losses=losses)
        elif self.stage.first:
            self.schedule.step(x)
        elif self.stage.last:
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step()
        loss = torch.stack([v.detach() for v in losses]).mean() if losses else torch.zeros((), device=x.device)
        dist.broadcast(loss, self.last_rank, group=self.group)  # every stage logs the same loss
        return loss
