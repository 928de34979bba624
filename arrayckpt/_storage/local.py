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

from .._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateError,
    StorageError,
)
from .._format.manifest import is_arrayckpt_root

if TYPE_CHECKING:
    from .._storage.object import ObjectLocation, ObjectWriter

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
        from .._io.arrays import read_context

        return read_context()

    def write_context(self) -> Any:
        from .._io.arrays import write_context

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
        from .._storage.object import OBJECT_SCHEMES, parse_object_url

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
    from .._storage.object import ObjectWriter

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


def collect_garbage(root: str | os.PathLike[str], min_age_s: float = 3600.0, dry_run: bool = False,
                    storage_options: Mapping[str, Any] | None = None) -> list[Path] | list[str]:
    """Remove what interrupted saves left under ``root``, returning it (``dry_run``: only find it).

    In a local directory: the temporary directories of interrupted saves (paths). Under an object-storage
    prefix (``s3://bucket/run``, ``memory://...``): the incomplete checkpoints right below it (URLs), see
    :func:`find_object_garbage`. Only leftovers untouched for ``min_age_s`` seconds are removed, so a
    save still running next to them is not disturbed. Committed checkpoints are never touched, nor any
    object that is not arrayckpt's.

    >>> import arrayckpt, tempfile
    >>> arrayckpt.gc(tempfile.mkdtemp())
    []
    """
    import time

    location = parse_location(root, storage_options)
    if not isinstance(location, LocalLocation):
        found, _ = find_object_garbage(location, min_age_s)
        removed = []
        for leftover in found:
            if dry_run or leftover.remove():
                removed.append(leftover.url)
        return removed
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


@dataclass(frozen=True)
class ObjectLeftover:
    """An incomplete checkpoint on object storage: a prefix with arrayckpt's objects and no root document."""

    location: ObjectLocation
    keys: tuple[str, ...]  # every object under the prefix (relative to it), all arrayckpt-shaped
    age_s: float | None  # seconds since its newest object was written (None: the store gives no times)

    @property
    def url(self) -> str:
        return str(self.location)

    def remove(self) -> bool:
        """Delete the objects found, unless a root document has appeared meanwhile (a save committed after all:
        then nothing is deleted and ``False`` is returned)."""
        from .._storage.object import _delete, _read

        store = self.location.open_store()
        if _read(store, ROOT_METADATA, self.location) is not None:
            return False
        _delete(store, list(self.keys), self.location)
        return True


def find_object_garbage(location: ObjectLocation,
                        min_age_s: float) -> tuple[list[ObjectLeftover], list[tuple[str, str]]]:
    """The incomplete checkpoints right below ``location``'s prefix that are safe to remove, and the other
    non-committed prefixes there, each with why it is kept.

    A prefix ``P`` below the root is removed only when all of these hold (spec §9.3):

    - ``P/zarr.json`` does not exist (a committed checkpoint, or a foreign Zarr hierarchy, is never touched);
    - every object under ``P`` is arrayckpt-shaped (a ``zarr.json`` or a chunk name), and its ``zarr.json``
      documents are Zarr v3 groups or arrays, at least one of them an array that arrayckpt wrote
      (``attributes.arrayckpt``): positive evidence that ``P`` is an interrupted arrayckpt save and not, say,
      numbered objects or a Zarr store of someone else's;
    - its newest object is at least ``min_age_s`` old. On S3 the objects' ``LastModified`` (through s3fs,
      one listing per 1,000 objects) is compared with this machine's clock. Where the store gives no times
      (``memory://``, TensorStore's in-process store; ``gs://``; S3 without s3fs) objects count as just
      written, so only ``min_age_s=0`` removes anything there: the caller then vouches that no save to
      those prefixes is running (on ``memory://`` such a save could only be one of this very process).

    The root itself must not be, or lie inside, a checkpoint or another Zarr hierarchy (its groups would
    look like incomplete checkpoints): that is refused.
    """
    import time

    from .._storage.object import ObjectLocation, _ours, _read

    _refuse_inside_hierarchy(location)
    listing = _list_with_times(location)
    children: dict[str, list[tuple[str, float | None]]] = {}
    for key, mtime in listing:
        child, slash, rest = key.partition("/")
        if slash and rest:
            children.setdefault(child, []).append((rest, mtime))
    store = location.open_store()
    now = time.time()
    found: list[ObjectLeftover] = []
    kept: list[tuple[str, str]] = []
    for child, entries in sorted(children.items()):
        prefix = f"{location.prefix}/{child}" if location.prefix else child
        where = ObjectLocation(location.scheme, location.bucket, prefix, location.options)
        keys = [k for k, _ in entries]
        if ROOT_METADATA in keys:
            document = _read(store, f"{child}/{ROOT_METADATA}", where)
            try:
                committed = is_arrayckpt_root(json.loads(document)) if document is not None else False
            except ValueError:
                committed = False
            if not committed:
                kept.append((str(where), "its zarr.json is not an arrayckpt checkpoint's: not arrayckpt's data"))
            continue
        foreign = sorted(set(keys) - set(_ours(keys)))
        if foreign:
            kept.append((str(where), f"holds objects that are not arrayckpt's (e.g. {foreign[0]!r})"))
            continue
        problem = _not_arrayckpt_documents(store, child, [k for k in keys if k.rpartition("/")[2] == ROOT_METADATA],
                                           where)
        if problem:
            kept.append((str(where), problem))
            continue
        times = [t for _, t in entries]
        age = None if any(t is None for t in times) else max(0.0, now - max(times))  # type: ignore[type-var]
        if min_age_s > 0 and (age is None or age < min_age_s):
            reason = (f"newest object written {age:.0f} s ago, under the minimum age of {min_age_s:g} s"
                      if age is not None else f"{location.scheme}:// gives no modification times here, so its "
                      f"objects count as just written (min_age_s=0 removes it)")
            kept.append((str(where), f"incomplete checkpoint, maybe still being saved: {reason}"))
            continue
        found.append(ObjectLeftover(where, tuple(sorted(keys)), age))
    return found, kept


