"""SwiGLU in the decode matmul's epilogue (the gated MLP's gate_up projection): swiglu(a @ W.T + bias) (M, F)
for W (2F, K) holding [gate | up], bit for bit the gate_up decode matmul followed by kiln's SwiGLU kernel
with the same config, and against float64; both kernels, odd F, ragged K, M in {1, 3, 16}, bias or none;
its clear errors; the rule's config for it; bf16 at the Qwen2.5-1.5B gate_up shape on the GPU, also inside
a CUDA graph; and the kernels cross-compiled for sm_90 (registers and spills beside the plain kernel's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.kernels import matmul_decode
from kiln.kernels.dispatch import use_backend
from kiln.kernels.matmul import matmul_ref
from kiln.kernels.matmul_decode import DecodeConfig, decode_config, decode_matmul
from kiln.kernels.swiglu import swiglu, swiglu_ref

from ._tolerance import assert_close

GEMV = [
    DecodeConfig("gemv", 16, 32),  # 8 features a program, several K steps, a ragged last block
    DecodeConfig("gemv", 4, 32, stages=3),  # the rule's one-row shape: 2 features a program, pipelined
    DecodeConfig("gemv", 2, 64),  # one feature a program (the rule's long-K tile)
]
DOT = [DecodeConfig("dot", 16, 32), DecodeConfig("dot", 32, 16)]
SHAPES = [(37, 100), (40, 48)]  # (F, K): odd F (a ragged last block), K not a multiple of BLOCK_K


def _inputs(M, F, K, dtype, device, seed, bias=True, exact=False):
    """x (M, K), B = W.T (K, 2F) for W (2F, K) = [gate rows; up rows], bias (2F,) or None. exact: x and W
    on grids (multiples of 1/4 and 1/16, |x|, |w| <= 1) whose float32 products and sums over K <= 100 are
    exact in any order, so that the product's bits do not depend on the order of its K sum (see
    test_dot_kernel_bit_equal_to_unfused)."""
    gen = torch.Generator().manual_seed(seed)
    if exact:
        x = torch.randint(-4, 5, (M, K), generator=gen) / 4
        w = torch.randint(-16, 17, (2 * F, K), generator=gen) / 16
    else:
        x = torch.randn(M, K, generator=gen)
        w = torch.randn(2 * F, K, generator=gen) / K**0.5
    b = torch.randn(2 * F, generator=gen).to(device, dtype) if bias else None
    return x.to(device, dtype), w.to(device, dtype).t(), b


def _unfused(x, b, bias, config):
    """The two ops the epilogue replaces: the gate_up decode matmul (M, 2F), then kiln's SwiGLU kernel."""
    with use_backend("triton"):
        return swiglu(decode_matmul(x, b, bias, config=config), None)


def _float64(x, b, bias):
    return swiglu_ref(matmul_ref(x.double(), b.double(), None if bias is None else bias.double()))


def _check(x, b, bias, config, *, bit_equal=True):
    M, F = x.shape[0], b.shape[1] // 2
    y = decode_matmul(x, b, bias, config=config, epilogue="swiglu")
    assert y.shape == (M, F) and y.dtype == x.dtype and y.is_contiguous()
    if bit_equal:
        want = _unfused(x, b, bias, config)
        assert torch.equal(y, want), f"{config}: max diff {(y.float() - want.float()).abs().max().item()}"
    # two roundings to x's dtype (gate_up's output, then the SwiGLU's) against float64's none: twice the
    # one-rounding tolerance
    assert_close(y, _float64(x, b, bias), scale=2, name=str(config))
    return y


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [1, 5])  # one row, and several in a ragged power-of-two block (the CI's time)
@pytest.mark.parametrize("config", GEMV, ids=str)
def test_gemv_bit_equal_to_unfused(config, M, dtype, device):
    # the FMA kernel has no tl.dot: bf16 runs through the interpreter too, and its K sum (elementwise
    # FMAs, then a row sum) is the same sequence for a W row wherever it sits in the block. The narrow
    # blocks (1-2 features a program: many programs, slow through the interpreter) take one shape.
    for F, K in SHAPES if config.block_n >= 16 else SHAPES[:1]:
        for bias in (True, False):
            _check(*_inputs(M, F, K, dtype, device, seed=M * F + K, bias=bias), config)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [1, 16, 33])  # 33: the wide tiles' x.T (64 columns, ragged)
