import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data.corpus import (
    DOC_MAX_BYTES,
    DOC_MIN_BYTES,
    default_corpus_files,
    iter_documents,
    load_documents,
    split_text,
)
from kiln.errors import KilnError

STDLIB = Path(os.__file__).parent


def test_default_corpus_is_the_stdlib_and_pydoc_data():
    files = default_corpus_files()
    assert any(f.name == "os.py" for f in files)
    assert all("site-packages" not in f.parts for f in files)
    docs = load_documents(None, max_bytes=200_000)
    assert sum(len(d.encode()) for d in docs) >= 200_000
    assert docs == load_documents(None, max_bytes=200_000)  # same order every time


def test_text_file_directory_jsonl_and_parquet(tmp_path):
    (tmp_path / "a.txt").write_text("alpha text")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "b.md").write_text("beta text")
    (sub / "c.jsonl").write_text(
        json.dumps({"text": "gamma"}) + "\n\n" + json.dumps({"text": "delta"}) + "\n"
    )
    pq.write_table(pa.table({"text": ["eps", "zeta"], "id": [1, 2]}), sub / "d.parquet")
    assert list(iter_documents(tmp_path / "a.txt")) == ["alpha text"]
    assert list(iter_documents(sub / "c.jsonl")) == ["gamma", "delta"]
    assert list(iter_documents(sub / "d.parquet")) == ["eps", "zeta"]
    assert list(iter_documents(tmp_path)) == ["alpha text", "beta text", "gamma", "delta", "eps", "zeta"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p / "missing.txt", "does not exist"),
        (lambda p: (p / "empty.txt").write_text("  \n") and p / "empty.txt", "empty"),
        (lambda p: (p / "bad.jsonl").write_text("{not json\n") and p / "bad.jsonl", "not valid JSON"),
        (lambda p: (p / "nt.jsonl").write_text('{"body": "x"}\n') and p / "nt.jsonl", "'text'"),
        (
            lambda p: pq.write_table(pa.table({"body": ["x"]}), p / "x.parquet") or p / "x.parquet",
            "no 'text' column",
        ),
        (lambda p: (p / "emptydir").mkdir() or p / "emptydir", "no text"),
    ],
)
def test_bad_corpus_paths_name_the_problem(tmp_path, make, message):
    path = make(tmp_path)
    with pytest.raises(KilnError, match=message):
        load_documents(path)


def test_split_text_golden_case():
    # paragraphs "aaaa\n\n" (6 B), "bbbbbbbbbb\n\n" (12 B, cut to 8 + 4: 8 = max - min), "cc\n" (3 B), min 6 B
    text = "aaaa\n\nbbbbbbbbbb\n\ncc\n"
    assert split_text(text, min_bytes=6, max_bytes=14) == ["aaaa\n\n", "bbbbbbbb", "bb\n\ncc\n"]
    # pieces of at most max - min = 10 bytes: a cut takes the last line end in the piece's second half
    # (even before a later space), else the last space there, else cuts at 10 bytes
    assert split_text("abcdef\ng h ijkl", min_bytes=1, max_bytes=11) == ["abcdef\n", "g h ijkl"]
    assert split_text("one two three", min_bytes=1, max_bytes=11) == ["one two ", "three"]
    assert split_text("x" * 25, min_bytes=1, max_bytes=11) == ["x" * 10, "x" * 10, "x" * 5]
    assert split_text("é" * 6, min_bytes=1, max_bytes=6) == ["éé", "éé", "éé"]  # whole characters only


def test_split_text_keeps_every_byte_and_the_size_range():
    text = (STDLIB / "argparse.py").read_text(encoding="utf-8")
    for t in (text, text.replace("\n\n", "\n"), "é" * 9000 + "\n\n" + "x" * 30_000, "short", ""):
        docs = split_text(t)
        assert "".join(docs) == t
        sizes = [len(d.encode("utf-8")) for d in docs]
        assert all(DOC_MIN_BYTES <= s < DOC_MAX_BYTES for s in sizes[:-1]), sizes
        assert all(s < DOC_MAX_BYTES for s in sizes)
        if t == text:  # at blank lines only: every document but the last ends a paragraph
            assert all(d.endswith("\n\n") for d in docs[:-1])


def test_a_single_text_file_is_split_a_directory_file_is_not(tmp_path):
    text = (STDLIB / "argparse.py").read_text(encoding="utf-8")[:30_000]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "one.txt").write_text(text, encoding="utf-8")
    docs = load_documents(tmp_path / "d" / "one.txt")
    assert len(docs) >= 4 and "".join(docs) == text
    assert load_documents(tmp_path / "d") == [text]


def test_directory_skips_binary_and_non_utf8_files_with_a_note(tmp_path):
    (tmp_path / "a.txt").write_text("alpha ✓", encoding="utf-8")
    (tmp_path / "b.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blob").write_bytes(b"\x7fELF\x00\x00binary")
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    (tmp_path / "d.md").write_text("delta", encoding="utf-8")
    notes = []
    docs = load_documents(tmp_path, note=notes.append)
    assert docs == ["alpha ✓", "delta"]  # nothing decoded as U+FFFD
    assert len(notes) == 1 and "skipped 3 file(s)" in notes[0] and "binary or not UTF-8" in notes[0]
    with pytest.raises(KilnError, match="is not UTF-8 text"):
        load_documents(tmp_path / "b.txt")
    with pytest.raises(KilnError, match="binary file"):
        load_documents(tmp_path / "blob")
