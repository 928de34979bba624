"""Host copies of a save's arrays, allocated once and reused by the next save: what a background save (``async_save``,
a peer-memory save) stages into, so that the caller may change its tensors as soon as the copy is made.

One buffer per (array path, shape, dtype); device tensors get pinned buffers where CUDA is there and are copied by their
device's copier (``_torch/transfer.py``: non-blocking, on a side stream), issued in batches of ``device_issue_bytes``
(``_settings.py``) while the state is still being described, so that the copies overlap the walk of the rest of the
state; host tensors in one batched ``torch._foreach_copy_``. :meth:`HostCopies.finish` returns once every copy is done,
so the caller blocks for about the longer of the walk and the copies, not their sum.

Kept buffers cost host memory between saves (one copy of what the rank saves): :meth:`HostCopies.release` gives
them back, pinned ones to the driver (torch's pinned allocator would otherwise cache them for the next pinned
allocation, which is the same as holding them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from .._format.dtypes import DType
from .._settings import settings
from .._torch.dtypes import numpy_view
from .._torch.transfer import SyncCopier, Ticket, copy_grouped, is_staged, release_pinned

__all__ = ["HostCopies", "nbytes", "pinned"]

Slot = tuple[str, tuple[int, ...], "np.dtype | torch.dtype"]  # (array path, shape, dtype)


def nbytes(buffers: Iterable[np.ndarray | torch.Tensor]) -> int:
    """The bytes of ``buffers``."""
    return sum(int(buffer.nbytes) for buffer in buffers)


def pinned(buffers: Iterable[np.ndarray | torch.Tensor]) -> bool:
    """Whether one of ``buffers`` is pinned (its memory goes back to the driver only if told)."""
    return any(isinstance(buffer, torch.Tensor) and buffer.is_pinned() for buffer in buffers)


class HostCopies:
    """Reusable host buffers (the ``host`` callback of ``describe_local``): :meth:`host` hands out a buffer per array,
    :meth:`finish` copies every tensor into its buffer and forgets the buffers this save did not use."""

    def __init__(self) -> None:
        self._buffers: dict[Slot, Any] = {}
        self._used: set[Slot] = set()
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, source) of host tensors: in finish()
        self._device: list[tuple[torch.Tensor, torch.Tensor]] = []  # (buffer, source) of device tensors not issued
        self._device_bytes = 0
        self._tickets: list[Ticket] = []  # device copies issued

    def host(self, key: str, path: str, value: torch.Tensor | np.ndarray, dt: DType) -> np.ndarray:
        """The buffer for ``value``; numpy arrays are copied now, device tensors in batches as they come, host
        tensors by :meth:`finish`, in one batched call."""
        if isinstance(value, np.ndarray):
            slot: Slot = (path, value.shape, value.dtype)
            array = self._buffers.get(slot)
            if array is None:
                array = self._buffers[slot] = np.empty(value.shape, value.dtype)
            np.copyto(array, value)
            self._used.add(slot)
            return array
        source = value.detach()
        slot = (path, tuple(source.shape), source.dtype)
        tensor = self._buffers.get(slot)
        if tensor is None:
            pinned = source.is_cuda and torch.cuda.is_available()
            tensor = self._buffers[slot] = torch.empty(source.shape, dtype=source.dtype, pin_memory=pinned)
        self._used.add(slot)
        if not is_staged(source):
            self._copies.append((tensor, source))
            return numpy_view(tensor, dt)
        self._device.append((tensor, source))
        self._device_bytes += tensor.numel() * tensor.element_size()
        if self._device_bytes >= settings().device_issue_bytes:
            self._issue()
        return numpy_view(tensor, dt)

    def _issue(self) -> None:
        """Start the device copies that wait (they run while the state is still being described)."""
        pairs, self._device, self._device_bytes = self._device, [], 0  # (never issued twice, even after a failure)
        self._tickets.extend(copy_grouped(pairs))

    def finish(self) -> None:
        """Copy every tensor into its buffer and wait for the device copies; forget the buffers this save did not
        use (the state's layout changed). Call it after describing, also when describing failed: copies may be in
        flight into the buffers."""
        try:
            self._issue()
            SyncCopier().copy(self._copies)
        finally:
            tickets, self._tickets = self._tickets, []
            for ticket in tickets:
                ticket.wait()
            self._copies.clear()
        for slot in set(self._buffers) - self._used:
            del self._buffers[slot]
        self._used.clear()

    def held_bytes(self) -> int:
        """The bytes of the buffers kept for the next save."""
        return nbytes(self._buffers.values())

    def release(self) -> int:
        """Drop every buffer (the next save allocates its own); returns their bytes. Pinned memory goes back to the
        driver once nothing else holds it (a copy's numpy view, a save in flight): call it between saves."""
        held = self.held_bytes()
        was_pinned = pinned(self._buffers.values())
        self._buffers = {}
        self._used.clear()
        if was_pinned:
            release_pinned()
        return held
