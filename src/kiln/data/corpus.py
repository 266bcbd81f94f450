"""Where text comes from: the bundled default corpus, or the user's files.

A corpus is an iterable of documents (str); the train/validation split is drawn by document. Sources:
- no path: the Python standard-library sources and `pydoc_data` topics of the running interpreter,
  real text that ships with every Python (sorted, so every machine with the same Python reads the
  same corpus in the same order);
- one text file (`.txt`, `.md`, `.py`, any suffix but .jsonl/.parquet): cut into documents by
  `split_text` at blank lines: paragraphs are merged until a document holds at least 2 KB
  (DOC_MIN_BYTES) of UTF-8, and paragraphs longer than 6 KB (DOC_MAX_BYTES - DOC_MIN_BYTES) are cut at
  a line end (else a space), so every document but the last is 2-8 KB; the documents joined give the
  file back exactly;
- a directory: every text file below it (sorted), one document each; `.jsonl`/`.parquet` inside are
  read as below; binary files (a NUL byte in the first 8 KB) and files that are not UTF-8 are skipped,
  with one note on stderr naming how many and one of them (as `kiln tokenizer train` does);
- `.jsonl`: one JSON object per line, its `text` field a document;
- `.parquet`: the `text` column (strings), one document per row (read in row-group batches).
Text named explicitly (one file) must be UTF-8: anything else is an error, never U+FFFD.
"""

from __future__ import annotations

import json
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator
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


DOC_MIN_BYTES = 2_000  # a single text file's documents: at least this much UTF-8 (but the last) ...
DOC_MAX_BYTES = 8_000  # ... and less than this
_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")  # a paragraph break: one or more blank lines


class NotText(Exception):
    """A file that is binary or not UTF-8 (skipped in a directory, an error when named alone)."""


def _read_text(path: Path, errors: str = "strict") -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise KilnError(f"cannot read {path}: {e.strerror}") from None
    if errors == "strict" and b"\0" in raw[:8192]:
        raise NotText(f"{path} is a binary file (it holds NUL bytes), not text")
    try:
        return raw.decode("utf-8", errors=errors)
    except UnicodeDecodeError as e:
        raise NotText(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _cut(text: str, limit: int) -> Iterator[str]:
    """`text` in pieces of at most `limit` UTF-8 bytes (limit >= 4), each ending at a line end, else a
    space, when one lies in the piece's second half (else at a character boundary)."""
    data = text.encode("utf-8")
    start = 0
    while len(data) - start > limit:
        end = start + limit
        while data[end] & 0xC0 == 0x80:  # a UTF-8 continuation byte: back off to the character's start
            end -= 1
        at = data.rfind(b"\n", start, end)
        if at < start + limit // 2:
            at = data.rfind(b" ", start, end)
        if at >= start + limit // 2:
            end = at + 1
        yield data[start:end].decode("utf-8")
        start = end
    if start < len(data):
        yield data[start:].decode("utf-8")


def split_text(text: str, min_bytes: int = DOC_MIN_BYTES, max_bytes: int = DOC_MAX_BYTES) -> list[str]:
    """One text cut into documents at paragraph breaks (see the module docstring); "".join(result) == text.

    Paragraphs (each with its trailing blank lines) longer than max_bytes - min_bytes are cut first, so
    a document still under min_bytes always has room for the next piece: every document is then in
    [min_bytes, max_bytes) bytes except the last, which may be shorter.
    """
    if not 0 < min_bytes < max_bytes:
        raise ValueError(f"need 0 < min_bytes < max_bytes, got {min_bytes}, {max_bytes}")
    bounds = [m.end() for m in _BLANK_LINES.finditer(text)]
    paragraphs = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)]) if b > a]
    docs: list[str] = []
    cur: list[str] = []
    size = 0
    for para in paragraphs:
        for piece in _cut(para, max_bytes - min_bytes):
            if size >= min_bytes:
                docs.append("".join(cur))
                cur, size = [], 0
            cur.append(piece)
            size += len(piece.encode("utf-8"))
    if cur:
        docs.append("".join(cur))
    return docs


def _iter_jsonl(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
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
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for corrupt files
        raise KilnError(f"cannot read parquet file {path}: {e}") from None
    if "text" not in pf.schema_arrow.names:
        raise KilnError(f"{path} has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
    kind = pf.schema_arrow.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise KilnError(
            f"{path}: the 'text' column holds {kind}, not strings: write the documents as a string column"
        )
    for batch in pf.iter_batches(columns=["text"], batch_size=1024):
        for t in batch.column(0).to_pylist():
            if t:
                yield t


def _iter_file(path: Path, alone: bool) -> Iterator[str]:
    """The documents of one file; `alone`: the file is the whole corpus (a text file is then split)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            yield from _iter_jsonl(path)
        elif suffix == ".parquet":
            yield from _iter_parquet(path)
        else:
            text = _read_text(path)
            yield from split_text(text) if alone else [text]
    except UnicodeDecodeError as e:  # from a JSONL file
        raise NotText(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def iter_documents(path: str | Path | None = None, skipped: list[Path] | None = None) -> Iterator[str]:
    """Yield the documents of the corpus at `path` (None: the bundled default corpus).

    In a directory, files that are binary or not UTF-8 are skipped and appended to `skipped`; a single
    file that is neither is a KilnError.
    """
    if path is None:
        for p in default_corpus_files():
            yield _read_text(p, errors="replace")  # a few stdlib test files are deliberately not UTF-8
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
            if f.suffix.lower() == ".parquet":  # streamed by row group; its strings are always UTF-8
                yield from _iter_file(f, alone=False)
                continue
            try:  # decode the whole file first, so a skipped file contributes nothing
                docs = list(_iter_file(f, alone=False))
            except NotText:
                if skipped is None:
                    raise KilnError(f"{f} is binary or not UTF-8 text") from None
                skipped.append(f)
                continue
            yield from docs
    else:
        try:
            yield from _iter_file(p, alone=True)
        except NotText as e:
            raise KilnError(
                f"{e}: --data takes UTF-8 text (convert it with iconv, or pass a directory)"
            ) from None


def _note_stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_documents(
    path: str | Path | None = None, max_bytes: int | None = None, note: Callable[[str], None] = _note_stderr
) -> list[str]:
    """Read a corpus into memory, stopping once `max_bytes` of UTF-8 text are collected.

    Files skipped in a directory (binary, not UTF-8) are reported through `note` (default: one line on
    stderr). Raises KilnError if nothing but empty documents is found.
    """
    docs: list[str] = []
    skipped: list[Path] = []
    total = 0
    for doc in iter_documents(path, skipped):
        if not doc.strip():
            continue
        docs.append(doc)
        total += len(doc.encode("utf-8"))
        if max_bytes is not None and total >= max_bytes:
            break
    if skipped:
        note(
            f"kiln: note: skipped {len(skipped)} file(s) in {path} that are binary or not UTF-8 text (e.g. {skipped[0]})"
        )
    if not docs:
        where = "the default corpus" if path is None else str(path)
        why = f"its {len(skipped)} file(s) are binary or not UTF-8 text" if skipped else "the corpus is empty"
        raise KilnError(f"no text found in {where}: {why}")
    return docs
