"""Pre-tokenization: the split patterns that cut text into chunks before byte-pair merging, and the
cut around special tokens (split.py applies the patterns as tiktoken does).

BPE never merges across a chunk boundary, so the pattern decides what a token can be (a word with its
leading space, up to three digits, a run of punctuation, ...). The named patterns are copied verbatim
from the tokenizers that made them famous, so a vocabulary trained here with `pattern="gpt4"` splits
text exactly as tiktoken's cl100k_base does. They use possessive quantifiers (`++`, `?+`), which the
`regex` module and, from Python 3.11, the stdlib `re` support.
"""

from __future__ import annotations

from collections.abc import Sequence

import regex

from kiln.errors import KilnError

# GPT-2 (tiktoken's r50k/p50k): contractions, letters, numbers and punctuation each with an optional
# leading space, then whitespace.
GPT2 = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

# GPT-4 (tiktoken's cl100k_base): case-insensitive contractions, numbers in groups of at most three
# digits, newlines kept with the punctuation before them.
GPT4 = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
    r"""\s*[\r\n]|\s+(?!\S)|\s"""
)

# GPT-4o (tiktoken's o200k_base): splits CamelCase words at the case change and keeps contractions
# attached to the word.
O200K = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Qwen2 / Qwen2.5 / Qwen3: cl100k's shape without possessives, and every digit its own chunk.
QWEN2 = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"""
    r"""\s+(?!\S)|\s+"""
)

PATTERNS: dict[str, str] = {"gpt2": GPT2, "gpt4": GPT4, "cl100k": GPT4, "o200k": O200K, "qwen2": QWEN2}


def resolve_pattern(pattern: str) -> str:
    """A pattern name ("gpt2", "gpt4"/"cl100k", "o200k", "qwen2") or a custom regex -> the regex text.

    A custom regex must compile with the `regex` module and must not match the empty string (the
    encoder would loop or drop text).
    """
    if not isinstance(pattern, str) or not pattern:
        raise KilnError(f"split pattern must be a name ({', '.join(PATTERNS)}) or a regex, got {pattern!r}")
    if pattern in PATTERNS:
        return PATTERNS[pattern]
    if pattern.isidentifier():
        # A bare word is almost surely a misspelt name, not a regex meant to match that literal word.
        raise KilnError(
            f"unknown split pattern name {pattern!r}; choose one of {', '.join(PATTERNS)} or a regex"
        )
    try:
        compiled = regex.compile(pattern)
    except regex.error as e:
        raise KilnError(f"split pattern {pattern!r} is not a valid regex: {e}") from e
    if compiled.match("") is not None:
        raise KilnError(f"split pattern {pattern!r} matches the empty string; every chunk must be non-empty")
    return pattern


def pattern_name(pattern: str) -> str | None:
    """The canonical name of a named pattern's regex text, or None for a custom regex."""
    for name in ("gpt2", "gpt4", "o200k", "qwen2"):
        if PATTERNS[name] == pattern:
            return name
    return None


def onig_compatible(pattern: str) -> str:
    """The same split in the dialect of HF `tokenizers` (Oniguruma, Ruby syntax).

    In Ruby syntax `{1,3}+` is not possessive but "one or more groups of one to three": `\\p{N}{1,3}+`
    would swallow a whole digit run. After `\\p{N}{1,3}` nothing follows inside that alternative, so
    the greedy form matches exactly the same text; the other possessives (`++`, `?+`, `*+`) mean the
    same in both engines.
    """
    return regex.sub(r"\{(\d+),(\d+)\}\+", r"{\1,\2}", pattern)


ENDOFTEXT = "<|endoftext|>"


def special_splitter(special_tokens: Sequence[str]) -> regex.Pattern | None:
    """A regex matching any special token, longest first (so "<|a|>x" wins over a prefix "<|a|>")."""
    if not special_tokens:
        return None
    return regex.compile("|".join(regex.escape(s) for s in sorted(special_tokens, key=len, reverse=True)))


def utf8(text: str) -> bytes:
    """UTF-8 bytes of `text`; lone surrogates become U+FFFD (as tiktoken does before encoding)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")
