"""Worker threads kept for the life of the process: the foreground's chunk transfers and fsyncs.

A training job saves and loads many times; starting a pool's threads for each call cost ~1 ms (measured on ext4: a
fresh 16-thread pool to fsync a 1 MiB checkpoint's 12 paths made the fsyncs ~1.5 ms slower than a kept one). A pool
is made on its first use, and made afresh in a child after ``fork`` (the child's copy of the parent's pool has no
threads behind it). Background saves keep starting their own, niced threads (``priority.worker_initializer``).

Work goes through :func:`map_kept`, which never leaves a task running behind its caller (on an error or an
interrupt it waits for what it started) and runs on the calling thread once the interpreter is shutting down (no
pool takes new work then: a save from an ``atexit`` handler, a background save finishing as the main thread ends).
A task run here must never wait for another task of the same pool (a full pool would deadlock): the callers submit
leaf work only (chunk transfers, fsyncs, file checks).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

__all__ = ["batches", "kept_pool", "map_kept"]

T = TypeVar("T")
R = TypeVar("R")

_POOLS: dict[str, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def kept_pool(name: str, threads: int) -> ThreadPoolExecutor:
    """The process's pool ``name`` (``threads`` workers, started as tasks arrive and then kept)."""
    with _LOCK:
        pool = _POOLS.get(name)
        if pool is None or pool._max_workers != threads:  # a changed size (tests): a new pool; the old one drains
            if pool is not None:
                pool.shutdown(wait=False)
            pool = _POOLS[name] = ThreadPoolExecutor(threads, thread_name_prefix=f"arrayckpt-{name}")
        return pool


def map_kept(name: str, threads: int, fn: Callable[[T], R], items: Sequence[T],
             on_error: Callable[[], None] | None = None,
             initializer: Callable[[], None] | None = None) -> list[R]:
    """``[fn(item) for item in items]``, run on the kept pool ``name``; the first error is raised, but only once
    every task started has ended (``on_error`` is called first: e.g. to tell running tasks to stop early), so that
    nothing keeps writing into memory or files the caller has moved on from. With an ``initializer`` (a background
    save's niced workers) on threads of a pool of their own, started for this call."""
    if initializer is not None:
        with ThreadPoolExecutor(threads, initializer=initializer) as pool:
            return _map(pool, fn, items, on_error)
    return _map(kept_pool(name, threads), fn, items, on_error)


def _map(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Sequence[T],
         on_error: Callable[[], None] | None) -> list[R]:
    futures: list[Future[R]] = []
    rest: Sequence[T] = ()
    for index, item in enumerate(items):
        try:
            futures.append(pool.submit(fn, item))
        except RuntimeError:  # the interpreter is shutting down: no pool takes new work
            rest = items[index:]
            break
    try:
        return [future.result() for future in futures] + [fn(item) for item in rest]
    except BaseException:
        if on_error is not None:
            on_error()
        for future in futures:
            future.cancel()
        wait(futures)
        raise


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()
    _POOLS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def batches(items: Sequence[T], size: Callable[[T], int], budget: int) -> list[list[T]]:
    """Consecutive groups of ``items`` of at most ``budget`` bytes each (an item bigger than that alone)."""
    out: list[list[T]] = []
    taken = budget
    for item in items:
        nbytes = size(item)
        if not out or taken + nbytes > budget:
            out.append([])
            taken = 0
        out[-1].append(item)
        taken += nbytes
    return out
