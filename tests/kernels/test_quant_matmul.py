"""The weight-only quantized matmul (INT8 per channel, INT4 groups of 32/64/128, symmetric and with zero
points) against dequantize-then-float64 matmul: both decode forms (FMA "gemv" for one row, "dot" for up to
16 rows), split K, int4 tiles spanning several groups or part of one, the prefill tile kernel; odd N and
M; the packing layout by a hand-worked case; clear errors for a bad format. bf16 and CUDA graphs on GPU."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import quant_matmul
from kiln.kernels.dispatch import use_backend
from kiln.kernels.matmul_decode import DecodeConfig
from kiln.kernels.quant_matmul import (
    dequantize_weight,
    pack_int4,
    unpack_int4,
    wq_linear,
    wq_matmul_fwd,
    wq_matmul_ref,
)

from ._tolerance import assert_close

FORMATS = [(8, 0, False), (4, 32, False), (4, 64, True), (4, 128, False), (4, 128, True)]


def quantized(N, K, bits, group, asymmetric, seed, device="cpu"):
    """Random quantized weights (any integers of the format, bf16-exact scales ~ 1 / sqrt(K) per weight)."""
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        s = (torch.rand(N, 1, generator=g) / (64 * K**0.5)).to(torch.bfloat16)
        return q.to(device), s.to(device), None
    q = pack_int4(torch.randint(0, 16, (N, K), generator=g))
    s = (torch.rand(N, K // group, generator=g) / (4 * K**0.5)).to(torch.bfloat16)
    z = torch.randint(0, 16, (N, K // group), generator=g, dtype=torch.uint8) if asymmetric else None
    return q.to(device), s.to(device), None if z is None else z.to(device)


def _fmt_id(f):
    bits, group, asym = f
    return "int8" if bits == 8 else f"int4-g{group}{'-asym' if asym else ''}"


def test_int4_packing_by_hand():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]])
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[1 | 2 << 4, 15], [7 | 8 << 4, 9 | 10 << 4]]
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))
    # symmetric: (q - 8) * s; asymmetric: (q - z) * s, per group of 2 here
    s = torch.tensor([[0.5, 2.0], [1.0, 1.0]])
    want = torch.tensor([[-3.5, -3.0, 14.0, -16.0], [-1.0, 0.0, 1.0, 2.0]])
    assert torch.equal(dequantize_weight(packed, s, None, 4, 2), want)
    z = torch.tensor([[1, 0], [8, 9]], dtype=torch.uint8)
    assert torch.equal(
        dequantize_weight(packed, s, z, 4, 2), torch.tensor([[0.0, 0.5, 30.0, 0.0], [-1, 0, 0, 1.0]])
    )


DECODE_CONFIGS = [  # (config, rows)
    (DecodeConfig("gemv", 16, 64), 1),  # int4: two 32-groups per K step, or half a 128-group
    (DecodeConfig("gemv", 8, 128, split_k=3), 1),  # K in slices summed by the second kernel
    (DecodeConfig("dot", 16, 32), 5),
    (DecodeConfig("dot", 8, 32, split_k=2), 5),
    # kernels/quant_decode.py: int32 words, dequantized by bit operations
    (DecodeConfig("fma", 16, 64), 1),  # int4: 8 words per row per step, a 32-group every 4 words
    (DecodeConfig("fma", 8, 128, split_k=3), 1),
    (DecodeConfig("mma", 16, 32), 5),  # int4: one group (or part of one) per K step
    (DecodeConfig("mma", 16, 32, split_k=2), 1),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
@pytest.mark.parametrize("config,M", DECODE_CONFIGS, ids=lambda c: str(c))
def test_decode_matches_dequantized_float64(fmt, config, M, device):
    bits, group, asym = fmt
    N, K = 37, 256 if bits == 4 else 200  # ragged column blocks; int8: K not a multiple of BLOCK_K
    q, s, z = quantized(N, K, bits, group, asym, seed=N + bits, device=device)
    g = torch.Generator().manual_seed(1)
    # fp16: the interpreter's bf16 tl.dot is broken (PLATFORM.md); bf16 runs on the GPU below
    x = torch.randn(M, K, generator=g).to(device, torch.float16)
    bias = torch.randn(N, generator=g).to(device, torch.float16)
    y = wq_matmul_fwd(x, q, s, z, bits, group, bias, config=config)
    assert y.dtype == torch.float16 and y.shape == (M, N)
    assert_close(y, wq_matmul_ref(x.double(), q, s, z, bits, group, bias.double()), name=f"{fmt} {config}")


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
@pytest.mark.parametrize("F", [40, 44], ids=["F40", "F44-ragged"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_fma_swiglu_epilogue_same_bits(fmt, F, with_bias, device):
    """epilogue="swiglu" on the fma form: swiglu of a merged [gate | up] projection (N = 2F), bit-equal to the
    projection followed by kiln's SwiGLU kernel (a block's 8 features of gate and up interleaved; 44: a
    ragged last block), several K steps (int4: groups of 32 spanning steps)."""
    from kiln.kernels.swiglu import swiglu

    bits, group, asym = fmt
    K = 256
    q, s, z = quantized(2 * F, K, bits, group, asym, seed=F + bits, device=device)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, K, generator=g).to(device, torch.float16)
    bias = torch.randn(2 * F, generator=g).to(device, torch.float16) if with_bias else None
    config = DecodeConfig("fma", 16, 64)
    with use_backend("triton"):
        want = swiglu(wq_matmul_fwd(x, q, s, z, bits, group, bias, config=config), None)
        got = wq_matmul_fwd(x, q, s, z, bits, group, bias, config=config, epilogue="swiglu")
    assert got.shape == (1, F) and torch.equal(got, want)


def test_swiglu_epilogue_refuses_other_forms():
    q, s, z = quantized(32, 64, 8, 0, False, seed=0)
    x = torch.randn(1, 64)
    for config in (
        DecodeConfig("fma", 8, 32, split_k=2),
        DecodeConfig("gemv", 8, 32),
        DecodeConfig("fma", 7, 32),
    ):
        with pytest.raises(ValueError, match="SwiGLU epilogue"):
            wq_matmul_fwd(x, q, s, z, 8, 0, config=config, epilogue="swiglu")
    with pytest.raises(ValueError, match="epilogue must be"):
        wq_matmul_fwd(x, q, s, z, 8, 0, epilogue="gelu")


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
@pytest.mark.parametrize("M", [1, 16, 33])
def test_default_route_and_prefill_tiles(fmt, M, device):
    """The launcher's own choice: decode kernels up to 16 rows, the tile kernel beyond (33: ragged tiles)."""
    bits, group, asym = fmt
    N, K = 50, 256
    q, s, z = quantized(N, K, bits, group, asym, seed=M, device=device)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(device, torch.float16)
    with use_backend("triton"):
        y = wq_linear(x, q, s, z, bits, group)
    assert_close(y, wq_matmul_ref(x.double(), q, s, z, bits, group), name=str(fmt))


