"""Packs (issue 35): the chunk files a rank writes, appended into a few files or objects of its own.

A save at R ranks of T tensors writes about R×T files or objects, one per chunk (or shard). In the packed layout
each rank appends the bytes of the chunk files it writes into its *pack*, made of *segments*: locally one file each,
on object storage one object each, assembled in memory and PUT once, whole. A table (the coordinator's, not written
here) records ``(pack file, offset, length)`` per chunk key; the Zarr key -> bytes mapping stays what it was. This
module is the storage-layer IO of packs only; the locations open and read them (``Location.open_pack``,
``read_pack``, ``read_pack_into``; ``base.open_pack``, ``read_ranges``, ``read_into``), and nothing else uses it yet.

Call order of a rank::

    pack = open_pack(writer.target, rank)          # nothing is created before the first reservation
    slot = pack.reserve(len(chunk))                # (segment, offset): contiguous, in order; cheap, under a lock
    pack.write(slot.segment, slot.offset, chunk)   # from any thread, each reserved range exactly once
    files = pack.close()                           # [(name, size)], durable (local) or PUT (object storage)
    pack.abort()                                   # instead, on any failure (or after close: the save failed)

Decisions, measured here (ext4 on a virtual disk and tmpfs, 2 writer threads, 2 loaded cores, 3 runs each):

- Offsets are packed, not aligned to 4 KiB. 8,000 chunks of 1 B-64 KiB (256 MB) wrote at 0.64-1.38 GB/s aligned
  and 0.73-1.36 GB/s packed, and read back (page cache, and cold after ``drop_caches``) within the same noise, but
  alignment made the file 6% larger; 50,000 chunks of 1 B-4 KiB: no faster either way (60-110 MB/s, syscall-bound),
  the file twice as large, its fsync 1.5x as long, cold reads 30% slower. 64 chunks of ~4 MiB: no difference.
- Segments (``_settings.py``): locally ``local_segment_bytes`` (1 GiB), so that a rank's pack is a handful of files
  and a copy to object storage can PUT each file as one object (under the 5 GiB of one PUT). On object storage
  ``object_segment_bytes`` (64 MiB) with ``object_segment_puts`` (1) PUT in flight: this module holds at most two
  segments (the one filling, and the complete one handed to TensorStore), but TensorStore copies a segment it PUTs
  (and keeps that copy until the PUT ends), so a rank's resident memory peaked at 5.5-5.7 segments (4 threads writing
  384-768 MiB to moto: 351 MiB at 64 MiB segments, 730 MiB at 128 MiB); 64 MiB keeps that under ~400 MiB while a
  PUT's request still costs little beside its transfer.
"""

from __future__ import annotations

import abc
import os
import stat
import threading
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from .._errors import CorruptCheckpointError, FormatError, StorageError
from .._format.packs import PACK_PREFIX, PackFile, pack_name
from .._io.pools import map_kept
from .._io.smallfiles import check_no_links, open_nonblocking, user_paths
from .._settings import settings
from .kvio import delete_keys, wait_all

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["MAX_PUT_BYTES", "PACK_DIRECTORY", "FilePackWriter", "ObjectPackWriter", "PackData", "PackSlot",
           "PackWriter", "read_file_ranges", "read_object_ranges"]

PACK_DIRECTORY = PACK_PREFIX.rstrip("/")
MAX_PUT_BYTES = 5 << 30  # the largest object S3 takes in one PUT (a fact of the store; GCS takes more)
_IOV_MAX = 1024  # buffers one pwritev/preadv takes (Linux's IOV_MAX)

PackData = bytes | bytearray | memoryview | Sequence[memoryview]  # one chunk file's bytes, whole or in pieces


class PackSlot(NamedTuple):
    """Where a reserved chunk goes: its segment, and its offset in it."""

    segment: int
    offset: int


