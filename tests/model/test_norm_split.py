"""The split add + RMSNorm in the model (KILN_DECODE_NORM=split, kiln.model.transformer.Decoder.norm_split):
a decode-sized step with the norms folded into the decode matmuls (o_proj / down_proj's residual_sumsq
epilogue, gate_up / qkv's rmsnorm prologue) gives the logits and greedy tokens of the separate add + RMSNorm
kernel; the norms it cannot split (layer 0's input, the final one, those next to a quantized linear, GPT-2's
LayerNorm, a prefill) run as before; a bad switch value is a clear error."""

from __future__ import annotations

import contextlib

import pytest
import torch

import kiln.model.layers as layers
import kiln.model.linear as linear
import kiln.model.quant_linear as quant_linear
from kiln.errors import KilnError
from kiln.kernels.dispatch import use_backend
from kiln.kernels.quant_matmul import wq_matmul_ref
from kiln.model import ModelConfig, build_model
from kiln.model.attn_metadata import AttnMetadata
from kiln.model.config import KernelConfig, decode_norm
from kiln.model.quant_linear import quant_linear_like
from kiln.quant.rtn import quantize_weight

# d 48 and FFN 40 are ragged against the interpreter's 16 x 32 decode tiles (several column blocks, so
# several partial sums of squares per row, and a partial last K step)
BASE = dict(vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden=40, max_seq_len=128)
CFGS = {
    "qwen2": dict(arch="qwen2", qkv_bias=True, head_dim=16),  # decode attention takes D in 16..256
    "llama": dict(arch="llama", head_dim=16),
}
# float32: the split form's rstd sums per-column-block partials and then the partials, the norm kernel
# sums the row in one tree; the normalized values differ in the last float32 bits (a few ulps), which the
# two layers and the head carry to the logits (measured: <= 2.4e-7 absolute on logits of scale ~3, and 0 in
# 3 of 4 cases); 1e-5 leaves a margin of ~40x and still catches a wrong weight, eps or stream (>= 1e-3).
TOL = dict(rtol=1e-5, atol=1e-5)


@contextlib.contextmanager
def env_form(monkeypatch, var: str, read_once):
    """A setter of the decode-form switch `var` for the next forward (None: unset); `read_once` (e.g.
    kiln.model.config.decode_norm) caches the switch, so its cache is cleared at every set and at the end,
    where the switch is unset again for the next test."""

    def set_form(form: str | None) -> None:
        if form is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, form)
        read_once.cache_clear()

    try:
        yield set_form
    finally:
        set_form(None)


@pytest.fixture
def norm_form(monkeypatch):
    """Set KILN_DECODE_NORM for the next forward."""
    with env_form(monkeypatch, "KILN_DECODE_NORM", decode_norm) as set_form:
        yield set_form


@pytest.fixture
def calls(monkeypatch):
    """Counts of the separate add + RMSNorm kernel and of the decode matmul's split-norm hooks."""
    n = {"rmsnorm": 0, "prologue": 0, "epilogue": 0}
    rmsnorm, decode_matmul = layers.rmsnorm, linear.decode_matmul

    def counted_rmsnorm(*args, **kw):
        n["rmsnorm"] += 1
        return rmsnorm(*args, **kw)

    def counted_matmul(*args, **kw):
        n["prologue"] += kw.get("prologue") == "rmsnorm"
        n["epilogue"] += kw.get("epilogue") == "residual_sumsq"
        return decode_matmul(*args, **kw)

    monkeypatch.setattr(layers, "rmsnorm", counted_rmsnorm)
    monkeypatch.setattr(linear, "decode_matmul", counted_matmul)

    def take() -> dict:
        out = dict(n)
        n.update(rmsnorm=0, prologue=0, epilogue=0)
        return out

    return take


def _model(name: str, device, **over):
    cfg = ModelConfig(**{**BASE, **CFGS.get(name, {}), **over})
    model = build_model(cfg, device, seed=1, kernels=KernelConfig(linear="kiln")).eval()
    with torch.no_grad():  # init leaves norm weights at 1: random ones test that each norm's own is used
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(
                    1.0 + 0.3 * torch.randn_like(p)
                    if n.endswith("norm.weight")
                    else 0.1 * torch.randn_like(p)
                )
    return model


