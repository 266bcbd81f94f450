"""A slow, obviously correct BPE trainer: recount every pair, merge the best, repeat.

Same contract as kiln.tokenizer.train.bpe_merges: counts of adjacent pairs (overlaps included),
weighted by word counts; the highest count wins, ties to the smallest (left, right) ids; a merge whose
bytes already have an id reuses it; stop at `n_new` new tokens or when the best count < min_frequency.
"""

from __future__ import annotations

from kiln.tokenizer.train import Merge


def reference_merges(
    words: dict[bytes, int], n_new: int, min_frequency: int = 2
) -> tuple[list[Merge], list[bytes]]:
    vocab = [bytes([i]) for i in range(256)]
    seqs = [(list(w), c) for w, c in words.items()]
    merges: list[Merge] = []
    while len(vocab) < 256 + n_new:
        counts: dict[tuple[int, int], int] = {}
        for seq, c in seqs:
            for pair in zip(seq, seq[1:]):
                counts[pair] = counts.get(pair, 0) + c
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        if counts[best] < min_frequency:
            break
        merged = vocab[best[0]] + vocab[best[1]]
        if merged in vocab:
            new = vocab.index(merged)
        else:
            new = len(vocab)
            vocab.append(merged)
        merges.append(Merge(best[0], best[1], new, counts[best]))
        for k, (seq, c) in enumerate(seqs):
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and (seq[i], seq[i + 1]) == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[k] = (out, c)
    return merges, vocab
