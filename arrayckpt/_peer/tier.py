"""The memory tier as the manager sees it: when a memory save is due, the save, the restore, clean-up, close.

The manager holds one :class:`MemoryTier` when it was given a :class:`PeerMemory`, and calls it from a few hooks
(``CheckpointManager.save``/``restore``/``clean_up``/``close``); everything else of the tier is in this package.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from .._errors import StateError
from .._torch.dist import Group
from .._write.options import SaveOptions
from .config import PeerMemory
from .node import NodeMemory
from .restore import memory_restore
from .save import MemorySaved, memory_save

__all__ = ["MemoryTier"]


class MemoryTier:
    """A manager's peer-memory tier on this rank (its node's directory, its last memory step)."""

    def __init__(self, memory: PeerMemory, root: str) -> None:
        self.memory = memory
        self.node = NodeMemory(memory.node_directory(root), root)
        self.last_step: int | None = None
        #: What the last memory save did (``None``: none yet in this process).
        self.last: MemorySaved | None = None
        #: Seconds the last memory save blocked the caller.
        self.blocking_seconds: float | None = None

    def due(self, step: int) -> bool:
        """Whether a memory save is due at ``step``: a multiple of ``every_steps`` after the last memory step."""
        every = self.memory.every_steps
        return step % every == 0 and (self.last_step is None or step > self.last_step)

    def save(self, state: Mapping[str, Any], step: int, metrics: Mapping[str, float] | None, options: SaveOptions,
             group: Group) -> MemorySaved:
        if self.last_step is not None and step <= self.last_step:
            raise StateError(f"memory step {step} is not after the last memory step {self.last_step}")
        started = time.perf_counter()
        self.last = memory_save(state, step, metrics, options, self.memory, self.node, group)
        self.blocking_seconds = time.perf_counter() - started
        self.last_step = step
        return self.last

    def restore(self, state: Mapping[str, Any], group: Group, load_options: Mapping[str, Any],
                at_least: int | None) -> int | None:
        """The newest memory step held whole by the survivors, restored into ``state`` (``None``: use the durable
        tiers; a warning says why where memory held anything)."""
        step = memory_restore(state, self.node, group, load_options, at_least)
        if step is not None:
            self.last_step = step
        return step

    def steps(self) -> list[int]:
        """Memory steps committed on this node (not necessarily whole among the nodes)."""
        return self.node.committed_steps()

    def clean_up(self, min_age_s: float) -> list[str]:
        return self.node.clean_up(min_age_s)

    def close(self) -> None:
        self.node.close()
