"""Sinks, sliding window, MoE, interleaved RoPE export, sizes and the errors that name a field."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from kiln.errors import KilnError
from kiln.model import ModelConfig, Transformer, build_model, from_pretrained, save_pretrained
from kiln.model.attn_metadata import AttnMetadata
from kiln.model.layers import Attention
from kiln.model.moe import SparseMoE

from ._helpers import assert_logits_close, hf_model, transformers

TINY = dict(
    arch="llama",
    vocab_size=97,
    d_model=40,
    n_layers=2,
    n_heads=5,
    n_kv_heads=1,
    ffn_hidden=56,
    max_seq_len=48,
)


def _ids(B, T, V=97, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_attention_layer_with_sinks_and_window_against_manual_softmax():
    cfg = ModelConfig(**{**TINY, "n_kv_heads": 5}, attn_sinks=True, sliding_window=4)
    torch.manual_seed(0)
    layer = Attention(cfg, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 9, 40)
    B, T, H, D = 2, 9, 5, 8
    got = layer(x.view(B * T, 40), None, AttnMetadata.dense(B, T)).view(B, T, 40)
    w = layer.state_dict()  # the checkpoint names of the merged q/k/v projection
    q, k, v = (
        F.linear(x, w[f"{n}.weight"]).view(B, T, H, D).transpose(1, 2).double()
        for n in ("q_proj", "k_proj", "v_proj")
    )
    s = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, T, T)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    s = s.masked_fill(~((j <= i) & (j > i - 4)), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    sink = torch.exp(layer.sinks.double().view(1, H, 1, 1) - s.amax(-1, keepdim=True))
    p = e / (e.sum(-1, keepdim=True) + sink)  # the sink takes mass, adds no value
    want = layer.o_proj((p @ v).transpose(1, 2).reshape(B, T, H * D).float())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sinks_train_and_vanish_when_very_negative():
    cfg = ModelConfig(**TINY, attn_sinks=True)
    model = build_model(cfg, seed=1)
    plain = Transformer(ModelConfig(**TINY))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("sinks")})
    ids = _ids(2, 13)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=1e-6)
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(2.0)
        assert not torch.allclose(model(ids), plain(ids), atol=1e-3)
    model.loss(ids, ids).backward()
    assert model.model.layers[0].self_attn.sinks.grad.abs().sum() > 0
    assert "model.layers.0.self_attn.sinks" in model.no_weight_decay_param_names()


def test_moe_layer_against_per_token_loop_and_hf_aux_loss():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    torch.manual_seed(0)
    moe = SparseMoE(d_model=24, hidden=20, n_experts=5, top_k=2)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(3, 7, 24)
    out, aux = moe(x)
    flat = x.reshape(-1, 24)
    probs = torch.softmax(moe.gate(flat), -1)
    want = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        w, idx = probs[n].topk(2)
        w = w / w.sum()
        for we, e in zip(w, idx):
            gate, up = (moe.experts.gate_up_proj[e] @ flat[n]).chunk(2)
            want[n] += we * (moe.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out.reshape(-1, 24), want, rtol=1e-5, atol=1e-5)
    hf_aux = load_balancing_loss_func((moe.gate(flat),), num_experts=5, top_k=2)
    torch.testing.assert_close(aux, hf_aux, rtol=1e-6, atol=1e-6)


def test_moe_loss_adds_aux_only_in_training():
    cfg = ModelConfig(
        **{**TINY, "arch": "mixtral"}, n_experts=4, n_experts_per_tok=2, router_aux_loss_coef=0.5
    )
    model = build_model(cfg, seed=0)
    ids = _ids(2, 11)
    model.eval()
    ce = model.loss(ids, ids)
    _, aux = model.hidden_states(ids)
    model.train()
    torch.testing.assert_close(model.loss(ids, ids), ce + 0.5 * aux)
    torch.testing.assert_close(model.loss(ids, ids, reduction="sum"), (ce + 0.5 * aux) * 22)
    model.loss(ids, ids).backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_sizes_from_config():
    cfg = ModelConfig(**TINY)
    L, H, hd, d, V, F = 2, 5, 8, 40, 97, 56
    active = L * (d * H * hd + 2 * d * hd + H * hd * d + 3 * d * F) + V * d
    assert cfg.flops_per_token(10) == pytest.approx(3 * (2 * active + 4 * L * H * hd * 5.5))
    win = ModelConfig(**TINY, sliding_window=4)
    mean_ctx = (1 + 2 + 3 + 4 + 4 * 6) / 10
    assert win.flops_per_token(10) == pytest.approx(3 * (2 * active + 4 * L * H * hd * mean_ctx))
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 2 * L * 1 * hd * 2
    assert cfg.kv_bytes_per_token(torch.float32) == 2 * L * 1 * hd * 4
    for extra in (
        {"arch": "gpt2", "n_kv_heads": None},
        {"arch": "mixtral", "n_experts": 3},
        {"qk_norm": True},
        {"qkv_bias": True, "tie_embeddings": True, "attn_sinks": True},
    ):
        c = ModelConfig(**{**TINY, **extra})
        m = Transformer(c)
        assert sum(p.numel() for p in m.parameters()) == c.num_params(), extra
        assert sum(c.param_counts().values()) == c.num_params()


def test_interleaved_rope_exports_as_half_rotated(tmp_path):
    cfg = ModelConfig(**{**TINY, "arch": "qwen3"}, rope_interleaved=True, qk_norm=True, head_dim=12)
    model = build_model(cfg, seed=2).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(2, 19)
    with torch.no_grad():
        assert_logits_close(model(ids), hf(ids).logits)
        assert_logits_close(from_pretrained(tmp_path)(ids), hf(ids).logits)


def test_gpt2_built_by_kiln_exports(tmp_path):
    cfg = ModelConfig(
        arch="gpt2",
        vocab_size=97,
        d_model=40,
        n_layers=2,
        n_heads=5,
        ffn_hidden=56,
        max_seq_len=48,
        tie_embeddings=True,
    )
    model = build_model(cfg, seed=0).eval()
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = _ids(2, 19)
    with torch.no_grad():
        assert_logits_close(model(ids), hf(ids).logits)


@pytest.mark.parametrize(
    "edit,field",
    [
        ({"architectures": ["FalconForCausalLM"]}, "architectures"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_type"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"attention_bias": True}, "attention_bias"),
        ({"quantization_config": {"bits": 4}}, "quantization_config"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_unsupported_hf_config_is_a_clear_error(tmp_path, edit, field):
    hf = hf_model("llama", num_hidden_layers=1)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KilnError, match=field):
        from_pretrained(tmp_path)


def test_mixed_sliding_layers_are_refused(tmp_path):
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    hf.save_pretrained(tmp_path)
    with pytest.raises(KilnError, match="layer_types"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"attn_sinks": True}, "attn_sinks"),
        ({"rope_scaling": {"rope_type": "ntk", "factor": 2.0}}, "rope_scaling"),
        ({"qkv_bias": True}, "qkv_bias"),
        ({"sliding_window": 8}, "sliding_window"),
    ],
)
def test_unexportable_config_is_a_clear_error(tmp_path, extra, field):
    model = build_model(ModelConfig(**TINY, **extra))
    with pytest.raises(KilnError, match=field):
        save_pretrained(model, tmp_path)
