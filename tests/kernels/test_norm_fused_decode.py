"""The add + RMSNorm split across two decode matmuls (kernels/matmul_decode.py): the "residual_sumsq"
epilogue (h = residual + x @ W1.T + b1, stored, and its partial sums of squares per column block) and the
"rmsnorm" prologue (each K tile of h normalized as it loads, rstd from the partials). Against the sequence
it replaces, run through kiln's own kernels (decode matmul, add + RMSNorm kernel, decode matmul: the new
stream bit for bit, the output within the dtype's tolerance) and against the float64 references; M 1, 3,
16, d not a multiple of the tile, a ragged K, split K in the producer, both kernels, the Gemma-style
(1 + gamma) weight, in-place streams, bad arguments; bf16 and the rule's configs on the GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kiln.kernels.dispatch import use_backend
from kiln.kernels.matmul_decode import DecodeConfig, decode_matmul
from kiln.kernels.rmsnorm import norm_fused_ref, rmsnorm, rmsnorm_ref

from ._tolerance import assert_close

EPS = 1e-5
# Producer (o / down projection) configs: the interpreter's rule (gemv at one row, dot above: 16 columns,
# no split), the gemv kernel over several rows, and both kernels with K split, where the residual epilogue
# runs in the split-K sum kernel.
PRODUCERS = [
    None,
    DecodeConfig("gemv", 16, 32),
    DecodeConfig("gemv", 8, 32, split_k=3),
    DecodeConfig("dot", 32, 16, split_k=4),
]


def _block(M, K1, d, N2, dtype, device, seed, bias=True):
    """x (M, K1) -> W1 (d, K1) -> + h (M, d) -> norm (gamma (d,)) -> W2 (N2, d): one decoder half-block."""
    gen = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    x, w1, h = t(M, K1), t(d, K1, scale=K1**-0.5), t(M, d)
    gamma = (1 + 0.5 * torch.randn(d, generator=gen)).to(device, dtype)
    w2 = t(N2, d, scale=d**-0.5)
    b1, b2 = (t(d), t(N2)) if bias else (None, None)
    return x, w1, b1, h, gamma, w2, b2


def _separate(x, w1, b1, h, gamma, w2, b2, c1, c2, offset=0.0):
    """What the model runs today: kiln's decode matmul, kiln's add + RMSNorm kernel, kiln's decode matmul."""
    y = decode_matmul(x, w1.t(), b1, config=c1)
    with use_backend("triton"):
        z, h_new = rmsnorm(y, gamma, EPS, residual=h, offset=offset)
    return h_new, decode_matmul(z, w2.t(), b2, config=c2)


def _fused(x, w1, b1, h, gamma, w2, b2, c1, c2, offset=0.0, out=None):
    h_new, ss = decode_matmul(x, w1.t(), b1, config=c1, epilogue="residual_sumsq", residual=h, out=out)
    y = decode_matmul(
        h_new, w2.t(), b2, config=c2, prologue="rmsnorm", norm_weight=gamma, sumsq=ss, eps=EPS,
        norm_offset=offset,
    )  # fmt: skip
    return h_new, ss, y


def _oracle(x, w1, b1, h, gamma, w2, b2, offset=0.0):
    d64 = [None if t is None else t.double() for t in (x, w1, b1, h, gamma, w2, b2)]
    x, w1, b1, h, gamma, w2, b2 = d64
    return norm_fused_ref(x, w1.t(), h, gamma, w2.t(), b1, b2, EPS, offset)


