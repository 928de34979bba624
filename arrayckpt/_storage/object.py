"""Object storage (S3, GCS, TensorStore's in-memory store): a checkpoint is a key prefix.

There is no rename on object storage, so the commit is the root ``zarr.json``: one PUT, written last by the
coordinator after every chunk (S3 and GCS make a whole object visible at once, and reads after a write see it). A
prefix holding objects but no root document is an incomplete checkpoint.

Replacing a committed checkpoint must not touch it before the new one commits, yet Zarr fixes where each array's
chunks live. Chunk keys are what can differ: Zarr v3 has two chunk key encodings, and arrayckpt alternates between
them from one save at a prefix to the next (``default``: ``c.0.1``, ``c`` for a 0-d array; ``v2``: ``0.1``, ``0``),
so the new chunks never land on the old ones. The per-array ``zarr.json`` documents are written only after the
commit (arrayckpt and zarr-python read the root's consolidated copies), then the old generation's chunks and any
other stale objects are deleted. Until the commit the old checkpoint is whole; after it, the new one is.

All IO, metadata included, goes through TensorStore's kvstores, so one client configuration
(endpoint, credentials, retries, concurrency) serves chunks and metadata alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    LocationError,
    StorageError,
)
from .._format.jsontypes import JSON, json_object, member
from .._format.manifest import MANIFEST_ATTRIBUTE, NODES_MEMBER, is_arrayckpt_root
from .._format.marker import MARKER, MARKER_NAME, is_marker
from .._format.packs import PACKS_MEMBER, REFS_NAME, is_pack_key
from .._format.zarr import KEY_ENCODINGS, parse_chunk_key
from .._settings import settings
from .base import (
    LEASE_NAME,
    ROOT_METADATA,
    Beside,
    Leftovers,
    Location,
    Opened,
    Writer,
    arrayckpt_keys,
    check_child_name,
    parse_location,
    parse_root_bytes,
    register_scheme,
    relative_parts,
)
from .clients import driver_spec, fsspec_options, listing_fs, object_context, resolve_options
from .gc import hierarchies_above, object_leftovers
from .kvio import delete_keys as _delete
from .kvio import list_keys as _list
from .kvio import read_key as _read
from .kvio import wait_all as _wait
from .kvio import write_key as _write
from .liveness import MANAGER_LEASE, Lease
from .packread import read_object_ranges
from .packs import MAX_PARTS, ObjectPackWriter, Upload

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["OBJECT_SCHEMES", "Kept", "ObjectLocation", "ObjectWriter", "kept_of", "object_context", "parse_object_url",
           "stale_keys"]

OBJECT_SCHEMES = ("s3", "gs", "memory")


@dataclass(frozen=True)
class ObjectLocation(Location):
    """A checkpoint at ``scheme://bucket/prefix`` on object storage."""

    scheme: str
    bucket: str
    prefix: str  # no leading or trailing "/"; "" is the bucket's root
    options: tuple[tuple[str, Any], ...] = ()  # resolved storage options, sorted (hashable)

    # pins_reads is False: nothing can pin a prefix, so readers check changed_since after reading
    shares_root = True  # one GET of the root document for all the ranks of a load

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.prefix}" if self.prefix else f"{self.scheme}://{self.bucket}"

    def __repr__(self) -> str:  # never show a secret (tracebacks with locals, logs)
        shown = tuple((k, "***" if k in ("secret", "token") else v) for k, v in self.options)
        return f"ObjectLocation({self.scheme!r}, {self.bucket!r}, {self.prefix!r}, options={shown!r})"

    @property
    def native(self) -> str:
        return str(self)

    @property
    def option(self) -> dict[str, Any]:
        return dict(self.options)

    def kvstore(self, subpath: str = "") -> JSON:
        """TensorStore kvstore spec of a "directory" (key prefix) inside the checkpoint."""
        # the memory kvstore has no buckets: the bucket is the first path segment there
        path = "/".join(p for p in (self.bucket if self.scheme == "memory" else "", self.prefix, subpath) if p)
        spec = driver_spec(self.scheme, self.bucket, self.option)
        spec["path"] = f"{path}/" if path else ""
        return spec

    def context(self) -> ts.Context:
        return object_context(self.scheme, self.options)

    read_context = write_context = context

    def open_committed(self) -> Opened:
        """The root document, the kvstore to read data from, a release function (nothing can be pinned on
        object storage) and the root's storage generation, for :meth:`changed_since`."""
        document, generation = self._read_root_stamped()
        return Opened(document, self.kvstore(), lambda: None, generation)

    def read_root_bytes(self) -> tuple[bytes, bytes]:
        try:
            result = self.open_store().read(ROOT_METADATA).result()
        except Exception as e:
            raise StorageError(f"{self}: reading {ROOT_METADATA} failed: {e}") from e
        if result.state != "value":
            self.read_root()  # says what is there instead: an incomplete checkpoint, or nothing
            raise CheckpointNotFoundError(f"{self}: no checkpoint here")
        return bytes(result.value), result.stamp.generation

    def changed_since(self, generation: bytes) -> bool:
        """Whether the root document is no longer ``generation``'s (replaced or removed): a conditional GET that
        transfers nothing while unchanged (a store answering with the object anyway is judged by its generation)."""
        try:
            result = self.open_store().read(ROOT_METADATA, if_not_equal=generation).result()
        except Exception as e:
            raise StorageError(f"{self}: re-reading the root zarr.json failed: {e}") from e
        return result.state == "missing" or (result.state == "value" and result.stamp.generation != generation)

    # --- reading --------------------------------------------------------------------------------

    def open_store(self) -> ts.KvStore:
        """The kvstore of the checkpoint's prefix (keys relative to it)."""
        try:
            import tensorstore as ts  # on first use (CLI start-up)
            return ts.KvStore.open(self.kvstore(), context=self.context()).result()
        except Exception as e:
            raise StorageError(f"{self}: cannot open the object store: {e}") from e

    def read_root(self) -> JSON:
        """The root ``zarr.json`` of a committed checkpoint, or a clear error saying what is there instead."""
        return self._read_root_stamped()[0]

    def _read_root_stamped(self) -> tuple[JSON, bytes]:
        store = self.open_store()
        try:
            result = store.read(ROOT_METADATA).result()
        except Exception as e:
            raise StorageError(f"{self}: reading {ROOT_METADATA} failed: {e}") from e
        data = result.value if result.state == "value" else None
        if data is None:
            if _list(store, self):
                raise IncompleteCheckpointError(
                    f"{self}: incomplete checkpoint (objects but no root zarr.json: its save never committed; "
                    "save again with overwrite=True to replace it)")
            raise CheckpointNotFoundError(f"{self}: no checkpoint here")
        return parse_root_bytes(data, self), result.stamp.generation

    def node_document(self, node_path: str) -> bytes | None:
        """A node's own ``zarr.json`` (``None`` when absent)."""
        return _read(self.open_store(), f"{node_path}/{ROOT_METADATA}" if node_path else ROOT_METADATA, self)

    def fsspec_options(self) -> dict[str, Any]:
        """The same storage options for fsspec (s3fs, gcsfs): e.g. ``zarr.open_group(url, storage_options=...)``."""
        return fsspec_options(self.scheme, self.option)

    # --- objects below the prefix (keys relative to it) -------------------------------------------

    def object_keys(self) -> list[str]:
        """Every object's key below the prefix (one LIST per 1,000 objects)."""
        return _list(self.open_store(), self)

    def object_times(self) -> list[tuple[str, float | None]]:
        """Every object below the prefix with its modification time (epoch seconds), where the store tells: through
        s3fs on S3 (``LastModified``) and gcsfs on GCS (``updated``); elsewhere TensorStore's listing, without times."""
        fs = listing_fs(self.scheme, self.option, skip_instance_cache=True)
        if fs is None:
            return [(key, None) for key in self.object_keys()]
        base = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        try:
            entries = fs.find(base, detail=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise StorageError(f"{self}: listing failed: {e}") from e
        out = []
        for name, info in entries.items():
            if info.get("type") == "directory" or not name.startswith(base + "/"):
                continue
            modified = info.get("LastModified" if self.scheme == "s3" else "mtime")
            out.append((name[len(base) + 1:], modified.timestamp() if modified is not None else None))
        return out

    def read_objects(self, keys: list[str]) -> dict[str, bytes | None]:
        """Objects read concurrently: key -> bytes (``None`` where there is no such object)."""
        store = self.open_store()
        pending = [(key, store.read(key)) for key in keys]
        _wait(pending, self, "reading")
        out: dict[str, bytes | None] = {}
        for key, future in pending:
            result = future.result()
            out[key] = result.value if result.state == "value" else None
        return out

    def delete_objects(self, keys: list[str]) -> None:
        """Delete these objects (one DELETE each, concurrently)."""
        _delete(self.open_store(), keys, self)

    # --- the places around it --------------------------------------------------------------------

    def children(self) -> list[str]:
        """Names of the "directories" right below the prefix: one delimited listing through s3fs or gcsfs where
        installed (TensorStore lists every key below, recursively); elsewhere TensorStore's listing."""
        fs = listing_fs(self.scheme, self.option)
        if fs is None:
            return sorted({key.split("/", 1)[0] for key in self.object_keys() if "/" in key})
        path = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        try:
            entries = fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise StorageError(f"{self}: listing failed: {e}") from e
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def child(self, name: str) -> ObjectLocation:
        check_child_name(name, self)
        return dataclasses.replace(self, prefix=f"{self.prefix}/{name}" if self.prefix else name)

    def leftovers(self, min_age_s: float) -> Leftovers:
        """Incomplete checkpoints right below the prefix, by the rules of spec §9.3 (see
        :func:`arrayckpt._storage.gc.object_leftovers`)."""
        return object_leftovers(self, min_age_s)

    def resolve(self, reference: str) -> Location:
        if "://" in reference or os.path.isabs(reference):
            # this location's storage options (credentials) go only to one on the same kind of storage
            same = "://" in reference and reference.partition("://")[0] == self.scheme
            return parse_location(reference, self.option if same and self.options else None)
        return dataclasses.replace(self, prefix="/".join(relative_parts(self, reference)))  # spec §10.1

    def reference_from(self, other: Location) -> str:
        if isinstance(other, ObjectLocation) and (other.scheme, other.bucket) == (self.scheme, self.bucket):
            return posixpath.relpath("/" + self.prefix, "/" + other.prefix)
        return str(self)

    # --- writing ---------------------------------------------------------------------------------

    def open_writer(self, overwrite: bool, beside: Beside | None = None) -> ObjectWriter:
        return ObjectWriter(self, overwrite)  # other objects under the prefix stay refused (beside or not)

    def open_pack(self, rank: int, tag: str = "") -> ObjectPackWriter:
        """One object; larger than one part (``object_part_bytes``): uploaded in parts through s3fs or gcsfs (a
        multipart upload on S3, a resumable one on GCS); on ``memory://`` written whole at close."""
        upload = None if self.scheme == "memory" else self._open_upload
        return ObjectPackWriter(self.open_store(), rank, self, settings().object_part_bytes, upload,
                                MAX_PARTS if self.scheme == "s3" else None, tag)

    def _open_upload(self, name: str, part_bytes: int) -> Upload:
        """The upload of the object ``name`` below the prefix, in parts of ``part_bytes`` (an fsspec file)."""
        fs = listing_fs(self.scheme, self.option)
        if fs is None:
            extra, library = ("s3", "s3fs") if self.scheme == "s3" else ("gcs", "gcsfs")
            raise StorageError(f"{self}: a pack larger than one part (object_part_bytes) is uploaded in parts through "
                               f"{library}, which is not installed: pip install 'arrayckpt[{extra}]'")
        upload: Upload = fs.open("/".join(p for p in (self.bucket, self.prefix, name) if p), "wb",
                                 block_size=part_bytes)
        return upload

    def read_pack(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return read_object_ranges(self.open_store(), name, ranges, self)

    def read_pack_into(self, name: str, ranges: Sequence[tuple[int, int]], buffers: Sequence[memoryview]) -> None:
        read_object_ranges(self.open_store(), name, ranges, self, buffers)

    def claim(self, patience_s: float = 0.0) -> Lease:
        return Lease(self.open_store(), MANAGER_LEASE, str(self), "another CheckpointManager holds this root",
                     patience_s)

    def write_references(self, data: bytes) -> None:
        """One PUT (an object appears whole)."""
        _wait([(REFS_NAME, _write(self.open_store(), REFS_NAME, data, self))], self, "writing the references")

    def write_marker(self) -> None:
        """One PUT (an object appears whole)."""
        _wait([(MARKER_NAME, _write(self.open_store(), MARKER_NAME, MARKER, self))], self, "writing the DCP marker")

    def delete(self) -> None:
        """Remove the checkpoint: its DCP marker (when arrayckpt's) and the commit first (so a half-deleted one reads
        as incomplete), then the rest."""
        store = self.open_store()
        keys = _list(store, self)
        if MARKER_NAME in keys and is_marker(_read(store, MARKER_NAME, self) or b""):
            _delete(store, [MARKER_NAME], self)
        _delete(store, [ROOT_METADATA], self)
        _delete(store, [k for k in arrayckpt_keys(keys) if k != ROOT_METADATA], self)


def parse_object_url(text: str, storage_options: Mapping[str, Any] | None = None) -> ObjectLocation:
    """``s3://bucket/prefix`` (or ``gs://``, ``memory://``) with its storage options resolved (given options first,
    then the standard environment variables: see :func:`arrayckpt._storage.clients.resolve_options`)."""
    scheme, _, rest = text.partition("://")
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not bucket:
        raise LocationError(f"{text!r}: no bucket in the URL; write {scheme}://BUCKET/PREFIX")
    if any(part in (".", "..") for part in prefix.split("/")) or "//" in prefix:
        raise LocationError(f"{text!r}: the prefix must not contain '.', '..' or empty segments (object storage "
                            f"would keep them in the keys, not resolve them); write the prefix they stand for: "
                            f"{scheme + '://' + bucket + posixpath.normpath('/' + prefix)!r}")
    options = resolve_options(text, scheme, storage_options)
    return ObjectLocation(scheme, bucket, prefix, tuple(sorted(options.items())))


for _scheme in OBJECT_SCHEMES:
    register_scheme(_scheme, parse_object_url)


@dataclass(frozen=True)
class Kept:
    """What a committed checkpoint's root document says is its own below its prefix: its node metadata and, packed
    (spec §16), its packs, index and references (then no node document or chunk object is its own)."""

    nodes: Mapping[str, JSON]
    files: frozenset[str] = frozenset()
    packed: bool = False


def kept_of(document: object) -> Kept:
    """The :class:`Kept` of a root document (an arrayckpt root, parsed leniently: this decides what a save deletes,
    and a damaged root keeps nothing of its own)."""
    root = json_object(document)
    attributes = json_object(member(root, "attributes", MANIFEST_ATTRIBUTE))
    packs = attributes.get(PACKS_MEMBER)
    if isinstance(packs, dict):
        listed = packs.get("files")
        files = {str(item[0]) for item in (listed if isinstance(listed, list) else [])
                 if isinstance(item, list) and item}
        index = member(packs, "index", "name")
        files.update([str(index), REFS_NAME] if isinstance(index, str) else [REFS_NAME])
        nodes = attributes.get(NODES_MEMBER)
        return Kept(nodes if isinstance(nodes, dict) else {}, frozenset(files), True)
    metadata = member(root, "consolidated_metadata", "metadata")
    return Kept(metadata if isinstance(metadata, dict) else {})


def stale_keys(keys: list[str], kept: Kept) -> list[str]:
    """The keys among ``keys`` that are arrayckpt-shaped but not part of the committed checkpoint that keeps
    ``kept``: chunks of another generation or of arrays it does not have, documents of nodes it does not have, packs
    and indexes of other saves (and, when it is packed, every node document and chunk object)."""
    stale = []
    for key in arrayckpt_keys(keys):
        node, _, name = key.rpartition("/")
        if key == ROOT_METADATA or key in kept.files:
            continue
        metadata = kept.nodes.get(node)
        if kept.packed or is_pack_key(key) or not isinstance(metadata, dict):
            stale.append(key)
        elif name == ROOT_METADATA:
            continue
        elif metadata.get("node_type") != "array" or parse_chunk_key(metadata, name) is None:
            stale.append(key)
    return stale


def _encoding_of(nodes: Mapping[str, JSON]) -> str:
    for metadata in nodes.values():
        if isinstance(metadata, dict) and metadata.get("node_type") == "array":
            return str(json_object(metadata.get("chunk_key_encoding")).get("name", "default"))
    return "default"


class ObjectWriter(Writer):
    """One save to an object-storage prefix; the root ``zarr.json`` PUT is the commit."""

    location: ObjectLocation

    def __init__(self, location: ObjectLocation, overwrite: bool) -> None:
        self.location = location
        self.store = location.open_store()
        self.target = location  # where the ranks write
        self._old_nodes: dict[str, JSON] | None = None  # the committed checkpoint being replaced
        self._old = Kept({})  # what it keeps (its nodes, or its packs)
        self._deferred_files: dict[str, bytes] = {}  # written after the commit (references: read by others)
        self._deferred: Mapping[str, bytes] = {}
        self._sweep = True  # list and delete stale objects after the commit (not needed on an empty prefix)
        self._outcome_unknown = False  # the commit PUT failed and the root could not be read back: delete nothing
        self._lease: Lease | None = None  # a save to a prefix without a committed checkpoint holds one (spec §9.4)
        self._written: list[str] = []  # node paths whose zarr.json was written before the commit
        self._listed: list[str] | None = None  # the listing of the check before the commit (reused by the sweep)
        for here, ours in hierarchies_above(location, itself=False):  # one GET per prefix above
            if ours:  # its overwrite or deletion would delete this checkpoint's objects as its own stale ones
                raise CheckpointExistsError(
                    f"{location}: lies inside the committed checkpoint at {here}; refusing to save a checkpoint "
                    f"there (replacing or deleting {here} would delete it); choose a prefix outside it")
        root = _read(self.store, ROOT_METADATA, location)
        if root is not None:
            try:
                document = json.loads(root)
            except (ValueError, RecursionError):
                document = None
            if not is_arrayckpt_root(document):
                raise CheckpointExistsError(f"{location}: a zarr.json that is not an arrayckpt checkpoint is here; "
                                            "refusing to replace it (delete it yourself, or choose another prefix)")
            if not overwrite:
                raise CheckpointExistsError(
                    f"{location}: a committed checkpoint is already here; pass overwrite=True to replace it "
                    "(the old one stays readable until the new one commits)")
            self._old = kept_of(document)
            self._old_nodes = dict(self._old.nodes)
            self._refuse_nested(_list(self.store, location))
        else:
            keys = _list(self.store, location)
            if keys and not overwrite:
                raise CheckpointExistsError(
                    f"{location}: objects but no committed checkpoint are here (an interrupted save, or other "
                    "data); pass overwrite=True to replace them, or choose another prefix")
            foreign = sorted(set(keys) - set(arrayckpt_keys(keys)))
            if foreign:
                raise CheckpointExistsError(f"{location}: objects that are not arrayckpt's are here (e.g. "
                                            f"{foreign[0]!r}); refusing to write among them")
            self._refuse_nested(keys)
            # Nothing was here: after the commit there is nothing stale to find, and listing a large
            # checkpoint costs a LIST per 1,000 objects (anything else found would be another writer's).
            self._sweep = bool(keys)
            self._lease = Lease(self.store, LEASE_NAME, str(location), "a save is writing here")
        old = _encoding_of(self._old_nodes) if self._old_nodes is not None else KEY_ENCODINGS[1]
        self.key_encoding = KEY_ENCODINGS[1 - KEY_ENCODINGS.index(old)] if old in KEY_ENCODINGS else KEY_ENCODINGS[0]

    def _refuse_nested(self, keys: list[str]) -> None:
        """Refuse to save over a prefix holding another committed checkpoint below it (its root document among
        ``keys``, at a path that is no node of the checkpoint being replaced): the sweep after the commit would
        delete its objects as stale. Only the ``zarr.json`` documents of nodes without chunks are read (groups;
        an arrayckpt root is one), concurrently; when replacing, only those of nodes the old one lacks."""
        chunked = {key.rpartition("/")[0] for key in arrayckpt_keys(keys) if key.rpartition("/")[2] != ROOT_METADATA}
        candidates = [key for key in arrayckpt_keys(keys) if key.endswith(f"/{ROOT_METADATA}")
                      and (node := key[:-len(ROOT_METADATA) - 1]) not in chunked
                      and (self._old_nodes is None or node not in self._old_nodes)]
        for key, data in sorted(self.location.read_objects(candidates).items()) if candidates else ():
            try:  # a root document is a group's (an array's zarr.json carries "arrayckpt" attributes too)
                document = json.loads(data) if data is not None else None
                nested = is_arrayckpt_root(document) and document.get("node_type") == "group"
            except (ValueError, RecursionError):
                nested = False
            if nested:
                inner = f"{self.location}/{key[:-len(ROOT_METADATA) - 1]}"
                raise CheckpointExistsError(
                    f"{self.location}: the committed checkpoint at {inner} lies inside it; refusing to save here "
                    f"(the save would delete {inner}'s objects as stale); move or delete it, or choose another prefix")

    def write_documents(self, documents: Mapping[str, bytes]) -> Callable[[], None]:
        """Start writing the array and group ``zarr.json`` documents; when replacing a committed checkpoint
        they wait until after the commit (they would otherwise describe the new arrays to readers of the old
        one)."""
        if self._old_nodes is not None:
            self._deferred = documents
            return lambda: None
        self._written = list(documents)
        pending = [(path, _write(self.store, f"{path}/{ROOT_METADATA}" if path else ROOT_METADATA, doc,
                                 self.location)) for path, doc in documents.items()]

        def wait() -> None:
            _wait(pending, self.location, "writing metadata")

        return wait

    def write_file(self, name: str, data: bytes) -> None:
        """(References of a checkpoint being replaced wait for the commit, as its node documents do: readers of the
        old one read them.)"""
        if self._old_nodes is not None and name in self._old.files:
            self._deferred_files[name] = data
            return
        _wait([(name, _write(self.store, name, data, self.location))], self.location, "writing the pack index")

    def missing(self, chunks: Mapping[str, Collection[str]]) -> list[str]:
        """The chunk objects (and node documents written before the commit) of this save not under the prefix now:
        one listing of the prefix (one LIST per 1,000 objects; the sweep after the commit reuses it). A packed save
        (only packs and its index expected) lists nothing: each rank's pack was whole when its upload completed,
        and the index is read back (one GET), so the commit's cost does not grow with the number of ranks."""
        expected = [f"{path}/{name}" if path else name for path, names in chunks.items() for name in names]
        if expected and all(is_pack_key(key) for key in expected) and not self._written:
            index = [key for key in expected if not key.endswith(".pack")]
            return [key for key in index if _read(self.store, key, self.location) is None]
        self._listed = _list(self.store, self.location)
        there = set(self._listed)
        expected += [f"{path}/{ROOT_METADATA}" for path in self._written if path]
        return [key for key in expected if key not in there]

    def commit(self, root_document: bytes) -> None:
        """Write the root document (the commit), then release the save's lease, write the deferred node documents and
        delete what the new checkpoint no longer needs. Failures after the commit only warn: it is committed."""
        try:
            self.store.write(ROOT_METADATA, root_document).result()
        except Exception as e:
            if not self._landed(root_document, e):
                raise StorageError(f"{self.location}: writing the root zarr.json (the commit) failed: {e}") from e
        try:
            if self._lease is not None:
                self._lease.release()
            pending = [(path, _write(self.store, f"{path}/{ROOT_METADATA}" if path else ROOT_METADATA, doc,
                                     self.location)) for path, doc in self._deferred.items()]
            pending += [(name, _write(self.store, name, data, self.location))
                        for name, data in self._deferred_files.items()]
            _wait(pending, self.location, "writing metadata")
            if self._sweep:  # (what the listing before the commit missed is this save's own: never stale)
                kept = kept_of(json.loads(root_document))
                listed = self._listed if self._listed is not None else _list(self.store, self.location)
                _delete(self.store, stale_keys(listed, kept), self.location)
        except Exception as e:  # noqa: BLE001 - committed; leftovers are only untidy
            warnings.warn(f"{self.location}: committed, but tidying up after the commit failed ({e}); a later save "
                          "with overwrite=True removes what is left", RuntimeWarning, stacklevel=2)

    def _landed(self, root_document: bytes, error: Exception) -> bool:
        """After a failed commit PUT: whether it took effect all the same (the store applied it but the answer was
        lost, e.g. a dropped connection). The root document is then ours (each holds its save's unique id), and
        aborting would delete the chunks of the checkpoint just committed. If the root cannot be read back
        either, the outcome is unknown and nothing may be deleted."""
        try:
            return _read(self.store, ROOT_METADATA, self.location) == root_document
        except StorageError as again:
            self._outcome_unknown = True
            raise StorageError(
                f"{self.location}: writing the root zarr.json (the commit) failed ({error}) and reading it back "
                f"failed too ({again}): the save may or may not have committed; nothing was deleted (open the "
                "checkpoint to see which one is there)") from error

    def abort(self) -> None:
        """Remove what this save wrote; a committed checkpoint being replaced keeps all its objects."""
        if self._lease is not None:
            self._lease.release()
        if self._outcome_unknown:  # the new root may be the commit: its chunks must stay; a later save tidies up
            return
        try:
            keys = _list(self.store, self.location)
            ours = stale_keys(keys, self._old) if self._old_nodes is not None else arrayckpt_keys(keys)
            _delete(self.store, ours, self.location)
        except StorageError as e:
            warnings.warn(f"{e} (while removing an aborted save's objects)", RuntimeWarning, stacklevel=2)

