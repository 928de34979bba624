"""The checkpoint manager's tiers: the one interface the manager holds them by (:class:`Tier`), the local and the
remote tier (:class:`LocalTier`, :class:`RemoteTier`), and the remote tier's configuration (:class:`Remote`).

A manager keeps its tiers in one list, fastest first: ``memory`` (the peer-memory tier,
:class:`arrayckpt._peer.tier.MemoryTier`, with ``memory=``), ``local`` (its root), ``remote`` (with ``remote=``).
What it asks of every tier is :class:`Tier`: its name, its steps, where a step may be restored from, clean-up,
close. What only one tier does stays that tier's own, called through the manager's typed accessor of it: saves
commit to the local tier, whose retention the manager applies; the remote tier copies them in the background (its
:class:`~arrayckpt._manage.copier.StepCopier`) and applies its own retention there; the memory tier saves, restores
and flushes on its own, collectively.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .._errors import ArrayckptError, CheckpointBusyError, StorageError
from .._storage import CleanedUp, Location, parse_location
from .._storage.liveness import HeldRoot
from .copier import StepCopier
from .policy import Retention
from .restore import StepSource
from .steptree import StepTree

if TYPE_CHECKING:
    from .._write.asynchronous import SaveHandle

__all__ = ["LocalTier", "Remote", "RemoteTier", "Tier"]

# Failures of the remote root's first request that no retry mends (TensorStore's status codes, S3's error codes)
_DEFINITIVE = ("NOT_FOUND", "NoSuchBucket", "PERMISSION_DENIED", "AccessDenied", "UNAUTHENTICATED", "INVALID_ARGUMENT")


class Tier(Protocol):
    """What a :class:`~arrayckpt.CheckpointManager` asks of each of its tiers (structural: the memory tier, a layer
    below, implements it without importing it).

    Capabilities that differ: :attr:`shared` (one root every rank sees, which the coordinator alone cleans up; or one
    directory per node, which each rank cleans up), and :meth:`source` (``None``: the tier restores on its own, as the
    memory tier does, collectively and before the others)."""

    @property
    def name(self) -> str:
        """What :meth:`~arrayckpt.CheckpointManager.tiers` reports: ``"memory"``, ``"local"`` or ``"remote"``."""
        ...

    @property
    def shared(self) -> bool:
        """Whether the tier is one root every rank sees (the coordinator alone cleans it up)."""
        ...

    def steps(self) -> list[int]:
        """The steps with a committed checkpoint here, ascending."""
        ...

    def source(self, step: int) -> StepSource | None:
        """Where ``restore`` may load step ``step`` from (``None``: this tier restores by its own means)."""
        ...

    def clean_up(self, min_age_s: float) -> CleanedUp:
        """Remove what interrupted saves and deletions left here (see ``CheckpointManager.clean_up``)."""
        ...

    def close(self) -> None:
        """Finish the tier's work in flight and let go of what it holds (its root, its threads)."""
        ...


