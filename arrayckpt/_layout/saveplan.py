"""Save planning on the coordinator: validate the global picture, lay out arrays, assign writers.

Ranks send only metadata (:class:`LocalDescription`). The coordinator checks that every key has one
dtype and global shape, and that the distinct shards of each tensor tile it exactly (no overlap, no gap)
before a byte is written; chooses chunk grids aligned with the shard boundaries; and gives every
outer chunk exactly one writer, spreading replicated data over its replicas balanced by bytes
(Megatron's fully-parallel save, Orbax's replica-parallel writes).
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .._errors import StateError
from .._format.codecs import CodecChoice, resolve_codec
from .._format.dtypes import dtype_by_name
from .._format.keys import Key, array_path
from .._format.manifest import ArrayEntry, Entry, PerRankEntry, PickleEntry, ValueEntry, per_rank_path
from .._format.zarr import MAX_CHUNK_BYTES, node_documents
from .._layout.box import Box
from .._layout.chunking import DEFAULT_CHUNKING, ArrayPlan, ChunkPolicy, choose_chunks, shard_grid

MAX_SEGMENT_BYTES = 255  # the usual limit of one directory entry

__all__ = ["ArrayDescription", "LocalDescription", "SavePlan", "WriteTask", "plan_save", "with_key_encoding"]


@dataclass(frozen=True)
class ArrayDescription:
    """One rank's piece of one array leaf (metadata only)."""

    key: str
    parts: Key
    kind: Literal["tensor", "ndarray", "pickle"]
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    replica_id: int


@dataclass(frozen=True)
class LocalDescription:
    """Everything one rank holds, as metadata (plain values travel encoded; array data never travels)."""

    arrays: tuple[ArrayDescription, ...] = ()
    values: tuple[ValueEntry, ...] = ()
    per_rank: tuple[ValueEntry | ArrayEntry, ...] = ()
    containers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class WriteTask:
    """Write the part ``box`` (global coordinates) of array ``path`` from this rank's local piece of ``key``."""

    key: str
    path: str
    box: Box


@dataclass(frozen=True)
class SavePlan:
    """The coordinator's decisions: manifest entries, array layouts, and each rank's write tasks."""

    entries: dict[str, Entry]
    arrays: dict[str, ArrayPlan]  # by array path
    tasks: tuple[tuple[WriteTask, ...], ...]  # by rank
    containers: dict[str, str]
    bytes_by_rank: tuple[int, ...]
    documents: dict[str, bytes]  # serialised zarr.json of every array and intermediate group, by path
    consolidated_json: str  # the same documents as one JSON object, for the root's consolidated metadata


def plan_save(descriptions: list[LocalDescription], codec: CodecChoice,
              chunking: ChunkPolicy = DEFAULT_CHUNKING) -> SavePlan:
    """Validate and plan a save from every rank's description (index = rank).

    The array layout (validation, chunk grids, writer assignment) depends only on the ranks' array
    metadata, the codec choice and the chunk policy, so a repeated save with the same layout reuses the
    last one; plain and per-rank values are taken fresh every time.
    """
    world = len(descriptions)
    values: dict[str, ValueEntry] = {}
    per_rank: dict[str, dict[int, ValueEntry | ArrayEntry]] = defaultdict(dict)
    containers: dict[str, str] = {}
    for rank, description in enumerate(descriptions):
        for value in description.values:
            values.setdefault(value.key, value)  # the lowest rank holding a value wins
        for item in description.per_rank:
            per_rank[item.key][rank] = item
        containers.update(description.containers)
    layout = _layout(descriptions, codec, chunking)
    _check_kinds(layout.holders, values, per_rank)
    entries: dict[str, Entry] = {}
    for key in sorted(set(layout.entries) | set(values) | set(per_rank), key=_first_seen(descriptions)):
        if key in values:
            entries[key] = values[key]
        elif key in per_rank:
            parts = next(iter(per_rank[key].values())).parts
            entries[key] = PerRankEntry(key, parts, tuple(per_rank[key].get(r) for r in range(world)))
        else:
            entries[key] = layout.entries[key]
    return SavePlan(entries, layout.arrays, layout.tasks, containers, layout.loads, layout.documents,
                    layout.consolidated_json)


