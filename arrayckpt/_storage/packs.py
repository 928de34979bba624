"""Packs (issue 35): the chunk files a rank writes, appended into one file or object of its own.

A save at R ranks of T tensors writes about R×T files or objects, one per chunk (or shard). In the packed layout
each rank appends the bytes of the chunk files it writes into its *pack*: exactly one per rank and save, locally one
file, on object storage one object (a multipart upload when it is larger than one part). A table (the coordinator's,
not written here) records ``(pack file, offset, length)`` per chunk key; the Zarr key -> bytes mapping stays what it
was. This module is the storage-layer IO of packs only; the locations open and read them (``Location.open_pack``,
``read_pack``, ``read_pack_into``; ``base.open_pack``, ``read_ranges``, ``read_into``).

Call order of a rank::

    pack = open_pack(writer.target, rank)          # nothing is created before the first reservation
    slot = pack.append(encoded)                    # reserve and write in one call (one thread, batch after batch)
    slot = pack.reserve(len(chunk))                # or: (offset, length), contiguous, in order; under a lock
    pack.write(slot.offset, chunk)                 #     from any thread, each reserved range exactly once
    files = pack.close()                           # [PackFile], durable (local) or uploaded (object storage)
    pack.abort()                                   # instead, on any failure (or after close: the save failed)

Decisions, measured here (ext4 on a virtual disk and tmpfs, 2 writer threads, 2 loaded cores, 3 runs each):

- Offsets are packed, not aligned to 4 KiB. 8,000 chunks of 1 B-64 KiB (256 MB) wrote at 0.64-1.38 GB/s aligned
  and 0.73-1.36 GB/s packed, and read back (page cache, and cold after ``drop_caches``) within the same noise, but
  alignment made the file 6% larger; 50,000 chunks of 1 B-4 KiB: no faster either way (60-110 MB/s, syscall-bound),
  the file twice as large, its fsync 1.5x as long, cold reads 30% slower. 64 chunks of ~4 MiB: no difference.
- One pack per rank, never split (``docs/PACKED_LAYOUT.md``, "Measured"): bounded segments gave 667 files at 8 ranks
  and 10,523 objects where the target is 2 × ranks + a constant.
- On object storage the pack is cut into parts of ``object_part_bytes`` (64 MiB). A pack of at most one part is one
  PUT at :meth:`PackWriter.close`, through the location's TensorStore kvstore (its context retries). A larger one is
  uploaded through an fsspec file opened for writing (s3fs: a multipart upload, one ``UploadPart`` per part; gcsfs: a
  resumable upload), which takes its bytes in order: a part goes to it once it and every part before it are written,
  from one uploading thread per pack, while the writers go on. A writer waits while ``object_pack_parts`` (4) parts
  are held (filling, queued or uploading), unless a byte before its range is still unwritten (then it may be the
  one that fills it: waiting could deadlock), so a rank appending in order holds at most that many parts.
  The parts are fixed at the first one uploaded, so a pack that would need more than S3's 10,000 is refused at the
  reservation that passes the limit (640 GiB a rank at 64 MiB parts), naming the setting to raise. ``memory://``
  holds the whole pack and writes it at close.
"""

from __future__ import annotations

import abc
import heapq
import os
import stat
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple, Protocol

from .._errors import StorageError
from .._format.packs import PACK_PREFIX, PackFile, pack_name
from .._settings import settings
from .kvio import delete_keys

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["MAX_PARTS", "MAX_PUT_BYTES", "MIN_PART_BYTES", "PACK_DIRECTORY", "PART_GRAIN", "FilePackWriter",
           "ObjectPackWriter", "PackData", "PackSlot", "PackWriter", "Upload", "byte_views"]

PACK_DIRECTORY = PACK_PREFIX.rstrip("/")
MAX_PUT_BYTES = 5 << 30  # the largest object S3 takes in one PUT, and its largest part (facts of the store)
MIN_PART_BYTES = 5 << 20  # S3's smallest part of a multipart upload (but the last)
MAX_PARTS = 10_000  # the most parts of one S3 multipart upload
PART_GRAIN = 256 << 10  # GCS takes the chunks of a resumable upload (but the last) in multiples of this
_IOV_MAX = 1024  # buffers one pwritev/preadv takes (Linux's IOV_MAX)

