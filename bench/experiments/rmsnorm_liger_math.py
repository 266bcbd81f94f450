"""H200 experiment: which part of Liger's RMSNorm forward makes it ~1% faster than kiln's at the same
output buffer (32768 x 4096 bf16)? `rmsnorm_bisect.json` (eaec5c4) found Liger's raw kernel 132.4-134.7
us against kiln's 134.1-135.1 into each of three shared buffers: the kernel, not launches or placement.
Both compile for sm_90 to the same loads (two 16-byte loads of the row, the weight loaded during the
reduction), 38 registers; Liger's has 255 instructions against kiln's 186 (predicated loads, an rstd
store, x * rstd rounded to bf16 per element, `offset + w` added in float32).

One kernel here takes each of those as a flag, all 16 combinations, beside kiln's and Liger's ops and raw
kernels, timed interleaved (7 rounds):
- MASK: loads and stores masked against n_cols (Liger's) or not (kiln's, D == BLOCK);
- RSTD: 1/rms stored per row before y (Liger's, and kiln's training forward);
- ROUND: y = bf16(x * rstd) * w (Liger's llama mode, Hugging Face's order) or bf16(x * rstd * w) (kiln's);
- OFFSET: the weight plus a run-time float32 offset of 0.0 (Liger's `offset + w`), 16 more FADDs.

    python bench/experiments/rmsnorm_liger_math.py OUT.json           # on a CUDA GPU, ~1 minute
    python bench/experiments/rmsnorm_liger_math.py OUT.json --smoke   # CPU interpreter: variants checked
    ... --second: the leaders of the first run again (9 rounds), DELAY extra FMAs per element before the
    store, and Hugging Face's rounding order with a float32 weight
"""

import itertools
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
FLAGS = ("MASK", "RSTD", "ROUND", "OFFSET")


@triton.jit
def rms_flags(X, Y, W, RSTD_ptr, stride, n_cols, eps, offset, one, MASK: tl.constexpr, RSTD: tl.constexpr,
              ROUND: tl.constexpr, OFFSET: tl.constexpr, DELAY: tl.constexpr, BLOCK: tl.constexpr,
              RSTD_LATE: tl.constexpr = False):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    if MASK:
        x = tl.load(X + row * stride + cols, mask=cols < n_cols, other=0.0)
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0)
    else:
        x = tl.load(X + row * stride + cols)
        w = tl.load(W + cols)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    if RSTD and not RSTD_LATE:
        tl.store(RSTD_ptr + row, rstd)
    wf = w.to(tl.float32) + offset if OFFSET else w.to(tl.float32)
    y = (xf * rstd).to(x.dtype) * wf if ROUND else xf * rstd * wf
    for _ in tl.static_range(DELAY):  # DELAY more FMAs per element before the store (one = 1.0, offset = 0)
        y = y * one + offset
    if MASK:
        tl.store(Y + row * stride + cols, y.to(Y.dtype.element_ty), mask=cols < n_cols)
    else:
        tl.store(Y + row * stride + cols, y.to(Y.dtype.element_ty))
    if RSTD and RSTD_LATE:  # stored after y (kiln's order at 176d0fc) instead of before
        tl.store(RSTD_ptr + row, rstd)


def main():
    smoke = "--smoke" in sys.argv
    device = "cpu" if smoke else "cuda"
    mk = kn.Inputs(device, smoke)
    M, D = (64, 256) if smoke else (32768, 4096)
    x, w = mk.randn(M, D), mk.randn(D, scale=0.1) + 1
    fns = {"kiln": no_grad(lambda: RN.rmsnorm(x, w, EPS))}
    if not smoke:  # Liger's kernel calls eps.to(), which the interpreter's plain float has not
        from rmsnorm_bisect import liger_kernel_into

        def liger_kernel_plain():
            y = torch.empty((M, D), dtype=x.dtype, device=x.device)
            return liger_kernel_into(x, w, y, torch.empty(M, dtype=torch.float32, device=x.device))

        fns["liger"] = no_grad(lambda: kn.LigerRMSNormFunction.apply(x, w, EPS))
        fns["liger_kernel_plain"] = liger_kernel_plain
    for bits in itertools.product((0, 1), repeat=len(FLAGS)):
        flags = dict(zip(FLAGS, map(bool, bits), strict=True))

        def run(flags=flags):
            y = torch.empty((M, D), dtype=x.dtype, device=x.device)
            rstd = torch.empty(M, dtype=torch.float32, device=x.device)
            rms_flags[(M,)](x, y, w, rstd, D, D, EPS, 0.0, 1.0, **flags, DELAY=0, BLOCK=D, num_warps=8)
            return y

        fns["v_" + "_".join(n.lower() for n, on in flags.items() if on) if any(bits) else "v_kiln_like"] = run
    if "--second" in sys.argv:  # the second round: the leaders again, more rounds, and two new questions
        keep = ("kiln", "liger", "liger_kernel_plain", "v_kiln_like", "v_mask", "v_offset", "v_round_offset",
                "v_mask_round_offset", "v_mask_rstd_round_offset")  # fmt: skip
        fns = {n: f for n, f in fns.items() if n in keep}
        # does more work between the reduction and the stores speed it up? (DELAY FMAs per element)
        # and HF's order with a float32 weight (mixed-precision training keeps float32 weights)
        w32 = w.float()
        for name, wt, rnd, delay in (("v_delay1", w, False, 1), ("v_delay2", w, False, 2),
                                     ("v_delay4", w, False, 4), ("v_delay8", w, False, 8),
                                     ("v_kiln_like_w32", w32, False, 0), ("v_round_w32", w32, True, 0)):  # fmt: skip

            def run(wt=wt, rnd=rnd, delay=delay):
                y = torch.empty((M, D), dtype=x.dtype, device=x.device)
                rms_flags[(M,)](x, y, wt, y, D, D, EPS, 0.0, 1.0, MASK=False, RSTD=False, ROUND=rnd,
                                OFFSET=False, DELAY=delay, BLOCK=D, num_warps=8)  # fmt: skip
                return y

            fns[name] = run
    with use_backend("triton"):
        ref = RN.rmsnorm_ref(x, w, EPS).float()
        errors = {n: float((f().float() - ref).abs().max()) for n, f in fns.items()}
        out = run_meta() | {"flags": FLAGS, "max_abs_err_vs_reference": errors}
        out["group"] = run_group(
            "rmsnorm_fwd_liger_math", fns, smoke, 2 * x.numel() * 2, rounds=9 if "--second" in sys.argv else 7
        )
    print(json.dumps(errors), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
