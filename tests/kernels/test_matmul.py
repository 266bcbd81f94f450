"""Triton matmul with fused epilogues against float64: output and dA, dB, dbias, every activation,
row-major and transposed operands (nn.Linear weights), TMA-aligned and unaligned (block pointer) shapes."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.matmul import linear, matmul, matmul_fwd, matmul_ref, tile_config

from ._tolerance import assert_close

CASES = [
    # (M, K, N, dtype, bias, activation, a_transposed, b_transposed)
    (1, 16, 8, torch.float32, False, "none", False, False),
    (37, 29, 45, torch.float32, True, "gelu", False, False),  # strides not 16-byte aligned: block pointers
    (64, 96, 80, torch.float16, True, "silu", False, False),  # aligned: tensor descriptors
    (33, 64, 48, torch.float16, False, "gelu_tanh", True, False),  # A column-major
    (40, 32, 72, torch.float32, True, "relu", False, True),  # B = W.T, the nn.Linear layout
    (16, 48, 32, torch.float16, True, "none", True, True),
]


def _operand(rows, cols, transposed, dtype, device, gen):
    if transposed:  # a (rows, cols) view of a (cols, rows) tensor
        return torch.randn(cols, rows, generator=gen).to(device, dtype).t()
    return torch.randn(rows, cols, generator=gen).to(device, dtype)


@pytest.mark.parametrize("M,K,N,dtype,has_bias,activation,a_t,b_t", CASES)
def test_matmul_matches_float64(M, K, N, dtype, has_bias, activation, a_t, b_t, device):
    gen = torch.Generator().manual_seed(M * K + N)
    a = _operand(M, K, a_t, dtype, device, gen)
    b = _operand(K, N, b_t, dtype, device, gen) / K**0.5
    bias = torch.randn(N, generator=gen).to(device, dtype) if has_bias else None
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (a, b, bias)]
    with use_backend("triton"):
        c = matmul(leaves[0], leaves[1], leaves[2], activation)
    ref = [t.detach().double().requires_grad_() if t is not None else None for t in (a, b, bias)]
    want = matmul_ref(ref[0], ref[1], ref[2], activation)
    assert c.dtype == dtype and c.shape == (M, N)
    assert_close(c, want, name="C")
    g = torch.randn(M, N, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(c, [t for t in leaves if t is not None], g.to(device, dtype))
    exp = torch.autograd.grad(want, [t for t in ref if t is not None], g.to(device))
    for name, x, y in zip(("dA", "dB", "dbias"), got, exp):
        # With an activation, dpre = dC * act'(pre) is rounded to fp16 before the backward GEMMs (as torch's
        # own fp16 autograd does); dA/dB/dbias sum n such terms of size ~1, each off by up to an fp16 ulp,
        # while the sums themselves can be much smaller: the bound grows like sqrt(n) (random walk).
        n = {"dA": N, "dB": M, "dbias": M}[name]
        assert_close(x, y, scale=n**0.5 if dtype == torch.float16 else 1.0, name=name)


def test_linear_reads_weight_in_place_and_keeps_leading_dims(device):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 5, 32, generator=gen).to(device, torch.float16)
    w = (torch.randn(24, 32, generator=gen) / 6).to(device, torch.float16)
    bias = torch.randn(24, generator=gen).to(device, torch.float16)
    with use_backend("triton"):
        y = linear(x, w, bias, "silu")
    want = matmul_ref(x.double().reshape(10, 32), w.double().t(), bias.double(), "silu").reshape(2, 5, 24)
    assert_close(y, want, name="linear")


def test_matmul_strided_slices(device):
    """Operands with no unit stride at all (every other element) go through block pointers."""
    gen = torch.Generator().manual_seed(8)
    a = torch.randn(20, 2 * 24, generator=gen).to(device)[:, ::2]
    b = torch.randn(2 * 24, 18, generator=gen).to(device)[::2]
    with use_backend("triton"):
        c = matmul(a, b)
    assert_close(c, matmul_ref(a.double(), b.double()), name="C")


@pytest.mark.parametrize(
    "persistent,flatten,epi_split", [(False, False, 1), (True, False, 1), (True, True, 1), (True, True, 2)]
)
def test_matmul_explicit_configs(persistent, flatten, epi_split, device):
    """The non-autotuned path the benchmark sweeps: one tile per program, or 4 programs looping over 12
    (with flatten, the tile loop and the K loop pipelined as one; with epi_split 2, C stored in halves)."""
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(64, 48, generator=gen).to(device, torch.float16)
    w = torch.randn(96, 48, generator=gen).to(device, torch.float16)
    bias = torch.randn(96, generator=gen).to(device, torch.float16)
    cfg = tile_config(16, 32, 16, 2, 4, 2, persistent=persistent, flatten=flatten, epi_split=epi_split)
    with use_backend("triton"):
        for tma in (True, False):
            c, _ = matmul_fwd(a, w.t(), bias, "gelu", config=cfg, tma=tma)
            assert_close(
                c, matmul_ref(a.double(), w.double().t(), bias.double(), "gelu"), name=f"C tma={tma}"
            )


@pytest.mark.parametrize("tma", [True, False])
def test_matmul_accumulate_and_row_stats(tma, device):
    """The epilogues the fused linear cross-entropy uses: C += A @ B, and per-tile row max / sum exp / sum
    of the rounded output, both through descriptors and block pointers."""
    import triton

    gen = torch.Generator().manual_seed(10)
    M, K, N, BN = 40, 32, 80, 32  # N not a multiple of BLOCK_N: a ragged last tile in the stats
    a = torch.randn(M, K, generator=gen).to(device, torch.float16)
    w = torch.randn(N, K, generator=gen).to(device, torch.float16)
    c0 = torch.randn(M, N, generator=gen).to(device, torch.float16)
    cfg = tile_config(16, BN, 16, 2, 4, 2, persistent=True)
    with use_backend("triton"):
        c, _ = matmul_fwd(a, w.t(), out=c0.clone(), accumulate=True, config=cfg, tma=tma)
        assert_close(c, c0.double() + a.double() @ w.double().t(), name="C += A @ B")
        stats = torch.empty(3, M, triton.cdiv(N, BN), device=device)
        c, _ = matmul_fwd(a, w.t(), row_stats=stats, config=cfg, tma=tma)
    v = torch.nn.functional.pad(c.double(), (0, 3 * BN - N), value=float("-inf")).view(M, 3, BN)
    t_max = v.amax(-1)
    assert_close(stats[0], t_max, torch.float32, name="tile max")
    assert_close(stats[1], (v - t_max[..., None]).exp().sum(-1), torch.float32, name="tile sum exp")
    assert_close(stats[2], v.nan_to_num(neginf=0.0).sum(-1), torch.float32, name="tile sum")


@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("M,K,N,split", [(1, 96, 40, 3), (5, 64, 48, 4), (16, 200, 24, 2)])
def test_matmul_split_k(M, K, N, split, tma, device):
    """Decode-sized GEMMs with K split over several programs (the last one applies bias and activation),
    called twice to check the kernel leaves its workspace zeroed."""
    gen = torch.Generator().manual_seed(M + K)
    a = torch.randn(M, K, generator=gen).to(device, torch.float16)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device, torch.float16)
    bias = torch.randn(N, generator=gen).to(device, torch.float16)
    want = matmul_ref(a.double(), w.double().t(), bias.double(), "silu")
    with use_backend("triton"):
        for _ in range(2):
            cfg = tile_config(16, 16, 16, 2, 4, 1, split_k=split)
            c, _ = matmul_fwd(a, w.t(), bias, "silu", config=cfg, tma=tma)
            assert_close(c, want, name="split-K C")


def test_matmul_bad_input_errors(device):
    with use_backend("triton"):
        with pytest.raises(ValueError, match="activation"):
            matmul(torch.randn(4, 4, device=device), torch.randn(4, 4, device=device), activation="tanh")
        with pytest.raises(ValueError, match=r"\(M, K\)"):
            matmul(torch.randn(4, 5, device=device), torch.randn(4, 4, device=device))
        with pytest.raises(TypeError, match="one dtype"):
            matmul(torch.randn(4, 4, device=device), torch.randn(4, 4, device=device).half())


def test_matmul_plans_follow_alignment_and_keep_their_checks(device):
    """matmul_fwd plans each layout of arguments once: a view of the same shape and strides at an address
    that is not 16-byte aligned must get its own plan (block pointers, not TMA), and a bad call after good
    ones still gets its error."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(40 * 64 + 8, generator=gen).to(device, torch.float16)
    b = (torch.randn(64, 48, generator=gen) / 8).to(device, torch.float16)
    with use_backend("triton"):
        for off in (0, 1, 0, 1):  # aligned, misaligned, and each again (the memoized plans)
            a = base[off : off + 40 * 64].view(40, 64)
            c, _ = matmul_fwd(a, b, activation="silu")
            assert_close(c, matmul_ref(a.double(), b.double(), None, "silu"), name=f"C at offset {off}")
        with pytest.raises(ValueError, match=r"\(M, K\)"):
            matmul_fwd(a, b[:5])
        with pytest.raises(ValueError, match="bias"):
            matmul_fwd(a, b, torch.zeros(47, device=device, dtype=torch.float16))


