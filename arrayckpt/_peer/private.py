"""A memory directory only this job's user can change: made with mode 0700, checked on every open.

The memory tier's directory lives in shared memory (``/dev/shm``), which every local user can write to, under a
name others can predict (so that a restarted job finds its memory again). Whoever can change it could plant a step
that a restore loads, or a link that makes a memory save overwrite another file. So it is trusted only when the
directory itself is a real directory (not a link) owned by this process's user and writable by nobody else, and
every directory above it (the path as resolved) is owned by root or this user and writable by nobody else unless
sticky (``/dev/shm``, ``/tmp``: others cannot rename or remove what is ours there). Anything else is refused with
:class:`UntrustedDirectoryError`, naming the directory, its owner and mode, and the fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .._errors import UntrustedDirectoryError

__all__ = ["check_private", "make_private"]


def make_private(directory: Path) -> None:
    """Create ``directory`` (and missing parents) with mode 0700, then :func:`check_private` it."""
    missing = []
    for level in (directory, *directory.parents):
        if os.path.lexists(level):
            break
        missing.append(level)
    for level in reversed(missing):
        try:
            os.mkdir(level, 0o700)
        except FileExistsError:
            pass  # made meanwhile (another rank of this node): checked below like any other
        except OSError as e:
            _check_above(level)  # a directory above that is another user's says more than EACCES
            raise UntrustedDirectoryError(f"{level}: cannot create the peer-memory directory ({e.strerror}); pass "
                                          "PeerMemory(directory=...) a directory of yours") from None
    check_private(directory)


def check_private(directory: Path) -> None:
    """Refuse ``directory`` unless only this user (and root) can change it or anything above it (module docstring)."""
    me = os.geteuid()
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        raise UntrustedDirectoryError(f"{directory}: the peer-memory directory is gone (removed while the job "
                                      "ran?)") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UntrustedDirectoryError(f"{directory}: the peer-memory directory is {_kind(info.st_mode)}, not a "
                                      "directory; arrayckpt never follows a link there: remove it, or pass "
                                      "PeerMemory(directory=...) the directory it names")
    if info.st_uid != me or info.st_mode & 0o022:
        raise UntrustedDirectoryError(f"{directory}: the peer-memory directory {_described(info)}, but must be "
                                      f"yours (uid {me}) and writable by you alone: another user could plant a "
                                      "step that a restore loads; remove it (or chmod go-w it if it is yours), or "
                                      "pass PeerMemory(directory=...) a private directory")
    _check_above(directory)


def _check_above(directory: Path) -> None:
    """Refuse ``directory`` when a directory above it (as resolved) is another user's or writable by others without
    being sticky."""
    me = os.geteuid()
    for parent in Path(os.path.realpath(directory.parent)).joinpath("x").parents:
        above = os.stat(parent)
        open_to_others = above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX
        if above.st_uid not in (0, me) or open_to_others:
            raise UntrustedDirectoryError(f"{directory}: a directory above it, {parent}, {_described(above)}: "
                                          "another user could replace the peer-memory directory; pass "
                                          "PeerMemory(directory=...) a directory below ones only you or root can "
                                          "change")


def _described(info: os.stat_result) -> str:
    return f"is owned by uid {info.st_uid} with mode {stat.filemode(info.st_mode)}"


def _kind(mode: int) -> str:
    return "a symbolic link" if stat.S_ISLNK(mode) else "not a directory"
