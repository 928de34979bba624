"""CheckpointManager: step-named checkpoints under one root, an interval policy, retention, resume.

Checkpoints live at ``<root>/step-<step:08d>``, locally or on object storage (``s3://bucket/run``). Only
committed checkpoints count: an interrupted save leaves a temporary directory (locally) or an incomplete
prefix (object storage) that is never listed and is removed by :meth:`CheckpointManager.clean_up`.
Retention runs on the coordinator after each save has committed, never removes the newest checkpoint, and
never removes a base that a kept delta checkpoint reads through.

The manager's tiers are one list, fastest first (``tiers.py``): the peer-memory tier (with a :class:`PeerMemory`), the
local tier (the root), the remote tier (with a :class:`Remote`). Every save commits to the (fast, local) root first,
then the remote tier's step copier copies it to the remote root in the background (``copier.py``); ``restore`` takes
the newest step from memory when the nodes hold it whole, else from whichever durable tier holds it whole.

One manager per root: its coordinator holds each root (spec §9.4: a ``flock`` locally, a lease on object storage)
from construction to :meth:`CheckpointManager.close`; a second manager on a root that is held is warned at
construction, and its saves, clean-ups and uploads are refused (``CheckpointBusyError``) until it can take it.
"""

from __future__ import annotations

import os
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._errors import CheckpointNotFoundError, StateError, StorageError
from .._format.codecs import CodecChoice
from .._layout.plancache import PlanCache
from .._peer.config import PeerMemory
from .._peer.tier import MemoryTier
from .._read.checkpoint import Checkpoint
from .._settings import settings
from .._storage import parse_location
from .._storage.liveness import HeldRoot
from .._torch.dist import Group, resolve_group
from .._write.asynchronous import SaveHandle, async_save_with
from .._write.options import SaveOptions, SaveSetup
from .._write.save import save_with
from .policy import Incremental, Interval, Retention
from .restore import StepCandidate, StepSource, restore_newest
from .signals import SigtermSave, StateAndStep
from .tiers import LocalTier, Remote, RemoteTier, Tier

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["CheckpointManager"]


def _release(holds: list[HeldRoot]) -> None:
    for hold in holds:
        hold.release()


def _close(tiers: list[Tier]) -> None:
    """Close every tier, slowest first, each even when one before it failed (the first failure is raised)."""
    failure: BaseException | None = None
    for tier in reversed(tiers):
        try:
            tier.close()
        except BaseException as e:  # noqa: BLE001 - the others are closed first
            failure = failure or e
    if failure is not None:
        raise failure


