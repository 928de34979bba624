"""Read-once loading: data several ranks need is read from storage by one of them and sent to the rest.

Replicated tensors (plain tensors, ``Replicate()`` placements, data-parallel copies of a shard) would
otherwise be read from storage by every rank that holds them. With ``load(..., read_once=True)`` the
ranks exchange what they need (one ``all_gather`` of metadata), agree — by the same deterministic rule
on every rank — on one reader per distinct piece (balanced by bytes), and the reader forwards the
bytes point-to-point over the CPU (gloo) group. Storage then serves each byte once (Orbax's
load-once-and-broadcast, Megatron's fully-parallel load).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch

from .._io.arrays import ArrayIO
from .._torch.dist import Group

__all__ = ["split_reads"]

Request = tuple[str, tuple[tuple[int | None, int | None], ...]]  # (key, the index as (start, stop) pairs)


def _request(job: ArrayIO) -> Request:
    index = job.index or ()
    return job.key, tuple((s.start, s.stop) for s in index)


def split_reads(reads: list[ArrayIO], group: Group) -> tuple[list[ArrayIO], Any]:
    """The reads this rank must do itself, and a function that exchanges the shared data afterwards.

    Every rank calls this with its planned reads (collective). Pieces needed by one rank stay with it;
    a piece needed by several is read by the needer with the least bytes assigned so far.
    """
    mine = {_request(job): job for job in reads}
    everyone = group.all_gather([(request, job.data.nbytes) for request, job in mine.items()])
    needers: dict[Request, list[int]] = defaultdict(list)
    sizes: dict[Request, int] = {}
    for rank, requests in enumerate(everyone):
        for request, nbytes in requests:
            needers[request].append(rank)
            sizes[request] = nbytes
    loads = [0] * group.size
    reader: dict[Request, int] = {}
    for request in sorted(needers, key=lambda r: (-sizes[r], repr(r))):
        ranks = needers[request]
        chosen = min(ranks, key=lambda r: (loads[r], r))
        reader[request] = chosen
        loads[chosen] += sizes[request]
    own = [job for request, job in mine.items() if reader[request] == group.rank]
    shared = sorted((r for r in needers if len(needers[r]) > 1), key=repr)

    def exchange() -> None:
        _exchange(shared, needers, reader, mine, group)

    return own, exchange


def _exchange(shared: list[Request], needers: dict[Request, list[int]], reader: dict[Request, int],
              mine: dict[Request, ArrayIO], group: Group) -> None:
    """Send what this rank read to the other needers; receive what others read for this rank."""
    import torch.distributed as dist

    ops, landing = [], []
    for request in shared:  # the same order on every rank, so sends and receives pair up
        source = reader[request]
        if source == group.rank:
            payload = _bytes_of(mine[request].data)
            for rank in needers[request]:
                if rank != group.rank:
                    ops.append(dist.P2POp(dist.isend, payload, group.global_rank(rank),
                                          group.cpu_pg))
        elif request in mine:
            buffer, finish = _landing(mine[request].data)
            landing.append(finish)
            ops.append(dist.P2POp(dist.irecv, buffer, group.global_rank(source), group.cpu_pg))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for finish in landing:
        finish()


def _bytes_of(data: np.ndarray) -> torch.Tensor:
    """A flat uint8 tensor of the array's bytes (a view when contiguous)."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return torch.from_numpy(flat)


def _landing(data: np.ndarray) -> tuple[torch.Tensor, Any]:
    """Where received bytes land: the destination itself when contiguous, else a buffer copied over after."""
    if data.flags.c_contiguous:
        return torch.from_numpy(data.reshape(-1).view(np.uint8)), lambda: None
    buffer = np.empty(data.shape, data.dtype)

    def finish() -> None:
        np.copyto(data, buffer)

    return torch.from_numpy(buffer.reshape(-1).view(np.uint8)), finish
