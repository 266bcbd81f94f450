"""Muon for the hidden matrices, AdamW for everything else (Keller Jordan's Muon, as modded-nanogpt uses it).

Muon ("MomentUm Orthogonalized by Newton-schulz") keeps a momentum buffer per matrix and steps along
an approximately orthogonalized version of it. For a weight W (m, n) with gradient G, one step is:

    B <- mu * B + (1 - mu) * G                          momentum (an exponential average)
    U <- (1 - mu) * G + mu * B      (Nesterov)          or U <- B without Nesterov
    O <- NS_k(U)                                        ~ U's polar factor: U = P S Q^T -> P Q^T
    W <- W * (1 - lr * wd) - lr * sqrt(max(1, m / n)) * O

NS_k is k steps of a quintic Newton-Schulz iteration on X0 = U / ||U||_F (so every singular value is
at most 1): X <- a X + (b A + c A^2) X with A = X X^T, run on the wide orientation (rows <= cols) so A is
the smaller Gram matrix. The coefficients (a, b, c) = (3.4445, -4.7750, 2.0315) push every singular
value in (0, 1] into roughly [0.7, 1.2] within five steps: not exactly 1, and it does not need to be
(Keller Jordan's write-up, "Muon: An optimizer for hidden layers in neural networks", 2024). The
sqrt(max(1, m/n)) factor keeps the update's per-entry size comparable between tall and wide matrices.
The iteration runs in bfloat16 on CUDA (it is stable there, and it is the part of the step that costs
matmuls) and in float32 on the CPU; parameters and momentum stay in their own dtype (float32).

Which tensors are "hidden matrices": the 2-D weights of kiln's `Linear` layers inside the blocks (the
attention and MLP projections). A merged projection (fused q/k/v, fused gate/up) is orthogonalized part by
part, exactly as the separate weights would be. The token embedding, the LM head, positions, norms,
biases, sink logits, MoE routers and expert stacks go to AdamW: Muon is for matrices that map one hidden
space into another, and an embedding's rows are looked up, not multiplied.

Hyper-parameters (TrainConfig): muon_lr 0.02, muon_momentum 0.95 with Nesterov, muon_ns_steps 5,
muon_weight_decay 0 (Keller Jordan's defaults); the AdamW part keeps train.lr/beta1/beta2/eps/weight_decay,
with train.embed_lr (default train.lr) for the embeddings: nanochat gives its embedding 50x the head's lr.
The schedule scales both learning rates by the same factor (kiln.train.optim.WarmupCosine).

Same-shape matrices are stacked and orthogonalized in one batched call (one NS per shape, not per
matrix), which keeps a 12-layer model's step to a few dozen kernel launches.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.nn as nn

from kiln.errors import KilnError

NS_COEFFS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g: torch.Tensor, steps: int = 5, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The approximate polar factor of each matrix in g (..., m, n), computed in `dtype` (default g's).

    Returns a tensor of g's shape in `dtype`. Zero matrices map to zero (the eps in the normalization).
    """
    if g.dim() < 2:
        raise ValueError(f"newton_schulz takes matrices (..., m, n), got shape {tuple(g.shape)}")
    a, b, c = NS_COEFFS
    # the Frobenius norm in float32 whatever the iteration's dtype: it sets the scale of everything after
    norm = g.float().norm(dim=(-2, -1), keepdim=True)
    x = (g.float() / (norm + 1e-7)).to(dtype or g.dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT  # (..., n, m): iterate on the wide side, so A = X X^T is the smaller square
    for _ in range(steps):
        gram = x @ x.mT  # (..., r, r), r = min(m, n)
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters. Each group may carry "splits": per parameter, the row counts of its parts
    (None: one part), so a merged projection is orthogonalized part by part.

    Honors a `found_inf` attribute (0-dim float tensor on the device, 1.0 = skip) as torch's fused AdamW
    does: the update is then discarded on the device (parameters and momentum untouched), with no host sync.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        weight_decay: float = 0.0,
        ns_dtype: torch.dtype | None = None,
    ):
        if not lr > 0:
            raise ValueError(f"Muon lr must be > 0, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"Muon momentum must be in [0, 1), got {momentum}")
        if ns_steps < 1:
            raise ValueError(f"Muon ns_steps must be >= 1, got {ns_steps}")
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps, weight_decay=weight_decay
        )
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        for group in self.param_groups:
            splits = group.setdefault("splits", [None] * len(group["params"]))
            if len(splits) != len(group["params"]):
                raise ValueError("Muon: a group's 'splits' needs one entry per parameter")
            for p, s in zip(group["params"], splits):
                if p.dim() != 2:
                    raise ValueError(f"Muon takes 2-D parameters only, got shape {tuple(p.shape)}")
                if s is not None and sum(s) != p.shape[0]:
                    raise ValueError(
                        f"Muon: splits {s} do not add up to the {p.shape[0]} rows of a parameter"
                    )

    def _iteration_dtype(self, p: torch.Tensor) -> torch.dtype:
        if self.ns_dtype is not None:
            return self.ns_dtype
        return torch.bfloat16 if p.is_cuda else torch.float32

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        keep = None if found_inf is None else found_inf == 0  # 0-dim bool on the device
        for group in self.param_groups:
            live = [(p, s) for p, s in zip(group["params"], group["splits"]) if p.grad is not None]
            if not live:
                continue
            params = [p for p, _ in live]
            grads = [p.grad for p in params]
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                bufs.append(state["momentum_buffer"])
            mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
            new_bufs = torch._foreach_lerp(bufs, grads, 1.0 - mu)  # mu * B + (1 - mu) * G
            if group["nesterov"]:
                upd = torch._foreach_lerp(grads, new_bufs, mu)  # (1 - mu) * G + mu * B
            else:
                upd = [b.clone() for b in new_bufs]  # orthogonalized in place below: not the buffer itself
            self._orthogonalize(params, [s for _, s in live], upd, group["ns_steps"])
            new_params = torch._foreach_mul(params, 1.0 - lr * wd) if wd else [p.clone() for p in params]
            torch._foreach_add_(new_params, upd, alpha=-lr)
            _commit(bufs, new_bufs, keep)
            _commit(params, new_params, keep)
        return loss

    def _orthogonalize(self, params, splits, upd, ns_steps: int) -> None:
        """Replace each part of each update in `upd` by its scaled NS_k, same-shape parts in one batch."""
        buckets: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
        for i, (p, s) in enumerate(zip(params, splits)):
            row = 0
            for rows in s or [p.shape[0]]:
                buckets[(rows, p.shape[1], p.device, self._iteration_dtype(p))].append((i, row, row + rows))
                row += rows
        for (m, n, _, dtype), parts in buckets.items():
            x = torch.stack([upd[i][r0:r1] for i, r0, r1 in parts])  # (k, m, n)
            o = newton_schulz(x, ns_steps, dtype) * math.sqrt(max(1.0, m / n))
            for j, (i, r0, r1) in enumerate(parts):
                upd[i][r0:r1].copy_(o[j])


