"""Save planning on the coordinator: every rank's :class:`LocalDescription` in, a :class:`Layout` and a
:class:`SavePlan` out.

Ranks send only metadata (:class:`LocalDescription`, its pieces as columns: ``pieces.py``). The coordinator
checks that every key has one dtype and global shape, and that the distinct shards of each tensor tile it
exactly (no overlap, no gap) before a byte is written; chooses chunk grids aligned with the shard
boundaries; and gives every outer chunk exactly one writer, spreading replicated data over its replicas
balanced by bytes (``planner.py``: numpy over all pieces at once, linear in their number).

The :class:`Layout` (made by :func:`plan_layout`) depends only on what :func:`fingerprint` digests of every rank's
description, on the codec each key resolves to and on the chunk policy, so the caller may keep it for its next save
(in its ``PlanCache``; this module keeps nothing): a save whose ranks report the same fingerprints reuses it without
looking at a single piece, and :func:`assemble` adds that save's plain and per-rank values to make its
:class:`SavePlan`. :func:`plan_save` does both in one call.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .._errors import ArrayckptError, StateError
from .._format.codecs import Codec, CodecChoice, resolve_codec
from .._format.keys import Key
from .._format.manifest import ArrayEntry, Entry, PerRankEntry, ValueEntry
from .._format.zarr import node_documents
from .chunking import DEFAULT_CHUNKING, ArrayPlan, ChunkPolicy
from .pieces import ArrayDescription, ArrayTable, LocalDescription, fingerprint
from .plainvalues import ValueLayout, merge_value, plan_values
from .planner import TaskTable, _lay_out_arrays
from .tasks import Task

MAX_SEGMENT_BYTES = 255  # the usual limit of one directory entry

__all__ = ["ArrayDescription", "ArrayTable", "Fresh", "Layout", "LocalDescription", "SavePlan", "TaskTable",
           "assemble", "check_paths", "documents_of", "fingerprint", "plan_layout", "plan_save", "with_key_encoding"]

Fresh = tuple[Sequence[ValueEntry], Sequence["ValueEntry | ArrayEntry"]]  # one rank's values and per-rank values


@dataclass(frozen=True)
class SavePlan:
    """One save's plan, made on the coordinator: manifest entries, the arrays (their :class:`ArrayPlan`), each rank's
    write tasks, and the documents; the transaction writes from it, and each rank gets its part (``rankplan.py``)."""

    entries: dict[str, Entry]
    arrays: dict[str, ArrayPlan]  # by array path
    tasks: Sequence[tuple[Task, ...]]  # by rank (only a delta plan's have RowsTasks)
    containers: dict[str, str]
    bytes_by_rank: tuple[int, ...]
    documents: dict[str, bytes]  # serialised zarr.json of every array and intermediate group, by path
    consolidated_json: str  # the same documents as one JSON object, for the root's consolidated metadata
    layout: Layout | None = None  # what the plan was assembled from (None: made another way)


@dataclass(frozen=True, eq=False)
class Layout:
    """The reusable part of a plan: everything but the plain and per-rank values, and what it was made from: the
    arrays of the save and who writes what (``planner.py``), every key's place in the manifest, and the documents."""

    plan_id: str  # names this layout to the ranks that hold their RankLayout of it
    fingerprints: tuple[bytes, ...]  # by rank
    names: tuple[str, ...]  # the keys whose codec was resolved
    codecs: tuple[Codec, ...]  # what each resolved to
    chunking: ChunkPolicy
    entries: dict[str, Entry]  # array, pickle and alias entries by key
    arrays: dict[str, ArrayPlan]  # by array path
    tasks: TaskTable  # every rank's write tasks
    loads: tuple[int, ...]  # by rank: the bytes it writes
    boxes: dict[str, tuple[np.ndarray, np.ndarray]]  # array key -> distinct non-empty (offsets, shapes), for deltas
    order: tuple[str, ...]  # every key of the manifest, in order
    per_rank_parts: dict[str, Key]  # per-rank key -> its key path
    containers: dict[str, str]
    documents: dict[str, bytes]
    consolidated_json: str
    values: ValueLayout  # who sends which plain values when it is reused (``plainvalues.py``)

    @property
    def world(self) -> int:
        return len(self.fingerprints)


def plan_save(descriptions: Sequence[LocalDescription], codec: CodecChoice,
              chunking: ChunkPolicy = DEFAULT_CHUNKING) -> SavePlan:
    """Validate and plan a save from every rank's description (index = rank), afresh (``PlanCache.plan_save`` reuses
    the layout of the previous save where it can)."""
    fingerprints = tuple(fingerprint(d) for d in descriptions)
    layout = plan_layout(descriptions, fingerprints, codec, chunking)
    return assemble(layout, [(d.values, d.per_rank) for d in descriptions])


def plan_layout(descriptions: Sequence[LocalDescription], fingerprints: tuple[bytes, ...], codec: CodecChoice,
                chunking: ChunkPolicy) -> Layout:
    """Validate and lay out the arrays of every rank's description (``fingerprints``: theirs)."""
    arrays = _lay_out_arrays(descriptions, codec, chunking)
    values: set[str] = set()
    per_rank: dict[str, Key] = {}
    position: dict[str, tuple[int, int, int]] = dict(arrays.first_seen)
    containers: dict[str, str] = {}
    for rank, description in enumerate(descriptions):
        for j, value in enumerate(description.values):
            values.add(value.key)
            position.setdefault(value.key, (rank, 1, j))
        for j, item in enumerate(description.per_rank):
            per_rank.setdefault(item.key, item.parts)
            position.setdefault(item.key, (rank, 2, j))
        containers.update(description.containers)
    _check_kinds(descriptions, set(arrays.entries), values, set(per_rank))
    check_paths(arrays.arrays)
    documents, consolidated = documents_of(arrays.arrays)
    names = tuple(sorted({*arrays.entries, *per_rank}))
    return Layout(plan_id=uuid.uuid4().hex, fingerprints=fingerprints, names=names,
                  codecs=tuple(resolve_codec(codec, name) for name in names), chunking=chunking,
                  entries=arrays.entries, arrays=arrays.arrays, tasks=arrays.tasks, loads=arrays.loads,
                  boxes=arrays.boxes, order=tuple(sorted(position, key=position.__getitem__)),
                  values=plan_values([d.values for d in descriptions]), per_rank_parts=per_rank,
                  containers=containers, documents=documents, consolidated_json=consolidated)


