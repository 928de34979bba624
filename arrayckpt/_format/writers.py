"""Which rank wrote each chunk: ``created.writers`` of the manifest (spec §4.2, informational).

Per array node, the ranks that wrote its stored chunks (in digest order: C order, or a chunks delta's ``present``
order) as arithmetic runs ``[first_rank, step, count]``: a tensor sharded over ranks ``r, r+s, r+2s, ...`` is
one run, whatever the number of ranks, so the record stays small at scale. Readers use it for pictures
(``arrayckpt report``); nothing reads data by it, and a malformed record is ignored, never an error.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["expand_runs", "writer_runs"]


def writer_runs(ranks: Sequence[int]) -> list[list[int]]:
    """``ranks`` as arithmetic runs ``[first, step, count]`` (greedy: each run as long as it can be).

    >>> writer_runs([0, 0, 1, 1])
    [[0, 0, 2], [1, 0, 2]]
    >>> writer_runs([0, 8, 16, 24, 3])
    [[0, 8, 4], [3, 0, 1]]
    """
    runs: list[list[int]] = []
    i = 0
    while i < len(ranks):
        step = ranks[i + 1] - ranks[i] if i + 1 < len(ranks) else 0
        j = i + 1
        while j < len(ranks) and ranks[j] - ranks[j - 1] == step:
            j += 1
        runs.append([int(ranks[i]), int(step), j - i])
        i = j
    return runs


def expand_runs(runs: object, count: int) -> list[int] | None:
    """The rank of each of ``count`` chunks from a ``writer_runs`` record; ``None`` when the record is not one
    (wrong shape, negative ranks, a total other than ``count``): it is informational, so it is ignored."""
    if not isinstance(runs, list):
        return None
    out: list[int] = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 3 and all(type(v) is int for v in run)) or run[2] < 1:
            return None
        first, step, n = run
        if first < 0 or first + step * (n - 1) < 0 or len(out) + n > count:
            return None
        out.extend(range(first, first + step * n, step) if step else [first] * n)
    return out if len(out) == count else None
