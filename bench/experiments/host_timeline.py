"""One-off H200 experiment: where the host time of a norm's forward+backward goes on the GPU machine.

    python bench/experiments/host_timeline.py OUT.json   # from the repo root, on a CUDA GPU (~30 s)

Run at commits 7f34ca8 and 19a1a39 (bench/results/host_timeline*.json): its TimedRMS copies the backward
of those commits (a second launch for the dw partial sums, `sum_partials`, since folded into the
backward kernel), so it needs one of them checked out.

On the 2-core CPU machine kiln's RMSNorm forward+backward costs ~90 us of Python; on the H200's host it
measured 300-660 us per call, over the GPU time of the 32768 x 4096 case. Here every step of one call is
stamped with perf_counter_ns on small (64 x 4096) tensors, so the GPU never holds the host back:
  apply_in   caller -> Function.forward entered
  fwd        kiln's forward launcher (allocations + one launch)
  apply_out  forward returned -> apply returned (autograd graph recording)
  to_bwd     torch.autograd.grad called -> backward entered (the engine, its device thread)
  bwd_kernel kiln's backward kernel launch (allocations + launch)
  bwd_sum    the dw partial-sum launch
  from_bwd   backward returned -> autograd.grad returned
Medians over 300 calls, in microseconds; the same for F.rms_norm's total, an identity Function, and
the launch path pieces (CachedLaunch key, compiled handle).
"""

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, "bench")
from host_busy import calls_us  # noqa: E402 - the idle/busy timer

from host_overhead import per_call_us  # noqa: E402 - the same per-call timer
from kiln.kernels import launch as L  # noqa: E402
from kiln.kernels import layernorm as LN  # noqa: E402
from kiln.kernels import rmsnorm as RN  # noqa: E402
from provenance import run_meta  # noqa: E402

ns = time.perf_counter_ns
ST: dict[str, int] = {}


