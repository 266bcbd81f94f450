"""One-off H200 experiment: memory-bound row kernels reading and writing through TMA (the Hopper bulk
tensor copy engine) instead of per-thread 16-byte loads, against kiln's kernels and the peers.

    python bench/experiments/tma_rows.py OUT.json   # from the repo root, on a CUDA GPU (~2 minutes)

RMSNorm forward (D = 4096 and 1536), LayerNorm forward (D = 4096) and SwiGLU forward (32768 x 8960), bf16.
Each TMA kernel takes host-side tensor descriptors: one program per (ROWS, BLOCK) tile, or a persistent
grid looping over tiles with the loop software-pipelined (the descriptor loads of the next tiles in
flight while this one reduces). Rows padded by the copy engine (zeros past the end), so no masks.
"""

import json
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, "bench")
import kernels_norms as kn  # noqa: E402
from kiln.kernels.dispatch import sm_count  # noqa: E402
from kiln.kernels.layernorm import layernorm_fwd  # noqa: E402
from kiln.kernels.rmsnorm import rmsnorm_fwd  # noqa: E402
from kiln.kernels.swiglu import swiglu  # noqa: E402
from provenance import run_meta  # noqa: E402
from sweep_memory_bound import no_grad, run_group  # noqa: E402

EPS = 1e-6


