"""Incremental saves: find what changed since a base checkpoint, and store only that (Check-N-Run style).

A delta save runs like a full one (describe, plan, write, commit) with two additions:

1. Before the first collective, each rank compares what it will write with the bytes last saved — the
   base read back through its chain, or nothing at all where the caller names the changed rows of a key
   (e.g. from an embedding's sparse gradient). The comparison is bitwise and exact: no hash decides that a
   chunk is unchanged. It yields, per piece, the changed chunks (on the base's chunk grid) and, for pieces
   holding whole rows, the changed rows.
2. The coordinator chooses per key the cheapest of: nothing (unchanged), the changed chunks, the changed
   rows (indices + values, optionally quantized), or the whole tensor (when a delta would not be smaller);
   it lays out the row arrays so that each writer fills whole chunks of its own.

Reads fall through the chain (see ``_chain``). Format: ``spec/FORMAT.md``, "Delta checkpoints".
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import posixpath
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import StateError
from .._format.dtypes import dtype_by_name
from .._format.manifest import ArrayEntry, BaseRef, Delta, Quantization
from .._layout.box import Box
from .._layout.chunking import ArrayPlan

if TYPE_CHECKING:
    from .._layout.saveplan import LocalDescription, SavePlan
    from .._read.checkpoint import Checkpoint
    from .._storage.local import Location

__all__ = ["DeltaRequest", "PieceChange", "Reference", "RowsTask", "chunk_jobs", "find_changes", "plan_delta",
           "rows_jobs", "stored_bytes"]

QUANTIZABLE = ("float16", "bfloat16", "float32", "float64")  # dtypes whose changed rows can be quantized
ROW_CHUNK_BYTES = 4 << 20  # chunk size of the row-delta arrays (rows and values)
INDEX_BYTES = 8  # one int64 row index per stored row


@dataclass(frozen=True)
class DeltaRequest:
    """What the caller asked of a delta save, on every rank."""

    base: Checkpoint
    ref: BaseRef
    rows: Mapping[str, np.ndarray]  # key -> changed global row indices given by the caller (sorted, unique)
    quantize: Mapping[str, int]  # key pattern -> bits (4 or 8); opt-in, lossy

    def bits(self, key: str) -> int | None:
        from fnmatch import fnmatchcase

        for pattern, bits in self.quantize.items():
            if fnmatchcase(key, pattern):
                return bits
        return None


@dataclass(frozen=True)
class PieceChange:
    """One rank's finding for the piece (box) of a key it writes: metadata only, sent to the coordinator."""

    key: str
    box: Box
    grid: tuple[int, ...]  # the chunk shape of the base's dense array of this key
    chunks: tuple[int, ...] | None  # flat indices of changed chunks (None: the box is not chunk-aligned)
    rows: int | None  # number of changed rows (None: the box does not hold whole rows)


@dataclass(frozen=True)
class RowsTask:
    """Write the changed rows of piece ``box`` of ``key`` at rows ``offset:offset+length`` of its row arrays."""

    key: str
    path: str
    box: Box
    offset: int
    length: int  # padded to whole chunks of the row arrays


def base_ref(base: Checkpoint, delta: Location) -> BaseRef:
    """How the delta at ``delta`` names its base: a relative path when both are in the same place (so a
    chain can be moved or copied as a whole), else the base's full location."""
    from .._storage.local import LocalLocation

    where = base.location
    if base.manifest.id is None:
        raise StateError(f"{where}: this checkpoint has no id (saved by an older arrayckpt) and cannot be a base; "
                         "save a full checkpoint first")
    if isinstance(where, LocalLocation) and isinstance(delta, LocalLocation):
        path = os.path.relpath(where.path, delta.path)
    elif (type(where) is type(delta) and getattr(where, "scheme", None) == getattr(delta, "scheme", None)
          and getattr(where, "bucket", None) == getattr(delta, "bucket", None)):
        path = posixpath.relpath("/" + where.prefix, "/" + delta.prefix)  # type: ignore[union-attr]
    else:
        path = str(where)
    return BaseRef(path, base.manifest.id, base.manifest.step)


def resolve_base(location: Location, ref: BaseRef) -> Location:
    """The location a delta's base reference names (relative references are relative to the delta)."""
    from .._storage.local import LocalLocation, parse_location

    if "://" in ref.path or os.path.isabs(ref.path):
        # the delta's storage options (credentials) go only to a base on the same kind of storage
        same = "://" in ref.path and ref.path.partition("://")[0] == getattr(location, "scheme", None)
        options = dict(getattr(location, "options", ())) if same else None
        return parse_location(ref.path, options or None)
    if isinstance(location, LocalLocation):
        return LocalLocation(type(location.path)(os.path.normpath(location.path / ref.path)))
    prefix = posixpath.normpath(posixpath.join("/" + location.prefix, ref.path)).strip("/")  # type: ignore[union-attr]
    return dataclasses.replace(location, prefix=prefix)  # type: ignore[type-var]


