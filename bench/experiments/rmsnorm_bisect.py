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

    python bench/experiments/rmsnorm_bisect.py OUT.json           # on a CUDA GPU, ~1 minute
    python bench/experiments/rmsnorm_bisect.py OUT.json --smoke   # CPU interpreter: kiln's variants checked
"""

import json
import os
import sys

if "--smoke" in sys.argv:  # the interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, "bench")
import kernels_norms as kn  # noqa: E402
from kiln.kernels import rmsnorm as RN  # noqa: E402
from kiln.kernels.dispatch import use_backend  # noqa: E402
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import no_grad, run_group  # noqa: E402

EPS = 1e-6


def main():
    smoke = "--smoke" in sys.argv
    device = "cpu" if smoke else "cuda"
    mk = kn.Inputs(device, smoke)
    M, D = (64, 256) if smoke else (32768, 4096)
    x, w = mk.randn(M, D), mk.randn(D, scale=0.1) + 1
    from liger_kernel.ops import rms_norm as LR

    def liger_kernel_plain():
        y = torch.empty((M, D), dtype=x.dtype, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        LR._rms_norm_forward_kernel[(M,)](
            y, y.stride(0), x, x.stride(0), w, w.stride(0), rstd, rstd.stride(0), D, EPS, 0.0, 0,
            elementwise_affine=True, BLOCK_SIZE=D, num_warps=8,
        )  # fmt: skip
        return y

    consts = dict(HAS_RESIDUAL=False, EVEN=True, ROWS=1, BLOCK=D, num_warps=8)

    def kiln_kernel_plain():
        y = torch.empty((M, D), dtype=x.dtype, device=x.device)
        RN._rmsnorm_fwd_kernel[(M,)](x, x, y, y, w, y, D, 0, D, M, D, EPS, FOR_BACKWARD=False, **consts)
        return y

    def kiln_kernel_liger_alloc():
        y = torch.empty((M, D), dtype=x.dtype, device=x.device)
        rstd = torch.empty(M + RN.COUNTERS.value, dtype=torch.float32, device=x.device)
        RN._rmsnorm_fwd_kernel[(M,)](x, x, y, y, w, rstd, D, 0, D, M, D, EPS, FOR_BACKWARD=True, **consts)
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
    with use_backend("triton"):
        ref = RN.rmsnorm_ref(x, w, EPS).float()
        errors = {n: float((f().float() - ref).abs().max()) for n, f in fns.items()}
        out = run_meta() | {"max_abs_err_vs_reference": errors}
        out["group"] = run_group("rmsnorm_fwd_bisect", fns, smoke, 2 * x.numel() * 2)
    print(json.dumps(errors), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
