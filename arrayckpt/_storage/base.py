"""The storage interface: where a checkpoint's bytes live, and the commit that makes them a checkpoint.

Every storage (a local directory: ``_storage.local``; an object-storage prefix: ``_storage.object``)
implements all of it, so no caller needs to know which one it holds (cf. zarr-python's ``abc/store.py``:
a small interface, capability flags, optional operations with default bodies). What differs between
storages is stated here as a promise or a flag, not left to ``isinstance``.

Call order of a save (DCP ``storage.py`` style: who calls what, in which order)::

    # coordinator
    writer = location.open_writer(overwrite)       # refuses to replace a committed checkpoint without overwrite
    wait = writer.write_documents({path: doc})     # array/group zarr.json documents, written in the background
    # every rank, with the plan (``writer.target``, ``writer.key_encoding``) broadcast by the coordinator
    writer.target.kvstore(path)                    # TensorStore kvstore spec for array data (writer.target
                                                   #   .write_context() for its context)
    writer.target.finish_rank_writes()             # non-coordinator ranks: fsync their chunks before reporting
    # coordinator, once every rank reported success
    wait()                                         # all metadata written
    writer.missing(chunks)                         # what the ranks reported written is all still there (else abort)
    writer.commit(root_document)                   # last: the root zarr.json; after it the checkpoint is whole
    writer.abort()                                 # instead, on any failure before the commit: removes the save

Until the commit the checkpoint at the location (if any) is whole and readable; after it, the new one is.
A location without a root document but with data is an *incomplete* checkpoint, which every reader refuses.

Call order of a read::

    document, kvstore, release, token = location.open_committed()
    ... read chunks through ``kvstore`` (with ``location.read_context()``) ...
    if not location.pins_reads and location.changed_since(token): ...   # what was read may mix two checkpoints
    release()
"""

from __future__ import annotations

import abc
import enum
import json
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from .._errors import ArrayckptError, BaseNotAllowedError, CorruptCheckpointError, FormatError, LocationError
from .._format.integrity import check_root_integrity
from .._format.jsontypes import JSON, member
from .._format.manifest import INTEGRITY_VERSION, MANIFEST_ATTRIBUTE, is_arrayckpt_root
from .._format.packs import is_pack_key
from .._format.paths import is_location_reference, parse_relative_reference, resolve_relative, shown
from .._format.zarr import ROOT_METADATA

if TYPE_CHECKING:
    from .._io.arrays import StoreContext
    from .packs import PackWriter

__all__ = ["LEASE_NAME", "ROOT_METADATA", "TEMP_MARKER", "Beside", "Claim", "CleanedUp", "Leftover", "Leftovers",
           "Location", "Opened", "Tree", "Writer", "arrayckpt_keys", "check_child_name", "finish_rank_writes",
           "follow_base", "kvstore_at", "open_pack", "open_writer", "parse_location", "parse_root_bytes", "parse_roots",
           "read_into", "read_ranges", "register_scheme", "relative_parts"]

TEMP_MARKER = ".arrayckpt-tmp-"  # local saves write into ``.<name>.arrayckpt-tmp-<hex>`` beside the path
LEASE_NAME = ".arrayckpt-lease"  # object storage: the lease of a save in progress in its prefix (``liveness.py``)


class Tree(NamedTuple):
    """Where a location lies, lexically: its storage (``file``, ``s3://bucket``) and the segments of its path below
    that storage's root. Compared without IO and without following links, as spec §10.1 resolves references."""

    storage: str
    parts: tuple[str, ...]

    def holds(self, other: Tree, strictly: bool = False) -> bool:
        """Whether ``other`` is this tree's location or lies below it (``strictly``: below it only)."""
        n = len(self.parts)
        return other.storage == self.storage and other.parts[:n] == self.parts and len(other.parts) >= n + strictly

    @property
    def parent(self) -> Tree:
        return Tree(self.storage, self.parts[:-1])


class Beside(enum.Enum):
    """What a save does where its local directory holds the user's files besides a checkpoint (DCP's semantics, for
    ``arrayckpt.dcp.ArrayckptWriter``; ``beside.py``); without it (``arrayckpt.save``) such a directory is refused.
    Either way the checkpoint is committed beside the files, keeping them. A committed checkpoint there is another
    matter: replacing it in a shared directory is not atomic (the directory loads as no checkpoint for a moment, and
    a kill then leaves neither), so that is never a default: the save must ask for it, and also pass ``overwrite``."""

    KEEP_CHECKPOINT = "keep-checkpoint"  # a committed checkpoint there is refused, whatever ``overwrite`` says
    REPLACE_CHECKPOINT = "replace-checkpoint"  # ... replaced in place where ``overwrite`` is true


