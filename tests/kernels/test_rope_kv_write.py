"""Fused RoPE + paged K/V write against its reference (apply_rope then paged_kv_write) in float64: both pair
layouts, odd head counts and head dims, q/k/v as strided views of one fused qkv row, table rows in any
order, padding slots (-1) writing nothing, and every other cache slot left as it was."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.rope import rope_kv_write, rope_kv_write_ref, rope_kv_write_split, rope_kv_write_split_ref

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


# ----------------------------------------------------------------------------------- rope_kv_write_split
def _split_inputs(N, Hq, Hk, D, S, dtype, device, seed, bias=True):
    """A q/k/v projection's split-K partials (S, N, (Hq + 2 Hk) D) float32 as decode_matmul leaves them with
    defer_sum, and everything rope_kv_write takes besides q, k, v."""
    from kiln.kernels.matmul_decode import DecodeConfig, decode_matmul

    g = torch.Generator().manual_seed(seed)
    K = 96
    x = torch.randn(N, K, generator=g).to(device, dtype)
    w = (torch.randn((Hq + 2 * Hk) * D, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn((Hq + 2 * Hk) * D, generator=g).to(device, dtype) if bias else None
    config = DecodeConfig("dot", 16, 32, S)
    with use_backend("triton"):
        partials = decode_matmul(x, w.t(), config=config, defer_sum=True)
        qkv = decode_matmul(x, w.t(), b, config=config)  # the sum kernel: what the separate path stores
    _, _, _, cos, sin, rows, kc, vc, slots = _inputs(N, Hq, Hk, D, 4, dtype, device, seed + 1)
    return partials, b, qkv, cos, sin, rows, kc, vc, slots


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_split_equals_sum_kernel_then_rope_kv_write(interleaved, dtype, bias, device):
    # the kernel adds the projection's float32 slices in the sum kernel's order, then the bias, and rounds as
    # it does: q and the caches are the bits of decode_matmul's sum kernel followed by rope_kv_write (fp16 /
    # fp32: the interpreter's bf16 tl.dot is broken, PLATFORM.md)
    N, Hq, Hk, D = 5, 3, 1, 16
    partials, b, qkv, cos, sin, rows, kc, vc, slots = _split_inputs(N, Hq, Hk, D, 3, dtype, device, 7, bias)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    want_kc, want_vc = kc.clone(), vc.clone()
    with use_backend("triton"):
        want_q = rope_kv_write(q.view(N, Hq, D), k.view(N, Hk, D), v.view(N, Hk, D), cos, sin, rows, want_kc,
                               want_vc, slots, interleaved=interleaved)  # fmt: skip
        got_q = rope_kv_write_split(partials, b, Hq, cos, sin, rows, kc, vc, slots, interleaved=interleaved)
    assert got_q.shape == (N, Hq, D) and got_q.dtype == dtype
    assert torch.equal(got_q, want_q) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    # and its reference is the same sequence in torch
    ref_kc, ref_vc = kc.clone().fill_(0), vc.clone().fill_(0)
    kc.fill_(0), vc.fill_(0)
    with use_backend("triton"):
        rope_kv_write_split(partials, b, Hq, cos, sin, rows, kc, vc, slots, interleaved=interleaved)
    ref_q = rope_kv_write_split_ref(partials, b, Hq, cos, sin, rows, ref_kc, ref_vc, slots, interleaved)
    assert_close(got_q, ref_q, name="q vs reference")
    assert_close(kc, ref_kc, name="k cache vs reference")
    assert torch.equal(vc, ref_vc)


def test_split_clear_errors(device):
    partials, b, _, cos, sin, rows, kc, vc, slots = _split_inputs(3, 2, 1, 16, 2, torch.float32, device, 3)
    with pytest.raises(ValueError, match=r"rope_kv_write_split: partials must be float32 \(S, N, 64\)"):
        rope_kv_write_split(partials[..., :60], b, 2, cos, sin, rows, kc, vc, slots)
    with pytest.raises(ValueError, match=r"rope_kv_write_split: bias must be \(64,\)"):
        rope_kv_write_split(partials, b[:5], 2, cos, sin, rows, kc, vc, slots)
    with pytest.raises(ValueError, match="one slot and one table row per token"):
        rope_kv_write_split(partials, b, 2, cos, sin, rows, kc, vc, slots[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 64])
def test_split_bf16_qwen_shape_eager_and_in_a_graph(M):
    """Qwen2.5-1.5B's q/k/v (1536 -> 12 + 2 + 2 heads of 128, bias) at the rule's split config (the wide tiles'
    4-way split at 64 rows; at 4 rows the 16-wide tile splits nothing: a forced 2-way split), bf16: q and the
    caches the bits of the sum kernel + rope_kv_write, eagerly and replayed from a CUDA graph."""
    from kiln.kernels.dispatch import sm_count
    from kiln.kernels.matmul_decode import DecodeConfig, decode_config, decode_matmul

    Hq, Hk, D, K = 12, 2, 128, 1536
    config = decode_config(M, (Hq + 2 * Hk) * D, K, sm_count(torch.device("cuda")))
    if config.split_k == 1:
        config = DecodeConfig("dot", 16, 128, 2, 4, 3, True)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=g).cuda().bfloat16()
    w = (torch.randn((Hq + 2 * Hk) * D, K, generator=g) / K**0.5).cuda().bfloat16()
    b = torch.randn((Hq + 2 * Hk) * D, generator=g).cuda().bfloat16()
    _, _, _, cos, sin, rows, kc, vc, slots = _inputs(M, Hq, Hk, D, 16, torch.bfloat16, "cuda", M + 1)

    def separate(kc, vc):
        q, k, v = decode_matmul(x, w.t(), b, config=config).split([Hq * D, Hk * D, Hk * D], dim=-1)
        return rope_kv_write(
            q.view(M, Hq, D), k.view(M, Hk, D), v.view(M, Hk, D), cos, sin, rows, kc, vc, slots
        )

    def fused(kc, vc):
        p = decode_matmul(x, w.t(), config=config, defer_sum=True)
        return rope_kv_write_split(p, b, Hq, cos, sin, rows, kc, vc, slots)

    with use_backend("triton"):
        want_kc, want_vc = kc.clone(), vc.clone()
        want_q = separate(want_kc, want_vc)
        got_q = fused(kc, vc)
        assert torch.equal(got_q, want_q) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gq = fused(kc, vc)
        x.copy_(torch.randn_like(x))
        want_q = separate(want_kc, want_vc)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(gq, want_q) and torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
