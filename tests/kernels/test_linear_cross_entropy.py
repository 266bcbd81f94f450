"""Fused linear + cross-entropy against the float64 reference: loss and the gradients of hidden, weight
and bias, over several token chunks (a tiny chunk budget forces many), every reduction."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.linear_cross_entropy import (
    PLAN,
    Plan,
    chunk_bounds,
    linear_cross_entropy,
    linear_cross_entropy_ref,
    split_rows,
)

from ._tolerance import assert_close

CASES = [
    # (N, H, V, dtype, bias, ignore_index, label_smoothing, reduction)
    (1, 8, 16, torch.float32, False, -100, 0.0, "mean"),
    (13, 24, 77, torch.float32, True, -100, 0.1, "mean"),
    (10, 16, 130, torch.float16, False, -1, 0.0, "sum"),
    (9, 32, 50, torch.float32, True, -100, 0.2, "none"),
]


def _run(hidden, weight, targets, bias, ignore_index, eps, reduction, dtype, plan=PLAN):
    leaves = [hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_())
    with use_backend("triton"):
        loss = linear_cross_entropy(leaves[0], leaves[1], targets, leaves[2] if bias is not None else None,
                                    ignore_index, eps, reduction, plan)  # fmt: skip
    ref = [
        t.detach().double().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())
    ]
    want = linear_cross_entropy_ref(ref[0], ref[1], targets, ref[2] if bias is not None else None,
                                    ignore_index, eps, reduction)  # fmt: skip
    # The reference sees the same bf16/fp16 inputs; the kernel rounds the logits and dlogits to the input
    # dtype between GEMMs (as any fused CE does): low-precision results get the bound of that dtype.
    assert_close(loss, want, torch.float32 if dtype == torch.float32 else dtype, name="loss")
    g = torch.rand(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 0.5
    got_grads = torch.autograd.grad(loss, leaves, g.to(loss.device, torch.float32))
    want_grads = torch.autograd.grad(want, ref, g.to(want.device))
    for name, a, b in zip(("dhidden", "dweight", "dbias"), got_grads, want_grads):
        assert a.dtype == dtype
        assert_close(a, b, dtype, name=name)


# "kiln": logits with fused row statistics and dweight accumulated by kiln's matmul; "cublas": torch.matmul.
# overlap 2: each chunk in two parts (on a GPU their loss kernels run on a second stream). one_pass: the loss
# kernel writes exp(z - m) and a row factor instead of dloss/dz (float16 falls back to two passes).
PLANS = [("cublas", 1, False), ("kiln", 1, False), ("cublas", 2, False), ("kiln", 3, False),
         ("cublas", 1, True), ("cublas", 2, True)]  # fmt: skip


@pytest.mark.parametrize("gemms,overlap,one_pass", PLANS)
@pytest.mark.parametrize("N,H,V,dtype,has_bias,ignore_index,eps,reduction", CASES)
def test_linear_cross_entropy_matches_float64(N, H, V, dtype, has_bias, ignore_index, eps, reduction, gemms,
                                              overlap, one_pass, device):  # fmt: skip
    # A budget of 4 rows of logits per chunk, so every case runs several chunks and a ragged last one.
    plan = Plan(chunk_bytes=4 * V * torch.finfo(dtype).bits // 8, logits_gemm=gemms, dweight_gemm=gemms,
                overlap=overlap, one_pass=one_pass)  # fmt: skip
    gen = torch.Generator().manual_seed(N + H + V)
    hidden = torch.randn(N, H, generator=gen).to(device, dtype)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(device, dtype)
    bias = torch.randn(V, generator=gen).to(device, dtype) if has_bias else None
    targets = torch.randint(0, V, (N,), generator=gen).to(device)
    if N > 2:
        targets[2] = ignore_index
    _run(hidden, weight, targets, bias, ignore_index, eps, reduction, dtype, plan)


BF16_CASES = [
    # bf16 through torch.matmul (the interpreter's bf16 tl.dot is broken, so no kiln GEMMs here)
    (12, 32, 200, True, -100, 0.0, "mean"),
    (9, 16, 130, False, -100, 0.1, "none"),
    (7, 24, 77, True, 3, 0.2, "sum"),
]


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("N,H,V,has_bias,ignore_index,eps,reduction", BF16_CASES)
def test_linear_cross_entropy_bf16_matches_float64(N, H, V, has_bias, ignore_index, eps, reduction, one_pass,
                                                   device):  # fmt: skip
    dtype = torch.bfloat16
    plan = Plan(chunk_bytes=4 * V * 2, one_pass=one_pass)
    gen = torch.Generator().manual_seed(N * H + V)
    hidden = torch.randn(N, H, generator=gen).to(device, dtype)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(device, dtype)
    bias = torch.randn(V, generator=gen).to(device, dtype) if has_bias else None
    targets = torch.randint(0, V, (N,), generator=gen).to(device)
    targets[1] = ignore_index
    _run(hidden, weight, targets, bias, ignore_index, eps, reduction, dtype, plan)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_one_pass_moves_its_reference_up(eps, device):
    """Logits that jump far above the first block and the target (a bias of +30, +60, +95 late in the
    vocabulary) make the one-pass kernel move its reference and rescale what it has written, up to three
    times in a row; the result is the float64 reference's."""
    gen = torch.Generator().manual_seed(11)
    N, H, V = 6, 16, 260  # 64-wide steps in the interpreter: 5 blocks per row
    hidden = torch.randn(N, H, generator=gen).to(device)
    weight = (torch.randn(V, H, generator=gen) / H**0.5).to(device)
    bias = torch.zeros(V)
    bias[[70, 150, 250]] = torch.tensor([30.0, 60.0, 95.0])
    targets = torch.tensor([0, 5, 70, 150, 250, 10]).to(device)
    _run(hidden, weight, targets, bias.to(device), -100, eps, "mean", torch.float32,
         Plan(chunk_bytes=4 * V * 4, one_pass=True))  # fmt: skip


