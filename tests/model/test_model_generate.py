"""generate with a KV cache: equal to recomputation, padded batches, sampling, eos, streaming (StreamingLLM)."""

from __future__ import annotations

import pytest
import torch

from kiln.model import ModelConfig, StreamingKVCache, build_model

BASE = dict(vocab_size=97, d_model=40, n_layers=2, n_heads=5, n_kv_heads=1, ffn_hidden=56, max_seq_len=48)
VARIANTS = {
    "llama": dict(arch="llama"),
    "window+sinks": dict(arch="mistral", sliding_window=5, attn_sinks=True, n_kv_heads=5),
    "gpt2": dict(arch="gpt2", n_kv_heads=None, tie_embeddings=True),
    "moe+qknorm": dict(arch="mixtral", n_experts=3, qk_norm=True, head_dim=6),
}


def _model(name, seed=0):
    model = build_model(ModelConfig(**{**BASE, **VARIANTS[name]}), seed=seed).eval()
    with torch.no_grad():  # make attention sinks matter
        for n, p in model.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0, 1.0)
    return model


def _ids(B, T, seed=0):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


def _greedy_without_cache(model, ids, n):
    for _ in range(n):
        ids = torch.cat((ids, model(ids)[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_cached_greedy_equals_recomputation(name):
    model = _model(name)
    ids = _ids(2, 6)
    with torch.no_grad():
        want = _greedy_without_cache(model, ids, 12)
    assert model.generate(ids, 12, temperature=0).tolist() == want.tolist()


def test_left_padded_rows_generate_as_alone():
    model = _model("llama")
    a, b = _ids(1, 9, seed=1), _ids(1, 5, seed=2)
    batch = torch.cat((a, torch.cat((torch.zeros(1, 4, dtype=torch.long), b), dim=1)))
    mask = torch.ones_like(batch)
    mask[1, :4] = 0
    out = model.generate(batch, 10, temperature=0, attention_mask=mask)
    assert out[0].tolist() == model.generate(a, 10, temperature=0)[0].tolist()
    assert out[1, 4:].tolist() == model.generate(b, 10, temperature=0)[0].tolist()


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = _model("llama")
    ids = _ids(3, 4)
    s1 = model.generate(ids, 8, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(7))
    s2 = model.generate(ids, 8, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(7))
    assert s1.tolist() == s2.tolist()
    k1 = model.generate(ids, 8, temperature=0.8, top_k=1, generator=torch.Generator().manual_seed(1))
    assert k1.tolist() == model.generate(ids, 8, temperature=0).tolist()
    assert model.training is False and model.generate(ids, 0).tolist() == ids.tolist()


def test_eos_stops_rows_and_generation():
    model = _model("llama")
    ids = _ids(2, 4)
    greedy = model.generate(ids, 6, temperature=0)
    eos = int(greedy[0, 5])  # row 0's second new token
    out = model.generate(ids, 6, temperature=0, eos_id=eos)
    row0 = out[0, 4:].tolist()
    assert row0[:2] == greedy[0, 4:6].tolist() and all(t == eos for t in row0[1:])
    # a row that finished keeps emitting eos; once all have, generation stops early
    both = model.generate(torch.cat((ids[:1], ids[:1])), 6, temperature=0, eos_id=eos)
    assert both.shape[1] == 6


def test_streaming_equals_contiguous_within_budget():
    model = _model("llama")
    ids = _ids(2, 5)
    want = model.generate(ids, 10, temperature=0)
    assert model.generate(ids, 10, temperature=0, streaming=(4, 16)).tolist() == want.tolist()


def test_streaming_runs_past_training_length_on_sinks_plus_window():
    # one layer: the cached K/V depend only on their token, so each step's logits must equal a fresh
    # forward over [first n_sink tokens] + [last window tokens], positioned 0.. as in the cache
    cfg = ModelConfig(**{**BASE, "n_layers": 1, "max_seq_len": 16})
    model = build_model(cfg, seed=3).eval()
    n_sink, window = 2, 9
    ids = _ids(1, 4)
    out = model.generate(ids, 40, temperature=0, streaming=(n_sink, window))  # 44 tokens, trained on 16
    assert out.shape == (1, 44)
    with torch.no_grad():
        for n in range(20, 44):  # out[n] was chosen from the pass over token n-1
            ctx = torch.cat((out[:, :n_sink], out[:, max(n_sink, n - window - 1) : n]), dim=1)
            assert int(model(ctx)[0, -1].argmax()) == int(out[0, n]), n


def test_streaming_cache_keeps_sinks_and_window():
    cache = StreamingKVCache(n_layers=1, n_sink=2, window=3)
    k = torch.arange(8.0).view(1, 8, 1, 1)
    cache.update(0, k, k)
    cache.advance(8)
    assert cache.seq_len == 5 and cache.k[0].flatten().tolist() == [0, 1, 5, 6, 7]
    k_all, _ = cache.update(0, torch.full((1, 1, 1, 1), 8.0), torch.zeros(1, 1, 1, 1))
    assert k_all.flatten().tolist() == [0, 1, 5, 6, 7, 8]
    cache.advance(1)
    assert cache.k[0].flatten().tolist() == [0, 1, 6, 7, 8]


def test_gpt2_refuses_generation_past_its_positions():
    model = _model("gpt2")
    with pytest.raises(ValueError, match="learned"):
        model.generate(_ids(1, 40), 20)
