"""Local fast path: uncompressed chunk files read and written with positional IO and hardware crc32c.

TensorStore's wheels compute crc32c in software (measured here: about 1 s per GiB each way, as much as
the IO itself), which halves the throughput of uncompressed local saves and loads. For the layout
arrayckpt uses most — a local file, no compression, chunks that split only the first dimension — a
chunk file is simple enough to write and read directly: the rows' bytes (little-endian, C order), zero
padding of an edge chunk to the full chunk shape, and a 4-byte crc32c; with ``sharding_indexed``, inner
chunks of that form followed by an index of (offset, nbytes) uint64 pairs and its crc32c. This module
writes exactly those Zarr v3 bytes straight from the tensors' memory and reads them straight into it
(one copy, ``pwritev``/``preadv``), checksummed with the ``crc32c`` package (hardware, ~10 GB/s).
Anything else — compression, other grids, object storage, non-contiguous memory — goes through
TensorStore. Tests check both directions against TensorStore and zarr-python.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import crc32c
import numpy as np

from .._errors import CorruptCheckpointError, StorageError
from .._format.dtypes import DTYPES
from .._format.integrity import crc_combine
from .._format.jsontypes import JSON, member
from .._settings import settings
from .pools import map_kept
from .priority import worker_initializer
from .smallfiles import open_nonblocking, user_paths

__all__ = ["STATS", "ChunkSink", "Locate", "RowLayout", "read_rows", "row_layout", "write_rows"]

MISSING = 2**64 - 1  # index entry of an inner chunk that is not stored
# Bytes this process moved through the fast path (benchmarks and tests read them).
STATS = {"bytes_read": 0, "bytes_written": 0}
_STATS_LOCK = threading.Lock()


def _count(name: str, nbytes: int) -> None:
    with _STATS_LOCK:
        STATS[name] += nbytes


_CRC = struct.Struct("<I")
_BYTES_CODECS = ({"name": "bytes"}, {"name": "bytes", "configuration": {"endian": "little"}})
_CRC32C = {"name": "crc32c"}


@dataclass(frozen=True)
class RowLayout:
    """An array whose chunks are runs of whole rows (first-dimension indices), stored uncompressed."""

    rows: int  # extent of the first dimension (1 for a 0-d array)
    row_bytes: int  # bytes of one row
    outer_rows: int
    inner_rows: int  # == outer_rows when unsharded
    ndim: int
    separator: str

    @property
    def sharded(self) -> bool:
        return self.inner_rows != self.outer_rows

    @property
    def inner_per_outer(self) -> int:
        return self.outer_rows // self.inner_rows

    def chunk_key(self, index: int) -> str:
        """The key of outer chunk ``index`` (``c`` for 0-d arrays)."""
        if self.ndim == 0:
            return "c"
        return self.separator.join(["c", str(index), *("0" * (self.ndim - 1))])


_LAYOUTS: dict[int, tuple[JSON, RowLayout | None]] = {}  # by id(metadata), see row_layout


def row_layout(metadata: JSON) -> RowLayout | None:
    """The row layout of an array's metadata, or ``None`` when the fast path does not apply.

    Save plans and opened checkpoints reuse their metadata dicts, so the answer is cached per dict.
    """
    cached = _LAYOUTS.get(id(metadata))
    if cached is not None and cached[0] is metadata:
        return cached[1]
    if len(_LAYOUTS) > 1 << 16:
        _LAYOUTS.clear()
    layout = _row_layout(metadata)
    _LAYOUTS[id(metadata)] = (metadata, layout)
    return layout


def _row_layout(metadata: JSON) -> RowLayout | None:
    shape = metadata.get("shape")
    chunk = member(metadata, "chunk_grid", "configuration", "chunk_shape")
    separator = member(metadata, "chunk_key_encoding", "configuration", "separator")
    codecs = metadata.get("codecs")
    if not (isinstance(shape, list) and isinstance(chunk, list) and isinstance(separator, str)
            and isinstance(codecs, list)) or member(metadata, "chunk_grid", "name") != "regular" \
            or member(metadata, "chunk_key_encoding", "name") != "default":
        return None
    if sys.byteorder != "little" or list(chunk[1:]) != list(shape[1:]) or math.prod(shape) == 0:
        return None
    data_type = metadata.get("data_type")
    dtype = DTYPES.get(data_type) if isinstance(data_type, str) else None
    if dtype is None:
        return None
    row_bytes = dtype.itemsize * math.prod(shape[1:])
    rows, outer = (shape[0], chunk[0]) if shape else (1, 1)
    if plain_pipeline(codecs, dtype.itemsize):
        return RowLayout(rows, row_bytes, outer, outer, len(shape), separator)
    if len(codecs) != 1 or codecs[0].get("name") != "sharding_indexed":
        return None
    config = codecs[0].get("configuration", {})
    inner = config.get("chunk_shape")
    index_codecs = config.get("index_codecs")
    if (
        not isinstance(inner, list)
        or not shape
        or inner[1:] != list(shape[1:])
        or outer % inner[0]
        or not plain_pipeline(config.get("codecs"), dtype.itemsize)
        or index_codecs != [_BYTES_CODECS[1], _CRC32C]
        or config.get("index_location", "end") != "end"
    ):
        return None
    return RowLayout(rows, row_bytes, outer, inner[0], len(shape), separator)


def plain_pipeline(codecs: object, itemsize: int) -> bool:
    """Exactly ``bytes`` (little-endian, or endian-free for one-byte types) then ``crc32c``."""
    allowed = _BYTES_CODECS if itemsize == 1 else _BYTES_CODECS[1:]
    return isinstance(codecs, list) and len(codecs) == 2 and codecs[0] in allowed and codecs[1] == _CRC32C


def _row_bytes_view(data: np.ndarray, layout: RowLayout) -> memoryview | None:
    """The data as a flat byte view (rows back to back), or ``None`` when it is not C-contiguous."""
    if not data.flags.c_contiguous:
        return None
    return data.reshape(-1).view(np.uint8).data


def _pieces(layout: RowLayout, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
    """(outer chunk index, first row, end row) of every outer chunk overlapping rows [start, stop)."""
    for index in range(start // layout.outer_rows, math.ceil(stop / layout.outer_rows)):
        yield index, index * layout.outer_rows, min((index + 1) * layout.outer_rows, layout.rows)


# --------------------------------------------------------------------------------------------- writing


class ChunkSink(Protocol):
    """Where whole chunk files go instead of files of their own: a rank's pack (``_write/packed.py``). ``put`` is
    called from several threads at once, with the array's node path, the chunk's flat index and its bytes in
    pieces."""

    def put(self, node: str, index: int, buffers: list[memoryview | bytes]) -> None: ...


def write_rows(jobs: list[tuple[str, str, RowLayout, int, np.ndarray, dict[int, int]]], where: str,
               sink: ChunkSink | None = None) -> list[int]:
    """Write rows of arrays: jobs of (key, array directory, layout, first row, data rows, checksums). Each job's
    ``checksums`` dict receives the crc32c of every outer chunk's content (its rows) by chunk index, computed
    on the way (spec §11.2: an outer chunk of a row layout is a row of the chunk grid, so its index is its flat
    index). With a ``sink``, each chunk file goes to it, and a job's "array directory" is its node path.

    Each job's rows must start on an outer chunk boundary and end on one or at the array's end (save
    plans guarantee it). Returns the indices of jobs it could not take (not C-contiguous), which the
    caller writes through TensorStore.
    """
    declined: list[int] = []
    write = _write_chunk if sink is None else partial(_put_chunk, sink)

    def work() -> Iterator[tuple]:
        for n, (key, directory, layout, first, data, sums) in enumerate(jobs):
            raw = _row_bytes_view(data, layout)
            if raw is None:
                declined.append(n)
                continue
            stop = first + (data.shape[0] if layout.ndim else 1)
            for index, lo, hi in _pieces(layout, first, stop):
                part = raw[(lo - first) * layout.row_bytes:(hi - first) * layout.row_bytes]
                name = directory if sink is not None else os.path.join(directory, layout.chunk_key(index))
                yield key, name, layout, sums, index, part

    _run_all(work(), write, where, "write")
    return declined


def _chunk_file(layout: RowLayout, sums: dict[int, int], index: int, part: memoryview) -> list[memoryview | bytes]:
    """The pieces of one outer chunk file's bytes; its content's crc32c recorded in ``sums``."""
    if layout.sharded:
        buffers, sums[index] = _sharded_buffers(layout, part)
    else:
        buffers, sums[index] = _chunk_buffers(layout, part, layout.outer_rows)
    return buffers


def _put_chunk(sink: ChunkSink, key: str, node: str, layout: RowLayout, sums: dict[int, int], index: int,
               part: memoryview) -> None:
    """One outer chunk file into ``sink`` (on the worker thread: in parallel)."""
    buffers = _chunk_file(layout, sums, index, part)
    sink.put(node, index, buffers)
    _count("bytes_written", sum(len(b) for b in buffers))


def _write_chunk(key: str, path: str, layout: RowLayout, sums: dict[int, int], index: int, part: memoryview) -> None:
    """Write one outer chunk file and record its content's crc32c in ``sums`` (on the worker thread: in parallel)."""
    buffers = _chunk_file(layout, sums, index, part)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:  # the array's directory does not exist yet
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, flags, 0o644)
    try:
        for i in range(0, len(buffers), 512):  # IOV_MAX is 1024 on Linux
            batch = buffers[i:i + 512]
            expected = sum(len(b) for b in batch)
            written = os.writev(fd, batch)
            _count("bytes_written", written)
            if written != expected:  # short writes are rare; finish the batch the slow way
                os.write(fd, b"".join(bytes(b) for b in batch)[written:])
    finally:
        os.close(fd)