@dataclass(frozen=True)
class Remote:
    """The second tier of a :class:`CheckpointManager`: where its committed checkpoints are copied in the background.

    Args:
        url: a root like the manager's own (``s3://bucket/run``, ``gs://``, a directory).
        storage_options: for an object-storage ``url``, as for :func:`arrayckpt.save`.
        retention: which steps it keeps (default: ``Retention()``; a delta's bases are kept as long as it is).
        max_bytes_per_second: paces the uploads so that they leave bandwidth to training.
        keep_until_uploaded: a local step is deleted only once its upload has committed; ``False``: the local
            retention deletes as if there were no remote tier, and a step it deletes before its upload is never
            uploaded.

    Raises:
        ValueError: ``max_bytes_per_second`` is not a positive number.

    Examples:
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


class LocalTier:
    """The manager's root: where every save commits first, with the coordinator's hold on it (spec §9.4)."""

    name = "local"
    shared = True

    def __init__(self, location: Location, storage_options: Mapping[str, Any] | None) -> None:
        self.location = location
        self.storage_options = storage_options
        self.tree = StepTree(location)
        self.held = HeldRoot(location)  # taken by the coordinator (the manager's ``_take_roots``)

    def path(self, step: int) -> Path | str:
        return self.tree.step_location(step).native

    def steps(self) -> list[int]:
        return self.tree.steps()

    def source(self, step: int) -> StepSource:
        return StepSource(self.path(step), self.storage_options, self.name)

    def apply_retention(self, retention: Retention, protect: set[int] | None) -> None:
        """Delete the steps ``retention`` does not keep, nor ``protect`` (``None``: delete none; see
        :meth:`StepTree.apply_retention`); nothing while the hold on the root is lost (a warning says so)."""
        try:
            self.held.check()
        except (CheckpointBusyError, StorageError) as e:  # e.g. a lease lost since the save: delete nothing now
            warnings.warn(f"retention skipped: {e}", RuntimeWarning, stacklevel=4)
            return
        self.tree.apply_retention(retention, protect)

    def clean_up(self, min_age_s: float) -> CleanedUp:
        """Raises ``CheckpointBusyError`` while another manager holds the root."""
        self.held.check()
        return self.tree.clean_up(min_age_s)

    def close(self) -> None:
        self.held.release()


class RemoteTier:
    """The second durable tier: a root elsewhere (object storage, typically) that the coordinator's
    :class:`StepCopier` copies the local tier's committed steps to, in the background. Built from a :class:`Remote`
    (:attr:`config`); on the other ranks it only lists and restores."""

    name = "remote"
    shared = True

    def __init__(self, config: Remote, local: LocalTier) -> None:
        location = parse_location(config.url, config.storage_options)
        if str(location) == str(local.location):
            raise ValueError(f"{location}: the remote tier must be another root than the local one")
        self.config, self.local, self.location = config, local, location
        self.tree = StepTree(location)
        self.held = HeldRoot(location)
        self.copier: StepCopier | None = None  # the coordinator's (:meth:`start`)

    def start(self) -> None:
        """The coordinator's: make the root, hold it, start copying. Holding it is the check that it exists and is
        writable (#24): a missing bucket or refused credentials raise ``StorageError``, an unreachable store is
        warned about (copies are tried again), another manager's hold too (its copies are refused meanwhile)."""
        self.location.make_directory()
        try:
            busy = self.held.take()
        except StorageError as e:
            if any(code in str(e) for code in _DEFINITIVE):
                raise StorageError(f"{self.location}: the remote tier cannot be used: {e}") from e
            warnings.warn(f"{self.location}: the remote tier cannot be reached now ({e}); saves go on locally and "
                          "uploads are tried again", RuntimeWarning, stacklevel=4)
        else:
            if busy is not None:
                warnings.warn(f"{busy}. This manager's uploads are refused while that manager holds the remote root",
                              RuntimeWarning, stacklevel=4)
        self.copier = StepCopier(self.local.tree, self.tree, self.config.retention or Retention(),
                                 self.config.max_bytes_per_second, self.held.check)

    def path(self, step: int) -> Path | str:
        return self.tree.step_location(step).native

    def steps(self) -> list[int]:
        return self.tree.steps()

    def source(self, step: int) -> StepSource:
        return StepSource(self.path(step), self.config.storage_options, self.name)

    # --- the copies (the coordinator's; nothing on the other ranks) -----------------------------------------------

    def add(self, step: int, handle: SaveHandle | None = None) -> None:
        """Copy local step ``step`` here once its save (``handle``, if still running) has committed."""
        if self.copier is not None:
            self.copier.add(step, handle)

    def protected(self) -> set[int] | None:
        """The local steps the local retention must keep for this tier: those whose copy has not committed, unless
        ``keep_until_uploaded`` is false (``None``: not known yet, keep them all)."""
        if self.copier is None or not self.config.keep_until_uploaded:
            return set()
        return self.copier.pending()

    def wait_for_copies(self, timeout: float | None) -> bool:
        """Try the failed copies once more and wait until none is queued or running; whether that happened within
        ``timeout``."""
        if self.copier is None:
            return True
        self.copier.retry_failed()
        return self.copier.wait(timeout)

    def errors(self) -> list[tuple[int, BaseException]]:
        """``(step, error)`` for every step whose last copy failed and that has not been copied since."""
        return self.copier.errors() if self.copier is not None else []

    def take_unreported(self) -> list[tuple[int, BaseException]]:
        """The failures not reported yet (each is returned once), still unresolved."""
        return self.copier.take_unreported() if self.copier is not None else []

    # --- clean-up, close ---------------------------------------------------------------------------------------

    def clean_up(self, min_age_s: float) -> CleanedUp:
        """Copies cut short too, except at the steps the local tier holds (the copier may be copying them); a
        failure is warned about (the local tier's clean-up stands)."""
        try:
            self.held.check()
            return self.tree.clean_up(min_age_s, skip=set(self.local.tree.listed_steps()))
        except ArrayckptError as e:
            warnings.warn(f"{self.location}: the remote tier could not be cleaned up: {e}", RuntimeWarning,
                          stacklevel=3)
            return CleanedUp([], [])

    def close(self) -> None:
        """Stop the copier once its queue is empty (what is queued is copied first), then let the root go."""
        try:
            if self.copier is not None:
                self.copier.close()
        finally:
            self.held.release()
