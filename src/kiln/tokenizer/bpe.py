"""Encoding one pre-tokenized chunk: the byte-pair merge loop, in the two flavours files come in.

- By rank (tiktoken): two adjacent parts may merge when their concatenation is a token; the
  lowest-ranked such concatenation merges first, the leftmost on a tie. A chunk that is itself a token
  is emitted whole without merging. This is tiktoken's `byte_pair_merge`, step for step.
- By merge list (HF `tokenizers`, GPT-2's merges.txt): only listed pairs merge, the one listed
  earliest first, the leftmost on a tie. HF's `ignore_merges` flag adds the whole-chunk shortcut.

Both are one loop over token ids, `Merger.__call__`, with a different table of mergeable pairs.
Callers cache results per chunk, so this loop only runs on chunks seen for the first time; on
multilingual text (a new word every few chunks) it is still most of the encoding time, hence ints:
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
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None  # pairs as sorted arrays, for many()

    def __call__(self, piece: bytes) -> list[int]:
        """The ids of one chunk's bytes."""
        if self.whole_first:
            token = self.vocab.get(piece)
            if token is not None:
                return [token]
        ids = [self.byte_ids[b] for b in piece]
        if len(ids) < 2:
            return ids
        get = self.pairs.get
        n = self.n
        # ranks[i]: the packed value of merging ids[i] with ids[i + 1].
        ranks = [get(a * n + b, NO_MERGE) for a, b in zip(ids, ids[1:])]
        while ranks:
            best = min(ranks)
            if best == NO_MERGE:
                break
            i = ranks.index(best)  # the leftmost of the lowest
            new = best & ID_MASK
            ids[i] = new
            del ids[i + 1]
            del ranks[i]
            if i:
                ranks[i - 1] = get(ids[i - 1] * n + new, NO_MERGE)
            if i < len(ranks):
                ranks[i] = get(new * n + ids[i + 1], NO_MERGE)
        return ids

    def many(self, pieces: list[bytes]) -> list[list[int]]:
        """The ids of many chunks at once: the same loop, vectorized over chunks with numpy.

        Each round performs one step of the loop above in every chunk still merging: find its
        lowest pair (leftmost on a tie) and merge it. One step per chunk per round is exactly the
        sequential loop, so the ids are the same; the cost is a few array passes per round instead
        of a dozen Python operations per merge. Worth it from a few hundred new chunks on.
        """
        out: list[list[int] | None] = [None] * len(pieces)
        todo: list[int] = []
        for k, piece in enumerate(pieces):
            token = self.vocab.get(piece) if self.whole_first else None
            if token is not None:
                out[k] = [token]
            elif len(piece) < 2:
                out[k] = [self.byte_ids[b] for b in piece]
            else:
                todo.append(k)
        if todo:
            keys, values = self._sorted_pairs()
            n = self.n

            def lookup(left: np.ndarray, right: np.ndarray) -> np.ndarray:
                pair = left * n + right
                at = np.minimum(np.searchsorted(keys, pair), len(keys) - 1)
                return np.where(keys[at] == pair, values[at], NO_MERGE)

            byte_ids = np.asarray(self.byte_ids, dtype=np.int64)
            lens = np.fromiter((len(pieces[k]) for k in todo), dtype=np.int64, count=len(todo))
            ids = byte_ids[np.frombuffer(b"".join([pieces[k] for k in todo]), dtype=np.uint8)]
            words = np.asarray(todo, dtype=np.int64)
            ends = np.cumsum(lens)
            # rank[p]: the packed value of merging ids[p] with ids[p + 1]; NO_MERGE at each word's
            # last position, whose "next" belongs to another word. Kept up to date: a merge changes
            # only the ranks on both sides of the merged position.
            rank = np.full(len(ids), NO_MERGE, dtype=np.int64)
            rank[:-1] = lookup(ids[:-1], ids[1:])
            rank[ends - 1] = NO_MERGE
            while True:
                starts = ends - lens
                best = np.minimum.reduceat(rank, starts)  # (words,)
                done = best == NO_MERGE
                if done.any():
                    finished = np.repeat(done, lens)
                    flat = ids[finished].tolist()
                    s = 0
                    for w, m in zip(words[done].tolist(), lens[done].tolist()):
                        out[w] = flat[s : s + m]
                        s += m
                    left = ~done
                    if not left.any():
                        break
                    ids, rank, lens, words, best = (
                        ids[~finished],
                        rank[~finished],
                        lens[left],
                        words[left],
                        best[left],
                    )
                    ends = np.cumsum(lens)
                    starts = ends - lens
                # The leftmost position of each word's lowest pair: the first p with rank == best.
                hit = np.flatnonzero(rank == np.repeat(best, lens))
                word_of_hit = np.repeat(np.arange(len(lens)), lens)[hit]
                first = hit[np.r_[True, word_of_hit[1:] != word_of_hit[:-1]]]  # (words,)
                ids[first] = best & ID_MASK
                keep = np.ones(len(ids), dtype=bool)
                keep[first + 1] = False
                ids, rank = ids[keep], rank[keep]
                lens = lens - 1
                ends = ends - np.arange(1, len(lens) + 1)
                at = first - np.arange(len(first))  # the merged positions after the deletions
                has_next = at < ends - 1
                rank[at] = NO_MERGE
                rank[at[has_next]] = lookup(ids[at[has_next]], ids[at[has_next] + 1])
                has_prev = at > ends - lens
                prev = at[has_prev] - 1
                rank[prev] = lookup(ids[prev], ids[prev + 1])
        return out  # type: ignore[return-value]

    def _sorted_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        if self._sorted is None:
            keys = np.fromiter(self.pairs.keys(), dtype=np.int64, count=len(self.pairs))
            values = np.fromiter(self.pairs.values(), dtype=np.int64, count=len(self.pairs))
            order = np.argsort(keys)
            if not len(keys):  # no merges at all: one key that matches nothing
                keys, values, order = np.array([-1]), np.array([NO_MERGE]), np.array([0])
            self._sorted = (keys[order], values[order])
        return self._sorted
