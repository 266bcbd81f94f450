"""The producers that quantize their own output rows for an FP8 linear: rmsnorm_fp8 (add + RMSNorm) and
swiglu_fp8. Each must give the bits of the op followed by quantize_fp8 (the path they replace): checked in
Triton's interpreter on odd shapes (its float32 -> FP8 conversion errs where rounding carries, but the two
paths convert the same float32 values, so they agree bit for bit) and in bf16 on the GPU; the reference
path against the float64 ops within e4m3's rounding."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import swiglu as swiglu_mod
from kiln.kernels.dispatch import use_backend
from kiln.kernels.fp8_matmul import FP8, FP8_MAX, Fp8Rows, quantize_fp8
from kiln.kernels.rmsnorm import rmsnorm, rmsnorm_fp8, rmsnorm_fp8_ref, rmsnorm_ref
from kiln.kernels.swiglu import swiglu, swiglu_fp8, swiglu_fp8_ref, swiglu_ref


def _bits(rows: Fp8Rows, q: torch.Tensor, s: torch.Tensor) -> None:
    assert rows.q.dtype == FP8 and rows.scale.dtype == torch.float32
    assert rows.q.shape == q.shape and rows.scale.shape == s.shape == (q.shape[0], 1)
    assert torch.equal(rows.q.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(rows.scale, s)


def _within_e4m3(rows: Fp8Rows, want: torch.Tensor) -> None:
    """q * scale within half an e4m3 step of want (3 mantissa bits: 2**-4 relative, or half the smallest
    subnormal step absolute), and the row's largest value on 448 (its scale is amax / 448)."""
    back = rows.q.double() * rows.scale.double()
    want = want.reshape(back.shape).double()
    bound = want.abs() * 2**-4 + 2**-10 * rows.scale.double()
    assert bool(((back - want).abs() <= bound * (1 + 1e-6)).all())
    assert torch.allclose(want.abs().amax(1, keepdim=True) / FP8_MAX, rows.scale.double().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "shape", [(5, 100), (3, 7, 48), (2, 2100)], ids=str
)  # tiles of several rows; one a program
@pytest.mark.parametrize("residual", [True, False])
def test_rmsnorm_fp8_is_rmsnorm_then_quantize(dtype, shape, residual, device):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(device)
    r = torch.randn(shape, generator=g).to(dtype).to(device) if residual else None
    w = torch.randn(shape[-1], generator=g).to(dtype).to(device)
    x[0, ..., 0] = 0.0  # rows need not be all nonzero; one row all zero: the 1e-12 scale
    if residual:
        r[0] = -x[0]
    with use_backend("triton"):
        rows, h = rmsnorm_fp8(x, w, 1e-6, r)
        out = rmsnorm(x, w, 1e-6, r)
        y, h_want = out if residual else (out, x)
        q, s = quantize_fp8(y.reshape(-1, shape[-1]), per_row=True)
    _bits(rows, q, s)
    assert rows.dtype == dtype and torch.equal(h, h_want)
    assert not residual or float(rows.scale[0]) == float(torch.tensor(1e-12))  # float32's 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("fused", [True, False])
def test_swiglu_fp8_is_swiglu_then_quantize(dtype, fused, device):
    g = torch.Generator().manual_seed(3)  # H = 150: a row of 256 lanes, the last 106 masked
    n, H = 7, 150
    if fused:
        gate, up = (torch.randn(n, 2 * H, generator=g) * 2).to(dtype).to(device), None
    else:  # two strided views: rows of the (n, 2H) buffer
        buf = (torch.randn(n, 4 * H, generator=g) * 2).to(dtype).to(device)
        gate, up = buf[:, :H], buf[:, 2 * H : 3 * H]
    with use_backend("triton"):
        rows = swiglu_fp8(gate, up)
        q, s = quantize_fp8(swiglu(gate, up).reshape(n, H), per_row=True)
    _bits(rows, q, s)
    assert rows.dtype == dtype


def test_swiglu_fp8_past_a_row_in_registers_runs_the_two_kernels(monkeypatch, device):
    monkeypatch.setattr(swiglu_mod, "MAX_ROW", 64)
    launched = []
    monkeypatch.setattr(swiglu_mod, "_fp8_launch", {(3,): lambda *a, **k: launched.append(a)})
    gu = (torch.randn(3, 200, generator=torch.Generator().manual_seed(4)) * 2).to(torch.float16).to(device)
    with use_backend("triton"):
        rows = swiglu_fp8(gu)
        q, s = quantize_fp8(swiglu(gu), per_row=True)
    assert launched == []  # rows of 100 > MAX_ROW: not the one-row kernel
    _bits(rows, q, s)


def test_references_are_the_ops_within_e4m3_rounding():
    g = torch.Generator().manual_seed(5)
    x, r = torch.randn(9, 64, generator=g) * 4, torch.randn(9, 64, generator=g)
    w = torch.randn(64, generator=g)
    rows, h = rmsnorm_fp8_ref(x, w, 1e-5, r)
    assert torch.equal(h, x + r)
    _within_e4m3(rows, rmsnorm_ref(x.double(), w.double(), 1e-5, r.double())[0])
    gu = torch.randn(4, 6, 40, generator=g) * 3
    rows = swiglu_fp8_ref(gu)
    assert rows.shape == (24, 20)
    _within_e4m3(rows, swiglu_ref(gu.double()))
    with use_backend("reference"):  # the public ops off Triton take the references
        assert torch.equal(swiglu_fp8(gu).q.view(torch.uint8), rows.q.view(torch.uint8))


def test_inference_only():
    x = torch.randn(3, 16, requires_grad=True)
    with use_backend("triton"):
        with pytest.raises(ValueError, match="inference"):
            rmsnorm_fp8(x, torch.ones(16))
        with pytest.raises(ValueError, match="inference"):
            swiglu_fp8(torch.randn(3, 32, requires_grad=True))


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 77, 2048])
def test_gpu_bits_at_the_qwen_shapes(n):
    """bf16 at Qwen2.5-1.5B's d = 1536 (several rows a program) and F = 8960 (five chunks a row)."""
    g = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(n, 1536, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    r = torch.randn(n, 1536, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(1536, device="cuda", generator=g, dtype=torch.bfloat16)
    rows, h = rmsnorm_fp8(x, w, 1e-6, r)
    y, h_want = rmsnorm(x, w, 1e-6, r)
    _bits(rows, *quantize_fp8(y, per_row=True))
    assert torch.equal(h, h_want)
    _within_e4m3(rows, y)
    gu = torch.randn(n, 2 * 8960, device="cuda", generator=g, dtype=torch.bfloat16) * 3
    rows = swiglu_fp8(gu)
    a = swiglu(gu)
    _bits(rows, *quantize_fp8(a, per_row=True))
    _within_e4m3(rows, a)
