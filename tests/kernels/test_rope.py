"""RoPE kernel (q and k in one launch) vs the float64 reference: both pair layouts, position ids,
(B, T, H, D) and (B, H, T, D) memory layouts, forward and both gradients."""

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.rope import apply_rope, apply_rope_ref, rope_launch

from ._tolerance import assert_close, check_op


def tables(P, D, device="cpu"):
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D))
    f = torch.outer(torch.arange(P, dtype=torch.float64, device=device), inv)
    return f.cos().float(), f.sin().float()


def _op(q, k, cos, sin, pos, interleaved):
    with use_backend("triton"):
        return apply_rope(q, k, cos, sin, pos, interleaved)


def _ref(q, k, cos, sin, pos, interleaved):
    return apply_rope_ref(q, k, cos.double(), sin.double(), pos, interleaved)


# (B, T, Hq, Hk, D): tiny, GQA-typical (small), odd heads and head dim (D/2 not a power of two)
SHAPES = [(1, 1, 1, 1, 2), (2, 5, 4, 2, 16), (2, 3, 3, 1, 20)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("positions", [False, True])
def test_rope_matches_float64(shape, dtype, interleaved, positions):
    B, T, Hq, Hk, D = shape
    g = torch.Generator().manual_seed(0)
    cos, sin = tables(32, D)
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype)
    k = torch.randn(B, T, Hk, D, generator=g).to(dtype)
    pos = torch.randint(0, 32, (B, T), generator=g) if positions else None
    check_op(_op, _ref, [q, k, cos, sin, pos, interleaved], grad_inputs=(0, 1))


def test_rope_bhtd_layout_and_fused_qkv_views():
    B, T, Hq, Hk, D = 2, 6, 4, 2, 16
    g = torch.Generator().manual_seed(1)
    cos, sin = tables(T, D)
    q = torch.randn(B, Hq, T, D, generator=g).transpose(1, 2)  # (B, H, T, D) memory as a (B, T, H, D) view
    k = torch.randn(B, Hk, T, D, generator=g).transpose(1, 2)
    check_op(_op, _ref, [q, k, cos, sin, None, False], grad_inputs=(0, 1))
    qkv = torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g)  # slices of a fused projection
    q = qkv[..., : Hq * D].view(B, T, Hq, D)
    k = qkv[..., Hq * D : (Hq + Hk) * D].view(B, T, Hk, D)
    check_op(_op, _ref, [q, k, cos, sin, None, True], grad_inputs=(0, 1))


def test_rope_packed_sequences_and_decode_positions():
    D = 8
    cos, sin = tables(64, D)
    g = torch.Generator().manual_seed(2)
    # two packed documents in one row: positions restart at the boundary
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    q, k = torch.randn(1, 7, 2, D, generator=g), torch.randn(1, 7, 1, D, generator=g)
    qo, ko = _op(q, k, cos, sin, pos, False)
    q3, k3 = _op(q[:, 3:], k[:, 3:], cos, sin, None, False)  # the second document alone, from 0
    assert_close(qo[:, 3:], q3.double(), name="packed q")
    assert_close(ko[:, 3:], k3.double(), name="packed k")
    # decoding: one new token per sequence at its own cache offset
    pos = torch.tensor([[17], [40]])
    q, k = torch.randn(2, 1, 2, D, generator=g), torch.randn(2, 1, 1, D, generator=g)
    check_op(_op, _ref, [q, k, cos, sin, pos, False], grad_inputs=(0, 1))


@pytest.mark.parametrize("tokens", [1, 4])
def test_rope_tokens_per_program(tokens):
    # whole-token blocks as bench/kernels_norms.py sweeps them: 1 token per block, and 4 with a ragged last one
    g = torch.Generator().manual_seed(3)
    cos, sin = tables(16, 8)
    q, k = torch.randn(1, 7, 3, 8, generator=g), torch.randn(1, 7, 1, 8, generator=g)
    pos = torch.randint(0, 16, (1, 7), generator=g)
    qo, ko = rope_launch(q, k, cos, sin, pos, False, tokens=tokens, num_warps=1)
    q2, k2 = _ref(q.double(), k.double(), cos, sin, pos, False)
    assert_close(qo, q2, name="q")
    assert_close(ko, k2, name="k")


@pytest.mark.parametrize("block", [{"rows": 4}, {"rows": 16}, {"tokens": 1}, {"tokens": 2}])
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_blocks(block, interleaved):
    # flat row blocks and whole-token blocks: q blocks then k blocks, ragged last blocks, non-power-of-two
    # heads, (B, H, T, D) memory, positions, and the inverse rotation
    g = torch.Generator().manual_seed(4)
    cos, sin = tables(16, 8)
    q = torch.randn(2, 3, 7, 8, generator=g).transpose(1, 2)  # (B, T, Hq, D) view of (B, H, T, D) memory
    k = torch.randn(2, 7, 1, 8, generator=g)
    pos = torch.randint(0, 16, (2, 7), generator=g)
    for backward in (False, True):
        qo, ko = rope_launch(q, k, cos, sin, pos, interleaved, backward, num_warps=1, **block)
        sgn = -1.0 if backward else 1.0
        q2, k2 = _ref(q.double(), k.double(), cos, sgn * sin, pos, interleaved)
        assert_close(qo, q2, name="q")
        assert_close(ko, k2, name="k")


def test_rope_errors():
    cos, sin = tables(8, 8)
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8)
    with pytest.raises(ValueError, match="even"):
        _op(torch.randn(1, 4, 2, 7), torch.randn(1, 4, 1, 7), cos, sin, None, False)
    with pytest.raises(ValueError, match=r"\(P, D/2\)"):
        _op(q, k, cos[:, :3], sin[:, :3], None, False)
    with pytest.raises(ValueError, match=r"lie in \[0, 8\)"):
        _op(q, k, cos, sin, torch.full((1, 4), 8), False)
    with pytest.raises(ValueError, match="constants"):
        _op(q, k, cos.requires_grad_(), sin, None, False)
    with pytest.raises(ValueError, match="same B, T and D"):
        _op(q, torch.randn(1, 3, 1, 8), cos, sin, None, False)


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_gpu_bf16(interleaved):
    B, T, Hq, Hk, D = 2, 1024, 32, 8, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    cos, sin = tables(4096, D, "cuda")
    q = torch.randn(B, T, Hq, D, generator=g, device="cuda").bfloat16()
    k = torch.randn(B, T, Hk, D, generator=g, device="cuda").bfloat16()
    pos = torch.randint(0, 4096, (B, T), generator=g, device="cuda")
    check_op(_op, _ref, [q, k, cos, sin, pos, interleaved], grad_inputs=(0, 1))
