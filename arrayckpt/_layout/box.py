"""Boxes: hyper-rectangles of a global array (an offset and a shape per dimension), and the chunks of a
regular grid that meet one. Pure geometry, no IO and no torch: shards, chunks, write tasks and reads are all
boxes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Box", "grid_cells"]


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


def grid_cells(box: Box, grid: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[int, Box]]:
    """The chunks of the regular grid ``grid`` over an array of ``shape`` that meet ``box``: (flat C-order index,
    the chunk's box clipped to the array)."""
    counts = [math.ceil(n / c) for n, c in zip(shape, grid, strict=True)]
    ranges = [range(o // c, math.ceil(e / c)) for o, e, c in zip(box.offset, box.stop, grid, strict=True)]
    out = []
    for index in itertools.product(*ranges):
        start = tuple(i * c for i, c in zip(index, grid, strict=True))
        stop = tuple(min(s + c, n) for s, c, n in zip(start, grid, shape, strict=True))
        flat = int(np.ravel_multi_index(index, counts)) if counts else 0
        out.append((flat, Box(start, tuple(e - s for s, e in zip(start, stop, strict=True)))))
    return out
