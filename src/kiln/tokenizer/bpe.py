"""Encoding one pre-tokenized chunk: the byte-pair merge loop, in the two flavours files come in.

- By rank (tiktoken): two adjacent parts may merge when their concatenation is a token; the
  lowest-ranked such concatenation merges first, the leftmost on a tie. A chunk that is itself a token
  is emitted whole without merging. This is tiktoken's `byte_pair_merge`, step for step.
- By merge list (HF `tokenizers`, GPT-2's merges.txt): only listed pairs merge, the one listed
  earliest first, the leftmost on a tie. HF's `ignore_merges` flag adds the whole-chunk shortcut.

Both are one loop over token ids, `Merger.__call__`, with a different table of mergeable pairs, and
the same loop vectorized over many chunks with numpy, `Merger.many`. Callers cache results per chunk,
so merging only runs on chunks seen for the first time; on multilingual text (a new word every few
chunks) it is still a large part of the encoding time, hence ints:
a pair is one int key (left * n + right), and the table's value packs the pair's priority above
the id of the token it makes, so min() over a list of ints finds the pair to merge (in C) and the
new token's id comes with it. (Byte strings as parts, with a concatenation and a lookup per pair,
took 1.4x as long.)
"""

from __future__ import annotations

import numpy as np

NO_MERGE = 1 << 62  # the value of a pair that cannot merge: above every real priority
ID_BITS = 24  # token ids below 16.7M
ID_MASK = (1 << ID_BITS) - 1
# Merger.many's pair keys: priority << POS_BITS | position, below NO_MERGE.
POS_BITS = 32
POS_LIMIT = 1 << 31  # bytes merged in one vectorized batch
POS_MASK = (1 << POS_BITS) - 1
DELETED = (1 << 63) - 1  # Merger.many's key of a merged-away part: above NO_MERGE | position
TAIL_CHUNKS = 32  # chunks still merging below which the vectorized rounds hand over to the loop


