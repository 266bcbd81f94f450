"""The `kiln` command. Each area registers its own subcommands; this file only wires them."""

from __future__ import annotations

import argparse
import sys

from kiln.errors import KilnError


def version() -> str:
    """The installed distribution's version; kiln.__version__ when kiln runs from a source tree."""
    from importlib import metadata

    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:
        import kiln

        return kiln.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln: an LLM stack from tokens to silicon")
    parser.add_argument("--version", action="version", version=f"kiln {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    from kiln.train import cli as train_cli

    train_cli.register(sub)
    from kiln.tokenizer import cli as tokenizer_cli

    tokenizer_cli.register(sub)
    from kiln.model import cli as model_cli

    model_cli.register(sub)
    from kiln.infer import cli as infer_cli

    infer_cli.register(sub)
    from kiln.quant import cli as quant_cli

    quant_cli.register(sub)
    from kiln.serve import cli as serve_cli

    serve_cli.register(sub)
    from kiln.profile import cli as profile_cli

    profile_cli.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args, extra) or 0)
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
