"""The decode matmul (M <= 16 rows, and the dot kernel's wide tiles up to 128) against float64: both kernels
(FMA "gemv" and swapped "dot"), split K with its deterministic second pass, bias and every activation, odd N
and K, M from 1 to 128, strided x and both weight layouts; that kiln's matmul/linear route decode shapes here
(and nothing else); the rule."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import matmul_decode
from kiln.kernels.dispatch import use_backend
from kiln.kernels.matmul import ACTIVATIONS, linear, matmul_fwd, matmul_ref, tile_config
from kiln.kernels.matmul_decode import DecodeConfig, decode_config, decode_matmul

from ._tolerance import assert_close

CONFIGS = [
    DecodeConfig("gemv", 16, 32),  # several K steps, a ragged last column block
    DecodeConfig("gemv", 8, 32, split_k=3, stages=3),  # K in 3 slices, summed by the second kernel
    DecodeConfig("dot", 16, 32),
    DecodeConfig("dot", 32, 16, split_k=4),
]


def _inputs(M, K, N, dtype, device, seed, x_strided=False, w_rowmajor=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, 2 * K if x_strided else K, generator=gen).to(device, dtype)
    x = x[:, ::2] if x_strided else x  # (M, K) with stride_xk = 2
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(device, dtype)
    b = w.t().contiguous() if w_rowmajor else w.t()  # (K, N): N-contiguous, or the nn.Linear view
    bias = torch.randn(N, generator=gen).to(device, dtype)
    return x, b, bias


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("M,K,N", [(1, 100, 37), (3, 64, 48), (16, 200, 24), (7, 33, 17)])
def test_decode_matmul_matches_float64(config, M, K, N, device):
    # fp16: the interpreter's bf16 tl.dot is broken (PLATFORM.md); bf16 runs on the GPU below
    x, b, bias = _inputs(M, K, N, torch.float16, device, seed=M * K + N)
    c = decode_matmul(x, b, bias, "silu", config=config)
    assert c.dtype == torch.float16 and c.shape == (M, N)
    assert_close(c, matmul_ref(x.double(), b.double(), bias.double(), "silu"), name=str(config))


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[3]], ids=str)
def test_decode_epilogue_every_activation(activation, config, device):
    """Bias and activation in the kernel (one K slice) and in the split-K sum kernel."""
    x, b, bias = _inputs(2, 48, 40, torch.float32, device, seed=3)
    c = decode_matmul(x, b, bias, activation, config=config)
    assert_close(c, matmul_ref(x.double(), b.double(), bias.double(), activation), name=activation)


@pytest.mark.parametrize(
    "config,K",
    [(DecodeConfig("gemv", 16, 32, pre_k=64), 100), (DecodeConfig("gemv", 16, 32, pre_k=128), 100),
     (DecodeConfig("gemv", 8, 16, stages=3, pre_k=32), 48), (DecodeConfig("gemv", 16, 32, pre_k=64), 64)],
    ids=["part", "whole-ragged", "part-pipelined", "whole-exact"],
)  # fmt: skip
@pytest.mark.parametrize("prologue", ["none", "swiglu", "rmsnorm"])
def test_decode_gemv_weight_preload(config, K, prologue, device):
    """pre_k: W's first pre_k columns loaded before the programmatic-launch wait, the loop resuming after
    them (or covering none where pre_k >= K), with each prologue's x; against float64."""
    x, b, bias = _inputs(1, K, 37, torch.float32, device, seed=K + config.pre_k)
    kw, a, xr = {}, x, x.double()
    if prologue == "swiglu":  # x (1, 2K) = [gate | up]
        a = torch.cat([x, x.flip(1)], 1)
        xr = torch.nn.functional.silu(x.double()) * x.flip(1).double()
    elif prologue == "rmsnorm":  # rstd from the row's sum of squares, as the producing epilogue writes it
        g = torch.randn(K, generator=torch.Generator().manual_seed(5)).to(device)
        kw = dict(norm_weight=g, sumsq=(x.float() ** 2).sum(1, keepdim=True), eps=1e-6)
        xr = x.double() * torch.rsqrt((x.double() ** 2).mean(1, keepdim=True) + 1e-6) * g.double()
    c = decode_matmul(a, b, bias, "silu", config=config, prologue=prologue, **kw)
    assert_close(c, matmul_ref(xr, b.double(), bias.double(), "silu"), name=f"{config} {prologue}")


