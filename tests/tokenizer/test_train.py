"""BPE training: the fast incremental trainer against the slow reference, and train_bpe's contract."""

from __future__ import annotations

import random

import pytest
import regex

from kiln.errors import KilnError
from kiln.tokenizer import train_bpe
from kiln.tokenizer.patterns import resolve_pattern
from kiln.tokenizer.train import Merge, bpe_merges, count_chunks

from ._corpora import HARD, stdlib_text
from ._reference import reference_merges


def chunk_counts(text: str, pattern: str = "gpt4") -> dict[bytes, int]:
    counts: dict[bytes, int] = {}
    for chunk in regex.findall(resolve_pattern(pattern), text):
        b = chunk.encode("utf-8")
        counts[b] = counts.get(b, 0) + 1
    return counts


def test_golden_aaabdaaabac():
    # The Wikipedia / minbpe example: aa -> Z, then ab -> Y (ties go to the smaller pair: (a, b) beats
    # (Z, a)), then ZY -> X, leaving "XdXac".
    merges, vocab = bpe_merges({b"aaabdaaabac": 1}, n_new=10, min_frequency=2, progress=False)
    a, b = ord("a"), ord("b")
    assert merges == [Merge(a, a, 256, 4), Merge(a, b, 257, 2), Merge(256, 257, 258, 2)]
    assert vocab[256:] == [b"aa", b"ab", b"aaab"]


def random_words(seed: int, n: int, alphabet: str, max_len: int) -> dict[bytes, int]:
    rng = random.Random(seed)
    words: dict[bytes, int] = {}
    for _ in range(n):
        w = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, max_len))).encode()
        words[w] = words.get(w, 0) + rng.randint(1, 5)
    return words


CORPORA = {
    "stdlib": lambda: chunk_counts(stdlib_text(40_000)),
    "hard": lambda: chunk_counts(HARD, "o200k"),
    # Tiny alphabets: long runs ("aaaa", "abab") exercise overlapping and back-to-back occurrences.
    "runs": lambda: random_words(0, 400, "ab", 12),
    "abc": lambda: random_words(1, 600, "abc ", 16),
}


@pytest.mark.parametrize("name", list(CORPORA))
def test_fast_trainer_equals_reference(name):
    words = CORPORA[name]()
    n_new = 150
    for min_frequency in (1, 2):
        fast, fast_vocab = bpe_merges(words, n_new, min_frequency=min_frequency, progress=False)
        slow, slow_vocab = reference_merges(words, n_new, min_frequency=min_frequency)
        assert fast == slow, (
            f"first difference at merge {next(i for i, (x, y) in enumerate(zip(fast, slow)) if x != y)}"
        )
        assert fast_vocab == slow_vocab
        assert len(set(fast_vocab)) == len(fast_vocab)  # every token's bytes are distinct


def test_train_bpe_layout_and_specials():
    text = stdlib_text(60_000)
    texts = [text[i : i + 5000] + "<|endoftext|>" for i in range(0, len(text), 5000)]
    specials = ("<|endoftext|>", "<|im_start|>")
    tok = train_bpe(iter(texts), 600, special_tokens=specials, processes=1, progress=False)
    assert tok.n_vocab == 600
    assert tok.special_tokens == {"<|endoftext|>": 598, "<|im_start|>": 599}
    assert tok.eot_id == 598
    vocab = tok.vocab
    assert sorted(vocab.values()) == list(range(598))
    assert all(vocab[bytes([i])] == i for i in range(256))
    # Special tokens are cut out before counting, so no token spans one.
    assert not any(b"|>" in t and b"<|" in t for t in vocab)
    assert tok.encode("a<|endoftext|>b", allowed_special="all")[1] == 598


def test_parallel_counting_equals_serial():
    text = stdlib_text(300_000)
    texts = [text[i : i + 70_000] for i in range(0, len(text), 70_000)]
    serial = count_chunks(texts, "gpt4", ("<|endoftext|>",), processes=1, progress=False)
    # Small batches, so that several tasks really go through the pool.
    parallel = count_chunks(
        iter(texts), "gpt4", ("<|endoftext|>",), processes=2, progress=False, batch_chars=100_000
    )
    assert parallel == serial


def test_min_frequency_stops_early():
    tok = train_bpe(["ab ab ab cd"], 10_000, pattern="gpt2", min_frequency=3, processes=1, progress=False)
    # " ab" appears twice and "ab" once... only pairs seen 3 times merge: (a, b).
    assert set(tok.vocab) - {bytes([i]) for i in range(256)} == {b"ab"}
    assert tok.n_vocab == 258


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"vocab_size": 256}, "too small"),
        ({"vocab_size": 1000, "pattern": "gpt5"}, "unknown split pattern"),
        ({"vocab_size": 1000, "pattern": "a|"}, "empty string"),
        ({"vocab_size": 1000, "pattern": "(unclosed"}, "not a valid regex"),
        ({"vocab_size": 1000, "special_tokens": ("<a>", "<a>")}, "distinct"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(KilnError, match=message):
        train_bpe(["some text"], progress=False, **kwargs)


def test_empty_and_non_text_input():
    with pytest.raises(KilnError, match="empty"):
        train_bpe([], 300, progress=False)
    with pytest.raises(KilnError, match="empty"):
        train_bpe(["", ""], 300, progress=False)
    with pytest.raises(TypeError, match="iterable of str"):
        train_bpe([b"bytes"], 300, progress=False)
    with pytest.raises(TypeError, match="not one text"):
        train_bpe("a single string is a classic mistake", 300, progress=False)
