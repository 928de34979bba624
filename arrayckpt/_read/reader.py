"""The one read path: every read of a checkpoint's array data goes through :func:`read`.

``load``, slicing a :class:`~arrayckpt.LazyArray` (``[...]``, ``.numpy()``, ``.torch()``, ``.read_into``),
per-rank arrays, pickled bytes, ``compact``, ``verify``, ``diff`` and ``show`` all hand it a list of requests:

- :class:`ChainRead`: a box of a tensor, read through the chain of bases into ``out`` (``_read/chain.py``
  plans it as plain reads from the layers that hold it, plus row overlays of rows deltas);
- :class:`~arrayckpt._io.arrays.ArrayIO`: a named array's spec and index, read as it is (per-rank arrays,
  pickled bytes, arrays of a rows delta, whole outer chunks for ``verify``).

It plans every request, runs all the plain reads at once (``_io.arrays.read_into``: concurrently, local
uncompressed chunks on the fast path), applies the overlays in order, and then checks — once per call, whatever
the number of requests — that the checkpoint was not replaced meanwhile: a failure caused by the checkpoint (or
a base read through) being replaced or removed says so (:meth:`ChainSource.raise_if_replaced`), and a success is
checked not to have been overtaken by a replacement (:meth:`ChainSource.check_unchanged`), since on object
storage what was read could otherwise mix two checkpoints.

How the plain reads run is the caller's ``execute`` (``read_into``'s signature, and by default ``read_into``):
``load(read_once=True)`` reads this rank's share and exchanges the rest with the other ranks there, and a slice
of one array is read by :class:`ArraySlices`. Whatever runs them, the checks are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .._errors import ArrayckptError
from .._format.jsontypes import JSON
from .._io.arrays import ArrayIO, open_array, read_failure, read_into, typed_data
from .._io.staged import source_of
from .._layout.box import Box
from .._read.chain import Overlay, plan_box
from .._settings import settings

if TYPE_CHECKING:
    import tensorstore as ts

    from .._io.arrays import StoreContext
    from .source import ChainSource

__all__ = ["ArraySlices", "ChainRead", "Execute", "Request", "read", "read_box", "read_boxes"]


class ChainRead(NamedTuple):
    """Box ``box`` of tensor ``key``, through the chain of bases, into ``out`` (an array shaped like the box)."""

    key: str
    box: Box
    out: np.ndarray


Request = ChainRead | ArrayIO
#: Runs the plain reads of one :func:`read`: ``execute(jobs, context, where)`` fills every job's memory, reading
#: from storage (with ``read_into`` and the checkpoint's read ``context``) what it does not get otherwise, and
#: raises an :class:`arrayckpt.ArrayckptError` naming ``where`` on failure.
Execute = Callable[[Sequence[ArrayIO], "StoreContext", str], None]


def read(checkpoint: ChainSource, requests: Iterable[Request], *, execute: Execute = read_into) -> None:
    """Fill every request's memory from ``checkpoint`` (see the module docstring); after a failure some of it
    may be filled, some not.

    Raises :class:`arrayckpt.ReplacedCheckpointError` (a :class:`arrayckpt.CorruptCheckpointError`) when the
    checkpoint, or a base read through, was replaced or removed before the reads ended; otherwise what the reads
    raise (``CorruptCheckpointError`` for damage, ``StorageError`` for storage that cannot be reached).
    """
    jobs: list[ArrayIO] = []
    overlays: list[Overlay] = []
    for request in requests:  # planning reads nothing: errors here come before the first byte is read
        if isinstance(request, ChainRead):
            plan_box(checkpoint, request.key, request.box, request.out, jobs, overlays)
        else:
            jobs.append(request)
    try:
        execute(jobs, checkpoint.read_context, str(checkpoint.location))
        for overlay in overlays:
            overlay()
    except ArrayckptError as e:
        checkpoint.raise_if_replaced(e)
        raise
    checkpoint.check_unchanged()




class ArraySlices:
    """An ``execute`` for slices of one array (``LazyArray[...]``): each job read through TensorStore, one after the
    other, on the calling thread, through the array opened once and kept (failures named as ``read_into`` names
    them). ``read_into`` starts threads (its local fast path, its TensorStore transfers) and opens the array for
    every call, which costs more than a small read: ~1.5 ms instead of ~0.15 ms per slice of a small tensor."""

    def __init__(self, spec: JSON) -> None:
        self.spec = spec  # every job's spec (the array's)
        self._store: ts.TensorStore | None = None

    def __call__(self, jobs: Sequence[ArrayIO], context: StoreContext, where: str) -> None:
        if source_of(self.spec) is not None:  # a packed array: its chunk files are staged for each read
            read_into(jobs, context, where)
            return
        for job in jobs:
            assert job.spec is self.spec, "ArraySlices reads slices of its own array only"
            if self._store is None:
                self._store = open_array(self.spec, context, job.key, where)
            target = self._store if job.index is None else self._store[job.index]
            data = typed_data(job)  # values are assigned: a carrier-typed view would have them converted
            try:
                if data.nbytes <= settings().small_slice_bytes:  # TensorStore reads into its own memory faster
                    data[...] = target.read().result()
                else:  # straight into the destination: no second copy in memory
                    import tensorstore as ts  # on first use (CLI start-up)
                    ts.array(data, copy=False, write=True).write(target).result()
            except Exception as e:  # TensorStore raises ValueError/RuntimeError carrying a status code
                message = str(e).strip() or type(e).__name__
                raise read_failure(f"{where}: tensor {job.key!r}: read failed: {message}", e) from e


def read_box(checkpoint: ChainSource, key: str, box: Box, out: np.ndarray) -> None:
    """Fill ``out`` (shaped like ``box``) with that part of tensor ``key``, through the chain."""
    read(checkpoint, [ChainRead(key, box, out)])


def read_boxes(checkpoint: ChainSource, key: str, boxes: Sequence[Box]) -> list[np.ndarray]:
    """Several boxes of tensor ``key`` into new arrays, read at once through the chain."""
    entry = checkpoint.manifest.array_entry(key)
    if entry is None:
        raise KeyError(f"{checkpoint.location}: no tensor {key!r}")
    dtype = entry.dtype.numpy
    outs = [np.empty(box.shape, dtype) for box in boxes]
    read(checkpoint, [ChainRead(key, box, out) for box, out in zip(boxes, outs, strict=True)])
    return outs
