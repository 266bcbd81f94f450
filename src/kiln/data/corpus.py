"""Where text comes from: the bundled default corpus, or the user's files.

A corpus is an iterable of documents (str). Sources:
- no path: the Python standard-library sources and `pydoc_data` topics of the running interpreter,
  real text that ships with every Python (sorted, so every machine with the same Python reads the
  same corpus in the same order);
- a `.txt`/`.md`/`.py`/... text file: one document;
- a directory: every text file below it (sorted), one document each; `.jsonl`/`.parquet` inside are
  read as below;
- `.jsonl`: one JSON object per line, its `text` field a document;
- `.parquet`: the `text` column, one document per row (read in row-group batches).
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from kiln.errors import KilnError

TEXT_SUFFIXES = {
    ".txt",
    ".md",
    ".rst",
    ".py",
    ".c",
    ".h",
    ".json",
    ".html",
    ".xml",
    ".csv",
    ".tex",
    ".yaml",
    ".yml",
}


def default_corpus_files() -> list[Path]:
    """The stdlib's .py sources (no site-packages), sorted by path."""
    std = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in std.rglob("*.py") if "site-packages" not in p.parts and p.is_file())


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise KilnError(f"cannot read {path}: {e.strerror}") from None


def _iter_jsonl(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise KilnError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); each line must be an object"
                ) from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise KilnError(f"{path}:{lineno}: each JSONL line needs a string field 'text'")
            yield obj["text"]


def _iter_parquet(path: Path) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise KilnError(f"cannot read parquet file {path}: {e}") from None
    if "text" not in pf.schema_arrow.names:
        raise KilnError(f"{path} has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
    for batch in pf.iter_batches(columns=["text"], batch_size=1024):
        for t in batch.column(0).to_pylist():
            if t:
                yield t


def _iter_file(path: Path) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _iter_jsonl(path)
    elif suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        yield _read_text(path)


def iter_documents(path: str | Path | None = None) -> Iterator[str]:
    """Yield the documents of the corpus at `path` (None: the bundled default corpus)."""
    if path is None:
        for p in default_corpus_files():
            yield _read_text(p)
        from pydoc_data.topics import topics

        for key in sorted(topics):
            yield topics[key]
        return
    p = Path(path)
    if not p.exists():
        raise KilnError(
            f"data path {p} does not exist: pass --data PATH to a text/JSONL/parquet file or a directory"
        )
    if p.is_dir():
        files = sorted(
            f
            for f in p.rglob("*")
            if f.is_file() and (f.suffix.lower() in TEXT_SUFFIXES | {".jsonl", ".parquet"} or not f.suffix)
        )
        if not files:
            raise KilnError(f"data directory {p} holds no text, JSONL or parquet files")
        for f in files:
            yield from _iter_file(f)
    else:
        yield from _iter_file(p)


def load_documents(path: str | Path | None = None, max_bytes: int | None = None) -> list[str]:
    """Read a corpus into memory, stopping once `max_bytes` of UTF-8 text are collected.

    Raises KilnError if nothing but empty documents is found.
    """
    docs: list[str] = []
    total = 0
    for doc in iter_documents(path):
        if not doc.strip():
            continue
        docs.append(doc)
        total += len(doc.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            break
    if not docs:
        where = "the default corpus" if path is None else str(path)
        raise KilnError(f"no text found in {where}: the corpus is empty")
    return docs
