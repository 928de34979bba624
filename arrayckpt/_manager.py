"""CheckpointManager: step-named checkpoints under one root, an interval policy, retention, resume.

Checkpoints live at ``<root>/step-<step:08d>``, locally or on object storage (``s3://bucket/run``). Only
committed checkpoints count: an interrupted save leaves a temporary directory (locally) or an incomplete
prefix (object storage) that is never listed and is removed by :meth:`CheckpointManager.clean_up`.
Retention runs on the coordinator after each save has committed, never removes the newest checkpoint, and
never removes a base that a kept delta checkpoint reads through.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ._errors import ArrayckptError, CheckpointNotFoundError, IncompleteCheckpointError, StateError
from ._read.checkpoint import open_checkpoint
from ._read.load import load
from ._storage import Location, parse_location
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
        """Remove what interrupted saves left: incomplete step checkpoints older than the newest committed
        one (a later save is never still running), and the other leftovers of interrupted saves untouched for
        ``min_age_s`` (see :func:`arrayckpt.gc`). Returns what was removed. Coordinator only."""
        if not self._is_coordinator():
            return []
        committed = self.steps()
        removed: list[str] = []
        if committed:
            for step in self._listed_steps():
                if step < committed[-1] and step not in committed:
                    location = self._step_location(step)
                    try:
                        location.read_root()
                        continue  # readable after all (a transient failure hid it): never delete
                    except IncompleteCheckpointError:  # positively no root document: an interrupted save
                        location.delete()
                        removed.append(str(location))
                    except ArrayckptError:  # unreadable or foreign: leave it for a person to look at
                        continue
        found, _ = self._location.leftovers(min_age_s)
        removed.extend(leftover.url for leftover in found if leftover.remove())
        return removed

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
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
            self._apply_retention()

    def _apply_retention(self) -> None:
        if not self._is_coordinator():
            return
        steps = self.steps()
        metrics = {}
        if self.retention.keep_best and self.retention.metric:
            metrics = {s: dict(open_checkpoint(self.path(s), storage_options=self.storage_options).metrics)
                       for s in steps}
        kept = self.retention.keep(steps, metrics)
        kept |= self._bases_of(kept, set(steps))
        for step in set(steps) - kept:
            self._step_location(step).delete()

    def _bases_of(self, kept: set[int], steps: set[int]) -> set[int]:
        """Steps that kept delta checkpoints read through (transitively): deleting them would break those."""
        by_location = {str(self._step_location(s)): s for s in steps}
        needed: set[int] = set()
        todo = sorted(kept)
        while todo:
            step = todo.pop()
            ref = open_checkpoint(self.path(step), storage_options=self.storage_options).manifest.base
            if ref is None:
                continue
            found = by_location.get(str(self._step_location(step).resolve(ref.path)))
            if found is not None and found not in needed and found not in kept:
                needed.add(found)
                todo.append(found)
        return needed

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
        then exit with the signal's default status. Opt-in; call once, from the main thread."""
        def handler(signum: int, frame: Any) -> None:
            self.wait()
            step, state = state_and_step()
            if self._last_step is None or step > self._last_step:
                asynchronous, self.asynchronous = self.asynchronous, False
                try:
                    self.save(step, state, force=True)
                finally:
                    self.asynchronous = asynchronous
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, handler)

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

