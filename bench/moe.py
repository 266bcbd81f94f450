"""Mixture-of-experts benchmark on the H200: kiln's router / permutation / grouped GEMM kernels against a
per-expert loop, padded batched matmul, torch._grouped_mm and a dense matmul of the same FLOPs.

    python bench/moe.py                 # on a CUDA GPU (about 3 minutes) -> bench/results/moe.json
    python bench/moe.py --smoke         # tiny shapes on the CPU through the interpreter (seconds)

Shapes (one MoE layer's experts, bf16): Mixtral-8x7B (8 experts top-2, d 4096, FFN 14336), Qwen3-30B-A3B-
like (128 top-8, 2048 / 768), DeepSeek-V2-Lite-like (64 top-6, 2048 / 1408, plus a shared SwiGLU expert of
2 x 1408 that every implementation runs the same way). Routing: "balanced" (token n takes experts
(n*k + j) mod E: equal counts) and "zipf" (expert popularity ~ 1 / rank^1.2, k distinct experts per
token by Gumbel top-k: a few hot experts, many cold or empty).

Cases:
- "experts" (prefill, 1k / 4k / 16k tokens, forward and forward+backward): x (N, d), the routing (N, k)
  and its weights -> out (N, d): gather into expert order, gate/up GEMM, SwiGLU, down GEMM, weighted
  combine. kiln: moe_permute + moe_gemm (+ kernels/swiglu); "kiln_fused": the same with the SwiGLU fused
  into the gate/up GEMM (grouped_swiglu; "fused_speedup" > 1 says it pays); "loop": the model's eager Experts.forward
  (one host sync, a matmul pair per expert); "padded_bmm": every expert padded to the largest count
  (a host sync for it), torch.bmm; "grouped_mm": the same gather with torch ops, torch._grouped_mm (CUDA
  sm90+; an error is recorded elsewhere), index_add combine; "dense": one expert's weights over all N*k
  rows (the same FLOPs as one matmul pair: the roofline the grouped GEMM chases).
- "gemm" (4k tokens): the gate/up projection alone over expert-sorted rows: kiln grouped_linear vs
  torch._grouped_mm vs dense F.linear, forward and forward+backward (dx and dw).
- "decode" (batch 1 / 8 / 64, forward, CUDA-graph replay where capturable: the loop syncs, so it is
  timed eagerly; the decode kernels' two forms, kiln_decode_pairs and kiln_decode_experts, side by
  side at every batch, experts_vs_pairs their ratio): the unit is GB/s over the active experts' weights
  (each read once), against the device copy bandwidth measured at the start of the run (kiln.profile.ceilings; copy counts read + write,
  the weights are only read: a reference point, not a ceiling).
- "router" (16k tokens): kiln's router (top-k, weights, counts, aux and z losses, forward+backward)
  against the eager formula of kiln.model.moe.
- "tune": the gate/up grouped GEMM's forward and dw at several launch configs (4k tokens and decode
  batch 8, balanced), the default marked: the data to set mm_config's choices from.
- "train": a Mixtral-style kiln model (d 1024, 4 layers, 8 experts top-2, FFN 2816, 8 x 2048 tokens,
  bf16 autocast) forward + backward in tokens/s, KernelConfig.moe "kiln" against "eager".
TFLOP/s count 2 * rows * (d * 2I + I * d) per forward (x3 forward+backward), plus the shared expert;
ratios are peer time / kiln time (> 1: kiln faster). Times: kiln.profile.timing (do_bench medians over
interleaved rounds, L2 flushed). A failing implementation records its error and the run goes on; past
120 s the slow peers (loop, padded_bmm) are skipped, past --budget (165 s) no new case starts (listed in
"skipped_for_time"); the phases run the goal points of every shape first.
"""

from __future__ import annotations

import os
import sys
import zlib
from types import SimpleNamespace

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import torch.nn.functional as F

from kiln.kernels.dispatch import use_backend
from kiln.kernels.moe_decode import (
    DecodeTiles,
    add_shared_slots,
    decode_tiles,
    expert_rows,
    expert_tiles,
    moe_decode_fwd,
    shared_mlp_as_experts,
    stack_shared_experts,
    use_decode,
)
from kiln.kernels.moe_gemm import (
    DW_TMA,
    TMA_BIG,
    dw_config,
    grouped_dw,
    grouped_linear,
    grouped_mm,
    grouped_swiglu,
    mm_config,
)
from kiln.kernels.moe_permute import permute, routing_plan, unpermute
from kiln.kernels.moe_router import route
from kiln.kernels.swiglu import swiglu
from kiln.model.moe import Experts
from kiln.profile.ceilings import fraction
from kiln.profile.harness import BenchRun, bench_parser

SHAPES = {  # name: (E, k, d, I, shared hidden or 0)
    "mixtral-8x7b": (8, 2, 4096, 14336, 0),
    "qwen3-30b-a3b": (128, 8, 2048, 768, 0),
    "deepseek-v2-lite": (64, 6, 2048, 1408, 2816),
}
SMOKE_SHAPES = {"tiny+shared": (4, 2, 32, 16, 32)}
PREFILL = (4096, 16384, 1024)  # the goal points (>= 4k tokens) first
DECODE = (1, 8, 64)
# A decode step reads each layer's experts from HBM. A decode case is timed over enough copies of the
# weights, one after another, that no copy's bytes are still in the 50 MB L2 when it is read again (copies x
# active bytes >= L2_ROTATION_BYTES, at most MAX_COPIES; Mixtral-like's hundreds of MB need none); --warm
# times one copy replayed back to back, as the runs before 2026-12-04 did
L2_ROTATION_BYTES = 256 * 2**20
MAX_COPIES = 8
TIME_BUDGET_S = 120.0  # past this: no loop / padded peers (a GPU run's share is ~3 minutes in all)
HARD_BUDGET_S = 165.0  # past this: no new case (recorded as skipped)
SLOW_PEERS = ("loop", "padded_bmm")


