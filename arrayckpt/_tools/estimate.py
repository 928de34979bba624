"""Back-of-the-envelope sizing: how big a checkpoint will be, in total and per rank.

Size follows the bytes-per-parameter rule of mixed-precision training with Adam: 16-bit weights (2 bytes)
plus two fp32 moments (8 bytes) is 10 bytes per parameter, 14 with an fp32 master copy of the weights.
(How often to checkpoint is ``optimal_interval`` in ``_manage/policy.py``.) :func:`human_bytes` is the one formatter of
byte counts for people (the command line and the HTML report). No imports beyond the standard library: the command
line's start-up imports this module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction

from .._format.jsontypes import JSON

__all__ = ["SizeEstimate", "estimate_size", "human_bytes", "parse_count"]

WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
OPTIMIZER_BYTES = {"adam": 8, "sgd": 4, "none": 0}  # fp32 state per parameter: Adam m and v; SGD momentum
MASTER_BYTES = 4  # fp32 master weights kept by mixed-precision optimizers
MAX_PARAMS = 10**18  # a million times the largest models: a larger count is a typo (1e400 overflowed a float)
_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """``"7B"`` -> 7_000_000_000; also ``405e9``, ``1.3m``, ``125000``.

    >>> parse_count("70B"), parse_count("1.5k"), parse_count("4e3")
    (70000000000, 1500, 4000)
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmbgt]?)\s*", text.lower())
    if match is None:
        raise ValueError(f"{text!r} is not a parameter count; write e.g. 7B, 405e9 or 125000000")
    exponent = match[1].partition("e")[2]
    if exponent and int(exponent) > 30:  # before building the number: 1e999999999 would take minutes
        raise ValueError(f"{text!r} parameters is more than the {MAX_PARAMS:.0e} this estimate takes")
    count = round(Fraction(match[1]) * _SUFFIXES[match[2]])  # exact: a float turns 1e300 into 1000...0525
    if count > MAX_PARAMS:
        raise ValueError(f"{text!r} parameters is more than the {MAX_PARAMS:.0e} this estimate takes")
    return count


@dataclass(frozen=True)
class SizeEstimate:
    """Checkpoint size of a model, as :func:`estimate_size` returns it.

    Attributes:
        params: the number of parameters.
        bytes_per_param: the bytes a parameter takes, all parts together.
        breakdown: bytes per parameter by part: ``weights``, ``optimizer``, ``master``.
        total_bytes: the size of the checkpoint.
        ranks: the ranks it is sharded over.
        per_rank_bytes: what each rank writes.

    Examples:
        >>> import arrayckpt
        >>> arrayckpt.estimate_size(1_000_000, dtype="fp32", optimizer="sgd").breakdown
        {'weights': 4, 'optimizer': 4, 'master': 0}
    """

    params: int
    bytes_per_param: int
    breakdown: dict[str, int]
    total_bytes: int
    ranks: int
    per_rank_bytes: int

    def to_dict(self) -> JSON:
        return dict(self.__dict__)


def estimate_size(params: int, *, dtype: str = "bf16", optimizer: str = "adam", master_weights: bool = False,
                  ranks: int = 1) -> SizeEstimate:
    """Expected checkpoint size of a model with ``params`` parameters, sharded evenly over ``ranks`` ranks.

    Args:
        params: the number of parameters.
        dtype: the weights' dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"fp8"``.
        optimizer: its fp32 state per parameter: ``"adam"`` (two moments), ``"sgd"`` (momentum) or ``"none"``.
        master_weights: an fp32 master copy of the weights is kept (mixed-precision training).
        ranks: the ranks the checkpoint is sharded over.

    Returns:
        The size per parameter, in total and per rank.

    Raises:
        ValueError: an unknown ``dtype`` or ``optimizer``, ``params < 0`` or ``ranks < 1``.

    Examples:
        >>> e = estimate_size(7_000_000_000, master_weights=True, ranks=8)
        >>> e.bytes_per_param, e.total_bytes // 10**9, e.per_rank_bytes // 10**9
        (14, 98, 12)
    """
    if dtype not in WEIGHT_BYTES:
        raise ValueError(f"weight dtype {dtype!r} is not one of {', '.join(WEIGHT_BYTES)}")
    if optimizer not in OPTIMIZER_BYTES:
        raise ValueError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZER_BYTES)}")
    if params < 0 or ranks < 1:
        raise ValueError(f"need params >= 0 and ranks >= 1, got params={params}, ranks={ranks}")
    breakdown = {"weights": WEIGHT_BYTES[dtype], "optimizer": OPTIMIZER_BYTES[optimizer],
                 "master": MASTER_BYTES if master_weights and dtype != "fp32" else 0}
    per_param = sum(breakdown.values())
    total = params * per_param
    return SizeEstimate(params, per_param, breakdown, total, ranks, math.ceil(total / ranks))


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
