"""The one-token q/k/v projection with RoPE and the paged K/V write in its epilogue (kiln.kernels.rope.qkv_rope):
against float64 (the projection, then rope_kv_write's reference), both pair layouts, with and without bias,
a K longer than one step and ragged against it, odd head counts; bit-equal to the two kernels it replaces
(the one-row decode gemv at the same tiles, then rope_kv_write); a padding slot writes nothing; the shapes
it does not take are refused; with its W slice loaded before the wait (the default where the gemv preloads),
bit-equal to the preloading gemv and rope_kv_write."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels.dispatch import sm_count, use_backend
from kiln.kernels.matmul_decode import DecodeConfig, decode_config, decode_matmul
from kiln.kernels.rope import (
    QKV_BLOCK_K,
    QKV_PAIRS,
    QKV_STAGES,
    QKV_WARPS,
    qkv_rope,
    qkv_rope_ref,
    qkv_rope_supported,
    rope_kv_write,
)

from ._tolerance import assert_close


def _inputs(K, Hq, Hk, D, page, dtype, device, seed, bias=True, slot=5):
    g = torch.Generator().manual_seed(seed)
    N = (Hq + 2 * Hk) * D
    x = torch.randn(1, K, generator=g).to(device, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, dtype)
    b = torch.randn(N, generator=g).to(device, dtype) if bias else None
    ang = torch.rand(7, D // 2, generator=g, dtype=torch.float64) * 6.3
    cos, sin = ang.cos().float().to(device), ang.sin().float().to(device)
    rows = torch.tensor([4], device=device)
    k_cache = torch.randn(3, page, Hk, D, generator=g).to(device, dtype)
    v_cache = torch.randn(3, page, Hk, D, generator=g).to(device, dtype)
    slots = torch.tensor([slot], device=device)
    return x, w, b, cos, sin, rows, k_cache, v_cache, slots


CASES = [  # K, Hq, Hk, D, page
    (300, 3, 1, 8, 4),  # K: one whole 256-wide step and a ragged one
    (64, 6, 2, 16, 8),
    (520, 2, 2, 32, 16),
]


@pytest.mark.parametrize(
    "bias,interleaved", [(True, False), (False, True)], ids=["bias-half", "nobias-interleaved"]
)
@pytest.mark.parametrize("K,Hq,Hk,D,page", CASES)
def test_matches_float64(K, Hq, Hk, D, page, bias, interleaved, device):
    x, w, b, cos, sin, rows, kc, vc, slots = _inputs(K, Hq, Hk, D, page, torch.float32, device, K + D, bias)
    want_kc, want_vc = kc.cpu().double(), vc.cpu().double()
    want_q = qkv_rope_ref(x.cpu().double(), w.cpu().double(), None if b is None else b.cpu().double(),
                          cos.cpu().double(), sin.cpu().double(), rows.cpu(), want_kc, want_vc, slots.cpu(), Hq,
                          Hk, interleaved)  # fmt: skip
    before_kc = kc.clone()
    with use_backend("triton"):
        q = qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, Hq, interleaved=interleaved)
    assert q.shape == (1, Hq, D) and q.dtype == x.dtype
    assert_close(q, want_q, name="q")
    assert_close(kc, want_kc, name="k cache")
    assert_close(vc, want_vc, name="v cache")
    others = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    others[slots.cpu()] = False
    assert torch.equal(kc.view(-1, Hk, D).cpu()[others], before_kc.view(-1, Hk, D).cpu()[others])


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_bit_equal_to_the_two_kernels(dtype, interleaved, device):
    """The same bits as the decode gemv at the tiles this kernel reproduces, then rope_kv_write (the FMA
    gemv has no tl.dot, so bf16 runs in the interpreter too)."""
    K, Hq, Hk, D, page = 300, 6, 2, 16, 4
    x, w, b, cos, sin, rows, kc, vc, slots = _inputs(K, Hq, Hk, D, page, dtype, device, 3)
    kc2, vc2 = kc.clone(), vc.clone()
    with use_backend("triton"):
        q = qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, Hq, interleaved=interleaved)
        cfg = DecodeConfig("gemv", 2 * QKV_PAIRS, QKV_BLOCK_K, 1, QKV_WARPS, QKV_STAGES)
        qkv = decode_matmul(x, w.t(), b, config=cfg)
        qs, ks, vs = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
        q2 = rope_kv_write(qs.view(1, Hq, D), ks.view(1, Hk, D), vs.view(1, Hk, D), cos, sin, rows, kc2, vc2,
                           slots, interleaved=interleaved)  # fmt: skip
    assert torch.equal(q, q2)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_preload_bit_equal_to_the_preloading_gemv(dtype, interleaved, device):
    """With its whole W slice loaded before the wait (pre_k, the default where matmul_decode.preload_weight
    holds) the kernel sums as the preloading gemv does: the same bits as that gemv and rope_kv_write, with the
    tables read before the wait or after it; and within float rounding of the K loop's form."""
    K, Hq, Hk, D, page = 300, 6, 2, 16, 4
    x, w, b, cos, sin, rows, kc, vc, slots = _inputs(K, Hq, Hk, D, page, dtype, device, 5)
    kc2, vc2, kc3, vc3 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    with use_backend("triton"):
        q = qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, Hq, interleaved=interleaved, pre_k=512,
                     early=True)  # fmt: skip
        q3 = qkv_rope(x, w, b, cos, sin, rows, kc3, vc3, slots, Hq, interleaved=interleaved, pre_k=512,
                      early=False)  # fmt: skip
        cfg = DecodeConfig("gemv", 2 * QKV_PAIRS, QKV_BLOCK_K, 1, QKV_WARPS, QKV_STAGES, pre_k=512)
        qkv = decode_matmul(x, w.t(), b, config=cfg)
        qs, ks, vs = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
        q2 = rope_kv_write(qs.view(1, Hq, D), ks.view(1, Hk, D), vs.view(1, Hk, D), cos, sin, rows, kc2, vc2,
                           slots, interleaved=interleaved)  # fmt: skip
        looped = qkv_rope(x, w, b, cos, sin, rows, kc3.clone(), vc3.clone(), slots, Hq, interleaved=interleaved,
                          pre_k=0)  # fmt: skip
    assert torch.equal(q, q2) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(q, q3) and torch.equal(kc, kc3) and torch.equal(vc, vc3)
    assert_close(q, looped, name="preloaded vs looped")
    with pytest.raises(ValueError, match="pre_k"):
        qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, Hq, pre_k=256)  # below K
    with pytest.raises(ValueError, match="pre_k"):
        qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, Hq, pre_k=384)  # not a power of two


