"""Storage: where a checkpoint's bytes live, and the commit that makes them a checkpoint.

The interface is deliberately small (cf. zarr-python's ``abc/store.py``). Call order for a save::

    writer = open_writer(location, overwrite)   # refuses to replace a committed checkpoint
    wait = writer.write_documents({path: doc})  # array/group metadata, written in the background
    writer.kvstore(path)                        # TensorStore kvstore spec for array data
    wait()                                      # all metadata written
    writer.commit(root_doc)                     # last: root zarr.json, then durable, then visible
    writer.abort()                              # on any failure before commit: removes the leftovers

On a local filesystem a save writes into a hidden sibling directory and renames it into place (an
atomic exchange when replacing an old checkpoint), so the path only ever holds a whole checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from ._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
)

if TYPE_CHECKING:
    from ._objstore import ObjectLocation, ObjectWriter

__all__ = [
    "LocalLocation",
    "LocalWriter",
    "Location",
    "Writer",
    "collect_garbage",
    "file_kvstore",
    "finish_rank_writes",
    "kvstore_at",
    "make_durable",
    "open_writer",
    "parse_location",
    "pin_directory",
    "read_root_json",
]

ROOT_METADATA = "zarr.json"
TEMP_MARKER = ".arrayckpt-tmp-"


@dataclass(frozen=True)
class LocalLocation:
    """A checkpoint directory on a local (or locally mounted) filesystem."""

    path: Path

    def __str__(self) -> str:
        return str(self.path)

    def kvstore(self, subpath: str = "") -> dict[str, Any]:
        """TensorStore kvstore spec of a directory inside the checkpoint."""
        return file_kvstore(self.path, subpath)

    def read_root(self) -> dict[str, Any]:
        return read_root_json(self)

    def read_context(self) -> Any:
        from ._io import read_context

        return read_context()

    def write_context(self) -> Any:
        from ._io import write_context

        return write_context()

    def open_committed(self) -> tuple[dict[str, Any], dict[str, Any], Callable[[], None], Any]:
        """The root document, the kvstore to read the data from, a function that releases it, and a token
        for :meth:`changed_since`: the directory is pinned, so an overwrite meanwhile cannot mix two
        checkpoints' chunks."""
        for _ in range(_OPEN_ATTEMPTS):
            root, release = pin_directory(self.path)
            try:
                return read_root_json(self, root), file_kvstore(root, ""), release, None
            except (CheckpointNotFoundError, IncompleteCheckpointError):
                # An overwrite swapped the directory we pinned out of the path and deleted it before we read its
                # root document: not an incomplete checkpoint. Pin the one at the path now.
                replaced = _replaced(root, self.path)
                release()
                if not replaced:
                    raise
            except BaseException:
                release()
                raise
        raise CorruptCheckpointError(f"{self}: the checkpoint was replaced {_OPEN_ATTEMPTS} times while being opened; "
                                     "open it again")

    def changed_since(self, token: Any) -> bool:
        """Never: reads go to the pinned directory, whatever replaces it at the path."""
        return False

    def node_document(self, node_path: str) -> bytes | None:
        """A node's own ``zarr.json`` (``None`` when absent)."""
        try:
            return (self.path / node_path / ROOT_METADATA).read_bytes()
        except FileNotFoundError:
            return None

    def is_committed(self) -> bool:
        return is_committed(self)

    def delete(self) -> None:
        """Remove the checkpoint: the commit first (so a half-removed one reads as incomplete), then the rest."""
        try:
            (self.path / ROOT_METADATA).unlink()
        except FileNotFoundError:
            pass
        shutil.rmtree(self.path, ignore_errors=True)

    def leftovers(self) -> list[Path]:
        """Temporary directories of interrupted saves to this path."""
        parent = self.path.parent
        if not parent.is_dir():
            return []
        return sorted(parent.glob(f".{self.path.name}{TEMP_MARKER}*"))


def file_kvstore(root: Path | str, subpath: str) -> dict[str, Any]:
    """TensorStore's ``file`` kvstore spec of ``root/subpath/`` (plain strings: called once per array)."""
    return {"driver": "file", "path": f"{root}/{subpath}/" if subpath else f"{root}/"}


