"""Pre-tokenization: the split patterns that cut text into chunks before byte-pair merging, the
Splitter that applies them as tiktoken does, and the cut around special tokens.

BPE never merges across a chunk boundary, so the pattern decides what a token can be (a word with its
leading space, up to three digits, a run of punctuation, ...). The named patterns are copied verbatim
from the tokenizers that made them famous, so a vocabulary trained here with `pattern="gpt4"` splits
text exactly as tiktoken's cl100k_base does. They use possessive quantifiers (`++`, `?+`), which the
`regex` module supports and the stdlib `re` does not.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import regex

from kiln.errors import KilnError
from kiln.tokenizer.unicode_pin import newer_characters, pinned_pattern

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


# ASCII meanings of the properties the named patterns use: \p{L} is A-Za-z on ASCII text, \p{N} is
# 0-9, and \s (the White_Space property, which the `regex` module and tiktoken use) is \t\n\v\f\r and
# space; U+001C-U+001F are not White_Space, though str.isspace() says they are.
_ASCII_PROPERTIES = {
    "L": "A-Za-z",
    "N": "0-9",
    "Lu": "A-Z",
    "Ll": "a-z",
    "Lt": "",
    "Lm": "",
    "Lo": "",
    "M": "",
}
_ASCII_SPACE = r"\t\n\x0b\x0c\r "


def _ascii_translation(pattern: str) -> str | None:
    """`pattern` with Unicode properties spelt as ASCII classes, or None if it uses anything else."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1]
            if nxt == "p" and pattern[i + 2 : i + 3] == "{":
                end = pattern.index("}", i)
                chars = _ASCII_PROPERTIES.get(pattern[i + 3 : end])
                if chars is None:
                    return None
                out.append(chars if in_class else (f"[{chars}]" if chars else "(?!)"))
                i = end + 1
                continue
            if nxt == "s":
                out.append(_ASCII_SPACE if in_class else f"[{_ASCII_SPACE}]")
            elif nxt == "S" and not in_class:
                out.append(f"[^{_ASCII_SPACE}]")
            elif nxt in "rnt" or not nxt.isalnum():
                out.append(pattern[i : i + 2])  # \r \n \t and escaped punctuation mean the same
            else:
                return None  # \w, \d, \b, \P{..}, ...: not translated, so no ASCII form
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
        elif c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def ascii_form(pattern: str) -> str | None:
    """For a named pattern, an equivalent regex for pure-ASCII text that the stdlib `re` runs ~2.5x
    faster than the `regex` module runs the original (no Unicode property lookups); None otherwise.

    Only the named patterns get one: for those the tests check, on ASCII text, that `re` with this form
    splits exactly as `regex` with the original (and both as tiktoken). A custom pattern may use
    syntax the two engines read differently, so it always goes through `regex`.
    """
    if pattern_name(pattern) is None:
        return None
    return _ascii_translation(pattern)


# Mixed text (mostly ASCII with some non-ASCII, e.g. source files joined into one string) is cut into
# stretches, each split by the faster engine that is exact for it. A cut must not change any chunk;
# for the named patterns a line start p is such a cut when text[p-1] is "\n", text[p-2] is not
# whitespace and text[p] is neither whitespace nor "/": no chunk of theirs holds "\n" followed by
# anything but whitespace (or "/", o200k's [\r\n/]*), so a chunk ends at p; the chunk holding that
# "\n" is the same whether the text goes on or ends at p (a lone "\n" after a non-space; the
# lookaheads \s+(?!\S) and \s++$ cannot tell, see tests/tokenizer/test_encode.py); and nothing looks
# behind. The test compares the cut split with the uncut one around every kind of line start.
ASCII_RUN = 2048  # ASCII characters worth switching engines for
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
# Tried only where a run starts (the lookbehind), so the search is linear in the text.
_LONG_ASCII = re.compile(rf"(?<![\x00-\x7f])[\x00-\x7f]{{{ASCII_RUN},}}")


def _is_cut(text: str, p: int) -> bool:
    c = text[p]
    return text[p - 1] == "\n" and not text[p - 2].isspace() and not c.isspace() and c != "/"


def _cut_before(text: str, i: int, lo: int) -> int:
    """The last cut p with lo < p <= i, else lo."""
    while True:
        j = text.rfind("\n", lo + 1, i)  # a cut after it has p - 2 = j - 1 >= lo
        if j < 0:
            return lo
        if j + 1 < len(text) and _is_cut(text, j + 1):
            return j + 1
        i = j


def _cut_after(text: str, i: int) -> int:
    """The first cut p >= i, else len(text)."""
    n = len(text)
    while True:
        j = text.find("\n", max(i - 1, 1))
        if j < 0 or j + 1 >= n:
            return n
        if _is_cut(text, j + 1):
            return j + 1
        i = j + 2


class Splitter:
    """Cuts text into chunks exactly as tiktoken's engine does with `pattern` (a resolved regex).

    Three compiled forms: pure-ASCII text goes to the stdlib `re` with the ASCII form (named patterns
    only, ~2.5x faster than the `regex` module); text with a code point newer than tiktoken's Unicode
    data goes to the pinned form (see unicode_pin.py); the rest to the `regex` module with the pattern
    as written. A long text of a named pattern that mixes both is cut at line starts into ASCII
    stretches and the rest (see _is_cut).
    """

    def __init__(self, pattern: str):
        self.pattern = pattern
        self._regex = regex.compile(pattern)
        form = ascii_form(pattern)
        self._ascii = re.compile(form) if form is not None else None
        pinned = pinned_pattern(pattern)
        self._pinned = None
        if pinned is not None:
            try:
                self._pinned = regex.compile(pinned)
            except regex.error as e:
                raise KilnError(
                    f"split pattern {pattern!r} cannot be pinned to tiktoken's Unicode data ({e}); "
                    "escape any '[' inside a character class"
                ) from e
        self._newer = newer_characters()

    def findall(self, text: str) -> list[str]:
        """The chunks of `text`, in order; they concatenate back to the part of `text` the pattern
        matches (all of it for the named patterns)."""
        if self._ascii is None:
            return self._unicode(text)
        if text.isascii():
            return self._ascii.findall(text)
        if len(text) < 2 * ASCII_RUN:
            return self._unicode(text)
        return self._mixed(text)

    def _unicode(self, text: str) -> list[str]:
        if self._pinned is not None and not self._newer.isdisjoint(text):
            return self._pinned.findall(text)
        return self._regex.findall(text)

    def _mixed(self, text: str) -> list[str]:
        out: list[str] = []
        n = len(text)
        pos = 0  # a cut: everything before it is split
        while pos < n:
            m = _NON_ASCII.search(text, pos)
            if m is None:
                out += self._ascii.findall(text, pos)
                break
            start = _cut_before(text, m.start(), pos)
            if start > pos:
                out += self._ascii.findall(text, pos, start)
            # The non-ASCII stretch runs to the first cut inside the next long ASCII run.
            end = n
            run = _LONG_ASCII.search(text, m.end())
            while run is not None:
                end = _cut_after(text, run.start())
                if end < run.end():
                    break
                end = n
                run = _LONG_ASCII.search(text, run.end())
            out += self._unicode(text[start:end])
            pos = end
        return out

    def __reduce__(self):
        return (Splitter, (self.pattern,))


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
