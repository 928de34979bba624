"""Each rank's part of a save: what the coordinator sends it, and the :class:`RankPlan` the rank writes from.

A rank needs only its own write tasks and the arrays they write to, never the whole :class:`SavePlan`: its part is
sent to it alone (a scatter), so the bytes a rank receives do not grow with the number of ranks.

- A full save's part is a :class:`RankLayout` (its share of the :class:`Layout`, made by :func:`rank_layouts`):
  per task, the row of the rank's *own* description it cuts from, the box, and the array's outer and inner chunk
  shapes and codec, all as numpy arrays. No key, path or dtype travels (the rank has them), so a RankLayout is a few
  small arrays, cheap to build, pickle and send for every rank. The rank turns it into its RankPlan with
  :func:`expand`, and holds it in its ``PlanCache``: a later save with the same Layout sends it nothing
  (``_write/exchange.py``).
- A delta save's part is the rank's :class:`RankPlan` itself (its tasks depend on what changed, every save):
  :func:`explicit_part`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .._format.codecs import Codec
from .._format.dtypes import dtype_by_name
from .._format.keys import array_path
from .._format.manifest import ArrayEntry, Entry, per_rank_path
from .box import Box
from .chunking import ArrayPlan
from .pieces import DTYPE, GLOBAL, NDIM, LocalDescription
from .saveplan import Layout, SavePlan
from .tasks import Task, WriteTask

__all__ = ["RankLayout", "RankPlan", "expand", "explicit_part", "rank_layouts"]

ROW_ARRAYS = ("rows", "values", "codes", "scale", "offset")  # a rows delta's arrays (``delta.py``)


@dataclass(frozen=True, eq=False)
class RankLayout:
    """One rank's part of a full save's :class:`Layout`, as it travels and as the rank holds it (see the module
    docstring)."""

    source: np.ndarray  # per task: row of the rank's ``arrays`` table, or len(arrays) + j for its per_rank[j]
    offset: np.ndarray  # (tasks, width)
    shape: np.ndarray
    outer: np.ndarray  # the chunk shapes of each task's array
    inner: np.ndarray
    codec: np.ndarray  # per task: index into ``codecs``
    codecs: tuple[Codec, ...]
    sent: tuple[str, ...] = ()  # the plain values this rank sends when the layout is reused (``ValueLayout.sent``)


@dataclass(frozen=True)
class RankPlan:
    """What one rank writes: its tasks, the arrays they write to by path, and the entries of their keys."""

    tasks: tuple[Task, ...]
    arrays: dict[str, ArrayPlan]
    entries: dict[str, Entry] = field(default_factory=dict)  # by key; only a delta's (their ``delta`` mode)


def rank_layouts(layout: Layout) -> list[RankLayout]:
    """Every rank's :class:`RankLayout` (vectorised over all tasks; ``PlanCache.rank_layouts`` keeps them)."""
    table = layout.tasks
    width = table.offset.shape[1]
    codecs: dict[Codec, int] = {}
    outer = np.ones((len(table.plans), width), np.int64)
    inner = np.ones((len(table.plans), width), np.int64)
    codec = np.zeros(len(table.plans), np.int64)
    for i, plan in enumerate(table.plans):
        outer[i, :len(plan.shape)], inner[i, :len(plan.shape)] = plan.outer_chunk, plan.inner_chunk
        codec[i] = codecs.setdefault(plan.codec, len(codecs))
    by_codec = tuple(codecs)
    outers, inners, task_codecs = outer[table.array], inner[table.array], codec[table.array]
    starts = table.starts.tolist()
    parts = []
    for rank in range(len(table)):
        rows = slice(starts[rank], starts[rank + 1])
        parts.append(RankLayout(table.source[rows], table.offset[rows], table.shape[rows], outers[rows], inners[rows],
                                task_codecs[rows], by_codec, layout.values.sent[rank]))
    return parts


def expand(part: RankLayout, description: LocalDescription, rank: int, key_encoding: str) -> RankPlan:
    """The tasks and arrays of a :class:`RankLayout`, from the rank's own description."""
    table = description.table
    n = len(table)
    tasks = []
    arrays: dict[str, ArrayPlan] = {}
    for source, offset, shape, outer, inner, codec in zip(part.source.tolist(), part.offset.tolist(),
                                                         part.shape.tolist(), part.outer.tolist(),
                                                         part.inner.tolist(), part.codec.tolist(), strict=True):
        if source < n:
            key = table.keys[source]
            ndim = int(table.meta[source, NDIM])
            dtype = dtype_by_name(table.dtypes[int(table.meta[source, DTYPE])])
            global_shape = tuple(table.coords[source, GLOBAL, :ndim].tolist())
            path = array_path(key)
        else:
            item = description.per_rank[source - n]
            assert isinstance(item, ArrayEntry)
            key, dtype, global_shape, ndim = item.key, item.dtype, item.shape, len(item.shape)
            path = per_rank_path(key, rank)
        if path not in arrays:
            arrays[path] = ArrayPlan(key, path, dtype, global_shape, tuple(outer[:ndim]), tuple(inner[:ndim]),
                                     part.codecs[codec], key_encoding)
        tasks.append(WriteTask(key, path, Box(tuple(offset[:ndim]), tuple(shape[:ndim]))))
    return RankPlan(tuple(tasks), arrays)


def explicit_part(plan: SavePlan, rank: int) -> RankPlan:
    """Rank ``rank``'s part of any plan (a delta's too) as objects: its tasks, their arrays and entries."""
    tasks = tuple(plan.tasks[rank])
    arrays: dict[str, ArrayPlan] = {}
    for task in tasks:
        for path in (task.path, *(f"{task.path}/{name}" for name in ROW_ARRAYS)):
            if path in plan.arrays:
                arrays[path] = plan.arrays[path]
    return RankPlan(tasks, arrays, {task.key: plan.entries[task.key] for task in tasks})