def _commit(dst: list[torch.Tensor], new: list[torch.Tensor], keep: torch.Tensor | None) -> None:
    if keep is None:
        torch._foreach_copy_(dst, new)
        return
    for d, v in zip(dst, new):
        d.copy_(torch.where(keep, v, d))


def hidden_matrices(model: nn.Module) -> dict[str, list[int] | None]:
    """{parameter name: row splits or None} of the matrices Muon takes: the weights of kiln `Linear`
    layers inside the blocks (model.layers.*), merged ones with their parts' row counts."""
    from kiln.model.linear import Linear, MergedLinear

    out: dict[str, list[int] | None] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Linear) and ".layers." in f".{name}." and mod.weight.dim() == 2:
            out[f"{name}.weight"] = list(mod.parts.values()) if isinstance(mod, MergedLinear) else None
    return out


class MuonAdamW:
    """One optimizer object for the training loop: Muon over the hidden matrices, torch's AdamW over the
    rest: the head (decayed), the embeddings (decayed, at `embed_lr`, default `lr`) and the norms and biases
    (undecayed: Transformer.no_weight_decay_param_names).

    It offers what the loop, the scheduler and checkpoints use of an optimizer: param_groups (AdamW's
    first, so the logged lr is train.lr's schedule), step, zero_grad, state_dict / load_state_dict,
    defaults["fused"] and `found_inf` (set by the loop for an on-device skip: passed to both halves).
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        muon_lr: float,
        muon_momentum: float,
        muon_ns_steps: int,
        muon_weight_decay: float,
        embed_lr: float | None = None,
        ns_dtype: torch.dtype | None = None,
    ):
        hidden = hidden_matrices(model)
        if not hidden:
            raise KilnError(
                "train.optimizer=muon found no hidden matrices (kiln Linear layers in the blocks)"
            )
        named = dict(model.named_parameters())
        muon_params = [named[n] for n in hidden]
        skip = model.no_weight_decay_param_names()
        rest = [(n, p) for n, p in named.items() if n not in hidden]
        embeds = {n for n, _ in rest if n.split(".")[-2] in ("embed_tokens", "embed_positions")}
        fused = all(p.is_cuda for p in named.values())
        groups = [  # the head (decayed) first: param_groups[0]'s lr is the one the loop logs
            {
                "params": [p for n, p in rest if n not in skip and n not in embeds],
                "weight_decay": weight_decay,
            },
            {
                "params": [p for n, p in rest if n in embeds],
                "weight_decay": weight_decay,
                "lr": embed_lr or lr,
            },
            {"params": [p for n, p in rest if n in skip and n not in embeds], "weight_decay": 0.0},
        ]
        self.adamw = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=lr,
            betas=betas,
            eps=eps,
            fused=fused or None,
        )
        self.muon = Muon(
            [{"params": muon_params, "splits": [hidden[n] for n in hidden]}],
            lr=muon_lr,
            momentum=muon_momentum,
            ns_steps=muon_ns_steps,
            weight_decay=muon_weight_decay,
            ns_dtype=ns_dtype,
        )
        # the loop skips a bad step on the device only when every part can (fused AdamW and Muon both can)
        self.defaults = {"fused": bool(self.adamw.defaults.get("fused"))}

    @property
    def param_groups(self) -> list[dict]:
        return self.adamw.param_groups + self.muon.param_groups

    def step(self) -> None:
        found_inf = getattr(self, "found_inf", None)
        for opt in (self.adamw, self.muon):
            if found_inf is not None and opt is self.adamw and not self.defaults["fused"]:
                if bool(found_inf):  # unfused AdamW takes no flag: decide on the host (the loop never asks)
                    continue
                opt.step()
                continue
            if found_inf is not None:
                opt.found_inf = found_inf
            try:
                opt.step()
            finally:
                if found_inf is not None:
                    del opt.found_inf

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.adamw.zero_grad(set_to_none=set_to_none)
        self.muon.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"adamw": self.adamw.state_dict(), "muon": self.muon.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != {"adamw", "muon"}:
            raise KeyError("not a Muon + AdamW optimizer state (it was saved by another optimizer)")
        self.adamw.load_state_dict(state["adamw"])
        self.muon.load_state_dict(state["muon"])
