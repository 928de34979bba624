"""Reading: a committed checkpoint opened as lazy arrays, with no torch needed to look inside.

``open`` costs one read (the root ``zarr.json`` holds the manifest and every array's metadata); array
data is read only when sliced, and only the chunks the slice touches.
"""

from __future__ import annotations

import math
import os
import pickle
import weakref
from collections.abc import Iterator, Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import ArrayckptError, CorruptCheckpointError, FormatError, PickleNotAllowedError
from .._format.codecs import check_checksummed
from .._format.dtypes import DType
from .._format.manifest import ArrayEntry, PerRankEntry, PickleEntry, ValueEntry, parse_root_document, per_rank_path
from .._format.values import decode_value
from .._format.zarr import check_array_metadata, grid_counts
from .._io.arrays import ArrayIO, array_spec, open_array, read_failure, read_into
from .._layout.box import Box
from .._storage.local import Location, kvstore_at, parse_location

if TYPE_CHECKING:
    import tensorstore as ts
    import torch

__all__ = ["Checkpoint", "LazyArray", "open_checkpoint"]

MAX_CHAIN = 10_000  # a longer chain of bases is damage (or a loop), not a plan


class LazyArray:
    """One stored tensor: metadata now, data on slicing.

    ``arr[0:2]`` returns numpy (bfloat16 as ``ml_dtypes.bfloat16``); ``arr.torch()`` a torch tensor.
    """

    def __init__(self, checkpoint: Checkpoint, entry: ArrayEntry, metadata: dict[str, Any]) -> None:
        self._checkpoint = checkpoint
        self.entry = entry
        self.metadata = metadata

    @property
    def key(self) -> str:
        return self.entry.key

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    @property
    def ndim(self) -> int:
        return len(self.entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype the tensor was saved with."""
        from .._torch.dtypes import torch_dtype  # torch only for torch's answer

        return torch_dtype(self.entry.dtype)

    @property
    def numpy_dtype(self) -> np.dtype:
        return self.entry.dtype.numpy

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    @property
    def size(self) -> int:
        return math.prod(self.entry.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d array")
        return self.shape[0]

    def __repr__(self) -> str:
        return f"LazyArray({self.key!r}, shape={self.shape}, dtype={self.entry.dtype.name})"

    @cached_property
    def _store(self) -> ts.TensorStore:
        import tensorstore as ts

        store = open_array(self.spec, self._checkpoint._context, self.key, str(self._checkpoint.location))
        # explicit bounds: an index past the shape is an IndexError when indexing (as a negative one is), not a
        # read that fails later and would be reported as damage
        return store[ts.d[:].mark_bounds_implicit[False]]

    @property
    def spec(self) -> dict[str, Any]:
        """The TensorStore spec of this array (metadata included, so opening needs no request). A rows delta
        has no array of the tensor's shape: read it by slicing instead."""
        if self.entry.delta is not None and self.entry.delta.mode == "rows":
            raise TypeError(f"{self._checkpoint.location}: tensor {self.key!r} is stored as changed rows of its base; "
                            "it has no array of its own to open (slice it, or use .torch())")
        return array_spec(kvstore_at(self._checkpoint._base, self.entry.path), self.metadata)

    def __getitem__(self, index: Any) -> np.ndarray:
        """numpy indexing: basic indices (ints, slices, ``...``, negative positions) read only the chunks they
        touch; anything else (index arrays, negative steps, ``None``) reads the whole array, then indexes it."""
        from .._read.chain import basic_index

        normal = basic_index(index, self.shape)
        if normal is None:
            return self.numpy()[index]
        if self.entry.delta is not None:
            return self._through_chain(normal)
        try:
            out = np.asarray(self._store[normal].read().result())
        except (IndexError, TypeError):
            raise
        except Exception as e:
            failed = read_failure(f"{self._checkpoint.location}: tensor {self.key!r}: read failed: {e}", e)
            failed.__cause__ = e
            self._checkpoint.raise_if_replaced(failed)
            raise failed from e
        self._checkpoint.check_unchanged()
        return out

    def _through_chain(self, index: Any) -> np.ndarray:
        """A read of a delta entry: the bounding box of the index through the chain, then the index within it."""
        from .._read.chain import bounding_box, read_box

        found = bounding_box(index, self.shape)
        assert found is not None  # a basic index (see __getitem__)
        box, relative = found
        out = np.empty(box.shape, self.numpy_dtype)
        read_box(self._checkpoint, self.key, box, out)
        return out[relative]

    def numpy(self) -> np.ndarray:
        """The whole array as numpy."""
        return self[(slice(None),) * len(self.shape)]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def torch(self) -> torch.Tensor:
        """The whole array as a new CPU torch tensor of the saved dtype."""
        import torch

        out = torch.empty(self.shape, dtype=self.dtype)
        self.read_into(out)
        return out

    def read_into(self, tensor: torch.Tensor) -> None:
        """Read the whole array into an existing CPU tensor of the same shape and dtype."""
        from .._read.chain import read_box
        from .._torch.tensors import writable_numpy  # torch only when reading into torch

        read_box(self._checkpoint, self.key, Box.whole(self.shape), writable_numpy(tensor, self.entry.dtype, self.key))


class _Values(Mapping[str, Any]):
    """Plain values by key; pickled ones are unpickled on access, only with consent."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self._checkpoint = checkpoint
        self._entries = {
            k: e for k, e in checkpoint.manifest.entries.items() if isinstance(e, (ValueEntry, PickleEntry))
        }

    def __getitem__(self, key: str) -> Any:
        if key not in self._entries:
            raise KeyError(key)
        return self._checkpoint.value(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class Checkpoint(Mapping[str, LazyArray]):
    """A committed checkpoint, read-only: dotted key -> :class:`LazyArray`.

    Plain values are in :attr:`plain_values`, the manifest in :attr:`manifest`.
    """

    def __init__(self, location: Location, allow_pickle: bool = False) -> None:
        self.location = location
        self.allow_pickle = allow_pickle
        self._above: frozenset[str | None] = frozenset()  # ids of the deltas that read through this checkpoint
        where = str(location)
        document, self._base, release, self._generation = location.open_committed()
        weakref.finalize(self, release)
        self.manifest, self._nodes = parse_root_document(document, where)
        self._context = location.read_context()
        self._arrays: dict[str, LazyArray] = {}
        for key, entry in self.manifest.entries.items():
            if isinstance(entry, ArrayEntry):
                rows = entry.delta is not None and entry.delta.mode == "rows"
                metadata = {} if rows else self._node(entry.path, key, entry.dtype, entry.shape)
                self._arrays[key] = LazyArray(self, entry, metadata)

    # --- delta checkpoints ------------------------------------------------------------------------

    @cached_property
    def base(self) -> Checkpoint:
        """The checkpoint this delta checkpoint was saved against (opened on first use, and checked to be the
        very one: a base replaced since is refused)."""
        from .._errors import CheckpointNotFoundError
        from .._layout.delta import resolve_base

        ref = self.manifest.base
        if ref is None:
            raise ValueError(f"{self.location}: a full checkpoint; it has no base")
        location = resolve_base(self.location, ref)
        try:
            base = Checkpoint(location, self.allow_pickle)
        except ArrayckptError as e:
            kind = CheckpointNotFoundError if isinstance(e, CheckpointNotFoundError) else CorruptCheckpointError
            raise kind(f"{self.location}: its base checkpoint {location} (step {ref.step}) cannot be read: {e}") from e
        if base.manifest.id != ref.id:
            raise CorruptCheckpointError(
                f"{self.location}: its base {location} is not the checkpoint it was saved against (id "
                f"{base.manifest.id}, expected {ref.id}): the base was replaced; this delta cannot be read")
        base._above = self._above | {self.manifest.id}
        if ref.id in base._above or len(base._above) > MAX_CHAIN:
            raise CorruptCheckpointError(f"{self.location}: its chain of bases loops back or exceeds {MAX_CHAIN} "
                                         "checkpoints")
        return base

    def chain(self) -> list[Checkpoint]:
        """This checkpoint and its bases, newest first, down to a full checkpoint (every one opened)."""
        out = [self]
        while out[-1].manifest.base is not None:
            out.append(out[-1].base)
        return out

    def check_unchanged(self) -> None:
        """After reading data: on object storage (where nothing can pin a checkpoint), make sure the checkpoint
        and the bases read through were not replaced meanwhile, or the data read may mix two checkpoints.
        One small read per layer; nothing to do locally (the directory is pinned)."""
        layer: Checkpoint | None = self
        while layer is not None:
            if layer._generation is not None and layer.location.changed_since(layer._generation):
                raise CorruptCheckpointError(
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
                raise CorruptCheckpointError(
                    f"{layer.location}: the checkpoint was replaced (or removed) while it was being read, its data "
                    "with it (the read failed; see the cause): open it again") from error
            layer = layer.__dict__.get("base")

    def _replaced(self) -> bool:
        if self._generation is not None:  # object storage: the root document changed
            return self.location.changed_since(self._generation)
        pinned, path = self._base.get("path"), getattr(self.location, "path", None)
        if not isinstance(pinned, str) or path is None:
            return False
        try:
            held = os.stat(pinned)
        except OSError:
            return False
        try:
            now = os.stat(path)
        except FileNotFoundError:
            return True
        return (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino)

    def dense_grid(self, key: str) -> tuple[int, ...]:
        from .._read.chain import dense_grid

        return dense_grid(self, key)

    def read_box(self, key: str, box: Box, out: np.ndarray) -> None:
        """Fill ``out`` with ``box`` of tensor ``key``, through the chain of bases for delta entries."""
        from .._read.chain import read_box

        read_box(self, key, box, out)

    def read_plan(self, key: str, box: Box, out: np.ndarray) -> tuple[list[ArrayIO], list[Any]]:
        """The reads (and row overlays to run after them, in order) that fill ``out`` with ``box`` of ``key``."""
        from .._read.chain import read_plan

        return read_plan(self, key, box, out)

    def _dense_metadata(self, key: str) -> dict[str, Any]:
        """The array metadata of ``key`` in the nearest layer storing it as an array of its shape."""
        from .._read.chain import dense_layer

        return dense_layer(self, key)[key].metadata

    def _kvstore(self, path: str) -> dict[str, Any]:
        return kvstore_at(self._base, path)

    def _present(self, key: str) -> frozenset[int]:
        cache = self.__dict__.setdefault("_present_cache", {})
        if key not in cache:
            entry = self.manifest.entries[key]
            assert isinstance(entry, ArrayEntry) and entry.delta is not None
            count = math.prod(grid_counts(self[key].metadata))
            if any(i >= count for i in entry.delta.present):
                raise FormatError(f"{self.location}: entry {key!r}: delta names chunks beyond its {count}-chunk grid")
            cache[key] = frozenset(entry.delta.present)
        return cache[key]

    def _delta_spec(self, entry: ArrayEntry, name: str) -> dict[str, Any]:
        """Spec of one array of a rows delta (``rows``, ``values``, ``codes``, ``scale``, ``offset``), checked."""
        from .._format.dtypes import dtype_by_name

        assert entry.delta is not None
        count = self._delta_count(entry)
        tail = entry.shape[1:]
        expected = {"rows": ("int64", (count,)), "values": (entry.dtype.name, (count, *tail)),
                    "scale": ("float32", (count,)), "offset": ("float32", (count,))}
        path = f"{entry.path}/{name}"
        if name == "codes":
            from .._format.quant import packed_columns

            bits = entry.delta.quantized.bits if entry.delta.quantized is not None else 8
            dtype_name, shape = "uint8", (count, packed_columns(math.prod(tail), bits))
        else:
            dtype_name, shape = expected[name]
        return array_spec(kvstore_at(self._base, path), self._node(path, entry.key, dtype_by_name(dtype_name), shape))

    def _delta_count(self, entry: ArrayEntry) -> int:
        metadata = self._nodes.get(f"{entry.path}/rows")
        shape = metadata.get("shape") if isinstance(metadata, dict) else None
        if not (isinstance(shape, list) and len(shape) == 1 and isinstance(shape[0], int)):
            raise FormatError(f"{self.location}: entry {entry.key!r}: its rows delta has no valid 'rows' array")
        return shape[0]

    def _delta_rows(self, key: str) -> np.ndarray:
        """The row indices a rows delta stores (read once; -1 marks padding)."""
        cache = self.__dict__.setdefault("_rows_cache", {})
        if key not in cache:
            entry = self.manifest.entries[key]
            assert isinstance(entry, ArrayEntry)
            rows = np.empty((self._delta_count(entry),), np.int64)
            read_into([ArrayIO(key, self._delta_spec(entry, "rows"), rows)], self._context, str(self.location))
            if len(rows) and (rows.max() >= entry.shape[0] or rows.min() < -1):
                raise CorruptCheckpointError(f"{self.location}: tensor {key!r}: its changed rows name rows outside "
                                             f"0..{entry.shape[0] - 1}")
            cache[key] = rows
        return cache[key]

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
        path = per_rank_path(key, rank)
        return array_spec(kvstore_at(self._base, path), self._node(path, key, item.dtype, item.shape))

    def per_rank(self, key: str) -> list[Any]:
        """Every rank's value of a :class:`arrayckpt.PerRank` entry (tensors read whole; ``None`` where a rank
        had none), e.g. to inspect RNG states or resume at another world size."""
        from .._torch.dtypes import torch_view  # per-rank tensors come back as torch tensors

        entry = self.manifest.entries.get(key)
        if not isinstance(entry, PerRankEntry):
            raise KeyError(f"{self.location}: {key!r} is not a per-rank entry")
        out: list[Any] = []
        for rank, item in enumerate(entry.items):
            if isinstance(item, ArrayEntry):
                array = np.empty(item.shape, item.dtype.numpy)
                read_into([ArrayIO(key, self.per_rank_spec(key, rank), array)], self._context, str(self.location))
                out.append(array if item.kind == "ndarray" else torch_view(array, item.dtype))
            else:
                out.append(None if item is None else decode_value(item.value, key))
        return out

    @property
    def step(self) -> int | None:
        return self.manifest.step

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
            return self._unpickle(entry)
        raise KeyError(f"{key!r} is an array, not a plain value; use checkpoint[{key!r}]")

    def _unpickle(self, entry: PickleEntry) -> Any:
        if not self.allow_pickle:
            raise PickleNotAllowedError(
                f"{self.location}: value {entry.key!r} is pickled; unpickling can run arbitrary code, so it "
                "needs allow_pickle=True (only for checkpoints you trust)"
            )
        metadata = self._node(entry.path, entry.key, _uint8(), (entry.nbytes,))
        raw = np.empty((entry.nbytes,), np.uint8)
        read_into([ArrayIO(entry.key, array_spec(kvstore_at(self._base, entry.path), metadata), raw)],
                  self._context, str(self.location))
        return pickle.loads(raw.tobytes())

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
        return f"arrayckpt.Checkpoint({str(self.location)!r}, {len(self)} arrays, {len(self.plain_values)} values)"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values())


def _uint8() -> DType:
    from .._format.dtypes import DTYPES

    return DTYPES["uint8"]


def open_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False,
                    storage_options: Mapping[str, Any] | None = None) -> Checkpoint:
    """Open a committed checkpoint read-only: a local path or an object-storage URL (``s3://bucket/prefix``,
    with ``storage_options`` as for :func:`arrayckpt.save`). Opening reads one object, the root ``zarr.json``.

    >>> import arrayckpt, torch, tempfile, os
    >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> arrayckpt.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, d)
    >>> ckpt = arrayckpt.open(d)
    >>> ckpt["w"].shape, ckpt["w"][1, :2].tolist(), ckpt.plain_values["step"]
    ((2, 3), [3.0, 4.0], 7)
    """
    return Checkpoint(parse_location(path, storage_options), allow_pickle)
