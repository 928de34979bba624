"""Asynchronous saves: training blocks only while tensors are copied to host staging buffers.

``async_save`` walks the state and copies every tensor into a host buffer (pinned memory for CUDA
tensors, one non-blocking copy each and one synchronisation), then returns a :class:`SaveHandle`; a
background thread does the rest of an ordinary save — collectives, writes, commit — from the staged
copies, so the training loop may change its tensors right away. Buffers are allocated once per
(array, shape, dtype) and reused by the next save (``keep_buffers``): a host copy of the rank's state held between
saves, which :func:`release_host_buffers` gives back. The background collectives run on a process group
of their own, so they never interleave with the training's collectives. So that the training loop does not feel
the save, Python's cyclic garbage collector is paused until it ends (its full collections hold the GIL for 100 ms
and more) and the IO worker threads it starts run at a lower CPU priority (``_io/priority.py``); measured in
``benchmarks/async_save.py``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from .._errors import CheckpointBusyError
from .._format.codecs import CodecChoice
from .._format.dtypes import DType
from .._format.keys import array_path
from .._io.arrays import collector_paused
from .._io.priority import background_priority
from .._layout.box import Box
from .._settings import settings
from .._torch.dist import Group, resolve_group
from .._torch.transfer import host_pool, release_pinned
from .changes import Reference
from .describe import LocalState, describe_local
from .hostcopies import HostCopies, nbytes, pinned
from .options import NO_SETUP, SaveOptions, SaveSetup
from .save import SaveRequest, _attempt, begin_save, check_record, finish_save

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .._read.checkpoint import Checkpoint

__all__ = ["SaveHandle", "async_save", "async_save_with", "release_host_buffers"]


class SaveHandle:
    """A save running in the background: :meth:`wait` for it (re-raising its error) or poll :meth:`done`. Made by
    :func:`async_save`.

    Attributes:
        path: where the checkpoint is being saved.
        blocking_seconds: how long ``async_save`` blocked the caller (staging copies); what a checkpoint costs
            training.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> handle = arrayckpt.async_save({"w": torch.ones(4)}, os.path.join(tempfile.mkdtemp(), "ckpt"))
        >>> handle.wait()
        >>> handle.done(), handle.blocking_seconds < 10
        (True, True)
    """

    def __init__(self, future: Future[None], path: str, blocking_seconds: float) -> None:
        self._future = future
        self._observed = False  # whether the caller has seen the outcome (so it is not raised twice)
        self.path = path
        #: How long ``async_save`` blocked the caller (staging copies); what a checkpoint costs training.
        self.blocking_seconds = blocking_seconds

    def done(self) -> bool:
        """Whether the save is over, committed or failed (:meth:`wait` says which)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save has committed; raise what made it fail (nothing was committed then).

        Args:
            timeout: at most this many seconds (``None``: no limit).

        Raises:
            TimeoutError: the save is still running after ``timeout`` seconds (wait again later).
            ArrayckptError: what made the save fail, as :func:`arrayckpt.save` raises it.

        Examples:
            >>> import arrayckpt, torch, tempfile, os
            >>> handle = arrayckpt.async_save({"w": torch.ones(4)}, os.path.join(tempfile.mkdtemp(), "ckpt"))
            >>> handle.wait(timeout=60)
        """
        try:
            self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException:
            self._observed = True
            raise
        self._observed = True

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle({self.path!r}, {state}, blocked {self.blocking_seconds * 1e3:.1f} ms)"


class _Stager(HostCopies):
    """Host copies of the arrays of a save, allocated once per (array path, shape, dtype) and reused.

    With ``keep_copy`` the copies of a committed save are kept as they are (the next save stages into a
    second set of buffers), so that the next incremental save against that checkpoint compares with them in
    memory instead of reading the checkpoint back: exact, at the cost of a second host copy of the state.
    """

    def __init__(self) -> None:
        super().__init__()
        self._views: dict[str, np.ndarray] = {}  # by array path: this staging's host copies
        self._kept: dict[tuple[str, tuple[int, ...], Any], Any] = {}  # buffers of the kept copy
        self._kept_views: dict[str, tuple[Box, np.ndarray]] = {}  # by array path: (box held, its bytes)
        self.kept_id: str | None = None  # the checkpoint whose bytes the kept copy holds

    def keep(self, checkpoint_id: str, boxes: dict[str, Box]) -> None:
        """The save just staged committed as ``checkpoint_id``: keep its copies, stage the next elsewhere."""
        self._kept_views = {path: (boxes[path], view) for path, view in self._views.items() if path in boxes}
        self._kept, self._buffers = self._buffers, self._kept
        self.kept_id = checkpoint_id

    def begin(self) -> None:
        """A new staging starts (the previous save is over, its copy kept or not)."""
        self._views = {}

    def forget(self) -> int:
        """Drop the kept copy (its memory too, pinned memory back to the driver); returns its bytes."""
        held, was_pinned = nbytes(self._kept.values()), pinned(self._kept.values())
        self._kept, self._kept_views, self.kept_id = {}, {}, None
        if was_pinned:
            release_pinned()
        return held

    def release(self) -> int:
        """Drop the staging buffers (:meth:`HostCopies.release`; the kept copy stays); returns their bytes."""
        self._views = {}
        return super().release()

    def held_bytes(self) -> int:
        """The bytes held between saves: the staging buffers and the kept copy."""
        return super().held_bytes() + nbytes(self._kept.values())

    def reference(self, base_id: str | None) -> Callable[[str, Box], np.ndarray | None] | None:
        """The kept bytes of checkpoint ``base_id`` by (array path, box), if that is the one kept."""
        if base_id is None or base_id != self.kept_id:
            return None
        views = self._kept_views

        def lookup(path: str, box: Box) -> np.ndarray | None:
            kept = views.get(path)
            return kept[1] if kept is not None and kept[0] == box else None

        return lookup

    def host(self, key: str, path: str, value: torch.Tensor | np.ndarray, dt: DType) -> np.ndarray:
        """The staging buffer of ``value`` (:meth:`HostCopies.host`), remembered as this staging's copy of ``path``."""
        self._views[path] = super().host(key, path, value, dt)
        return self._views[path]


