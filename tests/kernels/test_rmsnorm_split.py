"""The add + RMSNorm that adds a split-K decode matmul's partial sums itself (kiln.kernels.rmsnorm.rmsnorm_split,
KILN_DECODE_SUM=norm): against float64; the matmul's output and the new stream bit for bit those of the decode
matmul's sum kernel followed by rmsnorm, the normalized rows within a rounding of them; decode_matmul's
defer_sum and both ops' clear errors; bf16 at the Qwen2.5-1.5B o / down shapes on the GPU, eager and in a
CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.matmul_decode import DecodeConfig, decode_matmul
from kiln.kernels.rmsnorm import rmsnorm, rmsnorm_ref, rmsnorm_split, rmsnorm_split_ref

from ._tolerance import assert_close


def _inputs(M, K, N, S, dtype, device, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(device, dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=gen).to(device, dtype) if bias else None
    r = torch.randn(M, N, generator=gen).to(device, dtype)
    gamma = (1 + 0.1 * torch.randn(N, generator=gen)).to(device, dtype)
    return x, w, b, r, gamma


def _separate(x, w, b, r, gamma, config):
    """What KILN_DECODE_SUM=separate runs: the decode matmul with its sum kernel, then the add + RMSNorm."""
    with use_backend("triton"):
        y = decode_matmul(x, w.t(), b, config=config)
        return rmsnorm(y, gamma, 1e-6, r)


def _fused(x, w, b, r, gamma, config):
    with use_backend("triton"):
        p = decode_matmul(x, w.t(), config=config, defer_sum=True)
        return rmsnorm_split(p, b, gamma, 1e-6, r)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in units of a's dtype's last place (at b's magnitude)."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(torch.finfo(a.dtype).tiny)
    step = 2.0 ** torch.floor(torch.log2(scale)) * eps
    return int(((a.float() - b.float()).abs() / step).max().round())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("M,K,N,split", [(3, 96, 40, 2), (5, 128, 24, 4)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_split_norm_matches_the_sum_kernel_then_rmsnorm(M, K, N, split, bias, dtype, device):
    # the dot kernel (the rule's form at 2-64 rows) with K split; fp16 / fp32: the interpreter's bf16
    # tl.dot is broken (PLATFORM.md), and the partials' bits are what both forms share anyway
    config = DecodeConfig("dot", 16, 32, split)
    x, w, b, r, gamma = _inputs(M, K, N, split, dtype, device, seed=M * N + split, bias=bias)
    y, h = _fused(x, w, b, r, gamma, config)
    y_sep, h_sep = _separate(x, w, b, r, gamma, config)
    assert y.shape == (M, N) and h.shape == (M, N) and y.dtype == h.dtype == dtype
    assert torch.equal(h, h_sep)  # the matmul's output + the residual: the same bits
    assert _ulps(y, y_sep) <= 1  # rstd's float32 sum may run in another order: a rounding at most
    # float64: x W^T + b rounded as the matmul stores it, then the add + RMSNorm reference
    want_y = (x.double() @ w.double().t() + (0 if b is None else b.double())).to(dtype)
    h64 = (want_y.double() + r.double()).to(dtype)
    assert_close(h, h64, scale=2, name="h")  # the split's float32 sum and two roundings against float64's one
    hf = h64.double()
    y64 = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).double() * gamma.double()
    assert_close(y, y64.to(dtype), scale=2, name="y")  # the same roundings, one more for the normalized row


def test_reference_is_the_sum_then_the_norm(device):
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(3, 4, 24, generator=gen).to(device)
    b = torch.randn(24, generator=gen).to(device, torch.bfloat16)
    r = torch.randn(4, 24, generator=gen).to(device, torch.bfloat16)
    g = torch.randn(24, generator=gen).to(device, torch.bfloat16)
    y, h = rmsnorm_split_ref(p, b, g, 1e-6, r)
    x = (p[0] + p[1] + p[2] + b.float()).to(torch.bfloat16)
    want_y, want_h = rmsnorm_ref(x, g, 1e-6, r)
    assert torch.equal(h, want_h) and torch.equal(y, want_y)


def test_clear_errors(device):
    x, w, b, r, gamma = _inputs(3, 96, 40, 2, torch.float32, device, seed=1)
    with use_backend("triton"):
        with pytest.raises(ValueError, match="defer_sum needs a config that splits K"):
            decode_matmul(x, w.t(), config=DecodeConfig("dot", 16, 32, 1), defer_sum=True)
        with pytest.raises(ValueError, match="defer_sum returns the bare partial sums"):
            decode_matmul(x, w.t(), activation="silu", config=DecodeConfig("dot", 16, 32, 2), defer_sum=True)
        with pytest.raises(ValueError, match="defer_sum returns the bare partial sums: no bias"):
            decode_matmul(x, w.t(), b, config=DecodeConfig("dot", 16, 32, 2), defer_sum=True)
        p = decode_matmul(x, w.t(), config=DecodeConfig("dot", 16, 32, 2), defer_sum=True)
        assert p.shape == (2, 3, 40) and p.dtype == torch.float32
        with pytest.raises(ValueError, match="rmsnorm_split: partials must be float32"):
            rmsnorm_split(p.half(), b, gamma, 1e-6, r)
        with pytest.raises(ValueError, match="rmsnorm_split: partials must be float32"):
            rmsnorm_split(p, b, gamma, 1e-6, r[:2])
        with pytest.raises(ValueError, match=r"rmsnorm_split: bias must be \(40,\)"):
            rmsnorm_split(p, b[:3], gamma, 1e-6, r)


# Qwen2.5-1.5B: o 1536 -> 1536 at 64 rows (the wide tiles split K 4 ways) and down 8960 -> 1536 at 16 rows
@pytest.mark.gpu
@pytest.mark.parametrize(
    "M,K,bias", [(64, 1536, False), (32, 1536, True), (16, 8960, False), (4, 8960, False)]
)
def test_bf16_qwen_shapes_eager_and_in_a_graph(M, K, bias):
    """The rule's config (decode_config), bf16: h the bits of the sum kernel + rmsnorm, y within a bf16
    rounding, eagerly and replayed from a CUDA graph (a new step's input read by the replay)."""
    from kiln.kernels.dispatch import sm_count
    from kiln.kernels.matmul_decode import decode_config

    N = 1536
    config = decode_config(M, N, K, sm_count(torch.device("cuda")))
    assert config.split_k > 1, config
    x, w, b, r, gamma = _inputs(M, K, N, config.split_k, torch.bfloat16, "cuda", seed=M + K, bias=bias)
    y, h = _fused(x, w, b, r, gamma, None)
    y_sep, h_sep = _separate(x, w, b, r, gamma, None)
    assert torch.equal(h, h_sep) and _ulps(y, y_sep) <= 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg, hg = _fused(x, w, b, r, gamma, None)
    x.copy_(torch.randn_like(x))
    y_sep, h_sep = _separate(x, w, b, r, gamma, None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(hg, h_sep) and _ulps(yg, y_sep) <= 1