QWEN_SHAPES = [(8192, 1536, 2048), (8192, 1536, 1536), (1, 1536, 17920), (16, 8960, 1536), (4096, 4096, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", QWEN_SHAPES)
def test_matmul_bf16_llm_shapes(M, K, N):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to("cuda", torch.bfloat16)
    bias = torch.randn(N, generator=gen).to("cuda", torch.bfloat16)
    for _ in range(2):  # the second call takes the plan's bound launch: new data, same layout
        y = linear(x, w, bias, "silu")
        assert_close(y, matmul_ref(x.double(), w.double().t(), bias.double(), "silu"), name="linear bf16")
        x = torch.randn(M, K, generator=gen).to("cuda", torch.bfloat16)
    # and the backward's layouts (A column-major, B row-major) at the same size
    y = matmul(x.t().contiguous().t(), w.t().contiguous())
    assert_close(y, matmul_ref(x.double(), w.double().t()), name="matmul bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("M", [512, 4096])
def test_linear_backward_bf16(M):
    """dx, dW, dbias of silu(x @ W.T + b) in bf16 at prefill-like sizes, against float64: 512 tokens go
    through the autotuner, 4096 fill the GPU with persistent 128x256 tiles (the forward storing the
    pre-activation, the backward's transposed operands)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(M, 1536, generator=gen).to("cuda", torch.bfloat16)
    w = (torch.randn(2048, 1536, generator=gen) / 1536**0.5).to("cuda", torch.bfloat16)
    b = torch.randn(2048, generator=gen).to("cuda", torch.bfloat16)
    g = torch.randn(M, 2048, generator=gen).to("cuda", torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    got = torch.autograd.grad(linear(*leaves, "silu"), leaves, g)
    ref = [t.double().requires_grad_() for t in (x, w, b)]
    want = torch.autograd.grad(matmul_ref(ref[0], ref[1].t(), ref[2], "silu"), ref, g.double())
    for name, a, r in zip(("dx", "dW", "dbias"), got, want):
        # sums over 512-4096 terms of bf16-rounded dpre: compare relative to the largest entry
        top = r.abs().max()
        assert_close(a.double() / top, r / top, torch.bfloat16, name=name)