def _chunk_buffers(layout: RowLayout, part: memoryview, chunk_rows: int) -> tuple[list[memoryview | bytes], int]:
    """One (inner or unsharded) chunk: its rows, zero padding to ``chunk_rows`` rows, and the crc32c; and the crc32c
    of its rows alone (its content)."""
    padding = chunk_rows * layout.row_bytes - len(part)
    content = checksum = crc32c.crc32c(part)
    buffers: list[memoryview | bytes] = [part]
    if padding:
        zeros = bytes(padding)
        checksum = crc32c.crc32c(zeros, checksum)
        buffers.append(zeros)
    buffers.append(_CRC.pack(checksum))
    return buffers, content


def _sharded_buffers(layout: RowLayout, part: memoryview) -> tuple[list[memoryview | bytes], int]:
    """An outer chunk with its inner chunks back to back and the index (with its crc32c) at the end; and the
    crc32c of its rows (its content), combined from its inner chunks' (no second pass over the bytes)."""
    buffers: list[memoryview | bytes] = []
    content = 0  # the crc32c of nothing
    index = np.full((layout.inner_per_outer, 2), MISSING, dtype="<u8")
    offset = 0
    inner_bytes = layout.inner_rows * layout.row_bytes
    for j in range(layout.inner_per_outer):
        piece = part[j * inner_bytes:(j + 1) * inner_bytes]
        if not len(piece):
            continue  # entirely past the array's end: not stored
        chunk, crc = _chunk_buffers(layout, piece, layout.inner_rows)
        content = crc_combine(content, crc, len(piece))
        size = inner_bytes + 4
        index[j] = (offset, size)
        offset += size
        buffers.extend(chunk)
    raw_index = index.tobytes()
    buffers.append(raw_index)
    buffers.append(_CRC.pack(crc32c.crc32c(raw_index)))
    return buffers, content


