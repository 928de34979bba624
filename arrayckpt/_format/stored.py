"""A stored chunk file's bytes checked as they are, without decoding: what a copy verifies on the way (spec §7.4,
§11).

For the pipelines arrayckpt writes uncompressed (``bytes`` then ``crc32c``, unsharded or wrapped in
``sharding_indexed`` with its index at the end) a chunk file is simple enough to check byte by byte: its size,
every crc32c (of the chunk, of each inner chunk, of the shard index), the index's entries, and the chunk's
*content checksum* of spec §11.2 (the crc32c of its in-bounds elements in C order), which for a chunk inside the
array, or one whose inner chunks split only the first dimension, is a combination of the stored checksums and
costs no extra pass over the data. :func:`stored_content_crc` returns ``None`` for anything else (a compressed
pipeline, another index layout): those chunks must be decoded (``_io/decode.py``).
"""

from __future__ import annotations

import math
import struct

import crc32c
import numpy as np

from .._errors import CorruptCheckpointError
from .dtypes import dtype_by_name
from .integrity import crc_combine
from .jsontypes import JSON, int_list, json_object, member

__all__ = ["MISSING", "max_chunk_file_bytes", "stored_content_crc"]

MISSING = 2**64 - 1  # shard index entry of an inner chunk that is not stored
_CRC = struct.Struct("<I")
_CRC32C: JSON = {"name": "crc32c"}
_BYTES_ANY = ({"name": "bytes"}, {"name": "bytes", "configuration": {"endian": "little"}})


