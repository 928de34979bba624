"""``arrayckpt verify PATH`` (every chunk read and checked; exit status 1 on damage), ``show PATH KEY [SLICE]``
(values and statistics of a tensor, or a plain value), ``diff A B`` (exit status 1 when they differ)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .._tools.estimate import human_bytes
from .common import Commands, Counter, print_json
from .text import emit

if TYPE_CHECKING:
    from .._read.checkpoint import Checkpoint

__all__ = ["add_diff", "add_show", "add_verify", "per_rank_values"]

MAX_DAMAGE_LINES = 50


def add_verify(commands: Commands) -> argparse.ArgumentParser:
    """Add ``verify`` to the command line's subparsers."""
    verify = commands.add_parser("verify", help="read every chunk and check checksums and completeness "
                                                "(exit status 1 on damage)")
    verify.add_argument("path", help="checkpoint directory (or file:// URL)")
    verify.add_argument("--json", action="store_true", help="print JSON (every problem found)")
    verify.set_defaults(func=cmd_verify)
    return verify


def add_show(commands: Commands) -> argparse.ArgumentParser:
    """Add ``show`` to the command line's subparsers."""
    show = commands.add_parser("show", help="values and statistics of a tensor or a slice of it")
    show.add_argument("path", help="checkpoint directory (or file:// URL)")
    show.add_argument("key", help="dotted key, e.g. model.layers.0.weight")
    show.add_argument("slice", nargs="?", default="", type=slice_text,
                      help="numpy-style slice, e.g. '0:4,::2' or '...,-1' (default: everything)")
    show.add_argument("--max-values", type=int, default=1000, help="print values of selections up to this size")
    show.add_argument("--json", action="store_true", help="print JSON")
    show.set_defaults(func=cmd_show)
    return show


def add_diff(commands: Commands) -> argparse.ArgumentParser:
    """Add ``diff`` to the command line's subparsers."""
    diff = commands.add_parser("diff", help="compare two checkpoints (exit status 1 when they differ)")
    diff.add_argument("a", help="first checkpoint")
    diff.add_argument("b", help="second checkpoint")
    diff.add_argument("--json", action="store_true", help="print JSON")
    diff.set_defaults(func=cmd_diff)
    return diff


def print_zarr_hint(dtypes: Iterable[str]) -> None:
    """One note for bfloat16/float8 arrays when zarr-python run without arrayckpt cannot read them here."""
    import textwrap

    from .text import terminal_width, zarr_hint

    note = zarr_hint(dtypes)
    if note:
        width = terminal_width()
        emit(*(textwrap.wrap(note, width, subsequent_indent="      ") if width else [note]))


def cmd_verify(args: argparse.Namespace) -> int:
    from .._tools.verify import verify

    counter = Counter("verify")
    try:
        report = verify(args.path, progress=counter, base_roots=args.base_root)
    finally:
        counter.close()
    if args.json:
        print_json(report.to_dict())
        return 0 if report.ok else 1
    for damage in report.damage[:MAX_DAMAGE_LINES]:
        emit(f"DAMAGED {damage.key or '(checkpoint)'}: {damage.file}: {damage.problem}")
    if len(report.damage) > MAX_DAMAGE_LINES:
        emit(f"... and {len(report.damage) - MAX_DAMAGE_LINES} more (--json lists all)")
    checked = f"{report.arrays} arrays, {report.chunks} chunks, {human_bytes(report.bytes_checked)} checked"
    for what in report.unprotected:
        emit(f"unprotected: {what}")
    if report.ok:
        emit(f"OK {report.path}: {checked}")
        from .._read.checkpoint import open_checkpoint

        with open_checkpoint(args.path, base_roots=args.base_root) as checkpoint:
            print_zarr_hint(array.entry.dtype.name for array in checkpoint.values())
        return 0
    emit(f"DAMAGED {report.path}: {len(report.damage)} problem(s) in {len(report.damaged_keys)} entr"
          f"{'y' if len(report.damaged_keys) == 1 else 'ies'} ({checked})")
    return 1