@pytest.mark.parametrize("config", DOT, ids=str)
def test_dot_kernel_bit_equal_to_unfused(config, M, dtype, device):
    # fp16 and fp32: the interpreter's bf16 tl.dot is broken (PLATFORM.md). The interpreter's tl.dot is
    # numpy's matmul (OpenBLAS), whose float32 sum over K depends on a row's position in the tile (measured:
    # a row-permuted A changes results by ~1e-6), and the epilogue's tile holds W's rows in another order
    # than the unfused call's: bit-equality is checked on inputs whose sums are exact in any order, and
    # random inputs against float64. A tensor-core mma sums each element in one way wherever it sits: on
    # the GPU the test below checks random bf16 inputs bit for bit.
    for F, K in SHAPES:
        for bias in (True, False):
            _check(*_inputs(M, F, K, dtype, device, seed=M * F + K, bias=bias, exact=True), config)
            on_cpu = device.type == "cpu"
            _check(*_inputs(M, F, K, dtype, device, seed=M + F + K, bias=bias), config, bit_equal=not on_cpu)


def test_rule_config_and_out(device):
    """No explicit config: the rule's (the interpreter's small tiles here), the same as the unfused call's;
    `out` is written in place."""
    x, b, bias = _inputs(3, 37, 100, torch.float16, device, seed=1, exact=True)
    out = torch.empty(3, 37, device=device, dtype=torch.float16)
    y = decode_matmul(x, b, bias, epilogue="swiglu", out=out)
    assert y.data_ptr() == out.data_ptr()
    with use_backend("triton"):
        assert torch.equal(y, swiglu(decode_matmul(x, b, bias), None))
    x1, b1, _ = _inputs(1, 40, 48, torch.bfloat16, device, seed=2)
    with use_backend("triton"):
        assert torch.equal(decode_matmul(x1, b1, epilogue="swiglu"), swiglu(decode_matmul(x1, b1), None))


@pytest.mark.parametrize("config", [GEMV[0], DOT[0]], ids=str)
def test_with_the_rmsnorm_prologue(config, device):
    """The split norm's prologue (x normalized as it loads) composes with the epilogue: the same bits as the
    normalizing gate_up followed by the SwiGLU kernel. (The model keeps the separate SwiGLU there.)"""
    x, b, _ = _inputs(3, 37, 100, torch.float32, device, seed=4)
    gen = torch.Generator().manual_seed(5)
    gamma = torch.randn(100, generator=gen).to(device)
    sumsq = x.square().sum(1, keepdim=True)  # (M, 1): one partial per row
    norm = dict(prologue="rmsnorm", norm_weight=gamma, sumsq=sumsq, eps=1e-6)
    y = decode_matmul(x, b, config=config, epilogue="swiglu", **norm)
    with use_backend("triton"):
        want = swiglu(decode_matmul(x, b, config=config, **norm), None)
    if device.type == "cpu" and config.kernel == "dot":  # the interpreter's tl.dot: see the dot test above
        assert_close(y, want, name=str(config))
    else:
        assert torch.equal(y, want)


def test_clear_errors(device):
    x, b, bias = _inputs(2, 20, 32, torch.float32, device, seed=3)
    with pytest.raises(ValueError, match=r"epilogue='swiglu' takes b \(K, 2F\).*N = 39 \(odd\)"):
        decode_matmul(x, b[:, :39], epilogue="swiglu")
    with pytest.raises(ValueError, match="does not split K"):
        decode_matmul(x, b, epilogue="swiglu", config=DecodeConfig("gemv", 8, 16, split_k=2))
    with pytest.raises(ValueError, match="does not split K"):
        decode_matmul(x, b, epilogue="swiglu", config=DecodeConfig("dot", 32, 16, split_k=4))
    with pytest.raises(ValueError, match="takes no activation"):
        decode_matmul(x, b, bias, "silu", epilogue="swiglu")
    with pytest.raises(ValueError, match="block_n >= 2"):
        decode_matmul(x, b, epilogue="swiglu", config=DecodeConfig("gemv", 1, 16))
    with pytest.raises(ValueError, match=r"out must be a contiguous \(2, 20\)"):
        decode_matmul(x, b, epilogue="swiglu", out=torch.empty(2, 40, device=device))
    with pytest.raises(ValueError, match="one of none, residual_sumsq, swiglu"):
        decode_matmul(x, b, epilogue="glu")


def test_rule_never_splits_for_the_epilogue(monkeypatch):
    """The rule on the H200 (132 SMs): at the Qwen2.5-1.5B gate_up shape (K 1536, N = 2F = 17920) it splits
    at no row count, so the fused call takes the unfused call's config; where it would split (few
    columns, K > 4096) the epilogue gets the same tile over all of K. Pure Python."""
    monkeypatch.setattr(matmul_decode, "interpreting", lambda: False)
    rule = decode_config.__wrapped__  # past the cache (which holds interpreter answers)
    assert rule(1, 17920, 1536, 132) == DecodeConfig("gemv", 4, 256, 1, 2, 3, True)
    for M in (2, 4, 8, 16):
        assert rule(M, 17920, 1536, 132) == DecodeConfig("dot", 64, 128, 1, 4, 3)
        assert rule(M, 17920, 1536, 132, split_ok=False) == rule(M, 17920, 1536, 132)
        split = rule(M, 2048, 8192, 132)
        assert split.split_k > 1 and rule(M, 2048, 8192, 132, split_ok=False) == split._replace(split_k=1)


