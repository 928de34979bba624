"""Boxes: hyper-rectangles of a global array (an offset and a shape per dimension), and the chunks of a
regular grid that meet one. Pure geometry, no IO and no torch: shards, chunks, write tasks and reads are all
boxes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from .._format.zarr import grid_indices

__all__ = ["Box", "CoverProblem", "cover_problem", "distinct_rows", "grid_cells", "shard_steps", "sorted_unique"]


@dataclass(frozen=True)
class Box:
    """A hyper-rectangle of a global array: ``offset`` and ``shape`` per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def stop(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offset, self.shape, strict=True))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.shape, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The common part of two boxes, or ``None`` when they do not overlap (empty boxes never do)."""
        start = tuple(max(a, b) for a, b in zip(self.offset, other.offset, strict=True))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop, strict=True))
        if any(e <= s for s, e in zip(start, stop, strict=True)):
            return None
        return Box(start, tuple(e - s for s, e in zip(start, stop, strict=True)))

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """This box's slices in the coordinates of ``outer`` (which contains it)."""
        return tuple(slice(o - oo, o - oo + n) for o, oo, n in zip(self.offset, outer.offset, self.shape, strict=True))

    @classmethod
    def whole(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), shape)


def row_pieces(box: Box, row_bytes: int, budget: int, multiple: int = 1) -> list[Box]:
    """``box`` cut along its first dimension into pieces of at most ``budget`` bytes (``row_bytes`` a row) where
    it can be, each a whole number of ``multiple`` rows counted from its start (a piece is never less than
    ``multiple`` rows); ``[box]`` when it fits, is 0-d, or ``multiple`` is 0. Device transfers go a batch at a
    time: a tensor bigger than a batch is moved in such pieces (at chunk rows for writes, whose chunks' checksums
    need whole chunks)."""
    if not box.shape or multiple <= 0 or row_bytes * box.shape[0] <= budget:
        return [box]
    step = max(1, budget // max(row_bytes * multiple, 1)) * multiple
    return [Box((start, *box.offset[1:]), (min(step, box.stop[0] - start), *box.shape[1:]))
            for start in range(box.offset[0], box.stop[0], step)]


def grid_cells(box: Box, grid: tuple[int, ...], shape: tuple[int, ...]) -> Iterator[tuple[int, Box]]:
    """The chunks of the regular grid ``grid`` over an array of ``shape`` that meet ``box``: (flat C-order index,
    the chunk's box clipped to the array), in C order, lazily (memory does not grow with the number of chunks)."""
    counts = [math.ceil(n / c) for n, c in zip(shape, grid, strict=True)]
    ranges = [range(o // c, math.ceil(e / c)) for o, e, c in zip(box.offset, box.stop, grid, strict=True)]
    for index in grid_indices(ranges):
        start = tuple(i * c for i, c in zip(index, grid, strict=True))
        stop = tuple(min(s + c, n) for s, c, n in zip(start, grid, shape, strict=True))
        flat = int(np.ravel_multi_index(index, counts)) if counts else 0
        yield flat, Box(start, tuple(e - s for s, e in zip(start, stop, strict=True)))


# --- many boxes at once (the coordinator's planning): int64 arrays, one row per box ------------------------------

_MIX = np.uint64(0x9E3779B97F4A7C15)


def distinct_rows(columns: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group identical rows of int64 columns (1-D or 2-D arrays side by side): ``(order, starts, counts)`` where
    ``order`` lists each group's rows together, in their original order within a group; group ``g`` is
    ``order[starts[g]:starts[g] + counts[g]]``, and groups are numbered in the order of their first row. Sorts a
    64-bit hash of the rows (one argsort instead of a lexicographic sort of every column); rows with equal hashes
    are compared, and a collision between different rows falls back to the exact sort."""
    def rows(at: np.ndarray | slice = slice(None)) -> np.ndarray:
        return np.column_stack([np.asarray(c, np.int64)[at] for c in columns])

    n = len(columns[0])
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    digest = np.zeros(n, np.uint64)
    for column in (c.reshape(n, -1) for c in columns):
        for j in range(column.shape[1]):
            digest ^= column[:, j].astype(np.int64, copy=False).view(np.uint64)
            digest *= _MIX
            digest ^= digest >> np.uint64(29)
    order = np.argsort(digest, kind="stable")
    ordered = digest[order]
    first = np.empty(n, bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    repeated = np.flatnonzero(~first)  # rows whose hash equals the previous row's: replicas, or a collision
    if len(repeated) and (rows(order[repeated]) != rows(order[repeated - 1])).any():
        order = np.lexsort(rows().T[::-1])
        ordered_rows = rows(order)
        first[1:] = (ordered_rows[1:] != ordered_rows[:-1]).any(axis=1)
    starts = np.flatnonzero(first)
    counts = np.diff(np.append(starts, n))
    group = np.empty(n, np.int64)
    group[order] = np.cumsum(first) - 1
    head = np.zeros(n, bool)
    head[order[starts]] = True
    by_first = group[np.flatnonzero(head)]  # the groups in the order of their first row: later gathers run forwards
    return order, starts[by_first], counts[by_first]


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted: ``np.unique`` of a 1-D array without its import of ``numpy.ma`` (10-20 ms, which
    every first save in a process would pay planning its layout)."""
    ordered = np.sort(values)
    keep = np.ones(len(ordered), bool)
    keep[1:] = ordered[1:] != ordered[:-1]
    return ordered[keep]


def shard_steps(shape: tuple[int, ...], offsets: np.ndarray, shapes: np.ndarray) -> tuple[int | None, ...]:
    """:func:`~arrayckpt._layout.chunking.shard_grid` of many boxes given as ``(n, ndim)`` offsets and shapes."""
    out: list[int | None] = []
    for d, n in enumerate(shape):
        bounds = np.concatenate((offsets[:, d], offsets[:, d] + shapes[:, d]))
        interior = sorted_unique(bounds[(bounds > 0) & (bounds < n)])
        out.append(int(np.gcd.reduce(interior)) if len(interior) else None)
    return tuple(out)


class CoverProblem(NamedTuple):
    """Why distinct boxes do not tile an array: a box reaching ``"outside"`` it (``boxes``: that box), boxes that
    ``"overlap"`` (``boxes``: those meeting at the first doubly-covered cell), or a ``"gap"`` (``start``, ``stop``:
    the first uncovered cell). Boxes are given by their row in the ``offsets`` and ``shapes`` looked at."""

    what: Literal["outside", "overlap", "gap"]
    boxes: tuple[int, ...] = ()
    start: tuple[int, ...] = ()
    stop: tuple[int, ...] = ()


def cover_problem(shape: tuple[int, ...], offsets: np.ndarray, shapes: np.ndarray) -> CoverProblem | None:
    """Whether distinct boxes tile an array of ``shape`` exactly: ``None``, or the first problem found (see
    :class:`CoverProblem`). Cells are the grid of every box boundary; a box covering one cell (the usual shard
    grid) is counted with one ``bincount``, others with an N-D difference array."""
    if math.prod(shape) == 0:
        return None
    ndim = len(shape)
    stops = offsets + shapes
    outside = (offsets < 0).any(axis=1) | (stops > np.array(shape, np.int64)).any(axis=1) if ndim else None
    if outside is not None and outside.any():
        return CoverProblem("outside", (int(np.argmax(outside)),))
    if ndim == 0:
        return None if len(offsets) else CoverProblem("gap")
    bounds = [sorted_unique(np.concatenate(([0, n], offsets[:, d], stops[:, d]))) for d, n in enumerate(shape)]
    lo = [np.searchsorted(b, offsets[:, d]) for d, b in enumerate(bounds)]
    hi = [np.searchsorted(b, stops[:, d]) for d, b in enumerate(bounds)]
    cells = tuple(len(b) - 1 for b in bounds)
    if all(((h - lo_) == 1).all() for lo_, h in zip(lo, hi, strict=True)):
        cover = np.bincount(np.ravel_multi_index(tuple(lo), cells), minlength=math.prod(cells)).reshape(cells)
    else:
        diff = np.zeros([c + 1 for c in cells], np.int64)
        for corner in itertools.product((0, 1), repeat=ndim):
            np.add.at(diff, tuple(hi[d] if c else lo[d] for d, c in enumerate(corner)), (-1) ** sum(corner))
        for d in range(ndim):
            diff = np.cumsum(diff, axis=d)
        cover = diff[tuple(slice(0, c) for c in cells)]
    if (cover > 1).any():
        cell = np.argwhere(cover > 1)[0]
        inside = np.ones(len(offsets), bool)
        for d in range(ndim):
            inside &= (lo[d] <= cell[d]) & (cell[d] < hi[d])
        return CoverProblem("overlap", tuple(np.flatnonzero(inside).tolist()))
    if (cover == 0).any():
        cell = np.argwhere(cover == 0)[0]
        return CoverProblem("gap", start=tuple(int(b[c]) for b, c in zip(bounds, cell, strict=True)),
                            stop=tuple(int(b[c + 1]) for b, c in zip(bounds, cell, strict=True)))
    return None