class CheckpointManager:
    """Save every so often, keep what the retention policy says, resume from the newest committed step.

    With ``remote`` (a URL, or a :class:`Remote`), every save commits to ``root`` (fast local storage) first, then a
    background thread copies it to the remote root; training waits for that only in :meth:`wait_for_uploads` and
    :meth:`close`. :meth:`restore` takes the newest step from either tier (the local copy when it reads back whole),
    :meth:`tiers` says which tiers hold each step (``"memory"`` too), and each tier has its own retention. The
    coordinator holds each root until :meth:`close` (spec §9.4): a second manager on a held root is warned, and its
    saves refused.

    Args:
        root: the directory (or object-storage prefix) where each step's checkpoint goes (``step-00000100``).
        interval: when :meth:`save` actually saves (default: at every call).
        retention: which committed steps to keep (default: ``Retention()``, the newest 3).
        asynchronous: save in the background (:func:`arrayckpt.async_save`): :meth:`save` returns once the data is
            staged.
        codec: as for :func:`arrayckpt.save`.
        process_group: the ranks that save together (default: the default group, if initialised).
        incremental: save deltas between full checkpoints (:class:`Incremental`).
        storage_options: for an object-storage ``root``, as for :func:`arrayckpt.save`.
        remote: a second tier (a URL, or a :class:`Remote`): every save commits to ``root`` (fast local storage)
            first, then a background thread copies it there.
        memory: a peer-memory tier (:class:`PeerMemory`): steps are also kept in node-local memory, replicated to
            other nodes, and restored from there first (``docs/PEER_MEMORY.md``).
        durable: ``False`` saves without the fsync before each commit (see :func:`arrayckpt.save`): for a
            local tier that a remote one makes durable.
        keep_buffers: for an asynchronous manager, as for :func:`arrayckpt.async_save`: ``True`` keeps the staging
            buffers (a host copy of the rank's state) between saves so that the next save stages faster; ``False``
            frees them after each save.

    Raises:
        LocationError: ``root`` (or the remote's URL) or ``storage_options`` cannot name a location.
        StorageError: the remote root refuses its first request for good (no bucket, bad credentials).

    Examples:
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
        process_group: ProcessGroup | Group | None = None,
        incremental: Incremental | None = None,
        storage_options: Mapping[str, Any] | None = None,
        remote: str | os.PathLike[str] | Remote | None = None,
        memory: PeerMemory | None = None,
        durable: bool = True,
        keep_buffers: bool = True,
    ) -> None:
        self._local = LocalTier(parse_location(root, storage_options), storage_options)
        self.storage_options = storage_options
        #: The root: a local directory (``Path``) or an object-storage URL (``str``).
        self.root: Path | str = self._local.location.native
        self.incremental = incremental
        self.interval = interval or Interval(every_steps=1)
        self.retention = retention or Retention()
        self.asynchronous = asynchronous
        self.keep_buffers = keep_buffers
        self.process_group = process_group
        # The options every save starts from (each save sets its step, metrics and base on a copy), and what the
        # manager adds to each: the check that it still holds its root, its own plan cache.
        self._save_options = SaveOptions(codec=codec, overwrite=True, process_group=process_group,
                                         storage_options=storage_options, durable=durable)
        self._save_setup = SaveSetup(guard=self._local.held.check, plan_cache=PlanCache())
        self._pending: SaveHandle | None = None  # the asynchronous save in flight
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._blocking_seconds: float | None = None
        self._sigterm = SigtermSave(self._save_before_exit)  # save_on_sigterm's handling
        #: What the last :meth:`clean_up` left in place although it looked like a leftover: ``(path, why)``.
        self.kept: list[tuple[str, str]] = []
        self._local.location.make_directory()
        #: The peer-memory tier on this rank (``_peer/tier.py``; ``None`` without ``memory=``); its configuration is
        #: ``memory.config``.
        self.memory = MemoryTier(memory, str(self._local.location)) if memory is not None else None
        #: The remote tier (``None``: no ``remote=``); its configuration (a :class:`Remote`) is ``remote.config``.
        self.remote = RemoteTier(Remote(remote) if isinstance(remote, (str, os.PathLike)) else remote, self._local) \
            if remote is not None else None
        #: Every tier, fastest first: what :meth:`tiers`, :meth:`restore`, :meth:`clean_up` and :meth:`close` go over.
        self._tiers: list[Tier] = []
        if self.memory is not None:
            self._tiers.append(self.memory)
        self._tiers.append(self._local)
        if self.remote is not None:
            self._tiers.append(self.remote)
        if self._is_coordinator():
            self._take_roots()

    def _take_roots(self) -> None:
        """Hold the root and start the remote tier (coordinator), warning loudly when another manager holds the root;
        the remote tier's start is the check that its root exists and is writable (:meth:`RemoteTier.start`)."""
        busy = self._local.held.take()
        holds = [self._local.held]
        if self.remote is not None:
            holds.append(self.remote.held)
            try:
                self.remote.start()
            except BaseException:
                self._local.held.release()
                raise
        weakref.finalize(self, _release, holds)  # a manager dropped without close() lets its roots go
        if busy is not None:
            warnings.warn(f"{busy}. This manager can list and restore, but its saves and clean-ups are refused "
                          "(CheckpointBusyError) while that one holds the root: close it (a crashed process's lock "
                          f"is gone with it; a lease on object storage expires {settings().lease_ttl_s:g} s after its "
                          "holder stopped), or use another root", RuntimeWarning, stacklevel=3)

    # --- where checkpoints are --------------------------------------------------------------------

    def path(self, step: int) -> Path | str:
        """Where step ``step``'s checkpoint is in the local tier (committed or not).

        Args:
            step: the training step.

        Returns:
            A path, or a URL on object storage.

        Examples:
            >>> import arrayckpt, tempfile
            >>> arrayckpt.CheckpointManager(tempfile.mkdtemp()).path(100).name
            'step-00000100'
        """
        return self._local.path(step)

    def remote_path(self, step: int) -> str | Path:
        """Where step ``step``'s checkpoint is in the remote tier (committed or not).

        Args:
            step: the training step.

        Returns:
            A URL (or a path, for a remote directory).

        Raises:
            StateError: this manager has no remote tier.

        Examples:
            >>> import arrayckpt, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp(), remote=tempfile.mkdtemp())  # or "s3://..."
            >>> manager.remote_path(100).name
            'step-00000100'
            >>> manager.close()
        """
        if self.remote is None:
            raise StateError("this manager has no remote tier (CheckpointManager(..., remote=...))")
        return self.remote.path(step)

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint in any tier, ascending (incomplete ones are ignored; see :meth:`tiers`).

        Examples:
            >>> import arrayckpt, torch, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp())
            >>> [manager.save(step, {"w": torch.zeros(1)}) for step in (10, 20)] and manager.steps()
            [10, 20]
        """
        return sorted(self.tiers())

    def tiers(self) -> dict[int, tuple[str, ...]]:
        """Which tiers hold a committed checkpoint of each step, ascending: ``{step: ("memory", "local", "remote")}``,
        the names fastest first. ``"memory"``: this node's memory directory holds the step (committed here; whether
        the nodes hold it whole is known only to a restore or a flush, which ask them all). Waits for the memory save
        in flight, raising its failure.

        Examples:
            >>> import arrayckpt, torch, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp())
            >>> manager.save(5, {"w": torch.zeros(1)}) and manager.tiers()
            {5: ('local',)}
        """
        held: dict[int, list[str]] = {}
        for tier in self._tiers:
            for step in tier.steps():
                held.setdefault(step, []).append(tier.name)
        return {step: tuple(held[step]) for step in sorted(held)}

    def clean_up(self, min_age_s: float = 3600.0) -> list[str]:
        """Remove what interrupted saves and deletions left, and only that; returns what was removed.

        - An incomplete step checkpoint (no root document) older than the newest committed one, when it holds
          only what arrayckpt writes (its ``zarr.json`` documents, one of an array it wrote, and chunk files; or
          only empty directories) and nothing in it was touched for ``min_age_s``: the rule of
          :func:`arrayckpt.gc` for object storage. A directory holding anything else is kept.
        - A committed delta checkpoint whose base, a step of this manager, is gone (a deletion cut short): it
          can never be read again.
        - The other leftovers of interrupted saves untouched for ``min_age_s`` (see :func:`arrayckpt.gc`).

        In the remote tier too (uploads cut short), except at the steps the local tier holds (its step copier may be
        copying them). What looked like a leftover but stays is in :attr:`kept` as ``(path, why)``; a step directory
        kept because it is not arrayckpt's is also named in a warning. What a running save holds is never removed (spec
        §9.4). Coordinator only (on the other ranks it cleans up their memory tier only).

        Args:
            min_age_s: leftovers touched more recently than this many seconds ago are kept.

        Returns:
            What was removed.

        Raises:
            CheckpointBusyError: another manager holds the root.

        Examples:
            >>> import arrayckpt, tempfile
            >>> arrayckpt.CheckpointManager(tempfile.mkdtemp()).clean_up(min_age_s=0)
            []
        """
        self.kept = []
        removed: list[str] = []
        coordinator = self._is_coordinator()
        for tier in self._tiers:  # the memory tier on every rank (each its node's), a shared root on the coordinator
            if tier.shared and not coordinator:
                continue
            cleaned = tier.clean_up(min_age_s)
            removed += cleaned.removed
            self.kept += cleaned.kept
        foreign = [f"{path} ({why})" for path, why in self.kept
                   if "maybe still being saved" not in why and "a save is running" not in why]
        if foreign:
            warnings.warn(f"{self.root}: clean_up left {len(foreign)} thing(s) that are not known to be arrayckpt's "
                          f"leftovers; look at them and remove them yourself if they are not needed: "
                          + "; ".join(foreign), RuntimeWarning, stacklevel=2)
        return removed

    def _open(self, step: int) -> Checkpoint:
        """Step ``step``'s local checkpoint, opened: use it in a ``with`` block, which closes it."""
        return self._local.tree.open(step)

    def latest_step(self) -> int | None:
        """The newest step committed in any tier (:meth:`steps`) (``None``: none).

        Examples:
            >>> import arrayckpt, torch, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp())
            >>> manager.latest_step() is None, manager.save(3, {"w": torch.zeros(1)}), manager.latest_step()
            (True, True, 3)
        """
        steps = self.steps()
        return steps[-1] if steps else None

    # --- saving -----------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether the interval policy asks for a checkpoint at ``step`` (what :meth:`save` asks itself).

        Args:
            step: the training step.

        Returns:
            ``True`` when a save at ``step`` would save.

        Examples:
            >>> import arrayckpt, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp(), interval=arrayckpt.Interval(every_steps=10))
            >>> manager.should_save(5), manager.should_save(10)
            (False, True)
        """
        elapsed = time.monotonic() - (self._last_time or 0.0)
        return self.interval.due(step, self._last_step, elapsed, self._blocking_seconds)

    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False,
             metrics: Mapping[str, float] | None = None,
             changed_rows: Mapping[str, torch.Tensor | np.ndarray | Sequence[int]] | None = None) -> bool:
        """Save ``state`` as step ``step`` if the interval policy (or ``force``) says so, then apply the retention.
        Asynchronous managers return once the data is staged. With a remote tier, the save is queued for upload.

        Args:
            step: the training step.
            state: as for :func:`arrayckpt.save`.
            force: save whatever the interval policy says (e.g. at the last step).
            metrics: finite numbers by name, recorded with the step (what ``Retention(keep_best=...)`` ranks by).
            changed_rows: with ``incremental``: key -> row indices changed since the previous save; spares reading
                the base back for those keys.

        Returns:
            Whether a save was started.

        Raises:
            StorageError: an upload failed since the last call (once per failure, after this save was made).
            CheckpointBusyError: another manager holds the root.
            ArrayckptError: what :func:`arrayckpt.save` raises (an asynchronous save's failure: at the next call).

        Examples:
            >>> import arrayckpt, torch, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp(), interval=arrayckpt.Interval(every_steps=100))
            >>> manager.save(50, {"w": torch.zeros(1)}), manager.save(50, {"w": torch.zeros(1)}, force=True)
            (False, True)
        """
        with self._sigterm.deferred():
            saved = self._save(step, state, force, metrics, changed_rows)
            if saved:
                self._raise_upload_errors(new_only=True)
            return saved

    def _save(self, step: int, state: Mapping[str, Any], force: bool, metrics: Mapping[str, float] | None,
              changed_rows: Mapping[str, torch.Tensor | np.ndarray | Sequence[int]] | None) -> bool:
        in_memory = self.memory is not None and self.memory.due(step)
        if not (force or self.should_save(step)):
            return in_memory and self._save_memory(step, state, metrics)
        if self._last_step is not None and step <= self._last_step:
            raise StateError(f"step {step} is not after the last saved step {self._last_step}")
        self.wait()
        started = time.perf_counter()
        options = self._delta_options(replace(self._save_options, step=step, metrics=metrics), changed_rows)
        if self.asynchronous:
            keep = self.incremental is not None and self.incremental.keep_copy
            self._pending = async_save_with(state, self.path(step), options, keep_copy=keep,
                                            keep_buffers=self.keep_buffers, setup=self._save_setup)
            self._blocking_seconds = self._pending.blocking_seconds
            if self.remote is not None:
                self.remote.add(step, self._pending)
        else:
            save_with(state, self.path(step), options, self._save_setup)
            self._blocking_seconds = time.perf_counter() - started
            if self.remote is not None:
                self.remote.add(step)
            self._apply_retention()
        self._last_step, self._last_time = step, time.monotonic()
        return not in_memory or self._save_memory(step, state, metrics)

    def _save_memory(self, step: int, state: Mapping[str, Any], metrics: Mapping[str, float] | None) -> bool:
        assert self.memory is not None
        self.memory.save(state, step, metrics, self._save_options, self._save_setup,
                         resolve_group(self.process_group))
        return True

    def _delta_options(self, options: SaveOptions,
                       changed_rows: Mapping[str, torch.Tensor | np.ndarray | Sequence[int]] | None) -> SaveOptions:
        """``options`` for the next save: a delta against the newest local checkpoint, or as they are (a full
        save)."""
        if self.incremental is None:
            if changed_rows:
                raise StateError("changed_rows needs an incremental manager (incremental=arrayckpt.Incremental())")
            return options
        steps = self._local.steps()
        if not steps:
            return options
        with self._open(steps[-1]) as base:  # closed here: the save opens its base again, and closes it when over
            if self.incremental.wants_full(base):
                return options
        return replace(options, base=self.path(steps[-1]), changed_rows=changed_rows,
                       quantize=self.incremental.quantize)

    def wait(self) -> None:
        """Wait for an asynchronous save and a memory save in flight (raising their errors), then apply retention.

        Raises:
            ArrayckptError: what made the save in flight fail, as :func:`arrayckpt.save` raises it.

        Examples:
            >>> import arrayckpt, torch, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp(), asynchronous=True)
            >>> manager.save(1, {"w": torch.zeros(1)})
            True
            >>> manager.wait()
        """
        with self._sigterm.deferred():
            if self.memory is not None:
                self.memory.wait()
            if self._pending is not None:
                pending, self._pending = self._pending, None
                pending.wait()
                self._apply_retention()

    def wait_for_uploads(self, timeout: float | None = None) -> None:
        """Wait for the local save in flight and until every local step is uploaded (steps whose upload failed are
        tried once more), then apply the local retention.

        Args:
            timeout: at most this many seconds (``None``: no limit).

        Raises:
            StorageError: an upload failed (the steps stay local: a later save or call tries them again).
            TimeoutError: uploads are still running after ``timeout`` seconds.

        Examples:
            >>> import arrayckpt, torch, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp(), remote=tempfile.mkdtemp())
            >>> manager.save(1, {"w": torch.zeros(1)})
            True
            >>> manager.wait_for_uploads(timeout=60); manager.upload_errors()
            []
            >>> manager.close()
        """
        self.wait()
        if self.remote is None:
            return
        if not self.remote.wait_for_copies(timeout):
            raise TimeoutError(f"{self.remote.location}: uploads still running after {timeout} s")
        self._apply_retention()
        self.remote.take_unreported()
        self._raise_upload_errors(new_only=False)

    def upload_errors(self) -> list[tuple[int, BaseException]]:
        """``(step, error)`` for every step whose last upload failed and that has not been uploaded since.

        Examples:
            >>> import arrayckpt, tempfile
            >>> arrayckpt.CheckpointManager(tempfile.mkdtemp()).upload_errors()  # no remote tier: never any
            []
        """
        return self.remote.errors() if self.remote is not None else []

    def _raise_upload_errors(self, new_only: bool) -> None:
        if self.remote is None:
            return
        failed = self.remote.take_unreported() if new_only else self.remote.errors()
        if failed:
            steps = ", ".join(str(step) for step, _ in failed)
            raise StorageError(f"{self.remote.location}: uploading step(s) {steps} to the remote tier failed (they "
                               f"stay in {self.root}, and are tried again with the next save): {failed[-1][1]}") \
                from failed[-1][1]

    def _apply_retention(self) -> None:
        """Delete the local steps the retention does not keep, nor any kept delta reads through, nor (with a remote
        tier, unless ``keep_until_uploaded`` is false) any whose upload has not committed; see
        :meth:`LocalTier.apply_retention`."""
        if not self._is_coordinator():
            return
        protect = self.remote.protected() if self.remote is not None else set()
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
        all of them restore the same step (see ``arrayckpt._manage.restore.restore_newest``).

        Args:
            state: the targets, as for :func:`arrayckpt.load`.
            step: restore this step only (default: the newest that reads back whole).
            load_options: keyword arguments of :func:`arrayckpt.load` (``strict``, ``atomic``, ``allow_pickle``...).

        Returns:
            The step restored, or ``None`` when there is nothing to resume from.

        Raises:
            KeyMismatchError: the state does not match the step's keys (with ``strict``, the default).
            CorruptCheckpointError: ``step`` was given and it is damaged in every copy.
            CheckpointNotFoundError: ``step`` was given and no tier holds it.

        Examples:
            >>> import arrayckpt, torch, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp())
            >>> state = {"w": torch.zeros(2)}
            >>> manager.restore(state) is None  # a fresh start
            True
            >>> manager.save(7, {"w": torch.ones(2)}) and manager.restore(state), state["w"]
            (7, tensor([1., 1.]))
        """
        sources = self._restore_sources()
        if self.memory is not None:  # the newest step the surviving nodes hold whole, if not older (or ``step``)
            group = resolve_group(self.process_group)
            newest = max(sources, default=None) if step is None else None
            found = self.memory.restore(state, group, load_options, newest, only=step)
            if found is not None:
                self._last_step, self._last_time = found, time.monotonic()
                return found
        if step is not None and step not in sources:
            raise CheckpointNotFoundError(f"{self.path(step)}: no committed checkpoint for step {step}")
        order = [step] if step is not None else sorted(sources, reverse=True)
        if not order:
            return None
        candidates = [StepCandidate(s, sources[s]) for s in order]
        step = restore_newest(state, candidates, resolve_group(self.process_group), {"atomic": True, **load_options})
        self._last_step, self._last_time = step, time.monotonic()
        return step

    def _restore_sources(self) -> dict[int, list[StepSource]]:
        """Every step a tier can restore from one path (the durable tiers), with its sources, fastest tier first; a
        remote tier that cannot be listed is left out, with a warning."""
        out: dict[int, list[StepSource]] = {}
        for tier in self._tiers:
            try:
                steps = tier.steps()
            except StorageError as e:
                if tier is not self.remote:
                    raise
                warnings.warn(f"{self.remote.location}: the remote tier cannot be listed ({e}); restoring from the "
                              "local tier", RuntimeWarning, stacklevel=3)
                continue
            for step in steps:
                source = tier.source(step)
                if source is not None:
                    out.setdefault(step, []).append(source)
        return out

    # --- peer memory -----------------------------------------------------------------------------

    def flush_memory(self, step: int | None = None) -> int | None:
        """Make a memory step durable: copy its chunk files, as they are, from the nodes holding them to
        ``path(step)`` in the local tier (then, with a remote tier, it is uploaded like any save); collective, on
        every rank. ``step=None`` takes the newest memory step the nodes hold whole (after a node loss too: the
        replicas stand in). Returns the step flushed (``None``: no memory step to flush); a step the local tier
        already holds as this very checkpoint is not copied again. Waits for the saves in flight first
        (``_peer/flush.py``).

        Args:
            step: the memory step to flush (``None``: the newest the nodes hold whole).

        Returns:
            The step flushed (``None``: no memory step to flush).

        Raises:
            StateError: the manager has no memory tier, or the step is not whole among the nodes.
            CorruptCheckpointError: a chunk file is damaged (named).
            CheckpointBusyError: another manager holds the root.

        Examples:
            Not run here: a memory tier needs several nodes (``tests/peer/test_peer_memory.py`` runs it)::

                manager = arrayckpt.CheckpointManager("/nvme/ckpt", memory=arrayckpt.PeerMemory(every_steps=50))
                ...
                manager.flush_memory()  # before the job ends: the newest memory step becomes durable
        """
        if self.memory is None:
            raise StateError("this manager has no memory tier: pass memory=arrayckpt.PeerMemory(...)")
        with self._sigterm.deferred():
            self.wait()
            group = resolve_group(self.process_group)
            flushed = self.memory.flush(step, group, self._local.tree.step_location, self._local.held.check)
            if flushed is None:
                return None
            if flushed.copied and self.remote is not None:
                self.remote.add(flushed.step)
            self._apply_retention()
            return flushed.step

    # --- preemption -------------------------------------------------------------------------------

    def save_on_sigterm(self, state_and_step: StateAndStep) -> None:
        """On SIGTERM (preemption), finish any save in flight, save ``state_and_step()`` synchronously,
        then exit with the signal's default status. Opt-in; call once, from the main thread.

        The handler runs once: a second SIGTERM while it runs (a launcher forwarding the scheduler's) is
        ignored. A signal that arrives while the main thread is inside :meth:`save` or :meth:`wait` is handled
        when that call returns (never a save inside a save). If the saving fails, the error propagates and a
        later SIGTERM is handled again (``signals.py``).

        Args:
            state_and_step: called on SIGTERM; returns ``(step, state)``, the newest state to save.

        Examples:
            Not run here (it installs a signal handler in the process)::

                manager = arrayckpt.CheckpointManager("ckpt")
                manager.save_on_sigterm(lambda: (step, state))  # reads the loop's current step and state
                for step in range(start, total):
                    ...
        """
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
        """Wait for the save in flight and (with a remote tier) for the uploads, raising what failed; then close every
        tier, slowest first (the remote tier's copier stops, the roots are let go: another manager may take them).

        Raises:
            StorageError: an upload failed.
            ArrayckptError: what made the save in flight fail.

        Examples:
            >>> import arrayckpt, torch, tempfile
            >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp(), asynchronous=True)
            >>> manager.save(1, {"w": torch.zeros(1)})
            True
            >>> manager.close()
        """
        try:
            self.wait()
            self.wait_for_uploads()
        finally:
            _close(self._tiers)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