@dataclass(frozen=True)
class _Layout:
    """The cacheable part of a plan: array entries, array plans and writer assignment."""

    entries: dict[str, Entry]
    arrays: dict[str, ArrayPlan]
    tasks: tuple[tuple[WriteTask, ...], ...]
    loads: tuple[int, ...]
    holders: dict[str, list[int]]
    documents: dict[str, bytes]
    consolidated_json: str


_LAST_LAYOUT: list[tuple[Any, _Layout]] = []  # one entry: (layout key, layout)


def _layout_key(descriptions: list[LocalDescription], codec: CodecChoice, chunking: ChunkPolicy) -> Any:
    per_rank_arrays = tuple(tuple((i.key, i.dtype.name, i.shape) for i in d.per_rank if isinstance(i, ArrayEntry))
                            for d in descriptions)
    # the codec every array resolves to (a callable codec may answer differently from one save to the next)
    names = sorted({a.key for d in descriptions for a in d.arrays} | {i.key for d in descriptions for i in d.per_rank})
    codec_key = tuple(resolve_codec(codec, name) for name in names)
    return tuple(d.arrays for d in descriptions), per_rank_arrays, codec_key, chunking


def _layout(descriptions: list[LocalDescription], codec: CodecChoice, chunking: ChunkPolicy) -> _Layout:
    key = _layout_key(descriptions, codec, chunking)
    if _LAST_LAYOUT and _LAST_LAYOUT[0][0] == key:
        return _LAST_LAYOUT[0][1]
    world = len(descriptions)
    pieces: dict[str, list[tuple[int, ArrayDescription]]] = defaultdict(list)
    per_rank_arrays: dict[str, dict[int, ArrayEntry]] = defaultdict(dict)
    for rank, description in enumerate(descriptions):
        for piece in description.arrays:
            pieces[piece.key].append((rank, piece))
        for item in description.per_rank:
            if isinstance(item, ArrayEntry):
                per_rank_arrays[item.key][rank] = item
    entries: dict[str, Entry] = {}
    arrays: dict[str, ArrayPlan] = {}
    work: list[tuple[int, list[int], str, str, Box]] = []  # (bytes, candidate ranks, key, path, box)
    for name, holders in pieces.items():
        entries[name] = _plan_array(name, holders, codec, chunking, arrays, work)
    for name, items in per_rank_arrays.items():
        _plan_per_rank_arrays(name, items, codec, chunking, arrays, work)
    _check_paths(arrays)
    tasks, loads = _assign(work, world)
    documents, consolidated = documents_of(arrays)
    layout = _Layout(entries, arrays, tasks, loads, {k: [r for r, _ in v] for k, v in pieces.items()}, documents,
                     consolidated)
    _LAST_LAYOUT[:] = [(key, layout)]
    return layout


def documents_of(arrays: dict[str, ArrayPlan]) -> tuple[dict[str, bytes], str]:
    """The serialised ``zarr.json`` of every array and group, and the same as consolidated metadata."""
    nodes = node_documents({path: array.metadata for path, array in arrays.items()})
    documents = {path: json.dumps(document).encode() for path, document in nodes.items()}
    consolidated = "{" + ", ".join(f"{json.dumps(path)}: {doc.decode()}" for path, doc in documents.items()) + "}"
    return documents, consolidated


def with_key_encoding(plan: SavePlan, encoding: str) -> SavePlan:
    """The same plan with every array's chunk key encoding set to ``encoding`` (see ``_objstore``)."""
    if all(a.key_encoding == encoding for a in plan.arrays.values()):
        return plan
    arrays = {path: dataclasses.replace(a, key_encoding=encoding) for path, a in plan.arrays.items()}
    documents, consolidated = documents_of(arrays)
    return dataclasses.replace(plan, arrays=arrays, documents=documents, consolidated_json=consolidated)


