"""Copying a packed checkpoint's packs (spec §16) from one storage to another, checked on the way: ``copy``'s engine
for the packed layout, beside ``copy_files.py`` for one file per chunk.

A pack is copied as one file or object, byte for byte (the chunk table's offsets stay valid, so the manifest's
``packs`` member, the index and the references are the source's), under its own name: through the destination's
pack writer (``Location.open_pack``: locally one file, fsynced; on object storage one PUT, or a multipart upload
through s3fs/gcsfs when it is larger than ``object_part_bytes``). It is read in windows of whole chunk files (about
``copy_in_flight_bytes / concurrency`` bytes, a larger chunk file alone), and every chunk file in a window is checked
before the window is written, as ``copy_files.py`` checks a chunk file (its size is the table's, its crc32c, its
shard index; compressed ones decoded). Before any pack is read the table is checked as ``verify`` checks it: every
section (its length, crc32c, rows inside the packs, no overlaps) and no chunk of two arrays sharing bytes. Each pack
written must have the size the manifest records; with ``read_back`` it is read back from the destination and its
crc32c compared with that of the bytes written. Several packs are copied at once, within the copy's byte budget
(a pack claims its window and, on object storage, the parts its upload holds). A storage error retries the whole
pack (its partial upload abandoned) a bounded number of times; damage is never retried.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np
from numpy.typing import NDArray

from .._errors import CorruptCheckpointError, StorageError
from .._format.integrity import ChunkDigest
from .._format.packs import ChunkTable, PackFile, check_index, parse_pack_name
from .._format.zarr import chunk_key
from .._read.packed import PackedChunks
from .._settings import settings
from .._storage import Location
from .copy_files import PERMANENT, RETRY_DELAYS, ArrayCopy, Budget, ChunkChecker, Progress, Throttle

__all__ = ["PackCopier", "checked_table", "read_index"]


def checked_table(packed: PackedChunks, paths: Sequence[str], outcome: str) -> ChunkTable:
    """The chunk table of the arrays ``paths`` of ``packed``, checked as ``verify`` checks it: every section decoded
    and checked (its length, crc32c, rows inside the packs, no overlap), and no chunk of two arrays sharing bytes.
    What ``copy`` copies and ``arrayckpt refs`` makes references of: a damaged table is refused, never passed on.
    Raises :class:`CorruptCheckpointError` naming the checkpoint (``outcome`` ends the one for an array without a
    section: ``nothing was copied``)."""
    layout, where = packed.layout, packed.where
    for path in paths:
        if path not in layout.sections:
            raise CorruptCheckpointError(f"{where}: array {path!r} has no section in the pack index (the manifest is "
                                         f"damaged or crafted); {outcome}")
    rows = packed.rows(paths)
    table = ChunkTable(rows)
    check_index(layout.packs, table, where, {path: packed.stored(path) for path in rows})
    return table


def read_index(packed: PackedChunks, outcome: str) -> bytes:
    """The whole index file of ``packed``, which must be the one its manifest records (its size and crc32c): a copy
    writes it as it is. Raises :class:`CorruptCheckpointError` naming the checkpoint; ``outcome`` ends it."""
    layout = packed.layout
    index = packed.read_file(layout.index_name, [(0, layout.index_size)])[0] if layout.index_size else b""
    if len(index) != layout.index_size or crc32c.crc32c(index) != layout.index_crc:
        raise CorruptCheckpointError(f"{packed.where}: the pack index {layout.index_name} is not the one the manifest "
                                     f"records ({len(index):,} bytes, crc32c {crc32c.crc32c(index):#010x}; recorded: "
                                     f"{layout.index_size:,} bytes, {layout.index_crc:#010x}): it was damaged or "
                                     f"replaced; {outcome}")
    return index


class PackCopier:
    """Copies the packs of one opened packed checkpoint (``packed``) to ``target`` (a write transaction's target);
    see the module docstring. :attr:`objects` counts the chunk files copied, :attr:`stored_bytes` the pack bytes."""

    def __init__(self, packed: PackedChunks, target: Location, *, throttle: Throttle, read_back: bool,
                 concurrency: int, progress: Progress | None) -> None:
        self._packed, self._target, self._where = packed, target, packed.where
        self._throttle, self._read_back, self._concurrency = throttle, read_back, max(1, concurrency)
        self._progress = progress
        self._checker = ChunkChecker()
        self._window = max(1, settings().copy_in_flight_bytes // self._concurrency)
        self._held = settings().object_part_bytes * settings().object_pack_parts  # what an upload holds, at most
        self._budget = Budget(settings().copy_in_flight_bytes)
        self._lock = threading.Lock()
        self._done = self._total = 0
        self.objects = self.stored_bytes = 0

    def copy_packs(self, arrays: Sequence[ArrayCopy], table: ChunkTable) -> dict[str, str]:
        """Copy every pack, checking every chunk file of ``arrays`` in them (``table``: :func:`checked_table`);
        returns each array's digest of its chunks' content checksums (spec §11.2)."""
        grids = [list(array.chunks()) for array in arrays]
        crcs = [np.zeros(len(grid), np.uint64) for grid in grids]
        by_pack: list[list[tuple[int, int, int, int]]] = [[] for _ in self._packed.layout.packs]
        for a, array in enumerate(arrays):  # (offset, length, array, row) of every chunk, by pack
            for row, (pack, offset, length) in enumerate(table.rows[array.path].tolist()):
                by_pack[pack].append((offset, length, a, row))
        self._total = sum(array.nbytes() for array in arrays)
        with ThreadPoolExecutor(self._concurrency, thread_name_prefix="arrayckpt-copy-pack") as pool:
            futures = [pool.submit(self._copy_pack, pack, sorted(chunks), arrays, grids, crcs)
                       for pack, chunks in zip(self._packed.layout.packs, by_pack, strict=True)]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        digests = {}
        for array, found in zip(arrays, crcs, strict=True):
            digest = ChunkDigest()
            for crc in found.tolist():
                digest.add(crc)
            digests[array.path] = digest.value
        return digests

    def _copy_pack(self, pack: PackFile, chunks: list[tuple[int, int, int, int]], arrays: Sequence[ArrayCopy],
                   grids: list[list[tuple[int, ...]]], crcs: list[NDArray[np.uint64]]) -> None:
        """Copy one pack, checked; retried whole after a storage error."""
        claim = min(pack.size, self._window + self._held)
        self._budget.acquire(claim)
        try:
            for delay in (*RETRY_DELAYS, None):
                try:
                    return self._copy_pack_once(pack, chunks, arrays, grids, crcs)
                except StorageError as e:
                    if delay is None or any(mark in str(e) for mark in PERMANENT):
                        raise
                    time.sleep(delay)
        finally:
            self._budget.release(claim)

    def _copy_pack_once(self, pack: PackFile, chunks: list[tuple[int, int, int, int]], arrays: Sequence[ArrayCopy],
                        grids: list[list[tuple[int, ...]]], crcs: list[NDArray[np.uint64]]) -> None:
        named = parse_pack_name(pack.name)
        if named is None:
            raise StorageError(f"{self._where}: the pack {pack.name} is not named as arrayckpt names packs "
                               "(packs/<tag>-r<rank>.pack), so it cannot be written under its name; copy a "
                               "checkpoint arrayckpt wrote, or `arrayckpt compact` this one first")
        writer = self._target.open_pack(*named)
        done = count = 0
        try:
            whole = 0  # crc32c of the bytes written, for the read-back
            if pack.size == 0:
                writer.append(b"")
            for start, end, inside in _windows(chunks, pack.size, self._window):
                data = self._packed.read_file(pack.name, [(start, end - start)])[0]
                if len(data) != end - start:
                    raise CorruptCheckpointError(f"{self._where}: the pack {pack.name} is truncated: bytes [{start:,}, "
                                                 f"{end:,}) of the {pack.size:,} the manifest records gave "
                                                 f"{len(data):,}; nothing was copied")
                view = memoryview(data)
                for offset, length, a, row in inside:
                    array, grid_index = arrays[a], grids[a][row]
                    file = f"{array.path}/{chunk_key(array.source, grid_index)}"
                    where = f"{self._where}/{file} (bytes [{offset:,}, {offset + length:,}) of {pack.name})"
                    piece = bytes(view[offset - start:offset - start + length])
                    crcs[a][row] = self._checker.content_crc(array, grid_index, piece, where)
                    done += math.prod(s.stop - s.start for s in array.extent(grid_index)) * array.itemsize
                count += len(inside)
                self._throttle.take(len(data))
                writer.append(data)
                whole = crc32c.crc32c(data, whole)
                self._advance(done)
                done = 0
            written = writer.close()
        except BaseException:
            writer.abort()
            raise
        size = written[0].size if written else 0
        if [file.name for file in written] != [pack.name] or size != pack.size:
            raise StorageError(f"{self._target}: the pack {pack.name} was written with {size:,} bytes, the manifest "
                               f"records {pack.size:,}")
        if self._read_back:
            self._check_written(pack, whole)
        with self._lock:
            self.objects += count
            self.stored_bytes += pack.size

    def _check_written(self, pack: PackFile, expected: int) -> None:
        """Read the pack back from the destination, a window at a time, and compare its crc32c."""
        crc = 0
        try:
            for start in range(0, pack.size, self._window):
                crc = crc32c.crc32c(self._target.read_pack(pack.name, [(start, min(self._window,
                                                                                  pack.size - start))])[0], crc)
        except CorruptCheckpointError as e:
            raise StorageError(f"{self._target}: {pack.name} read back is not what was written: {e}") from e
        if crc != expected:
            raise StorageError(f"{self._target}: {pack.name} read back differs from what was written (crc32c "
                               f"{crc:#010x}, written {expected:#010x})")

    def _advance(self, nbytes: int) -> None:
        with self._lock:
            self._done += nbytes
            if self._progress is not None:
                self._progress(self._done, self._total)


def _windows(chunks: list[tuple[int, int, int, int]], size: int,
             window: int) -> list[tuple[int, int, list[tuple[int, int, int, int]]]]:
    """``[0, size)`` cut into consecutive ranges ``(start, end, chunks inside)`` ending at chunk ends, of about
    ``window`` bytes (a larger chunk alone); ``chunks``: ``(offset, length, ...)`` sorted by offset, disjoint, inside
    ``[0, size)``. Bytes outside every chunk are copied too (the pack is copied byte for byte), in ranges of at most
    ``window`` bytes.

    >>> _windows([(0, 4, 0, 0), (4, 4, 0, 1), (20, 4, 0, 2)], 30, 8)
    [(0, 8, [(0, 4, 0, 0), (4, 4, 0, 1)]), (8, 16, []), (16, 24, [(20, 4, 0, 2)]), (24, 30, [])]
    """
    out: list[tuple[int, int, list[tuple[int, int, int, int]]]] = []
    start = position = 0
    inside: list[tuple[int, int, int, int]] = []
    for chunk in chunks:
        offset, end = chunk[0], chunk[0] + chunk[1]
        if end - start > window:
            if inside:
                out.append((start, position, inside))
                start, inside = position, []
            while offset - start > window:  # a long run of bytes outside every chunk
                out.append((start, start + window, []))
                start += window
        inside.append(chunk)
        position = end
    if inside:
        out.append((start, position, inside))
        start = position
    while start < size:
        out.append((start, min(start + window, size), []))
        start += window
    return out