def test_decode_gemv_weight_preload_rule_and_checks(monkeypatch, device):
    # The rule preloads the small one-row projections only, on the GPU, unless KILN_DECODE_PREW=off; an
    # explicit pre_k must suit the gemv's loop
    monkeypatch.setattr(matmul_decode, "interpreting", lambda: False)
    matmul_decode.preload_switch.cache_clear()
    assert matmul_decode.preload_weight(2048, 1536) and matmul_decode.preload_weight(1536, 1536)
    assert not matmul_decode.preload_weight(17920, 1536) and not matmul_decode.preload_weight(1536, 8960)
    monkeypatch.setenv("KILN_DECODE_PREW", "off")
    matmul_decode.preload_switch.cache_clear()
    assert not matmul_decode.preload_weight(2048, 1536)
    monkeypatch.setenv("KILN_DECODE_PREW", "sometimes")
    matmul_decode.preload_switch.cache_clear()
    with pytest.raises(ValueError, match="KILN_DECODE_PREW"):
        matmul_decode.preload_weight(2048, 1536)
    matmul_decode.preload_switch.cache_clear()
    monkeypatch.undo()
    x, b, _ = _inputs(2, 64, 8, torch.float32, device, seed=6)
    for cfg, rows in [(DecodeConfig("gemv", 8, 32, pre_k=48), 1), (DecodeConfig("gemv", 8, 32, pre_k=16), 1),
                      (DecodeConfig("dot", 16, 32, pre_k=64), 1), (DecodeConfig("gemv", 8, 32, pre_k=64), 2)]:  # fmt: skip
        with pytest.raises(ValueError, match="pre_k"):
            decode_matmul(x[:rows], b, config=cfg)


@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[2]], ids=str)
def test_decode_strided_x_and_row_major_weight(config, device):
    """x with a K stride of 2 and B = a (K, N) row-major tensor: loads take any strides."""
    x, b, _ = _inputs(5, 40, 24, torch.float32, device, seed=4, x_strided=True, w_rowmajor=True)
    assert x.stride(1) == 2 and b.stride(1) == 1
    assert_close(decode_matmul(x, b, config=config), matmul_ref(x.double(), b.double()), name="strided")


def test_matmul_one_row_of_row_major_b(device):
    """matmul(x, B) with B (K, N) row-major, one row: the rule takes the dot kernel (tiles along N)."""
    x, b, bias = _inputs(1, 64, 40, torch.float16, device, seed=10, w_rowmajor=True)
    with use_backend("triton"):
        c = matmul_fwd(x, b, bias, "relu")[0]
    assert decode_config(1, 40, 64, 4, False).kernel == "dot"
    assert_close(c, matmul_ref(x.double(), b.double(), bias.double(), "relu"), name="row-major B")


def test_decode_gemv_bfloat16_and_out(device):
    """The FMA kernel has no tl.dot, so bf16 runs through the interpreter too; `out` is written in place."""
    x, b, bias = _inputs(1, 96, 40, torch.bfloat16, device, seed=5)
    out = torch.empty(1, 40, device=device, dtype=torch.bfloat16)
    c = decode_matmul(x, b, bias, "gelu", out=out, config=DecodeConfig("gemv", 8, 32, split_k=2))
    assert c.data_ptr() == out.data_ptr()
    assert_close(c, matmul_ref(x.double(), b.double(), bias.double(), "gelu"), name="bf16 gemv")


def test_decode_split_k_is_deterministic(device):
    x, b, bias = _inputs(4, 96, 32, torch.float32, device, seed=6)
    cfg = DecodeConfig("gemv", 8, 16, split_k=3)
    assert torch.equal(decode_matmul(x, b, bias, config=cfg), decode_matmul(x, b, bias, config=cfg))


