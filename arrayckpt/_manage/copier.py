"""The remote tier's step copier: one background thread that copies the local tier's committed steps to the remote
tier (what the public API and its messages call uploads: ``wait_for_uploads``, ``upload_errors``).

Each committed local step is copied to the remote tier with :func:`arrayckpt.copy` (chunk files streamed as stored
and checked, a delta's bases first, the remote root document written last), oldest first, then the remote retention
runs. It starts by comparing the two tiers and queues every local step the remote lacks (a previous process killed
mid-copy left the remote step uncommitted: it is copied again). A failed copy is retried (after each object's own
retries) a few times, then recorded as an error that the manager raises once; the step is retried with the next
save. Until a step's copy has committed (or the remote tier would not keep it anyway), the local retention keeps
it.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._errors import ArrayckptError, CorruptCheckpointError, FormatError
from .._settings import settings
from .._tools.copy import copy_checkpoint
from .._tools.copy_files import Throttle
from .steptree import StepTree

if TYPE_CHECKING:
    from .._write.asynchronous import SaveHandle
    from .policy import Retention

__all__ = ["STEP_RETRY_DELAYS", "StepCopier"]

STEP_RETRY_DELAYS = (2.0, 10.0)  # seconds before each new attempt at a whole step's copy that failed


class StepCopier:
    """The background thread that copies committed local steps to the remote tier (see the module docstring)."""

    def __init__(self, local: StepTree, remote: StepTree, retention: Retention,
                 max_bytes_per_second: float | None, guard: Callable[[], None] | None = None) -> None:
        self.local, self.remote, self.retention = local, remote, retention
        self.guard = guard  # raises unless the manager holds the remote root (spec §9.4): checked before each copy
        self._throttle = Throttle(max_bytes_per_second)
        self._cond = threading.Condition()
        self._queue: dict[int, SaveHandle | None] = {}  # step -> its local save still running, or None
        self._current: int | None = None
        self._failed: dict[int, BaseException] = {}  # steps whose last copy failed, with the error
        self._unreported: list[int] = []  # failures not raised yet
        self._remote_ids: dict[int, str | None] | None = None  # committed remote steps' ids (None: not looked yet)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="arrayckpt-copier", daemon=True)
        self._thread.start()

    # --- what the manager calls (its own thread) ---------------------------------------------------------------

    def add(self, step: int, handle: SaveHandle | None = None) -> None:
        """Copy step ``step`` once its local save (``handle``, if still running) has committed; failed steps are
        tried again too."""
        with self._cond:
            self._queue[step] = handle
            for failed in self._failed:
                self._queue.setdefault(failed, None)
            self._cond.notify_all()

    def retry_failed(self) -> None:
        with self._cond:
            for failed in self._failed:
                self._queue.setdefault(failed, None)
            self._cond.notify_all()

    def pending(self) -> set[int] | None:
        """Steps whose copy has not committed yet: queued, in progress or failed (``None``: not known yet, before
        the first comparison of the tiers)."""
        with self._cond:
            if self._remote_ids is None:
                return None
            busy = set() if self._current is None else {self._current}
            return set(self._queue) | set(self._failed) | busy

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or in progress; whether that happened within ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and self._current is None and self._remote_ids
                                       is not None or not self._thread.is_alive(), timeout)

    def errors(self) -> list[tuple[int, BaseException]]:
        with self._cond:
            return sorted(self._failed.items(), key=lambda item: item[0])

    def take_unreported(self) -> list[tuple[int, BaseException]]:
        """The failures not reported yet (each is returned once), still unresolved."""
        with self._cond:
            out = [(step, self._failed[step]) for step in self._unreported if step in self._failed]
            self._unreported.clear()
            return out

    def close(self) -> None:
        """Stop the thread once the queue is empty (what is queued is copied first)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    # --- the thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._compare_tiers()
        except BaseException as e:  # noqa: BLE001 - never let the thread die: copy everything instead
            warnings.warn(f"{self.remote.location}: comparing the tiers failed ({e})", RuntimeWarning, stacklevel=2)
            with self._cond:
                if self._remote_ids is None:
                    self._remote_ids = {}
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if not self._queue:
                    return
                step = min(self._queue)
                handle = self._queue.pop(step)
                self._current = step
            error: BaseException | None = None
            try:
                error = self._copy(step, handle)
            except BaseException as e:  # noqa: BLE001 - never let the thread die: report it
                error = e
            with self._cond:
                self._current = None
                if error is None:
                    self._failed.pop(step, None)
                else:
                    self._failed[step] = error
                    self._unreported.append(step)
                self._cond.notify_all()

    def _compare_tiers(self) -> None:
        """Queue every committed local step whose copy the remote tier lacks (or holds another checkpoint of)."""
        ids: dict[int, str | None] = {}
        try:
            for step in self.remote.steps():
                ids[step] = self.remote.identity(step)
        except ArrayckptError as e:
            warnings.warn(f"{self.remote.location}: the remote tier cannot be listed ({e}); every local step will be "
                          "uploaded", RuntimeWarning, stacklevel=2)
        local: list[int] = []
        try:
            local = [s for s in self.local.steps() if self.local.identity(s) != ids.get(s, "")]
        except ArrayckptError as e:
            warnings.warn(f"{self.local.location}: the local tier cannot be listed ({e})", RuntimeWarning, stacklevel=2)
        with self._cond:
            for step in local:
                self._queue.setdefault(step, None)
            self._remote_ids = ids
            self._cond.notify_all()

    def _copy(self, step: int, handle: SaveHandle | None) -> BaseException | None:
        """Copy one step (after its local save, if that is still running); the error that stands, if any."""
        while handle is not None and not handle.done():
            time.sleep(settings().uploader_poll_s)
        source, target = self.local.step_location(step), self.remote.step_location(step)
        identity = self.local.identity(step)
        assert self._remote_ids is not None
        there = step in self._remote_ids and self._remote_ids[step] == identity
        if identity is None or there or not self._worth(step):
            return None  # deleted, or its save failed (the manager raises that); already there; or not to be kept
        try:
            if self.guard is not None:
                self.guard()  # another manager holds the remote root, or it cannot be reached: not now
        except ArrayckptError as e:
            return e
        last: BaseException | None = None
        for delay in (0.0, *STEP_RETRY_DELAYS):
            time.sleep(delay)
            try:
                copy_checkpoint(source, target, overwrite=True, throttle=self._throttle)
                break
            except (CorruptCheckpointError, FormatError) as e:  # the local copy is damaged: no retry mends it
                return e if source.is_committed() else None
            except (ArrayckptError, OSError, ValueError) as e:
                if not source.is_committed():
                    return None  # deleted locally meanwhile (keep_until_uploaded=False): nothing to copy
                last = e
        else:
            return last
        with self._cond:
            self._remote_ids[step] = identity
        try:
            deleted = self.remote.apply_retention(self.retention, set())
        except ArrayckptError as e:  # the copy stands; retention runs again after the next one
            warnings.warn(f"{self.remote.location}: retention failed ({e}); it runs again after the next upload",
                          RuntimeWarning, stacklevel=2)
            return None
        with self._cond:
            for gone in deleted:
                self._remote_ids.pop(gone, None)
        return None

    def _worth(self, step: int) -> bool:
        """Whether the remote retention would keep ``step`` beside the steps the remote tier holds: an older step that
        it would delete at once is not copied (nor kept locally for it)."""
        assert self._remote_ids is not None
        known = set(self._remote_ids)
        if not any(s > step for s in known) or (self.retention.keep_best and self.retention.metric):
            return True
        return step in self.retention.keep(sorted(known | {step}), {})
