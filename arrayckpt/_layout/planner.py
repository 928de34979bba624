"""The arrays of a save's :class:`~arrayckpt._layout.saveplan.Layout`: every rank's pieces validated, chunked and
given one writer each (:func:`~arrayckpt._layout.saveplan.plan_layout` calls :func:`_lay_out_arrays` and adds the
values).

The work is linear in the number of pieces with small constants: every rank's :class:`ArrayTable` is stacked
into one set of int64 columns, identical boxes (replicas) are found by sorting a hash of the rows, and the
checks and chunk choices run once per key on that key's distinct boxes (numpy, not a Python object per box).
The result keeps the write tasks as columns too (:class:`TaskTable`): rank ``r``'s tasks become objects only
on the rank that writes them (``rankplan.py``), or when a caller indexes the table.

Checks, in order (the first problem found is raised, naming the key and the ranks): every holder of a key
agrees on its kind, dtype and global shape; every box lies inside the tensor; the distinct boxes of every
tensor tile it exactly (no overlap, no gap); the chunk grid aligned with the shard boundaries stays under the
readers' chunk-size limit. Writers: a box held by one rank is written by it; a replicated box is split into
runs of whole outer chunks (one per replica at most) and each run goes to its least-loaded replica, biggest
first, after the loads of the unreplicated boxes are counted (Megatron's fully-parallel save, Orbax's
replica-parallel writes).

Aliases (tied weights, ``_format/alias.py``): a key that ranks report as one tensor with an earlier key's is stored
as an alias of it only where every rank holding either key holds both and reports that same alias (so the boxes are
the same tensor's on every rank); otherwise it is planned as an array of its own. An alias's pieces are dropped
before anything is laid out: it has no array, no task and no bytes.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .._errors import StateError
from .._format.codecs import Codec, CodecChoice, resolve_codec
from .._format.dtypes import dtype_by_name
from .._format.keys import array_path
from .._format.manifest import AliasEntry, ArrayEntry, Entry, PickleEntry, per_rank_path
from .._format.zarr import MAX_CHUNK_BYTES
from .box import Box, CoverProblem, cover_problem, distinct_rows, shard_steps
from .chunking import ArrayPlan, ChunkPolicy, choose_chunks
from .pieces import DTYPE, GLOBAL, KIND, KINDS, NDIM, OFFSET, REPLICA, SHAPE, LocalDescription
from .tasks import WriteTask

__all__ = ["TaskTable"]

PICKLE = KINDS.index("pickle")


@dataclass(frozen=True, eq=False)
class TaskTable(Sequence[tuple[WriteTask, ...]]):
    """Every rank's write tasks as columns, sorted by rank; ``table[r]`` is rank ``r``'s tasks as objects.

    ``source[i]`` is the row of the writer's own description the task cuts from: an index into its
    ``arrays`` table, or ``len(arrays) + j`` for its ``per_rank[j]``. ``array[i]`` indexes :attr:`plans`.
    """

    plans: tuple[ArrayPlan, ...]  # the arrays tasks write to
    starts: np.ndarray  # (world + 1,): rank r's tasks are rows starts[r]:starts[r + 1]
    source: np.ndarray
    array: np.ndarray
    offset: np.ndarray  # (tasks, width), padded with 0
    shape: np.ndarray  # (tasks, width), padded with 1

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, rank: int) -> tuple[WriteTask, ...]:  # type: ignore[override]
        if not -len(self) <= rank < len(self):
            raise IndexError(rank)
        rank %= len(self)
        rows = range(int(self.starts[rank]), int(self.starts[rank + 1]))
        out = []
        part = slice(rows.start, rows.stop)
        for a, offset, shape in zip(self.array[part].tolist(), self.offset[part].tolist(), self.shape[part].tolist(),
                                    strict=True):
            plan = self.plans[a]
            ndim = len(plan.shape)
            out.append(WriteTask(plan.key, plan.path, Box(tuple(offset[:ndim]), tuple(shape[:ndim]))))
        return tuple(out)

    def __iter__(self) -> Iterator[tuple[WriteTask, ...]]:
        return (self[r] for r in range(len(self)))


class _LaidOut(NamedTuple):
    """What :func:`_lay_out_arrays` decides, for ``plan_layout`` to put into its ``Layout`` (the fields of the same
    names there) and to order the manifest by (``first_seen``)."""

    entries: dict[str, Entry]  # array, pickle and alias entries by key
    arrays: dict[str, ArrayPlan]  # by array path
    tasks: TaskTable
    loads: tuple[int, ...]  # by rank: the bytes it writes
    boxes: dict[str, tuple[np.ndarray, np.ndarray]]  # array key -> distinct non-empty (offsets, shapes)
    first_seen: dict[str, tuple[int, int, int]]  # array key -> (rank, 0, row) where it was first seen


@functools.lru_cache(maxsize=4096)
def _chunks(shape: tuple[int, ...], itemsize: int, steps: tuple[int | None, ...],
            policy: ChunkPolicy) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return choose_chunks(shape, itemsize, steps, policy)


@dataclass(frozen=True)
class _Stacked:
    """Every rank's pieces, one row each, in rank order."""

    keys: list[str]  # by key id, in the order first seen
    key: np.ndarray
    rank: np.ndarray
    local: np.ndarray  # the row in its rank's table
    meta: np.ndarray  # dtype codes index `dtypes`
    gshape: np.ndarray  # (rows, width) each, contiguous: global shape, box offset, box shape
    offset: np.ndarray
    shape: np.ndarray
    dtypes: list[str]
    first: np.ndarray  # by key id: its first row (lowest rank)