# ---------------------------------------------------------------------------------------------- routing
def make_routing(N: int, E: int, k: int, kind: str, device, gen: torch.Generator):
    """(expert_idx (N, k) int64, weights (N, k) float32 summing to 1 per token)."""
    if kind == "balanced":
        idx = (torch.arange(N * k, device=device) % E).view(N, k)
    else:  # zipf: Gumbel top-k over log popularity, so each token's k experts are distinct
        pop = -1.2 * torch.log(torch.arange(1, E + 1, device=device, dtype=torch.float32))
        u = torch.rand(N, E, generator=gen, device=device).clamp_(1e-9, 1 - 1e-9)
        idx = (pop - torch.log(-torch.log(u))).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(N, k, generator=gen, device=device), -1)
    return idx, w


# ------------------------------------------------------------------------------------- implementations
def kiln_experts(x, idx, w, w1, w2):
    """The model's dispatch (Experts.grouped): the decode kernels at inference up to 64 tokens."""
    if use_decode(idx.shape[0]) and not torch.is_grad_enabled():
        return moe_decode_fwd(x, idx, w, w1, w2)
    return kiln_grouped_experts(x, idx, w, w1, w2)


def kiln_grouped_experts(x, idx, w, w1, w2):
    """The grouped path at any batch: routing plan, permute, grouped GEMM, SwiGLU, grouped GEMM, combine."""
    plan = routing_plan(idx, w1.shape[0])
    h = swiglu(grouped_linear(permute(x, plan), w1, plan.offsets), None)
    return unpermute(grouped_linear(h, w2, plan.offsets), plan, w)


def kiln_fused_experts(x, idx, w, w1, w2):
    """kiln with the SwiGLU fused into the gate/up GEMM (kernels/moe_gemm.py grouped_swiglu)."""
    plan = routing_plan(idx, w1.shape[0])
    h = grouped_swiglu(permute(x, plan), w1, plan.offsets)
    return unpermute(grouped_linear(h, w2, plan.offsets), plan, w)


def loop_experts(x, idx, w, w1, w2):
    """The model's eager reference (kiln.model.moe.Experts.forward) on these weights."""
    return Experts.forward(SimpleNamespace(gate_up_proj=w1, down_proj=w2), x, idx, w)


def _sorted(x, idx, E):
    k = idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    return order, order // k, counts


def _swiglu_eager(h):
    g, u = h.chunk(2, -1)
    return F.silu(g) * u


def grouped_mm_experts(x, idx, w, w1, w2):
    order, token, counts = _sorted(x, idx, w1.shape[0])
    offs = counts.cumsum(0, dtype=torch.int32)
    h = _swiglu_eager(torch._grouped_mm(x[token], w1.transpose(1, 2), offs=offs))
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    return torch.zeros_like(x).index_add_(0, token, (y.float() * w.reshape(-1)[order, None]).to(x.dtype))


def padded_experts(x, idx, w, w1, w2):
    E = w1.shape[0]
    order, token, counts = _sorted(x, idx, E)
    C = int(counts.max())  # the host sync padding needs
    e_sorted = idx.reshape(-1)[order]
    rank = torch.arange(order.numel(), device=x.device) - (counts.cumsum(0) - counts)[e_sorted]
    xp = x.new_zeros(E, C, x.shape[1]).index_put((e_sorted, rank), x[token])
    yp = torch.bmm(_swiglu_eager(torch.bmm(xp, w1.transpose(1, 2))), w2.transpose(1, 2))
    y = yp[e_sorted, rank]
    return torch.zeros_like(x).index_add_(0, token, (y.float() * w.reshape(-1)[order, None]).to(x.dtype))


def dense_pair(xr, w1e, w2e):
    return F.linear(_swiglu_eager(F.linear(xr, w1e)), w2e)


def with_shared(f, shared):
    """f plus the shared expert (the same eager SwiGLU MLP in every implementation)."""
    if shared is None:
        return f
    s1, s2 = shared

    def g(x, *rest):
        return f(x, *rest) + dense_pair(x, s1, s2)

    return g


