"""Triton cross-entropy against the float64 reference: loss and dlogits, every reduction, ignore_index,
label smoothing, odd vocabulary sizes and strided logits."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.cross_entropy import cross_entropy, cross_entropy_ref
from kiln.kernels.dispatch import use_backend

from ._tolerance import assert_close

CASES = [
    # (N, V, dtype, ignore_index, label_smoothing, reduction)
    (1, 8, torch.float32, -100, 0.0, "mean"),
    (5, 123, torch.float32, -100, 0.1, "sum"),
    (7, 300, torch.float16, -1, 0.0, "none"),
    (6, 257, torch.bfloat16, -100, 0.25, "mean"),
    (16, 1000, torch.float32, -100, 0.0, "mean"),
]


def _targets(N: int, V: int, ignore_index: int, device, gen) -> torch.Tensor:
    t = torch.randint(0, V, (N,), generator=gen).to(device)
    if N > 2:
        t[1] = ignore_index  # at least one ignored token
    return t


def _check(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, eps: float, reduction: str):
    x = logits.detach().clone().requires_grad_()
    with use_backend("triton"):
        loss = cross_entropy(x, targets, ignore_index, eps, reduction)
    x64 = logits.detach().double().requires_grad_()
    want = cross_entropy_ref(x64, targets, ignore_index, eps, reduction).double()
    assert loss.dtype == torch.float32
    assert_close(loss, want, torch.float32, name="loss")
    g = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    (gx,) = torch.autograd.grad(loss, x, g.to(loss.device, torch.float32))
    (gw,) = torch.autograd.grad(want, x64, g.to(x64.device))
    assert gx.dtype == logits.dtype and gx.shape == logits.shape
    assert_close(gx, gw, logits.dtype, name="dlogits")


@pytest.mark.parametrize("N,V,dtype,ignore_index,eps,reduction", CASES)
def test_cross_entropy_matches_float64(N, V, dtype, ignore_index, eps, reduction, device):
    gen = torch.Generator().manual_seed(N * 1000 + V)
    logits = (torch.randn(N, V, generator=gen) * 3).to(device, dtype)
    _check(logits, _targets(N, V, ignore_index, device, gen), ignore_index, eps, reduction)


def test_cross_entropy_strided_logits_and_targets(device):
    """Logits as a column-strided view and as a transposed view, targets as a strided view: no copies."""
    gen = torch.Generator().manual_seed(0)
    big = torch.randn(9, 2 * 101, generator=gen).to(device)
    t = torch.randint(0, 101, (18,), generator=gen).to(device)[::2]
    _check(big[:, ::2], t, -100, 0.1, "mean")
    _check(torch.randn(101, 9, generator=gen).to(device).t(), t, -100, 0.0, "none")


def test_cross_entropy_masked_vocabulary_block(device):
    """A leading run of -inf logits (a masked or padded vocabulary) longer than one block."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 300, generator=gen).to(device)
    logits[:, :140] = float("-inf")
    t = torch.randint(140, 300, (4,), generator=gen).to(device)
    _check(logits, t, -100, 0.0, "mean")


def test_cross_entropy_all_ignored_is_nan_like_torch(device):
    logits = torch.randn(3, 10).to(device)
    t = torch.full((3,), -100, device=device)
    with use_backend("triton"):
        assert torch.isnan(cross_entropy(logits, t)).item()
        assert cross_entropy(logits, t, reduction="sum").item() == 0.0


def test_cross_entropy_bad_input_errors(device):
    with use_backend("triton"):
        with pytest.raises(ValueError, match="flatten"):
            cross_entropy(
                torch.randn(2, 3, 5, device=device), torch.zeros(2, 3, dtype=torch.long, device=device)
            )
        with pytest.raises(TypeError, match="class indices"):
            cross_entropy(torch.randn(2, 5, device=device), torch.zeros(2, device=device))
        with pytest.raises(ValueError, match="reduction"):
            cross_entropy(torch.randn(2, 5, device=device), torch.zeros(2, dtype=torch.long, device=device),
                          reduction="avg")  # fmt: skip


@pytest.mark.gpu
def test_cross_entropy_llm_vocab_bf16():
    """The benchmark shape, scaled down in tokens: 151936-wide rows in bf16 on the H200."""
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 151936, generator=gen) * 2).to("cuda", torch.bfloat16)
    t = torch.randint(0, 151936, (64,), generator=gen).cuda()
    t[5] = -100
    _check(logits, t, -100, 0.0, "mean")
    _check(logits, t, -100, 0.1, "none")
