"""The Tokenizer: byte-level BPE encoding and decoding with tiktoken's semantics.

A Tokenizer is a vocabulary (token bytes -> id), a split pattern and special tokens. By default ids
are tiktoken ranks: a pair merges when its concatenation is a token, lowest id first. A vocabulary
loaded from HF or GPT-2 files may instead carry an explicit merge list (pair -> priority), which is
then followed exactly as HF `tokenizers` follows it (see bpe.py).

Encoding splits text with the pattern's regex and merges each chunk; results are cached per chunk
(text repeats its words), in a bounded dict owned by the instance.
"""

from __future__ import annotations

import os
import unicodedata
from array import array
from collections.abc import Collection, Iterable, Sequence
from functools import reduce
from itertools import compress, islice, repeat
from operator import iadd, is_
from typing import Literal

from kiln.errors import KilnError
from kiln.tokenizer import formats
from kiln.tokenizer.bpe import ID_MASK, Merger
from kiln.tokenizer.patterns import ENDOFTEXT, resolve_pattern, special_splitter, utf8
from kiln.tokenizer.split import Splitter

CACHE_MAX = 1 << 18  # chunks per cache generation (two generations: ~100 MB at most)
MANY_CHUNKS = 64  # new chunks in one text above which Merger.many (numpy, vectorized) beats the loop


class DisallowedSpecialError(KilnError, ValueError):
    """The text contains a special token that the caller did not allow (tiktoken raises ValueError)."""

    def __init__(self, message: str, token: str):
        super().__init__(message)
        self.token = token


