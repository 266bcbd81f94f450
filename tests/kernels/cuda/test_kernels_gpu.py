"""Every CUDA C++ kernel against torch on the GPU (`pytest -m gpu tests/kernels/cuda`; skipped on CPU).

Oracles: torch's a + b (vector add, bit-exact: one fp32 add either way); float64 matmul of the same
inputs for the fp32 ladder (max error over max |C| within 1e-3, on odd shapes); the fp32 product of the
same bf16 / e4m3 inputs for the tensor-core kernels (within 1e-2 of max |C|: the result is rounded to
bf16, relative step 2**-8 = 3.9e-3, and fp32 accumulation order differs) and torch's own bf16 matmul
and torch._scaled_mm beside them.
"""

import pytest
import torch

from kiln.errors import KilnError
from kiln.kernels.cuda.build import load_extension
from kiln.kernels.cuda.ladder import MMA_CONFIGS, SGEMM_LADDER, SKEWED_CONFIGS, WARPTILE_CONFIGS
from kiln.kernels.cuda.ops import (
    VECTOR_ADD_VARIANTS,
    mma_bf16,
    mma_fp8,
    sgemm,
    sgemm_double_buffered,
    sgemm_skewed,
    sgemm_warptile,
    vector_add,
)

pytestmark = pytest.mark.gpu

SGEMM_SHAPES = [(1, 1, 1), (7, 5, 3), (129, 65, 257), (256, 256, 256), (1000, 1027, 999), (64, 132, 20)]
TC_SHAPES = [(16, 8, 16), (37, 40, 24), (130, 136, 72), (256, 256, 256), (1001, 1024, 1000), (512, 384, 2048)]
FP8_SHAPES = [
    (16, 8, 16),
    (37, 40, 48),
    (130, 136, 80),
    (256, 256, 256),
    (1001, 1024, 1008),
    (512, 384, 2048),
]


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return float((c.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))


def test_extension_agrees_with_the_ladder_registry():
    assert load_extension().sgemm_steps() == len(SGEMM_LADDER)
    assert load_extension().sgemm_warptile_configs() == len(WARPTILE_CONFIGS)
    assert load_extension().mma_configs() == len(MMA_CONFIGS)
    assert load_extension().sgemm_skewed_configs() == len(SKEWED_CONFIGS)


@pytest.mark.parametrize("variant", VECTOR_ADD_VARIANTS)
@pytest.mark.parametrize("n", [1, 3, 4, 1000, (1 << 20) + 3, 50_000_001])
def test_vector_add_is_exact(variant, n):
    g = torch.Generator(device="cuda").manual_seed(n)
    a = torch.randn(n, device="cuda", generator=g)
    b = torch.randn(n, device="cuda", generator=g)
    assert torch.equal(vector_add(a, b, variant), a + b)


def test_vector_add_2d_and_bad_inputs():
    a = torch.randn(33, 17, device="cuda")
    assert torch.equal(vector_add(a, a), a + a)
    base = torch.randn(1001, device="cuda")
    with pytest.raises(KilnError, match="16-byte aligned"):
        vector_add(base[1:], base[1:], "float4")
    assert torch.equal(vector_add(base[1:], base[1:], "grid_stride"), base[1:] * 2)
    with pytest.raises(KilnError, match="float32"):
        vector_add(a.half(), a.half())
    with pytest.raises(KilnError, match="unknown vector add variant"):
        vector_add(a, a, "warp")


@pytest.mark.parametrize("step", [s.name for s in SGEMM_LADDER])
@pytest.mark.parametrize("shape", SGEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_sgemm_ladder_matches_float64(step, shape):
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(k, n, device="cuda", generator=g)
    c = sgemm(a, b, step)
    assert c.shape == (m, n) and c.dtype == torch.float32
    err = rel_err(c, a.double() @ b.double())
    assert err < 1e-3, f"{step} {shape}: max error / max |C| = {err:.2e}"


@pytest.mark.parametrize("config", range(len(WARPTILE_CONFIGS)))
@pytest.mark.parametrize(
    "shape", [(1, 1, 1), (1000, 1027, 999), (129, 200, 64)], ids=lambda s: "x".join(map(str, s))
)
def test_sgemm_warptile_configs_match_float64(config, shape):
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(config)
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(k, n, device="cuda", generator=g)
    err = rel_err(sgemm_warptile(a, b, config), a.double() @ b.double())
    assert err < 1e-3, f"config {config} {shape}: {err:.2e}"


@pytest.mark.parametrize("config", range(len(WARPTILE_CONFIGS)))
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1), (1000, 1027, 999), (129, 200, 64), (300, 260, 1000)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_sgemm_double_buffered_configs_match_float64(config, shape):
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(config)
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(k, n, device="cuda", generator=g)
    err = rel_err(sgemm_double_buffered(a, b, config), a.double() @ b.double())
    assert err < 1e-3, f"config {config} {shape}: {err:.2e}"


