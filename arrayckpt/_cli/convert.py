"""The longer parts of the command line, kept out of ``cli.py``: saying what a path holds when it is not an
arrayckpt checkpoint, turning library error text into command-line wording, ``gc`` and ``convert``.

No torch or TensorStore at import: ``arrayckpt --help`` imports this module.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._errors import FormatError

if TYPE_CHECKING:
    from ._read.checkpoint import Checkpoint

__all__ = ["cli_message", "cmd_convert", "cmd_gc", "info_header", "per_rank_info", "per_rank_values",
           "ranks_text"]



def cli_message(error: BaseException) -> str:
    """An error's text in command-line terms (``--overwrite``, not ``overwrite=True``), on one line."""
    text = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    text = text.replace("pass overwrite=True (--overwrite)", "pass --overwrite")
    text = text.replace("with overwrite=True", "with --overwrite").replace("overwrite=True", "--overwrite")
    return " ".join(text.split()) or type(error).__name__


def cmd_gc(args: argparse.Namespace) -> int:
    from ._storage import parse_location

    # what interrupted saves left right below the root; what looks like it but stays is reported with why
    found, kept = parse_location(args.root).leftovers(args.min_age)
    removed = [leftover.url for leftover in found if args.dry_run or leftover.remove()]
    if args.json:
        report: dict[str, Any] = {"removed" if not args.dry_run else "would_remove": removed}
        if kept:
            report["kept"] = [{"path": path, "reason": reason} for path, reason in kept]
        print(json.dumps(report))
        return 0
    for path in removed:
        print(f"{'would remove' if args.dry_run else 'removed'} {path}")
    for path, reason in kept:
        print(f"kept {path}: {reason}")
    n = len(removed)
    what = f"{n} leftover{'' if n == 1 else 's'}"
    summary = f"would remove {what}" if args.dry_run else f"removed {what}"
    if kept:
        summary += (f"; kept {len(kept)} (listed above with why; --min-age SECONDS lowers the age a temporary "
                    f"directory needs before it is removed)")
    elif not n:
        summary = f"nothing to remove in {args.root}"
    print(summary)
    return 0


def cmd_convert(args: argparse.Namespace, counter: Any, human_bytes: Any) -> int:
    from ._convert.dispatch import convert

    try:
        result = convert(args.src, args.dst, from_format=args.from_format, to_format=args.to_format,
                         overwrite=args.overwrite, allow_pickle=args.allow_pickle,
                         max_shard_bytes=args.max_shard_size, select=args.select, tie=dict(args.tie) or None,
                         config=args.config, progress=counter, base_roots=args.base_root,
                         param_names=_param_names(args.param_names))
    finally:
        counter.close()
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        print()
        return 0
    took = f" ({result.selected}* with the prefix stripped)" if result.selected else ""
    print(f"converted {result.source_format} {args.src} -> {result.target_format} {args.dst}: {result.tensors} "
          f"tensors{took}, {human_bytes(result.bytes)}")
    if result.tied:
        print("left out as tied: " + ", ".join(f"{alias} (= {name})" for alias, name in result.tied.items()))
    if result.skipped:
        shown = ", ".join(result.skipped[:10]) + (f" ... ({len(result.skipped)} in all)" if len(result.skipped) > 10
                                                  else "")
        why = "not the model's weights" if result.target_format == "hf" else f"{result.target_format} cannot hold them"
        print(f"not converted ({why}): {shown}", file=sys.stderr)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def _param_names(path: str | None) -> list[str] | None:
    """``--param-names FILE``: one name per line (blank lines ignored)."""
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise FormatError(f"{path}: cannot read the parameter names: {e.strerror or e}") from None
    return [line.strip() for line in text.splitlines() if line.strip()]


def per_rank_info(checkpoint: Checkpoint) -> dict[str, list[str]]:
    """Each per-rank entry (``rng``...) as what each rank holds (``uint8[5056]``, ``value``, ``-``: none), from
    the manifest alone (no torch, nothing read)."""
    from ._format.manifest import ArrayEntry, PerRankEntry

    def describe(item: object) -> str:
        if isinstance(item, ArrayEntry):
            return f"{item.dtype.name}[{', '.join(map(str, item.shape))}]"
        return "-" if item is None else "value"

    return {key: [describe(item) for item in entry.items]
            for key, entry in checkpoint.manifest.entries.items() if isinstance(entry, PerRankEntry)}


def per_rank_values(checkpoint: Checkpoint, key: str) -> list[str]:
    """Each rank's part of a per-rank entry, in words: a value as it is, a tensor by dtype and shape (the values
    themselves: ``Checkpoint.per_rank`` in Python)."""
    from ._format.manifest import ArrayEntry, PerRankEntry
    from ._format.values import decode_value

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


def info_header(info: dict[str, Any]) -> str:
    """``checkpoint PATH  (format v1, step 3)``; the step recorded at save, else a plain value ``step``, labelled."""
    step = info["step"]
    if step is None:
        value = info["values"].get("step")
        step = "none recorded" if not isinstance(value, int) else f"none recorded; the value `step` is {value}"
    return f"checkpoint {info['path']}  (format v{info['format_version']}, step {step})"


def ranks_text(ranks: list[str]) -> str:
    """``per rank (2 ranks): uint8[5056] each`` or each rank's."""
    same = len(set(ranks)) == 1
    count = f"{len(ranks)} rank{'' if len(ranks) == 1 else 's'}"
    return f"per rank ({count}): " + (f"{ranks[0]} each" if same else ", ".join(ranks))
