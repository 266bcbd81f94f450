"""The quantized matmul kernels compiled for the H200 (sm_90) on the CPU machine: Triton cross-compiles
without a GPU. Each kernel must build, its tensor-core forms must use wgmma, and its weight stream must be
vector copies into shared memory (cp.async), not one-byte loads: a first version of the int4 kernels
computed byte addresses as (2j) // 2, which Triton's contiguity analysis cannot see through, and loaded
weights a byte at a time; the interpreter's results were right all the same. Pointers and the ints Triton
would specialize are declared 16-divisible (stride 1 a constant), as the JIT sees them at a real launch.

Runs in a subprocess: the pytest process imports triton under its interpreter (tests/conftest.py), which
replaces the jit functions that a compile needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = r"""
import json, re
from collections import Counter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels import fp8_matmul as f8, quant_matmul as qm

def compile_(fn, ptrs, consts, divisible, **opts):
    names = [p.name for p in fn.params]
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*ptrs, *divisible]}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    loads = Counter(re.findall(r"(ld\.global\.b8|cp\.async\.c[ag]\.shared\.global|cp\.async\.bulk\.tensor)", ptx))
    return {"wgmma": "wgmma" in ptx, "byte_loads": loads["ld.global.b8"],
            "async": loads["cp.async.ca.shared.global"] + loads["cp.async.cg.shared.global"],
            "tma": loads["cp.async.bulk.tensor"]}

ptrs = dict(X_ptr="*bf16", Q_ptr="*u8", S_ptr="*bf16", Z_ptr="*u8", Y_ptr="*bf16", Bias_ptr="*bf16")
ints = ["M", "N", "K", "stride_xm", "stride_qn", "stride_sn"]
out = {}
for name, dot, bn, bk, warps in [("gemv", False, 4, 512, 2), ("dot", True, 64, 128, 4)]:
    c = dict(stride_xk=1, BITS=4, GROUP=128, HAS_ZERO=True, HAS_BIAS=False, DOT=dot, PRECISION="ieee",
             BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, STAGES=3)
    out[f"int4 {name}"] = compile_(qm._wq_decode_kernel, ptrs, c, [*ints, "k_split"], num_warps=warps, num_stages=3)
for bits, q in ((4, "*u8"), (8, "*i8")):  # the small-M tiles (quicker to compile than 128x128)
    c = dict(stride_xk=1, BITS=bits, GROUP=128 if bits == 4 else 1, HAS_ZERO=bits == 4, HAS_BIAS=False,
             PRECISION="ieee", BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, STAGES=4)
    out[f"int{bits} tile"] = compile_(qm._wq_tile_kernel, {**ptrs, "Q_ptr": q}, c, ints, num_warps=4, num_stages=4)
c = dict(ROW_A=True, ROW_B=True, HAS_BIAS=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, STAGES=4, TMA=False)
fp8_ptrs = dict(A_ptr="*fp8e4nv", B_ptr="*fp8e4nv", SA_ptr="*fp32", SB_ptr="*bf16", C_ptr="*bf16", Bias_ptr="*bf16")
out["fp8 tile"] = compile_(f8._fp8_tile_kernel, fp8_ptrs, c, ["M", "N", "K", "stride_am", "stride_bn"], num_warps=4,
                           num_stages=4)
out["fp8 tile, TMA"] = compile_(f8._fp8_tile_kernel, fp8_ptrs, {**c, "TMA": True},
                                ["M", "N", "K", "stride_am", "stride_bn"], num_warps=4, num_stages=4)
# the decode kernel quantizing bf16 activations itself (QUANT_A), K split in two
c = dict(ROW_A=False, ROW_B=True, HAS_BIAS=False, BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, STAGES=3, QUANT_A=True, PDL=True)
out["fp8 decode, x quantized inside"] = compile_(f8._fp8_decode_kernel, {**fp8_ptrs, "A_ptr": "*bf16"}, c,
                                                ["M", "N", "K", "stride_am", "stride_bn", "k_split"], num_warps=4,
                                                num_stages=3)
print(json.dumps(out))
"""


SCRIPT_WORDS = r"""
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels import quant_decode as qd

def compile_(fn, ptrs, consts, divisible, **opts):
    names = [p.name for p in fn.params]
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in [*ptrs, *divisible]}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    head = ptx.split("griddepcontrol.wait")[0]  # issued before the programmatic-launch wait
    return {"before_wait": head.count("ld.global") + head.count("cp.async"),
            "wgmma": "wgmma" in ptx, "int_to_float": len(re.findall(r"cvt\.rn\.f(16|32)\.[su](8|16|32)", ptx)),
            "bf16_to_float": len(re.findall(r"cvt\.f32\.bf16", ptx)), "griddep": "griddepcontrol.wait" in ptx,
            "async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
            "lop3": len(re.findall(r"lop3\.b32 [^;]*, 0xea;", ptx)), "prmt": len(re.findall(r"prmt\.b32", ptx))}

