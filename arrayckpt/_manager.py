"""CheckpointManager: step-named checkpoints under one root, an interval policy, retention, resume.

Checkpoints live at ``<root>/step-<step:08d>``, locally or on object storage (``s3://bucket/run``). Only
committed checkpoints count: an interrupted save leaves a temporary directory (locally) or an incomplete
prefix (object storage) that is never listed and is removed by :meth:`CheckpointManager.clean_up`.
Retention runs on the coordinator after each save has committed, never removes the newest checkpoint, and
never removes a base that a kept delta checkpoint reads through.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ._errors import ArrayckptError, CheckpointNotFoundError, IncompleteCheckpointError, StateError
from ._read.checkpoint import open_checkpoint
from ._read.load import load
from ._storage import Location, parse_location
from ._storage.gc import incomplete_leftovers
from ._tools.interval import optimal_interval
from ._torch.dist import resolve_group
from ._write.asynchronous import async_save_with
from ._write.options import SaveOptions
from ._write.save import save_with

__all__ = ["CheckpointManager", "Incremental", "Interval", "Retention"]

_STEP_DIR = re.compile(r"step-(\d{8,})")


@dataclass(frozen=True)
class Interval:
    """When :meth:`CheckpointManager.save` actually saves (any rule that fires is enough).

    ``every_steps`` / ``every_seconds``: fixed intervals. ``mtbf_hours``: Daly's optimum from the
    measured blocking time of the previous save and the given mean time between failures.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    mtbf_hours: float | None = None


