"""Splitting text into chunks exactly as tiktoken's engine does, as fast as Python allows.

The `regex` module runs a named pattern at ~0.6-0.8 µs per chunk: its Unicode property lookups
(\\p{L}, \\p{N}, \\s) dominate, and on multilingual text the split alone costs about as much as all of
tiktoken's encode. The stdlib `re` is 2.5-3x faster with the same pattern when every property is
written out as an explicit class of Basic Multilingual Plane code points (sre compiles such a class
into a two-level bitmap: one lookup per character). A class holding code points above U+FFFF
loses that (sre scans its ranges one by one, 3x slower than `regex`), so:

- text with no code point above U+FFFF (nearly all text, ASCII included) goes to the stdlib `re`
  with the pattern's *BMP form*: each property spelt as the BMP code points that the `regex` module,
  pinned to tiktoken's Unicode data (unicode_pin.py), puts in it; each letter under (?i:...) spelt
  as the characters it matches case-insensitively (s, S and U+017F for "s"). Same pattern, same
  engine semantics (backtracking, leftmost alternative first, possessive quantifiers: Python 3.11+),
  same character sets: the same chunks. The tests compare the two on every BMP code point in
  contexts that exercise each class, and on random text;
- text with such a code point (emoji, historic scripts, math letters) goes to the `regex` module,
  pinned when it holds a code point newer than tiktoken's Unicode data; a long text of that kind is
  cut at safe line starts so its stretches without them still take the fast path (see _is_cut).

Only the named patterns get a BMP form; a custom pattern may use syntax the two engines read
differently, so it always goes to the `regex` module.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import regex

from kiln.errors import KilnError
from kiln.tokenizer.patterns import pattern_name
from kiln.tokenizer.unicode_pin import newer_characters, pinned_pattern

# The Unicode properties the named patterns use (a pattern with any other has no BMP form).
_PROPERTIES = ("L", "N", "Lu", "Ll", "Lt", "Lm", "Lo", "M")


def _bmp_class(expr: str) -> str:
    """The body of a character class holding the BMP code points that the `regex` expression `expr`
    (one character, e.g. a pinned \\p{L}) matches, as \\u escapes and ranges."""
    plane = "".join(map(chr, range(0x10000)))  # position == code point
    return "".join(
        f"\\u{m.start():04x}" if m.end() - m.start() == 1 else f"\\u{m.start():04x}-\\u{m.end() - 1:04x}"
        for m in regex.finditer(f"{expr}+", plane)
    )


def _translate(pattern: str, classes: dict[str, str], space: str, fold: Callable[[str], str]) -> str | None:
    """`pattern` with \\p{..} spelt as `classes[name]`, \\s as `space`, and each letter under (?i:...)
    as `fold(letter)`, all class bodies; None if it uses anything else (\\w, \\d, \\b, \\P, ...)."""
    out: list[str] = []
    in_class = False
    folding: list[bool] = []  # per open group: is it a (?i:...) group
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            nxt = pattern[i + 1]
            if nxt == "p" and pattern[i + 2 : i + 3] == "{":
                end = pattern.index("}", i)
                body = classes.get(pattern[i + 3 : end])
                if body is None:
                    return None
                out.append(body if in_class else (f"[{body}]" if body else "(?!)"))
                i = end + 1
                continue
            if nxt == "s":
                out.append(space if in_class else f"[{space}]")
            elif nxt == "S" and not in_class:
                out.append(f"[^{space}]")
            elif nxt in "rnt" or not nxt.isalnum():
                out.append(pattern[i : i + 2])  # \r \n \t and escaped punctuation mean the same
            else:
                return None
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif pattern.startswith("(?i:", i):
            folding.append(True)
            out.append("(?:")
            i += 4
            continue
        elif c == "(":
            folding.append(False)
        elif c == ")":
            folding.pop()
        elif c == "[":
            in_class = True
        if c.isascii() and c.isalpha() and any(folding):
            out.append(fold(c) if in_class else f"[{fold(c)}]")
        else:
            out.append(c)
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=8)
def bmp_form(pattern: str) -> str | None:
    """For a named pattern, the same pattern for the stdlib `re` on text without code points above
    U+FFFF, every class spelt out (see the module docstring); None for a custom pattern.

    Reading the classes off the `regex` module's tables takes 0.1-0.4 s, so the result (a pure
    function of the pattern text) is memoized, like the stdlib's own cache of compiled patterns: each
    Tokenizer, training run and worker process would otherwise pay it again.
    """
    if pattern_name(pattern) is None:
        return None

    def pinned(expr: str) -> str:
        return pinned_pattern(expr) or expr

    used = set(regex.findall(r"\\p\{(\w+)\}", pattern))
    classes = {name: _bmp_class(pinned(f"\\p{{{name}}}")) for name in _PROPERTIES if name in used}
    return _translate(
        pattern, classes, _bmp_class(pinned(r"\s")), lambda letter: _bmp_class(f"(?i:{letter})")
    )


# Long text with code points above U+FFFF here and there (source files joined into one string, chat
# logs with emoji) is cut into stretches, each split by the faster engine that is exact for it. A cut
# must not change any chunk; for the named patterns a line start p is such a cut when text[p-1] is
# "\n", text[p-2] is not whitespace and text[p] is neither whitespace nor "/": no chunk of theirs
# holds "\n" followed by anything but whitespace (or "/", o200k's [\r\n/]*), so a chunk ends at p;
# the chunk holding that "\n" is the same whether the text goes on or ends at p (a lone "\n" after a
# non-space; the lookaheads \s+(?!\S) and \s++$ cannot tell, see tests/tokenizer/test_encode.py);
# and nothing looks behind. The test compares the cut split with the uncut one around every kind of
# line start.
BMP_RUN = 2048  # characters without an astral code point worth switching engines for
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")
# Tried only where a run starts (the lookbehind), so the search is linear in the text.
_LONG_BMP = re.compile(f"(?<![\U00010000-\U0010ffff])[\\x00-\\uffff]{{{BMP_RUN},}}")


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


def _has_astral(text: str) -> bool:
    # UTF-16 takes two units for exactly those code points; encoding runs at ~1 ns per character.
    return len(text.encode("utf-16-le", "surrogatepass")) != 2 * len(text)


class Splitter:
    """Cuts text into chunks exactly as tiktoken's engine does with `pattern` (a resolved regex).

    Three compiled forms: the BMP form for the stdlib `re` (named patterns only, text without code
    points above U+FFFF); the `regex` module with the pattern as written; and the pinned form for
    text with a code point newer than tiktoken's Unicode data (see unicode_pin.py). The BMP form is
    built on first use (see bmp_form).
    """

    def __init__(self, pattern: str):
        self.pattern = pattern
        self._regex = regex.compile(pattern)
        self._has_bmp_form = pattern_name(pattern) is not None
        self._bmp: re.Pattern | None = None
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
        if not self._has_bmp_form:
            return self._unicode(text)
        bmp = self._bmp
        if bmp is None:
            bmp = self._bmp = re.compile(bmp_form(self.pattern))  # type: ignore[arg-type]
        if text.isascii() or not _has_astral(text):
            return bmp.findall(text)
        if len(text) < 2 * BMP_RUN:
            return self._unicode(text)
        return self._mixed(text, bmp)

    def _unicode(self, text: str) -> list[str]:
        if self._pinned is not None and not self._newer.isdisjoint(text):
            return self._pinned.findall(text)
        return self._regex.findall(text)

    def _mixed(self, text: str, bmp: re.Pattern) -> list[str]:
        out: list[str] = []
        n = len(text)
        pos = 0  # a cut: everything before it is split
        while pos < n:
            m = _ASTRAL.search(text, pos)
            if m is None:
                out += bmp.findall(text, pos)
                break
            start = _cut_before(text, m.start(), pos)
            if start > pos:
                out += bmp.findall(text, pos, start)
            # The stretch with astral code points runs to the first cut inside the next long BMP run.
            end = n
            run = _LONG_BMP.search(text, m.end())
            while run is not None:
                end = _cut_after(text, run.start())
                if end < run.end():
                    break
                end = n
                run = _LONG_BMP.search(text, run.end())
            out += self._unicode(text[start:end])
            pos = end
        return out

    def __reduce__(self):
        return (Splitter, (self.pattern,))
