"""One stored tensor of an opened checkpoint: metadata at once, data when sliced (``_read/reader.py`` reads it,
through the checkpoint's :class:`~.stored.StoredCheckpoint`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .._format.jsontypes import JSON
from .._format.manifest import ArrayEntry
from .._io.arrays import ArrayIO, array_spec
from .._layout.box import Box
from .._read.chain import basic_index, bounding_box
from .._read.reader import ChainRead, read
from .._settings import settings

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch
    from torch import Tensor  # (inside the class, ``torch`` is the method below)

    from .stored import StoredCheckpoint

__all__ = ["LazyArray"]


class LazyArray:
    """One stored tensor: metadata now, data on slicing.

    ``arr[0:2]`` returns numpy (bfloat16 as ``ml_dtypes.bfloat16``); ``arr.torch()`` a torch tensor. Once its
    checkpoint is closed, the metadata stays and every read (and :attr:`spec`) raises
    :class:`arrayckpt.ClosedCheckpointError`. Made by indexing a :class:`Checkpoint`.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)}, path)
        >>> with arrayckpt.open(path) as ckpt:
        ...     w = ckpt["w"]
        ...     w.shape, w.dtype, w[1:].tolist(), w.torch()[0]
        ((3, 2), torch.bfloat16, [[2.0, 3.0], [4.0, 5.0]], tensor([0., 1.], dtype=torch.bfloat16))
    """

    def __init__(self, stored: StoredCheckpoint, entry: ArrayEntry, metadata: JSON) -> None:
        self._stored = stored  # its checkpoint's: every read goes through it
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

    @property
    def spec(self) -> JSON:
        """The TensorStore spec of this array (metadata included, so opening needs no request). A rows delta
        has no array of the tensor's shape, and a packed checkpoint's arrays (spec §16) no kvstore TensorStore can
        open on its own (their chunk files are byte ranges of packs): read those by slicing instead."""
        if self.entry.delta is not None and self.entry.delta.mode == "rows":
            raise TypeError(f"{self._stored.location}: tensor {self.key!r} is stored as changed rows of its base; "
                            "it has no array of its own to open (slice it, or use .torch())")
        if self._stored.packed is not None:
            raise TypeError(f"{self._stored.location}: tensor {self.key!r} is stored in the checkpoint's packs, which "
                            "TensorStore cannot open as a kvstore of its own: slice it or use .numpy()/.torch(), or "
                            "read the checkpoint's refs.json with zarr-python (written by `arrayckpt refs`)")
        return array_spec(self._stored.node_kvstore(self.entry.path), self.metadata)

    def __getitem__(self, index: Any) -> np.ndarray:  # any numpy index (numpy types it as a union of its own)
        """numpy indexing: basic indices (ints, slices, ``...``, negative positions) read only the chunks they
        touch; anything else (index arrays, negative steps, ``None``) reads the whole array, then indexes it."""
        self._stored.check_open()
        normal = basic_index(index, self.shape)
        if normal is None:
            whole: np.ndarray = self.numpy()[index]  # (an index array, a negative step, None: an array)
            return whole
        if self.entry.delta is not None:
            return self._through_chain(normal)
        # the selection itself (strides included) is read, an integer as a length-1 slice dropped afterwards
        shape = [1 if isinstance(part, int) else len(range(part.start, part.stop, part.step)) for part in normal]
        out = np.empty(shape, self.numpy_dtype)
        selection = tuple(slice(part, part + 1) if isinstance(part, int) else part for part in normal)
        read(self._stored, [ArrayIO(self.key, self._stored.read_spec(self.key), out, selection or None)],
             execute=self._stored.slices(self.key))
        return out.reshape([n for n, part in zip(shape, normal, strict=True) if not isinstance(part, int)])

    def _through_chain(self, index: tuple[int | slice, ...]) -> np.ndarray:
        """A read of a delta entry: the bounding box of the index through the chain, then the index within it."""
        found = bounding_box(index, self.shape)
        assert found is not None  # a basic index (see __getitem__)
        box, relative = found
        out = np.empty(box.shape, self.numpy_dtype)
        read(self._stored, [ChainRead(self.key, box, out)])
        selected: np.ndarray = out[relative]
        return selected

    def numpy(self) -> np.ndarray:
        """The whole array as numpy (a big one probed first: :meth:`_probe`)."""
        self._probe()
        return self[(slice(None),) * len(self.shape)]

    def _probe(self) -> None:
        """For an array of more than ``probe_bytes`` (``_settings.py``), read its first and last elements (through the
        chain) before the whole is allocated: a crafted root document claiming gigabytes that its chunk files do not
        hold fails here, on the missing or short data (an error naming the chunk, never zeros), not after the
        allocation."""
        if self.nbytes > settings().probe_bytes:
            self[(0,) * self.ndim]
            self[tuple(n - 1 for n in self.shape)]

    def __array__(self, dtype: npt.DTypeLike | None = None, copy: bool | None = None) -> np.ndarray:
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def torch(self) -> torch.Tensor:
        """The whole array as a new CPU torch tensor of the saved dtype."""
        import torch

        self._stored.check_open()  # before allocating
        self._probe()
        try:
            out = torch.empty(self.shape, dtype=self.dtype)
        except (RuntimeError, MemoryError):  # torch's allocator says RuntimeError
            raise MemoryError(f"{self._stored.location}: tensor {self.key!r} ({self.entry.dtype.name}"
                              f"{list(self.shape)}, {self.nbytes:,} bytes) is more than this machine can allocate; "
                              "read it in slices (ckpt[key][a:b]), or use a machine with more memory") from None
        self.read_into(out)
        return out

    def read_into(self, tensor: Tensor) -> None:
        """Read the whole array into an existing CPU tensor of the same shape and dtype."""
        from .._torch.tensors import writable_numpy  # torch only when reading into torch

        self._stored.check_open()
        out = writable_numpy(tensor, self.entry.dtype, self.key)
        read(self._stored, [ChainRead(self.key, Box.whole(self.shape), out)])
