"""Encoding and decoding: kiln's ids equal tiktoken's and HF tokenizers' on the same vocabulary."""

from __future__ import annotations

import random
import re
import unicodedata

import pytest
import regex
import tiktoken
import tiktoken.load
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer

from kiln.tokenizer import DisallowedSpecialError, Tokenizer, bpe
from kiln.tokenizer.bpe import Merger
from kiln.tokenizer.patterns import resolve_pattern
from kiln.tokenizer.split import BMP_RUN, Splitter, _has_astral, bmp_form
from kiln.tokenizer.unicode_pin import pinned_pattern

from ._corpora import HARD, PATTERN_NAMES


def tiktoken_twin(tok: Tokenizer, tmp_path) -> tiktoken.Encoding:
    """A tiktoken Encoding built independently from kiln's saved ranks file, not from kiln's objects."""
    tok.save(tmp_path, hf=False)
    ranks = tiktoken.load.load_tiktoken_bpe(str(tmp_path / "tokenizer.tiktoken"))
    return tiktoken.Encoding(
        "twin", pat_str=tok.pattern, mergeable_ranks=ranks, special_tokens=tok.special_tokens
    )


def hf_twin(tok: Tokenizer, tmp_path) -> HFTokenizer:
    tok.save(tmp_path)
    return HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))


def texts_for(train_text: str, heldout_text: str) -> list[str]:
    lines = heldout_text.splitlines(keepends=True)
    return [heldout_text, HARD, train_text[:50_000], *lines[:300], *HARD.splitlines(), "", " ", "\n\n", "a"]


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_ids_equal_tiktoken_and_hf(name, trained, train_text, heldout_text, tmp_path):
    tok = trained[name]
    enc = tiktoken_twin(tok, tmp_path / "tt")
    hf = hf_twin(tok, tmp_path / "hf")
    for text in texts_for(train_text, heldout_text):
        ids = tok.encode_ordinary(text)
        assert ids == enc.encode_ordinary(text), f"tiktoken differs on {text[:80]!r}"
        assert ids == hf.encode(text, add_special_tokens=False).ids, f"HF differs on {text[:80]!r}"
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode("utf-8")


@pytest.mark.parametrize("name", ["gpt4", "o200k"])
def test_batch_paths_equal_single(name, trained, heldout_text, tmp_path):
    tok = trained[name]
    texts = heldout_text.splitlines(keepends=True)[:400] + [HARD]
    want = [tok.encode_ordinary(t) for t in texts]
    assert tok.as_tiktoken() is not None
    assert tok.encode_ordinary_batch(texts, processes=2) == want  # the tiktoken path
    # kiln's own process pool: a vocabulary with an explicit merge list has no tiktoken twin.
    tok.save(tmp_path)
    from_hf = Tokenizer.load(tmp_path / "tokenizer.json")
    assert from_hf.merges is not None and from_hf.as_tiktoken() is None
    assert from_hf.encode_ordinary_batch(texts, processes=2) == want
    assert tok.encode_ordinary_batch(texts, processes=2, engine="kiln") == want


def test_special_tokens_follow_tiktoken(trained, tmp_path):
    tok = trained["gpt4"]
    enc = tiktoken_twin(tok, tmp_path)
    text = "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>x<|endoftext|><|im_end|>"
    for allowed in ("all", {"<|endoftext|>"}, {"<|im_start|>", "<|im_end|>"}):
        for disallowed in ((), "all"):
            try:
                want = enc.encode(text, allowed_special=allowed, disallowed_special=disallowed)
            except ValueError:
                with pytest.raises(DisallowedSpecialError):
                    tok.encode(text, allowed_special=allowed, disallowed_special=disallowed)
                continue
            assert tok.encode(text, allowed_special=allowed, disallowed_special=disallowed) == want
    with pytest.raises(ValueError, match="<\\|endoftext\\|>.*not allowed"):
        tok.encode("a <|endoftext|>")
    assert tok.encode("a <|endoftext|>", disallowed_special=()) == tok.encode_ordinary("a <|endoftext|>")
    ids = tok.encode("a<|endoftext|>", allowed_special="all")
    assert ids[-1] == tok.eot_id and tok.decode(ids) == "a<|endoftext|>"