def weight_copies(b: Bench, weights, nbytes: int) -> list:
    """[weights] and clones of it: enough that the copies' active bytes reach L2_ROTATION_BYTES (at most
    MAX_COPIES; one in a smoke run or with --warm). Each is (w1, w2, shared, slots) as make_weights gives."""
    n = 1 if b.smoke or b.warm else min(MAX_COPIES, max(1, -(-L2_ROTATION_BYTES // max(1, nbytes))))

    def clone(t):
        return None if t is None else tuple(u.clone() for u in t)

    w1, w2, shared, slots = weights
    return [weights] + [(w1.clone(), w2.clone(), clone(shared), clone(slots)) for _ in range(n - 1)]


def in_turn(calls: list):
    """One call that runs `calls` in order: a variant over every weight copy (its time / len(calls) is one
    layer's, each copy read cold)."""

    def run():
        for c in calls:
            c()

    return run


def same_size_copy(b: Bench, nbytes: int, n: int):
    """A device copy moving nbytes (half read, half written) n times over n buffer pairs in turn: what a
    kernel this short reaches, timed as the decode variants are."""
    pairs = [torch.empty(nbytes // 2, dtype=torch.uint8, device=b.dev) for _ in range(2 * n)]
    return in_turn([lambda s=pairs[2 * i], d=pairs[2 * i + 1]: d.copy_(s) for i in range(n)])


# ------------------------------------------------------------------------------------------- the bench
class Bench:
    def __init__(self, run: BenchRun):
        self.run = run
        self.timer = run.timer
        self.smoke = run.smoke
        self.dev = run.device
        self.dtype = torch.float32 if self.smoke else torch.bfloat16  # the interpreter's bf16 dot is wrong
        self.gen = torch.Generator(device=self.dev).manual_seed(0)
        self.cases: list[dict] = []
        self.warm = False  # decode cases: one weight copy replayed L2-warm (--warm), not a rotation of copies

    def randn(self, *shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=self.gen, device=self.dev)).to(self.dtype)

    def over_budget(self, limit: float = TIME_BUDGET_S) -> bool:
        return not self.smoke and self.run.elapsed() > limit

    def time(self, fns: dict, graph: bool = False) -> dict[str, dict]:
        """{name: {"ms": ..} or {"error": ..}}: warm each (recording failures), then interleaved rounds."""
        res, ok = {}, {}
        for name, fn in fns.items():
            if name in SLOW_PEERS and self.over_budget():
                res[name] = {"error": "skipped: time budget"}
                continue
            try:
                fn()
                ok[name] = fn
            except Exception as e:  # noqa: BLE001 - record and go on
                res[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        for name, t in self.timer.interleaved(ok).items():
            res[name] = {"ms": round(t["ms"], 4), "rounds_ms": t["rounds"]}
        if graph and not self.smoke:
            for name, fn in ok.items():
                try:
                    res[name]["graph_ms"] = round(self.timer.graph(fn), 4)
                except Exception as e:  # noqa: BLE001 - a host sync cannot be captured: eager time only
                    res[name]["graph_ms"] = f"{type(e).__name__}: {str(e)[:120]}"
        return res

    def record(self, entry: dict, res: dict, flops: float | None = None, nbytes: float | None = None):
        ceil = self.run.ceilings
        for v in res.values():
            ms = v.get("graph_ms") if isinstance(v.get("graph_ms"), float) else v.get("ms")
            if ms is None:
                continue
            if flops:
                v["TFLOPs"] = round(flops / ms / 1e9, 1)
                v["frac_matmul"] = fraction(v["TFLOPs"], ceil.get("bf16_matmul_TFLOPs"))
            if nbytes:
                v["GBps"] = round(nbytes / ms / 1e6, 1)
                v["frac_copy"] = fraction(v["GBps"] / 1e3, ceil.get("copy_TBps"))
        entry["results"] = res
        best = {n: v.get("graph_ms") if isinstance(v.get("graph_ms"), float) else v.get("ms")
                for n, v in res.items() if not n.startswith("kiln") and n not in ("dense", "copy")
                and "ms" in v}  # fmt: skip
        kiln = res.get("kiln", {})
        k_ms = kiln.get("graph_ms") if isinstance(kiln.get("graph_ms"), float) else kiln.get("ms")
        if best and k_ms:
            peer = min(best, key=best.get)
            entry.update(best_peer=peer, ratio=round(best[peer] / k_ms, 3))
        for peer in ("grouped_mm", "loop"):
            ms = best.get(peer)
            if ms and k_ms:
                entry[f"ratio_vs_{peer}"] = round(ms / k_ms, 3)
        grouped = res.get("kiln_grouped", {})
        g_ms = grouped.get("graph_ms") if isinstance(grouped.get("graph_ms"), float) else grouped.get("ms")
        if g_ms and k_ms and grouped is not kiln:
            entry["speedup_vs_kiln_grouped"] = round(
                g_ms / k_ms, 3
            )  # the decode kernels against the old path
        fused = res.get("kiln_fused", {})
        f_ms = fused.get("graph_ms") if isinstance(fused.get("graph_ms"), float) else fused.get("ms")
        if f_ms and k_ms:
            entry["fused_speedup"] = round(k_ms / f_ms, 3)  # > 1: the fused SwiGLU pays
        self.cases.append(entry)
        cells = " ".join(
            f"{n}={v['ms']:.3f}ms" + (f"/{v['TFLOPs']}TF" if "TFLOPs" in v else "")
            + (f"/{v['GBps']}GB/s" if "GBps" in v else "") if "ms" in v else f"{n}=ERR"
            for n, v in res.items()
        )  # fmt: skip
        self.run.log(f"{entry['case']:<7} {entry['shape']:<17} {entry.get('tokens', '')!s:>6} "
                     f"{entry.get('routing', ''):<8} {entry.get('mode', ''):<8} {cells}"
                     f" ratio={entry.get('ratio')} vs {entry.get('best_peer')}")  # fmt: skip


def fwd_bwd(f, inputs: list[torch.Tensor], dy: torch.Tensor):
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]

    def run():
        out = f(*leaves)
        return torch.autograd.grad(out, [t for t in leaves if t.requires_grad], dy)

    return run


def fwd(f, inputs: list[torch.Tensor]):
    ins = [t.detach() for t in inputs]

    def run():
        with torch.no_grad():
            return f(*ins)

    return run


def layer_flops(rows: int, d: int, inter: int) -> float:
    return 2.0 * rows * (d * 2 * inter + inter * d)


def experts_case(
    b: Bench, shape: str, N: int, routing: str, weights, mode_list=("fwd", "fwd+bwd"), quick: bool = False
):
    E, k, d, inter, sh = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    w1, w2, shared, _ = weights
    x = b.randn(N, d)
    idx, w = make_routing(N, E, k, routing, b.dev, b.gen)
    xr = b.randn(N * k, d)  # the dense peer's rows (same count as the routed pairs)
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    flops = layer_flops(N * k, d, inter) + (layer_flops(N, d, sh // 2) if sh else 0.0)
    impls = {"kiln": kiln_experts, "kiln_fused": kiln_fused_experts, "grouped_mm": grouped_mm_experts,
             "loop": loop_experts, "padded_bmm": padded_experts}  # fmt: skip
    if quick:  # what changed and its peer: kiln (the TMA kernel on large experts) against torch._grouped_mm
        impls = {"kiln": kiln_experts, "grouped_mm": grouped_mm_experts}
    with torch.no_grad():
        err = (kiln_experts(x, idx, w, w1, w2).float() - loop_experts(x, idx, w, w1, w2).float()).abs().max()
    for mode in mode_list:
        fns = {}
        for name, f in impls.items():
            f = with_shared(f, shared)
            ins = [x, idx, w, w1, w2]
            fns[name] = fwd(f, ins) if mode == "fwd" else fwd_bwd(f, ins, torch.ones_like(x))
        dense_ins = [xr, w1[0], w2[0]]  # one expert's weights over all N*k rows: the FLOPs of the routed part
        fns["dense"] = (
            fwd(dense_pair, dense_ins)
            if mode == "fwd"
            else fwd_bwd(dense_pair, dense_ins, torch.ones_like(xr))
        )
        res = b.time(fns)
        entry = dict(case="experts", shape=shape, tokens=N, routing=routing, mode=mode,
                     E=E, k=k, d=d, I=inter, shared=sh, max_count=int(counts.max()),
                     empty_experts=int((counts == 0).sum()))  # fmt: skip
        if routing == "zipf":
            entry["tokens_per_expert"] = counts.tolist()
        if mode == "fwd":
            entry["kiln_max_abs_err_vs_loop"] = float(err)
        b.record(entry, res, flops=flops * (3 if mode != "fwd" else 1))


def gemm_case(b: Bench, shape: str, N: int, routing: str, weights):
    E, k, d, inter, _ = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    w1 = weights[0]
    idx, _ = make_routing(N, E, k, routing, b.dev, b.gen)
    plan = routing_plan(idx, E)
    xs = b.randn(N * k, d)
    offs = plan.offsets
    ends = offs[1:].contiguous()
    flops = 2.0 * N * k * d * 2 * inter
    impls = {
        "kiln": (lambda xs, w: grouped_linear(xs, w, offs), [xs, w1]),
        "grouped_mm": (lambda xs, w: torch._grouped_mm(xs, w.transpose(1, 2), offs=ends), [xs, w1]),
        "dense": (lambda xs, w: F.linear(xs, w), [xs, w1[0]]),
    }
    for mode in ("fwd", "fwd+bwd"):
        fns = {}
        for name, (f, ins) in impls.items():
            dy = torch.ones(N * k, w1.shape[1], device=b.dev, dtype=b.dtype)
            fns[name] = fwd(f, ins) if mode == "fwd" else fwd_bwd(f, ins, dy)
        entry = dict(
            case="gemm", shape=shape, tokens=N, routing=routing, mode=mode, M=N * k, N=2 * inter, K=d
        )
        b.record(entry, b.time(fns), flops=flops * (3 if mode != "fwd" else 1))


def decode_pairs(x, idx, w, w1, w2):
    """The decode kernels' pairs form at any batch: each (token, expert) pair streams its expert."""
    return moe_decode_fwd(x, idx, w, w1, w2, form="pairs")


def decode_experts(x, idx, w, w1, w2):
    """The decode kernels' experts form at any batch: each distinct expert streamed once for its tokens."""
    return moe_decode_fwd(x, idx, w, w1, w2, form="experts")


def decode_experts_one_row(x, idx, w, w1, w2):
    """The experts form with one row a pass at a few tokens: the per-pair kernels of one token (up, the
    preloading down, the combine) for every pair, as the pairs form streams them, but with the preload."""
    return moe_decode_fwd(x, idx, w, w1, w2, form="experts", rows=1)


def decode_experts_rows16(x, idx, w, w1, w2):
    """The experts form with 16-row tl.dot passes (its default from 3 tokens): each expert read once."""
    return moe_decode_fwd(x, idx, w, w1, w2, form="experts", rows=16)


def decode_experts_no_preload(x, idx, w, w1, w2):
    """The experts form at one token with its down kernel waiting for the up kernel before any load (the
    form before `preload_down`): the A/B of the preload."""
    return moe_decode_fwd(x, idx, w, w1, w2, form="experts", preload=False)


def decode_inputs(b: Bench, shape: str, B: int, routing: str):
    """A decode case's x (B, d), routing (B, k) and weights, its active experts and the bytes of their
    weights (with the shared expert's where the shape has one: read once per step as well). The routing is
    drawn from a generator seeded by (shape, B, routing), not the run's: at a few tokens the Zipf draw sets
    how many experts are active (14-22 for 24 slots at 3 tokens), so every script and run that times a
    case (the quick case, bench/experiments/moe_decode_batch.py) times the same draw."""
    E, k, d, inter, sh = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    x = b.randn(B, d)
    gen = torch.Generator(device=b.dev).manual_seed(zlib.crc32(f"{shape}/{B}/{routing}".encode()))
    idx, w = make_routing(B, E, k, routing, b.dev, gen)
    active = int(torch.unique(idx).numel())
    elem = torch.finfo(b.dtype).bits // 8
    return x, idx, w, active, active * 3 * inter * d * elem + (3 * (sh // 2) * d * elem if sh else 0)


def decode_case(b: Bench, shape: str, B: int, routing: str, weights, quick: bool = False):
    """kiln (the model's dispatch: the decode kernels' experts form up to 64 tokens),
    kiln_decode_pairs and kiln_decode_experts (the decode kernels' two forms at every batch, past
    use_decode's 64 tokens too: which form wins where, and where the grouped path takes over),
    kiln_grouped (the grouped path), torch._grouped_mm, and "copy": a device copy moving the same number
    of bytes (half read, half written) at this size, the bandwidth reachable by a kernel this short.
    Quick: no loop, no fused."""
    E, k = (SMOKE_SHAPES if b.smoke else SHAPES)[shape][:2]
    w1, w2, shared, slots = weights
    x, idx, w, active, nbytes = decode_inputs(b, shape, B, routing)
    copies = weight_copies(b, weights, nbytes)
    impls = {"kiln": kiln_experts, "kiln_grouped": kiln_grouped_experts, "grouped_mm": grouped_mm_experts}
    impls |= {"kiln_decode_pairs": decode_pairs, "kiln_decode_experts": decode_experts}
    if B == 1:
        impls["kiln_decode_experts_no_preload"] = decode_experts_no_preload
    elif B <= 4:  # where the experts form's passes change from one row (2 tokens) to 16 (3 and more)
        impls["kiln_decode_experts_one_row"] = decode_experts_one_row
        impls["kiln_decode_experts_rows16"] = decode_experts_rows16
    if not quick:
        impls |= {"kiln_fused": kiln_fused_experts, "loop": loop_experts}
    fns = {
        n: in_turn([fwd(with_shared(f, c[2]), [x, idx, w, c[0], c[1]]) for c in copies])
        for n, f in impls.items()
    }
    slots_err = None
    if slots is not None:  # the shared expert as more slots of the routed kernels (moe_decode's docs)
        W1, W2 = slots
        ids, ws = add_shared_slots(idx, w, E, W1.shape[0] - E)
        # the model's dispatch, the stacked slots of each copy
        fns["kiln_shared_slots"] = in_turn([fwd(kiln_experts, [x, ids, ws, *c[3]]) for c in copies])
        with torch.no_grad():
            slots_err = float((kiln_experts(x, ids, ws, W1, W2).float()
                               - with_shared(kiln_experts, shared)(x, idx, w, w1, w2).float()).abs().max())  # fmt: skip
    fns["copy"] = same_size_copy(b, nbytes, len(copies))
    with torch.no_grad():
        grouped = kiln_grouped_experts(x, idx, w, w1, w2).float()
        err = (kiln_experts(x, idx, w, w1, w2).float() - grouped).abs()
        err_forms = (
            decode_experts(x, idx, w, w1, w2).float() - decode_pairs(x, idx, w, w1, w2).float()
        ).abs()
    counts = torch.bincount(idx.reshape(-1), minlength=E)
    entry = dict(case="decode", shape=shape, tokens=B, routing=routing, mode="fwd", active_experts=active,
                 pairs_per_active_expert=round(B * k / active, 2), max_tokens_per_expert=int(counts.max()),
                 weight_bytes=nbytes, weight_copies=len(copies), path="decode" if use_decode(B) else "grouped",
                 form="experts" if use_decode(B) else None,
                 experts_rows=expert_rows(B, b.dtype), max_abs_diff_vs_grouped=float(err.max()),
                 max_abs_diff_experts_vs_pairs=float(err_forms.max()))  # fmt: skip
    if slots_err is not None:  # the slots' sum rounds once, the separate MLP's adds two bf16 outputs
        entry["max_abs_diff_shared_slots_vs_separate"] = slots_err
    b.record(entry, b.time(fns, graph=True), nbytes=nbytes * len(copies))
    # > 1: the experts form is faster than the pairs form at this batch and routing
    ms = {n: _best_ms(entry["results"].get(n, {})) for n in ("kiln_decode_pairs", "kiln_decode_experts")}
    if all(ms.values()):
        entry["experts_vs_pairs"] = round(ms["kiln_decode_pairs"] / ms["kiln_decode_experts"], 3)
        b.run.log(f"        experts form / pairs form speedup {entry['experts_vs_pairs']}")
    no_pre = _best_ms(entry["results"].get("kiln_decode_experts_no_preload", {}))
    if no_pre and ms["kiln_decode_experts"]:  # > 1: the preload pays
        entry["preload_speedup"] = round(no_pre / ms["kiln_decode_experts"], 3)
        b.run.log(f"        down kernel preload speedup {entry['preload_speedup']}")


def _best_ms(v: dict) -> float | None:
    """A result's CUDA-graph time where it has one, else its eager median."""
    return v["graph_ms"] if isinstance(v.get("graph_ms"), float) else v.get("ms")


def router_case(b: Bench, shape: str, N: int):
    E, k, d, _, _ = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    logits = b.randn(N, E)

    def eager(lg):
        probs = torch.softmax(lg.float(), -1)
        tw, ti = probs.topk(k, -1)
        tw = tw / tw.sum(-1, keepdim=True)
        f = torch.zeros(E, device=lg.device).scatter_add_(
            0, ti.reshape(-1), torch.ones(ti.numel(), device=lg.device)
        )
        aux = E * (f / N * probs.mean(0)).sum()
        return tw, aux

    def kiln(lg):
        r = route(lg, k)
        return r.weights, r.aux_loss

    def fb(f):
        leaf = logits.detach().requires_grad_()
        dw = torch.ones(N, k, device=b.dev)

        def run():
            tw, aux = f(leaf)
            return torch.autograd.grad((tw * dw).sum() + aux, leaf)

        return run

    entry = dict(case="router", shape=shape, tokens=N, routing="", mode="fwd+bwd", E=E, k=k)
    b.record(entry, b.time({"kiln": fb(kiln), "eager": fb(eager)}))


def train_case(b: Bench):
    """End to end: a Mixtral-style kiln model's training step (forward + backward, bf16 autocast, no
    optimizer) in tokens/s with KernelConfig.moe "kiln" against "eager"."""
    from kiln.model import ModelConfig, build_model
    from kiln.model.config import KernelConfig

    if b.smoke:
        cfg = ModelConfig(arch="mixtral", vocab_size=64, d_model=32, n_layers=1, n_heads=2, ffn_hidden=16,
                          max_seq_len=16, n_experts=4, n_experts_per_tok=2)  # fmt: skip
        B, T = 1, 8
    else:
        cfg = ModelConfig(arch="mixtral", vocab_size=32000, d_model=1024, n_layers=4, n_heads=16, n_kv_heads=4,
                          ffn_hidden=2816, max_seq_len=2048, n_experts=8, n_experts_per_tok=2)  # fmt: skip
        B, T = 8, 2048
    model = build_model(cfg, device=b.dev, seed=0)
    ids = torch.randint(0, cfg.vocab_size, (B, T), device=b.dev, generator=b.gen)
    amp = torch.autocast(b.dev.type, dtype=torch.bfloat16, enabled=not b.smoke)

    def step(backend):
        def run():
            model.set_kernels(KernelConfig(moe=backend))
            with amp:
                loss = model.loss(ids, ids)
            loss.backward()
            model.zero_grad(set_to_none=True)

        return run

    res = b.time({"kiln": step("kiln"), "eager": step("eager")})
    for v in res.values():
        if "ms" in v:
            v["tokens_per_s"] = round(B * T / v["ms"] * 1e3)
    entry = dict(case="train", shape=f"mixtral d{cfg.d_model} L{cfg.n_layers} E8 top-2", tokens=B * T,
                 routing="learned", mode="fwd+bwd")  # fmt: skip
    b.record(entry, res)


# launch configs to choose the defaults from: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for the forward,
# (BLOCK_N, BLOCK_K, BLOCK_R, warps, stages) for dw
TUNE_FWD = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4),
            (128, 64, 64, 4, 4), (64, 256, 64, 8, 3)]  # fmt: skip
TUNE_DECODE = [(16, 64, 128, 4, 4), (16, 128, 128, 4, 4), (16, 64, 256, 4, 3), (16, 32, 128, 4, 4),
               (32, 64, 128, 4, 4)]  # fmt: skip
TUNE_DW = [(128, 128, 64, 8, 3), (128, 128, 32, 8, 3), (64, 128, 64, 4, 4), (128, 256, 64, 8, 3)]


def tune_case(b: Bench, shape: str, N: int):
    """The gate/up grouped GEMM (forward and dw) at each launch config: the data to pick mm_config's
    defaults from (recorded under "tuning"; the chosen default is marked)."""
    E, k, d, inter, _ = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    w1 = b.randn(E, 2 * inter, d, scale=d**-0.5)
    idx, _ = make_routing(N, E, k, "balanced", b.dev, b.gen)
    plan = routing_plan(idx, E)
    xs = b.randn(N * k, d)
    dy = b.randn(N * k, 2 * inter)
    wt = w1.transpose(1, 2)
    fwd_cfgs = [mm_config(N * k, E)] + (TUNE_DECODE if N * k / E <= 16 else TUNE_FWD)
    dw_cfgs = TUNE_DW if N * k / E > 16 else []
    if b.smoke:
        fwd_cfgs, dw_cfgs = fwd_cfgs[:1], [(64, 64, 16, 4, 1)]
    fns = {
        f"fwd{c}": (lambda c=c: grouped_mm(xs, wt, plan.offsets, config=c)) for c in dict.fromkeys(fwd_cfgs)
    }
    fns |= {f"dw{c}": (lambda c=c: grouped_dw(dy, xs, plan.offsets, E, config=c)) for c in dw_cfgs}
    res = b.time(fns)
    flops = 2.0 * N * k * d * 2 * inter
    for v in res.values():
        if "ms" in v:
            v["TFLOPs"] = round(flops / v["ms"] / 1e9, 1)
    entry = dict(case="tune", shape=shape, tokens=N, routing="balanced", mode="gate_up",
                 default_fwd=str(mm_config(N * k, E)), results=res)  # fmt: skip
    b.cases.append(entry)
    b.run.log(f"tune {shape} {N}: " + " ".join(f"{n}={v.get('TFLOPs', 'ERR')}" for n, v in res.items()))


# --case quick: the persistent TMA kernel (and the pointer kernel at the same and the old tiles) on Mixtral's
# three GEMMs at 4k tokens; the decode kernels' tiles at batch 1
SWEEP_GEMM = [
    TMA_BIG,
    (128, 256, 64, 8, 4, "tma"),
    (128, 128, 64, 8, 4, "tma"),
    TMA_BIG[:5],
    (128, 128, 64, 8, 3),
]
SMOKE_SWEEP_GEMM = [(16, 16, 16, 4, 1, "tma"), (16, 64, 64, 4, 1)]
SWEEP_DW = [DW_TMA, (128, 128, 64, 8, 4, "tma"), (256, 128, 64, 8, 3, "tma"), (128, 128, 64, 8, 3)]
SWEEP_DECODE_UP = [DecodeTiles(8, 256, 4, 3), DecodeTiles(4, 512, 4, 2), DecodeTiles(2, 512, 2, 3),
                   DecodeTiles(16, 128, 4, 3), DecodeTiles(2, 1024, 4, 1)]  # fmt: skip
SWEEP_DECODE_DOWN = [DecodeTiles(4, 256, 2, 3), DecodeTiles(2, 1024, 4, 1), DecodeTiles(8, 256, 4, 3),
                     DecodeTiles(2, 256, 1, 3), DecodeTiles(1, 1024, 2, 2)]  # fmt: skip
# the experts form's tl.dot tiles (batch > 1; block_n and block_k >= 16) around expert_tiles' 64-column
# default: the 16-column rule it replaced, 32 and 128 columns, 8 warps, shorter and longer K steps
SWEEP_EXPERTS_DOT = [DecodeTiles(16, 128, 4, 3), DecodeTiles(32, 128, 4, 3), DecodeTiles(128, 128, 4, 3),
                     DecodeTiles(64, 128, 8, 3), DecodeTiles(64, 64, 4, 4), DecodeTiles(64, 256, 4, 2)]  # fmt: skip


def gemm_sweep_case(b: Bench, shape: str, N: int, weights):
    """The gate/up forward, its dx and the down forward over expert-sorted rows (balanced) at each
    SWEEP_GEMM config and mm_config's default, against torch._grouped_mm on the same rows."""
    E, k, d, inter, _ = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    w1, w2, _, _ = weights
    idx, _ = make_routing(N, E, k, "balanced", b.dev, b.gen)
    offs = routing_plan(idx, E).offsets
    ends = offs[1:].contiguous()
    R = N * k
    xs, dy, h = b.randn(R, d), b.randn(R, 2 * inter), b.randn(R, inter)
    problems = {  # name: (A, B as (E, K, N), flops)
        "gate_up": (xs, w1.transpose(1, 2), 2.0 * R * d * 2 * inter),
        "gate_up_dx": (dy, w1, 2.0 * R * d * 2 * inter),
        "down": (h, w2.transpose(1, 2), 2.0 * R * inter * d),
    }
    for name, (a, bm, flops) in problems.items():
        cfgs = SMOKE_SWEEP_GEMM if b.smoke else SWEEP_GEMM
        fns = {f"kiln{c}": (lambda c=c, a=a, bm=bm: grouped_mm(a, bm, offs, config=c)) for c in cfgs}
        fns["kiln_default"] = lambda a=a, bm=bm: grouped_mm(a, bm, offs)
        fns["grouped_mm"] = lambda a=a, bm=bm: torch._grouped_mm(a, bm, offs=ends)
        res = b.time(fns)
        for v in res.values():
            if "ms" in v:
                v["TFLOPs"] = round(flops / v["ms"] / 1e9, 1)
        peer = res["grouped_mm"].get("ms")
        entry = dict(case="sweep_gemm", shape=shape, tokens=N, routing="balanced", mode=name, M=R,
                     N=bm.shape[2], K=bm.shape[1], default=str(mm_config(R, E, False, bm.shape[2], bm.shape[1])),
                     results=res)  # fmt: skip
        if peer:
            entry["ratio_vs_grouped_mm"] = {n: round(peer / v["ms"], 3) for n, v in res.items() if "ms" in v}
        b.cases.append(entry)
        b.run.log(
            f"sweep {shape} {name}: " + " ".join(f"{n}={v.get('TFLOPs', 'ERR')}" for n, v in res.items())
        )
    # the gate/up weight gradient: kiln's dw kernels against torch._grouped_mm's 2-D x 2-D form (offsets
    # along the reduction), as its own backward computes it
    cfgs = SMOKE_SWEEP_GEMM if b.smoke else SWEEP_DW
    fns = {f"kiln{c}": (lambda c=c: grouped_dw(dy, xs, offs, E, config=c)) for c in cfgs}
    fns["kiln_default"] = lambda: grouped_dw(dy, xs, offs, E)
    fns["grouped_mm"] = lambda: torch._grouped_mm(dy.t(), xs, offs=ends)
    res = b.time(fns)
    flops = 2.0 * R * d * 2 * inter
    for v in res.values():
        if "ms" in v:
            v["TFLOPs"] = round(flops / v["ms"] / 1e9, 1)
    peer = res["grouped_mm"].get("ms")
    entry = dict(case="sweep_gemm", shape=shape, tokens=N, routing="balanced", mode="gate_up_dw", M=R,
                 N=2 * inter, K=d, default=str(dw_config(R, E, 2 * inter, d)), results=res)  # fmt: skip
    if peer:
        entry["ratio_vs_grouped_mm"] = {n: round(peer / v["ms"], 3) for n, v in res.items() if "ms" in v}
    b.cases.append(entry)
    b.run.log(
        f"sweep {shape} gate_up_dw: " + " ".join(f"{n}={v.get('TFLOPs', 'ERR')}" for n, v in res.items())
    )


def decode_sweep_case(b: Bench, shape: str, B: int, weights, form: str = "pairs", routing: str = "balanced"):
    """The decode kernels' tiles (kernels/moe_decode.py) in one form: each sweep up tile with the default
    down tile and each down tile with the default up tile; GB/s over the active experts' weights,
    CUDA-graph replay. The pairs form (and the experts form at one token, the same FMA loops) sweeps
    SWEEP_DECODE_UP / _DOWN; the experts form's tl.dot tiles (batch > 1) sweep SWEEP_EXPERTS_DOT."""
    E, k, d, inter, _ = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    w1, w2, _, _ = weights
    x = b.randn(B, d)
    idx, w = make_routing(B, E, k, routing, b.dev, b.gen)
    nbytes = int(torch.unique(idx).numel()) * 3 * inter * d * (torch.finfo(b.dtype).bits // 8)
    rows = expert_rows(B, b.dtype)
    if form == "experts":
        up0, down0 = expert_tiles(d, rows), expert_tiles(inter, rows)
    else:
        up0, down0 = decode_tiles(d), decode_tiles(inter)
    if form == "experts" and rows > 1:
        ups = downs = SWEEP_EXPERTS_DOT[:1] if b.smoke else SWEEP_EXPERTS_DOT
    else:
        ups = SWEEP_DECODE_UP[:1] if b.smoke else SWEEP_DECODE_UP
        downs = SWEEP_DECODE_DOWN[:1] if b.smoke else SWEEP_DECODE_DOWN
    cfgs = {"default": (up0, down0)} | {f"up{tuple(t)}": (t, down0) for t in ups} | {
        f"down{tuple(t)}": (up0, t) for t in downs}  # fmt: skip
    fns = {n: (lambda c=c: moe_decode_fwd(x, idx, w, w1, w2, config=c, form=form)) for n, c in cfgs.items()}
    res = b.time(fns, graph=True)
    for v in res.values():
        ms = v.get("graph_ms") if isinstance(v.get("graph_ms"), float) else v.get("ms")
        if ms:
            v["GBps"] = round(nbytes / ms / 1e6, 1)
            v["frac_copy"] = fraction(v["GBps"] / 1e3, b.run.ceilings.get("copy_TBps"))
    entry = dict(case="sweep_decode", shape=shape, tokens=B, routing=routing, mode="fwd", form=form,
                 rows=rows if form == "experts" else None,
                 default=f"up {tuple(up0)} down {tuple(down0)}", weight_bytes=nbytes, results=res)  # fmt: skip
    b.cases.append(entry)
    b.run.log(f"sweep decode {form} {shape} {B} {routing}: "
              + " ".join(f"{n}={v.get('GBps', 'ERR')}" for n, v in res.items()))  # fmt: skip


def case_label(f, args) -> str:
    """A skipped case as the JSON lists it: its function and its plain arguments (no tensors)."""
    return f.__name__ + repr(tuple(v for v in args if isinstance(v, (str, int, float))))


def make_weights(b: Bench, shape: str):
    E, k, d, inter, sh = (SMOKE_SHAPES if b.smoke else SHAPES)[shape]
    w1 = b.randn(E, 2 * inter, d, scale=d**-0.5)
    w2 = b.randn(E, d, inter, scale=inter**-0.5)
    shared = (b.randn(sh, d, scale=d**-0.5), b.randn(d, sh // 2, scale=(sh // 2) ** -0.5)) if sh else None
    # the routed experts with the shared one stacked after them (the decode case's shared-slots row), once
    slots = stack_shared_experts(w1, w2, *shared_mlp_as_experts(*shared, inter)) if sh else None
    return w1, w2, shared, slots


def main() -> int:
    ap = bench_parser("moe", __doc__)
    ap.add_argument("--budget", type=float, default=HARD_BUDGET_S,
                    help=f"seconds after which no new case starts (default {HARD_BUDGET_S:.0f}; the slow "
                    f"peers stop at {TIME_BUDGET_S:.0f}): pass a large value to run every case")  # fmt: skip
    ap.add_argument("--warm", action="store_true",
                    help="decode cases: time one weight copy replayed back to back (L2-warm), not a rotation of "
                    "copies that the L2 cannot hold (the default since 2026-12-04)")  # fmt: skip
    ap.add_argument("--case", choices=("full", "quick"), default="full",
                    help="quick: only what issue 19's second round changed (decode batch 1-64 with the decode "
                    "kernels, Mixtral / Qwen3 prefill at 4k and 16k tokens, the TMA GEMM and decode tile "
                    "sweeps; about 150 s) -> bench/results/moe_quick.json")  # fmt: skip
    args = ap.parse_args()
    if args.case == "quick":
        return quick(args)
    run = BenchRun("moe", __file__, args, rounds=3)
    b = Bench(run)
    b.warm = args.warm
    run.meta["decode_weights"] = (
        "one copy, L2-warm" if args.warm else f"rotated copies, >= {L2_ROTATION_BYTES >> 20} MB"
    )
    shapes = SMOKE_SHAPES if b.smoke else SHAPES
    # the smoke run: one shape, one size, one routing per case (each interpreted call costs seconds)
    prefill = (12,) if b.smoke else PREFILL
    decode = (2,) if b.smoke else DECODE
    routings = ("zipf",) if b.smoke else ("balanced", "zipf")
    run.meta["grouped_mm_available"] = hasattr(torch, "_grouped_mm")
    skipped = []

    def go(f, *a):
        if b.over_budget(args.budget):
            skipped.append(case_label(f, a))
            return
        try:
            f(b, *a)
        except Exception as e:  # noqa: BLE001 - record the case's failure and go on
            b.cases.append(
                dict(case=f.__name__, args=repr(a[:3]), error=f"{type(e).__name__}: {str(e)[:300]}")
            )
            run.log(f"{f.__name__}{a[:3]} failed: {type(e).__name__}: {e}")

    # phases across the shapes, the goal points first (>= 4k tokens, decode), so that a run cut
    # by the budget has every shape at those points; every shape's weights stay resident (~5 GB in bf16)
    with use_backend("triton"):  # the smoke run takes the kernels through the interpreter
        go(train_case)  # short, and the end-to-end answer
        weights = {shape: make_weights(b, shape) for shape in shapes}
        for shape in shapes:
            for routing in routings:
                go(experts_case, shape, prefill[0], routing, weights[shape])
        for shape in shapes:
            for B in decode:
                for routing in routings:
                    go(decode_case, shape, B, routing, weights[shape])
        for N in prefill[1:]:
            for shape in shapes:
                for routing in routings:
                    go(experts_case, shape, N, routing, weights[shape])
        for shape in shapes:
            for routing in routings:
                go(gemm_case, shape, prefill[0], routing, weights[shape])
            go(router_case, shape, prefill[0] * (4 if not b.smoke else 1))
        del weights
        names = list(shapes)
        tune = [(names[0], prefill[0])] + ([(names[1], decode[1])] if len(names) > 1 else [])
        for shape, N in tune:  # Mixtral at 4k tokens, Qwen3 at decode batch 8
            go(tune_case, shape, N)
    run.meta["skipped_for_time"] = skipped
    run.write(cases=b.cases, time_budget_s=TIME_BUDGET_S, hard_budget_s=args.budget)
    return 0


QUICK_DECODE = (1, 2, 3, 4, 8, 16, 32, 64)
QUICK_BUDGET_S = 135.0  # no new case past this: the last one ends within ~150 s


def quick(args) -> int:
    """--case quick: decode at batch 1-64 on every shape (decode kernels vs the grouped path vs
    torch._grouped_mm vs a copy of the same bytes), Mixtral / Qwen3 prefill at 4k (then 16k) tokens
    forward and forward+backward (kiln vs torch._grouped_mm), then the GEMM config sweep on Mixtral at 4k
    and the decode tile sweep at batch 1 (the goal points first: a run cut by the budget keeps them)."""
    run = BenchRun("moe_quick", __file__, args, rounds=3)
    b = Bench(run)
    b.warm = args.warm
    run.meta["decode_weights"] = (
        "one copy, L2-warm" if args.warm else f"rotated copies, >= {L2_ROTATION_BYTES >> 20} MB"
    )
    shapes = list(SMOKE_SHAPES if b.smoke else SHAPES)
    prefill_shapes = shapes[:2]  # Mixtral, Qwen3
    decode = (1, 2) if b.smoke else QUICK_DECODE
    prefill = (12,) if b.smoke else (4096, 16384)
    routings = ("zipf",) if b.smoke else ("balanced", "zipf")
    budget = args.budget if args.budget != HARD_BUDGET_S else QUICK_BUDGET_S
    skipped = []

    def go(f, *a):
        if b.over_budget(budget):
            skipped.append(case_label(f, a))
            return
        try:
            f(b, *a)
        except Exception as e:  # noqa: BLE001 - record the case's failure and go on
            b.cases.append(
                dict(case=f.__name__, args=repr(a[:3]), error=f"{type(e).__name__}: {str(e)[:300]}")
            )
            run.log(f"{f.__name__}{a[:3]} failed: {type(e).__name__}: {e}")

    with use_backend("triton"):
        weights = {shape: make_weights(b, shape) for shape in shapes}
        for shape in shapes:
            for B in decode:  # Zipf from batch 2: tokens share hot experts, which the experts form dedupes
                for routing in routings if B >= 2 or b.smoke else routings[:1]:
                    go(decode_case, shape, B, routing, weights[shape], True)
        # the tile sweeps (past the budget the rest is skipped): the experts form's tl.dot tiles where tokens
        # share experts most (Qwen3-like 16, Zipf) and its one-token FMA tiles (DeepSeek-like and Qwen3-like
        # batch 1, I 1408 and 768); the pairs form's at batch 1
        qwen = shapes[1 if len(shapes) > 1 else 0]
        go(decode_sweep_case, qwen, 16 if not b.smoke else 2, weights[qwen], "experts", "zipf")
        go(decode_sweep_case, shapes[-1], 1, weights[shapes[-1]], "experts")
        go(decode_sweep_case, qwen, 1, weights[qwen], "experts")
        for shape in shapes[:2]:
            go(decode_sweep_case, shape, 1 if not b.smoke else 2, weights[shape])
        for shape in prefill_shapes:
            for routing in routings:
                go(experts_case, shape, prefill[0], routing, weights[shape], ("fwd", "fwd+bwd"), True)
        for N in prefill[1:]:
            for shape in prefill_shapes:
                for routing in routings:
                    go(experts_case, shape, N, routing, weights[shape], ("fwd", "fwd+bwd"), True)
        go(gemm_sweep_case, shapes[0], prefill[0], weights[shapes[0]])
    run.meta["skipped_for_time"] = skipped
    run.write(cases=b.cases, case="quick", hard_budget_s=budget)
    return 0


if __name__ == "__main__":
    sys.exit(main())
