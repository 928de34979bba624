"""``verify``'s checks of what a packed checkpoint (spec §16) adds to the chunk files' bytes: the packs and the index.

The chunks themselves are read and checked by ``verify.py`` exactly as for the files layout (the read path fetches
each chunk file's bytes through the table and TensorStore decodes them: crc32c of the chunk, its inner chunks, its
shard index), and their digests catch a row that points a key at another valid chunk of its array. What only a
packed checkpoint has is checked here, each problem one :class:`Damage`:

* every pack holds exactly the bytes the manifest records (a truncated pack, or bytes appended to one);
* the index file too, and its crc32c is the manifest's (the whole file, read in pieces of the batch budget);
* every array's section passes ``decode_section`` (its length, crc32c, rows within the packs, no overlap inside it):
  an array whose section fails is reported once, and its chunks are not read (they cannot be found);
* ``check_index`` over the whole table: no two chunks of *different* arrays share bytes of a pack, each overlap
  reported by key and chunk file, with the pack and both byte ranges.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import crc32c
import numpy as np
from numpy.typing import NDArray

from .._errors import CorruptCheckpointError
from .._format.jsontypes import JSON, json_object
from .._format.packs import ChunkTable, check_index, row_of
from .._format.zarr import chunk_key, unravel
from .chunkwise import chunk_shape
from .damage import Damage

if TYPE_CHECKING:
    from .._read.packed import PackedChunks
    from .chunkwise import ChunkRef

__all__ = ["PackCheck", "check_packs", "stored_range"]

_HELD = re.compile(r"it holds ([0-9,]+) bytes")
MAX_OVERLAPS = 100  # overlaps reported per array (as damaged chunks are: ``verify.MAX_ARRAY_DAMAGE``)


@dataclass(frozen=True)
class PackCheck:
    """What :func:`check_packs` found: the damage, and how many damaged chunks each array already has (an array
    whose section is unusable counts as fully damaged: ``verify`` reads none of its chunks)."""

    damage: list[Damage] = field(default_factory=list)
    failed: dict[str, int] = field(default_factory=dict)


def check_packs(packed: PackedChunks, arrays: Sequence[tuple[str, str]], nodes: Mapping[str, JSON],
                batch_bytes: int, unreadable: int) -> PackCheck:
    """Check the packs, the index and every section of the arrays ``arrays`` (key, array path) of one packed
    checkpoint (module docstring), whose node metadata is ``nodes``. ``unreadable``: the count
    :attr:`PackCheck.failed` gives an array whose section cannot be used. Reads the index whole, in pieces of at
    most ``batch_bytes``, and two bytes of each pack."""
    out = PackCheck()
    layout, where = packed.layout, packed.where
    index = _index_problem(packed, max(1, batch_bytes))
    if index is not None:
        out.damage.append(Damage(None, layout.index_name, index))
    for pack in layout.packs:
        problem = _size_problem(packed, pack.name, pack.size, "pack")
        if problem is not None:
            out.damage.append(Damage(None, pack.name, problem))
    keys = dict((path, key) for key, path in arrays)
    rows = _sections(packed, keys, out, unreadable)
    try:
        check_index(layout.packs, ChunkTable(rows), where, {path: packed.stored(path) for path in rows})
    except CorruptCheckpointError as e:
        found = _overlaps(packed, rows, keys, nodes)
        for _, path in found:
            out.failed[path] = out.failed.get(path, 0) + 1
        out.damage.extend([damage for damage, _ in found] or [Damage(None, layout.index_name, _short(str(e), where))])
    return out


def stored_range(packed: PackedChunks, chunk: ChunkRef) -> str | None:
    """Where chunk ``chunk`` is stored, for a damage report: ``bytes [a, b) of packs/r000000-000.pack`` (``None``
    when its row cannot be found: its section's damage is reported already)."""
    outer = chunk_shape(json_object(chunk.spec.get("metadata")))
    grid = [s.start // c for s, c in zip(chunk.index, outer, strict=True)]
    counts = packed.stored(chunk.array_path).counts
    flat = 0
    for i, count in zip(grid, counts, strict=True):
        flat = flat * count + i
    try:
        table = packed.rows([chunk.array_path])[chunk.array_path]
    except (CorruptCheckpointError, KeyError):
        return None
    row = row_of(packed.stored(chunk.array_path).order, flat)
    if row is None:
        return None
    pack, offset, length = (int(v) for v in table[row])
    return f"bytes [{offset:,}, {offset + length:,}) of {packed.layout.packs[pack].name}"


def _index_problem(packed: PackedChunks, piece: int) -> str | None:
    """Why the index file is not the one the manifest records (its size, its crc32c), or ``None``."""
    layout = packed.layout
    problem = _size_problem(packed, layout.index_name, layout.index_size, "pack index")
    if problem is not None:
        return problem
    crc = 0
    for offset in range(0, layout.index_size, piece):
        data = packed.read_file(layout.index_name, [(offset, min(piece, layout.index_size - offset))])[0]
        crc = crc32c.crc32c(data, crc)
    if crc != layout.index_crc:
        return (f"the pack index fails its checksum (crc32c {crc:#010x}, the manifest records "
                f"{layout.index_crc:#010x}): the index file was damaged or replaced; restore the checkpoint from a "
                "copy")
    return None


def _size_problem(packed: PackedChunks, name: str, size: int, what: str) -> str | None:
    """Why file ``name`` does not hold exactly ``size`` bytes (missing, truncated, or longer), or ``None``. Two
    one-byte reads through the read path (every storage answers them; no listing): its last byte, and the byte
    after it, which must not be there."""
    try:
        packed.read_file(name, [(max(size - 1, 0), min(size, 1))])
    except CorruptCheckpointError as e:
        held = _HELD.search(str(e))  # what a local pack's error tells (object storage does not)
        if held is None and "missing" in str(e):
            return _short(str(e), packed.where)
        return (f"the {what} {name} is truncated: it holds {held.group(1) if held else 'fewer'} bytes, the manifest "
                f"records {size:,}; restore it from a copy")
    try:
        packed.read_file(name, [(size, 1)])
    except CorruptCheckpointError:
        return None
    return (f"the {what} {name} holds more than the {size:,} bytes the manifest records (bytes were appended after "
            "it was written, or it was replaced): restore it from a copy")


def _sections(packed: PackedChunks, keys: Mapping[str, str], out: PackCheck,
              unreadable: int) -> dict[str, NDArray[np.uint64]]:
    """The checked rows of every array whose section is sound; one damage for each other (its chunks unread)."""
    layout = packed.layout
    paths = [path for path in keys if path in layout.sections]
    for path in keys:
        if path not in layout.sections:
            out.damage.append(Damage(keys[path], layout.index_name, f"array {path!r} has no section in the pack "
                                     "index (the manifest is damaged or crafted): restore the checkpoint from a copy"))
            out.failed[path] = unreadable
    try:
        return packed.rows(paths)  # one ranged read of every section: the usual case
    except CorruptCheckpointError:
        pass
    rows = {}
    for path in paths:  # those decoded before the damaged one are kept by ``packed``: read again from memory
        try:
            rows[path] = packed.rows([path])[path]
        except CorruptCheckpointError as e:
            out.damage.append(Damage(keys[path], layout.index_name, _short(str(e), packed.where)))
            out.failed[path] = unreadable
    return rows


def _overlaps(packed: PackedChunks, rows: Mapping[str, NDArray[np.uint64]], keys: Mapping[str, str],
              nodes: Mapping[str, JSON]) -> list[tuple[Damage, str]]:
    """(damage, array path) of each chunk that shares bytes of a pack with a chunk of another array (up to
    :data:`MAX_OVERLAPS` an array), named by key and chunk file, with the pack and both byte ranges. Per pack, the
    rows sorted by offset: a row overlaps an earlier one when it starts before the furthest end before it."""
    paths = list(rows)
    if not paths:
        return []
    table = np.concatenate([rows[path] for path in paths])
    owner = np.repeat(np.arange(len(paths)), [len(rows[path]) for path in paths])
    starts = np.cumsum([0] + [len(rows[path]) for path in paths])
    found: list[tuple[Damage, str]] = []
    counts: dict[str, int] = {}
    for pack in np.unique(table[:, 0]):
        (mine,) = np.nonzero(table[:, 0] == pack)
        mine = mine[np.argsort(table[mine, 1], kind="stable")]
        offset, end = table[mine, 1], table[mine, 1] + table[mine, 2]
        furthest = np.maximum.accumulate(end)
        holder = np.maximum.accumulate(np.where(end == furthest, np.arange(len(mine)), 0))
        for i in np.flatnonzero(offset[1:] < furthest[:-1]) + 1:
            a, b = int(mine[holder[i - 1]]), int(mine[i])
            if owner[a] == owner[b]:  # inside one section: decode_section refused it already
                continue
            path = paths[owner[b]]
            if counts.get(path, 0) >= MAX_OVERLAPS:
                continue
            counts[path] = counts.get(path, 0) + 1
            other = _chunk_file(packed, nodes, paths[owner[a]], a - int(starts[owner[a]]))
            name = packed.layout.packs[int(pack)].name
            found.append((Damage(keys[path], _chunk_file(packed, nodes, path, b - int(starts[owner[b]])),
                                f"the pack index puts its chunk file at {_span(table[b])} of {name}, which overlaps "
                                f"{other} (of {keys[paths[owner[a]]]!r}) at {_span(table[a])}: the pack index was "
                                "damaged or crafted; restore the checkpoint from a copy"), path))
    return found


def _chunk_file(packed: PackedChunks, nodes: Mapping[str, JSON], path: str, row: int) -> str:
    """The chunk file of row ``row`` of array ``path``: ``model/w/c.1.0``."""
    stored = packed.stored(path)
    return f"{path}/{chunk_key(json_object(nodes[path]), unravel(stored.order[row], stored.counts))}"


def _span(row: NDArray[np.uint64]) -> str:
    return f"bytes [{int(row[1]):,}, {int(row[1]) + int(row[2]):,})"


def _short(message: str, where: str) -> str:
    return message.removeprefix(f"{where}: ").strip()

