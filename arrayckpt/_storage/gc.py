"""Garbage collection: removing what interrupted saves left, on any storage, through :class:`Location`.

:func:`collect_garbage` asks a location for its :meth:`~Location.leftovers` and removes them. Locally those
are the temporary directories of saves that never committed (``_storage/local.py``); on object storage,
incomplete checkpoints, found by the rules of spec §9.3 in :func:`object_leftovers` below (written against
``ObjectLocation``'s public methods only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from .._errors import StateError
from .._format.manifest import is_arrayckpt_root
from .._format.packs import is_save_file
from .._io.smallfiles import read_regular_file
from .base import LEASE_NAME, ROOT_METADATA, Leftover, Leftovers, Location, arrayckpt_keys, parse_location
from .files import directory_files, remove_arrayckpt_files
from .liveness import Holder, live_holder
from .local import LocalLocation

__all__ = ["LocalIncomplete", "ObjectLeftover", "ObjectPrefix", "collect_garbage", "hierarchies_above",
           "incomplete_leftovers", "judge_incomplete", "object_leftovers"]


def collect_garbage(root: str | os.PathLike[str], min_age_s: float = 3600.0, dry_run: bool = False,
                    storage_options: Mapping[str, Any] | None = None) -> list[Path] | list[str]:
    """Remove what interrupted saves left under ``root``, returning it (``dry_run``: only find it).

    In a local directory: the temporary directories of interrupted saves (paths). Under an object-storage
    prefix (``s3://bucket/run``, ``memory://...``): the incomplete checkpoints right below it (URLs), see
    :func:`object_leftovers`. What a running save holds is never removed, whatever ``min_age_s`` says (its
    ``flock`` on its temporary directory, its lease in a new prefix: spec §9.4); of the rest, only leftovers
    untouched for ``min_age_s`` seconds are removed. Committed checkpoints are never touched, nor any object that
    is not arrayckpt's.

    Args:
        root: a directory, or an object-storage prefix, that holds checkpoints.
        min_age_s: only leftovers untouched for this many seconds are removed.
        dry_run: only find the leftovers; remove nothing.
        storage_options: for object storage, as for :func:`arrayckpt.save`.

    Returns:
        What was removed (or, with ``dry_run``, would be): local paths, or URLs.

    Raises:
        StateError: ``root`` is a checkpoint, or lies inside one, rather than a prefix holding checkpoints.
        StorageError: the storage could not be listed or changed.

    Examples:
        >>> import arrayckpt, tempfile
        >>> arrayckpt.gc(tempfile.mkdtemp())
        []
        >>> arrayckpt.gc(tempfile.mkdtemp(), min_age_s=0, dry_run=True)
        []
    """
    found, _ = parse_location(root, storage_options).leftovers(min_age_s)
    return [leftover.location.native for leftover in found if dry_run or leftover.remove()]  # type: ignore[return-value]



class ObjectPrefix(Protocol):
    """What the rules below need of an object-storage location (``ObjectLocation`` implements it): gc stays below
    the backend that calls it."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # a dataclass: its prefix is replaced

    @property
    def scheme(self) -> str: ...

    @property
    def prefix(self) -> str: ...  # no leading or trailing "/"; "" is the bucket's root

    @property
    def native(self) -> str: ...

    def node_document(self, node_path: str) -> bytes | None: ...

    def object_times(self) -> list[tuple[str, float | None]]: ...

    def read_objects(self, keys: list[str]) -> dict[str, bytes | None]: ...

    def delete_objects(self, keys: list[str]) -> None: ...

    def children(self) -> list[str]: ...

    def child(self, name: str) -> ObjectPrefix: ...


@dataclass(frozen=True)
class ObjectLeftover(Leftover):
    """An incomplete checkpoint on object storage: a prefix with arrayckpt's objects and no root document."""

    location: ObjectPrefix  # type: ignore[assignment]  # an ObjectLocation: a Location and an ObjectPrefix
    keys: tuple[str, ...]  # every object under the prefix (relative to it), all arrayckpt-shaped
    age_s: float | None  # seconds since its newest object was written (None: the store gives no times)

    def remove(self) -> bool:
        """Delete the objects found, unless a root document or a live save's lease has appeared meanwhile (a save
        committed after all, or began again: then nothing is deleted and ``False`` is returned)."""
        if self.location.node_document("") is not None or _live_lease(self.location) is not None:
            return False
        self.location.delete_objects(list(self.keys))
        return True


def object_leftovers(location: ObjectPrefix, min_age_s: float) -> Leftovers:
    """The incomplete checkpoints right below ``location``'s prefix that are safe to remove, and the other
    non-committed prefixes there, each with why it is kept.

    A prefix ``P`` below the root is removed only when all of these hold (spec §9.3):

    - ``P/zarr.json`` does not exist (a committed checkpoint, or a foreign Zarr hierarchy, is never touched), nor
      does the root document of a committed checkpoint anywhere below ``P`` (a prefix holding checkpoints, such
      as a manager's root, is not an incomplete checkpoint);
    - no live save lease ``P/.arrayckpt-lease`` is there (a first save is running: spec §9.4), whatever its age;
    - every object under ``P`` is arrayckpt-shaped (a ``zarr.json`` or a chunk name), and its ``zarr.json``
      documents are Zarr v3 groups or arrays, at least one of them an array that arrayckpt wrote
      (``attributes.arrayckpt``), or it holds packs or a pack index named as arrayckpt's packed saves name them
      (``packs/<tag>-r<rank>.pack``, ``packs/<tag>-index.bin``: a packed save writes no node documents, spec
      §16.1; its packs, index and ``refs.json`` are then removed as that save's): positive evidence that ``P`` is
      an interrupted arrayckpt save and not, say, numbered objects or a Zarr store of someone else's;
    - its newest object is at least ``min_age_s`` old. On S3 the objects' ``LastModified`` (through s3fs,
      one listing per 1,000 objects), on GCS their ``updated`` time (through gcsfs), is compared with this machine's
      clock. Where the store gives no times (``memory://``, TensorStore's in-process store; S3 without s3fs, GCS
      without gcsfs) objects count as just written, so only ``min_age_s=0`` removes anything there: the caller then
      vouches that no save to those prefixes is running (on ``memory://`` such a save could only be one of this very
      process).

    The root itself must not be, or lie inside, a checkpoint or another Zarr hierarchy (its groups would
    look like incomplete checkpoints): that is refused.
    """
    _refuse_inside_hierarchy(location)
    found: list[Leftover] = []
    kept: list[tuple[str, str]] = []
    for child in location.children():  # one delimited listing on S3, not one of every checkpoint's objects
        try:
            where = location.child(child)
        except ValueError:
            kept.append((f"{location}/{child}", "not a name a checkpoint can have: not arrayckpt's data"))
            continue
        one = _prefix_leftovers(where, min_age_s)
        found.extend(one.found)
        kept.extend(one.kept)
    return Leftovers(found, kept)


def _prefix_leftovers(where: ObjectPrefix, min_age_s: float) -> Leftovers:
    """The prefix ``where`` as a removable leftover, or kept with why, or neither (committed, or nothing there)."""
    document = where.node_document("")
    if document is not None:
        try:
            committed = is_arrayckpt_root(json.loads(document))
        except (ValueError, RecursionError):
            committed = False
        if not committed:
            return Leftovers([], [(str(where), "its zarr.json is not an arrayckpt checkpoint's: not arrayckpt's data")])
        return Leftovers([], [])
    entries = where.object_times()
    if not entries:
        return Leftovers([], [])  # removed meanwhile
    keys = [k for k, _ in entries]
    holder = _live_lease(where) if LEASE_NAME in keys else None
    if holder is not None:
        return Leftovers([], [(str(where), f"incomplete checkpoint: a save is running in it (its lease, held by "
                                           f"{holder}, spec §9.4)")])
    times = [t for _, t in entries]
    newest = None if any(t is None for t in times) else max(times)  # type: ignore[type-var]
    no_times = (f"{where.scheme}:// gives no modification times here, so its objects count as just "
                "written (min_age_s=0 removes it)")
    problem, age = judge_incomplete(keys, newest, where.read_objects, min_age_s, no_times)
    if problem:
        return Leftovers([], [(str(where), problem)])
    return Leftovers([ObjectLeftover(where, tuple(sorted(keys)), age)], [])


Reader = Callable[[list[str]], Mapping[str, bytes | None]]  # keys -> their bytes (None: no such file or object)


def judge_incomplete(keys: list[str], newest: float | None, read_documents: Reader, min_age_s: float,
                     no_times: str = "") -> tuple[str | None, float | None]:
    """Whether an incomplete checkpoint (no root document) holding the files or objects ``keys`` (relative to
    it, the newest written at epoch ``newest``; ``None``: unknown) may be removed, by the rule of spec §9.3
    (see :func:`object_leftovers`): ``(None, age)`` when it may, else ``(why it is kept, age)``."""
    foreign = sorted(set(keys) - set(arrayckpt_keys(keys)))
    if foreign:
        return f"holds objects that are not arrayckpt's (e.g. {foreign[0]!r})", None
    packed = any(is_save_file(key) for key in keys)  # an interrupted packed save has no node documents (§16.1)
    problem = _not_arrayckpt_documents(read_documents, [k for k in keys if k.rpartition("/")[2] == ROOT_METADATA],
                                       packed)
    if problem:
        return problem, None
    now = time.time()  # after the listing: its objects are not younger than now
    age = None if newest is None else max(0.0, now - newest)
    if min_age_s > 0 and (age is None or age < min_age_s):
        reason = (f"newest object written {age:.0f} s ago, under the minimum age of {min_age_s:g} s"
                  if age is not None else no_times)
        return f"incomplete checkpoint, maybe still being saved: {reason}", age
    return None, age


def hierarchies_above(location: ObjectPrefix, itself: bool = True) -> Iterator[tuple[ObjectPrefix, bool]]:
    """Each prefix from the bucket's root down to ``location``'s own (``itself``: included) holding a ``zarr.json``,
    with whether it is an arrayckpt checkpoint's root document: one GET per prefix, taken lazily."""
    parts = location.prefix.split("/") if location.prefix else []
    for depth in range(len(parts) + int(itself)):
        here = dataclasses.replace(location, prefix="/".join(parts[:depth]))
        document = here.node_document("")
        if document is None:
            continue
        try:
            ours = is_arrayckpt_root(json.loads(document))
        except (ValueError, RecursionError):
            ours = False
        yield here, ours


def _refuse_inside_hierarchy(location: ObjectPrefix) -> None:
    """Refuse a root that is, or lies inside, a Zarr hierarchy (a ``zarr.json`` at it or at a prefix above it)."""
    for here, ours in hierarchies_above(location):
        what = "a committed checkpoint" if ours else "a Zarr hierarchy (zarr.json)"
        if here.prefix == location.prefix:
            raise StateError(f"{location}: is {what}, not a prefix holding checkpoints; gc takes the prefix above it")
        raise StateError(f"{location}: lies inside {what} at {here}; gc takes a prefix that holds checkpoints")


def _live_lease(where: ObjectPrefix) -> Holder | None:
    """The live holder of the save lease in ``where``'s prefix (one GET; ``None``: none, or expired)."""
    return live_holder(where.read_objects([LEASE_NAME]).get(LEASE_NAME))


def _not_arrayckpt_documents(read_documents: Reader, documents: list[str], packed: bool = False) -> str | None:
    """Why the ``zarr.json`` documents ``documents`` (read through ``read_documents``) do not show an
    interrupted arrayckpt save (``None``: they do). ``packed``: packs or an index named as arrayckpt's saves name them
    are there, which show one without any document (but no document may then be a committed checkpoint's root, or
    another writer's)."""
    if not documents and packed:
        return None
    if not documents:
        return "no zarr.json of an arrayckpt array under it (only chunk-named objects): not known to be arrayckpt's"
    arrays = 0
    for name, data in read_documents(documents).items():
        if data is None:
            continue  # deleted meanwhile
        try:
            document = json.loads(data)
        except (ValueError, RecursionError):
            return f"{name} is not JSON: not known to be arrayckpt's"
        node = document.get("node_type") if isinstance(document, dict) else None
        if not isinstance(document, dict) or document.get("zarr_format") != 3 or node not in ("group", "array"):
            return f"{name} is not a Zarr v3 group or array document: not arrayckpt's"
        if node == "group" and is_arrayckpt_root(document):  # a committed checkpoint below: never removed
            return f"holds the committed checkpoint whose root document is {name}: not a leftover"
        if node == "array":
            attributes = document.get("attributes")
            if not (isinstance(attributes, dict) and isinstance(attributes.get("arrayckpt"), dict)):
                return f"{name} describes an array arrayckpt did not write: not arrayckpt's"
            arrays += 1
    if not arrays and not packed:
        return "no zarr.json of an arrayckpt array under it: not known to be arrayckpt's"
    return None


@dataclass(frozen=True)
class LocalIncomplete(Leftover):
    """An incomplete checkpoint in a local directory (no root document; only arrayckpt's files, see
    :func:`incomplete_leftovers`): what an interrupted deletion, or a save on a filesystem without atomic
    renames, leaves."""

    location: LocalLocation
    age_s: float | None

    def remove(self) -> bool:
        """Remove arrayckpt's files and the directories left empty, unless a root document has appeared
        meanwhile (then nothing is touched and ``False`` is returned). ``False`` too when something that is not
        arrayckpt's appeared meanwhile and stays."""
        if os.path.lexists(self.location.path / ROOT_METADATA):
            return False
        return remove_arrayckpt_files(self.location.path)


def incomplete_leftovers(location: Location, min_age_s: float) -> Leftovers:
    """The checkpoint at ``location`` as a leftover when it is incomplete (no root document) and holds only what
    an interrupted arrayckpt save or deletion leaves, untouched for ``min_age_s``: the rule of
    :func:`object_leftovers` (positive evidence: arrayckpt's file names, and a ``zarr.json`` of an array arrayckpt
    wrote; locally a tree of empty directories too). Otherwise nothing is found and, unless nothing or a
    committed checkpoint is there, it is kept with why. Locally, a link or special file is never followed: kept."""
    if isinstance(location, LocalLocation):
        return _local_incomplete(location, min_age_s)
    return _prefix_leftovers(location, min_age_s)  # type: ignore[arg-type]


def _local_incomplete(location: LocalLocation, min_age_s: float) -> Leftovers:
    path = location.path
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        return Leftovers([], [(str(location), "a link or a file, not a directory arrayckpt wrote: left alone")])
    if not path.is_dir() or os.path.lexists(path / ROOT_METADATA):
        return Leftovers([], [])  # nothing there, or committed (or another Zarr hierarchy's): not a leftover
    try:
        keys, newest, odd = directory_files(path)
    except FileNotFoundError:
        return Leftovers([], [])  # removed meanwhile
    if odd is not None:
        return Leftovers([], [(str(location), f"holds {odd!r}, a link or special file: not arrayckpt's")])

    def read(names: list[str]) -> dict[str, bytes | None]:
        out: dict[str, bytes | None] = {}
        for name in names:
            try:
                out[name] = read_regular_file(path / name, str(path / name), follow=False)  # bounded, no link
            except FileNotFoundError:
                out[name] = None
        return out

    if keys:
        problem, age = judge_incomplete(keys, newest, read, min_age_s)
    else:  # only empty directories: removing them removes nothing of anyone's
        age = max(0.0, time.time() - newest)
        problem = None if age >= min_age_s else (f"incomplete checkpoint, maybe still being saved: newest entry "
                                                 f"written {age:.0f} s ago, under the minimum age of {min_age_s:g} s")
    if problem:
        return Leftovers([], [(str(location), problem)])
    return Leftovers([LocalIncomplete(location, age)], [])