def test_linear_cross_entropy_fewer_programs_than_rows(device):
    """The row-striding grid (Plan.row_programs, an L2 tuning knob) computes the same thing."""
    gen = torch.Generator().manual_seed(5)
    hidden, weight = (
        torch.randn(11, 16, generator=gen).to(device),
        torch.randn(40, 16, generator=gen).to(device),
    )
    targets = torch.randint(0, 40, (11,), generator=gen).to(device)
    _run(hidden, weight, targets, None, -100, 0.1, "mean", torch.float32, Plan(8 * 40 * 4, row_programs=3))


def test_linear_cross_entropy_strided_inputs(device):
    """hidden as a transposed view, weight as a column slice of a wider matrix."""
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(16, 11, generator=gen).to(device).t()
    weight = torch.randn(40, 32, generator=gen).to(device)[:, 3:19]
    targets = torch.randint(0, 40, (11,), generator=gen).to(device)
    _run(hidden, weight, targets, None, -100, 0.0, "mean", torch.float32)


def test_linear_cross_entropy_second_backward_is_an_error(device):
    h = torch.randn(4, 8, device=device, requires_grad=True)
    w = torch.randn(10, 8, device=device, requires_grad=True)
    with use_backend("triton"):
        loss = linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long, device=device))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


def test_linear_cross_entropy_bad_input_errors(device):
    with use_backend("triton"):
        with pytest.raises(ValueError, match="weight"):
            linear_cross_entropy(torch.randn(4, 8, device=device), torch.randn(10, 7, device=device),
                                 torch.zeros(4, dtype=torch.long, device=device))  # fmt: skip
        with pytest.raises(TypeError, match="cast"):
            linear_cross_entropy(torch.randn(4, 8, device=device), torch.randn(10, 8, device=device).half(),
                                 torch.zeros(4, dtype=torch.long, device=device))  # fmt: skip


def test_chunk_bounds_split_evenly_in_whole_tiles():
    # 8192 x 151936 bf16 logits under 480 MiB a chunk: 5 chunks of 13, 13, 13, 13 and 12 tiles of 128 rows.
    assert chunk_bounds(8192, 151936, 2, 480 * 2**20) == [(0, 1664), (1664, 3328), (3328, 4992),
                                                          (4992, 6656), (6656, 8192)]  # fmt: skip
    assert split_rows(100, 110, 3) == [(100, 104), (104, 107), (107, 110)]  # under 128 rows a part: rows
    assert split_rows(0, 300, 2) == [(0, 256), (256, 300)]  # 3 tiles of 128: 2 + 1
    assert split_rows(0, 5, 8) == [(i, i + 1) for i in range(5)]
    assert split_rows(3, 3, 2) == []


