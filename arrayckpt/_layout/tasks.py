"""What a rank writes: a :class:`WriteTask` (a box of one array) or a :class:`RowsTask` (a rows delta's changed rows
of one piece); :data:`Task` is either. The coordinator decides them (``planner.py``, ``delta.py``); each rank gets
its own in its ``RankPlan`` (``rankplan.py``) and writes them (``_write/save.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from .box import Box

__all__ = ["RowsTask", "Task", "WriteTask"]


@dataclass(frozen=True)
class WriteTask:
    """Write the part ``box`` (global coordinates) of array ``path`` from this rank's local piece of ``key``."""

    key: str
    path: str
    box: Box


@dataclass(frozen=True)
class RowsTask:
    """Write the changed rows of piece ``box`` of ``key`` at rows ``offset:offset+length`` of its row arrays (the
    group at ``path``: ``spec/FORMAT.md``, "Delta checkpoints")."""

    key: str
    path: str
    box: Box
    offset: int
    length: int  # padded to whole chunks of the row arrays


Task: TypeAlias = WriteTask | RowsTask  # one write of a rank (only a delta plan has RowsTasks)
