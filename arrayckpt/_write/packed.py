"""Writing a packed checkpoint (spec §16): each rank appends the chunk files it writes to its one pack, and the
coordinator turns what the ranks report into the chunk table that the commit records.

A rank encodes its chunks with TensorStore exactly as for the files layout (same specs, same codecs, same
checksums), but into a ``memory`` kvstore, a batch of bounded bytes at a time (``pack_batch_bytes``); after each
batch it moves every chunk file TensorStore made there to the end of its pack and empties the store. What it
reports with its chunk checksums is, per array, each chunk's ``(offset, length)`` in its pack, and the pack
itself (name, size). The coordinator concatenates the ranks' packs (rank order), builds one row per stored chunk
(spec §11.2's order) and refuses a chunk nobody reported, as the chunk digests already do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import crc32c
import numpy as np

from .._errors import StorageError
from .._format.jsontypes import JSON, json_object
from .._format.packs import (
    REFS_NAME,
    ChunkTable,
    PackFile,
    PackLayout,
    StoredChunks,
    encode_index,
    index_name,
    references_file,
)
from .._format.zarr import grid_counts, parse_chunk_key
from .._io.arrays import ArrayIO, Checksums, LazyContext, resolve_context, split_rows, write_all
from .._io.fastio import write_rows
from .._io.pools import batches
from .._settings import settings

if TYPE_CHECKING:
    from .._io.arrays import StoreContext
    from .._storage.base import Location
    from .._storage.packs import PackWriter

__all__ = ["ChunkDestination", "PackReport", "RankPack", "chunk_destination", "chunk_table", "index_files",
           "memory_kvstore"]


@dataclass(frozen=True)
class PackReport:
    """What one rank wrote into its pack: the pack (``None``: the rank wrote nothing) and, per array path, each
    chunk's ``flat index -> (offset, length)`` in it."""

    pack: PackFile | None
    chunks: Mapping[str, Mapping[int, tuple[int, int]]] = field(default_factory=dict)


def memory_kvstore(path: str) -> JSON:
    """Where a rank's TensorStore writes the chunk files of node ``path`` before they go to its pack."""
    return {"driver": "memory", "path": f"{path}/"}


class RankPack:
    """One rank's pack being written: :meth:`write` is a ``write_all`` that ends with the chunk files in the pack;
    :meth:`close` finishes it (its :class:`PackReport`), :meth:`abort` removes it."""

    def __init__(self, target: Location, rank: int, where: str, tag: str) -> None:
        self.where = where
        self.context = LazyContext({})  # its own memory kvstore, emptied after every batch
        self._target, self._rank, self._tag = target, rank, tag
        self._writer: PackWriter | None = None
        self._chunks: dict[str, dict[int, tuple[int, int]]] = {}
        self._lock = threading.Lock()  # the fast path appends from several threads

    def write(self, jobs: Sequence[ArrayIO], context: StoreContext, where: str) -> Checksums:
        """Write ``jobs`` (their specs on :func:`memory_kvstore`; ``context`` is :attr:`context`): uncompressed row
        layouts straight into the pack (``fastio``: one copy, hardware crc32c, several threads), the rest a batch
        at a time through TensorStore, each batch's chunk files moved to the pack before the next is encoded. The
        jobs of one array go into one batch, so that no chunk is ever encoded in two parts."""
        out: Checksums = {}
        rows, rest = split_rows(jobs)
        if rows:
            sums: list[dict[int, int]] = [{} for _ in rows]
            declined = write_rows([(job.key, job.node or job.key, layout, first, job.data, found)
                                   for (job, layout, first), found in zip(rows, sums, strict=True)], where, self)
            skipped = set(declined)
            rest = [*rest, *(rows[i][0] for i in declined)]
            for i, ((job, _, _), found) in enumerate(zip(rows, sums, strict=True)):
                if i not in skipped and job.node is not None:
                    out.setdefault(job.node, {}).update(found)
        for batch in _batches(rest, settings().pack_batch_bytes):
            for path, found in write_all(batch, context, where).items():
                out.setdefault(path, {}).update(found)
            self._drain(batch, context)
        return out

    def _drain(self, batch: Sequence[ArrayIO], context: StoreContext) -> None:
        """Move every chunk file of ``batch``'s arrays from the memory kvstore to the end of the pack."""
        import tensorstore as ts  # only where a save is packed

        store = ts.KvStore.open({"driver": "memory"}, context=resolve_context(context)).result()
        metadata = {job.node or "": json_object(job.spec.get("metadata")) for job in batch}
        for node, meta in metadata.items():
            keys = store.list(ts.KvStore.KeyRange(f"{node}/", f"{node}0")).result()  # '0' follows '/'
            names = [key.decode()[len(node) + 1:] for key in keys]
            values = [store.read(f"{node}/{name}") for name in names]
            counts = grid_counts(meta)
            with self._lock:
                found = self._chunks.setdefault(node, {})
            for name, pending in zip(names, values, strict=True):
                grid_index = parse_chunk_key(meta, name)
                if grid_index is None:
                    raise StorageError(f"{self.where}: array {node!r}: TensorStore wrote {name!r}, which is not a "
                                       "chunk key of the array (a bug in arrayckpt: please report it)")
                flat = int(np.ravel_multi_index(grid_index, counts)) if counts else 0
                if flat in found:
                    raise StorageError(f"{self.where}: array {node!r}: chunk {grid_index} was written twice by rank "
                                       f"{self._rank} (a bug in arrayckpt: please report it)")
                found[flat] = self._append(pending.result().value)
        store.delete_range(ts.KvStore.KeyRange()).result()

    def put(self, node: str, index: int, buffers: list[memoryview | bytes]) -> None:
        """One chunk file from the fast path (any thread): appended, and recorded as chunk ``index`` of ``node``."""
        offset, length = self._append([memoryview(b) for b in buffers])
        with self._lock:
            found = self._chunks.setdefault(node, {})
            if index in found:
                raise StorageError(f"{self.where}: array {node!r}: chunk {index} was written twice by rank "
                                   f"{self._rank} (a bug in arrayckpt: please report it)")
            found[index] = (offset, length)

    def _append(self, data: bytes | list[memoryview]) -> tuple[int, int]:
        with self._lock:
            if self._writer is None:
                self._writer = self._target.open_pack(self._rank, self._tag)
            writer = self._writer
        offset, length = writer.append(data)
        return offset, length

    def close(self) -> PackReport:
        """Finish the pack (synced to disk unless the save is not durable): what this rank reports."""
        if self._writer is None:
            return PackReport(None)
        files = self._writer.close()
        return PackReport(files[0] if files else None, self._chunks)

    def abort(self) -> None:
        """Remove the pack (the save failed)."""
        if self._writer is not None:
            self._writer.abort()


