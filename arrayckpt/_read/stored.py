"""An opened checkpoint as the read layer, the tools and the converters see it: :class:`StoredCheckpoint`.

The public :class:`~arrayckpt.Checkpoint` (``checkpoint.py``) is what users hold: a mapping of lazy arrays with the
manifest, plain values and closing. What reading needs besides — the storage handles, the consolidated node
metadata, the checks of what a delta stores, the detection of a replaced checkpoint, pickled bytes — is here, in
the one private object a ``Checkpoint`` holds (``stored_of(checkpoint)``, ``checkpoint.py``) and every
:class:`~arrayckpt.LazyArray` of it reads through. It implements the read path's :class:`~.source.ChainSource`.

It holds storage resources until :meth:`StoredCheckpoint.close`: on a local directory a descriptor that pins the
directory it opened (``_storage/files.py::pin_directory``), its TensorStore context and array handles, and the
bases it opened (a delta checkpoint's chain). One garbage-collected unclosed releases them then, with a
:class:`ResourceWarning` as Python's files do.
"""

from __future__ import annotations

import math
import pickle
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import (
    ArrayckptError,
    BaseNotAllowedError,
    CheckpointNotFoundError,
    ClosedCheckpointError,
    CorruptCheckpointError,
    FormatError,
    PickleNotAllowedError,
    ReplacedCheckpointError,
    warn_unpickling,
)
from .._format.codecs import check_checksummed
from .._format.dtypes import DTYPES, DType, dtype_by_name
from .._format.jsontypes import JSON, json_object
from .._format.manifest import ArrayEntry, PerRankEntry, PickleEntry, ValueEntry, parse_root_document, per_rank_path
from .._format.quant import packed_columns
from .._format.values import decode_value
from .._format.zarr import array_shape, check_array_metadata, grid_counts
from .._io.arrays import ArrayIO, array_spec
from .._io.smallfiles import check_no_links
from .._read.reader import ArraySlices, read
from .._storage import Location, follow_base, kvstore_at
from .._storage.base import Opened
from .._storage.packread import read_file_ranges
from .packed import PackedChunks, ReadRanges

if TYPE_CHECKING:
    from .._io.arrays import StoreContext

__all__ = ["MAX_CHAIN", "StoredCheckpoint"]

MAX_CHAIN = 10_000  # a longer chain of bases is damage (or a loop), not a plan

_CONTEXT_LOCK = threading.Lock()


def _collected(release: Callable[[], None], unclosed: list[str]) -> None:
    """The finalizer of a checkpoint garbage-collected unclosed: release what it holds and, unless a delta that
    opened it as its base speaks for it (``unclosed`` emptied), warn as unclosed files do."""
    release()
    if unclosed:
        warnings.warn(f"{unclosed[0]}: an arrayckpt checkpoint was never closed (its storage was held until it was "
                      "garbage-collected): use `with arrayckpt.open(path) as ckpt:` or call ckpt.close()",
                      ResourceWarning, stacklevel=3)  # the frame that dropped it (past weakref.finalize)


