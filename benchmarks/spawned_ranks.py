"""Spawned gloo ranks for the multi-rank benchmarks (``distributed.py``, ``s3_ranks.py``): one fresh process group
on 127.0.0.1 per job, an op timed between two barriers on each rank, what each rank measured gathered back to the
parent; and the state both build, a training state whose tensors are ``Shard(0)`` rows of global tensors.

Ranks are processes started with ``torch.multiprocessing`` (spawn), so a job and the function a rank runs must be
picklable: a module-level function, and a job whose tensors are in shared memory (``share_memory_()``), which the
ranks map instead of copying.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

PG_TIMEOUT = datetime.timedelta(minutes=10)

J = TypeVar("J")  # the job of a rank
T = TypeVar("T")  # what an op returns

Where = tuple[str, ...]  # where a tensor sits in the nested state dict
State = dict[str, Any]


# ------------------------------------------------------------------------------------------- the ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(main: Callable[[int, int, J], object], job: J, world: int, threads: int) -> list[Any]:
    """Run ``main(rank, world, job)`` on ``world`` spawned ranks in a fresh gloo process group, each with ``threads``
    torch threads; what each rank returned (JSON-able), in rank order."""
    with tempfile.TemporaryDirectory(prefix="spawned-ranks-") as tmp:
        out = Path(tmp) / "ranks.json"
        torch_mp.start_processes(_rank, args=(world, free_port(), threads, main, job, str(out)), nprocs=world,
                                 join=True, start_method="spawn")
        return json.loads(out.read_text())


def _rank(rank: int, world: int, port: int, threads: int, main: Callable[[int, int, J], object], job: J,
          out: str) -> None:
    """One spawned rank: ``main`` in the process group; rank 0 writes what every rank returned to ``out``.

    The rank ends with ``os._exit`` once every rank has its result, skipping the interpreter's finalization: under
    load (a load average of 10 on 2 cores) about one run in three had a rank abort there with "terminate called
    without an active exception" (a native thread of the process group or of a storage client torn down while
    joinable), after its work was done and its result written, failing a run that had succeeded."""
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=PG_TIMEOUT)
    try:
        result = main(rank, world, job)
        everyone: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(result, everyone, dst=0)
        if everyone is not None:
            Path(out).write_text(json.dumps(everyone))
        dist.barrier()  # every rank has its part (rank 0 has written it): nobody still needs another's sockets
    except BaseException:
        traceback.print_exc()
        _leave(1)
    _leave(0)


def _leave(code: int) -> NoReturn:
    """Flush and end the process now (see :func:`_rank`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def between_barriers(op: Callable[[], T]) -> tuple[T, float]:
    """``op()`` and its seconds on this rank, between two barriers of the world (every rank starts together; an
    op's time is the slowest rank's)."""
    dist.barrier()
    start = time.perf_counter()
    result = op()
    seconds = time.perf_counter() - start
    dist.barrier()
    return result, seconds


# ------------------------------------------------------------------------------------------- the state


@dataclass(frozen=True)
class TensorSpec:
    path: Where
    shape: tuple[int, ...]
    dtype: torch.dtype
    sharded: bool  # Shard(0) over the ranks; else a plain tensor, identical on every rank

    @property
    def name(self) -> str:
        return "/".join(self.path)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def local_rows(rows: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [start, stop) of part ``index`` of ``rows`` split like ``torch.chunk`` (DTensor ``Shard(0)``)."""
    size = -(-rows // parts)
    start = min(rows, index * size)
    return start, min(rows, start + size)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def nest(items: Iterable[tuple[Where, Any]]) -> State:
    state: State = {}
    for path, value in items:
        node = state
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return state


def leaf(state: State, path: Where) -> Any:
    for part in path:
        state = state[part]
    return state


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (so NaNs compare, and -0.0 differs from 0.0)."""
    return torch.equal(_bits(a), _bits(b))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
