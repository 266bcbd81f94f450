"""Token shards on disk: the corpus tokenized once, split into train/validation by document.

Layout of a prepared data directory:
    meta.json                      vocab size, dtype, tokens/docs/bytes per split, the eot id
    train_000.bin, train_001.bin   shards of one split
    val_000.bin
A shard is a 1024-byte header (int32: magic, version, itemsize, n_tokens, rest zero) followed by the
tokens as little-endian uint16 (vocab <= 65536) or uint32. Every document is written as
[eot] + tokens(document), so documents are delimited and a model can start generating after eot.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from kiln.errors import KilnError

MAGIC = 20261129
VERSION = 1
HEADER_BYTES = 1024


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def write_shard(path: Path, tokens: np.ndarray) -> None:
    """Write one shard atomically (temporary file, fsync, rename)."""
    header = np.zeros(HEADER_BYTES // 4, dtype=np.int32)
    header[:4] = (MAGIC, VERSION, tokens.dtype.itemsize, len(tokens))
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: str | Path) -> np.ndarray:
    """Memory-map a shard's tokens; a bad header is a KilnError naming the file."""
    path = Path(path)
    try:
        header = np.fromfile(path, dtype=np.int32, count=HEADER_BYTES // 4)
    except OSError as e:
        raise KilnError(f"cannot read shard {path}: {e.strerror}") from None
    if len(header) < 4 or header[0] != MAGIC or header[1] != VERSION:
        raise KilnError(f"{path} is not a kiln token shard (bad header): prepare the data again")
    itemsize, n = int(header[2]), int(header[3])
    dtype = {2: np.uint16, 4: np.uint32}.get(itemsize)
    expected = HEADER_BYTES + n * itemsize
    if dtype is None or path.stat().st_size != expected:
        raise KilnError(
            f"shard {path} is truncated or corrupt ({path.stat().st_size} bytes, expected {expected})"
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n,))


def split_documents(n_docs: int, val_fraction: float, seed: int) -> list[bool]:
    """Which documents go to validation: a seeded coin per document, at least one on each side."""
    if n_docs < 2:
        raise KilnError(
            f"too little data: the corpus holds {n_docs} document(s), and a train/validation split needs at "
            "least 2 (a single text file is cut into documents of about 2-8 KB, so it needs more than 2 KB)"
        )
    rng = random.Random(seed)
    is_val = [rng.random() < val_fraction for _ in range(n_docs)]
    if not any(is_val):
        is_val[-1] = True
    if all(is_val):
        is_val[0] = False
    return is_val


def prepare_shards(
    docs: Sequence[str],
    tokenizer,
    out_dir: str | Path,
    val_fraction: float = 0.05,
    seed: int = 0,
    shard_tokens: int = 100_000_000,
    batch_docs: int = 256,
    progress: bool = True,
    is_val: Sequence[bool] | None = None,
    corpus: dict | None = None,
) -> dict:
    """Tokenize `docs` into train/val shards under `out_dir`; returns (and writes) meta.json's dict.

    is_val: the split, one flag per document (default: `split_documents(len(docs), val_fraction, seed)`);
    corpus: a description of the corpus (e.g. its fingerprint) kept in meta.json under "corpus".
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if is_val is None:
        is_val = split_documents(len(docs), val_fraction, seed)
    elif len(is_val) != len(docs) or all(is_val) or not any(is_val):
        raise KilnError(
            f"the split holds {sum(is_val)} validation documents of {len(docs)} ({len(is_val)} flags): each "
            "side needs at least one document; use more data or change data.val_fraction"
        )
    dtype = token_dtype(tokenizer.n_vocab)
    eot = tokenizer.eot_id
    meta: dict = {"vocab_size": tokenizer.n_vocab, "dtype": dtype.name, "eot_id": eot, "splits": {}}
    if corpus is not None:
        meta["corpus"] = corpus
    for split in ("train", "val"):
        idx = [i for i, v in enumerate(is_val) if v == (split == "val")]
        n_bytes = sum(len(docs[i].encode("utf-8")) for i in idx)
        buf: list[np.ndarray] = []
        buffered = 0
        shards: list[str] = []
        n_tokens = 0
        bar = tqdm(total=n_bytes, unit="B", unit_scale=True, desc=f"tokenize {split}", disable=not progress)
        for start in range(0, len(idx), batch_docs):
            chunk = [docs[i] for i in idx[start : start + batch_docs]]
            for ids in tokenizer.encode_ordinary_batch(chunk):
                arr = np.empty(len(ids) + 1, dtype=dtype)
                arr[0] = eot
                arr[1:] = ids
                buf.append(arr)
                buffered += len(arr)
            bar.update(sum(len(d.encode("utf-8")) for d in chunk))
            while buffered >= shard_tokens:
                flat = np.concatenate(buf)
                name = f"{split}_{len(shards):03d}.bin"
                write_shard(out / name, flat[:shard_tokens])
                shards.append(name)
                n_tokens += shard_tokens
                buf, buffered = [flat[shard_tokens:]], len(flat) - shard_tokens
        if buffered:
            name = f"{split}_{len(shards):03d}.bin"
            write_shard(out / name, np.concatenate(buf))
            shards.append(name)
            n_tokens += buffered
        bar.close()
        meta["splits"][split] = {"shards": shards, "tokens": n_tokens, "docs": len(idx), "bytes": n_bytes}
    tmp = out / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2))
    os.replace(tmp, out / "meta.json")
    return meta


def load_meta(data_dir: str | Path) -> dict:
    path = Path(data_dir) / "meta.json"
    if not path.exists():
        raise KilnError(f"{data_dir} holds no prepared data (no meta.json)")
    return json.loads(path.read_text())