class PackWriter(abc.ABC):
    """One rank's pack being written (the module docstring has the call order). :meth:`reserve` places chunks one
    after the other, rolling over to a new segment when the next one would pass ``segment_bytes`` (a chunk longer
    than that gets a segment of its own); :meth:`write` may be called from many threads at once, each reserved range
    exactly once. Not to be closed or aborted while writes are running."""

    largest_segment: ClassVar[int | None] = None  # what one segment may hold at most (None: no limit)

    def __init__(self, rank: int, segment_bytes: int, where: object) -> None:
        if rank < 0 or segment_bytes < 1:
            raise ValueError(f"{where}: a pack needs a rank of at least 0 and segments of at least 1 byte, not rank "
                             f"{rank} and segment_bytes={segment_bytes}")
        self.rank, self.segment_bytes, self.where = rank, segment_bytes, where
        self._lock = threading.Lock()
        self._sizes: list[int] = []  # bytes reserved in each segment: its size once everything is written
        self._unwritten: list[int] = []  # bytes reserved in each segment and not written yet
        self._reserved: dict[PackSlot, int] = {}  # ranges reserved and not written yet -> their length
        self._state = "open"  # then "closing" and "closed", or "aborted"

    def reserve(self, length: int) -> PackSlot:
        """Where a chunk of ``length`` bytes goes: right after the previous one, or at the start of a new segment."""
        if length < 0:
            raise ValueError(f"{self.where}: cannot reserve {length} bytes in a pack")
        sealed = None
        with self._lock:
            self._check_open()
            if not self._sizes or (self._sizes[-1] and self._sizes[-1] + length > self.segment_bytes):
                self._start(len(self._sizes))
                self._sizes.append(0)
                self._unwritten.append(0)
                if len(self._sizes) > 1 and self._unwritten[-2] == 0:
                    sealed = len(self._sizes) - 2  # no more reservations go there, and it is all written
            slot = PackSlot(len(self._sizes) - 1, self._sizes[-1])
            if self.largest_segment is not None and slot.offset + length > self.largest_segment:
                raise StorageError(f"{self.where}: a chunk of {length:,} bytes does not fit in one object of at most "
                                   f"{self.largest_segment:,} bytes (one PUT); save with smaller chunks or shards")
            self._sizes[-1] += length
            self._unwritten[-1] += length
            if length:
                self._reserved[slot] = length
        if sealed is not None:
            self._complete(sealed)
        return slot

    def write(self, segment: int, offset: int, data: PackData) -> None:
        """Write a reserved chunk's bytes (a buffer, or its pieces in order) at the place :meth:`reserve` gave."""
        views = _byte_views(data)
        length = sum(view.nbytes for view in views)
        slot = PackSlot(segment, offset)
        with self._lock:
            self._check_open()
            # (an empty chunk is not recorded: it shares its slot with the chunk after it, and needs no writing)
            reserved = self._reserved.pop(slot, None) if length else 0
            if reserved is None or not 0 <= segment < len(self._sizes) or offset > self._sizes[segment]:
                raise ValueError(f"{self.where}: rank {self.rank}'s pack range at {slot} was not reserved, or was "
                                 "written already")
            if reserved != length:
                self._reserved[slot] = reserved
                raise ValueError(f"{self.where}: rank {self.rank}'s pack range at {slot} was reserved for "
                                 f"{reserved:,} bytes, not {length:,}")
        if not length:
            return
        self._write(segment, offset, views)
        with self._lock:
            self._unwritten[segment] -= length
            done = self._unwritten[segment] == 0 and segment < len(self._sizes) - 1 and self._state == "open"
        if done:
            self._complete(segment)

    def append(self, data: PackData) -> tuple[int, int]:
        """Reserve and write ``data`` at the end of the pack: its ``(offset, length)``."""
        views = _byte_views(data)
        slot = self.reserve(sum(view.nbytes for view in views))
        self.write(slot.segment, slot.offset, views)
        return slot.offset, sum(view.nbytes for view in views)

    def close(self) -> list[PackFile]:
        """Finish the pack once every reserved range is written: locally fsync its files (unless the save is not
        durable), on object storage PUT the last segment and wait for every PUT. What it wrote, in segment order."""
        with self._lock:
            self._check_open()
            if self._reserved or any(self._unwritten):
                slots = sorted(self._reserved)
                raise ValueError(f"{self.where}: rank {self.rank}'s pack has {len(slots)} reserved range(s) not "
                                 f"written (the first at {slots[0] if slots else '?'}); write each one before close(), "
                                 "or abort()")
            self._state = "closing"
        if self._sizes:
            self._complete(len(self._sizes) - 1)
        self._finish()
        self._state = "closed"
        return [PackFile(pack_name(self.rank, s), size, self.rank) for s, size in enumerate(self._sizes)]

    def abort(self) -> None:
        """Remove every segment this pack wrote (also after :meth:`close`, when the save fails elsewhere). Never
        raises for a failed clean-up: it warns."""
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

    def _name(self, segment: int) -> str:
        return pack_name(self.rank, segment)

    @abc.abstractmethod
    def _start(self, segment: int) -> None:
        """Make room for a new segment (called under the lock, before any reservation in it)."""

    @abc.abstractmethod
    def _write(self, segment: int, offset: int, views: list[memoryview]) -> None:
        """Put the bytes of ``views`` at ``offset`` of ``segment`` (any thread, disjoint ranges)."""

    def _complete(self, segment: int) -> None:  # noqa: B027 - a hook: nothing to do locally
        """``segment`` is all written and takes no more reservations (called once per segment, outside the lock)."""

    @abc.abstractmethod
    def _finish(self) -> None:
        """The rest of :meth:`close`, once every segment is complete."""

    @abc.abstractmethod
    def _remove(self) -> None:
        """The rest of :meth:`abort`: remove what was written."""