# --------------------------------------------------------------------------------------------- reading

#: Where chunk ``index`` of a packed array lies: (pack file path, offset, length, the chunk file's name, e.g.
#: ``model/w/c.1.0``) (``read_rows``'s "directory").
Locate = Callable[[int], tuple[str, int, int, str]]



def read_rows(jobs: list[tuple[str, str | Locate, RowLayout, int, np.ndarray, Any]], where: str) -> list[int]:
    """Read rows of arrays into memory: jobs of (key, array directory, layout, first row, destination rows, unused);
    for a packed array, instead of its directory, where each of its chunk files lies (:data:`Locate`).

    Returns the indices of jobs it could not take (destination not C-contiguous), for TensorStore.
    """
    declined: list[int] = []

    def work() -> Iterator[tuple]:
        for n, (key, directory, layout, first, dest, _) in enumerate(jobs):
            raw = _row_bytes_view(dest, layout)
            if raw is None or not dest.flags.writeable:
                declined.append(n)
                continue
            stop = first + (dest.shape[0] if layout.ndim else 1)
            for index, lo, hi in _pieces(layout, first, stop):
                a, b = max(lo, first), min(hi, stop)
                target = raw[(a - first) * layout.row_bytes:(b - first) * layout.row_bytes]
                if isinstance(directory, str):
                    path, base, size = os.path.join(directory, layout.chunk_key(index)), 0, None
                    shown = path
                else:  # a packed array: where its chunk file lies in a pack
                    path, base, size, chunk = directory(index)
                    shown = f"chunk file {chunk} (bytes [{base:,}, {base + size:,}) of {_pack_name(path)})"
                yield key, path, shown, layout, (a - lo, b - lo), base, size, target

    _run_all(work(), _read_chunk, where, "read")
    return declined