ptrs = dict(X_ptr="*bf16", W_ptr="*i32", S_ptr="*bf16", Z_ptr="*u8", Y_ptr="*bf16", Bias_ptr="*bf16")
ints = ["M", "N", "K", "stride_xm", "stride_wn", "stride_sn", "k_split"]
tiles = dict(stride_xk=1, HAS_ZERO=True, HAS_BIAS=False, SPLIT_K=1, STAGES=3)
out = {"int4 fma": compile_(qd._wq_fma_kernel, ptrs, dict(tiles, BITS=4, GROUP=128, BLOCK_N=8, BLOCK_K=256, ASM=True,
                                                   X_PAIRS=False, PDL=False, PRE=False, GLU=False),
                            ints, num_warps=2, num_stages=3),
       # one row, 128-wide K steps inside one g128 group, x read as int32 pairs
       "int4 fma, pairs": compile_(qd._wq_fma_kernel, ptrs, dict(tiles, BITS=4, GROUP=128, BLOCK_N=32, BLOCK_K=128,
                                   ASM=True, X_PAIRS=True, PDL=True, PRE=False, GLU=False), ints, num_warps=2,
                                   num_stages=3),
       # the q/k/v projection's int8 table config with its first K step before the wait (the default)
       "int8 fma, pre": compile_(qd._wq_fma_kernel, ptrs, dict(tiles, BITS=8, GROUP=1, BLOCK_N=8, BLOCK_K=512,
                                 HAS_ZERO=False, ASM=True, X_PAIRS=True, PDL=True, PRE=True, GLU=False), ints,
                                 num_warps=4, num_stages=3),
       # gate/up's int8 table config with the SwiGLU in its epilogue
       "int8 fma, swiglu": compile_(qd._wq_fma_kernel, ptrs, dict(tiles, BITS=8, GROUP=1, BLOCK_N=16, BLOCK_K=256,
                                    HAS_ZERO=False, ASM=True, X_PAIRS=True, PDL=True, PRE=False, GLU=True), ints,
                                    num_warps=2, num_stages=3),
       "int4 mma": compile_(qd._wq_mma_kernel, ptrs, dict(tiles, BITS=4, GROUP=128, MAGIC=0x4300, SH=0,
                            PRECISION="ieee", BLOCK_N=64, BLOCK_K=128, PDL=True, ASM=True), ints, num_warps=4,
                            num_stages=3),
       "int8 mma": compile_(qd._wq_mma_kernel, ptrs, dict(tiles, BITS=8, GROUP=1, MAGIC=0x4300, SH=0,
                            PRECISION="ieee", BLOCK_N=64, BLOCK_K=128, HAS_ZERO=False, PDL=False), ints, num_warps=4,
                            num_stages=3)}
print(json.dumps(out))
"""


@pytest.mark.slow  # ~10-15 s of compiling on 2 cores
def test_word_kernels_convert_nothing(tmp_path):
    """kernels/quant_decode.py's point: weights become floats by bit operations, so the PTX of its int4
    kernels holds no integer-to-float conversion (the first kernels' I2F ran at an eighth of the FP32 rate),
    streams the words through cp.async, the mma form uses wgmma, and the fma form ORs each nibble under its
    exponent with one lop3."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT_WORDS], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        assert r["int_to_float"] == 0, f"{name}: integer-to-float conversions in its PTX: {r}"
        assert r["async"] > 0, f"{name}: no cp.async in its PTX: {r}"
    assert res["int4 mma"]["wgmma"] and res["int8 mma"]["wgmma"], res
    # each nibble's AND-OR is one inline lop3 (LUT 0xea: (a & b) | c): 8 nibbles x the thread's words a K step
    assert res["int4 fma"]["lop3"] >= 8, res
    # x as int32 pairs: each bf16 widened by a shift or an AND, so the only bf16 -> float32 conversions left
    # are the scales, one per row a thread holds (4 at 32 rows over 2 warps); the bf16 load converts every x
    assert res["int4 fma, pairs"]["bf16_to_float"] <= 4 < res["int4 fma"]["bf16_to_float"], res
    # the int4 mma form takes each byte's two nibbles as two 16-bit floats with one PRMT and one LOP3
    assert res["int4 mma"]["prmt"] >= 4 and res["int4 mma"]["lop3"] >= 4, res
    # launched with programmatic dependent launch in a decode step, they wait for the kernel before
    assert res["int4 fma, pairs"]["griddep"] and res["int4 mma"]["griddep"], res
    # and load nothing before that wait, unless told to preload their first K step: (8 x 128 words) / 128
    # threads, two 16-byte loads a thread
    assert res["int4 fma, pairs"]["before_wait"] == 0 and res["int8 fma, pre"]["before_wait"] >= 2, res


@pytest.mark.slow  # ~15-20 s of compiling on 2 cores
def test_kernels_compile_for_sm90_with_vector_weight_streams(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: compile for real, touch nothing shared
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in res.items():
        if "TMA" in name:  # tensor-descriptor copies, no per-thread cp.async
            assert r["tma"] > 0 and r["async"] == 0, (
                f"{name}: expected TMA copies (cp.async.bulk.tensor): {r}"
            )
        else:
            assert r["async"] > 0, f"{name}: no cp.async in its PTX (the weight stream is not pipelined): {r}"
        assert r["byte_loads"] <= 2, f"{name}: {r['byte_loads']} one-byte global loads per thread: {r}"
        assert r["wgmma"] or name == "int4 gemv", f"{name}: no wgmma (tensor cores) in its PTX"
