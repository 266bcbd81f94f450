"""FP8 training GEMMs on the GPU (kiln.kernels.fp8_train, the kiln::fp8_scaled_mm op on cuBLAS): forward,
dX and dW under bf16 autocast against float64 autograd, eager and compiled by inductor, both recipes, at a
token-heavy training shape; and the op against the float32 emulation on the same quantized operands.

The CPU suite runs the same code on torch's CPU _scaled_mm kernel (tests/kernels/test_fp8_train.py); these
check cuBLAS and inductor's CUDA codegen, which the CPU cannot. bench/fp8_check.py is the wider diagnostic.
"""

from __future__ import annotations

import pytest
import torch

import kiln.kernels.fp8_train as fp8_train
from kiln.kernels.fp8_cast import CAST_FORMS
from kiln.kernels.fp8_train import fp8_train_linear, use_scaled_mm

from .test_fp8_train import BOUND

pytestmark = pytest.mark.gpu

SHAPE = (4096, 768, 2048)  # (M tokens, K in, N out): every dim % 16, as the op requires


def _inputs(seed: int = 0):
    M, K, N = SHAPE
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g)
    w = torch.randn(N, K, device="cuda", generator=g) * K**-0.5
    dy = torch.randn(M, N, device="cuda", generator=g).bfloat16()
    return x, w, dy


def _step(fn, x, w, dy):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(xr, wr)
    y.backward(dy)
    return y.detach().float(), xr.grad, wr.grad


def _float64(x, w, dy):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    y64 = x64 @ w64.T
    y64.backward(dy.double())
    return y64.detach(), x64.grad, w64.grad


def _rel(got, want) -> float:
    return float((got.double() - want).norm() / want.norm())


# each recipe in each form of kiln.kernels.fp8_cast (the rowwise recipe has one kernel form: one_pass)
RECIPE_CASTS = [("rowwise", "copy"), ("rowwise", "one_pass")] + [("tensorwise", form) for form in CAST_FORMS]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("recipe,cast", RECIPE_CASTS)
def test_scaled_mm_gemms_against_float64(recipe, cast, compiled, monkeypatch):
    monkeypatch.setenv("KILN_FP8_CAST", cast)
    x, w, dy = _inputs()
    assert use_scaled_mm(x, w)
    fn = lambda a, b: fp8_train_linear(a, b, None, recipe)  # noqa: E731
    torch._dynamo.reset()
    got = _step(torch.compile(fn, fullgraph=True, dynamic=False) if compiled else fn, x, w, dy)
    # FP8's rounding plus one bf16 rounding of each output (0.004): the CPU-derived bounds hold
    errs = [_rel(g, want) for g, want in zip(got, _float64(x, w, dy), strict=True)]
    assert all(e <= b for e, b in zip(errs, BOUND[recipe], strict=True)), (recipe, cast, compiled, errs)


@pytest.mark.parametrize("recipe,cast", RECIPE_CASTS)
def test_scaled_mm_equals_the_emulation_on_the_gpu(recipe, cast, monkeypatch):
    monkeypatch.setenv("KILN_FP8_CAST", cast)
    x, w, dy = _inputs(seed=1)
    fn = lambda a, b: fp8_train_linear(a, b, None, recipe)  # noqa: E731
    op = _step(fn, x, w, dy)
    monkeypatch.setattr(fp8_train, "use_scaled_mm", lambda *tensors: False)
    emulated = _step(fn, x, w, dy)
    for a, b in zip(op, emulated, strict=True):
        # the same quantized operands; accumulation order (the forward's fast accumulation) and one bf16
        # rounding differ: within about 2 bf16 steps relative
        assert _rel(a, b) < 1e-2, (recipe, cast, _rel(a, b))
