"""Memory directories of ended jobs, removed whole or not at all (``gc --memory``, ``CheckpointManager.clean_up``).

A memory directory is removed only when it is this user's, no live manager holds its ``node.json`` (every rank of
a live job holds a shared ``flock`` on it), nothing in it was written for the minimum age, and everything in it is
arrayckpt's; otherwise nothing in it is touched and the caller is told why. Nothing is followed through a link.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .._storage.base import arrayckpt_keys
from .._storage.files import directory_files, remove_arrayckpt_files
from .node import NODE_FILE, is_own_file, is_regular, is_step_name, last_written

__all__ = ["Swept", "ended_memory_directories", "remove_memory_directory"]


@dataclass(frozen=True)
class Swept:
    """What a sweep of memory directories did: the ones removed (or, on a dry run, that would be), and the ones of
    ended jobs kept, with why (``gc`` says so)."""

    removed: list[str]
    kept: list[tuple[str, str]]


def ended_memory_directories(parent: Path, min_age_s: float, remove: bool) -> Swept:
    """The memory directories of ended jobs right below ``parent`` (see :func:`remove_memory_directory`), removed
    when ``remove`` (else only judged: ``gc --dry-run`` says exactly what a run would do); a live job's (its ranks
    hold ``node.json``) never."""
    try:
        children = sorted(parent.iterdir())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return Swept([], [])
    removed, kept = [], []
    for child in children:
        if not is_regular(child / NODE_FILE):
            continue  # not a memory directory (or one reached through a link: never followed)
        why = remove_memory_directory(child, min_age_s, dry_run=not remove)
        if why is None:
            removed.append(str(child))
        elif why:
            kept.append((str(child), why))
    return Swept(removed, kept)


def remove_memory_directory(directory: Path, min_age_s: float, dry_run: bool = False) -> str | None:
    """Remove a memory directory of an ended job: one of this user's, with arrayckpt's ``node.json`` that no live
    manager holds (its shared ``flock``), where nothing was written for ``min_age_s``, and that holds nothing but
    arrayckpt's files (node.json, step records, step trees of chunk files and documents). All or nothing: a
    directory holding anything else is left untouched. ``None`` when it was removed (with ``dry_run``: when it would
    be; nothing is removed); else why it stays: ``""`` for a live or recent job's (nothing to report), a sentence
    otherwise."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return ""
    if not stat.S_ISDIR(info.st_mode):
        return "not a directory (a link?): never followed"
    if info.st_uid != os.geteuid():
        return f"owned by uid {info.st_uid}, not by you: another user's memory directory is never touched"
    with _exclusive(directory / NODE_FILE) as free:
        if not free or last_written(directory, time.time()) < min_age_s:
            return ""
        foreign = _first_foreign(directory)
        if foreign is not None:
            return f"holds {foreign!r}, which is not arrayckpt's: nothing in it was removed"
        if dry_run:
            return None
        for name in sorted(os.listdir(directory)):
            if is_step_name(name):
                remove_arrayckpt_files(directory / name)
            elif name != NODE_FILE:
                (directory / name).unlink(missing_ok=True)
        (directory / NODE_FILE).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        directory.rmdir()
    return None if not os.path.lexists(directory) else "could not be removed whole (written to meanwhile?)"


def _first_foreign(directory: Path) -> str | None:
    """The first entry below a memory directory that is not arrayckpt's (``None``: all are), never following a link:
    ``node.json``, step records and their temporary files (regular files), and step directories holding only
    regular files named as arrayckpt names its files (chunk keys, ``zarr.json``)."""
    for name in sorted(os.listdir(directory)):
        mode = os.lstat(directory / name).st_mode
        if name == NODE_FILE or is_own_file(name):
            if not stat.S_ISREG(mode):
                return name
        elif is_step_name(name) and stat.S_ISDIR(mode):
            keys, _, odd = directory_files(directory / name)
            if odd is not None:
                return f"{name}/{odd}"
            foreign = sorted(set(keys) - set(arrayckpt_keys(keys)))
            if foreign:
                return f"{name}/{foreign[0]}"
        else:
            return name
    return None


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[bool]:
    """Whether nobody holds ``path`` (an exclusive ``flock`` taken without waiting), held for the block."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)
