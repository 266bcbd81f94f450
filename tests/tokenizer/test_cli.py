"""`kiln tokenizer ...`: a train/encode/decode/convert round trip and clean errors."""

from __future__ import annotations

import json

import pytest

from kiln.cli import main
from kiln.tokenizer import Tokenizer

from ._corpora import HARD, stdlib_text


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    text = stdlib_text(120_000)
    for i in range(4):
        (d / f"part{i}.py").write_text(text[i * 30_000 : (i + 1) * 30_000])
    (d / "hard.txt").write_text(HARD)
    (d / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    return d


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    argv = ["tokenizer", "train", str(corpus), "--out", str(out), "--vocab-size", "700", "--processes", "1"]
    assert main(argv + ["--special", "<|endoftext|>", "--special", "<|im_end|>"]) == 0
    return out


def test_train_encode_decode(tok_dir, corpus, capsys):
    capsys.readouterr()
    tok = Tokenizer.load(tok_dir)
    assert tok.n_vocab == 700 and set(tok.special_tokens) == {"<|endoftext|>", "<|im_end|>"}
    text = "def f(x):\n    return 'héllo' + 中文 <|endoftext|>"
    assert main(["tokenizer", "encode", "-t", str(tok_dir), text, "--allowed-special", "all", "--json"]) == 0
    ids = json.loads(capsys.readouterr().out)
    assert ids == tok.encode(text, allowed_special="all")
    assert main(["tokenizer", "decode", "-t", str(tok_dir), *map(str, ids)]) == 0
    assert capsys.readouterr().out == text + "\n"
    files = sorted(corpus.glob("*.py"))[:2]
    assert main(["tokenizer", "encode", "-t", str(tok_dir), "--file", *map(str, files)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [list(map(int, line.split())) for line in lines] == [tok.encode(f.read_text()) for f in files]


def test_convert_round_trips(tok_dir, tmp_path, capsys):
    tok = Tokenizer.load(tok_dir)
    sample = stdlib_text(20_000, skip=200) + HARD
    assert (
        main(
            ["tokenizer", "convert", str(tok_dir), "--to", "tiktoken", "--out", str(tmp_path / "r.tiktoken")]
        )
        == 0
    )
    specials = [f"--special={s}={i}" for s, i in tok.special_tokens.items()]
    argv = ["tokenizer", "convert", str(tmp_path / "r.tiktoken"), "--to", "hf", "--out", str(tmp_path / "hf")]
    assert main(argv + ["--pattern", "gpt4", *specials]) == 0
    assert (
        main(["tokenizer", "convert", str(tmp_path / "hf"), "--to", "gpt2", "--out", str(tmp_path / "g")])
        == 0
    )
    hf = Tokenizer.load(tmp_path / "hf")
    assert hf.special_tokens == tok.special_tokens
    assert hf.encode_ordinary(sample) == tok.encode_ordinary(sample)
    assert Tokenizer.load(tmp_path / "g").decode(tok.encode_ordinary(sample)) == sample


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "{missing}", "--out", "{tmp}/o"], "does not exist"),
        (["train", "{empty}", "--out", "{tmp}/o"], "empty"),
        (["train", "{corpus}", "--out", "{tmp}/o", "--vocab-size", "100"], "too small"),
        (["train", "{corpus}", "--out", "{tmp}/o", "--pattern", "gpt5"], "unknown split pattern"),
        (["train", "{corpus}/blob.bin", "--out", "{tmp}/o"], "not UTF-8"),
        (["encode", "-t", "{bad}", "x"], "not valid JSON"),
        (["encode", "-t", "{tok}", "a <|endoftext|>"], "--allowed-special"),
        (["decode", "-t", "{tok}", "1", "x"], "must be integers"),
        (["decode", "-t", "{tok}", "99999"], "not in the vocabulary"),
        (["convert", "{tmp}/r.tiktoken", "--to", "hf", "--out", "{tmp}/h"], "--pattern"),
    ],
)
def test_errors_are_clean(argv, message, corpus, tok_dir, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{oops")
    (tmp_path / "r.tiktoken").write_text("YQ== 0\n")
    paths = {
        "missing": tmp_path / "missing",
        "empty": tmp_path / "empty.txt",
        "corpus": corpus,
        "tmp": tmp_path,
        "bad": tmp_path / "bad",
        "tok": tok_dir,
    }
    argv = [a.format(**paths) for a in argv]
    capsys.readouterr()
    assert main(["tokenizer", *argv]) == 2
    err = capsys.readouterr().err
    assert "kiln: error: " in err and message in err and "Traceback" not in err
