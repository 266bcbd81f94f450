"""Token permutation (kernels/moe_permute.py): the routing plan against a per-pair loop (dropless and
with a capacity), and permute / unpermute with the fused routing weights against float64 references,
forward and every gradient; the custom ops under opcheck; bf16 on the GPU."""

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.moe_permute import (
    expert_capacity,
    permute,
    permute_op,
    permute_ref,
    routing_plan,
    unpermute,
    unpermute_bwd_op,
    unpermute_op,
    unpermute_ref,
)

from ._tolerance import check_op


def _routing(N, k, E, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    if skew:  # most tokens to expert 0 and 1: drops under a capacity, empty experts
        scores = torch.rand(N, E, generator=g) + torch.linspace(2, 0, E)
    else:
        scores = torch.rand(N, E, generator=g)
    return scores.topk(k, dim=1).indices


def _plan_by_loop(idx, E, capacity):
    """The plan the docstring describes, pair by pair in Python."""
    N, k = idx.shape
    pairs = [(int(idx[n, j]), n * k + j) for n in range(N) for j in range(k)]
    dest, src, rows_of = [-1] * (N * k), [], []
    for e in range(E):
        mine = [p for ee, p in pairs if ee == e]  # in pair order: the stable sort
        kept = mine if capacity is None else mine[:capacity]
        rows_of.append(len(kept) if capacity is None else capacity)
        for p in kept:
            dest[p] = len(src)
            src.append(p)
        if capacity is not None:
            src += [-1] * (capacity - len(kept))
    offsets = [0]
    for c in rows_of:
        offsets.append(offsets[-1] + c)
    counts = [sum(1 for ee, _ in pairs if ee == e) for e in range(E)]
    dropped = [0 if capacity is None else max(0, c - capacity) for c in counts]
    return src, dest, offsets, counts, dropped


@pytest.mark.parametrize("N, k, E, capacity, skew", [
    (7, 2, 4, None, False), (13, 1, 8, None, True), (9, 8, 8, None, False),
    (11, 2, 4, 3, True), (6, 1, 3, 1, False), (5, 2, 64, 1, True),
])  # fmt: skip
def test_routing_plan_matches_loop(N, k, E, capacity, skew):
    idx = _routing(N, k, E, seed=N + k, skew=skew)
    plan = routing_plan(idx, E, capacity)
    src, dest, offsets, counts, dropped = _plan_by_loop(idx, E, capacity)
    assert plan.src.tolist() == src and plan.dest.tolist() == dest
    assert plan.offsets.tolist() == offsets and plan.counts.tolist() == counts
    assert plan.dropped.tolist() == dropped and plan.top_k == k
    given = routing_plan(idx, E, capacity, counts=plan.counts)  # the router's counts: the same plan
    assert all(torch.equal(a, b) for a, b in zip(given[:5], plan[:5]))
    assert sum(dropped) == sum(d < 0 for d in dest)  # drop accounting: every dropped pair counted once


def _ops(plan):
    def op(x, y, w):
        with use_backend("triton"):
            return permute(x, plan), unpermute(y, plan, w)

    def ref(x, y, w):
        return permute_ref(x, plan.src, plan.top_k), unpermute_ref(y, plan.dest, w, plan.top_k)

    return op, ref


@pytest.mark.parametrize("N, k, E, capacity, d", [
    (7, 2, 4, None, 10), (5, 1, 1, None, 33), (6, 8, 8, None, 16), (11, 2, 4, 3, 40), (9, 2, 64, 1, 8),
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_permute_unpermute_match_float64(N, k, E, capacity, d, dtype):
    plan = routing_plan(_routing(N, k, E, seed=d, skew=capacity is not None), E, capacity)
    g = torch.Generator().manual_seed(d)
    x = torch.randn(N, d, generator=g).to(dtype)
    y = torch.randn(plan.src.shape[0], d, generator=g).to(dtype)
    w = torch.rand(N, k, generator=g)  # float32 routing weights whatever the rows' dtype
    op, ref = _ops(plan)
    check_op(op, ref, [x, y, w])


def test_permute_roundtrip_is_sum_of_weights():
    # permute then unpermute: each token comes back times the sum of its kept weights (1 when dropless)
    idx = _routing(10, 2, 4, seed=3)
    plan = routing_plan(idx, 4)
    x = torch.randn(10, 24)
    w = torch.softmax(torch.randn(10, 2), -1)
    with use_backend("triton"):
        back = unpermute(permute(x, plan), plan, w)
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)


def test_plan_and_permute_errors():
    with pytest.raises(ValueError, match="integer"):
        routing_plan(torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match="positive"):
        routing_plan(torch.zeros(3, 2, dtype=torch.long), 4, capacity=0)
    with pytest.raises(ValueError, match="positive"):
        expert_capacity(8, 2, 4, 0.0)
    assert expert_capacity(10, 2, 4, 1.25) == 7  # ceil(1.25 * 20 / 4)
    plan = routing_plan(torch.zeros(3, 2, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="N \\* top_k"):
        permute(torch.randn(4, 8), plan)
    with pytest.raises(ValueError, match="weights"):
        unpermute(torch.randn(6, 8), plan, torch.rand(2, 2))


def test_permute_opcheck():
    plan = routing_plan(_routing(5, 2, 4, seed=1, skew=True), 4, capacity=2)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 12, generator=g, requires_grad=True)
    y = torch.randn(8, 12, generator=g, requires_grad=True)
    w = torch.rand(5, 2, generator=g, requires_grad=True)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    with use_backend("triton"):
        torch.library.opcheck(permute_op, (x, plan.src, plan.dest, 2), test_utils=checks)
        torch.library.opcheck(unpermute_op, (y, plan.src, plan.dest, w, 2), test_utils=checks)
        torch.library.opcheck(unpermute_op, (y, plan.src, plan.dest, None, 2), test_utils=checks)
        dout = torch.randn(5, 12, generator=g)
        bwd_args = (dout, y.detach(), plan.src, plan.dest, w.detach(), 2)
        torch.library.opcheck(unpermute_bwd_op, bwd_args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.gpu
@pytest.mark.parametrize("capacity", [None, 300])
def test_permute_gpu_bf16(capacity):
    idx = _routing(2049, 2, 8, seed=0, skew=True).cuda()
    plan = routing_plan(idx, 8, capacity)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2049, 4096, generator=g, device="cuda").bfloat16()
    y = torch.randn(plan.src.shape[0], 4096, generator=g, device="cuda").bfloat16()
    w = torch.rand(2049, 2, generator=g, device="cuda")
    op, ref = _ops(plan)
    # dweights (float32) is a 4096-term dot product accumulated in float32: an absolute error of about
    # sqrt(4096) * 6e-8 * |terms| next to zero-crossing sums, past the float32 table's 1e-5 atol; the bf16
    # gradients (dx, dy) are one rounding of an exact float32 sum, far inside 1e-4 + 1.6e-2 relative
    check_op(op, ref, [x, y, w], grad_atol=1e-4)