# Qwen2.5-1.5B's gate_up: d 1536 -> 2 x 8960
@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 32, 64])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_bf16_qwen_gate_up_bit_equal_and_in_a_graph(M, bias):
    """The rule's config (gemv 4 x 256 at one row, the 64 x 128 tensor-core tile at 16, the wide tiles at 32
    and 64), bf16: the same
    bits as gate_up then kiln's SwiGLU kernel, eager and replayed from a CUDA graph, and close to float64."""
    x, b, bb = _inputs(M, 8960, 1536, torch.bfloat16, "cuda", seed=M, bias=bias)
    with use_backend("triton"):
        want = swiglu(decode_matmul(x, b, bb), None)
        y = decode_matmul(x, b, bb, epilogue="swiglu")
        assert torch.equal(y, want), (y.float() - want.float()).abs().max().item()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = decode_matmul(x, b, bb, epilogue="swiglu")
        x.copy_(torch.randn_like(x))  # a new step's input, read by the replay
        want = swiglu(decode_matmul(x, b, bb), None)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, want)
    assert_close(yg, _float64(x, b, bb), scale=2, name=f"M={M}")  # two roundings, as _check


# Cross-compiled for the H200 (sm_90) in a subprocess (the pytest process runs Triton's interpreter,
# tests/conftest.py), as tests/kernels/test_norm_fused_decode.py does: registers and spill bytes from ptxas
# for each kernel with the epilogue beside the same config without it, at the rule's gate_up configs.
SM90_SCRIPT = r"""
import json, os, re, subprocess, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels import matmul_decode as md

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

def build(fn, consts, warps, stages):
    ptrs = dict(X_ptr="*bf16", W_ptr="*bf16", Y_ptr="*bf16", Bias_ptr="*bf16", R_ptr="*bf16", SS_ptr="*fp32",
                G_ptr="*bf16")
    names = [p.name for p in fn.params]
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in ("eps", "norm_offset") else "i32")
           for n in names}
    # as a real launch at these shapes specializes them (N = 17920, K = 1536, unit K strides)
    div = [n for n in names if n in ptrs or n in ("N", "K", "stride_xm", "stride_wn", "k_split")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div if n not in consts}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ptx)
        v = subprocess.run([PTXAS, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True, check=True).stderr
    num = lambda pat: int(re.search(pat, v).group(1))
    return {"regs": num(r"Used (\d+) registers"), "spill_stores": num(r"(\d+) bytes spill stores"),
            "spill_loads": num(r"(\d+) bytes spill loads")}

out = {}
for M in (1, 16):
    cfg = md.decode_config(M, 17920, 1536, 132)
    for glu in (False, True):
        c = dict(stride_xk=1, stride_wk=1, HAS_BIAS=False, ACTIVATION="none", SWIGLU=False, RMSNORM=False,
                 RESIDUAL=False, GLU=glu, SS_BLOCK=1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=1,
                 PDL=cfg.pdl, GRIDDEP=True)
        if cfg.kernel == "gemv":
            c.update(BLOCK_M=1, STAGES=cfg.stages, PRE_K=0)
        else:
            c.update(BLOCK_M=16, PRECISION="ieee")
        kernel = md._gemv_kernel if cfg.kernel == "gemv" else md._dot_kernel
        out[f"{cfg} {'swiglu' if glu else 'plain'}"] = build(kernel, c, cfg.warps, cfg.stages)
print(json.dumps(out))
"""


def sm90_resources(cache: Path) -> dict[str, dict]:
    """{"<config> plain|swiglu": {"regs", "spill_stores", "spill_loads" (bytes)}} at the rule's gate_up
    configs for 1 and 16 rows (gemv 4 x 256, 2 warps, 3 stages; dot 64 x 128, 4 warps, 3 stages)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = Path(__file__).resolve().parents[2] / "src"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(cache)  # a fresh cache: compile for real, touch nothing shared
    proc = subprocess.run(
        [sys.executable, "-c", SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 4 compiles and ptxas runs: ~10 s
def test_epilogue_kernels_compile_for_sm90_without_spills(tmp_path):
    res = sm90_resources(tmp_path)
    assert len(res) == 4, res
    for name, r in res.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        if name.endswith("swiglu"):  # an epilogue's few registers at most
            assert r["regs"] <= res[name.replace("swiglu", "plain")]["regs"] + 16, (name, res)
