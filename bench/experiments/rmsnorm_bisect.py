"""H200 experiment, prepared for the next GPU session (not yet run): where does Liger's RMSNorm forward
gain its last 1% over kiln's (32768 x 4096 bf16)? Nsight Compute (`ncu_rmsnorm.csv`) found the same
registers, occupancy and hit rates and a DRAM efficiency of 85.2% against 83.9-84.5%. Each contender
swaps one part between the two:

- kiln, liger: the public ops (inference path), as bench/kernels_norms.py times them;
- liger_kernel_plain: Liger's kernel launched here (Y then RSTD allocated as Liger does), without its
  autograd Function: Liger's kernel alone;
- kiln_kernel_plain: kiln's kernel through Triton's own launch instead of CachedLaunch;
- kiln_kernel_liger_alloc: kiln's kernel into Y and RSTD allocated as Liger allocates them, storing rstd
  (FOR_BACKWARD): kiln's kernel with Liger's buffers and stores.

A second group runs both raw kernels (and kiln's capped at 32 registers, 8 programs per SM instead of 6)
into the same three preallocated outputs (kernel against kernel at one placement; `output_placement.json` found placement alone moving kiln's kernel by 0.7%). A third tries
a structure not swept before: persistent programs (k per SM) that keep the weight in registers (read once
per program instead of once per row: 256 MB less L2 traffic at this shape) and prefetch their next row
into registers while the current one reduces and stores (PREFETCH), against the same without prefetch.

    python bench/experiments/rmsnorm_bisect.py OUT.json           # on a CUDA GPU, ~1 minute
    python bench/experiments/rmsnorm_bisect.py OUT.json --smoke   # CPU interpreter: kiln's variants checked
"""

import json
import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

sys.path.insert(0, "bench")
import kernels_norms as kn  # noqa: E402
from kiln.kernels import rmsnorm as RN  # noqa: E402
from kiln.kernels.dispatch import use_backend  # noqa: E402
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import no_grad, run_group  # noqa: E402

EPS = 1e-6


def liger_kernel_into(x, w, y, rstd):
    """Liger's RMSNorm forward kernel into y and rstd (x: (M, D) rows, D a power of two), launched as its
    op launches it (llama casting, 8 warps at D = 4096) but without its autograd Function."""
    from liger_kernel.ops import rms_norm as LR

    M, D = x.shape
    LR._rms_norm_forward_kernel[(M,)](
        y, y.stride(0), x, x.stride(0), w, w.stride(0), rstd, rstd.stride(0), D, EPS, 0.0, 0,
        elementwise_affine=True, BLOCK_SIZE=D, num_warps=8,
    )  # fmt: skip
    return y


