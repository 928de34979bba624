"""Reading: a committed checkpoint opened as lazy arrays, with no torch needed to look inside.

``open`` costs one read (the root ``zarr.json`` holds the manifest and every array's metadata); array
data is read only when sliced, and only the chunks the slice touches.

An open checkpoint holds storage resources until :meth:`Checkpoint.close` (or the end of a ``with`` block): on a
local directory a descriptor that pins the directory it opened (``_storage/files.py::pin_directory``), and its
TensorStore context and array handles; a delta checkpoint also the bases it opened. Closing releases them all;
a checkpoint garbage-collected unclosed releases them then, with a :class:`ResourceWarning` as Python's files do.
"""

from __future__ import annotations

import math
import os
import pickle
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import cached_property
from types import MappingProxyType
from typing import Any, cast

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
from .._format.manifest import ArrayEntry, PerRankEntry, PickleEntry, ValueEntry, parse_root_document, per_rank_path
from .._format.quant import packed_columns
from .._format.values import decode_value
from .._format.zarr import check_array_metadata, grid_counts
from .._io.arrays import ArrayIO, array_spec
from .._io.smallfiles import check_no_links
from .._layout.box import Box
from .._read.chain import dense_grid, dense_layer, read_plan
from .._read.lazy import LazyArray
from .._read.reader import ChainRead, read
from .._storage import Location, follow_base, kvstore_at, parse_location, parse_roots
from .._storage.base import Opened

__all__ = ["Checkpoint", "LazyArray", "open_checkpoint", "opened"]

MAX_CHAIN = 10_000  # a longer chain of bases is damage (or a loop), not a plan


def _collected(release: Callable[[], None], unclosed: list[str]) -> None:
    """The finalizer of a checkpoint garbage-collected without :meth:`Checkpoint.close`: release what it holds and,
    unless a delta that opened it as its base speaks for it (``unclosed`` emptied), warn as unclosed files do."""
    release()
    if unclosed:
        warnings.warn(f"{unclosed[0]}: an arrayckpt checkpoint was never closed (its storage was held until it was "
                      "garbage-collected): use `with arrayckpt.open(path) as ckpt:` or call ckpt.close()",
                      ResourceWarning, stacklevel=3)  # the frame that dropped it (past weakref.finalize)


