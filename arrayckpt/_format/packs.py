"""The packed layout (issue 35): each rank's chunk files appended into a few *pack* files, and the table that says
where each chunk lies. Pure: no IO, no torch; nothing uses it yet.

A checkpoint saved at R ranks of T tensors is ~R×T chunk files (561,534 for a Llama-70B-shaped state at 256
ranks). Packed, the Zarr key → bytes mapping stays exactly the same (every chunk file is still the bytes the
codecs of its array make, shard index and crc32c included), but each rank appends the bytes of the chunk files it
writes into one pack file, or a few segments (:func:`pack_name`), and the checkpoint records where each chunk is:

* the **chunk table** (:class:`ChunkTable`): per array path, one row per *stored chunk* in the order of spec §11.2
  (all outer chunks in C order of the grid; for a chunks delta, those of ``present``, in that order), each row
  (pack index, offset, length). Row ``r`` of a full array is its chunk of flat index ``r``; a chunks delta maps a
  flat index to its row through ``present`` (:func:`row_of`).
* the **index file** (:data:`INDEX_NAME`, written by the coordinator): the table, one *section* per array, back to
  back in table order. A section is its rows as little-endian u64 triples (pack index, offset, length: 24 bytes a
  chunk, :data:`ROW_SIZE`), then the crc32c of those bytes (4 bytes, little-endian, as the ``crc32c`` codec). A
  reader fetches only the sections of the arrays it reads, with ranged reads (:func:`decode_section`).
* the manifest member ``packs`` (:func:`packs_member`, :func:`parse_packs_member`): the pack files (name, size,
  writing rank), the index file (name, size, crc32c of the whole file) and each array's section (offset, length,
  crc32c), so that opening a checkpoint is still one read of the root document.
* kerchunk v1 references (:func:`reference_document`), through which zarr-python reads a packed checkpoint with
  fsspec's ``ReferenceFileSystem``: node documents inline, each chunk key ``[pack name, offset, length]`` with pack
  names relative to the checkpoint (resolved there by a ``dir`` filesystem).

Every byte of the index and of the member is untrusted input (spec §12: a valid checksum proves no honesty): a
section's row count, pack indices, extents, lengths and overlaps are checked before any of it is used, and every
problem is a :class:`CorruptCheckpointError` (in a section) or a :class:`FormatError` (in the member) of one line
naming the checkpoint, the array and the chunk. Order of the checks a reader makes: :func:`parse_packs_member` when
the root document is opened; :func:`decode_section` for each array it reads (:func:`decode_sections`: the same
checks for all the arrays of a load at once); ``verify`` also :func:`check_index` over the whole table (no two chunks
of different arrays share bytes).
"""

from __future__ import annotations

import bisect
import json
import math
import re
import secrets
import struct
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

import crc32c
import numpy as np
from numpy.typing import NDArray

from .._errors import CorruptCheckpointError, FormatError
from .jsontypes import JSON
from .paths import MAX_NAME_BYTES, is_node_path, shown
from .zarr import ROOT_METADATA, chunk_keys, grid_counts, unravel

__all__ = ["INDEX_NAME", "PACKS_MEMBER", "PACK_PREFIX", "REFS_NAME", "ROW_SIZE", "ChunkTable", "PackFile",
           "PackLayout", "Section", "SectionBytes", "StoredChunks", "check_index", "check_section_arrays",
           "decode_section", "decode_sections", "encode_index", "index_name", "is_pack_key", "is_save_file", "new_tag",
           "pack_name", "packs_member", "parse_pack_name", "parse_packs_member", "reference_document",
           "reference_root", "references_file", "row_of",
           "stored_chunk_keys"]

