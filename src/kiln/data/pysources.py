"""The Python-sources corpus: the standard library, `pydoc_data` and named installed packages, split by file.

It exists on any machine with Python and those packages, with no download, which is what a speed run
on a machine without network needs (`kiln run --preset speedrun`). Documents are whole files, named
    stdlib/<path under the stdlib dir>          every .py of the standard library (no site-packages)
    pydoc_data/topics/<key>                     the interpreter's help topics
    <package>/<path under the package dir>      every .py of each package in `packages`, in that order
and taken in the order of a hash of their names, so the shards mix sources and a truncated corpus
(`max_bytes`) is a sample of all of them. A file is held out for validation when a second hash of its
name falls below `val_fraction`: the held-out set is fixed by the names alone, whatever else the corpus
holds. A package that is not installed is an error (a corpus that silently lost a package would not be
comparable); `fingerprint` (files, bytes, SHA-256 of the name list and of the text) makes runs
comparable: the same fingerprint means the same text.

`min_zlib_bpb` leaves out files that zlib compresses below that many bits per byte: tables, serialized
patterns and other generated text a model learns to copy, not to write. Hand-written Python sits near 1.8
bits per byte (the byte-weighted median of the speed-run corpus); 2% of that corpus's bytes are below 0.8,
among them one 529 KB generated table at 0.33 that was 12% of the held-out bytes, so a validation bits-per-
byte target fell steeply once a model could copy it (docs/perf/training.md). The filter is a function of a
file's own bytes, so the held-out set stays fixed by the names alone among the files kept.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import sysconfig
import zlib
from collections.abc import Sequence
from pathlib import Path

from kiln.errors import KilnError


def _hash01(salt: str, name: str) -> float:
    """A fixed pseudo-random number in [0, 1) from a name (the first 8 bytes of its SHA-256)."""
    digest = hashlib.sha256(f"{salt}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def held_out(name: str, val_fraction: float) -> bool:
    """Whether the document `name` belongs to the validation split."""
    return _hash01("val", name) < val_fraction


def package_dir(package: str) -> Path:
    """The installed package's source directory, found without importing it; KilnError when absent."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise KilnError(
            f"data.packages names {package!r}, which is not an installed package in {sys.executable}: install "
            "it, or leave it out of data.packages (the corpus then differs from runs that had it)"
        )
    return Path(locations[0])


def source_files(packages: Sequence[str]) -> list[tuple[str, Path]]:
    """(document name, path) of every source file, stdlib first, then each package's, sorted by path."""
    std = Path(sysconfig.get_paths()["stdlib"])
    files = [
        (f"stdlib/{p.relative_to(std).as_posix()}", p)
        for p in sorted(std.rglob("*.py"))
        if "site-packages" not in p.parts and p.is_file()
    ]
    seen = set()
    for pkg in packages:
        if pkg in seen:
            raise KilnError(f"data.packages names {pkg!r} twice")
        seen.add(pkg)
        root = package_dir(pkg)
        files += [
            (f"{pkg}/{p.relative_to(root).as_posix()}", p)
            for p in sorted(root.rglob("*.py"))
            if p.is_file() and "__pycache__" not in p.parts
        ]
    return files


def zlib_bits_per_byte(data: bytes) -> float:
    """Bits per byte of `data` compressed by zlib at level 6: how repetitive a file is."""
    return 8.0 * len(zlib.compress(data, 6)) / max(1, len(data))


def load_python_corpus(
    packages: Sequence[str], max_bytes: int | None = None, min_zlib_bpb: float = 0.0
) -> tuple[list[str], list[str], dict]:
    """(names, documents, fingerprint) in hash-of-name order, empty files left out (and, with
    `min_zlib_bpb` > 0, files zlib compresses below it), stopping once `max_bytes` of UTF-8 are collected.
    Files that are not UTF-8 (a few stdlib tests, on purpose) are read with U+FFFD replacements, as the
    bundled corpus reads them."""
    from pydoc_data.topics import topics

    entries: list[tuple[str, Path | str]] = list(source_files(packages))
    entries += [(f"pydoc_data/topics/{k}", topics[k]) for k in sorted(topics)]
    entries.sort(key=lambda e: _hash01("order", e[0]))
    names, docs = [], []
    list_hash, text_hash = hashlib.sha256(), hashlib.sha256()
    total = dropped_files = dropped_bytes = 0
    for name, src in entries:
        text = src if isinstance(src, str) else src.read_bytes().decode("utf-8", errors="replace")
        if not text.strip():
            continue
        data = text.encode("utf-8")
        if min_zlib_bpb > 0 and zlib_bits_per_byte(data) < min_zlib_bpb:
            dropped_files += 1
            dropped_bytes += len(data)
            continue
        names.append(name)
        docs.append(text)
        list_hash.update(f"{name}\t{len(data)}\n".encode())
        text_hash.update(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    fingerprint = {
        "packages": list(packages),
        "python": sys.version.split()[0],
        "files": len(docs),
        "bytes": total,
        "list_sha256": list_hash.hexdigest(),
        "text_sha256": text_hash.hexdigest(),
    }
    if min_zlib_bpb > 0:  # absent when off, so fingerprints of unfiltered corpora read as before
        fingerprint |= {
            "min_zlib_bpb": min_zlib_bpb,
            "dropped_files": dropped_files,
            "dropped_bytes": dropped_bytes,
        }
    return names, docs, fingerprint