class FilePackWriter(PackWriter):
    """A pack in a local directory (a save's temporary directory): one file per segment below ``packs/``, created
    exclusively (never through a link), written with ``pwrite``/``pwritev``, fsynced at :meth:`close` unless the
    save is not durable (``fsync=False``)."""

    def __init__(self, root: str, fsync: bool, rank: int, segment_bytes: int, where: object) -> None:
        super().__init__(rank, segment_bytes, where)
        self._root, self._fsync = root, fsync
        self._fds: list[int] = []
        self._closed = False

    def _start(self, segment: int) -> None:
        directory = f"{self._root}/{PACK_DIRECTORY}"
        path = f"{self._root}/{self._name(segment)}"
        try:
            if segment == 0:
                _make_directory(directory, self.where)
            self._fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644))
        except FileExistsError:
            raise StorageError(f"{self.where}: {self._name(segment)} exists already: two writers of rank {self.rank}'s "
                               "pack (do two processes have this rank?); nothing was overwritten") from None
        except OSError as e:
            raise StorageError(f"{self.where}: creating {self._name(segment)} failed: {e}") from e

    def _write(self, segment: int, offset: int, views: list[memoryview]) -> None:
        fd = self._fds[segment]
        index = 0
        try:
            while index < len(views):
                batch = views[index:index + _IOV_MAX]
                done = os.pwritev(fd, batch, offset) if len(batch) > 1 else os.pwrite(fd, batch[0], offset)
                if done == 0:
                    raise OSError("the file system wrote nothing")
                offset += done
                while index < len(views) and done >= views[index].nbytes:  # drop what was written
                    done -= views[index].nbytes
                    index += 1
                if done:
                    views[index] = views[index][done:]
        except OSError as e:
            raise StorageError(f"{self.where}: writing {self._name(segment)} failed: {e}") from e

    def _finish(self) -> None:
        try:
            if self._fsync and self._fds:
                for fd in self._fds:
                    os.fsync(fd)
                _fsync_directory(f"{self._root}/{PACK_DIRECTORY}")
        except OSError as e:
            raise StorageError(f"{self.where}: syncing rank {self.rank}'s pack to disk failed: {e}") from e
        finally:
            self._close_files()

    def _remove(self) -> None:
        self._close_files()
        for segment in range(len(self._fds)):
            try:
                os.unlink(f"{self._root}/{self._name(segment)}")
            except FileNotFoundError:
                pass
        try:
            os.rmdir(f"{self._root}/{PACK_DIRECTORY}")
        except OSError:  # other ranks' packs are still there (or it is gone)
            pass

    def _close_files(self) -> None:
        if not self._closed:
            self._closed = True
            for fd in self._fds:
                os.close(fd)