@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_norm_equals_rmsnorm_then_the_kernel(dtype, with_residual, device):
    """norm_weight: the block's add + RMSNorm inside the kernel. The new stream is the norm kernel's bit for
    bit; q and the cache writes agree with rmsnorm followed by this kernel up to rstd's last float32 bits
    (the two sum the row's squares in other orders: an element may move by one ulp of the dtype)."""
    from kiln.kernels.rmsnorm import rmsnorm, rmsnorm_ref

    K, Hq, Hk, D, page = 300, 6, 2, 16, 4
    x, w, b, cos, sin, rows, kc, vc, slots = _inputs(K, Hq, Hk, D, page, dtype, device, 7)
    g = torch.Generator().manual_seed(8)
    r = torch.randn(1, K, generator=g).to(device, dtype) if with_residual else None
    gamma = (1 + 0.1 * torch.randn(K, generator=g)).to(device, dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    with use_backend("triton"):
        q, h = qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, Hq, pre_k=512, norm_weight=gamma, residual=r,
                        eps=1e-5)  # fmt: skip
        normed = rmsnorm(x, gamma, 1e-5, r)
        normed, h2 = normed if with_residual else (normed, x)
        q2 = qkv_rope(normed, w, b, cos, sin, rows, kc2, vc2, slots, Hq, pre_k=512)
    assert torch.equal(h, h2)
    assert_close(q, q2, name="q")
    assert_close(kc, kc2, name="k cache")
    assert_close(vc, vc2, name="v cache")
    # and against float64: the norm's reference, then the projection, RoPE and the cache writes
    x64 = x.cpu().double() if r is None else x.cpu().double() + r.cpu().double()
    want = qkv_rope_ref(rmsnorm_ref(x64, gamma.cpu().double(), 1e-5), w.cpu().double(), b.cpu().double(),
                        cos.cpu().double(), sin.cpu().double(), rows.cpu(), kc2.cpu().double(), vc2.cpu().double(),
                        slots.cpu(), Hq, Hk, False)  # fmt: skip
    assert_close(q, want, name="q vs float64")