def slice_text(text: str) -> str:
    """argparse type for SLICE: checked now, so a typo is a usage error, not a traceback."""
    from .._tools.inspect import parse_slice

    try:
        parse_slice(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def cmd_show(args: argparse.Namespace) -> int:
    from .._format.manifest import PerRankEntry, PickleEntry
    from .._read.checkpoint import open_checkpoint
    from .._tools.inspect import show

    with open_checkpoint(args.path, base_roots=args.base_root) as checkpoint:
        entry = checkpoint.manifest.entries.get(args.key)
        if entry is not None and args.key not in checkpoint:  # a plain value: show it as it is
            if isinstance(entry, PickleEntry):
                value: Any = f"<pickled value, {entry.nbytes} bytes; not unpickled>"
            elif isinstance(entry, PerRankEntry):
                value = per_rank_values(checkpoint, args.key)
                if not args.json:
                    emit(f"{args.key}: per rank ({len(value)} rank{'' if len(value) == 1 else 's'})",
                         *(f"  rank {rank}: {text}" for rank, text in enumerate(value)))
                    return 0
            else:
                value = checkpoint.plain_values[args.key]
            print_json({"key": args.key, "value": value}) if args.json else emit(f"{args.key} = {value!r}")
            return 0
        summary = show(checkpoint, args.key, args.slice, max_values=args.max_values)
    if args.json:
        print_json(summary.to_dict())
        return 0
    shape = "×".join(map(str, summary.shape)) or "scalar"
    selected = "×".join(map(str, summary.selected_shape)) or "scalar"
    where = f"[{args.slice}]" if args.slice else ""
    emit(f"{summary.key}{where}  {summary.dtype}  shape {shape}  selected {selected} ({summary.count} values)")
    if summary.count:
        emit(f"min {summary.min}  max {summary.max}  mean {summary.mean}  std {summary.std}  "
              f"nan {summary.nan_count}  inf {summary.inf_count}")
    if summary.values is not None:
        import numpy as np

        emit(*np.array2string(np.asarray(summary.values), threshold=args.max_values).splitlines())
    if summary.note:
        emit(f"({summary.note})")
    return 0


def per_rank_values(checkpoint: Checkpoint, key: str) -> list[str]:
    """Each rank's part of a per-rank entry, in words: a value as it is, a tensor by dtype and shape (the values
    themselves: ``Checkpoint.per_rank`` in Python)."""
    from .._format.manifest import ArrayEntry, PerRankEntry
    from .._format.values import decode_value

    entry = checkpoint.manifest.entries.get(key)
    if not isinstance(entry, PerRankEntry):
        raise KeyError(f"{checkpoint.location}: {key!r} is not a per-rank entry")
    out = []
    for item in entry.items:
        if isinstance(item, ArrayEntry):
            out.append(f"{item.kind} {item.dtype.name}[{', '.join(map(str, item.shape))}], {item.nbytes} bytes")
        else:
            text = "none (this rank did not hold it)" if item is None else repr(decode_value(item.value, key))
            out.append(text if len(text) < 200 else text[:197] + "...")
    return out


def cmd_diff(args: argparse.Namespace) -> int:
    from .._read.checkpoint import open_checkpoint
    from .._tools.inspect import diff

    roots = args.base_root
    with open_checkpoint(args.a, base_roots=roots) as a, open_checkpoint(args.b, base_roots=roots) as b:
        report = diff(a, b)
    if args.json:
        print_json(report.to_dict())
        return 0 if report.identical else 1
    for key in report.only_in_a:
        emit(f"only in A: {key}")
    for key in report.only_in_b:
        emit(f"only in B: {key}")
    for key, change in report.changed.items():
        emit(f"changed:   {key}: {change}")
    for t in report.tensors:
        if t.differing_elements:
            chunks = "" if t.differing_chunks is None else f", {t.differing_chunks}/{t.chunks} chunks"
            extra = f", {t.nonfinite} NaN/inf" if t.nonfinite else ""
            elements = f"{t.differing_elements} element{'' if t.differing_elements == 1 else 's'}"
            emit(f"differs:   {t.key}: {elements}{chunks}, max abs {t.max_abs:.6g}, "
                  f"max rel {t.max_rel:.6g}{extra}")
    for key, (was, now) in report.values.items():
        emit(f"value:     {key}: {was!r} -> {now!r}")
    same = sum(1 for t in report.tensors if not t.differing_elements)
    emit("identical" if report.identical else f"{same} of {len(report.tensors)} common tensors identical")
    return 0 if report.identical else 1
