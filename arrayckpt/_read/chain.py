"""Reading through a delta chain: each read of a box becomes plain reads from the layers that hold it,
plus row overlays applied afterwards, oldest first.

For a box of a key, a layer answers:

- stored whole (no delta): one read of the box from this layer;
- ``chunks`` delta: per chunk of its grid meeting the box, a read from this layer if the chunk is present,
  else the same question asked of the base for that part;
- ``rows`` delta: the base answers for the whole box, then this layer's changed rows that fall inside the
  box are written over it.

An alias (tied weights, ``_format/alias.py``) is answered by its target in the same layer, so a key that is an
alias in one layer and a tensor of its own in another reads right, whichever is the delta.

The plain reads of one box never overlap, so they run concurrently; overlays run after them. Bit-exact by
construction: every byte comes from the newest layer that stored it. This module only plans; the reads run in
``_read/reader.py`` (the one read path), which also runs the overlays (they read the rows they write).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._errors import CorruptCheckpointError
from .._format.dtypes import as_typed, dtype_by_name
from .._format.jsontypes import JSON, json_object
from .._format.manifest import ArrayEntry
from .._format.quant import QuantizedRows, dequantize_rows
from .._format.zarr import array_shape, outer_chunk_shape, read_chunk_shape, unravel
from .._io.arrays import ArrayIO, read_into
from .._layout.box import Box, grid_cells

if TYPE_CHECKING:
    from .source import ChainSource

__all__ = ["Dense", "Overlay", "basic_index", "bounding_box", "dense_grid", "dense_layer", "dense_metadata",
           "delta_rows", "plan_box", "read_plan"]

Overlay = Callable[[], None]


def _entry(checkpoint: ChainSource, key: str, above: ArrayEntry | None = None) -> ArrayEntry:
    """``key``'s entry in ``checkpoint`` (an alias's target: its ``key`` is then the target's); with ``above`` (the
    entry of the delta reading through it), it must be a tensor of the same dtype and shape, or the chain is
    inconsistent."""
    entry = checkpoint.manifest.array_entry(key)
    if entry is None:
        raise CorruptCheckpointError(f"{checkpoint.location}: a delta checkpoint reads tensor {key!r} through this "
                                     "base, which does not hold it")
    if above is not None and (entry.dtype != above.dtype or entry.shape != above.shape):
        raise CorruptCheckpointError(
            f"{checkpoint.location}: tensor {key!r} is {entry.dtype.name}{list(entry.shape)} here but "
            f"{above.dtype.name}{list(above.shape)} in the delta checkpoint that reads through this base")
    return entry


class Dense(NamedTuple):
    """Where a key's data is stored as an array of its own shape: the layer, and the key of that array there (an
    alias's target, where the key is an alias in that layer or in one above it)."""

    layer: ChainSource
    key: str


def dense_layer(checkpoint: ChainSource, key: str) -> Dense:
    """The nearest layer of the chain (``checkpoint`` itself or a base) that stores ``key`` as an array of its
    own shape: a full array or a chunks delta (a rows delta has only rows)."""
    layer, entry = checkpoint, _entry(checkpoint, key)
    while entry.delta is not None and entry.delta.mode == "rows":
        layer = layer.base
        entry = _entry(layer, entry.key, entry)
    return Dense(layer, entry.key)


def dense_metadata(checkpoint: ChainSource, key: str) -> JSON:
    """The array metadata of tensor ``key`` in the nearest layer of the chain storing it as an array of its shape
    (``checkpoint`` itself, or a base for a rows delta)."""
    dense = dense_layer(checkpoint, key)
    return dense.layer.metadata[dense.key]


def dense_grid(checkpoint: ChainSource, key: str) -> tuple[int, ...]:
    """The read-chunk shape of :func:`dense_metadata` (inner chunks when sharded): the grid a delta of ``key``
    against this checkpoint compares and stores chunks on."""
    return tuple(read_chunk_shape(dense_metadata(checkpoint, key)))


def read_plan(checkpoint: ChainSource, key: str, box: Box, out: np.ndarray) -> tuple[list[ArrayIO], list[Overlay]]:
    """The reads (and overlays, to run after them in order) that fill ``out`` with ``box`` of ``key``."""
    jobs: list[ArrayIO] = []
    overlays: list[Overlay] = []
    plan_box(checkpoint, key, box, out, jobs, overlays)
    return jobs, overlays