class ObjectPackWriter(PackWriter):
    """A pack on object storage: each segment assembled in memory and PUT once, as one object, when it is complete
    (or at :meth:`close`), through the location's TensorStore kvstore (its context retries failed requests).

    Memory is bounded by back-pressure on the writers: at most ``object_segment_puts`` PUTs are in flight (the thread
    completing a segment waits for the oldest beyond that), and a write into segment ``s`` waits while more than
    ``object_segment_puts`` segments before ``s`` are not PUT yet, all of them complete (their PUTs then end without
    any other write). A segment before ``s`` still waiting for a write lets writes into ``s`` go on, so that no
    order of writes can deadlock: memory then grows with the segments filling at once."""

    largest_segment = MAX_PUT_BYTES

    def __init__(self, store: ts.KvStore, rank: int, segment_bytes: int, where: object) -> None:
        if segment_bytes > MAX_PUT_BYTES:
            raise ValueError(f"{where}: segment_bytes={segment_bytes:,} is more than one PUT takes ({MAX_PUT_BYTES:,})")
        super().__init__(rank, segment_bytes, where)
        self._store = store
        self._buffers: list[bytearray | None] = []
        self._puts: list[tuple[str, ts.Future[ts.KvStore.TimestampedStorageGeneration]]] = []
        self._waited = 0  # PUTs before this index in ``_puts`` have ended
        self._put_lock = threading.Lock()  # one thread issues PUTs (or waits for them) at a time
        self._put_done: set[int] = set()  # segments whose PUT ended
        self._first_held = 0  # the first segment whose PUT has not ended: it and the later ones hold memory
        self._changed = threading.Condition(self._lock)  # a PUT ended (or the pack was aborted)

    def _start(self, segment: int) -> None:
        self._buffers.append(None)

    def _write(self, segment: int, offset: int, views: list[memoryview]) -> None:
        end = offset + sum(view.nbytes for view in views)
        with self._lock:  # the copies hold the GIL anyway; growing the buffer must not move it under one
            while self._must_wait(segment):
                self._changed.wait()
            self._check_open()
            buffer = self._buffers[segment]
            if buffer is None:
                buffer = self._buffers[segment] = bytearray()
            if len(buffer) < end:
                buffer += bytes(end - len(buffer))
            for view in views:
                buffer[offset:offset + view.nbytes] = view
                offset += view.nbytes

    def _must_wait(self, segment: int) -> bool:
        """Whether a write into ``segment`` waits for PUTs (class docstring; called under the lock)."""
        first = self._first_held
        if self._state != "open" or segment - first <= settings().object_segment_puts:
            return False
        return not any(self._unwritten[first:segment])

    def _ended(self, segment: int) -> None:
        """A PUT ended (whether or not it succeeded: a failure is raised by whoever waits for it)."""
        with self._lock:
            self._put_done.add(segment)
            while self._first_held in self._put_done:
                self._first_held += 1
            self._changed.notify_all()

    def _complete(self, segment: int) -> None:
        with self._put_lock:
            self._wait_puts(keep=settings().object_segment_puts - 1)
            with self._lock:
                if self._state == "aborted":
                    return
                buffer, self._buffers[segment] = self._buffers[segment] or bytearray(), None
            size = self._sizes[segment]
            if len(buffer) < size:  # zero-length chunks at its end
                buffer += bytes(size - len(buffer))
            key = self._name(segment)
            try:
                # TensorStore copies a bytearray as it does bytes (bytes(buffer) would be one copy more); ours is let
                # go right away, so a segment being PUT is held once
                future = self._store.write(key, buffer)  # type: ignore[arg-type]
            except Exception as e:
                raise StorageError(f"{self.where}: writing {key} failed: {e}") from e
            del buffer
            self._puts.append((key, future))
            future.add_done_callback(lambda _: self._ended(segment))

    def _wait_puts(self, keep: int) -> None:
        """Wait for the oldest PUTs until at most ``keep`` are in flight (``StorageError`` naming a failed one)."""
        while len(self._puts) - self._waited > keep:
            self._waited += 1
            wait_all([self._puts[self._waited - 1]], self.where, f"writing rank {self.rank}'s pack")

    def _finish(self) -> None:
        with self._put_lock:
            self._wait_puts(keep=0)

    def _remove(self) -> None:
        with self._lock:
            self._changed.notify_all()  # writers waiting for PUTs find the pack aborted
        with self._put_lock:  # every PUT issued has ended (failed ones too: they may have landed) before deleting
            for _, future in self._puts[self._waited:]:
                try:
                    future.result()
                except Exception:  # noqa: BLE001, S110 - deleted below all the same
                    pass
            self._waited = len(self._puts)
            self._buffers = [None] * len(self._buffers)
            keys = [key for key, _ in self._puts]
        delete_keys(self._store, keys, self.where)


