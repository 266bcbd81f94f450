r"""Pinning split patterns to the Unicode data of tiktoken's regex engine.

A split pattern's \p{L}, \p{N}, \p{M}, ... mean whatever the regex engine's Unicode tables say. The
`regex` module that kiln splits with carries newer tables (2026.11.19: Unicode 17 and later) than
tiktoken 0.14's Rust `regex` crate (Unicode 16.0); HF `tokenizers` 0.23 (Oniguruma) splits those
code points as tiktoken does too.
Code points assigned after 16.0 (CJK Extension J, Seal script, new Latin letters, ...) are letters or
marks to one and unassigned to the other, so "\U0003E04F's" splits in two different ways and the ids
differ.

kiln follows tiktoken: NEWER_THAN_TIKTOKEN lists every code point that the installed `regex` module
puts in a property class the named patterns use while tiktoken's engine leaves it unassigned (found by
comparing both engines on every code point in a "{c}'s" context with the gpt2, gpt4, o200k and qwen2
patterns; tests/tokenizer/test_unicode.py repeats that comparison and fails, naming the code points,
when either library's tables move). A text that contains none of them (nearly every text) is split by
the pattern as written; one that does is split by `pinned_pattern`, the same pattern with those code
points removed from every property class, which is what tiktoken's engine sees.
"""

from __future__ import annotations

# Inclusive code point ranges: assigned in the `regex` module's Unicode data, unassigned in Unicode
# 16.0 (tiktoken 0.14, tokenizers 0.23). Measured with regex 2026.11.19.
NEWER_THAN_TIKTOKEN: tuple[tuple[int, int], ...] = (
    (0x00558, 0x00558),
    (0x0058B, 0x0058C),
    (0x005C8, 0x005C9),
    (0x0088F, 0x0088F),
    (0x00B53, 0x00B54),
    (0x00C5C, 0x00C5C),
    (0x00CDC, 0x00CDC),
    (0x01ACF, 0x01AF0),
    (0x0208F, 0x0208F),
    (0x0209D, 0x0209F),
    (0x0A7CE, 0x0A7CF),
    (0x0A7D2, 0x0A7D2),
    (0x0A7D4, 0x0A7D4),
    (0x0A7DD, 0x0A7DD),
    (0x0A7E2, 0x0A7E2),
    (0x0A7F1, 0x0A7F1),
    (0x0AB6C, 0x0AB6D),
    (0x107BB, 0x107BF),
    (0x10940, 0x10959),
    (0x10EC5, 0x10EC7),
    (0x10ECB, 0x10ECF),
    (0x10ED9, 0x10EEE),
    (0x10EF0, 0x10EFB),
    (0x11B0A, 0x11B0A),
    (0x11B60, 0x11B67),
    (0x11DB0, 0x11DDB),
    (0x11DE0, 0x11DE9),
    (0x11DF0, 0x11DF1),
    (0x1246F, 0x1246F),
    (0x12475, 0x1247F),
    (0x12550, 0x12686),
    (0x16EA0, 0x16EB8),
    (0x16EBB, 0x16ED3),
    (0x16FF2, 0x16FF6),
    (0x187F8, 0x187FF),
    (0x18CD6, 0x18CDA),
    (0x18D09, 0x18D20),
    (0x18D80, 0x18DF2),
    (0x18E00, 0x19191),
    (0x191A0, 0x191D2),
    (0x1B123, 0x1B128),
    (0x1B168, 0x1B168),
    (0x1D127, 0x1D128),
    (0x1D250, 0x1D252),
    (0x1D25B, 0x1D25C),
    (0x1D25F, 0x1D25F),
    (0x1D280, 0x1D281),
    (0x1D6A6, 0x1D6A6),
    (0x1DF1F, 0x1DF24),
    (0x1DF2B, 0x1DF81),
    (0x1DF90, 0x1DF96),
    (0x1DFCD, 0x1DFFF),
    (0x1E6C0, 0x1E6DE),
    (0x1E6E0, 0x1E6F5),
    (0x1E6FE, 0x1E6FF),
    (0x2B73A, 0x2B73F),
    (0x2B81E, 0x2B81E),
    (0x2CEA2, 0x2CEAD),
    (0x323B0, 0x33479),
    (0x3D000, 0x3FC3F),
)


def _class_body() -> str:
    # Literal characters, not \x{...} escapes: the code points are all letters, marks, digits or
    # symbols, never a character that is special inside a class.
    return "".join(chr(a) if a == b else f"{chr(a)}-{chr(b)}" for a, b in NEWER_THAN_TIKTOKEN)


def newer_characters() -> frozenset[str]:
    """The characters of NEWER_THAN_TIKTOKEN: `not newer.isdisjoint(text)` tells whether a text holds
    one, ten times faster than a regex search for the class."""
    return frozenset(chr(c) for a, b in NEWER_THAN_TIKTOKEN for c in range(a, b + 1))


def pinned_pattern(pattern: str) -> str | None:
    r"""`pattern` with NEWER_THAN_TIKTOKEN removed from its Unicode classes, or None when it uses none.

    Every \p{..} / \pX becomes [\p{..}--[NEWER]] and \w, \d the same; \P{..}, \PX, \W, \D
    (whose complements shrink) gain the code points instead. This needs the `regex` module's version 1
    syntax for set operations, which is otherwise the same language for these patterns (the tests
    check the named ones on every code point). Word boundaries (\b) are not pinned.
    """
    newer = _class_body()
    out: list[str] = []
    changed = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c != "\\" or i + 1 >= len(pattern):
            out.append(c)
            i += 1
            continue
        nxt = pattern[i + 1]
        if nxt in "pP":
            if pattern[i + 2 : i + 3] == "{":
                end = pattern.index("}", i)
                name = pattern[i + 3 : end]
                i = end + 1
            else:
                name = pattern[i + 2 : i + 3]
                i += 3
            escape = f"\\{nxt}{{{name}}}"
            out.append(f"[{escape}--[{newer}]]" if nxt == "p" else f"[{escape}[{newer}]]")
            changed = True
        elif nxt in "wd":
            out.append(f"[\\{nxt}--[{newer}]]")
            changed = True
            i += 2
        elif nxt in "WD":
            out.append(f"[\\{nxt}[{newer}]]")
            changed = True
            i += 2
        else:
            out.append(pattern[i : i + 2])
            i += 2
    return "(?V1)" + "".join(out) if changed else None