def _decode_step(cfg: ModelConfig, lens: list[int], page: int, seed: int, device):
    """A paged decode step of len(lens) sequences with lens[i] cached keys (random caches, scattered pages)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    width = max(-(-(n + 1) // page) for n in lens) + 1
    tables = torch.randperm(B * width, generator=g).view(B, width).to(torch.int32)
    caches = [
        tuple(
            torch.randn(B * width, page, cfg.n_kv_heads, cfg.head_dim, generator=g).to(device)
            for _ in range(2)
        )
        for _ in range(cfg.n_layers)
    ]
    pos = torch.tensor(lens)
    slots = tables[torch.arange(B), pos // page].long() * page + pos % page
    meta = AttnMetadata(
        cu_seqlens_q=torch.arange(B + 1, dtype=torch.int32, device=device),
        max_seqlen_q=1,
        slot_mapping=slots.to(device),
        block_tables=tables.to(device),
        context_lens=(pos + 1).to(torch.int32).to(device),
        decode=True,
    )
    tokens = torch.randint(0, cfg.vocab_size, (B,), generator=g).to(device)
    return tokens, pos.to(device), meta, caches


def _clones(caches):
    """Copies of the per-layer K/V caches (a step writes its K/V into them)."""
    return [(k.clone(), v.clone()) for k, v in caches]


def _logits(model, tokens, pos, meta, caches):
    """The step's logits (N, V), on copies of the caches."""
    caches = _clones(caches)
    with torch.no_grad(), use_backend("triton"):
        h, _ = model.model(tokens, pos, meta, caches)
        return model.compute_logits(h)


@pytest.mark.parametrize(
    "name,lens", [("qwen2", [0, 5, 30, 12]), ("llama", [9])], ids=["qwen2-4rows-dot", "llama-1row-gemv"]
)
def test_decode_step_split_equals_separate(name, lens, norm_form, calls, device):
    model = _model(name, device)
    L = model.config.n_layers
    step = _decode_step(model.config, lens, page=8, seed=2, device=device)
    norm_form(None)
    want = _logits(model, *step)
    assert calls() == {"rmsnorm": 2 * L + 1, "prologue": 0, "epilogue": 0}  # off by default
    norm_form("split")
    got = _logits(model, *step)
    # 2 L - 1 norms split (each one epilogue and one prologue); layer 0's input norm and the final norm stay
    assert calls() == {"rmsnorm": 2, "prologue": 2 * L - 1, "epilogue": 2 * L - 1}
    torch.testing.assert_close(got, want, **TOL)


def test_quantized_linear_keeps_its_norms_separate(norm_form, calls, monkeypatch, device):
    # layer 1's o_proj quantized: the norm after it (layer 1's post-attention norm) cannot split; layer
    # 0's post-attention norm and layer 1's input norm (between plain linears) still do. The quantized
    # layer runs its eager reference: at 7784c39 the weight-only decode kernels do not compile (they call
    # matmul_decode._store with its signature from before the split norm's arguments), and what this test
    # checks is which norms split, not that kernel.
    monkeypatch.setattr(quant_linear, "wq_linear", wq_matmul_ref)
    model = _model("qwen2", device)
    attn = model.model.layers[1].self_attn
    q = quant_linear_like(attn.o_proj, "int8")
    res = quantize_weight(attn.o_proj.weight, "int8")
    q.set_quantized(res["qweight"], res["scales"])
    attn.o_proj = q
    step = _decode_step(model.config, [3, 17], page=8, seed=3, device=device)
    norm_form(None)
    want = _logits(model, *step)
    calls()
    norm_form("split")
    got = _logits(model, *step)
    assert calls() == {"rmsnorm": 3, "prologue": 2, "epilogue": 2}
    torch.testing.assert_close(got, want, **TOL)


def test_prefill_and_layernorm_take_the_old_path(norm_form, calls, device):
    # more than 16 flat tokens (a prefill) and GPT-2 (LayerNorm, GELU MLP): every norm as before, the same bits
    cases = [
        (_model("llama", device), 17),
        (_model("gpt2", device, arch="gpt2", head_dim=None, n_kv_heads=6), 3),
    ]
    g = torch.Generator().manual_seed(4)
    for model, T in cases:
        ids = torch.randint(0, BASE["vocab_size"], (1, T), generator=g).to(device)
        with torch.no_grad(), use_backend("triton"):
            norm_form(None)
            want = model(ids)
            norm_form("split")
            got = model(ids)
        rms = 2 * model.config.n_layers + 1 if model.config.arch == "llama" else 0  # GPT-2: LayerNorm
        assert calls() == {"rmsnorm": 2 * rms, "prologue": 0, "epilogue": 0}  # both forwards
        assert torch.equal(got, want)