class Merger:
    """The merge loop for one vocabulary.

    vocab: token bytes -> id, every single byte included.
    merges: None for tiktoken's rule (every pair whose concatenation is a token, by that token's
        rank = id); else (left bytes, right bytes) -> priority, HF's rule.
    whole_first: emit a chunk that is a token as that token (tiktoken; HF's ignore_merges).
    """

    def __init__(
        self,
        vocab: dict[bytes, int],
        merges: dict[tuple[bytes, bytes], int] | None = None,
        whole_first: bool = True,
    ):
        if vocab and max(vocab.values()) > ID_MASK:
            raise ValueError(f"token ids must be below {ID_MASK + 1}")
        self.vocab = vocab
        self.whole_first = whole_first
        self.byte_ids = [vocab[bytes([b])] for b in range(256)]
        self.n = max(vocab.values(), default=0) + 1
        n = self.n
        pairs: dict[int, int] = {}
        if merges is None:
            # Every split of every token into two tokens; the ranks are the ids.
            get = vocab.get
            for token, i in vocab.items():
                for k in range(1, len(token)):
                    left = get(token[:k])
                    if left is not None:
                        right = get(token[k:])
                        if right is not None:
                            pairs[left * n + right] = (i << ID_BITS) | i
        else:
            for (left, right), priority in merges.items():
                pairs[vocab[left] * n + vocab[right]] = (priority << ID_BITS) | vocab[left + right]
        self.pairs = pairs
        self._arrays: _PairTables | None = None  # the pairs as numpy arrays, for many(): built on use

    def __call__(self, piece: bytes) -> list[int]:
        """The ids of one chunk's bytes."""
        if self.whole_first:
            token = self.vocab.get(piece)
            if token is not None:
                return [token]
        ids = list(map(self.byte_ids.__getitem__, piece))
        return self._loop(ids) if len(ids) > 1 else ids

    def _loop(self, ids: list[int]) -> list[int]:
        """Merge `ids` (a chunk's parts, at least two) until no pair merges; returns `ids`."""
        get = self.pairs.get
        n = self.n
        # ranks[i]: the packed value of merging ids[i] with ids[i + 1].
        ranks = [get(a * n + b, NO_MERGE) for a, b in zip(ids, ids[1:])]
        while True:
            best = min(ranks)
            if best == NO_MERGE:
                return ids
            i = ranks.index(best)  # the leftmost of the lowest
            new = best & ID_MASK
            ids[i] = new
            del ids[i + 1]
            del ranks[i]
            if not ranks:
                return ids
            if i:
                ranks[i - 1] = get(ids[i - 1] * n + new, NO_MERGE)
            if i < len(ranks):
                ranks[i] = get(new * n + ids[i + 1], NO_MERGE)

    def many(self, pieces: list[bytes]) -> list[list[int]]:
        """The ids of many chunks at once: the same loop, vectorized over chunks with numpy.

        Each round performs one step of the loop above in every chunk still merging: its lowest pair
        (leftmost on a tie) merges. One step per chunk per round is exactly the sequential loop, so
        the ids are the same; the cost is ~30 array operations per round, instead of a dozen Python
        operations per merge. The chunks stay where they were laid out (nothing is copied per
        round): a merged-away part is unlinked from a doubly linked list, and a pair's key packs its
        priority above its position, so one `minimum.reduceat` gives each chunk's lowest pair and
        where it is. When few chunks are left merging (the long ones, for which a round costs more
        than it merges), they finish in the loop.
        """
        get = self.vocab.get if self.whole_first else {}.get
        # A whole token is one id; an empty chunk none; the rest (None) merge.
        out: list[list[int] | None] = [
            [t] if (t := get(p)) is not None else (None if p else []) for p in pieces
        ]
        todo = [k for k, o in enumerate(out) if o is None]
        if not todo:
            return out  # type: ignore[return-value]
        batches = [todo]
        if sum(map(len, pieces)) >= POS_LIMIT:  # more bytes than the key's position bits hold
            batches, size = [[]], 0
            for k in todo:
                if size + len(pieces[k]) >= POS_LIMIT and batches[-1]:
                    batches.append([])
                    size = 0
                batches[-1].append(k)
                size += len(pieces[k])
        for batch in batches:
            for k, ids in zip(batch, self._many([pieces[k] for k in batch])):
                out[k] = ids
        return out  # type: ignore[return-value]

    def _many(self, pieces: list[bytes]) -> list[list[int]]:
        """many() for non-empty chunks to merge (not whole tokens), fewer than POS_LIMIT bytes in all."""
        tables = self._tables()
        lookup = tables.lookup
        made_of = tables.made
        # Position 0 is a sentinel part (id n, which pairs with nothing): the "previous" of every
        # chunk's first part and the "next" of its last, so no round needs a mask. Chunk k's parts
        # start at starts[k]; the parts after position N belong to the last chunk.
        buf = b"\0" + b"".join(pieces)
        size = len(buf)
        raw = np.frombuffer(buf, dtype=np.uint8).astype(np.int64)  # (N,)
        ids = raw.copy() if tables.bytes_are_ids else tables.byte_ids[raw]
        ids[0] = self.n
        lens = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        ends = np.cumsum(lens) + 1
        starts = ends - lens
        pos = np.arange(size, dtype=np.int64)
        # key[p]: the pair (part at p, next part) as dense priority << POS_BITS | p; NO_MERGE or
        # above when it does not merge (a chunk's last part, a pair not in the table); DELETED for a
        # part merged into its left neighbour. Byte pairs come from a 64k table, not a search.
        key = np.empty(size, dtype=np.int64)
        key[:-1] = tables.byte_pair_key[(raw[:-1] << 8) | raw[1:]] | pos[:-1]
        key[-1] = NO_MERGE
        key[ends - 1] = NO_MERGE
        nxt = pos + 1
        nxt[ends - 1] = 0
        prv = pos - 1
        prv[starts] = 0
        while True:
            best = np.minimum.reduceat(key, starts)  # (chunks,) each chunk's lowest pair
            merging = best < NO_MERGE
            best = best[merging]
            if len(best) <= TAIL_CHUNKS:
                break
            p = best & POS_MASK  # (merging,) where each merges
            q = nxt[p]  # the part merged into p
            r = nxt[q]  # the part after it (0: none)
            ids[p] = made_of[best >> POS_BITS]
            key[q] = DELETED
            nxt[p] = r
            prv[r] = p  # r = 0 writes the sentinel's prv, which nothing reads
            left = prv[p]  # 0 (the sentinel) for a chunk's first part: its key is never read
            # The two new pairs of each merge, (p, r) and (left, p), in one lookup.
            at = np.concatenate((p, left))
            key[at] = lookup(ids[at], ids[np.concatenate((r, p))]) | at
        # Each chunk's surviving parts, in order; the few still merging finish in the loop.
        alive = key[1:] != DELETED
        flat = ids[1:][alive].tolist()
        bounds = np.cumsum(np.add.reduceat(alive, starts - 1)).tolist()
        result = list(map(flat.__getitem__, map(slice, [0, *bounds[:-1]], bounds)))
        if len(best):
            for w in np.flatnonzero(merging).tolist():
                result[w] = self._loop(result[w])
        return result

    def _tables(self) -> _PairTables:
        if self._arrays is None:
            self._arrays = _PairTables(self)
        return self._arrays


class _PairTables:
    """The pair table as numpy arrays, for Merger.many.

    keys: the sorted pair keys (left * (n + 1) + right, so that id n, the sentinel, pairs with
    nothing), then a sentinel key above them all; prio: each pair's dense priority << POS_BITS (the
    packed values' order, priority then id, renumbered 0, 1, ... so they fit), NO_MERGE at the
    sentinel key; made: the token of each dense priority (one token per value).
    byte_pair_key: prio of the 65,536 pairs of raw bytes (index first << 8 | second): the first
    round's lookups, by indexing instead of a search.
    """

    def __init__(self, merger: Merger):
        n = merger.n
        count = len(merger.pairs)
        packed = np.fromiter(merger.pairs.values(), dtype=np.int64, count=count)
        pair = np.fromiter(merger.pairs.keys(), dtype=np.int64, count=count)
        left, right = pair // n, pair % n
        keys = left * (n + 1) + right
        order = np.argsort(keys)
        keys, packed = keys[order], packed[order]
        values, dense = np.unique(packed, return_inverse=True)
        self.n = n
        self.keys = np.append(keys, np.iinfo(np.int64).max)
        self.prio = np.append(dense.astype(np.int64).reshape(-1) << POS_BITS, NO_MERGE)
        self.made = values & ID_MASK
        self.byte_ids = np.asarray(merger.byte_ids, dtype=np.int64)
        self.bytes_are_ids = bool((self.byte_ids == np.arange(256)).all())
        self.byte_pair_key = self.lookup(np.repeat(self.byte_ids, 256), np.tile(self.byte_ids, 256))

    def lookup(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """The prio of each pair (left[i], right[i]), NO_MERGE where it does not merge."""
        pair = left * (self.n + 1) + right
        at = np.searchsorted(self.keys, pair)
        return np.where(self.keys[at] == pair, self.prio[at], NO_MERGE)