def _read_chunk(key: str, path: str, name: str, layout: RowLayout, rows: tuple[int, int], base: int,
                size: int | None, target: memoryview) -> None:
    """Fill ``target`` with rows [rows) (relative to the outer chunk) of one chunk file, verifying crc32c; or of the
    chunk file at bytes ``[base, base + size)`` of the pack file ``path``. ``name``: how errors name it."""
    try:
        fd = open_nonblocking(path, False, f"chunk file {path}")  # no link; never blocks: a FIFO is refused below
    except FileNotFoundError:
        raise _missing(path) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(f"chunk file {path} is not a regular file (a pipe or device in its place); "
                                         "the checkpoint is damaged: restore the file from a copy")
        stored = info.st_size if size is None else size
        if size is not None and base + size > info.st_size:
            raise CorruptCheckpointError(f"{name}: the pack has only {info.st_size} bytes (cut off); restore the "
                                         "checkpoint from a copy")
        if not layout.sharded:
            expected = layout.outer_rows * layout.row_bytes + 4
            if stored != expected:  # bytes appended after the checksum would pass it: Zarr readers refuse them
                raise CorruptCheckpointError(f"chunk file {name} has {stored} bytes where an uncompressed chunk "
                                             f"of its array has {expected} (bytes appended or cut off); restore the "
                                             "file from a copy")
            _read_piece(fd, base, layout, layout.outer_rows, rows, target, name)
            return
        entries = _read_index(fd, layout, name, base, stored)
        first, last = rows[0] // layout.inner_rows, math.ceil(rows[1] / layout.inner_rows)
        for j in range(first, last):
            offset, inner = (int(v) for v in entries[j])
            if offset == MISSING:
                raise _missing(path, j)
            if inner != layout.inner_rows * layout.row_bytes + 4:
                raise CorruptCheckpointError(f"{name}: inner chunk {j} has size {inner}, expected "
                                             f"{layout.inner_rows * layout.row_bytes + 4}")
            if offset + inner > stored - layout.inner_per_outer * 16 - 4:
                raise CorruptCheckpointError(f"{name}: inner chunk {j} at [{offset}, {offset + inner}) lies outside "
                                             "the shard's chunks (the shard index is damaged or crafted)")
            lo = j * layout.inner_rows
            a, b = max(rows[0], lo), min(rows[1], lo + layout.inner_rows)
            piece = target[(a - rows[0]) * layout.row_bytes:(b - rows[0]) * layout.row_bytes]
            _read_piece(fd, base + offset, layout, layout.inner_rows, (a - lo, b - lo), piece,
                        f"{name} inner chunk {j}")
    finally:
        os.close(fd)


def _pack_name(path: str) -> str:
    """A pack file's name as the checkpoint records it (``packs/<file>``, spec §16.1), from its path."""
    folder, _, file = path.rpartition("/")
    return f"{folder.rpartition('/')[2]}/{file}"


def _read_piece(fd: int, offset: int, layout: RowLayout, chunk_rows: int, rows: tuple[int, int],
                target: memoryview, name: str) -> None:
    """Read one stored chunk at ``offset`` whose rows [rows) go to ``target``; checks its crc32c."""
    size = chunk_rows * layout.row_bytes
    stored = bytearray(4)
    if rows == (0, chunk_rows):  # the whole chunk straight into place
        got = os.preadv(fd, [target, stored], offset)
        checksum = crc32c.crc32c(target)
    elif rows[0] == 0:  # a leading part straight into place, the rest (edge padding) into scratch
        rest = bytearray(size - len(target))
        got = os.preadv(fd, [target, rest, stored], offset)
        checksum = crc32c.crc32c(rest, crc32c.crc32c(target))
    else:
        scratch = bytearray(size)
        got = os.preadv(fd, [scratch, stored], offset)
        checksum = crc32c.crc32c(scratch)
        start = rows[0] * layout.row_bytes
        target[:] = memoryview(scratch)[start:start + len(target)]
    _count("bytes_read", got)
    if got != size + 4:
        raise CorruptCheckpointError(f"{name}: truncated ({got} of {size + 4} bytes)")
    if checksum != _CRC.unpack(stored)[0]:
        raise CorruptCheckpointError(f"{name}: checksum mismatch (crc32c {checksum:#010x}, stored "
                                     f"{_CRC.unpack(stored)[0]:#010x})")


