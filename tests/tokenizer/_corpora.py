"""Corpora built from what ships with Python: stdlib sources, pydoc prose, and hard multilingual text."""

from __future__ import annotations

import sysconfig
from pathlib import Path

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def stdlib_text(max_chars: int, skip: int = 0) -> str:
    """Concatenated stdlib sources, about `max_chars` characters, starting after `skip` files."""
    out: list[str] = []
    n = 0
    for path in sorted(STDLIB.glob("*.py"))[skip:]:
        text = path.read_text(encoding="utf-8", errors="replace")
        out.append(text)
        n += len(text)
        if n >= max_chars:
            break
    return "".join(out)[:max_chars]


def prose(max_chars: int) -> str:
    """English prose: the pydoc topic texts."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics.values())[:max_chars]


# Text meant to break encoders: scripts, emoji (ZWJ sequences, flags, skin tones, variation selectors),
# combining marks, odd whitespace, digit runs, every kind of newline, contractions in any case.
HARD = "\n".join(
    [
        "日本語のテキストと中文文本，还有한국어 문장도 있습니다。",
        "العربية: مرحبا بالعالم! ١٢٣٤٥ والأرقام 2024م.",
        "Emoji: 👨‍👩‍👧‍👦 🏳️‍🌈 👍🏽 🇫🇷🇯🇵 ❤️ ☺︎ 🧑🏿‍🚀 ✈️",
        "Combining: é (e\u0301), ñ, Å, ḁ\u0323\u0307, Zalgo z\u0336\u0353a\u0337\u0329l\u0334g\u0338o",
        "Whitespace:  two  \t\ttabs   three\u00a0nbsp\u2003em\u3000ideographic   \n\n\n   ",
        "Digits: 1234567890123456789 3.14159265358979 ١٢٣ ۱۲۳ १२३ ①②③ 1,000,000",
        "Newlines: a\r\nb\rc\nd\r\n\r\ne\u2028f\u2029g\x0bh\x0ci\x85j",
        "Contractions: I'm you're HE'LL we've THEY'D it's DON'T o'clock 'tis",
        "CamelCase HTTPServerError getHTTPResponseCode snake_case_name __dunder__",
        "Mixed: Ελληνικά кириллица עברית हिन्दी ไทย ქართული Ⅻ ﬁ ㎏ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛",
        "Code: def f(x):\n    return x**2  # comment\n\tif x != 0: pass\n}}]])) ;;; ->> => !== <=>",
        "",
        "   leading spaces and trailing   ",
        # Line starts around the encoder's segment cuts (patterns.SEGMENT_BOUNDARIES).
        "a+\n/b x:\n  \n\ty\n\n  \n  z foo \n bar\r\n  x a\n\x85b a\n\u3000b a\n\x1cb c\n'sx 1\n2 _\n\n/ .\n//",
    ]
)


def multilingual(max_chars: int) -> str:
    """Source code, English prose and HARD, repeated, about `max_chars` characters."""
    part = max_chars // 3
    return stdlib_text(part) + "\n" + prose(part) + "\n" + HARD * max(1, part // len(HARD))


PATTERN_NAMES = ["gpt2", "gpt4", "o200k", "qwen2"]
