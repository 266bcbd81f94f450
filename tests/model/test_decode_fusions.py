"""The model's decode step on the fused decode kernels (RoPE + paged K/V write in one kernel, SwiGLU in the
down projection's prologue, decode attention sized by the live context) equals the same step on the
eager reference ops, and the fused kernels are the ones that run (the separate ops are not called)."""

from __future__ import annotations

import pytest
import torch

import kiln.model.layers as layers
from kiln.kernels.decode_attention import decode_attention
from kiln.kernels.dispatch import use_backend
from kiln.model import ModelConfig, build_model
from kiln.model.attn_metadata import AttnMetadata
from kiln.model.config import KernelConfig

BASE = dict(vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden=40, max_seq_len=128)
CFGS = {
    "qwen2-bias": dict(arch="qwen2", qkv_bias=True, head_dim=16),  # decode attention takes D in 16..256
    "qwen3-interleaved-window-sinks": dict(
        arch="qwen3", qk_norm=True, head_dim=16, rope_interleaved=True, sliding_window=7, attn_sinks=True
    ),
}


def _step_inputs(cfg: ModelConfig, lens: list[int], page: int, seed: int, device):
    """A decode step of len(lens) sequences with lens[i] cached keys each (random caches, scattered pages),
    plus one padding row (slot -1, context 1), as the CUDA-graph bucket pads it."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    width = max(-(-(n + 1) // page) for n in lens) + 2  # wider than any sequence needs (a captured table)
    pool = (B + 1) * width
    tables = torch.randperm(pool, generator=g).view(B + 1, width).to(torch.int32)
    tables[B] = 0
    caches = [
        tuple(torch.randn(pool, page, cfg.n_kv_heads, cfg.head_dim, generator=g) for _ in range(2))
        for _ in range(cfg.n_layers)
    ]
    pos = torch.tensor(lens + [0])
    slots = tables[torch.arange(B + 1), pos // page].long() * page + pos % page
    slots[B] = -1
    meta = AttnMetadata(
        cu_seqlens_q=torch.arange(B + 2, dtype=torch.int32),
        max_seqlen_q=1,
        slot_mapping=slots,
        block_tables=tables,
        context_lens=(pos + 1).to(torch.int32),
        decode=True,
    )
    tokens = torch.randint(0, cfg.vocab_size, (B + 1,), generator=g)
    move = lambda t: t.to(device)  # noqa: E731
    meta = AttnMetadata(
        **{
            f: move(getattr(meta, f))
            for f in ("cu_seqlens_q", "slot_mapping", "block_tables", "context_lens")
        },
        max_seqlen_q=1,
        decode=True,
    )
    return move(tokens), move(pos), meta, [(move(k), move(v)) for k, v in caches]


@pytest.mark.parametrize("name", list(CFGS))
def test_decode_step_on_fused_kernels_equals_reference(name, monkeypatch, device):
    cfg = ModelConfig(**BASE, **CFGS[name])
    model = build_model(cfg, device, seed=1, kernels=KernelConfig(linear="kiln"))
    with torch.no_grad():
        for layer in model.model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.normal_(0, 1.0)
    tokens, pos, meta, caches = _step_inputs(cfg, [0, 5, 40, 9], page=8, seed=2, device=device)
    want_caches = [(k.clone(), v.clone()) for k, v in caches]
    with torch.no_grad(), use_backend("reference"):
        want, _ = model.model(tokens, pos, meta, want_caches)

    calls = {"rope_kv_write": 0}

    def counted(name, fn):
        def wrapper(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)

        return wrapper

    def unexpected(*args, **kw):
        raise AssertionError("a separate op ran in the fused decode path")

    for op in calls:
        monkeypatch.setattr(layers, op, counted(op, getattr(layers, op)))
    for op in ("apply_rope", "paged_kv_write"):
        monkeypatch.setattr(layers, op, unexpected)
    with torch.no_grad(), use_backend("triton"):
        got, _ = model.model(tokens, pos, meta, caches)
    assert calls == {"rope_kv_write": cfg.n_layers}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for (k, v), (wk, wv) in zip(caches, want_caches):  # v from the kiln matmul vs matmul_ref: fp32 rounding
        torch.testing.assert_close(k, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, wv, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_compiled_decode_step_equals_eager(device, monkeypatch):
    # decode_backend="compile" traces the step whole: the fused ops enter as opaque custom ops (fullgraph),
    # the K/V write declared as mutating the caches (one layer: Dynamo's tracing is most of the time). A
    # traced step keeps the separate SwiGLU kernel; the eager step does too here, since at these 4 rows the
    # interpreter's dot kernel may sum the gate_up epilogue's K in other float32 bits (test_swiglu_epilogue)
    from kiln.model.config import decode_swiglu

    from .test_norm_split import env_form

    cfg = ModelConfig(**{**BASE, "n_layers": 1}, **CFGS["qwen2-bias"])
    model = build_model(cfg, device, seed=1, kernels=KernelConfig(linear="kiln"))
    tokens, pos, meta, caches = _step_inputs(cfg, [0, 5, 40, 9], page=8, seed=2, device=device)
    compiled_caches = [(k.clone(), v.clone()) for k, v in caches]
    torch._dynamo.reset()
    step = torch.compile(
        lambda t, p: model.model(t, p, meta, compiled_caches)[0], backend="aot_eager", fullgraph=True
    )
    with (
        torch.no_grad(),
        use_backend("triton"),
        env_form(monkeypatch, "KILN_DECODE_SWIGLU", decode_swiglu) as form,
    ):
        form("separate")
        want, _ = model.model(tokens, pos, meta, caches)
        got = step(tokens, pos)
    assert torch.equal(got, want)
    for (k, v), (ck, cv) in zip(caches, compiled_caches):
        assert torch.equal(k, ck) and torch.equal(v, cv)


@pytest.mark.parametrize("window", [None, 7])
def test_warm_up_decode_launches_what_served_steps_launch(window, monkeypatch):
    # warm_up_decode launches decode attention at each batch size an eager step can have, over tables as
    # wide as the engine pads them: a served step of any of those batches, whatever its sequences' lengths
    # and pages, then launches a split kernel (split count, EARLY form, table stride: its specialization)
    # and a reduction that the warm-up compiled. A windowed layer's capacity is its window. The launches are
    # caught (no kernel); at the H200's 132 SMs the split count follows the batch (66 at one sequence, 9 at
    # eight) up to the table's capacity (160 pages of 16: 20 splits of 128 keys), EARLY where it reaches it.
    import kiln.kernels.decode_attention as dec

    seen = []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                kind = "split" if "EARLY" in kw else "reduce"  # the reduction takes no EARLY
                seen.append(
                    (
                        kind,
                        grid[2] if kind == "split" else kw["BLOCK_S"],
                        kw.get("EARLY"),
                        args[18] if kind == "split" else None,
                    )
                )  # fmt: skip (args[18]: the table's row stride)

            return launch

    monkeypatch.setattr(dec, "_decode_split_kernel", Spy())
    monkeypatch.setattr(dec, "_decode_reduce_kernel", Spy())
    monkeypatch.setattr(dec, "sm_count", lambda device: 132)
    cfg = ModelConfig(**{**BASE, **CFGS["qwen2-bias"], "sliding_window": window})
    model = build_model(cfg, "cpu", seed=1, kernels=KernelConfig(linear="kiln"))
    attn = model.model.layers[0].self_attn
    page, width, batches = 16, 160, range(1, 9)
    kv = tuple(torch.zeros(200, page, cfg.n_kv_heads, cfg.head_dim) for _ in range(2))
    with use_backend("triton"):
        attn.warm_up_decode(kv, width, batches)
        warmed, seen[:] = set(seen), []
        g = torch.Generator().manual_seed(5)
        for B in batches:
            q = torch.randn(B, cfg.n_heads, cfg.head_dim, generator=g)
            lens = torch.randint(1, width * page + 1, (B,), generator=g, dtype=torch.int32)
            table = torch.randint(0, 200, (B, width), generator=g, dtype=torch.int32)
            decode_attention(q, *kv, table, lens, window=attn.window, sinks=attn.sinks)
    served = set(seen)
    assert served <= warmed, served - warmed
    counts = {s for kind, s, _, _ in warmed if kind == "split"}
    assert counts == {1} if window else len(counts) > 2  # the window's 7 keys: one split; else the batch's
    assert {e for kind, _, e, _ in warmed if kind == "split"} == ({True} if window else {True, False})


@pytest.mark.parametrize("batch", [1, 3])
def test_signal_first_only_ahead_of_a_preloading_projection(batch, monkeypatch, device):
    # The norm before the q/k/v projection and decode attention before the o projection let that projection
    # be scheduled before they wait (signal_first) only at one-token steps whose projection loads its weight
    # before its own wait (Linear.reads_early: matmul_decode.preload_weight, off in the interpreter, so
    # forced on here); never ahead of gate_up (no preload). Quantized projections: the next test
    import kiln.model.linear as linear_mod

    monkeypatch.setattr(linear_mod, "preload_weight", lambda n, k: n != 80)  # qkv and o, not gate_up (2 x 40)
    cfg = ModelConfig(**BASE, **CFGS["qwen2-bias"])
    model = build_model(cfg, device, seed=1, kernels=KernelConfig(linear="kiln"))
    seen = {"rmsnorm": [], "decode_attention": []}

    def spy(name, fn):
        def wrapper(*args, **kw):
            seen[name].append(kw.get("signal_first", False))
            return fn(*args, **kw)

        return wrapper

    for name in seen:
        monkeypatch.setattr(layers, name, spy(name, getattr(layers, name)))
    tokens, pos, meta, caches = _step_inputs(cfg, [5] * batch, page=8, seed=2, device=device)
    tokens, pos = tokens[:batch], pos[:batch]  # no padding row: `batch` tokens
    meta = AttnMetadata(cu_seqlens_q=meta.cu_seqlens_q[: batch + 1], max_seqlen_q=1,
                        slot_mapping=meta.slot_mapping[:batch], block_tables=meta.block_tables[:batch],
                        context_lens=meta.context_lens[:batch], decode=True)  # fmt: skip
    with torch.no_grad(), use_backend("triton"):
        model.model(tokens, pos, meta, caches)
    one = batch == 1
    # per layer: input norm (-> qkv), post-attention norm (-> gate_up); then the final norm (-> the head)
    assert seen["rmsnorm"] == [one, False] * cfg.n_layers + [False]
    assert seen["decode_attention"] == [one] * cfg.n_layers
    o_proj = model.model.layers[0].self_attn.o_proj
    with use_backend("triton"):
        with torch.no_grad():
            assert o_proj.reads_early(torch.zeros(1, 96, device=device))
            assert not o_proj.reads_early(torch.zeros(1, 1, 96, device=device))  # not a flat step
        # training (its weight wants a gradient): torch's or kiln's training matmul, nothing early
        assert not o_proj.reads_early(torch.zeros(1, 96, device=device))


def test_quantized_projection_reads_early_unless_switched_off(monkeypatch):
    # A quantized q/k/v or o projection of one token takes the norm's / decode attention's early signal only
    # where its fma launch preloads its first K step (the default; not with KILN_QUANT_PREW=off): ahead of
    # quantized projections that read nothing early the signal cost 6% at batch 1. Never an FP8 one, a
    # batch, or gate_up's size.
    from kiln.kernels import quant_matmul
    from kiln.model.quant_linear import QuantLinear

    monkeypatch.setattr(quant_matmul, "interpreting", lambda: False)  # the GPU's rule and table
    x, batch = torch.zeros(1, 1536), torch.zeros(2, 1536)
    qkv = {kind: QuantLinear(1536, 2048, True, kind, group_size=128 if kind == "int4" else 0)
           for kind in ("int8", "int4", "fp8")}  # fmt: skip
    gate_up = QuantLinear(1536, 17920, False, "int8")
    try:
        with use_backend("triton"):
            for value, want in (("", True), ("off", False), ("on", True)):
                monkeypatch.setenv("KILN_QUANT_PREW", value)
                quant_matmul.preload_switch.cache_clear()
                assert qkv["int8"].reads_early(x) is want and qkv["int4"].reads_early(x) is want
                assert not qkv["fp8"].reads_early(x) and not gate_up.reads_early(x)
                assert not qkv["int8"].reads_early(batch)
    finally:
        quant_matmul.preload_switch.cache_clear()


def test_quantized_gate_up_swiglu_rule_at_the_gpu_table(monkeypatch):
    # At the GPU's table a one-token int8 or int4-g128 gate_up of the Qwen2.5-1.5B shape runs the fma form
    # with K unsplit, so it takes the SwiGLU epilogue; never FP8, two tokens, or one projection of its own
    from kiln.kernels import quant_matmul
    from kiln.model.quant_linear import QuantLinear

    monkeypatch.setattr(quant_matmul, "interpreting", lambda: False)  # the GPU's rule and table
    parts = {"gate_proj": 8960, "up_proj": 8960}
    x, batch = torch.zeros(1, 1536), torch.zeros(2, 1536)
    with use_backend("triton"):
        for kind, group in (("int8", 0), ("int4", 128)):
            gate_up = QuantLinear(1536, 17920, False, kind, group_size=group, parts=parts)
            assert gate_up.swiglu_fusable(x) and not gate_up.swiglu_fusable(batch)
            assert not QuantLinear(1536, 17920, False, kind, group_size=group).swiglu_fusable(x)  # no parts
        assert not QuantLinear(1536, 17920, False, "fp8", parts=parts).swiglu_fusable(x)
