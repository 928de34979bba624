"""Incremental saves, on every rank: find what changed since the base checkpoint, and write only that.

Before the first collective of a delta save, each rank compares what it will write with the bytes last saved
— the base read back through its chain (or a host copy kept from the save that wrote it), or nothing at all
where the caller names the changed rows of a key (e.g. from an embedding's sparse gradient). The comparison
is bitwise and exact: no hash decides that a chunk is unchanged. It yields, per piece, the changed chunks (on
the base's chunk grid) and, for pieces holding whole rows, the changed rows; the coordinator then chooses how
to store each key (``_layout/delta.py``) and every rank writes its share (:func:`chunk_jobs`,
:func:`rows_jobs`). Reads fall through the chain (``_read/chain.py``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, NamedTuple, cast

import numpy as np

from .._errors import BaseNotAllowedError, FormatError, StateError
from .._format.dtypes import as_typed
from .._format.jsontypes import JSON, json_object
from .._format.keys import array_path
from .._format.manifest import ArrayEntry, BaseRef
from .._format.quant import max_abs_error, quantize_rows
from .._format.zarr import array_shape
from .._io.arrays import ArrayIO, array_spec
from .._layout.box import Box, grid_cells
from .._layout.delta import PieceChange
from .._layout.saveplan import SavePlan
from .._layout.tasks import RowsTask
from .._read.chain import dense_grid
from .._read.checkpoint import Checkpoint, stored_of
from .._read.reader import read_box
from .._settings import settings
from .._storage import Location, follow_base

__all__ = ["Changes", "DeltaRequest", "NO_CHANGES", "Reference", "chunk_jobs", "find_changes", "rows_jobs"]


class Changes(NamedTuple):
    """What a rank found changed since the base (:func:`find_changes`)."""

    pieces: list[PieceChange]  # the findings the coordinator plans the delta from
    rows: dict[str, np.ndarray]  # by key: the changed global row indices this rank keeps for writing rows


NO_CHANGES = Changes([], {})  # a full save's (and a failed comparison's): nothing compared


@dataclass(frozen=True)
class DeltaRequest:
    """What the caller asked of a delta save, on every rank. ``owned``: the save opened ``base`` itself (from a
    path) and closes it when the save finishes (:meth:`close`); a :class:`Checkpoint` the caller passed is
    never closed here."""

    base: Checkpoint
    ref: BaseRef
    rows: Mapping[str, np.ndarray]  # key -> changed global row indices given by the caller (sorted, unique)
    quantize: Mapping[str, int]  # key pattern -> bits (4 or 8); opt-in, lossy
    owned: bool = False

    def close(self) -> None:
        """The save is over (committed or failed): release the base if the save opened it."""
        if self.owned:
            self.base.close()

    def bits(self, key: str) -> int | None:
        for pattern, bits in self.quantize.items():
            if fnmatchcase(key, pattern):
                return bits
        return None


def base_ref(base: Checkpoint, delta: Location) -> BaseRef:
    """How the delta at ``delta`` names its base: a relative path when both are in the same place (so a
    chain can be moved or copied as a whole), else the base's full location."""
    where = base.location
    if base.manifest.id is None:
        raise StateError(f"{where}: this checkpoint has no id (saved by an older arrayckpt) and cannot be a base; "
                         "save a full checkpoint first")
    reference = where.reference_from(delta)
    try:
        follow_base(delta, reference)
    except BaseNotAllowedError:  # written all the same: a caller who saves it there knows where it is
        warnings.warn(f"{delta}: its base {where} is not in the directory holding the delta checkpoint, so readers "
                      f"will follow its reference {reference!r} only inside a root they name (base_roots=[...], "
                      "command line --base-root; spec §10.1); save deltas beside their bases to need none",
                      UserWarning, stacklevel=7)  # the caller of arrayckpt.save
    except FormatError:
        raise StateError(f"{delta}: its base {where} would lie inside the delta checkpoint or above it, which no "
                         "reader follows (spec §10.1); save the delta checkpoint beside its base") from None
    return BaseRef(reference, base.manifest.id, base.manifest.step)


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
    diff: np.ndarray = a != b
    return cast(np.ndarray, diff.any(axis=-1)) if diff.ndim > new.ndim else diff.reshape(new.shape)