def max_chunk_file_bytes(metadata: JSON) -> int:
    """An upper bound on the size of any chunk file of the array described by ``metadata`` (valid array metadata):
    its elements, plus what compression can add (zstd and blosc add well under 1/16 and a few KiB per block), plus
    each inner chunk's crc32c and the shard index. What a peer announces beyond this is not a chunk file of it."""
    itemsize = dtype_by_name(metadata["data_type"]).itemsize
    outer = int_list(member(metadata, "chunk_grid", "configuration", "chunk_shape"), "chunk shape")
    raw: int = math.prod(outer) * itemsize
    codecs = metadata.get("codecs", [])
    pieces = 1
    if isinstance(codecs, list) and len(codecs) == 1 and json_object(codecs[0]).get("name") == "sharding_indexed":
        inner = int_list(member(codecs[0], "configuration", "chunk_shape") or outer, "inner chunk shape")
        pieces = math.prod(-(-o // max(1, i)) for o, i in zip(outer, inner, strict=False))
    return raw + raw // 16 + pieces * (4096 + 16) + 64


def _plain(codecs: object, itemsize: int) -> bool:
    """Exactly ``bytes`` (little-endian, or endian-free for one-byte types) then ``crc32c``."""
    allowed = _BYTES_ANY if itemsize == 1 else _BYTES_ANY[1:]
    return isinstance(codecs, list) and len(codecs) == 2 and codecs[0] in allowed and codecs[1] == _CRC32C


def _checked_body(data: memoryview, expected: int, file: str, what: str = "chunk") -> tuple[memoryview, int]:
    """The encoded bytes of an uncompressed chunk (``expected`` bytes and its crc32c), checked; and that crc."""
    if len(data) != expected + 4:
        raise CorruptCheckpointError(f"{file}: {what} has {len(data)} bytes, {expected + 4} expected (an uncompressed "
                                     "chunk of this array has a fixed size): truncated or damaged")
    body = data[:expected]
    stored = _CRC.unpack(data[expected:])[0]
    actual = crc32c.crc32c(body)
    if actual != stored:
        raise CorruptCheckpointError(f"{file}: {what} checksum mismatch (crc32c {actual:#010x}, stored {stored:#010x})")
    return body, actual


def stored_content_crc(metadata: JSON, grid_index: tuple[int, ...], data: bytes | memoryview,
                       file: str) -> int | None:
    """Check the stored bytes ``data`` of outer chunk ``grid_index`` of the array described by ``metadata`` (valid
    array metadata, checked by the reader) and return the chunk's content checksum (spec §11.2). ``None`` when the
    pipeline is not one of the uncompressed ones this module reads (decode the chunk instead). Raises
    ``CorruptCheckpointError`` naming ``file`` on any mismatch."""
    itemsize = dtype_by_name(metadata["data_type"]).itemsize
    shape = int_list(metadata["shape"], "shape")
    outer = int_list(member(metadata, "chunk_grid", "configuration", "chunk_shape"), "chunk shape")
    origin = [i * c for i, c in zip(grid_index, outer, strict=True)]
    extent = [max(0, min(c, n - o)) for c, n, o in zip(outer, shape, origin, strict=True)]  # in bounds
    codecs = metadata["codecs"]
    view = memoryview(data).cast("B")
    if _plain(codecs, itemsize):
        body, crc = _checked_body(view, math.prod(outer) * itemsize, file)
        return crc if extent == outer else _clipped_crc(body, outer, extent, itemsize)
    if not isinstance(codecs, list) or len(codecs) != 1 or json_object(codecs[0]).get("name") != "sharding_indexed":
        return None
    config = json_object(codecs[0].get("configuration"))
    inner = config.get("chunk_shape")
    if not (_plain(config.get("codecs"), itemsize) and config.get("index_codecs") == [_BYTES_ANY[1], _CRC32C]
            and config.get("index_location", "end") == "end" and isinstance(inner, list)):
        return None
    return _sharded_crc(view, outer, inner, extent, itemsize, file)


def _clipped_crc(body: memoryview, chunk: list[int], extent: list[int], itemsize: int) -> int:
    """The crc32c of the in-bounds part ``extent`` of a chunk of shape ``chunk`` whose C-order bytes are ``body``."""
    if math.prod(extent) == 0:
        return 0
    if extent[1:] == chunk[1:]:  # clipped along the first dimension only: a prefix of the bytes
        return crc32c.crc32c(body[:math.prod(extent) * itemsize])
    array = np.frombuffer(body, np.uint8).reshape(*chunk, itemsize)
    return crc32c.crc32c(np.ascontiguousarray(array[tuple(slice(0, e) for e in extent)]).data)


def _sharded_crc(data: memoryview, outer: list[int], inner: list[int], extent: list[int], itemsize: int,
                 file: str) -> int:
    """Check a shard (inner chunks, then the index of (offset, nbytes) pairs and its crc32c) and return the content
    checksum of its in-bounds elements."""
    counts = [o // i for o, i in zip(outer, inner, strict=True)]
    n = math.prod(counts)
    size = 16 * n
    if len(data) < size + 4:
        raise CorruptCheckpointError(f"{file}: {len(data)} bytes, too short for its shard index ({size + 4} bytes)")
    end = len(data) - size - 4
    raw = data[end:end + size]
    if crc32c.crc32c(raw) != _CRC.unpack(data[end + size:])[0]:
        raise CorruptCheckpointError(f"{file}: shard index checksum mismatch")
    index = np.frombuffer(raw, "<u8").reshape(n, 2)
    inner_bytes = math.prod(inner) * itemsize
    rows_only = inner[1:] == outer[1:]
    whole = None if rows_only else np.zeros((*outer, itemsize), np.uint8)
    total = 0
    for flat in range(n):
        position = np.unravel_index(flat, counts) if len(counts) else ()
        start = [int(p) * i for p, i in zip(position, inner, strict=True)]
        part = [max(0, min(i, e - s)) for i, e, s in zip(inner, extent, start, strict=True)]
        offset, nbytes = (int(v) for v in index[flat])
        if offset == MISSING and nbytes == MISSING:
            if math.prod(part):
                raise CorruptCheckpointError(f"{file}: inner chunk {flat} is missing")
            continue
        if offset > end or nbytes > end - offset:
            raise CorruptCheckpointError(f"{file}: shard index entry {flat} ({offset}, {nbytes}) points past the "
                                         f"inner chunks ({end} bytes)")
        body, crc = _checked_body(data[offset:offset + nbytes], inner_bytes, file, f"inner chunk {flat}")
        if whole is None:  # the shard's content is the inner chunks' in-bounds rows, back to back
            if math.prod(part):
                piece = crc if part == inner else _clipped_crc(body, inner, part, itemsize)
                total = crc_combine(total, piece, math.prod(part) * itemsize)
        elif math.prod(part):
            target = tuple(slice(s, s + i) for s, i in zip(start, inner, strict=True))
            whole[target] = np.frombuffer(body, np.uint8).reshape(*inner, itemsize)
    if whole is None:
        return total
    return crc32c.crc32c(np.ascontiguousarray(whole[tuple(slice(0, e) for e in extent)]).data)
