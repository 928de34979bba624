"""Ranks as threads of one process: a ``Group`` whose collectives meet at a barrier.

The save and load protocols only need gather / broadcast / all_gather of Python objects, so running
the ranks as threads exercises the whole protocol (planning, validation, writer assignment, commit)
in milliseconds, which is what a property test needs. Real multi-process runs are in
write/test_distributed.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from arrayckpt._torch.dist import Group


@dataclass(eq=False)
class _Hub:
    size: int
    barrier: threading.Barrier = field(init=False)
    slots: list[Any] = field(init=False)

    def __post_init__(self) -> None:
        self.barrier = threading.Barrier(self.size, timeout=60)
        self.slots = [None] * self.size

    def exchange(self, rank: int, obj: Any) -> list[Any]:
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


@dataclass(frozen=True)
class ThreadGroup(Group):
    hub: Any = None

    def gather(self, obj: Any) -> list[Any] | None:
        out = self.hub.exchange(self.rank, obj)
        return out if self.is_coordinator else None

    def broadcast(self, obj: Any) -> Any:
        return self.hub.exchange(self.rank, obj)[0]

    def all_gather(self, obj: Any) -> list[Any]:
        return self.hub.exchange(self.rank, obj)


def run_thread_ranks(world: int, fn: Callable[[int, Group], Any]) -> list[Any]:
    """``fn(rank, group)`` on ``world`` threads; re-raises the first rank's exception."""
    hub = _Hub(world)
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, ThreadGroup(rank, world, None, None, hub))
        except BaseException as e:
            errors[rank] = e
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for error in errors:
        if error is not None and not isinstance(error, threading.BrokenBarrierError):
            raise error
    for error in errors:
        if error is not None:
            raise error
    return results