def _check_paths(arrays: dict[str, ArrayPlan]) -> None:
    """Refuse layouts a filesystem or Zarr cannot hold: an array with children (keys ``a`` and ``a.b``),
    names too long for a directory entry, and keys equal but for letter case (one directory on macOS and
    Windows, where their chunks would overwrite each other)."""
    folded: dict[str, tuple[str, str]] = {}  # casefolded node path -> (path, a key under it)
    for path, plan in arrays.items():
        segments = path.split("/")
        for i in range(1, len(segments) + 1):
            node = "/".join(segments[:i])
            other_path, other_key = folded.setdefault(node.casefold(), (node, plan.key))
            if other_path != node:
                raise StateError(f"keys {other_key!r} and {plan.key!r} differ only in letter case, which "
                                 "case-insensitive filesystems cannot keep apart; rename one")
        if any(len(segment) > MAX_SEGMENT_BYTES for segment in path.split("/")):
            raise StateError(f"key {plan.key!r} has a part longer than {MAX_SEGMENT_BYTES} bytes once escaped; "
                             "filesystems cannot store it")
        segments = path.split("/")
        for i in range(1, len(segments)):
            parent = arrays.get("/".join(segments[:i]))
            if parent is not None:
                raise StateError(
                    f"{parent.key!r} is a tensor and also the prefix of tensor {plan.key!r}; rename one of them"
                )


def _first_seen(descriptions: list[LocalDescription]) -> Any:
    """Sort keys in the order ranks walked them (rank 0's order first), for a readable manifest."""
    order: dict[str, int] = {}
    for description in descriptions:
        for item in (*description.arrays, *description.values, *description.per_rank):
            order.setdefault(item.key, len(order))
    return lambda key: order.get(key, len(order))


def _check_kinds(holders: dict[str, list[int]], values: dict, per_rank: dict) -> None:
    for key in set(values) & set(holders):
        raise StateError(
            f"{key!r} is a tensor on rank(s) {sorted(holders[key])} but a plain value on another rank; every "
            "rank must hold the same kind of thing under a key"
        )
    for key in set(per_rank) & (set(holders) | set(values)):
        raise StateError(f"{key!r} is a PerRank value on some ranks and not on others; wrap it on every rank")


def _plan_array(
    key: str, holders: list[tuple[int, ArrayDescription]], codec: CodecChoice, chunking: ChunkPolicy, arrays: dict,
    work: list
) -> ArrayEntry | PickleEntry:
    first_rank, first = holders[0]
    for rank, piece in holders[1:]:
        if (piece.dtype, piece.global_shape, piece.kind) != (first.dtype, first.global_shape, first.kind):
            raise StateError(
                f"tensor {key!r} is {first.kind} {first.dtype}{list(first.global_shape)} on rank {first_rank} but "
                f"{piece.kind} {piece.dtype}{list(piece.global_shape)} on rank {rank}; every rank must agree on "
                "the global dtype and shape"
            )
    dtype, shape = dtype_by_name(first.dtype), first.global_shape
    if first.kind == "pickle":  # pickled values may differ between ranks: like plain values, the lowest rank's
        holders = [(first_rank, first)]
    replicas = _distinct_boxes(holders)
    _check_tiling(key, shape, replicas)
    path = array_path(key)
    steps = shard_grid(shape, replicas)
    outer, inner = choose_chunks(shape, dtype.itemsize, steps, chunking)
    if math.prod(inner) * dtype.itemsize > MAX_CHUNK_BYTES:  # readers refuse such chunks: never write one
        raise StateError(f"tensor {key!r}: its shards (boundaries every {list(steps)} along each dimension) leave no "
                         f"chunk grid under {MAX_CHUNK_BYTES} bytes per chunk (one chunk would be {list(inner)}); "
                         "shard it so that rank boundaries have a common divisor, e.g. torch.chunk-style even splits")
    chosen = resolve_codec(None if first.kind == "pickle" else codec, key)
    arrays[path] = ArrayPlan(key, path, dtype, shape, outer, inner, chosen)
    for box, ranks in replicas.items():
        _add_work(work, key, path, box, ranks, outer, dtype.itemsize)
    if first.kind == "pickle":
        return PickleEntry(key, first.parts, math.prod(shape))
    return ArrayEntry(key, first.parts, dtype, shape, first.kind)  # type: ignore[arg-type]


def _distinct_boxes(holders: list[tuple[int, ArrayDescription]]) -> dict[Box, list[int]]:
    """Identical boxes are replicas of one shard: box -> its holders, primary replica first."""
    replicas: dict[Box, list[tuple[int, int]]] = defaultdict(list)
    for rank, piece in holders:
        if piece.box.size or not any(piece.global_shape):
            replicas[piece.box].append((piece.replica_id, rank))
    return {box: [rank for _, rank in sorted(ranks)] for box, ranks in replicas.items()}


