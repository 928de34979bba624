"""``arrayckpt report CKPT [--against OTHER] -o report.html``: the command-line side of :func:`arrayckpt.report`.

Building the parser imports nothing heavy (no numpy, TensorStore or matplotlib); the command imports the report
(``_tools/report/``) when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys

from .common import Commands, add_base_root_option
from .text import emit

__all__ = ["add_report"]


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def add_report(subparsers: Commands) -> argparse.ArgumentParser:
    """Add the ``report`` command to ``subparsers`` (what ``ArgumentParser.add_subparsers`` returned)."""
    parser = subparsers.add_parser(
        "report", help="write a picture of a checkpoint: one self-contained HTML file (sizes, statistics, "
                       "histograms, chunk grids, delta chain; with --against, which tensors and layers moved)")
    parser.add_argument("path", help="checkpoint directory or URL")
    parser.add_argument("--against", metavar="OTHER", default=None,
                        help="another checkpoint: rank the tensors by relative change ||a - b|| / ||b|| against it")
    parser.add_argument("-o", "--output", default="report.html", help="the HTML file to write (default report.html)")
    parser.add_argument("--png", metavar="PATH", default=None, help="also write the main pictures as one PNG")
    parser.add_argument("--max-tensors", type=_count, default=None, metavar="N",
                        help="statistics of the N largest tensors only (default: every tensor)")
    parser.add_argument("--histograms", type=_count, default=8, metavar="N",
                        help="value histograms of the N largest tensors (default 8)")
    parser.add_argument("--grids", type=_count, default=6, metavar="N",
                        help="chunk grid pictures of the N largest tensors (default 6)")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    add_base_root_option(parser)
    parser.set_defaults(func=cmd_report)
    return parser


def cmd_report(args: argparse.Namespace) -> int:
    """Run ``arrayckpt report``; 0 when written, 1 when written but some tensor could not be read (damage: said on
    stderr, as ``verify`` exits 1 on damage), 2 when matplotlib is missing (errors of reading the checkpoints
    propagate to ``main``, which prints them)."""
    from .._tools.report.build import write_report

    try:
        output, data = write_report(args.path, against=args.against, output=args.output, overview=args.png,
                                    max_tensors=args.max_tensors, histograms=args.histograms, grids=args.grids,
                                    base_roots=args.base_root)
    except ModuleNotFoundError as e:
        if e.name != "matplotlib":
            raise
        emit(f"arrayckpt: error: {e}", file=sys.stderr)
        return 2
    unreadable = [t for t in data.tensors if t.error]
    written = {"output": str(output), "bytes": output.stat().st_size, **({"png": args.png} if args.png else {}),
               "unreadable": [t.key for t in unreadable]}
    if args.json:
        print(json.dumps(written))
    else:
        extra = f" and {args.png}" if args.png else ""
        emit(f"wrote {output} ({written['bytes'] / 1024:.0f} KiB){extra}")
    if not unreadable:
        return 0
    first = unreadable[0]
    what = ("no tensor could be read" if len(unreadable) == len(data.tensors) else
            f"{len(unreadable)} of {len(data.tensors)} tensors could not be read")
    emit(f"arrayckpt: error: {what} (the report lists them; `arrayckpt verify` names every damaged chunk): "
          f"{first.key!r}: {' '.join(str(first.error).split())}", file=sys.stderr)
    return 1
