"""Collectives: the few metadata exchanges a save needs, over a CPU-capable (gloo) process group.

A save uses four collectives whatever the number of tensors: gather the local descriptions, scatter
each rank its part of the plan, gather the write results, broadcast the commit outcome. With one process there is no
``torch.distributed`` at all and every exchange is the identity.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from .._errors import CollectiveError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Group", "resolve_group"]

_CPU_GROUPS: dict[ProcessGroup | None, ProcessGroup | None] = {}

T = TypeVar("T")  # what one collective exchanges: the same type on every rank


@dataclass(frozen=True)
class Group:
    """This process's view of the group it saves or loads with; rank 0 of the group coordinates."""

    rank: int
    size: int
    pg: ProcessGroup | None = None  # the user's process group (None: single process)
    cpu_pg: ProcessGroup | None = None  # a gloo group over the same ranks, for object collectives (None: no torch)

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def global_rank(self, rank: int) -> int:
        """Rank ``rank`` of this group in torch's global numbering: what torch's collectives over :attr:`cpu_pg`
        take as source or destination."""
        import torch.distributed as dist

        assert self.cpu_pg is not None, "only a group of several processes exchanges through torch, and " \
            "resolve_group gives every such group its gloo group"
        return dist.get_global_rank(self.cpu_pg, rank)

    def gather(self, obj: T) -> list[T] | None:
        """Every rank's ``obj`` on the coordinator (``None`` elsewhere)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[T] | None = [obj] * self.size if self.is_coordinator else None  # each slot overwritten
        with _collective("gather", self.rank):
            dist.gather_object(obj, out, dst=self.global_rank(0), group=self.cpu_pg)
        return out

    def broadcast(self, obj: T) -> T:
        """The coordinator's ``obj`` on every rank."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]  # what the other ranks pass is replaced by the coordinator's
        with _collective("broadcast", self.rank):
            dist.broadcast_object_list(box, src=self.global_rank(0), group=self.cpu_pg)
        return box[0]

    def scatter(self, objs: Sequence[T] | None) -> T:
        """``objs[rank]`` of the coordinator's list on every rank (the list is ignored elsewhere): each rank
        receives only its own object. A group without a torch process group (a test double) broadcasts the
        list instead."""
        if self.size == 1:
            assert objs is not None
            return objs[0]
        if self.cpu_pg is None:
            scattered = self.broadcast(objs)
            assert scattered is not None, "the coordinator scatters a list (its own is broadcast)"
            return scattered[self.rank]
        import torch.distributed as dist

        out: list[T | None] = [None]
        with _collective("scatter", self.rank):
            dist.scatter_object_list(out, list(objs) if self.is_coordinator and objs is not None else None,
                                     src=self.global_rank(0), group=self.cpu_pg)
        return out[0]  # type: ignore[return-value]  # filled with the coordinator's objs[rank], a T

    def all_gather(self, obj: T) -> list[T]:
        if self.size == 1:
            return [obj]
        import torch.distributed as dist

        out: list[T] = [obj] * self.size  # each slot overwritten
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
