"""Checkpoints in a local (or locally mounted) directory.

A save writes into a hidden sibling directory, ``.<name>.arrayckpt-tmp-<12 hex digits>``, and its commit
renames that into place (an atomic exchange when replacing an old checkpoint, after which the old one is
removed), so the path only ever holds a whole checkpoint. Everything written is made durable (an ``fsync`` of
each file and directory, ``renames.py::make_durable``) before the rename. Readers pin the directory they opened
(``/proc/self/fd/N``), so an overwrite meanwhile can never mix two checkpoints' chunks in one read
(:attr:`LocalLocation.pins_reads`).

The interface and the call order of a save are in ``_storage/base.py``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .._errors import (
    BaseNotAllowedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LocationError,
    StorageError,
)
from .._format.jsontypes import JSON
from .._format.manifest import is_arrayckpt_root
from .._io.arrays import LazyContext, read_context, write_context
from .._io.smallfiles import first_link, read_checkpoint_file, read_regular_file
from .._settings import settings
from .base import (
    ROOT_METADATA,
    TEMP_MARKER,
    Beside,
    Leftover,
    Leftovers,
    Location,
    Opened,
    Tree,
    Writer,
    check_child_name,
    parse_location,
    parse_root_bytes,
    register_scheme,
    relative_parts,
)
from .beside import checkpoint_nodes, commit_beside, refuse_shared_checkpoint
from .files import pin_directory, remove_arrayckpt_files, remove_marker, write_marker_file, write_references_file
from .liveness import RootLock, create_held_directory, exclusive_directory
from .packread import read_file_ranges
from .packs import FilePackWriter
from .renames import exchange, fsync_dir, make_durable, rename_noreplace

__all__ = [
    "LocalLeftover",
    "LocalLocation",
    "LocalWriter",
    "file_kvstore",
    "make_durable",
    "read_root_json",
]


@dataclass(frozen=True)
class LocalLocation(Location):
    """A checkpoint directory on a local (or locally mounted) filesystem. ``fsync=False`` (a save with
    ``durable=False``) skips the fsync before the commit: the commit is still atomic, but a power loss or a
    crash of the machine (not of the process) may leave the committed checkpoint without its data."""

    path: Path
    fsync: bool = field(default=True, compare=False)

    pins_reads = True  # reads go to the directory pinned at open (see the module docstring)

    def __str__(self) -> str:
        return str(self.path)

    @property
    def native(self) -> Path:
        return self.path

    def kvstore(self, subpath: str = "") -> JSON:
        """TensorStore kvstore spec of a directory inside the checkpoint."""
        return file_kvstore(self.path, subpath)

    def without_fsync(self) -> LocalLocation:
        return replace(self, fsync=False)

    def read_context(self) -> LazyContext:
        return read_context()

    def write_context(self) -> LazyContext:
        return write_context()

    # --- reading ---------------------------------------------------------------------------------

    def read_root(self) -> JSON:
        return read_root_json(self)

    def open_committed(self) -> Opened:
        """The root document, the kvstore of the pinned directory, a function that releases the pin, and the
        pinned directory's identity (``(st_dev, st_ino)``) for :meth:`changed_since`."""
        for _ in range(_OPEN_ATTEMPTS):
            root, release = pin_directory(self.path)
            token = _identity(root)
            try:
                return Opened(read_root_json(self, root), file_kvstore(root, ""), release, token)
            except (CheckpointNotFoundError, IncompleteCheckpointError):
                # An overwrite swapped the directory we pinned out of the path and deleted it before we read its
                # root document: not an incomplete checkpoint. Pin the one at the path now.
                replaced = token is not None and self.changed_since(token)
                release()
                if not replaced:
                    raise
            except BaseException:
                release()
                raise
        raise CorruptCheckpointError(f"{self}: the checkpoint was replaced {_OPEN_ATTEMPTS} times while being opened; "
                                     "open it again")

    def changed_since(self, token: tuple[int, int] | None) -> bool:
        """Whether another directory (or nothing) is at the path now than the one opened as ``token``: one
        ``stat``. (Reads of the pinned directory are not affected; its data may be gone, though.)"""
        if token is None:  # nothing could be identified at open: cannot tell
            return False
        try:
            now = os.stat(self.path)
        except (FileNotFoundError, NotADirectoryError):
            return True
        return (now.st_dev, now.st_ino) != token

    def node_document(self, node_path: str) -> bytes | None:
        """A node's own ``zarr.json`` (``None`` when absent)."""
        try:
            return read_checkpoint_file(str(self.path), f"{node_path}/zarr.json", f"{self}: {node_path}/zarr.json")
        except (FileNotFoundError, NotADirectoryError):
            return None

    def is_committed(self) -> bool:
        """Whether an arrayckpt root document is here (one file read; a foreign Zarr store does not count)."""
        try:
            document = json.loads(read_regular_file(self.path / ROOT_METADATA, f"{self}: {ROOT_METADATA}"))
        except (OSError, ValueError, RecursionError, CorruptCheckpointError):
            return False
        return is_arrayckpt_root(document)

    # --- the places around it --------------------------------------------------------------------

    def children(self) -> list[str]:
        """Directories right below (the temporary directories of saves in progress excepted)."""
        try:
            entries = list(os.scandir(self.path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(e.name for e in entries if e.is_dir() and not _is_temporary(e.name))

    def child(self, name: str) -> LocalLocation:
        check_child_name(name, self)
        return LocalLocation(self.path / name)

    def leftovers(self, min_age_s: float) -> Leftovers:
        """Temporary directories of interrupted saves right below this directory (``.<name>.arrayckpt-tmp-*``)
        whose newest file is at least ``min_age_s`` old. Kept: those a live save holds (its lock, spec §9.4), at
        any age, and younger ones (where the filesystem has no ``flock``, the age is all that protects a save)."""
        if not self.path.is_dir():
            raise CheckpointNotFoundError(f"{self.path}: not a directory")
        now = time.time()
        found: list[Leftover] = []
        kept: list[tuple[str, str]] = []
        for path in sorted(self.path.glob(f".*{TEMP_MARKER}*")):
            if not path.is_dir():
                continue
            if not path.is_symlink():
                with exclusive_directory(path) as busy:
                    if busy is not None:
                        if "gone" not in busy:
                            kept.append((str(path), f"temporary directory of a save: {busy}"))
                        continue
            try:
                age = now - _newest_mtime(path)
            except FileNotFoundError:  # gone meanwhile: its save committed (renamed it) or gave up
                continue
            if NEW_MARKER in path.name and age < max(min_age_s, settings().new_grace_s):
                kept.append((str(path), "temporary directory of a save, maybe still being saved: just created, "
                                        "not locked yet (one nobody locked is removed "
                                        f"{settings().new_grace_s:g} s after it was made)"))
            elif age >= min_age_s:
                found.append(LocalLeftover(LocalLocation(path), max(0.0, age)))
            else:
                kept.append((str(path), f"temporary directory of a save, maybe still being saved: newest file written "
                                        f"{max(0.0, age):.0f} s ago, under the minimum age of {min_age_s:g} s"))
        return Leftovers(found, kept)

    def refuse_links_below(self, ancestor: Tree, where: str) -> None:
        link = first_link("/" + "/".join(ancestor.parts), "/".join(self.tree.parts[len(ancestor.parts):]))
        if link is not None:
            raise BaseNotAllowedError(f"{where} leads through {link}, a symbolic link; arrayckpt never follows a link "
                                      "to or inside a checkpoint (it could lead anywhere, and a copy would write "
                                      "through it): replace the link by the directory it points to, or remove it")

    def resolve(self, reference: str) -> Location:
        if "://" in reference or os.path.isabs(reference):
            return parse_location(reference)  # a URL gets no options from a local location: it has none
        return LocalLocation(type(self.path)("/", *relative_parts(self, reference)))  # spec §10.1, never clamped

    def reference_from(self, other: Location) -> str:
        if isinstance(other, LocalLocation):
            return os.path.relpath(self.path, other.path)
        return str(self)

    # --- writing ---------------------------------------------------------------------------------

    def open_writer(self, overwrite: bool, beside: Beside | None = None) -> Writer:  # (a memory step's: PeerWriter)
        return LocalWriter(self, overwrite, beside)

    def make_directory(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def finish_rank_writes(self) -> None:
        """On a (possibly shared) filesystem, fsync the chunks written below before reporting success."""
        if self.fsync:
            make_durable(self.path)

    def open_pack(self, rank: int, tag: str = "") -> FilePackWriter:
        return FilePackWriter(str(self.path), self.fsync, rank, self, tag)

    def read_pack(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """(A committed checkpoint is read through its pinned directory: the location ``open_committed`` gave.)"""
        return read_file_ranges(str(self.path), name, ranges, self)

    def read_pack_into(self, name: str, ranges: Sequence[tuple[int, int]], buffers: Sequence[memoryview]) -> None:
        read_file_ranges(str(self.path), name, ranges, self, buffers)

    def delete(self) -> None:
        """Remove the checkpoint: the commit first (so a half-removed one reads as incomplete), then arrayckpt's
        other files (anything else stays). A link at the path is removed as a link, never followed."""
        if self.path.is_symlink():
            self.path.unlink(missing_ok=True)
            return
        remove_marker(self.path)
        try:
            (self.path / ROOT_METADATA).unlink()
        except (FileNotFoundError, NotADirectoryError):
            pass
        remove_arrayckpt_files(self.path)

    def write_references(self, data: bytes) -> None:
        """Written into ``packs/``, then renamed over ``refs.json`` and made durable (unless ``fsync=False``): a
        process killed meanwhile leaves a file named as arrayckpt's own there (``is_pack_key``), which a delete or an
        overwrite removes with the checkpoint, never a stranger at its top. A link at ``refs.json`` or ``packs`` is
        refused (spec §12)."""
        write_references_file(self.path, data, self.fsync, str(self))

    def write_marker(self) -> None:
        """Written beside, then renamed into place (a reader never sees part of it), and made durable with the save."""
        write_marker_file(self.path, self.fsync)

    def claim(self, patience_s: float = 0.0) -> RootLock:
        return RootLock(self.path)  # (a flock dies with its holder: nothing to wait for)

    def _temporary_siblings(self) -> list[Path]:
        """Temporary directories of (possibly interrupted) saves to this path."""
        parent = self.path.parent
        if not parent.is_dir():
            return []
        return sorted(parent.glob(f".{self.path.name}{TEMP_MARKER}*"))


@dataclass(frozen=True)
class LocalLeftover(Leftover):
    """The temporary directory of an interrupted save."""

    location: LocalLocation
    age_s: float

    def remove(self) -> bool:
        """Delete the directory while holding its exclusive lock, unless a live save holds it (spec §9.4: then
        nothing is touched and ``False`` is returned; a save that committed meanwhile renamed it away); a link is
        removed as a link, never followed. Whether nothing is left at its path now."""
        path = self.location.path
        if path.is_symlink():
            path.unlink(missing_ok=True)
            return not os.path.lexists(path)
        with exclusive_directory(path) as busy:
            if busy is not None:
                return not os.path.lexists(path)
            shutil.rmtree(path, ignore_errors=True)
        return not os.path.lexists(path)


def _parse_path(text: str, storage_options: Mapping[str, Any] | None) -> LocalLocation:
    """A local path (or a ``file://`` URL's path), made absolute."""
    if storage_options:
        raise LocationError(f"{text!r}: storage_options apply to object-storage URLs only; pass them with an s3://, "
                            "gs:// or memory:// URL, or leave them out")
    return LocalLocation(Path(text).expanduser().absolute())


register_scheme("file", _parse_path)


def _is_temporary(name: str) -> bool:
    return name.startswith(".") and TEMP_MARKER in name


def _newest_mtime(path: Path) -> float:
    """The latest modification under ``path`` (a save in progress keeps touching its directory)."""
    newest = path.stat().st_mtime
    for directory, _, files in os.walk(path):
        for name in (directory, *(os.path.join(directory, f) for f in files)):
            try:
                newest = max(newest, os.stat(name).st_mtime)
            except FileNotFoundError:
                pass
    return newest


def file_kvstore(root: Path | str, subpath: str) -> JSON:
    """TensorStore's ``file`` kvstore spec of ``root/subpath/`` (plain strings: called once per array)."""
    return {"driver": "file", "path": f"{root}/{subpath}/" if subpath else f"{root}/"}


NEW_MARKER = f"{TEMP_MARKER}new-"  # a save's T before it is locked and renamed to its T name (spec §9.4)
_OPEN_ATTEMPTS = 100  # opens overtaken by an overwrite (each one a new committed checkpoint) before giving up


def _identity(path: str) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of what ``path`` names (``None``: nothing)."""
    try:
        held = os.stat(path)
    except OSError:
        return None
    return held.st_dev, held.st_ino


def read_root_json(location: LocalLocation, directory: str | None = None) -> JSON:
    """The root ``zarr.json`` of a committed checkpoint (read from ``directory`` if given, e.g. a pinned
    one), or a clear error saying what is there instead."""
    root = Path(directory or location.path) / ROOT_METADATA
    try:
        data = read_regular_file(root, f"{location}: {ROOT_METADATA}", follow=False)  # no link inside (spec §12)
    except FileNotFoundError:
        if location.path.is_dir():
            raise IncompleteCheckpointError(
                f"{location}: incomplete checkpoint (no root zarr.json: its save never committed)"
            ) from None
        hint = ""
        if location._temporary_siblings():
            hint = " (an interrupted save left temporary data beside it; `arrayckpt gc` removes it)"
        raise CheckpointNotFoundError(f"{location}: no checkpoint here{hint}") from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{location}: is a file, not a checkpoint directory") from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{location}: root zarr.json is a directory") from None
    return parse_root_bytes(data, location)


class LocalWriter(Writer):
    """One save to a local directory: a temporary sibling directory, committed by rename."""

    location: LocalLocation

    def __init__(self, location: LocalLocation, overwrite: bool, beside: Beside | None = None) -> None:
        if location.path.is_symlink():  # save to where it points (the exchange would swap the link itself away)
            location = replace(location, path=Path(os.path.realpath(location.path)))
        self.location = location
        self.overwrite = overwrite
        self.replaces_beside = overwrite and beside is Beside.REPLACE_CHECKPOINT  # a committed one there, in place
        self.beside = beside is not None and _holds_others(location, self.replaces_beside)  # committed into it
        if not self.beside:
            _check_replaceable(location, overwrite)
        location.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(_OPEN_ATTEMPTS):  # a gc may remove a new T between its mkdir and its lock: take another
            self.temp = location.path.parent / f".{location.path.name}{TEMP_MARKER}{uuid.uuid4().hex[:12]}"
            hold = create_held_directory(self.temp, NEW_MARKER)  # a live save's mark (spec §9.4), until it ends
            if hold is not None:
                self._hold = hold
                break
        else:
            raise StorageError(f"{location}: the save's temporary directory was removed {_OPEN_ATTEMPTS} times as "
                               "soon as it was made (a gc without the minimum age is running); try again")
        self._documents: list[str] = []  # node paths whose zarr.json this writer wrote
        self.target = LocalLocation(self.temp, fsync=location.fsync)  # where the ranks write
        self.key_encoding = "default"

    def write_documents(self, documents: Mapping[str, bytes]) -> Callable[[], None]:
        """Start writing many serialised ``zarr.json`` documents in a background thread (plain file writes:
        no temporary file and rename each, the whole directory is committed at once); the returned function
        waits for them and raises the first failure."""
        import threading

        errors: list[str] = []
        self._documents = list(documents)

        def run() -> None:
            root = str(self.temp)
            for path, document in documents.items():
                directory = f"{root}/{path}" if path else root
                try:
                    try:
                        _write_file(f"{directory}/{ROOT_METADATA}", document)
                    except FileNotFoundError:
                        os.makedirs(directory, exist_ok=True)
                        _write_file(f"{directory}/{ROOT_METADATA}", document)
                except OSError as e:
                    errors.append(f"{path or '/'}: {e}")

        worker = threading.Thread(target=run, name="arrayckpt-metadata", daemon=True)
        worker.start()

        def wait() -> None:
            worker.join()
            if errors:
                raise StorageError(f"{self.location}: writing metadata failed: {errors[0]} "
                                   f"({len(errors)} document(s) failed)")

        return wait

    def write_file(self, name: str, data: bytes) -> None:
        path = f"{self.temp}/{name}"
        try:
            _write_file(path, data)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _write_file(path, data)

    def missing(self, chunks: Mapping[str, Collection[str]]) -> list[str]:
        """The chunk files (and node documents) of this save not in its temporary directory now: one listing of
        each node's directory, and a ``stat`` of each name not listed (a shared filesystem's client may list a
        directory from its cache). Everything, when the directory was removed or replaced."""
        expected = {path: set(names) for path, names in chunks.items()}
        for path in self._documents:
            if path:
                expected.setdefault(path, set()).add(ROOT_METADATA)
        if not self._hold.still_at(self.temp):
            return sorted(f"{path}/{name}" for path, names in expected.items() for name in names) or ["."]
        gone: list[str] = []
        for path, names in expected.items():
            directory = f"{self.temp}/{path}" if path else str(self.temp)
            try:
                listed = set(os.listdir(directory))
            except (FileNotFoundError, NotADirectoryError):
                listed = set()
            gone.extend(f"{path}/{name}" for name in sorted(names - listed)
                        if not os.path.lexists(f"{directory}/{name}"))
        return gone

    def commit(self, root_document: bytes) -> None:
        """Write the (serialised) root metadata, make everything durable, then make it visible at the path: only if
        the temporary directory is still the one this save made (a ``stat``, right before the rename)."""
        (self.temp / ROOT_METADATA).write_bytes(root_document)
        if self.location.fsync:
            make_durable(self.temp)
        if not self._hold.still_at(self.temp):
            raise StorageError(f"{self.location}: the save's temporary directory {self.temp} was removed or replaced "
                               "before its commit (by something that ignored its lock, spec §9.4); nothing committed")
        target = self.location.path
        if self.beside and target.is_dir():
            commit_beside(self.temp, target, str(self.location), self.location.fsync, self.replaces_beside)
            self._fsync_parent()
            return
        if rename_noreplace(self.temp, target):
            self._fsync_parent()
            return
        _check_replaceable(self.location, self.overwrite)  # something appeared meanwhile
        if _is_empty_dir(target):
            target.rmdir()
            os.rename(self.temp, target)
        else:
            exchange(self.temp, target)  # self.temp now holds the old checkpoint
            shutil.rmtree(self.temp, ignore_errors=True)
        self._fsync_parent()

    def _fsync_parent(self) -> None:
        """After the rename: make it durable (unless the save is not), and let the temporary directory's hold go."""
        if self.location.fsync:
            fsync_dir(self.location.path.parent)
        self._hold.release()

    def abort(self) -> None:
        shutil.rmtree(self.temp, ignore_errors=True)
        self._hold.release()


def _write_file(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _check_replaceable(location: LocalLocation, overwrite: bool) -> None:
    """Refuse to replace a committed checkpoint without ``overwrite``, and anything else always, but a directory that
    is recognisably a checkpoint of DCP's ``FileSystemWriter`` (a save switched to arrayckpt at a fixed path, such as
    ``latest/``, finds one there): replaced as a committed checkpoint is."""
    path = location.path
    if not path.exists() or _is_empty_dir(path):
        return
    if not path.is_dir():
        raise CheckpointExistsError(f"{location}: a file is in the way; remove it or choose another path")
    committed, dcp = location.is_committed(), _dcp_files_only(path)
    if (committed or dcp) and overwrite:
        return
    if committed or dcp:
        raise CheckpointExistsError(
            f"{location}: a {'committed' if committed else 'PyTorch DCP (FileSystemWriter)'} checkpoint is already "
            "here; pass overwrite=True to replace it (the old one stays readable until the new one commits)")
    names = sorted(os.listdir(path))
    raise CheckpointExistsError(
        f"{location}: the directory exists and is not an arrayckpt checkpoint, nor a DCP one (only .metadata and "
        f"__<rank>_<n>.distcp files); it holds {', '.join(map(repr, names[:3]))}{' ...' if len(names) > 3 else ''}; "
        "refusing to replace it: remove it yourself, or choose another path")


def _holds_others(location: LocalLocation, replace: bool) -> bool:
    """Whether the directory holds files of the user's besides a checkpoint (arrayckpt's, or DCP's only), which a
    save that keeps them commits beside (``beside.py``). A committed checkpoint there is refused unless ``replace``
    (``overwrite`` and ``Beside.REPLACE_CHECKPOINT``): its replacement in a shared directory is not atomic. Beside
    a committed one, DCP's files (``FileSystemWriter`` saved there too) are a checkpoint, not the user's: the directory
    is replaced as a whole with ``overwrite``, atomically, as one holding DCP's files only is."""
    path = location.path
    if not path.is_dir() or _is_empty_dir(path) or _dcp_files_only(path):
        return False
    if not location.is_committed():
        return True
    nodes = checkpoint_nodes(path)
    others = sorted(set(os.listdir(path)) - nodes - {ROOT_METADATA})
    if all(_DCP_FILE.fullmatch(name) and (path / name).is_file() and not (path / name).is_symlink() for name in others):
        return False  # arrayckpt's checkpoint and DCP's only (none: a directory of its own)
    if not replace:
        refuse_shared_checkpoint(str(location), others, nodes)
    return True


_DCP_FILE = re.compile(r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp")  # FileSystemWriter's names, and no other


def _dcp_files_only(path: Path) -> bool:
    """Whether ``path`` holds regular files named as DCP's ``FileSystemWriter`` names them, and nothing else."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return False
    return bool(entries) and all(_DCP_FILE.fullmatch(e.name) and e.is_file(follow_symlinks=False) for e in entries)
