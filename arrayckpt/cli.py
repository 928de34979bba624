"""The ``arrayckpt`` command line: inspect checkpoints without writing Python.

``arrayckpt info PATH`` prints a table of tensors (dtype, shape, size, codec) and plain values;
``--json`` prints the same as JSON for scripts.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from ._errors import ArrayckptError
from ._reader import Checkpoint, LazyArray, open_checkpoint

__all__ = ["main"]


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def codec_name(array: LazyArray) -> str:
    """A short description of an array's codec pipeline (``zstd(3)``, ``blosc(zstd,5,bitshuffle)``)."""
    codecs = array.metadata.get("codecs", [])
    if codecs and codecs[0].get("name") == "sharding_indexed":
        codecs = codecs[0]["configuration"]["codecs"]
    for codec in codecs:
        name, config = codec.get("name"), codec.get("configuration", {})
        if name == "zstd":
            return f"zstd({config.get('level')})"
        if name == "blosc":
            return f"blosc({config.get('cname')},{config.get('clevel')},{config.get('shuffle')})"
    return "none"


def info_dict(checkpoint: Checkpoint) -> dict[str, Any]:
    """Everything ``info`` shows, as plain JSON-able data."""
    from ._format import PickleEntry

    values: dict[str, Any] = {}
    for key in checkpoint.plain_values:
        entry = checkpoint.manifest.entries[key]
        values[key] = {"pickled": entry.nbytes} if isinstance(entry, PickleEntry) else checkpoint.value(key)
    return {
        "path": str(checkpoint.location),
        "format_version": checkpoint.manifest.format_version,
        "step": checkpoint.step,
        "created": dict(checkpoint.manifest.created),
        "tensors": {
            key: {
                "dtype": a.entry.dtype.name,
                "shape": list(a.shape),
                "nbytes": a.nbytes,
                "codec": codec_name(a),
                "kind": a.entry.kind,
            }
            for key, a in checkpoint.items()
        },
        "values": values,
        "total_bytes": checkpoint.nbytes,
    }


def _print_info(info: dict[str, Any]) -> None:
    print(f"checkpoint {info['path']}  (format v{info['format_version']}, step {info['step']})")
    created = info["created"]
    if created:
        print("created   " + ", ".join(f"{k}={v}" for k, v in created.items()))
    rows = [(k, t["dtype"], "×".join(map(str, t["shape"])) or "scalar", human_bytes(t["nbytes"]), t["codec"])
            for k, t in info["tensors"].items()]
    header = ("key", "dtype", "shape", "size", "codec")
    widths = [max([len(header[i])] + [len(r[i]) for r in rows]) for i in range(5)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.ljust(w) if i != 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    print(f"\n{len(rows)} tensors, {human_bytes(info['total_bytes'])}")
    if info["values"]:
        print("\nvalues")
        for key, value in info["values"].items():
            text = repr(value)
            print(f"  {key} = {text if len(text) < 100 else text[:97] + '...'}")


def _cmd_info(args: argparse.Namespace) -> int:
    info = info_dict(open_checkpoint(args.path))
    if args.json:
        json.dump(info, sys.stdout, indent=2, default=repr)
        print()
    else:
        _print_info(info)
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from ._storage import collect_garbage

    removed = collect_garbage(args.root, min_age_s=args.min_age, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    print(f"{len(removed)} leftover(s) {verb}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arrayckpt", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="list the tensors and values of a checkpoint")
    info.add_argument("path", help="checkpoint directory (or file:// URL)")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.set_defaults(func=_cmd_info)
    gc = commands.add_parser("gc", help="remove what interrupted saves left in a directory")
    gc.add_argument("root", help="directory holding checkpoints")
    gc.add_argument("--min-age", type=float, default=3600.0, metavar="SECONDS",
                    help="only remove leftovers untouched this long (default 3600: never a running save's)")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed")
    gc.set_defaults(func=_cmd_gc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ArrayckptError as e:
        print(f"arrayckpt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
