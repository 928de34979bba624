"""Where a packed checkpoint's chunk files are (spec §16): the chunk table, read a section at a time, and the byte
ranges of the packs that hold the chunks a read needs.

A :class:`PackedChunks` is the :class:`~arrayckpt._io.staged.ChunkSource` of one opened packed checkpoint: the read
layer gives its arrays specs on a ``memory`` kvstore named by its token (:meth:`PackedChunks.kvstore`), and the IO
layer asks it for the chunk files a read touches. An array's section of the index file is read the first time one
of its chunks is (one ranged read for the sections of every array a call needs), checked as untrusted input
(``_format/packs.py::decode_sections``) and kept while the checkpoint is open.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from .._errors import CorruptCheckpointError
from .._format.jsontypes import JSON
from .._format.packs import PACK_PREFIX, PackLayout, SectionBytes, StoredChunks, decode_sections, row_of
from .._format.stored import max_chunk_file_bytes
from .._format.zarr import chunk_key, grid_counts, unravel
from .._io.fastio import Locate
from .._io.pools import map_kept
from .._io.shards import Part
from .._io.smallfiles import check_no_links
from .._io.staged import TOKEN_PREFIX, register
from .._settings import settings

__all__ = ["PackedChunks", "ReadRanges"]

#: Reads ``(offset, length)`` ranges of one file of the checkpoint (a pack, the index): ``(name, ranges) -> bytes``.
ReadRanges = Callable[[str, Sequence[tuple[int, int]]], list[bytes]]


class PackedChunks:
    """The chunk files of one opened packed checkpoint, by array path and flat grid index (module docstring)."""

    def __init__(self, layout: PackLayout, nodes: Mapping[str, JSON], present: Mapping[str, tuple[int, ...]],
                 read_ranges: ReadRanges, where: str, root: str | None = None) -> None:
        self.layout, self.where = layout, where
        self._root = root  # the pinned directory, when the packs are local files
        self._packs_checked = False  # whether its packs folder was checked not to be a link
        self.token = f"{TOKEN_PREFIX}{uuid.uuid4().hex}"
        self._nodes, self._present, self._read = nodes, present, read_ranges
        self._rows: dict[str, NDArray[np.uint64]] = {}
        self._stored: dict[str, StoredChunks] = {}
        self._lock = threading.Lock()
        register(self)

    def kvstore(self, path: str) -> JSON:
        """The spec through which array ``path`` is read (``_io/staged.py`` stages its chunk files there)."""
        return {"driver": "memory", "path": f"{self.token}/{path}/"}

    def stored(self, path: str) -> StoredChunks:
        """Which chunks array ``path`` stores, in table order (worked out from its metadata once per open checkpoint:
        every chunk lookup needs it)."""
        found = self._stored.get(path)
        if found is None:
            found = self._stored[path] = StoredChunks(tuple(grid_counts(self._nodes[path])), self._present.get(path))
        return found

    def rows(self, paths: Sequence[str]) -> dict[str, NDArray[np.uint64]]:
        """The checked rows (pack index, offset, length) of each array of ``paths``, read once: the sections not
        read yet in one call."""
        with self._lock:
            missing = [path for path in dict.fromkeys(paths) if path not in self._rows]
        if missing:
            sections = [self.layout.sections[path] for path in missing]
            data = self._read(self.layout.index_name, [(s.offset, s.length) for s in sections])
            read = [SectionBytes(path, raw, len(self.stored(path).order), max_chunk_file_bytes(self._nodes[path]),
                                 section.crc, self.stored(path))
                    for path, section, raw in zip(missing, sections, data, strict=True)]
            decoded = decode_sections(read, self.layout.packs, self.where)  # checked together: one pass of numpy
            with self._lock:
                self._rows.update(zip(missing, decoded, strict=True))
        with self._lock:
            return {path: self._rows[path] for path in paths}

    def locate(self, path: str) -> Locate | None:
        """Where each chunk file of array ``path`` lies, as (pack file path, offset, length), when the packs are
        local files below the pinned directory (whose ``packs`` folder must not be a link: spec §12)."""
        if self._root is None:
            return None
        if not self._packs_checked:  # the pinned directory's packs folder, once per open checkpoint
            check_no_links(self._root, PACK_PREFIX.rstrip("/"), self.where)
            self._packs_checked = True
        table, stored = self.rows([path])[path], self.stored(path)
        order, names = stored.order, [f"{self._root.rstrip('/')}/{pack.name}" for pack in self.layout.packs]

        def where_is(flat: int) -> tuple[str, int, int, str]:
            row = row_of(order, flat)
            if row is None:
                raise self._not_stored(path, stored, flat)
            pack, offset, length = table[row].tolist()
            return names[pack], offset, length, f"{path}/{chunk_key(self._nodes[path], unravel(flat, stored.counts))}"
        return where_is

    def _not_stored(self, path: str, stored: StoredChunks, flat: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.where}: array {path!r}: chunk {unravel(flat, stored.counts)} is not stored in this checkpoint "
            "(the read asked for a chunk its table does not hold)")

    def read_file(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The ``(offset, length)`` ranges of the file ``name`` of this checkpoint (a pack, the index), read as the
        chunk reads are: for ``verify``, which checks whole files (their sizes, the index's crc32c)."""
        return self._read(name, ranges)

    def lengths(self, path: str, flats: Sequence[int]) -> list[int]:
        """The byte length of each chunk file of array ``path`` at ``flats``, from its checked section."""
        table, stored = self.rows([path])[path], self.stored(path)
        out = []
        for flat in flats:
            row = row_of(stored.order, flat)
            if row is None:
                raise self._not_stored(path, stored, flat)
            out.append(int(table[row][2]))
        return out

    def fetch_parts(self, parts: Sequence[Part]) -> list[list[bytes]]:
        """For each ``(path, flat, ranges)``, those ``(offset, length)`` ranges of that chunk file of array ``path``
        (``(0, -n)``: its last ``n`` bytes), of any arrays, the ranges of one pack in one call (merged into few reads
        on object storage); a range outside the chunk file is damage (its bytes would be another chunk's)."""
        tables = self.rows(sorted({path for path, _, _ in parts}))
        by_pack: dict[int, list[tuple[int, int, int, int]]] = {}  # pack -> (part, range, offset, length)
        for i, (path, flat, ranges) in enumerate(parts):
            stored = self.stored(path)
            row = row_of(stored.order, flat)
            if row is None:
                raise self._not_stored(path, stored, flat)
            pack, base, size = tables[path][row].tolist()
            for j, (offset, length) in enumerate(ranges):
                if length < 0:
                    offset, length = size + length, -length
                if offset < 0 or offset + length > size:
                    raise CorruptCheckpointError(
                        f"{self.where}: array {path!r}: chunk {unravel(flat, stored.counts)} has {size} bytes, but "
                        f"its shard index points at bytes [{offset}, {offset + length}) of it: the checkpoint is "
                        "damaged or crafted; restore it from a copy")
                by_pack.setdefault(pack, []).append((i, j, base + offset, length))
        out: list[list[bytes]] = [[b""] * len(ranges) for _, _, ranges in parts]
        for pack, data in self._read_packs(by_pack).items():
            for (i, j, _, _), piece in zip(by_pack[pack], data, strict=True):
                out[i][j] = piece
        return out

    def prepare(self, paths: Sequence[str]) -> None:
        """The sections of ``paths`` read now, in one call (a load's arrays: one ranged read of the index, merged)."""
        self.rows([path for path in paths if path in self.layout.sections])

    def fetch_many(self, requests: Sequence[tuple[str, Sequence[int]]]) -> list[list[bytes]]:
        """The chunk files of several arrays (``(path, flats)`` each), their sections read in one call and the ranges
        of each pack in one call (merged into few reads on object storage: ``pack_read_gap_bytes``)."""
        for path, _ in requests:
            if path not in self.layout.sections:
                raise CorruptCheckpointError(f"{self.where}: array {path!r} has no section in the pack index")
        tables = self.rows([path for path, _ in requests])
        by_pack: dict[int, list[tuple[int, int, int, int]]] = {}  # pack -> (request, position, offset, length)
        for i, (path, flats) in enumerate(requests):
            table, stored = tables[path], self.stored(path)
            order = stored.order
            for position, flat in enumerate(flats):
                row = row_of(order, flat)
                if row is None:
                    raise self._not_stored(path, stored, flat)
                pack, offset, length = table[row].tolist()
                by_pack.setdefault(pack, []).append((i, position, offset, length))
        out: list[list[bytes]] = [[b""] * len(flats) for _, flats in requests]
        for pack, data in self._read_packs(by_pack).items():
            for (i, position, _, _), chunk in zip(by_pack[pack], data, strict=True):
                out[i][position] = chunk
        return out

    def _read_packs(self, by_pack: Mapping[int, Sequence[tuple[int, int, int, int]]]) -> dict[int, list[bytes]]:
        """The ranges ``(_, _, offset, length)`` of each pack, each pack's in one call (merged into few GETs on object
        storage), the packs concurrently: on object storage every call is a round trip, and a reshard reads from
        several ranks' packs."""
        def one(pack: int) -> list[bytes]:
            return self._read(self.layout.packs[pack].name, [(offset, length) for *_, offset, length in by_pack[pack]])
        packs = list(by_pack)
        if len(packs) <= 1:
            return {pack: one(pack) for pack in packs}
        return dict(zip(packs, map_kept("pack-files", min(len(packs), settings().io_threads), one, packs), strict=True))
