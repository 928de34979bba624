"""The manifest's chunk digests of a planned save, from the checksums its writers reported (spec §11).

Which chunks an array stores is a planning fact (all of them; for a chunks delta, those in ``present``), so the
coordinator can insist that every one of them was reported written before it commits: a chunk no rank
wrote would otherwise only be noticed by the first read of it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence

import numpy as np

from .._errors import ArrayckptError
from .._format.integrity import chunk_digest
from .._format.manifest import ArrayEntry, Entry
from .._format.writers import writer_runs
from .chunking import ArrayPlan

__all__ = ["chunk_digests", "chunk_writers", "stored_chunks"]


def stored_chunks(array: ArrayPlan, entries: Mapping[str, Entry]) -> range | tuple[int, ...]:
    """The flat C-order indices of the outer chunks an array stores, in digest order."""
    entry = entries.get(array.key)
    if isinstance(entry, ArrayEntry) and entry.delta is not None and entry.delta.mode == "chunks" \
            and array.path == entry.path:
        return entry.delta.present
    return range(math.prod(math.ceil(n / c) for n, c in zip(array.shape, array.outer_chunk, strict=True)))


def chunk_digests(arrays: Mapping[str, ArrayPlan], entries: Mapping[str, Entry],
                  checksums: Mapping[str, Mapping[int, int]], where: str) -> dict[str, str]:
    """Every array's digest of its stored chunks' checksums, by array path. Refuses (nothing may be committed) when
    a stored chunk was not reported written."""
    out = {}
    for path, array in arrays.items():
        found = checksums.get(path, {})
        order = stored_chunks(array, entries)
        for flat in order:
            if flat not in found:
                raise ArrayckptError(f"{where}: tensor {array.key!r}: chunk {flat} of array {path!r} was not reported "
                                     "written, so the save was not committed (a bug in arrayckpt: please report it)")
        out[path] = chunk_digest(found[flat] for flat in order)
    return out


def chunk_writers(arrays: Mapping[str, ArrayPlan], entries: Mapping[str, Entry],
                  reports: Mapping[str, Sequence[tuple[int, Mapping[int, int]]]]) -> dict[str, list[list[int]]]:
    """Per array, the rank that reported each stored chunk (in digest order) as ``writer_runs``: the manifest's
    ``created.writers``. ``reports[path]`` lists (rank, the chunks it reported) in rank order; a chunk reported
    twice counts for the first. Per array in numpy: millions of chunks at 16,384 ranks."""
    out = {}
    for path, array in arrays.items():
        order = np.asarray(stored_chunks(array, entries), dtype=np.int64)
        owner = np.full(int(order.max()) + 1 if order.size else 0, -1, np.int64)
        by = reports.get(path, ())
        if by:
            reported = np.fromiter(itertools.chain.from_iterable(found for _, found in by), np.int64)
            ranks = np.repeat(np.fromiter((rank for rank, _ in by), np.int64, len(by)),
                              np.fromiter((len(found) for _, found in by), np.int64, len(by)))
            keep = reported < owner.size
            owner[reported[keep][::-1]] = ranks[keep][::-1]  # reversed: the first report of a chunk is kept
        out[path] = writer_runs(owner[order])
    return out
