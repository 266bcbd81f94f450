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

PairRank = Callable[[bytes, bytes], "int | None"]


def merge_parts(piece: bytes, pair_rank: PairRank) -> list[bytes]:
    """Split `piece` into bytes, then merge the lowest-ranked adjacent pair (leftmost on ties) until
    no adjacent pair has a rank. Returns the final parts."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    # ranks[i]: the rank of merging parts[i] with parts[i + 1], None when they cannot merge.
    ranks = [pair_rank(parts[i], parts[i + 1]) for i in range(len(parts) - 1)]
    while True:
        best = None
        best_i = -1
        for i, r in enumerate(ranks):
            if r is not None and (best is None or r < best):
                best, best_i = r, i
        if best is None:
            return parts
        i = best_i
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
        del ranks[i]
        if i > 0:
            ranks[i - 1] = pair_rank(parts[i - 1], parts[i])
        if i < len(parts) - 1:
            ranks[i] = pair_rank(parts[i], parts[i + 1])


def merge_by_rank(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """tiktoken's encoding of one chunk with `ranks` (token bytes -> rank, and the rank is the id)."""
    token = ranks.get(piece)
    if token is not None:
        return [token]
    get = ranks.get
    return [ranks[p] for p in merge_parts(piece, lambda left, right: get(left + right))]


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
    parts = merge_parts(piece, lambda left, right: get((left, right)))
    try:
        return [ids[p] for p in parts]
    except KeyError as e:
        raise ValueError(f"the vocabulary has no token for the bytes {e.args[0]!r}") from None
