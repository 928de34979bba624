"""What ``report`` shows of where a checkpoint's bytes are: chunk grids, the chain of bases, what a delta stores.

All of it comes from metadata (array documents and manifests), except the rows a rows delta stores, whose
indices are read in blocks of ``ROWS_BLOCK`` and only counted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from ..._errors import ArrayckptError
from ..._format.dtypes import dtype_by_name
from ..._format.jsontypes import json_object
from ..._format.manifest import ArrayEntry, ValueEntry
from ..._format.values import step_value
from ..._format.writers import ranks_at
from ..._format.zarr import array_shape, grid_counts
from ..._io.arrays import ArrayIO
from ..._read.chain import dense_layer
from ..._read.checkpoint import Checkpoint, LazyArray, stored_of
from ..._read.reader import read
from ..._read.source import ChainSource
from ..._read.stored import StoredCheckpoint
from .data import ChunkGrid, DeltaPart, Layer, optimizer_state

__all__ = ["chain_of", "deltas_of", "grid_of", "step_of", "stored_text"]

ROW_BINS = 256  # bins of a rows delta's picture (fraction of rows stored per bin)
ROWS_BLOCK = 1 << 20  # row indices of a rows delta read at once


def step_of(checkpoint: Checkpoint) -> int | None:
    """The step saved with the checkpoint, or else the plain value that names it (``_format.values.step_value``)."""
    if checkpoint.step is not None:
        return checkpoint.step
    found = step_value({key: e.value for key, e in checkpoint.manifest.entries.items() if isinstance(e, ValueEntry)})
    return found.step if found is not None else None


def stored_text(array: LazyArray) -> str:
    """How a tensor is stored: ``whole``, or relative to its base (``unchanged``, ``3/16 chunks``, ``120 rows``,
    ``120 rows, 8-bit (max error 0.00412)``); ``arrayckpt info`` and ``report`` both show it."""
    delta = array.entry.delta
    if delta is None:
        return "whole"
    if delta.mode == "chunks":
        total = math.prod(grid_counts(array.metadata))
        return "unchanged" if not delta.present else f"{len(delta.present)}/{total} chunks"
    lossy = f", {delta.quantized.bits}-bit (max error {delta.quantized.max_abs_error:.3g})" if delta.quantized else ""
    return f"{delta.rows} rows{lossy}"


def grid_of(checkpoint: Checkpoint, key: str) -> ChunkGrid | None:
    """The chunk grid of the array holding ``key``'s layout (a base's for a rows delta); ``None`` for a
    scalar, an empty tensor, or a base that cannot be read."""
    array = checkpoint[key]
    if not array.shape or not array.size:
        return None
    try:
        layer, stored = dense_layer(stored_of(checkpoint), key)
    except ArrayckptError:
        return None
    grid = _grid(stored, layer.metadata[stored])
    grid = _writers_from_bases(layer, replace(grid, writers=_writers(layer, stored, grid)))
    if layer is not stored_of(checkpoint) and grid.writers is not None:  # a rows delta: its chunks are all its base's
        grid = replace(grid, in_base=frozenset(i for i, rank in enumerate(grid.writers) if rank >= 0))
    return replace(grid, key=key)  # an alias: the chunks of the tensor it names, under the key asked for


def _writers_from_bases(layer: ChainSource, grid: ChunkGrid) -> ChunkGrid:
    """``grid`` with the writers of the drawn chunks that ``layer`` (a chunks delta) leaves to its bases: each from
    the base down the chain that stores it. A delta's chunks are its base's read chunks (the inner chunks of a
    sharded array), so each takes the writer of the base chunk that holds its first element. Only the drawn
    chunks are looked up (a few thousand, whatever the grid's size)."""
    if grid.writers is None or -1 not in grid.writers:
        return grid
    writers = np.asarray(grid.writers, np.int64)
    in_base = np.zeros(writers.size, bool)
    origins = np.stack(np.unravel_index(grid.drawn_chunks(), grid.counts), axis=1) * np.asarray(grid.chunk)
    entry = layer.manifest.entries.get(grid.key)
    while (writers < 0).any() and isinstance(entry, ArrayEntry) and entry.delta is not None and \
            entry.delta.mode == "chunks":
        try:
            layer = layer.base
        except ArrayckptError:  # the report's chain section says why
            break
        entry = layer.manifest.entries.get(grid.key)
        if not isinstance(entry, ArrayEntry) or (entry.delta is not None and entry.delta.mode != "chunks"):
            break
        below = _grid(grid.key, layer.metadata[grid.key])
        if below.shape != grid.shape:
            break
        holders = np.ravel_multi_index(tuple((origins // np.asarray(below.chunk)).T), below.counts)
        found = _writers(layer, grid.key, below, holders.astype(np.int64))
        if found is None:
            break
        found_ranks = np.asarray(found, np.int64)
        fill = (writers < 0) & (found_ranks >= 0)
        writers[fill], in_base[fill] = found_ranks[fill], True
    return replace(grid, writers=tuple(writers.tolist()), in_base=frozenset(np.flatnonzero(in_base).tolist()))


def _writers(layer: ChainSource, key: str, grid: ChunkGrid, drawn: np.ndarray | None = None) -> tuple[int, ...] | None:
    """Who wrote the chunks ``drawn`` (flat C-order indices; by default the first chunk of each drawn cell,
    :meth:`ChunkGrid.drawn_chunks`) of ``key``'s array in ``layer``, from the manifest's ``created.writers`` (one
    rank: rank 0 wrote all; -1: stored in a base); ``None`` when the checkpoint does not say (older ones, DCP's
    writer, a bad record). Looked up for those chunks only: never a list of the grid."""
    entry = layer.manifest.entries.get(key)
    if not isinstance(entry, ArrayEntry):
        return None
    total = math.prod(grid.counts)
    drawn = grid.drawn_chunks() if drawn is None else drawn
    if entry.delta is not None and entry.delta.mode == "chunks":  # positions in `present` order (-1: the base's)
        present = entry.delta.present
        if any(not 0 <= i < total for i in present):
            return None
        order = {flat: position for position, flat in enumerate(present)}
        positions = np.fromiter((order.get(int(flat), -1) for flat in drawn), np.int64, len(drawn))
        count = len(present)
    else:
        positions, count = drawn, total
    ranks, mine = np.full(len(positions), -1, np.int64), positions >= 0
    record = layer.manifest.created.get("writers")
    if isinstance(record, dict):
        found = ranks_at(record.get(entry.path), count, positions[mine])
        if found is None:
            return None
        ranks[mine] = found
    elif layer.manifest.created.get("world_size") == 1:  # a save by one process records nothing: it wrote all
        ranks[mine] = 0
    else:
        return None
    return tuple(ranks.tolist())


def _grid(key: str, metadata: Mapping[str, Any]) -> ChunkGrid:
    chunk = tuple(metadata["chunk_grid"]["configuration"]["chunk_shape"])
    codecs = metadata.get("codecs", [])
    inner = None
    if codecs and codecs[0].get("name") == "sharding_indexed":
        inner = tuple(codecs[0]["configuration"]["chunk_shape"])
    return ChunkGrid(key, tuple(metadata["shape"]), chunk, inner)


def chain_of(checkpoint: Checkpoint) -> list[Layer]:
    """The checkpoint and its bases, newest first; a base that cannot be opened ends the list with its error."""
    out: list[Layer] = []
    layer: Checkpoint | None = checkpoint
    while layer is not None:
        ref = layer.manifest.base
        out.append(Layer(str(layer.location), step_of(layer), layer.manifest.stored_bytes, ref is not None))
        if ref is None:
            break
        try:
            layer = layer.base
        except ArrayckptError as e:
            out.append(Layer(ref.path, ref.step, None, False, str(e)))
            layer = None
    return out


def deltas_of(checkpoint: Checkpoint, pictures: int) -> list[DeltaPart]:
    """What a delta checkpoint stores of each tensor, most stored bytes first; the first ``pictures`` chunks and
    rows deltas that store anything, the model's before the optimizer state's (whose moments, as large as the
    weights or larger, would otherwise take every picture), carry what their picture needs (present chunks, or row
    density)."""
    out = []
    drawn = 0
    for key, array in checkpoint.items():
        if array.key != key:  # an alias: stored as its target
            continue
        entry = array.entry
        stored = _stored_bytes(stored_of(checkpoint), array)
        out.append(DeltaPart(entry.key, "whole" if entry.delta is None else entry.delta.mode, stored_text(array),
                             stored, array.nbytes))
    out.sort(key=lambda p: (-p.stored_bytes, -p.nbytes))
    for i in sorted(range(len(out)), key=lambda i: optimizer_state(out[i].key)):  # the model's first
        part = out[i]
        if drawn >= pictures or not part.stored_bytes or part.mode == "whole":
            continue
        entry = checkpoint[part.key].entry
        assert entry.delta is not None
        if part.mode == "chunks" and entry.shape:
            out[i] = DeltaPart(part.key, part.mode, part.stored, part.stored_bytes, part.nbytes,
                               _grid(part.key, checkpoint[part.key].metadata), frozenset(entry.delta.present))
        elif part.mode == "rows":
            try:
                out[i] = DeltaPart(part.key, part.mode, part.stored, part.stored_bytes, part.nbytes,
                                   row_density=_row_density(stored_of(checkpoint), entry))
            except ArrayckptError:  # its rows cannot be read: the table still lists it
                continue
        drawn += out[i].drawn
    return out


def _stored_bytes(checkpoint: StoredCheckpoint, array: LazyArray) -> int:
    """Bytes a delta checkpoint stores of a tensor: all of them, its present chunks (clipped to the array), or
    its row-delta arrays (spec §4.2, ``stored_bytes``)."""
    entry = array.entry
    if entry.delta is None:
        return entry.nbytes
    if entry.delta.mode == "rows":
        total = 0
        for name in ("rows", "values", "codes", "scale", "offset"):
            node = checkpoint.nodes.get(f"{entry.path}/{name}")
            if isinstance(node, dict) and isinstance(node.get("shape"), list):
                total += math.prod(array_shape(node)) * dtype_by_name(node.get("data_type")).itemsize
        return total
    grid = _grid(entry.key, array.metadata)
    total = 0
    for flat in entry.delta.present:
        index = np.unravel_index(flat, grid.counts) if grid.counts else ()
        total += math.prod(min(c, n - int(i) * c) for i, c, n in zip(index, grid.chunk, grid.shape, strict=True))
    return total * entry.dtype.itemsize


def _row_density(checkpoint: StoredCheckpoint, entry: ArrayEntry) -> np.ndarray:
    """The fraction of rows a rows delta stores, in ``ROW_BINS`` equal bins of rows (row indices read in blocks
    of ``ROWS_BLOCK``)."""
    spec = checkpoint.rows_delta_spec(entry, "rows")
    stored = array_shape(json_object(spec.get("metadata")))[0]
    rows_total = entry.shape[0]
    bins = max(1, min(ROW_BINS, rows_total))
    changed = np.zeros(bins, np.int64)
    for start in range(0, stored, ROWS_BLOCK):
        out = np.empty(min(ROWS_BLOCK, stored - start), np.int64)
        read(checkpoint, [ArrayIO(entry.key, spec, out, (slice(start, start + len(out)),))])
        rows = out[(out >= 0) & (out < rows_total)]  # -1: padding
        changed += np.bincount(rows * bins // rows_total, minlength=bins)
    starts = -(-np.arange(bins + 1, dtype=np.int64) * rows_total // bins)  # row r is in bin r * bins // rows_total
    return changed / np.maximum(np.diff(starts), 1)