PACKS_MEMBER = "packs"  # the manifest member that describes a packed checkpoint
PACK_PREFIX = "packs/"  # every pack file and the index file lie right below this folder of the checkpoint
INDEX_NAME = f"{PACK_PREFIX}index.bin"  # the index of an untagged save (tests); a save's is ``index_name(tag)``
REFS_NAME = "refs.json"  # kerchunk v1 references of a packed checkpoint, for readers without arrayckpt (spec §16.4)
ROW_SIZE = 24  # bytes of one stored chunk in the index: pack index, offset, length as little-endian u64
MIN_CHUNK_SIZE = 4  # bytes: every chunk file ends with its crc32c (spec §7.4)
MAX_RANK = 999_999  # pack names hold six digits of rank, so that the packs of one save sort by rank
MAX_SIZE = 2**63 - 1  # sizes and offsets stay within int64 and uint64 arithmetic alike
_CRC = struct.Struct("<I")
_TAG = re.compile(r"[0-9a-f]{1,16}")
_PACK_NAME = re.compile(r"packs/(?:([0-9a-f]{1,16})-)?r([0-9]{6})\.pack")
_INDEX_NAME = re.compile(r"packs/(?:[0-9a-f]{1,16}-)?index\.bin")
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")  # one file name: not hidden, no '.', '..', '/', '\\'


def is_pack_key(key: str) -> bool:
    """Whether ``key`` (relative to a checkpoint) is where a packed checkpoint keeps its packs, index or references."""
    return key == REFS_NAME or _file_name(key)


def is_save_file(key: str) -> bool:
    """Whether ``key`` (relative to a checkpoint) is a pack or an index named as arrayckpt's saves name them
    (:func:`pack_name`, :func:`index_name`): what ``gc`` takes as evidence that a prefix without a root document is
    an interrupted packed save (it has no node documents, spec §16.1).

    >>> is_save_file("packs/1f0c9a2e-r000003.pack"), is_save_file("packs/1f0c9a2e-index.bin"), is_save_file("refs.json")
    (True, True, False)
    """
    return parse_pack_name(key) is not None or _INDEX_NAME.fullmatch(key) is not None


def new_tag() -> str:
    """A save's tag (spec §16.1): 8 hexadecimal digits, new for every save, in the names of its packs and index, so
    that a save replacing a committed checkpoint on object storage never writes over the files of the one it
    replaces."""
    return secrets.token_hex(4)


def pack_name(rank: int, tag: str = "") -> str:
    """The name of rank ``rank``'s pack file of the save tagged ``tag``, relative to the checkpoint. Names of one save
    sort by rank.

    >>> pack_name(3, "1f0c9a2e"), pack_name(3)
    ('packs/1f0c9a2e-r000003.pack', 'packs/r000003.pack')
    """
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank <= MAX_RANK:
        raise ValueError(f"pack rank {rank!r} must be an integer from 0 to {MAX_RANK}")
    return f"{PACK_PREFIX}{_tagged(tag)}r{rank:06d}.pack"


def parse_pack_name(name: str) -> tuple[int, str] | None:
    """The rank and tag of a pack named as :func:`pack_name` names them (``None``: another name, which spec §16.2
    allows other writers), so that a copy writes the pack under the same name.

    >>> parse_pack_name("packs/1f0c9a2e-r000003.pack"), parse_pack_name("packs/r000003.pack"), parse_pack_name("x")
    ((3, '1f0c9a2e'), (3, ''), None)
    """
    found = _PACK_NAME.fullmatch(name)
    return None if found is None else (int(found.group(2)), found.group(1) or "")


def index_name(tag: str = "") -> str:
    """The name of the index file of the save tagged ``tag`` (spec §16.1).

    >>> index_name("1f0c9a2e")
    'packs/1f0c9a2e-index.bin'
    """
    return f"{PACK_PREFIX}{_tagged(tag)}index.bin"


def _tagged(tag: str) -> str:
    if tag and not _TAG.fullmatch(tag):
        raise ValueError(f"pack tag {tag!r} must be 1 to 16 lowercase hexadecimal digits")
    return f"{tag}-" if tag else ""


@dataclass(frozen=True)
class PackFile:
    """One pack file: its name relative to the checkpoint (``packs/r000003.pack``), its size in bytes, and the
    rank that wrote it."""

    name: str
    size: int
    rank: int


class Section(NamedTuple):
    """Where one array's rows lie in the index file: ``length`` bytes at ``offset``, whose last 4 are ``crc``, the
    crc32c of the rows before them."""

    offset: int
    length: int
    crc: int