@dataclass(frozen=True)
class Retention:
    """Which committed checkpoints to keep; everything else is deleted after each save.

    ``keep_last`` newest; every step that is a multiple of ``keep_every``; the ``keep_best`` best by
    ``metric`` (``mode="min"`` or ``"max"``; checkpoints without that metric do not compete).
    ``None`` everywhere keeps everything.
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: Literal["min", "max"] = "min"

    def keep(self, steps: list[int], metrics: Mapping[int, Mapping[str, float]]) -> set[int]:
        """The steps to keep out of the committed ``steps`` (sorted ascending)."""
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            return set(steps)
        kept = set(steps[-max(1, self.keep_last or 1):])  # the newest is always kept
        if self.keep_every:
            kept.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best and self.metric:
            scored = [s for s in steps if self.metric in metrics.get(s, {})]
            scored.sort(key=lambda s: metrics[s][self.metric], reverse=self.mode == "max")
            kept.update(scored[: self.keep_best])
        return kept


@dataclass(frozen=True)
class Incremental:
    """Delta saves between full ones, with Check-N-Run's intermittent rule for when to start over.

    Each save is a delta against the newest committed checkpoint, until the deltas since the last full
    checkpoint store more than ``max_chain_ratio`` times what that full checkpoint stores (reading a long
    chain costs more than it saved) or the chain has ``max_chain_length`` deltas; then a full checkpoint
    begins a new chain. ``quantize`` (key pattern -> 4 or 8 bits) stores matching tensors' changed rows
    quantized (lossy; see :func:`arrayckpt.save`). Retention never deletes a base that a kept checkpoint
    still reads through.
    """

    max_chain_ratio: float = 1.0
    max_chain_length: int | None = 16
    quantize: Mapping[str, int] | None = None
    keep_copy: bool = False  # asynchronous managers: compare with a kept host copy (2x host memory), not a read

    def wants_full(self, latest: Any) -> bool:
        """Whether the next save should be full, given the newest committed checkpoint (opened)."""
        chain = latest.chain()
        deltas = [c for c in chain if c.manifest.base is not None]
        full = chain[-1]
        full_bytes = full.manifest.stored_bytes if full.manifest.stored_bytes is not None else full.nbytes
        spent = sum(c.manifest.stored_bytes or 0 for c in deltas)
        if self.max_chain_length is not None and len(deltas) >= self.max_chain_length:
            return True
        return spent > self.max_chain_ratio * full_bytes


class CheckpointManager:
    """Save every so often, keep what the retention policy says, resume from the newest committed step.

    >>> import arrayckpt, torch, tempfile
    >>> manager = arrayckpt.CheckpointManager(tempfile.mkdtemp(), interval=arrayckpt.Interval(every_steps=2))
    >>> w = torch.zeros(2)
    >>> [manager.save(step, {"w": w}) for step in range(1, 5)]
    [False, True, False, True]
    >>> manager.latest_step(), manager.restore({"w": w})
    (4, 4)
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        interval: Interval | None = None,
        retention: Retention | None = None,
        asynchronous: bool = False,
        codec: Any = None,
        process_group: Any = None,
        incremental: Incremental | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self._location = parse_location(root, storage_options)
        self.storage_options = storage_options
        #: The root: a local directory (``Path``) or an object-storage URL (``str``).
        self.root: Path | str = self._location.native
        self.incremental = incremental
        self.interval = interval or Interval(every_steps=1)
        self.retention = retention or Retention()
        self.asynchronous = asynchronous
        self.process_group = process_group
        #: The options every save starts from; each save sets its step, metrics and base on a copy.
        self.save_options = SaveOptions(codec=codec, overwrite=True, process_group=process_group,
                                        storage_options=storage_options)
        self._pending: Any = None  # the in-flight SaveHandle of an asynchronous save
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._blocking_seconds: float | None = None
        self._on_signal: Callable[[], tuple[int, Mapping[str, Any]]] | None = None  # save_on_sigterm's callback
        self._signalled: int | None = None  # the signal being handled (save_on_sigterm)
        self._deferring = 0  # save()/wait() calls in progress on the main thread: a signal waits for them
        self._terminating = False
        #: What the last :meth:`clean_up` left in place although it looked like a leftover: ``(path, why)``.
        self.kept: list[tuple[str, str]] = []
        self._location.make_directory()

    # --- where checkpoints are --------------------------------------------------------------------

    def path(self, step: int) -> Path | str:
        """Where step ``step``'s checkpoint is (a path, or a URL on object storage)."""
        return self._step_location(step).native

    def _step_location(self, step: int) -> Location:
        return self._location.child(f"step-{step:08d}")

    def _listed_steps(self) -> list[int]:
        """Steps with something at their path, committed or not."""
        names = self._location.children()
        return sorted(int(m.group(1)) for m in map(_STEP_DIR.fullmatch, names) if m)

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending (incomplete ones are ignored)."""
        return [s for s in self._listed_steps() if self._step_location(s).is_committed()]

    def clean_up(self, min_age_s: float = 3600.0) -> list[str]:
        """Remove what interrupted saves and deletions left, and only that; returns what was removed.

        - An incomplete step checkpoint (no root document) older than the newest committed one, when it holds
          only what arrayckpt writes (its ``zarr.json`` documents, one of an array it wrote, and chunk files; or
          only empty directories) and nothing in it was touched for ``min_age_s``: the rule of
          :func:`arrayckpt.gc` for object storage. A directory holding anything else is kept.
        - A committed delta checkpoint whose base, a step of this manager, is gone (a deletion cut short): it
          can never be read again.
        - The other leftovers of interrupted saves untouched for ``min_age_s`` (see :func:`arrayckpt.gc`).

        What looked like a leftover but stays is in :attr:`kept` as ``(path, why)``; a step directory kept
        because it is not arrayckpt's is also named in a warning. Coordinator only."""
        self.kept = []
        if not self._is_coordinator():
            return []
        removed = self._remove_orphaned_deltas()
        committed = self.steps()
        if committed:
            for step in self._listed_steps():
                if step < committed[-1] and step not in committed:
                    location = self._step_location(step)
                    try:
                        location.read_root()
                        continue  # readable after all (a transient failure hid it): never delete
                    except IncompleteCheckpointError:  # positively no root document: an interrupted save
                        pass
                    except ArrayckptError:  # unreadable or foreign: leave it for a person to look at
                        continue
                    found, kept = incomplete_leftovers(location, min_age_s)
                    removed.extend(leftover.url for leftover in found if leftover.remove())
                    self.kept.extend(kept)
        found, kept = self._location.leftovers(min_age_s)
        removed.extend(leftover.url for leftover in found if leftover.remove())
        self.kept.extend(k for k in kept if k not in self.kept)
        foreign = [f"{path} ({why})" for path, why in self.kept if "maybe still being saved" not in why]
        if foreign:
            warnings.warn(f"{self.root}: clean_up left {len(foreign)} thing(s) that are not known to be arrayckpt's "
                          f"leftovers; look at them and remove them yourself if they are not needed: "
                          + "; ".join(foreign), RuntimeWarning, stacklevel=2)
        return removed

    def _remove_orphaned_deltas(self) -> list[str]:
        """Delete committed delta checkpoints whose base, a step of this manager, is positively gone (no
        checkpoint, or an incomplete one, at its path): a deletion of that base was cut short before its deltas
        were removed. A base that cannot be read for another reason (a storage error) keeps its deltas."""
        removed: list[str] = []
        gone: set[int] = set()
        changed = True
        while changed:
            changed = False
            for step in self.steps():
                try:
                    base = self._base_step(step)
                except ArrayckptError:
                    continue
                if base is None:
                    continue
                if base not in gone:
                    try:
                        self._step_location(base).read_root()
                        continue
                    except (CheckpointNotFoundError, IncompleteCheckpointError):
                        pass
                    except ArrayckptError:
                        continue
                location = self._step_location(step)
                location.delete()
                removed.append(str(location))
                gone.add(step)
                changed = True
        return removed

    def _base_step(self, step: int) -> int | None:
        """The step of this manager that step ``step``'s checkpoint is a delta against (``None``: a full checkpoint,
        or a base elsewhere). Raises what opening the checkpoint raises."""
        ref = open_checkpoint(self.path(step), storage_options=self.storage_options).manifest.base
        if ref is None:
            return None
        base = str(self._step_location(step).resolve(ref.path))
        match = _STEP_DIR.fullmatch(base.rstrip("/").rpartition("/")[2])
        if match is None or str(self._step_location(int(match.group(1)))) != base:
            return None
        return int(match.group(1))

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    # --- saving -----------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        """Whether the interval policy asks for a checkpoint at ``step``."""
        rule = self.interval
        if self._last_step is None:
            return bool(rule.every_steps and step % rule.every_steps == 0) or rule.every_steps is None
        if rule.every_steps and step - self._last_step >= rule.every_steps:
            return True
        elapsed = time.monotonic() - (self._last_time or 0.0)
        if rule.every_seconds and elapsed >= rule.every_seconds:
            return True
        if rule.mtbf_hours and self._blocking_seconds is not None:
            return elapsed >= optimal_interval(self._blocking_seconds, rule.mtbf_hours * 3600).daly_seconds
        return False

    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False,
             metrics: Mapping[str, float] | None = None, changed_rows: Mapping[str, Any] | None = None) -> bool:
        """Save ``state`` as step ``step`` if the interval policy (or ``force``) says so; returns whether
        a save was started. Asynchronous managers return once the data is staged. With ``incremental``,
        ``changed_rows`` (key -> row indices changed since the previous save) spares reading the base back
        for those keys."""
        with self._signals_deferred():
            return self._save(step, state, force, metrics, changed_rows)

    def _save(self, step: int, state: Mapping[str, Any], force: bool, metrics: Mapping[str, float] | None,
              changed_rows: Mapping[str, Any] | None) -> bool:
        if not (force or self.should_save(step)):
            return False
        if self._last_step is not None and step <= self._last_step:
            raise StateError(f"step {step} is not after the last saved step {self._last_step}")
        self.wait()
        started = time.perf_counter()
        from dataclasses import replace

        options = replace(self.save_options, step=step, metrics=metrics, **self._delta_options(changed_rows))
        if self.asynchronous:
            keep = self.incremental is not None and self.incremental.keep_copy
            self._pending = async_save_with(state, self.path(step), options, keep_copy=keep)
            self._blocking_seconds = self._pending.blocking_seconds
        else:
            save_with(state, self.path(step), options)
            self._blocking_seconds = time.perf_counter() - started
            self._apply_retention()
        self._last_step, self._last_time = step, time.monotonic()
        return True

    def _delta_options(self, changed_rows: Mapping[str, Any] | None) -> dict[str, Any]:
        """The next save's incremental options (``SaveOptions`` fields): a delta against the newest checkpoint,
        or none (a full save)."""
        if self.incremental is None:
            if changed_rows:
                raise StateError("changed_rows needs an incremental manager (incremental=arrayckpt.Incremental())")
            return {}
        latest = self.latest_step()
        if latest is None:
            return {}
        base = open_checkpoint(self.path(latest), storage_options=self.storage_options)
        if self.incremental.wants_full(base):
            return {}
        return {"base": base, "changed_rows": changed_rows, "quantize": self.incremental.quantize}

    def wait(self) -> None:
        """Wait for an asynchronous save in flight (raising its error), then apply retention."""
        with self._signals_deferred():
            if self._pending is not None:
                pending, self._pending = self._pending, None
                pending.wait()
                self._apply_retention()

    def _apply_retention(self) -> None:
        """Delete the committed steps the policy does not keep, and that no kept delta reads through, in an order
        where every state a crash can leave is consistent: a delta before the base it reads through (newest
        first), and each checkpoint's root document first (see :meth:`Location.delete`)."""
        if not self._is_coordinator():
            return
        steps = self.steps()
        metrics = {}
        if self.retention.keep_best and self.retention.metric:
            metrics = {s: dict(open_checkpoint(self.path(s), storage_options=self.storage_options).metrics)
                       for s in steps}
        kept = self.retention.keep(steps, metrics)
        bases: dict[int, int | None] = {}
        for step in steps:
            try:
                bases[step] = self._base_step(step)
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
        for step in _deletion_order(set(steps) - kept, bases):
            self._step_location(step).delete()

    def _is_coordinator(self) -> bool:
        return resolve_group(self.process_group).is_coordinator

    # --- resuming ---------------------------------------------------------------------------------

    def restore(self, state: Mapping[str, Any], step: int | None = None, **load_options: Any) -> int | None:
        """Load the newest committed checkpoint (or ``step``) into ``state``; returns its step, or
        ``None`` when there is nothing to resume from (a fresh start)."""
        if step is None:
            step = self.latest_step()
            if step is None:
                return None
        elif step not in self.steps():
            raise CheckpointNotFoundError(f"{self.path(step)}: no committed checkpoint for step {step}")
        load(state, self.path(step), process_group=self.process_group, storage_options=self.storage_options,
             **load_options)
        self._last_step, self._last_time = step, time.monotonic()
        return step

    # --- preemption -------------------------------------------------------------------------------

    def save_on_sigterm(self, state_and_step: Callable[[], tuple[int, Mapping[str, Any]]]) -> None:
        """On SIGTERM (preemption), finish any save in flight, save ``state_and_step()`` synchronously,
        then exit with the signal's default status. Opt-in; call once, from the main thread.

        The handler runs once: a second SIGTERM while it runs (a launcher forwarding the scheduler's) is
        ignored. A signal that arrives while the main thread is inside :meth:`save` or :meth:`wait` is handled
        when that call returns (never a save inside a save). If the saving fails, the error propagates and a
        later SIGTERM is handled again."""
        def handler(signum: int, frame: Any) -> None:
            if self._signalled is not None:
                return  # a second signal while the first is handled (or about to be): ignored
            self._signalled = signum
            if self._deferring:
                return  # inside save() or wait(): they finish first, then call _terminate
            self._terminate(signum, state_and_step)

        self._on_signal = state_and_step
        signal.signal(signal.SIGTERM, handler)

    def _terminate(self, signum: int, state_and_step: Callable[[], tuple[int, Mapping[str, Any]]]) -> None:
        """The SIGTERM handler's work: finish the save in flight, save the newest state, exit with ``signum``."""
        self._terminating = True
        try:
            self.wait()
            step, state = state_and_step()
            if self._last_step is None or step > self._last_step:
                asynchronous, self.asynchronous = self.asynchronous, False
                try:
                    self.save(step, state, force=True)
                finally:
                    self.asynchronous = asynchronous
        except BaseException:
            self._signalled, self._terminating = None, False
            raise
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    @contextlib.contextmanager
    def _signals_deferred(self) -> Iterator[None]:
        """Around :meth:`save` and :meth:`wait` on the main thread: a SIGTERM that arrives meanwhile is handled
        when the outermost of them returns (or fails), so the handler never runs a save inside a save nor
        misses the save in flight that :meth:`wait` has taken over."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            signum = self._signalled
            if not self._deferring and signum is not None and not self._terminating and self._on_signal is not None:
                self._terminate(signum, self._on_signal)

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _deletion_order(doomed: set[int], bases: Mapping[int, int | None]) -> list[int]:
    """``doomed`` ordered so that a delta comes before every base it reads through, newest first otherwise."""
    order: list[int] = []
    remaining = set(doomed)
    while remaining:
        read_through = {bases.get(s) for s in remaining}
        ready = [s for s in remaining if s not in read_through] or list(remaining)  # (a loop of bases: any order)
        order.append(max(ready))
        remaining.discard(order[-1])
    return order
