"""SwiGLU fused into the decode matmul's prologue against float64: swiglu(gate_up) rounded to the input
dtype (as the separate swiglu kernel returns it), then the product; both kernels, split K, odd sizes,
M from 1 to 16; the public op's dispatch and errors; bf16 at the Qwen2.5-1.5B down projection on the GPU,
also inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.matmul import matmul_ref
from kiln.kernels.matmul_decode import DecodeConfig, decode_matmul
from kiln.kernels.swiglu import swiglu_linear, swiglu_ref

from ._tolerance import assert_close

CONFIGS = [
    DecodeConfig("gemv", 16, 32),
    DecodeConfig("gemv", 8, 32, split_k=3, stages=3),
    DecodeConfig("dot", 16, 32),
    DecodeConfig("dot", 32, 16, split_k=4),
]


def _inputs(M, F, N, dtype, device, seed, bias=True):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (2 * torch.randn(M, 2 * F, generator=gen)).to(device, dtype)
    w = (torch.randn(N, F, generator=gen) / F**0.5).to(device, dtype)
    b = torch.randn(N, generator=gen).to(device, dtype) if bias else None
    return gate_up, w, b


def _want(gate_up, w, b):
    """float64 product of the input-dtype swiglu: what swiglu then linear compute, without their rounding."""
    x = swiglu_ref(gate_up.cpu()).double()
    return matmul_ref(x, w.cpu().double().t(), None if b is None else b.cpu().double())


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("M,F,N", [(1, 100, 37), (3, 64, 48), (16, 200, 24), (7, 33, 17)])
def test_swiglu_prologue_matches_float64(config, M, F, N, device):
    # fp16: the interpreter's bf16 tl.dot is broken (PLATFORM.md); bf16 runs on the GPU below
    gate_up, w, b = _inputs(M, F, N, torch.float16, device, seed=M * F + N)
    y = decode_matmul(gate_up, w.t(), b, config=config, prologue="swiglu")
    assert y.shape == (M, N) and y.dtype == torch.float16
    assert_close(y, _want(gate_up, w, b), name=str(config))


@pytest.mark.parametrize("M", [1, 5])
def test_swiglu_linear_public_op(M, device):
    gate_up, w, b = _inputs(M, 72, 40, torch.float32, device, seed=M)
    with use_backend("triton"):
        got = swiglu_linear(gate_up, w, b)
        nobias = swiglu_linear(gate_up, w)
    assert_close(got, _want(gate_up, w, b))
    assert_close(nobias, _want(gate_up, w, None))
    with use_backend("reference"):  # the reference path is the two unfused ops
        assert torch.equal(swiglu_linear(gate_up, w, b), matmul_ref(swiglu_ref(gate_up), w.t(), b))


def test_swiglu_linear_bad_inputs(device):
    gate_up, w, b = _inputs(2, 16, 8, torch.float32, device, seed=0)
    with pytest.raises(ValueError, match=r"\(M, 2F\)"):
        swiglu_linear(gate_up[:, :30], w, b)
    with pytest.raises(TypeError, match="share a float dtype"):
        swiglu_linear(gate_up, w.half(), b)
    with pytest.raises(ValueError, match="bias must be"):
        swiglu_linear(gate_up, w, b[:3])
    big, w2, _ = _inputs(17, 16, 8, torch.float32, device, seed=1)
    with use_backend("triton"), pytest.raises(ValueError, match="1 to 16 rows"):
        swiglu_linear(big, w2)
    with pytest.raises(ValueError, match="prologue"):
        decode_matmul(gate_up, w.t(), prologue="gelu")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 4, 8, 16])
def test_gpu_bf16_swiglu_linear_qwen_down(M):
    # Qwen2.5-1.5B's down projection (8960 -> 1536), the rule's config, eagerly and in a CUDA graph
    gate_up, w, _ = _inputs(M, 8960, 1536, torch.bfloat16, "cuda", seed=M, bias=False)
    y = swiglu_linear(gate_up, w)
    assert_close(y, _want(gate_up, w, None), name=f"M={M}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = swiglu_linear(gate_up, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)
