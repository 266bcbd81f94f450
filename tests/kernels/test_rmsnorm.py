"""RMSNorm kernel vs its float64 reference: forward, dx, dw (and the residual's gradient)."""

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.rmsnorm import rmsnorm, rmsnorm_ref

from ._tolerance import assert_close, check_op

# tiny, typical-but-small, odd (D not a power of two, rows not a multiple of the 4 backward programs)
SHAPES = [(1, 1, 8), (4, 64), (3, 7, 123)]


def _op(x, w, r=None, offset=0.0):
    with use_backend("triton"):
        return rmsnorm(x, w, 1e-6, r, offset)


def _ref(x, w, r=None, offset=0.0):
    return rmsnorm_ref(x, w, 1e-6, r, offset)


def _ref_rounded(dtype):
    """The float64 reference with h = x + r rounded to `dtype`, as the op (and the eager add) stores it.

    Without the rounding, dw = sum over rows of dy * h * rstd differs from the float64 sum by about
    eps(dtype) * sqrt(rows) per column, an error of the stored residual, not of the kernel."""

    def ref(x, w, r=None):
        if r is None:
            return _ref(x, w)
        h = (x.to(dtype) + r.to(dtype)).to(x.dtype)  # gradients pass straight through the casts
        return _ref(h, w), h

    return ref


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_matches_float64(shape, dtype, residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
    inputs = [x, w] + ([torch.randn(shape, generator=g).to(dtype)] if residual else [])
    check_op(_op, _ref_rounded(dtype), inputs)


@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_weight_offset(residual):
    """offset + w as the weight (Gemma-style zero-centred weights, offset 1): forward, dx, dw, dresidual."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(3, 7, 123, generator=g), 0.1 * torch.randn(123, generator=g)
    inputs = [x, w] + ([torch.randn(3, 7, 123, generator=g)] if residual else [])
    check_op(lambda *t: _op(*t, offset=1.0), lambda *t: _ref(*t, offset=1.0), inputs)
    # the same function as the plain op on a weight of 1 + w
    with torch.no_grad():
        a, b = _op(x, w, offset=1.0), _op(x, 1.0 + w)
    assert_close(a, b.double(), name="offset vs 1 + w")


def _rounds_like_hugging_face(dtype, device):
    """The normalized row is rounded to x's dtype before the weight multiply, as Hugging Face's
    LlamaRMSNorm does (`weight * hidden.to(dtype)`); the reference is that code, line for line."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 96, generator=g).to(device, dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(device, dtype)
    hs = x.float()
    hs = hs * torch.rsqrt(hs.pow(2).mean(-1, keepdim=True) + 1e-6)
    hf_out = w * hs.to(dtype)
    assert torch.equal(rmsnorm_ref(x, w, 1e-6), hf_out)
    with torch.no_grad():
        got = _op(x, w)
    # the kernel's rsqrt and sum order differ from torch's in the last float32 bits, which can flip a
    # rounding: at most one step of `dtype` apart, and equal almost everywhere
    step = torch.finfo(dtype).eps * hf_out.float().abs()
    assert bool(((got.float() - hf_out.float()).abs() <= step).all())
    assert (got == hf_out).float().mean() > 0.98


def test_rmsnorm_rounds_like_hugging_face():
    # fp16 on the CPU: the interpreter (Triton 3.6) casts float32 to bf16 by truncation, not to nearest
    _rounds_like_hugging_face(torch.float16, "cpu")


@pytest.mark.gpu
def test_rmsnorm_rounds_like_hugging_face_gpu():
    _rounds_like_hugging_face(torch.bfloat16, "cuda")
    _rounds_like_hugging_face(torch.float16, "cuda")


def test_rmsnorm_fp16_weight_fp32():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=g).half()
    w = torch.randn(96, generator=g)  # fp32 master weight with fp16 activations
    check_op(_op, _ref, [x, w])


def test_rmsnorm_non_contiguous():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 80, generator=g)[:, ::2]  # last dim strided: copied to rows by the launcher
    r = torch.randn(40, 6, generator=g).t()  # transposed
    w = torch.randn(40, generator=g)
    check_op(_op, _ref, [x, w, r])
    xt = torch.randn(40, 3, 5, generator=g).permute(1, 2, 0)  # (3, 5, 40), rows not evenly strided
    check_op(_op, _ref, [xt, w])


def test_rmsnorm_only_residual_output_used():
    # the gradient of y is None (materialization off): dx must equal the residual's gradient alone
    x = torch.randn(3, 16, requires_grad=True)
    r = torch.randn(3, 16)
    w = torch.ones(16, requires_grad=True)
    _, h = _op(x, w, r)
    h.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    torch.testing.assert_close(w.grad, torch.zeros_like(w))


