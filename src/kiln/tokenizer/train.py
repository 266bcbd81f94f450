"""Byte-level BPE training: stream and count chunks in parallel, then merge incrementally.

Two phases.

1. Counting. Text arrives as an iterable of strings (a generator over a corpus larger than memory is
   fine: at most two batches per worker are in flight). Special tokens are cut out first, so they are
   never merged into anything; the rest is split by the pattern's regex and each distinct chunk is
   counted. Batches of about `BATCH_CHARS` characters go to a process pool; each worker returns a
   Counter and the parent adds them up. Only the distinct chunks stay in memory.

2. Merging. Every distinct chunk becomes a "word", a list of token ids (its UTF-8 bytes at first), with
   its count. We keep
     - pair_count[pair]: occurrences of each adjacent pair, weighted by word counts;
     - where[pair]: the words that contain (or once contained) the pair;
     - a max-heap of (count, pair) entries, checked lazily: an entry whose count is stale is re-pushed
       with the current count when it reaches the top.
   Merging the best pair (a, b) -> x rewrites only the words in where[(a, b)], and in each only the
   neighbours of each occurrence change: (p, a) and (b, n) lose, (p, x) and (x, n) gain. No merge
   recounts the corpus. Ties in count go to the smallest pair of ids, as in HF `tokenizers`.

Pairs are stored as one int, a * PAIR_BASE + b, because ints hash faster than tuples.
"""

from __future__ import annotations

import heapq
import multiprocessing
import os
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain, islice

from tqdm.auto import tqdm

from kiln.errors import KilnError
from kiln.tokenizer.patterns import resolve_pattern, special_splitter, utf8
from kiln.tokenizer.split import Splitter
from kiln.tokenizer.tokenizer import Tokenizer

BATCH_CHARS = 1 << 21  # ~2 MB of text per counting task
PAIR_BASE = 1 << 24  # ids stay below 16.7M, far above any vocabulary we train


@dataclass(frozen=True)
class Merge:
    """One training step: the adjacent pair (left, right) became token `new` (seen `count` times)."""

    left: int
    right: int
    new: int
    count: int


def count_chunks_in(texts: Sequence[str], pattern: str, special_tokens: Sequence[str]) -> Counter[str]:
    """Counts of the distinct regex chunks of `texts`, special tokens removed (one worker's task)."""
    split = Splitter(pattern)  # the encoder's split, so training sees the chunks encoding will
    specials = special_splitter(special_tokens)
    counts: Counter[str] = Counter()
    for text in texts:
        parts = specials.split(text) if specials is not None else (text,)
        for part in parts:
            counts.update(split.findall(part))
    return counts


def _count_task(args: tuple[list[str], str, tuple[str, ...]]) -> tuple[Counter[str], int]:
    return count_chunks_in(*args), sum(map(len, args[0]))


