"""The checkpoint manager's storage tiers: the step checkpoints under one root, and the uploader that copies the
local tier's committed steps to the remote one.

:class:`StepTree` is one root holding ``step-<step:08d>`` checkpoints (a local directory or an object-storage
prefix): listing, retention that deletes in a crash-consistent order and never a base a kept delta reads through,
and clean-up of what interrupted saves and deletions left. A two-tier manager has two of them.

:class:`Uploader` is one background thread. Each committed local step is copied to the remote tier with
:func:`arrayckpt.copy` (chunk files streamed as stored and checked, a delta's bases first, the remote root document
written last), oldest first, then the remote retention runs. It starts by comparing the two tiers and queues every
local step the remote lacks (a previous process killed mid-upload left the remote step uncommitted: it is copied
again). A failed copy is retried (after each object's own retries) a few times, then recorded as an error that the
manager raises once; the step is retried with the next save. Until a step's upload has committed (or the remote
tier would not keep it anyway), the local retention keeps it.
"""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import (
    ArrayckptError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatError,
    IncompleteCheckpointError,
)
from ._format.manifest import MANIFEST_ATTRIBUTE
from ._read.checkpoint import Checkpoint, open_checkpoint
from ._read.load import load
from ._storage import Location
from ._storage.gc import incomplete_leftovers
from ._tools.copy import copy_checkpoint
from ._tools.pump import Throttle
from ._torch.dist import Group

if TYPE_CHECKING:
    from ._policies import Retention

__all__ = ["STEP_RETRY_DELAYS", "Remote", "StepCopy", "StepTree", "Uploader", "restore_newest"]

STEP_DIR = re.compile(r"step-(\d{8,})")
STEP_RETRY_DELAYS = (2.0, 10.0)  # seconds before each new attempt at a whole step's upload that failed
_POLL_S = 0.02  # how often the uploader looks whether the local asynchronous save it waits for has finished


@dataclass(frozen=True)
class Remote:
    """The second tier of a :class:`CheckpointManager`: where its committed checkpoints are copied in the background.

    ``url`` is a root like the manager's own (``s3://bucket/run``, ``gs://``, a directory), with its
    ``storage_options``; ``retention`` says which steps it keeps (default: ``Retention()``; a delta's bases are kept
    as long as it is); ``max_bytes_per_second`` paces the uploads so that they leave bandwidth to training.
    A local step is deleted only once its upload has committed, unless ``keep_until_uploaded`` is false (then the
    local retention deletes as if there were no remote tier, and a step it deletes before its upload is never
    uploaded).

    >>> import arrayckpt
    >>> arrayckpt.Remote("s3://bucket/run", retention=arrayckpt.Retention(keep_last=5, keep_every=10_000),
    ...                  max_bytes_per_second=200e6).max_bytes_per_second
    200000000.0
    """

    url: str | os.PathLike[str]
    storage_options: Mapping[str, Any] | None = None
    retention: Retention | None = None
    max_bytes_per_second: float | None = None
    keep_until_uploaded: bool = True

    def __post_init__(self) -> None:
        rate = self.max_bytes_per_second
        if rate is not None and not (isinstance(rate, (int, float)) and rate > 0):
            raise ValueError(f"Remote: max_bytes_per_second must be a positive number of bytes per second (or None), "
                             f"got {rate!r}")