class Tokenizer:
    """Byte-level BPE tokenizer.

    vocab: token bytes -> id for every ordinary token; all 256 single bytes must be present.
    pattern: a split pattern name ("gpt2", "gpt4", "o200k", "qwen2") or a regex.
    special_tokens: special token text -> id (ids distinct from the vocab's).
    merges: None for tiktoken semantics (ids are ranks); else (left bytes, right bytes) -> priority,
        followed as HF `tokenizers` does, and `ignore_merges` is HF's flag of that name.
    normalization: None, or a Unicode form ("NFC", "NFD", "NFKC", "NFKD") applied to ordinary text
        before splitting, as an HF normalizer does (Qwen2's tokenizer.json uses NFC).
    """

    def __init__(
        self,
        vocab: dict[bytes, int],
        pattern: str,
        special_tokens: dict[str, int] | None = None,
        *,
        merges: dict[tuple[bytes, bytes], int] | None = None,
        ignore_merges: bool = True,
        normalization: str | None = None,
    ):
        if normalization not in (None, "NFC", "NFD", "NFKC", "NFKD"):
            raise KilnError(f"normalization must be None, NFC, NFD, NFKC or NFKD, got {normalization!r}")
        self.normalization = normalization
        self.pattern = resolve_pattern(pattern)
        self._vocab = dict(vocab)
        self._specials = dict(special_tokens or {})
        self._merges = dict(merges) if merges is not None else None
        self.ignore_merges = bool(ignore_merges) if merges is not None else True
        missing = [i for i in range(256) if bytes([i]) not in self._vocab]
        if missing:
            raise KilnError(
                f"not a byte-level vocabulary: {len(missing)} single bytes have no token "
                f"(first missing: {missing[:5]}); every byte 0..255 needs one"
            )
        self._decoder: dict[int, bytes] = {i: b for b, i in self._vocab.items()}
        if len(self._decoder) != len(self._vocab):
            raise KilnError("the vocabulary gives the same id to two different tokens")
        if max(self._decoder) > ID_MASK or min(self._decoder) < 0:
            raise KilnError(f"ordinary token ids must be in 0..{ID_MASK}")
        for s, i in self._specials.items():
            if not s:
                raise KilnError("a special token cannot be the empty string")
            if i in self._decoder:
                raise KilnError(f"special token {s!r} has id {i}, which an ordinary token already uses")
            self._decoder[i] = s.encode("utf-8")
        if len(self._decoder) != len(self._vocab) + len(self._specials):
            raise KilnError("two special tokens share an id")
        if self._merges is not None:
            for left, right in self._merges:
                if left not in self._vocab or right not in self._vocab or left + right not in self._vocab:
                    raise KilnError(f"merge {left!r} + {right!r} uses or makes a token the vocabulary lacks")
        self._setup()

    def _setup(self) -> None:
        # Derived, rebuilt after unpickling: compiled regexes, the caches, a tiktoken twin.
        self._n_vocab = max(self._decoder) + 1
        self._split = Splitter(self.pattern)
        self._special_regex = special_splitter(list(self._specials))
        self._merger: Merger | None = None  # built on the first new chunk (a pair table: ~0.1 s at 32k)
        self._chunks = _ChunkCache(CACHE_MAX)
        self._tiktoken = None

    def clear_cache(self) -> None:
        """Forget every cached chunk (for cold-start measurements)."""
        self._chunks.forget()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for k in ("_split", "_special_regex", "_merger", "_chunks", "_tiktoken"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._setup()

    # ---- vocabulary ------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        """Number of ids: one more than the largest id (ordinary or special)."""
        return self._n_vocab

    @property
    def special_tokens(self) -> dict[str, int]:
        return dict(self._specials)

    @property
    def eot_id(self) -> int:
        """Id of "<|endoftext|>"."""
        if ENDOFTEXT not in self._specials:
            raise KilnError(
                f"this tokenizer has no {ENDOFTEXT} special token (it has {list(self._specials)})"
            )
        return self._specials[ENDOFTEXT]

    @property
    def vocab(self) -> dict[bytes, int]:
        """Ordinary token bytes -> id (a copy)."""
        return dict(self._vocab)

    @property
    def merges(self) -> dict[tuple[bytes, bytes], int] | None:
        """The explicit merge list (pair -> priority), or None for tiktoken (rank) semantics."""
        return dict(self._merges) if self._merges is not None else None

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token decodes to (a special token's UTF-8 text)."""
        try:
            return self._decoder[token]
        except KeyError:
            raise ValueError(f"token id {token} is not in the vocabulary (n_vocab={self.n_vocab})") from None

    # ---- encoding --------------------------------------------------------------------------------

    def _encode_chunks(self, text: str) -> list[int]:
        # The split and every pass over the chunks run in C (map/compress/reduce over the methods of
        # dicts and lists); only the distinct chunks not seen before are merged, all of them at once.
        # reduce(iadd) concatenates the chunks' ids ~20% faster than chain.from_iterable (no iterator
        # per chunk); its first argument is a new list, so no cached list is ever extended.
        if self.normalization is not None:
            text = unicodedata.normalize(self.normalization, text)
        chunks = self._split.findall(text)
        cache = self._chunks
        try:  # every chunk cached (the common case): one pass in C, as fast as it gets
            return reduce(iadd, map(cache.__getitem__, chunks), [])
        except KeyError:
            pass
        parts = list(map(cache.get, chunks))  # (chunks,) ids, None where not cached
        fresh = self._encode_new(dict.fromkeys(compress(chunks, map(is_, parts, repeat(None)))))
        cache.store(fresh)
        # Each chunk's ids: the merged ones where it was new, else the cached ones (a small dict's
        # lookups, not a second pass over the large cache).
        return reduce(iadd, map(fresh.get, chunks, parts), [])

    def _encode_new(self, new: dict[str, None]) -> dict[str, list[int]]:
        """The ids of the distinct chunks `new` (none in the cache), from the cache's previous
        generation or by merging."""
        merger = self._merger
        if merger is None:
            merger = self._merger = Merger(self._vocab, self._merges, self.ignore_merges)
        fresh = self._chunks.previous_generation(new)
        todo = [c for c, ids in fresh.items() if ids is None] if self._chunks.previous else list(fresh)
        pieces = list(map(str.encode, todo))
        fresh.update(zip(todo, merger.many(pieces) if len(todo) > MANY_CHUNKS else map(merger, pieces)))
        return fresh  # type: ignore[return-value]

    def encode_ordinary(self, text: str) -> list[int]:
        """Ids of `text`, with special tokens treated as ordinary text."""
        try:
            return self._encode_chunks(text)
        except UnicodeEncodeError:  # lone surrogates: repaired to U+FFFD as tiktoken does
            return self._encode_chunks(_fix_surrogates(text))

    def encode(
        self,
        text: str,
        *,
        allowed_special: Literal["all"] | Collection[str] = frozenset(),
        disallowed_special: Literal["all"] | Collection[str] = "all",
    ) -> list[int]:
        """Ids of `text` with tiktoken's rules for special tokens.

        Special tokens in `allowed_special` ("all" for every one) are encoded as their ids; a special
        token in `disallowed_special` ("all": every one not allowed) raises DisallowedSpecialError;
        any other special token text is encoded as ordinary text.
        """
        allowed = set(self._specials) if allowed_special == "all" else set(allowed_special)
        disallowed = set(self._specials) - allowed if disallowed_special == "all" else set(disallowed_special)
        if disallowed:
            find = (
                self._special_regex
                if disallowed == set(self._specials)
                else special_splitter(sorted(disallowed))
            )
            m = find.search(text)
            if m is not None:
                raise DisallowedSpecialError(
                    f"the text contains the special token {m.group()!r}, which is not allowed. Pass "
                    f"allowed_special={{{m.group()!r}}} (or 'all') to encode it as a special token, or "
                    f"disallowed_special=() to encode it as ordinary text",
                    m.group(),
                )
        if not allowed or self._special_regex is None:
            return self.encode_ordinary(text)
        try:
            utf8_ok = text.encode("utf-8") is not None
        except UnicodeEncodeError:
            utf8_ok = False
        if not utf8_ok:
            text = _fix_surrogates(text)
        ids: list[int] = []
        start = 0
        while True:
            # The next special token that is allowed; others stay inside the ordinary text.
            find = start
            m = self._special_regex.search(text, find)
            while m is not None and m.group() not in allowed:
                find = m.start() + 1
                m = self._special_regex.search(text, find)
            end = m.start() if m is not None else len(text)
            ids += self._encode_chunks(text[start:end])
            if m is None:
                return ids
            ids.append(self._specials[m.group()])
            start = m.end()

    def encode_ordinary_batch(
        self,
        texts: Sequence[str],
        processes: int | None = None,
        engine: Literal["auto", "kiln", "tiktoken"] = "auto",
    ) -> list[list[int]]:
        """encode_ordinary of each text, in parallel: the fastest exact path.

        engine "auto": tiktoken's Rust encoder on this tokenizer's own ranks and pattern when that is
        exact (tiktoken semantics, tiktoken installed; the tests check the ids are identical), else
        kiln's encoder. "kiln": kiln's encoder in a pool of `processes` worker processes.
        "tiktoken": tiktoken in `processes` threads, or a KilnError when it cannot be exact here.
        """
        if isinstance(texts, str | bytes):
            raise TypeError(
                "encode_ordinary_batch takes a sequence of texts, not one text: use encode_ordinary"
            )
        texts = list(texts)
        processes = (os.cpu_count() or 1) if processes is None else processes
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        if engine not in ("auto", "kiln", "tiktoken"):
            raise ValueError(f"engine must be 'auto', 'kiln' or 'tiktoken', got {engine!r}")
        enc = self.as_tiktoken() if engine != "kiln" else None
        if engine == "tiktoken" and enc is None:
            raise KilnError(
                "tiktoken cannot encode this vocabulary exactly (tiktoken missing, an explicit merge list, "
                "or a pattern its regex engine rejects); use engine='kiln'"
            )
        if enc is not None:
            if self.normalization is not None:
                texts = [unicodedata.normalize(self.normalization, t) for t in texts]
            return enc.encode_ordinary_batch(texts, num_threads=processes)
        if processes == 1 or len(texts) < 2:
            return [self.encode_ordinary(t) for t in texts]
        import multiprocessing

        # One task per process, so each worker unpickles the tokenizer once and keeps its chunk cache
        # warm over its whole share; texts are dealt round-robin, so neighbouring texts (often alike
        # in size and script) spread over the workers and the shares take about equally long.
        shares = [texts[k::processes] for k in range(processes)]
        with multiprocessing.get_context().Pool(processes) as pool:
            parts = pool.map(_encode_batch_task, [(self, share) for share in shares], chunksize=1)
        return [parts[i % processes][i // processes].tolist() for i in range(len(texts))]

    def as_tiktoken(self):
        """A `tiktoken.Encoding` with exactly this tokenizer's behaviour, or None when impossible
        (tiktoken not installed, an explicit merge list, or a pattern tiktoken's regex engine rejects)."""
        if self._merges is not None:
            return None
        if self._tiktoken is None:
            try:
                import tiktoken

                self._tiktoken = tiktoken.Encoding(
                    name="kiln",
                    pat_str=self.pattern,
                    mergeable_ranks=self._vocab,
                    special_tokens=self._specials,
                )
            except Exception:  # noqa: BLE001 - any failure just means "use kiln's own encoder"
                self._tiktoken = False
        return self._tiktoken or None

    # ---- decoding --------------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The bytes of a sequence of ids (special tokens give their text)."""
        try:
            return b"".join([self._decoder[i] for i in ids])
        except KeyError as e:
            raise ValueError(
                f"token id {e.args[0]} is not in the vocabulary (n_vocab={self.n_vocab})"
            ) from None

    def decode(self, ids: Iterable[int]) -> str:
        """The text of a sequence of ids; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    # ---- files -----------------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike, hf: bool = True, **hf_options) -> None:
        """Write kiln's form to `directory` (kiln_tokenizer.json + tokenizer.tiktoken), and with `hf`
        also HF's tokenizer.json + tokenizer_config.json so transformers can load the directory;
        `hf_options` (bos_token, eos_token, pad_token, chat_template, model_max_length) go to the
        latter (see kiln.tokenizer.formats.save_hf)."""
        if hf_options and not hf:
            raise ValueError(f"HF options {sorted(hf_options)} given with hf=False")
        formats.save_kiln(self, directory)
        if hf:
            formats.save_hf(self, directory, **hf_options)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load a tokenizer from kiln's directory, an HF tokenizer.json (or its directory), or a
        GPT-2 directory (vocab.json + merges.txt); for a tiktoken ranks file see from_tiktoken."""
        return cls.from_spec(formats.read(path))

    @classmethod
    def from_tiktoken(
        cls, path: str | os.PathLike, pattern: str, special_tokens: dict[str, int] | None = None
    ) -> Tokenizer:
        """A Tokenizer from a tiktoken ranks file plus the pattern and special tokens it was made with."""
        return cls(formats.load_tiktoken(path), pattern, special_tokens)

    @classmethod
    def from_spec(cls, spec: formats.TokenizerSpec) -> Tokenizer:
        """A Tokenizer from what a file reader returned (see kiln.tokenizer.formats)."""
        return cls(
            spec.vocab,
            spec.pattern,
            spec.special_tokens,
            merges=spec.merges,
            ignore_merges=spec.ignore_merges,
            normalization=spec.normalization,
        )

    def __repr__(self) -> str:
        mode = "ranks" if self._merges is None else f"{len(self._merges)} merges"
        return f"Tokenizer(n_vocab={self.n_vocab}, {mode}, specials={list(self._specials)})"


class _ChunkCache(dict):
    """chunk text -> ids, bounded: lookups are plain dict.get (in C).

    When `max_items` are kept, they become the previous generation and the cache starts empty; new
    chunks are looked up there before they are merged, so the chunks in use survive the flush (two
    generations approximate LRU without bookkeeping on hits).
    """

    def __init__(self, max_items: int):
        super().__init__()
        self.max_items = max_items
        self.previous: dict[str, list[int]] = {}

    def previous_generation(self, chunks: dict[str, None]) -> dict[str, list[int] | None]:
        """`chunks` with the ids the previous generation holds for them (None for the rest)."""
        if not self.previous:
            return chunks
        get = self.previous.get
        return {c: get(c) for c in chunks}

    def store(self, fresh: dict[str, list[int]]) -> None:
        if len(self) + len(fresh) > self.max_items:
            self.previous = dict(self)
            self.clear()
            if len(fresh) > self.max_items:  # one text with more new chunks than fit: keep its last
                fresh = dict(islice(fresh.items(), len(fresh) - self.max_items, None))
        self.update(fresh)

    def forget(self) -> None:
        self.clear()
        self.previous = {}


def _fix_surrogates(text: str) -> str:
    return utf8(text).decode("utf-8")


def _encode_batch_task(args: tuple[Tokenizer, list[str]]) -> list[array]:
    # Arrays pickle as raw bytes: sending lists of Python ints back would cost as much as encoding.
    tok, texts = args
    return [array("I", tok.encode_ordinary(t)) for t in texts]