@pytest.mark.parametrize(
    "config,M", [(DecodeConfig("fma", 8, 64), 1), (DecodeConfig("mma", 16, 32, 2), 3)], ids=str
)
def test_bit_dequantization_in_float32(config, M, device):
    """The fma/mma forms' float32 path (2**23 + q, and 128 + q at the units place of a float32), asymmetric,
    against float64: exact weights, so only the float32 sums' rounding remains."""
    q, s, z = quantized(40, 256, 4, 64, True, seed=7, device=device)
    x = torch.randn(M, 256, generator=torch.Generator().manual_seed(3)).to(device)
    y = wq_matmul_fwd(x, q, s, z, 4, 64, config=config)
    assert_close(y, wq_matmul_ref(x.double(), q, s, z, 4, 64), name=str(config))


@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
@pytest.mark.parametrize(
    "config", [DecodeConfig("fma", 16, 64), DecodeConfig("fma", 32, 128, split_k=2)], ids=str
)
def test_fma_reads_bf16_x_as_pairs_with_the_same_bits(fmt, config, device):
    """The fma form reads a contiguous bf16 x as int32 pairs and widens each half by a shift or an AND: the
    same float32 values as the bf16 load and conversion it replaces, so the same bits as a strided x (which
    takes the old path); K steps inside one group take one scale a row (int4-g64 / g128), across groups one
    a word (g32). Against float64 too."""
    bits, group, asym = fmt
    N, K = 37, 256
    q, s, z = quantized(N, K, bits, group, asym, seed=11, device=device)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(5)).to(device, torch.bfloat16)
    strided = torch.zeros(1, 2 * K, device=device, dtype=torch.bfloat16)[:, ::2]
    strided.copy_(x)
    quant_matmul._PLANS.clear()
    y = wq_matmul_fwd(x, q, s, z, bits, group, config=config)
    assert [p.meta["X_PAIRS"] for p in quant_matmul._PLANS.values()] == [True]  # the pairs path ran
    assert torch.equal(y, wq_matmul_fwd(strided, q, s, z, bits, group, config=config))
    assert_close(y, wq_matmul_ref(x.double(), q, s, z, bits, group), name=f"{fmt} {config}")


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
def test_fma_steps_of_two_groups(asym, device):
    """K steps of two int4 groups (BLOCK_K = 2 * GROUP) load both groups' scales (and zero points) a row and
    let each word select its own; K = 96 ends on half a step, whose second group does not exist."""
    q, s, z = quantized(37, 96, 4, 32, asym, seed=3, device=device)
    x = torch.randn(1, 96, generator=torch.Generator().manual_seed(2)).to(device, torch.bfloat16)
    for config in (DecodeConfig("fma", 16, 64), DecodeConfig("fma", 8, 64, split_k=2)):
        y = wq_matmul_fwd(x, q, s, z, 4, 32, config=config)
        assert_close(y, wq_matmul_ref(x.double(), q, s, z, 4, 32), name=f"{asym} {config}")


