"""kiln vs transformers: logits, padded batches, greedy generation and the round trip, per architecture."""

from __future__ import annotations

import pytest
import torch

from kiln.model import from_pretrained, save_pretrained

from ._helpers import LLAMA3_ROPE, assert_logits_close, hf_model, transformers

# one rope scaling variant (and one feature) per architecture, so every path meets transformers once
CASES = {
    "gpt2": ("gpt2", {}),
    "llama": ("llama", dict(rope_scaling=LLAMA3_ROPE)),
    "mistral": (
        "mistral",
        dict(
            sliding_window=7,
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 24},
        ),
    ),
    "qwen2": (
        "qwen2",
        dict(
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=9,
            max_window_layers=0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "qwen3": ("qwen3", dict(head_dim=24, rope_scaling={"rope_type": "dynamic", "factor": 3.0})),
    "mixtral": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=2, rope_theta=1e6)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    hf = hf_model(arch, **overrides)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return hf, from_pretrained(path).eval(), path


def test_logits_match(pair):
    hf, kiln, _ = pair
    ids = torch.randint(0, 1000, (2, 41), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_logits_close(kiln(ids), hf(ids).logits)


def test_logits_match_past_max_position(pair):
    hf, kiln, _ = pair
    ids = torch.randint(0, 1000, (1, 110), generator=torch.Generator().manual_seed(5))  # max_position 96
    if kiln.config.arch == "gpt2":  # learned positions end at n_positions: a clear error, not garbage
        with pytest.raises(ValueError, match="exceed the 96 learned positions"):
            kiln(ids)
        return
    with torch.no_grad():
        assert_logits_close(kiln(ids), hf(ids).logits)


def test_padded_batch_matches(pair):
    hf, kiln, _ = pair
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 1000, (3, 23), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # left padding
    mask[2, :2] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=pos).logits
        got = kiln(ids, position_ids=pos, attention_mask=mask)
    real = mask.bool()
    assert_logits_close(got[real], want[real])


def test_greedy_generation_matches(pair):
    hf, kiln, _ = pair
    ids = torch.randint(0, 1000, (1, 9), generator=torch.Generator().manual_seed(3))
    want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    got = kiln.generate(ids, 20, temperature=0)
    assert got.tolist() == want.tolist()


def test_export_round_trip(pair, tmp_path):
    hf, kiln, _ = pair
    save_pretrained(kiln, tmp_path, max_shard_bytes=200_000)  # forces several shards + index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 1000, (2, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_logits_close(back(ids).logits, hf(ids).logits)