PackData = bytes | bytearray | memoryview | Sequence[memoryview]  # one chunk file's bytes, whole or in pieces


class PackSlot(NamedTuple):
    """Where a chunk file's bytes lie in its rank's pack."""

    offset: int
    length: int


class Upload(Protocol):
    """One object uploaded from sequential writes: an s3fs or gcsfs file opened with ``"wb"`` (a multipart or
    resumable upload started once a part is written to it). ``close`` completes it; ``discard`` abandons it (S3's
    ``AbortMultipartUpload``, GCS's cancelled session)."""

    closed: bool

    def write(self, data: memoryview, /) -> int: ...

    def close(self) -> None: ...

    def discard(self) -> None: ...


class PackWriter(abc.ABC):
    """One rank's pack being written (the module docstring has the call order): the single file or object
    ``pack_name(rank, tag)``. :meth:`reserve` places chunks one after the other; :meth:`write` may be called from many
    threads at once, each reserved range exactly once; :meth:`append` does both. Not to be closed or aborted while
    writes are running."""

    def __init__(self, rank: int, where: object, tag: str = "") -> None:
        if rank < 0:
            raise ValueError(f"{where}: a pack needs a rank of at least 0, not {rank}")
        self.rank, self.where, self.name = rank, where, pack_name(rank, tag)
        self._lock = threading.Lock()
        self._size: int | None = None  # bytes reserved (None: nothing reserved, nothing created)
        self._reserved: dict[int, int] = {}  # ranges reserved and not being written yet: offset -> length
        self._writing: set[int] = set()  # ranges being written now (their offsets)
        self._unfinished: list[int] = []  # a heap of offsets of ranges reserved; stale once written
        self._state = "open"  # then "closing" and "closed", or "aborted"

    def reserve(self, length: int) -> PackSlot:
        """Where a chunk of ``length`` bytes goes: right after the previous one."""
        if length < 0:
            raise ValueError(f"{self.where}: cannot reserve {length} bytes in a pack")
        with self._lock:
            self._check_open()
            if self._size is None:
                self._start()
                self._size = 0
            slot = PackSlot(self._size, length)
            self._check_size(slot.offset + length)
            self._size += length
            if length:
                self._reserved[slot.offset] = length
                heapq.heappush(self._unfinished, slot.offset)
        return slot

    def write(self, offset: int, data: PackData) -> None:
        """Write a reserved chunk's bytes (a buffer, or its pieces in order) at the offset :meth:`reserve` gave."""
        views = byte_views(data)
        length = sum(view.nbytes for view in views)
        with self._lock:
            self._check_open()
            # (an empty chunk is not recorded: it shares its offset with the chunk after it, and needs no writing)
            reserved = self._reserved.pop(offset, None) if length else 0
            if reserved is None or self._size is None or not 0 <= offset <= self._size:
                raise ValueError(f"{self.where}: rank {self.rank}'s pack range at offset {offset} was not reserved, or "
                                 "was written already")
            if reserved != length:
                self._reserved[offset] = reserved
                raise ValueError(f"{self.where}: rank {self.rank}'s pack range at offset {offset} was reserved for "
                                 f"{reserved:,} bytes, not {length:,}")
            if length:
                self._writing.add(offset)
        if not length:
            return
        try:
            self._write(offset, views)
        except BaseException:
            with self._lock:  # not written: close() refuses, abort() removes the pack
                self._writing.discard(offset)
                self._reserved[offset] = length
            raise
        with self._lock:
            self._writing.discard(offset)
        self._written()

    def append(self, data: PackData) -> PackSlot:
        """Reserve and write a chunk's bytes (a buffer, or its pieces in order) in one call: where they went."""
        views = byte_views(data)
        slot = self.reserve(sum(view.nbytes for view in views))
        self.write(slot.offset, views)
        return slot

    def close(self) -> list[PackFile]:
        """Finish the pack once every reserved range is written: locally fsync its file (unless the save is not
        durable), on object storage upload the rest and complete the object. What it wrote: ``[]`` or one file."""
        with self._lock:
            self._check_open()
            if self._reserved or self._writing:
                first = min([*self._reserved, *self._writing])
                count = len(self._reserved) + len(self._writing)
                raise ValueError(f"{self.where}: rank {self.rank}'s pack has {count} reserved range(s) not written "
                                 f"(the first at offset {first}); write each one before close(), or abort()")
            self._state = "closing"
        if self._size is not None:
            self._finish()
        self._state = "closed"
        return [] if self._size is None else [PackFile(self.name, self._size, self.rank)]

    def abort(self) -> None:
        """Remove what this pack wrote (also after :meth:`close`, when the save fails elsewhere). Never raises for a
        failed clean-up: it warns."""
        with self._lock:
            if self._state == "aborted":
                return
            self._state = "aborted"
        try:
            self._remove()
        except (OSError, StorageError) as e:
            warnings.warn(f"{self.where}: removing rank {self.rank}'s pack failed: {e}", RuntimeWarning, stacklevel=2)

    def _check_open(self) -> None:
        if self._state != "open":
            raise ValueError(f"{self.where}: rank {self.rank}'s pack is {self._state}")

    def _written_before(self) -> int:
        """The offset before which every reserved byte is written (called under the lock)."""
        heap = self._unfinished
        while heap and heap[0] not in self._reserved and heap[0] not in self._writing:
            heapq.heappop(heap)
        return heap[0] if heap else self._size or 0

    def _check_size(self, size: int) -> None:  # noqa: B027 - a hook: no limit locally
        """Refuse a reservation that would make the pack ``size`` bytes long (called under the lock)."""

    def _written(self) -> None:  # noqa: B027 - a hook: nothing to do locally
        """A write ended (called outside the lock)."""

    @abc.abstractmethod
    def _start(self) -> None:
        """Make room for the pack (called under the lock, at the first reservation)."""

    @abc.abstractmethod
    def _write(self, offset: int, views: list[memoryview]) -> None:
        """Put the bytes of ``views`` at ``offset`` (any thread, disjoint ranges)."""

    @abc.abstractmethod
    def _finish(self) -> None:
        """The rest of :meth:`close`, once every range is written."""

    @abc.abstractmethod
    def _remove(self) -> None:
        """The rest of :meth:`abort`: remove what was written."""