def test_word_forms_refuse_what_they_cannot_read():
    q8, s8, _ = quantized(8, 66, 8, 0, False, seed=0)  # 66 bytes a row: not whole int32 words
    with pytest.raises(ValueError, match="int32 words"):
        wq_matmul_fwd(torch.randn(1, 66), q8, s8, None, 8, 0, config=DecodeConfig("fma", 8, 64))
    q, s, _ = quantized(8, 64, 4, 32, False, seed=0)
    with pytest.raises(ValueError, match="at most 1"):
        wq_matmul_fwd(torch.randn(2, 64), q, s, None, 4, 32, config=DecodeConfig("fma", 8, 64))
    q8, s8, _ = quantized(8, 64, 8, 0, False, seed=0)
    with pytest.raises(ValueError, match="power of two >= 32"):  # tl.dot's K side
        wq_matmul_fwd(torch.randn(2, 64), q8, s8, None, 8, 0, config=DecodeConfig("mma", 16, 16))
    with pytest.raises(ValueError, match="power of two"):
        wq_matmul_fwd(torch.randn(1, 64), q, s, None, 4, 32, config=DecodeConfig("fma", 8, 48))
    with pytest.raises(ValueError, match="decode kernel must be one of"):
        wq_matmul_fwd(torch.randn(1, 64), q, s, None, 4, 32, config=DecodeConfig("warp", 8, 64))


def test_float32_activations_and_leading_dims(device):
    q, s, z = quantized(24, 128, 4, 32, True, seed=5, device=device)
    x = torch.randn(2, 3, 128, generator=torch.Generator().manual_seed(2)).to(device)
    with use_backend("triton"):
        y = wq_linear(x, q, s, z, 4, 32)
    assert y.shape == (2, 3, 24)
    want = wq_matmul_ref(x.double().reshape(6, 128), q, s, z, 4, 32).reshape(2, 3, 24)
    assert_close(y, want)


def test_bad_formats_are_clear_errors():
    q, s, _ = quantized(8, 64, 4, 32, False, seed=0)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="group size must be one of"):
        wq_matmul_fwd(x, q, s, None, 4, 48)
    with pytest.raises(ValueError, match="scales"):
        wq_matmul_fwd(x, q, s[:, :1], None, 4, 32)
    with pytest.raises(ValueError, match=r"x must be \(M, 64\)"):
        wq_matmul_fwd(torch.randn(1, 63), q, s, None, 4, 32)
    with pytest.raises(ValueError, match="int8 weights"):
        wq_matmul_fwd(x, q.view(torch.int8), s, None, 8, 0)
    with pytest.raises(ValueError, match="BLOCK_K >= 32 dividing the group"):
        wq_matmul_fwd(torch.randn(3, 64), q, s, None, 4, 32, config=DecodeConfig("dot", 16, 64))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
@pytest.mark.parametrize("M", [1, 4, 16, 200])
def test_bf16_on_gpu_and_in_a_cuda_graph(fmt, M):
    """bf16 activations at a Qwen2.5-1.5B shape (down: K = 8960, split K at 2-16 rows), eager and replayed
    from a CUDA graph (how the engine's decode step runs it)."""
    bits, group, asym = fmt
    N, K = 1536, 8960
    q, s, z = quantized(N, K, bits, group, asym, seed=M, device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    want = wq_matmul_ref(x.double(), q, s, z, bits, group)
    y = wq_linear(x, q, s, z, bits, group)
    # bf16 output of a 8960-term sum whose inputs are bf16-rounded: the table's bf16 bound, twice (int4
    # tiles are dequantized to bf16 before tl.dot: one more rounding per weight)
    assert_close(y, want, scale=2.0)
    out = torch.empty_like(y)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(wq_linear(x, q, s, z, bits, group))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, y)
    # the word forms (kernels/quant_decode.py) in bf16, whatever the rule picks: bf16 tl.dot and the bf16
    # magic (0x4300 | q) run on the GPU only
    forms = [DecodeConfig("fma", 8, 256, 2, 2, 3)] if M == 1 else []
    if M <= 16:
        forms.append(DecodeConfig("mma", 64, min(128, group or 128), 4, 4, 3))
    for config in forms:
        assert_close(wq_matmul_fwd(x, q, s, z, bits, group, config=config), want, scale=2.0, name=str(config))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [(8, 0, False), (4, 128, False), (4, 128, True)], ids=_fmt_id)
