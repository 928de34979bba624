"""What ``report`` shows, as values: one tensor's statistics and histogram, its change against another checkpoint,
chunk grids, the chain of bases, what a delta stores, and the tree of sizes with its treemap layout.

``build.py`` and ``layout.py`` fill them in from a checkpoint; ``figures.py`` draws them and
``page.py`` writes them out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..estimate import human_bytes

__all__ = ["MAX_CELLS", "MODEL", "OPTIMIZER", "Change", "ChangeGroup", "ChunkGrid", "DeltaPart", "Histogram", "Layer",
           "ReportData", "SizeNode", "TensorStats", "change_groups", "human_bytes", "optimizer_state", "printable",
           "size_tree", "squarify"]


def printable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode as U+FFFD: a path whose name is not UTF-8 reaches Python with
    surrogate escapes (``os.fsdecode``), which neither the page (UTF-8) nor matplotlib's text can hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
    return text


@dataclass(frozen=True)
class TensorStats:
    """One tensor's statistics, as :func:`arrayckpt.show` computes them for the whole tensor, plus zeros.

    ``count`` is every element (NaN and inf included); min/max/mean/std are over the finite values.
    ``computed`` is false for a tensor left out by ``max_tensors``; ``error`` says why one could not be read.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored: str = "whole"  # how a delta checkpoint stores it: whole, unchanged, 3/16 chunks, 120 rows
    computed: bool = False
    count: int = 0
    nan: int = 0
    inf: int = 0
    zeros: int = 0
    min: float | int | None = None
    max: float | int | None = None
    mean: float | None = None
    std: float | None = None
    error: str = ""

    @property
    def nonfinite(self) -> bool:
        return bool(self.nan or self.inf)


@dataclass(frozen=True)
class Histogram:
    """Counts of a tensor's finite values in ``len(counts)`` bins, from ``sampled`` of its ``count`` values."""

    key: str
    counts: np.ndarray
    edges: np.ndarray
    sampled: int
    count: int


@dataclass(frozen=True)
class Change:
    """``||a - b|| / ||b||`` of one tensor over its finite elements (``b`` the checkpoint compared against), and
    its place in the layer heat map. NaN when NaN or inf values differ between the two (NaN and inf where both
    have them are no change); inf when ``b`` is all zeros and ``a`` is not."""

    key: str
    relative: float
    layer: tuple[str, int] | None


# The last key part of an optimizer's per-parameter state under a ``state`` part, in torch's optimizers (a key with a
# part named ``optim…`` is optimizer state whatever its last part: ``optimizer_states.0.state.3.exp_avg``)
MOMENTS = frozenset({"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta",
                     "grad_avg", "sum", "step", "mu", "eta", "ax", "prev", "step_size", "exp_inf"})
MODEL, OPTIMIZER = "model", "optimizer state"  # the groups of the change chart, in this order


def optimizer_state(key: str) -> bool:
    """Whether ``key`` holds optimizer state rather than the model: a part before the last names an optimizer
    (``optim``, ``optimizer``, ``optimizer_states``: DCP's, DeepSpeed's, Lightning's, Megatron's keys), or the
    key is a moment under a ``state`` part (``opt.state.0.exp_avg``).

    >>> [optimizer_state(k) for k in ("optim.state.fc.weight.exp_avg", "optimizer.state.exp_avg.decoder.w",
    ...                                "opt.state.0.momentum_buffer", "model.fc.weight", "model.state.weight")]
    [True, True, True, False, False]
    """
    parts = key.split(".")
    return any(p.lower().startswith("optim") for p in parts[:-1]) or ("state" in parts[:-1] and parts[-1] in MOMENTS)


@dataclass(frozen=True)
class ChangeGroup:
    """The tensors of one group of the change chart (``model`` or ``optimizer state``) that it shows, largest change
    first, of ``total`` compared."""

    name: str
    changes: list[Change]
    total: int