def test_cached_launch_keys_tell_configs_apart(monkeypatch, device):
    """CachedLaunch (kernels/launch.py) reuses a compiled kernel for calls with equal keys, and keys
    positional ints by Triton's value classes only (== 1, divisible by 16): a constexpr passed positionally
    let SPLIT_K 2 and 4 share one binary on the H200 (the sum kernel added 2 of 4 slices). Every launch's
    key must differ between configs that compile differently."""
    from kiln.kernels.launch import _arg_key

    keys: dict[str, list] = {}
    for name in ("_gemv_launch", "_dot_launch", "_sum_launch"):
        real = getattr(matmul_decode, name)

        def record(grid, name=name, real=real):
            def go(*args, **meta):
                keys.setdefault(name, []).append((tuple(map(_arg_key, args)), tuple(meta.items())))
                return real[grid](*args, **meta)

            return go

        monkeypatch.setattr(
            matmul_decode, name, type("Recorder", (), {"__getitem__": lambda self, g, r=record: r(g)})()
        )
    x, b, bias = _inputs(2, 96, 40, torch.float16, device, seed=11)
    want = matmul_ref(x.double(), b.double(), bias.double(), "silu")
    for config in [DecodeConfig("gemv", 4, 32, 2), DecodeConfig("gemv", 8, 16, 4), DecodeConfig("dot", 16, 32, 2),
                   DecodeConfig("dot", 32, 16, 4)]:  # fmt: skip
        assert_close(decode_matmul(x, b, bias, "silu", config=config), want, name=str(config))
    # two gemv and two dot configs, each splitting K in 2 and then 3 (K = 96 in 32- and 16-wide steps)
    assert len(set(keys["_gemv_launch"])) == len(set(keys["_dot_launch"])) == 2, "two configs share a key"
    assert len(keys["_sum_launch"]) == 4 and len(set(keys["_sum_launch"])) == 2, "SPLIT_K 2 and 3 share a key"


@pytest.mark.parametrize(
    "config", [DecodeConfig("dot", 16, 32), DecodeConfig("dot", 32, 16, split_k=3, stages=3)], ids=str
)
@pytest.mark.parametrize("M,K,N", [(17, 72, 37), (40, 50, 24), (128, 33, 19)])
def test_decode_wide_rows_match_float64(config, M, K, N, device):
    """17-128 rows (x.T padded to M's next power of two, from 32 to 128 wide): bias, activation, split K,
    ragged column blocks and K steps."""
    x, b, bias = _inputs(M, K, N, torch.float16, device, seed=M + K)
    c = decode_matmul(x, b, bias, "gelu_tanh", config=config)
    assert c.shape == (M, N)
    assert_close(c, matmul_ref(x.double(), b.double(), bias.double(), "gelu_tanh"), name=f"{M} rows {config}")


def test_decode_wide_rule_and_residual_epilogue(device):
    """The rule's config past 16 rows, and the residual_sumsq epilogue at 33 rows (its sum kernel's
    (rows, columns) tile at a wide M)."""
    x, b, bias = _inputs(33, 64, 40, torch.float32, device, seed=12)
    assert_close(decode_matmul(x, b, bias), matmul_ref(x.double(), b.double(), bias.double()), name="rule")
    r = torch.randn(33, 40, dtype=torch.float32).to(device)
    h, ss = decode_matmul(x, b, bias, epilogue="residual_sumsq", residual=r.clone(),
                          config=DecodeConfig("dot", 16, 16, split_k=2))  # fmt: skip
    want = r.double() + matmul_ref(x.double(), b.double(), bias.double())
    assert_close(h, want, name="residual")
    assert_close(ss.sum(1), h.double().square().sum(1), name="sum of squares")


def test_decode_rejects_too_many_rows(device):
    x, b, _ = _inputs(129, 16, 8, torch.float32, device, seed=7)
    with pytest.raises(ValueError, match="at most 128 rows"):
        decode_matmul(x, b)
    with pytest.raises(ValueError, match="gemv decode kernel takes at most 16 rows"):
        decode_matmul(x[:17], b, config=DecodeConfig("gemv", 16, 16))
    with pytest.raises(ValueError, match="unknown decode kernel"):
        decode_matmul(x[:2], b, config=DecodeConfig("wgmma", 16, 16))


