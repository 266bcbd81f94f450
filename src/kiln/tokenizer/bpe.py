"""Encoding one pre-tokenized chunk: the byte-pair merge loop, in the two flavours files come in.

- By rank (tiktoken): two adjacent parts may merge when their concatenation is a token; the
  lowest-ranked such concatenation merges first, the leftmost on a tie. A chunk that is itself a token
  is emitted whole without merging. This is tiktoken's `byte_pair_merge`, step for step.
- By merge list (HF `tokenizers`, GPT-2's merges.txt): only listed pairs merge, the one listed
  earliest first, the leftmost on a tie. HF's `ignore_merges` flag adds the whole-chunk shortcut.

Both are one loop, `merge_parts`, with a different "rank of this pair" function. Callers cache
results per chunk, so this loop only runs on chunks seen for the first time.
"""

from __future__ import annotations

from collections.abc import Callable

PairRank = Callable[[bytes, bytes], int]
NO_MERGE = 1 << 62  # the rank of a pair that cannot merge: above every real rank or priority


def merge_parts(piece: bytes, pair_rank: PairRank) -> list[bytes]:
    """Split `piece` into bytes, then merge the lowest-ranked adjacent pair (leftmost on ties) until
    no adjacent pair can merge. Returns the final parts.

    `pair_rank(left, right)` gives a pair's rank, NO_MERGE when it cannot merge. Taking the minimum
    with min() and its position with list.index() (the leftmost) keeps the scans in C.
    """
    parts = [piece[i : i + 1] for i in range(len(piece))]
    # ranks[i]: the rank of merging parts[i] with parts[i + 1].
    ranks = [pair_rank(parts[i], parts[i + 1]) for i in range(len(parts) - 1)]
    while ranks:
        best = min(ranks)
        if best == NO_MERGE:
            break
        i = ranks.index(best)
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del ranks[i]
        if i > 0:
            ranks[i - 1] = pair_rank(parts[i - 1], parts[i])
        if i < len(parts) - 1:
            ranks[i] = pair_rank(parts[i], parts[i + 1])
    return parts


def merge_by_rank(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's encoding of one chunk with `ranks` (token bytes -> rank, and the rank is the id)."""
    token = ranks.get(piece)
    if token is not None:
        return [token]
    get = ranks.get
    return [ranks[p] for p in merge_parts(piece, lambda left, right: get(left + right, NO_MERGE))]


def merge_by_list(
    piece: bytes, ids: dict[bytes, int], merges: dict[tuple[bytes, bytes], int], whole_first: bool
) -> list[int]:
    """HF `tokenizers`' encoding of one chunk: `merges` maps a pair of parts to its priority.

    `ids` maps token bytes to ids; `whole_first` is HF's `ignore_merges` (emit a chunk that is a token).
    """
    if whole_first:
        token = ids.get(piece)
        if token is not None:
            return [token]
    get = merges.get
    parts = merge_parts(piece, lambda left, right: get((left, right), NO_MERGE))
    try:
        return [ids[p] for p in parts]
    except KeyError as e:
        raise ValueError(f"the vocabulary has no token for the bytes {e.args[0]!r}") from None