def test_gpu_swiglu_epilogue_at_the_gate_up_shape(fmt):
    """Qwen2.5-1.5B's gate/up (1536 -> 2 x 8960) at one bf16 row on the launcher's own config (the swept fma
    tile): the SwiGLU epilogue bit-equal to the projection and kiln's SwiGLU kernel, eagerly and replayed
    from a CUDA graph; wq_swiglu_fusable holds there and not at two rows."""
    from kiln.kernels.swiglu import swiglu

    bits, group, asym = fmt
    N, K = 17920, 1536
    q, s, z = quantized(N, K, bits, group, asym, seed=7, device="cuda")
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    assert quant_matmul.wq_swiglu_fusable(x, N, K, bits, group, asym)
    assert not quant_matmul.wq_swiglu_fusable(x.expand(2, -1), N, K, bits, group, asym)
    want = swiglu(wq_linear(x, q, s, z, bits, group), None)
    got = wq_matmul_fwd(x, q, s, z, bits, group, epilogue="swiglu")
    assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wq_matmul_fwd(x, q, s, z, bits, group, epilogue="swiglu")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=_fmt_id)
def test_gpu_fma_preload_after_an_early_signal(fmt):
    """The q/k/v shape's fma launch with its first K step loaded before its programmatic-launch wait
    (pre_k), right after an RMSNorm that lets it be scheduled before the norm itself waits (signal_first,
    as the model does ahead of a preloading projection): x, which the norm writes, must be read after the
    wait. Eager and in a CUDA graph replayed over fresh norm inputs: the same bits as without the preload."""
    from kiln.kernels.rmsnorm import rmsnorm

    bits, group, asym = fmt
    N, K = 2048, 1536
    q, s, z = quantized(N, K, bits, group, asym, seed=7, device="cuda")
    cfg = DecodeConfig("fma", 8, 512, 1, 4, 3)
    h = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    gamma = torch.rand(K, device="cuda", dtype=torch.bfloat16) + 0.5

    def step(pre):
        x = rmsnorm(h, gamma, 1e-6, signal_first=True)
        return wq_matmul_fwd(x, q, s, z, bits, group, config=cfg._replace(pre_k=512 if pre else 0))

    assert torch.equal(step(True), step(False))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(True)
    for i in range(5):
        h.copy_(torch.randn(1, K, generator=torch.Generator().manual_seed(i)).to("cuda", torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step(False)), i


def test_swept_decode_tables_pass_the_launch_checks():
    """Every entry the H200 sweep wrote into DECODE_TABLE / FP8_DECODE_TABLE is a config the launchers accept
    for its own shape and row count (the checks run without a launch: the weights are never read)."""
    from kiln.kernels.fp8_matmul import FP8_DECODE_TABLE
    from kiln.kernels.matmul_decode import DecodeConfig
    from kiln.kernels.quant_matmul import DECODE_TABLE, _plan

    assert DECODE_TABLE and FP8_DECODE_TABLE
    for (fmt, rows, N, K), config in DECODE_TABLE.items():
        bits = 8 if fmt == "int8" else 4
        group = 0 if bits == 8 else int(fmt.split("-g")[1].split("-")[0])
        q = (
            torch.empty((N, K), dtype=torch.int8)
            if bits == 8
            else torch.empty((N, K // 2), dtype=torch.uint8)
        )
        s = torch.empty((N, 1 if bits == 8 else K // group), dtype=torch.bfloat16)
        z = torch.empty_like(s, dtype=torch.uint8) if fmt.endswith("-asym") else None
        x = torch.empty((rows, K), dtype=torch.bfloat16)
        plan = _plan(x, q, s, z, bits, group, None, config)
        assert plan.decode and plan.form == config.kernel, (fmt, rows, N, K)
    for (rows, N, K), config in FP8_DECODE_TABLE.items():
        assert rows in (1, 4, 16), (rows, N, K, config)
        if not isinstance(config, DecodeConfig):  # a tile of the prefill kernel
            bm, bn, bk, stages, warps = config  # (fp8_linear quantizes x, then fp8_matmul launches it)
            assert bm >= rows and min(bm, bn, bk) >= 16 and stages >= 1 and warps in (4, 8), config
            assert all(v & (v - 1) == 0 for v in (bm, bn, bk)), config  # tl.arange needs powers of two
            continue
        # the FP8 decode kernel's own launch rule
        assert config.kernel == "dot", (rows, N, K, config)
        assert config.block_k >= 32 and config.block_n >= 16, (rows, N, K, config)


PRELOAD_CASES = [  # (format, K, block_k): several steps, one step; int8 with a ragged last step too
    *[(f, 256, 64) for f in FORMATS],
    *[(f, 128, 128) for f in FORMATS],
    ((8, 0, False), 200, 64),
]


@pytest.mark.parametrize(
    "fmt,K,block_k", PRELOAD_CASES, ids=lambda c: _fmt_id(c) if isinstance(c, tuple) else c
)
def test_fma_first_step_preloaded_same_bits(fmt, K, block_k, device):
    """pre_k = block_k: the fma form loads its first K step's words before its programmatic-launch wait and
    runs that step ahead of the loop (kiln.kernels.quant_matmul.preload): the same passes in the same order,
    so the same bits as without it; ragged K (int8; int4 needs whole groups) and a single step. Against
    float64 too."""
    bits, group, asym = fmt
    q, s, z = quantized(37, K, bits, group, asym, seed=K + bits, device=device)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(3)).to(device, torch.bfloat16)
    bias = torch.randn(37, generator=torch.Generator().manual_seed(4)).to(device, torch.bfloat16)
    base = DecodeConfig("fma", 16, block_k)
    quant_matmul._PLANS.clear()
    y = wq_matmul_fwd(x, q, s, z, bits, group, bias, config=base._replace(pre_k=block_k))
    assert [p.meta["PRE"] for p in quant_matmul._PLANS.values()] == [True]
    assert torch.equal(y, wq_matmul_fwd(x, q, s, z, bits, group, bias, config=base))
    assert_close(y, wq_matmul_ref(x.double(), q, s, z, bits, group, bias.double()), name=f"{fmt} {K}")


def test_fma_preload_rule_and_checks(monkeypatch):
    # The launcher preloads unless KILN_QUANT_PREW=off, on the GPU, at one row of the fma form with K
    # unsplit, for the small projections; an explicit pre_k must be the fma form's block_k, unsplit
    monkeypatch.setattr(quant_matmul, "interpreting", lambda: False)
    fma = DecodeConfig("fma", 8, 512, 1, 4, 3)
    monkeypatch.setenv("KILN_QUANT_PREW", "off")
    quant_matmul.preload_switch.cache_clear()
    assert not quant_matmul.preload(1, 2048, 1536, fma)
    monkeypatch.delenv("KILN_QUANT_PREW")
    quant_matmul.preload_switch.cache_clear()
    # the default
    assert quant_matmul.preload(1, 2048, 1536, fma) and quant_matmul.preload(1, 1536, 1536, fma)
    assert not quant_matmul.preload(1, 17920, 1536, fma)  # gate_up: too large to be resident early
    assert not quant_matmul.preload(4, 2048, 1536, fma)
    assert not quant_matmul.preload(1, 2048, 1536, fma._replace(split_k=2))
    assert not quant_matmul.preload(1, 2048, 1536, DecodeConfig("mma", 32, 128, 4, 4, 3))
    monkeypatch.setenv("KILN_QUANT_PREW", "sometimes")
    quant_matmul.preload_switch.cache_clear()
    with pytest.raises(ValueError, match="KILN_QUANT_PREW"):
        quant_matmul.preload(1, 2048, 1536, fma)
    quant_matmul.preload_switch.cache_clear()
    monkeypatch.undo()
    q, s, _ = quantized(8, 128, 4, 32, False, seed=0)
    x = torch.randn(1, 128)
    for bad in (DecodeConfig("fma", 8, 64, pre_k=32), DecodeConfig("fma", 8, 64, split_k=2, pre_k=64),
                DecodeConfig("gemv", 8, 64, pre_k=64)):  # fmt: skip
        with pytest.raises(ValueError, match="pre_k"):
            wq_matmul_fwd(x, q, s, None, 4, 32, config=bad)