Location = Union[LocalLocation, "ObjectLocation"]
Writer = Union["LocalWriter", "ObjectWriter"]


def parse_location(path: str | os.PathLike[str] | Location,
                   storage_options: Mapping[str, Any] | None = None) -> Location:
    """Turn what the user passed into a location: a local path or ``file://`` URL, or an object-storage URL
    (``s3://``, ``gs://``, ``memory://``) with its storage options."""
    if isinstance(path, LocalLocation) or type(path).__name__ == "ObjectLocation":
        return path  # type: ignore[return-value]
    text = os.fspath(path)  # type: ignore[arg-type]
    if "://" in text:
        scheme, _, rest = text.partition("://")
        from ._objstore import OBJECT_SCHEMES, parse_object_url

        if scheme in OBJECT_SCHEMES:
            return parse_object_url(text, storage_options)
        if scheme != "file":
            raise ValueError(f"{text!r}: URL scheme {scheme!r} is not supported; use a local path, file://, "
                             f"or one of {', '.join(s + '://' for s in OBJECT_SCHEMES)}")
        text = rest
    if storage_options:
        raise ValueError(f"{text!r}: storage_options apply to object-storage URLs only")
    return LocalLocation(Path(text).expanduser().absolute())


def open_writer(location: Location, overwrite: bool) -> Writer:
    """The writer for one save to ``location`` (refuses to replace a committed checkpoint without ``overwrite``)."""
    if isinstance(location, LocalLocation):
        return LocalWriter(location, overwrite)
    from ._objstore import ObjectWriter

    return ObjectWriter(location, overwrite)


def finish_rank_writes(target: Location) -> None:
    """What a non-coordinator rank does after writing its chunks: on a (possibly shared) filesystem, flush
    them before reporting success; object stores have nothing to flush."""
    if isinstance(target, LocalLocation):
        make_durable(target.path)


def kvstore_at(base: dict[str, Any], subpath: str) -> dict[str, Any]:
    """The kvstore spec of ``subpath`` inside the checkpoint whose (directory) kvstore spec is ``base``."""
    if not subpath:
        return base
    return {**base, "path": f"{base['path']}{subpath}/"}


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
    return pinned, lambda: os.close(fd)


_OPEN_ATTEMPTS = 100  # opens overtaken by an overwrite (each one a new committed checkpoint) before giving up


def _replaced(pinned: str, path: Path) -> bool:
    """Whether the directory pinned as ``pinned`` is no longer the one at ``path`` (an overwrite swapped it out)."""
    try:
        held, now = os.stat(pinned), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino)


def read_root_json(location: LocalLocation, directory: str | None = None) -> dict[str, Any]:
    """The root ``zarr.json`` of a committed checkpoint (read from ``directory`` if given, e.g. a pinned
    one), or a clear error saying what is there instead."""
    root = Path(directory or location.path) / ROOT_METADATA
    try:
        data = root.read_bytes()
    except FileNotFoundError:
        if location.path.is_dir():
            raise IncompleteCheckpointError(
                f"{location}: incomplete checkpoint (no root zarr.json: its save never committed)"
            ) from None
        hint = ""
        if location.leftovers():
            hint = " (an interrupted save left temporary data beside it; `arrayckpt gc` removes it)"
        raise CheckpointNotFoundError(f"{location}: no checkpoint here{hint}") from None
    except NotADirectoryError:
        raise CheckpointNotFoundError(f"{location}: is a file, not a checkpoint directory") from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{location}: root zarr.json is a directory") from None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{location}: root zarr.json is damaged: {e}") from None