class FilePackWriter(PackWriter):
    """A pack in a local directory (a save's temporary directory): one file below ``packs/``, created exclusively
    (never through a link), written with ``pwrite``/``pwritev``, fsynced at :meth:`close` unless the save is not
    durable (``fsync=False``)."""

    def __init__(self, root: str, fsync: bool, rank: int, where: object, tag: str = "") -> None:
        super().__init__(rank, where, tag)
        self._root, self._fsync = root, fsync
        self._fd: int | None = None

    def _start(self) -> None:
        try:
            _make_directory(f"{self._root}/{PACK_DIRECTORY}", self.where)
            self._fd = os.open(f"{self._root}/{self.name}",
                               os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            raise StorageError(f"{self.where}: {self.name} exists already: two writers of rank {self.rank}'s pack (do "
                               "two processes have this rank?); nothing was overwritten") from None
        except OSError as e:
            raise StorageError(f"{self.where}: creating {self.name} failed: {e}") from e

    def _write(self, offset: int, views: list[memoryview]) -> None:
        assert self._fd is not None  # (reserved: created)
        index = 0
        try:
            while index < len(views):
                batch = views[index:index + _IOV_MAX]
                done = os.pwritev(self._fd, batch, offset) if len(batch) > 1 else os.pwrite(self._fd, batch[0], offset)
                if done == 0:
                    raise OSError("the file system wrote nothing")
                offset += done
                while index < len(views) and done >= views[index].nbytes:  # drop what was written
                    done -= views[index].nbytes
                    index += 1
                if done:
                    views[index] = views[index][done:]
        except OSError as e:
            raise StorageError(f"{self.where}: writing {self.name} failed: {e}") from e

    def _finish(self) -> None:
        try:
            if self._fsync and self._fd is not None:
                os.fsync(self._fd)
                _fsync_directory(f"{self._root}/{PACK_DIRECTORY}")
        except OSError as e:
            raise StorageError(f"{self.where}: syncing rank {self.rank}'s pack to disk failed: {e}") from e
        finally:
            self._close_file()

    def _remove(self) -> None:
        self._close_file()
        if self._size is not None:  # created at the first reservation (a failed creation left it None)
            try:
                os.unlink(f"{self._root}/{self.name}")
            except FileNotFoundError:
                pass
        try:
            os.rmdir(f"{self._root}/{PACK_DIRECTORY}")
        except OSError:  # other ranks' packs are still there (or it is gone)
            pass

    def _close_file(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


class ObjectPackWriter(PackWriter):
    """A pack on object storage: one object, cut into parts of ``part_bytes`` held in memory. At most one part: one
    PUT at :meth:`close` through the location's TensorStore kvstore. More: each part, once it and every part before
    it are written, goes to ``open_upload(name, part_bytes)``'s :class:`Upload` from one thread of this pack (the
    module docstring says why and how memory stays bounded); ``open_upload=None`` (``memory://``) writes the whole
    pack at close. ``max_parts``: the most parts the object may have (S3's 10,000; ``None``: no limit)."""

    def __init__(self, store: ts.KvStore, rank: int, where: object, part_bytes: int,
                 open_upload: Callable[[str, int], Upload] | None, max_parts: int | None = MAX_PARTS,
                 tag: str = "") -> None:
        super().__init__(rank, where, tag)
        if not MIN_PART_BYTES <= part_bytes <= MAX_PUT_BYTES or part_bytes % PART_GRAIN:
            raise ValueError(f"{where}: object_part_bytes={part_bytes:,} is not a part object storage takes: give a "
                             f"multiple of {PART_GRAIN:,} (GCS) from {MIN_PART_BYTES:,} to {MAX_PUT_BYTES:,} (S3)")
        self._store, self._part, self._open_upload = store, part_bytes, open_upload
        self._max_parts = max_parts if open_upload is not None else None
        self._max_held = settings().object_pack_parts if open_upload is not None else None
        self._parts: dict[int, bytearray] = {}  # the parts held: filling, queued or being uploaded
        self._sent = 0  # parts handed to the uploading thread (in order)
        self._held_from = 0  # the first part whose upload has not ended
        self._uploader: ThreadPoolExecutor | None = None
        self._uploads: list[Future[None]] = []
        self._upload: Upload | None = None  # the object's upload, from its first part until it completes
        self._failure: BaseException | None = None  # the first failed part upload
        self._changed = threading.Condition(self._lock)  # a part upload ended (or the pack was aborted)

    def _start(self) -> None:
        pass

    def _check_size(self, size: int) -> None:
        if self._max_parts is not None and size > self._part * self._max_parts:
            raise StorageError(f"{self.where}: rank {self.rank}'s pack would pass {size:,} bytes, more than "
                               f"{self._max_parts:,} parts of object_part_bytes={self._part:,} hold (S3's limit of "
                               "one multipart upload); raise ARRAYCKPT_OBJECT_PART_BYTES (at most 5 GiB), or save "
                               "from more ranks")

    def _write(self, offset: int, views: list[memoryview]) -> None:
        end = offset + sum(view.nbytes for view in views)
        first, last = offset // self._part, (end - 1) // self._part
        with self._lock:
            while self._must_wait(first, offset):
                self._changed.wait()
            self._check_open()
            self._check_failure()
            buffers = {}
            for part in range(first, last + 1):
                buffer = self._parts.get(part)
                if buffer is None:
                    buffer = self._parts[part] = bytearray(self._part)
                buffers[part] = buffer
        for view in views:  # (disjoint ranges of buffers that are not resized: no lock needed)
            while view.nbytes:
                part, start = divmod(offset, self._part)
                count = min(view.nbytes, self._part - start)
                buffers[part][start:start + count] = view[:count]
                view, offset = view[count:], offset + count

    def _must_wait(self, part: int, offset: int) -> bool:
        """Whether a write into ``part`` at ``offset`` waits for uploads (module docstring; under the lock): while
        ``object_pack_parts`` parts are held and every byte before ``offset`` is written (their uploads then end
        without any other write)."""
        if self._max_held is None or self._state != "open" or self._failure is not None:
            return False
        return part - self._held_from >= self._max_held and self._written_before() == offset

    def _written(self) -> None:
        with self._lock:
            if self._state != "open" or self._open_upload is None or self._size is None:
                return
            ready = self._written_before()
            while (self._sent + 1) * self._part <= ready and (self._sent + 1) * self._part < self._size:
                self._send(self._part)  # (the last part waits for close: the pack may end in it)

    def _send(self, length: int) -> None:
        """Hand the next part (its first ``length`` bytes) to the uploading thread (under the lock)."""
        if self._uploader is None:
            self._uploader = ThreadPoolExecutor(1, thread_name_prefix=f"pack-upload-{self.rank}")
        part = self._sent
        self._uploads.append(self._uploader.submit(self._upload_part, part, memoryview(self._parts[part])[:length]))
        self._sent += 1

    def _upload_part(self, part: int, data: memoryview) -> None:
        """Upload one part (the uploading thread, in order); a failure is kept for the writers and close."""
        try:
            if self._failure is None and self._state != "aborted":
                upload = self._upload
                if upload is None:
                    assert self._open_upload is not None  # (parts are sent only to an upload)
                    upload = self._upload = self._open_upload(self.name, self._part)
                upload.write(data)
        except Exception as e:  # noqa: BLE001 - raised by the writers and close() as a StorageError
            self._failure = self._failure or e
        finally:
            del data
            with self._lock:
                self._parts.pop(part, None)
                self._held_from = part + 1
                self._changed.notify_all()

    def _check_failure(self) -> None:
        if self._failure is not None:
            raise StorageError(f"{self.where}: writing rank {self.rank}'s pack failed: {self.name}: "
                               f"{self._failure}") from self._failure

    def _finish(self) -> None:
        assert self._size is not None  # (reserved)
        size, whole = self._size, None
        with self._lock:
            count = -(-size // self._part)
            if self._sent == 0 and (self._open_upload is None or size <= self._part):
                whole = bytearray()
                for part in range(count):
                    whole += memoryview(self._parts.pop(part))[:min(self._part, size - part * self._part)]
            else:
                while self._sent < count:
                    self._send(min(self._part, size - self._sent * self._part))
        if whole is not None:
            try:
                # TensorStore copies a bytearray as it does bytes (bytes(whole) would be one copy more)
                future = self._store.write(self.name, whole)  # type: ignore[arg-type]
                del whole
                future.result()
            except Exception as e:
                raise StorageError(f"{self.where}: writing rank {self.rank}'s pack failed: {self.name}: {e}") from e
            return
        assert self._uploader is not None  # (parts sent)
        self._uploader.shutdown(wait=True)
        self._check_failure()
        upload, self._upload = self._upload, None
        try:
            assert upload is not None  # (a part uploaded)
            upload.close()  # completes the multipart upload (S3) or the resumable one (GCS)
        except Exception as e:
            self._upload = upload  # abort() abandons it
            raise StorageError(f"{self.where}: completing rank {self.rank}'s pack {self.name} failed: {e}") from e

    def _remove(self) -> None:
        with self._lock:
            self._changed.notify_all()  # writers waiting for uploads find the pack aborted
        if self._uploader is not None:  # parts still queued are dropped; the one being uploaded ends first
            self._uploader.shutdown(wait=True, cancel_futures=True)
        self._parts.clear()
        upload, self._upload = self._upload, None
        try:
            if upload is not None:  # not completed: S3's AbortMultipartUpload, or GCS's cancelled session
                upload.discard()
                upload.closed = True  # (s3fs's discard leaves it open: its finaliser would try to complete it)
        except Exception as e:
            raise StorageError(f"{self.where}: abandoning the upload of rank {self.rank}'s pack failed: {e}") from e
        finally:
            if self._size is not None:  # a PUT or a completed upload may have landed
                delete_keys(self._store, [self.name], self.where)


# --- helpers ------------------------------------------------------------------------------------------------------


def byte_views(data: PackData) -> list[memoryview]:
    """``data`` as flat byte views (a tensor's or array's buffer is cast, without a copy)."""
    pieces = [data] if isinstance(data, (bytes, bytearray, memoryview)) else list(data)
    views = []
    for piece in pieces:
        view = memoryview(piece)
        if view.format != "B" or view.ndim != 1:
            if not view.c_contiguous:
                raise ValueError("pack data must be contiguous buffers; pass a contiguous copy")
            view = view.cast("B")
        views.append(view)
    return views


def _make_directory(path: str, where: object) -> None:
    """Create the ``packs/`` directory (several ranks race to), refusing a link or file in its place."""
    try:
        os.mkdir(path, 0o755)
    except FileExistsError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise StorageError(f"{where}: {PACK_DIRECTORY} is not a directory (a link or a file is in its place); "
                               "nothing is written through it") from None


def _fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
