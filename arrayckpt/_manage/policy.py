"""The policies of a :class:`arrayckpt.CheckpointManager`, apart from its machinery: when to save (:class:`Interval`,
with Young's and Daly's optimal intervals), which steps to keep (:class:`Retention`), and when a delta chain starts
over (:class:`Incremental`). Plain values and arithmetic: no IO, no torch (``arrayckpt interval`` imports this module
where torch is not installed).

With δ the time a checkpoint blocks training and M the mean time between failures, Young's first-order
optimum is ``T = sqrt(2·δ·M)``; Daly's higher-order estimate is
``T = sqrt(2·δ·M)·[1 + ⅓·sqrt(δ/2M) + ⅑·(δ/2M)] − δ`` for ``δ < 2M``, else ``T = M``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .._read.checkpoint import Checkpoint

__all__ = ["Incremental", "Interval", "OptimalInterval", "Retention", "optimal_interval"]


@dataclass(frozen=True)
class Interval:
    """When :meth:`CheckpointManager.save` actually saves (any rule that fires is enough).

    ``every_steps``: at every step that is a multiple of it (as Orbax's ``save_interval_steps``), or at the first
    step called after one was passed by (when ``save`` is not called at every step); an off-interval save (e.g.
    ``force=True`` at step 17) does not shift the grid: with ``every_steps=5`` the next is 20, not 22.
    ``every_seconds``: that long after the previous save. ``mtbf_hours``: Daly's optimum from the measured
    blocking time of the previous save and the given mean time between failures.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    mtbf_hours: float | None = None

    def due(self, step: int, last_step: int | None, elapsed_s: float, blocking_s: float | None) -> bool:
        """Whether a checkpoint is due at ``step``, ``elapsed_s`` seconds after the previous save (at ``last_step``;
        ``None``: none yet this run), which blocked training ``blocking_s`` seconds (``None``: not measured)."""
        if last_step is None:
            return bool(self.every_steps and step % self.every_steps == 0) or self.every_steps is None
        if self.every_steps and step // self.every_steps > last_step // self.every_steps:
            return True  # a multiple of every_steps reached (or passed) since the previous save
        if self.every_seconds and elapsed_s >= self.every_seconds:
            return True
        if self.mtbf_hours and blocking_s is not None:
            return elapsed_s >= optimal_interval(blocking_s, self.mtbf_hours * 3600).daly_seconds
        return False


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
            metric = self.metric
            scored = [s for s in steps if metric in metrics.get(s, {})]
            scored.sort(key=lambda s: metrics[s][metric], reverse=self.mode == "max")
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

    def wants_full(self, latest: Checkpoint) -> bool:
        """Whether the next save should be full, given the newest committed checkpoint (opened)."""
        chain = latest.chain()
        deltas = [c for c in chain if c.manifest.base is not None]
        full = chain[-1]
        full_bytes = full.manifest.stored_bytes if full.manifest.stored_bytes is not None else full.nbytes
        spent = sum(c.manifest.stored_bytes or 0 for c in deltas)
        if self.max_chain_length is not None and len(deltas) >= self.max_chain_length:
            return True
        return spent > self.max_chain_ratio * full_bytes


@dataclass(frozen=True)
class OptimalInterval:
    """Optimal seconds of training between checkpoints, by Young's and by Daly's formula."""

    blocking_seconds: float
    mtbf_seconds: float
    young_seconds: float
    daly_seconds: float


def optimal_interval(blocking_seconds: float, mtbf_seconds: float) -> OptimalInterval:
    """Young's and Daly's optimal checkpoint intervals for a blocking time and a mean time between failures.

    >>> round(optimal_interval(10.0, 3600.0).young_seconds, 1)
    268.3
    """
    delta, m = float(blocking_seconds), float(mtbf_seconds)
    if not (delta >= 0 and m > 0 and math.isfinite(delta) and math.isfinite(m)):
        raise ValueError(f"need blocking_seconds >= 0 and mtbf_seconds > 0, got {blocking_seconds!r}, {mtbf_seconds!r}")
    young = math.sqrt(2 * delta * m)
    if delta < 2 * m:
        ratio = delta / (2 * m)
        daly = young * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta
    else:
        daly = m
    return OptimalInterval(blocking_seconds=delta, mtbf_seconds=m, young_seconds=young, daly_seconds=daly)