class StepTree:
    """The step checkpoints right below one root (see the module docstring)."""

    def __init__(self, location: Location) -> None:
        self.location = location

    def step_location(self, step: int) -> Location:
        return self.location.child(f"step-{step:08d}")

    def listed_steps(self) -> list[int]:
        """Steps with something at their path, committed or not."""
        return sorted(int(m.group(1)) for m in map(STEP_DIR.fullmatch, self.location.children()) if m)

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending."""
        return [s for s in self.listed_steps() if self.step_location(s).is_committed()]

    def open(self, step: int) -> Checkpoint:
        """Step ``step``'s checkpoint, opened (use it in a ``with`` block)."""
        return open_checkpoint(self.step_location(step))

    def identity(self, step: int) -> str | None:
        """The id of step ``step``'s committed checkpoint (``None``: none is committed there, or it has no id)."""
        try:
            manifest = self.step_location(step).read_root().get("attributes", {}).get(MANIFEST_ATTRIBUTE)
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            return None
        return manifest.get("id") if isinstance(manifest, dict) else None

    def base_step(self, step: int) -> int | None:
        """The step of this tree that step ``step`` is a delta against (``None``: a full checkpoint, or a base
        elsewhere). Raises what opening the checkpoint raises."""
        with self.open(step) as checkpoint:
            ref = checkpoint.manifest.base
        if ref is None:
            return None
        base = str(self.step_location(step).resolve(ref.path))
        match = STEP_DIR.fullmatch(base.rstrip("/").rpartition("/")[2])
        if match is None or str(self.step_location(int(match.group(1)))) != base:
            return None
        return int(match.group(1))

    def apply_retention(self, retention: Retention, protect: set[int] | None = None) -> list[int]:
        """Delete the committed steps ``retention`` does not keep (nor ``protect``; ``None``: protect them all), and
        that no kept delta reads through, in an order where every state a crash can leave is consistent: a delta
        before the base it reads through (newest first), each root document first. Returns the steps deleted."""
        if protect is None:
            return []
        steps = self.steps()
        metrics: dict[int, dict[str, float]] = {}
        if retention.keep_best and retention.metric:
            for step in steps:
                with self.open(step) as checkpoint:
                    metrics[step] = dict(checkpoint.metrics)
        kept = retention.keep(steps, metrics) | (protect & set(steps))
        bases: dict[int, int | None] = {}
        for step in steps:
            try:
                bases[step] = self.base_step(step)
            except ArrayckptError:
                if step in kept:
                    raise  # what it reads through is unknown: deleting anything could break it
                bases[step] = None
        todo = sorted(kept)
        while todo:  # the bases kept checkpoints read through, transitively
            base = bases.get(todo.pop())
            if base is not None and base not in kept:
                kept.add(base)
                todo.append(base)
        doomed = deletion_order(set(steps) - kept, bases)
        for step in doomed:
            self.step_location(step).delete()
        return doomed

    def clean_up(self, min_age_s: float, skip: Collection[int] = ()) -> tuple[list[str], list[tuple[str, str]]]:
        """Remove what interrupted saves and deletions left (see ``CheckpointManager.clean_up``), except at the steps
        ``skip``; returns what was removed and what looked like a leftover but stays, with why."""
        removed = self.remove_orphaned_deltas()
        kept: list[tuple[str, str]] = []
        committed = self.steps()
        if committed:
            for step in self.listed_steps():
                if step < committed[-1] and step not in committed and step not in skip:
                    location = self.step_location(step)
                    try:
                        location.read_root()
                        continue  # readable after all (a transient failure hid it): never delete
                    except IncompleteCheckpointError:  # positively no root document: an interrupted save
                        pass
                    except ArrayckptError:  # unreadable or foreign: leave it for a person to look at
                        continue
                    found, why = incomplete_leftovers(location, min_age_s)
                    removed.extend(leftover.url for leftover in found if leftover.remove())
                    kept.extend(why)
        skipped = {str(self.step_location(step)) for step in skip}
        found, why = self.location.leftovers(min_age_s)
        removed.extend(leftover.url for leftover in found if leftover.url not in skipped and leftover.remove())
        kept.extend(k for k in why if k not in kept)
        return removed, kept

    def remove_orphaned_deltas(self) -> list[str]:
        """Delete committed delta checkpoints whose base, a step of this tree, is positively gone (no checkpoint, or an
        incomplete one, at its path): a deletion of that base was cut short before its deltas were removed. A base
        that cannot be read for another reason (a storage error) keeps its deltas."""
        removed: list[str] = []
        gone: set[int] = set()
        changed = True
        while changed:
            changed = False
            for step in self.steps():
                try:
                    base = self.base_step(step)
                except ArrayckptError:
                    continue
                if base is None:
                    continue
                if base not in gone:
                    try:
                        self.step_location(base).read_root()
                        continue
                    except (CheckpointNotFoundError, IncompleteCheckpointError):
                        pass
                    except ArrayckptError:
                        continue
                location = self.step_location(step)
                location.delete()
                removed.append(str(location))
                gone.add(step)
                changed = True
        return removed


def deletion_order(doomed: set[int], bases: Mapping[int, int | None]) -> list[int]:
    """``doomed`` ordered so that a delta comes before every base it reads through, newest first otherwise."""
    order: list[int] = []
    remaining = set(doomed)
    while remaining:
        read_through = {bases.get(s) for s in remaining}
        ready = [s for s in remaining if s not in read_through] or list(remaining)  # (a loop of bases: any order)
        order.append(max(ready))
        remaining.discard(order[-1])
    return order


