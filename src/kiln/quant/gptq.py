"""GPTQ (Frantar et al., 2022): quantize a weight column by column, pushing each column's rounding error
onto the columns not yet quantized, weighted by the inverse Hessian of the layer's reconstruction loss.

For a linear y = x W^T with calibration inputs X (n, K), the loss ||X W^T - X Q^T||^2 has the Hessian
H = 2 X^T X / n (K, K), the same for every output row. With U the upper Cholesky factor of H^-1, column j
is quantized and its error e = (w_j - q_j) / U[j, j] is subtracted from the later columns:
W[:, j:] -= e U[j, j:] (lazily per block of 128 columns, then once for the columns after the block).
Group parameters (int4) are chosen when the first column of a group is reached, from the columns as the
updates have left them; with act-order (columns in decreasing diag(H)) they are fixed up front from the
original weight instead ("static groups"), so that groups stay contiguous in K, as the kernels read them.
int8 takes one scale per row from the original weight. H is damped by 1% of its mean diagonal; columns
never seen (diag 0) are zeroed.

`collect_hessians` gathers H for a model's linears from forward hooks; `gptq_model` walks the blocks in
order, each block's Hessians measured with the blocks before it already quantized (as the reference
implementation does), so later layers correct for earlier layers' error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from kiln.kernels.quant_matmul import dequantize_weight, pack_int4
from kiln.model.linear import Linear
from kiln.quant.rtn import int4_params, quantize_int4_values, quantize_weight

BLOCK = 128  # columns updated lazily together: a multiple of every int4 group size


class _Stop(Exception):
    """Raised after the last block whose inputs are needed: the rest of the forward is skipped."""


def gptq_quantize(
    w: torch.Tensor,
    H: torch.Tensor,
    kind: str,
    group_size: int = 0,
    asymmetric: bool = False,
    act_order: bool = False,
    damp: float = 0.01,
) -> dict:
    """W (N, K) and its Hessian H (K, K) -> {"qweight", "scales", "zeros"} as rtn.quantize_weight."""
    if kind not in ("int8", "int4"):
        raise ValueError(f"GPTQ quantizes int8 or int4, not {kind!r}")
    W = w.detach().float().clone()
    H = H.detach().float().clone()
    N, K = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    G = group_size if kind == "int4" else K
    ng = K // G
    # per-group parameters, (N, ng); fixed now for int8 and act-order, else chosen as groups are reached
    S = torch.zeros(N, ng, dtype=torch.bfloat16, device=W.device)
    Z = torch.zeros(N, ng, device=W.device)
    fixed = kind == "int8" or act_order
    if kind == "int8":
        S[:] = quantize_weight(W, "int8")["scales"]
    elif act_order:
        for g in range(ng):
            s, z = int4_params(W[:, g * G : (g + 1) * G], asymmetric)
            S[:, g], Z[:, g] = s[:, 0], z[:, 0]
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(K, device=W.device)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(K, device=H.device)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Qint = torch.zeros(N, K, device=W.device)  # integer values, permuted order
    for i1 in range(0, K, BLOCK):
        i2 = min(i1 + BLOCK, K)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // G
            if (
                not fixed and col % G == 0
            ):  # a group's first column (no permutation: the group is W1[:, i:i+G])
                s, z = int4_params(W1[:, i : i + G], asymmetric)
                S[:, g], Z[:, g] = s[:, 0], z[:, 0]
            s, z = S[:, g].float(), Z[:, g]
            wc = W1[:, i]
            if kind == "int8":
                q = (wc / s).round().clamp(-127, 127)
                deq = q * s
            else:
                q = quantize_int4_values(wc, s, z)
                deq = (q - z) * s
            Qint[:, i1 + i] = q
            err = (wc - deq) / U1[i, i]
            W1[:, i:] -= err[:, None] * U1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ U[i1:i2, i2:]
    Qint = Qint[:, torch.argsort(perm)]  # back to the original column order
    if kind == "int8":
        return {"qweight": Qint.to(torch.int8), "scales": S, "zeros": None}
    return {"qweight": pack_int4(Qint), "scales": S, "zeros": Z.to(torch.uint8) if asymmetric else None}


def collect_hessians(
    model: nn.Module, linears: dict[str, nn.Module], run: Callable[[], None]
) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n (float32, (K, K)) of each linear's inputs over what `run()` feeds the model."""
    H: dict[str, torch.Tensor] = {}
    count: dict[str, int] = {}

    def hook(name, module, args, output):
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()  # (n, K)
        n0, n = count.get(name, 0), x.shape[0]
        if name not in H:
            H[name] = torch.zeros(x.shape[1], x.shape[1], device=x.device)
        H[name] *= n0 / (n0 + n)  # a running mean over every row seen
        x = x * (2 / (n0 + n)) ** 0.5
        H[name] += x.T @ x
        count[name] = n0 + n

    handles = [m.register_forward_hook(functools.partial(hook, n)) for n, m in linears.items()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return H


def _stop(module, args, output):
    raise _Stop


@torch.no_grad()
def gptq_model(
    model: nn.Module,
    calib: Iterable[torch.Tensor],
    kind: str,
    group_size: int = 0,
    asymmetric: bool = False,
    act_order: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, dict]:
    """GPTQ every linear in the blocks of a kiln Transformer, block by block; returns {module name:
    quantized tensors}. The model's float weights are replaced by their dequantized values as it goes
    (so the next block's Hessians see the quantized earlier blocks). `calib`: (B, T) token id batches."""
    calib = list(calib)
    out: dict[str, dict] = {}
    for i, block in enumerate(model.model.layers):
        linears = {f"model.layers.{i}.{n}": m for n, m in block.named_modules() if isinstance(m, Linear)}
        stop = block.register_forward_hook(_stop)

        def run():
            for ids in calib:
                try:
                    model.hidden_states(ids)
                except _Stop:
                    pass

        try:
            H = collect_hessians(model, linears, run)
        finally:
            stop.remove()
        for name, m in linears.items():
            if name not in H:
                raise ValueError(f"{name} saw no calibration input")
            res = gptq_quantize(m.weight, H[name], kind, group_size, asymmetric, act_order)
            bits = 8 if kind == "int8" else 4
            deq = dequantize_weight(res["qweight"], res["scales"], res["zeros"], bits, group_size)
            m.weight.copy_(deq.to(m.weight.dtype))
            out[name] = res
        if log is not None:
            log(f"gptq: block {i + 1}/{len(model.model.layers)} ({len(linears)} linears)")
    return out
