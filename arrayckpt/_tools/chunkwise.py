"""Chunk-by-chunk access to stored arrays, for tools that must touch every byte with bounded memory.

``verify`` and ``diff`` walk an array one outer chunk (one chunk file) at a time: that bounds memory by
the chunk size rather than the tensor size, and lets a failure be pinned on one chunk file. Reads go
through the read path (``_read/reader.py``: uncompressed local chunks take the fast path, hardware crc32c,
the rest go through TensorStore; both verify every checksum), which also refuses a checkpoint replaced
while it was being read.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .._format.dtypes import dtype_by_name
from .._format.jsontypes import JSON, json_object, member
from .._format.zarr import array_shape, chunk_key, grid_indices, outer_chunk_shape, unravel
from .._io.arrays import ArrayIO
from .._read.reader import read

if TYPE_CHECKING:
    from .._read.stored import StoredCheckpoint

__all__ = ["ChunkRef", "chunk_file", "chunk_shape", "iter_chunks", "read_chunks"]


@dataclass(frozen=True)
class ChunkRef:
    """One outer chunk of one array: where it lies in the array and the file that holds it."""

    key: str  # the dotted key of the entry it belongs to
    array_path: str  # the array's path inside the checkpoint
    file: str  # the chunk file's path inside the checkpoint, e.g. ``model/w/c.1.0``
    index: tuple[slice, ...]  # the part of the array it holds (clipped to the array's shape)
    spec: JSON  # the array's TensorStore spec

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.index)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_by_name(member(self.spec, "metadata", "data_type")).itemsize


def chunk_shape(metadata: JSON) -> tuple[int, ...]:
    """The outer (write-unit) chunk shape of an array's ``zarr.json`` document."""
    return tuple(outer_chunk_shape(metadata))


def chunk_file(metadata: JSON, grid_index: tuple[int, ...]) -> str:
    """The chunk key of outer chunk ``grid_index`` (``c.1.0``; ``c`` for a 0-d array)."""
    return chunk_key(metadata, grid_index)


def iter_chunks(key: str, array_path: str, spec: JSON,
                flat: Iterable[int] | None = None) -> Iterator[ChunkRef]:
    """Every outer chunk of an array in C order, or those at the C-order positions ``flat`` (none for an array with
    no elements). Lazy: memory does not grow with the number of chunks."""
    metadata = json_object(spec.get("metadata"))
    shape = tuple(array_shape(metadata))
    if math.prod(shape) == 0:
        return
    chunk = chunk_shape(metadata)
    counts = [math.ceil(n / c) for n, c in zip(shape, chunk, strict=True)]
    grid: Iterable[tuple[int, ...]] = grid_indices([range(n) for n in counts])
    if flat is not None:
        grid = (unravel(i, counts) for i in flat)
    for grid_index in grid:
        index = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(grid_index, chunk, shape, strict=True))
        file = f"{array_path}/{chunk_file(metadata, grid_index)}"
        yield ChunkRef(key, array_path, file, index, spec)



def read_chunks(checkpoint: StoredCheckpoint, chunks: list[ChunkRef]) -> list[np.ndarray]:
    """Read whole outer chunks of ``checkpoint``'s arrays concurrently into new arrays (checksums verified);
    raises on the first failure."""
    out = [np.empty(chunk.shape, dtype_by_name(member(chunk.spec, "metadata", "data_type")).numpy) for chunk in chunks]
    read(checkpoint, [ArrayIO(chunk.key, chunk.spec, data, chunk.index or None)
                      for chunk, data in zip(chunks, out, strict=True)])
    return out
