"""A PyTorch DCP ``StorageReader`` that loads any arrayckpt checkpoint: :class:`ArrayckptReader`.

``torch.distributed.checkpoint.load(state, storage_reader=ArrayckptReader(path))`` loads a checkpoint written by
``arrayckpt.save``, by :class:`ArrayckptWriter`, converted from another format, a delta checkpoint (through its
chain of bases), local or on object storage, into whatever state DCP's load planner is given, at any number of
ranks and any sharding. Call order (DCP's): ``reset`` (with a ``checkpoint_id``), ``read_metadata``,
``set_up_storage_reader``, ``prepare_local_plan``, ``prepare_global_plan`` (coordinator), ``read_data``.

- The checkpoint is opened afresh by every load, so a reader made once for a fixed path (``latest``) loads what
  is there at each load, however often it was replaced meanwhile: by ``reset(checkpoint_id)``, which DCP calls
  first when given a ``checkpoint_id`` (so a path that holds no checkpoint fails there, with arrayckpt's own
  error, before DCP starts), or else by ``read_metadata``; it is closed when ``read_data`` ends, on ``reset``, or
  when the reader is collected. A reader made with a path checks at once that a checkpoint is there.
- ``read_metadata`` builds DCP's ``Metadata`` from the manifest alone, reading no data. Each tensor is described
  as one stored chunk covering all of it, so DCP's planner asks each rank for exactly the boxes its targets
  hold; ``read_data`` reads those boxes through arrayckpt's one read path (``_read/reader.py``: concurrently,
  every chunk's checksum checked, deltas read through their chain), straight into the targets' memory where it
  can (a CPU tensor of the stored dtype); device (GPU) targets of the stored dtype through pooled, pinned host
  buffers, each batch copied to the device while the next one is read (``_read/deviceload.py``, as
  ``arrayckpt.load`` does); anything else through a staging buffer and ``copy_`` as DCP's own reader does.
- Plain values are offered under the keys DCP's flattening gives them (``dcp_keys.py``: ``optim.param_groups``
  is asked for as ``optim.param_groups.0.lr``, …) as ``BYTE_IO`` items, ``torch.save``d into the ``BytesIO``
  handed to ``planner.load_bytes``; bytes as an ``io.BytesIO`` where the state loaded into holds one. numpy
  arrays are ``BYTE_IO`` items too (read whole). Pickled values load only with ``allow_pickle=True``; asking for
  one without it fails before any data is read, naming the key.
- An alias (a tensor saved under two keys, stored once: tied weights) is offered under its own key as its target's
  tensor, so a state holding both keys gets both filled.
- A per-rank entry of plain values (a value that differed between the saving ranks, or an ``arrayckpt.PerRank`` of
  one) is offered like a plain value: each rank of the default process group gets its own saved value at the world
  size of the save; at another, the reader's ``per_rank`` policy says which (``_read/perrank.py``), and without one
  the load is refused before any data is read, naming the key. Per-rank tensors have no DCP equivalent and are
  left out of the metadata (load them with ``arrayckpt.load`` or ``arrayckpt.open(path).per_rank(key)``); so are
  entries inside a tuple, which DCP would ask for as one value.
"""

from __future__ import annotations

import io
import os
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._errors import ArrayckptError, FormatError, PickleNotAllowedError, StateError
from .._format.dtypes import DType
from .._format.keys import dotted
from .._format.manifest import ArrayEntry, PerRankEntry, PickleEntry, ValueEntry
from .._format.values import decode_value
from .._io.arrays import collector_paused
from .._layout.box import Box
from .._read.checkpoint import Checkpoint, open_checkpoint, stored_of
from .._read.deviceload import DeviceLoads
from .._read.perrank import PerRankFunction, PerRankPolicy, check_policy, choose
from .._read.reader import ChainRead, read
from .._settings import settings
from .._storage import parse_location
from .._torch.dist import resolve_group
from .._torch.dtypes import torch_dtype
from .._torch.tensors import overlaps_itself, writable_numpy
from .._torch.transfer import is_staged
from .dcp_keys import dcp_path, dcp_terminals
from .dcp_options import check_reader_options