class _Handoff:
    """What the background save takes from the staging: the staged state and the kept copy it compares with.

    It takes them, rather than receiving them as arguments (which the executor holds until the call has returned),
    so that once the save is over nothing but the stager holds the buffers, and ``keep_buffers=False`` frees them.
    """

    def __init__(self, local: LocalState | None, reference: Reference | None) -> None:
        self._parts: tuple[LocalState | None, Reference | None] | None = (local, reference)

    def take(self) -> tuple[LocalState | None, Reference | None]:
        """The staged state and the kept copy's lookup (once: a second call gets nothing)."""
        parts, self._parts = self._parts, None
        return parts if parts is not None else (None, None)


_EXECUTOR = ThreadPoolExecutor(1, thread_name_prefix="arrayckpt-save")
_LOCK = threading.Lock()
_IN_FLIGHT: list[SaveHandle] = []
_STAGER = _Stager()
_BACKGROUND_GROUPS: dict[ProcessGroup | None, Group] = {}


def async_save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    codec: CodecChoice = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    process_group: ProcessGroup | Group | None = None,
    step: int | None = None,
    metrics: Mapping[str, float] | None = None,
    if_busy: Literal["wait", "error"] = "wait",
    storage_options: Mapping[str, Any] | None = None,
    base: str | os.PathLike[str] | Checkpoint | None = None,
    changed_rows: Mapping[str, torch.Tensor | np.ndarray | Sequence[int]] | None = None,
    quantize: Mapping[str, int] | None = None,
    keep_copy: bool = False,
    keep_buffers: bool = True,
    durable: bool = True,
    packed: bool | None = None,
) -> SaveHandle:
    """Start saving ``state`` like :func:`arrayckpt.save`; returns once the data is staged on the host.

    The state may be modified as soon as this returns. A failure is raised by the handle's ``wait()``
    (nothing is committed then). An incremental save (``base=...``) compares the staged copy with the base in the
    background, so it blocks training no longer than a full one. While the save runs, Python's cyclic garbage
    collector is paused (as during :func:`arrayckpt.save`, for at most 30 s; cycles the training makes meanwhile
    are collected after it) and, on Linux, its IO worker threads run at niceness +10 (``ARRAYCKPT_BACKGROUND_NICE``
    sets another, 0 for none), so that where cores are short the training keeps them and the save takes what is
    left.

    Args:
        state: as for :func:`arrayckpt.save`.
        path: as for :func:`arrayckpt.save`.
        codec: as for :func:`arrayckpt.save`.
        overwrite: as for :func:`arrayckpt.save`.
        allow_pickle: as for :func:`arrayckpt.save`.
        process_group: as for :func:`arrayckpt.save`.
        step: as for :func:`arrayckpt.save`.
        metrics: as for :func:`arrayckpt.save`.
        if_busy: what to do while an earlier async save is still running: ``"wait"`` for it (its error, if any, is
            raised here) or ``"error"`` (refuse).
        storage_options: as for :func:`arrayckpt.save`.
        base: as for :func:`arrayckpt.save`.
        changed_rows: as for :func:`arrayckpt.save`.
        quantize: as for :func:`arrayckpt.save`.
        keep_copy: keep this save's host copy once it has committed (a second host copy of the state), so that the
            next incremental save against it compares in memory instead of reading the checkpoint back.
        keep_buffers: keep the staging buffers once the save is over, for the next async save to stage into
            (``True``: it skips allocating, and pinning, a host copy of the state; the memory stays held between
            saves until :func:`release_host_buffers`). ``False``: they are freed when the save is over; the kept
            copy of ``keep_copy=True`` is not (it is a copy of the committed bytes, not a buffer for reuse).
        durable: ``False``: no fsync before the commit (see :func:`arrayckpt.save`).
        packed: one pack file per rank, or one file per chunk (see :func:`arrayckpt.save`).

    Returns:
        The handle of the save running in the background.

    Raises:
        CheckpointBusyError: ``if_busy="error"`` and an earlier async save is still running.
        ArrayckptError: what :func:`arrayckpt.save` raises before writing (a state that cannot be saved, a
            checkpoint already at ``path``...); what fails later is raised by ``handle.wait()``.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> w = torch.ones(4)
        >>> handle = arrayckpt.async_save({"w": w}, os.path.join(tempfile.mkdtemp(), "ckpt"))
        >>> w.zero_()  # training goes on; the checkpoint keeps the ones
        tensor([0., 0., 0., 0.])
        >>> handle.wait()
    """
    options = SaveOptions(codec=codec, overwrite=overwrite, allow_pickle=allow_pickle, process_group=process_group,
                          step=step, metrics=metrics, storage_options=storage_options, base=base,
                          changed_rows=changed_rows, quantize=quantize, durable=durable, packed=packed)
    return async_save_with(state, path, options, if_busy=if_busy, keep_copy=keep_copy, keep_buffers=keep_buffers)