def row_of(present: range | tuple[int, ...], flat: int) -> int | None:
    """The row of the chunk table that holds chunk ``flat`` (its flat C-order index in the array's outer grid) of an
    array storing the chunks ``present`` (spec §11.2's order: ``range(n)`` for a full array, where the row is the
    flat index; a chunks delta's ``present``, ascending, where it is found by bisection); ``None`` when the array
    does not store that chunk (a chunks delta: it is the base's).

    >>> row_of(range(6), 4), row_of((1, 4, 9), 4), row_of((1, 4, 9), 5)
    (4, 1, None)
    """
    if isinstance(present, range):
        return present.index(flat) if flat in present else None
    row = bisect.bisect_left(present, flat)
    return row if row < len(present) and present[row] == flat else None


@dataclass(frozen=True)
class StoredChunks:
    """Which chunks an array stores, in table order: its outer grid's chunk counts, and its stored flat indices
    (``present`` of a chunks delta; ``None``: every chunk, in C order). Errors name a row as its chunk's grid
    index with it."""

    counts: tuple[int, ...]
    present: range | tuple[int, ...] | None = None

    @property
    def order(self) -> range | tuple[int, ...]:
        """The flat indices of the stored chunks, row by row."""
        return self.present if self.present is not None else range(math.prod(self.counts))

    def describe(self, row: int) -> str:
        """``chunk (1, 0) (row 3)``: how an error names a row."""
        order = self.order
        return f"chunk {unravel(order[row], self.counts)} (row {row})" if 0 <= row < len(order) else f"row {row}"


def stored_chunk_keys(metadata: JSON, present: range | tuple[int, ...] | None = None) -> list[str]:
    """The chunk keys (below the array, ``c.1.0``) of an array's stored chunks in table order, from its metadata
    (checked, or written by arrayckpt): every outer chunk in C order, or those of a chunks delta's ``present``."""
    counts = grid_counts(metadata)
    order = StoredChunks(tuple(counts), present).order
    return chunk_keys(metadata, (unravel(flat, counts) for flat in order))


@dataclass(frozen=True, eq=False)
class ChunkTable:
    """Per array path, where each stored chunk lies: an ``(n_stored, 3)`` ``uint64`` array of rows (pack index,
    offset, length), in spec §11.2's order. The arrays are made read-only views (a table is a value; two tables
    compare by identity, as numpy arrays have no single truth value)."""

    rows: Mapping[str, NDArray[np.uint64]]

    def __post_init__(self) -> None:
        fixed = {}
        for path, rows in self.rows.items():
            if not (isinstance(rows, np.ndarray) and rows.dtype == np.uint64 and rows.ndim == 2
                    and rows.shape[1] == 3):
                raise ValueError(f"chunk table of array {path!r}: rows must be an (n, 3) uint64 array (pack index, "
                                 f"offset, length), got {getattr(rows, 'shape', None)} "
                                 f"{getattr(rows, 'dtype', type(rows).__name__)}")
            view = rows.view()
            view.flags.writeable = False
            fixed[path] = view
        object.__setattr__(self, "rows", MappingProxyType(fixed))


def encode_index(packs: Sequence[PackFile], table: ChunkTable) -> tuple[bytes, dict[str, Section]]:
    """The index file of ``table`` (its sections back to back, in table order) and each array's :class:`Section` in
    it, for the manifest member. Refuses (``ValueError``: a writer's bug) a row outside ``packs``, shorter than a
    crc32c or overlapping another; the coordinator may call :func:`check_index` for all of them first.

    >>> data, sections = encode_index([PackFile("packs/r000000.pack", 40, 0)],
    ...                               ChunkTable({"w": np.array([[0, 0, 12], [0, 12, 28]], np.uint64)}))
    >>> len(data), sections["w"].length
    (52, 52)
    """
    problem = _first_problem(_all_rows(table), packs, None, lambda i: f"row {i} of the table")
    if problem is not None:
        raise ValueError(f"chunk table: {problem} (a bug in arrayckpt: please report it)")
    parts, sections, offset = [], {}, 0
    for path, rows in table.rows.items():
        body = rows.astype("<u8", copy=False).tobytes()
        crc = crc32c.crc32c(body)
        parts.append(body + _CRC.pack(crc))
        sections[path] = Section(offset, len(body) + 4, crc)
        offset += len(body) + 4
    return b"".join(parts), sections


