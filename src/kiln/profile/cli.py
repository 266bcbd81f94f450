"""`kiln profile ceilings|roofline|decode`: the device's measured ceilings, every kernel on the roofline,
and one decode step taken apart kernel by kernel (docs/profile.md)."""

from __future__ import annotations

import argparse


def _ceilings(args: argparse.Namespace, extra: list[str]) -> int:
    import torch

    from kiln.errors import KilnError
    from kiln.profile.ceilings import ceilings_rows, load_or_measure_ceilings
    from kiln.profile.report import format_table, write_json

    if not torch.cuda.is_available():
        raise KilnError("kiln profile ceilings measures a CUDA GPU; this machine has none")
    doc = load_or_measure_ceilings(torch.device("cuda"), args.refresh, log=print)
    how = "read from the cache" if doc["cached"] else f"measured in {doc['measure_s']} s"
    print(f"{doc['device_name']}, torch {doc['torch']}: {how} ({doc['cache_path']})")
    print(format_table(ceilings_rows(doc), [("ceiling", "ceiling"), ("value", "value"), ("unit", "unit"),
                                             ("method", "method")]))  # fmt: skip
    if args.out:
        print(f"wrote {write_json(args.out, doc)}")
    return 0


def _roofline(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.profile import roofline

    return roofline.main(args)


def _decode(args: argparse.Namespace, extra: list[str]) -> int:
    from kiln.profile import decode

    return decode.main(args)


SHAPES = ("qwen2.5-1.5b",)  # kiln.profile.decode.shape_config


def _roofline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", help="comma-separated op names (default: all of the catalog)")
    p.add_argument("--out", default="profile/roofline", help="directory for roofline.json and roofline.png")
    p.add_argument(
        "--smoke", action="store_true", help="CPU: each op once at tiny shapes (TRITON_INTERPRET=1)"
    )
    p.add_argument("--refresh", action="store_true", help="measure the ceilings again first")


def _decode_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model", help="a model directory, HF checkpoint or run (as `kiln generate --checkpoint`)"
    )
    src.add_argument("--shape", choices=SHAPES, help="a known shape with random weights")
    p.add_argument(
        "--batch", default="1", help="sequences decoding in the step; a comma list runs each (default 1)"
    )
    p.add_argument("--context", type=int, default=512, help="keys per sequence at the step (default 512)")
    p.add_argument(
        "--graphs", default="on", help="CUDA graphs for the decode step: on, off, or on,off for both"
    )
    p.add_argument(
        "--quant",
        help="quantize the model first (round to nearest, head included, as `kiln quantize`): int8, int4-g32, "
        "int4-g64, int4-g128 or fp8",
    )
    p.add_argument("--steps", type=int, default=5, help="steps profiled; the median one is reported")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    p.add_argument("--out", default="profile/decode", help="directory for the JSON, CSV, PNGs and trace")
    p.add_argument("--refresh", action="store_true", help="measure the ceilings again first")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measured ceilings, every kernel on the roofline, one decode step kernel by kernel",
        description=__doc__,
    )
    what = p.add_subparsers(dest="what", required=True)
    c = what.add_parser("ceilings", help="measure (or read the cached) bandwidth, matmul and launch ceilings")
    c.add_argument("--out", help="also write the ceilings JSON here")
    c.add_argument("--refresh", action="store_true", help="measure again even when cached")
    c.set_defaults(func=_ceilings)
    r = what.add_parser("roofline", help="every kiln kernel at its benchmark shape on the roofline")
    _roofline_arguments(r)
    r.set_defaults(func=_roofline)
    d = what.add_parser("decode", help="one engine decode step attributed kernel by kernel")
    _decode_arguments(d)
    d.set_defaults(func=_decode)
