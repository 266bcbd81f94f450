"""SamplingParams validation: each bad value is a KilnError that names the field."""

import math

import pytest

from kiln.errors import KilnError
from kiln.infer.sampling_params import SamplingParams


def test_defaults_are_valid():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p, p.n) == (16, 1.0, -1, 1.0, 0.0, 1)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None and not p.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("n", 0),
        ("max_tokens", 0),
        ("max_tokens", True),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("frequency_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("presence_penalty", 3.0),
        ("presence_penalty", math.nan),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", 21),
        ("prompt_logprobs", -1),
        ("stop", 3),
        ("stop", ["ok", 4]),
        ("stop", [""]),
        ("stop_token_ids", [1, -3]),
        ("stop_token_ids", "7"),
        ("seed", 1.5),
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("ignore_eos", "yes"),
    ],
)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(KilnError, match=field):
        SamplingParams(**{field: value})


def test_normalizations():
    assert SamplingParams(top_k=0).top_k == -1  # 0 is "off" too
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


def test_edges_accepted():
    SamplingParams(
        top_p=1.0, min_p=1.0, frequency_penalty=-2, presence_penalty=2, logprobs=0, prompt_logprobs=20
    )
    SamplingParams(temperature=0, top_k=1, seed=-5, repetition_penalty=1e-3)
