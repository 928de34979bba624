"""Integrity beyond Zarr's per-chunk crc32c: a checksum of the root document, and a digest that ties every chunk's
content to its place in its array (spec §11).

A chunk's crc32c proves its bytes are the ones written, not that they are the chunk *this key* was given: two
chunk files swapped, or one copied in from another checkpoint, pass it. And nothing covered the root document,
so a flipped digit in the step, a metric or a plain value read silently. Both are closed here:

* ``integrity``: the manifest member ``"sha256:<hex>"``, the SHA-256 of the whole root ``zarr.json`` as stored,
  with those 64 hex digits read as ``0``. The writer serialises the document with 64 zeros, hashes it and writes
  the digits in; a reader zeroes them again and re-hashes: byte exact, no canonical JSON needed.
* ``chunk_digests``: per array node, the SHA-256 of the crc32c of every stored (outer) chunk's content, in C order
  of the chunk grid (a chunks delta: in the order of ``present``), each as 4 little-endian bytes. A chunk's
  content is its in-bounds elements in C order, as little-endian bytes (exactly what the ``bytes`` codec
  stores). Writers know it for free while they hold the data; ``verify`` recomputes it from what it reads.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
from collections.abc import Iterable, Mapping
from typing import TypeGuard

import crc32c
import numpy as np

from .._errors import CorruptCheckpointError, FormatError

__all__ = ["INTEGRITY_MEMBER", "PLACEHOLDER", "ChunkDigest", "check_root_integrity", "chunk_crc", "chunk_digest",
           "crc_combine", "parse_chunk_digests", "seal", "valid_digest"]

INTEGRITY_MEMBER = "integrity"
_ZEROS = "0" * 64
PLACEHOLDER = f"sha256:{_ZEROS}"
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_CRC = struct.Struct("<I")


def valid_digest(value: object) -> TypeGuard[str]:
    """Whether ``value`` is a digest as this format writes them: ``sha256:`` and 64 lowercase hex digits."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


def seal(document: bytes) -> bytes:
    """The root document with its ``integrity`` placeholder (present exactly once) replaced by the document's
    checksum."""
    marker = PLACEHOLDER.encode()
    assert document.count(marker) == 1, "the root document must hold the integrity placeholder exactly once"
    return document.replace(marker, f"sha256:{hashlib.sha256(document).hexdigest()}".encode())


def check_root_integrity(data: bytes, manifest: Mapping[str, object], required: bool, where: object) -> bool:
    """Check a root document's checksum; ``True`` when it has one (and it matches), ``False`` when it has none and
    none is ``required`` (an older version's checkpoint: unprotected). Raises ``CorruptCheckpointError`` on a
    mismatch, and on a missing checksum where the format version requires one (its member renamed or removed
    by damage)."""
    value = manifest.get(INTEGRITY_MEMBER)
    if value is None:
        if required:
            raise CorruptCheckpointError(f"{where}: root zarr.json is damaged: its manifest has no "
                                         f"'{INTEGRITY_MEMBER}' checksum, which its format version requires")
        return False
    if not valid_digest(value):
        raise CorruptCheckpointError(f"{where}: root zarr.json is damaged: its '{INTEGRITY_MEMBER}' member {value!r} "
                                     "is not 'sha256:' and 64 hex digits")
    digits = value.removeprefix("sha256:").encode()
    if data.count(digits) != 1:  # damage made the digits appear again elsewhere: cannot tell which is the member
        raise CorruptCheckpointError(f"{where}: root zarr.json is damaged: its checksum digits appear "
                                     f"{data.count(digits)} times in it")
    actual = hashlib.sha256(data.replace(digits, _ZEROS.encode())).hexdigest()
    if actual.encode() != digits:
        raise CorruptCheckpointError(f"{where}: root zarr.json is damaged: its SHA-256 is {actual}, the manifest "
                                     f"records {digits.decode()} (a changed byte in the manifest or the array "
                                     "metadata); restore the checkpoint from a copy")
    return True


def chunk_crc(data: np.ndarray) -> int:
    """The crc32c of one chunk's content: its elements in C order as stored (little-endian). A C-contiguous view
    costs no copy; any other is copied once."""
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return crc32c.crc32c(flat.data)


class ChunkDigest:
    """The digest of an array's chunks, built one chunk at a time (``verify`` reads them in batches)."""

    def __init__(self) -> None:
        self._hasher = hashlib.sha256()

    def add(self, crc: int) -> None:
        self._hasher.update(_CRC.pack(crc))

    @property
    def value(self) -> str:
        return f"sha256:{self._hasher.hexdigest()}"


_POLY = 0x82F63B78  # crc32c (Castagnoli), bit-reflected


def _multiply(a: int, b: int) -> int:
    """``a(x) * b(x)`` modulo the crc32c polynomial (bit-reflected, as zlib's ``multmodp``)."""
    m, product = 1 << 31, 0
    while m:
        if a & m:
            product ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        m >>= 1
    return product


_X2N = [1 << 30]  # x^(2^n) modulo the polynomial, n = 0..31 (x^1 first)
for _ in range(31):
    _X2N.append(_multiply(_X2N[-1], _X2N[-1]))


@functools.lru_cache(maxsize=256)
def _shift(length: int) -> int:
    """``x^(8 * length)`` modulo the polynomial: appending ``length`` bytes multiplies a crc by it."""
    product, k = 1 << 31, 3
    while length:
        if length & 1:
            product = _multiply(_X2N[k & 31], product)
        length >>= 1
        k += 1
    return product


def crc_combine(first: int, second: int, second_length: int) -> int:
    """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)`` (zlib's ``crc32_combine``): a chunk's
    content checksum from its inner chunks' checksums, without reading its bytes again."""
    return _multiply(_shift(second_length), first) ^ second


def chunk_digest(crcs: Iterable[int]) -> str:
    """The digest of an array's chunks: SHA-256 of their crc32c values in order, 4 little-endian bytes each."""
    digest = ChunkDigest()
    for crc in crcs:
        digest.add(crc)
    return digest.value


def parse_chunk_digests(value: object) -> dict[str, str]:
    """The manifest's ``chunk_digests`` member: a JSON object of digests by array node path."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and valid_digest(v) for k, v in value.items()):
        raise FormatError("manifest 'chunk_digests' must map array paths to 'sha256:<64 hex digits>' digests")
    return dict(value)