@pytest.mark.parametrize("producer", PRODUCERS, ids=str)
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_norm_matches_separate_kernels_and_float64(M, producer, dtype, device):
    # d = 40: ragged against 16- and 32-column blocks and 32-wide K steps; K1 = 100 ragged too
    K1, d, N2 = 100, 40, 37
    args = _block(M, K1, d, N2, dtype, device, seed=M * 7 + len(str(producer)))
    h_new, ss, y = _fused(*args, producer, None)
    h_sep, y_sep = _separate(*args, producer, None)
    # The same products summed in the same order, rounded at the same points: the same bits. (Against
    # torch's float32 matmul the stream differs by the order of the K sum, a few float32 ulps.)
    assert torch.equal(h_new, h_sep), (h_new - h_sep).abs().max()
    blocks = -(-d // (producer.block_n if producer and producer.split_k == 1 else 16))
    if producer is not None and producer.split_k > 1:
        blocks = 1  # the split-K sum's column block (64-512 wide) holds all 40 columns
    assert ss.shape == (M, blocks) and ss.dtype == torch.float32
    assert_close(ss.sum(1), h_new.double().pow(2).sum(1), torch.float32, name="sum of partials")
    # rstd from a sum of partials instead of one tree over the row: within a float32 ulp or two of the norm
    # kernel's, so the normalized activations may differ by one ulp of the dtype in rare elements
    assert_close(y, y_sep.double(), name="fused vs separate kernels")
    h_ref, y_ref = _oracle(*args)
    assert_close(h_new, h_ref, name="stream vs float64")
    # Four roundings to the dtype (y, the stream, the normalized row, times gamma) come before the second
    # matmul: in fp16 the separate kernels' output is as far from float64 (the comparison above is the tight
    # one), up to 2.5e-3 on these shapes against the table's 2e-3 for a single op
    assert_close(y, y_ref, scale=2 if dtype == torch.float16 else 1, name="output vs float64")
    assert_close(y_sep, y_ref, scale=2 if dtype == torch.float16 else 1, name="separate output vs float64")


@pytest.mark.parametrize(
    "M,config,n_ss",
    [
        (16, DecodeConfig("dot", 16, 32), 300),
        (3, DecodeConfig("gemv", 16, 32), 1500),
        (1, None, 7),
        (1, DecodeConfig("dot", 16, 32), 7),
    ],
    ids=["dot-2-steps", "gemv-2-steps", "gemv-1-step", "dot-1-row"],
)
def test_rmsnorm_prologue_any_partials_and_offset(M, config, n_ss, device):
    """The consumer takes partials in any number (here made by torch, split unevenly over the row): more
    than one step of its rstd sum (SS_TILE), and the Gemma-style weight 1 + gamma."""
    gen = torch.Generator().manual_seed(n_ss)
    d, N = 72, 24
    h = torch.randn(M, d, generator=gen, dtype=torch.float64)
    gamma = 0.3 * torch.randn(d, generator=gen, dtype=torch.float64)
    w = torch.randn(N, d, generator=gen, dtype=torch.float64) / d**0.5
    cuts = torch.linspace(0, d, n_ss + 1).round().long()  # uneven, some partials cover no column
    sq = h.pow(2)
    ss = torch.stack([sq[:, a:b].sum(1) for a, b in zip(cuts[:-1], cuts[1:])], 1).float()
    y = decode_matmul(
        h.float().to(device), w.float().t().to(device), config=config, prologue="rmsnorm",
        norm_weight=gamma.float().to(device), sumsq=ss.to(device), eps=EPS, norm_offset=1.0,
    )  # fmt: skip
    z = rmsnorm_ref(h, gamma, EPS, offset=1.0)
    assert_close(y, z @ w.t(), name=f"n_ss={n_ss}")


def test_stream_in_place_deterministic_and_bf16_gemv(device):
    """out=residual updates the stream in place; two runs give the same bits; bf16 through the FMA (gemv)
    kernels, which have no tl.dot and so run in bf16 under the interpreter too."""
    args = _block(1, 96, 48, 40, torch.bfloat16, device, seed=5)
    x, w1, b1, h, gamma, w2, b2 = args
    c1, c2 = DecodeConfig("gemv", 8, 32), DecodeConfig("gemv", 16, 32, split_k=2)
    h_sep, y_sep = _separate(*args, c1, c2)
    stream = h.clone()
    h_new, ss, y = _fused(x, w1, b1, stream, gamma, w2, b2, c1, c2, out=stream)
    assert h_new.data_ptr() == stream.data_ptr() and torch.equal(stream, h_sep)
    assert ss.shape == (1, 6)
    assert_close(y, y_sep.double(), name="bf16 fused vs separate")
    h2, ss2, y2 = _fused(*args, c1, c2)
    assert torch.equal(h2, h_new) and torch.equal(ss2, ss) and torch.equal(y2, y)
    assert_close(y, _oracle(*args)[1], name="bf16 vs float64")


def test_residual_epilogue_with_swiglu_prologue_and_activation(device):
    """The flags are independent: the down projection's SwiGLU prologue with the residual epilogue, and
    an activation before the residual add (in the main kernel and in the split-K sum)."""
    gen = torch.Generator().manual_seed(12)
    M, F, d = 3, 40, 24
    gate_up = torch.randn(M, 2 * F, generator=gen).to(device)
    w = (torch.randn(d, F, generator=gen) / F**0.5).to(device)
    h = torch.randn(M, d, generator=gen).to(device)
    for config in (DecodeConfig("dot", 16, 32), DecodeConfig("gemv", 8, 16, split_k=2)):
        h_new, _ = decode_matmul(gate_up, w.t(), config=config, prologue="swiglu", epilogue="residual_sumsq",
                                 residual=h)  # fmt: skip
        want = decode_matmul(gate_up, w.t(), config=config, prologue="swiglu") + h
        assert torch.equal(h_new, want), str(config)
        h_act, _ = decode_matmul(
            h, w.t()[:d], None, "silu", config=config, epilogue="residual_sumsq", residual=h
        )
        assert torch.equal(h_act, decode_matmul(h, w.t()[:d], None, "silu", config=config) + h), str(config)


def test_bad_arguments(device):
    x, w1, b1, h, gamma, w2, b2 = _block(2, 32, 24, 16, torch.float32, device, seed=3)
    ss = torch.zeros(2, 3, device=device)
    cases = [
        (dict(epilogue="residual_add"), "unknown epilogue"),
        (dict(prologue="layernorm"), "unknown prologue"),
        (dict(residual=h), "argument of epilogue='residual_sumsq'"),
        (dict(epilogue="residual_sumsq"), "needs residual"),
        (dict(epilogue="residual_sumsq", residual=h[:, :8]), r"residual must be a contiguous \(2, 24\)"),
        (dict(epilogue="residual_sumsq", residual=h.half()), "residual must be"),
        (
            dict(epilogue="residual_sumsq", residual=h, out=torch.empty(24, 2, device=device).t()),
            "out must be",
        ),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            decode_matmul(x, w1.t(), **kwargs)
    with pytest.raises(ValueError, match="not the input a"):
        square = torch.eye(24, device=device)  # (d, d): a's shape is the output's, so out=a would pass
        decode_matmul(h, square, epilogue="residual_sumsq", residual=h.clone(), out=h)
    hn = h
    cases = [
        (dict(sumsq=ss), "arguments of prologue='rmsnorm'"),
        (dict(prologue="rmsnorm", norm_weight=gamma), "needs norm_weight"),
        (
            dict(prologue="rmsnorm", norm_weight=gamma[:8], sumsq=ss),
            r"norm_weight must be a contiguous float \(24,\)",
        ),
        (dict(prologue="rmsnorm", norm_weight=gamma.repeat(2)[::2], sumsq=ss), r"stride \(2,\)"),
        (
            dict(prologue="rmsnorm", norm_weight=gamma, sumsq=ss.double()),
            r"sumsq must be a contiguous \(2, n\)",
        ),
        (dict(prologue="rmsnorm", norm_weight=gamma, sumsq=ss[:1]), "sumsq must be"),
        (dict(prologue="rmsnorm", norm_weight=gamma, sumsq=ss, eps=-1.0), "eps must be >= 0"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            decode_matmul(hn, w2.t(), **kwargs)


QWEN = {"o+qkv": (1536, 1536, 2048), "down+gate_up": (8960, 1536, 17920)}  # producer K, d, consumer N


@pytest.mark.gpu
@pytest.mark.parametrize("pair", QWEN)
@pytest.mark.parametrize("M", [1, 4, 16])
def test_split_norm_bf16_qwen_shapes(pair, M):
    """The rule's configs at the Qwen2.5-1.5B pairs, bf16 (the interpreter's bf16 tl.dot is broken), and
    inside a CUDA graph (the partials and any split-K buffer allocated in the graph's pool)."""
    K1, d, N2 = QWEN[pair]
    args = _block(M, K1, d, N2, torch.bfloat16, "cuda", seed=M + d)
    h_new, ss, y = _fused(*args, None, None)
    h_sep, y_sep = _separate(*args, None, None)
    assert torch.equal(h_new, h_sep)
    assert_close(y, y_sep.double(), name=f"{pair} M={M} fused vs separate")
    h_ref, y_ref = _oracle(*args)
    assert_close(h_new, h_ref, name="stream vs float64")
    # four bf16 roundings before the second matmul (as in fp16 above): the same sequence in torch, rounded
    # at the same points, reaches 0.94 of the single-op bound at down+gate_up, 16 rows, on these inputs
    assert_close(y, y_ref, scale=2, name="output vs float64")
    assert_close(y_sep, y_ref, scale=2, name="separate output vs float64")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hg, _, yg = _fused(*args, None, None)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(hg, h_new) and torch.equal(yg, y)


# Cross-compiled for the H200 (sm_90) on the CPU machine, in a subprocess (the pytest process runs Triton's
# interpreter, tests/conftest.py), at the rule's configs for the Qwen2.5-1.5B pairs: registers and spill
# bytes from ptxas (Triton's own, `-v`) for each fused kernel beside the plain kernel of the same config.
SM90_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels import matmul_decode as md

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

def build(fn, ptrs, consts, warps, stages):
    names = [p.name for p in fn.params]
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in ("eps", "norm_offset") else "i32")
           for n in names}
    # as a real launch specializes them at these shapes (n_ss: 384 or 768 partials at one row)
    div = [n for n in names if n in ptrs or n in ("N", "K", "stride_xm", "stride_wn", "k_split", "n_ss")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div if n not in consts}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(a),): v for a, v in consts.items()}, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "k.ptx"), "w").write(ptx)
        v = subprocess.run([PTXAS, "-arch=sm_90a", "-v", os.path.join(d, "k.ptx"), "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True, check=True).stderr
    spill = re.search(r"(\d+) bytes spill stores", v)
    return {"regs": int(re.search(r"Used (\d+) registers", v).group(1)), "spill": int(spill.group(1)),
            "wait": ptx.count("griddepcontrol.wait")}

out = {}
ptrs = dict(X_ptr="*bf16", W_ptr="*bf16", Y_ptr="*bf16", Bias_ptr="*bf16", R_ptr="*bf16", SS_ptr="*fp32", G_ptr="*bf16")
SHAPES = {"o": (1536, 1536), "down": (8960, 1536), "qkv": (1536, 2048), "gate_up": (1536, 17920)}
for M in [int(m) for m in sys.argv[1].split(",")]:
    for name, (K, N) in SHAPES.items():
        cfg = md.decode_config(M, N, K, 132)
        producer = name in ("o", "down")
        for fused in (False, True):
            # x and W K-contiguous: a launch specializes the unit strides (Triton's == 1 class), as here
            c = dict(stride_xk=1, stride_wk=1, HAS_BIAS=name == "qkv", ACTIVATION="none", SWIGLU=False,
                     RMSNORM=fused and not producer,
                     RESIDUAL=fused and producer and cfg.split_k == 1, GLU=False, SS_BLOCK=1, BLOCK_N=cfg.block_n,
                     BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, PDL=cfg.pdl, GRIDDEP=True)
            if c["RMSNORM"]:  # the launcher's step for the partials the rule's producer writes at M rows
                pk = 1536 if name == "qkv" else 8960  # o feeds qkv, down feeds gate_up
                pc = md.decode_config(M, 1536, pk, 132)
                n_ss = -(-1536 // (pc.block_n if pc.split_k == 1 else md._residual_sum_tile(M)))
                c["SS_BLOCK"] = min(md.pow2(n_ss), md.SS_TILE // (md.pow2(M) if cfg.kernel == "gemv" else 16))
            if cfg.kernel == "gemv":
                c.update(BLOCK_M=md.pow2(M), STAGES=cfg.stages, PRE_K=0)
            else:
                c.update(BLOCK_M=16, PRECISION="ieee")
            kernel = md._gemv_kernel if cfg.kernel == "gemv" else md._dot_kernel
            p = dict(ptrs, Y_ptr="*fp32") if cfg.split_k > 1 else ptrs
            out[f"{name} M={M} {'fused' if fused else 'plain'}"] = build(kernel, p, c, cfg.warps, cfg.stages)
        if producer and cfg.split_k > 1:
            c = dict(HAS_BIAS=False, ACTIVATION="none", SPLIT_K=cfg.split_k, PDL=True)
            out[f"{name} M={M} sum plain"] = build(md._split_sum_kernel, dict(P_ptr="*fp32", Y_ptr="*bf16", Bias_ptr="*bf16"),
                                                   dict(c, BLOCK=1024), 4, 1)
            out[f"{name} M={M} sum fused"] = build(md._split_residual_kernel, dict(P_ptr="*fp32", Y_ptr="*bf16",
                                                   Bias_ptr="*bf16", R_ptr="*bf16", SS_ptr="*fp32"),
                                                   dict(c, BLOCK_M=md.pow2(M), BLOCK_S=md._residual_sum_tile(M)), 4, 1)
print(json.dumps(out))
"""


def sm90_resources(rows: str, cache: Path) -> dict[str, dict]:
    """{"<shape> M=<rows> plain|fused": {"regs", "spill" (bytes), "wait" (griddepcontrol.wait count)}}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = Path(__file__).resolve().parents[2] / "src"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
    env["TRITON_CACHE_DIR"] = str(cache)  # a fresh cache: compile for real, touch nothing shared
    proc = subprocess.run(
        [sys.executable, "-c", SM90_SCRIPT, rows], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 8 compiles and ptxas runs: ~10 s
def test_split_norm_kernels_compile_for_sm90(tmp_path):
    """At one row (the batch-1 decode step, gemv kernels) the fused producer and consumer compile for
    sm_90 with programmatic dependent launch and without spills, as the plain kernels do."""
    res = sm90_resources("1", tmp_path)
    assert len(res) == 8, res
    for name, r in res.items():
        assert r["spill"] == 0 and r["wait"] > 0, (name, r)
        if name.endswith("fused"):  # a few registers of epilogue or prologue at most
            assert r["regs"] <= res[name.replace("fused", "plain")]["regs"] + 16, (name, res)
