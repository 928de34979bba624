"""Delta plans (on the coordinator): per key, the cheapest way to store what changed since the base.

Given every rank's findings (:class:`PieceChange`: which chunks and how many rows of its piece changed; see
``_write/changes.py`` for how ranks find them), the coordinator chooses per key the cheapest of: nothing
(unchanged), the changed chunks, the changed rows (indices + values, optionally quantized), or the whole tensor
(when a delta would not be smaller); it lays out the row arrays so that each writer fills whole chunks of its
own. Format: ``spec/FORMAT.md``, "Delta checkpoints".
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .._errors import StateError
from .._format.codecs import Codec
from .._format.dtypes import dtype_by_name
from .._format.manifest import ArrayEntry, Delta, Quantization
from .._format.quant import packed_columns
from .._format.zarr import dimension_names
from .box import Box, grid_cells
from .chunking import DEFAULT_CHUNKING, ArrayPlan, ChunkPolicy
from .saveplan import LocalDescription, SavePlan, documents_of
from .tasks import RowsTask, Task, WriteTask

__all__ = ["INDEX_BYTES", "QUANTIZABLE", "PieceChange", "QuantizeRule", "plan_delta", "row_dimension_names",
           "stored_bytes"]

QUANTIZABLE = ("float16", "bfloat16", "float32", "float64")  # dtypes whose changed rows can be quantized
INDEX_BYTES = 8  # one int64 row index per stored row


class QuantizeRule(Protocol):
    """Which keys have their changed rows quantized, and to how many bits (``None``: stored exactly)."""

    def bits(self, key: str) -> int | None: ...


@dataclass(frozen=True)
class PieceChange:
    """One rank's finding for the piece (box) of a key it writes: metadata only, sent to the coordinator."""

    key: str
    box: Box
    grid: tuple[int, ...]  # the chunk shape of the base's dense array of this key
    chunks: tuple[int, ...] | None  # flat indices of changed chunks (None: the box is not chunk-aligned)
    rows: int | None  # number of changed rows (None: the box does not hold whole rows)


# --- on the coordinator: choose and lay out ------------------------------------------------------


def plan_delta(plan: SavePlan, descriptions: Sequence[LocalDescription] | None, findings: list[list[PieceChange]],
               request: QuantizeRule, policy: ChunkPolicy = DEFAULT_CHUNKING) -> SavePlan:
    """The delta :class:`SavePlan` of a full one: per key the cheapest of unchanged/chunks/rows/whole (the row
    arrays chunked by ``policy.row_chunk_bytes``). The distinct boxes of every key come from the plan's Layout, or
    from ``descriptions`` for a plan made without one."""
    reported: dict[str, list[tuple[int, PieceChange]]] = defaultdict(list)
    for rank, found in enumerate(findings):
        for change in found:
            reported[change.key].append((rank, change))
    boxes = _distinct_boxes(plan, descriptions, set(reported))
    entries = dict(plan.entries)
    arrays = dict(plan.arrays)
    tasks: list[list[Task]] = [[] for _ in range(len(plan.tasks))]  # (iterating would build every task)
    replaced: set[str] = set()
    for key, entry in plan.entries.items():
        if not isinstance(entry, ArrayEntry):
            continue
        pieces = reported.get(key, [])
        choice = _choose(entry, pieces, boxes.get(key, set()), request.bits(key)) if pieces else None
        if choice is None:
            continue
        path = entry.path
        codec = plan.arrays[path].codec
        replaced.add(key)
        grid = pieces[0][1].grid
        if choice == "chunks":
            present = tuple(sorted({c for _, p in pieces for c in p.chunks or ()}))
            arrays[path] = ArrayPlan(key, path, entry.dtype, entry.shape, grid, grid, codec,
                                     plan.arrays[path].key_encoding)
            entries[key] = dataclasses.replace(entry, delta=Delta("chunks", present=present))
            for rank, piece in pieces:
                if piece.chunks:
                    tasks[rank].append(WriteTask(key, path, piece.box))
        else:
            bits = request.bits(key)
            del arrays[path]
            row_arrays, placed = _row_arrays(entry, pieces, bits, codec, plan.arrays[path].key_encoding,
                                             policy.row_chunk_bytes)
            arrays.update(row_arrays)
            total = sum(p.rows or 0 for _, p in pieces)
            entries[key] = dataclasses.replace(
                entry, delta=Delta("rows", rows=total, quantized=Quantization(bits, 0.0) if bits else None))
            for rank, task in placed:
                tasks[rank].append(task)
    for rank, rank_tasks in enumerate(plan.tasks):  # the full plan's tasks of the keys stored whole, then the delta's
        tasks[rank][:0] = [t for t in rank_tasks if t.key not in replaced]
    documents, consolidated = documents_of(arrays)
    return dataclasses.replace(plan, entries=entries, arrays=arrays, tasks=tuple(tuple(t) for t in tasks),
                               documents=documents, consolidated_json=consolidated)


def _distinct_boxes(plan: SavePlan, descriptions: Sequence[LocalDescription] | None,
                    keys: set[str]) -> dict[str, set[Box]]:
    """The distinct non-empty boxes of each of ``keys``."""
    boxes: dict[str, set[Box]] = defaultdict(set)
    if plan.layout is not None:
        for key in keys & set(plan.layout.boxes):
            offsets, shapes = plan.layout.boxes[key]
            boxes[key] = {Box(tuple(o), tuple(s)) for o, s in zip(offsets.tolist(), shapes.tolist(), strict=True)}
        return boxes
    for description in descriptions or ():
        for piece in description.arrays:
            if piece.box.size and piece.key in keys:
                boxes[piece.key].add(piece.box)
    return boxes


