"""Grouped GEMM (kernels/moe_gemm.py) against the float64 per-expert loop: forward, dx and dw, odd row
counts, experts with no rows, E = 1 / 8 / 64; the custom op under opcheck; bf16 on the GPU."""

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.moe_gemm import (
    grouped_dw,
    grouped_linear,
    grouped_linear_bwd_op,
    grouped_linear_op,
    grouped_linear_ref,
    grouped_mm,
)

from ._tolerance import assert_close, check_op


def _offsets(counts: list[int], device="cpu") -> torch.Tensor:
    c = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    return c.to(torch.int32).to(device)


def _op(x, w, offsets):
    with use_backend("triton"):
        return grouped_linear(x, w, offsets)


@pytest.mark.parametrize(
    "counts, N, K",
    [
        ([5], 16, 16),  # E = 1, fewer rows than a tile
        ([3, 0, 17, 1, 0, 9, 33, 2], 24, 20),  # E = 8: empty experts, several row tiles, ragged N and K
        ([0] * 20 + [1, 2, 0, 5] + [0] * 39 + [3], 16, 8),  # E = 64, most experts empty
    ],
    ids=["E1", "E8", "E64"],
)
def test_grouped_linear_matches_float64(counts, N, K):
    g = torch.Generator().manual_seed(len(counts))
    x = torch.randn(sum(counts), K, generator=g)
    w = torch.randn(len(counts), N, K, generator=g) / K**0.5
    offs = _offsets(counts)
    check_op(lambda x, w: _op(x, w, offs), lambda x, w: grouped_linear_ref(x, w, offs), [x, w])


def test_grouped_linear_strided_and_fp16():
    # x a column slice (row stride 2K), w a transposed copy's view: the kernel reads any strides
    g = torch.Generator().manual_seed(1)
    counts = [4, 0, 11, 6]
    x = torch.randn(sum(counts), 40, generator=g)[:, ::2]
    w = torch.randn(4, 20, 18, generator=g).transpose(1, 2)  # (4, 18, 20), K-stride 18
    offs = _offsets(counts)
    check_op(lambda x, w: _op(x, w, offs), lambda x, w: grouped_linear_ref(x, w, offs), [x, w])
    x16, w16 = x.half(), w.half()
    with use_backend("triton"):
        got = grouped_linear(x16, w16, offs)
    assert_close(got, grouped_linear_ref(x16.double(), w16.double(), offs))


def test_grouped_mm_small_tiles_ragged_columns():
    # 16-wide tiles: several column tiles with a ragged last one in N and in K (the default interpreter
    # config covers these shapes with one)
    g = torch.Generator().manual_seed(5)
    counts = [3, 0, 21, 9]
    x = torch.randn(sum(counts), 37, generator=g)
    w = torch.randn(4, 35, 37, generator=g)
    offs = _offsets(counts)
    with use_backend("triton"):
        got, _ = grouped_mm(x, w.transpose(1, 2), offs, config=(16, 16, 16, 4, 1))
    assert_close(got, grouped_linear_ref(x.double(), w.double(), offs))


def test_grouped_mm_bigger_tiles_span_experts():
    # 32-row tiles over experts of 1..40 rows: tiles that end mid-expert, and a bound of cdiv(R, 32) + E
    g = torch.Generator().manual_seed(2)
    counts = [40, 1, 0, 31, 33]
    x = torch.randn(sum(counts), 32, generator=g)
    w = torch.randn(5, 32, 32, generator=g)
    offs = _offsets(counts)
    with use_backend("triton"):
        got, _ = grouped_mm(x, w.transpose(1, 2), offs, config=(32, 32, 32, 4, 1))
    assert_close(got, grouped_linear_ref(x.double(), w.double(), offs))


def test_grouped_linear_no_rows_and_errors():
    w = torch.randn(3, 8, 16, requires_grad=True)
    x = torch.zeros(0, 16, requires_grad=True)
    out = _op(x, w, torch.zeros(4, dtype=torch.int32))
    assert out.shape == (0, 8)
    out.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))  # every expert empty: an exact zero gradient
    with pytest.raises(ValueError, match="offsets must be"):
        _op(torch.randn(4, 16), w, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="stacked weights"):
        _op(torch.randn(4, 15), w, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="rise from 0"):
        grouped_linear_ref(torch.randn(4, 16), w, torch.tensor([0, 3, 2, 4]))


