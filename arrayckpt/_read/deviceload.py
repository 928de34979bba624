"""A load into device (GPU) tensors: read into pooled host buffers a batch at a time, each batch copied to the
device while the next one is read (``_torch/transfer.py``), with no pageable temporary per key.

A plain load runs the pipeline: read batch 0 (with every host target), then for each batch ``k`` issue its
copies to the device and read batch ``k + 1`` meanwhile; host memory holds about two batches. A load that must
read everything before touching the state (``atomic=True``), or whose reads are one collective call
(``read_once=True``), reads every batch first and copies them after, still from pooled buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
import torch

from .._format.dtypes import DType
from .._io.pools import batches
from .._layout.box import Box, row_pieces
from .._torch.tensors import writable_numpy
from .._torch.transfer import ALIGN, Batch, aligned, settings
from .reader import Request

__all__ = ["DeviceLoads"]

ReadBatch = Callable[[list[Request]], None]


@dataclass(frozen=True)
class _Target:
    """A device tensor to fill with a box of an array, and how to read that box into a host array."""

    key: str
    tensor: torch.Tensor
    box: Box  # the part of the array ``tensor`` takes
    dt: DType
    request: Callable[[Box, np.ndarray], Request]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class DeviceLoads:
    """The device targets of a load, filled by :meth:`run` together with the load's host reads."""

    def __init__(self) -> None:
        self._targets: list[_Target] = []

    def add(self, key: str, tensor: torch.Tensor, box: Box, dt: DType,
            request: Callable[[Box, np.ndarray], Request]) -> None:
        """Fill ``tensor`` (on a device) with ``box`` of the array, which ``request(box, host array)`` reads, once
        :meth:`run` runs. A tensor bigger than a batch is split into row ranges of about a batch each."""
        tensor = tensor.detach()  # filled outside autograd (a parameter that requires grad, a DTensor's local view)
        row_bytes = tensor.element_size() * math.prod(box.shape[1:]) if box.shape else 0
        budget = settings().batch_bytes - ALIGN  # a piece with its alignment padding fits a batch
        for piece in row_pieces(box, row_bytes, budget):
            self._targets.append(_Target(key, tensor[piece.relative_to(box)], piece, dt, request))

    def run(self, requests: list[Request], read_batch: ReadBatch, *, whole: bool, touched: list[str]) -> None:
        """Read ``requests`` (the host reads) and every device target's box, and copy the latter to their devices.

        ``whole``: every read before the first copy (one call of ``read_batch``); else pipelined. The keys of the
        device tensors whose copies were issued are appended to ``touched`` as they are (a failed read later
        leaves those holding the checkpoint's bytes)."""
        groups = batches(self._targets, lambda target: aligned(target.nbytes), settings().batch_bytes)
        if not groups:
            read_batch(requests)
            return
        with ExitStack() as pending:  # on an error, copies in flight are waited for before buffers go back
            if whole:
                staged = [self._stage(group, pending) for group in groups]
                read_batch(requests + [r for _, _, reads in staged for r in reads])
                for group, (batch, pairs, _) in zip(groups, staged, strict=True):
                    touched.extend(target.key for target in group)
                    batch.copy(pairs)
                for batch, _, _ in staged:
                    batch.settle()
                return
            current = self._stage(groups[0], pending)
            read_batch(requests + current[2])
            for index, group in enumerate(groups):
                touched.extend(target.key for target in group)
                current[0].copy(current[1])
                following = self._stage(groups[index + 1], pending) if index + 1 < len(groups) else None
                if following is not None:
                    read_batch(following[2])  # while the copies of this batch run
                current[0].settle()
                current = following  # type: ignore[assignment]

    @staticmethod
    def _stage(group: Sequence[_Target], pending: ExitStack
               ) -> tuple[Batch, list[tuple[torch.Tensor, torch.Tensor]], list[Request]]:
        """Buffers for one batch: (the batch, its (device tensor, host buffer) copies, its reads)."""
        batch = Batch()
        pending.callback(batch.settle)
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        reads: list[Request] = []
        hosts = batch.views([(tuple(target.tensor.shape), target.tensor.dtype) for target in group])
        for target, host in zip(group, hosts, strict=True):
            pairs.append((target.tensor, host))
            reads.append(target.request(target.box, writable_numpy(host, target.dt, target.key)))
        return batch, pairs, reads