def stored_bytes(plan: SavePlan) -> int:
    """The array bytes a planned checkpoint stores itself, before compression (the manifest's
    ``stored_bytes``): every array whole, except the chunks a chunks delta leaves to its base; row arrays
    with their indices and padding."""
    total = 0
    for array in plan.arrays.values():
        entry = plan.entries.get(array.key)
        delta = entry.delta if isinstance(entry, ArrayEntry) and array.path == entry.path else None
        if delta is not None and delta.mode == "chunks":
            present = set(delta.present)
            total += sum(cell.size for flat, cell in grid_cells(Box.whole(array.shape), array.outer_chunk, array.shape)
                         if flat in present) * array.dtype.itemsize
        else:
            total += math.prod(array.shape) * array.dtype.itemsize
    return total


def _choose(entry: ArrayEntry, pieces: list[tuple[int, PieceChange]], boxes: set[Box], bits: int | None) -> str | None:
    """``"chunks"``, ``"rows"``, or ``None`` (store whole): whichever stores fewer bytes."""
    if {p.box for _, p in pieces} != boxes:
        return None  # some piece was not compared (e.g. no replica 0 of it): store whole
    itemsize = entry.dtype.itemsize
    row_elements = math.prod(entry.shape[1:]) if entry.shape else 1
    if bits and (entry.dtype.name not in QUANTIZABLE or not entry.shape):
        raise StateError(f"tensor {entry.key!r} is {entry.dtype.name}{list(entry.shape)}; only floating-point "
                         f"tensors ({', '.join(QUANTIZABLE)}) of at least 1 dimension can have quantized deltas: "
                         "narrow the quantize= pattern")
    if all(p.rows is not None for _, p in pieces):
        rows = sum(p.rows or 0 for _, p in pieces)
        if bits:
            cost = rows * (packed_columns(row_elements, bits) + 8 + INDEX_BYTES)
            return "rows" if cost < entry.nbytes else None
        row_cost: float = rows * (row_elements * itemsize + INDEX_BYTES)
    else:
        if bits:
            raise StateError(f"tensor {entry.key!r}: quantized deltas need pieces of whole rows (row-sharded or "
                             "unsharded); this save has column-sharded pieces")
        row_cost = math.inf
    if all(p.chunks is not None for _, p in pieces):
        grid = pieces[0][1].grid
        chunk_cost: float = len({c for _, p in pieces for c in p.chunks or ()}) * math.prod(grid) * itemsize
    else:
        chunk_cost = math.inf
    best = min(row_cost, chunk_cost)
    if best >= entry.nbytes and entry.nbytes > 0:
        return None
    return "chunks" if chunk_cost <= row_cost else "rows"


def _row_arrays(entry: ArrayEntry, pieces: list[tuple[int, PieceChange]], bits: int | None, codec: Codec,
                key_encoding: str, chunk_bytes: int) -> tuple[dict[str, ArrayPlan], list[tuple[int, RowsTask]]]:
    """The row arrays of a rows delta and each writer's range in them: pieces in box order, each padded to
    whole chunks of ``length`` rows, so that every chunk has exactly one writer."""
    key, path = entry.key, entry.path
    tail = entry.shape[1:]
    row_elements = math.prod(tail)
    if bits:
        value_arrays = {"codes": (dtype_by_name("uint8"), (packed_columns(row_elements, bits),)),
                        "scale": (dtype_by_name("float32"), ()), "offset": (dtype_by_name("float32"), ())}
    else:
        value_arrays = {"values": (entry.dtype, tail)}
    row_bytes = INDEX_BYTES + sum(d.itemsize * math.prod(s) for d, s in value_arrays.values())
    largest = max((p.rows or 0) for _, p in pieces)
    most = max(1, chunk_bytes // max(row_bytes, 1))
    length = max(1, math.ceil(largest / max(1, math.ceil(largest / most))))  # balanced: no mostly-empty chunk
    placed = []
    offset = 0
    ordered = [(rank, piece) for rank, piece in sorted(pieces, key=lambda rp: rp[1].box.offset) if piece.rows]
    for i, (rank, piece) in enumerate(ordered):
        # every piece but the last is padded to whole chunks, so no chunk has two writers
        count = piece.rows or 0
        padded = count if i == len(ordered) - 1 else math.ceil(count / length) * length
        placed.append((rank, RowsTask(key, path, piece.box, offset, padded)))
        offset += padded
    out = {}
    for name, (dtype, shape) in {"rows": (dtype_by_name("int64"), ()), **value_arrays}.items():
        full = (offset, *shape)
        chunk = (length, *shape)
        out[f"{path}/{name}"] = ArrayPlan(key, f"{path}/{name}", dtype, full, chunk, chunk, codec, key_encoding,
                                          row_dimension_names(path, name, len(full)))
    return out, placed


def row_dimension_names(path: str, name: str, ndim: int) -> tuple[str, ...]:
    """Dimension names of the row array ``name`` of a rows delta at ``path`` (spec §7.2): every row array's first
    dimension is the group's ``<dotted path>.rows`` (all of them are indexed by it); ``values`` keeps the tensor's
    own names for its other dimensions; the others get their own array's default names."""
    rows = f"{path.replace('/', '.')}.rows"
    rest = dimension_names(path if name == "values" else f"{path}/{name}", ndim)[1:]
    return (rows, *rest)
