import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kiln.data.corpus import default_corpus_files, iter_documents, load_documents
from kiln.errors import KilnError


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
