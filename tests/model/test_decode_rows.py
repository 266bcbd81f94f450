"""KILN_DECODE_ROWS (kiln.model.config.decode_rows): a no-gradient linear of 17 up to 64 rows (the default; 32 /
128 with the switch) takes the decode matmul's wide tiles instead of the tile kernel or cuBLAS, with the same
logits (float32, to the sums' order); with 16, during training, and past the switch's rows, nothing changes;
a bad value is one clear error."""

from __future__ import annotations

import pytest
import torch

import kiln.model.linear as linear
from kiln.errors import KilnError
from kiln.kernels.dispatch import use_backend
from kiln.model import ModelConfig, build_model
from kiln.model.config import KernelConfig, decode_rows

from .test_norm_split import env_form

CFG = ModelConfig(arch="qwen2", qkv_bias=True, vocab_size=97, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                  head_dim=16, ffn_hidden=40, max_seq_len=128)  # fmt: skip


@pytest.fixture
def rows_form(monkeypatch):
    with env_form(monkeypatch, "KILN_DECODE_ROWS", decode_rows) as set_form:
        yield set_form


@pytest.fixture
def wide_calls(monkeypatch):
    """The row counts of the decode matmul calls the model's Linear makes itself (the wide route)."""
    seen, real = [], linear.decode_matmul

    def counted(a, *args, **kw):
        seen.append(a.shape[0])
        return real(a, *args, **kw)

    monkeypatch.setattr(linear, "decode_matmul", counted)
    return seen


def test_wide_rows_switch(rows_form, wide_calls, device):
    model = build_model(CFG, device, seed=1, kernels=KernelConfig(linear="kiln")).eval()
    ids = torch.randint(0, CFG.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)).to(device)
    with use_backend("triton"), torch.no_grad():
        rows_form("16")
        want = model(ids)
        assert wide_calls == []  # 40 rows: the tile kernel
        rows_form("32")
        model(ids)
        assert wide_calls == []  # past the switch's 32 rows
        rows_form(None)
        assert decode_rows() == 64
        got = model(ids)
        # every block linear (qkv, o, gate_up, down): 40 rows each through the wide tiles (the head is
        # F.linear in compute_logits, as at every row count)
        assert wide_calls == [40] * (4 * CFG.n_layers)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32: the sums' order only
        wide_calls.clear()
        model.train()
        with torch.enable_grad():
            model(ids)  # training: the tile kernel, with its backward
        assert wide_calls == []


def test_no_wide_rows_under_torch_compile(rows_form, monkeypatch, device):
    # torch.compile traces kiln's matmul (<= 16 rows) but not the wide tiles' launcher, and reads no switch
    lin = linear.Linear(48, 40, bias=False, backend="kiln").to(device)
    x = torch.randn(40, 48, device=device)
    with use_backend("triton"), torch.no_grad():
        assert lin._decode_rows(x) == 40 and lin._decode_rows(x[:16]) == 16
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert lin._decode_rows(x) == 0 and lin._decode_rows(x[:16]) == 16


def test_no_decode_kernels_for_a_tensor_subclass_weight(device):
    # a DTensor weight (tensor parallel, FSDP) takes F.linear, whose sharded matmul DTensor implements;
    # a plain subclass stands in for it here (a DTensor needs a process group)
    class Sharded(torch.Tensor):
        pass

    lin = linear.Linear(48, 40, bias=False, backend="kiln").to(device)
    x = torch.randn(40, 48, device=device)
    with use_backend("triton"), torch.no_grad():
        assert lin._decode_rows(x) == 40
        lin.weight = torch.nn.Parameter(lin.weight.detach().as_subclass(Sharded), requires_grad=False)
        assert lin._decode_rows(x) == 0 and lin._decode_rows(x[:4]) == 0


def test_bad_rows_value_is_a_clear_error(rows_form):
    rows_form("48")
    with pytest.raises(KilnError, match="KILN_DECODE_ROWS='48' is not one of 64, 16, 32, 128"):
        decode_rows()
