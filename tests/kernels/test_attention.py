"""FlashAttention kernels (forward, dQ, dK, dV, dsinks) against the float64 eager reference.

On CPU the Triton kernels run through the interpreter (slow), so most cases use head dim 16 and a few
heads; the interpreter's block sizes (64 x 32 forward, 32 x 64 for dK/dV) are unequal, as on the GPU,
so lengths 17 / 129 / 1000 cross block edges, the causal diagonal and the window's far edge.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kiln.kernels.attention import attention, attention_ref
from kiln.kernels.dispatch import use_backend

from ._tolerance import assert_close


def _inputs(B, Tq, Tk, Hq, Hk, D, dtype, device, seed=0, sinks=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, D, generator=g).to(device, dtype)
    k = torch.randn(B, Tk, Hk, D, generator=g).to(device, dtype)
    v = torch.randn(B, Tk, Hk, D, generator=g).to(device, dtype)
    s = torch.randn(Hq, generator=g).to(device, torch.float32) if sinks else None
    return q, k, v, s


def _check_against_f64(q, k, v, sinks, grad_scale=1.0, **kw):
    """Run the Triton path and the float64 reference; compare the output and every gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sink = sinks.detach().clone().requires_grad_() if sinks is not None else None
    with use_backend("triton"):
        out = attention(*leaves, sinks=sink, **kw)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad(out, leaves + ([sink] if sink is not None else []), do)

    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref_sink = sinks.detach().cpu().double().requires_grad_() if sinks is not None else None
    ref = attention_ref(
        *ref_leaves, sinks=ref_sink, **{a: (b.cpu() if torch.is_tensor(b) else b) for a, b in kw.items()}
    )
    ref_grads = torch.autograd.grad(
        ref, ref_leaves + ([ref_sink] if ref_sink is not None else []), do.cpu().double()
    )

    assert_close(out, ref, name="out")
    for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        # dsinks is float32 but built from O and dO in the inputs' dtype: their tolerance applies.
        assert_close(g, rg, q.dtype, scale=grad_scale, name=name)


# (B, Tq, Tk, Hq, Hk) covering lengths 1 / 17 / 129, GQA ratios 1, 2, 4, 8 and MQA, Tq != Tk both ways.
SHAPES = [
    (1, 1, 1, 2, 2),
    (2, 17, 17, 2, 2),
    (1, 129, 129, 4, 2),
    (1, 17, 17, 8, 2),
    (1, 129, 129, 8, 1),  # MQA
    (1, 33, 129, 4, 4),  # chunked prefill: queries are the last 33 positions
    (2, 129, 40, 2, 1),  # more queries than keys: causal rows before the first key see nothing
]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(shape, causal, device):
    B, Tq, Tk, Hq, Hk = shape
    q, k, v, _ = _inputs(B, Tq, Tk, Hq, Hk, 16, torch.float32, device)
    _check_against_f64(q, k, v, None, causal=causal)


@pytest.mark.parametrize(
    "B,Tq,Tk,Hq,Hk,causal,window,sinks",
    [
        (1, 129, 129, 4, 2, True, 40, False),  # window wider than a block, narrower than the sequence
        (1, 129, 129, 2, 2, False, 7, False),  # non-causal window: only the far edge masks
        (2, 17, 17, 4, 1, True, None, True),
        (1, 129, 129, 4, 2, True, 33, True),  # gpt-oss: window and sinks together
        (1, 20, 129, 4, 4, True, None, True),  # sinks with chunked prefill
    ],
)
def test_window_and_sinks(B, Tq, Tk, Hq, Hk, causal, window, sinks, device):
    q, k, v, s = _inputs(B, Tq, Tk, Hq, Hk, 16, torch.float32, device, seed=2, sinks=sinks)
    _check_against_f64(q, k, v, s, causal=causal, window=window)


@pytest.mark.slow
@pytest.mark.parametrize("causal,window", [(True, None), (True, 300)])
def test_length_1000(causal, window, device):
    q, k, v, _ = _inputs(1, 1000, 1000, 2, 1, 16, torch.float32, device, seed=3)
    _check_against_f64(q, k, v, None, causal=causal, window=window)


