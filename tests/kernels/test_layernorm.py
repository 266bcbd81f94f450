"""LayerNorm kernel vs its float64 reference: forward, dx, dw, db (and the residual's gradient)."""

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.layernorm import layernorm, layernorm_ref

from ._tolerance import assert_close, check_op

SHAPES = [(1, 1, 8), (4, 64), (3, 7, 123)]


def _op(x, w, b, r=None):
    with use_backend("triton"):
        return layernorm(x, w, b, 1e-5, r)


def _ref(x, w, b, r=None):
    return layernorm_ref(x, w, b, 1e-5, r)


def _ref_rounded(dtype):
    """The float64 reference with h = x + r rounded to `dtype`, as the op stores it (see test_rmsnorm)."""

    def ref(x, w, b, r=None):
        if r is None:
            return _ref(x, w, b)
        h = (x.to(dtype) + r.to(dtype)).to(x.dtype)
        return _ref(h, w, b), h

    return ref


def _inputs(shape, dtype, bias, residual, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(shape, generator=g, device=device) + 0.5).to(dtype)  # a non-zero mean to remove
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g, device=device)).to(dtype)
    b = (0.1 * torch.randn(shape[-1], generator=g, device=device)).to(dtype) if bias else None
    r = torch.randn(shape, generator=g, device=device).to(dtype) if residual else None
    return [x, w, b] + ([r] if residual else [])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,residual", [(True, False), (False, True), (True, True)])
def test_layernorm_matches_float64(shape, dtype, bias, residual):
    check_op(_op, _ref_rounded(dtype), _inputs(shape, dtype, bias, residual))


def test_layernorm_non_contiguous():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 80, generator=g)[:, 1::2]
    r = torch.randn(40, 6, generator=g).t()
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    check_op(_op, _ref, [x, w, b, r])


def test_layernorm_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="bias must be"):
        _op(x, torch.ones(8), torch.ones(9))
    with pytest.raises(ValueError, match="weight has shape"):
        _op(x, torch.ones(9), None)
    with pytest.raises(TypeError, match="dtype"):
        _op(x.double(), torch.ones(8), None)


def test_layernorm_fixed_configs():
    from kiln.kernels.layernorm import layernorm_bwd, layernorm_fwd

    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(9, 40, generator=g), torch.randn(9, 40, generator=g)
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    yr = layernorm_ref(xr, wr, br, 1e-5)
    yr.backward(dy.double())
    # forward tiles of 1, 2 and 4 rows (9 rows: a ragged last tile), each one's mean/rstd feeding a backward
    for rows, stages in ((1, 1), (2, 3), (4, 3)):
        y, h, stats = layernorm_fwd(x, w, b, 1e-5, num_warps=2, rows=rows)
        assert_close(y, yr, name=f"y rows={rows}")
        dx, dw, db = layernorm_bwd(
            dy, h, w, b.dtype, stats, None, num_warps=2, programs_per_sm=1, stages=stages
        )
        assert_close(dx, xr.grad, name="dx")
        assert_close(dw, wr.grad, name="dw")
        assert_close(db, br.grad, name="db")


@pytest.mark.parametrize("shape", [(128, 64), (4, 4096), (3, 7, 123)])
@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_inference_path(shape, bias, device):
    """Without autograd the forward saves no statistics; (128, 64) and (4, 4096) take the unmasked tiles."""
    g = torch.Generator().manual_seed(9)
    x, w = torch.randn(shape, generator=g).to(device), torch.randn(shape[-1], generator=g).to(device)
    b = torch.randn(shape[-1], generator=g).to(device) if bias else None
    with torch.no_grad(), use_backend("triton"):
        got = layernorm(x, w, b, 1e-5)
    want = layernorm_ref(x.double(), w.double(), None if b is None else b.double(), 1e-5)
    assert got.shape == want.shape
    assert_close(got, want, name="inference")


def test_layernorm_backward_sums_groups_and_resets_its_counters(device):
    """dw and db summed by the backward's last programs over three groups (40 programs on the
    interpreter), the same bits from a second backward of the same forward."""
    from kiln.kernels.layernorm import layernorm_bwd, layernorm_fwd

    g = torch.Generator().manual_seed(6)
    x, dy = torch.randn(50, 24, generator=g).to(device), torch.randn(50, 24, generator=g).to(device)
    w, b = torch.randn(24, generator=g).to(device), torch.randn(24, generator=g).to(device)
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    layernorm_ref(xr, wr, br, 1e-5).backward(dy.double())
    with use_backend("triton"):
        _, h, stats = layernorm_fwd(x, w, b, 1e-5)
        per_sm = 10 if device.type == "cpu" else 1
        first = layernorm_bwd(dy, h, w, b.dtype, stats, None, num_warps=1, programs_per_sm=per_sm)
        second = layernorm_bwd(dy, h, w, b.dtype, stats, None, num_warps=1, programs_per_sm=per_sm)
    for name, got, want in zip(("dx", "dw", "db"), first, (xr.grad, wr.grad, br.grad)):
        assert_close(got, want, name=name)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 1024, 4096), (3, 333, 1536)])
@pytest.mark.parametrize("residual", [False, True])
def test_layernorm_gpu_bf16(shape, residual):
    check_op(_op, _ref_rounded(torch.bfloat16), _inputs(shape, torch.bfloat16, True, residual, device="cuda"))
