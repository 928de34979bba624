"""CheckpointManager: step-named checkpoints under one root, an interval policy, retention, resume.

Checkpoints live at ``<root>/step-<step:08d>``, locally or on object storage (``s3://bucket/run``). Only
committed checkpoints count: an interrupted save leaves a temporary directory (locally) or an incomplete
prefix (object storage) that is never listed and is removed by :meth:`CheckpointManager.clean_up`.
Retention runs on the coordinator after each save has committed, never removes the newest checkpoint, and
never removes a base that a kept delta checkpoint reads through.

With a :class:`Remote`, the manager has two tiers: every save commits to the (fast, local) root first, then a
background uploader copies it to the remote root (``uploader.py``); ``restore`` takes the newest step from whichever
tier holds it whole.

One manager per root: its coordinator holds each root (spec §9.4: a ``flock`` locally, a lease on object storage)
from construction to :meth:`CheckpointManager.close`; a second manager on a root that is held is warned at
construction, and its saves, clean-ups and uploads are refused (``CheckpointBusyError``) until it can take it.
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._errors import ArrayckptError, CheckpointBusyError, CheckpointNotFoundError, StateError, StorageError
from .._format.codecs import CodecChoice
from .._layout.plancache import PlanCache
from .._peer.config import PeerMemory
from .._peer.tier import MemoryTier
from .._read.checkpoint import Checkpoint
from .._settings import settings
from .._storage import Location, parse_location
from .._storage.liveness import HeldRoot
from .._torch.dist import resolve_group
from .._write.asynchronous import SaveHandle, async_save_with
from .._write.options import SaveOptions, SaveSetup
from .._write.save import save_with
from .policy import Incremental, Interval, Retention
from .restore import StepCandidate, StepCopy, restore_newest
from .signals import SigtermSave, StateAndStep
from .tiers import Remote, StepTree
from .uploader import Uploader

__all__ = ["CheckpointManager"]

# Failures of the remote root's first request that no retry mends (TensorStore's status codes, S3's error codes)
_DEFINITIVE = ("NOT_FOUND", "NoSuchBucket", "PERMISSION_DENIED", "AccessDenied", "UNAUTHENTICATED", "INVALID_ARGUMENT")


def _release(holds: list[HeldRoot]) -> None:
    for hold in holds:
        hold.release()


class CheckpointManager:
    """Save every so often, keep what the retention policy says, resume from the newest committed step.

    With ``remote`` (a URL, or a :class:`Remote`), every save commits to ``root`` (fast local storage) first, then a
    background thread copies it to the remote root; training waits for that only in :meth:`wait_for_uploads` and
    :meth:`close`. :meth:`restore` takes the newest step from either tier (the local copy when it reads back whole),
    :meth:`tiers` says which tiers hold each step, and each tier has its own retention. The coordinator holds each root