@triton.jit
def rms_persistent(X, Y, W, n_rows, stride, n_cols, eps, PREFETCH: tl.constexpr, BLOCK: tl.constexpr):
    """Rows pid, pid + programs, ...: the weight loaded once; with PREFETCH the next row's load is issued
    before this row's reduction (a register double buffer, no shared memory)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    w = tl.load(W + cols).to(tl.float32)
    x = tl.load(X + pid.to(tl.int64) * stride + cols, mask=(cols < n_cols) & (pid < n_rows), other=0.0)
    for row in range(pid, n_rows, step):
        if PREFETCH:
            nxt = row + step
            x_next = tl.load(X + tl.cast(nxt, tl.int64) * stride + cols, mask=(cols < n_cols) & (nxt < n_rows),
                             other=0.0)  # fmt: skip
        else:
            x = tl.load(X + tl.cast(row, tl.int64) * stride + cols)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
        tl.store(Y + tl.cast(row, tl.int64) * stride + cols, (xf * rstd * w).to(Y.dtype.element_ty))
        if PREFETCH:
            x = x_next


def main():
    smoke = "--smoke" in sys.argv
    device = "cpu" if smoke else "cuda"
    mk = kn.Inputs(device, smoke)
    M, D = (64, 256) if smoke else (32768, 4096)
    x, w = mk.randn(M, D), mk.randn(D, scale=0.1) + 1

    def liger_kernel_plain():
        y = torch.empty((M, D), dtype=x.dtype, device=x.device)
        return liger_kernel_into(x, w, y, torch.empty(M, dtype=torch.float32, device=x.device))

    consts = dict(HAS_RESIDUAL=False, ROWS=1, BLOCK=D, num_warps=8)

    def kiln_kernel_plain():
        y = torch.empty((M, D), dtype=x.dtype, device=x.device)
        RN._rmsnorm_fwd_kernel[(M,)](x, x, y, y, w, y, D, 0, D, M, D, EPS, 0.0, FOR_BACKWARD=False, **consts)
        return y

    def kiln_kernel_liger_alloc():
        y = torch.empty((M, D), dtype=x.dtype, device=x.device)
        rstd = torch.empty(M + RN.COUNTERS.value, dtype=torch.float32, device=x.device)
        RN._rmsnorm_fwd_kernel[(M,)](
            x, x, y, y, w, rstd, D, 0, D, M, D, EPS, 0.0, FOR_BACKWARD=True, **consts
        )
        return y

    fns = {
        "kiln": no_grad(lambda: RN.rmsnorm(x, w, EPS)),
        "liger": no_grad(lambda: kn.LigerRMSNormFunction.apply(x, w, EPS)),
        "liger_kernel_plain": liger_kernel_plain,
        "kiln_kernel_plain": kiln_kernel_plain,
        "kiln_kernel_liger_alloc": kiln_kernel_liger_alloc,
    }
    if smoke:  # Liger's kernel calls eps.to(), which the interpreter's plain float has not
        del fns["liger"], fns["liger_kernel_plain"]
    # group 2: kernel against kernel, into the same outputs (three buffers kept apart by spacers)
    same, keep = {}, []
    for b in range(3):
        y = torch.empty((M, D), dtype=x.dtype, device=x.device)
        rstd = torch.empty(M + RN.COUNTERS.value, dtype=torch.float32, device=x.device)
        keep += [y, rstd, torch.empty((b + 1) * (40 << 20), dtype=torch.uint8, device=x.device)]

        def liger_into(y=y, rstd=rstd):
            return liger_kernel_into(x, w, y, rstd)

        def kiln_into(y=y, rstd=rstd):
            RN._fwd_launch[(M,)](x, x, y, y, w, rstd, D, 0, D, M, D, EPS, 0.0, FOR_BACKWARD=True, **consts)
            return y

        def kiln_cap32_into(y=y, rstd=rstd):  # 32 registers (no spills at sm_90): 8 programs per SM, not 6
            RN._rmsnorm_fwd_kernel[(M,)](x, x, y, y, w, rstd, D, 0, D, M, D, EPS, 0.0, FOR_BACKWARD=True,
                                         **consts, maxnreg=32)  # fmt: skip
            return y

        same[f"liger_kernel_buf{b}"], same[f"kiln_kernel_buf{b}"] = liger_into, kiln_into
        if not smoke:  # the interpreter takes no register cap
            same[f"kiln_cap32_buf{b}"] = kiln_cap32_into
    if smoke:
        same = {n: f for n, f in same.items() if n.startswith("kiln")}

    # group 3: persistent programs, weight in registers, with and without the next row prefetched
    sms = 4 if smoke else torch.cuda.get_device_properties(0).multi_processor_count
    persist = {"kiln": fns["kiln"], "kiln_kernel_plain": kiln_kernel_plain}
    if not smoke:
        persist["liger"] = fns["liger"]
    # programs per SM up to what fits at once (sm_90 compile, D = 4096: prefetch 64 registers at 8 warps,
    # 96 at 4; plain 48 and 79), so that no program waits for a second wave
    for per_sm, warps, pre in ((2, 8, 1), (3, 8, 1), (4, 8, 1), (4, 4, 1), (5, 4, 1), (4, 8, 0), (5, 8, 0),
                               (6, 4, 0)):  # fmt: skip

        def run(per_sm=per_sm, nw=warps, pre=bool(pre)):
            g = min(M, sms * per_sm)
            y = torch.empty((M, D), dtype=x.dtype, device=x.device)
            rms_persistent[(g,)](x, y, w, M, D, D, EPS, PREFETCH=pre, BLOCK=D, num_warps=nw, num_stages=1)
            return y

        persist[f"persist{per_sm}_w{warps}_{'prefetch' if pre else 'plain'}"] = run

    with use_backend("triton"):
        ref = RN.rmsnorm_ref(x, w, EPS).float()
        every = fns | same | persist
        errors = {n: float((f().float() - ref).abs().max()) for n, f in every.items()}
        out = run_meta() | {"max_abs_err_vs_reference": errors}
        out["group"] = run_group("rmsnorm_fwd_bisect", fns, smoke, 2 * x.numel() * 2)
        out["same_buffer"] = run_group("rmsnorm_fwd_same_buffer", same, smoke, 2 * x.numel() * 2)
        out["persistent"] = run_group("rmsnorm_fwd_persistent", persist, smoke, 2 * x.numel() * 2)
    print(json.dumps(errors), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