def test_matmul_routes_decode_shapes(monkeypatch, device):
    """linear/matmul/matmul_fwd send M <= 16 to the decode kernels, M > 16 and the cases they do not
    cover (a stored pre-activation for the backward, accumulate, an explicit config) to the tile kernel;
    the results match float64 on both paths, gradients included."""
    calls, real = [], matmul_decode.decode_matmul

    def counted(a, *args, **kwargs):
        calls.append(tuple(a.shape))
        return real(a, *args, **kwargs)

    monkeypatch.setattr(matmul_decode, "decode_matmul", counted)
    gen = torch.Generator().manual_seed(8)
    w = (torch.randn(24, 32, generator=gen) / 6).to(device, torch.float16)
    bias = torch.randn(24, generator=gen).to(device, torch.float16)
    with use_backend("triton"):
        for lead in [(1,), (2, 8), (17,)]:  # 1 and 16 tokens: decode; 17: the tile kernel
            x = torch.randn(*lead, 32, generator=gen).to(device, torch.float16)
            want = matmul_ref(x.double().reshape(-1, 32), w.double().t(), bias.double(), "relu")
            assert_close(linear(x, w, bias, "relu"), want.reshape(*lead, 24), name=f"linear {lead}")
        assert calls == [(1, 32), (16, 32)]
        x = torch.randn(4, 32, generator=gen).to(device, torch.float16)
        matmul_fwd(x, w.t(), config=tile_config(16, 16, 16, 1, 4, 1))
        matmul_fwd(x, w.t(), out=torch.zeros(4, 24, device=device, dtype=torch.float16), accumulate=True)
        assert len(calls) == 2
        # autograd with an activation stores the pre-activation: the tile kernel's epilogue
        leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
        y = linear(*leaves, "silu")
        assert len(calls) == 2
        ref = [t.double().requires_grad_() for t in (x, w, bias)]
        want = matmul_ref(ref[0], ref[1].t(), ref[2], "silu")
        assert_close(y, want, name="autograd forward")
        g = torch.randn(4, 24, generator=gen, dtype=torch.float64)
        got = torch.autograd.grad(y, leaves, g.to(device, torch.float16))
        exp = torch.autograd.grad(want, ref, g.to(device))
        for name, a, r in zip(("dx", "dW", "dbias"), got, exp):
            assert_close(
                a, r, scale=24**0.5, name=name
            )  # fp16 dpre summed over up to 24 terms (as test_matmul)


