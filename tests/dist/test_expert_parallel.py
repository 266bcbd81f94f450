"""kiln.dist.expert_parallel's dispatch against the one-process experts, on 2 gloo ranks: outputs, the
gradients of the tokens, of the routing weights and of each rank's experts, for balanced and one-sided
routing (a rank that receives no rows at all), uneven token counts per rank, and both local paths (the
eager loop; the grouped GEMM, through its reference on the CPU). The same for the experts split over
tensor-parallel ranks (every rank holding all the tokens, the partial outputs summed)."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.model.moe import Experts

E, K, D, HIDDEN = 4, 2, 8, 6
TOKENS = (5, 3)  # tokens on rank 0 and rank 1
# routing: "balanced" draws experts at random; "one_sided" sends every pair to rank 0's experts (0 and 1),
# so rank 1 receives nothing and its experts' gradients must come out zero, not missing
CASES = [(route, grouped) for route in ("balanced", "one_sided") for grouped in (False, True)]


def _inputs(route: str):
    """Everything both sides use: the full experts' weights, each rank's tokens, routing and output
    gradient (float64, so the comparison is exact up to summation order)."""
    g = torch.Generator().manual_seed(3)
    w1 = torch.randn(E, 2 * HIDDEN, D, generator=g, dtype=torch.float64)
    w2 = torch.randn(E, D, HIDDEN, generator=g, dtype=torch.float64)
    per_rank = []
    for n in TOKENS:
        x = torch.randn(n, D, generator=g, dtype=torch.float64)
        hi = E if route == "balanced" else E // 2
        idx = torch.stack([torch.randperm(hi, generator=g)[:K] for _ in range(n)])  # k distinct experts
        w = torch.rand(n, K, generator=g, dtype=torch.float64)
        grad = torch.randn(n, D, generator=g, dtype=torch.float64)
        per_rank.append((x, idx, w / w.sum(1, keepdim=True), grad))
    return w1, w2, per_rank


def _reference(route: str):
    """One process over both ranks' tokens: (out, dx, dweights) per rank, dW1, dW2."""
    w1, w2, per_rank = _inputs(route)
    ex = Experts(E, D, HIDDEN).double()
    with torch.no_grad():
        ex.gate_up_proj.copy_(w1)
        ex.down_proj.copy_(w2)
    x = torch.cat([p[0] for p in per_rank]).requires_grad_()
    w = torch.cat([p[2] for p in per_rank]).requires_grad_()
    out = ex(x, torch.cat([p[1] for p in per_rank]), w)
    out.backward(torch.cat([p[3] for p in per_rank]))
    parts = [(o, dx, dw) for o, dx, dw in zip(*(t.detach().split(TOKENS) for t in (out, x.grad, w.grad)))]
    return parts, ex.gate_up_proj.grad, ex.down_proj.grad


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    from torch.distributed.device_mesh import init_device_mesh

    from kiln.dist.expert_parallel import ExpertParallelExperts, TensorParallelExperts, sum_over

    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        results = {}
        for route, grouped in CASES:
            w1, w2, per_rank = _inputs(route)
            full = Experts(E, D, HIDDEN).double()
            with torch.no_grad():
                full.gate_up_proj.copy_(w1)
                full.down_proj.copy_(w2)
            ep = ExpertParallelExperts(full, mesh)
            x, idx, w, grad = per_rank[rank]
            x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = ep.grouped(x, idx, w) if grouped else ep(x, idx, w)
            out.backward(grad)
            results[(route, grouped)] = {
                "out": out.detach(),
                "dx": x.grad,
                "dw": w.grad,
                # this rank's experts; the dispatch scales them by 1 / ep (FSDP2 averages the rest)
                "dW1": ep.gate_up_proj.grad.to_local() * world,
                "dW2": ep.down_proj.grad.to_local() * world,
            }
            # tensor parallel: both ranks hold all the tokens; each returns its experts' partial output
            tp = TensorParallelExperts(full, mesh)
            x = torch.cat([p[0] for p in per_rank]).requires_grad_()
            w = torch.cat([p[2] for p in per_rank]).requires_grad_()
            idx = torch.cat([p[1] for p in per_rank])
            out = sum_over(tp.grouped(x, idx, w) if grouped else tp(x, idx, w), mesh.get_group())
            out.backward(torch.cat([p[3] for p in per_rank]))
            results[("tp", route, grouped)] = {
                "out": out.detach(),
                "dx": x.grad,
                "dw": w.grad,
                "dW1": tp.gate_up_proj.grad.to_local(),  # whole on the rank that holds the expert
                "dW2": tp.down_proj.grad.to_local(),
            }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ep")
    mp.spawn(_worker, args=(2, str(out / "init"), str(out)), nprocs=2)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("route, grouped", CASES)
def test_dispatch_matches_one_process(ranks, route, grouped):
    parts, dw1, dw2 = _reference(route)
    local = E // 2
    for r, got in enumerate(ranks):
        got = got[(route, grouped)]
        out, dx, dw = parts[r]
        for name, want in (("out", out), ("dx", dx), ("dw", dw)):
            torch.testing.assert_close(got[name], want, rtol=1e-12, atol=1e-12, msg=f"rank {r} {name}")
        mine = slice(r * local, (r + 1) * local)
        torch.testing.assert_close(got["dW1"], dw1[mine], rtol=1e-12, atol=1e-12, msg=f"rank {r} dW1")
        torch.testing.assert_close(got["dW2"], dw2[mine], rtol=1e-12, atol=1e-12, msg=f"rank {r} dW2")
        if route == "one_sided" and r == 1:  # nothing arrived: zero gradients, present
            assert not got["dW1"].any() and not got["dW2"].any()


@pytest.mark.slow
@pytest.mark.parametrize("route, grouped", CASES)
def test_tensor_parallel_split_matches_one_process(ranks, route, grouped):
    parts, dw1, dw2 = _reference(route)
    whole = {name: torch.cat([p[i] for p in parts]) for i, name in enumerate(("out", "dx", "dw"))}
    local = E // 2
    for r, got in enumerate(ranks):
        got = got[("tp", route, grouped)]
        for name, want in whole.items():  # summed over tp, every rank holds the whole
            torch.testing.assert_close(got[name], want, rtol=1e-12, atol=1e-12, msg=f"rank {r} {name}")
        mine = slice(r * local, (r + 1) * local)
        torch.testing.assert_close(got["dW1"], dw1[mine], rtol=1e-12, atol=1e-12, msg=f"rank {r} dW1")
        torch.testing.assert_close(got["dW2"], dw2[mine], rtol=1e-12, atol=1e-12, msg=f"rank {r} dW2")
