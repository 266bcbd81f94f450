"""SwiGLU kernel vs the float64 reference: two tensors or one fused [gate | up] tensor."""

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.swiglu import swiglu, swiglu_fwd, swiglu_ref

from ._tolerance import assert_close, check_op


def _op(gate, up=None):
    with use_backend("triton"):
        return swiglu(gate, up)


@pytest.mark.parametrize("shape", [(1, 1, 1), (4, 64), (3, 7, 123)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
def test_swiglu_matches_float64(shape, dtype, fused):
    g = torch.Generator().manual_seed(0)
    if fused:
        inputs = [(2 * torch.randn(*shape[:-1], 2 * shape[-1], generator=g)).to(dtype)]
    else:
        inputs = [(2 * torch.randn(shape, generator=g)).to(dtype) for _ in range(2)]
    check_op(_op, swiglu_ref, inputs)


def test_swiglu_non_contiguous():
    g = torch.Generator().manual_seed(1)
    gate = torch.randn(50, 6, generator=g).t()  # (6, 50) transposed: copied per row
    up = torch.randn(6, 100, generator=g)[:, ::2]  # strided columns
    check_op(_op, swiglu_ref, [gate, up])
    check_op(_op, swiglu_ref, [torch.randn(3, 9, 40, generator=g)[:, 1:8]])  # fused, row-strided view
    check_op(_op, swiglu_ref, [torch.randn(50, 4, 2, generator=g).permute(2, 1, 0)])  # fused, permuted


def test_swiglu_block_tiles_ragged_rows():
    # several column tiles per row and a ragged last tile, on the per-row (non-flat) path
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 2 * 45, generator=g)
    got = swiglu_fwd(x[:, :45], x[:, 45:], block=16)
    assert_close(got, swiglu_ref(x.double()))


def test_swiglu_errors():
    with pytest.raises(ValueError, match="even"):
        _op(torch.randn(2, 5))
    with pytest.raises(ValueError, match="must match"):
        _op(torch.randn(2, 4), torch.randn(2, 5))
    with pytest.raises(TypeError, match="dtype"):
        _op(torch.ones(2, 4, dtype=torch.int32), torch.ones(2, 4, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_swiglu_gpu_bf16(fused):
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 2 if not fused else 1
    width = 8960 if not fused else 2 * 8960
    inputs = [(2 * torch.randn(3, 257, width, generator=g, device="cuda")).bfloat16() for _ in range(n)]
    check_op(_op, swiglu_ref, inputs)
