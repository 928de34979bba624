"""The ``arrayckpt sync SRC DST`` command (:func:`arrayckpt.copy` on the command line), kept apart from ``copy.py`` so
that building the command line's parser imports nothing heavy (``arrayckpt estimate`` needs no TensorStore)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_base_root_option", "add_sync_parser", "sync_command"]


def add_sync_parser(commands: Any) -> Any:
    """Add the ``sync`` command to the ``arrayckpt`` command line's subparsers; returns its parser."""
    sync = commands.add_parser("sync", help="copy a committed checkpoint (and its chain of bases) to another "
                                            "location as stored, checking every chunk; the copy commits last")
    sync.add_argument("src", help="checkpoint directory or URL (s3://bucket/prefix, gs://...)")
    sync.add_argument("dst", help="where the copy goes (a delta's bases go to the same relative places)")
    sync.add_argument("--overwrite", action="store_true", help="replace another committed checkpoint at dst")
    sync.add_argument("--max-rate", type=_rate, default=None, metavar="RATE",
                      help="at most this many bytes per second (e.g. 100MB, 1GiB)")
    sync.add_argument("--read-back", action="store_true", help="read every copied file back and compare it")
    sync.add_argument("--json", action="store_true", help="print JSON")
    add_base_root_option(sync)
    sync.set_defaults(func=sync_command)
    return sync


def add_base_root_option(parser: argparse.ArgumentParser) -> None:
    """``--base-root DIR_OR_URL`` (repeatable), for the commands that read a delta checkpoint's chain of bases:
    where bases may be besides the directory (prefix) holding each checkpoint (spec §10.1)."""
    parser.add_argument("--base-root", action="append", default=None, metavar="DIR_OR_URL",
                        help="also read (and, for sync, place) a delta checkpoint's bases inside this directory or "
                             "URL; repeatable (by default only bases beside the checkpoint are read: spec §10.1)")


def sync_command(args: argparse.Namespace) -> int:
    """``arrayckpt sync SRC DST``: exit status 0 when the destination holds the checkpoint (copied or already
    there); errors (damage in the source: nothing committed) are raised to the command line's handler."""
    show = sys.stderr.isatty() and not args.json

    def progress(done: int, total: int) -> None:
        percent = 100 * done / total if total else 100.0
        print(f"\rsync: {done / 2**20:.1f} of {total / 2**20:.1f} MiB ({percent:.0f}%)", end="", file=sys.stderr,
              flush=True)

    try:
        from .copy import copy

        result = copy(args.src, args.dst, overwrite=args.overwrite, max_bytes_per_second=args.max_rate,
                      read_back=args.read_back, progress=progress if show else None, base_roots=args.base_root)
    finally:
        if show:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        print()
        return 0
    if not result.copied:
        print(f"{result.destination} already holds {result.source} (id {result.id}): nothing to copy")
        return 0
    print(f"copied {result.source} -> {result.destination}: {len(result.copied)} checkpoint(s) "
          f"({', '.join(result.copied)}), {result.objects} chunk files, {result.bytes_copied / 2**20:.1f} MiB")
    if result.skipped:
        print(f"already in place: {', '.join(result.skipped)}")
    return 0


def _rate(text: str) -> float:
    """``100MB``, ``1.5GiB``, ``500000`` -> bytes per second."""
    units = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    number = text.strip().lower().removesuffix("/s").removesuffix("b")
    digits = number.rstrip("kmgi")
    try:
        value = float(digits) * units[number[len(digits):]]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate; write e.g. 100MB, 1GiB or 500000") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the rate must be positive")
    return value
