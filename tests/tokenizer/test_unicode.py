"""Every code point splits as tiktoken splits it (issue 13 item 12).

The `regex` module kiln splits with has newer Unicode tables than tiktoken's engine; kiln pins its
split to tiktoken's (kiln.tokenizer.unicode_pin). The sweep puts each code point c (all of
U+0000..U+10FFFF but the surrogates) in the context "{c}'s", where the split around the apostrophe
depends on whether c is a letter, a number, a mark, a space or something else, and compares ids with
tiktoken on a vocabulary of the 256 bytes plus the token "'s": that token appears exactly where "'s"
ends up inside one chunk, so equal ids mean equal splits around every c.
"""

from __future__ import annotations

import re
from itertools import repeat

import pytest
import regex
import tiktoken

from kiln.tokenizer import Tokenizer
from kiln.tokenizer.patterns import PATTERNS
from kiln.tokenizer.split import Splitter, bmp_form
from kiln.tokenizer.unicode_pin import NEWER_THAN_TIKTOKEN, pinned_pattern

BYTES = {bytes([i]): i for i in range(256)}
VOCAB = BYTES | {b"'s": 256}
CODE_POINTS = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
BATCH = 8192  # code points per text: ~140 texts, so tiktoken's and kiln's per-call costs vanish


def _marked(chunks: list[str], marker: str) -> str:
    """The text of `chunks` with every "'s" that lies inside one chunk replaced by `marker`."""
    return "".join(map(str.replace, chunks, repeat("'s"), repeat(marker)))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "gpt4", "o200k"])  # qwen2 uses gpt4's classes
def test_every_code_point_splits_as_tiktoken(name):
    pattern = PATTERNS[name]
    enc = tiktoken.Encoding(name="sweep", pat_str=pattern, mergeable_ranks=VOCAB, special_tokens={})
    split = Splitter(pattern)
    # tiktoken's ids back to text, with token 256 ("'s" merged in one chunk) shown as a marker that is
    # not in the batch: the last code point, or for the batch holding it, U+0100.
    markers = {m: chr(m) for m in (0x10FFFF, 0x100)}
    shown = {
        m: tiktoken.Encoding(
            name="show", pat_str=pattern, mergeable_ranks=BYTES | {c.encode(): 256}, special_tokens={}
        )
        for m, c in markers.items()
    }
    batches = [CODE_POINTS[i : i + BATCH] for i in range(0, len(CODE_POINTS), BATCH)]
    texts = ["\n".join(f"{chr(c)}'s" for c in batch) for batch in batches]
    want = enc.encode_ordinary_batch(texts, num_threads=2)
    marker = [0x10FFFF if batch[-1] < 0x10FFFF else 0x100 for batch in batches]
    bad = [
        k
        for k, text in enumerate(texts)
        if _marked(split.findall(text), markers[marker[k]]) != shown[marker[k]].decode(want[k])
    ]
    if bad:
        # Name the code points (one at a time, only in the failing batches) so the table can be fixed.
        points = [
            f"U+{c:04X}"
            for k in bad
            for c in batches[k]
            if _marked(split.findall(f"{chr(c)}'s"), markers[marker[k]])
            != shown[marker[k]].decode(enc.encode_ordinary(f"{chr(c)}'s"))
        ]
        pytest.fail(f"{len(points)} code points split unlike tiktoken with {name}: {points[:50]}")


def test_newer_code_points_encode_as_tiktoken_on_both_paths():
    """The issue's example: encode_ordinary (kiln's engine) and encode_ordinary_batch (tiktoken's)
    agree on text with code points newer than tiktoken's Unicode data, and both equal tiktoken."""
    newer = "".join(chr(a) + chr(b) for a, b in NEWER_THAN_TIKTOKEN)
    texts = ["\U0003e04f's", f"x{newer}'s y", f"Hello{chr(0x323B0)}World's 12{chr(0x1E6C0)}3 don't", newer]
    for name in ("gpt2", "gpt4", "o200k", "qwen2"):
        tok = Tokenizer(VOCAB, name)
        enc = tiktoken.Encoding(name="t", pat_str=PATTERNS[name], mergeable_ranks=VOCAB, special_tokens={})
        for text in texts:
            ids = tok.encode_ordinary(text)
            assert ids == enc.encode_ordinary(text), (name, text)
            assert tok.encode_ordinary_batch([text], processes=1) == [ids]
            assert tok.encode_ordinary_batch([text], processes=1, engine="kiln") == [ids]


def _contexts(c: str) -> str:
    # c after and before letters, digits, spaces, a newline and an apostrophe, inside the case-folded
    # contractions ('s, 'll, 've, 're) and next to itself: every class and fold the patterns use.
    return f"{c}'s '{c} '{c}e 'v{c}x{c}1{c}{c} A{c}a\n{c} "


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "gpt4", "o200k", "qwen2"])
def test_bmp_form_splits_every_bmp_code_point_as_regex(name):
    """The stdlib-`re` form that splits text without code points above U+FFFF (kiln.tokenizer.split)
    against the `regex` module with the pinned pattern (which the sweep above ties to tiktoken), on
    every BMP code point, lone surrogates included, in contexts that exercise each class."""
    fast = re.compile(bmp_form(PATTERNS[name]))
    slow = regex.compile(pinned_pattern(PATTERNS[name]))
    bad: list[str] = []
    for lo in range(0, 0x10000, BATCH):
        text = "".join(_contexts(chr(c)) for c in range(lo, lo + BATCH))
        if fast.findall(text) != slow.findall(text):
            bad += [
                f"U+{c:04X}"
                for c in range(lo, lo + BATCH)
                if fast.findall(_contexts(chr(c))) != slow.findall(_contexts(chr(c)))
            ]
    assert not bad, f"{len(bad)} code points split differently with {name}: {bad[:50]}"
