"""Partial reads of a packed shard (spec §16.3): a read that needs a few inner chunks of a ``sharding_indexed`` chunk
file fetches its shard index, then only those inner chunks, and stages a compact shard holding just them.

A reshard (4 ranks → 3) reads pieces of the shards another rank wrote; fetching whole shards would read up to about
twice what it needs, and on object storage every byte is a transfer. The shard staged instead has the same inner
chunks, byte for byte (each with its own crc32c, which TensorStore checks), at new offsets, and an index whose other
entries say "not stored": TensorStore reads only the inner chunks the read asks for, so it never looks at those. The
index read is untrusted (its crc32c and every entry's bounds are checked) and so is everything it points to.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import crc32c
import numpy as np

from .._errors import CorruptCheckpointError
from .._format.jsontypes import JSON, json_object
from .._format.zarr import grid_indices, outer_chunk_shape

#: Ranges of chunk files of any arrays: ``[(path, flat, [(offset, length), ...]), ...] -> bytes per range``
#: (``ChunkSource.fetch_parts``; a negative length: the last bytes of the chunk file).
FetchParts = Callable[[Sequence["Part"]], list[list[bytes]]]
#: Ranges of one chunk file: array path, flat C-order grid index, ``(offset, length)`` ranges within the file.
Part = tuple[str, int, Sequence[tuple[int, int]]]
#: A shard read in part: array path, flat grid index, the inner chunks needed, inner chunks per shard.
PartialShard = tuple[str, int, set[int], int]

__all__ = ["FetchParts", "Part", "PartialShard", "inner_chunks", "inner_grid", "partial_shards"]

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


def partial_shards(fetch_parts: FetchParts, shards: Sequence[PartialShard]) -> list[bytes]:
    """For each shard ``(path, flat, needed, count)``, a compact shard holding only its inner chunks ``needed``
    (``count``: inner chunks per shard): two rounds of ranged reads for all shards of a read together, whatever array
    they are of (the indexes, then the inner chunks), so that a reshard of hundreds of arrays is two merged reads per
    pack, not two per array."""
    indexes = fetch_parts([(path, flat, [(0, -(count * 16 + 4))]) for path, flat, _, count in shards])
    wanted: list[Part] = []
    entries_of: list[np.ndarray] = []
    for (path, flat, need, count), (raw,) in zip(shards, indexes, strict=True):
        index_bytes = count * 16
        if len(raw) != index_bytes + 4 or crc32c.crc32c(raw[:index_bytes]) != _CRC.unpack(raw[index_bytes:])[0]:
            raise CorruptCheckpointError(f"array {path!r}: the shard index of chunk {flat} fails its checksum; the "
                                         "checkpoint is damaged: restore it from a copy")
        entries = np.frombuffer(raw[:index_bytes], "<u8").reshape(count, 2)
        entries_of.append(entries)
        ranges = []
        for j in sorted(need):
            offset, size = (int(v) for v in entries[j])
            if offset != MISSING:
                ranges.append((offset, size))
        wanted.append((path, flat, ranges))
    bodies = fetch_parts(wanted)
    out = []
    for pieces, entries, (_, _, need, count) in zip(bodies, entries_of, shards, strict=True):
        index = np.full((count, 2), MISSING, "<u8")
        offset, stored = 0, iter(pieces)
        for j in sorted(need):
            if int(entries[j][0]) == MISSING:
                continue  # not stored: TensorStore names it when the read asks for it
            piece = next(stored)
            index[j] = (offset, len(piece))
            offset += len(piece)
        body = b"".join(pieces)
        raw_index = index.tobytes()
        out.append(body + raw_index + _CRC.pack(crc32c.crc32c(raw_index)))
    return out
