"""Moving tensor data between an accelerator and host memory, for saves and loads of GPU state.

Storage reads and writes host memory; a GPU state has to cross PCIe first. Done naively (``.cpu()`` per tensor,
``copy_`` from a fresh pageable tensor per key) each copy is synchronous, goes through a driver bounce buffer at
a fraction of the link's speed, and the whole state sits in host memory at once. Here instead:

- host buffers come from a :class:`HostPool` of pinned buffers (pinned where CUDA is there), kept between saves
  and loads, so a training job allocates (and registers with the driver) its staging memory once;
- copies are issued in batches, ``non_blocking``, on a side stream (:class:`CudaCopier`): a save writes batch
  ``k`` while batch ``k + 1`` copies, a load copies batch ``k`` to the device while batch ``k + 1`` is read, so
  host memory holds about two batches (:data:`TransferSettings.batch_bytes`), not the state;
- the copier is injectable (:func:`transfer_settings`): tests run the same batching and ordering on CPU tensors
  with a copier that performs its copies only when waited for, so a missing wait gives wrong bytes, not luck.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

__all__ = [
    "ALIGN", "Batch", "Copier", "HostPool", "SyncCopier", "Ticket", "TransferSettings", "aligned",
    "copier_for", "copy_grouped", "host_pool", "is_staged", "release_pinned", "settings", "transfer_settings",
]

Pairs = Sequence[tuple[torch.Tensor, torch.Tensor]]  # (destination, source)
T = TypeVar("T")


class Ticket(Protocol):
    """Copies in flight: :meth:`wait` returns once they are done (their destinations hold the data and their
    sources may change)."""

    def wait(self) -> None: ...


class Copier(Protocol):
    """Issues batched copies between one device and host buffers, returning at once with a :class:`Ticket`."""

    def copy(self, pairs: Pairs) -> Ticket: ...


class _Done:
    def wait(self) -> None:
        pass


class SyncCopier:
    """Copies at once (any device ``copy_`` supports); what devices other than CUDA get."""

    def copy(self, pairs: Pairs) -> Ticket:
        _foreach_copy(pairs, non_blocking=False)
        return _Done()


class _EventTicket:
    """Waits for an event; keeps the batch's tensors alive until then (a source that only the state walk held, e.g.
    a tensor ``state_dict()`` made, would otherwise be freed and its memory reused while the copy still reads it)."""

    def __init__(self, event: torch.cuda.Event, pairs: list) -> None:
        self._event: torch.cuda.Event | None = event
        self._pairs: list | None = pairs

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = self._pairs = None


class CudaCopier:
    """Copies on a side stream of one CUDA device, ``non_blocking`` between the device and pinned buffers.

    The side stream first waits for the work already queued on the current stream (the kernels that produce
    a tensor being saved, or still read a tensor being loaded into), so the copies see what the caller sees.
    A :class:`Ticket` waits on an event recorded after the batch: the host may then read (save) or reuse
    (load) the buffers, and the caller's later kernels, queued after the wait, see the loaded values.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)

    def copy(self, pairs: Pairs) -> Ticket:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._stream):
            try:
                _foreach_copy(pairs, non_blocking=True)
            except BaseException:  # some copies may be queued: let them end before the buffers can be reused
                self._stream.synchronize()
                raise
            event = torch.cuda.Event(blocking=True)  # waited for without spinning a core the training loop wants
            event.record(self._stream)
        return _EventTicket(event, list(pairs))


def _foreach_copy(pairs: Pairs, non_blocking: bool) -> None:
    """Copy ``pairs`` (destination, source) in one batched call, outside autograd (a load's destinations may be
    parameters that require grad)."""
    if pairs:
        destinations, sources = zip(*pairs, strict=True)
        with torch.no_grad():
            torch._foreach_copy_([d.detach() for d in destinations],
                                 [s.detach().resolve_conj().resolve_neg() for s in sources], non_blocking=non_blocking)