def collect_garbage(root: str | os.PathLike[str], min_age_s: float = 3600.0, dry_run: bool = False) -> list[Path]:
    """Remove what interrupted saves left in directory ``root`` (temporary directories), returning them.

    Only leftovers untouched for ``min_age_s`` seconds are removed, so a save still running next to them
    is not disturbed. Committed checkpoints are never touched.

    >>> import arrayckpt, tempfile
    >>> arrayckpt.gc(tempfile.mkdtemp())
    []
    """
    import time

    location = parse_location(root)
    if not isinstance(location, LocalLocation):
        raise ValueError(f"{location}: gc works on local directories; on object storage an interrupted save "
                         "is replaced by saving again with overwrite=True")
    base = location.path
    if not base.is_dir():
        raise CheckpointNotFoundError(f"{base}: not a directory")
    now = time.time()
    found = []
    for path in sorted(base.glob(f".*{TEMP_MARKER}*")):
        if path.is_dir() and now - _newest_mtime(path) >= min_age_s:
            found.append(path)
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True)
    return found


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


def is_committed(location: LocalLocation) -> bool:
    """Whether ``location`` holds an arrayckpt root document (a foreign Zarr store does not count)."""
    try:
        document = json.loads((location.path / ROOT_METADATA).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and isinstance(document.get("attributes"), dict) and \
        "arrayckpt" in document["attributes"]


class LocalWriter:
    """One save to a local directory: a temporary sibling directory, committed by rename."""

    def __init__(self, location: LocalLocation, overwrite: bool) -> None:
        self.location = location
        self.overwrite = overwrite
        _check_replaceable(location, overwrite)
        location.path.parent.mkdir(parents=True, exist_ok=True)
        self.temp = location.path.parent / f".{location.path.name}{TEMP_MARKER}{uuid.uuid4().hex[:12]}"
        self.temp.mkdir()
        self.target = LocalLocation(self.temp)  # where the ranks write
        self.key_encoding = "default"

    def kvstore(self, subpath: str = "") -> dict[str, Any]:
        return file_kvstore(self.temp, subpath)

    def write_json(self, subpath: str, document: dict[str, Any]) -> None:
        """Write one ``zarr.json`` below the checkpoint (made durable at commit)."""
        directory = self.temp / subpath if subpath else self.temp
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ROOT_METADATA).write_text(json.dumps(document))

    def write_documents(self, documents: Mapping[str, bytes]) -> Callable[[], None]:
        """Start writing many serialised ``zarr.json`` documents in a background thread (plain file writes:
        no temporary file and rename each, the whole directory is committed at once); the returned function
        waits for them and raises the first failure."""
        import threading

        errors: list[str] = []

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

    def commit(self, root_document: bytes) -> None:
        """Write the (serialised) root metadata, make everything durable, then make it visible at the path."""
        (self.temp / ROOT_METADATA).write_bytes(root_document)
        make_durable(self.temp)
        target = self.location.path
        if _rename_noreplace(self.temp, target):
            _fsync_dir(target.parent)
            return
        _check_replaceable(self.location, self.overwrite)  # something appeared meanwhile
        if _is_empty_dir(target):
            target.rmdir()
            os.rename(self.temp, target)
        else:
            _exchange(self.temp, target)  # self.temp now holds the old checkpoint
            shutil.rmtree(self.temp, ignore_errors=True)
        _fsync_dir(target.parent)

    def abort(self) -> None:
        shutil.rmtree(self.temp, ignore_errors=True)


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
    """Refuse to replace a committed checkpoint without ``overwrite``, and anything else always."""
    path = location.path
    if not path.exists() or _is_empty_dir(path):
        return
    if not path.is_dir():
        raise CheckpointExistsError(f"{location}: a file is in the way; remove it or choose another path")
    if is_committed(location):
        if overwrite:
            return
        raise CheckpointExistsError(
            f"{location}: a committed checkpoint is already here; pass overwrite=True to replace it "
            "(the old one stays readable until the new one commits)"
        )
    raise CheckpointExistsError(
        f"{location}: the directory exists and is not an arrayckpt checkpoint; "
        "refusing to replace it (remove it yourself, or choose another path)"
    )


# --- durability and atomic renames (Linux fast paths, portable fallbacks) -----------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
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


def _rename_noreplace(src: Path, dst: Path) -> bool:
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


def _exchange(new: Path, old: Path) -> None:
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


def _fsync_dir(path: Path) -> None:
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
        _fsync_dir(Path(directory))