def _changed_rows(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """Per row (first dimension): whether any byte differs, compared as same-size unsigned integers a block of
    rows at a time, so the temporary boolean array stays small (numpy measured 3x faster than torch here)."""
    rows = new.shape[0]
    a, b = _bits(new).reshape(rows, -1), _bits(old).reshape(rows, -1)
    out = np.empty(rows, bool)
    step = max(1, settings().compare_block_bytes // max(1, a.shape[1] * a.dtype.itemsize))

    def block(start: int) -> None:  # numpy releases the GIL: blocks run in parallel
        np.any(a[start:start + step] != b[start:start + step], axis=1, out=out[start:start + step])

    starts = range(0, rows, step)
    if len(starts) == 1:
        block(0)
    else:
        with ThreadPoolExecutor(min(settings().io_threads, len(starts))) as pool:
            list(pool.map(block, starts))
    return out


def _aligned(box: Box, grid: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    return all(o % c == 0 and (e % c == 0 or e == n) for o, e, c, n in zip(box.offset, box.stop, grid, shape,
                                                                          strict=True))


def _whole_rows(box: Box, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 1 and all(o == 0 and n == m for o, n, m in zip(box.offset[1:], box.shape[1:], shape[1:],
                                                                         strict=True))


Reference = Callable[[str, Box], "np.ndarray | None"]  # (array path, box) -> the base's bytes of it, if kept


def find_changes(arrays: Any, data: Mapping[str, tuple[Box, np.ndarray]], request: DeltaRequest,
                 reference: Reference | None = None, aliases: Mapping[str, str] | None = None,
                 ) -> Changes:
    """Compare this rank's pieces (those it would write: replica 0) with the base — a kept host copy of its
    bytes where ``reference`` has one, else the base read back — and return the findings for the coordinator
    and, by key, the changed global row indices this rank keeps for writing rows. Keys in ``aliases`` (tied to an
    earlier key: stored as its alias) are not compared, their target is; one the coordinator does not alias after
    all, having no findings, is stored whole. A key that is an alias in the base is compared with its target
    there."""
    findings: list[PieceChange] = []
    rows_by_key: dict[str, np.ndarray] = {}
    for description in arrays:
        key, box, shape = description.key, description.box, description.global_shape
        base_entry = request.base.manifest.array_entry(key)
        if (key in (aliases or {}) or description.kind == "pickle" or description.replica_id != 0 or box.size == 0
                or not isinstance(base_entry, ArrayEntry) or base_entry.dtype.name != description.dtype
                or base_entry.shape != shape or base_entry.kind != description.kind):
            continue
        grid = dense_grid(stored_of(request.base), key)
        held, values = data[array_path(key)]
        values = values[box.relative_to(held)]
        whole_rows = _whole_rows(box, shape)
        given = request.rows.get(key)
        if given is not None and whole_rows:
            rows = given[(given >= box.offset[0]) & (given < box.stop[0])]
            changed_rows: np.ndarray | None = rows
            row_mask = np.zeros(box.shape[0], bool)
            row_mask[rows - box.offset[0]] = True
            chunks: tuple[int, ...] | None = _changed_chunks_by_rows(row_mask, box, grid, shape)
        else:
            if given is not None:
                raise StateError(f"changed rows were given for {key!r}, but this rank holds a piece of it that is "
                                 f"not whole rows ({box}); give changed rows only for row-sharded tensors")
            old = reference(array_path(key), box) if reference is not None else None
            if old is None:
                old = np.empty(box.shape, values.dtype)
                read_box(stored_of(request.base), key, box, old)
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
    return Changes(findings, rows_by_key)


def _changed_chunks(diff: np.ndarray, box: Box, grid: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    if diff.ndim >= 1 and tuple(grid[1:]) == tuple(shape[1:]) and _whole_rows(box, shape):
        row_mask = cast(np.ndarray, diff.reshape(box.shape[0], -1).any(axis=1))
        return _changed_chunks_by_rows(row_mask, box, grid, shape)
    changed = []
    for flat, cell in grid_cells(box, grid, shape):
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
    mask = np.concatenate([mask, np.zeros(groups * rows_per - len(mask), bool)]).reshape(groups, rows_per)
    mask = cast(np.ndarray, mask.any(1))
    per_row = math.prod(math.ceil(n / c) for n, c in zip(shape[1:], grid[1:], strict=True))
    starts = (first + np.flatnonzero(mask)) * per_row
    return tuple((starts[:, None] + np.arange(per_row)).ravel().tolist())


# --- on every rank: writing --------------------------------------------------------------------------


def chunk_jobs(task: Any, change: PieceChange, spec: JSON, values: np.ndarray, held: Box) -> list[Any]:
    """The writes of a chunks delta task: only the changed chunks of the task's box."""
    changed = set(change.chunks or ())
    shape = tuple(array_shape(json_object(spec.get("metadata"))))
    jobs = []
    for flat, cell in grid_cells(task.box, change.grid, shape):
        part = cell.intersect(task.box) if flat in changed else None
        if part is not None:
            jobs.append(ArrayIO(task.key, spec, values[part.relative_to(held)], part.slices(), task.path))
    return jobs




def rows_jobs(task: RowsTask, plan: SavePlan, values: np.ndarray, held: Box, rows: np.ndarray,
              bits: int | None, kvstore: Callable[[str], JSON]) -> tuple[list[Any], float]:
    """The writes of one rows task (indices, values or quantized codes; -1 and zeros as padding) and the
    largest quantization error (0.0 when exact)."""
    n = len(rows)
    index = np.full(task.length, -1, np.int64)
    index[:n] = rows
    entry = plan.entries[task.key]
    if isinstance(entry, ArrayEntry):  # quantization reads values (a bfloat16 host view comes carrier-typed)
        values = as_typed(values, entry.dtype)
    picked = values[task.box.relative_to(held)][rows - task.box.offset[0]]  # a copy: fancy indexing

    def region(shape: tuple[int, ...]) -> tuple[slice, ...]:
        return (slice(task.offset, task.offset + task.length), *(slice(0, n) for n in shape[1:]))

    error = 0.0
    if bits:
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
                    index, region((task.length,)), f"{task.path}/rows")]
    for name, part in parts.items():
        array = plan.arrays[f"{task.path}/{name}"]
        padded = part
        if task.length != n:
            padded = np.zeros((task.length, *array.shape[1:]), part.dtype)
            padded[:n] = part
        jobs.append(ArrayIO(task.key, array_spec(kvstore(array.path), array.metadata), padded, region(array.shape),
                            array.path))
    return jobs, error
