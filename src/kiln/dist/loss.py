"""The training loss under tensor parallel: vocab-parallel head and cross-entropy (`loss_parallel`).

The one-process loss (`Transformer.loss`) runs kiln's fused linear + cross-entropy on the full head.
Under tensor parallel the head's weight (V, d) is split by vocabulary rows, so each rank computes its
(N, V / tp) slice of the logits and `loss_parallel` computes the softmax statistics with two small
all-reduces (max and sum over the vocabulary) instead of gathering (N, V) logits. Its backward must
run under the same context: `loss_context()` covers both (kiln.dist.strategy enters it).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from kiln.model.attn_metadata import AttnMetadata


def loss_context():
    """The context the forward and backward of `VocabParallelLoss` run in."""
    return loss_parallel()


class VocabParallelLoss(nn.Module):
    """forward(input_ids (B, T), targets (B, T)) -> mean next-token loss (targets -100 ignored), for a
    Transformer sharded by kiln.dist.tp.apply_tp over `tp_mesh`; in training mode a MoE model's
    load-balancing loss is added as Transformer.loss adds it."""

    def __init__(self, model: nn.Module, tp_mesh):
        super().__init__()
        self.model = model
        self.tp_mesh = tp_mesh

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B, T = x.shape
        # the dense wrapper's metadata and positions (Transformer.hidden_states), on the flat decoder:
        # under sequence parallel its output is a token-sharded DTensor that (B, T, d) views cannot take
        positions = torch.arange(T, device=x.device).expand(B, T)
        h, aux = self.model.model(x.reshape(-1), positions, AttnMetadata.dense(B, T))  # (N, d)
        if isinstance(h, DTensor):  # sequence parallel: gather the tokens for the vocab-parallel head
            h = h.redistribute(placements=[Replicate()])
        else:
            h = DTensor.from_local(h, self.tp_mesh, [Replicate()], run_check=False)
        w = self.model.head_weight  # (V, d), Shard(0) over tp
        dev = x.device.type
        if torch.is_autocast_enabled(dev):  # as Transformer.loss: the head's matmul in 16 bits
            dt = torch.get_autocast_dtype(dev)
            h, w = h.to(dt), w.to(dt)
        logits = F.linear(h, w)  # (N, V) Shard(1): this rank's vocabulary columns
        loss = F.cross_entropy(logits.float(), y.reshape(-1), ignore_index=-100)
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        coef = self.model.config.router_aux_loss_coef
        if self.model.training and aux is not None and coef:  # every tp rank routes all tokens alike
            loss = loss + coef * aux
        return loss