def test_decode_replaces_invalid_utf8(trained):
    tok = trained["gpt4"]
    ids = tok.encode_ordinary("é")  # two bytes, likely two tokens or one
    raw = b"".join(tok.token_bytes(i) for i in ids)
    assert raw == "é".encode()
    assert tok.decode([0xC3]) == "\ufffd"
    assert tok.decode_bytes([0xC3]) == b"\xc3"
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.decode([tok.n_vocab + 5])
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.token_bytes(-1)


def test_lone_surrogates_like_tiktoken(trained, tmp_path):
    tok = trained["gpt4"]
    enc = tiktoken_twin(tok, tmp_path)
    for text in ["a\ud800b", "\udfff", "x \ud83d\ude00 y"]:
        assert tok.encode_ordinary(text) == enc.encode_ordinary(text)
        assert tok.encode(text) == enc.encode(text)


# Characters assigned in this Python's Unicode tables (surrogates and unassigned code points out):
# tiktoken's Rust regex and the `regex` module may use different Unicode versions for new characters.
assigned = st.characters(blacklist_categories=("Cs", "Cn"), codec="utf-8").filter(
    lambda c: unicodedata.category(c) != "Cn"
)
unicode_text = st.text(assigned, max_size=80) | st.text(
    st.sampled_from(list(" \t\n\r\u00a0\x85\x1c'/:+sSmM09aé中🙂\u200d")), max_size=40
)


@pytest.fixture(scope="module")
def twins(trained, tmp_path_factory):
    out = {}
    for name in ("gpt4", "o200k", "qwen2"):
        tok = trained[name]
        out[name] = (tok, tiktoken_twin(tok, tmp_path_factory.mktemp(name)))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=unicode_text)
def test_property_random_unicode(twins, text):
    for tok, enc in twins.values():
        ids = tok.encode_ordinary(text)
        assert ids == enc.encode_ordinary(text)
        assert tok.decode(ids) == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_property_any_string_roundtrips(twins, text):
    # Arbitrary strings, surrogates included: decoding gives the text back with lone surrogates as U+FFFD.
    tok, _ = twins["gpt4"]
    fixed = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    assert tok.decode(tok.encode_ordinary(text)) == fixed


def test_chunk_cache_flushes_keep_results_exact(trained, heldout_text, monkeypatch):
    # A tiny cache that flushes constantly must not change a single id.
    tok = trained["gpt4"]
    want = tok.encode_ordinary(heldout_text)
    tok.clear_cache()
    monkeypatch.setattr(tok._chunks, "max_items", 16)
    assert tok.encode_ordinary(heldout_text) == want
    assert len(tok._chunks) <= 16 and len(tok._chunks.previous) <= 16
    # Texts that share chunks with what is cached and bring new ones: a flush in the middle of a text
    # drops chunks it found cached, whose ids must still come out.
    lines = heldout_text.splitlines(keepends=True)[:400]
    texts = ["".join(lines[i : i + 7]) for i in range(0, len(lines), 3)]
    want = list(map(tok.as_tiktoken().encode_ordinary, texts))
    tok.clear_cache()
    assert [tok.encode_ordinary(t) for t in texts] == want
    tok.clear_cache()


bmp_text = st.text(st.characters(max_codepoint=0xFFFF), max_size=60) | st.text(
    st.sampled_from(
        list(" \t\n\r\x0b\x0c\x1c\x85\u00a0\u3000'sStTdDlLvVeEmMrR\u017f09\u0663aZ\u00e9_/.:+\u0301")
    ),
    max_size=60,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=bmp_text)
