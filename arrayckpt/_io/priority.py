"""Background IO that yields the CPU to training: IO worker threads started for a background save run niced.

An asynchronous save writes while the training loop runs. Where cores are short (a CPU-bound loop, data loader
workers, several ranks per node), the writer's threads — crc32c and copies into the page cache, all CPU — take
cores from the loop: measured on 2 busy cores, a 383 MiB save written by two threads at normal priority made
training steps 3-4x slower while it ran. At niceness +10 the kernel gives the loop the cores it wants and the
writer what is left (steps 1.2-1.5x slower, the save up to 2.4x longer, about as much training time lost per save);
where cores are free, nothing changes.

Only the worker threads that the IO layer starts for a transfer are niced (a thread's niceness can only go up
without privileges, and threads inherit their creator's): never the calling thread, which holds the GIL between
calls (a niced thread preempted while holding it would stall the loop), and never a pool that outlives the save
(TensorStore's, which later synchronous saves and loads use). Linux only: elsewhere a thread's niceness is its
process's. ``ARRAYCKPT_BACKGROUND_NICE`` (0..19; 0: no change) sets the step for a job whose loop does not need
the cores (a GPU-bound loop with idle host cores: the save then finishes sooner).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator

from .._settings import settings

__all__ = ["background_priority", "lower_this_thread", "worker_initializer"]

_LOCAL = threading.local()


@contextlib.contextmanager
def background_priority(nice: int | None = None) -> Iterator[None]:
    """Inside, IO worker threads that this thread starts (:func:`worker_initializer`) run ``nice`` steps lower
    (``background_nice`` of ``_settings.py`` by default)."""
    previous = getattr(_LOCAL, "nice", 0)
    _LOCAL.nice = settings().background_nice if nice is None else nice
    try:
        yield
    finally:
        _LOCAL.nice = previous


def worker_initializer() -> Callable[[], None] | None:
    """The ``initializer`` for the IO worker threads the calling thread starts now: lowers their priority inside
    :func:`background_priority`, else ``None`` (they run as the caller does)."""
    nice = getattr(_LOCAL, "nice", 0)
    if nice <= 0 or not sys.platform.startswith("linux"):
        return None
    return lambda: lower_this_thread(nice)


def lower_this_thread(nice: int) -> None:
    """Raise this thread's niceness by ``nice`` (capped at 19). A failure leaves it as it was: priority is a
    preference, never a reason for a save to fail."""
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