def assemble(layout: Layout, fresh: Sequence[Fresh]) -> SavePlan:
    """The plan of one save: ``layout`` with the values every rank sent this time (by rank; a rank may send only
    the values it owns and those that varied, ``layout.values.sent``). A plain value that differs between the ranks
    that sent it is stored per rank (``plainvalues.py``)."""
    values: dict[str, dict[int, ValueEntry]] = defaultdict(dict)
    per_rank: dict[str, dict[int, ValueEntry | ArrayEntry]] = defaultdict(dict)
    for rank, (rank_values, rank_per_rank) in enumerate(fresh):
        for value in rank_values:
            if value.key in layout.values.owners:
                values[value.key][rank] = value
        for item in rank_per_rank:
            per_rank[item.key][rank] = item
    entries: dict[str, Entry] = {}
    for key in layout.order:
        if key in layout.values.owners:
            owner = layout.values.owners[key]
            if owner not in values.get(key, {}):
                raise ArrayckptError(f"the value {key!r} was not sent by rank {owner}, which holds it (a bug in "
                                     "arrayckpt: please report it)")
            entries[key] = merge_value(layout.values, key, values[key])
        elif key in layout.per_rank_parts:
            items = per_rank.get(key, {})
            entries[key] = PerRankEntry(key, layout.per_rank_parts[key], tuple(items.get(r) for r in
                                                                               range(layout.world)))
        else:
            entries[key] = layout.entries[key]
    return SavePlan(entries=entries, arrays=layout.arrays, tasks=layout.tasks,
                    containers=layout.containers, bytes_by_rank=layout.loads, documents=layout.documents,
                    consolidated_json=layout.consolidated_json, layout=layout)


def documents_of(arrays: dict[str, ArrayPlan]) -> tuple[dict[str, bytes], str]:
    """The serialised ``zarr.json`` of every array and group, and the same as consolidated metadata."""
    nodes = node_documents({path: array.metadata for path, array in arrays.items()})
    documents = {path: json.dumps(document).encode() for path, document in nodes.items()}
    consolidated = "{" + ", ".join(f"{json.dumps(path)}: {doc.decode()}" for path, doc in documents.items()) + "}"
    return documents, consolidated


def with_key_encoding(plan: SavePlan, encoding: str) -> SavePlan:
    """The same plan with every array's chunk key encoding set to ``encoding`` (the storage's: ``_storage``)."""
    if all(a.key_encoding == encoding for a in plan.arrays.values()):
        return plan
    arrays = {path: dataclasses.replace(a, key_encoding=encoding) for path, a in plan.arrays.items()}
    documents, consolidated = documents_of(arrays)
    return dataclasses.replace(plan, arrays=arrays, documents=documents, consolidated_json=consolidated)


def check_paths(arrays: dict[str, ArrayPlan]) -> None:
    """Refuse layouts a filesystem or Zarr cannot hold: an array with children (keys ``a`` and ``a.b``),
    names too long for a directory entry, and keys equal but for letter case (one directory on macOS and
    Windows, where their chunks would overwrite each other). Each node is looked at once."""
    folded: dict[str, tuple[str, str]] = {}  # casefolded node path -> (path, a key under it)
    groups: set[str] = set()

    def fold(node: str, key: str) -> None:
        other_path, other_key = folded.setdefault(node.casefold(), (node, key))
        if other_path != node:
            raise StateError(f"keys {other_key!r} and {key!r} differ only in letter case, which "
                             "case-insensitive filesystems cannot keep apart; rename one")

    for path, plan in arrays.items():
        segments = path.split("/")
        if any(len(segment) > MAX_SEGMENT_BYTES for segment in segments):
            raise StateError(f"key {plan.key!r} has a part longer than {MAX_SEGMENT_BYTES} bytes once escaped; "
                             "filesystems cannot store it")
        for i in range(len(segments) - 1, 0, -1):  # the groups above it, up to one already seen
            node = "/".join(segments[:i])
            if node in groups:
                break
            groups.add(node)
            fold(node, plan.key)
        fold(path, plan.key)
    for parent in sorted(groups & arrays.keys()):
        child = next(a.key for p, a in arrays.items() if p.startswith(parent + "/"))
        raise StateError(f"{arrays[parent].key!r} is a tensor and also the prefix of tensor {child!r}; rename one of "
                         "them")


def _check_kinds(descriptions: Sequence[LocalDescription], arrays: set[str], values: set[str],
                 per_rank: set[str]) -> None:
    for key in sorted(values & arrays):
        holders = [r for r, d in enumerate(descriptions) if key in set(d.table.keys)]
        raise StateError(
            f"{key!r} is a tensor on rank(s) {holders} but a plain value on another rank; every "
            "rank must hold the same kind of thing under a key"
        )
    for key in sorted(per_rank & (arrays | values)):
        raise StateError(f"{key!r} is a PerRank value on some ranks and not on others; wrap it on every rank")

