"""The manifest's chunk digests of a planned save, from the checksums its writers reported (spec §11).

Which chunks an array stores is a planning fact (all of them; for a chunks delta, those in ``present``), so the
coordinator can insist that every one of them was reported written before it commits: a chunk no rank
wrote would otherwise only be noticed by the first read of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

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
                  by_rank: Sequence[Mapping[str, Mapping[int, int]]]) -> dict[str, list[list[int]]]:
    """Per array, the rank that reported each stored chunk (in digest order) as ``writer_runs``: the manifest's
    ``created.writers``. ``by_rank[r]`` is what rank ``r`` reported; a chunk reported twice counts for the first."""
    owner: dict[str, dict[int, int]] = {}
    for rank, sums in enumerate(by_rank):
        for path, found in sums.items():
            owned = owner.setdefault(path, {})
            for flat in found:
                owned.setdefault(flat, rank)
    out = {}
    for path, array in arrays.items():
        owned = owner.get(path, {})
        out[path] = writer_runs([owned[flat] for flat in stored_chunks(array, entries)])
    return out