def test_fused_norm_refuses_what_it_does_not_take(device):
    x, w, b, cos, sin, rows, kc, vc, slots = _inputs(64, 2, 1, 8, 4, torch.float32, device, 1)
    gamma = torch.ones(64, device=device)
    with pytest.raises(ValueError, match="pre_k > 0"):
        qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, 2, pre_k=0, norm_weight=gamma)
    with pytest.raises(ValueError, match="norm_weight must be"):
        qkv_rope(
            x, w, b, cos, sin, rows, kc, vc, slots, 2, pre_k=64, norm_weight=torch.ones(63, device=device)
        )
    with pytest.raises(ValueError, match="runs on Triton"):  # the reference backend: rmsnorm, then the kernel
        qkv_rope(x.cpu(), w.cpu(), b.cpu(), cos.cpu(), sin.cpu(), rows.cpu(), kc.cpu(), vc.cpu(), slots.cpu(), 2,
                 pre_k=64, norm_weight=gamma.cpu())  # fmt: skip
    with pytest.raises(ValueError, match="residual is an argument"):
        qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, 2, pre_k=64, residual=x.clone())


def test_padding_slot_writes_nothing(device):
    x, w, b, cos, sin, rows, kc, vc, slots = _inputs(64, 2, 1, 8, 4, torch.float32, device, 1, slot=-1)
    before_k, before_v = kc.clone(), vc.clone()
    with use_backend("triton"):
        q = qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, 2)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)
    want = qkv_rope_ref(x, w, b, cos, sin, rows, kc.clone(), vc.clone(), slots, 2, 1)
    assert_close(q, want, name="q")


def test_refuses_what_it_does_not_take(device):
    x, w, b, cos, sin, rows, kc, vc, slots = _inputs(64, 2, 1, 8, 4, torch.float32, device, 1)
    assert qkv_rope_supported(x, w, kc, 2)
    assert not qkv_rope_supported(x.expand(2, -1), w, kc, 2)  # two tokens
    assert not qkv_rope_supported(x, w, kc, 3)  # rows that are not (Hq + 2 Hk) D
    assert not qkv_rope_supported(x, w.t().contiguous().t(), kc, 2)  # W not K-contiguous
    xl = torch.zeros(1, 5000, device=device)
    assert not qkv_rope_supported(xl, torch.zeros(32, 5000, device=device), kc, 2)  # K past the gemv rule's
    kc6 = torch.zeros(3, 4, 1, 6, device=device)  # D / 2 = 3: not whole pairs per program
    assert not qkv_rope_supported(x, torch.zeros(24, 64, device=device), kc6, 2)
    with pytest.raises(ValueError, match="qkv_rope_supported"):
        qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "interleaved"])