class StoredCheckpoint:
    """A committed checkpoint opened for reading: its manifest, node metadata and storage handles, and every check
    a read of its data needs. ``opened``: what ``location.open_committed()`` gives, from a root document another
    rank read; ``base_roots``: where bases may be besides the directory holding each layer (spec §10.1)."""

    def __init__(self, location: Location, allow_pickle: bool = False, opened: Opened | None = None,
                 base_roots: tuple[Location, ...] = ()) -> None:
        self.location = location
        self.allow_pickle = allow_pickle
        self.base_roots = base_roots
        self._above: frozenset[str | None] = frozenset()  # ids of the deltas that read through this checkpoint
        where = str(location)
        document, self._kvstore, release, self._generation = opened or location.open_committed()
        try:
            self.manifest, nodes = parse_root_document(document, where)
            #: The root's consolidated metadata: every node's ``zarr.json`` document by path (read-only).
            self.nodes: MappingProxyType[str, JSON] = MappingProxyType(nodes)
            if self.manifest.base is not None:  # refused at open, not at the first read through it (no IO)
                follow_base(location, self.manifest.base.path, base_roots)
            #: Each array entry's array metadata, checked (``{}`` for a rows delta: it has no array of its shape).
            self.metadata: dict[str, JSON] = {}
            for key, entry in self.manifest.entries.items():
                if isinstance(entry, ArrayEntry):
                    rows = entry.delta is not None and entry.delta.mode == "rows"
                    metadata = {} if rows else self._node(entry.path, key, entry.dtype, entry.shape)
                    if entry.delta is not None and entry.delta.present:  # ascending (checked by the parser)
                        self._check_present(key, entry.delta.present[-1], metadata)
                    self.metadata[key] = metadata
            #: Where the chunk files are, for a packed checkpoint (spec §16); ``None``: one file or object each.
            self.packed: PackedChunks | None = None
            if self.manifest.packs is not None:
                arrays = {path: node for path, node in nodes.items()
                          if isinstance(node, dict) and node.get("node_type") == "array"}
                root = str(self._kvstore["path"]) if self._kvstore.get("driver") == "file" else None
                self.packed = PackedChunks(self.manifest.packs, arrays, self.manifest.delta_chunks, self._pack_reader(),
                                           where, root)
        except BaseException:
            release()
            raise
        self._read_context: StoreContext | None = None  # made on the first read of data (importing TensorStore then)
        self.rows_cache: dict[str, np.ndarray] = {}  # row indices of rows deltas, by key (chain.delta_rows)
        self._specs: dict[str, JSON] = {}  # read_spec, by key
        self._slices: dict[str, ArraySlices] = {}  # slices, by key
        self._present: dict[str, frozenset[int]] = {}  # present_chunks, by key
        self._closed = False
        self._unclosed = [where]  # what the finalizer warns about (emptied: it does not warn)
        self._finalizer = weakref.finalize(self, _collected, release, self._unclosed)
        self._finalizer.atexit = False  # at exit the process releases everything; no warnings then

    # --- closing ------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the pinned directory (local storage), the TensorStore context and array handles, and the bases
        opened; once (calling it again does nothing)."""
        if self._closed:
            return
        self._closed = True
        self._unclosed.clear()
        try:
            base = self.__dict__.pop("base", None)  # reading through a closed delta opens no base again
            if base is not None:
                base.close()
            self._specs, self._slices = {}, {}
            self._read_context = None
            self.rows_cache = {}
        finally:
            self._finalizer()  # releases the pin, once

    def check_open(self) -> None:
        """Raise :class:`ClosedCheckpointError` once closed (before any read: on local storage the pinned
        directory's descriptor number may name another directory by then)."""
        if self._closed:
            raise ClosedCheckpointError(f"{self.location}: the checkpoint was closed; its data can no longer be read "
                                        "(open it again: arrayckpt.open)")

    @property
    def read_context(self) -> StoreContext:
        """The TensorStore read context (what every read of data uses: closed, it raises)."""
        self.check_open()
        if self._read_context is None:
            with _CONTEXT_LOCK:  # one context per checkpoint, even when threads read first at once
                if self._read_context is None:
                    self._read_context = self.location.read_context()
        return self._read_context

    # --- delta checkpoints ------------------------------------------------------------------------

    @cached_property
    def base(self) -> StoredCheckpoint:
        """The checkpoint this delta checkpoint was saved against, opened on first use and checked to be the very
        one (a base replaced since is refused); only where spec §10.1 lets a reader go."""
        ref = self.manifest.base
        if ref is None:
            raise ValueError(f"{self.location}: a full checkpoint; it has no base")
        self.check_open()
        location = follow_base(self.location, ref.path, self.base_roots)
        try:
            base = StoredCheckpoint(location, self.allow_pickle, base_roots=self.base_roots)
        except BaseNotAllowedError:
            raise
        except (ArrayckptError, OSError) as e:  # OSError: the system's own (a path too long, ...): named here too
            kind = CheckpointNotFoundError if isinstance(e, CheckpointNotFoundError) else CorruptCheckpointError
            raise kind(f"{self.location}: its base checkpoint {location} (step {ref.step}) cannot be read: {e}") from e
        base._unclosed.clear()  # closed with this checkpoint; collected with it, this one warns for both
        if base.manifest.id != ref.id:
            base.close()
            raise CorruptCheckpointError(
                f"{self.location}: its base {location} is not the checkpoint it was saved against (id "
                f"{base.manifest.id}, expected {ref.id}): the base was replaced; this delta cannot be read")
        base._above = self._above | {self.manifest.id}
        if ref.id in base._above or len(base._above) > MAX_CHAIN:
            base.close()
            raise CorruptCheckpointError(f"{self.location}: its chain of bases loops back or exceeds {MAX_CHAIN} "
                                         "checkpoints")
        return base

    def check_unchanged(self, pinned_too: bool = False) -> None:
        """After reading data: where storage cannot pin a checkpoint for reading (object storage), make sure the
        checkpoint and the bases read through were not replaced meanwhile, or the data read may mix two
        checkpoints. One small read per such layer; nothing to do where reads are pinned (local directories), unless
        ``pinned_too``: before writing something made from what was read into the location (``arrayckpt refs``),
        where the pinned directory may no longer be the one at its path."""
        layer: StoredCheckpoint | None = self
        while layer is not None:
            if (pinned_too or not layer.location.pins_reads) and layer.location.changed_since(layer._generation):
                raise ReplacedCheckpointError(
                    f"{layer.location}: the checkpoint was replaced (or removed) while it was being read; "
                    "what was read may mix two checkpoints: open it again")
            layer = layer.__dict__.get("base")

    def raise_if_replaced(self, error: BaseException) -> None:
        """After a failed read: if the checkpoint, or a base read through, is no longer the one at its location
        (replaced or removed since it was opened), raise that instead of ``error``: its chunks went with it, they
        are not damaged. Returns when it cannot tell, or when nothing was replaced."""
        layer: StoredCheckpoint | None = self
        while layer is not None:
            try:
                replaced = layer.location.changed_since(layer._generation)
            except Exception:  # noqa: BLE001 - cannot tell: the original error stands
                replaced = False
            if replaced:
                raise ReplacedCheckpointError(
                    f"{layer.location}: the checkpoint was replaced (or removed) while it was being read, its data "
                    "with it (the read failed; see the cause): open it again") from error
            layer = layer.__dict__.get("base")

    # --- specs and checks ---------------------------------------------------------------------------------

    def read_spec(self, key: str) -> JSON:
        """The TensorStore spec of array entry ``key`` (not a rows delta), built once for the read path (which
        never changes it)."""
        spec = self._specs.get(key)
        if spec is None:
            entry = self.manifest.entries[key]
            assert isinstance(entry, ArrayEntry)
            spec = self._specs[key] = array_spec(self.node_kvstore(entry.path), self.metadata[key])
        return spec

    def slices(self, key: str) -> ArraySlices:
        """How slices of array entry ``key`` are read (the array opened once, dropped on :meth:`close`)."""
        execute = self._slices.get(key)
        if execute is None:
            execute = self._slices[key] = ArraySlices(self.read_spec(key))
        return execute

    def _pack_reader(self) -> ReadRanges:
        """How this checkpoint's packs and index are read: from the pinned directory locally (refusing links), with
        ranged reads on object storage."""
        where = str(self.location)
        if self._kvstore.get("driver") == "file":
            root = str(self._kvstore["path"])

            def read_local(name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
                self.check_open()
                return read_file_ranges(root, name, ranges, where)
            return read_local

        def read_remote(name: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
            self.check_open()
            return self.location.read_pack(name, ranges)
        return read_remote

    def node_kvstore(self, path: str) -> JSON:
        """The kvstore spec of node ``path`` of this checkpoint (of the pinned directory on local storage, whose
        node directories must not be symbolic links: spec §12; of its chunk source when packed)."""
        self.check_open()
        if self.packed is not None:
            return self.packed.kvstore(path)
        if self._kvstore.get("driver") == "file":
            check_no_links(str(self._kvstore["path"]), path, str(self.location))
        return kvstore_at(self._kvstore, path)

    def array_spec(self, path: str, key: str, dtype: DType, shape: tuple[int, ...]) -> JSON:
        """The TensorStore spec of the array at ``path`` (of entry ``key``), its metadata checked to describe a
        checksummed ``dtype`` array of ``shape`` (:class:`arrayckpt.FormatError` if not)."""
        return array_spec(self.node_kvstore(path), self._node(path, key, dtype, shape))

    def present_chunks(self, key: str) -> frozenset[int]:
        """The flat indices of the chunks a chunks delta of tensor ``key`` stores (the others are its base's)."""
        if key not in self._present:
            entry = self.manifest.entries[key]
            assert isinstance(entry, ArrayEntry) and entry.delta is not None
            if entry.delta.present:
                self._check_present(key, max(entry.delta.present), self.metadata[key])
            self._present[key] = frozenset(entry.delta.present)
        return self._present[key]

    def _check_present(self, key: str, largest: int, metadata: JSON) -> None:
        count = math.prod(grid_counts(metadata))
        if largest >= count:
            raise FormatError(f"{self.location}: entry {key!r}: its delta names chunk {largest}, beyond its "
                              f"{count}-chunk grid: the manifest is damaged or crafted")

    def rows_delta_spec(self, entry: ArrayEntry, name: str) -> JSON:
        """Spec of one array of a rows delta (``rows``, ``values``, ``codes``, ``scale``, ``offset``), checked."""
        assert entry.delta is not None
        count = self._delta_count(entry)
        tail = entry.shape[1:]
        expected = {"rows": ("int64", (count,)), "values": (entry.dtype.name, (count, *tail)),
                    "scale": ("float32", (count,)), "offset": ("float32", (count,))}
        if name == "codes":
            bits = entry.delta.quantized.bits if entry.delta.quantized is not None else 8
            expected["codes"] = "uint8", (count, packed_columns(math.prod(tail), bits))
        dtype_name, shape = expected[name]
        return self.array_spec(f"{entry.path}/{name}", entry.key, dtype_by_name(dtype_name), shape)

    def _delta_count(self, entry: ArrayEntry) -> int:
        metadata = self.nodes.get(f"{entry.path}/rows")
        shape = metadata.get("shape") if isinstance(metadata, dict) else None
        if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int)):
            raise FormatError(f"{self.location}: entry {entry.key!r}: its rows delta has no valid 'rows' array")
        if entry.delta is not None and entry.delta.rows > shape[0]:
            raise FormatError(f"{self.location}: entry {entry.key!r}: its rows delta records {entry.delta.rows} "
                              f"changed rows but stores {shape[0]}: the manifest is damaged or crafted")
        return shape[0]

    def check_delta_rows(self, entry: ArrayEntry, rows: np.ndarray) -> None:
        """The row indices a rows delta of ``entry`` stores, as read, against what its writer guarantees: each
        ``-1`` (padding) or a row of the tensor, no row twice, and as many changed rows as the manifest records."""
        assert entry.delta is not None
        changed = rows[rows != -1]
        where = f"{self.location}: tensor {entry.key!r}: its changed rows"
        if len(changed) and (changed.max() >= entry.shape[0] or changed.min() < 0):
            raise CorruptCheckpointError(f"{where} name rows outside 0..{entry.shape[0] - 1}")
        if len(np.unique(changed)) != len(changed):
            raise CorruptCheckpointError(f"{where} name a row twice: the checkpoint is damaged or crafted")
        if len(changed) != entry.delta.rows:
            raise CorruptCheckpointError(f"{where} are {len(changed)}, but the manifest records {entry.delta.rows}: "
                                         "the checkpoint is damaged or crafted")

    def _node(self, path: str, key: str, dtype: DType, shape: tuple[int, ...]) -> JSON:
        where = f"{self.location}: entry {key!r}"
        metadata = check_array_metadata(self.nodes.get(path), shape, dtype.name, where)
        check_checksummed(metadata, where)
        return metadata

    def per_rank_spec(self, key: str, rank: int) -> JSON:
        """TensorStore spec of rank ``rank``'s array of per-rank entry ``key``."""
        entry = self.manifest.entries[key]
        item = entry.items[rank] if isinstance(entry, PerRankEntry) and 0 <= rank < len(entry.items) else None
        if not isinstance(item, ArrayEntry):
            raise KeyError(f"{self.location}: {key!r} has no per-rank array for rank {rank}")
        return self.array_spec(per_rank_path(key, rank), key, item.dtype, item.shape)

    # --- plain values ---------------------------------------------------------------------------------------

    def pickle_spec(self, key: str) -> JSON:
        """TensorStore spec of the bytes of pickled value ``key`` (a uint8 array), checked."""
        entry = self.manifest.entries[key]
        if not isinstance(entry, PickleEntry):
            raise KeyError(f"{self.location}: {key!r} is not a pickled value")
        return self.array_spec(entry.path, key, DTYPES["uint8"], (entry.nbytes,))

    def pickle_bytes(self, key: str) -> bytes:
        """The stored bytes of pickled value ``key``, read (checksum checked) but never unpickled."""
        spec = self.pickle_spec(key)
        raw = np.empty(tuple(array_shape(json_object(spec.get("metadata")))), np.uint8)
        read(self, [ArrayIO(key, spec, raw)])
        return raw.tobytes()

    def value(self, key: str) -> Any:
        """One plain value, decoded (a pickled one unpickled: with ``allow_pickle=True`` only). ``Any``: whatever was
        saved, which the caller knows."""
        entry = self.manifest.entries[key]
        if isinstance(entry, ValueEntry):
            return decode_value(entry.value, key)
        if isinstance(entry, PickleEntry):
            return self.unpickle([key])[key]
        raise KeyError(f"{key!r} is an array, not a plain value; use checkpoint[{key!r}]")

    def unpickle(self, keys: Sequence[str]) -> dict[str, Any]:
        """The pickled values ``keys``, unpickled (with ``allow_pickle=True`` only) with one
        :class:`arrayckpt.PickleWarning` naming them all: ``load`` unpickles a state's values in one call."""
        self.check_open()
        if not keys:
            return {}
        if not self.allow_pickle:
            raise PickleNotAllowedError(f"{self.location}: value {keys[0]!r} is pickled; unpickling can run arbitrary "
                                        "code, so it needs allow_pickle=True (only for checkpoints you trust)")
        raw = {key: self.pickle_bytes(key) for key in keys}  # every checksum checked before anything runs
        warn_unpickling(f"{self.location}: unpickling " + ", ".join(repr(k) for k in keys[:10])
                        + (f", … ({len(keys) - 10} more)" if len(keys) > 10 else ""))
        return {key: pickle.loads(data) for key, data in raw.items()}
