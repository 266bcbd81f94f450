"""The Hopper wgmma + TMA GEMMs against torch on the GPU (`pytest -m gpu tests/kernels/cuda`; skipped on CPU
and on GPUs other than compute capability 9.0).

Every configuration of ladder.WGMMA_CONFIGS on random and odd shapes (M and N not multiples of the tile,
K not a multiple of the 64- or 128-element K tile: the TMA zero fill at every edge). Oracle: the fp32
product of the same bf16 / e4m3 inputs, within 1e-2 of max |C| (the result is rounded to bf16, relative
step 2**-8 = 3.9e-3, and the accumulation order differs), and torch's own bf16 matmul / _scaled_mm
beside it. This file sorts after the other GPU tests on purpose: a pipeline bug here traps the kernel
(kiln_hopper::mbar_wait's watchdog) and the CUDA context is lost for the rest of the process.
"""

import pytest
import torch

from kiln.errors import KilnError
from kiln.kernels.cuda.build import load_extension
from kiln.kernels.cuda.ladder import WGMMA_CONFIGS
from kiln.kernels.cuda.ops import wgmma_bf16, wgmma_fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="wgmma and TMA need a Hopper GPU (compute capability 9.0)",
    ),
]

BF16_SHAPES = [(1, 8, 8), (37, 40, 24), (130, 136, 72), (256, 256, 256), (1001, 1024, 1000), (512, 384, 2048)]
FP8_SHAPES = [(1, 8, 16), (37, 40, 48), (130, 136, 80), (256, 256, 256), (1001, 1024, 1008), (512, 384, 2048)]
CONFIGS = range(len(WGMMA_CONFIGS))


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return float((c.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def test_extension_agrees_with_the_config_table():
    assert load_extension().wgmma_configs() == len(WGMMA_CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("shape", BF16_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_wgmma_bf16_matches_fp32_product(config, shape):
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(m + n + k + config)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    bt = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    c = wgmma_bf16(a, bt, config)
    assert c.dtype == torch.bfloat16 and c.shape == (m, n)
    err = rel_err(c, a.float() @ bt.float().t())
    assert err < 1e-2, f"config {config} {shape}: max error / max |C| = {err:.2e}"
    assert rel_err(c, a @ bt.t()) < 1e-2  # and torch's own bf16 matmul


def test_wgmma_bf16_every_element_is_written():
    # C comes from torch.empty: a tile the kernel skipped would hold garbage; poison the allocator's
    # memory first so that skipped elements cannot pass by being zero
    torch.full((4096, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
    a = torch.ones(300, 64, device="cuda", dtype=torch.bfloat16)
    bt = torch.ones(520, 64, device="cuda", dtype=torch.bfloat16)
    for config in CONFIGS:
        assert torch.equal(wgmma_bf16(a, bt, config), torch.full((300, 520), 64.0, device="cuda").bfloat16())


def _fp8_inputs(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    bt = (torch.randn(n, k, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    return a, bt, torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_wgmma_fp8_matches_fp32_product_and_scaled_mm(config, shape):
    m, n, k = shape
    a, bt, sa, sb = _fp8_inputs(m, n, k, m + n + k + config)
    c = wgmma_fp8(a, bt, sa, sb, config)
    assert c.dtype == torch.bfloat16 and c.shape == (m, n)
    err = rel_err(c, (a.float() @ bt.float().t()) * (sa * sb))
    assert err < 1e-2, f"config {config} {shape}: max error / max |C| = {err:.2e}"
    if m % 16 == 0 and n % 16 == 0:  # torch._scaled_mm's own shape rule
        peer = torch._scaled_mm(a, bt.t(), sa, sb, out_dtype=torch.bfloat16)
        assert rel_err(c, peer.float()) < 1e-2


def test_wgmma_bad_inputs():
    a = torch.randn(16, 12, device="cuda").bfloat16()
    with pytest.raises(KilnError, match="K divisible by 8"):
        wgmma_bf16(a, torch.randn(16, 12, device="cuda").bfloat16())
    a = torch.randn(16, 16, device="cuda").bfloat16()
    with pytest.raises(KilnError, match="inner dimensions"):
        wgmma_bf16(a, torch.randn(16, 24, device="cuda").bfloat16())
    with pytest.raises(KilnError, match="N by 8"):
        wgmma_bf16(a, torch.randn(12, 16, device="cuda").bfloat16())
    a8, bt8, sa, sb = _fp8_inputs(16, 16, 24, 0)
    with pytest.raises(KilnError, match="K divisible by 16"):
        wgmma_fp8(a8, bt8, sa, sb)
    with pytest.raises(KilnError, match="unknown wgmma config"):
        wgmma_bf16(a, a, len(WGMMA_CONFIGS))