def _stack(descriptions: Sequence[LocalDescription]) -> _Stacked:
    tables = [d.table for d in descriptions]
    lengths = np.fromiter((len(t) for t in tables), np.int64, len(tables))
    total = int(lengths.sum())
    ids: dict[str, int] = {}
    by_keys: dict[tuple[str, ...], np.ndarray] = {}  # ranks of one pipeline stage hold the same keys: map them once
    key_ids = []
    for t in tables:
        found = by_keys.get(t.keys)
        if found is None:
            found = by_keys[t.keys] = np.fromiter((ids.setdefault(k, len(ids)) for k in t.keys), np.int64,
                                                  len(t.keys))
        key_ids.append(found)
    key = np.concatenate(key_ids) if key_ids else np.zeros(0, np.int64)
    width = max([1, *(t.coords.shape[2] for t in tables)])
    coords = [t.coords if t.coords.shape[2] == width else _widen(t.coords, width) for t in tables]
    names: dict[str, int] = {}
    by_dtypes: dict[tuple[str, ...], np.ndarray] = {}
    luts = [by_dtypes[t.dtypes] if t.dtypes in by_dtypes else by_dtypes.setdefault(
        t.dtypes, np.array([names.setdefault(n, len(names)) for n in t.dtypes] or [0], np.int64)) for t in tables]
    lut_starts = np.cumsum([0, *(len(lut) for lut in luts)])[:-1]
    meta = np.concatenate([t.meta for t in tables]) if tables else np.zeros((0, 4), np.int64)
    if total:
        meta[:, DTYPE] = np.concatenate(luts)[np.repeat(lut_starts, lengths) + meta[:, DTYPE]]
    starts = np.cumsum(lengths) - lengths
    seen_before = np.maximum.accumulate(np.concatenate(([-1], key[:-1]))) if total else key
    gshape, offset, shape = (np.concatenate([c[:, plane] for c in coords]) if coords else np.zeros((0, 1), np.int64)
                             for plane in (GLOBAL, OFFSET, SHAPE))
    return _Stacked(list(ids), key, np.repeat(np.arange(len(tables)), lengths), np.arange(total) -
                    np.repeat(starts, lengths), meta, gshape, offset, shape, list(names),
                    np.flatnonzero(key > seen_before))


