"""The op catalog's FLOP and byte counts against hand-worked cases (the numbers in the comments are the
counting rules of kiln.profile.ops worked out by hand), and every op's call at its smoke shape."""

import pytest
import torch

from kiln.profile import ops as O


def test_elementwise_and_reduction_counts():
    # rmsnorm 2 x 3 bf16: 4 flops per element = 24; bytes x + y (2 * 6 * 2) + w (3 * 2) = 30
    op = O.RMSNorm("n", rows=2, cols=3)
    assert (op.flops(), op.bytes()) == (24, 30)
    # with the residual: 5 per element = 30 flops; x, r, y, sum = 4 * 6 * 2 = 48, + w 6 = 54
    op = O.RMSNorm("n", rows=2, cols=3, residual=True)
    assert (op.flops(), op.bytes()) == (30, 54)
    # layernorm 2 x 4 fp32: 7 * 8 = 56 flops; x + y = 2 * 8 * 4 = 64, w + b = 2 * 4 * 4 = 32 -> 96
    op = O.LayerNorm("l", rows=2, cols=4, dtype="fp32")
    assert (op.flops(), op.bytes()) == (56, 96)
    # softmax 3 x 5 bf16: 5 * 15 = 75 flops; read + write 2 * 15 * 2 = 60 bytes
    assert (O.Softmax("s", rows=3, cols=5).flops(), O.Softmax("s", rows=3, cols=5).bytes()) == (75, 60)
    # swiglu 2 rows, hidden 4: 5 * 8 = 40 flops; read 2 * 8, write 8 elements = 24 * 2 bytes = 48
    op = O.SwiGLU("g", rows=2, hidden=4)
    assert (op.flops(), op.bytes()) == (40, 48)
    # rope 2 tokens, 4 + 2 heads, D 8: 3 * 2 * 6 * 8 = 288 flops; q, k in + out 2 * 96 * 2 = 384,
    # tables 2 (cos, sin) * 2 tokens * 4 * 4 bytes = 64 -> 448
    op = O.RoPE("r", tokens=2, heads_q=4, heads_k=2, head_dim=8)
    assert (op.flops(), op.bytes()) == (288, 448)
    # cross-entropy 2 x 10 bf16: 4 * 20 = 80 flops; logits 40 + targets 16 + losses 8 = 64
    op = O.CrossEntropy("c", rows=2, vocab=10)
    assert (op.flops(), op.bytes()) == (80, 64)
    # sampling 2 x 10 fp32: 5 * 20 = 100; noise written + read, logits read: 3 * 80 = 240, + ids 16
    op = O.Sampling("s", rows=2, vocab=10)
    assert (op.flops(), op.bytes()) == (100, 256)
    # argmax 3 x 7 bf16: 21 compares; 42 bytes read + 24 written
    assert (O.Argmax("a", rows=3, vocab=7).flops(), O.Argmax("a", rows=3, vocab=7).bytes()) == (21, 66)
    # embedding 4 rows of d 8 bf16: ids 32 + rows read 64 + written 64 = 160
    assert O.Embedding("e", rows=4, d=8).bytes() == 160 and O.Embedding("e", rows=4, d=8).flops() == 0
    # paged KV write 3 tokens, 2 heads, D 4 bf16: k, v read + written 4 * 24 * 2 = 192, slots 24 -> 216
    assert O.PagedKVWrite("w", tokens=3, kv_heads=2, head_dim=4).bytes() == 216