def test_grouped_linear_opcheck():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 16, generator=g, requires_grad=True)
    w = torch.randn(3, 16, 16, generator=g, requires_grad=True)
    offs = _offsets([4, 0, 5])
    with use_backend("triton"):
        torch.library.opcheck(
            grouped_linear_op, (x, w, offs),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )  # fmt: skip
        dy = torch.randn(9, 16, generator=g)
        torch.library.opcheck(grouped_linear_bwd_op, (dy, x.detach(), w.detach(), offs),
                              test_utils=("test_schema", "test_faketensor"))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(
    "E, k, d, inter, n",
    [(8, 2, 4096, 1024, 1000), (8, 2, 4096, 1024, 2048), (128, 8, 2048, 768, 513), (64, 6, 256, 96, 7)],
)  # (8, 2, 4096, 1024, 2048): 512 rows per expert, forward and dx through the persistent TMA kernel
def test_grouped_linear_gpu_bf16(E, k, d, inter, n):
    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, E, (n * k,), generator=g, device="cuda")
    counts = torch.bincount(idx, minlength=E).tolist()
    x = torch.randn(n * k, d, generator=g, device="cuda").bfloat16()
    w = (torch.randn(E, 2 * inter, d, generator=g, device="cuda") / d**0.5).bfloat16()
    offs = _offsets(counts, "cuda")
    # a K = d reduction in bf16 inputs with fp32 accumulation: the dw sums up to n*k rows per expert
    check_op(lambda x, w: _op(x, w, offs), lambda x, w: grouped_linear_ref(x, w, offs), [x, w], scale=2.0)


@pytest.mark.parametrize(
    "counts, N, K",
    [
        ([3, 0, 21, 9, 40], 48, 40),
        ([0, 0, 50, 0], 32, 32),
        ([7], 32, 16),
        ([0, 1, 0, 0, 2, 0, 0, 66], 16, 48),
    ],
    ids=["ragged", "one-expert-all-rows", "E1", "skewed"],
)
def test_grouped_mm_tma_forward_dx_and_dw(counts, N, K):
    # the persistent TMA kernel (explicit config; its default is for large experts on an sm_90+ GPU):
    # 16-row tiles that run past their expert's end, empty experts, 4 programs looping over the tiles
    g = torch.Generator().manual_seed(sum(counts))
    x = torch.randn(sum(counts), K, generator=g)
    w = torch.randn(len(counts), N, K, generator=g) / K**0.5
    dy = torch.randn(sum(counts), N, generator=g)
    offs = _offsets(counts)
    cfg = (16, 16, 16, 4, 1, "tma")
    with use_backend("triton"):
        y, _ = grouped_mm(x, w.transpose(1, 2), offs, config=cfg)  # forward: w (E, N, K) seen transposed
        dx, _ = grouped_mm(dy, w, offs, config=cfg)  # dx = dy @ w[e]: the reduction down w[e]'s N rows
        dw = grouped_dw(dy, x, offs, len(counts), config=cfg)  # descriptors over each expert's rows
    assert_close(y, grouped_linear_ref(x.double(), w.double(), offs))
    assert_close(dx, grouped_linear_ref(dy.double(), w.transpose(1, 2).contiguous().double(), offs))
    assert_close(dw, _dw_ref(dy, x, counts))


def _dw_ref(dy, x, counts):
    bounds = _offsets(counts).tolist()
    return torch.stack([dy[a:b].double().T @ x[a:b].double() for a, b in zip(bounds, bounds[1:])])


def test_grouped_mm_tma_rejects_what_descriptors_cannot_read():
    offs = _offsets([3, 4])
    w = torch.randn(2, 24, 32)  # dx's reduction over 24 rows of w[e] is not a multiple of BLOCK_K = 16
    with use_backend("triton"), pytest.raises(ValueError, match="TMA config"):
        grouped_mm(torch.randn(7, 24), w, offs, config=(16, 16, 16, 4, 1, "tma"))
    with use_backend("triton"), pytest.raises(ValueError, match="TMA config"):  # a strided x
        grouped_mm(torch.randn(7, 64)[:, ::2], w.transpose(1, 2), offs, config=(16, 16, 16, 4, 1, "tma"))
    with use_backend("triton"), pytest.raises(ValueError, match="TMA config"):  # dw: a strided dy
        grouped_dw(torch.randn(7, 48)[:, ::2], torch.randn(7, 32), offs, 2, config=(16, 16, 16, 4, 1, "tma"))


def test_mm_config_table():
    from kiln.kernels import moe_gemm

    if moe_gemm.interpreting():  # the interpreter's one small config
        assert moe_gemm.mm_config(8192, 8, N=28672, K=4096) == (16, 64, 64, 4, 1)
        assert moe_gemm.dw_config(8192, 8, 28672, 4096) == (64, 64, 16, 4, 1)
        return
    assert moe_gemm.mm_config(8192, 8, N=28672, K=4096) == moe_gemm.TMA_BIG  # Mixtral at 4k tokens
    assert moe_gemm.mm_config(32768, 128, N=1536, K=2048)[:2] == (128, 128)  # Qwen3: small experts
    assert moe_gemm.mm_config(8, 128, N=1536, K=2048)[0] == 16  # decode
    assert moe_gemm.dw_config(8192, 8, 28672, 4096) == moe_gemm.DW_TMA
    assert moe_gemm.dw_config(32768, 128, 1536, 2048) == (128, 128, 64, 8, 3)


