"""The L2 prefetch (kiln.kernels.l2_prefetch): a no-op off sm_90+ (the reference: a prefetch changes no
value), a clear error for what it cannot take, and on the H200 a kernel that runs between a producer and a
consumer without breaking their order (PDL: it waits for its predecessor before it ends)."""

from __future__ import annotations

import pytest
import torch

import kiln.kernels.l2_prefetch as pf
from kiln.kernels.l2_prefetch import can_prefetch, l2_prefetch


def test_noop_off_hopper_changes_nothing():
    w = torch.randn(64, 48)
    before = w.clone()
    assert not can_prefetch(w)
    l2_prefetch([(w, w.nbytes), (w[:3], 100)])  # nothing launched on the CPU (or the interpreter)
    l2_prefetch([])
    assert torch.equal(w, before)


def test_rejects_bad_regions():
    w = torch.randn(8, 8)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch([(w.t(), 64)])
    with pytest.raises(ValueError, match="at most 3"):
        l2_prefetch([(w, 16)] * 4)


def test_region_sizes(monkeypatch):
    """What the launcher asks the kernel for: each region clipped to its tensor and rounded down to the
    instruction's 16 bytes, empty or misaligned regions dropped, the grid covering every region."""
    seen = {}

    class Launch:
        def __getitem__(self, grid):
            def go(*args, **meta):
                seen.update(grid=grid, args=args, meta=meta)

            return go

    monkeypatch.setattr(pf, "can_prefetch", lambda t: True)
    monkeypatch.setattr(pf, "pdl", lambda t: False)
    monkeypatch.setattr(pf, "_prefetch_launch", Launch())
    a = torch.empty(3_000_000, dtype=torch.uint8)
    b = torch.empty(100, dtype=torch.float32)  # 400 bytes
    l2_prefetch([(a, 2_000_007), (b, 10_000), (b, 0)])
    args = seen["args"]
    per_prog = pf.CHUNK * pf.BLOCK
    assert args[1] == 2_000_000 and args[3] == 400 and args[5] == 0  # rounded down, clipped, padded
    assert args[6] == -(-2_000_000 // per_prog) and args[7] == args[6] + 1
    assert seen["grid"] == (args[7],)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_between_producer_and_consumer_on_gpu():
    """Producer (kiln's SwiGLU) -> prefetch -> consumer (SwiGLU of its output), many times over in one stream and in a CUDA
    graph: the consumer always sees the producer's result (a prefetch that ended before its predecessor
    would let the consumer read stale data), and the prefetched weight is unchanged."""
    if not can_prefetch(torch.empty(1, device="cuda")):
        pytest.skip("L2 bulk prefetch needs sm_90+")
    from kiln.kernels.swiglu import swiglu

    torch.manual_seed(0)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)  # 32 MB
    w0 = w.clone()
    h = torch.randn(16, 2 * 8192, device="cuda", dtype=torch.bfloat16)
    want = swiglu(swiglu(h, None), None).float().sum()

    def step():
        a = swiglu(h, None)  # PDL-launched kiln kernels on both sides: each waits only for the one before
        l2_prefetch([(w, w.nbytes), (h, h.nbytes)])
        return swiglu(a, None).float().sum()

    for _ in range(20):
        assert step() == want
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for _ in range(10):
        g.replay()
        torch.cuda.synchronize()
        assert out == want
    assert torch.equal(w, w0)
