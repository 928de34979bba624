"""arrayckpt's own files in a local directory: finding them without following links, removing only them.

Used where a directory's contents must be judged or removed file by file (``LocalLocation.delete``, and the
incomplete step checkpoints that :func:`arrayckpt._storage.gc.incomplete_leftovers` finds), so that nothing
that is not arrayckpt's, nor anything a link points to, is ever removed.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path

from .._errors import CorruptCheckpointError
from .._format.marker import MARKER, MARKER_NAME, is_marker
from .._format.packs import PACK_PREFIX, REFS_NAME
from .._io.smallfiles import check_no_links, forget_pin, remember_pin
from .base import ROOT_METADATA, arrayckpt_keys
from .renames import fsync_dir

__all__ = ["directory_files", "holds_marker", "pin_directory", "remove_arrayckpt_files", "remove_marker",
           "write_marker_file", "write_references_file"]


def write_marker_file(path: Path, fsync: bool) -> None:
    """Write the DCP marker (spec §2.1) into the checkpoint directory ``path``: beside, then renamed into place (a
    reader never sees part of it), durable before it returns with ``fsync``. A ``.metadata`` there that is not
    arrayckpt's (DCP's own, of a DCP checkpoint the save was committed beside) is left as it is, and so is a link."""
    if os.path.lexists(path / MARKER_NAME) and not holds_marker(path):
        return
    temporary = path / f"{MARKER_NAME}.tmp"
    temporary.unlink(missing_ok=True)
    _replace_whole(temporary, path / MARKER_NAME, MARKER, fsync)


def _replace_whole(temporary: Path, target: Path, data: bytes, fsync: bool) -> None:
    """``data`` written to the new file ``temporary`` (never through a link; removed on failure), then renamed over
    ``target``, so a reader sees the old file or the whole new one; durable before it returns with ``fsync``."""
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(target.parent)


def write_references_file(path: Path, data: bytes, fsync: bool, where: str) -> None:
    """Replace ``refs.json`` of the packed checkpoint directory ``path`` by ``data``, atomically: written to a new
    file in its ``packs`` folder (a name arrayckpt owns there, so that one left by a killed process goes with the
    checkpoint), then renamed into place; durable before it returns with ``fsync``. A link at ``packs`` or
    ``refs.json`` is refused, never followed or replaced (spec §12); ``where`` names the checkpoint in errors."""
    for name in (PACK_PREFIX.rstrip("/"), REFS_NAME):
        check_no_links(str(path), name, where)
    if not (path / PACK_PREFIX).is_dir():
        raise CorruptCheckpointError(f"{where}: the checkpoint has no {PACK_PREFIX} folder, so it is not packed "
                                     "(or lost its packs): it has no references to write")
    _replace_whole(path / f"{PACK_PREFIX}refs-{secrets.token_hex(8)}.tmp", path / REFS_NAME, data, fsync)


def remove_marker(path: Path) -> None:
    """Remove the DCP marker (spec §2.1) of the checkpoint directory ``path`` when the file there is arrayckpt's
    marker, byte for byte (a ``.metadata`` of DCP's own, saved beside, is not arrayckpt's to remove); never through
    a link."""
    if holds_marker(path):
        (path / MARKER_NAME).unlink(missing_ok=True)


def holds_marker(path: Path) -> bool:
    """Whether ``path/.metadata`` is a regular file (not a link) holding arrayckpt's marker, byte for byte."""
    try:
        fd = os.open(path / MARKER_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # none, or a link (not arrayckpt's)
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and is_marker(os.read(fd, len(MARKER) + 1))
    finally:
        os.close(fd)


def directory_files(path: Path) -> tuple[list[str], float, str | None]:
    """What is below the directory ``path``, never following links: the regular files (relative POSIX paths),
    the newest modification time (of them and the directories), and the first entry that is neither a regular
    file nor a directory (a link, a FIFO, ...; ``None`` if there is none)."""
    keys: list[str] = []
    newest = path.lstat().st_mtime
    odd: str | None = None
    for directory, dirnames, files in os.walk(path):
        for name in (*dirnames, *files):
            full = os.path.join(directory, name)
            try:
                info = os.lstat(full)
            except FileNotFoundError:
                continue
            relative = os.path.relpath(full, path).replace(os.sep, "/")
            newest = max(newest, info.st_mtime)
            if stat.S_ISREG(info.st_mode):
                keys.append(relative)
            elif not stat.S_ISDIR(info.st_mode) and odd is None:
                odd = relative
    return sorted(keys), newest, odd


def remove_arrayckpt_files(path: Path) -> bool:
    """Remove arrayckpt's files below the directory ``path`` (``arrayckpt_keys``: chunks first, then the
    ``zarr.json`` documents, deepest first, so a removal cut short still shows whose files are left), then every
    directory left empty, ``path`` included. Anything else stays. Returns whether ``path`` is gone."""
    if path.is_symlink() or not path.is_dir():
        return not os.path.lexists(path)
    keys, _, _ = directory_files(path)
    ours = arrayckpt_keys(keys)
    chunks = [k for k in ours if k.rpartition("/")[2] != ROOT_METADATA]
    documents = sorted((k for k in ours if k.rpartition("/")[2] == ROOT_METADATA), key=lambda k: -k.count("/"))
    for key in (*chunks, *documents):
        try:
            os.unlink(path / key)
        except FileNotFoundError:
            pass
    for directory, _, _ in sorted(os.walk(path), key=lambda entry: -entry[0].count(os.sep)):
        try:
            os.rmdir(directory)
        except OSError:  # not empty: something that is not arrayckpt's is in it
            pass
    return not os.path.lexists(path)


def pin_directory(path: Path) -> tuple[str, Callable[[], None]]:
    """A path that keeps naming the directory ``path`` names now, and a function that releases it.

    Readers use it so that the root document and every chunk come from the same checkpoint even if the
    path is overwritten meanwhile (an overwrite swaps directories): on Linux, ``/proc/self/fd/N`` of an open
    directory. Elsewhere (or when ``path`` is no directory) it is just ``path``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return str(path), lambda: None
    pinned = f"/proc/self/fd/{fd}"
    if not os.path.isdir(pinned):
        os.close(fd)
        return str(path), lambda: None
    remember_pin(pinned, str(path))  # error messages name ``path``, not the pin

    def release() -> None:
        forget_pin(pinned)
        os.close(fd)

    return pinned, release