def _refuse_inside_hierarchy(location: ObjectLocation) -> None:
    """Refuse a root that is, or lies inside, a Zarr hierarchy (a ``zarr.json`` at it or at a prefix above it)."""
    from .._storage.object import ObjectLocation, _read

    bucket = ObjectLocation(location.scheme, location.bucket, "", location.options)
    store = bucket.open_store()
    parts = location.prefix.split("/") if location.prefix else []
    for depth in range(len(parts) + 1):
        prefix = "/".join(parts[:depth])
        document = _read(store, f"{prefix}/{ROOT_METADATA}" if prefix else ROOT_METADATA, bucket)
        if document is None:
            continue
        here = ObjectLocation(location.scheme, location.bucket, prefix, location.options)
        try:
            ours = is_arrayckpt_root(json.loads(document))
        except ValueError:
            ours = False
        what = "a committed checkpoint" if ours else "a Zarr hierarchy (zarr.json)"
        if depth == len(parts):
            raise StateError(f"{location}: is {what}, not a prefix holding checkpoints; gc takes the prefix above it")
        raise StateError(f"{location}: lies inside {what} at {here}; gc takes a prefix that holds checkpoints")


def _not_arrayckpt_documents(store: Any, child: str, documents: list[str], where: object) -> str | None:
    """Why the ``zarr.json`` documents below ``child`` do not show an interrupted arrayckpt save (``None``: they do)."""
    from .._storage.object import _wait

    if not documents:
        return "no zarr.json of an arrayckpt array under it (only chunk-named objects): not known to be arrayckpt's"
    futures = [(name, store.read(f"{child}/{name}")) for name in documents]
    _wait(futures, where, "reading metadata")
    arrays = 0
    for name, future in futures:
        result = future.result()
        if result.state != "value":
            continue  # deleted meanwhile
        try:
            document = json.loads(result.value)
        except ValueError:
            return f"{name} is not JSON: not known to be arrayckpt's"
        node = document.get("node_type") if isinstance(document, dict) else None
        if not isinstance(document, dict) or document.get("zarr_format") != 3 or node not in ("group", "array"):
            return f"{name} is not a Zarr v3 group or array document: not arrayckpt's"
        if node == "array":
            attributes = document.get("attributes")
            if not (isinstance(attributes, dict) and isinstance(attributes.get("arrayckpt"), dict)):
                return f"{name} describes an array arrayckpt did not write: not arrayckpt's"
            arrays += 1
    if not arrays:
        return "no zarr.json of an arrayckpt array under it: not known to be arrayckpt's"
    return None


def _list_with_times(location: ObjectLocation) -> list[tuple[str, float | None]]:
    """Every object under the prefix (key relative to it) with its modification time (epoch seconds), where the
    store tells: on S3 through s3fs (``LastModified``); elsewhere TensorStore's listing, without times."""
    from .._storage.object import _list

    if location.scheme == "s3":
        try:
            import s3fs
        except ImportError:
            s3fs = None
        if s3fs is not None:
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **location.fsspec_options())
            base = f"{location.bucket}/{location.prefix}" if location.prefix else location.bucket
            try:
                entries = fs.find(base, detail=True)
            except FileNotFoundError:
                return []
            except Exception as e:
                raise StorageError(f"{location}: listing failed: {e}") from e
            out = []
            for name, info in entries.items():
                if info.get("type") == "directory" or not name.startswith(base + "/"):
                    continue
                modified = info.get("LastModified")
                out.append((name[len(base) + 1:], modified.timestamp() if modified is not None else None))
            return out
    return [(key, None) for key in _list(location.open_store(), location)]


def is_committed(location: LocalLocation) -> bool:
    """Whether ``location`` holds an arrayckpt root document (a foreign Zarr store does not count)."""
    try:
        document = json.loads((location.path / ROOT_METADATA).read_bytes())
    except (OSError, ValueError):
        return False
    return is_arrayckpt_root(document)


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