def test_rmsnorm_errors():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight has shape"):
        _op(x, torch.ones(7))
    with pytest.raises(TypeError, match="dtype torch.int64"):
        _op(torch.ones(2, 8, dtype=torch.long), torch.ones(8))
    with pytest.raises(ValueError, match="residual must match"):
        _op(x, torch.ones(8), torch.randn(2, 8).half())


def test_rmsnorm_auto_backend_on_cpu_is_reference():
    x, w = torch.randn(2, 8), torch.randn(8)
    with use_backend("auto"):
        torch.testing.assert_close(rmsnorm(x, w), rmsnorm_ref(x, w))


def test_rmsnorm_fixed_configs():
    # the non-autotuned launch path (benchmark sweeps): explicit warps, programs per SM, stages
    from kiln.kernels.rmsnorm import rmsnorm_bwd, rmsnorm_fwd

    g = torch.Generator().manual_seed(4)
    x, w, dy = torch.randn(9, 40, generator=g), torch.randn(40, generator=g), torch.randn(9, 40, generator=g)
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    yr = rmsnorm_ref(xr, wr, 1e-6)
    yr.backward(dy.double())
    # forward tiles of 1, 2 and 4 rows (9 rows: a ragged last tile), each one's rstd feeding a backward
    for rows, stages in ((1, 1), (2, 3), (4, 3)):
        y, h, rstd = rmsnorm_fwd(x, w, 1e-6, num_warps=2, rows=rows)
        assert_close(y, yr, name=f"y rows={rows}")
        dx, dw = rmsnorm_bwd(dy, h, w, rstd, None, num_warps=2, programs_per_sm=1, stages=stages)
        assert_close(dx, xr.grad, name="dx")
        assert_close(dw, wr.grad, name="dw")


@pytest.mark.parametrize("shape", [(128, 64), (2, 4096), (3, 7, 123), (5, 48)])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_inference_path(shape, residual, device):
    """Without autograd the forward saves no statistics: rows of a power of two and not, tiles of several
    rows (D = 64, 48) and one (4096), a ragged last tile (5 rows of 48)."""
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(shape, generator=g).to(device), torch.randn(shape[-1], generator=g).to(device)
    r = torch.randn(shape, generator=g).to(device) if residual else None
    with torch.no_grad(), use_backend("triton"):
        got = rmsnorm(x, w, 1e-6, r)
    want = rmsnorm_ref(x.double(), w.double(), 1e-6, None if r is None else r.double())
    for a, b in zip(got if residual else (got,), want if residual else (want,)):
        assert a.shape == b.shape
        assert_close(a, b, name="inference")


def test_rmsnorm_backward_sums_groups_and_resets_its_counters(device):
    """dw is summed in the backward's own launch by the programs that finish last (groups of 16, then the
    group sums): 40 programs make three groups, one ragged. A second backward through the same graph
    (retain_graph) must find the counters zeroed again and give the same gradients, bit for bit."""
    from kiln.kernels.rmsnorm import rmsnorm_bwd, rmsnorm_fwd

    g = torch.Generator().manual_seed(5)
    x, w, dy = (t.to(device) for t in (torch.randn(50, 24, generator=g), torch.randn(24, generator=g),
                                       torch.randn(50, 24, generator=g)))  # fmt: skip
    xr, wr = x.double().requires_grad_(), w.double().requires_grad_()
    rmsnorm_ref(xr, wr, 1e-6).backward(dy.double())
    with use_backend("triton"):
        _, h, rstd = rmsnorm_fwd(x, w, 1e-6)
        per_sm = 10 if device.type == "cpu" else 1  # 40 programs on the interpreter, the SM count on a GPU
        first = rmsnorm_bwd(dy, h, w, rstd, None, num_warps=1, programs_per_sm=per_sm)
        second = rmsnorm_bwd(dy, h, w, rstd, None, num_warps=1, programs_per_sm=per_sm)
        assert_close(first[0], xr.grad, name="dx")
        assert_close(first[1], wr.grad, name="dw")
        assert torch.equal(first[1], second[1]) and torch.equal(first[0], second[0])
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rmsnorm(xa, wa)
        once = torch.autograd.grad(y, (xa, wa), dy, retain_graph=True)
        twice = torch.autograd.grad(y, (xa, wa), dy)
        assert all(torch.equal(a, b) for a, b in zip(once, twice))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 1024, 4096), (3, 333, 1536), (2, 17, 8192)])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_gpu_bf16(shape, residual):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, generator=g, device="cuda").bfloat16()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g, device="cuda")).bfloat16()
    inputs = [x, w] + ([torch.randn(shape, generator=g, device="cuda").bfloat16()] if residual else [])
    check_op(_op, _ref_rounded(torch.bfloat16), inputs)