def decode_section(data: bytes | memoryview, path: str, n_stored: int, packs: Sequence[PackFile], where: str,
                   max_length: int, *, crc: int | None = None,
                   stored: StoredChunks | None = None) -> NDArray[np.uint64]:
    """The rows of array ``path`` from its section's bytes ``data`` (exactly the section's ``length`` bytes of the
    index file), checked as untrusted input: ``n_stored`` rows (the array's stored chunks, spec §11.2) and their
    crc32c; each row's pack index names one of ``packs``; its bytes lie inside that pack; its length is at least 4
    and at most ``max_length`` (``stored.py::max_chunk_file_bytes`` of the array's metadata); no two rows share
    bytes of one pack. ``crc``: the section's crc32c the manifest records, which its last 4 bytes must equal (a
    section of another array, or of another checkpoint, has a valid crc32c of its own). ``stored``: the array's
    stored chunks, so that errors name a chunk by its grid index. Raises :class:`CorruptCheckpointError` naming
    ``where``, the array and the chunk."""
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: the pack index section of array {path!r} {what}; the pack index file "
                                      "was damaged or crafted: restore the checkpoint from a copy")

    expected = n_stored * ROW_SIZE + 4
    view = memoryview(data).cast("B")
    if len(view) != expected:
        raise bad(f"has {len(view)} bytes, {expected} expected ({n_stored} stored chunks of {ROW_SIZE} bytes, "
                  "then a 4-byte crc32c)")
    body = view[:-4]
    actual, written = crc32c.crc32c(body), _CRC.unpack(view[-4:])[0]
    if actual != written:
        raise bad(f"fails its checksum (crc32c {actual:#010x}, stored {written:#010x})")
    if crc is not None and written != crc:
        raise bad(f"has the crc32c {written:#010x}, the manifest records {crc:#010x} (a section of another array "
                  "or another checkpoint)")
    rows = np.frombuffer(body, "<u8").reshape(n_stored, 3).astype(np.uint64, copy=False)
    describe = stored.describe if stored is not None else (lambda row: f"row {row}")
    problem = _first_problem(rows, packs, max_length, describe)
    if problem is not None:
        raise bad(f"is wrong: {problem}")
    return rows


class SectionBytes(NamedTuple):
    """One array's section as read, with what :func:`decode_section` checks it against (its arguments of the same
    names)."""

    path: str
    data: bytes | memoryview
    n_stored: int
    max_length: int
    crc: int | None = None
    stored: StoredChunks | None = None


def decode_sections(sections: Sequence[SectionBytes], packs: Sequence[PackFile], where: str
                    ) -> list[NDArray[np.uint64]]:
    """The rows of several arrays' sections, each checked exactly as :func:`decode_section` checks it, but the rows
    of all of them at once: a load of hundreds of small arrays pays a few numpy calls, not a few per array (the per
    array calls were most of a packed load's fixed cost). Each section's length and crc32c are still checked on its
    own bytes. Where anything is wrong, the sections are decoded one by one, in order, so that the error is the one
    :func:`decode_section` raises for the first bad section."""
    bodies: list[memoryview] = []
    for item in sections:
        view = memoryview(item.data).cast("B")
        if len(view) != item.n_stored * ROW_SIZE + 4:
            return _one_by_one(sections, packs, where)
        written = _CRC.unpack(view[-4:])[0]
        if crc32c.crc32c(view[:-4]) != written or (item.crc is not None and written != item.crc):
            return _one_by_one(sections, packs, where)
        bodies.append(view[:-4])
    counts = [item.n_stored for item in sections]
    rows = np.frombuffer(b"".join(bodies), "<u8").reshape(-1, 3).astype(np.uint64, copy=False)
    owner = np.repeat(np.arange(len(sections)), counts)
    longest = np.repeat(np.array([min(item.max_length, MAX_SIZE) for item in sections], np.uint64), counts)
    if _any_problem(rows, owner, packs, longest):
        return _one_by_one(sections, packs, where)
    ends = np.cumsum(counts).tolist()
    return [rows[end - count:end] for count, end in zip(counts, ends, strict=True)]