def _check_tiling(key: str, shape: tuple[int, ...], replicas: dict[Box, list[int]]) -> None:
    """Every element must belong to exactly one distinct shard: no overlaps, no gaps."""
    if math.prod(shape) == 0:
        return
    bounds = [sorted({0, n, *(b for box in replicas for b in (box.offset[d], box.stop[d]))}) for d, n in
              enumerate(shape)]
    cover = np.zeros([len(b) - 1 for b in bounds], np.int32)
    cells = {}
    for box in replicas:
        index = tuple(slice(bisect.bisect_left(b, o), bisect.bisect_left(b, e))
                      for b, o, e in zip(bounds, box.offset, box.stop, strict=True))
        cover[index] += 1
        cells[box] = index
    if (cover > 1).any():
        cell = tuple(int(i) for i in np.argwhere(cover > 1)[0])
        clash = [box for box, index in cells.items() if all(s.start <= c < s.stop for s, c in zip(index, cell,
                                                                                               strict=True))]
        described = "; ".join(f"rank(s) {replicas[b]} hold offset {list(b.offset)} shape {list(b.shape)}"
                              for b in clash)
        raise StateError(f"tensor {key!r}: shards overlap ({described}); each element must be held by one shard "
                         "(identical shards are replicas and are fine)")
    if (cover == 0).any():
        cell = tuple(int(i) for i in np.argwhere(cover == 0)[0])
        start = [b[c] for b, c in zip(bounds, cell, strict=True)]
        stop = [b[c + 1] for b, c in zip(bounds, cell, strict=True)]
        holders = sorted({r for ranks in replicas.values() for r in ranks})
        raise StateError(f"tensor {key!r} of shape {list(shape)}: no rank holds the region from {start} to {stop} "
                         f"(holders: ranks {holders}); the shards must cover the whole tensor")


def _add_work(work: list, key: str, path: str, box: Box, ranks: list[int], outer: tuple[int, ...],
              itemsize: int) -> None:
    """Split a shard held by several replicas into runs of whole outer chunks, one run per replica."""
    split = next((d for d in range(len(box.shape)) if box.shape[d] > outer[d]), None)
    if len(ranks) == 1 or split is None:
        work.append((box.size * itemsize, ranks, key, path, box))
        return
    chunks = math.ceil(box.shape[split] / outer[split])
    runs = min(len(ranks), chunks)
    for run in range(runs):
        first, last = run * chunks // runs, (run + 1) * chunks // runs
        start = box.offset[split] + first * outer[split]
        stop = min(box.stop[split], box.offset[split] + last * outer[split])
        offset = (*box.offset[:split], start, *box.offset[split + 1:])
        shape = (*box.shape[:split], stop - start, *box.shape[split + 1:])
        part = Box(offset, shape)
        work.append((part.size * itemsize, ranks, key, path, part))


def _assign(work: list, world: int) -> tuple[tuple[tuple[WriteTask, ...], ...], tuple[int, ...]]:
    """Greedy balance by bytes: biggest pieces first, each to its least-loaded candidate rank."""
    loads = [0] * world
    tasks: list[list[WriteTask]] = [[] for _ in range(world)]
    for nbytes, ranks, key, path, box in sorted(work, key=lambda w: -w[0]):
        rank = min(ranks, key=lambda r: (loads[r], r))
        loads[rank] += nbytes
        tasks[rank].append(WriteTask(key, path, box))
    return tuple(tuple(t) for t in tasks), tuple(loads)


def _plan_per_rank_arrays(key: str, items: dict[int, ArrayEntry], codec: CodecChoice, chunking: ChunkPolicy,
                          arrays: dict, work: list) -> None:
    """Each rank's per-rank tensor is its own array, written by that rank."""
    for rank, item in items.items():
        path = per_rank_path(key, rank)
        outer, inner = choose_chunks(item.shape, item.dtype.itemsize, None, chunking)
        arrays[path] = ArrayPlan(key, path, item.dtype, item.shape, outer, inner, resolve_codec(codec, key))
        work.append((item.nbytes, [rank], key, path, Box.whole(item.shape)))
