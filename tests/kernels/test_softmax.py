"""Softmax kernels (one-block and online multi-block) vs the float64 reference, forward and backward."""

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.softmax import softmax, softmax_bwd, softmax_fwd, softmax_ref

from ._tolerance import assert_close, check_op

# Probabilities are far below 1 (1e-2 here, 1e-5 at vocabulary widths), so the table's atol (1.6e-2 in
# bf16) would accept anything: bound the outputs absolutely at 1e-7 (fp16's subnormal step is 6e-8),
# leaving the relative bound to do the work. Gradients keep the table: dx = y * (dy - sum(dy * y)) is
# computed from the saved y, rounded to the input dtype as torch.softmax's backward does too, and where
# dy ~ sum(dy * y) that rounding leaves an absolute error of order eps(dtype) * y * |dy| with y <= 1,
# which is what the table's atol is (measured: the same error as torch's own bf16/fp16 backward).
TIGHT = {"atol": 1e-7}


def _op(x):
    with use_backend("triton"):
        return softmax(x)


@pytest.mark.parametrize("shape", [(1, 1), (1, 1, 8), (4, 64), (3, 5, 123)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_softmax_matches_float64(shape, dtype):
    x = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(0))).to(dtype)
    check_op(_op, softmax_ref, [x], **TIGHT)


@pytest.mark.parametrize("n_cols,max_block,online_block", [(100, 16, 16), (257, 64, 32), (64, 32, 32)])
def test_softmax_online_multi_block(n_cols, max_block, online_block):
    # small blocks force the online path on CPU-sized rows: ragged last block, exact multiple
    g = torch.Generator().manual_seed(1)
    x = 4 * torch.randn(3, n_cols, generator=g, dtype=torch.float64)
    x[0, :40] = -float("inf")  # a masked prefix: the running max starts at -inf for whole blocks
    x[1, -1] = 30.0  # the max arrives in the last block: every earlier sum is rescaled
    y = softmax_fwd(x.float(), max_block=max_block, online_block=online_block)
    assert_close(y, softmax_ref(x), atol=1e-7, name="online forward")
    dy = torch.randn(3, n_cols, generator=g, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    softmax_ref(xr).backward(dy)
    dx = softmax_bwd(dy.float(), y, max_block=max_block, online_block=online_block)
    assert_close(dx, xr.grad, name="online backward")


def test_softmax_all_masked_row_is_nan_like_torch():
    x = torch.full((2, 16), -float("inf"))
    x[1, 3] = 0.0
    for max_block in (16, 8):
        y = softmax_fwd(x, max_block=max_block, online_block=8)
        assert torch.isnan(y[0]).all()
        assert_close(y[1], torch.softmax(x[1].double(), -1), name="masked row")


def test_softmax_other_dim_and_non_contiguous():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 6, 7, generator=g)
    with use_backend("triton"):
        check_op(lambda t: softmax(t, 1), lambda t: softmax_ref(t, 1), [x], **TIGHT)
    check_op(_op, softmax_ref, [torch.randn(20, 6, generator=g).t()], **TIGHT)
    check_op(_op, softmax_ref, [torch.randn(6, 40, generator=g)[:, ::3]], **TIGHT)


def test_softmax_rejects_integer_input():
    with pytest.raises(TypeError, match="dtype torch.int64"):
        _op(torch.ones(2, 3, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4096, 4096), (7, 1000), (4, 151936)])  # last: the online path
def test_softmax_gpu_bf16(shape):
    x = (
        3 * torch.randn(shape, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda")
    ).bfloat16()
    check_op(_op, softmax_ref, [x], **TIGHT)