def _read_index(fd: int, layout: RowLayout, path: str, base: int, stored: int) -> np.ndarray:
    """The shard index at the end of the chunk file at bytes ``[base, base + stored)`` of ``fd``, checked."""
    count = layout.inner_per_outer
    size = count * 16
    if stored < size + 4:
        raise CorruptCheckpointError(f"{path}: too short for its shard index ({stored} bytes)")
    raw = os.pread(fd, size + 4, base + stored - size - 4)
    _count("bytes_read", len(raw))
    if crc32c.crc32c(raw[:size]) != _CRC.unpack(raw[size:])[0]:
        raise CorruptCheckpointError(f"{path}: shard index checksum mismatch")
    return np.frombuffer(raw[:size], dtype="<u8").reshape(count, 2)


def _missing(path: str, inner: int | None = None) -> CorruptCheckpointError:
    what = "" if inner is None else f" (inner chunk {inner})"
    return CorruptCheckpointError(f"chunk file {path}{what} is missing")


WINDOW = 1 << 14  # chunk transfers listed at once: their bookkeeping stays small, however many chunks a job has


def _run_all(work: Iterator[tuple], fn: Callable[..., object], where: str, action: str) -> None:
    """:func:`_run` over ``work`` taken ``WINDOW`` items at a time (one item per chunk file: a job of millions of
    tiny chunks must not list them all at once)."""
    while True:
        window = list(itertools.islice(work, WINDOW))
        if not window:
            return
        _run(window, fn, where, action)


def _run(work: list[tuple], fn: Callable[..., object], where: str, action: str) -> None:
    """Run chunk transfers on a few threads (IO and crc32c release the GIL); raise the first failure, stopping
    the others there (a job of millions of missing chunks fails at the first, not after trying them all).

    The work is dealt into a few batches balanced by bytes rather than one task per chunk: with
    thousands of small tensors, per-task executor overhead would cost more than the IO.
    """
    if not work:
        return
    batches: list[list[tuple]] = [[] for _ in range(min(settings().io_threads, len(work)))]
    loads = [0] * len(batches)
    for item in sorted(work, key=lambda w: -len(w[-1])):
        i = loads.index(min(loads))
        batches[i].append(item)
        loads[i] += len(item[-1]) + 4096  # every file costs something, however small
    failed = threading.Event()
    if len(batches) == 1 or sum(loads) <= settings().inline_bytes:  # starting threads would cost more than they save
        failures = [f for batch in batches for f in _run_batch(batch, fn, failed)]
    else:  # on the kept threads; in a background save on niced threads of its own
        done = map_kept("io", settings().io_threads, lambda b: _run_batch(b, fn, failed), batches, on_error=failed.set,
                        initializer=worker_initializer())
        failures = [f for batch in done for f in batch]
    if failures:
        key, error = failures[0]
        if isinstance(error, CorruptCheckpointError):
            raise CorruptCheckpointError(user_paths(f"{where}: tensor {key!r}: {error}")) from error
        if isinstance(error, OSError):
            kind = StorageError if action == "write" else CorruptCheckpointError
            raise kind(user_paths(f"{where}: tensor {key!r}: {action} failed: {error}")) from error
        raise error


def _run_batch(batch: list[tuple], fn: Callable[..., object], failed: threading.Event) \
        -> list[tuple[str, BaseException]]:
    """Run one thread's transfers until one fails (returned) or another thread's did (``failed``)."""
    for item in batch:
        if failed.is_set():
            break
        try:
            fn(*item)
        except Exception as e:  # reported by _run, naming the tensor
            failed.set()
            return [(item[0], e)]
    return []