def test_property_bmp_form_splits_like_the_original(twins, text):
    # Text without code points above U+FFFF goes through the stdlib `re` with the BMP form.
    for name in PATTERN_NAMES:
        pattern = resolve_pattern(name)
        assert re.findall(bmp_form(pattern), text) == regex.findall(pinned_pattern(pattern), text), name
    for tok, enc in twins.values():
        assert tok.encode_ordinary(text) == enc.encode_ordinary(text)


def test_bmp_form_only_for_named_patterns():
    assert bmp_form(r"\w+|\s+") is None
    assert bmp_form(r"[a-z]+|.") is None  # custom: always the `regex` module
    assert all(bmp_form(resolve_pattern(n)) is not None for n in PATTERN_NAMES)
    assert Splitter(r"[a-z]+|.").findall("abc. é") == ["abc", ".", " ", "é"]


def test_vectorized_merges_equal_the_loop(trained, heldout_text, tmp_path, monkeypatch):
    # Merger.many (numpy, one merge step per chunk per round) against the one-chunk loop, on every
    # distinct chunk of the held-out text, with tiktoken's rule and with an explicit merge list (HF's
    # rule, with and without the whole-chunk shortcut); with the loop finishing the last chunks and
    # with every merge done in the vectorized rounds, in one batch or many; and with byte ids that are
    # not the bytes.
    tok = trained["o200k"]
    pieces = list(dict.fromkeys(c.encode() for c in regex.findall(tok.pattern, heldout_text)))
    pieces += [b"\x00\x00", b"a" * 300, b"ab" * 100, b" \n" * 7]
    tok.save(tmp_path)
    hf = Tokenizer.load(tmp_path / "tokenizer.json")  # HF's rule: an explicit merge list
    shuffled = list(range(256))
    random.Random(0).shuffle(shuffled)
    permuted = {b: shuffled[i] if i < 256 else i for b, i in tok.vocab.items()}
    mergers = (
        Merger(tok.vocab),
        Merger(hf.vocab, hf.merges, whole_first=True),
        Merger(hf.vocab, hf.merges, whole_first=False),
        Merger(permuted),
    )
    for tail, limit in ((bpe.TAIL_CHUNKS, bpe.POS_LIMIT), (0, bpe.POS_LIMIT), (0, 1000)):
        monkeypatch.setattr(bpe, "TAIL_CHUNKS", tail)
        monkeypatch.setattr(bpe, "POS_LIMIT", limit)  # 1000: batches of under 1000 bytes
        for merger in mergers:
            assert merger.many(pieces) == [merger(p) for p in pieces]
    assert not mergers[3]._tables().bytes_are_ids
    assert Merger(tok.vocab).many([]) == []
    assert Merger(tok.vocab).many([b"", b"a"]) == [[], [tok.vocab[b"a"]]]


# Characters on either side of a line start, for the cuts of mixed ASCII/non-ASCII text.
_BEFORE = ["a", " ", "\t", ")", "\r", "\n", "é", "\u3000", "1", "'", "\x0c", "\x1c", "🙂", "𝔘"]
_AFTER = ["a", " ", "/", "\n", "\r", "1", "'", "é", "\u3000", ")", "\x85", "s", "\x1c", "\t", "🙂", "𝔘"]


@pytest.mark.parametrize("name", PATTERN_NAMES)
def test_cut_mixed_text_splits_like_the_whole(name, heldout_text):
    # A long text with code points above U+FFFF here and there is cut at line starts into stretches
    # that each go to the faster exact engine. Put every pair of characters around a "\n" both just
    # before an astral character (where a stretch starts) and at the start of a long run without them
    # (where one ends).
    split = Splitter(resolve_pattern(name))
    code = heldout_text[:3000].encode("ascii", "replace").decode()
    pieces = []
    for a in _BEFORE:
        for b in _AFTER:
            pieces.append(f"{code}x{a}\n{b}🙂{a}\n{b}{code}")
    text = "".join(pieces)
    assert _has_astral(text) and len(text) > 4 * BMP_RUN
    assert split.findall(text) == regex.findall(resolve_pattern(name), text)
    for piece in pieces[:20]:
        assert split.findall(piece) == regex.findall(resolve_pattern(name), piece)