until :meth:`close` (spec §9.4): a second manager on a held root is warned, and its saves refused. With ``memory`` (a
:class:`PeerMemory`) steps are also kept in node-local memory, replicated to other nodes, and restored from there first
(``docs/PEER_MEMORY.md``). ``durable=False`` saves without the flush to disk before each commit (see
:func:`arrayckpt.save`): for a local tier that a remote one makes durable.

    >>> import arrayckpt, torch, tempfile
    >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp(), interval=arrayckpt.Interval(every_steps=2))
    >>> w = torch.zeros(2)
    >>> [manager.save(step, {"w": w}) for step in range(1, 5)]
    [False, True, False, True]
    >>> manager.latest_step(), manager.restore({"w": w})
    (4, 4)
    >>> two = arrayckpt.CheckpointManager(tempfile.mkdtemp(), remote=tempfile.mkdtemp())  # e.g. "s3://bucket/run"
    >>> two.save(1, {"w": w}); two.wait_for_uploads(); two.tiers()
    True
    {1: ('local', 'remote')}
    >>> two.close()
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        interval: Interval | None = None,
        retention: Retention | None = None,
        asynchronous: bool = False,
        codec: CodecChoice = None,
        process_group: Any = None,
        incremental: Incremental | None = None,
        storage_options: Mapping[str, Any] | None = None,
        remote: str | os.PathLike[str] | Remote | None = None,
        memory: PeerMemory | None = None,
        durable: bool = True,
    ) -> None:
        self._location = parse_location(root, storage_options)
        self._local = StepTree(self._location)
        self.storage_options = storage_options
        #: The root: a local directory (``Path``) or an object-storage URL (``str``).
        self.root: Path | str = self._location.native
        self.incremental = incremental
        self.interval = interval or Interval(every_steps=1)
        self.retention = retention or Retention()
        self.asynchronous = asynchronous
        self.process_group = process_group
        self._held = HeldRoot(self._location)  # the coordinator's hold on the root (spec §9.4)
        self._remote_held: HeldRoot | None = None
        # The options every save starts from (each save sets its step, metrics and base on a copy), and what the
        # manager adds to each: the check that it still holds its root, its own plan cache.
        self._save_options = SaveOptions(codec=codec, overwrite=True, process_group=process_group,
                                         storage_options=storage_options, durable=durable)
        self._save_setup = SaveSetup(guard=self._held.check, plan_cache=PlanCache())
        self._pending: SaveHandle | None = None  # the asynchronous save in flight
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._blocking_seconds: float | None = None
        self._sigterm = SigtermSave(self._save_before_exit)  # save_on_sigterm's handling
        #: What the last :meth:`clean_up` left in place although it looked like a leftover: ``(path, why)``.
        self.kept: list[tuple[str, str]] = []
        self._location.make_directory()
        #: The peer-memory tier on this rank (``_peer/``; None without ``memory=``).
        self.memory = MemoryTier(memory, str(self._location)) if memory is not None else None
        #: The remote tier (``None``: a one-tier manager).
        self.remote: Remote | None = Remote(remote) if isinstance(remote, (str, os.PathLike)) else remote
        self._remote: StepTree | None = None
        self._uploader: Uploader | None = None
        if self.remote is not None:
            location = parse_location(self.remote.url, self.remote.storage_options)
            if str(location) == str(self._location):
                raise ValueError(f"{location}: the remote tier must be another root than the local one")
            self._remote = StepTree(location)
            self._remote_held = HeldRoot(location)
            if self._is_coordinator():
                location.make_directory()
        if self._is_coordinator():
            self._take_roots()
            if self._remote is not None and self._remote_held is not None and self.remote is not None:
                self._uploader = Uploader(self._local, self._remote, self.remote.retention or Retention(),
                                          self.remote.max_bytes_per_second, self._remote_held.check)

    def _take_roots(self) -> None:
        """Hold the root and the remote root (coordinator), warning loudly when another manager holds one; the hold
        on the remote root is the check that it exists and is writable (#24): a missing bucket or refused
        credentials fail here, an unreachable store is warned about (uploads try again)."""
        busy = self._held.take()
        holds = [self._held]
        if self._remote_held is not None:
            holds.append(self._remote_held)
            try:
                busy_remote = self._remote_held.take()
            except StorageError as e:
                if any(code in str(e) for code in _DEFINITIVE):
                    self._held.release()
                    raise StorageError(f"{self._remote_held.location}: the remote tier cannot be used: {e}") from e
                warnings.warn(f"{self._remote_held.location}: the remote tier cannot be reached now ({e}); saves go on "
                              "locally and uploads are tried again", RuntimeWarning, stacklevel=3)
            else:
                if busy_remote is not None:
                    warnings.warn(f"{busy_remote}. This manager's uploads are refused while that manager holds the "
                                  "remote root", RuntimeWarning, stacklevel=3)
        weakref.finalize(self, _release, holds)  # a manager dropped without close() lets its roots go
        if busy is not None:
            warnings.warn(f"{busy}. This manager can list and restore, but its saves and clean-ups are refused "
                          "(CheckpointBusyError) while that one holds the root: close it (a crashed process's lock "
                          f"is gone with it; a lease on object storage expires {settings().lease_ttl_s:g} s after its "
                          "holder stopped), or use another root", RuntimeWarning, stacklevel=3)

    # --- where checkpoints are --------------------------------------------------------------------

    def path(self, step: int) -> Path | str:
        """Where step ``step``'s checkpoint is (a path, or a URL on object storage); in the local tier."""
        return self._step_location(step).native

    def remote_path(self, step: int) -> str | Path:
        """Where step ``step``'s checkpoint is in the remote tier."""
        if self._remote is None:
            raise StateError("this manager has no remote tier (CheckpointManager(..., remote=...))")
        return self._remote.step_location(step).native

    def _step_location(self, step: int) -> Location:
        return self._local.step_location(step)

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending, in either tier (incomplete ones are ignored)."""
        return sorted(self.tiers())

    def tiers(self) -> dict[int, tuple[str, ...]]:
        """Which tiers hold a committed checkpoint of each step: ``{step: ("local", "remote")}``, ascending."""
        local = set(self._local.steps())
        remote = set(self._remote.steps()) if self._remote is not None else set()
        return {step: tuple(name for name, there in (("local", step in local), ("remote", step in remote)) if there)
                for step in sorted(local | remote)}

    def clean_up(self, min_age_s: float = 3600.0) -> list[str]:
        """Remove what interrupted saves and deletions left, and only that; returns what was removed.

        - An incomplete step checkpoint (no root document) older than the newest committed one, when it holds
          only what arrayckpt writes (its ``zarr.json`` documents, one of an array it wrote, and chunk files; or
          only empty directories) and nothing in it was touched for ``min_age_s``: the rule of
          :func:`arrayckpt.gc` for object storage. A directory holding anything else is kept.
        - A committed delta checkpoint whose base, a step of this manager, is gone (a deletion cut short): it
          can never be read again.
        - The other leftovers of interrupted saves untouched for ``min_age_s`` (see :func:`arrayckpt.gc`).

        In the remote tier too (uploads cut short), except at the steps the local tier holds (the uploader may be
        copying them). What looked like a leftover but stays is in :attr:`kept` as ``(path, why)``; a step directory
        kept because it is not arrayckpt's is also named in a warning. What a running save holds is never removed (spec
        §9.4). Coordinator only; raises ``CheckpointBusyError`` while another manager holds the root."""
        self.kept = []
        memory = self.memory.clean_up(min_age_s) if self.memory is not None else []
        if not self._is_coordinator():
            return memory
        self._held.check()
        removed, self.kept = self._local.clean_up(min_age_s)
        removed += memory
        if self._remote is not None and self._remote_held is not None:
            try:
                self._remote_held.check()
                more, kept = self._remote.clean_up(min_age_s, skip=set(self._local.listed_steps()))
            except ArrayckptError as e:
                warnings.warn(f"{self._remote.location}: the remote tier could not be cleaned up: {e}", RuntimeWarning,
                              stacklevel=2)
            else:
                removed += more
                self.kept += kept
        foreign = [f"{path} ({why})" for path, why in self.kept
                   if "maybe still being saved" not in why and "a save is running" not in why]
        if foreign:
            warnings.warn(f"{self.root}: clean_up left {len(foreign)} thing(s) that are not known to be arrayckpt's "
                          f"leftovers; look at them and remove them yourself if they are not needed: "
                          + "; ".join(foreign), RuntimeWarning, stacklevel=2)
        return removed

    def _open(self, step: int) -> Checkpoint:
        """Step ``step``'s local checkpoint, opened: use it in a ``with`` block, which closes it."""
        return self._local.open(step)

    def latest_step(self) -> int | None:
        """The newest step committed in either tier."""
        steps = self.steps()
        return steps[-1] if steps else None

    # --- saving -----------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether the interval policy asks for a checkpoint at ``step``."""
        elapsed = time.monotonic() - (self._last_time or 0.0)
        return self.interval.due(step, self._last_step, elapsed, self._blocking_seconds)

    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False,
             metrics: Mapping[str, float] | None = None, changed_rows: Mapping[str, Any] | None = None) -> bool:
        """Save ``state`` as step ``step`` if the interval policy (or ``force``) says so; returns whether
        a save was started. Asynchronous managers return once the data is staged. With ``incremental``,
        ``changed_rows`` (key -> row indices changed since the previous save) spares reading the base back
        for those keys. With a remote tier, the save is queued for upload, and an upload that failed since the
        last call is raised here (``StorageError``; once per failure, after this save was made)."""
        with self._sigterm.deferred():
            saved = self._save(step, state, force, metrics, changed_rows)
            if saved:
                self._raise_upload_errors(new_only=True)
            return saved

    def _save(self, step: int, state: Mapping[str, Any], force: bool, metrics: Mapping[str, float] | None,
              changed_rows: Mapping[str, Any] | None) -> bool:
        in_memory = self.memory is not None and self.memory.due(step)
        if not (force or self.should_save(step)):
            return in_memory and self._save_memory(step, state, metrics)
        if self._last_step is not None and step <= self._last_step:
            raise StateError(f"step {step} is not after the last saved step {self._last_step}")
        self.wait()
        started = time.perf_counter()
        options = replace(self._save_options, step=step, metrics=metrics, **self._delta_options(changed_rows))
        if self.asynchronous:
            keep = self.incremental is not None and self.incremental.keep_copy
            self._pending = async_save_with(state, self.path(step), options, keep_copy=keep,
                                            setup=self._save_setup)
            self._blocking_seconds = self._pending.blocking_seconds
            if self._uploader is not None:
                self._uploader.add(step, self._pending)
        else:
            save_with(state, self.path(step), options, self._save_setup)
            self._blocking_seconds = time.perf_counter() - started
            if self._uploader is not None:
                self._uploader.add(step)
            self._apply_retention()
        self._last_step, self._last_time = step, time.monotonic()
        return not in_memory or self._save_memory(step, state, metrics)

    def _save_memory(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, float] | None) -> bool:
        assert self.memory is not None
        self.memory.save(state, step, metrics, self._save_options, self._save_setup,
                         resolve_group(self.process_group))
        return True

    def _delta_options(self, changed_rows: Mapping[str, Any] | None) -> dict[str, Any]:
        """The next save's incremental options (``SaveOptions`` fields): a delta against the newest local checkpoint,
        or none (a full save)."""
        if self.incremental is None:
            if changed_rows:
                raise StateError("changed_rows needs an incremental manager (incremental=arrayckpt.Incremental())")
            return {}
        steps = self._local.steps()
        if not steps:
            return {}
        with self._open(steps[-1]) as base:  # closed here: the save opens its base again, and closes it when over
            if self.incremental.wants_full(base):
                return {}
        return {"base": self.path(steps[-1]), "changed_rows": changed_rows, "quantize": self.incremental.quantize}

    def wait(self) -> None:
        """Wait for an asynchronous save and a memory save in flight (raising their errors), then apply retention."""
        with self._sigterm.deferred():
            if self.memory is not None:
                self.memory.wait()
            if self._pending is not None:
                pending, self._pending = self._pending, None
                pending.wait()
                self._apply_retention()

    def wait_for_uploads(self, timeout: float | None = None) -> None:
        """Wait for the local save in flight and until every local step is uploaded (steps whose upload failed are
        tried once more), then apply the local retention. Raises ``StorageError`` when an upload failed (the steps
        stay local: a later save or call tries them again) and ``TimeoutError`` after ``timeout`` seconds."""
        self.wait()
        if self._uploader is None:
            return
        self._uploader.retry_failed()
        if not self._uploader.wait(timeout):
            raise TimeoutError(f"{self._remote_root()}: uploads still running after {timeout} s")
        self._apply_retention()
        self._uploader.take_unreported()
        self._raise_upload_errors(new_only=False)

    def upload_errors(self) -> list[tuple[int, BaseException]]:
        """``(step, error)`` for every step whose last upload failed and that has not been uploaded since."""
        return self._uploader.errors() if self._uploader is not None else []

    def _raise_upload_errors(self, new_only: bool) -> None:
        if self._uploader is None:
            return
        failed = self._uploader.take_unreported() if new_only else self._uploader.errors()
        if failed:
            steps = ", ".join(str(step) for step, _ in failed)
            raise StorageError(f"{self._remote_root()}: uploading step(s) {steps} to the remote tier failed (they stay "
                               f"in {self.root}, and are tried again with the next save): {failed[-1][1]}") \
                from failed[-1][1]

    def _remote_root(self) -> str:
        return str(self._remote.location) if self._remote is not None else str(self.root)

    def _apply_retention(self) -> None:
        """Delete the local steps the retention does not keep, nor any kept delta reads through, nor (with a remote
        tier, unless ``keep_until_uploaded`` is false) any whose upload has not committed; see
        :meth:`StepTree.apply_retention`."""
        if not self._is_coordinator():
            return
        try:
            self._held.check()
        except (CheckpointBusyError, StorageError) as e:  # e.g. a lease lost since the save: delete nothing now
            warnings.warn(f"retention skipped: {e}", RuntimeWarning, stacklevel=3)
            return
        protect: set[int] | None = set()
        if self._uploader is not None and self.remote is not None and self.remote.keep_until_uploaded:
            protect = self._uploader.pending()
        self._local.apply_retention(self.retention, protect)

    def _is_coordinator(self) -> bool:
        return resolve_group(self.process_group).is_coordinator

    # --- resuming ---------------------------------------------------------------------------------

    def restore(self, state: Mapping[str, Any], step: int | None = None, **load_options: Any) -> int | None:
        """Load the newest committed step (or ``step``) that reads back whole into ``state``; returns its step, or
        ``None`` when there is nothing to resume from (a fresh start). Each step is read from its local copy, else
        (damaged or absent) from its remote copy; a step damaged in every copy is named in a warning and the newest
        older step is tried (with ``step=``, only that step). Every attempt loads with ``atomic=True`` unless
        ``load_options`` say otherwise: the reads go to fresh host buffers and the state is written only once all of
        them passed, so a damaged step never leaves part of itself in ``state``. The cost: host memory for one copy
        of what this rank restores, and one more memory copy; IO is one read of the step restored (plus the reads a
        damaged step got through). ``atomic=False`` spares the memory, but a failed attempt may leave some tensors
        overwritten (only a later successful attempt that loads every key rewrites them all). With several ranks
        all of them restore the same step (see :func:`arrayckpt._manage.restore.restore_newest`)."""
        tiers = self._restore_tiers()
        if self.memory is not None:  # the newest step the surviving nodes hold whole, if not older (or ``step``)
            group = resolve_group(self.process_group)
            found = self.memory.restore(state, group, load_options, max(tiers, default=None) if step is None else None,
                                        only=step)
            if found is not None:
                self._last_step, self._last_time = found, time.monotonic()
                return found
        if step is not None and step not in tiers:
            raise CheckpointNotFoundError(f"{self.path(step)}: no committed checkpoint for step {step}")
        order = [step] if step is not None else sorted(tiers, reverse=True)
        if not order:
            return None
        candidates = [StepCandidate(s, [self._copy(s, tier) for tier in tiers[s]]) for s in order]  # local first
        step = restore_newest(state, candidates, resolve_group(self.process_group), {"atomic": True, **load_options})
        self._last_step, self._last_time = step, time.monotonic()
        return step

    def _copy(self, step: int, tier: str) -> StepCopy:
        if tier == "local":
            return StepCopy(self.path(step), self.storage_options, tier)
        return StepCopy(self.remote_path(step), self.remote.storage_options if self.remote else None, tier)

    def _restore_tiers(self) -> dict[int, tuple[str, ...]]:
        """:meth:`tiers`, or only the local one with a warning when the remote tier cannot be listed."""
        try:
            return self.tiers()
        except StorageError as e:
            if self._remote is None:
                raise
            warnings.warn(f"{self._remote.location}: the remote tier cannot be listed ({e}); restoring from the "
                          "local tier", RuntimeWarning, stacklevel=3)
            return {step: ("local",) for step in self._local.steps()}

    # --- peer memory -----------------------------------------------------------------------------

    def flush_memory(self, step: int | None = None) -> int | None:
        """Make a memory step durable: copy its chunk files, as they are, from the nodes holding them to
        ``path(step)`` in the local tier (then, with a remote tier, it is uploaded like any save); collective, on
        every rank. ``step=None`` takes the newest memory step the nodes hold whole (after a node loss too: the
        replicas stand in). Returns the step flushed (``None``: no memory step to flush); a step the local tier
        already holds as this very checkpoint is not copied again. Waits for the saves in flight first. Raises
        ``StateError`` when the step is not whole among the nodes, ``CorruptCheckpointError`` naming a damaged
        chunk file, ``CheckpointBusyError`` while another manager holds the root (``_peer/flush.py``)."""
        if self.memory is None:
            raise StateError("this manager has no memory tier: pass memory=arrayckpt.PeerMemory(...)")
        with self._sigterm.deferred():
            self.wait()
            group = resolve_group(self.process_group)
            flushed = self.memory.flush(step, group, self._step_location, self._held.check)
            if flushed is None:
                return None
            if flushed.copied and self._uploader is not None:
                self._uploader.add(flushed.step)
            self._apply_retention()
            return flushed.step

    # --- preemption -------------------------------------------------------------------------------

    def save_on_sigterm(self, state_and_step: StateAndStep) -> None:
        """On SIGTERM (preemption), finish any save in flight, save ``state_and_step()`` synchronously,
        then exit with the signal's default status. Opt-in; call once, from the main thread.

        The handler runs once: a second SIGTERM while it runs (a launcher forwarding the scheduler's) is
        ignored. A signal that arrives while the main thread is inside :meth:`save` or :meth:`wait` is handled
        when that call returns (never a save inside a save). If the saving fails, the error propagates and a
        later SIGTERM is handled again (``signals.py``)."""
        self._sigterm.install(state_and_step)

    def _save_before_exit(self, state_and_step: StateAndStep) -> None:
        """The SIGTERM handler's work before the process exits: finish the save in flight, save the newest state."""
        self.wait()
        step, state = state_and_step()
        if self._last_step is None or step > self._last_step:
            asynchronous, self.asynchronous = self.asynchronous, False
            try:
                self._save(step, state, True, None, None)  # (an upload failure is not raised here)
            finally:
                self.asynchronous = asynchronous

    def close(self) -> None:
        """Wait for the save in flight and (with a remote tier) for the uploads, raising what failed; then stop the
        uploader and let the roots go (another manager may take them)."""
        try:
            self.wait()
            self.wait_for_uploads()
        finally:
            if self._uploader is not None:
                self._uploader.close()
            self._held.release()
            if self._remote_held is not None:
                self._remote_held.release()
            if self.memory is not None:
                self.memory.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

