"""Small files read whole — a ``--config``, a ``--param-names`` list, a checkpoint's metadata documents — as regular
files of bounded size only: a name the user typed (``/dev/zero``, a FIFO) or a file a hostile checkpoint holds (a
sparse file claiming gigabytes) must end in a clear error, not a read that blocks forever or exhausts memory.

Files inside a checkpoint are also reached without following a link (:func:`read_checkpoint_file`,
:func:`check_no_links`: spec §12), and errors name the user's path, not a pinned ``/proc/self/fd/N``
(:func:`user_paths`). No torch, numpy or TensorStore here (the command line's argument checks use it).
"""

from __future__ import annotations

import errno
import os
import re
import stat
from typing import BinaryIO

from .._errors import CorruptCheckpointError, FormatError

__all__ = ["DOCUMENT_LIMIT", "USER_FILE_LIMIT", "check_no_links", "check_user_file", "first_link", "forget_pin",
           "open_nonblocking", "read_bounded", "read_checkpoint_file", "read_regular_file", "read_user_file",
           "remember_pin", "user_paths"]

USER_FILE_LIMIT = 64 << 20  # a config.json or a list of parameter names: far below this
DOCUMENT_LIMIT = 1 << 30  # a checkpoint's metadata document: far above any real one, far below a crafted one


def read_bounded(file: BinaryIO, limit: int) -> bytes | None:
    """The whole of the open regular ``file``, or ``None`` when it holds more than ``limit`` bytes (its size is
    checked before anything is read, so a sparse file claiming terabytes costs nothing)."""
    size = os.fstat(file.fileno()).st_size
    if size > limit:
        return None
    data = file.read(size)  # as much memory as the file holds (``read(limit)`` would take ``limit`` at once)
    while len(data) <= limit:  # a file that grew since fstat: read on, in pieces, up to the limit
        more = file.read(min(1 << 20, limit + 1 - len(data)))
        if not more:
            break
        data += more
    return None if len(data) > limit else data


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words, for the error that refuses it."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a pipe (FIFO)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a socket or other special file"


