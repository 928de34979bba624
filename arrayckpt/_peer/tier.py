"""The memory tier as the manager sees it: when a memory save is due, the save, the restore, the flush (a memory step
made durable in the local tier), clean-up, close.

The manager holds one :class:`MemoryTier` when it was given a :class:`PeerMemory`, first in its list of tiers (the
fastest). It implements the manager's ``Tier`` interface (``arrayckpt/_manage/tiers.py``: ``name``, ``shared``,
``steps``, ``source``, ``clean_up``, ``close``) structurally, without importing it (the manager is a layer above);
the rest (``due``, ``save``, ``wait``, ``restore``, ``flush``) the manager calls on this tier alone. Everything else of
the tier is in this package.

A memory save blocks the caller only while the state is copied to host buffers; the save into the node's memory and
the replication run on a thread of the tier's own, their collectives on a process group of their own (created, over
the same ranks, by the first memory save). One is in flight at a time: the next memory save, a restore, ``steps``,
``clean_up`` and ``close`` wait for it first, and raise its failure (on every rank alike).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .._errors import StateError
from .._storage import CleanedUp, Location
from .._torch.dist import Group
from .._write.hostcopies import HostCopies
from .._write.options import SaveOptions, SaveSetup
from .config import PeerMemory
from .flush import Flushed, flush_memory_step
from .node import NodeMemory
from .restore import memory_restore
from .save import MemorySaved, start_memory_save
from .sweep import ended_memory_directories

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["MemoryTier"]


class MemoryTier:
    """A manager's peer-memory tier on this rank (its node's directory, its last memory step)."""

    name = "memory"
    shared = False  # one directory per node: every rank cleans up its node's

    def __init__(self, config: PeerMemory, root: str) -> None:
        self.config = config
        self.node = NodeMemory(config.node_directory(root), root)
        self.last_step: int | None = None
        #: What the last memory save did (``None``: none yet in this process).
        self.last: MemorySaved | None = None
        #: Seconds the last memory save blocked the caller (the staging).
        self.blocking_seconds: float | None = None
        self._copies = HostCopies()
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[MemorySaved] | None = None
        # the manager's group's pg -> the background collectives'
        self._background: dict[ProcessGroup | None, Group] = {}

    def due(self, step: int) -> bool:
        """Whether a memory save is due at ``step``: a multiple of ``every_steps`` after the last memory step."""
        every = self.config.every_steps
        return step % every == 0 and (self.last_step is None or step > self.last_step)

    def save(self, state: Mapping[str, Any], step: int, metrics: Mapping[str, float] | None, options: SaveOptions,
             setup: SaveSetup, group: Group) -> None:
        """Start memory step ``step``: returns once the state is staged (after the previous memory save is over,
        its failure raised); :meth:`wait` for the rest."""
        self.wait()
        if self.last_step is not None and step <= self.last_step:
            raise StateError(f"memory step {step} is not after the last memory step {self.last_step}")
        started = time.perf_counter()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="arrayckpt-memory")
        self._pending = start_memory_save(state, step, metrics, options, setup, self.config, self.node, group,
                                          self._background_group(group), self._copies, self._executor)
        self.blocking_seconds = time.perf_counter() - started
        self.last_step = step

    def wait(self) -> MemorySaved | None:
        """Wait for the memory save in flight (raising its failure); what the last memory save did."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self.last = pending.result()
        return self.last

    def _background_group(self, group: Group) -> Group:
        """A gloo group over ``group``'s ranks for the background collectives (created once, collectively)."""
        if group.size == 1 or type(group) is not Group:
            return group
        if group.pg not in self._background:
            import torch.distributed as dist

            pg = dist.new_group(ranks=dist.get_process_group_ranks(group.pg), backend="gloo")
            self._background[group.pg] = Group(group.rank, group.size, pg, pg)
        return self._background[group.pg]

    def restore(self, state: Mapping[str, Any], group: Group, load_options: Mapping[str, Any],
                at_least: int | None, only: int | None = None) -> int | None:
        """The newest memory step held whole by the survivors (with ``only``: that step), restored into ``state``
        (``None``: use the durable tiers; a warning says why where memory held anything)."""
        self.wait()
        step = memory_restore(state, self.node, group, load_options, at_least, only)
        if step is not None:
            self.last_step = step
        return step

    def flush(self, step: int | None, group: Group, location_of: Callable[[int], Location],
              guard: Callable[[], None] | None) -> Flushed | None:
        """Make memory step ``step`` (``None``: the newest held whole) durable: its chunk files copied, as stored, to
        ``location_of(step)`` in the local tier (``flush.py``)."""
        self.wait()
        return flush_memory_step(self.node, group, step, location_of, guard)

    def steps(self) -> list[int]:
        """Memory steps committed on this node (not necessarily whole among the nodes)."""
        self.wait()
        return self.node.committed_steps()

    def source(self, step: int) -> None:
        """None: a memory step is restored collectively, from the survivors (:meth:`restore`), not from one path."""
        return None

    def clean_up(self, min_age_s: float) -> CleanedUp:
        """Remove interrupted memory saves in this node's directory, and the memory directories of ended jobs beside
        it (``sweep.py``); what was removed (the directories the sweep keeps are not reported here: ``arrayckpt gc
        --memory`` names them)."""
        self.wait()
        removed = self.node.clean_up(min_age_s)
        return CleanedUp(removed + ended_memory_directories(self.node.directory.parent, min_age_s, remove=True).removed,
                         [])

    def close(self) -> None:
        """Wait for the memory save in flight (raising its failure), then let the node's directory go and the host
        copies the memory saves staged into (pinned memory back to the driver)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()
                self._executor = None
            self._copies.release()
            self.node.close()