@pytest.mark.parametrize("D", [32, 64])
def test_fp16_and_head_dims(D, device):
    q, k, v, s = _inputs(1, 129, 129, 4, 2, D, torch.float16, device, seed=4, sinks=True)
    _check_against_f64(q, k, v, s, causal=True)


@pytest.mark.parametrize("causal,window,sinks", [(True, None, False), (False, None, True), (True, 9, True)])
def test_varlen(causal, window, sinks, device):
    # Four packed documents of lengths 5, 25, 1 and 100: none may see another.
    cu = torch.tensor([0, 5, 30, 31, 131], dtype=torch.int32, device=device)
    q, k, v, s = _inputs(1, 131, 131, 4, 2, 16, torch.float32, device, seed=5, sinks=sinks)
    _check_against_f64(q[0], k[0], v[0], s, causal=causal, window=window, cu_seqlens=cu)


def test_varlen_documents_are_isolated(device):
    # Changing one document's keys must not move another document's output.
    cu = torch.tensor([0, 40, 70], dtype=torch.int32, device=device)
    q, k, v, _ = _inputs(1, 70, 70, 2, 2, 16, torch.float32, device, seed=6)
    q, k, v = q[0], k[0], v[0]
    with use_backend("triton"):
        a = attention(q, k, v, cu_seqlens=cu)
        k2 = k.clone()
        k2[40:] += 1.0
        b = attention(q, k2, v, cu_seqlens=cu)
    assert torch.equal(a[:40], b[:40])


def test_non_contiguous_inputs(device):
    # q, k, v sliced out of one fused (B, T, 3, H, D) projection: strided batch/time, contiguous D.
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(2, 40, 3, 4, 16, generator=g).to(device)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    _check_against_f64(q, k, v, None, causal=True)
    # A non-unit stride on the head dim is copied to a contiguous layout first.
    qt = torch.randn(2, 40, 4, 16, generator=g).to(device).transpose(-1, -2).contiguous().transpose(-1, -2)
    assert qt.stride(-1) != 1
    _check_against_f64(qt, k, v, None, causal=False)


