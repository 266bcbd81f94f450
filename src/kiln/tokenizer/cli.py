"""`kiln tokenizer train|encode|decode|convert`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from kiln.errors import KilnError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tokenizer", help="train, use and convert byte-level BPE tokenizers")
    tsub = p.add_subparsers(dest="tokenizer_command", required=True)

    t = tsub.add_parser("train", help="train a tokenizer on text files or directories")
    t.add_argument("inputs", nargs="+", help="text files, or directories searched recursively")
    t.add_argument("--out", required=True, help="directory to write the tokenizer to")
    t.add_argument("--vocab-size", type=int, default=4096, help="ids in all: 256 bytes + merges + specials")
    t.add_argument("--pattern", default="gpt4", help="gpt2 | gpt4 | o200k | qwen2 | a custom regex")
    t.add_argument(
        "--special", action="append", default=None, help="a special token (repeatable; default <|endoftext|>)"
    )
    t.add_argument(
        "--min-frequency", type=int, default=2, help="stop when the best pair is rarer than this (>= 1)"
    )
    t.add_argument(
        "--processes", type=int, default=None, help="counting processes, >= 1 (default: all cores)"
    )
    t.add_argument("--force", action="store_true", help="overwrite a tokenizer already in --out")
    t.add_argument("--ext", default=None, help="only files with these suffixes in directories, e.g. .py,.txt")
    t.add_argument("--chat-template", default=None, help="a Jinja chat template file to save with it")
    t.set_defaults(func=_train)

    e = tsub.add_parser("encode", help="print the ids of a text (argument, --file, or stdin)")
    e.add_argument("text", nargs="?", help="the text (default: --file or stdin)")
    e.add_argument("--tokenizer", "-t", required=True, help="a kiln, HF or GPT-2 tokenizer directory")
    e.add_argument(
        "--file", nargs="+", default=None, help="encode these files instead: one line of ids per file"
    )
    e.add_argument(
        "--allowed-special",
        default="none",
        help="'all', 'none', or a comma-separated list of special tokens encoded as their ids",
    )
    e.add_argument("--json", action="store_true", help="print a JSON list instead of space-separated ids")
    e.set_defaults(func=_encode)

    d = tsub.add_parser("decode", help="print the text of ids (arguments or stdin)")
    d.add_argument("ids", nargs="*", help="token ids (default: read from stdin, spaces/commas/JSON)")
    d.add_argument("--tokenizer", "-t", required=True, help="a kiln, HF or GPT-2 tokenizer directory")
    d.set_defaults(func=_decode)

    c = tsub.add_parser("convert", help="convert between kiln, HF, GPT-2 and tiktoken formats")
    c.add_argument("source", help="a kiln/HF/GPT-2 directory, a tokenizer.json, or a tiktoken ranks file")
    c.add_argument("--to", required=True, choices=["kiln", "hf", "gpt2", "tiktoken"])
    c.add_argument("--out", required=True, help="output directory (a file for --to tiktoken)")
    c.add_argument("--pattern", default=None, help="split pattern, needed when the source is a tiktoken file")
    c.add_argument(
        "--special",
        action="append",
        default=None,
        help="NAME=ID special token for a tiktoken source (repeatable)",
    )
    c.add_argument("--chat-template", default=None, help="a Jinja chat template file (for --to hf/kiln)")
    c.add_argument("--force", action="store_true", help="overwrite a tokenizer (or file) already at --out")
    c.set_defaults(func=_convert)


# every file a tokenizer directory of any format may hold: --out refuses to overwrite them without --force
_TOKENIZER_FILES = (
    "kiln_tokenizer.json",
    "tokenizer.tiktoken",
    "merges.kiln",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
)


def _check_out(out: str, *, file: bool, force: bool) -> None:
    """Refuse an --out that cannot be written (a file where a directory goes, or the reverse; a file
    among its parents) or that holds a tokenizer already, before any work is done."""
    path = Path(out)
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise KilnError(f"--out {path}: {parent} is a file, not a directory")
            break
    if file:
        if path.is_dir():
            raise KilnError(
                f"--out {path} is a directory, but --to tiktoken writes one file: give a file path, "
                f"e.g. {path / 'tokenizer.tiktoken'}"
            )
        if path.exists() and not force:
            raise KilnError(
                f"--out {path} already exists: choose another path, or pass --force to replace it"
            )
        return
    if path.exists() and not path.is_dir():
        raise KilnError(
            f"--out {path} is an existing file, not a directory: give a directory (it is created if missing)"
        )
    found = [name for name in _TOKENIZER_FILES if (path / name).exists()]
    if found and not force:
        raise KilnError(
            f"--out {path} already holds a tokenizer ({found[0]}): choose another directory, or pass --force "
            "to overwrite it"
        )


def _read_text_files(inputs: list[str], ext: str | None) -> tuple[list[Path], int]:
    suffixes = tuple(s if s.startswith(".") else "." + s for s in ext.split(",")) if ext else None
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(
                p for p in path.rglob("*") if p.is_file() and (suffixes is None or p.suffix in suffixes)
            )
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise KilnError(f"input {name} does not exist (give text files or directories)")
    if not files:
        raise KilnError(
            f"no input files found in {inputs}" + (f" with suffixes {suffixes}" if suffixes else "")
        )
    return files, sum(p.stat().st_size for p in files)


def _texts(files: list[Path], explicit: set[Path], skipped: list[Path]) -> Iterator[str]:
    for path in files:
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise KilnError(f"cannot read {path}: {e.strerror}") from e
        try:
            if b"\0" in raw[:8192]:  # binary, though it may decode (as kiln run's --data reads directories)
                raise UnicodeDecodeError("utf-8", raw, raw.index(b"\0"), raw.index(b"\0") + 1, "NUL byte")
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if path in explicit:
                raise KilnError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from e
            skipped.append(path)  # a binary file found while walking a directory


def _read_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"cannot read chat template {path}: {e}") from e


def _train(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.tokenizer import train_bpe

    if args.processes is not None and args.processes < 1:
        raise KilnError(f"--processes must be >= 1 (or left out: all cores), got {args.processes}")
    if args.min_frequency < 1:
        raise KilnError(
            f"--min-frequency must be >= 1 (a merge must occur at least once), got {args.min_frequency}"
        )
    _check_out(args.out, file=False, force=args.force)
    files, n_bytes = _read_text_files(args.inputs, args.ext)
    template = _read_template(args.chat_template)
    specials = tuple(args.special) if args.special else ("<|endoftext|>",)
    skipped: list[Path] = []
    explicit = {Path(n) for n in args.inputs if Path(n).is_file()}
    print(
        f"training on {len(files)} files ({n_bytes / 1e6:.1f} MB), vocab {args.vocab_size}, pattern {args.pattern}"
    )
    t0 = time.perf_counter()
    tok = train_bpe(
        _texts(files, explicit, skipped),
        args.vocab_size,
        pattern=args.pattern,
        special_tokens=specials,
        min_frequency=args.min_frequency,
        processes=args.processes,
    )
    seconds = time.perf_counter() - t0
    options = {"chat_template": template} if template is not None else {}
    tok.save(args.out, **options)
    if skipped:
        print(
            f"kiln: note: skipped {len(skipped)} file(s) that are binary or not UTF-8 text (e.g. {skipped[0]})",
            file=sys.stderr,
        )
    print(f"trained {tok.n_vocab} ids in {seconds:.1f} s -> {args.out}")
    return 0


def _allowed(spec: str) -> str | set[str]:
    if spec == "all":
        return "all"
    if spec == "none":
        return set()
    return {s for s in spec.split(",") if s}


def _encode(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.tokenizer import DisallowedSpecialError, Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    if args.text is not None and args.file is not None:
        raise KilnError("give the text as an argument or with --file, not both")
    allowed = _allowed(args.allowed_special)
    sources = args.file if args.file is not None else [None]
    for name in tqdm(sources, desc="encoding", unit="file", disable=len(sources) < 2, leave=False):
        if name is None:
            text = args.text if args.text is not None else sys.stdin.read()
        else:
            try:
                text = Path(name).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise KilnError(f"cannot read {name} as UTF-8 text: {e}") from e
        try:
            ids = tok.encode(text, allowed_special=allowed)
        except DisallowedSpecialError as e:
            raise KilnError(
                f"the text contains the special token {e.token!r}; pass --allowed-special all (or a "
                f"comma-separated list) to encode special tokens as their ids"
            ) from e
        print(json.dumps(ids) if args.json else " ".join(map(str, ids)))
    return 0


def _decode(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.tokenizer import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    raw = " ".join(args.ids) if args.ids else sys.stdin.read()
    words = raw.replace(",", " ").replace("[", " ").replace("]", " ").split()
    try:
        ids = [int(w) for w in words]
    except ValueError as e:
        raise KilnError(f"token ids must be integers: {e}") from e
    try:
        sys.stdout.write(tok.decode(ids) + "\n")
    except ValueError as e:
        raise KilnError(str(e)) from e
    return 0


def _convert(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.tokenizer import Tokenizer, formats

    source = Path(args.source)
    _check_out(args.out, file=args.to == "tiktoken", force=args.force)
    if source.is_file() and source.suffix != ".json":
        # A tiktoken ranks file: the pattern and the special tokens are not in the file.
        if args.pattern is None:
            raise KilnError(f"{source} looks like a tiktoken ranks file: give --pattern (e.g. gpt4)")
        specials = {}
        for item in args.special or []:
            name, _, value = item.rpartition("=")
            if not name or not value.isdigit():
                raise KilnError(f"--special takes NAME=ID, got {item!r}")
            specials[name] = int(value)
        tok = Tokenizer.from_tiktoken(source, args.pattern, specials)
    else:
        if args.pattern is not None or args.special:
            raise KilnError("--pattern and --special apply only to a tiktoken ranks file source")
        tok = Tokenizer.load(source)
    template = _read_template(args.chat_template)
    if template is not None and args.to not in ("hf", "kiln"):
        raise KilnError("--chat-template is saved only with --to hf or --to kiln")
    if args.to == "kiln":
        tok.save(args.out, **({"chat_template": template} if template is not None else {}))
    elif args.to == "hf":
        formats.save_hf(tok, args.out, chat_template=template)
    elif args.to == "gpt2":
        formats.save_gpt2(tok, args.out)
    else:
        if tok.merges is not None:
            print(
                "note: this vocabulary has an explicit merge list; a tiktoken file keeps only ranks (ids), "
                "which encodes identically only when merges follow id order",
                file=sys.stderr,
            )
        formats.save_tiktoken(tok.vocab, args.out)
    print(f"wrote {args.to} tokenizer ({tok.n_vocab} ids) -> {args.out}")
    return 0
