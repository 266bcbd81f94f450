"""The fused decode kernels compiled for the H200 (sm_90) on the CPU machine (Triton cross-compiles without
a GPU): decode attention's split kernel with and without its own normalization (one split) and in its
one-pass form (the last split program reduces), and its reduction, RoPE + paged K/V write in both pair
layouts, and the decode matmuls with the SwiGLU prologue at the down projection's configs. The interpreter runs Python's semantics, so code that only the compiler
rejects (a static branch followed by a second `return` of another shape was one) shows up only here.

Runs in a subprocess: the pytest process imports triton under its interpreter (tests/conftest.py), which
replaces the jit functions that a compile needs (as tests/kernels/test_quant_sm90.py)."""

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
from triton.runtime.jit import JITFunction
from kiln.kernels import decode_attention as da, matmul_decode as md, rope

def compile_(fn, ptrs, consts, floats=(), **opts):
    while not isinstance(fn, JITFunction):  # an autotuner's kernel
        fn = fn.fn
    names = [p.name for p in fn.params]
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    return len(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"])

out = {}
for single, one_pass in ((False, False), (True, False), (False, True)):
    part = "*bf16" if single else "*fp32"
    ptrs = dict(Q="*bf16", K_CACHE="*bf16", V_CACHE="*bf16", BLOCK_TABLE="*i32", SEQ_LENS="*i32", O_PART=part,
                LSE_PART=part, SINKS="*fp32", OUT="*bf16", COUNTERS="*i32")
    c = dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=16, WINDOW=True, SINGLE=single, ONE_PASS=one_pass, GROUP_P=8,
             SPLIT_STEP=8, SINK=True, PDL=True, BLOCK_N=64)
    out[f"split single={single} one_pass={one_pass}"] = compile_(da._decode_split_kernel, ptrs, c, ("qk_scale",),
                                                                 num_warps=4, num_stages=3)
out["reduce"] = compile_(da._decode_reduce_kernel, dict(O_PART="*fp32", LSE_PART="*fp32", SINKS="*fp32", OUT="*bf16"),
                         dict(HEAD_DIM=128, BLOCK_S=32, SINK=True, PDL=True))
ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", Q_OUT="*bf16", COS="*fp32", SIN="*fp32", ROWS="*i64", K_CACHE="*bf16",
            V_CACHE="*bf16", SLOTS="*i64")
for inter in (False, True):
    c = dict(PAGE_SIZE=16, INTERLEAVED=inter, BLOCK_QH=16, BLOCK_KH=2, BLOCK_D=64, PDL=True)
    out[f"rope_kv interleaved={inter}"] = compile_(rope._rope_kv_write_kernel, ptrs, c)
mm = dict(X_ptr="*bf16", W_ptr="*bf16", Y_ptr="*fp32", Bias_ptr="*bf16", R_ptr="*bf16", SS_ptr="*fp32", G_ptr="*bf16")
for cfg in (md.decode_config(1, 1536, 8960, 132), md.decode_config(8, 1536, 8960, 132)):
    kernel = md._gemv_kernel if cfg.kernel == "gemv" else md._dot_kernel
    c = dict(HAS_BIAS=False, ACTIVATION="none", SWIGLU=True, RMSNORM=False, RESIDUAL=False, SS_BLOCK=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
             SPLIT_K=cfg.split_k, PDL=True, GRIDDEP=True)
    c.update(dict(BLOCK_M=1, STAGES=cfg.stages) if cfg.kernel == "gemv" else dict(BLOCK_M=16, PRECISION="ieee"))
    out[f"swiglu {cfg}"] = compile_(kernel, mm, c, num_warps=cfg.warps, num_stages=cfg.stages)
print(json.dumps(out))
"""


@pytest.mark.slow  # 8 compiles: ~10-25 s on an idle 2-core machine
def test_fused_decode_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: compile for real, touch nothing shared
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) == 8 and all(n > 0 for n in res.values()), res
