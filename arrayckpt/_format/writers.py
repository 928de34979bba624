"""Which rank wrote each chunk: ``created.writers`` of the manifest (spec §4.2, informational).

Per array node, the ranks that wrote its stored chunks (in digest order: C order, or a chunks delta's ``present``
order) as runs ``[first_rank, step, count, each]``: a tensor sharded over ranks ``r, r+s, r+2s, ...``, each
shard one or more chunks, is one run whatever the number of ranks, so the record stays small at scale. Readers
use it for pictures (``arrayckpt report``); nothing reads data by it, and a malformed record is ignored, never an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["expand_runs", "ranks_at", "writer_counts", "writer_runs"]


def writer_runs(ranks: Sequence[int] | np.ndarray) -> list[list[int]]:
    """``ranks`` as runs ``[first, step, count, each]``: ranks ``first, first + step, ...`` (``count`` of them),
    each repeated ``each`` times (a shard stored as several chunks). Greedy: each run as long as it can be. Vectorised
    over blocks of equal ranks: a coordinator of 16,384 ranks encodes millions of chunks.

    >>> writer_runs([0, 0, 1, 1])
    [[0, 1, 2, 2]]
    >>> writer_runs([0, 8, 16, 24, 3])
    [[0, 8, 4, 1], [3, 0, 1, 1]]
    """
    r = np.asarray(ranks, dtype=np.int64).ravel()
    if r.size == 0:
        return []
    starts = np.flatnonzero(np.concatenate(([True], r[1:] != r[:-1])))  # blocks of equal ranks
    value, length = r[starts], np.diff(np.append(starts, r.size))
    blocks = len(starts)
    step = np.diff(value)  # step[k]: block k -> k + 1
    same_length = np.concatenate(([False], length[1:] == length[:-1]))  # block k as long as block k - 1
    same_step = np.concatenate(([False, False], step[1:] == step[:-1]))  # k - 1 -> k as k - 2 -> k - 1
    # first block >= k that cannot continue a run begun two or more blocks before it
    stops = np.flatnonzero(~(same_length & same_step))
    runs: list[list[int]] = []
    s = 0
    while s < blocks:
        if s + 1 < blocks and same_length[s + 1]:
            later = stops[np.searchsorted(stops, s + 2):]
            end = int(later[0]) if len(later) else blocks  # blocks s .. end - 1
            runs.append([int(value[s]), int(step[s]), end - s, int(length[s])])
        else:
            end = s + 1
            runs.append([int(value[s]), 0, 1, int(length[s])])
        s = end
    return runs


def expand_runs(runs: object, count: int) -> list[int] | None:
    """The rank of each of ``count`` chunks from a ``writer_runs`` record; ``None`` when the record is not one
    (wrong shape, negative ranks, a total other than ``count``): it is informational, so it is ignored."""
    if not isinstance(runs, list):
        return None
    out: list[int] = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 4 and all(type(v) is int for v in run)) or min(run[2:]) < 1:
            return None
        first, step, n, each = run
        if first < 0 or first + step * (n - 1) < 0 or len(out) + n * each > count:
            return None
        ranks = range(first, first + step * n, step) if step else [first] * n
        out.extend(rank for rank in ranks for _ in range(each))
    return out if len(out) == count else None


def ranks_at(runs: object, count: int, positions: np.ndarray) -> np.ndarray | None:
    """The ranks of the chunks at ``positions`` (in digest order) of ``count`` chunks, from a ``writer_runs``
    record, without expanding it (a record of a few runs may stand for millions of chunks, of which a picture
    shows a few thousand); ``None`` when the record is not one, as :func:`expand_runs` decides."""
    if not isinstance(runs, list):
        return None
    starts, total = [], 0
    for run in runs:
        if not (isinstance(run, list) and len(run) == 4 and all(type(v) is int for v in run)) or min(run[2:]) < 1:
            return None
        first, step, n, each = run
        if first < 0 or first + step * (n - 1) < 0 or total + n * each > count:
            return None
        starts.append(total)
        total += n * each
    if total != count:
        return None
    where = np.asarray(positions, dtype=np.int64)
    if where.size and (where.min() < 0 or where.max() >= count):
        raise ValueError(f"positions must lie in 0..{count - 1}")
    table = np.asarray(runs, dtype=np.int64).reshape(-1, 4)
    k = np.searchsorted(np.asarray(starts, dtype=np.int64), where, side="right") - 1
    first, step, each = table[k, 0], table[k, 1], table[k, 3]
    out: np.ndarray = first + step * ((where - np.asarray(starts, dtype=np.int64)[k]) // each)
    return out


MAX_COUNTED = 1 << 24  # rank entries `writer_counts` expands at most (a record is informational: a bigger one is not)


def writer_counts(record: object) -> dict[int, int] | None:
    """How many chunks each rank wrote, over every array of a ``created.writers`` record (``{node path: runs}``),
    for a summary (``arrayckpt info``); ``None`` when the record is not one. A run of one rank costs nothing; a
    run over many ranks one entry per rank, at most ``MAX_COUNTED`` in all.

    >>> writer_counts({"model/w": [[0, 1, 2, 2]], "model/b": [[0, 0, 1, 1]]})
    {0: 3, 1: 2}
    """
    if not isinstance(record, dict):
        return None
    counts: dict[int, int] = {}
    ranks: list[np.ndarray] = []
    weights: list[np.ndarray] = []
    expanded = 0
    for runs in record.values():
        if not isinstance(runs, list):
            return None
        for run in runs:
            if not (isinstance(run, list) and len(run) == 4 and all(type(v) is int for v in run)) or min(run[2:]) < 1:
                return None
            first, step, n, each = run
            if first < 0 or first + step * (n - 1) < 0:
                return None
            if step == 0:  # one rank: n blocks of `each`
                counts[first] = counts.get(first, 0) + n * each
                continue
            expanded += n
            if expanded > MAX_COUNTED:
                return None
            ranks.append(first + step * np.arange(n, dtype=np.int64))
            weights.append(np.full(n, each, dtype=np.int64))
    if ranks:
        unique, index = np.unique(np.concatenate(ranks), return_inverse=True)
        for rank, total in zip(unique.tolist(), np.bincount(index, weights=np.concatenate(weights)).tolist(),
                               strict=True):
            counts[rank] = counts.get(rank, 0) + int(total)
    return dict(sorted(counts.items()))
