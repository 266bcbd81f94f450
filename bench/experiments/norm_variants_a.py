"""One-off H200 experiment (run at commit 6e35a22; results in bench/results/sweep_norm_variants.json).

    python bench/experiments/norm_variants_a.py OUT.json   # from the repo root, on a CUDA GPU

RMSNorm forward at 32768 x 4096: the statement order (row before weight) and Liger's weight math
(x * rstd rounded, then a bf16 multiply) as stand-alone kernels, against kiln's and Liger's; LayerNorm
and RMSNorm + residual row tiles at D = 1536; RoPE blocks without eviction hints, with and without the
one-token cos/sin path (an option removed afterwards: it measured no gain, so this script needs that
commit); prefill GEMM host path. None of the RMSNorm variants beat Liger (134.6-136.2 us against
133.6 us); the row tiles became the defaults.
"""

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, "bench")
import kernels_norms as kn
from kiln.kernels.dispatch import use_backend
from kiln.kernels.layernorm import layernorm_fwd
from kiln.kernels.matmul import linear, matmul_fwd
from kiln.kernels.rmsnorm import rmsnorm_fwd
from kiln.kernels.rope import rope_launch
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import no_grad, run_group


@triton.jit
def rms_var(
    X, Y, W, RSTD, stride, n_cols, eps, XFIRST: tl.constexpr, BF16W: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if XFIRST:
        x = tl.load(X + row * stride + cols, mask=mask, other=0.0)
        w = tl.load(W + cols, mask=mask, other=0.0)
    else:
        w = tl.load(W + cols, mask=mask, other=0.0)
        x = tl.load(X + row * stride + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    if BF16W:
        y = (xf * rstd).to(x.dtype) * w
    else:
        y = xf * rstd * w.to(tl.float32)
    tl.store(Y + row * stride + cols, y.to(Y.dtype.element_ty), mask=mask)


def main():
    out = run_meta() | {
        "groups": [],
    }
    mk = kn.Inputs("cuda", False)
    M = 32768
    x, w = mk.randn(M, 4096), mk.randn(4096, scale=0.1) + 1
    y = torch.empty_like(x)
    rs = torch.empty(M, device="cuda")
    fns = {"src_r1_w8": no_grad(lambda: rmsnorm_fwd(x, w, 1e-6, None, 8, 1))}
    for xf in (False, True):
        for bw in (False, True):
            for nw in (4, 8):
                fns[f"var_x{int(xf)}_bf16w{int(bw)}_w{nw}"] = lambda xf=xf, bw=bw, nw=nw: rms_var[(M,)](
                    x, y, w, rs, 4096, 4096, 1e-6, XFIRST=xf, BF16W=bw, BLOCK=4096, num_warps=nw
                )
    fns["liger"] = no_grad(lambda: kn.LigerRMSNormFunction.apply(x, w, 1e-6))
    out["groups"].append(run_group("rmsnorm_4096_variants", fns, False, 2 * x.numel() * 2))
    del x, y
    x, w, b = mk.randn(M, 1536), mk.randn(1536, scale=0.1) + 1, mk.randn(1536, scale=0.1)
    fns = {
        f"kiln_r{r}_w{nw}": no_grad(lambda r=r, nw=nw: layernorm_fwd(x, w, b, 1e-6, None, nw, r))
        for r in (1, 2, 4)
        for nw in (2, 4, 8)
    }
    fns["liger"] = no_grad(lambda: kn.LigerLayerNormFunction.apply(x, w, b, 1e-6))
    out["groups"].append(run_group("layernorm_1536", fns, False, 2 * x.numel() * 2))
    xr = mk.randn(M, 1536)
    fns = {
        f"kiln_r{r}_w{nw}": no_grad(lambda r=r, nw=nw: rmsnorm_fwd(x, w, 1e-6, xr, nw, r))
        for r in (1, 2, 4)
        for nw in (4, 8)
    }
    fns["liger"] = no_grad(lambda: kn.LigerFusedAddRMSNormFunction.apply(x, xr, w, 1e-6))
    out["groups"].append(run_group("rmsnorm_residual_1536", fns, False, 4 * x.numel() * 2))
    x, w, b = mk.randn(M, 4096), mk.randn(4096, scale=0.1) + 1, mk.randn(4096, scale=0.1)
    fns = {
        f"kiln_r{r}_w{nw}": no_grad(lambda r=r, nw=nw: layernorm_fwd(x, w, b, 1e-6, None, nw, r))
        for r, nw in ((1, 4), (2, 8), (2, 4), (2, 16))
    }
    fns["liger"] = no_grad(lambda: kn.LigerLayerNormFunction.apply(x, w, b, 1e-6))
    out["groups"].append(run_group("layernorm_4096", fns, False, 2 * x.numel() * 2))
    del x
    torch.cuda.empty_cache()
    B, T, Hq, Hk, D = 8, 4096, 32, 8, 128
    q, k = mk.randn(B, T, Hq, D), mk.randn(B, T, Hk, D)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    ang = torch.outer(torch.arange(T, device="cuda").float(), inv)
    cos, sin = ang.cos(), ang.sin()
    cf, sf = torch.cat((cos, cos), -1).bfloat16(), torch.cat((sin, sin), -1).bfloat16()
    fns = {
        f"kiln_r{r}_w{nw}_{'one' if o else 'row'}": no_grad(
            lambda r=r, nw=nw, o=o: rope_launch(
                q, k, cos, sin, None, False, rows=r, num_warps=nw, evict="", one_token=o
            )
        )
        for r, nw in ((4, 1), (8, 1), (8, 2), (16, 1), (16, 4))
        for o in (False, True)
    }
    c = torch.compile(kn.eager_rope, dynamic=False)
    qt, kt = q.transpose(1, 2), k.transpose(1, 2)
    fns["compile"] = no_grad(lambda: c(qt, kt, cf, sf))
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    fns["copy"] = lambda: (qo.copy_(q), ko.copy_(k))
    out["groups"].append(run_group("rope_fwd", fns, False, 2 * (q.numel() + k.numel()) * 2))
    del q, k, qo, ko
    torch.cuda.empty_cache()
    with torch.no_grad(), use_backend("triton"):
        for name, K, N in (("qkv", 1536, 2048), ("o", 1536, 1536)):
            x, w = mk.randn(8192, K), mk.randn(N, K, scale=K**-0.5)
            out["groups"].append(
                run_group(
                    f"gemm_{name}",
                    {
                        "kiln_linear": lambda: linear(x, w),
                        "kiln_matmul_fwd": lambda: matmul_fwd(x, w.t()),
                        "cublas": lambda: F.linear(x, w),
                    },
                    False,
                )
            )
    json.dump(out, open(sys.argv[1], "w"), indent=1)


main()