# --- reading ------------------------------------------------------------------------------------------------------


def read_file_ranges(root: str, name: str, ranges: Sequence[tuple[int, int]], where: object,
                     buffers: Sequence[memoryview] | None = None) -> list[bytes]:
    """The ``(offset, length)`` ranges of the pack file ``name`` below the local checkpoint directory ``root`` (read
    concurrently with ``pread``; into ``buffers`` with ``preadv`` where given, then ``[]`` is returned). The file is
    reached through no link and must be a regular file."""
    _check_name(name, where)
    if buffers is not None and len(buffers) != len(ranges):
        raise ValueError(f"{where}: {len(ranges)} ranges of {name} but {len(buffers)} buffers to read them into")
    check_no_links(root, name.rpartition("/")[0], f"{where}: {name}")
    path = f"{root.rstrip('/')}/{name}"
    try:
        fd = open_nonblocking(path, False, f"{where}: {name}")
    except (FileNotFoundError, NotADirectoryError):
        raise CorruptCheckpointError(_missing(where, name)) from None
    except CorruptCheckpointError:
        raise
    except OSError as e:
        raise StorageError(user_paths(f"{where}: opening {name} failed: {e}")) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(user_paths(f"{where}: {name} is not a regular file; the checkpoint is "
                                                    "damaged: restore the pack from a copy"))
        for offset, length in ranges:
            if offset < 0 or length < 0 or offset + length > info.st_size:
                raise CorruptCheckpointError(_short(where, name, offset, length, info.st_size))

        def one(index: int) -> bytes:
            offset, length = ranges[index]
            view = memoryview(bytearray(length)) if buffers is None else _byte_views(buffers[index])[0]
            if view.nbytes != length:
                raise ValueError(f"{where}: the buffer for bytes [{offset}, {offset + length}) of {name} holds "
                                 f"{view.nbytes:,} bytes, not {length:,}")
            if buffers is None and length:
                first = os.pread(fd, length, offset)  # (no copy: pread makes the bytes returned)
                if len(first) == length:
                    return first
                view[:len(first)] = first
                done = len(first)
            else:
                done = 0
            while done < length:
                got = os.preadv(fd, [view[done:]], offset + done)
                if got == 0:  # truncated since the fstat
                    raise CorruptCheckpointError(_short(where, name, offset, length, offset + done))
                done += got
            return bytes(view) if buffers is None else b""

        indices = list(range(len(ranges)))
        try:
            if sum(length for _, length in ranges) <= settings().inline_bytes or len(ranges) == 1:
                out = [one(i) for i in indices]
            else:
                out = map_kept("pack-read", settings().io_threads, one, indices)
        except OSError as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            raise StorageError(user_paths(f"{where}: reading {name} failed: {e}")) from e
    finally:
        os.close(fd)
    return out if buffers is None else []


