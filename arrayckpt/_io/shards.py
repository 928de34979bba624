"""Partial reads of a packed shard (spec §16.3): a read that needs a few inner chunks of a ``sharding_indexed`` chunk
file fetches its shard index, then only those inner chunks, and stages a compact shard holding just them.

A reshard (4 ranks → 3) reads pieces of the shards another rank wrote; fetching whole shards would read up to about
twice what it needs, and on object storage every byte is a transfer. The shard staged instead has the same inner
chunks, byte for byte (each with its own crc32c, which TensorStore checks), at new offsets, and an index whose other
entries say "not stored": TensorStore reads only the inner chunks the read asks for, so it never looks at those. The
index read is untrusted (its crc32c and every entry's bounds are checked) and so is everything it points to.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Callable, Sequence

import crc32c
import numpy as np

from .._errors import CorruptCheckpointError
from .._format.dtypes import DTYPES
from .._format.jsontypes import JSON, json_object
from .._format.zarr import array_shape, grid_indices, outer_chunk_shape
from .fastio import plain_pipeline

#: Ranges of chunk files of any arrays: ``[(path, flat, [(offset, length), ...]), ...] -> bytes per range``
#: (``ChunkSource.fetch_parts``; a negative length: the last bytes of the chunk file).
FetchParts = Callable[[Sequence["Part"]], list[list[bytes]]]
#: Ranges of one chunk file: array path, flat C-order grid index, ``(offset, length)`` ranges within the file.
Part = tuple[str, int, Sequence[tuple[int, int]]]
#: A shard read in part: array path, flat grid index, the inner chunks needed, inner chunks per shard, and the
#: encoded size of every inner chunk where the shard's layout is predictable (:func:`fixed_inner_size`), else None.
PartialShard = tuple[str, int, set[int], int, int | None]

__all__ = ["FetchParts", "Part", "PartialShard", "fixed_inner_size", "inner_chunks", "inner_grid", "partial_shards"]

MISSING = 2**64 - 1  # a shard index entry of an inner chunk that is not stored
_CRC = struct.Struct("<I")
_INDEX_CODECS = ([{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],)


def inner_grid(metadata: JSON) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The inner chunk shape and the inner chunks per shard (per dimension) of a sharded array whose shard index is
    at the end, little-endian with a crc32c (what arrayckpt writes); ``None`` for any other array."""
    codecs = metadata.get("codecs")
    if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)
            and codecs[0].get("name") == "sharding_indexed"):
        return None
    config = json_object(codecs[0].get("configuration"))
    inner, outer = config.get("chunk_shape"), outer_chunk_shape(metadata)
    if (config.get("index_location", "end") != "end" or config.get("index_codecs") not in _INDEX_CODECS
            or not isinstance(inner, list) or len(inner) != len(outer)
            or any(not isinstance(i, int) or i < 1 or o % i for i, o in zip(inner, outer, strict=True))):
        return None
    return tuple(inner), tuple(o // i for i, o in zip(inner, outer, strict=True))


def inner_chunks(part: Sequence[tuple[int, int]], inner: Sequence[int], counts: Sequence[int]) -> list[int]:
    """The inner chunks (flat, C order within the shard of ``counts`` inner chunks per dimension) that the part
    ``[start, stop)`` per dimension of a shard (relative to it) touches."""
    ranges = [range(start // size, -(-stop // size)) for (start, stop), size in zip(part, inner, strict=True)]
    out = []
    for index in grid_indices(ranges):
        flat = 0
        for i, n in zip(index, counts, strict=True):
            flat = flat * n + i
        out.append(flat)
    return out


def fixed_inner_size(metadata: JSON, grid_index: Sequence[int], length: int) -> int | None:
    """The encoded size of each inner chunk of the shard at ``grid_index`` (a chunk file of ``length`` bytes), when
    where each lies is known before its index is read: inner chunks stored plain (``bytes`` then ``crc32c``: the
    default, uncompressed), so each has the same size, all of them stored (none lies wholly outside the array) and
    the file exactly that long, so that inner chunk ``j`` is bytes ``[j * size, (j + 1) * size)`` as arrayckpt writes
    them, and a guess never reaches past the file. ``None`` otherwise."""
    grid, codecs, data_type = inner_grid(metadata), metadata.get("codecs"), metadata.get("data_type")
    dtype = DTYPES.get(data_type) if isinstance(data_type, str) else None
    if grid is None or dtype is None or not isinstance(codecs, list):  # (a sharded array has one codec)
        return None
    if not plain_pipeline(json_object(json_object(codecs[0]).get("configuration")).get("codecs"), dtype.itemsize):
        return None
    inner, counts = grid
    outer, shape = outer_chunk_shape(metadata), array_shape(metadata)
    for g, o, i, c, n in zip(grid_index, outer, inner, counts, shape, strict=True):
        if -(-(min(n, (g + 1) * o) - g * o) // i) != c:  # inner chunks past the array's edge are not stored
            return None
    size = dtype.itemsize * math.prod(inner) + 4
    count = math.prod(counts)
    return size if length == count * size + count * 16 + 4 else None


def partial_shards(fetch_parts: FetchParts, shards: Sequence[PartialShard]) -> list[bytes]:
    """For each shard ``(path, flat, needed, count, fixed)``, a compact shard holding only its inner chunks
    ``needed`` (``count``: inner chunks per shard), all shards of a read together, whatever array they are of. The
    shard indexes are read in one round, with the inner chunks of the shards whose layout is predictable (``fixed``:
    their offsets are known before the index is read); the index then confirms each prediction (a crc32c-checked
    entry equal to the range read), and only the inner chunks not predicted, or predicted wrong, are read in a second
    round: a reshard of hundreds of arrays is one or two merged reads per pack, not two per array."""
    first: list[Part] = []
    for path, flat, need, count, fixed in shards:
        guesses = [] if fixed is None else [(j * fixed, fixed) for j in sorted(need)]
        first.append((path, flat, [(0, -(count * 16 + 4)), *guesses]))
    fetched = fetch_parts(first)
    pieces_of: list[dict[int, bytes]] = []
    second: list[Part] = []
    missed_of: list[tuple[int, list[int]]] = []  # per part of the second round: its shard, its inner chunks
    for position, ((path, flat, need, count, fixed), (raw, *guessed)) in enumerate(zip(shards, fetched, strict=True)):
        entries = _checked_index(raw, count, path, flat)
        pieces: dict[int, bytes] = {}
        missed: list[int] = []
        for j, guess in itertools.zip_longest(sorted(need), guessed):
            offset, size = (int(v) for v in entries[j])
            if offset == MISSING:
                continue  # not stored: TensorStore names it when the read asks for it
            if fixed is not None and (offset, size) == (j * fixed, fixed):
                pieces[j] = guess
            else:
                missed.append(j)
        pieces_of.append(pieces)
        if missed:
            second.append((path, flat, [(int(entries[j][0]), int(entries[j][1])) for j in missed]))
            missed_of.append((position, missed))
    for (position, missed), data in zip(missed_of, fetch_parts(second) if second else [], strict=True):
        pieces_of[position].update(zip(missed, data, strict=True))
    return [_compact(pieces, count) for pieces, (_, _, _, count, _) in zip(pieces_of, shards, strict=True)]


def _checked_index(raw: bytes, count: int, path: str, flat: int) -> np.ndarray:
    """The ``(offset, size)`` entries of a shard index read from storage, its crc32c checked."""
    index_bytes = count * 16
    if len(raw) != index_bytes + 4 or crc32c.crc32c(raw[:index_bytes]) != _CRC.unpack(raw[index_bytes:])[0]:
        raise CorruptCheckpointError(f"array {path!r}: the shard index of chunk {flat} fails its checksum; the "
                                     "checkpoint is damaged: restore it from a copy")
    return np.frombuffer(raw[:index_bytes], "<u8").reshape(count, 2)


def _compact(pieces: dict[int, bytes], count: int) -> bytes:
    """A shard of ``count`` inner chunks holding only ``pieces`` (by inner chunk), its other entries "not stored"."""
    index = np.full((count, 2), MISSING, "<u8")
    offset, body = 0, []
    for j in sorted(pieces):
        index[j] = (offset, len(pieces[j]))
        offset += len(pieces[j])
        body.append(pieces[j])
    raw_index = index.tobytes()
    return b"".join(body) + raw_index + _CRC.pack(crc32c.crc32c(raw_index))
