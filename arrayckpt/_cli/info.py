"""``arrayckpt info PATH``: a table of tensors (dtype, shape, size, codec, chunks; how a delta stores each) and plain
values; ``--tree`` as a tree of the dotted keys; ``--json`` everything, for scripts. Reads the root document only."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .._errors import ArrayckptError
from .._format.jsontypes import JSON, json_object, member
from .common import Commands, print_json

if TYPE_CHECKING:
    from .._read.checkpoint import Checkpoint, LazyArray

__all__ = ["add_info", "chain_info", "chunk_grid", "codec_name", "info_dict", "per_rank_info"]


def add_info(commands: Commands) -> argparse.ArgumentParser:
    """Add ``info`` to the command line's subparsers."""
    info = commands.add_parser("info", help="list the tensors and values of a checkpoint")
    info.add_argument("path", help="checkpoint directory (or file:// URL)")
    info.add_argument("--json", action="store_true", help="print JSON instead of a table")
    info.add_argument("--tree", action="store_true", help="print the keys as a tree of their dotted parts")
    info.add_argument("--wide", action="store_true", help="print long keys, values and records in full, however "
                      "wide the terminal (default: every line fits it; --json: everything, for scripts)")
    info.set_defaults(func=cmd_info)
    return info


def cmd_info(args: argparse.Namespace) -> int:
    from .._read.checkpoint import open_checkpoint

    with open_checkpoint(args.path, base_roots=args.base_root) as checkpoint:  # closing it closes the bases too
        info = info_dict(checkpoint)
    from .text import emit, info_lines, terminal_width, tree_lines, zarr_hint

    width = 0 if args.wide else terminal_width()
    if args.json:
        print_json(info)
    elif args.tree:
        emit(*tree_lines(info, width))
    else:
        note = zarr_hint(str(json_object(t).get("dtype")) for t in json_object(info["tensors"]).values())
        emit(*info_lines(info, width, [note] if note else []))
    return 0


def codec_name(array: LazyArray) -> str:
    """A short description of an array's codec pipeline (``zstd(3)``, ``blosc(zstd,5,bitshuffle)``)."""
    codecs = array.metadata.get("codecs", [])
    if isinstance(codecs, list) and codecs and json_object(codecs[0]).get("name") == "sharding_indexed":
        codecs = member(codecs[0], "configuration", "codecs")
    for codec in codecs if isinstance(codecs, list) else []:
        name, config = json_object(codec).get("name"), json_object(json_object(codec).get("configuration"))
        if name == "zstd":
            return f"zstd({config.get('level')})"
        if name == "blosc":
            return f"blosc({config.get('cname')},{config.get('clevel')},{config.get('shuffle')})"
    return "none"


def info_dict(checkpoint: Checkpoint) -> JSON:
    """Everything ``info`` shows, as plain JSON-able data."""
    from .._format.manifest import PickleEntry
    from .._tools.report.layout import stored_text

    values: JSON = {}
    for key in checkpoint.plain_values:
        entry = checkpoint.manifest.entries[key]
        values[key] = {"pickled": entry.nbytes} if isinstance(entry, PickleEntry) else checkpoint.plain_values[key]
    return {
        "path": str(checkpoint.location),
        "format_version": checkpoint.manifest.format_version,
        "packs": None if (packs := checkpoint.manifest.packs) is None else {
            "files": len(packs.packs), "bytes": sum(pack.size for pack in packs.packs),
            "index_bytes": packs.index_size},
        "step": checkpoint.step,
        "per_rank": per_rank_info(checkpoint),
        "created": dict(checkpoint.manifest.created),
        "tensors": {
            key: {
                "dtype": a.entry.dtype.name,
                "shape": list(a.shape),
                "nbytes": a.nbytes,
                "codec": codec_name(a),
                "kind": a.entry.kind,
                "stored": stored_text(a),
                "chunks": chunk_grid(checkpoint, key),
            }
            for key, a in checkpoint.items() if a.key == key  # a tensor stored once, not its aliases
        },
        "aliases": dict(checkpoint.aliases()),
        "values": values,
        "total_bytes": checkpoint.nbytes,
        "stored_bytes": checkpoint.manifest.stored_bytes,
        "chain": chain_info(checkpoint),
    }


def chunk_grid(checkpoint: Checkpoint, key: str) -> list[int]:
    """Chunks per dimension of the array that holds the tensor's layout (its own, or its base's for a rows
    delta): the sharding at save, since chunks follow the ranks' shards (``[4, 1]``: split over rows in 4)."""
    from .._read.chain import dense_metadata
    from .._read.checkpoint import stored_of

    try:
        metadata = dense_metadata(stored_of(checkpoint), key)
    except ArrayckptError:  # a rows delta whose base cannot be read: `info` reports the chain's error instead
        return []
    from .._format.zarr import grid_counts

    return grid_counts(metadata)


def chain_info(checkpoint: Checkpoint) -> list[JSON]:
    """The checkpoint and its bases, newest first; an unreadable base ends the list with its error."""
    out: list[JSON] = []
    layer: Checkpoint | None = checkpoint
    while layer is not None:
        out.append({"path": str(layer.location), "step": layer.step, "id": layer.manifest.id,
                    "stored_bytes": layer.manifest.stored_bytes, "delta": layer.manifest.base is not None})
        base = layer.manifest.base
        if base is None:
            break
        try:
            layer = layer.base
        except ArrayckptError as e:
            out.append({"path": base.path, "error": str(e)})
            layer = None
    return out


def per_rank_info(checkpoint: Checkpoint) -> dict[str, list[str]]:
    """Each per-rank entry (``rng``...) as what each rank holds (``uint8[5056]``, ``value``, ``-``: none), from
    the manifest alone (no torch, nothing read)."""
    from .._format.manifest import ArrayEntry, PerRankEntry

    def describe(item: object) -> str:
        if isinstance(item, ArrayEntry):
            return f"{item.dtype.name}[{', '.join(map(str, item.shape))}]"
        return "-" if item is None else "value"

    return {key: [describe(item) for item in entry.items]
            for key, entry in checkpoint.manifest.entries.items() if isinstance(entry, PerRankEntry)}
