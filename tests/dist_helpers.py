"""Run a function on N spawned ranks with torch.distributed (gloo on 127.0.0.1), as the tests' helper.

Every rank's exception comes back with its traceback; a rank that hangs fails the test after a timeout
instead of hanging the suite.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, results: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import datetime

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S - 30))
        try:
            results.put((rank, "ok", fn(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(world: int, fn: Callable, *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned ranks; returns each rank's result, by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = results.get(timeout=TIMEOUT_S)
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("distributed run failed:\n" + "\n".join(errors))
    return [out[r] for r in range(world)]