def change_groups(changes: list[Change], limit: int) -> list[ChangeGroup]:
    """What the "which tensors moved" chart shows of ``changes`` (largest first): the model's tensors, then the
    optimizer state's, each largest first, at most ``limit`` in all, each group at least half of them when it has
    that many (the model's weights move by about the learning rate, its optimizer's moments by far more: ranked
    together, the moments would fill the chart). Groups with nothing compared are left out.

    >>> [(g.name, [c.key for c in g.changes], g.total) for g in change_groups(
    ...     [Change("optim.state.w.exp_avg", 1.0, None), Change("optim.state.w.exp_avg_sq", 0.9, None),
    ...      Change("model.w", 1e-3, None), Change("model.b", 1e-4, None)], 3)]
    [('model', ['model.w', 'model.b'], 2), ('optimizer state', ['optim.state.w.exp_avg'], 2)]
    """
    model = [c for c in changes if not optimizer_state(c.key)]
    optimizer = [c for c in changes if optimizer_state(c.key)]
    kept = min(len(model), max(limit - len(optimizer), (limit + 1) // 2))
    groups = [ChangeGroup(MODEL, model[:kept], len(model)), ChangeGroup(OPTIMIZER, optimizer[:limit - kept],
                                                                         len(optimizer))]
    return [group for group in groups if group.total]


@dataclass
class ReportData:
    """Everything a report shows (:func:`collect`); ``page.render`` turns it into the page."""

    location: str
    format_version: int
    step: int | None
    created: Mapping[str, Any]
    tensors: list[TensorStats]
    against: str | None = None
    histograms: list[Histogram] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)  # largest first
    unmatched: list[tuple[str, str]] = field(default_factory=list)  # (key, why it has no change)
    grids: list[ChunkGrid] = field(default_factory=list)
    chain: list[Layer] = field(default_factory=list)  # empty for a full checkpoint
    deltas: list[DeltaPart] = field(default_factory=list)
    values: list[tuple[str, str]] = field(default_factory=list)  # (key, what it holds)

    @property
    def world_size(self) -> int | None:
        size = self.created.get("world_size")
        return size if isinstance(size, int) and not isinstance(size, bool) else None

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


MAX_CELLS = 128  # chunks drawn per dimension of a grid picture (more are drawn in groups)


@dataclass(frozen=True)
class ChunkGrid:
    """A tensor's outer chunk grid (and inner chunks when sharded), from its array metadata. A picture draws the
    (at most two) dimensions with the most chunks, in cells of ``group`` chunks per dimension when there are more
    than ``MAX_CELLS`` (:attr:`view`); everything drawn is a few thousand values, whatever the grid's size."""

    key: str
    shape: tuple[int, ...]
    chunk: tuple[int, ...]
    inner: tuple[int, ...] | None
    # The rank that wrote the first chunk of each drawn cell (:meth:`drawn_chunks`), in C order of the cells, in
    # whichever checkpoint of a delta chain stores it (-1: not recorded there); None: not recorded
    writers: tuple[int, ...] | None = None
    # The drawn cells (positions in :meth:`drawn_chunks`) whose first chunk a base checkpoint of the chain stores,
    # rather than this one
    in_base: frozenset[int] = frozenset()

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(math.ceil(n / c) for n, c in zip(self.shape, self.chunk, strict=True))

    @property
    def view(self) -> tuple[tuple[int, ...], int]:
        """The dimensions drawn (at most two, those with the most chunks) and the chunks per cell along each."""
        counts = self.counts
        dims = tuple(sorted(sorted(range(len(counts)), key=lambda d: -counts[d])[:2]))
        return dims, max(1, max((math.ceil(counts[d] / MAX_CELLS) for d in dims), default=1))

    def drawn_chunks(self) -> np.ndarray:
        """The flat C-order index of the first chunk of each drawn cell, in C order of the cells (the other
        dimensions at their first chunk)."""
        counts = self.counts
        dims, group = self.view
        axes = [np.arange(0, n, group) if d in dims else np.zeros(1, np.int64) for d, n in enumerate(counts)]
        if not axes:
            return np.zeros(1, np.int64)
        mesh = np.meshgrid(*axes, indexing="ij")
        return np.ravel_multi_index([m.ravel() for m in mesh], counts).astype(np.int64)


@dataclass(frozen=True)
class DeltaPart:
    """What a delta checkpoint stores of one tensor (``mode``: ``chunks``, ``rows`` or ``whole``): for a picture,
    the chunks of ``grid`` it stores (``present``), or ``row_density``, the fraction of rows it stores in each of
    ``len(row_density)`` equal bins of rows."""

    key: str
    mode: str
    stored: str
    stored_bytes: int
    nbytes: int
    grid: ChunkGrid | None = None
    present: frozenset[int] = frozenset()
    row_density: np.ndarray | None = None

    @property
    def drawn(self) -> bool:
        return self.grid is not None or self.row_density is not None


@dataclass(frozen=True)
class Layer:
    """One checkpoint of a chain, newest first (``error``: it could not be opened)."""

    location: str
    step: int | None
    stored_bytes: int | None
    delta: bool
    error: str = ""


@dataclass
class SizeNode:
    """A dotted prefix of keys (``model.layers``) with the bytes and tensors below it, children largest first."""

    name: str  # its last part ("" for the root)
    nbytes: int = 0
    tensors: int = 0
    children: list[SizeNode] = field(default_factory=list)


def size_tree(tensors: list[TensorStats], depth: int = 4) -> SizeNode:
    """The tensors' bytes summed by key prefix, ``depth`` parts deep (deeper parts are counted in their prefix).

    >>> tree = size_tree([TensorStats("m.a.w", "float32", (2,), 8), TensorStats("m.b", "float32", (1,), 4)])
    >>> tree.nbytes, [(c.name, c.nbytes) for c in tree.children[0].children]
    (12, [('a', 8), ('b', 4)])
    """
    root = SizeNode("")
    index: dict[tuple[str, ...], SizeNode] = {(): root}
    for tensor in tensors:
        parts = tuple(tensor.key.split("."))[:depth]
        for n in range(len(parts) + 1):
            node = index.get(parts[:n])
            if node is None:
                node = index[parts[:n]] = SizeNode(parts[n - 1])
                index[parts[:n - 1]].children.append(node)
            node.nbytes += tensor.nbytes
            node.tensors += 1
    for node in index.values():
        node.children.sort(key=lambda c: -c.nbytes)
    return root


def squarify(sizes: list[float], x: float, y: float, width: float, height: float) -> list[tuple[float, ...]]:
    """Rectangles ``(x, y, width, height)`` of areas proportional to ``sizes`` (largest first) tiling the given
    one, as square as the squarified treemap algorithm (Bruls, Huizing, van Wijk) makes them.

    >>> [tuple(round(v, 3) for v in r) for r in squarify([2, 1, 1], 0, 0, 2, 2)]
    [(0, 0, 1.0, 2.0), (1.0, 0, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0)]
    """
    total = sum(sizes)
    areas = [s * width * height / total for s in sizes] if total > 0 else []
    out: list[tuple[float, ...]] = []
    while areas:
        short = min(width, height)
        row = [areas[0]]
        while len(row) < len(areas) and _worst(row + [areas[len(row)]], short) <= _worst(row, short):
            row.append(areas[len(row)])
        areas = areas[len(row):]
        if width >= height:  # the row is a column at the left
            step = sum(row) / height if height else 0.0
            offset = y
            for area in row:
                out.append((x, offset, step, area / step if step else 0.0))
                offset += out[-1][3]
            x, width = x + step, width - step
        else:  # a row at the bottom
            step = sum(row) / width if width else 0.0
            offset = x
            for area in row:
                out.append((offset, y, area / step if step else 0.0, step))
                offset += out[-1][2]
            y, height = y + step, height - step
    return out


def _worst(row: list[float], short: float) -> float:
    total = sum(row)
    if not total or not short:
        return math.inf
    return max(max(short * short * r / (total * total), total * total / (short * short * r)) if r else math.inf
               for r in row)
