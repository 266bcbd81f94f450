import numpy as np
import pytest

from kiln.data.corpus import load_documents
from kiln.data.loader import TokenLoader
from kiln.data.shards import load_meta, prepare_shards, read_shard, split_documents
from kiln.errors import KilnError
from kiln.tokenizer import train_bpe


@pytest.fixture(scope="module")
def corpus():
    return load_documents(None, max_bytes=150_000)


@pytest.fixture(scope="module")
def tok(corpus):
    return train_bpe(corpus[:20], vocab_size=300, progress=False)


@pytest.fixture(scope="module")
def prepared(corpus, tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    meta = prepare_shards(corpus, tok, out, val_fraction=0.2, seed=3, shard_tokens=20_000, progress=False)
    return out, meta


def test_shards_hold_every_document_once_delimited_by_eot(corpus, tok, prepared):
    out, meta = prepared
    assert meta == load_meta(out)
    is_val = split_documents(len(corpus), 0.2, 3)
    for split in ("train", "val"):
        info = meta["splits"][split]
        tokens = np.concatenate([read_shard(out / s) for s in info["shards"]])
        assert len(tokens) == info["tokens"]
        assert tokens.dtype == np.uint16
        docs = [d for d, v in zip(corpus, is_val) if v == (split == "val")]
        assert info["docs"] == len(docs) and info["bytes"] == sum(len(d.encode()) for d in docs)
        eot = np.flatnonzero(tokens == tok.eot_id)
        assert len(eot) == len(docs) and eot[0] == 0
        pieces = np.split(tokens, eot[1:])
        assert [tok.decode(p[1:].tolist()) for p in pieces] == docs
    assert len(meta["splits"]["train"]["shards"]) > 1  # shard_tokens forced several shards


def test_loader_batches_are_windows_of_the_shards(prepared):
    out, meta = prepared
    paths = [out / s for s in meta["splits"]["train"]["shards"]]
    loader = TokenLoader(paths, batch_size=4, seq_len=32, seed=1)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 32)
    assert (x[:, 1:] == y[:, :-1]).all()
    flat = np.concatenate([read_shard(p) for p in paths]).tolist()
    s = "," + ",".join(map(str, flat)) + ","
    for row in x.tolist():
        assert "," + ",".join(map(str, row)) + "," in s


def test_loader_resumes_exactly_and_ranks_are_disjoint(prepared):
    out, meta = prepared
    paths = [out / s for s in meta["splits"]["train"]["shards"]]
    a = TokenLoader(paths, 4, 32, seed=7)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch()[0] for _ in range(a.batches_per_epoch)]  # crosses an epoch boundary
    assert a.epoch >= 1
    b = TokenLoader(paths, 4, 32, seed=7)
    b.load_state_dict(state)
    assert all((b.next_batch()[0] == e).all() for e in expected)
    # two ranks of world 2 split each global batch of the single-process order with batch 8
    single = TokenLoader(paths, 8, 32, seed=7, world_size=1)
    r0 = TokenLoader(paths, 4, 32, seed=7, rank=0, world_size=2)
    r1 = TokenLoader(paths, 4, 32, seed=7, rank=1, world_size=2)
    for _ in range(3):
        full = single.next_batch()[0]
        assert (full[:4] == r0.next_batch()[0]).all() and (full[4:] == r1.next_batch()[0]).all()


def test_too_little_data_and_bad_shards_are_clear_errors(prepared, tmp_path):
    out, meta = prepared
    paths = [out / s for s in meta["splits"]["val"]["shards"]]
    with pytest.raises(KilnError, match="too few"):
        TokenLoader(paths, batch_size=10_000, seq_len=512)
    bad = tmp_path / "bad.bin"
    bad.write_bytes((out / meta["splits"]["train"]["shards"][0]).read_bytes()[:-7])
    with pytest.raises(KilnError, match="truncated or corrupt"):
        read_shard(bad)
    bad.write_bytes(b"\0" * 2048)
    with pytest.raises(KilnError, match="not a kiln token shard"):
        read_shard(bad)
    with pytest.raises(KilnError, match="at least 2"):
        split_documents(1, 0.1, 0)