def test_plan_rejects_bad_values():
    with pytest.raises(ValueError, match="logits_gemm"):
        Plan(logits_gemm="cutlass")
    with pytest.raises(ValueError, match="positive"):
        Plan(overlap=0)
    with pytest.raises(ValueError, match="power of two"):
        Plan(row_block=3000)
    with pytest.raises(ValueError, match="one_pass"):
        Plan(logits_gemm="kiln")  # one_pass (the default) needs cuBLAS logits


@pytest.mark.parametrize("g", [1.0, 2.5])
def test_scale_in_place(g, device):
    """The backward's in-place scaling by the incoming gradient, which leaves the tensor alone when g == 1."""
    from kiln.kernels.linear_cross_entropy import scale_

    x = torch.randn(1000, device=device, dtype=torch.float16)
    want = (x.double() * g).to(torch.float16)
    with use_backend("triton"):
        scale_(x, torch.tensor(g, device=device))
    assert torch.equal(x, want)


def test_linear_cross_entropy_unit_incoming_gradient(device):
    """loss.backward() (incoming gradient exactly 1: the scaling kernel does nothing) gives the reference's."""
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(12, 16, generator=gen).to(device).requires_grad_()
    weight = torch.randn(40, 16, generator=gen).to(device).requires_grad_()
    targets = torch.randint(0, 40, (12,), generator=gen).to(device)
    with use_backend("triton"):
        linear_cross_entropy(hidden, weight, targets, plan=Plan(4 * 40 * 4)).backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    linear_cross_entropy_ref(h64, w64, targets).backward()
    assert_close(hidden.grad, h64.grad, torch.float32, name="dhidden")
    assert_close(weight.grad, w64.grad, torch.float32, name="dweight")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "plan",
    [
        Plan(256 * 151936 * 2, logits_gemm=lg, dweight_gemm=dg, one_pass=False)
        for lg in ("kiln", "cublas")
        for dg in ("kiln", "cublas")
    ]
    + [
        Plan(256 * 151936 * 2, overlap=2, one_pass=False),
        Plan(256 * 151936 * 2, overlap=2, gemm_priority=True, one_pass=False),
        Plan(256 * 151936 * 2, row_programs=132, row_block=16384, row_warps=16, one_pass=False),
        Plan(256 * 151936 * 2, one_pass=True),
        Plan(256 * 151936 * 2, one_pass=True, overlap=2),
    ],
    ids=[
        "kiln-kiln",
        "kiln-cublas",
        "cublas-kiln",
        "cublas-cublas",
        "overlap2",
        "overlap2-priority",
        "rows-132x16384",
        "one-pass",
        "one-pass-overlap2",
    ],
)
def test_linear_cross_entropy_bf16_qwen_head(plan):
    """The Qwen2.5 head (1536 -> 151936) in bf16 on 512 tokens, two chunks."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(512, 1536, generator=gen).to("cuda", torch.bfloat16)
    weight = (torch.randn(151936, 1536, generator=gen) * 0.02).to("cuda", torch.bfloat16)
    targets = torch.randint(0, 151936, (512,), generator=gen).cuda()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = linear_cross_entropy(h, w, targets, plan=plan)
    loss.backward()
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    want = linear_cross_entropy_ref(h64, w64, targets)
    want.backward()
    assert_close(loss, want, torch.bfloat16, name="loss")
    # The gradients are tiny (mean over 512 tokens of dlogits ~ 1/V): compare them relative to their largest
    # entry, or the table's absolute bound would pass anything.
    for name, got, ref in (("dhidden", h.grad, h64.grad), ("dweight", w.grad, w64.grad)):
        top = ref.abs().max()
        assert_close(got.double() / top, ref / top, torch.bfloat16, name=name)