def test_gradient_autocast_and_wrapped_blocks_take_the_old_path(norm_form, device):
    # a decode-sized step that wants gradients (training) or runs under autocast keeps the separate norms
    model = _model("llama", device)
    h = model.model.embed_tokens(torch.tensor([1, 2, 3], device=device))  # (3, d), requires grad
    norm_form("split")
    with use_backend("triton"):
        assert model.model.norm_split(h) is None
        with torch.no_grad():
            assert model.model.norm_split(h) == [(False, True, True), (True, True, False)]
            with torch.autocast(device.type, dtype=torch.bfloat16):
                assert model.model.norm_split(h) is None
    with use_backend("reference"), torch.no_grad():  # kiln's kernels not in use: F.linear / the reference
        assert model.model.norm_split(h) is None
    # layer 1 wrapped (as activation checkpointing wraps a block) or hooked: called whole, as today; only
    # layer 0's post-attention norm, between two plain linears of an unwrapped block, still splits
    wrapped = _model("llama", device)
    wrapped.model.layers[1] = torch.nn.Sequential(wrapped.model.layers[1])
    hooked = _model("llama", device)
    hooked.model.layers[1].register_forward_pre_hook(lambda *args: None)
    with use_backend("triton"), torch.no_grad():
        for m in (wrapped, hooked):
            assert m.model.norm_split(h) == [(False, True, False), (False, False, False)]


@pytest.mark.slow  # 15-20 s on the shared CPU: 3 engine steps of each form, ~20 kernels a step through the interpreter
def test_engine_greedy_tokens_equal(norm_form, calls, device):
    from kiln.infer import SamplingParams
    from kiln.infer.engine import LLM

    model = _model("qwen2", device, max_seq_len=64)
    prompts = [[5, 17, 3], [40, 2, 9, 11, 60]]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    outs = {}
    for form in ("separate", "split"):
        norm_form(form)
        # every step (prefill chunks of <= 12 tokens too) is decode-sized; decode steps take the
        # static-buffer step (a CUDA graph on GPU) of buckets 1 and 2
        llm = LLM(model, log=None, device=str(device), num_blocks=32, block_size=4, max_num_batched_tokens=12,
                  max_graph_batch=2, kernels=KernelConfig(linear="kiln"))  # fmt: skip
        with use_backend("triton"):
            outs[form] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        # three forwards: one prefill step of both prompts (8 tokens), two decode steps (bucket 2); each
        # splits 2 L - 1 = 3 norms
        assert calls()["prologue"] == (9 if form == "split" else 0)
    assert outs["split"] == outs["separate"]
    assert all(len(t) == 3 for t in outs["split"])


def test_bad_switch_value_is_a_clear_error(norm_form, device):
    model = _model("llama", device)
    step = _decode_step(model.config, [2], page=8, seed=6, device=device)
    norm_form("fused")
    with pytest.raises(KilnError, match=r"KILN_DECODE_NORM='fused' is not one of separate, split"):
        _logits(model, *step)
    for form, want in (("separate", "separate"), ("split", "split"), ("", "separate")):
        norm_form(form)
        assert decode_norm() == want


@pytest.mark.gpu
def test_cuda_graph_of_a_split_decode_step_bf16(norm_form, calls):
    # Qwen2.5-1.5B's block shapes (d 1536, 12 / 2 heads of 128, FFN 8960, q/k/v bias), 2 layers, a small
    # vocabulary, bf16; decode steps of 1 and 4 rows (gemv and dot kernels, down_proj's split K at 4) with
    # the split norm, captured in a CUDA graph, against the same step eager and against the separate norms
    dev = torch.device("cuda")
    cfg = dict(vocab_size=1024, d_model=1536, n_layers=2, n_heads=12, n_kv_heads=2, ffn_hidden=8960,
               max_seq_len=256, head_dim=128)  # fmt: skip
    model = _model("qwen2", dev, **cfg).to(torch.bfloat16)
    for lens in ([100], [3, 50, 130, 7]):
        tokens, pos, meta, caches = _decode_step(model.config, lens, page=16, seed=7, device=dev)
        caches = [(k.bfloat16(), v.bfloat16()) for k, v in caches]
        with torch.no_grad():
            norm_form("separate")
            want = model.model(tokens, pos, meta, _clones(caches))[0]
            norm_form("split")
            # the eager step also compiles every kernel before the capture
            eager = model.model(tokens, pos, meta, _clones(caches))[0]
            calls()
            graph_caches = _clones(caches)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                h = model.model(tokens, pos, meta, graph_caches)[0]
        assert calls()["prologue"] == 3  # captured with the split form (2 L - 1 norms)
        g.replay()
        torch.cuda.synchronize()
        # kiln's Triton kernels, replayed on the same inputs: the same bits as the eager step
        assert torch.equal(h, eager)
        # against the separate norms: the stream is the same bit for bit, but a normalized element can differ
        # by one bf16 ulp where the two float32 rstd sums round apart; two layers carry that to the final
        # norm's output (O(1), ~3-4 at most: gamma ~ 1 +- 0.3) at a few bf16 ulps (1 ulp at 4: 0.8% of
        # it). Through the interpreter at d 128, one row, the two forms measured bit-identical (3 seeds).
        err = (eager.float() - want.float()).abs().max().item()
        assert err <= 0.05 * want.float().abs().max().item(), err