def _one_by_one(sections: Sequence[SectionBytes], packs: Sequence[PackFile], where: str) -> list[NDArray[np.uint64]]:
    return [decode_section(item.data, item.path, item.n_stored, packs, where, item.max_length, crc=item.crc,
                           stored=item.stored) for item in sections]


def _any_problem(rows: NDArray[np.uint64], owner: NDArray[np.intp], packs: Sequence[PackFile],
                 longest: NDArray[np.uint64]) -> bool:
    """Whether any row of ``rows`` (of the section ``owner``, whose chunk files hold at most ``longest`` bytes) fails a
    check of :func:`_first_problem`: its pack, length, extent, or an overlap with a row of the same section."""
    pack, offset, length = rows[:, 0], rows[:, 1], rows[:, 2]
    if (pack >= len(packs)).any() or (length < MIN_CHUNK_SIZE).any() or (length > longest).any():
        return True
    sizes = np.array([p.size for p in packs], np.uint64)[pack] if packs else np.zeros(0, np.uint64)
    if ((length > sizes) | (offset > sizes - np.minimum(length, sizes))).any():
        return True
    order = np.lexsort((offset, pack, owner))  # by section, pack, then offset: an overlap shows between neighbours
    s, p, o, n = owner[order], pack[order], offset[order], length[order]
    return bool(((s[1:] == s[:-1]) & (p[1:] == p[:-1]) & (o[1:] < o[:-1] + n[:-1])).any())


def check_index(packs: Sequence[PackFile], table: ChunkTable, where: str,
                stored: Mapping[str, StoredChunks] | None = None) -> None:
    """Check a whole chunk table (what ``verify`` reads): every row as :func:`decode_section` checks it but for its
    length's upper bound, and, across arrays, that no two chunks share bytes of one pack (one sort of all rows:
    O(n log n)). ``stored``: the arrays' stored chunks, so that errors name chunks by grid index. Raises
    :class:`CorruptCheckpointError` naming ``where`` and the arrays and chunks."""
    paths = list(table.rows)
    starts = np.cumsum([0] + [len(table.rows[path]) for path in paths])

    def describe(i: int) -> str:
        which = int(np.searchsorted(starts, i, side="right")) - 1
        path, row = paths[which], i - int(starts[which])
        chunks = (stored or {}).get(path)
        return f"array {path!r}, " + (chunks.describe(row) if chunks is not None else f"row {row}")

    problem = _first_problem(_all_rows(table), packs, None, describe)
    if problem is not None:
        raise CorruptCheckpointError(f"{where}: the pack index is wrong: {problem}; the pack index file was "
                                     "damaged or crafted: restore the checkpoint from a copy")


def _all_rows(table: ChunkTable) -> NDArray[np.uint64]:
    arrays = list(table.rows.values())
    return np.concatenate(arrays) if arrays else np.zeros((0, 3), np.uint64)


