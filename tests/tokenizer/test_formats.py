"""File formats: kiln <-> tiktoken, HF tokenizer.json (+ transformers), GPT-2 vocab.json/merges.txt."""

from __future__ import annotations

import base64
import json
import unicodedata

import pytest
import tiktoken.load
from tokenizers import Regex as HFRegex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from kiln.errors import KilnError
from kiln.tokenizer import Tokenizer, formats
from kiln.tokenizer.chat import CHATML, render_chat
from kiln.tokenizer.patterns import onig_compatible, resolve_pattern

from ._corpora import HARD


@pytest.fixture(scope="module")
def sample(heldout_text) -> list[str]:
    return [heldout_text[:40_000], HARD, *HARD.splitlines(), "", "x"]


def hf_bpe_trained(train_text: str, pre: str) -> HFTokenizer:
    """A vocabulary trained by HF's own BpeTrainer (byte-level, with a special token)."""
    hf = HFTokenizer(models.BPE())
    if pre == "bytelevel":
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:  # a Split with the GPT-4 (or Qwen2, after NFC as Qwen2 does) regex, then bytes -> characters
        pattern = resolve_pattern("qwen2" if pre == "split_nfc" else "gpt4")
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(HFRegex(onig_compatible(pattern)), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre == "split_nfc":
        hf.normalizer = normalizers.NFC()
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator([train_text], trainer=trainer)
    return hf


@pytest.mark.parametrize("pre", ["bytelevel", "split", "split_nfc"])
def test_hf_bpetrainer_vocab_loads_and_encodes_identically(pre, train_text, sample, tmp_path):
    hf = hf_bpe_trained(train_text, pre)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.load(tmp_path / "tokenizer.json")
    assert tok.special_tokens == {"<|endoftext|>": 0}
    assert tok.n_vocab == hf.get_vocab_size()
    for text in sample:
        ids = tok.encode_ordinary(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text[:80]
        assert tok.decode(ids) == (unicodedata.normalize("NFC", text) if pre == "split_nfc" else text)
    text = "one<|endoftext|>two"
    assert tok.encode(text, allowed_special="all") == hf.encode(text, add_special_tokens=False).ids
    # kiln's own directory keeps the merge list, so it round-trips exactly too.
    tok.save(tmp_path / "kiln")
    again = Tokenizer.load(tmp_path / "kiln")
    assert again.merges == tok.merges and again.encode_ordinary(sample[0]) == tok.encode_ordinary(sample[0])
    # ... and HF reads kiln's re-export of it.
    hf_again = HFTokenizer.from_file(str(tmp_path / "kiln" / "tokenizer.json"))
    assert hf_again.encode(sample[0], add_special_tokens=False).ids == tok.encode_ordinary(sample[0])


def test_kiln_directory_round_trip(trained, sample, tmp_path):
    tok = trained["o200k"]
    tok.save(tmp_path)
    meta = json.loads((tmp_path / "kiln_tokenizer.json").read_text())
    assert meta["pattern_name"] == "o200k" and meta["semantics"] == "tiktoken"
    again = Tokenizer.load(tmp_path)
    assert again.vocab == tok.vocab and again.special_tokens == tok.special_tokens
    assert again.pattern == tok.pattern and again.merges is None
    for text in sample:
        assert again.encode_ordinary(text) == tok.encode_ordinary(text)


def test_tiktoken_file_round_trip(trained, sample, tmp_path):
    tok = trained["qwen2"]
    formats.save_tiktoken(tok.vocab, tmp_path / "t.tiktoken")
    assert tiktoken.load.load_tiktoken_bpe(str(tmp_path / "t.tiktoken")) == tok.vocab
    # A file written the way tiktoken's dump_tiktoken_bpe writes (it needs blobfile, so inline), in
    # shuffled order, loads into kiln.
    lines = [base64.b64encode(t) + b" " + str(r).encode() + b"\n" for t, r in tok.vocab.items()]
    (tmp_path / "by_tiktoken.tiktoken").write_bytes(b"".join(reversed(lines)))
    again = Tokenizer.from_tiktoken(tmp_path / "by_tiktoken.tiktoken", "qwen2", tok.special_tokens)
    for text in sample:
        assert again.encode_ordinary(text) == tok.encode_ordinary(text)


def test_tiktoken_file_with_an_empty_token(trained, sample, tmp_path):
    # whisper's multilingual.tiktoken has the line "= 50256": base64 of the empty string, padded.
    # tiktoken loads it as the token b""; kiln must too, and must read back its own save of it.
    tok = trained["gpt4"]
    n = len(tok.vocab)
    lines = [
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(tok.vocab.items(), key=lambda kv: kv[1])
    ]
    (tmp_path / "empty.tiktoken").write_text("".join(lines) + f"= {n}\n")
    ranks = tiktoken.load.load_tiktoken_bpe(str(tmp_path / "empty.tiktoken"))
    assert ranks[b""] == n
    assert formats.load_tiktoken(tmp_path / "empty.tiktoken") == ranks
    specials = {"<|endoftext|>": n + 1}
    kiln_tok = Tokenizer.from_tiktoken(tmp_path / "empty.tiktoken", "gpt4", specials)
    ref = tiktoken.Encoding(
        name="e", pat_str=resolve_pattern("gpt4"), mergeable_ranks=ranks, special_tokens=specials
    )
    for text in sample:
        ids = kiln_tok.encode_ordinary(text)
        assert ids == ref.encode_ordinary(text)
        assert kiln_tok.decode(ids) == text
    assert kiln_tok.decode([n, 104, n]) == ref.decode([n, 104, n]) == "h"
    kiln_tok.save(tmp_path / "k", hf=False)
    assert "= " + str(n) in (tmp_path / "k" / "tokenizer.tiktoken").read_text().splitlines()[-1]
    again = Tokenizer.load(tmp_path / "k")
    assert again.vocab == ranks and again.special_tokens == specials
    assert again.encode_ordinary(sample[0]) == ref.encode_ordinary(sample[0])
    formats.save_tiktoken(again.vocab, tmp_path / "again.tiktoken")
    assert tiktoken.load.load_tiktoken_bpe(str(tmp_path / "again.tiktoken")) == ranks


def test_gpt2_files_match_hf(trained, sample, tmp_path):
    tok = trained["gpt2"]
    formats.save_gpt2(tok, tmp_path)
    assert (tmp_path / "merges.txt").read_text().startswith("#version: 0.2\n")
    loaded = Tokenizer.from_spec(formats.read_gpt2(tmp_path))
    assert loaded.special_tokens == {s: i for s, i in tok.special_tokens.items() if s == "<|endoftext|>"}
    # HF's classic GPT-2 setup: BPE from the two files, ByteLevel pre-tokenizer with its own regex.
    hf = HFTokenizer(models.BPE.from_file(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for text in sample:
        ids = loaded.encode_ordinary(text)
        assert ids == hf.encode(text, add_special_tokens=False).ids, text[:80]
        assert loaded.decode(ids) == text
    # Same vocabulary, same pattern, GPT-2 merge semantics: the ids match kiln's tiktoken semantics here
    # on ordinary text (the merge list holds every split of every token).
    same_pattern = Tokenizer.from_spec(formats.read_gpt2(tmp_path, pattern=tok.pattern))
    assert same_pattern.encode_ordinary(sample[0]) == tok.encode_ordinary(sample[0])


def test_transformers_loads_kiln_directory_and_chat_template(trained, sample, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = trained["gpt4"]
    tok.save(tmp_path, chat_template=CHATML, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert auto.eos_token == "<|im_end|>" and auto.pad_token_id == tok.special_tokens["<|endoftext|>"]
    for text in sample:
        assert auto.encode(text, add_special_tokens=False) == tok.encode_ordinary(text)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say 'hi' in 中文 🙂"},
        {"role": "assistant", "content": "你好"},
        {"role": "user", "content": "again"},
    ]
    for gen in (False, True):
        want = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        got = render_chat(messages, formats.load_chat_template(tmp_path), add_generation_prompt=gen)
        assert got == want
        assert tok.encode(got, allowed_special="all") == auto.encode(want, add_special_tokens=False)


def test_chat_template_features_like_transformers(trained, tmp_path):
    # A template using what HF templates use: loop controls, tojson, raise_exception, special tokens,
    # whitespace control with trim_blocks/lstrip_blocks.
    transformers = pytest.importorskip("transformers")
    template = """{{ bos_token }}{% for m in messages %}
    {% if m['role'] not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role') }}{% endif %}
    {% if loop.index0 > 5 %}{% break %}{% endif %}
<{{ m['role'] }}>{{ m['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""
    tok = trained["gpt4"]
    tok.save(tmp_path, chat_template=template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": 'quote " and <tag> & é'}, {"role": "assistant", "content": "ok"}]
    want = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    got = render_chat(
        messages, template, add_generation_prompt=True, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    assert got == want
    with pytest.raises(KilnError, match="bad role"):
        render_chat([{"role": "tool", "content": "x"}], template)


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not valid JSON"),
        ('{"model": {"type": "WordPiece", "vocab": {}}}', "not BPE"),
        (
            '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": null}',
            "pre-tokenizer",
        ),
        ("[1, 2]", "JSON object"),
        ('{"model": {"type": "BPE"}, "pre_tokenizer": {"type": "ByteLevel"}}', "not a valid HF"),
    ],
)
def test_malformed_hf_files(content, message, tmp_path):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(KilnError, match=message):
        Tokenizer.load(tmp_path)


def test_malformed_and_missing_files(trained, tmp_path):
    with pytest.raises(KilnError, match="does not exist"):
        Tokenizer.load(tmp_path / "nope")
    with pytest.raises(KilnError, match="holds no tokenizer"):
        Tokenizer.load(tmp_path)
    (tmp_path / "bad.tiktoken").write_text("!!!notbase64 1\n")
    with pytest.raises(KilnError, match="malformed tiktoken line"):
        formats.load_tiktoken(tmp_path / "bad.tiktoken")
    (tmp_path / "short.tiktoken").write_text("YQ== 0\n")
    with pytest.raises(KilnError, match="not a byte-level vocabulary"):
        Tokenizer.from_tiktoken(tmp_path / "short.tiktoken", "gpt4")
    trained["gpt4"].save(tmp_path / "k", hf=False)
    (tmp_path / "k" / "kiln_tokenizer.json").write_text('{"format": "kiln-tokenizer", "pattern": "gpt4"}')
    with pytest.raises(KilnError, match="not a valid kiln tokenizer"):
        Tokenizer.load(tmp_path / "k")