class _Values(Mapping[str, Any]):
    """Plain values by key; pickled ones are unpickled on access, only with consent."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint
        self._entries = [k for k, e in checkpoint.manifest.entries.items() if isinstance(e, (ValueEntry, PickleEntry))]
        self._keys = frozenset(self._entries)

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._checkpoint.value(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


_CONTEXT_LOCK = threading.Lock()


class Checkpoint(Mapping[str, LazyArray]):
    """A committed checkpoint, read-only: dotted key -> :class:`LazyArray`.

    Plain values are in :attr:`plain_values`, the manifest in :attr:`manifest`. A tensor the state held under two
    keys (tied weights) is stored once: the second key is an alias (:meth:`aliases`), and ``checkpoint[alias]``
    is the target's :class:`LazyArray`. Close it when done (``with
    arrayckpt.open(path) as ckpt:``, or :meth:`close`) to release what it holds on storage. After closing, what is
    in memory keeps working (keys, shapes, dtypes, :attr:`manifest`, :attr:`step`, :attr:`metrics`, plain values
    that are not pickled), as a closed file's name does; reading data (slicing, ``.numpy()``, ``.torch()``,
    ``read_into``, :meth:`per_rank`, pickled values, opening a base) raises :class:`ClosedCheckpointError`.
    Made by :func:`arrayckpt.open`.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"model": torch.nn.Linear(2, 1), "step": 3}, path, step=3, metrics={"loss": 0.5})
        >>> with arrayckpt.open(path) as ckpt:
        ...     sorted(ckpt), ckpt.step, ckpt.metrics, dict(ckpt.plain_values)
        (['model.bias', 'model.weight'], 3, {'loss': 0.5}, {'step': 3})
    """

    def __init__(self, location: Location, allow_pickle: bool = False, opened: Opened | None = None,
                 base_roots: tuple[Location, ...] = ()) -> None:
        self.location = location
        self.allow_pickle = allow_pickle
        self.base_roots = base_roots  # where bases may be besides the directory holding each layer (spec §10.1)
        self._above: frozenset[str | None] = frozenset()  # ids of the deltas that read through this checkpoint
        where = str(location)
        # ``opened``: what location.open_committed() gives, from a root document another rank read
        document, self._base, release, self._generation = opened or location.open_committed()
        try:
            self.manifest, self._nodes = parse_root_document(document, where)
            if self.manifest.base is not None:  # refused at open, not at the first read through it (no IO)
                follow_base(location, self.manifest.base.path, base_roots)
            self._read_context: Any = None  # made on the first read of data (importing TensorStore then)
            self.rows_cache: dict[str, np.ndarray] = {}  # row indices of rows deltas, by key (chain.delta_rows)
            self._arrays: dict[str, LazyArray] = {}
            for key, entry in self.manifest.entries.items():
                if isinstance(entry, ArrayEntry):
                    rows = entry.delta is not None and entry.delta.mode == "rows"
                    metadata = {} if rows else self._node(entry.path, key, entry.dtype, entry.shape)
                    if entry.delta is not None and entry.delta.present:  # ascending (checked by the parser)
                        self._check_present(key, entry.delta.present[-1], metadata)
                    self._arrays[key] = LazyArray(self, entry, metadata)
            aliases = self.manifest.aliases  # an alias is its target's array, in the order of the entries
            self._arrays = {key: self._arrays[aliases.get(key, key)] for key in self.manifest.entries
                            if aliases.get(key, key) in self._arrays}
        except BaseException:
            release()
            raise
        self._closed = False
        self._unclosed = [where]  # what the finalizer warns about (emptied: it does not warn)
        self._finalizer = weakref.finalize(self, _collected, release, self._unclosed)
        self._finalizer.atexit = False  # at exit the process releases everything; no warnings then

    # --- closing ------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (by itself, a ``with`` block, or the delta that opened this base)."""
        return self._closed

    def close(self) -> None:
        """Release what the checkpoint holds on storage: the pinned directory (local storage), the TensorStore
        context and array handles, and the bases it opened (a delta checkpoint's chain). Calling it again does
        nothing. Do not close while reads run on other threads. Reading data afterwards raises
        :class:`ClosedCheckpointError`; what is in memory (keys, shapes, manifest, plain values) stays readable.
        """
        if self._closed:
            return
        self._closed = True
        self._unclosed.clear()
        try:
            base = self.__dict__.pop("base", None)  # reading through a closed delta opens no base again
            if base is not None:
                base.close()
            for array in self._arrays.values():
                array._forget_handles()
            self._read_context = None
            self.rows_cache = {}
        finally:
            self._finalizer()  # releases the pin, once

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def check_open(self) -> None:
        """Raise :class:`ClosedCheckpointError` once closed (before any read: on local storage the pinned
        directory's descriptor number may name another directory by then)."""
        if self._closed:
            raise ClosedCheckpointError(f"{self.location}: the checkpoint was closed; its data can no longer be read "
                                        "(open it again: arrayckpt.open)")

    @property
    def read_context(self) -> Any:
        """The TensorStore read context (what every read of data uses: closed, it raises)."""
        self.check_open()
        if self._read_context is None:
            with _CONTEXT_LOCK:  # one context per checkpoint, even when threads read first at once
                if self._read_context is None:
                    self._read_context = self.location.read_context()
        return self._read_context

    # --- delta checkpoints ------------------------------------------------------------------------

    @cached_property
    def base(self) -> Checkpoint:
        """The checkpoint this delta checkpoint was saved against (opened on first use, and checked to be the
        very one: a base replaced since is refused). Only where spec §10.1 lets a reader go: the directory holding
        this checkpoint, or one of :attr:`base_roots` (:class:`arrayckpt.BaseNotAllowedError` otherwise)."""

        ref = self.manifest.base
        if ref is None:
            raise ValueError(f"{self.location}: a full checkpoint; it has no base")
        self.check_open()
        location = follow_base(self.location, ref.path, self.base_roots)
        try:
            base = Checkpoint(location, self.allow_pickle, base_roots=self.base_roots)
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

    def chain(self) -> list[Checkpoint]:
        """This checkpoint and its bases, newest first, down to a full checkpoint (every one opened; closing this
        checkpoint closes them)."""
        out = [self]
        while out[-1].manifest.base is not None:
            out.append(out[-1].base)
        return out

    def check_unchanged(self) -> None:
        """After reading data: where storage cannot pin a checkpoint for reading (object storage), make sure the
        checkpoint and the bases read through were not replaced meanwhile, or the data read may mix two
        checkpoints. One small read per such layer; nothing to do where reads are pinned (local directories)."""
        layer: Checkpoint | None = self
        while layer is not None:
            if not layer.location.pins_reads and layer.location.changed_since(layer._generation):
                raise ReplacedCheckpointError(
                    f"{layer.location}: the checkpoint was replaced (or removed) while it was being read; "
                    "what was read may mix two checkpoints: open it again")
            layer = layer.__dict__.get("base")

    def raise_if_replaced(self, error: BaseException) -> None:
        """After a failed read: if the checkpoint, or a base read through, is no longer the one at its location
        (replaced or removed since it was opened), raise that instead of ``error``: its chunks went with it, they
        are not damaged. Returns when it cannot tell, or when nothing was replaced."""
        layer: Checkpoint | None = self
        while layer is not None:
            try:
                replaced = layer._replaced()
            except Exception:  # noqa: BLE001 - cannot tell: the original error stands
                replaced = False
            if replaced:
                raise ReplacedCheckpointError(
                    f"{layer.location}: the checkpoint was replaced (or removed) while it was being read, its data "
                    "with it (the read failed; see the cause): open it again") from error
            layer = layer.__dict__.get("base")

    def _replaced(self) -> bool:
        return self.location.changed_since(self._generation)

    # --- what the read path and the tools use (internal: not part of the public API) --------------------------

    @property
    def nodes(self) -> MappingProxyType[str, Any]:
        """The root's consolidated metadata: every node's ``zarr.json`` document by path (read-only)."""
        return MappingProxyType(self._nodes)

    def node_kvstore(self, path: str) -> dict[str, Any]:
        """The kvstore spec of node ``path`` of this checkpoint (of the pinned directory on local storage, whose
        node directories must not be symbolic links: spec §12)."""
        self.check_open()
        if self._base.get("driver") == "file":
            check_no_links(self._base["path"], path, str(self.location))
        return kvstore_at(self._base, path)

    def array_spec(self, path: str, key: str, dtype: DType, shape: tuple[int, ...]) -> dict[str, Any]:
        """The TensorStore spec of the array at ``path`` (of entry ``key``), its metadata checked to describe a
        checksummed ``dtype`` array of ``shape`` (:class:`arrayckpt.FormatError` if not)."""
        return array_spec(self.node_kvstore(path), self._node(path, key, dtype, shape))

    def dense_metadata(self, key: str) -> dict[str, Any]:
        """The array metadata of tensor ``key`` in the nearest layer of the chain storing it as an array of its
        shape (this checkpoint, or a base for a rows delta)."""
        layer, stored = dense_layer(self, key)
        return cast("dict[str, Any]", layer[stored].metadata)

    def dense_grid(self, key: str) -> tuple[int, ...]:
        """The read-chunk shape of :meth:`dense_metadata` (the grid a delta of ``key`` compares chunks on)."""
        return dense_grid(self, key)

    def present_chunks(self, key: str) -> frozenset[int]:
        """The flat indices of the chunks a chunks delta of tensor ``key`` stores (the others are its base's)."""
        cache: dict[str, frozenset[int]] = self.__dict__.setdefault("_present_cache", {})
        if key not in cache:
            entry = self.manifest.entries[key]
            assert isinstance(entry, ArrayEntry) and entry.delta is not None
            if entry.delta.present:
                self._check_present(key, max(entry.delta.present), self[key].metadata)
            cache[key] = frozenset(entry.delta.present)
        return cache[key]

    def _check_present(self, key: str, largest: int, metadata: dict[str, Any]) -> None:
        count = math.prod(grid_counts(metadata))
        if largest >= count:
            raise FormatError(f"{self.location}: entry {key!r}: its delta names chunk {largest}, beyond its "
                              f"{count}-chunk grid: the manifest is damaged or crafted")

    def rows_delta_spec(self, entry: ArrayEntry, name: str) -> dict[str, Any]:
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
        metadata = self._nodes.get(f"{entry.path}/rows")
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

    def _node(self, path: str, key: str, dtype: DType, shape: tuple[int, ...]) -> dict[str, Any]:
        where = f"{self.location}: entry {key!r}"
        metadata = check_array_metadata(self._nodes.get(path), shape, dtype.name, where)
        check_checksummed(metadata, where)
        return metadata

    def per_rank_spec(self, key: str, rank: int) -> dict[str, Any]:
        """TensorStore spec of rank ``rank``'s array of per-rank entry ``key``."""
        entry = self.manifest.entries[key]
        item = entry.items[rank] if isinstance(entry, PerRankEntry) and 0 <= rank < len(entry.items) else None
        if not isinstance(item, ArrayEntry):
            raise KeyError(f"{self.location}: {key!r} has no per-rank array for rank {rank}")
        return self.array_spec(per_rank_path(key, rank), key, item.dtype, item.shape)

    def pickle_spec(self, key: str) -> dict[str, Any]:
        """TensorStore spec of the bytes of pickled value ``key`` (a uint8 array), checked."""
        entry = self.manifest.entries[key]
        if not isinstance(entry, PickleEntry):
            raise KeyError(f"{self.location}: {key!r} is not a pickled value")
        return self.array_spec(entry.path, key, DTYPES["uint8"], (entry.nbytes,))

    def pickle_bytes(self, key: str) -> bytes:
        """The stored bytes of pickled value ``key``, read (checksum checked) but never unpickled."""
        spec = self.pickle_spec(key)
        raw = np.empty(tuple(spec["metadata"]["shape"]), np.uint8)
        read(self, [ArrayIO(key, spec, raw)])
        return raw.tobytes()

    def read_box(self, key: str, box: Box, out: np.ndarray) -> None:
        """Fill ``out`` with ``box`` of tensor ``key``, through the chain of bases for delta entries."""
        read(self, [ChainRead(key, box, out)])

    def read_plan(self, key: str, box: Box, out: np.ndarray) -> tuple[list[ArrayIO], list[Any]]:
        """The reads (and row overlays to run after them, in order) that fill ``out`` with ``box`` of ``key``."""
        return read_plan(self, key, box, out)

    # --- public -----------------------------------------------------------------------------------------------

    def per_rank(self, key: str) -> list[Any]:
        """Every rank's value of a :class:`arrayckpt.PerRank` entry (tensors read whole; ``None`` where a rank
        had none), e.g. to inspect RNG states or resume at another world size."""
        from .._torch.dtypes import torch_view  # per-rank tensors come back as torch tensors

        entry = self.manifest.entries.get(key)
        if not isinstance(entry, PerRankEntry):
            raise KeyError(f"{self.location}: {key!r} is not a per-rank entry")
        self.check_open()
        arrays = {rank: np.empty(item.shape, item.dtype.numpy) for rank, item in enumerate(entry.items)
                  if isinstance(item, ArrayEntry)}
        read(self, [ArrayIO(key, self.per_rank_spec(key, rank), array) for rank, array in arrays.items()])
        out: list[Any] = []
        for rank, item in enumerate(entry.items):
            if isinstance(item, ArrayEntry):
                out.append(arrays[rank] if item.kind == "ndarray" else torch_view(arrays[rank], item.dtype))
            else:
                out.append(None if item is None else decode_value(item.value, key))
        return out

    @property
    def step(self) -> int | None:
        return self.manifest.step

    def aliases(self) -> Mapping[str, str]:
        """Every alias key and the key of the tensor it names, stored once under that target (e.g.
        ``{"lm_head.weight": "transformer.wte.weight"}`` for tied weights); ``{}`` when there are none. An export that
        drops tied duplicates keeps the targets."""
        return self.manifest.aliases

    @property
    def metrics(self) -> Mapping[str, float]:
        """The metrics recorded at save (``save(..., metrics={"val_loss": 1.9})``)."""
        return self.manifest.metrics

    @cached_property
    def plain_values(self) -> Mapping[str, Any]:
        """Plain values by dotted key (pickled ones raise unless opened with ``allow_pickle=True``)."""
        return _Values(self)

    def value(self, key: str) -> Any:
        """One plain value, decoded."""
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

    def __getitem__(self, key: str) -> LazyArray:
        try:
            return self._arrays[key]
        except KeyError:
            hint = " (it is a plain value: see .plain_values)" if key in self.manifest.entries else ""
            raise KeyError(f"{self.location}: no tensor {key!r}{hint}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        closed = ", closed" if self._closed else ""
        aliases = len(self.manifest.aliases)
        stored = f"{len(self) - aliases} arrays" + (f" (+{aliases} aliases)" if aliases else "")
        return f"arrayckpt.Checkpoint({str(self.location)!r}, {stored}, {len(self.plain_values)} values{closed})"

    @property
    def nbytes(self) -> int:
        """The bytes of the tensors, each stored tensor counted once (an alias adds none)."""
        return sum(a.nbytes for key, a in self._arrays.items() if a.key == key)


def open_checkpoint(path: str | os.PathLike[str] | Location, *, allow_pickle: bool = False,
                    storage_options: Mapping[str, Any] | None = None,
                    base_roots: Sequence[str | os.PathLike[str]] | None = None) -> Checkpoint:
    """Open a committed checkpoint read-only: a local path or an object-storage URL (``s3://bucket/prefix``,
    with ``storage_options`` as for :func:`arrayckpt.save`). Opening reads one object, the root ``zarr.json``.
    Use it as a context manager (or call :meth:`Checkpoint.close`) to release what it holds when done.

    A delta checkpoint's bases are read from the directory (prefix) holding it, as saves write them; a base
    elsewhere is read only inside one of ``base_roots`` (directories or URLs you trust), else opening the delta
    raises :class:`arrayckpt.BaseNotAllowedError` naming its reference (spec §10.1).

    Args:
        path: a directory or an object-storage URL.
        allow_pickle: let pickled values be read (unpickling runs the writer's code: only for checkpoints you trust).
        storage_options: for object storage, as for :func:`arrayckpt.save`.
        base_roots: directories or URLs you trust, where a delta's bases may be read besides the delta's own.

    Returns:
        The open checkpoint, a read-only mapping of dotted keys to :class:`LazyArray`.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        IncompleteCheckpointError: a save at ``path`` never committed.
        CorruptCheckpointError: the root metadata is damaged.
        FormatError: the metadata does not follow the format (or a newer version of it).
        BaseNotAllowedError: a delta's base is outside the delta's directory and ``base_roots``.
        LocationError: ``path`` or ``storage_options`` cannot name a location.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, d)
        >>> with arrayckpt.open(d) as ckpt:
        ...     ckpt["w"].shape, ckpt["w"][1, :2].tolist(), ckpt.plain_values["step"]
        ((2, 3), [3.0, 4.0], 7)
        >>> ckpt.closed, sorted(ckpt)  # closed: data can no longer be read, what is in memory can
        (True, ['w'])
    """
    return Checkpoint(parse_location(path, storage_options), allow_pickle,
                      base_roots=parse_roots(base_roots, storage_options))


def opened(source: Checkpoint | str | os.PathLike[str], **kwargs: Any) -> AbstractContextManager[Checkpoint]:
    """``with opened(source) as checkpoint:`` for internal callers: a :class:`Checkpoint` passed in is used as is
    and left open (its owner closes it); a path is opened (``kwargs`` as for :func:`open_checkpoint`) and closed
    when the block ends."""
    return nullcontext(source) if isinstance(source, Checkpoint) else open_checkpoint(source, **kwargs)