def _first_problem(rows: NDArray[np.uint64], packs: Sequence[PackFile], max_length: int | None,
                   describe: Callable[[int], str]) -> str | None:
    """What is wrong with the first bad row of ``rows`` (named by ``describe``), in the order: pack index, length,
    extent, overlap; ``None`` when every row is right. Vectorised: a million rows take well under a second."""
    pack, offset, length = rows[:, 0], rows[:, 1], rows[:, 2]

    def first(mask: NDArray[np.bool_]) -> int | None:
        hits = np.flatnonzero(mask)
        return int(hits[0]) if hits.size else None

    if (i := first(pack >= len(packs))) is not None:
        return f"{describe(i)} names pack {int(pack[i])}, but the checkpoint has {len(packs)} pack files"
    if (i := first(length < MIN_CHUNK_SIZE)) is not None:
        return f"{describe(i)} is {int(length[i])} bytes long, shorter than a chunk file's crc32c (4 bytes)"
    if max_length is not None and (i := first(length > min(max_length, MAX_SIZE))) is not None:
        return (f"{describe(i)} is {int(length[i])} bytes long, more than any chunk file of this array holds "
                f"({max_length} bytes)")
    sizes = np.array([p.size for p in packs], np.uint64)[pack] if packs else np.zeros(0, np.uint64)
    if (i := first((length > sizes) | (offset > sizes - np.minimum(length, sizes)))) is not None:
        name = packs[int(pack[i])]
        return (f"{describe(i)} lies at bytes [{int(offset[i])}, {int(offset[i]) + int(length[i])}) of {name.name}, "
                f"which has {name.size} bytes")
    order = np.lexsort((offset, pack))  # by pack, then offset: an overlap shows between neighbours
    p, o, n = pack[order], offset[order], length[order]
    if (i := first((p[1:] == p[:-1]) & (o[1:] < o[:-1] + n[:-1]))) is not None:
        a, b = int(order[i]), int(order[i + 1])
        return (f"{describe(b)} at bytes [{int(offset[b])}, {int(offset[b]) + int(length[b])}) of "
                f"{packs[int(pack[b])].name} overlaps {describe(a)} at [{int(offset[a])}, "
                f"{int(offset[a]) + int(length[a])})")
    return None


@dataclass(frozen=True)
class PackLayout:
    """The manifest member ``packs``, parsed: the pack files, the index file (name, size, crc32c of all of it) and
    each array's section in it."""

    packs: tuple[PackFile, ...]
    index_name: str
    index_size: int
    index_crc: int
    sections: Mapping[str, Section]


def packs_member(packs: Sequence[PackFile], index_name: str, index_size: int, index_crc: int,
                 sections: Mapping[str, Section | tuple[int, int, int]]) -> JSON:
    """The manifest member ``packs`` as JSON: ``{"files": [[name, size, rank], ...], "index": {"name", "size",
    "crc32c"}, "sections": {array path: [offset, length, crc32c], ...}}`` (lists, not objects, for the files and
    sections: a checkpoint of 16,384 ranks lists as many files, in the root document every reader reads).

    >>> packs_member([PackFile("packs/r000000.pack", 40, 0)], INDEX_NAME, 52, 7, {"w": Section(0, 52, 9)})
    {'files': [['packs/r000000.pack', 40, 0]], 'index': {'name': 'packs/index.bin', 'size': 52, 'crc32c': 7}, \
'sections': {'w': [0, 52, 9]}}
    """
    return {"files": [[p.name, p.size, p.rank] for p in packs],
            "index": {"name": index_name, "size": index_size, "crc32c": index_crc},
            "sections": {path: [int(v) for v in section] for path, section in sections.items()}}


def _count(value: object, top: int = MAX_SIZE) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= top


def _file_name(value: object) -> bool:
    """``packs/`` and one plain file name: relative, no ``..``, no leading ``/``, nothing hidden, at most 255 bytes."""
    if not (isinstance(value, str) and value.startswith(PACK_PREFIX)):
        return False
    name = value[len(PACK_PREFIX):]
    return bool(_PLAIN_NAME.fullmatch(name)) and len(name.encode()) <= MAX_NAME_BYTES


