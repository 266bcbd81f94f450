"""Grouped GEMM (kernels/moe_gemm.py) against the float64 per-expert loop: forward, dx and dw, odd row
counts, experts with no rows, E = 1 / 8 / 64; the custom op under opcheck; bf16 on the GPU."""

import pytest
import torch
import torch.nn.functional as F

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
    return torch.stack([dy[a:b].double().T @ x[a:b].double() for a, b in _pairs(counts)])


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


def _swiglu_stages(x, w, counts, dh):
    """The fused gate/up + SwiGLU forward and backward at each of its rounding points, then end to end.

    Each stage is checked against float64 computed from the kernel's own rounded inputs to that stage:
    the stored products pre (R, 2I) against x @ w[e].T (one K-reduction, rounded once), h against silu(g) * u
    of pre, dpre = [dgate | dup] against the SwiGLU derivative of pre and dh, dw (E, 2I, K) against
    dpre.T @ x per expert and dx against dpre @ w[e] (one reduction, rounded once): the table's bound,
    tight enough that a wrong row, column, expert or half is far outside it. End to end, against the
    unrounded float64 chain, dw is a sum over an expert's rows of terms dpre[r, j] * x[r, k] that each
    carry up to ~3 unit roundoffs u of relative error (pre's g and u rounded, dpre rounded), with random
    signs: the error scales with sqrt(sum_r (dpre x)^2), not with |dw|, which cancels to near zero in some
    elements (an elementwise rtol there fails on rounding alone: docs/perf/moe.md, the 0.8% of the
    H200's bf16 run). The bound is u * |dw| (the output's rounding) + 6 u sqrt(sum_r (dpre x)^2);
    a CPU emulation of the bf16 GPU case's rounding points peaked at 3.3 of the 6 over 3 x 23M elements."""
    from kiln.kernels.moe_gemm import grouped_swiglu, grouped_swiglu_op, grouped_swiglu_ref, swiglu_grad

    offs = _offsets(counts, x.device)
    xk, wk = x.clone().requires_grad_(), w.clone().requires_grad_()
    with use_backend("triton"):
        h, pre = grouped_swiglu_op(x, w, offs, True)
        hk = grouped_swiglu(xk, wk, offs)
        hk.backward(dh)
        dpre = swiglu_grad(dh, pre)
    assert torch.equal(hk.detach(), h)  # the autograd path launches the same forward
    x64, w64, dh64 = x.double(), w.double(), dh.double()
    assert_close(pre, grouped_linear_ref(x64, w64, offs), name="pre")
    g, u = pre.double().chunk(2, dim=-1)
    assert_close(h, F.silu(g) * u, name="h from pre")
    sig = torch.sigmoid(g)
    assert_close(dpre, torch.cat([dh64 * u * sig * (1 + g * (1 - sig)), dh64 * g * sig], 1), name="dpre")
    dp = dpre.double()
    assert_close(wk.grad, _dw_ref(dp, x64, counts), name="dw from dpre")
    assert_close(xk.grad, grouped_linear_ref(dp, w64.transpose(1, 2).contiguous(), offs), name="dx from dpre")

    # end to end against float64 that rounds nothing: h and dx as the bf16 table at scale 2 (silu of a
    # rounded product, and dx's reduction over 2I rounded products); dw with the bound above
    assert_close(h, grouped_swiglu_ref(x64, w64, offs), scale=2.0, name="h")
    g64, u64 = grouped_linear_ref(x64, w64, offs).chunk(2, dim=-1)
    sig64 = torch.sigmoid(g64)
    dp64 = torch.cat([dh64 * u64 * sig64 * (1 + g64 * (1 - sig64)), dh64 * g64 * sig64], 1)
    assert_close(
        xk.grad, grouped_linear_ref(dp64, w64.transpose(1, 2).contiguous(), offs), scale=2.0, name="dx"
    )
    dw64 = _dw_ref(dp64, x64, counts)
    spread = torch.stack(  # sqrt(sum_r (dpre[r, j] x[r, k])^2) per expert: (E, 2I, K)
        [_dw_ref(dp64[a:b] ** 2, x64[a:b] ** 2, [b - a])[0].sqrt() for a, b in _pairs(counts)]
    )
    unit = torch.finfo(x.dtype).eps / 2
    err = (wk.grad.double() - dw64).abs()
    bound = unit * dw64.abs() + 6 * unit * spread
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"dw: {int((err > bound).sum())} elements past u|dw| + 6u sqrt(sum (dpre x)^2); worst at "
        f"{tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), err.shape))}: error "
        f"{err.flatten()[worst]:.4g}, bound {bound.flatten()[worst]:.4g}"
    )


