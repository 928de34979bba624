"""Collectives: the few metadata exchanges a save needs, over a CPU-capable (gloo) process group.

A save uses four collectives whatever the number of tensors: gather the local descriptions, scatter
each rank its part of the plan, gather the write results, broadcast the commit outcome. With one process there is no
``torch.distributed`` at all and every exchange is the identity.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import CollectiveError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Group", "resolve_group"]

_CPU_GROUPS: dict[ProcessGroup | None, ProcessGroup | None] = {}


@dataclass(frozen=True)
class Group:
    """This process's view of the group it saves or loads with; rank 0 of the group coordinates."""

    rank: int
    size: int
    pg: Any = None  # the user's process group (None: single process)
    cpu_pg: Any = None  # a gloo group over the same ranks, for object collectives

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the coordinator (``None`` elsewhere)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.size if self.is_coordinator else None
        with _collective("gather", self.rank):
            dist.gather_object(obj, out, dst=dist.get_global_rank(self.cpu_pg, 0), group=self.cpu_pg)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.is_coordinator else None]
        with _collective("broadcast", self.rank):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.cpu_pg, 0), group=self.cpu_pg)
        return box[0]

    def scatter(self, objs: list[Any] | None) -> Any:
        """``objs[rank]`` of the coordinator's list on every rank (the list is ignored elsewhere): each rank
        receives only its own object. A group without a torch process group (a test double) broadcasts the
        list instead."""
        if self.size == 1:
            assert objs is not None
            return objs[0]
        if self.cpu_pg is None:
            return self.broadcast(objs)[self.rank]
        import torch.distributed as dist

        out: list[Any] = [None]
        with _collective("scatter", self.rank):
            dist.scatter_object_list(out, objs if self.is_coordinator else None,
                                     src=dist.get_global_rank(self.cpu_pg, 0), group=self.cpu_pg)
        return out[0]

    def all_gather(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        with _collective("all_gather", self.rank):
            dist.all_gather_object(out, obj, group=self.cpu_pg)
        return out


@contextlib.contextmanager
def _collective(name: str, rank: int) -> Iterator[None]:
    """Turn a failed collective (a dead or hung rank) into an error that says so."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        raise CollectiveError(
            f"rank {rank}: the {name} with the other ranks failed — another rank died, hung past the process "
            f"group's timeout, or called arrayckpt differently; nothing was committed ({e})"
        ) from e


def resolve_group(process_group: ProcessGroup | Group | None = None) -> Group:
    """The group to use: the given one, else the default group when initialised, else a single process."""
    import torch.distributed as dist

    if isinstance(process_group, Group):  # already resolved (tests run ranks as threads this way)
        return process_group
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return Group(0, 1)
        process_group = dist.group.WORLD
    size = dist.get_world_size(process_group)
    rank = dist.get_rank(process_group)
    if size == 1:
        return Group(0, 1, process_group, None)
    return Group(rank, size, process_group, _cpu_group(process_group))


def _cpu_group(pg: ProcessGroup | None) -> ProcessGroup | None:
    """``pg`` itself when it is gloo; otherwise a gloo group over the same ranks, created once (collectively)."""
    import torch.distributed as dist

    if dist.get_backend(pg) == "gloo":
        return pg
    if pg not in _CPU_GROUPS:
        _CPU_GROUPS[pg] = dist.new_group(ranks=dist.get_process_group_ranks(pg), backend="gloo")
    return _CPU_GROUPS[pg]
