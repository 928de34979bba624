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
    """When :meth:`CheckpointManager.save` actually saves (any rule that fires is enough; none given: every call).

    Args:
        every_steps: at every step that is a multiple of it (as Orbax's ``save_interval_steps``), or at the first
            step called after one was passed by (when ``save`` is not called at every step); an off-interval save
            (e.g. ``force=True`` at step 17) does not shift the grid: with ``every_steps=5`` the next is 20, not 22.
        every_seconds: that long after the previous save.
        mtbf_hours: Daly's optimum from the measured blocking time of the previous save and the given mean time
            between failures.

    Examples:
        >>> import arrayckpt
        >>> interval = arrayckpt.Interval(every_steps=100, every_seconds=600)
        >>> interval.due(200, last_step=100, elapsed_s=30.0, blocking_s=None)
        True
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    mtbf_hours: float | None = None

    def due(self, step: int, last_step: int | None, elapsed_s: float, blocking_s: float | None) -> bool:
        """Whether a checkpoint is due at ``step`` (the manager asks at each :meth:`CheckpointManager.save`).

        Args:
            step: the training step about to be saved.
            last_step: the step of the previous save (``None``: none yet this run).
            elapsed_s: seconds since the previous save.
            blocking_s: seconds the previous save blocked training (``None``: not measured).

        Returns:
            ``True`` when a rule fires.

        Examples:
            >>> import arrayckpt
            >>> arrayckpt.Interval(every_steps=5).due(22, last_step=17, elapsed_s=1.0, blocking_s=None)
            True
        """
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
    """Which committed checkpoints to keep; everything else is deleted after each save. ``None`` everywhere keeps
    everything; the newest is always kept.

    Args:
        keep_last: how many of the newest to keep.
        keep_every: keep every step that is a multiple of it.
        keep_best: how many of the best by ``metric`` to keep (checkpoints without that metric do not compete).
        metric: the name of a metric given to :meth:`CheckpointManager.save`.
        mode: ``"min"`` or ``"max"``: which end of ``metric`` is best.

    Examples:
        >>> import arrayckpt
        >>> retention = arrayckpt.Retention(keep_last=2, keep_every=100, keep_best=1, metric="loss")
        >>> sorted(retention.keep([100, 150, 200, 250, 300], {150: {"loss": 0.1}, 250: {"loss": 0.3}}))
        [100, 150, 200, 250, 300]
        >>> sorted(arrayckpt.Retention(keep_last=2).keep([100, 150, 200], {}))
        [150, 200]
    """

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: Literal["min", "max"] = "min"

    def keep(self, steps: list[int], metrics: Mapping[int, Mapping[str, float]]) -> set[int]:
        """The steps to keep out of the committed ones.

        Args:
            steps: the committed steps, sorted ascending.
            metrics: each step's metrics (as given to :meth:`CheckpointManager.save`).

        Returns:
            The steps to keep; the manager deletes the others.

        Examples:
            >>> import arrayckpt
            >>> sorted(arrayckpt.Retention(keep_last=1, keep_every=10).keep([10, 15, 20, 25], {}))
            [10, 20, 25]
        """
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
    begins a new chain. Retention never deletes a base that a kept checkpoint still reads through.

    Args:
        max_chain_ratio: start over once the deltas since the last full checkpoint store more than this times what
            it stores.
        max_chain_length: start over once the chain has this many deltas (``None``: no limit).
        quantize: key pattern -> 4 or 8 bits: matching tensors' changed rows are stored quantized (lossy; see
            :func:`arrayckpt.save`).
        keep_copy: for an asynchronous manager: find what changed by comparing with a copy kept in host memory
            (twice the host memory) rather than by reading the base back.

    Examples:
        >>> import arrayckpt
        >>> arrayckpt.Incremental(max_chain_ratio=0.5, quantize={"model.emb.*": 8}).max_chain_length
        16
    """

    max_chain_ratio: float = 1.0
    max_chain_length: int | None = 16
    quantize: Mapping[str, int] | None = None
    keep_copy: bool = False  # asynchronous managers: compare with a kept host copy (2x host memory), not a read

    def wants_full(self, latest: Checkpoint) -> bool:
        """Whether the next save should be full (the manager asks before each save).

        Args:
            latest: the newest committed checkpoint, opened.

        Returns:
            ``True`` when its chain is long enough to start over.

        Examples:
            >>> import arrayckpt, torch, tempfile, os
            >>> d = tempfile.mkdtemp()
            >>> arrayckpt.save({"w": torch.zeros(1000)}, f"{d}/full")
            >>> arrayckpt.save({"w": torch.ones(1000)}, f"{d}/delta", base=f"{d}/full")  # all changed: as big
            >>> with arrayckpt.open(f"{d}/delta") as latest:
            ...     arrayckpt.Incremental(max_chain_ratio=0.5).wants_full(latest)
            True
        """
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
    """Optimal seconds of training between checkpoints, by Young's and by Daly's formula (what
    :func:`optimal_interval` returns).

    Attributes:
        blocking_seconds: the time a checkpoint blocks training, as given.
        mtbf_seconds: the mean time between failures, as given.
        young_seconds: Young's first-order optimum.
        daly_seconds: Daly's higher-order optimum.

    Examples:
        >>> import arrayckpt
        >>> round(arrayckpt.optimal_interval(10.0, 3600.0).daly_seconds, 1)
        261.7
    """

    blocking_seconds: float
    mtbf_seconds: float
    young_seconds: float
    daly_seconds: float


def optimal_interval(blocking_seconds: float, mtbf_seconds: float) -> OptimalInterval:
    """Young's and Daly's optimal checkpoint intervals for a blocking time and a mean time between failures.

    Args:
        blocking_seconds: how long a checkpoint blocks training (``>= 0``).
        mtbf_seconds: the mean time between failures (``> 0``).

    Returns:
        Both optima, in seconds of training between checkpoints.

    Raises:
        ValueError: a negative, zero (``mtbf_seconds``) or non-finite argument.

    Examples:
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
