"""Reading packs (issue 35): ranges of a rank's pack file or object, for the locations' ``read_pack`` and
``read_pack_into`` (``packs.py`` writes them). A pack's name and ranges come from a checkpoint's table, untrusted: a
name that leaves the checkpoint is ``FormatError``, a missing or short pack ``CorruptCheckpointError`` naming both."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from .._errors import CorruptCheckpointError, FormatError, StorageError
from .._io.pools import map_kept
from .._io.smallfiles import check_no_links, open_nonblocking, user_paths
from .._settings import settings
from .packs import byte_views

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["read_file_ranges", "read_object_ranges"]


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
            view = memoryview(bytearray(length)) if buffers is None else byte_views(buffers[index])[0]
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
    """The ``(offset, length)`` ranges of the pack object ``name`` in ``store`` (the checkpoint's prefix), copied into
    ``buffers`` where given (then ``[]`` is returned). Ranges at most ``pack_read_gap_bytes`` apart are read by one
    ranged GET (of at most ``object_part_bytes``), and every GET is issued at once: the store's context bounds the
    requests in flight and retries failed ones."""
    _check_name(name, where)
    if buffers is not None and len(buffers) != len(ranges):
        raise ValueError(f"{where}: {len(ranges)} ranges of {name} but {len(buffers)} buffers to read them into")
    for offset, length in ranges:
        if offset < 0 or length < 0:
            raise CorruptCheckpointError(_short(where, name, offset, length, None))
    values = _get_ranges(store, name, ranges, _requests(ranges, settings().pack_read_gap_bytes,
                                                         settings().object_part_bytes), where)
    if buffers is None:
        return [bytes(value) for value in values]
    for (offset, length), value, buffer in zip(ranges, values, buffers, strict=True):
        target = byte_views(buffer)[0]
        if target.nbytes != length:
            raise ValueError(f"{where}: the buffer for bytes [{offset}, {offset + length}) of {name} holds "
                             f"{target.nbytes:,} bytes, not {length:,}")
        target[:] = value
    return []


class _Request(NamedTuple):
    """One ranged GET: bytes [start, end) of a pack, covering the ranges at ``indices``."""

    start: int
    end: int
    indices: list[int]


def _requests(ranges: Sequence[tuple[int, int]], gap: int, largest: int) -> list[_Request]:
    """``ranges`` in ranged GETs: sorted by offset, a range joins the previous GET when it starts at most ``gap`` bytes
    after its end and the GET stays within ``largest`` bytes (``gap < 0``: one GET per range)."""
    out: list[_Request] = []
    for index in sorted(range(len(ranges)), key=lambda i: ranges[i][0]):
        offset, length = ranges[index]
        end = offset + length
        if out and gap >= 0 and offset - out[-1].end <= gap and max(end, out[-1].end) - out[-1].start <= largest:
            out[-1] = _Request(out[-1].start, max(end, out[-1].end), [*out[-1].indices, index])
        else:
            out.append(_Request(offset, end, [index]))
    return out


def _get_ranges(store: ts.KvStore, name: str, ranges: Sequence[tuple[int, int]], requests: list[_Request],
                where: object) -> list[bytes | memoryview]:
    """The bytes of each range (views of what the GETs returned), refusing a missing or short pack."""
    try:
        pending = [store.read(name, byte_range=slice(r.start, r.end)) for r in requests]
    except Exception as e:
        raise StorageError(f"{where}: reading {name} failed: {e}") from e
    out: list[bytes | memoryview] = [b""] * len(ranges)
    for request, future in zip(requests, pending, strict=True):
        try:
            result = future.result()
        except Exception as e:
            if "OUT_OF_RANGE" not in str(e):
                raise StorageError(f"{where}: reading bytes [{request.start}, {request.end}) of {name} failed: "
                                   f"{e}") from e
            if len(request.indices) == 1:  # TensorStore's answer to a range past the object's end
                offset, length = ranges[request.indices[0]]
                raise CorruptCheckpointError(_short(where, name, offset, length, None)) from None
            # a merged GET passed the end: its ranges one by one, to name the one that does
            singles = [_Request(ranges[i][0], sum(ranges[i]), [i]) for i in request.indices]
            for index, value in zip(request.indices, _get_ranges(store, name, ranges, singles, where), strict=True):
                out[index] = value
            continue
        if result.state != "value":
            raise CorruptCheckpointError(_missing(where, name))
        value = memoryview(result.value)
        for index in request.indices:
            offset, length = ranges[index]
            piece = value[offset - request.start:offset - request.start + length]
            if piece.nbytes != length:
                raise CorruptCheckpointError(_short(where, name, offset, length, request.start + value.nbytes))
            out[index] = result.value if piece.nbytes == value.nbytes else piece  # (no copy of a whole GET)
    return out


# --- helpers ------------------------------------------------------------------------------------------------------


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