def async_save_with(state: Mapping[str, Any], path: str | os.PathLike[str], options: SaveOptions, *,
                    if_busy: Literal["wait", "error"] = "wait", keep_copy: bool = False, keep_buffers: bool = True,
                    setup: SaveSetup = NO_SETUP) -> SaveHandle:
    """:func:`async_save` with the options of the save as one value, and what an internal caller adds (``setup``:
    the chunk policy, a guard, a plan cache)."""
    check_record(options.step, options.metrics)  # a bad step fails before waiting for the previous save
    _wait_for_previous(if_busy)
    started = time.perf_counter()
    group = _background_group(resolve_group(options.process_group))
    request = begin_save(path, options, setup)
    try:
        with collector_paused():  # the caller waits for the staging, as for a save (and see _save_in_background)
            future = _stage_and_start(state, options, group, request, keep_copy, keep_buffers)
    except BaseException:
        request.close()  # the background save never started: release the base it opened
        if not keep_buffers:
            _STAGER.release()
        raise
    handle = SaveHandle(future, str(request.location), time.perf_counter() - started)
    with _LOCK:
        _IN_FLIGHT[:] = [handle]
    return handle


def _stage_and_start(state: Mapping[str, Any], options: SaveOptions, group: Group, request: SaveRequest,
                     keep_copy: bool, keep_buffers: bool) -> Future[None]:
    """Copy the state to host staging buffers, then start the rest of the save in the background (which closes
    ``request`` when it finishes)."""
    delta = request.delta
    reference = _STAGER.reference(delta.base.manifest.id if delta is not None else None)
    if not keep_copy and reference is None:
        _STAGER.forget()
    _STAGER.begin()
    local, error = _attempt(lambda: describe_local(state, group.rank, options.allow_pickle, _STAGER.host))
    _STAGER.finish()
    if error is not None and group.size == 1:
        raise error  # nobody else to tell: fail now rather than on wait()
    boxes = {path: box for path, (box, _) in local.data.items()} if local is not None else {}
    if delta is not None and local is not None:  # quantized rows are stored lossy: the staged bytes are not theirs
        for piece in local.description.arrays:
            if delta.bits(piece.key):
                boxes.pop(array_path(piece.key), None)
    return _EXECUTOR.submit(_save_in_background, _Handoff(local, reference), error, group, request,
                            boxes if keep_copy else None, keep_buffers)