def test_matmul_counts():
    # linear M 2, N 3, K 4 bf16: 2 * 24 = 48 flops; x 8 + W 12 + y 6 = 26 elements = 52 bytes (+ bias 6)
    op = O.Linear("m", m=2, n=3, k=4)
    assert (op.flops(), op.bytes(), op.roof) == (48, 52, "bf16")
    assert O.Linear("m", m=2, n=3, k=4, bias=True).bytes() == 58
    # the Qwen2.5-1.5B gate_up at batch 1: the weight dominates: 17920 * 1536 * 2 = 55.05 MB
    op = O.Linear("gu", m=1, n=17920, k=1536)
    assert op.bytes() == 2 * (1536 + 17920 * 1536 + 17920) and op.intensity() == pytest.approx(1.0, rel=2e-3)
    # linear + CE 2 rows, V 5, d 3 bf16: 2 * 30 + 4 * 10 = 100 flops; (6 + 15) * 2 + 12 * 2 = 66 bytes
    op = O.LinearCrossEntropy("lce", rows=2, vocab=5, d=3)
    assert (op.flops(), op.bytes()) == (100, 66)
    # int8 M 1, N 4, K 8: 64 flops; W 32 + scales 4 * 2 + x 16 + y 8 = 64
    op = O.QuantLinear("q8", m=1, n=4, k=8, bits=8)
    assert (op.flops(), op.bytes()) == (64, 64)
    # int4, group 4: W 16 bytes, scales 4 * 2 groups * 2 = 16, x 16 + y 8 -> 56
    assert O.QuantLinear("q4", m=1, n=4, k=8, bits=4, group=4).bytes() == 56
    # fp8 M 2, N 4, K 8: 128 flops; x 32 + y 16 bytes (bf16), W 32, scales 16 -> 96; fp8 roof
    op = O.FP8Linear("f8", m=2, n=4, k=8)
    assert (op.flops(), op.bytes(), op.roof) == (128, 96, "fp8")
    # grouped 6 rows, N 2, K 3, 2 experts: 72 flops; x 18 + W 12 + y 12 = 42 elements = 84, offsets 12
    op = O.GroupedLinear("g", rows=6, n=2, k=3, experts=2)
    assert (op.flops(), op.bytes()) == (72, 96)


def test_attention_counts():
    # causal fwd B 1, T 4, H 2, Hk 1, D 8: 4 * 1 * 2 * 16 * 8 / 2 = 512; q, o 2 * 4 * 2 * 8 and k, v
    # 2 * 4 * 1 * 8: (128 + 64) * 2 bytes = 384, lse 4 * 2 * 4 = 32 -> 416
    op = O.Attention("a", batch=1, seq=4, heads=2, kv_heads=1, head_dim=8)
    assert (op.flops(), op.bytes()) == (512, 416)
    # bwd: 2.5 x = 1280; q-sized (64 el = 128 B): q, o, do, dq = 4 * 128; kv-sized (32 el = 64 B): k, v,
    # dk, dv = 4 * 64; lse 32 -> 512 + 256 + 32 = 800
    op = O.AttentionBwd("b", batch=1, seq=4, heads=2, kv_heads=1, head_dim=8)
    assert (op.flops(), op.bytes()) == (1280, 800)
    # decode: B 2, ctx 20, Hq 4, Hk 2, D 8, pages of 16: 4 * 2 * 4 * 20 * 8 = 5120 flops;
    # K + V 2 * 2 * 20 * 2 * 8 * 2 = 2560, q + o 2 * 2 * 4 * 8 * 2 = 256, tables 4 * 2 * (2 + 1) = 24
    op = O.DecodeAttention("d", batch=2, context=20, heads=4, kv_heads=2, head_dim=8, block_size=16)
    assert (op.flops(), op.bytes()) == (5120, 2840)


def test_catalog_names_every_kernel_family():
    names = [op.name for op in O.catalog()]
    for want in ("rmsnorm", "layernorm", "softmax", "swiglu", "rope", "cross_entropy", "linear_cross_entropy",
                 "matmul_prefill", "matmul_decode", "attention_fwd", "attention_bwd", "decode_attention",
                 "sampling", "quant_matmul_int8", "quant_matmul_int4", "fp8_matmul", "moe_grouped_gemm"):  # fmt: skip
        assert want in names
    assert [op.name for op in O.catalog(smoke=True)] == names
    for op in O.catalog():
        assert op.bytes() > 0 and op.flops() >= 0 and op.shape_str()


@pytest.mark.parametrize("name", ["rmsnorm", "matmul_decode", "decode_attention", "quant_matmul_int4"])
def test_smoke_calls_run_kilns_kernels(name):
    from kiln.kernels.dispatch import use_backend

    op = next(o for o in O.catalog(smoke=True) if o.name == name)
    with use_backend("triton"):
        out = op.build(torch.device("cpu"))()
    out = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(out.float()).all()