def test_qwen_shape_bf16_on_gpu(interleaved):
    """Qwen2.5-1.5B's attention (d 1536, 12 / 2 heads of 128, q/k/v bias), bf16, eager and in a CUDA graph:
    bit-equal to the projection the engine runs without it (the rule's one-row gemv) and rope_kv_write."""
    K, Hq, Hk, D, page = 1536, 12, 2, 128, 16
    x, w, b, cos, sin, rows, kc, vc, slots = _inputs(K, Hq, Hk, D, page, torch.bfloat16, "cuda", 0, slot=37)
    kc2, vc2 = kc.clone(), vc.clone()
    kc3, vc3, kc4, vc4 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    # W preloaded: the default at this shape
    q = qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, Hq, interleaved=interleaved)
    looped = qkv_rope(x, w, b, cos, sin, rows, kc3, vc3, slots, Hq, interleaved=interleaved, pre_k=0)
    with use_backend("triton"):
        qkv = decode_matmul(x, w.t(), b)  # the rule, with its W preload (preload_weight holds at this shape)
        # and the rule's tiles without the preload: what the K loop mirrors
        qkv_loop = decode_matmul(x, w.t(), b, config=decode_config(1, w.shape[0], K, sm_count(x.device)))
    for got, kcg, vcg, ref, kcr, vcr in ((q, kc, vc, qkv, kc2, vc2), (looped, kc3, vc3, qkv_loop, kc4, vc4)):
        qs, ks, vs = ref.split([Hq * D, Hk * D, Hk * D], dim=-1)
        q2 = rope_kv_write(qs.view(1, Hq, D), ks.view(1, Hk, D), vs.view(1, Hk, D), cos, sin, rows, kcr, vcr,
                           slots, interleaved=interleaved)  # fmt: skip
        assert torch.equal(got, q2) and torch.equal(kcg, kcr) and torch.equal(vcg, vcr)
    want = qkv_rope_ref(x.float(), w.float(), b.float(), cos, sin, rows, kc.float().clone(), vc.float().clone(),
                        slots, Hq, Hk, interleaved)  # fmt: skip
    assert_close(q, want, name="q vs float32")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qg = qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, Hq, interleaved=interleaved)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(qg, q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_norm_qwen_shape_bf16_on_gpu():
    """The fused norm at Qwen2.5-1.5B's shape, bf16: the new stream bit-equal to the norm kernel's, q and the
    cache writes within a bf16 ulp of rmsnorm + the kernel (rstd's sum order), a CUDA graph replay the same
    bits as the eager call."""
    from kiln.kernels.rmsnorm import rmsnorm

    K, Hq, Hk, D, page = 1536, 12, 2, 128, 16
    x, w, b, cos, sin, rows, kc, vc, slots = _inputs(K, Hq, Hk, D, page, torch.bfloat16, "cuda", 0, slot=37)
    g = torch.Generator().manual_seed(1)
    r = torch.randn(1, K, generator=g).to("cuda", torch.bfloat16)
    gamma = (1 + 0.1 * torch.randn(K, generator=g)).to("cuda", torch.bfloat16)
    kc2, vc2 = kc.clone(), vc.clone()
    q, h = qkv_rope(x, w, b, cos, sin, rows, kc, vc, slots, Hq, pre_k=2048, norm_weight=gamma, residual=r)
    normed, h2 = rmsnorm(x, gamma, 1e-6, r)
    q2 = qkv_rope(normed, w, b, cos, sin, rows, kc2, vc2, slots, Hq, pre_k=2048)
    assert torch.equal(h, h2)
    torch.testing.assert_close(q, q2, rtol=1.6e-2, atol=1e-2)  # a bf16 ulp where rstd's last bits moved one
    torch.testing.assert_close(kc, kc2, rtol=1.6e-2, atol=1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qg, hg = qkv_rope(
            x, w, b, cos, sin, rows, kc, vc, slots, Hq, pre_k=2048, norm_weight=gamma, residual=r
        )
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(qg, q) and torch.equal(hg, h)