def _save_in_background(handoff: _Handoff, error: BaseException | None, group: Group, request: SaveRequest,
                        keep: dict[str, Box] | None, keep_buffers: bool) -> None:
    """The rest of the save; then the staged copy is kept (or the kept one dropped, as it is stale), and the staging
    buffers freed unless ``keep_buffers``. The base the save opened is closed when it is over, committed or failed.
    The training loop runs meanwhile: the collector is paused (its full collections would hold the GIL for 100 ms;
    at most ``background_pause_s``, so that a long upload does not hold back the loop's garbage) and the IO worker
    threads run niced (they would take the loop's cores), see ``benchmarks/README.md`` (``async_save.py``)."""
    local, reference = handoff.take()
    try:
        with collector_paused(limit_s=settings().background_pause_s), background_priority():
            committed = finish_save(local, error, group, request, reference)
    except BaseException:
        local = reference = None
        _STAGER.forget()
        if not keep_buffers:
            _STAGER.release()
        raise
    finally:
        request.close()
    local = reference = None  # (views of the buffers: with these gone, release() gives their memory back)
    if keep is not None:
        _STAGER.keep(committed, keep)
    else:
        _STAGER.forget()
    if not keep_buffers:
        _STAGER.release()


def release_host_buffers(*, if_busy: Literal["wait", "error"] = "wait") -> int:
    """Give back the host memory that saves keep between saves: :func:`async_save`'s staging buffers (a copy of
    what the rank saves), the copy ``keep_copy=True`` kept, and the idle buffers of the pool that GPU saves and loads
    copy through (1 GiB at most). Pinned memory goes back to the driver.

    The next async save allocates (and pins) its buffers again, which costs it some staging time; an incremental
    save against a checkpoint whose kept copy was released reads the checkpoint back instead. Call it where host
    memory is needed between saves (an evaluation, a data-loading phase), from the thread that starts the async
    saves. A peer-memory tier's copies are its manager's (``close()`` releases them).

    Args:
        if_busy: what to do while an async save is still running (its background writes read these buffers):
            ``"wait"`` for it to end, then release (its error, if any, is not raised here: its handle's ``wait()``
            or the next :func:`async_save` raises it), or ``"error"`` (refuse; nothing is released).

    Returns:
        The bytes released (0 when nothing was held).

    Raises:
        CheckpointBusyError: ``if_busy="error"`` and an async save is still running.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> arrayckpt.async_save({"w": torch.ones(1024)}, os.path.join(tempfile.mkdtemp(), "ckpt")).wait()
        >>> arrayckpt.release_host_buffers() >= 4096  # at least the 4 KiB staging copy of w
        True
        >>> arrayckpt.release_host_buffers()
        0
    """
    with _LOCK:
        previous = _IN_FLIGHT[0] if _IN_FLIGHT else None
    if previous is not None and not previous.done():
        if if_busy == "error":
            raise CheckpointBusyError(f"an async save to {previous.path} is still running and stages from the host "
                                      "buffers: wait() for it first, or release_host_buffers(if_busy='wait')")
        previous._future.exception()  # waits (the error stays for the handle's wait() or the next async_save)
    return _STAGER.forget() + _STAGER.release() + host_pool().clear()


def _wait_for_previous(if_busy: str) -> None:
    """The staging buffers are about to be reused: the previous save must be over, and its failure seen."""
    with _LOCK:
        previous = _IN_FLIGHT[0] if _IN_FLIGHT else None
    if previous is None:
        return
    if if_busy == "error" and not previous.done():
        raise CheckpointBusyError(f"an async save to {previous.path} is still running; wait() for it first")
    error = previous._future.exception()  # waits
    with _LOCK:
        _IN_FLIGHT.clear()
    if error is not None and not previous._observed:
        previous._observed = True
        raise error


def _background_group(group: Group) -> Group:
    """A separate gloo group over the same ranks for the background collectives (created once, collectively)."""
    if group.size == 1 or type(group) is not Group:
        return group
    import torch.distributed as dist

    if group.pg not in _BACKGROUND_GROUPS:
        pg = dist.new_group(ranks=dist.get_process_group_ranks(group.pg), backend="gloo")
        _BACKGROUND_GROUPS[group.pg] = Group(group.rank, group.size, pg, pg)
    return _BACKGROUND_GROUPS[group.pg]