def plan_box(checkpoint: ChainSource, key: str, box: Box, out: np.ndarray, jobs: list[ArrayIO],
             overlays: list[Overlay]) -> None:
    """Append to ``jobs`` the plain reads, and to ``overlays`` the overlays (to run after them, in order), that
    fill ``out`` with ``box`` of ``key``. A tensor stored whole costs one ``ArrayIO`` (``load``'s hot path)."""
    entry = _entry(checkpoint, key)
    key = entry.key  # an alias reads its target, here and through the chain
    if entry.delta is None:
        jobs.append(ArrayIO(key, checkpoint.read_spec(key), out, box.slices() if box.shape else None))
        return
    base = checkpoint.base
    _entry(base, key, entry)
    if entry.delta.mode == "rows":
        plan_box(base, key, box, out, jobs, overlays)
        overlays.append(lambda: _overlay_rows(checkpoint, entry, box, out))
        return
    grid = tuple(outer_chunk_shape(checkpoint.metadata[key]))
    stored = _present_in(checkpoint.present_chunks(key), box, grid, entry.shape) if box.size else []
    if not stored:
        plan_box(base, key, box, out, jobs, overlays)
        return
    _plan_chunks(_Layer(base, key, checkpoint.read_spec(key), grid), box, out, stored, 0, jobs, overlays)


class _Layer(NamedTuple):
    """A chunks delta being read: its base, the key, its array's spec and chunk shape."""

    base: ChainSource
    key: str
    spec: JSON
    grid: tuple[int, ...]


def _plan_chunks(layer: _Layer, box: Box, out: np.ndarray, stored: list[tuple[int, ...]], dim: int,
                 jobs: list[ArrayIO], overlays: list[Overlay]) -> None:
    """Rule 2 of spec §10.6 for ``box``, which lies within one chunk along dimensions ``< dim``; ``stored``: the
    grid indices of the present chunks that meet it. Along ``dim``, each run of chunks none of which is present is
    filled from the base at once, so a read costs reads in proportion to the chunks present, not to the grid (a
    crafted grid claims millions of chunks where the delta stores one)."""
    if dim == len(box.shape):  # one chunk, present: read its part of the box from this layer
        jobs.append(ArrayIO(layer.key, layer.spec, out, box.slices() if box.shape else None))
        return
    c = layer.grid[dim]
    by_chunk: dict[int, list[tuple[int, ...]]] = {}
    for index in stored:
        by_chunk.setdefault(index[dim], []).append(index)
    position, stop = box.offset[dim], box.stop[dim]
    for i in sorted(by_chunk):
        lo, hi = max(i * c, box.offset[dim]), min((i + 1) * c, stop)
        if position < lo:  # the run of chunks before this one stores nothing here: the base's
            _fill(layer, box, out, dim, position, lo, jobs, overlays, None)
        _fill(layer, box, out, dim, lo, hi, jobs, overlays, by_chunk[i])
        position = hi
    if position < stop:
        _fill(layer, box, out, dim, position, stop, jobs, overlays, None)


def _fill(layer: _Layer, box: Box, out: np.ndarray, dim: int, lo: int, hi: int, jobs: list[ArrayIO],
          overlays: list[Overlay], stored: list[tuple[int, ...]] | None) -> None:
    """Fill the part ``[lo, hi)`` along ``dim`` of ``box``: from the base (``stored`` is ``None``), or chunk-wise
    along the next dimension."""
    part = Box((*box.offset[:dim], lo, *box.offset[dim + 1:]), (*box.shape[:dim], hi - lo, *box.shape[dim + 1:]))
    view = out[part.relative_to(box)]
    if stored is None:
        plan_box(layer.base, layer.key, part, view, jobs, overlays)
    else:
        _plan_chunks(layer, part, view, stored, dim + 1, jobs, overlays)