def _widen(coords: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((len(coords), 3, width), np.int64)
    out[:, GLOBAL] = out[:, SHAPE] = 1
    out[:, :, :coords.shape[2]] = coords
    return out


def _lay_out_arrays(descriptions: Sequence[LocalDescription], codec: CodecChoice,
                    chunking: ChunkPolicy) -> _LaidOut:
    """Validate every rank's pieces and lay out the arrays (see the module docstring). Raises
    :class:`StateError` naming the key and ranks of the first problem."""
    s = _stack(descriptions)
    _check_agreement(s)
    aliases, alias_order = _aliases(s, descriptions)
    if aliases:
        s = _without(s, set(aliases))
    named_by: dict[str, list[str]] = defaultdict(list)  # target -> its aliases, in the order of the state
    for alias in sorted(aliases, key=alias_order.__getitem__):
        named_by[aliases[alias].target].append(alias)
    ndim = s.meta[:, NDIM]
    pad = np.arange(s.shape.shape[1])[None, :] >= ndim[:, None]
    size = np.prod(s.shape, axis=1)
    keep = (size > 0) | ((s.gshape == 0) | pad).all(axis=1)
    is_first = np.zeros(len(keep), bool)
    is_first[s.first] = True
    keep &= (s.meta[:, KIND] != PICKLE) | is_first  # pickled values may differ between ranks: the lowest rank's
    rows = np.flatnonzero(keep)
    every = len(rows) == len(keep)
    columns = [s.key if every else s.key[rows], *(a if every else a[rows] for a in (s.offset, s.shape))]
    row_order, group_starts, counts = distinct_rows(columns)
    holders_sorted = rows[row_order]  # the rows of every distinct box's holders, box after box, ranks ascending
    heads = holders_sorted[group_starts]  # one row of each distinct box
    by_key = np.argsort(s.key[heads], kind="stable")  # key after key; within one, in rank order (heads ascend)
    sorted_heads = heads[by_key]  # the distinct boxes, key after key
    key_starts = np.searchsorted(s.key[sorted_heads], np.arange(len(s.keys) + 1)).tolist()
    all_offsets, all_shapes = s.offset[sorted_heads], s.shape[sorted_heads]
    firsts = s.first.tolist()
    first_meta, first_shape = s.meta[s.first].tolist(), s.gshape[s.first].tolist()
    entries: dict[str, Entry] = {}
    plans: list[ArrayPlan] = []
    itemsizes = np.zeros(len(s.keys), np.int64)
    outers = np.ones((len(s.keys), s.shape.shape[1]), np.int64)
    boxes: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    checked: dict[tuple[tuple[int, ...], bytes, bytes], tuple[int | None, ...]] = {}  # many keys share one sharding
    for k, name in enumerate(s.keys):
        nd, kind_code, dtype_code, _ = first_meta[k]
        kind, dtype, shape = KINDS[kind_code], dtype_by_name(s.dtypes[dtype_code]), tuple(first_shape[k][:nd])
        mine = slice(key_starts[k], key_starts[k + 1])
        offsets, shapes = all_offsets[mine, :nd], all_shapes[mine, :nd]
        signature = (shape, offsets.tobytes(), shapes.tobytes())
        steps = checked.get(signature)
        if steps is None:
            problem = cover_problem(shape, offsets, shapes)
            if problem is not None:
                raise StateError(_cover_message(name, shape, problem, s, holders_sorted, group_starts[by_key[mine]],
                                                counts[by_key[mine]], offsets, shapes))
            steps = checked[signature] = shard_steps(shape, offsets, shapes)
        outer, inner = _chunks(shape, dtype.itemsize, steps, chunking)
        if math.prod(inner) * dtype.itemsize > MAX_CHUNK_BYTES:  # readers refuse such chunks: never write one
            raise StateError(f"tensor {name!r}: its shards (boundaries every {list(steps)} "
                             f"along each dimension) leave no chunk grid under {MAX_CHUNK_BYTES} bytes per chunk (one "
                             f"chunk would be {list(inner)}); shard it so that rank boundaries have a common divisor, "
                             "e.g. torch.chunk-style even splits")
        plans.append(ArrayPlan(name, array_path(name), dtype, shape, outer, inner,
                               resolve_codec(None if kind == "pickle" else codec, name),
                               aliases=tuple(named_by.get(name, ()))))
        itemsizes[k], outers[k, :nd] = dtype.itemsize, outer
        if nd and math.prod(shape) == 0:  # an empty tensor's boxes may be empty too
            nonempty = np.prod(shapes, axis=1) > 0
            offsets, shapes = offsets[nonempty], shapes[nonempty]
        boxes[name] = (offsets, shapes)
        parts = descriptions[int(s.rank[firsts[k]])].table.parts_of(int(s.local[firsts[k]]))
        entries[name] = (PickleEntry(name, parts, math.prod(shape)) if kind == "pickle"
                         else ArrayEntry(name, parts, dtype, shape, kind))  # type: ignore[arg-type]
    single, replicated, loads = _work(s, holders_sorted, group_starts, counts, itemsizes, outers, len(descriptions),
                                      chunking)
    per_rank = _per_rank_arrays(descriptions, plans, codec, chunking, loads)
    tasks = _tasks(s, single, [replicated, per_rank], plans, len(descriptions))
    order = {name: (int(s.rank[f]), 0, int(s.local[f])) for name, f in zip(s.keys, s.first.tolist(), strict=True)}
    entries.update(aliases)
    order.update(alias_order)
    return _LaidOut(entries, {p.path: p for p in plans}, tasks, tuple(loads), boxes, order)


def _aliases(s: _Stacked, descriptions: Sequence[LocalDescription]
             ) -> tuple[dict[str, AliasEntry], dict[str, tuple[int, int, int]]]:
    """The alias entries of the save, and where each key was first seen: a key every rank reports as one tensor with
    the same target, where the ranks holding the key are exactly those holding the target (a key tied on one rank
    but not on another, or whose pieces are not all the target's, is stored as an array of its own). No alias names
    an alias."""
    claims: dict[str, dict[int, str]] = defaultdict(dict)  # alias -> {rank: its target there}
    for rank, description in enumerate(descriptions):
        for alias, target in description.aliases.items():
            claims[alias][rank] = target
    if not claims:
        return {}, {}
    ids = {name: i for i, name in enumerate(s.keys)}
    wanted = sorted({ids[k] for alias, by in claims.items() for k in (alias, *by.values()) if k in ids})
    rows = np.flatnonzero(np.isin(s.key, wanted))
    holders: dict[str, set[int]] = defaultdict(set)
    for k, rank in zip(s.key[rows].tolist(), s.rank[rows].tolist(), strict=True):
        holders[s.keys[k]].add(rank)
    agreed = {}
    for alias, by in claims.items():
        targets = set(by.values())
        target = min(targets)
        if len(targets) == 1 and set(by) == holders[alias] == holders[target] and \
                s.meta[s.first[ids[target]], KIND] != PICKLE:
            agreed[alias] = target
    entries, order = {}, {}
    for alias, target in agreed.items():
        if target in agreed:  # ranks walking their states in different orders: keep the tie out of it
            continue
        row = int(s.first[ids[alias]])
        rank, local = int(s.rank[row]), int(s.local[row])
        entries[alias] = AliasEntry(alias, descriptions[rank].table.parts_of(local), target)
        order[alias] = (rank, 0, local)
    return entries, order


def _without(s: _Stacked, dropped: set[str]) -> _Stacked:
    """``s`` without the rows of the keys ``dropped`` (aliases: stored as their targets), the remaining keys numbered
    afresh in the same order; rows keep their place in their rank's description (``local``)."""
    kept = np.fromiter((name not in dropped for name in s.keys), bool, len(s.keys))
    renumbered = np.cumsum(kept) - 1
    rows = kept[s.key]
    key = renumbered[s.key[rows]]
    seen_before = np.maximum.accumulate(np.concatenate(([-1], key[:-1]))) if len(key) else key
    return _Stacked([name for name in s.keys if name not in dropped], key, s.rank[rows], s.local[rows], s.meta[rows],
                    s.gshape[rows], s.offset[rows], s.shape[rows], s.dtypes, np.flatnonzero(key > seen_before))


def _check_agreement(s: _Stacked) -> None:
    """Every holder of a key agrees with its first holder on kind, dtype and global shape."""
    if not len(s.key):
        return
    first = s.first[s.key]
    signature = (s.meta[:, NDIM] << 40) | (s.meta[:, KIND] << 32) | s.meta[:, DTYPE]  # (ndim, kind, dtype code)
    bad = (signature != signature[first]) | (s.gshape != s.gshape[first]).any(axis=1)
    if not bad.any():
        return
    candidates = np.flatnonzero(bad)
    row = int(candidates[np.lexsort((s.rank[candidates], s.key[candidates]))[0]])
    head = int(first[row])

    def what(i: int) -> str:
        nd = int(s.meta[i, NDIM])
        return f"{KINDS[int(s.meta[i, KIND])]} {s.dtypes[int(s.meta[i, DTYPE])]}{s.gshape[i, :nd].tolist()}"

    raise StateError(f"tensor {s.keys[int(s.key[row])]!r} is {what(head)} on rank {int(s.rank[head])} but {what(row)} "
                     f"on rank {int(s.rank[row])}; every rank must agree on the global dtype and shape")


def _cover_message(name: str, shape: tuple[int, ...], problem: CoverProblem, s: _Stacked, holders: np.ndarray,
                   starts: np.ndarray, counts: np.ndarray, offsets: np.ndarray, shapes: np.ndarray) -> str:
    def ranks(b: int) -> list[int]:
        rows = holders[starts[b]:starts[b] + counts[b]]
        return [int(r) for _, r in sorted(zip(s.meta[rows, REPLICA].tolist(), s.rank[rows].tolist(), strict=True))]

    if problem.what == "overlap":
        described = "; ".join(f"rank(s) {ranks(b)} hold offset {offsets[b].tolist()} shape {shapes[b].tolist()}"
                              for b in problem.boxes)
        return (f"tensor {name!r}: shards overlap ({described}); each element must be held by one shard (identical "
                "shards are replicas and are fine)")
    if problem.what == "outside":
        b = problem.boxes[0]
        return (f"tensor {name!r} of shape {list(shape)}: rank(s) {ranks(b)} hold offset "
                f"{offsets[b].tolist()} shape {shapes[b].tolist()}, which reaches outside it")
    every = sorted({r for b in range(len(starts)) for r in ranks(b)})
    return (f"tensor {name!r} of shape {list(shape)}: no rank holds the region from {list(problem.start)} to "
            f"{list(problem.stop)} (holders: ranks {every}); the shards must cover the whole tensor")


@dataclass(frozen=True)
class _Work:
    """Write tasks as columns: the writer, the row of its description, the array, the box."""

    rank: np.ndarray
    source: np.ndarray
    array: np.ndarray
    offset: np.ndarray
    shape: np.ndarray


def _row_products(a: np.ndarray) -> np.ndarray:
    out = a[:, 0].copy() if a.shape[1] else np.ones(len(a), np.int64)
    for column in range(1, a.shape[1]):
        out *= a[:, column]
    return out


def _work(s: _Stacked, holders: np.ndarray, starts: np.ndarray, counts: np.ndarray, itemsizes: np.ndarray,
          outers: np.ndarray, world: int, chunking: ChunkPolicy) -> tuple[np.ndarray, _Work, list[int]]:
    """The rows of the unreplicated boxes (each written by its holder, in rank order), the tasks of the replicated
    ones, and every rank's bytes. Replicated pieces of at most ``chunking.gather_piece_bytes`` (AdamW's 0-d
    ``step`` of every parameter) are gathered on few writers (:func:`_gatherer`), not spread one per rank: every rank
    of a load reads them all, and gathered in one pack they are one ranged read, not one read per writer's pack
    (723 steps of a Llama-70B state over 1,024 ranks: 723 reads per rank, 740,000 per load)."""
    single = holders[starts[counts == 1]]
    nbytes = _row_products(s.shape[single]) * itemsizes[s.key[single]]
    loads = np.bincount(s.rank[single], weights=nbytes, minlength=world).astype(np.int64).tolist()
    # replicated boxes: one item each, or runs of whole outer chunks (one per replica at most), to the least-loaded
    # replica, biggest first
    multi = np.flatnonzero(counts > 1)
    heads = holders[starts[multi]]
    key, offset, shape = s.key[heads], s.offset[heads], s.shape[heads]
    over = shape > outers[key]
    cumulative = np.concatenate(([0], np.cumsum(counts[multi]))).astype(np.int64)
    bounds = cumulative.tolist()
    rows = holders[np.repeat(starts[multi] - cumulative[:-1], counts[multi]) + np.arange(bounds[-1])]
    candidate_rows, candidate_ranks = rows.tolist(), s.rank[rows].tolist()
    items: list[tuple[int, int, list[int], list[int]]] = []  # (bytes, replicated box, offset, shape)
    splits = np.where(over.any(axis=1), np.argmax(over, axis=1), -1).tolist()
    for i, (split, nb, off, shp, outer, itemsize) in enumerate(zip(
            splits, (_row_products(shape) * itemsizes[key]).tolist(), offset.tolist(), shape.tolist(),
            outers[key].tolist(), itemsizes[key].tolist(), strict=True)):
        if split < 0:
            items.append((nb, i, off, shp))
            continue
        step, replicas = outer[split], bounds[i + 1] - bounds[i]
        chunks = math.ceil(shp[split] / step)
        runs = min(replicas, chunks)
        for run in range(runs):
            first, last = run * chunks // runs, (run + 1) * chunks // runs
            start = off[split] + first * step
            stop = min(off[split] + shp[split], off[split] + last * step)
            o, n = list(off), list(shp)
            o[split], n[split] = start, stop - start
            items.append((math.prod(n) * itemsize, i, o, n))
    items.sort(key=lambda item: -item[0])
    chosen: list[int] = []
    gathered: dict[int, int] = {}  # rank -> bytes of the small replicated pieces it writes
    for nb, i, _, _ in items:
        candidates = candidate_ranks[bounds[i]:bounds[i + 1]]  # ascending: ties go to the lowest rank
        rank = min(candidates, key=loads.__getitem__)
        if nb <= chunking.gather_piece_bytes:
            rank = _gatherer(candidates, gathered, nb, chunking.gather_rank_bytes, rank)
            gathered[rank] = gathered.get(rank, 0) + nb
        loads[rank] += nb
        chosen.append(candidate_rows[bounds[i] + candidates.index(rank)])
    width = s.shape.shape[1]
    picked = np.array(chosen, np.int64)
    return single, _Work(s.rank[picked], s.local[picked], s.key[picked],
                         np.array([o for _, _, o, _ in items], np.int64).reshape(-1, width),
                         np.array([n for _, _, _, n in items], np.int64).reshape(-1, width)), loads


def _gatherer(candidates: list[int], gathered: Mapping[int, int], nb: int, limit: int, least_loaded: int) -> int:
    """The writer of a small replicated piece: of its holders, the one already writing the most small pieces that
    stays within ``limit`` bytes of them (ties to the lowest rank), else the least loaded (which starts a new
    gathering)."""
    best, most = least_loaded, 0
    for rank in candidates:
        have = gathered.get(rank, 0)
        if have > most and have + nb <= limit:
            best, most = rank, have
    return best


def _per_rank_arrays(descriptions: Sequence[LocalDescription], plans: list[ArrayPlan], codec: CodecChoice,
                     chunking: ChunkPolicy, loads: list[int]) -> _Work:
    """Each rank's per-rank tensor is its own array, written by that rank (appended to ``plans``)."""
    ranks, sources, shapes = [], [], []
    codecs: dict[str, Codec] = {}
    first = len(plans)
    for rank, description in enumerate(descriptions):
        for j, item in enumerate(description.per_rank):
            if isinstance(item, ArrayEntry):
                outer, inner = _chunks(item.shape, item.dtype.itemsize, (None,) * len(item.shape), chunking)
                chosen = codecs.get(item.key) or codecs.setdefault(item.key, resolve_codec(codec, item.key))
                plans.append(ArrayPlan(item.key, per_rank_path(item.key, rank), item.dtype, item.shape, outer, inner,
                                       chosen))
                ranks.append(rank)
                sources.append(len(description.table) + j)
                shapes.append(item.shape)
                loads[rank] += item.nbytes
    width = max([1, *(len(s) for s in shapes)])
    shape = np.ones((len(shapes), width), np.int64)
    for i, s in enumerate(shapes):
        shape[i, :len(s)] = s
    return _Work(np.array(ranks, np.int64), np.array(sources, np.int64), np.arange(first, len(plans)),
                 np.zeros_like(shape), shape)


def _pad(a: np.ndarray, width: int, fill: int) -> np.ndarray:
    if a.shape[1] == width:
        return a
    out = np.full((len(a), width), fill, np.int64)
    out[:, :a.shape[1]] = a
    return out


def _tasks(s: _Stacked, single: np.ndarray, extra: list[_Work], plans: list[ArrayPlan], world: int) -> TaskTable:
    """Every task in rank order: the unreplicated boxes (already in rank order) merged with the other tasks."""
    width = max([s.shape.shape[1], *(e.shape.shape[1] for e in extra)])
    rank = np.concatenate([s.rank[single], *(e.rank for e in extra)])
    order = np.argsort(rank, kind="stable")  # runs: quick
    source = np.concatenate([s.local[single], *(e.source for e in extra)])[order]
    array = np.concatenate([s.key[single], *(e.array for e in extra)])[order]
    offset = np.concatenate([_pad(s.offset[single], width, 0), *(_pad(e.offset, width, 0) for e in extra)])[order]
    shape = np.concatenate([_pad(s.shape[single], width, 1), *(_pad(e.shape, width, 1) for e in extra)])[order]
    return TaskTable(tuple(plans), np.searchsorted(rank[order], np.arange(world + 1)), source, array, offset, shape)