def _batches(texts: Iterable[str], batch_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    size = 0
    for text in texts:
        if not isinstance(text, str):
            raise TypeError(
                f"train_bpe expects an iterable of str, got an item of type {type(text).__name__}"
            )
        batch.append(text)
        size += len(text)
        if size >= batch_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def count_chunks(
    texts: Iterable[str],
    pattern: str,
    special_tokens: Sequence[str] = (),
    processes: int | None = None,
    progress: bool = True,
    batch_chars: int = BATCH_CHARS,
) -> Counter[str]:
    """Counts of every distinct chunk over a stream of texts, in `processes` worker processes.

    Texts are grouped into tasks of about `batch_chars` characters. With one process (or a single
    task) it counts in this process and starts no pool.
    """
    pattern = resolve_pattern(pattern)
    processes = (os.cpu_count() or 1) if processes is None else processes
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    specials = tuple(special_tokens)
    batches = _batches(texts, batch_chars)
    head = list(islice(batches, 2))
    total: Counter[str] = Counter()
    bar = tqdm(desc="counting chunks", unit="MB", disable=not progress, leave=False)

    def add(counts: Counter[str], n_chars: int) -> None:
        total.update(counts)
        bar.update(round(n_chars / 1e6, 2))

    if processes == 1 or len(head) < 2:
        for batch in chain(head, batches):
            add(*_count_task((batch, pattern, specials)))
    else:
        # At most two tasks per process in flight, so a corpus larger than memory streams through
        # (Pool.imap would read the whole iterable ahead into its task queue).
        with multiprocessing.get_context().Pool(processes) as pool:
            pending: deque = deque()
            for batch in chain(head, batches):
                pending.append(pool.apply_async(_count_task, ((batch, pattern, specials),)))
                if len(pending) > 2 * processes:
                    add(*pending.popleft().get())
            while pending:
                add(*pending.popleft().get())
    bar.close()
    return total


def bpe_merges(
    words: dict[bytes, int],
    n_new: int,
    min_frequency: int = 2,
    progress: bool = True,
) -> tuple[list[Merge], list[bytes]]:
    """BPE merges over `words` (distinct chunk bytes -> count) until `n_new` tokens are learnt.

    Returns the merges and the token bytes of every id (0..255 are the single bytes). When a merge
    produces bytes that already have an id, the merge reuses that id and adds no token (HF does the
    same); training stops early when the best pair is seen fewer than `min_frequency` times.
    """
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    vocab: list[bytes] = [bytes([i]) for i in range(256)]
    ids_of: dict[bytes, int] = {b: i for i, b in enumerate(vocab)}
    seqs: list[list[int]] = []
    counts: list[int] = []
    for chunk, c in words.items():
        if len(chunk) >= 2:
            seqs.append(list(chunk))
            counts.append(c)

    # Pair counts and the pair -> words index. `where` lists may hold a word twice or a word that no
    # longer has the pair; merging checks, so the index only needs to be a superset.
    pair_count: dict[int, int] = {}
    where: dict[int, list[int]] = {}
    for w, seq in enumerate(seqs):
        c = counts[w]
        for k in map(int.__add__, [s * PAIR_BASE for s in seq[:-1]], seq[1:]):
            if k in pair_count:
                pair_count[k] += c
                where[k].append(w)
            else:
                pair_count[k] = c
                where[k] = [w]
    heap = [(-c, k) for k, c in pair_count.items()]
    heapq.heapify(heap)

    merges: list[Merge] = []
    bar = tqdm(total=n_new, desc="merging", unit="merge", disable=not progress, leave=False)
    while len(vocab) < 256 + n_new and heap:
        neg, key = heapq.heappop(heap)
        cur = pair_count.get(key, 0)
        if cur != -neg:  # stale entry: put it back with its current count
            if cur > 0:
                heapq.heappush(heap, (-cur, key))
            continue
        if cur < min_frequency:
            break
        a, b = divmod(key, PAIR_BASE)
        merged = vocab[a] + vocab[b]
        x = ids_of.get(merged)
        if x is None:
            x = len(vocab)
            vocab.append(merged)
            ids_of[merged] = x
            bar.update(1)
        merges.append(Merge(a, b, x, cur))

        gained: set[int] = set()  # pairs with x whose counts grew: pushed once after the pass
        xb = x * PAIR_BASE
        for w in set(where.pop(key)):
            seq = seqs[w]
            n = len(seq)
            if n < 2:
                continue
            c = counts[w]
            out: list[int] = []
            i = 0
            changed = False
            while i < n:
                if i + 1 < n and seq[i] == a and seq[i + 1] == b:
                    changed = True
                    pair_count[key] -= c
                    if out:  # left neighbour: (p, a) -> (p', x), p' being x if it was merged too
                        old = seq[i - 1] * PAIR_BASE + a
                        pair_count[old] -= c
                        new = out[-1] * PAIR_BASE + x
                        pair_count[new] = pair_count.get(new, 0) + c
                        where.setdefault(new, []).append(w)
                        gained.add(new)
                    if i + 2 < n:  # right neighbour, unless it starts the next occurrence
                        r = seq[i + 2]
                        if not (r == a and i + 3 < n and seq[i + 3] == b):
                            old = b * PAIR_BASE + r
                            pair_count[old] -= c
                            new = xb + r
                            pair_count[new] = pair_count.get(new, 0) + c
                            where.setdefault(new, []).append(w)
                            gained.add(new)
                    out.append(x)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            if changed:
                seqs[w] = out
        for k in gained:
            heapq.heappush(heap, (-pair_count[k], k))
        pair_count.pop(key, None)
    bar.close()
    return merges, vocab


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    pattern: str = "gpt4",
    special_tokens: Sequence[str] = ("<|endoftext|>",),
    min_frequency: int = 2,
    processes: int | None = None,
    progress: bool = True,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer with `vocab_size` ids in all (256 bytes + merges + specials).

    Ids 0..255 are the bytes, then the merged tokens in the order they were learnt (so an id is also
    its tiktoken rank), then the special tokens. Training can stop short of `vocab_size` when no pair
    occurs `min_frequency` times; `n_vocab` of the result says how many ids there are.
    """
    if isinstance(texts, str | bytes):
        raise TypeError("train_bpe takes an iterable of texts, not one text: wrap it in a list")
    special_tokens = tuple(special_tokens)
    if len(set(special_tokens)) != len(special_tokens) or any(not s for s in special_tokens):
        raise KilnError(f"special tokens must be distinct non-empty strings, got {special_tokens!r}")
    if vocab_size < 256 + len(special_tokens):
        raise KilnError(
            f"vocab_size {vocab_size} is too small: byte-level BPE needs 256 byte tokens plus "
            f"{len(special_tokens)} special token(s), so at least {256 + len(special_tokens)}"
        )
    regex_text = resolve_pattern(pattern)
    chunks = count_chunks(texts, regex_text, special_tokens, processes=processes, progress=progress)
    if not chunks:
        raise KilnError("the training text is empty: nothing to learn merges from")
    words: dict[bytes, int] = {}
    for chunk, c in chunks.items():
        b = utf8(chunk)
        words[b] = words.get(b, 0) + c
    del chunks
    n_new = vocab_size - 256 - len(special_tokens)
    _, vocab = bpe_merges(words, n_new, min_frequency=min_frequency, progress=progress)
    ranks = {b: i for i, b in enumerate(vocab)}
    specials = {s: len(vocab) + i for i, s in enumerate(special_tokens)}
    return Tokenizer(ranks, regex_text, specials)