def parse_packs_member(obj: object, where: str, arrays: Collection[str] | None = None) -> PackLayout:
    """The manifest member ``packs`` (:func:`packs_member`), checked strictly: its members and their types; file
    names ``packs/<name>``, unique, the index's none of the packs'; sizes, ranks and offsets non-negative integers
    below 2**63, crc32c values below 2**32; section paths node paths (spec §3.2), each section a whole number of
    rows and its crc32c, the sections tiling the index file in order. ``arrays``: the array paths the manifest
    stores chunks of, which must be exactly the sections'. Raises :class:`FormatError` naming ``where`` and the
    bad value."""
    def bad(what: str) -> FormatError:
        return FormatError(f"{where}: manifest member '{PACKS_MEMBER}' {what}; it was damaged or crafted")

    if not (isinstance(obj, dict) and set(obj) == {"files", "index", "sections"}):
        raise bad(f"must be an object of 'files', 'index' and 'sections', got {shown(obj)}")
    files, index, sections = obj["files"], obj["index"], obj["sections"]
    if not isinstance(files, list):
        raise bad(f"'files' must be a list of [name, size, rank], got {shown(files)}")
    packs = []
    for item in files:
        if not (isinstance(item, list) and len(item) == 3 and _file_name(item[0]) and _count(item[1])
                and _count(item[2], MAX_RANK)):
            raise bad(f"lists the pack file {shown(item)}, not [name, size, rank] with a name 'packs/<file name>' "
                      f"(relative, no '..'), a size below 2**63 and a rank from 0 to {MAX_RANK}")
        packs.append(PackFile(item[0], item[1], item[2]))
    names = [p.name for p in packs]
    if len(set(names)) != len(names):
        raise bad(f"lists the pack file {shown(next(n for n in names if names.count(n) > 1))} twice")
    if not (isinstance(index, dict) and set(index) == {"name", "size", "crc32c"} and _file_name(index["name"])
            and index["name"] not in names and _count(index["size"]) and _count(index["crc32c"], 2**32 - 1)):
        raise bad(f"'index' must be {{name, size, crc32c}}: a name 'packs/<file name>' that is no pack file's, a size "
                  f"below 2**63 and a crc32c below 2**32, got {shown(index)}")
    if not isinstance(sections, dict):
        raise bad(f"'sections' must map array paths to [offset, length, crc32c], got {shown(sections)}")
    parsed = {}
    for path, section in sections.items():
        if not is_node_path(path):
            raise bad(f"names the section of {shown(path)}, which is not an array path (spec §3.2)")
        if not (isinstance(section, list) and len(section) == 3 and all(_count(v) for v in section)
                and section[2] < 2**32 and section[1] >= 4 and (section[1] - 4) % ROW_SIZE == 0):
            raise bad(f"gives array {path!r} the section {shown(section)}, not [offset, length, crc32c] of "
                      f"{ROW_SIZE} bytes a stored chunk and a 4-byte crc32c")
        parsed[path] = Section(*section)
    end = 0
    for path, section in sorted(parsed.items(), key=lambda item: item[1].offset):
        if section.offset != end:
            raise bad(f"gives array {path!r} the section at byte {section.offset} of the index file, where the "
                      f"sections before it end at byte {end} (the sections lie back to back)")
        end += section.length
    if end != index["size"]:
        raise bad(f"has sections that end at byte {end} of the index file, which has {index['size']} bytes")
    layout = PackLayout(tuple(packs), index["name"], index["size"], index["crc32c"], parsed)
    if arrays is not None:
        check_section_arrays(layout, arrays, where)
    return layout


def check_section_arrays(layout: PackLayout, arrays: Collection[str], where: str) -> None:
    """Refuse (:class:`FormatError` naming ``where`` and the array) a parsed member whose sections are not exactly
    those of ``arrays``, the array paths the manifest stores chunks of: :func:`parse_packs_member`'s last check, for
    a reader that parsed the member before it knew the arrays (the manifest is parsed before its node metadata)."""
    if set(arrays) != set(layout.sections):
        odd = sorted(set(arrays) ^ set(layout.sections))[0]
        stores = odd in arrays
        raise FormatError(f"{where}: manifest member '{PACKS_MEMBER}' {'has no' if stores else 'has a'} section for "
                          f"array {odd!r}, which the manifest {'stores chunks of' if stores else 'does not store'}; it "
                          "was damaged or crafted")


