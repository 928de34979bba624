"""How often to checkpoint: Young's and Daly's optimal intervals.

With δ the time a checkpoint blocks training and M the mean time between failures, Young's first-order
optimum is ``T = sqrt(2·δ·M)``; Daly's higher-order estimate is
``T = sqrt(2·δ·M)·[1 + ⅓·sqrt(δ/2M) + ⅑·(δ/2M)] − δ`` for ``δ < 2M``, else ``T = M``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["OptimalInterval", "optimal_interval"]


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
    return OptimalInterval(delta, m, young, daly)