class TimedRMS(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ST["f0"] = ns()
        y, h, rstd = RN.rmsnorm_fwd(x, w, 1e-6)
        ST["f1"] = ns()
        ctx.save_for_backward(h, w, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        ST["b0"] = ns()
        h, w, rstd = ctx.saved_tensors
        n_rows, D = h.shape
        dy2 = RN.as_rows(dy, D)
        dx = torch.empty((n_rows, D), dtype=h.dtype, device=h.device)
        n_prog = max(1, min(n_rows, RN.programs_per_device(h.device, RN.PROGRAMS_PER_SM)))
        dwp = torch.empty((n_prog, D), dtype=torch.float32, device=h.device)
        block = RN.pow2(D)
        RN._bwd_launch[(n_prog,)](
            dy2, h, dy2, w, rstd, dx, dwp, dy2.stride(0), h.stride(0), 0, n_rows, D, RN.cdiv(n_rows, n_prog),
            HAS_DH=False, STAGES=RN.ROW_LOOP_STAGES, BLOCK=block, num_warps=RN.row_warps(block),
        )  # fmt: skip
        ST["b1"] = ns()
        dw = RN.sum_partials(dwp, w.dtype)[0]
        ST["b2"] = ns()
        return dx.view(ctx.shape), dw


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ST["f0"] = ST["f1"] = ns()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        ST["b0"] = ST["b1"] = ST["b2"] = ns()
        return dy, None


class Allocs(torch.autograd.Function):
    """The same allocations as kiln's RMSNorm, no launches."""

    @staticmethod
    def forward(ctx, x, w):
        ST["f0"] = ns()
        y = torch.empty_like(x)
        r = torch.empty(x.shape[0], device=x.device)
        ST["f1"] = ns()
        ctx.save_for_backward(x, w, r)
        return y

    @staticmethod
    def backward(ctx, dy):
        ST["b0"] = ns()
        h, w, r = ctx.saved_tensors
        dx = torch.empty_like(h)
        p = torch.empty(264, h.shape[1], device=h.device)
        ST["b1"] = ns()
        dw = torch.empty(h.shape[1], dtype=w.dtype, device=h.device)
        ST["b2"] = ns()
        return dx, dw + 0 * p[0, 0]


def timeline(fn_cls, x, w, g, n=300) -> dict:
    segs: dict[str, list[float]] = {k: [] for k in
                                    ("apply_in", "fwd", "apply_out", "to_bwd", "bwd_kernel", "bwd_sum", "from_bwd", "total")}  # fmt: skip
    for i in range(n + 30):
        t0 = ns()
        y = fn_cls.apply(x, w)
        t1 = ns()
        torch.autograd.grad(y, (x, w), g, allow_unused=True)
        t2 = ns()
        if i < 30:
            continue
        s = ST
        for k, v in (("apply_in", s["f0"] - t0), ("fwd", s["f1"] - s["f0"]), ("apply_out", t1 - s["f1"]),
                     ("to_bwd", s["b0"] - t1), ("bwd_kernel", s["b1"] - s["b0"]), ("bwd_sum", s["b2"] - s["b1"]),
                     ("from_bwd", t2 - s["b2"]), ("total", t2 - t0)):  # fmt: skip
            segs[k].append(v / 1e3)
    torch.cuda.synchronize()
    return {k: round(statistics.median(v), 2) for k, v in segs.items()}


def busy_call_us(fn) -> float:
    """Host microseconds per call while the GPU is busy (host_busy.py's timer, a sleep kernel queued
    first): launches go into a non-empty queue, as in a GPU-bound benchmark loop."""
    return calls_us(fn, busy=True)


def main():
    dev = torch.device("cuda")
    x = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn_like(w, requires_grad=True)
    g = torch.randn_like(x)
    out = run_meta() | {"timeline_us": {}, "per_call_us": {}}
    for name, cls in (("kiln_rmsnorm", TimedRMS), ("identity", Identity), ("allocs_only", Allocs)):
        out["timeline_us"][name] = timeline(cls, x, w, g)
        print(name, out["timeline_us"][name], flush=True)
    pc = out["per_call_us"]
    pc["kiln rmsnorm fwd+bwd"] = per_call_us(lambda: torch.autograd.grad(RN.rmsnorm(x, w), (x, w), g))
    pc["F.rms_norm fwd+bwd"] = per_call_us(
        lambda: torch.autograd.grad(F.rms_norm(x, (4096,), w, 1e-6), (x, w), g)
    )
    pc["kiln layernorm fwd+bwd"] = per_call_us(
        lambda: torch.autograd.grad(LN.layernorm(x, w, b), (x, w, b), g)
    )
    pc["F.layer_norm fwd+bwd"] = per_call_us(
        lambda: torch.autograd.grad(F.layer_norm(x, (4096,), w, b), (x, w, b), g)
    )
    pc["identity fwd+bwd"] = per_call_us(lambda: torch.autograd.grad(Identity.apply(x, w), (x,), g))
    with torch.no_grad():
        pc["kiln rmsnorm_fwd"] = per_call_us(lambda: RN.rmsnorm_fwd(x, w, 1e-6))
        _, h, rstd = RN.rmsnorm_fwd(x, w, 1e-6)
        pc["kiln rmsnorm_bwd"] = per_call_us(lambda: RN.rmsnorm_bwd(g, h, w, rstd))
        p = torch.empty(264, 4096, device=dev)
        pc["sum_partials"] = per_call_us(lambda: RN.sum_partials(p, torch.bfloat16))
        pc["torch.empty 64x4096"] = per_call_us(
            lambda: torch.empty(64, 4096, device=dev, dtype=torch.bfloat16)
        )
        # the launch path of the forward kernel, arguments prepared
        y = torch.empty_like(x)
        args = (x, x, x, y, w, rstd, 4096, 0, 4096, 64, 4096, 1e-6)
        meta = dict(HAS_RESIDUAL=False, ROWS=1, BLOCK=4096, num_warps=8)
        lc = RN._fwd_launch
        pc["CachedLaunch launch"] = per_call_us(lambda: lc[(64,)](*args, **meta))
        key = lc.key(torch.cuda.current_device(), args, meta)
        pc["CachedLaunch key only"] = per_call_us(lambda: lc.key(torch.cuda.current_device(), args, meta))
        pc["torch.cuda.current_device"] = per_call_us(torch.cuda.current_device)
        kern = lc.compiled[key][0]
        rest = [meta[n] if n in meta else lc.defaults[n] for n in lc.names[len(args) :]]
        stream = L.driver.active.get_current_stream(0)
        pc["get_current_stream"] = per_call_us(lambda: L.driver.active.get_current_stream(0))
        pc["kernel.run direct"] = per_call_us(
            lambda: kern.run(
                64, 1, 1, stream, kern.function, kern.packed_metadata, None, None, None, *args, *rest
            )
        )
    from kiln.kernels.matmul import linear, matmul_fwd, pick_config

    xm, wm = (
        torch.randn(8192, 1536, device=dev, dtype=torch.bfloat16),
        torch.randn(1536, 1536, device=dev, dtype=torch.bfloat16),
    )
    with torch.no_grad():
        pc["F.linear 8192x1536x1536"] = per_call_us(lambda: F.linear(xm, wm), n=50)
        pc["kiln linear"] = per_call_us(lambda: linear(xm, wm), n=50)
        cfg = pick_config(8192, 1536, 1536, 132)
        pc["kiln matmul_fwd fixed config"] = per_call_us(lambda: matmul_fwd(xm, wm.t(), config=cfg), n=50)
        pc["torch.empty 8192x1536"] = per_call_us(lambda: xm.new_empty(8192, 1536), n=50)
        # the GEMM launch path in pieces: Python before the launch (launch stubbed), the cache key, the
        # compiled handle's run (which asks the allocator for the descriptors' scratch), the scratch alone
        from kiln.kernels import matmul as MM

        ml = MM._matmul_launch
        seen = {}
        ml.launch = lambda grid, a, m: seen.update(grid=grid, args=a, meta=m)
        pc["matmul_fwd python only (launch stubbed)"] = per_call_us(
            lambda: matmul_fwd(xm, wm.t(), config=cfg), n=50
        )
        del ml.launch
        margs, mmeta, mgrid = seen["args"], seen["meta"], seen["grid"]
        mkey = ml.key(torch.cuda.current_device(), margs, mmeta)
        pc["matmul CachedLaunch key only"] = per_call_us(lambda: ml.key(0, margs, mmeta), n=50)
        mk_ = ml.compiled[mkey][0]
        mrest = [mmeta[n] if n in mmeta else ml.defaults[n] for n in ml.names[len(margs) :]]
        pc["matmul kernel.run direct"] = per_call_us(
            lambda: mk_.run(
                mgrid[0], 1, 1, stream, mk_.function, mk_.packed_metadata, None, None, None, *margs, *mrest
            ),
            n=50,
        )
        pc["descriptor scratch alloc"] = per_call_us(lambda: MM._tma_alloc(132 * 384, 128, None), n=50)
    busy = out["busy_gpu_per_call_us"] = {}
    busy["kiln rmsnorm fwd+bwd"] = busy_call_us(lambda: torch.autograd.grad(RN.rmsnorm(x, w), (x, w), g))
    busy["F.rms_norm fwd+bwd"] = busy_call_us(
        lambda: torch.autograd.grad(F.rms_norm(x, (4096,), w, 1e-6), (x, w), g)
    )
    busy["kiln layernorm fwd+bwd"] = busy_call_us(
        lambda: torch.autograd.grad(LN.layernorm(x, w, b), (x, w, b), g)
    )
    busy["F.layer_norm fwd+bwd"] = busy_call_us(
        lambda: torch.autograd.grad(F.layer_norm(x, (4096,), w, b), (x, w, b), g)
    )
    busy["identity fwd+bwd"] = busy_call_us(lambda: torch.autograd.grad(Identity.apply(x, w), (x,), g))
    with torch.no_grad():
        busy["kiln linear"] = busy_call_us(lambda: linear(xm, wm))
        busy["F.linear"] = busy_call_us(lambda: F.linear(xm, wm))
        busy["kiln rmsnorm_fwd"] = busy_call_us(lambda: RN.rmsnorm_fwd(x, w, 1e-6))
        busy["CachedLaunch launch"] = busy_call_us(lambda: lc[(64,)](*args, **meta))
        busy["kernel.run direct"] = busy_call_us(
            lambda: kern.run(
                64, 1, 1, stream, kern.function, kern.packed_metadata, None, None, None, *args, *rest
            )
        )
        busy["torch.add"] = busy_call_us(lambda: torch.add(g, g))
        pc["torch.add"] = per_call_us(lambda: torch.add(g, g))
        xl, bl = x.detach(), b.detach()
        pc["kiln layernorm_fwd"] = per_call_us(lambda: LN.layernorm_fwd(xl, w, bl, 1e-6))
        _, hl, mean, rs = LN.layernorm_fwd(xl, w, bl, 1e-6)
        pc["kiln layernorm_bwd"] = per_call_us(lambda: LN.layernorm_bwd(g, hl, w, bl.dtype, mean, rs))
    for k, v in busy.items():
        print(f"busy {k:35s} {v}", flush=True)
    for k, v in pc.items():
        print(f"{k:40s} {v}", flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
