"""Which rank wrote each chunk: ``created.writers`` of the manifest (spec §4.2, informational).

Per array node, the ranks that wrote its stored chunks (in digest order: C order, or a chunks delta's ``present``
order) as runs ``[first_rank, step, count, each]``: a tensor sharded over ranks ``r, r+s, r+2s, ...``, each
shard one or more chunks, is one run whatever the number of ranks, so the record stays small at scale. Readers
use it for pictures (``arrayckpt report``); nothing reads data by it, and a malformed record is ignored, never an error.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["expand_runs", "writer_runs"]


def writer_runs(ranks: Sequence[int]) -> list[list[int]]:
    """``ranks`` as runs ``[first, step, count, each]``: ranks ``first, first + step, ...`` (``count`` of them),
    each repeated ``each`` times (a shard stored as several chunks). Greedy: each run as long as it can be.

    >>> writer_runs([0, 0, 1, 1])
    [[0, 1, 2, 2]]
    >>> writer_runs([0, 8, 16, 24, 3])
    [[0, 8, 4, 1], [3, 0, 1, 1]]
    """
    runs: list[list[int]] = []
    i, n = 0, len(ranks)
    while i < n:
        each = 1
        while i + each < n and ranks[i + each] == ranks[i]:
            each += 1
        step = int(ranks[i + each] - ranks[i]) if i + each < n else 0
        count, j = 1, i + each
        while j + each <= n and all(ranks[j + k] == ranks[i] + step * count for k in range(each)) and \
                (j + each == n or ranks[j + each] != ranks[j]):
            count, j = count + 1, j + each
        if count == 1:
            step = 0
        runs.append([int(ranks[i]), step, count, each])
        i = j
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
