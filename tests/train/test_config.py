import json

import pytest

from kiln.config import parse_overrides, to_dict
from kiln.errors import KilnError
from kiln.train.config import PRESETS, RunConfig, config_from_dict, resolve_config


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_resolve_and_round_trip(preset):
    cfg = resolve_config(preset)
    assert isinstance(cfg, RunConfig)
    assert cfg.model.vocab_size == cfg.tokenizer.vocab_size
    again = config_from_dict(json.loads(json.dumps(to_dict(cfg))))
    assert to_dict(again) == to_dict(cfg)


def test_overrides_are_typed_and_nested():
    cfg = resolve_config(
        "tiny",
        overrides=[
            "--train.steps=7",
            "--train.lr",
            "0.01",
            "--model.n_layers=3",
            "--tokenizer.vocab_size=500",
            "--data.max_bytes=null",
            "--train.compile=false",
            '--sample.prompts=["a","b"]',
        ],
    )
    assert cfg.train.steps == 7 and cfg.train.lr == 0.01 and cfg.model.n_layers == 3
    assert cfg.tokenizer.vocab_size == 500 and cfg.model.vocab_size == 500  # vocab follows the tokenizer
    assert cfg.data.max_bytes is None and cfg.train.compile is False
    assert cfg.sample.prompts == ["a", "b"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--train.stepz=3"], "unknown config key config.train.stepz"),
        (["--nosuch.key=1"], "unknown config key config.nosuch"),
        (["--model.n_headz=2"], "n_headz"),
        (["--train.steps=abc"], "expected int"),
        (["--train.steps=0"], "train.steps must be positive"),
        (["--train.seq_len=4096"], "exceeds model.max_seq_len"),
        (["--model.n_kv_heads=3"], "n_kv_heads"),
        (["--train.steps"], "has no value"),
        (["train.steps=3"], "overrides look like"),
    ],
)
def test_bad_overrides_are_clear_errors(overrides, message):
    with pytest.raises(KilnError, match=message):
        resolve_config("tiny", overrides=overrides)


def test_parse_overrides_nests_sections():
    assert parse_overrides(["--a.b.c=1", "--a.d", "x", "--e=2"]) == {
        "a": {"b": {"c": "1"}, "d": "x"},
        "e": "2",
    }