# --- on every rank: what changed --------------------------------------------------------------------


def _bits(data: np.ndarray) -> np.ndarray:
    """The array's elements as unsigned integers of the same size, for exact bitwise comparison (NaNs with
    the same payload are equal, -0.0 differs from 0.0); 16-byte elements become pairs of uint64."""
    size = data.dtype.itemsize
    data = np.ascontiguousarray(data)
    if size in (1, 2, 4, 8):
        return data.view(f"u{size}")
    return data.view(np.uint64).reshape(*data.shape, size // 8) if data.ndim else data.reshape(1).view(np.uint64)


def _differs(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Element-wise: whether the bytes differ (same shape as ``new``)."""
    a, b = _bits(new), _bits(old)
    diff = a != b
    return diff.any(axis=-1) if diff.ndim > new.ndim else diff.reshape(new.shape)


COMPARE_BLOCK_BYTES = 16 << 20  # rows compared at once, per thread: bounds the temporary boolean arrays


def _changed_rows(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Per row (first dimension): whether any byte differs, compared as same-size unsigned integers a block of
    rows at a time, so the temporary boolean array stays small (numpy measured 3x faster than torch here)."""
    rows = new.shape[0]
    a, b = _bits(new).reshape(rows, -1), _bits(old).reshape(rows, -1)
    out = np.empty(rows, bool)
    step = max(1, COMPARE_BLOCK_BYTES // max(1, a.shape[1] * a.dtype.itemsize))

    def block(start: int) -> None:  # numpy releases the GIL: blocks run in parallel
        np.any(a[start:start + step] != b[start:start + step], axis=1, out=out[start:start + step])

    starts = range(0, rows, step)
    if len(starts) == 1:
        block(0)
    else:
        from concurrent.futures import ThreadPoolExecutor

        from .._io.fastio import IO_THREADS

        with ThreadPoolExecutor(min(IO_THREADS, len(starts))) as pool:
            list(pool.map(block, starts))
    return out


def _aligned(box: Box, grid: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return all(o % c == 0 and (e % c == 0 or e == n) for o, e, c, n in zip(box.offset, box.stop, grid, shape,
                                                                          strict=True))


def _cells(box: Box, grid: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[int, Box]]:
    """The chunks of the grid that meet ``box``: (flat C-order index, the chunk's box clipped to the array)."""
    counts = [math.ceil(n / c) for n, c in zip(shape, grid, strict=True)]
    ranges = [range(o // c, math.ceil(e / c)) for o, e, c in zip(box.offset, box.stop, grid, strict=True)]
    out = []
    for index in itertools.product(*ranges):
        start = tuple(i * c for i, c in zip(index, grid, strict=True))
        stop = tuple(min(s + c, n) for s, c, n in zip(start, grid, shape, strict=True))
        flat = int(np.ravel_multi_index(index, counts)) if counts else 0
        out.append((flat, Box(start, tuple(e - s for s, e in zip(start, stop, strict=True)))))
    return out


def _whole_rows(box: Box, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 1 and all(o == 0 and n == m for o, n, m in zip(box.offset[1:], box.shape[1:], shape[1:],
                                                                         strict=True))


Reference = Callable[[str, Box], "np.ndarray | None"]  # (array path, box) -> the base's bytes of it, if kept


def find_changes(arrays: Any, data: Mapping[str, tuple[Box, np.ndarray]], request: DeltaRequest,
                 reference: Reference | None = None) -> tuple[list[PieceChange], dict[str, np.ndarray]]:
    """Compare this rank's pieces (those it would write: replica 0) with the base — a kept host copy of its
    bytes where ``reference`` has one, else the base read back — and return the findings for the coordinator
    and, by key, the changed global row indices this rank keeps for writing rows."""
    from .._format.keys import array_path

    findings: list[PieceChange] = []
    rows_by_key: dict[str, np.ndarray] = {}
    for description in arrays:
        key, box, shape = description.key, description.box, description.global_shape
        base_entry = request.base.manifest.entries.get(key)
        if (description.kind == "pickle" or description.replica_id != 0 or box.size == 0
                or not isinstance(base_entry, ArrayEntry) or base_entry.dtype.name != description.dtype
                or base_entry.shape != shape or base_entry.kind != description.kind):
            continue
        grid = request.base.dense_grid(key)
        held, values = data[array_path(key)]
        values = values[box.relative_to(held)]
        whole_rows = _whole_rows(box, shape)
        given = request.rows.get(key)
        if given is not None and whole_rows:
            rows = given[(given >= box.offset[0]) & (given < box.stop[0])]
            changed_rows: np.ndarray | None = rows
            row_mask = np.zeros(box.shape[0], bool)
            row_mask[rows - box.offset[0]] = True
            chunks = _changed_chunks_by_rows(row_mask, box, grid, shape)
        else:
            if given is not None:
                raise StateError(f"changed rows were given for {key!r}, but this rank holds a piece of it that is "
                                 f"not whole rows ({box}); give changed rows only for row-sharded tensors")
            old = reference(array_path(key), box) if reference is not None else None
            if old is None:
                old = np.empty(box.shape, values.dtype)
                request.base.read_box(key, box, old)
            if whole_rows and tuple(grid[1:]) == tuple(shape[1:]):  # the usual case: rows are enough
                row_mask = _changed_rows(values, old)
                changed_rows = np.flatnonzero(row_mask) + box.offset[0]
                chunks = _changed_chunks_by_rows(row_mask, box, grid, shape)
            else:
                diff = _differs(values, old)
                changed_rows = (np.flatnonzero(diff.reshape(box.shape[0], -1).any(axis=1)) + box.offset[0]
                                if whole_rows else None)
                chunks = _changed_chunks(diff, box, grid, shape)
            del old
        if chunks is not None and not _aligned(box, grid, shape):
            chunks = None
        if changed_rows is not None:
            rows_by_key[key] = changed_rows.astype(np.int64, copy=False)
        findings.append(PieceChange(key, box, grid, chunks, None if changed_rows is None else len(changed_rows)))
    return findings, rows_by_key


def _changed_chunks(diff: np.ndarray, box: Box, grid: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    if diff.ndim >= 1 and tuple(grid[1:]) == tuple(shape[1:]) and _whole_rows(box, shape):
        return _changed_chunks_by_rows(diff.reshape(box.shape[0], -1).any(axis=1), box, grid, shape)
    changed = []
    for flat, cell in _cells(box, grid, shape):
        part = cell.intersect(box) if cell.size else None
        if part is not None and diff[part.relative_to(box)].any():
            changed.append(flat)
    return tuple(changed)


def _changed_chunks_by_rows(row_mask: np.ndarray, box: Box, grid: tuple[int, ...],
                            shape: tuple[int, ...]) -> tuple[int, ...]:
    """Changed chunks when a piece holds whole rows: every chunk of a changed row (whatever the column split,
    conservatively), found without a Python loop over cells."""
    first = box.offset[0] // grid[0]
    rows_per = grid[0]
    pad = box.offset[0] - first * rows_per  # 0 when the box starts on a chunk boundary
    mask = np.concatenate([np.zeros(pad, bool), row_mask])
    groups = math.ceil(len(mask) / rows_per)
    mask = np.concatenate([mask, np.zeros(groups * rows_per - len(mask), bool)]).reshape(groups, rows_per).any(1)
    per_row = math.prod(math.ceil(n / c) for n, c in zip(shape[1:], grid[1:], strict=True))
    starts = (first + np.flatnonzero(mask)) * per_row
    return tuple((starts[:, None] + np.arange(per_row)).ravel().tolist())


# --- on the coordinator: choose and lay out ------------------------------------------------------


def plan_delta(plan: SavePlan, descriptions: list[LocalDescription], findings: list[list[PieceChange]],
               request: DeltaRequest) -> SavePlan:
    """Turn a full save plan into a delta plan: per key the cheapest of unchanged/chunks/rows/whole."""
    from .._layout.saveplan import WriteTask, _documents

    reported: dict[str, list[tuple[int, PieceChange]]] = defaultdict(list)
    for rank, found in enumerate(findings):
        for change in found:
            reported[change.key].append((rank, change))
    boxes: dict[str, set[Box]] = defaultdict(set)
    for description in descriptions:
        for piece in description.arrays:
            if piece.box.size:
                boxes[piece.key].add(piece.box)
    entries = dict(plan.entries)
    arrays = dict(plan.arrays)
    tasks: list[list[Any]] = [list(t) for t in plan.tasks]
    for key, entry in plan.entries.items():
        if not isinstance(entry, ArrayEntry):
            continue
        pieces = reported.get(key, [])
        choice = _choose(entry, pieces, boxes[key], request.bits(key)) if pieces else None
        if choice is None:
            continue
        path = entry.path
        codec = plan.arrays[path].codec
        for rank_tasks in tasks:
            rank_tasks[:] = [t for t in rank_tasks if t.key != key]
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
            row_arrays, placed = _row_layout(entry, pieces, bits, codec, plan.arrays[path].key_encoding)
            arrays.update(row_arrays)
            total = sum(p.rows or 0 for _, p in pieces)
            entries[key] = dataclasses.replace(
                entry, delta=Delta("rows", rows=total, quantized=Quantization(bits, 0.0) if bits else None))
            for rank, task in placed:
                tasks[rank].append(task)
    documents, consolidated = _documents(arrays)
    return dataclasses.replace(plan, entries=entries, arrays=arrays, tasks=tuple(tuple(t) for t in tasks),
                               documents=documents, consolidated_json=consolidated)


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
            total += sum(cell.size for flat, cell in _cells(Box.whole(array.shape), array.outer_chunk, array.shape)
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
            from .._format.quant import packed_columns

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


def _row_layout(entry: ArrayEntry, pieces: list[tuple[int, PieceChange]], bits: int | None, codec: Any,
                key_encoding: str) -> tuple[dict[str, ArrayPlan], list[tuple[int, RowsTask]]]:
    """The row arrays of a rows delta and each writer's range in them: pieces in box order, each padded to
    whole chunks of ``length`` rows, so that every chunk has exactly one writer."""
    from .._format.quant import packed_columns

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
    most = max(1, ROW_CHUNK_BYTES // max(row_bytes, 1))
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
        out[f"{path}/{name}"] = ArrayPlan(key, f"{path}/{name}", dtype, full, chunk, chunk, codec, key_encoding)
    return out, placed


# --- on every rank: writing --------------------------------------------------------------------------


def chunk_jobs(task: Any, change: PieceChange, spec: dict[str, Any], values: np.ndarray, held: Box) -> list[Any]:
    """The writes of a chunks delta task: only the changed chunks of the task's box."""
    from .._io.arrays import ArrayIO

    changed = set(change.chunks or ())
    shape = tuple(spec["metadata"]["shape"])
    jobs = []
    for flat, cell in _cells(task.box, change.grid, shape):
        part = cell.intersect(task.box) if flat in changed else None
        if part is not None:
            jobs.append(ArrayIO(task.key, spec, values[part.relative_to(held)], part.slices()))
    return jobs




def rows_jobs(task: RowsTask, plan: SavePlan, values: np.ndarray, held: Box, rows: np.ndarray,
              bits: int | None, kvstore: Callable[[str], dict[str, Any]]) -> tuple[list[Any], float]:
    """The writes of one rows task (indices, values or quantized codes; -1 and zeros as padding) and the
    largest quantization error (0.0 when exact)."""
    from .._io.arrays import ArrayIO, array_spec

    n = len(rows)
    index = np.full(task.length, -1, np.int64)
    index[:n] = rows
    picked = values[task.box.relative_to(held)][rows - task.box.offset[0]]  # a copy: fancy indexing

    def region(shape: tuple[int, ...]) -> tuple[slice, ...]:
        return (slice(task.offset, task.offset + task.length), *(slice(0, n) for n in shape[1:]))

    error = 0.0
    if bits:
        from .._format.quant import max_abs_error, quantize_rows

        matrix = picked.reshape(n, -1)
        try:
            quantized = quantize_rows(matrix, bits)
        except ValueError as e:
            raise StateError(f"tensor {task.key!r}: cannot quantize its changed rows: {e}") from None
        error = max_abs_error(matrix, quantized) if n else 0.0
        parts = {"codes": quantized.codes, "scale": quantized.scale, "offset": quantized.offset}
    else:
        parts = {"values": picked.reshape(n, *values.shape[1:])}
    jobs = [ArrayIO(task.key, array_spec(kvstore(f"{task.path}/rows"), plan.arrays[f"{task.path}/rows"].metadata),
                    index, region((task.length,)))]
    for name, part in parts.items():
        array = plan.arrays[f"{task.path}/{name}"]
        padded = part
        if task.length != n:
            padded = np.zeros((task.length, *array.shape[1:]), part.dtype)
            padded[:n] = part
        jobs.append(ArrayIO(task.key, array_spec(kvstore(array.path), array.metadata), padded, region(array.shape)))
    return jobs, error