def test_fully_masked_rows_are_zero(device):
    # 30 queries, 10 keys, causal: the first 20 queries sit before every key.
    q, k, v, _ = _inputs(1, 30, 10, 2, 2, 16, torch.float32, device, seed=8)
    with use_backend("triton"):
        out = attention(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    assert (out[:, :20] == 0).all()


def test_attn_mask_takes_reference_path(device):
    q, k, v, _ = _inputs(2, 17, 17, 2, 2, 16, torch.float32, device, seed=9)
    mask = torch.rand(2, 1, 17, 17, generator=torch.Generator().manual_seed(0)).to(device) > 0.3
    with use_backend("triton"):
        got = attention(q, k, v, causal=False, attn_mask=mask)
    assert torch.equal(got, attention_ref(q, k, v, causal=False, attn_mask=mask))


def test_auto_backend_on_cpu_is_reference():
    q, k, v, _ = _inputs(1, 17, 17, 2, 1, 16, torch.float32, "cpu", seed=10)
    with use_backend("auto"):
        assert torch.equal(attention(q, k, v), attention_ref(q, k, v))


def test_bad_inputs(device):
    q, k, v, _ = _inputs(1, 17, 17, 6, 4, 16, torch.float32, device)
    with use_backend("triton"), pytest.raises(ValueError, match="multiple of key/value heads"):
        attention(q, k, v)
    q, k, v, _ = _inputs(1, 17, 17, 4, 2, 16, torch.float32, device)
    with use_backend("triton"), pytest.raises(ValueError, match="incompatible shapes"):
        attention(q, k[:, :, :, :8], v)
    with use_backend("triton"), pytest.raises(ValueError, match="sinks"):
        attention(q, k, v, sinks=torch.zeros(3, device=device))
    with use_backend("triton"), pytest.raises(ValueError, match="window"):
        attention(q, k, v, window=0)
    with use_backend("triton"), pytest.raises(TypeError, match="fp16/bf16/fp32"):
        attention(q, k.half(), v)


# ------------------------------------------------------------------------------------- the GPU, bf16
@pytest.mark.gpu
@pytest.mark.parametrize(
    "B,Tq,Tk,Hq,Hk,D,causal,window,sinks",
    [
        (2, 1024, 1024, 8, 8, 128, True, None, False),
        (2, 1000, 1000, 8, 2, 64, False, None, False),
        (1, 777, 2048, 16, 2, 128, True, None, False),
        (2, 513, 513, 8, 1, 128, True, 128, True),
        (1, 300, 300, 4, 4, 256, True, None, False),
    ],
)
def test_gpu_bf16(B, Tq, Tk, Hq, Hk, D, causal, window, sinks):
    q, k, v, s = _inputs(B, Tq, Tk, Hq, Hk, D, torch.bfloat16, "cuda", seed=11, sinks=sinks)
    # dQ and dK pass through dS rounded to bf16 before their dots (P is rounded for dV too): one more
    # rounding than the output, on sums of up to 2048 terms, so gradients get twice the output's bound.
    _check_against_f64(q, k, v, s, grad_scale=2.0, causal=causal, window=window)


@pytest.mark.gpu
def test_gpu_bf16_varlen():
    cu = torch.tensor([0, 100, 1100, 1101, 2048], dtype=torch.int32, device="cuda")
    q, k, v, s = _inputs(1, 2048, 2048, 8, 2, 128, torch.bfloat16, "cuda", seed=12, sinks=True)
    _check_against_f64(q[0], k[0], v[0], s, grad_scale=2.0, causal=True, cu_seqlens=cu)


@pytest.mark.parametrize("tma", [False, True])
def test_tma_and_pointer_paths(tma, device):
    # On Hopper the kernels can load through TMA tensor descriptors instead of pointers; both paths run
    # here (the interpreter implements descriptors), forward and backward, against the float64 reference.
    from kiln.kernels.attention import FlashAttention

    q, k, v, s = _inputs(2, 100, 129, 4, 2, 16, torch.float32, device, seed=13, sinks=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, s)]
    out = FlashAttention.apply(*leaves[:3], leaves[3], None, 0, True, 0.3, 50, tma, tma)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    grads = torch.autograd.grad(out, leaves, do)
    ref_leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, s)]
    ref = attention_ref(*ref_leaves[:3], softmax_scale=0.3, window=50, sinks=ref_leaves[3])
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.cpu().double())
    assert_close(out, ref)
    for name, g, rg in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert_close(g, rg, name=name)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_pointer_and_tma_paths(causal):
    from kiln.kernels.attention import attention_bwd, attention_fwd

    q, k, v, _ = _inputs(2, 1000, 1000, 8, 2, 128, torch.bfloat16, "cuda", seed=14)
    do = torch.randn_like(q)
    a, lse_a = attention_fwd(q, k, v, causal, 0.1, None, None, None, 0, tma=False)
    b, lse_b = attention_fwd(q, k, v, causal, 0.1, None, None, None, 0, tma=True)
    ref = attention_ref(
        q.cpu().double(), k.cpu().double(), v.cpu().double(), causal=causal, softmax_scale=0.1
    )
    assert_close(a, ref, name="pointer forward")
    assert_close(b, ref, name="TMA forward")
    assert_close(lse_a, lse_b.double(), torch.float32, name="lse")
    # The two backward load paths: same inputs, same results up to bf16 rounding of the outputs.
    want = attention_bwd(do, q, k, v, a, lse_a, causal, 0.1, None, None, 0, tma=False)
    got = attention_bwd(do, q, k, v, a, lse_a, causal, 0.1, None, None, 0, tma=True)
    for name, x, y in zip(("dq", "dk", "dv", "delta"), want, got):
        assert_close(y, x.double(), name=f"{name} (TMA vs pointers)")


def test_reference_keeps_float32_math_under_cpu_bf16_autocast():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 4, 16, generator=g) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(out, attention_ref(q, k, v, causal=True), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("flat,heavy_first", [(False, False), (True, True)])
def test_dkdv_loop_and_grid_switches(flat, heavy_first, device):
    # The dK/dV kernel's two switches (one loop over the group's heads or one per head; grid order)
    # give the same gradients: GQA 4, causal with a window, lengths crossing block edges.
    from kiln.kernels.attention import attention_bwd, attention_fwd

    q, k, v, _ = _inputs(2, 100, 129, 8, 2, 16, torch.float32, device, seed=15)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device)
    o, lse = attention_fwd(q, k, v, True, 0.3, 50, None, None, 0)
    cfg = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1, FLAT=flat, HEAVY_FIRST=heavy_first)
    dq, dk, dv, _ = attention_bwd(do, q, k, v, o, lse, True, 0.3, 50, None, 0, dkdv_config=cfg)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref = attention_ref(*leaves, softmax_scale=0.3, window=50)
    ref_grads = torch.autograd.grad(ref, leaves, do.cpu().double())
    for name, g, rg in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert_close(g, rg, name=name)


