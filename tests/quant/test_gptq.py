"""GPTQ against round-to-nearest on one layer whose inputs have correlated, unevenly scaled features (as a
transformer's do): GPTQ's layer output error ||X W^T - X Q^T|| is lower for int4 (with and without act-order)
and int8; the result is in the same format RTN writes, its Hessian from forward hooks is 2 X^T X / n."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.quant_matmul import dequantize_weight
from kiln.model.linear import Linear
from kiln.quant.gptq import collect_hessians, gptq_quantize
from kiln.quant.rtn import quantize_weight


def _layer(N=64, K=256, n=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(N, K, generator=g) / K**0.5
    # features: a few shared directions plus noise, with scales spread over 1.5 decades
    X = torch.randn(n, 16, generator=g) @ torch.randn(16, K, generator=g) + 0.3 * torch.randn(
        n, K, generator=g
    )
    X = X * torch.logspace(-0.75, 0.75, K)[torch.randperm(K, generator=g)]
    return W, X


def _out_err(X, W, res, bits, group):
    Q = dequantize_weight(res["qweight"], res["scales"], res["zeros"], bits, group)
    return float((X @ W.T - X @ Q.T).norm() / (X @ W.T).norm())


@pytest.mark.parametrize(
    "kind,group,asym,act_order",
    [
        ("int4", 32, False, False),
        ("int4", 128, True, False),
        ("int4", 64, False, True),
        ("int8", 0, False, False),
    ],
)
def test_gptq_beats_rtn_on_layer_output(kind, group, asym, act_order):
    W, X = _layer()
    H = 2 * X.T @ X / X.shape[0]
    bits = 4 if kind == "int4" else 8
    rtn = quantize_weight(W, kind, group, asym)
    gptq = gptq_quantize(W, H, kind, group, asym, act_order)
    for k in rtn:
        assert (rtn[k] is None) == (gptq[k] is None)
        if rtn[k] is not None:
            assert rtn[k].shape == gptq[k].shape and rtn[k].dtype == gptq[k].dtype
    e_rtn, e_gptq = _out_err(X, W, rtn, bits, group), _out_err(X, W, gptq, bits, group)
    assert e_gptq < 0.8 * e_rtn, f"GPTQ {e_gptq:.4f} vs RTN {e_rtn:.4f}"


def test_hessian_from_hooks():
    lin = Linear(32, 8, bias=False, backend="torch")
    torch.nn.init.normal_(lin.weight)
    xs = [torch.randn(5, 7, 32), torch.randn(3, 32)]
    H = collect_hessians(lin, {"l": lin}, lambda: [lin(x) for x in xs])["l"]
    X = torch.cat([x.reshape(-1, 32) for x in xs])
    torch.testing.assert_close(H, 2 * X.T @ X / X.shape[0], rtol=1e-5, atol=1e-5)