def _present_in(present: frozenset[int], box: Box, grid: tuple[int, ...],
                shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The grid indices of the chunks of ``present`` (flat indices) that meet ``box``, found by whichever is fewer:
    the box's cells, or the stored chunks (a crafted grid claims millions of cells while the delta stores one)."""
    counts = [-(-n // c) for n, c in zip(shape, grid, strict=True)]
    first = [o // c for o, c in zip(box.offset, grid, strict=True)]
    last = [-(-e // c) for e, c in zip(box.stop, grid, strict=True)]
    if math.prod(b - a for a, b in zip(first, last, strict=True)) <= len(present):
        return [unravel(flat, counts) for flat, _ in grid_cells(box, grid, shape) if flat in present]
    found = [unravel(flat, counts) for flat in present]
    return sorted(i for i in found if all(a <= x < b for x, a, b in zip(i, first, last, strict=True)))



def delta_rows(checkpoint: ChainSource, entry: ArrayEntry) -> np.ndarray:
    """The row indices a rows delta of ``checkpoint`` stores (read once, then kept; -1 marks padding). Runs in
    an overlay, inside the read path's checks."""
    cache = checkpoint.rows_cache
    if entry.key not in cache:
        spec = checkpoint.rows_delta_spec(entry, "rows")
        rows = np.empty(tuple(array_shape(json_object(spec.get("metadata")))), np.int64)
        read_into([ArrayIO(entry.key, spec, rows)], checkpoint.read_context, str(checkpoint.location))
        checkpoint.check_delta_rows(entry, rows)
        cache[entry.key] = rows
    return cache[entry.key]


def _overlay_rows(checkpoint: ChainSource, entry: ArrayEntry, box: Box, out: np.ndarray) -> None:
    """Write this layer's changed rows that fall in ``box`` over ``out``."""
    rows = delta_rows(checkpoint, entry)
    positions = np.flatnonzero((rows >= box.offset[0]) & (rows < box.stop[0]))
    if not len(positions):
        return
    values = _row_values(checkpoint, entry, positions)
    columns = tuple(slice(o, o + n) for o, n in zip(box.offset[1:], box.shape[1:], strict=True))
    out = as_typed(out, entry.dtype)  # (a bfloat16 host view comes carrier-typed: assigning would convert by value)
    out[rows[positions] - box.offset[0]] = values[(slice(None), *columns)]  # out covers exactly the box


def _read_rows_of(checkpoint: ChainSource, entry: ArrayEntry, name: str, positions: np.ndarray) -> np.ndarray:
    """Rows ``positions`` (ascending) of array ``name`` of a rows delta: the span they cover read (one read path
    for every layout: a packed array's chunk files are staged for it), then those rows taken from it."""
    spec = checkpoint.rows_delta_spec(entry, name)
    metadata = json_object(spec.get("metadata"))
    shape = tuple(array_shape(metadata))
    lo, hi = int(positions[0]), int(positions[-1]) + 1
    span = np.empty((hi - lo, *shape[1:]), dtype_by_name(str(metadata["data_type"])).numpy)
    index = (slice(lo, hi), *(slice(0, n) for n in shape[1:]))
    read_into([ArrayIO(entry.key, spec, span, index)], checkpoint.read_context, str(checkpoint.location))
    rows: np.ndarray = as_typed(span, dtype_by_name(str(metadata["data_type"])))[positions - lo]
    return rows


def _row_values(checkpoint: ChainSource, entry: ArrayEntry, positions: np.ndarray) -> np.ndarray:
    """The stored new values of the rows at ``positions`` of a rows delta, dequantized if they are codes."""
    assert entry.delta is not None
    quantized = entry.delta.quantized
    if quantized is None:
        return _read_rows_of(checkpoint, entry, "values", positions)
    codes = _read_rows_of(checkpoint, entry, "codes", positions)
    q = QuantizedRows(codes, _read_rows_of(checkpoint, entry, "scale", positions),
                      _read_rows_of(checkpoint, entry, "offset", positions), quantized.bits,
                      int(np.prod(entry.shape[1:], dtype=np.int64)))
    return dequantize_rows(q, entry.dtype.numpy).reshape(len(positions), *entry.shape[1:])


def basic_index(index: object, shape: tuple[int, ...]) -> tuple[int | slice, ...] | None:
    """A numpy basic index (ints, slices with positive steps, ``...``) normalised as numpy reads it: ``...``
    expanded, negative positions counted from the end, slices clipped to the shape; an integer out of range
    raises :class:`IndexError` as numpy does. ``None`` for anything else (advanced indexing, ``None``, negative
    steps), which the caller leaves to numpy on the whole array."""
    if not isinstance(index, tuple):
        index = (index,)
    if sum(part is Ellipsis for part in index) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if any(part is Ellipsis for part in index):
        at = next(i for i, part in enumerate(index) if part is Ellipsis)
        index = (*index[:at], *(slice(None),) * (len(shape) - len(index) + 1), *index[at + 1:])
    if len(index) > len(shape):
        if all(isinstance(part, (int, np.integer, slice)) for part in index):
            raise IndexError(f"too many indices: the array has {len(shape)} dimension(s), the index {len(index)}")
        return None
    out: list[int | slice] = []
    for axis, (part, n) in enumerate(zip((*index, *(slice(None),) * (len(shape) - len(index))), shape, strict=True)):
        if isinstance(part, (int, np.integer)) and not isinstance(part, (bool, np.bool_)):
            i = int(part) + n if part < 0 else int(part)
            if not 0 <= i < n:
                raise IndexError(f"index {int(part)} is out of bounds for axis {axis} with size {n}")
            out.append(i)
        elif isinstance(part, slice) and (part.step is None or part.step > 0):
            lo, hi, step = part.indices(n)
            out.append(slice(lo, max(hi, lo), step))
        else:
            return None
    return tuple(out)


def bounding_box(index: object, shape: tuple[int, ...]) -> tuple[Box, tuple[int | slice, ...]] | None:
    """For a basic index (see :func:`basic_index`): the box it touches and the same index relative to that box;
    ``None`` for anything else (the caller reads everything)."""
    normal = basic_index(index, shape)
    if normal is None:
        return None
    start, size = [], []
    relative: list[int | slice] = []
    for part in normal:
        if isinstance(part, int):
            start.append(part)
            size.append(1)
            relative.append(0)
        else:
            start.append(part.start)
            size.append(part.stop - part.start)
            relative.append(slice(0, part.stop - part.start, part.step))
    return Box(tuple(start), tuple(size)), tuple(relative)
