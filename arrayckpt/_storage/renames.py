"""Durability and atomic renames for local saves (Linux fast paths, portable fallbacks): ``syncfs``, ``renameat2``
with ``RENAME_NOREPLACE`` and ``RENAME_EXCHANGE`` (spec §9.1 steps 5 and 6).
"""

from __future__ import annotations

import ctypes
import errno
import os
import uuid
from pathlib import Path

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
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_durable(root: Path) -> None:
    """Flush everything written below ``root``: one ``syncfs`` on Linux, else fsync file by file.

    TensorStore is told not to fsync each chunk (``file_io_sync: false``); one filesystem-wide flush
    before the commit rename is far cheaper than thousands of per-file fsyncs.
    """
    fd = os.open(root, os.O_RDONLY)
    try:
        syncfs = getattr(_libc, "syncfs", None)
        if syncfs is not None and syncfs(fd) == 0:
            return
    finally:
        os.close(fd)
    for directory, _, files in os.walk(root):
        for name in files:
            file_fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(file_fd)
            finally:
                os.close(file_fd)
        fsync_dir(Path(directory))
