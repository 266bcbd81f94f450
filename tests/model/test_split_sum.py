"""The split-K sums of o_proj and down_proj added by the add + RMSNorm after them, and of q/k/v by the RoPE + K/V
write (KILN_DECODE_SUM=norm / all, kiln.model.linear.SplitSum, kiln.kernels.rmsnorm.rmsnorm_split,
kiln.kernels.rope.rope_kv_write_split): a decode-sized step gives the logits of the separate sum kernels,
launches no sum kernel where the next kernel takes it over (every post-attention norm, every input norm
after the first, the final norm, every RoPE + K/V write), and leaves a step alone where the configs do not split,
at a prefill, or with KILN_DECODE_SUM=separate; a bad switch value is a clear error."""

from __future__ import annotations

import pytest
import torch

import kiln.model.layers as layers
import kiln.model.linear as linear
from kiln.errors import KilnError
from kiln.kernels import matmul_decode
from kiln.kernels.matmul_decode import DecodeConfig
from kiln.model.config import decode_sum

from .test_norm_split import BASE, TOL, _decode_step, _logits, _model, env_form


@pytest.fixture
def sum_form(monkeypatch):
    with env_form(monkeypatch, "KILN_DECODE_SUM", decode_sum) as set_form:
        yield set_form


@pytest.fixture
def calls(monkeypatch):
    """Counts of rmsnorm_split and of decode matmuls that leave their sum (defer_sum)."""
    n = {"rmsnorm_split": 0, "rope_split": 0, "deferred": 0}
    split, rope_split, decode_matmul = layers.rmsnorm_split, layers.rope_kv_write_split, linear.decode_matmul

    def counted_split(*args, **kw):
        n["rmsnorm_split"] += 1
        return split(*args, **kw)

    def counted_rope(*args, **kw):
        n["rope_split"] += 1
        return rope_split(*args, **kw)

    def counted_matmul(*args, **kw):
        n["deferred"] += bool(kw.get("defer_sum"))
        return decode_matmul(*args, **kw)

    monkeypatch.setattr(layers, "rmsnorm_split", counted_split)
    monkeypatch.setattr(layers, "rope_kv_write_split", counted_rope)
    monkeypatch.setattr(linear, "decode_matmul", counted_matmul)

    def take() -> dict:
        out = dict(n)
        n.update(rmsnorm_split=0, rope_split=0, deferred=0)
        return out

    return take


def _split_everywhere(monkeypatch, split: int = 2):
    """The interpreter's rule splits no K; this one splits every decode matmul that may be split (not the
    SwiGLU epilogue, which takes none), so that o_proj and down_proj defer at any row count."""

    def rule(M, N, K, sms, k_major=True, split_ok=True):
        return DecodeConfig("dot", 16, 32, split if split_ok else 1)

    monkeypatch.setattr(matmul_decode, "decode_config", rule)
    monkeypatch.setattr(linear, "decode_config", rule)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_decode_step_split_sum_equals_separate(name, sum_form, calls, monkeypatch, device):
    _split_everywhere(monkeypatch)
    model = _model(name, device)
    L = model.config.n_layers
    step = _decode_step(model.config, [0, 5, 30, 12], page=8, seed=2, device=device)
    sum_form("separate")
    want = _logits(model, *step)
    assert calls() == {"rmsnorm_split": 0, "rope_split": 0, "deferred": 0}
    sum_form("norm")
    got = _logits(model, *step)
    # o_proj into every post-attention norm, down_proj into the next input norm or the final norm
    assert calls() == {"rmsnorm_split": 2 * L, "rope_split": 0, "deferred": 2 * L}
    torch.testing.assert_close(got, want, **TOL)  # rstd's sum order: see test_norm_split.TOL
    sum_form(None)  # the default, "all": q/k/v into the RoPE + K/V write too, the same bits as "norm"
    assert torch.equal(_logits(model, *step), got)
    assert calls() == {"rmsnorm_split": 2 * L, "rope_split": L, "deferred": 3 * L}


def test_no_split_no_deferral(sum_form, calls, device):
    # the interpreter's own rule splits no K: nothing to defer, the same logits bit for bit
    model = _model("qwen2", device)
    step = _decode_step(model.config, [3, 7], page=8, seed=4, device=device)
    sum_form("separate")
    want = _logits(model, *step)
    sum_form("norm")
    got = _logits(model, *step)
    assert calls() == {"rmsnorm_split": 0, "rope_split": 0, "deferred": 0}
    assert torch.equal(got, want)


def test_prefill_keeps_the_sum_kernel(sum_form, calls, monkeypatch, device):
    # more flat tokens than the decode tiles take (decode_rows(), 64): cuBLAS / kiln's matmul, no partials
    from kiln.kernels.dispatch import use_backend

    _split_everywhere(monkeypatch)
    model = _model("llama", device)
    ids = torch.randint(0, BASE["vocab_size"], (1, 65), generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad(), use_backend("triton"):
        sum_form("separate")
        want = model(ids)
        sum_form("norm")
        got = model(ids)
    assert calls() == {"rmsnorm_split": 0, "rope_split": 0, "deferred": 0}
    assert torch.equal(got, want)


def test_bad_switch_value_is_a_clear_error(sum_form, device):
    model = _model("llama", device)
    step = _decode_step(model.config, [4], page=8, seed=5, device=device)
    sum_form("sometimes")
    with pytest.raises(KilnError, match="KILN_DECODE_SUM='sometimes' is not one of all, norm, separate"):
        _logits(model, *step)


def test_defers_sum_under_torch_compile_reads_no_switch():
    # a compiled step keeps the summed matmul, and Dynamo is not sent through the cached environment switches
    # (decode_rows(), as decode_step_fusable's argument, was traced and warned once per process)
    import warnings

    from kiln.model.linear import Linear

    lin = Linear(32, 16, bias=False)
    with torch.no_grad():  # Linear allocates its weight uninitialized (NaN would fail torch.equal)
        lin.weight.copy_(torch.randn(16, 32, generator=torch.Generator().manual_seed(0)))

    @torch.compile(backend="eager")
    def step(x):
        return lin(x) * 2 if lin.defers_sum(x) else lin(x)

    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        x = torch.randn(1, 32)
        assert torch.equal(step(x), lin(x))
    traced = [
        str(w.message)[:300] for w in seen if "lru_cache" in str(w.message) or "decode_rows" in str(w.message)
    ]
    assert not traced, traced
