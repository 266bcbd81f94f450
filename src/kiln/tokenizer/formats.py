"""Reading and writing tokenizers: kiln's own directory, tiktoken ranks files, HF tokenizer.json
(+ tokenizer_config.json) and GPT-2's vocab.json + merges.txt.

- kiln: `kiln_tokenizer.json` (pattern, special tokens, semantics) next to `tokenizer.tiktoken`
  (one "base64(token bytes) id" line per token) and, for a vocabulary with an explicit merge list,
  `merges.kiln` (one "base64(left) base64(right)" line per merge, earliest first).
- tiktoken: the ranks file alone; the pattern and special tokens come from the caller. A token may be
  empty: whisper's multilingual.tiktoken has the line "= 50256" (base64 of nothing, padded); it is
  read as tiktoken reads it and written the same way.
- HF and GPT-2: tokens are strings in GPT-2's byte-to-unicode alphabet (each byte one printable
  character). A kiln vocabulary exports with every split of every token as a merge, ordered by the
  token's rank, plus `ignore_merges`: that is exactly tiktoken's rule in HF's terms. An HF or GPT-2
  vocabulary imports with its merge list and is encoded as HF encodes it.

This module works on plain data, below the Tokenizer class: readers return a TokenizerSpec (what
Tokenizer's constructor takes) and writers take anything with a Tokenizer's attributes (a Tokenizer or
a TokenizerSpec). Tokenizer.load and Tokenizer.save are built on it.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Protocol

import regex

from kiln.errors import KilnError
from kiln.tokenizer.patterns import ENDOFTEXT, onig_compatible, pattern_name

KILN_FILE = "kiln_tokenizer.json"
RANKS_FILE = "tokenizer.tiktoken"
MERGES_FILE = "merges.kiln"


@dataclass(frozen=True)
class TokenizerSpec:
    """What a tokenizer file holds: the arguments of Tokenizer(...) (see its docstring), unchecked."""

    vocab: dict[bytes, int]
    pattern: str
    special_tokens: dict[str, int]
    merges: dict[tuple[bytes, bytes], int] | None = None
    ignore_merges: bool = True
    normalization: str | None = None


class TokenizerData(Protocol):
    """What the writers read: a Tokenizer or a TokenizerSpec."""

    @property
    def vocab(self) -> dict[bytes, int]: ...
    @property
    def pattern(self) -> str: ...
    @property
    def special_tokens(self) -> dict[str, int]: ...
    @property
    def merges(self) -> dict[tuple[bytes, bytes], int] | None: ...
    @property
    def ignore_merges(self) -> bool: ...
    @property
    def normalization(self) -> str | None: ...


# HF's ByteLevel pre-tokenizer regex (use_regex=true): GPT-2's split as HF spells it.
HF_BYTELEVEL = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (printable Latin-1 maps to itself,
    the rest to U+0100 onwards), used by every HF byte-level vocabulary."""
    bs = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@cache
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def to_unicode(token: bytes) -> str:
    m = byte_to_unicode()
    return "".join(m[b] for b in token)


def from_unicode(token: str) -> bytes:
    m = unicode_to_byte()
    try:
        return bytes(m[c] for c in token)
    except KeyError as e:
        raise KilnError(
            f"token {token!r} has the character {e.args[0]!r}, outside the byte-level alphabet"
        ) from None


# ---- tiktoken ranks files ------------------------------------------------------------------------


def save_tiktoken(vocab: dict[bytes, int], path: str | os.PathLike) -> None:
    """Write a tiktoken ranks file: "base64(bytes) rank" per line, in rank order; the empty token is
    written "=" as in whisper's files (tiktoken's own dump writes nothing there, which no loader reads)."""
    lines = [f"{_b64(b)} {i}\n" for b, i in sorted(vocab.items(), key=lambda kv: kv[1])]
    Path(path).write_text("".join(lines), encoding="ascii")


def _b64(token: bytes) -> str:
    return base64.b64encode(token).decode() if token else "="


def _unb64(text: str) -> bytes:
    # "=" alone is the empty token (whisper's multilingual.tiktoken); tiktoken's loader decodes it to
    # b"" because it does not validate. Everything else must be strict base64.
    return b"" if text == "=" else base64.b64decode(text, validate=True)


