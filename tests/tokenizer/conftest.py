"""Tokenizers trained once per session on the corpora of _corpora.py."""

from __future__ import annotations

import pytest

from kiln.tokenizer import train_bpe

from ._corpora import HARD, PATTERN_NAMES, multilingual, prose, stdlib_text


@pytest.fixture(scope="session")
def train_text() -> str:
    return multilingual(300_000)


@pytest.fixture(scope="session")
def heldout_text() -> str:
    # Different stdlib files from the training ones, plus the hard text.
    return stdlib_text(60_000, skip=150) + prose(200_000)[-40_000:] + HARD


@pytest.fixture(scope="session")
def trained(train_text):
    """One tokenizer per named pattern, trained on the same text (vocab 1200, chat specials)."""
    specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    return {
        name: train_bpe(
            [train_text], 1200, pattern=name, special_tokens=specials, processes=1, progress=False
        )
        for name in PATTERN_NAMES
    }