__all__ = ["ArrayckptReader"]



@dataclass(frozen=True)
class _DeviceRead:
    """A box of a tensor for a device target of the stored dtype (read through :class:`DeviceLoads`)."""

    key: str
    box: Box
    dtype: DType


@dataclass(frozen=True)
class _Source:
    """Where a DCP key's data is in the checkpoint."""

    kind: str  # "tensor", "value", "per_rank" (a per-rank entry of values), "pickle" or "ndarray"
    key: str  # the entry
    sub: tuple[Any, ...] = ()  # for a value: the keys and indices of the leaf inside it


def _close(holder: list[Checkpoint]) -> None:
    while holder:
        holder.pop().close()


class ArrayckptReader(StorageReader):
    """A DCP ``StorageReader`` for arrayckpt checkpoints (see the module docstring).

    Args:
        path: a checkpoint's local path or URL; it may instead come from DCP's ``checkpoint_id``.
        allow_pickle: let pickled values load (only for checkpoints you trust: unpickling can run code; DCP's own
            reader unpickles every non-tensor value).
        storage_options: for object storage, as for :func:`arrayckpt.open`.
        base_roots: where a delta checkpoint's bases may be besides the directory holding it (as for
            :func:`arrayckpt.open`).
        per_rank: how a value saved per rank resumes at another world size than the save's, as for
            :func:`arrayckpt.load` (the world: the default process group's).
        filesystem_reader_options: ``FileSystemReader``'s ``_extension_registry`` is accepted and has no effect
            (``dcp_options.py``).

    Raises:
        TypeError: an argument ``FileSystemReader`` does not take either.

    Examples:
        >>> import arrayckpt, torch, tempfile, os, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> from arrayckpt.dcp import ArrayckptReader
        >>> path = os.path.join(tempfile.mkdtemp(), "step-1")
        >>> arrayckpt.save({"model": {"w": torch.ones(2, 3)}, "step": 7}, path)
        >>> state = {"model": {"w": torch.zeros(2, 3)}, "step": 0}
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # DCP warns that it loads in a single process
        ...     dcp.load(state, storage_reader=ArrayckptReader(path), no_dist=True)
        >>> state["model"]["w"].sum().item(), state["step"]
        (6.0, 7)
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, allow_pickle: bool = False,
                 storage_options: Mapping[str, Any] | None = None,
                 base_roots: Sequence[str | os.PathLike[str]] | None = None, per_rank: PerRankPolicy | None = None,
                 **filesystem_reader_options: Any) -> None:
        check_reader_options(filesystem_reader_options)
        check_policy(per_rank)
        super().__init__()
        self.per_rank = per_rank
        self._chosen: dict[str, int | PerRankFunction | str] = {}  # per-rank key -> what this rank takes (a load's)
        self.base_roots = base_roots
        self.path = None if path is None else os.fspath(path)
        self.allow_pickle = allow_pickle
        self.storage_options = storage_options
        self.load_id = uuid.uuid4().hex
        self._open: list[Checkpoint] = []  # at most one; a list so that the finalizer holds no reference to self
        self._finalizer = weakref.finalize(self, _close, self._open)
        self._sources: dict[str, _Source] = {}
        self._ambiguous: dict[str, list[str]] = {}  # DCP key -> the entries that would both give it
        self._opened_by_reset = False  # the checkpoint held was opened by reset(checkpoint_id), for this load
        if self.path is not None:
            self._checkpoint()  # a clear error now when nothing is there; reopened by each load
            _close(self._open)

    # --- DCP's StorageReader interface, in the order DCP calls it ----------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load begins: close the checkpoint held; with a ``checkpoint_id`` (the path), open it now."""
        _close(self._open)
        self._opened_by_reset = False
        self.load_id = uuid.uuid4().hex
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
            self._checkpoint()
            self._opened_by_reset = True

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether a committed arrayckpt checkpoint is at ``checkpoint_id`` (one read of its root document)."""
        try:
            return parse_location(checkpoint_id).is_committed()
        except Exception:  # noqa: BLE001 - not a location arrayckpt knows
            return False

    @property
    def checkpoint_id(self) -> str | None:
        """The path of the checkpoint loaded (DCP logs it)."""
        return self.path

    def read_metadata(self, *args: Any) -> Metadata:
        """DCP's description of the checkpoint, from its manifest (no data is read): the checkpoint at the path
        now (opened anew unless ``reset(checkpoint_id)`` just opened it)."""
        if not self._opened_by_reset:
            _close(self._open)
        self._opened_by_reset = False
        checkpoint = self._checkpoint()
        manifest = checkpoint.manifest
        described: dict[str, Any] = {}
        paths: dict[str, tuple[str | int, ...]] = {}
        sources: dict[str, _Source] = {}
        ambiguous: dict[str, list[str]] = {}

        def offer(path: tuple[str | int, ...], source: _Source, what: Any) -> None:
            fqn = ".".join(map(str, path))
            if fqn in sources:
                ambiguous.setdefault(fqn, [sources[fqn].key]).append(source.key)
                return
            described[fqn], paths[fqn], sources[fqn] = what, path, source

        for key, entry in manifest.entries.items():
            path = dcp_path(entry.parts, manifest.containers)
            if any(manifest.containers.get(dotted(entry.parts[:i])) == "tuple" for i in range(1, len(entry.parts))):
                continue  # inside a tuple: DCP would ask for the whole tuple as one value
            array = manifest.array_entry(key)  # an alias: its target's tensor
            if array is not None and array.kind == "tensor":
                shape = torch.Size(array.shape)
                chunk = ChunkStorageMetadata(offsets=torch.Size([0] * len(shape)), sizes=shape)
                offer(path, _Source("tensor", key),
                      TensorStorageMetadata(TensorProperties(dtype=torch_dtype(array.dtype)), shape, [chunk]))
            elif array is not None:
                offer(path, _Source("ndarray", key), BytesStorageMetadata())
            elif isinstance(entry, PickleEntry):
                offer(path, _Source("pickle", key), BytesStorageMetadata())
            elif isinstance(entry, ValueEntry):
                for below, sub in dcp_terminals(decode_value(entry.value, key)):
                    offer((*path, *below), _Source("value", key, sub), BytesStorageMetadata())
            elif isinstance(entry, PerRankEntry) and not any(isinstance(i, ArrayEntry) for i in entry.items):
                leaves: dict[tuple[str | int, ...], tuple[Any, ...]] = {}  # what any rank's value has
                for item in entry.items:
                    if isinstance(item, ValueEntry):
                        for below, sub in dcp_terminals(decode_value(item.value, key)):
                            leaves.setdefault(below, sub)
                for below, sub in leaves.items():
                    offer((*path, *below), _Source("per_rank", key, sub), BytesStorageMetadata())
            # a PerRankEntry of tensors: no DCP equivalent (see the module docstring)
        self._sources, self._ambiguous, self._chosen = sources, ambiguous, {}
        save_id = manifest.created.get("dcp_save_id")  # recorded by ArrayckptWriter (informational, spec §4.2)
        storage_meta = StorageMeta(checkpoint_id=self.path, save_id=save_id if isinstance(save_id, str) else None,
                                   load_id=self.load_id)
        return Metadata(described, planner_data=paths, storage_meta=storage_meta)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Refuse, before any data is read, what this rank's plan asks for and cannot have: a pickled value
        without ``allow_pickle=True``, a key two entries of the checkpoint would give, a value saved per rank at
        another world size that ``per_rank`` says nothing of."""
        where = str(self._checkpoint().location)
        group = resolve_group(None)
        for item in plan.items:
            fqn = item.storage_index.fqn
            if fqn in self._ambiguous:
                raise FormatError(f"{where}: entries {self._ambiguous[fqn]} of the checkpoint are both {fqn!r} to "
                                  "DCP; load them with arrayckpt.load instead")
            source = self._sources.get(fqn)
            if source is not None and source.kind == "pickle" and not self.allow_pickle:
                raise PickleNotAllowedError(
                    f"{where}: value {source.key!r} is pickled; unpickling can run arbitrary code, so loading it needs "
                    "ArrayckptReader(..., allow_pickle=True) (only for checkpoints you trust), or leave it out of "
                    "the state (DefaultLoadPlanner(allow_partial_load=True))")
            if source is not None and source.kind == "per_rank" and source.key not in self._chosen:
                entry = self._checkpoint().manifest.entries[source.key]
                assert isinstance(entry, PerRankEntry)  # read_metadata offered it as one
                self._chosen[source.key] = choose(self.per_rank, where, source.key, entry.items, group.rank,
                                                  group.size)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's items: tensor boxes concurrently through arrayckpt's read path into the planner's
        targets, values through ``planner.load_bytes``. The checkpoint is closed when it returns."""
        try:
            checkpoint = self._checkpoint()
            decoded: dict[str, Any] = {}  # plain values decoded once, however many DCP keys they give
            with collector_paused():
                batch: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None, ChainRead]] = []
                device, on_device = DeviceLoads(), []
                staged = 0
                for item in plan.items:
                    if item.type == LoadItemType.BYTE_IO:
                        data = self._bytes(checkpoint, item, decoded, planner)
                        if data is not None:  # None: a per-rank value the policy keeps as the state has it
                            planner.load_bytes(item, data)
                        continue
                    target, buffer, request = self._tensor_read(checkpoint, item, planner)
                    if request.box.size == 0 and request.box.shape:  # nothing to read (a rank holding no rows)
                        planner.commit_tensor(item, target)
                    elif isinstance(request, _DeviceRead):  # in batches through pooled host buffers
                        device.add(request.key, target, request.box, request.dtype,
                                   lambda box, out, key=request.key: ChainRead(key, box, out))  # type: ignore[misc]
                        on_device.append((item, target))
                    else:
                        batch.append((item, target, buffer, request))
                        staged += 0 if buffer is None else buffer.numel() * buffer.element_size()
                        if staged >= settings().dcp_staged_batch_bytes:
                            _run(checkpoint, batch, planner)
                            batch, staged = [], 0
                _run(checkpoint, batch, planner)
                device.run([], lambda requests: read(stored_of(checkpoint), requests), whole=False, touched=[])
                for item, target in on_device:
                    planner.commit_tensor(item, target)
        finally:
            _close(self._open)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    # --- helpers -------------------------------------------------------------------------------------------

    def _checkpoint(self) -> Checkpoint:
        if not self._open:
            if self.path is None:
                raise StateError("ArrayckptReader has no path: pass one, ArrayckptReader(path), or a checkpoint_id "
                                 "to torch.distributed.checkpoint.load")
            self._open.append(open_checkpoint(self.path, allow_pickle=self.allow_pickle,
                                              storage_options=self.storage_options, base_roots=self.base_roots))
        return self._open[0]

    def _source(self, item: ReadItem) -> _Source:
        source = self._sources.get(item.storage_index.fqn)
        if source is None:
            raise ArrayckptError(f"{self.path}: DCP asked for {item.storage_index.fqn!r}, which read_metadata did not "
                                 "describe")
        return source

    def _tensor_read(self, checkpoint: Checkpoint, item: ReadItem, planner: LoadPlanner
                     ) -> tuple[torch.Tensor, torch.Tensor | None, ChainRead | _DeviceRead]:
        """The target of one tensor item, the buffer it is staged in (``None``: read in place or on a device) and
        its read."""
        source = self._source(item)
        entry = checkpoint.manifest.array_entry(source.key)  # through an alias to its target
        assert entry is not None
        chunk = item.storage_index.offset or torch.Size([0] * len(entry.shape))
        offset = tuple(int(c) + int(o) for c, o in zip(chunk, item.storage_offsets, strict=True))
        box = Box(offset, tuple(int(n) for n in item.lengths))
        target = planner.resolve_tensor(item).detach()
        if tuple(target.shape) != box.shape:
            raise StateError(f"{checkpoint.location}: tensor {source.key!r}: the planner's target has shape "
                             f"{list(target.shape)} for a read of shape {list(box.shape)}")
        dtype = torch_dtype(entry.dtype)
        plain = (target.dtype == dtype and target.layout == torch.strided and not target.is_conj()
                 and not target.is_neg() and not overlaps_itself(tuple(target.shape), tuple(target.stride())))
        if plain and is_staged(target):
            return target, None, _DeviceRead(source.key, box, entry.dtype)
        if plain and target.device.type == "cpu":
            return target, None, ChainRead(source.key, box, writable_numpy(target, entry.dtype, source.key))
        buffer = torch.empty(box.shape, dtype=dtype)
        return target, buffer, ChainRead(source.key, box, writable_numpy(buffer, entry.dtype, source.key))

    def _bytes(self, checkpoint: Checkpoint, item: ReadItem, decoded: dict[str, Any],
               planner: LoadPlanner) -> io.BytesIO | None:
        """A BYTE_IO item's value, ``torch.save``d, as DCP's planners expect it; bytes as an ``io.BytesIO`` where the
        state loaded into holds one (``ArrayckptWriter`` stores an ``io.BytesIO`` as its bytes). ``None``: a per-rank
        value the ``per_rank`` policy keeps as the state holds it."""
        source = self._source(item)
        if source.kind == "per_rank":
            if source.key not in decoded:
                decoded[source.key] = self._per_rank_value(checkpoint, source.key)
            value = decoded[source.key]
            if value is _KEEP:
                return None
            try:
                for part in source.sub:
                    value = value[part]
            except (KeyError, IndexError, TypeError):
                raise StateError(f"{checkpoint.location}: DCP asked for {item.storage_index.fqn!r}, which the value of "
                                 f"{source.key!r} this rank takes (saved per rank) does not hold") from None
        elif source.kind == "value":
            if source.key not in decoded:
                decoded[source.key] = checkpoint.plain_values[source.key]
            value = decoded[source.key]
            for part in source.sub:
                value = value[part]
        elif source.kind == "ndarray":
            value = np.asarray(checkpoint[source.key].numpy())
        else:  # a pickle, allowed (prepare_local_plan refused it otherwise)
            value = checkpoint.plain_values[source.key]
        if isinstance(value, bytes) and isinstance(_target(planner, item), io.BytesIO):
            value = io.BytesIO(value)
        out = io.BytesIO()
        torch.save(value, out)
        out.seek(0)
        return out

    def _per_rank_value(self, checkpoint: Checkpoint, key: str) -> Any:
        """This rank's value of a per-rank entry of values: its own, or what the policy chose (``_KEEP``: none)."""
        entry = checkpoint.manifest.entries[key]
        assert isinstance(entry, PerRankEntry)  # read_metadata offered it as one
        group = resolve_group(None)
        chosen = self._chosen.get(key)
        if chosen is None:
            chosen = choose(self.per_rank, str(checkpoint.location), key, entry.items, group.rank, group.size)
        if chosen == "keep":
            return _KEEP
        if isinstance(chosen, int):
            item = entry.items[chosen] if 0 <= chosen < len(entry.items) else None
            if not isinstance(item, ValueEntry):
                raise StateError(f"{checkpoint.location}: per-rank value {key!r} has no value saved by rank {chosen}")
            return decode_value(item.value, key)
        assert callable(chosen)
        values = [decode_value(i.value, key) if isinstance(i, ValueEntry) else None for i in entry.items]
        return chosen(key, values, group.rank, group.size)


_KEEP = object()  # a per-rank value the policy keeps as the state holds it


def _target(planner: LoadPlanner, item: ReadItem) -> object:
    """What the state loaded into holds for a BYTE_IO item (``DefaultLoadPlanner.state_dict``, by DCP's key), or
    None with a planner that does not say."""
    state = getattr(planner, "state_dict", None)
    return state.get(item.dest_index.fqn) if isinstance(state, Mapping) else None


def _run(checkpoint: Checkpoint, batch: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None, ChainRead]],
         planner: LoadPlanner) -> None:
    """Read a batch of tensor items at once, copy staged ones into their targets, and commit them to the planner."""
    if not batch:
        return
    read(stored_of(checkpoint), [request for _, _, _, request in batch])
    for item, target, buffer, _ in batch:
        if buffer is not None:
            target.copy_(buffer)
        planner.commit_tensor(item, target)
