"""One tiny model directory for the whole server suite (its tokenizer carries the ChatML template)."""

import pytest

from ._server import make_model_dir


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("serve") / "tiny")
