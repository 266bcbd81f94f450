"""The fused decode kernels compiled for the H200 (sm_90) on the CPU machine (Triton cross-compiles without
a GPU): decode attention's split kernel with and without its own normalization (one split) and in its
one-pass form (the last split program reduces), with int64 and int32 (ADDR32) K/V addressing, and its reduction, RoPE + paged K/V write in both pair
layouts, and the decode matmuls with the SwiGLU prologue at the down projection's configs. The interpreter runs Python's semantics, so code that only the compiler
rejects (a static branch followed by a second `return` of another shape was one) shows up only here.

Runs in a subprocess: the pytest process imports triton under its interpreter (tests/conftest.py), which
replaces the jit functions that a compile needs (as tests/kernels/test_quant_sm90.py).

The second test compiles the split kernel as the H200 launches it: the launcher runs on CPU tensors of the
Qwen2.5-1.5B decode shape and the launch is caught before it runs, so the signature is Triton's own
specialization of those arguments (strides divisible by 16 marked so, as at a real launch: K/V rows load
as 16-byte cp.async; a signature that marks only the pointers, as the first test's, compiles scalar loads
through 64-bit pointer tensors, 255 registers with 300-500 bytes spilled, which no launch runs). ptxas -v
on the PTX gives registers and spills: the ADDR32 configs must not spill and must leave room for the
programs per SM that the split count aims at (docs/perf/attention.md has the table of all configs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kiln.kernels import decode_attention as dec

from ._sm90 import RESOURCES

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
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

def before_wait(ptx):  # global loads issued before the programmatic-launch wait
    head = ptx.split("griddepcontrol.wait")[0]
    return head.count("ld.global") + head.count("cp.async.cg")

def signals_first(ptx):  # griddepcontrol.launch_dependents ahead of griddepcontrol.wait (pdl_prologue's FIRST)
    return ptx.index("griddepcontrol.launch_dependents") < ptx.index("griddepcontrol.wait")

out = {}
for single, one_pass, addr32 in ((False, False, False), (False, False, True), (True, False, True), (False, True, True)):
    part = "*bf16" if single else "*fp32"
    ptrs = dict(Q="*bf16", K_CACHE="*bf16", V_CACHE="*bf16", BLOCK_TABLE="*i32", SEQ_LENS="*i32", O_PART=part,
                LSE_PART=part, SINKS="*fp32", OUT="*bf16", COUNTERS="*i32")
    c = dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=16, WINDOW=True, SINGLE=single, ONE_PASS=one_pass, GROUP_P=8,
             SPLIT_STEP=8, SINK=True, PDL=True, BLOCK_N=64, FITS32=True, ADDR32=addr32, TMA_OK=True, TMA=False,
             PRELOAD=addr32, MAX_PAGES=64, EARLY=addr32, FIRST=single)
    ptx = compile_(da._decode_split_kernel, ptrs, c, ("qk_scale",), num_warps=4, num_stages=3)
    out[f"split single={single} one_pass={one_pass} addr32={addr32}"] = len(ptx)
    out[f"split single={single} one_pass={one_pass} addr32={addr32} first"] = signals_first(ptx)
    out[f"split single={single} one_pass={one_pass} addr32={addr32} early"] = before_wait(ptx)
for first in (False, True):
    ptx = compile_(da._decode_reduce_kernel, dict(O_PART="*fp32", LSE_PART="*fp32", SINKS="*fp32", OUT="*bf16"),
                   dict(HEAD_DIM=128, BLOCK_S=32, SINK=True, PDL=True, FIRST=first))
    out[f"reduce first={first}"] = len(ptx)
    out[f"reduce first={first} first"] = signals_first(ptx)
ptrs = dict(Q="*bf16", K="*bf16", V="*bf16", Q_OUT="*bf16", COS="*fp32", SIN="*fp32", ROWS="*i64", K_CACHE="*bf16",
            V_CACHE="*bf16", SLOTS="*i64", BQ="*bf16", BK="*bf16", BV="*bf16")
for inter in (False, True):
    c = dict(PAGE_SIZE=16, INTERLEAVED=inter, BLOCK_QH=16, BLOCK_KH=2, BLOCK_D=64, PDL=True, EARLY=inter, FIRST=inter,
             SPLIT=0, HAS_BIAS=False)
    ptx = compile_(rope._rope_kv_write_kernel, ptrs, c)
    out[f"rope_kv interleaved={inter}"] = len(ptx)
    out[f"rope_kv interleaved={inter} first"] = signals_first(ptx)
    out[f"rope_kv interleaved={inter} early"] = before_wait(ptx)
# on a split-K q/k/v projection's partials (rope_kv_write_split): float32 q, k, v, the bias added
ptx = compile_(rope._rope_kv_write_kernel, dict(ptrs, Q="*fp32", K="*fp32", V="*fp32"),
               dict(c, INTERLEAVED=False, SPLIT=4, HAS_BIAS=True))
out["rope_kv split"] = len(ptx)
out["rope_kv split early"] = before_wait(ptx)
mm = dict(X_ptr="*bf16", W_ptr="*bf16", Y_ptr="*fp32", Bias_ptr="*bf16", R_ptr="*bf16", SS_ptr="*fp32", G_ptr="*bf16")
for cfg in (md.decode_config(1, 1536, 8960, 132), md.decode_config(8, 1536, 8960, 132)):
    kernel = md._gemv_kernel if cfg.kernel == "gemv" else md._dot_kernel
    c = dict(HAS_BIAS=False, ACTIVATION="none", SWIGLU=True, RMSNORM=False, RESIDUAL=False, GLU=False, SS_BLOCK=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
             SPLIT_K=cfg.split_k, PDL=True, GRIDDEP=True)
    c.update(dict(BLOCK_M=1, STAGES=cfg.stages, PRE_K=0) if cfg.kernel == "gemv" else dict(BLOCK_M=16, PRECISION="ieee"))
    out[f"swiglu {cfg}"] = len(compile_(kernel, mm, c, num_warps=cfg.warps, num_stages=cfg.stages))
# the one-row rule at the qkv projection with its whole W slice preloaded (decode_matmul's preload_weight)
cfg = md.decode_config(1, 2048, 1536, 132)
c = dict(HAS_BIAS=True, ACTIVATION="none", SWIGLU=False, RMSNORM=False, RESIDUAL=False, GLU=False, SS_BLOCK=1,
         BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=1, PDL=True, GRIDDEP=True, BLOCK_M=1, STAGES=cfg.stages,
         PRE_K=2048)
out["gemv pre early"] = before_wait(compile_(md._gemv_kernel, mm, c, num_warps=cfg.warps, num_stages=cfg.stages))
# the fused q/k/v + RoPE + K/V write at that shape, with its W slice and tables before the wait and without
qr = dict(X="*bf16", W="*bf16", BIAS="*bf16", Q_OUT="*bf16", COS="*fp32", SIN="*fp32", ROWS="*i64", K_CACHE="*bf16",
          V_CACHE="*bf16", SLOTS="*i64", R="*bf16", G="*bf16", H_OUT="*bf16")
for pre, norm in ((0, False), (2048, False), (2048, True)):  # the last with the block's add + RMSNorm inside
    c = dict(HAS_BIAS=True, INTERLEAVED=False, PAGE_SIZE=16, PAIRS=rope.QKV_PAIRS, BLOCK_K=rope.QKV_BLOCK_K,
             STAGES=rope.QKV_STAGES, PDL=True, NORM=norm, HAS_RESIDUAL=norm, PRE_K=pre, EARLY=pre > 0,
             FIRST=pre > 0)
    ptx = compile_(rope._qkv_rope_kernel, qr, c, ("eps",), num_warps=rope.QKV_WARPS, num_stages=rope.QKV_STAGES)
    tag = f"qkv_rope pre={pre}" + (" norm" if norm else "")
    out[f"{tag} early"] = before_wait(ptx)
    out[f"{tag} first"] = signals_first(ptx)
print(json.dumps(out))
"""


