"""Durability and atomic renames for local saves (Linux fast paths, portable fallbacks): ``fsync`` of what a save
wrote, ``renameat2`` with ``RENAME_NOREPLACE`` and ``RENAME_EXCHANGE`` (spec §9.1 steps 5 and 6).
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
import uuid
from pathlib import Path

from .._io.pools import map_kept
from .._settings import settings
from .base import TEMP_MARKER

__all__ = ["exchange", "fsync_dir", "make_durable", "rename_noreplace"]

# The symbols of the process, libc's among them: ``ctypes.util.find_library("c")`` would ask ``ldconfig`` (a few
# milliseconds of every process's first save or load).
_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2


def _renameat2(src: Path, dst: Path, flags: int) -> int:
    """``renameat2(2)``; returns 0 or the errno (ENOSYS/EINVAL where unsupported)."""
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return errno.ENOSYS
    rc = fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), ctypes.c_uint(flags))
    return 0 if rc == 0 else ctypes.get_errno()


def rename_noreplace(src: Path, dst: Path) -> bool:
    """Rename ``src`` to ``dst`` only if ``dst`` does not exist; False if it does."""
    err = _renameat2(src, dst, _RENAME_NOREPLACE)
    if err == 0:
        return True
    if err == errno.EEXIST:
        return False
    if err not in (errno.ENOSYS, errno.EINVAL):
        raise OSError(err, os.strerror(err), str(dst))
    if dst.exists():
        return False
    os.rename(src, dst)
    return True


def exchange(new: Path, old: Path) -> None:
    """Atomically swap two directories where the OS can; otherwise two renames (a short gap)."""
    err = _renameat2(new, old, _RENAME_EXCHANGE)
    if err == 0:
        return
    if err not in (errno.ENOSYS, errno.EINVAL):
        raise OSError(err, os.strerror(err), str(old))
    aside = old.parent / f".{old.name}{TEMP_MARKER}old-{uuid.uuid4().hex[:8]}"  # found by gc if we crash
    os.rename(old, aside)
    os.rename(new, old)
    os.rename(aside, new)


def fsync_dir(path: Path) -> None:
    _fsync_path(str(path))


def make_durable(root: Path) -> None:
    """Sync everything written below ``root`` to disk: ``fsync`` of every file and every directory there, 16 at a time.

    Not ``syncfs``, which is one call but waits for every writer on the filesystem (logs, other jobs, a data
    loader's cache), and not an fsync by each writer thread right after its file (each one a journal commit of its
    own, entangled with the other writers' data on ext4's ordered mode). Concurrent fsyncs share journal commits.
    Measured on ext4, 512 MiB in 32 tensors, beside a process writing 1.5 GB files in a loop: ``syncfs`` 1.62 s,
    an fsync per file by its writer 1.90 s, this 1.04–1.06 s, DCP 1.19–1.20 s; with nothing else writing 0.46–0.49
    s (``syncfs`` 0.52–0.54 s), DCP 0.61–0.74 s. The same on every platform. Files and directories are synced
    together, in no order: the save is published (renamed) only after every one of them is durable, so none has to
    come first, and one round shares the journal's commits (a 1 MiB save on ext4: 2.0 ms, files then directories
    2.5 ms).
    """
    if _memory_backed(root):
        return  # tmpfs, ramfs: nothing outlives a power loss there, and their fsync does nothing but cost a syscall
    files: list[str] = []
    directories: list[str] = []
    for directory, _, names in os.walk(root):
        directories.append(directory)
        files.extend(os.path.join(directory, name) for name in names)
    map_kept("fsync", settings().fsync_threads, _fsync_path, files + directories)  # kept: 16 new ones cost ~1 ms




_MEMORY_FILESYSTEMS = (0x01021994, 0x858458F6)  # TMPFS_MAGIC, RAMFS_MAGIC (linux/magic.h)


def _memory_backed(path: Path) -> bool:
    """Whether ``path`` is on a filesystem held in memory (Linux ``statfs``; elsewhere, or if it fails: no). Walking
    and fsyncing thousands of files there costs ~0.1 s a save for nothing."""
    statfs = getattr(_libc, "statfs", None) if sys.platform.startswith("linux") else None
    if statfs is None:
        return False
    buffer = ctypes.create_string_buffer(256)  # struct statfs; f_type, a native long, comes first
    if statfs(os.fsencode(path), buffer) != 0:
        return False
    return ctypes.c_long.from_buffer(buffer).value in _MEMORY_FILESYSTEMS


def _fsync_path(path: str) -> None:
    """fsync one file or directory; one gone since it was listed is skipped (another rank's writer, sharing the
    directory, removes its own temporary files, e.g. TensorStore's ``.__lock``: nothing of this save to fsync)."""
    try:  # never through a link, never blocking on a FIFO: only what the save wrote itself is there to fsync
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP):
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # (a special file, which no save writes: nothing to fsync)
            raise
    finally:
        os.close(fd)