def _batches(jobs: Sequence[ArrayIO], budget: int) -> list[list[ArrayIO]]:
    """``jobs`` grouped by array, arrays gathered into batches of about ``budget`` bytes (an array larger than that
    is a batch of its own)."""
    by_node: dict[str, list[ArrayIO]] = {}
    for job in jobs:
        by_node.setdefault(job.node or job.key, []).append(job)
    groups = batches(list(by_node.values()), lambda group: sum(job.data.nbytes for job in group), budget)
    return [[job for group in batch for job in group] for batch in groups]


@dataclass(frozen=True)
class ChunkDestination:
    """Where one rank's chunk files go, and how: ``write(jobs, context, where)``, each job's spec on ``kvstore(path)``
    (made by :func:`chunk_destination`, which holds the one choice between the two layouts)."""

    kvstore: Callable[[str], JSON]
    context: StoreContext
    write: Callable[[Sequence[ArrayIO], StoreContext, str], Checksums]
    pack: RankPack | None  # the pack they go into (the caller closes or aborts it); None: one file per chunk


def chunk_destination(target: Location, pack: RankPack | None) -> ChunkDestination:
    """The chunk files into ``pack`` where the save is packed (spec §16: encoded in its memory store, then appended
    to it), else one file (object) per chunk below ``target`` (``write_all``)."""
    if pack is None:
        return ChunkDestination(target.kvstore, target.write_context(), write_all, None)
    return ChunkDestination(memory_kvstore, pack.context, pack.write, pack)


def chunk_table(nodes: Mapping[str, JSON], present: Mapping[str, tuple[int, ...]], reports: Sequence[PackReport],
                where: str) -> tuple[list[PackFile], ChunkTable]:
    """The packs of a save (every rank's, in rank order) and its chunk table: per array path of ``nodes``, one row
    per stored chunk (every chunk of its grid; a chunks delta's ``present``). Raises :class:`StorageError` for a
    stored chunk no rank reported (the save is not committed)."""
    packs: list[PackFile] = []
    owner: dict[str, list[tuple[int, Mapping[int, tuple[int, int]]]]] = {}
    for report in reports:
        if report.pack is None:
            continue
        for path, chunks in report.chunks.items():
            owner.setdefault(path, []).append((len(packs), chunks))
        packs.append(report.pack)
    rows: dict[str, np.ndarray] = {}
    for path, metadata in nodes.items():
        stored = StoredChunks(tuple(grid_counts(metadata)), present.get(path))
        order = stored.order
        table = np.zeros((len(order), 3), np.uint64)
        where_is: dict[int, tuple[int, int, int]] = {}
        for index, chunks in owner.get(path, ()):
            for flat, (offset, length) in chunks.items():
                where_is[flat] = (index, offset, length)
        for row, flat in enumerate(order):
            found = where_is.get(flat)
            if found is None:
                raise StorageError(f"{where}: not committed: {stored.describe(row)} of array {path!r} was written by "
                                   "no rank (a bug in arrayckpt: please report it)")
            table[row] = found
        rows[path] = table
    return packs, ChunkTable(rows)


def index_files(nodes: Mapping[str, JSON], documents: Mapping[str, bytes], present: Mapping[str, tuple[int, ...]],
                packs: Sequence[PackFile], table: ChunkTable, tag: str,
                write: Callable[[str, bytes], None]) -> PackLayout:
    """Write the index file and, up to ``refs_max_chunks`` chunks, the kerchunk references (``write(name,
    bytes)``; ``documents``: every node's ``zarr.json`` but the root's, by node path); the layout the manifest
    records. Above that many chunks ``arrayckpt refs`` writes the references on demand (``_tools/refs.py``)."""
    data, sections = encode_index(packs, table)
    name = index_name(tag)
    write(name, data)
    if sum(len(rows) for rows in table.rows.values()) <= settings().refs_max_chunks:
        write(REFS_NAME, references_file(nodes, documents, present, table, packs))
    return PackLayout(tuple(packs), name, len(data), crc32c.crc32c(data), sections)