@pytest.mark.slow  # 13 compiles: ~10-30 s on an idle 2-core machine
def test_fused_decode_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a fresh cache: compile for real, touch nothing shared
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    early = {k: res.pop(k) for k in list(res) if k.endswith(" early")}
    # pdl_prologue's FIRST (compiled with it: the one-split kernel, the second reduction, interleaved RoPE):
    # the next kernel is signalled before the wait; otherwise after it
    first = {k: res.pop(k) for k in list(res) if k.endswith(" first")}
    assert first == {
        "split single=False one_pass=False addr32=False first": False,
        "split single=False one_pass=False addr32=True first": False,
        "split single=True one_pass=False addr32=True first": True,
        "split single=False one_pass=True addr32=True first": False,
        "reduce first=False first": False,
        "reduce first=True first": True,
        "rope_kv interleaved=False first": False,
        "rope_kv interleaved=True first": True,
        "qkv_rope pre=0 first": False,
        "qkv_rope pre=2048 first": True,
        "qkv_rope pre=2048 norm first": True,
    }, first
    assert len(res) == 11 and all(n > 0 for n in res.values()), res
    # EARLY (the ADDR32 launches here): the key count, the first tile's pages and its K and V rows load before
    # griddepcontrol.wait; the int64 form compiled without it loads nothing before the wait
    assert early.pop("split single=False one_pass=False addr32=False early") == 0, early
    # the preloading gemv: its W slice (4 rows x 2048 columns, 16-byte loads)
    assert early.pop("gemv pre early") >= 4, early
    # the fused q/k/v kernel: nothing before the wait in its loop form; with PRE_K and EARLY its W slice (as the
    # gemv's) and the table row, cos, sin and slot
    assert early.pop("qkv_rope pre=0 early") == 0, early
    assert early.pop("qkv_rope pre=2048 early") >= 8, early
    # with the norm inside: the weight slice and tables still before the wait (x and the residual after it)
    assert early.pop("qkv_rope pre=2048 norm early") >= 8, early
    # and RoPE's (EARLY in the interleaved compile): the table row, cos, sin and the slot
    assert early.pop("rope_kv interleaved=False early") == 0, early
    assert early.pop("rope_kv interleaved=True early") >= 4, early
    # on a split projection's partials: the same four before the wait (the partial sums after it)
    assert early.pop("rope_kv split early") >= 4, early
    assert len(early) == 3 and all(n >= 4 for n in early.values()), early


