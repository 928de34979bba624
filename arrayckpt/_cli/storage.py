"""``arrayckpt gc ROOT`` (remove what interrupted saves left, and only that), ``sync SRC DST``
(:func:`arrayckpt.copy`: a committed checkpoint and its chain copied as stored, checked, committed last) and
``refs PATH`` (:func:`arrayckpt.write_refs`: a packed checkpoint's kerchunk references, written on demand)."""

from __future__ import annotations

import argparse
import json
import sys

from .._format.jsontypes import JSON
from .common import Commands, add_base_root_option, print_json
from .text import emit

__all__ = ["add_gc", "add_refs", "add_sync"]


def add_gc(commands: Commands) -> argparse.ArgumentParser:
    """Add ``gc`` to the command line's subparsers."""
    gc = commands.add_parser("gc", help="remove what interrupted saves left in a directory or under a prefix "
                                        "(s3://bucket/run: its incomplete checkpoints)")
    gc.add_argument("root", help="directory, or object-storage prefix (s3://bucket/run), holding checkpoints")
    gc.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                    help="only remove leftovers untouched this long (default 3600; on object storage without "
                         "modification times, memory:// or S3/GCS without s3fs/gcsfs, only 0 removes). A running "
                         "save's is never removed, at any age: its lock or lease marks it (spec §9.4)")
    gc.add_argument("--memory", metavar="DIR", action="append", default=[],
                    help="also remove the peer-memory directories of ended jobs right below DIR (e.g. "
                         "/dev/shm/arrayckpt-UID, where PeerMemory keeps them by default): your own, that no running "
                         "manager holds, untouched for --min-age, holding only arrayckpt's files (others are listed "
                         "as kept, with why). May be repeated")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed")
    gc.add_argument("--json", action="store_true", help="print JSON")
    gc.set_defaults(func=cmd_gc)
    return gc


def cmd_gc(args: argparse.Namespace) -> int:
    from .._storage import parse_location

    # what interrupted saves left right below the root; what looks like it but stays is reported with why
    found, kept = parse_location(args.root).leftovers(args.min_age)
    removed = [leftover.url for leftover in found if args.dry_run or leftover.remove()]
    if args.memory:
        from pathlib import Path

        from .._peer.sweep import ended_memory_directories

        kept = list(kept)
        for parent in args.memory:
            swept = ended_memory_directories(Path(parent), args.min_age, remove=not args.dry_run)
            removed += swept.removed
            kept += swept.kept
    if args.json:
        report: JSON = {"removed" if not args.dry_run else "would_remove": removed}
        if kept:
            report["kept"] = [{"path": path, "reason": reason} for path, reason in kept]
        print(json.dumps(report))
        return 0
    for path in removed:
        emit(f"{'would remove' if args.dry_run else 'removed'} {path}")
    for path, reason in kept:
        emit(f"kept {path}: {reason}")
    n = len(removed)
    what = f"{n} leftover{'' if n == 1 else 's'}"
    summary = f"would remove {what}" if args.dry_run else f"removed {what}"
    if kept:
        summary += (f"; kept {len(kept)} (listed above with why; --min-age SECONDS lowers the age a temporary "
                    f"directory needs before it is removed)")
    elif not n:
        summary = f"nothing to remove in {args.root}"
    emit(summary)
    return 0


def add_sync(commands: Commands) -> argparse.ArgumentParser:
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
    sync.set_defaults(func=cmd_sync)
    return sync


def cmd_sync(args: argparse.Namespace) -> int:
    """``arrayckpt sync SRC DST``: exit status 0 when the destination holds the checkpoint (copied or already
    there); errors (damage in the source: nothing committed) are raised to the command line's handler."""
    show = sys.stderr.isatty() and not args.json

    def progress(done: int, total: int) -> None:
        percent = 100 * done / total if total else 100.0
        print(f"\rsync: {done / 2**20:.1f} of {total / 2**20:.1f} MiB ({percent:.0f}%)", end="", file=sys.stderr,
              flush=True)

    try:
        from .._tools.copy import copy

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
        emit(f"{result.destination} already holds {result.source} (id {result.id}): nothing to copy")
        return 0
    emit(f"copied {result.source} -> {result.destination}: {len(result.copied)} checkpoint(s) "
          f"({', '.join(result.copied)}), {result.objects} chunk files, {result.bytes_copied / 2**20:.1f} MiB")
    if result.skipped:
        emit(f"already in place: {', '.join(result.skipped)}")
    return 0


def add_refs(commands: Commands) -> argparse.ArgumentParser:
    """Add the ``refs`` command to the ``arrayckpt`` command line's subparsers; returns its parser."""
    refs = commands.add_parser("refs", help="write refs.json, the kerchunk references through which zarr-python reads "
                                            "a packed checkpoint without arrayckpt (a save writes them only up to "
                                            "refs_max_chunks chunks); replaces any there")
    refs.add_argument("path", help="packed checkpoint directory or URL (s3://bucket/prefix, gs://...)")
    refs.add_argument("--json", action="store_true", help="print JSON")
    add_base_root_option(refs)
    refs.set_defaults(func=cmd_refs)
    return refs


def cmd_refs(args: argparse.Namespace) -> int:
    """``arrayckpt refs PATH``: exit status 0 once the references are written; a checkpoint that is not packed, or
    whose pack index is damaged, is refused (nothing written) by the command line's handler, in one line."""
    from .._tools.estimate import human_bytes
    from .._tools.refs import write_refs

    result = write_refs(args.path, base_roots=args.base_root)
    if args.json:
        print_json(result.to_dict())
        return 0
    emit(f"wrote {result.refs}: kerchunk references of {result.chunks:,} chunk{'' if result.chunks == 1 else 's'} "
         f"({human_bytes(result.size)})")
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