def reference_document(nodes: Mapping[str, bytes], chunk_keys: Mapping[str, Sequence[str]], table: ChunkTable,
                       packs: Sequence[PackFile]) -> JSON:
    """The kerchunk v1 references of a packed checkpoint, for zarr-python through fsspec's ``ReferenceFileSystem``:
    ``{"version": 1, "refs": {...}}`` with every node's document (``nodes``: node path → its ``zarr.json`` bytes,
    every node but the root) inline as UTF-8 text at ``"<path>/zarr.json"``, a root ``"zarr.json"`` that is a plain
    group whose ``consolidated_metadata`` holds them all (:func:`reference_root`), and every stored chunk
    ``"<path>/<chunk key>"`` as ``[pack name, offset, length]``; ``chunk_keys``: per array path, its stored chunks'
    keys in table order (:func:`stored_chunk_keys`). Pack names stay relative to the checkpoint: a reader resolves
    them with a ``dir`` filesystem rooted there, so the references survive moving the checkpoint.

    >>> reference_document({"w": b"{}"}, {"w": ["c.0"]}, ChunkTable({"w": np.array([[0, 8, 12]], np.uint64)}),
    ...                    [PackFile("packs/r000000.pack", 20, 0)])["refs"]  # doctest: +NORMALIZE_WHITESPACE
    {'zarr.json': '{"zarr_format": 3, "node_type": "group", "attributes": {}, "consolidated_metadata": {"kind":
    "inline", "must_understand": false, "metadata": {"w": {}}}}', 'w/zarr.json': '{}', 'w/c.0':
    ['packs/r000000.pack', 8, 12]}
    """
    refs: JSON = {ROOT_METADATA: reference_root(nodes)}
    for path, data in nodes.items():
        if not is_node_path(path):
            raise ValueError(f"reference_document: {path!r} is not a node path (spec §3.2)")
        refs[f"{path}/{ROOT_METADATA}"] = data.decode("utf-8")  # JSON never begins with "base64:", kerchunk's escape
    if set(chunk_keys) != set(table.rows):
        raise ValueError(f"reference_document: the chunk keys name arrays {sorted(chunk_keys)}, the chunk table "
                         f"{sorted(table.rows)}: give the keys of every array in the table")
    names = [p.name for p in packs]
    for path, keys in chunk_keys.items():
        rows = table.rows[path]
        if len(keys) != len(rows):
            raise ValueError(f"reference_document: array {path!r} has {len(keys)} chunk keys and {len(rows)} rows "
                             "in the chunk table: one key per stored chunk, in table order")
        for key, (pack, offset, length) in zip(keys, rows.tolist(), strict=True):
            refs[f"{path}/{key}"] = [names[pack], offset, length]
    return {"version": 1, "refs": refs}


def reference_root(nodes: Mapping[str, bytes]) -> str:
    """The root ``zarr.json`` of the references: a plain group (no manifest: a reader of the references reads
    arrays) whose ``consolidated_metadata`` holds every node's document, as a files-layout root's does (spec §8).
    zarr-python then finds every member from this one document: listing the hierarchy instead fails through
    fsspec's ``ReferenceFileSystem`` below the top level (zarr-python 3.1's ``FsspecStore.list_dir`` asks for
    ``/model``, a key the references, relative like every kerchunk key, do not have), so without it
    ``group.members(max_depth=None)`` stops at the root's children."""
    consolidated = ", ".join(f"{json.dumps(path)}: {data.decode('utf-8')}" for path, data in nodes.items())
    return ('{"zarr_format": 3, "node_type": "group", "attributes": {}, "consolidated_metadata": {"kind": "inline", '
            '"must_understand": false, "metadata": {' + consolidated + "}}}")


def references_file(nodes: Mapping[str, JSON], documents: Mapping[str, bytes], present: Mapping[str, tuple[int, ...]],
                    table: ChunkTable, packs: Sequence[PackFile]) -> bytes:
    """The bytes of ``refs.json`` (:data:`REFS_NAME`): :func:`reference_document` of every array of ``table``, its
    stored chunks' keys from its metadata in ``nodes`` (checked, or written by arrayckpt) and ``present`` (the
    stored chunks of the arrays of chunks deltas, by path), in compact JSON. ``documents``: every node's
    ``zarr.json`` bytes but the root's, by node path. The one way a save, ``copy`` and ``arrayckpt refs`` make them,
    so that all three write the same bytes for one checkpoint (the chunks by array path, in sorted order: a save's
    table lists its arrays in the order it planned them, a checkpoint opened in the order of its node metadata)."""
    keys = {path: stored_chunk_keys(nodes[path], present.get(path)) for path in sorted(table.rows)}
    return json.dumps(reference_document(documents, keys, table, packs), separators=(",", ":")).encode()