class Location(abc.ABC):
    """Where one checkpoint lives, whether or not one is there yet. Immutable and hashable; ``str()`` is the
    path or URL that :func:`arrayckpt._storage.parse_location` turns back into an equal location."""

    #: Whether :meth:`open_committed`'s kvstore keeps reading the checkpoint that was opened, whatever replaces
    #: it at the location meanwhile (local: the directory is pinned). Where ``False`` (object storage) a read
    #: racing an overwrite can return chunks of two checkpoints, so readers must call :meth:`changed_since`
    #: after reading. Either way, a replaced checkpoint's data may be gone: reads of it then fail.
    pins_reads: ClassVar[bool] = False
    #: Whether the ranks of a load share one read of the root document (``_storage/shared.py``): where a read is a
    #: request (object storage); a local directory is opened, and pinned, by every process itself.
    shares_root: ClassVar[bool] = False

    def read_root_bytes(self) -> tuple[bytes, Any]:
        """The committed root document as stored, and the token of what was read (for :meth:`changed_since`);
        where :attr:`shares_root`. Errors as :meth:`read_root`."""
        raise NotImplementedError(f"{self}: its root document is not shared between ranks")

    @abc.abstractmethod
    def __str__(self) -> str: ...

    @property
    @abc.abstractmethod
    def native(self) -> Path | str:
        """The location as arrayckpt's public API shows it: a ``Path`` locally, the URL on object storage."""

    # --- data ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def kvstore(self, subpath: str = "") -> JSON:
        """TensorStore kvstore spec of the "directory" ``subpath`` inside the checkpoint (ends in ``/``)."""

    @abc.abstractmethod
    def read_context(self) -> StoreContext:
        """The TensorStore context to read this storage with."""

    @abc.abstractmethod
    def write_context(self) -> StoreContext:
        """The TensorStore context to write this storage with (array data of a save)."""

    # --- reading ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def read_root(self) -> JSON:
        """The parsed root ``zarr.json`` of a committed checkpoint. Raises ``CheckpointNotFoundError`` when
        nothing is there, ``IncompleteCheckpointError`` when data but no root document is (a save that never
        committed), ``CorruptCheckpointError`` when the root document is not JSON, ``StorageError`` when
        the storage fails."""

    @abc.abstractmethod
    def open_committed(self) -> Opened:
        """Open the committed checkpoint for reading: its root document, the kvstore spec to read its data
        through, a function that releases what the open holds (call it once, when done), and a token for
        :meth:`changed_since`. Errors as :meth:`read_root`."""

    @abc.abstractmethod
    def changed_since(self, token: Any) -> bool:
        """Whether the checkpoint opened as ``token`` (from :meth:`open_committed`) is no longer the one at the
        location: replaced by an overwrite, or removed. Cheap (one small request or ``stat``)."""

    @abc.abstractmethod
    def node_document(self, node_path: str) -> bytes | None:
        """The ``zarr.json`` of the node at ``node_path`` inside the checkpoint (``""``: the root) as stored,
        or ``None`` when there is none."""

    def is_committed(self) -> bool:
        """Whether an arrayckpt checkpoint is committed here (a foreign Zarr hierarchy does not count).
        Never raises for what :meth:`read_root` reports as an error."""
        try:
            document = self.read_root()
        except ArrayckptError:
            return False
        return is_arrayckpt_root(document)

    # --- the places around it --------------------------------------------------------------------

    @abc.abstractmethod
    def children(self) -> list[str]:
        """Sorted names of what is right below this location (local: directories; object storage: prefixes),
        committed checkpoints or not. Saves in progress locally (hidden temporary directories) are not
        children: they are :meth:`leftovers` once abandoned."""

    @abc.abstractmethod
    def child(self, name: str) -> Location:
        """The location ``name`` right below this one, on the same storage with the same options."""

    @abc.abstractmethod
    def leftovers(self, min_age_s: float) -> Leftovers:
        """What interrupted saves left right below this location and nobody has touched for ``min_age_s``
        seconds (``found``), and what looked like it but stays, each with why (``kept``). Committed
        checkpoints and data that is not arrayckpt's are never found. Removing is up to the caller
        (:meth:`Leftover.remove`). Raises ``CheckpointNotFoundError`` or ``StateError`` when this location
        cannot hold checkpoints (not a directory; inside a checkpoint or another Zarr hierarchy)."""

    @property
    def tree(self) -> Tree:
        """Where this location lies, lexically (its path normalised, links not followed), from ``str(self)``: a
        local path, or ``scheme://bucket/prefix``."""
        scheme, separator, rest = str(self).partition("://")
        if not separator:
            return Tree("file", tuple(s for s in os.path.normpath(scheme).split("/") if s))
        bucket, _, prefix = rest.partition("/")
        return Tree(f"{scheme}://{bucket}", tuple(s for s in prefix.split("/") if s))

    def refuse_links_below(self, ancestor: Tree, where: str) -> None:
        """Refuse a symbolic link at any level from ``ancestor`` (which holds this location, lexically) down to this
        location: a base reached through one could be anywhere, and ``copy`` would write through it. ``where``
        starts the error. Object storage has no links: nothing to check."""
        return None

    @abc.abstractmethod
    def resolve(self, reference: str) -> Location:
        """The location that ``reference``, written in a checkpoint at this location, names: a path relative
        to this location (spec §10.1's grammar, resolved on segments; ``FormatError`` when it climbs above the
        storage's root), or an absolute path or URL (which gets this location's storage options when it is
        on the same kind of storage). Says nothing about whether a reader may follow it: :func:`follow_base`."""

    @abc.abstractmethod
    def reference_from(self, other: Location) -> str:
        """How a checkpoint at ``other`` names this location, so that ``other.resolve(...)`` gives it back: a
        relative path when both are on the same storage (a chain of checkpoints can be moved as a whole),
        else this location's absolute path or URL."""

    # --- writing ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def open_writer(self, overwrite: bool, beside: Beside | None = None) -> Writer:
        """Start one save to this location. Raises ``CheckpointExistsError`` when a committed checkpoint is
        here and ``overwrite`` is false, or when something that is not arrayckpt's is in the way — unless
        ``beside`` says to keep it where the storage can: the checkpoint is then committed beside it (locally,
        ``beside.py``; DCP's semantics, for ``arrayckpt.dcp.ArrayckptWriter``)."""

    def make_directory(self) -> None:
        """Create this location as a place below which checkpoints can be saved and listed, where the storage
        has directories (locally, with its parents). Nothing by default: object-storage prefixes need no
        creating."""
        return None

    def without_fsync(self) -> Location:
        """This location for a save with ``durable=False``: one that skips the fsync before the commit (itself
        where the storage has nothing to sync to disk: object stores acknowledge a PUT once it is durable)."""
        return self

    def finish_rank_writes(self) -> None:
        """What a rank does after writing its chunks to this location (a writer's ``target``), before it
        reports success to the coordinator: make them durable. Nothing by default (object stores have nothing
        to fsync)."""
        return None

    # --- packs (issue 35: a rank's chunk files appended into one file or object; ``packs.py``) -----------------

    def open_pack(self, rank: int, tag: str = "") -> PackWriter:
        """Start rank ``rank``'s pack of the save tagged ``tag`` here (a writer's :attr:`Writer.target`): the one file
        or object ``pack_name(rank, tag)``. ``NotImplementedError`` where the storage holds no packs."""
        raise NotImplementedError(f"{self}: this storage holds no packs")

    def read_pack(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, length)`` range of the pack file ``name`` (relative to this location), read
        concurrently. A missing pack, or one shorter than a range, is ``CorruptCheckpointError`` naming the checkpoint,
        the pack and the range (missing data is never zeros); a failing storage is ``StorageError``."""
        raise NotImplementedError(f"{self}: this storage holds no packs")

    def read_pack_into(self, name: str, ranges: Sequence[tuple[int, int]], buffers: Sequence[memoryview]) -> None:
        """:meth:`read_pack` into writable buffers of the caller, one per range and of its length."""
        raise NotImplementedError(f"{self}: this storage holds no packs")

    def write_references(self, data: bytes) -> None:
        """Write ``data`` as the kerchunk references (``refs.json``, spec §16.4) of the committed packed checkpoint
        here, replacing any, whole or not at all (a reader sees the old file or the new one): ``arrayckpt refs``.
        Never through a link. ``NotImplementedError`` where the storage holds no packs."""
        raise NotImplementedError(f"{self}: this storage holds no packs")

    def write_marker(self) -> None:
        """Write the DCP marker (spec §2.1, ``_format/marker.py``) beside the committed checkpoint here, whole or not
        at all, so that DCP-based tools that find checkpoints by their ``.metadata`` find this one."""
        raise NotImplementedError(f"{self}: this storage takes no DCP marker")

    @abc.abstractmethod
    def delete(self) -> None:
        """Remove the checkpoint here: its DCP marker (spec §2.1: only when it is arrayckpt's) and the commit (root
        document) first, so that a deletion cut short leaves an incomplete checkpoint that no tool takes for a
        checkpoint, never a damaged committed one. Nothing here is not an error."""

    @abc.abstractmethod
    def claim(self, patience_s: float = 0.0) -> Claim:
        """Hold this location as the root of one writer of many checkpoints (a ``CheckpointManager``'s coordinator):
        locally an exclusive ``flock`` on a lock file in it, on object storage a lease object (spec §9.4), whose
        holder is watched for up to ``patience_s`` until it expires or is renewed. Raises ``CheckpointBusyError``
        naming the holder when another one holds it, ``StorageError`` when the storage cannot be reached or
        written."""


class Writer(abc.ABC):
    """One save to one location (see the module docstring for the call order)."""

    location: Location  # where the checkpoint appears at the commit
    target: Location  # where the ranks write the data (may differ from ``location``: a temporary directory)
    key_encoding: str  # the Zarr chunk key encoding the save's arrays must use ("default" or "v2")

    def kvstore(self, subpath: str = "") -> JSON:
        """TensorStore kvstore spec of ``subpath`` inside the checkpoint being written."""
        return self.target.kvstore(subpath)

    @abc.abstractmethod
    def write_documents(self, documents: Mapping[str, bytes]) -> Callable[[], None]:
        """Start writing serialised node ``zarr.json`` documents (node path -> bytes); the returned function
        waits for them and raises ``StorageError`` naming the first failure. (A storage may defer them until
        the commit, where describing the new arrays earlier would mislead readers of the old checkpoint.)"""

    def write_file(self, name: str, data: bytes) -> None:
        """Write the file ``name`` (relative to the checkpoint: a packed checkpoint's index and references) into
        :attr:`target`, before the commit. ``NotImplementedError`` where the storage holds no packs."""
        raise NotImplementedError(f"{self.location}: this storage holds no packed checkpoints")

    @abc.abstractmethod
    def missing(self, chunks: Mapping[str, Collection[str]]) -> list[str]:
        """Right before the commit: the files or objects of this save (``chunks``: node path -> the chunk key names
        the ranks reported written there; and the node documents this writer wrote itself) that are not in
        :attr:`target` now (removed by something that ignored the save's lock or lease, spec §9.4), as paths
        relative to it. Locally it also finds a temporary directory that was removed or replaced (everything
        missing then). Cheap: one directory listing per node locally, one LIST per 1,000 objects on object storage."""

    @abc.abstractmethod
    def commit(self, root_document: bytes) -> None:
        """Write the root document after everything else and make the checkpoint visible and durable: the
        commit. Once it returns, the new checkpoint is the one at the location."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Remove what this save wrote (called instead of :meth:`commit`); a committed checkpoint it was
        going to replace stays whole. Never raises for a failed clean-up (it warns)."""


class Claim(abc.ABC):
    """What :meth:`Location.claim` holds, until :meth:`release`."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise ``CheckpointBusyError`` unless it is still held (cheap: a ``stat``, or one GET)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Let it go (nothing once released)."""


class Leftover(abc.ABC):
    """Something an interrupted save left: a temporary directory, or an incomplete checkpoint's prefix."""

    location: Location  # where it is
    age_s: float | None  # seconds since it was last written to (None: the storage gives no times)

    @property
    def url(self) -> str:
        return str(self.location)

    @abc.abstractmethod
    def remove(self) -> bool:
        """Remove it, unless it turned out to be a committed checkpoint after all (then ``False``)."""


class Opened(NamedTuple):
    """What :meth:`Location.open_committed` gives: the committed checkpoint opened for reading."""

    document: JSON  # the root document, parsed and checked
    kvstore: JSON  # the TensorStore kvstore spec to read its data through
    release: Callable[[], None]  # releases what the open holds (call it once, when done)
    token: Any  # for :meth:`Location.changed_since`


class Leftovers(NamedTuple):
    """What :meth:`Location.leftovers` finds: removable leftovers, and ``(url, why it stays)`` for the rest."""

    found: list[Leftover]
    kept: list[tuple[str, str]]


class CleanedUp(NamedTuple):
    """What a clean-up did (a checkpoint manager's tier, say): what it removed, and ``(path, why it stays)`` for what
    looked like a leftover but was kept."""

    removed: list[str]
    kept: list[tuple[str, str]]


def check_child_name(name: str, where: object) -> None:
    """Refuse a child name that is not one plain path segment."""
    if not name or name in (".", "..") or "/" in name:
        raise ValueError(f"{where}: {name!r} is not the name of a location right below it")


def parse_roots(roots: Iterable[str | os.PathLike[str] | Location] | None,
                storage_options: Mapping[str, Any] | None = None) -> tuple[Location, ...]:
    """The ``base_roots`` a caller passed, as locations (object-storage ones with ``storage_options``)."""
    if roots is None:
        return ()
    if isinstance(roots, (str, os.PathLike, Location)):
        roots = [roots]
    out = []
    for root in roots:
        location = root if isinstance(root, Location) else parse_location(
            root, storage_options if "://" in os.fspath(root) else None)
        out.append(location)
    return tuple(out)


def relative_parts(location: Location, reference: str) -> tuple[str, ...]:
    """The path segments (below the storage's root) that a relative base reference written in the checkpoint at
    ``location`` leads to: spec §10.1's grammar and lexical resolution (``_format/paths.py``)."""
    where = str(location)
    return resolve_relative(location.tree.parts, parse_relative_reference(reference, where), where)


def follow_base(delta: Location, reference: str, roots: Iterable[Location] = ()) -> Location:
    """Where the delta checkpoint at ``delta`` finds the base its ``base.path`` names, if a reader may go there
    (spec §10.1): a relative reference that stays inside the directory (prefix) holding ``delta``, or any
    reference inside one of ``roots``, the places the caller named; never ``delta`` itself or a place inside it.
    Raises :class:`BaseNotAllowedError` naming the reference and the fix, or ``FormatError`` for a reference that
    is malformed or climbs above the root of its storage."""
    target = delta.resolve(reference)
    where, own = target.tree, delta.tree
    if own.holds(where):
        raise FormatError(f"{delta}: its base reference {shown(reference)} names the checkpoint itself or a place "
                          "inside it; it was damaged or crafted")
    holding = [root.tree for root in roots if root.tree.holds(where)]
    if not holding and not is_location_reference(reference) and own.parent.holds(where, strictly=True):
        holding = [own.parent]
    if holding:  # lexically inside: and on disk too, through no link (the place named may itself be one)
        target.refuse_links_below(holding[0], f"{delta}: its base reference {shown(reference)}")
        return target
    place = "outside the directory holding it" if not is_location_reference(reference) else \
        "an absolute location, which is followed only inside a root you name"
    suggestion = str(target).rstrip("/").rpartition("/")[0] or "/"  # the directory (prefix) holding the base
    raise BaseNotAllowedError(
        f"{delta}: its base reference {shown(reference)} leads to {target}, {place}; a delta checkpoint from an "
        f"untrusted source could name any place this way. If you trust it, name a root that holds its base: "
        f"base_roots=[{suggestion!r}] (command line: --base-root {suggestion})")


def kvstore_at(base: JSON, subpath: str) -> JSON:
    """The kvstore spec of ``subpath`` inside the checkpoint whose (directory) kvstore spec is ``base``."""
    if not subpath:
        return base
    return {**base, "path": f"{base['path']}{subpath}/"}


def parse_root_bytes(data: bytes, where: object) -> JSON:
    """A root ``zarr.json``'s bytes parsed, with its checksum checked when it is arrayckpt's (spec §11), or
    ``CorruptCheckpointError``."""
    try:
        document: JSON = json.loads(data)
    except (ValueError, RecursionError) as e:  # not JSON, nested too deep, an integer of too many digits
        problem = e if isinstance(e, ValueError) else "JSON nested too deeply"
        raise CorruptCheckpointError(f"{where}: root zarr.json is damaged: {problem}") from None
    if is_arrayckpt_root(document) and isinstance(manifest := member(document, "attributes", MANIFEST_ATTRIBUTE), dict):
        version = manifest.get("format_version")
        required = isinstance(version, int) and version >= INTEGRITY_VERSION
        check_root_integrity(data, manifest, required, where)
    return document


_CHUNK_NAME = re.compile(r"c(\.\d+)*|\d+(\.\d+)*")


def arrayckpt_keys(keys: list[str]) -> list[str]:
    """Keys shaped like arrayckpt's objects (``zarr.json`` documents, chunk keys, and a save's lease at the top of a
    checkpoint's prefix), made of plain segments only; others are left alone. An object store keeps ``a/../../b`` as
    a key of its own, but TensorStore's HTTP client normalises the URL it is sent to (measured with moto: reading,
    writing or deleting ``run/x/../../victim/zarr.json`` reaches ``victim/zarr.json``, outside the prefix), so such
    a key is never arrayckpt's to touch."""
    return [k for k in keys if _plain_key(k) and (k == LEASE_NAME or k.rpartition("/")[2] == ROOT_METADATA
                                                 or _CHUNK_NAME.fullmatch(k.rpartition("/")[2]) or is_pack_key(k))]


def _plain_key(key: str) -> bool:
    """Whether ``key`` is plain segments joined by ``/``: none empty, ``.`` or ``..``, no backslash or NUL."""
    return "\\" not in key and "\x00" not in key and all(s not in ("", ".", "..") for s in key.split("/"))


# --- from what the user passed to a location ----------------------------------------------------------------

Parser = Callable[[str, Mapping[str, Any] | None], Location]
_PARSERS: dict[str, Parser] = {}  # URL scheme -> parser; "file" also takes plain paths (without "file://")


def register_scheme(scheme: str, parser: Parser) -> None:
    """Make :func:`parse_location` hand ``scheme://...`` URLs (and their storage options) to ``parser``; each
    storage registers its schemes when its module is imported (``arrayckpt._storage`` imports them all)."""
    _PARSERS[scheme] = parser


def parse_location(path: str | os.PathLike[str] | Location,
                   storage_options: Mapping[str, Any] | None = None) -> Location:
    """Turn what the user passed into a location: a local path or ``file://`` URL, or an object-storage URL
    (``s3://``, ``gs://``, ``memory://``) with its storage options. A location is returned as it is."""
    if isinstance(path, Location):
        return path
    text = os.fspath(path)
    scheme, separator, rest = text.partition("://")
    if not separator:
        scheme, rest = "file", text
    parser = _PARSERS.get(scheme)
    if parser is None:
        others = ", ".join(s + "://" for s in _PARSERS if s != "file")
        raise LocationError(f"{text!r}: URL scheme {scheme!r} is not supported; use a local path, file://, "
                         f"or one of {others}")
    return parser(rest if scheme == "file" else text, storage_options)


def open_writer(location: Location, overwrite: bool) -> Writer:
    """The writer for one save to ``location`` (refuses to replace a committed checkpoint without ``overwrite``)."""
    return location.open_writer(overwrite)


def finish_rank_writes(target: Location) -> None:
    """What a non-coordinator rank does after writing its chunks to ``target`` (see :class:`Location`)."""
    target.finish_rank_writes()


def open_pack(target: Location, rank: int, tag: str = "") -> PackWriter:
    """Rank ``rank``'s pack in a writer's ``target`` (see :meth:`Location.open_pack` and ``packs.py``)."""
    return target.open_pack(rank, tag)


def read_ranges(location: Location, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """The ``(offset, length)`` ranges of the pack file ``name`` at ``location`` (:meth:`Location.read_pack`)."""
    return location.read_pack(name, ranges)


def read_into(location: Location, name: str, ranges: Sequence[tuple[int, int]], buffers: Sequence[memoryview]) -> None:
    """The ranges of the pack file ``name`` into ``buffers`` (:meth:`Location.read_pack_into`)."""
    location.read_pack_into(name, ranges, buffers)
