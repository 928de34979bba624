"""A synchronous save of device (GPU) tensors: copied to pooled host buffers in batches, each batch written while
the next one copies (``_torch/transfer.py``), so host memory holds about two batches, not the state.

:func:`device_view` is the ``host`` callback of ``describe_local`` for such a save: CPU data is viewed in place
(as :func:`describe.host_view` does), a device tensor is left where it is, as a :class:`DeviceData` standing for
its host view until its batch is copied. Only the write of a full save takes those (``_write_tasks``); a save
that must read its data before writing (a delta's comparison with its base) views every tensor on the host.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .._format.dtypes import DType
from .._format.jsontypes import JSON
from .._io.arrays import ArrayIO, Checksums
from .._io.pools import batches
from .._layout.box import Box, row_pieces
from .._torch.dtypes import numpy_view
from .._torch.transfer import ALIGN, Batch, aligned, is_staged, settings
from .describe import host_view

if TYPE_CHECKING:
    from .._io.arrays import StoreContext

__all__ = ["DeviceData", "DevicePart", "device_parts", "device_view", "write_batched"]


@dataclass(frozen=True)
class DeviceData:
    """A device tensor standing for its host view in ``LocalState.data`` until its batch is copied."""

    tensor: torch.Tensor
    dt: DType

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def __getitem__(self, index: Any) -> Any:
        raise TypeError("internal error: device data read as host memory before it was copied")


def device_view(key: str, path: str, value: torch.Tensor | np.ndarray, dt: DType) -> np.ndarray | DeviceData:
    """The ``host`` callback of a synchronous full save: host memory viewed in place, device tensors deferred."""
    if isinstance(value, torch.Tensor) and is_staged(value) and value.layout == torch.strided \
            and type(value).__name__ != "DTensor":
        return DeviceData(value.detach(), dt)
    return host_view(key, path, value, dt)  # (which also refuses what cannot be saved, with its message)


@dataclass(frozen=True)
class DevicePart:
    """One write of device data: ``source`` (a view of the device tensor) goes to ``index`` of the array."""

    key: str
    spec: JSON
    node: str
    source: torch.Tensor
    dt: DType
    index: tuple[slice, ...]

    @property
    def nbytes(self) -> int:
        return self.source.numel() * self.source.element_size()


def device_parts(key: str, spec: JSON, node: str, data: DeviceData, held: Box, box: Box,
                 chunk_rows: int) -> list[DevicePart]:
    """The writes of ``box`` (of the part ``held`` that ``data`` holds), cut at multiples of ``chunk_rows`` (the
    outer chunk's rows) into pieces of about a batch each."""
    row_bytes = data.tensor.element_size() * math.prod(box.shape[1:]) if box.shape else 0
    budget = settings().batch_bytes - ALIGN  # a piece with its alignment padding fits a batch
    return [DevicePart(key, spec, node, data.tensor[piece.relative_to(held)], data.dt, piece.slices())
            for piece in row_pieces(box, row_bytes, budget, chunk_rows)]


def _stage(parts: Sequence[DevicePart]) -> tuple[Batch, list[ArrayIO]]:
    """Issue the copies of one batch into buffers from the pool (returns at once), with the jobs writing them."""
    batch, jobs, pairs = Batch(), [], []
    try:
        hosts = batch.views([(part.source.shape, part.source.dtype) for part in parts])
        for part, host in zip(parts, hosts, strict=True):
            pairs.append((host, part.source))
            jobs.append(ArrayIO(part.key, part.spec, numpy_view(host, part.dt), part.index, part.node))
        batch.copy(pairs)
    except BaseException:
        batch.settle()
        raise
    return batch, jobs


def write_batched(jobs: list[ArrayIO], parts: list[DevicePart], context: StoreContext, where: str,
                  write: Callable[[Sequence[ArrayIO], StoreContext, str], Checksums]) -> Checksums:
    """Write ``jobs`` (host data) and ``parts`` (device data), the device data a batch at a time: batch ``k + 1``
    copies while batch ``k`` is written (the host jobs are written while the first batch copies); each by ``write``
    (a :class:`~.packed.ChunkDestination`'s: files, or the rank's pack)."""
    out: Checksums = {}
    groups = batches(parts, lambda part: aligned(part.nbytes), settings().batch_bytes)
    with ExitStack() as pending:  # on an error, every batch in flight is waited for before its buffers go back
        staged = [_stage(groups[0])] if groups else []
        if staged:
            pending.callback(staged[0][0].settle)
        if jobs:
            _merge(out, write(jobs, context, where))
        for index in range(len(groups)):
            if index + 1 < len(groups):
                staged.append(_stage(groups[index + 1]))
                pending.callback(staged[-1][0].settle)
            batch, written = staged.pop(0)
            batch.wait()
            _merge(out, write(written, context, where))
            batch.settle()
    return out


def _merge(out: Checksums, more: Checksums) -> None:
    for path, found in more.items():
        out.setdefault(path, {}).update(found)