@pytest.mark.gpu
def test_grouped_mm_tma_gpu_skewed_bf16():
    # Mixtral-sized experts (d 4096), skewed: one expert with most rows, empty ones, a 1-row expert; the
    # default configs take the TMA kernels for the forward, dx and dw
    from kiln.kernels.moe_gemm import DW_TMA, TMA_BIG, dw_config, mm_config

    counts = [0, 3000, 0, 0, 1, 0, 95, 1000]
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(sum(counts), 4096, generator=g, device="cuda").bfloat16()
    w = (torch.randn(8, 2048, 4096, generator=g, device="cuda") / 64).bfloat16()
    dy = torch.randn(sum(counts), 2048, generator=g, device="cuda").bfloat16()
    offs = _offsets(counts, "cuda")
    assert mm_config(sum(counts), 8, False, 2048, 4096) == TMA_BIG
    assert dw_config(sum(counts), 8, 2048, 4096) == DW_TMA
    with use_backend("triton"):
        y, _ = grouped_mm(x, w.transpose(1, 2), offs)
        dx, _ = grouped_mm(dy, w, offs)
        dw = grouped_dw(dy, x, offs, 8)
    # K = 4096 (2048 for dx) bf16 products in float32: the reference rounds once, as the kernel does
    assert_close(y, grouped_linear_ref(x, w, offs))
    assert_close(dx, grouped_linear_ref(dy, w.transpose(1, 2).contiguous(), offs))
    # dw sums up to 3000 rows of bf16 products in float32, rounded once to bf16; the float64 reference
    # rounds nothing, so the bf16 table's single rounding
    assert_close(dw, _dw_ref(dy, x, counts).to(torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("counts", [[3, 0, 17, 1], [5]], ids=["E4", "E1"])
def test_grouped_swiglu_matches_float64(counts):
    from kiln.kernels.moe_gemm import grouped_swiglu, grouped_swiglu_ref

    g = torch.Generator().manual_seed(6)
    x = torch.randn(sum(counts), 20, generator=g)
    w = torch.randn(len(counts), 2 * 24, 20, generator=g) / 20**0.5
    offs = _offsets(counts)

    def op(x, w):
        with use_backend("triton"):
            return grouped_swiglu(x, w, offs)

    check_op(op, lambda x, w: grouped_swiglu_ref(x, w, offs), [x, w])
    with torch.no_grad(), use_backend("triton"):  # inference: no products stored, the same values
        assert torch.equal(grouped_swiglu(x, w, offs), op(x, w).detach())


def test_grouped_swiglu_opcheck():
    from kiln.kernels.moe_gemm import grouped_swiglu_bwd_op, grouped_swiglu_op

    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, 16, generator=g, requires_grad=True)
    w = torch.randn(3, 32, 16, generator=g, requires_grad=True)
    with use_backend("triton"):
        torch.library.opcheck(
            grouped_swiglu_op, (x, w, _offsets([4, 0, 5]), True),
            test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
        )  # fmt: skip
        _, pre = grouped_swiglu_op(x.detach(), w.detach(), _offsets([4, 0, 5]), True)
        dh = torch.randn(9, 16, generator=g)
        torch.library.opcheck(grouped_swiglu_bwd_op, (dh, pre, x.detach(), w.detach(), _offsets([4, 0, 5])),
                              test_utils=("test_schema", "test_faketensor"))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.xfail(
    strict=False,
    reason="H200 at 5dcf13e: the weight gradient of the fused gate/up + SwiGLU is off by up to 0.35 on 0.8% "
    "of its elements (mean error at the bf16 bound); the model does not use the fused kernel; open in issue 19",
)
def test_grouped_swiglu_gpu_bf16():
    from kiln.kernels.moe_gemm import grouped_swiglu, grouped_swiglu_ref

    g = torch.Generator(device="cuda").manual_seed(1)
    E, d, inter, rows = 8, 1024, 1408, 3000
    idx = torch.randint(0, E, (rows,), generator=g, device="cuda")
    offs = _offsets(torch.bincount(idx, minlength=E).tolist(), "cuda")
    x = torch.randn(rows, d, generator=g, device="cuda").bfloat16()
    w = (torch.randn(E, 2 * inter, d, generator=g, device="cuda") / d**0.5).bfloat16()

    def op(x, w):
        with use_backend("triton"):
            return grouped_swiglu(x, w, offs)

    # silu of a bf16-rounded product: the reference rounds the same products, but a product within an
    # ulp of a rounding boundary may round the other way in float32 accumulation order
    check_op(op, lambda x, w: grouped_swiglu_ref(x, w, offs), [x, w], scale=2.0)
