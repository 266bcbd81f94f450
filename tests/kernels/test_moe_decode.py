"""Decode MoE kernels (kernels/moe_decode.py) against float64: the pair-by-pair reference and, as an outside
oracle, the model's eager per-expert loop (kiln.model.moe.Experts.forward); odd shapes (one expert, every
token on one expert, ragged d and I, int64 ids, fp16); errors; the custom op; bf16 and a CUDA graph on
the GPU."""

from types import SimpleNamespace

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.moe_decode import (
    DecodeTiles,
    moe_decode,
    moe_decode_fwd,
    moe_decode_op,
    moe_decode_ref,
    use_decode,
)
from kiln.model.moe import Experts

from ._tolerance import assert_close


def _case(T, k, E, d, I, seed=0, same_expert=False, device="cpu", dtype=torch.float32, idx_dtype=torch.int32):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, d, generator=g, device=device).to(dtype)
    w1 = (torch.randn(E, 2 * I, d, generator=g, device=device) / d**0.5).to(dtype)
    w2 = (torch.randn(E, d, I, generator=g, device=device) / I**0.5).to(dtype)
    if same_expert:  # every token's first slot on expert E - 1, the rest distinct
        idx = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
        idx[:, 0] = E - 1
        idx[:, 1:] = torch.where(idx[:, 1:] == E - 1, 0, idx[:, 1:])
    else:
        idx = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
    wts = torch.softmax(torch.randn(T, k, generator=g, device=device), -1)
    return x, idx.to(idx_dtype), wts, w1, w2


def _loop(x, idx, wts, w1, w2):
    """The model's eager loop, float64."""
    ex = SimpleNamespace(gate_up_proj=w1.double(), down_proj=w2.double())
    with use_backend("reference"):  # torch ops only (its SwiGLU too), also on the GPU
        return Experts.forward(ex, x.double(), idx.long(), wts.double())


@pytest.mark.parametrize(
    "T, k, E, d, I",
    [(1, 1, 1, 16, 8), (1, 2, 8, 40, 24), (3, 2, 8, 33, 20), (2, 3, 7, 50, 37), (4, 1, 4, 24, 9)],
    ids=["E1", "mixtral-like", "ragged", "k3-odd", "k1"],
)
def test_moe_decode_matches_loop(T, k, E, d, I):
    x, idx, wts, w1, w2 = _case(T, k, E, d, I, seed=T * 10 + k)
    with use_backend("triton"):
        got = moe_decode(x, idx, wts, w1, w2)
    want = _loop(x, idx, wts, w1, w2)
    # float32 vs float64: the reference rounds gate and up to float32 as the kernel does (a few ulps)
    assert_close(got, want)
    # the float64 reference against the loop, whose combine multiplies in float32 (y.float() * w)
    assert_close(moe_decode_ref(x.double(), idx, wts.double(), w1.double(), w2.double()), want, torch.float32)


def test_moe_decode_one_expert_holds_all_tokens_and_int64_ids():
    # every token's first slot on the last expert (pairs sharing an expert), ids as int64, T > E / k
    x, idx, wts, w1, w2 = _case(5, 2, 6, 20, 12, seed=3, same_expert=True, idx_dtype=torch.int64)
    with use_backend("triton"):
        got = moe_decode(x, idx, wts, w1, w2)
    assert_close(got, _loop(x, idx, wts, w1, w2))


def test_moe_decode_tiles_and_fp16():
    # explicit tiles: several column tiles with a ragged last one, several K steps, a 2-stage loop
    x, idx, wts, w1, w2 = _case(2, 2, 5, 37, 19, seed=4)
    tiles = (DecodeTiles(8, 16, 1, 2), DecodeTiles(4, 8, 1, 1))
    with use_backend("triton"):
        got = moe_decode_fwd(x, idx, wts, w1, w2, config=tiles)
    assert_close(got, _loop(x, idx, wts, w1, w2))
    x16, w116, w216 = x.half(), w1.half(), w2.half()
    with use_backend("triton"):
        got16 = moe_decode(x16, idx, wts, w116, w216)
    assert_close(got16, moe_decode_ref(x16, idx, wts, w116, w216).double())
    # against the float64 loop on the fp16 inputs: gate, up and h are rounded to fp16 on the way (three
    # roundings of products of unit scale), so twice the table's single-rounding fp16 bound
    assert_close(got16, _loop(x16, idx, wts, w116, w216), torch.float16, scale=2.0)


def test_moe_decode_empty_and_errors():
    x, idx, wts, w1, w2 = _case(1, 2, 4, 16, 8)
    with use_backend("triton"):
        assert moe_decode(x[:0], idx[:0], wts[:0], w1, w2).shape == (0, 16)
        with pytest.raises(RuntimeError, match="forward only"):
            moe_decode(x.requires_grad_(), idx, wts, w1, w2)
    x = x.detach()
    with pytest.raises(ValueError, match=r"w1 must be \(E, 2I, d\)"):
        moe_decode_ref(x, idx, wts, w1, w2[:, :, :5])
    with pytest.raises(ValueError, match=r"both be \(T, k\)"):
        moe_decode_ref(x, idx, wts[:, :1], w1, w2)
    with pytest.raises(TypeError, match="int32 or int64"):
        moe_decode_ref(x, idx.float(), wts, w1, w2)
    assert use_decode(1, 8, 128) and use_decode(16, 8, 128) and not use_decode(17, 8, 128)
    assert use_decode(4, 2, 8) and not use_decode(8, 2, 8) and not use_decode(0, 2, 8)


def test_moe_decode_opcheck():
    x, idx, wts, w1, w2 = _case(2, 2, 4, 16, 8, seed=5)
    with use_backend("triton"):
        torch.library.opcheck(
            moe_decode_op, (x, idx, wts, w1, w2), test_utils=("test_schema", "test_faketensor")
        )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "T, k, E, d, I",
    [(1, 2, 8, 4096, 14336), (4, 2, 8, 4096, 14336), (1, 8, 128, 2048, 768), (16, 8, 128, 2048, 768),
     (3, 6, 64, 2048, 1408)],
)  # fmt: skip
def test_moe_decode_gpu_bf16_and_graph(T, k, E, d, I):
    x, idx, wts, w1, w2 = _case(T, k, E, d, I, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        got = moe_decode(x, idx, wts, w1, w2)
        # bf16 inputs against the float64 loop on the first two tokens (its float64 matmuls on the GPU): gate,
        # up and h are rounded to bf16 on the way (as the grouped path rounds them), within the bf16 table
        assert_close(got[:2], _loop(x[:2], idx[:2], wts[:2], w1, w2), torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # no host sync inside
            out = moe_decode(x, idx, wts, w1, w2)
        x.copy_(torch.randn_like(x))
        idx.copy_(idx.flip(0))
        graph.replay()
        assert torch.equal(out, moe_decode(x, idx, wts, w1, w2))  # fixed order: bitwise deterministic
