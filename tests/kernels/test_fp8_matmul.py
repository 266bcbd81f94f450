"""FP8 (e4m3) quantization and matmul. On the CPU: the quantize math by hand-worked cases and its error
bound (Triton's interpreter converts to fp8 wrongly, so the quantize kernel runs on the GPU only), and the
matmul kernel through the interpreter on operands quantized by torch. On the GPU: the quantize kernel equal
to the reference, the matmul against torch._scaled_mm with per-tensor and per-row scales."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.fp8_matmul import (
    FP8,
    FP8_MAX,
    fp8_linear,
    fp8_matmul,
    fp8_matmul_ref,
    quantize_fp8,
    quantize_fp8_ref,
)
from kiln.kernels.matmul_decode import DecodeConfig

from ._tolerance import assert_close


def test_quantize_by_hand():
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0 / 4], [0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_fp8_ref(x, per_row=True)
    assert q.dtype == FP8 and s.shape == (2, 1)
    assert s[0, 0] == 0.25 and q[0].float().tolist() == [4.0, -8.0, 2.0, 448.0]  # amax lands on 448 exactly
    assert q[1].float().abs().sum() == 0 and s[1, 0] > 0  # an all-zero row: a tiny scale, no nan
    q, s = quantize_fp8_ref(x, per_row=False)
    assert s.shape == (1, 1) and s.item() == 0.25


@pytest.mark.parametrize("per_row", [True, False])
def test_quantize_error_within_half_a_step(per_row):
    """e4m3 has 3 mantissa bits: rounding to nearest errs by at most 2**-4 relative (normal range), or half
    the subnormal step 2**-9 * s absolute."""
    x = torch.randn(64, 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-2, 2, 64)[:, None]
    q, s = quantize_fp8_ref(x, per_row)
    back = q.float() * s
    bound = x.abs() * 2**-4 + 2**-10 * s
    assert bool(((back - x).abs() <= bound).all())
    assert float((x / s).abs().max()) <= FP8_MAX * (1 + 1e-6)


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("M,N,K", [(1, 37, 64), (50, 33, 100)])
def test_matmul_kernel_through_the_interpreter(per_row, M, N, K, device):
    g = torch.Generator().manual_seed(M + N)
    a_q, a_s = quantize_fp8_ref(torch.randn(M, K, generator=g), per_row)
    b_q, b_s = quantize_fp8_ref(torch.randn(N, K, generator=g), per_row=True)
    bias = torch.randn(N, generator=g).to(torch.bfloat16)
    a_q, a_s, b_q, b_s, bias = (t.to(device) for t in (a_q, a_s, b_q, b_s, bias))
    with use_backend("triton"):
        c = fp8_matmul(a_q, a_s, b_q, b_s, bias, torch.float32, config=(16, 16, 32, 1, 4))
    want = (a_q.double() * a_s.double()) @ (b_q.double() * b_s.double()).T + bias.double()
    assert_close(c, want)


@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize(
    "M,config", [(1, DecodeConfig("dot", 16, 32)), (5, DecodeConfig("dot", 16, 32, split_k=3))]
)
def test_decode_kernel_through_the_interpreter(per_row, M, config, device):
    """The decode form (weight as the tensor-core M side, K split across programs and summed in order):
    ragged N and K, bias."""
    N, K = 37, 100
    g = torch.Generator().manual_seed(M + 7)
    a_q, a_s = quantize_fp8_ref(torch.randn(M, K, generator=g), per_row)
    b_q, b_s = quantize_fp8_ref(torch.randn(N, K, generator=g), per_row=True)
    bias = torch.randn(N, generator=g).to(torch.bfloat16)
    a_q, a_s, b_q, b_s, bias = (t.to(device) for t in (a_q, a_s, b_q, b_s, bias))
    with use_backend("triton"):
        c = fp8_matmul(a_q, a_s, b_q, b_s, bias, torch.float32, config=config)
    want = (a_q.double() * a_s.double()) @ (b_q.double() * b_s.double()).T + bias.double()
    assert_close(c, want)


def test_linear_reference_and_errors():
    x = torch.randn(3, 5, 64)
    w_q, w_s = quantize_fp8_ref(torch.randn(16, 64), per_row=True)
    y = fp8_linear(x, w_q, w_s)
    a_q, a_s = quantize_fp8_ref(x.reshape(15, 64), per_row=True)
    assert y.shape == (3, 5, 16) and torch.equal(
        y.reshape(15, 16), fp8_matmul_ref(a_q, a_s, w_q, w_s, None, x.dtype)
    )
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fp8_matmul(a_q.float(), a_s, w_q, w_s)
    with pytest.raises(ValueError, match="scales must have"):
        fp8_matmul(a_q, a_s[:2], w_q, w_s)
    with use_backend("triton"), pytest.raises(ValueError, match="FP8 decode kernel"):
        fp8_matmul(a_q, a_s, w_q, w_s, config=DecodeConfig("gemv", 16, 32))


@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [True, False])
def test_quantize_kernel_equals_reference(per_row):
    x = torch.randn(77, 1536, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_fp8(x, per_row)
    q_ref, s_ref = quantize_fp8_ref(x, per_row)
    assert torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    # x * (1 / s) in the kernel, x / s in the reference: a value on a rounding boundary may go either way
    diff = (q.float() - q_ref.float()).abs() / q_ref.float().abs().clamp_min(2**-9)
    assert float(diff.max()) <= 2**-3 and float((q != q_ref).float().mean()) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("per_row", [True, False])
@pytest.mark.parametrize("M,N,K", [(1, 2048, 1536), (16, 1536, 8960), (500, 17920, 1536), (4096, 1536, 8960)])
def test_matmul_matches_scaled_mm(per_row, M, N, K):
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K**0.5
    a_q, a_s = quantize_fp8(x, per_row)
    b_q, b_s = quantize_fp8(w, per_row=True) if per_row else quantize_fp8(w, per_row=False)
    c = fp8_matmul(a_q, a_s, b_q, b_s)
    want = torch._scaled_mm(
        a_q, b_q.t(), scale_a=a_s, scale_b=b_s.t().contiguous() if per_row else b_s, out_dtype=torch.bfloat16
    )
    # both sum the same fp8 products in float32, in different orders: bf16 output rounding apart
    assert_close(c, want.double(), torch.bfloat16)
    if M <= 16:  # the decode form, K split in 4
        c = fp8_matmul(a_q, a_s, b_q, b_s, config=DecodeConfig("dot", 64, 128, 4, 4, 3))
        assert_close(c, want.double(), torch.bfloat16)