class Uploader:
    """The background thread that copies committed local steps to the remote tier (see the module docstring)."""

    def __init__(self, local: StepTree, remote: StepTree, retention: Retention,
                 max_bytes_per_second: float | None, guard: Callable[[], None] | None = None) -> None:
        self.local, self.remote, self.retention = local, remote, retention
        self.guard = guard  # raises unless the manager holds the remote root (spec §9.4): checked before each upload
        self._throttle = Throttle(max_bytes_per_second)
        self._cond = threading.Condition()
        self._queue: dict[int, Any] = {}  # step -> the SaveHandle of its local save still running, or None
        self._current: int | None = None
        self._failed: dict[int, BaseException] = {}  # steps whose last upload failed, with the error
        self._unreported: list[int] = []  # failures not raised yet
        self._remote_ids: dict[int, str | None] | None = None  # committed remote steps' ids (None: not looked yet)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="arrayckpt-uploader", daemon=True)
        self._thread.start()

    # --- what the manager calls (its own thread) ---------------------------------------------------------------

    def add(self, step: int, handle: Any = None) -> None:
        """Upload step ``step`` once its local save (``handle``, if still running) has committed; failed steps are
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
        """Steps whose upload has not committed yet: queued, in progress or failed (``None``: not known yet, before
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
        """Stop the thread once the queue is empty (what is queued is uploaded first)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    # --- the thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._compare_tiers()
        except BaseException as e:  # noqa: BLE001 - never let the thread die: upload everything instead
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
                error = self._upload(step, handle)
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

    def _upload(self, step: int, handle: Any) -> BaseException | None:
        """Copy one step (after its local save, if that is still running); the error that stands, if any."""
        while handle is not None and not handle.done():
            time.sleep(_POLL_S)
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
                    return None  # deleted locally meanwhile (keep_until_uploaded=False): nothing to upload
                last = e
        else:
            return last
        with self._cond:
            self._remote_ids[step] = identity
        try:
            deleted = self.remote.apply_retention(self.retention, set())
        except ArrayckptError as e:  # the upload stands; retention runs again after the next one
            warnings.warn(f"{self.remote.location}: retention failed ({e}); it runs again after the next upload",
                          RuntimeWarning, stacklevel=2)
            return None
        with self._cond:
            for gone in deleted:
                self._remote_ids.pop(gone, None)
        return None

    def _worth(self, step: int) -> bool:
        """Whether the remote retention would keep ``step`` beside the steps the remote tier holds: an older step that
        it would delete at once is not uploaded (nor kept locally for it)."""
        assert self._remote_ids is not None
        known = set(self._remote_ids)
        if not any(s > step for s in known) or (self.retention.keep_best and self.retention.metric):
            return True
        return step in self.retention.keep(sorted(known | {step}), {})


# --- resuming: the newest step that reads whole ------------------------------------------------------------------

_DAMAGE = (CorruptCheckpointError, FormatError, CheckpointNotFoundError, IncompleteCheckpointError)  # worth a fallback


@dataclass(frozen=True)
class StepCopy:
    """One copy of a step that :func:`restore_newest` may load: where it is, with its storage options."""

    path: Any  # a Path, or an object-storage URL
    storage_options: Mapping[str, Any] | None
    tier: str  # "local" or "remote"


def restore_newest(state: Mapping[str, Any], candidates: list[tuple[int, list[StepCopy]]], group: Group,
                   load_options: Mapping[str, Any]) -> int:
    """Load the first of ``candidates`` (newest first: a step and its copies, local first) that reads whole into
    ``state``; returns its step. Each copy is loaded with ``load_options`` (``atomic=True`` unless the caller chose
    otherwise: a damaged copy then leaves ``state`` as it was). A damaged copy (a failed checksum, a missing chunk,
    an incomplete or unreadable checkpoint) is named in a warning and the next copy, then the next older step, is
    tried; any other error (the state does not fit the checkpoint, storage unreachable) is raised at once. With
    several ranks every rank loads its part and they agree (one ``all_gather`` per step tried) before a step counts
    as restored, so that all of them restore the same step; the remote copy a rank falls back to is opened by that
    rank alone (``share_root=False``). When no candidate reads whole the newest one's error is raised."""
    newest: BaseException | None = None
    for n, (step, copies) in enumerate(candidates):
        error = _load_copies(state, step, copies, group, load_options)
        text = None if error is None else f"{type(error).__name__}: {error}"
        reports = group.all_gather((text, error is not None and not isinstance(error, _DAMAGE)))
        failed = [(rank, what) for rank, (what, _) in enumerate(reports) if what is not None]
        if not failed:
            return step
        if error is None:  # another rank could not restore this step: neither can the group
            error = CorruptCheckpointError(f"step {step}: rank {failed[0][0]} could not restore it ({failed[0][1]})")
        if any(fatal for _, fatal in reports):
            raise error
        newest = newest or error
        if n + 1 == len(candidates):
            raise newest
        if group.is_coordinator or text is not None:
            where = " or ".join(str(c.path) for c in copies)
            warnings.warn(f"{where}: step {step} cannot be restored ({failed[0][1]}"
                          f"{f', on rank {failed[0][0]}' if group.size > 1 else ''}); restoring step "
                          f"{candidates[n + 1][0]}, the newest before it, instead", RuntimeWarning, stacklevel=3)
    raise CheckpointNotFoundError("nothing to restore")  # (no candidates: the caller returns None before)


def _load_copies(state: Mapping[str, Any], step: int, copies: list[StepCopy], group: Group,
                 options: Mapping[str, Any]) -> BaseException | None:
    """Load step ``step`` from its first copy that reads whole; the last copy's error if none does (or the first
    error that is not damage)."""
    for i, copy in enumerate(copies):
        more = {"share_root": False} if i and group.size > 1 else {}
        try:
            load(state, copy.path, process_group=group, storage_options=copy.storage_options, **{**options, **more})
            return None
        except _DAMAGE as e:
            if i + 1 == len(copies):
                return e
            warnings.warn(f"{copy.path}: cannot be restored ({e}); restoring step {step} from the {copies[i + 1].tier} "
                          "tier instead", RuntimeWarning, stacklevel=4)
        except ArrayckptError as e:
            return e
    return None