LAUNCH_SCRIPT = (
    RESOURCES
    + r"""
import json, sys
import torch
from kiln.kernels import decode_attention as da


class Caught(Exception):
    pass


def launch_args(cfg, form, B=64, Hq=12, Hk=2, D=128, page=16, width=256, L=1100):
    # the H200's launch: B x 1100 live keys in a table 4096 wide, 5 splits (num_splits_for at 132 SMs), PDL
    fn, got = da._decode_split_kernel, {}

    def run(*args, grid, warmup, **kw):
        got.update(args=args, kw=kw)
        raise Caught

    fn.run = run  # an instance attribute: the launch goes here instead of compiling for the (absent) driver
    try:
        q = torch.zeros(B, Hq, D, dtype=torch.bfloat16)
        kc = torch.zeros(B * width, page, Hk, D, dtype=torch.bfloat16)
        splits = da.num_splits_for(B, Hk, width * page, 132)
        try:
            da.decode_attention_triton(q, kc, kc.clone(), torch.zeros(B, width, dtype=torch.int32),
                                       torch.full((B,), L, dtype=torch.int32), D ** -0.5, None, None, splits,
                                       dict(cfg), form=form)
        except Caught:
            pass
    finally:
        del fn.run
    # TMA_OK as on the H200 (the CPU launcher cannot know the caches are TMA-readable on a GPU)
    # (and EARLY, which the launcher turns off where TMA reads the pages)
    kw = got["kw"]
    return got["args"], dict(kw, PDL=True, launch_pdl=True, TMA_OK=cfg["TMA"], EARLY=kw["EARLY"] and not cfg["TMA"])


out = []
for n, w, s, a, t, pl in da.SPLIT_CONFIGS:
    for form in json.loads(sys.argv[1]):
        if (a or t or json.loads(sys.argv[2])) and not (t and n != 16):  # TMA: tiles of a page (16) only
            cfg = dict(BLOCK_N=n, num_warps=w, num_stages=s, ADDR32=a, TMA=t, PRELOAD=pl)
            r = resources(da._decode_split_kernel, *launch_args(cfg, form))
            out.append(dict(cfg, form=form, **{k: v for k, v in r.items() if k != "ptx"}))
print(json.dumps(out))
"""
)


def split_kernel_resources(forms=("two_pass", "one_pass"), old=False) -> list[dict]:
    """Registers, spills and shared memory of the split kernel's configs (the ADDR32 ones; `old`: all) at the
    H200's Qwen2.5-1.5B decode launch, per form. Also a tool: the docs' table came from old=True."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache  # a fresh cache: compile for real, touch nothing shared
        proc = subprocess.run(
            [sys.executable, "-c", LAUNCH_SCRIPT, json.dumps(list(forms)), json.dumps(old)],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 6 compiles and ptxas runs: ~20 s on the shared 2-core machine
def test_split_kernel_addr32_configs_do_not_spill_at_the_launch():
    # Every ADDR32 (and PRELOAD) and TMA config in both forms: no spill, and registers for the programs an SM
    # that the split plan aims at.
    res = split_kernel_resources()
    assert len(res) == 2 * sum((a or t) and not (t and n != 16) for n, _, _, a, t, _ in dec.SPLIT_CONFIGS), (
        res
    )
    for r in res:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        if r["PRELOAD"]:  # no table load in the loop: K and V tiles buffered num_stages - 1 deep
            assert r["smem"] >= (r["num_stages"] - 1) * 2 * r["BLOCK_N"] * 128 * 2, r
        # Programs an SM by registers, against what the split plan aims at: PER_SM (4) in PLAN_CONFIG's tiles,
        # PRELOAD_PER_SM in PLAN_PRELOAD's. EARLY holds the first K and V tile in registers across the wait
        # (BLOCK_N x D / threads a thread: 64 at 64-key tiles and 4 warps: 95 -> 165 registers): the sweeps'
        # wide configs fit fewer programs than they did (128 keys / 8 warps: one, by registers).
        by_regs = 65536 // (32 * r["num_warps"] * -(-r["regs"] // 8) * 8)
        cfg = {k: r[k] for k in ("BLOCK_N", "num_warps", "num_stages", "ADDR32", "TMA", "PRELOAD")}
        if cfg == dec.PLAN_CONFIG and r["form"] == "two_pass":
            assert by_regs >= dec.PER_SM, r
        elif cfg == dec.PLAN_PRELOAD:
            assert by_regs >= dec.PRELOAD_PER_SM, r