@pytest.mark.parametrize("config", range(len(SKEWED_CONFIGS)))
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1), (7, 5, 3), (1000, 1027, 999), (129, 200, 64), (300, 260, 1000), (257, 384, 16)],
    ids=lambda s: "x".join(map(str, s)),
)
def test_sgemm_skewed_configs_match_float64(config, shape):
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(config + 100)
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(k, n, device="cuda", generator=g)
    err = rel_err(sgemm_skewed(a, b, config), a.double() @ b.double())
    assert err < 1e-3, f"skewed config {config} {shape}: {err:.2e}"


@pytest.mark.parametrize("config", range(len(SKEWED_CONFIGS)))
def test_sgemm_skewed_unaligned_operands_take_the_scalar_path(config):
    # b at an odd address: not 16-byte aligned, so its float4 loads must not be used
    a = torch.randn(64, 128, device="cuda")
    b = torch.randn(128 * 96 + 1, device="cuda")[1:].view(128, 96)
    assert rel_err(sgemm_skewed(a, b, config), a.double() @ b.double()) < 1e-3


@pytest.mark.parametrize("step", ["vectorized", "warptiled", "double_buffered"])
def test_sgemm_unaligned_rows_take_the_scalar_path(step):
    # a view starting one float in: not 16-byte aligned, so the float4 loads must not be used
    base = torch.randn(64 * 129 + 1, device="cuda")
    a = base[1:].view(64, 129)[:, :128].contiguous()  # contiguous copy: aligned again
    b_store = torch.randn(128 * 96 + 1, device="cuda")
    b = b_store[1:].view(128, 96)  # contiguous but at an odd address
    ref = a.double() @ b.double()
    assert rel_err(sgemm(a, b, step), ref) < 1e-3


def test_sgemm_bad_inputs():
    a = torch.randn(4, 5, device="cuda")
    with pytest.raises(KilnError, match="inner dimensions"):
        sgemm(a, a)
    with pytest.raises(KilnError, match="contiguous"):
        sgemm(a.t(), a.t().contiguous().t())
    with pytest.raises(KilnError, match="unknown SGEMM step"):
        sgemm(a, a.t().contiguous(), "fastest")


@pytest.mark.parametrize("config", range(len(MMA_CONFIGS)))
@pytest.mark.parametrize("shape", TC_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mma_bf16_matches_fp32_product(shape, config):
    m, n, k = shape
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(k, n, device="cuda", generator=g).bfloat16()
    c = mma_bf16(a, b, config)
    ref = a.float() @ b.float()
    assert c.dtype == torch.bfloat16 and c.shape == (m, n)
    assert rel_err(c, ref) < 1e-2
    assert rel_err(c, a @ b) < 1e-2  # and torch's own bf16 matmul


@pytest.mark.parametrize("config", [i for i, c in enumerate(MMA_CONFIGS) if c.persistent])
def test_mma_bf16_persistent_loops_over_tiles(config):
    # more tiles than an H200 holds blocks at once (132 SMs; 288 tiles of 128 x 256, 576 of 128 x 128 at two
    # blocks per SM), partial at every edge: each block computes several tiles and its K-tile copies cross
    # from one tile into the next (TC_SHAPES have fewer tiles than blocks fit, one tile per block)
    m, n, k = 3001, 3064, 264
    g = torch.Generator(device="cuda").manual_seed(7)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = torch.randn(k, n, device="cuda", generator=g).bfloat16()
    c = mma_bf16(a, b, config)
    assert rel_err(c, a.float() @ b.float()) < 1e-2


def test_mma_bf16_bad_shapes():
    a = torch.randn(16, 12, device="cuda").bfloat16()
    with pytest.raises(KilnError, match="divisible by 8"):
        mma_bf16(a, torch.randn(12, 16, device="cuda").bfloat16())
    with pytest.raises(KilnError, match="unknown mma config"):
        mma_bf16(a, torch.randn(12, 16, device="cuda").bfloat16(), len(MMA_CONFIGS))


def _fp8_inputs(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(m, k, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    bt = (torch.randn(n, k, device="cuda", generator=g) * 2).to(torch.float8_e4m3fn)
    return a, bt, torch.tensor(0.5, device="cuda"), torch.tensor(0.25, device="cuda")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs sm_89+"
)
@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_mma_fp8_matches_fp32_product_and_scaled_mm(shape):
    m, n, k = shape
    a, bt, sa, sb = _fp8_inputs(m, n, k, m + n + k)
    c = mma_fp8(a, bt, sa, sb)
    ref = (a.float() @ bt.float().t()) * (sa * sb)
    assert c.dtype == torch.bfloat16 and c.shape == (m, n)
    assert rel_err(c, ref) < 1e-2
    if m % 16 == 0 and n % 16 == 0:  # torch._scaled_mm's own shape rule
        peer = torch._scaled_mm(a, bt.t(), sa, sb, out_dtype=torch.bfloat16)
        assert rel_err(c, peer.float()) < 1e-2


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="FP8 needs sm_89+"
)
def test_mma_fp8_bad_inputs():
    a, bt, sa, sb = _fp8_inputs(16, 16, 24, 0)
    with pytest.raises(KilnError, match="K divisible by 16"):
        mma_fp8(a, bt, sa, sb)
    a, bt, sa, sb = _fp8_inputs(16, 16, 32, 0)
    with pytest.raises(KilnError, match="one value"):
        mma_fp8(a, bt, torch.ones(2, device="cuda"), sb)
