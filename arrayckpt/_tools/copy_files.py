"""Copying one checkpoint's stored chunk files from one storage to another, checked on the way: the engine of ``copy``.

Each chunk file is read whole as stored (no decoding unless its codecs require it), checked (its size, every crc32c,
its shard index; compressed chunks are decoded through TensorStore), paced by an optional rate limit and written
under its (possibly re-encoded) key at the destination; optionally read back and compared. A few files are in
flight at once, bounded by count and by bytes; their content checksums come back in order, for the chunk digests
of spec §11.2. A storage error on one file retries that whole file a bounded number of times (on top of the
storage client's own retries); damage in the source is never retried.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .._errors import ArrayckptError, CorruptCheckpointError, FormatError, StorageError
from .._format.codecs import check_checksummed
from .._format.dtypes import dtype_by_name
from .._format.integrity import ChunkDigest, chunk_crc
from .._format.jsontypes import JSON
from .._format.manifest import ArrayEntry, PerRankEntry, PickleEntry, per_rank_path
from .._format.stored import stored_content_crc
from .._format.zarr import (
    array_shape,
    check_array_metadata,
    chunk_key,
    grid_counts,
    grid_indices,
    outer_chunk_shape,
)
from .._io.arrays import LazyContext, resolve_context
from .._io.decode import ChunkDecoder
from .._io.smallfiles import read_checkpoint_file
from .._settings import settings
from .._storage import Location

if TYPE_CHECKING:
    import tensorstore as ts

    from .._read.stored import StoredCheckpoint

__all__ = ["PERMANENT", "RETRY_DELAYS", "ArrayCopy", "Budget", "ChunkChecker", "FileCopier", "Throttle",
           "checked_arrays"]

RETRY_DELAYS = (0.5, 2.0)  # seconds before each retry of a whole chunk file after a storage error
# Errors no retry mends (in TensorStore's status names, or the OS's words): fail at once.
PERMANENT = ("PERMISSION_DENIED", "UNAUTHENTICATED", "INVALID_ARGUMENT", "FAILED_PRECONDITION",
              "RESOURCE_EXHAUSTED", "No space left", "Permission denied")

Progress = Callable[[int, int], None]  # (bytes done, bytes in all), in array bytes (before compression)


class Throttle:
    """Paces transfers to at most ``rate`` bytes per second on average, over every thread that shares it (``None``:
    no limit). Each transfer is given the next free slot of ``n / rate`` seconds and waits for its start."""

    def __init__(self, rate: float | None) -> None:
        if rate is not None and not rate > 0:
            raise ValueError(f"a rate limit must be a positive number of bytes per second, got {rate!r}")
        self.rate = rate
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        if self.rate is None:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.rate
        if start > now:
            time.sleep(start - now)


class Budget:
    """At most ``limit`` bytes held by the workers at once (a single bigger claim waits until it is alone)."""

    def __init__(self, limit: int) -> None:
        self._limit, self._held = limit, 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._held == 0 or self._held + nbytes <= self._limit)
            self._held += nbytes

    def release(self, nbytes: int) -> None:
        with self._cond:
            self._held -= nbytes
            self._cond.notify_all()


@dataclass(frozen=True)
class ArrayCopy:
    """One array to copy: its path, the entry it belongs to, its metadata at the source and at the destination (the
    chunk key encoding may differ), and the C-order positions of the chunks it stores (``None``: all of them)."""

    path: str
    key: str
    source: JSON
    target: JSON
    present: tuple[int, ...] | None

    def chunks(self) -> Iterator[tuple[int, ...]]:
        """The grid index of every stored chunk, in digest order (lazily: a grid is never listed)."""
        counts = grid_counts(self.source)
        if math.prod(array_shape(self.source)) == 0:
            return iter(())
        if self.present is None:
            return grid_indices([range(n) for n in counts])
        return (tuple(int(i) for i in np.unravel_index(flat, counts)) if counts else () for flat in self.present)

    def extent(self, grid_index: tuple[int, ...]) -> tuple[slice, ...]:
        """The in-bounds part of a chunk, in array coordinates."""
        chunk, shape = outer_chunk_shape(self.source), array_shape(self.source)
        return tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(grid_index, chunk, shape, strict=True))

    @property
    def itemsize(self) -> int:
        return dtype_by_name(self.source["data_type"]).itemsize

    def nbytes(self) -> int:
        """Array bytes of the stored chunks (what progress counts)."""
        if self.present is None:
            return math.prod(array_shape(self.source)) * self.itemsize
        return sum(math.prod(s.stop - s.start for s in self.extent(g)) for g in self.chunks()) * self.itemsize


class FileCopier:
    """Copies the chunk files of one checkpoint from ``source_kvstore`` (read with ``source``'s context) to
    ``target``; see the module docstring."""

    def __init__(self, source: Location, source_kvstore: JSON, target: Location, *, throttle: Throttle,
                 read_back: bool, concurrency: int, progress: Progress | None) -> None:
        self._where = str(source)
        self._local = str(source_kvstore["path"]) if source_kvstore.get("driver") == "file" else None
        self._source = None if self._local else _open(source_kvstore, source.read_context(), self._where)
        self._target = _open(target.kvstore(), target.write_context(), str(target))
        self._target_name = str(target)
        self._throttle, self._read_back, self._concurrency = throttle, read_back, max(1, concurrency)
        self._progress = progress
        self._budget = Budget(settings().copy_in_flight_bytes)
        self._checker = ChunkChecker()
        self._lock = threading.Lock()
        self.objects = self.stored_bytes = 0

    def copy_arrays(self, arrays: list[ArrayCopy]) -> dict[str, str]:
        """Copy every stored chunk file of ``arrays``; returns each array's digest of its chunks' content checksums."""
        total = sum(array.nbytes() for array in arrays)
        done = 0
        digests: dict[str, ChunkDigest] = {}
        window: deque[tuple[ChunkDigest, Future[int], int]] = deque()
        with ThreadPoolExecutor(self._concurrency, thread_name_prefix="arrayckpt-copy") as pool:
            try:
                for array in arrays:
                    digest = digests[array.path] = ChunkDigest()
                    for grid_index in array.chunks():
                        size = math.prod(s.stop - s.start for s in array.extent(grid_index)) * array.itemsize
                        window.append((digest, pool.submit(self._copy_file, array, grid_index), size))
                        while len(window) > 4 * self._concurrency:
                            done = self._finish(window.popleft(), done, total)
                while window:
                    done = self._finish(window.popleft(), done, total)
            except BaseException:
                for _, future, _ in window:
                    future.cancel()
                raise
        return {path: digest.value for path, digest in digests.items()}

    def _finish(self, item: tuple[ChunkDigest, Future[int], int], done: int, total: int) -> int:
        digest, future, size = item
        digest.add(future.result())
        if self._progress is not None:
            self._progress(done + size, total)
        return done + size

    def _copy_file(self, array: ArrayCopy, grid_index: tuple[int, ...]) -> int:
        """Copy one chunk file, checked; returns its content checksum. Retries it after a storage error."""
        name = chunk_key(array.source, grid_index)
        claim = math.prod(outer_chunk_shape(array.source)) * array.itemsize
        self._budget.acquire(claim)
        try:
            for delay in (*RETRY_DELAYS, None):
                try:
                    return self._copy_file_once(array, grid_index, name)
                except StorageError as e:
                    if delay is None or any(mark in str(e) for mark in PERMANENT):
                        raise
                    time.sleep(delay)
            raise AssertionError("unreachable")
        finally:
            self._budget.release(claim)

    def _copy_file_once(self, array: ArrayCopy, grid_index: tuple[int, ...], name: str) -> int:
        file = f"{array.path}/{name}"
        data = self._read(file)
        crc = self._checker.content_crc(array, grid_index, data, f"{self._where}/{file}")
        self._throttle.take(len(data))
        written = f"{array.path}/{chunk_key(array.target, grid_index)}"
        try:
            self._target.write(written, data).result()
            back = self._target.read(written).result() if self._read_back else None
        except Exception as e:
            raise StorageError(f"{self._target_name}: writing {written} failed: {e}") from e
        if back is not None and (back.state != "value" or back.value != data):
            raise StorageError(f"{self._target_name}: {written} read back differs from what was written")
        with self._lock:
            self.objects += 1
            self.stored_bytes += len(data)
        return crc

    def _read(self, file: str) -> bytes:
        """A chunk file's bytes as stored; a missing one is damage of the source."""
        if self._local is not None:
            try:
                return read_checkpoint_file(self._local, file, f"{self._where}/{file}")  # never through a link
            except (FileNotFoundError, NotADirectoryError):
                raise CorruptCheckpointError(f"{self._where}/{file}: chunk file is missing") from None
            except ArrayckptError:
                raise
            except OSError as e:
                raise StorageError(f"{self._where}/{file}: reading failed: {e}") from e
        assert self._source is not None
        try:
            result = self._source.read(file).result()
        except Exception as e:
            raise StorageError(f"{self._where}: reading {file} failed: {e}") from e
        if result.state != "value":
            raise CorruptCheckpointError(f"{self._where}/{file}: chunk object is missing")
        return result.value


class ChunkChecker:
    """Checks chunk files as stored and gives their content checksums (spec §11.2): uncompressed ones byte for byte
    (size, crc32c, shard index, inner chunks), compressed ones decoded through TensorStore, which checks the same.
    Shared by the threads of one copy (its decoders are made once per array)."""

    def __init__(self) -> None:
        self._decoders: dict[str, ChunkDecoder] = {}
        self._decoding: ts.Context | None = None  # one TensorStore context (in-memory store) for every decoder
        self._lock = threading.Lock()

    def content_crc(self, array: ArrayCopy, grid_index: tuple[int, ...], data: bytes, where: str) -> int:
        """The content checksum of chunk ``grid_index`` of ``array`` from its chunk file's bytes ``data``; raises
        ``CorruptCheckpointError`` naming ``where`` for a damaged one."""
        crc = stored_content_crc(array.source, grid_index, data, where)
        if crc is None:
            name = chunk_key(array.source, grid_index)
            crc = chunk_crc(self._decoder(array).decode(name, data, array.extent(grid_index), where))
        return crc

    def _decoder(self, array: ArrayCopy) -> ChunkDecoder:
        with self._lock:
            decoder = self._decoders.get(array.path)
            if decoder is None:
                if self._decoding is None:
                    import tensorstore as ts  # on first use (CLI start-up)
                    self._decoding = ts.Context()
                path = f"{len(self._decoders)}/"
                decoder = self._decoders[array.path] = ChunkDecoder(array.source, self._decoding, path)
            return decoder


def _open(spec: JSON, context: ts.Context | LazyContext, where: str) -> ts.KvStore:
    try:
        import tensorstore as ts  # on first use (CLI start-up)
        return ts.KvStore.open(spec, context=resolve_context(context)).result()
    except Exception as e:
        raise StorageError(f"{where}: cannot open the store: {e}") from e


def checked_arrays(checkpoint: StoredCheckpoint, where: str) -> list[ArrayCopy]:
    """Every array node of the checkpoint, its metadata checked as untrusted input before its grid is walked (its
    shape, chunking, codecs with their crc32c, data type), with the entry it belongs to and the chunks it stores:
    what ``copy`` copies and ``arrayckpt refs`` makes references of. Raises :class:`FormatError` naming ``where``
    and the array."""
    keys: dict[str, str] = {}
    deltas: dict[str, str] = {}  # array path -> key, for the arrays of chunks deltas
    for key, entry in checkpoint.manifest.entries.items():
        if isinstance(entry, ArrayEntry):
            keys[entry.path] = key
            if entry.delta is not None and entry.delta.mode == "chunks":
                deltas[entry.path] = key
            elif entry.delta is not None:
                keys.update({f"{entry.path}/{name}": key for name in ("rows", "values", "codes", "scale", "offset")})
        elif isinstance(entry, PickleEntry):
            keys[entry.path] = key
        elif isinstance(entry, PerRankEntry):
            keys.update({per_rank_path(key, rank): key for rank in range(len(entry.items))})
    out = []
    for path, node in checkpoint.nodes.items():
        if not (isinstance(node, dict) and node.get("node_type") == "array"):
            continue
        shape = node.get("shape")
        if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in shape)):
            raise FormatError(f"{where}: array {path!r}: shape {shape!r} is not a list of integers")
        check_array_metadata(node, tuple(shape), node.get("data_type"), f"{where}: array {path!r}")  # type: ignore[arg-type]
        check_checksummed(node, f"{where}: array {path!r}")
        dtype_by_name(node["data_type"])
        present = tuple(sorted(checkpoint.present_chunks(deltas[path]))) if path in deltas else None
        out.append(ArrayCopy(path, keys.get(path, path), node, node, present))
    return out
