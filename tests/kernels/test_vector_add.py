"""Vector add, the teaching kernel, vs the float64 sum."""

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.vector_add import vector_add, vector_add_launch, vector_add_ref

from ._tolerance import assert_close, check_op


def _op(x, y):
    with use_backend("triton"):
        return vector_add(x, y)


@pytest.mark.parametrize("shape", [(1,), (1024,), (3, 1000), (2, 3, 333)])  # one block, exact, ragged tails
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_vector_add_matches_float64(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    check_op(_op, vector_add_ref, [x, y])


def test_vector_add_non_contiguous_and_small_blocks():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 20, generator=g).t()
    y = torch.randn(20, 60, generator=g)[:, ::2]
    check_op(_op, vector_add_ref, [x, y])
    a, b = torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    assert_close(vector_add_launch(a, b, block=64), a.double() + b.double())


def test_vector_add_errors():
    with pytest.raises(ValueError, match="must match"):
        _op(torch.randn(3), torch.randn(4))
    with pytest.raises(TypeError, match="not supported"):
        _op(torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.int32))


@pytest.mark.gpu
def test_vector_add_gpu_large():
    x = torch.randn(2**24 + 3, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    check_op(_op, vector_add_ref, [x, y])
