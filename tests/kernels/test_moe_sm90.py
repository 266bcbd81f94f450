"""The MoE kernels of issue 19's second round compiled for the H200 (sm_90) on the CPU machine (Triton
cross-compiles without a GPU), at the launch configs their launchers pick for Mixtral-sized bf16 operands:
the persistent TMA grouped GEMM (forward: w read K-major; dx: w read row-major) must feed wgmma from
`cp.async.bulk.tensor` (TMA) copies, the TMA dW likewise, and the decode kernels must stream the weights
with 16-byte loads (`cp.async.cg` through the pipeline, or `ld.global.v4` at one stage). The interpreter
runs none of this: a kernel that silently fell back to scalar loads or to mma without TMA shows up only
here.

Runs in a subprocess: the pytest process imports triton under its interpreter (tests/conftest.py), which
replaces the jit functions that a compile needs (as tests/kernels/test_decode_sm90.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels import moe_decode as md, moe_gemm as mg

def ptx(fn, ptrs, consts, nodiv=(), **opts):
    fn = fn.fn if hasattr(fn, "fn") and not hasattr(fn, "params") else fn
    names = [p.name for p in fn.params]
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    # pointers 16-byte aligned and ints divisible by 16, as Triton specializes a real launch's
    # (the sizes here are 4096, 14336, 28672; the expert count and tile bounds are not)
    div = [n for n in names if n not in consts and n not in nodiv]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

def feats(p):
    return {f: p.count(f) for f in ("wgmma.mma_async", "cp.async.bulk.tensor", "cp.async.cg", "ld.global.v4")}

out = {}
bm, bn, bk, warps, stages, _ = mg.TMA_BIG
for kmajor in (True, False):
    out[f"mm_tma kmajor={kmajor}"] = feats(ptx(
        mg._grouped_mm_tma_kernel, dict(A_ptr="*bf16", B_ptr="*bf16", C_ptr="*bf16", Offs_ptr="*i32"),
        dict(B_KMAJOR=kmajor, PRECISION="ieee", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, BLOCK_E=16, GROUP_M=8),
        nodiv=("E", "m_tiles", "num_programs", "R"), num_warps=warps, num_stages=stages))
bn, bk, br, warps, stages, _ = mg.DW_TMA
out["dw_tma"] = feats(ptx(
    mg._grouped_dw_tma_kernel, dict(DY_ptr="*bf16", X_ptr="*bf16", DW_ptr="*bf16", Offs_ptr="*i32"),
    dict(PRECISION="ieee", BLOCK_N=bn, BLOCK_K=bk, BLOCK_R=br), num_warps=warps, num_stages=stages))
for K in (4096, 14336):  # Mixtral's d (the up kernel's stream) and I (the down kernel's)
    t = md.decode_tiles(K)
    out[f"up K={K}"] = feats(ptx(
        md._up_kernel, dict(X_ptr="*bf16", Idx_ptr="*i32", W_ptr="*bf16", H_ptr="*bf16"),
        dict(TOPK=2, BLOCK_N=t.block_n, BLOCK_K=t.block_k, STAGES=t.stages, stride_xc=1, stride_wc=1),
        num_warps=t.warps, num_stages=t.stages))
    out[f"down K={K}"] = feats(ptx(
        md._down_kernel, dict(H_ptr="*bf16", Idx_ptr="*i32", Wt_ptr="*fp32", W_ptr="*bf16", Y_ptr="*bf16"),
        dict(TOPK=2, TOPK_P2=2, BLOCK_N=t.block_n, BLOCK_K=t.block_k, STAGES=t.stages, stride_wi=1),
        num_warps=t.warps, num_stages=t.stages))
print(json.dumps(out))
"""


@pytest.mark.slow  # 7 compiles: ~15 s on an idle 2-core machine
def test_moe_kernels_compile_for_sm90_with_tma_and_vector_loads(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: compile for real, touch nothing shared
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 7, res
    for name in ("mm_tma kmajor=True", "mm_tma kmajor=False", "dw_tma"):
        assert res[name]["wgmma.mma_async"] > 0 and res[name]["cp.async.bulk.tensor"] > 0, (name, res[name])
    for name in ("up K=4096", "down K=4096"):  # 3-stage pipeline: 16-byte cp.async
        assert res[name]["cp.async.cg"] > 0, (name, res[name])
    for name in ("up K=14336", "down K=14336"):  # one stage: 16-byte loads straight to registers
        assert res[name]["ld.global.v4"] > 0, (name, res[name])