def _prefix_inputs(q_lens, k_lens, Hq, Hk, D, dtype, device, seed, sinks=False):
    """Packed queries and keys of documents whose keys are a cached prefix plus their new rows."""
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q, k, v, s = _inputs(1, sum(q_lens), sum(k_lens), Hq, Hk, D, dtype, device, seed=seed, sinks=sinks)
    return q[0], k[0], v[0], s, cu_q, cu_k


@pytest.mark.parametrize("window,sinks", [(None, False), (None, True), (20, False)])
def test_varlen_cached_prefix(window, sinks, device):
    # Documents with 0, 31, 100 and 7 cached keys before 5, 1, 70 and 1 new queries: chunked prefill,
    # a decode row and a prefix-cache hit in one packed batch, against the float64 reference.
    q_lens, k_lens = [5, 1, 70, 1], [5, 32, 170, 8]
    q, k, v, s, cu_q, cu_k = _prefix_inputs(q_lens, k_lens, 4, 2, 16, torch.float32, device, 13, sinks)
    with use_backend("triton"), torch.no_grad():
        out = attention(q, k, v, sinks=s, window=window, cu_seqlens=cu_q, max_seqlen=70, cu_seqlens_k=cu_k)
    ref = attention_ref(
        q.cpu().double(), k.cpu().double(), v.cpu().double(), sinks=None if s is None else s.cpu().double(),
        window=window, cu_seqlens=cu_q.cpu(), cu_seqlens_k=cu_k.cpu(),
    )  # fmt: skip
    assert_close(out, ref, name="out")
    # each document alone, dense, with its queries at the end of its keys: the same rows
    for i in range(len(q_lens)):
        a, b, c, d = cu_q[i].item(), cu_q[i + 1].item(), cu_k[i].item(), cu_k[i + 1].item()
        alone = attention_ref(q[None, a:b], k[None, c:d], v[None, c:d], sinks=s, window=window)[0]
        assert_close(out[a:b], alone, name=f"doc {i}")


def test_varlen_cached_prefix_is_forward_only(device):
    q, k, v, _, cu_q, cu_k = _prefix_inputs([3], [9], 2, 2, 16, torch.float32, device, 14)
    with use_backend("triton"), pytest.raises(ValueError, match="forward-only"):
        attention(q.requires_grad_(), k, v, cu_seqlens=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.gpu
def test_gpu_bf16_varlen_cached_prefix():
    q_lens, k_lens = [100, 1, 1000, 1, 37], [100, 513, 1900, 2, 2085]
    q, k, v, s, cu_q, cu_k = _prefix_inputs(q_lens, k_lens, 8, 2, 128, torch.bfloat16, "cuda", 15, True)
    with torch.no_grad():
        out = attention(q, k, v, sinks=s, cu_seqlens=cu_q, max_seqlen=1000, cu_seqlens_k=cu_k)
    ref = attention_ref(
        q.double(), k.double(), v.double(), sinks=s.double(), cu_seqlens=cu_q, cu_seqlens_k=cu_k
    )
    assert_close(out, ref, name="out")


def test_tuning_lengths_and_unspecialized_lengths():
    from kiln.kernels import attention_fwd as fwd

    # one length per autotuning bucket a call can reach (a warm-up calls each once)
    assert fwd.tuning_lengths(1) == [1]
    assert fwd.tuning_lengths(964) == [2**i for i in range(11)]
    assert fwd.tuning_lengths(10**6)[-1] == 8192 and {fwd._len_key(n) for n in range(1, 20000, 7)} <= set(
        fwd.tuning_lengths(10**6)
    )
    # the per-step lengths are not specialized on (a new value class would compile mid-step): the names
    # must stay the kernel's parameters
    params = inspect.signature(fwd._attn_fwd_kernel.fn.fn).parameters
    assert set(fwd._UNSPECIALIZED) <= set(params)
