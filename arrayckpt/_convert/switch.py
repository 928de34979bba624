"""Putting an export in place as local saves put a checkpoint there (``_storage/local.py``): written aside, made
durable, then switched in, so that a kill at any instant leaves the old export or the new one, never a mix of both.

The new files are written into a hidden directory ``.<name>.arrayckpt-tmp-<12 hex>`` (:func:`held_temporary`),
held (``flock``) by the running export as a save holds its own, so that ``arrayckpt gc`` on the directory holding it
removes it once its export was killed, and never while the export runs; a rerun of the same export removes it too.
Then either a whole directory is switched in (:func:`switch_directory`: Megatron, a new DeepSpeed target), or the
files are moved into a directory holding files of the user's (:func:`switch_files`: Hugging Face, whose
``hf.py`` says which states a kill can leave).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import uuid
from collections.abc import Collection, Iterator
from pathlib import Path

from .._errors import StorageError
from .._storage.base import TEMP_MARKER
from .._storage.liveness import create_held_directory
from .._storage.local import NEW_MARKER, LocalLeftover, LocalLocation
from .._storage.renames import exchange, fsync_dir, make_durable, rename_noreplace

__all__ = ["clean_leftovers", "held_temporary", "switch_directory", "switch_files", "switched_path"]

_ATTEMPTS = 100  # a gc without the minimum age may remove a fresh temporary directory before its lock: take another


def clean_leftovers(parent: Path, name: str) -> None:
    """Remove the temporary directories that killed exports to ``parent/name`` left (``.<name>.arrayckpt-tmp-*``),
    as gc removes them, but at any age: never one a live export holds (its lock). One just made and not locked yet
    may go too: its export sees that and takes another (``create_held_directory``)."""
    if not parent.is_dir():
        return
    for path in parent.glob(f".{glob.escape(name)}{TEMP_MARKER}*"):
        if path.is_dir():
            LocalLeftover(LocalLocation(path), 0.0).remove()


@contextlib.contextmanager
def held_temporary(parent: Path, name: str) -> Iterator[Path]:
    """A new hidden directory in ``parent`` (created, with its parents) to write the export ``parent/name`` into,
    held for the block and removed after it, whatever happens (once switched in, it holds the old export or
    nothing). The leftovers of earlier killed exports to the same name are removed first."""
    parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(parent, name)
    for _ in range(_ATTEMPTS):
        temporary = parent / f".{name}{TEMP_MARKER}{uuid.uuid4().hex[:12]}"
        hold = create_held_directory(temporary, NEW_MARKER)
        if hold is not None:
            break
    else:
        raise StorageError(f"{parent / name}: the export's temporary directory was removed {_ATTEMPTS} times as soon "
                           "as it was made (a gc without the minimum age is running); try again")
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        hold.release()


def switched_path(target: Path) -> Path:
    """The absolute path a directory export switches: where a link at ``target`` points (as a save to a link saves
    there), since the exchange would swap the link itself away."""
    return Path(os.path.realpath(target)) if target.is_symlink() else target.absolute()


def switch_directory(temporary: Path, target: Path) -> None:
    """The directory written in ``temporary``, made durable, in place at ``target`` in one step: renamed there when
    nothing (or an empty directory) is there, else exchanged with what is (``temporary`` then holds the old one,
    which :func:`held_temporary` removes)."""
    make_durable(temporary)
    if not rename_noreplace(temporary, target):
        if target.is_dir() and not any(target.iterdir()):
            target.rmdir()
            os.rename(temporary, target)
        else:
            exchange(temporary, target)
    fsync_dir(target.parent)


def switch_files(temporary: Path, target: Path, commit: str, entries: Collection[str], old: Collection[str]) -> None:
    """Move the files written in ``temporary`` into the directory ``target``, ``commit`` (the file that makes them a
    whole export) last, then remove ``old`` (the earlier export's files) that no new file replaced.

    ``entries`` are the names through which a loader finds an export (``model.safetensors``, the index). Where
    a new file other than ``commit`` takes the name of a file already there, or an entry other than ``commit``
    is there, moving the files in one at a time would let a loader find a mix of both exports: so the entries
    there go first (made durable), and until ``commit`` is in place the directory loads as neither."""
    make_durable(temporary)
    new = sorted((p.name for p in temporary.iterdir()), key=lambda name: name == commit)  # commit last
    clash = any(os.path.lexists(target / n) for n in new if n != commit) or \
        any(os.path.lexists(target / e) for e in entries if e != commit)
    if clash:
        for entry in entries:
            (target / entry).unlink(missing_ok=True)
        fsync_dir(target)
    for name in new:
        os.replace(temporary / name, target / name)
    fsync_dir(target)
    for name in set(old) - set(new):
        (target / name).unlink(missing_ok=True)
    fsync_dir(target)