def _open_user_file(path: str | os.PathLike[str], what: str, limit: int) -> int:
    """A read descriptor of the regular file ``path`` of at most ``limit`` bytes (opened without blocking, so that a
    FIFO is refused rather than waited on); ``FormatError`` naming ``path`` and ``what`` otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a link the user names is the user's choice: followed
    except OSError as e:
        raise FormatError(f"{os.fspath(path)}: cannot read {what}: {e.strerror or e}") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(info.st_mode):
        problem = f"is {_kind(info.st_mode)}, not a regular file"
    elif info.st_size > limit:
        problem = f"holds {info.st_size:,} bytes, more than the {limit:,} that {what} may have"
    if problem is not None:
        os.close(fd)
        raise FormatError(f"{os.fspath(path)}: {problem}; name the file that holds {what}")
    return fd


def check_user_file(path: str | os.PathLike[str], what: str, limit: int = USER_FILE_LIMIT) -> None:
    """Refuse ``path`` unless it is a regular file of at most ``limit`` bytes, before another part reads it whole
    (``what``: what it should hold, for the error)."""
    os.close(_open_user_file(path, what, limit))


def read_user_file(path: str | os.PathLike[str], what: str, limit: int = USER_FILE_LIMIT) -> bytes:
    """The bytes of a small file the user named (``--config``, ``--param-names``): a regular file of at most
    ``limit`` bytes, else a ``FormatError`` naming it and ``what`` it should hold."""
    fd = _open_user_file(path, what, limit)
    with open(fd, "rb") as file:
        data = read_bounded(file, limit)
    if data is None:
        raise FormatError(f"{os.fspath(path)}: grew past {limit:,} bytes while being read; name the file that "
                          f"holds {what}")
    return data


# Directories readers pinned (``_storage/files.py::pin_directory``: ``/proc/self/fd/N``) and the paths they were
# opened as, so that error messages name the user's path instead of the pin.
_PINS: dict[str, str] = {}
_PIN = re.compile(r"/proc/self/fd/\d+(?!\d)")


def remember_pin(pinned: str, path: str) -> None:
    """Record that ``pinned`` (``/proc/self/fd/N``) stands for ``path`` until :func:`forget_pin`."""
    _PINS[pinned] = path


def forget_pin(pinned: str) -> None:
    """Forget a pin (call it before closing the descriptor, whose number another pin may take next)."""
    _PINS.pop(pinned, None)


def read_regular_file(path: str | os.PathLike[str], name: str, follow: bool = True,
                      limit: int = DOCUMENT_LIMIT) -> bytes:
    """The bytes of a (metadata) file, refusing anything but a regular file of at most ``limit`` bytes: a FIFO in a
    hostile checkpoint would block a plain read forever, a huge (sparse) file exhaust memory. Opened without blocking,
    checked with ``fstat``; ``name`` names it in the error. ``follow=False``: a symbolic link at ``path`` is refused
    too (:func:`read_checkpoint_file`)."""
    fd = open_nonblocking(path, follow, name)
    try:
        mode = os.fstat(fd).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # reading a directory raises IsADirectoryError below
            raise CorruptCheckpointError(f"{name} is not a regular file (a pipe or device in its place); the "
                                         "checkpoint is damaged: remove it, or restore the file")
        with open(fd, "rb", closefd=False) as file:
            data = read_bounded(file, limit)
        if data is None:
            raise CorruptCheckpointError(f"{name} holds more than {limit:,} bytes, more than such a file ever holds; "
                                         "the checkpoint is damaged or crafted: restore the file")
        return data
    finally:
        os.close(fd)


def check_no_links(root: str, relative: str, where: str) -> None:
    """Refuse a symbolic link at any level of ``relative`` below the checkpoint directory ``root`` (which may be one:
    the user's choice); stop quietly at the first level that does not exist (whoever reads it reports that). A
    checkpoint holds directories and regular files only (spec §12): a link inside one could name any file of this
    machine, which a reader would read and ``copy`` would write elsewhere. One ``lstat`` per segment, lexically."""
    link = first_link(root, relative)
    if link is not None:
        raise CorruptCheckpointError(user_paths(f"{where}: {link} {_LINK}"))


def first_link(root: str, relative: str) -> str | None:
    """The first path from ``root`` down ``relative`` (segment by segment, lexically) that is a symbolic link;
    ``None`` when there is none down to the first level that does not exist. ``root`` itself is not looked at."""
    path = root.rstrip("/")
    for segment in relative.split("/"):
        if not segment:
            continue
        path = f"{path}/{segment}"
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return None
        if stat.S_ISLNK(mode):
            return path
    return None


def read_checkpoint_file(root: str, relative: str, name: str) -> bytes:
    """The bytes of the regular file ``relative`` below the checkpoint directory ``root``, reached without following
    a link at any level below ``root`` (``FileNotFoundError`` when it is absent); ``name`` names it in errors."""
    check_no_links(root, relative.rpartition("/")[0], name)
    return read_regular_file(f"{root.rstrip('/')}/{relative}", name, follow=False)


_LINK = ("is a symbolic link; arrayckpt never follows a link inside a checkpoint (one from an untrusted source could "
         "name any file of this machine): replace it by what it points to")


def open_nonblocking(path: str | os.PathLike[str], follow: bool, name: str) -> int:
    """A non-blocking read descriptor of ``path``; without ``follow``, a symbolic link there is damage."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise CorruptCheckpointError(user_paths(f"{name} {_LINK}")) from None
        raise


def user_paths(text: str) -> str:
    """``text`` (an error message) with every pinned directory replaced by the path it was opened as."""
    if "/proc/self/fd/" not in text:
        return text
    return _PIN.sub(lambda m: _PINS.get(m.group(0), m.group(0)), text)