def _default_copier(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else SyncCopier()


def _is_accelerator(tensor: torch.Tensor) -> bool:
    return tensor.device.type not in ("cpu", "meta")


@dataclass(frozen=True)
class TransferSettings:
    """How device data is staged (process-wide; :func:`transfer_settings` changes it for a block).

    ``batch_bytes``: the bytes copied per batch (a save or load holds about two batches of host buffers; a
    tensor part larger than this is split at chunk rows where it can be). ``staged(tensor)``: which tensors go
    through host buffers (default: those off the CPU). ``copier(device)``: what copies for a device (default: a
    side-stream :class:`CudaCopier` for CUDA, :class:`SyncCopier` otherwise). ``pinned``: whether the pool pins
    its buffers (default: when CUDA is available). ``keep_bytes``: idle pool memory kept for the next save or load.
    """

    batch_bytes: int = 256 << 20
    staged: Callable[[torch.Tensor], bool] = _is_accelerator
    copier: Callable[[torch.device], Copier] = _default_copier
    pinned: bool | None = None
    keep_bytes: int = 1 << 30


_settings = TransferSettings()
ALIGN = 64  # bytes: where each tensor of a batch starts in the batch's buffer
_copiers: dict[tuple[Callable, torch.device], Copier] = {}
_lock = threading.Lock()


def settings() -> TransferSettings:
    return _settings


@contextlib.contextmanager
def transfer_settings(**changes: object) -> Iterator[TransferSettings]:
    """Use other :class:`TransferSettings` (e.g. a test's copier, a smaller batch) inside the block."""
    global _settings
    before = _settings
    _settings = dataclasses.replace(before, **changes)  # type: ignore[arg-type]
    try:
        yield _settings
    finally:
        _settings = before


def is_staged(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s data reaches storage through host buffers (it is not in host memory)."""
    return _settings.staged(tensor)


def copier_for(device: torch.device) -> Copier:
    """The copier of ``device`` under the current settings (one per device and factory: a CUDA copier keeps its
    stream)."""
    key = (_settings.copier, device)
    with _lock:
        found = _copiers.get(key)
        if found is None:
            found = _copiers[key] = _settings.copier(device)
        return found


def copy_grouped(pairs: Pairs) -> list[Ticket]:
    """Issue ``pairs`` (destination, source) grouped by the device on their non-CPU side, one batch per device's
    copier; returns the tickets to wait for."""
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for pair in pairs:
        device = pair[0].device if pair[0].device.type != "cpu" else pair[1].device
        by_device.setdefault(device, []).append(pair)
    tickets: list[Ticket] = []
    try:
        for device, group in by_device.items():
            tickets.append(copier_for(device).copy(group))
    except BaseException:  # the devices issued before the failure: done before anyone reuses their buffers
        for ticket in tickets:
            ticket.wait()
        raise
    return tickets


class Batch:
    """One batch of a transfer: buffers taken from the pool and the copies in flight into or out of them. A
    batch's buffers go back to the pool only once its copies are done (:meth:`settle`)."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.tickets: list[Ticket] = []

    def views(self, tensors: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[torch.Tensor]:
        """Host tensors of these (shape, dtype) in one pool buffer held by this batch (each 64-byte aligned)."""
        offsets, end = [], 0
        for shape, dtype in tensors:
            offsets.append(end)
            end += aligned(math.prod(shape) * dtype.itemsize)
        taken = _pool.take(end)
        self.buffers.append(taken)
        return [view(taken[offset:], shape, dtype) for offset, (shape, dtype) in
                zip(offsets, tensors, strict=True)]

    def copy(self, pairs: Pairs) -> None:
        """Issue the copies ``pairs`` (destination, source); returns at once."""
        self.tickets.extend(copy_grouped(pairs))

    def wait(self) -> None:
        for ticket in self.tickets:
            ticket.wait()

    def settle(self) -> None:
        """Wait for the copies, then give the buffers back (never while a copy may still use them). Idempotent."""
        try:
            self.wait()
        finally:
            buffers, self.buffers = self.buffers, []
            _pool.give(buffers)


class HostPool:
    """Host buffers by size class, handed out and given back, kept between saves and loads (up to
    ``keep_bytes`` idle) so that pinned memory is allocated and registered once per job, not per save.

    Size classes are 8 per power of two (at most 12.5% unused), from 64 KiB; pinned buffers are powers of two,
    which is what torch's pinned allocator reserves for them anyway (so the counts are the memory really pinned,
    and a 256 MiB batch pins 256 MiB: batches count their alignment padding, :func:`aligned`). Pinned buffers the
    pool does not keep are handed back to the driver (torch's pinned cache would keep them for good). Thread-safe.
    Counts what it did (``allocations``, ``peak_bytes`` handed out at once) for tests and benchmarks.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}
        self._idle = 0
        self._lock = threading.Lock()
        self.allocations = 0
        self.in_use = 0
        self.peak_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A 1-D uint8 buffer of at least ``nbytes`` (pinned per the settings)."""
        pinned = _settings.pinned if _settings.pinned is not None else torch.cuda.is_available()
        size = _size_class(nbytes, pinned)
        with self._lock:
            free = self._free.get(size)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._idle -= size
            self.in_use += size
            self.peak_bytes = max(self.peak_bytes, self.in_use)
        if buffer is None:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
            with self._lock:
                self.allocations += 1
        return buffer

    def give(self, buffers: Sequence[torch.Tensor]) -> None:
        """Hand ``buffers`` back (no copy may still be in flight to or from them)."""
        dropped = False
        with self._lock:
            for buffer in buffers:
                size = buffer.numel()
                self.in_use -= size
                if self._idle + size <= _settings.keep_bytes:
                    self._free.setdefault(size, []).append(buffer)
                    self._idle += size
                else:
                    dropped = dropped or buffer.is_pinned()
        if dropped:
            release_pinned()

    def clear(self) -> int:
        """Drop the idle buffers (their memory goes back to the allocator, pinned memory to the driver); returns
        their bytes."""
        with self._lock:
            pinned = any(b.is_pinned() for free in self._free.values() for b in free)
            self._free.clear()
            idle, self._idle = self._idle, 0
        if pinned:
            release_pinned()
        return idle

    def reset_counts(self) -> None:
        with self._lock:
            self.allocations, self.peak_bytes = 0, self.in_use


def view(buffer: torch.Tensor, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """The front of a pool buffer as a contiguous tensor of ``shape`` and ``dtype``."""
    nbytes = math.prod(shape) * dtype.itemsize
    return buffer[:nbytes].view(dtype).view(tuple(shape))


def _size_class(nbytes: int, pinned: bool = False) -> int:
    nbytes = max(nbytes, 64 << 10)
    if pinned:
        return 1 << (nbytes - 1).bit_length()
    step = 1 << max(nbytes.bit_length() - 4, 0)  # 8 classes per power of two
    return -(-nbytes // step) * step


def aligned(nbytes: int) -> int:
    """What ``nbytes`` of a tensor take in a batch's buffer (:meth:`Batch.views` starts each at 64 bytes)."""
    return -(-nbytes // ALIGN) * ALIGN


def release_pinned() -> None:
    """Give the pinned blocks torch's allocator caches but nobody uses back to the driver (torch keeps them until
    told: a whole-state load's staging would otherwise stay pinned for the rest of the job)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


_pool = HostPool()


def host_pool() -> HostPool:
    """The process's pool of host buffers for device transfers."""
    return _pool