def read_object_ranges(store: ts.KvStore, name: str, ranges: Sequence[tuple[int, int]], where: object,
                       buffers: Sequence[memoryview] | None = None) -> list[bytes]:
    """The ``(offset, length)`` ranges of the pack object ``name`` in ``store`` (the checkpoint's prefix): one ranged
    GET each, all issued at once (the store's context bounds the requests in flight and retries failed ones); copied
    into ``buffers`` where given, then ``[]`` is returned."""
    _check_name(name, where)
    if buffers is not None and len(buffers) != len(ranges):
        raise ValueError(f"{where}: {len(ranges)} ranges of {name} but {len(buffers)} buffers to read them into")
    for offset, length in ranges:
        if offset < 0 or length < 0:
            raise CorruptCheckpointError(_short(where, name, offset, length, None))
    try:
        pending = [store.read(name, byte_range=slice(offset, offset + length)) for offset, length in ranges]
    except Exception as e:
        raise StorageError(f"{where}: reading {name} failed: {e}") from e
    out: list[bytes] = []
    for index, ((offset, length), future) in enumerate(zip(ranges, pending, strict=True)):
        try:
            result = future.result()
        except Exception as e:
            if "OUT_OF_RANGE" in str(e):  # TensorStore's answer to a range past the object's end
                raise CorruptCheckpointError(_short(where, name, offset, length, None)) from None
            raise StorageError(f"{where}: reading bytes [{offset}, {offset + length}) of {name} failed: {e}") from e
        if result.state != "value":
            raise CorruptCheckpointError(_missing(where, name))
        value = result.value
        if len(value) != length:
            raise CorruptCheckpointError(_short(where, name, offset, length, offset + len(value)))
        if buffers is None:
            out.append(value)
        else:
            target = _byte_views(buffers[index])[0]
            if target.nbytes != length:
                raise ValueError(f"{where}: the buffer for bytes [{offset}, {offset + length}) of {name} holds "
                                 f"{target.nbytes:,} bytes, not {length:,}")
            target[:] = value
    return out


# --- helpers ------------------------------------------------------------------------------------------------------


def _byte_views(data: PackData) -> list[memoryview]:
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


def _check_name(name: str, where: object) -> None:
    """Refuse a pack name (from a checkpoint's table: untrusted) that is not plain segments below the root."""
    if not name or name.startswith("/") or "\\" in name or "\x00" in name or \
            any(s in ("", ".", "..") for s in name.split("/")):
        raise FormatError(f"{where}: {name!r} is not the name of a pack file inside the checkpoint; the checkpoint "
                          "is damaged or crafted")


def _missing(where: object, name: str) -> str:
    return user_paths(f"{where}: pack {name} is missing; the checkpoint is damaged (its chunks are in that pack): "
                      "restore the pack from a copy, or save again")


def _short(where: object, name: str, offset: int, length: int, size: int | None) -> str:
    held = f" (it holds {size:,} bytes)" if size is not None else ""
    return user_paths(f"{where}: pack {name} is shorter than its table says: bytes [{offset:,}, {offset + length:,}) "
                      f"are past its end{held}; the checkpoint is damaged (a truncated pack): restore the pack from a "
                      "copy, or save again")


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