def test_decode_config_rule(monkeypatch):
    """The rule on the H200 (132 SMs) at the Qwen2.5-1.5B shapes: a known kernel, every SM busy, and whole
    BLOCK_K steps. Pure Python: checks the rule, not the GPU."""
    monkeypatch.setattr(matmul_decode, "interpreting", lambda: False)
    rule = decode_config.__wrapped__  # past the cache (which holds interpreter answers)
    for M in (1, 2, 4, 8, 16):
        for K, N in [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536), (1536, 151936)]:
            cfg = rule(M, N, K, 132)
            assert cfg.kernel in ("gemv", "dot"), cfg
            programs = -(-N // cfg.block_n) * cfg.split_k
            assert programs >= 132 // 2, (M, K, N, cfg)
            assert cfg.kernel == "dot" or M * cfg.block_n * cfg.block_k <= 64 * 32 * cfg.warps, (M, cfg)
            assert rule(M, N, K, 132, k_major=False).kernel == "dot"  # row-major B: no 16-byte loads along K
    for M in (17, 32, 64, 100, 128):  # the wide tiles: the dot kernel, and whole K steps in every split
        for K, N in [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536), (1536, 151936)]:
            cfg = rule(M, N, K, 132)
            assert cfg.kernel == "dot", cfg
            assert -(-N // cfg.block_n) * cfg.split_k >= 132 // 2, (M, K, N, cfg)
            assert -(-K // cfg.block_k) >= 2 * cfg.split_k or cfg.split_k == 1, (M, K, N, cfg)
            assert rule(M, N, K, 132, split_ok=False).split_k == 1


def test_decode_gemv_override_from_the_environment(monkeypatch):
    """KILN_DECODE_GEMV_LONG / _WIDE (whole-step A/B runs) replace the one-row rule for the long-K (down) and
    the too-large-to-preload (gate_up) projections only; a malformed value is one clear ValueError."""
    monkeypatch.setattr(matmul_decode, "interpreting", lambda: False)
    rule = decode_config.__wrapped__
    monkeypatch.setenv("KILN_DECODE_GEMV_LONG", "1:2048:4:2")
    monkeypatch.setenv("KILN_DECODE_GEMV_WIDE", " 8:128:2:4")
    matmul_decode.gemv_override.cache_clear()
    try:
        assert rule(1, 1536, 8960, 132) == DecodeConfig("gemv", 1, 2048, 1, 4, 2, True)
        assert rule(1, 17920, 1536, 132) == DecodeConfig("gemv", 8, 128, 1, 2, 4, True)
        assert rule(1, 2048, 1536, 132) == DecodeConfig("gemv", 4, 256, 1, 2, 3, True)  # qkv: the rule
        assert rule(16, 1536, 8960, 132).kernel == "dot"  # rows past one: the rule
        for bad in ("2:1024:4", "3:1024:4:1", "4:256:0:3", "4:256:2:x"):
            monkeypatch.setenv("KILN_DECODE_GEMV_LONG", bad)
            matmul_decode.gemv_override.cache_clear()
            with pytest.raises(ValueError, match="KILN_DECODE_GEMV_LONG must be"):
                rule(1, 1536, 8960, 132)
    finally:
        monkeypatch.undo()
        matmul_decode.gemv_override.cache_clear()


QWEN_DECODE = [
    (M, K, N) for M in (1, 4, 16) for K, N in [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536)]
]


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", QWEN_DECODE)
def test_decode_bf16_qwen_shapes(M, K, N):
    """The rule's config at every Qwen2.5-1.5B decode shape, bf16 with bias and activation, and inside a
    CUDA graph (how decode runs it: the split-K buffer is allocated in the graph's pool)."""
    x, b, bias = _inputs(M, K, N, torch.bfloat16, "cuda", seed=M + N)
    want = matmul_ref(x.double(), b.double(), bias.double(), "silu")
    with use_backend("triton"):
        y = linear(x, b.t(), bias, "silu")
        assert_close(y, want, name=f"bf16 {decode_config(M, N, K, 132)}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            yg = linear(x, b.t(), bias, "silu")
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [DecodeConfig("gemv", 8, 512, 2), DecodeConfig("dot", 64, 128, 4, 4, 3), DecodeConfig("gemv", 8, 512, 2, pdl=True),
     DecodeConfig("dot", 16, 256, 1, 2, 4, pdl=True), DecodeConfig("gemv", 4, 256, 1, 2, 3, True, pre_k=2048),
     DecodeConfig("gemv", 4, 256, 1, 2, 3, True, pre_k=512)],
    ids=str,
)  # fmt: skip
def test_decode_bf16_explicit_configs(config):
    """Split K (bf16 partial sums in float32), both kernels, and programmatic dependent launch (Hopper)."""
    if config.pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90+")
    x, b, bias = _inputs(16 if config.kernel == "dot" else 1, 1536, 2048, torch.bfloat16, "cuda", seed=9)
    y = decode_matmul(x, b, bias, "gelu_tanh", config=config)
    assert_close(y, matmul_ref(x.double(), b.double(), bias.double(), "gelu_tanh"), name=str(config))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "M,K,N",
    [(M, K, N) for M in (32, 64, 128) for K, N in [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536)]],
)
def test_decode_bf16_wide_rows(M, K, N):
    """The wide tiles' rule at the engine's 32-128 sequence buckets, bf16 with bias, eager and in a CUDA
    graph (the split-K buffer allocated in the graph's pool)."""
    x, b, bias = _inputs(M, K, N, torch.bfloat16, "cuda", seed=M + N)
    want = matmul_ref(x.double(), b.double(), bias.double())
    y = decode_matmul(x, b, bias)
    assert_close(y, want, name=f"bf16 {decode_config(M, N, K, 132)}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        yg = decode_matmul(x, b, bias)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(yg, y)
