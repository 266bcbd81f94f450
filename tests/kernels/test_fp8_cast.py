"""The FP8 casts (kiln.kernels.fp8_cast) against their reference, bit for bit: into both layouts in every
kernel form, and into one layout with a scale per row from a transposed view (the row-wise recipe's); odd
shapes, strided input, saturation, e4m3 and e5m2, bf16 and float32 input, the custom ops and their fakes,
the form switch; on the GPU with random values, where the rounding is the hardware's.

Triton's interpreter converts float32 to FP8 wrongly where rounding carries into the exponent (124 / 1 ->
e4m3 gives 64, not 128), so the CPU tests cast values that FP8 holds exactly (and values past the range,
which saturate to it): they check the tiles, masks, strides, the transposes and both stores; the GPU tests
check the rounding against torch's cast, and that two calls agree (a byte left unwritten in torch.empty's
memory would differ between calls)."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.fp8_cast import (
    CAST_FORMS,
    E4M3,
    E5M2,
    FP8_MAX,
    cast_dual_ref,
    cast_dual_triton,
    cast_form,
    cast_ref,
    cast_triton,
    fp8_cast,
    fp8_cast_dual,
)

KERNEL_FORMS = [f for f in CAST_FORMS if f != "copy"]


def _exact(shape, dtype, s: float, seed: int) -> torch.Tensor:
    """Random values q * s with q representable in `dtype`, a tenth of them (and the first) pushed past the
    range."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(*shape, generator=g) * FP8_MAX[dtype] / 8).to(dtype).float()
    over = torch.rand(*shape, generator=g) < 0.1
    over[0, 0] = True
    q = torch.where(over, q.sign() * FP8_MAX[dtype] * 4, q)
    return q * s


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


@pytest.mark.parametrize("form", KERNEL_FORMS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize(
    "shape,strided,src",
    [
        ((70, 130), False, torch.bfloat16),
        ((1, 5), False, torch.float32),
        ((130, 70), True, torch.bfloat16),
        ((64, 64), False, torch.float32),
    ],  # fmt: skip
)
def test_cast_dual_layouts(form, dtype, shape, strided, src, device):
    s = 0.03125  # a power of two: t / s is exact
    t = _exact((shape[0], 2 * shape[1]) if strided else shape, dtype, s, seed=shape[0])
    t = (t[:, ::2] if strided else t).to(device, src)
    scale = torch.tensor(s, device=device)
    with use_backend("triton"):
        q, qt = cast_dual_triton(t, scale, dtype, form)
    want_q, want_qt = cast_dual_ref(t, scale, dtype)
    assert q.dtype == qt.dtype == dtype and q.is_contiguous() and qt.is_contiguous()
    assert _bytes_equal(q, want_q) and _bytes_equal(qt, want_qt)
    assert q.float().abs().max() == FP8_MAX[dtype]  # the values past the range saturated


def test_cast_dual_op(device):
    t = _exact((48, 80), E4M3, 0.5, seed=3).to(device)
    s = torch.tensor(0.5, device=device)
    with use_backend("triton"):
        q, qt = fp8_cast_dual(t, s, False, "two_pass")
    assert _bytes_equal(q, cast_dual_ref(t, s, E4M3)[0]) and _bytes_equal(qt, q.t().contiguous())
    torch.library.opcheck(fp8_cast_dual, (t.cpu(), s.cpu(), True, "one_pass"))  # the reference path, the fake
    with pytest.raises(ValueError, match="must be 2-D"):
        fp8_cast_dual(t[0], s, False, "one_pass")
    with use_backend("triton"), pytest.raises(ValueError, match="form must be"):
        cast_dual_triton(t, s, E4M3, "copy")


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("shape,src", [((70, 130), torch.bfloat16), ((33, 5), torch.float32)])
def test_cast_rows_of_a_transposed_view(dtype, shape, src, device):
    """q = fp8(t^T * (1 / s)) with one power-of-two scale per row of t^T (per column of t): the row-wise
    recipe's transposed operands, written contiguous from the view."""
    R, C = shape
    s = 2.0 ** torch.randint(-6, 3, (C, 1), generator=torch.Generator().manual_seed(R)).float()
    t = (
        (_exact((C, R), dtype, 1.0, seed=C) * s).t().contiguous().to(device, src)
    )  # (R, C); t^T's rows scale by s
    tv, s = t.t(), s.to(device)  # (C, R) view of strides (1, C)
    with use_backend("triton"):
        q = cast_triton(tv, s, dtype)
    want = cast_ref(tv, s, dtype)
    assert q.shape == (C, R) and q.is_contiguous() and q.dtype == dtype and _bytes_equal(q, want)
    assert q.float().abs().max() == FP8_MAX[dtype]


def test_cast_op(device):
    t = _exact((40, 24), E4M3, 0.25, seed=5).to(device)
    s = torch.full((24, 1), 0.25, device=device)
    with use_backend("triton"):
        q = fp8_cast(t.t(), s, False)
    assert _bytes_equal(q, cast_ref(t.t(), s, E4M3)) and _bytes_equal(q, cast_dual_ref(t, s[0], E4M3)[1])
    torch.library.opcheck(fp8_cast, (t.t().cpu(), s.cpu(), True))
    with pytest.raises(ValueError, match="one value or one per row"):
        fp8_cast(t, s, False)  # 24 scales for 40 rows


def test_cast_form_switch(monkeypatch):
    monkeypatch.delenv("KILN_FP8_CAST", raising=False)
    assert cast_form() in CAST_FORMS
    monkeypatch.setenv("KILN_FP8_CAST", "two_pass")
    assert cast_form() == "two_pass"
    monkeypatch.setenv("KILN_FP8_CAST", "sideways")
    with pytest.raises(ValueError, match="KILN_FP8_CAST must be one of"):
        cast_form()


@pytest.mark.gpu
@pytest.mark.parametrize("form", KERNEL_FORMS)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 2816), (16, 16), (2048, 768)])
def test_cast_dual_rounding_on_the_gpu(form, dtype, src, shape):
    """Random values, a tenth of them saturating: the kernel's bytes are torch's cast's, call after call."""
    g = torch.Generator(device="cuda").manual_seed(shape[1])
    t = torch.randn(*shape, device="cuda", generator=g).to(src)
    s = (t.float().abs().amax() / FP8_MAX[dtype] * 0.7).reshape(())
    q, qt = cast_dual_triton(t, s, dtype, form)
    want_q, want_qt = cast_dual_ref(t, s, dtype)
    assert _bytes_equal(q, want_q) and _bytes_equal(qt, want_qt)
    q2, qt2 = cast_dual_triton(t, s, dtype, form)
    assert _bytes_equal(q2, q) and _bytes_equal(qt2, qt)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", [(4096, 2048), (1000, 2816), (2048, 768)])
@pytest.mark.parametrize("view", ["rows", "transposed"])
def test_cast_rows_rounding_on_the_gpu(dtype, src, shape, view):
    """Random values, per-row scales (a tenth of the values saturating): torch's bytes, call after call."""
    g = torch.Generator(device="cuda").manual_seed(shape[0])
    t = torch.randn(*shape, device="cuda", generator=g).to(src)
    t = t if view == "rows" else t.t()
    s = t.float().abs().amax(dim=1, keepdim=True) / FP8_MAX[dtype] * 0.7
    q = cast_triton(t, s, dtype)
    assert q.is_contiguous() and _bytes_equal(q, cast_ref(t, s, dtype))
    assert _bytes_equal(cast_triton(t, s, dtype), q)
