"""Fused RoPE + paged K/V write against its reference (apply_rope then paged_kv_write) in float64: both pair
layouts, odd head counts and head dims, q/k/v as strided views of one fused qkv row, table rows in any
order, padding slots (-1) writing nothing, and every other cache slot left as it was."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.rope import rope_kv_write, rope_kv_write_ref

from ._tolerance import assert_close


def _inputs(N, Hq, Hk, D, page, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(N, (Hq + 2 * Hk) * D, generator=g).to(device, dtype)  # the projection's output
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(N, Hq, D), k.view(N, Hk, D), v.view(N, Hk, D)  # strided views, D contiguous
    R = N + 3
    ang = torch.rand(R, D // 2, generator=g, dtype=torch.float64) * 6.3
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    rows = torch.randperm(R, generator=g)[:N].to(device)
    blocks = N + 2
    k_cache = torch.randn(blocks, page, Hk, D, generator=g).to(device, dtype)
    v_cache = torch.randn(blocks, page, Hk, D, generator=g).to(device, dtype)
    slots = torch.randperm(blocks * page, generator=g)[:N].to(device)
    slots[N // 2] = -1  # a padding row
    return q, k, v, cos, sin, rows, k_cache, v_cache, slots


def _check(N, Hq, Hk, D, page, dtype, interleaved, device, seed):
    q, k, v, cos, sin, rows, kc, vc, slots = _inputs(N, Hq, Hk, D, page, dtype, device, seed)
    want_kc, want_vc = kc.cpu().double(), vc.cpu().double()
    want_q = rope_kv_write_ref(
        *(t.cpu().double() for t in (q, k, v)), cos.cpu().double(), sin.cpu().double(), rows.cpu(),
        want_kc, want_vc, slots.cpu(), interleaved,
    )  # fmt: skip
    before_kc, before_vc = kc.clone(), vc.clone()
    with use_backend("triton"):
        got_q = rope_kv_write(q, k, v, cos, sin, rows, kc, vc, slots, interleaved=interleaved)
    assert got_q.shape == (N, Hq, D) and got_q.is_contiguous() and got_q.dtype == dtype
    assert_close(got_q, want_q, name="q")
    assert_close(kc, want_kc, name="k cache")
    assert_close(vc, want_vc, name="v cache")
    written = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    flat = lambda c: c.view(-1, *c.shape[2:]).cpu()  # noqa: E731
    assert torch.equal(flat(kc)[~written], flat(before_kc)[~written]), "a slot not written changed"
    assert torch.equal(flat(vc)[~written], flat(before_vc)[~written])
    keep = slots >= 0
    assert torch.equal(flat(vc)[slots[keep].cpu()], v[keep].cpu()), "v is copied exactly"


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize(
    "N,Hq,Hk,D,page,dtype",
    [
        (1, 2, 1, 8, 16, torch.float32),
        (5, 12, 2, 128, 16, torch.bfloat16),  # Qwen2.5-1.5B heads
        (7, 6, 3, 12, 4, torch.float16),  # odd heads, D/2 = 6 (a ragged tile)
        (3, 5, 5, 20, 8, torch.float32),
    ],
)
def test_rope_kv_write_matches_reference(N, Hq, Hk, D, page, dtype, interleaved, device):
    _check(N, Hq, Hk, D, page, dtype, interleaved, device, seed=N * D + Hq)


def test_rope_kv_write_equals_the_two_ops_it_replaces(device):
    # Same bits as apply_rope + paged_kv_write through kiln's own kernels (float32: one rounding each).
    from kiln.kernels.paged_kv import paged_kv_write
    from kiln.kernels.rope import apply_rope

    q, k, v, cos, sin, rows, kc, vc, slots = _inputs(6, 4, 2, 16, 8, torch.float32, device, seed=1)
    kc2, vc2 = kc.clone(), vc.clone()
    with use_backend("triton"):
        got = rope_kv_write(q, k, v, cos, sin, rows, kc, vc, slots)
        q2, k2 = apply_rope(q[None], k[None], cos, sin, rows[None])
        paged_kv_write(kc2, vc2, k2[0], v, slots)
    torch.testing.assert_close(got, q2[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(kc, kc2, rtol=0, atol=1e-6)
    assert torch.equal(vc, vc2)


def test_rope_kv_write_bad_inputs(device):
    q, k, v, cos, sin, rows, kc, vc, slots = _inputs(3, 4, 2, 16, 8, torch.float32, device, seed=2)
    with pytest.raises(ValueError, match="rows must be integer"):
        rope_kv_write(q, k, v, cos, sin, rows[:2], kc, vc, slots)
    with pytest.raises(ValueError, match="caches must be"):
        rope_kv_write(q, k, v, cos, sin, rows, kc[..., :8], vc[..., :8], slots)
    with pytest.raises(ValueError, match="cos and sin"):
        rope_kv_write(q, k, v, cos[:, :4], sin[:, :4], rows, kc, vc, slots)
    with pytest.raises(TypeError, match="share a float dtype"):
        rope_kv_write(q, k.half(), v, cos, sin, rows, kc, vc, slots)
    with pytest.raises(ValueError, match="slots must be"):
        rope_kv_write(q, k, v, cos, sin, rows, kc, vc, slots.float())


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_rope_kv_write_early_loads_are_the_same_bits(interleaved, device):
    # early: the table rows, cos / sin and slots read before the programmatic-launch wait; the same loads
    # and math, so the same q and caches
    from kiln.kernels.rope import rope_kv_write_triton

    got = []
    for early in (False, True):
        q, k, v, cos, sin, rows, kc, vc, slots = _inputs(5, 6, 2, 16, 4, torch.float32, device, seed=9)
        got.append((rope_kv_write_triton(q, k, v, cos, sin, rows, kc, vc, slots, interleaved, early), kc, vc))
    for a, b in zip(*got):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("N,Hq,Hk,D", [(1, 12, 2, 128), (64, 12, 2, 128), (33, 16, 8, 128), (9, 32, 8, 64)])
def test_gpu_bf16_rope_kv_write(N, Hq, Hk, D, interleaved):
    _check(N, Hq, Hk, D, 16, torch.bfloat16, interleaved, "cuda", seed=N + Hq)