def _pairs(counts):
    bounds = _offsets(counts).tolist()
    return list(zip(bounds, bounds[1:]))


def test_grouped_swiglu_stages_fp16():
    # the GPU test's checks through the interpreter (fp16: its bf16 dot is wrong, PLATFORM.md); I = 40 and
    # K = 48 ragged against the 64-wide column and K tiles, empty experts, several 16-row tiles per expert
    g = torch.Generator().manual_seed(8)
    counts = [37, 0, 70, 5, 0]
    x = torch.randn(sum(counts), 48, generator=g).half()
    w = (torch.randn(len(counts), 2 * 40, 48, generator=g) / 48**0.5).half()
    dh = torch.randn(sum(counts), 40, generator=g).half()
    _swiglu_stages(x, w, counts, dh)


def test_swiglu_grad_rejects_unpaired_products():
    from kiln.kernels.moe_gemm import swiglu_grad

    with pytest.raises(ValueError, match="pre \\(R, 2I\\) and dh \\(R, I\\)"):
        swiglu_grad(torch.randn(4, 3), torch.randn(4, 7))  # an odd column count: no [gate | up] halves
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_grad(torch.randn(4, 3), torch.randn(4, 12)[:, ::2])
    with pytest.raises(ValueError, match="dh \\(5, 3\\)"):
        swiglu_grad(torch.randn(5, 3), torch.randn(4, 6))


def test_grouped_swiglu_gpu_tiles_float32(monkeypatch):
    # the H200's launch configs for the failing case (E = 8, 375 rows per expert: the fused forward's
    # 128x64x64 tiles, dw's 128x128x64) through the interpreter in float32: an expert over two 128-row
    # tiles and two 64-row dw steps, empty and 1-row experts, I = 100 not a multiple of the 64-wide
    # column tiles (its gate and up halves split at column 100 of dw's 128-wide tiles), K = 96 ragged
    from kiln.kernels import moe_gemm
    from kiln.kernels.moe_gemm import grouped_swiglu, grouped_swiglu_ref

    monkeypatch.setattr(moe_gemm, "mm_config", lambda *a, **k: (128, 64, 64, 8, 3))
    monkeypatch.setattr(moe_gemm, "dw_config", lambda *a, **k: (128, 128, 64, 8, 3))
    g = torch.Generator().manual_seed(9)
    counts = [131, 0, 1, 18]
    x = torch.randn(sum(counts), 96, generator=g)
    w = torch.randn(len(counts), 2 * 100, 96, generator=g) / 96**0.5
    offs = _offsets(counts)

    def op(x, w):
        with use_backend("triton"):
            return grouped_swiglu(x, w, offs)

    check_op(op, lambda x, w: grouped_swiglu_ref(x, w, offs), [x, w])


@pytest.mark.gpu
def test_grouped_swiglu_gpu_bf16():
    # the shape that failed on the H200 at 5dcf13e against an elementwise bound on dw (issue 19): bf16
    # rounding, not a kernel error (docs/perf/moe.md); each rounding point and the end to end bound
    g = torch.Generator(device="cuda").manual_seed(1)
    E, d, inter, rows = 8, 1024, 1408, 3000
    idx = torch.randint(0, E, (rows,), generator=g, device="cuda")
    counts = torch.bincount(idx, minlength=E).tolist()
    x = torch.randn(rows, d, generator=g, device="cuda").bfloat16()
    w = (torch.randn(E, 2 * inter, d, generator=g, device="cuda") / d**0.5).bfloat16()
    dh = torch.randn(rows, inter, generator=g, device="cuda").bfloat16()
    _swiglu_stages(x, w, counts, dh)