@triton.jit
def _rms_tile(t, x_desc, y_desc, w, RSTD, n_rows, n_cols, eps, ROWS: tl.constexpr):
    row0 = t * ROWS
    x = x_desc.load([row0, 0]).to(tl.float32)  # (ROWS, BLOCK), zero past the row and past n_rows
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    y_desc.store([row0, 0], (x * rstd[:, None] * w[None, :]).to(y_desc.dtype))
    rows = row0 + tl.arange(0, ROWS)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def rms_tma(x_desc, y_desc, W, RSTD, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr,
            PERSIST: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    cols = tl.arange(0, BLOCK)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if PERSIST:
        for t in tl.range(tl.program_id(0), tl.cdiv(n_rows, ROWS), tl.num_programs(0), num_stages=STAGES):
            _rms_tile(t, x_desc, y_desc, w, RSTD, n_rows, n_cols, eps, ROWS)
    else:
        _rms_tile(tl.program_id(0), x_desc, y_desc, w, RSTD, n_rows, n_cols, eps, ROWS)


@triton.jit
def rms_tma3(x_desc, y_desc, W, RSTD, n_rows, n_cols, eps, ROWS: tl.constexpr, SPLIT: tl.constexpr):
    # rows viewed as (n_rows, SPLIT, 256): every box dim within the copy engine's 256 limit
    row0 = tl.program_id(0) * ROWS
    w = tl.load(W + tl.arange(0, SPLIT)[:, None] * 256 + tl.arange(0, 256)[None, :]).to(tl.float32)
    x = x_desc.load([row0, 0, 0]).to(tl.float32)  # (ROWS, SPLIT, 256)
    rstd = tl.rsqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / n_cols + eps)
    y_desc.store([row0, 0, 0], (x * rstd[:, None, None] * w[None, :, :]).to(y_desc.dtype))
    rows = row0 + tl.arange(0, ROWS)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def ln_tma(x_desc, y_desc, W, B, MEAN, RSTD, n_rows, n_cols, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    row0 = tl.program_id(0) * ROWS
    x = x_desc.load([row0, 0]).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    xc = tl.where((cols < n_cols)[None, :], x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    y_desc.store([row0, 0], (xc * rstd[:, None] * w[None, :] + b[None, :]).to(y_desc.dtype))
    rows = row0 + tl.arange(0, ROWS)
    tl.store(MEAN + rows, mean, mask=rows < n_rows)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def swiglu_tma(g_desc, u_desc, o_desc, n_tiles_n, n_tiles, BM: tl.constexpr, BN: tl.constexpr,
               PERSIST: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    if PERSIST:
        for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
            m, n = (t // n_tiles_n) * BM, (t % n_tiles_n) * BN
            g = g_desc.load([m, n]).to(tl.float32)
            u = u_desc.load([m, n]).to(tl.float32)
            o_desc.store([m, n], (g * tl.sigmoid(g) * u).to(o_desc.dtype))
    else:
        t = tl.program_id(0)
        m, n = (t // n_tiles_n) * BM, (t % n_tiles_n) * BN
        g = g_desc.load([m, n]).to(tl.float32)
        u = u_desc.load([m, n]).to(tl.float32)
        o_desc.store([m, n], (g * tl.sigmoid(g) * u).to(o_desc.dtype))


def rms_variants(x, w):
    M, D = x.shape
    B = triton.next_power_of_2(D)
    y, rstd = torch.empty_like(x), torch.empty(M, device=x.device)
    sms = sm_count(x.device)
    fns = {}
    for rows in (1, 2):
        xd, yd = (
            TensorDescriptor(x, [M, D], [D, 1], [rows, B]),
            TensorDescriptor(y, [M, D], [D, 1], [rows, B]),
        )
        for nw in (4, 8, 16):
            fns[f"tma_r{rows}_w{nw}"] = (lambda xd=xd, yd=yd, rows=rows, nw=nw: rms_tma[(triton.cdiv(M, rows),)](
                xd, yd, w, rstd, M, D, EPS, ROWS=rows, BLOCK=B, PERSIST=False, STAGES=1, num_warps=nw))  # fmt: skip
        for per_sm, stages, nw in ((2, 2, 8), (4, 2, 8), (2, 3, 8), (8, 2, 4), (4, 3, 4)):
            fns[f"tma_r{rows}_persist{per_sm}_s{stages}_w{nw}"] = (
                lambda xd=xd, yd=yd, rows=rows, nw=nw, per_sm=per_sm, stages=stages: rms_tma[(sms * per_sm,)](
                    xd, yd, w, rstd, M, D, EPS, ROWS=rows, BLOCK=B, PERSIST=True, STAGES=stages, num_warps=nw))  # fmt: skip
    if D % 256 == 0 and D // 256 in (2, 4, 8, 16):
        S = D // 256
        xd3 = TensorDescriptor(x, [M, S, 256], [D, 256, 1], [1, S, 256])
        yd3 = TensorDescriptor(y, [M, S, 256], [D, 256, 1], [1, S, 256])
        for nw in (4, 8):
            fns[f"tma3d_w{nw}"] = (lambda nw=nw: rms_tma3[(M,)](
                xd3, yd3, w, rstd, M, D, EPS, ROWS=1, SPLIT=S, num_warps=nw))  # fmt: skip
    return fns, y


def main():
    out = run_meta() | {"liger": kn.LIGER, "groups": [], "errors": []}
    mk = kn.Inputs("cuda", False)

    def save():
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)

    M = 32768
    for D in (4096, 1536):
        x, w = mk.randn(M, D), mk.randn(D, scale=0.1) + 1
        fns = {"kiln": no_grad(lambda x=x, w=w: rmsnorm_fwd(x, w, EPS))}
        fns["liger"] = kn.liger(no_grad(lambda x=x, w=w: kn.LigerRMSNormFunction.apply(x, w, EPS)))
        ref = rmsnorm_fwd(x, w, EPS)[0]
        variants, y = rms_variants(x, w)
        errs = {}
        for name, f in variants.items():  # correctness first: each variant writes the shared y
            try:
                y.zero_()
                f()
                errs[name] = float((y.float() - ref.float()).abs().max())
            except Exception as e:  # noqa: BLE001
                errs[name] = f"{type(e).__name__}: {str(e)[:300]}"
        out[f"rms_{D}_max_abs_err_vs_kiln"] = errs
        print(errs, flush=True)
        fns |= {n: f for n, f in variants.items() if isinstance(errs[n], float)}
        out["groups"].append(run_group(f"rmsnorm_fwd_{D}", fns, False, 2 * x.numel() * 2))
        save()

    D = 4096
    x, w, b = mk.randn(M, D), mk.randn(D, scale=0.1) + 1, mk.randn(D, scale=0.1)
    y, mean, rstd = torch.empty_like(x), torch.empty(M, device="cuda"), torch.empty(M, device="cuda")
    fns = {"kiln": no_grad(lambda: layernorm_fwd(x, w, b, EPS)),
           "liger": kn.liger(no_grad(lambda: kn.LigerLayerNormFunction.apply(x, w, b, EPS)))}  # fmt: skip
    for rows in (1, 2):
        xd, yd = (
            TensorDescriptor(x, [M, D], [D, 1], [rows, D]),
            TensorDescriptor(y, [M, D], [D, 1], [rows, D]),
        )
        for nw in (4, 8, 16):
            fns[f"tma_r{rows}_w{nw}"] = (lambda xd=xd, yd=yd, rows=rows, nw=nw: ln_tma[(triton.cdiv(M, rows),)](
                xd, yd, w, b, mean, rstd, M, D, EPS, ROWS=rows, BLOCK=D, num_warps=nw))  # fmt: skip
    ref = layernorm_fwd(x, w, b, EPS)[0]
    try:
        fns["tma_r2_w8"]()
        out["ln_tma_max_abs_err_vs_kiln"] = float((y.float() - ref.float()).abs().max())
    except Exception as e:  # noqa: BLE001
        out["errors"].append(f"ln: {type(e).__name__}: {str(e)[:300]}")
    out["groups"].append(run_group("layernorm_fwd_4096", fns, False, 2 * x.numel() * 2))
    save()

    H = 8960
    g_, u_ = mk.randn(M, H, scale=2.0), mk.randn(M, H, scale=2.0)
    o = torch.empty_like(g_)
    c = mk.compiled(kn.eager_swiglu)
    fns = {"kiln": no_grad(lambda: swiglu(g_, u_)), "compile": c and no_grad(lambda: c(g_, u_)),
           "liger": kn.liger(no_grad(lambda: kn.LigerSiLUMulFunction.apply(g_, u_)))}  # fmt: skip
    sms = sm_count(x.device)
    for bm, bn, nw in ((4, 256, 4), (8, 256, 4), (8, 256, 8), (16, 256, 8), (32, 128, 8), (2, 256, 2)):
        ds = [TensorDescriptor(t, [M, H], [H, 1], [bm, bn]) for t in (g_, u_, o)]
        nn_, nt = triton.cdiv(H, bn), triton.cdiv(M, bm) * triton.cdiv(H, bn)
        fns[f"tma_{bm}x{bn}_w{nw}"] = (lambda ds=ds, nn_=nn_, nt=nt, bm=bm, bn=bn, nw=nw: swiglu_tma[(nt,)](
            *ds, nn_, nt, BM=bm, BN=bn, PERSIST=False, STAGES=1, num_warps=nw))  # fmt: skip
        if (bm, bn) in ((8, 256), (16, 256)):
            for per_sm, st in ((2, 3), (4, 2), (8, 2)):
                fns[f"tma_{bm}x{bn}_w{nw}_p{per_sm}_s{st}"] = (
                    lambda ds=ds, nn_=nn_, nt=nt, bm=bm, bn=bn, nw=nw, per_sm=per_sm, st=st: swiglu_tma[(sms * per_sm,)](
                        *ds, nn_, nt, BM=bm, BN=bn, PERSIST=True, STAGES=st, num_warps=nw))  # fmt: skip
    try:
        fns["tma_8x256_w4"]()
        out["swiglu_tma_max_abs_err_vs_kiln"] = float((o.float() - swiglu(g_, u_).float()).abs().max())
    except Exception as e:  # noqa: BLE001
        out["errors"].append(f"swiglu: {type(e).__name__}: {str(e)[:300]}")
    out["groups"].append(run_group("swiglu_fwd", fns, False, 3 * g_.numel() * 2))
    save()


if __name__ == "__main__":
    main()