def load_tiktoken(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken ranks file into token bytes -> rank."""
    path = Path(path)
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read tiktoken ranks file {path}: {e}") from e
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[_unb64(token)] = int(rank)
        except ValueError as e:
            raise KilnError(f"{path}:{n}: malformed tiktoken line {line[:60]!r} (want 'base64 rank')") from e
    if not ranks:
        raise KilnError(f"tiktoken ranks file {path} is empty")
    return ranks


# ---- kiln's directory ----------------------------------------------------------------------------


def save_kiln(tok: TokenizerData, directory: str | os.PathLike) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_tiktoken(tok.vocab, directory / RANKS_FILE)
    merges = tok.merges
    meta = {
        "format": "kiln-tokenizer",
        "version": 1,
        "pattern": tok.pattern,
        "pattern_name": pattern_name(tok.pattern),
        "special_tokens": tok.special_tokens,
        "semantics": "tiktoken" if merges is None else "merges",
        "ignore_merges": tok.ignore_merges,
        "normalization": tok.normalization,
    }
    if merges is not None:
        lines = [f"{_b64(a)} {_b64(b)}\n" for (a, b), _ in sorted(merges.items(), key=lambda kv: kv[1])]
        (directory / MERGES_FILE).write_text("".join(lines), encoding="ascii")
    (directory / KILN_FILE).write_text(
        json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def read_kiln(directory: str | os.PathLike) -> TokenizerSpec:
    directory = Path(directory)
    meta = _read_json(directory / KILN_FILE)
    try:
        if meta.get("format") != "kiln-tokenizer":
            raise KeyError("format")
        vocab = load_tiktoken(directory / meta.get("ranks_file", RANKS_FILE))
        merges = None
        if meta["semantics"] == "merges":
            merges = {}
            text = (directory / MERGES_FILE).read_text(encoding="ascii")
            for i, line in enumerate(text.splitlines()):
                a, b = line.split()
                merges[(_unb64(a), _unb64(b))] = i
        return TokenizerSpec(
            vocab,
            str(meta["pattern"]),
            {str(k): int(v) for k, v in meta["special_tokens"].items()},
            merges=merges,
            ignore_merges=bool(meta.get("ignore_merges", True)),
            normalization=meta.get("normalization"),
        )
    except (KeyError, ValueError, TypeError, AttributeError, OSError) as e:
        raise KilnError(
            f"{directory / KILN_FILE} is not a valid kiln tokenizer ({type(e).__name__}: {e})"
        ) from e


# ---- HF tokenizers -------------------------------------------------------------------------------


def hf_merges(tok: TokenizerData) -> list[tuple[bytes, bytes]]:
    """The merge list that makes HF `tokenizers` (with ignore_merges) encode as `tok` does.

    tiktoken merges two parts whenever their concatenation is a token, ranked by that token's rank,
    so every split of a token into two tokens is a merge, listed in order of the token's rank.
    """
    if tok.merges is not None:
        return [pair for pair, _ in sorted(tok.merges.items(), key=lambda kv: kv[1])]
    vocab = tok.vocab
    out: list[tuple[bytes, bytes]] = []
    for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        for k in range(1, len(token)):
            if token[:k] in vocab and token[k:] in vocab:
                out.append((token[:k], token[k:]))
    return out


def to_hf_json(tok: TokenizerData) -> dict:
    """HF `tokenizers` tokenizer.json content for `tok`."""
    split = {
        "type": "Split",
        "pattern": {"Regex": onig_compatible(tok.pattern)},
        "behavior": "Isolated",
        "invert": False,
    }
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": i,
                "content": s,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for s, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
        ],
        "normalizer": {"type": tok.normalization} if tok.normalization is not None else None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [split, byte_level]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": tok.ignore_merges,
            "vocab": {to_unicode(b): i for b, i in sorted(tok.vocab.items(), key=lambda kv: kv[1])},
            "merges": [[to_unicode(a), to_unicode(b)] for a, b in hf_merges(tok)],
        },
    }


def save_hf(
    tok: TokenizerData,
    directory: str | os.PathLike,
    *,
    bos_token: str | None = None,
    eos_token: str | None = ENDOFTEXT,
    pad_token: str | None = None,
    chat_template: str | None = None,
    model_max_length: int | None = None,
) -> None:
    """Write tokenizer.json and tokenizer_config.json (loadable by transformers' AutoTokenizer)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specials = tok.special_tokens
    for role, s in (("bos", bos_token), ("eos", eos_token), ("pad", pad_token)):
        if s is not None and s not in specials:
            if role == "eos" and s == ENDOFTEXT:
                eos_token = None  # the default, for a tokenizer trained without it
                continue
            raise KilnError(f"{role}_token {s!r} is not one of the special tokens {list(specials)}")
    (directory / "tokenizer.json").write_text(
        json.dumps(to_hf_json(tok), ensure_ascii=False), encoding="utf-8"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "pad_token": pad_token,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length if model_max_length is not None else int(1e30),
        "added_tokens_decoder": {
            str(i): {
                "content": s,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for s, i in sorted(specials.items(), key=lambda kv: kv[1])
        },
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _hf_pattern(pre: dict | None) -> str:
    """The split regex of an HF pre-tokenizer that kiln can follow exactly, or a KilnError."""
    if pre is None:
        raise KilnError("the tokenizer has no pre-tokenizer; kiln needs a byte-level one")
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    pattern = None
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            if step.get("add_prefix_space"):
                raise KilnError("ByteLevel with add_prefix_space=true is not supported (it changes the text)")
            if step.get("use_regex", True):
                if pattern is not None:
                    raise KilnError("a Split followed by a regex ByteLevel is not supported")
                pattern = HF_BYTELEVEL
        elif kind == "Split":
            if pattern is not None:
                raise KilnError("more than one splitting pre-tokenizer is not supported")
            if step.get("behavior") != "Isolated" or step.get("invert"):
                raise KilnError(
                    f"Split with behavior={step.get('behavior')!r} invert={step.get('invert')} is not supported"
                )
            pat = step["pattern"]
            pattern = pat["Regex"] if "Regex" in pat else regex.escape(pat["String"])
        else:
            raise KilnError(
                f"pre-tokenizer {kind!r} is not supported (kiln reads byte-level BPE: Split + ByteLevel)"
            )
    if pattern is None:
        raise KilnError("the pre-tokenizer does not split text; kiln needs a split regex")
    return pattern


def spec_from_hf_json(data: dict, source: str = "tokenizer.json") -> TokenizerSpec:
    """A tokenizer's spec from the content of an HF tokenizer.json (byte-level BPE)."""
    try:
        model = data["model"]
        if model.get("type", "BPE") != "BPE":
            raise KilnError(f"{source}: model type {model.get('type')!r} is not BPE")
        if model.get("dropout") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            raise KilnError(f"{source}: BPE dropout and subword prefixes/suffixes are not supported")
        if model.get("byte_fallback"):
            raise KilnError(f"{source}: byte_fallback BPE is not byte-level; not supported")
        normalizer = data.get("normalizer")
        if normalizer is not None and normalizer.get("type") not in ("NFC", "NFD", "NFKC", "NFKD"):
            raise KilnError(
                f"{source}: normalizer {normalizer.get('type')!r} is not supported (only NFC/NFD/NFKC/NFKD)"
            )
        pattern = _hf_pattern(data.get("pre_tokenizer"))
        specials = {t["content"]: int(t["id"]) for t in data.get("added_tokens", [])}
        special_ids = set(specials.values())
        vocab = {from_unicode(s): int(i) for s, i in model["vocab"].items() if int(i) not in special_ids}
        merges: dict[tuple[bytes, bytes], int] = {}
        for n, m in enumerate(model["merges"]):
            a, b = m.split(" ") if isinstance(m, str) else m
            merges.setdefault((from_unicode(a), from_unicode(b)), n)
        return TokenizerSpec(
            vocab,
            pattern,
            specials,
            merges=merges,
            ignore_merges=bool(model.get("ignore_merges", False)),
            normalization=normalizer["type"] if normalizer is not None else None,
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise KilnError(f"{source} is not a valid HF tokenizer.json ({type(e).__name__}: {e})") from e


def read_hf(path: str | os.PathLike) -> TokenizerSpec:
    """A tokenizer's spec from an HF tokenizer.json, or a directory holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    return spec_from_hf_json(_read_json(path), str(path))


# ---- GPT-2 vocab.json + merges.txt ---------------------------------------------------------------


def save_gpt2(tok: TokenizerData, directory: str | os.PathLike) -> None:
    """Write vocab.json (special tokens included) and merges.txt in GPT-2's layout."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    vocab = {to_unicode(b): i for b, i in sorted(tok.vocab.items(), key=lambda kv: kv[1])}
    vocab.update(tok.special_tokens)
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    lines = ["#version: 0.2\n"] + [f"{to_unicode(a)} {to_unicode(b)}\n" for a, b in hf_merges(tok)]
    (directory / "merges.txt").write_text("".join(lines), encoding="utf-8")


def read_gpt2(
    directory: str | os.PathLike, pattern: str | None = None, special_tokens: tuple[str, ...] = (ENDOFTEXT,)
) -> TokenizerSpec:
    """A tokenizer's spec from GPT-2 files: vocab.json entries named in `special_tokens` become special tokens;
    the pattern defaults to GPT-2's (as HF's ByteLevel pre-tokenizer spells it)."""
    directory = Path(directory)
    raw = _read_json(directory / "vocab.json")
    try:
        text = (directory / "merges.txt").read_text(encoding="utf-8")
    except OSError as e:
        raise KilnError(f"cannot read {directory / 'merges.txt'}: {e}") from e
    try:
        specials = {s: int(raw[s]) for s in special_tokens if s in raw}
        vocab = {from_unicode(s): int(i) for s, i in raw.items() if s not in specials}
        merges: dict[tuple[bytes, bytes], int] = {}
        for line in text.splitlines():
            if not line or line.startswith("#version"):
                continue
            a, b = line.split(" ")
            merges.setdefault((from_unicode(a), from_unicode(b)), len(merges))
    except (ValueError, TypeError, AttributeError) as e:
        raise KilnError(f"{directory} does not hold valid GPT-2 vocab.json/merges.txt ({e})") from e
    return TokenizerSpec(vocab, pattern or HF_BYTELEVEL, specials, merges=merges, ignore_merges=False)


def load_chat_template(directory: str | os.PathLike) -> str | None:
    """The chat template in `directory`'s tokenizer_config.json (or chat_template.jinja), if any."""
    directory = Path(directory)
    if (directory / "chat_template.jinja").exists():
        return (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if not (directory / "tokenizer_config.json").exists():
        return None
    template = _read_json(directory / "tokenizer_config.json").get("chat_template")
    if template is not None and not isinstance(template, str):
        raise KilnError(f"{directory / 'tokenizer_config.json'}: chat_template must be a string")
    return template


# ---- any of them ---------------------------------------------------------------------------------


def read(path: str | os.PathLike) -> TokenizerSpec:
    """Read whichever format `path` holds: a kiln directory, an HF tokenizer.json (or a directory with
    one), or a GPT-2 directory."""
    path = Path(path)
    if not path.exists():
        raise KilnError(f"no tokenizer at {path}: the path does not exist")
    if path.is_dir():
        if (path / KILN_FILE).exists():
            return read_kiln(path)
        if (path / "tokenizer.json").exists():
            return read_hf(path)
        if (path / "vocab.json").exists() and (path / "merges.txt").exists():
            return read_gpt2(path)
        raise KilnError(
            f"{path} holds no tokenizer ({KILN_FILE}, tokenizer.json, or vocab.json + merges.txt)"
        )
    if path.suffix == ".json":
        return read_hf(path)
    raise KilnError(
        f"cannot tell the format of {path}; for a tiktoken ranks file use "
        "Tokenizer.from_tiktoken(path, pattern, special_tokens)"
    )


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise KilnError(f"cannot read {path}: {e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KilnError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise KilnError(f"{path} should hold a JSON object, not {type(data).__name__}")
    return data
