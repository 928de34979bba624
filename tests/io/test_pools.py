"""The worker pools kept for the process (``_io/pools.py``): reused between calls, and usable after a fork."""

from __future__ import annotations

import subprocess
import sys

import pytest

import arrayckpt
from arrayckpt._io.pools import kept_pool


def test_a_kept_pool_is_the_same_threads_from_call_to_call():
    pool = kept_pool("test-reuse", 2)
    assert list(pool.map(lambda x: x + 1, range(8))) == list(range(1, 9))
    threads = set(pool._threads)
    assert kept_pool("test-reuse", 2) is pool
    assert list(pool.map(lambda x: x * 2, range(8))) == [x * 2 for x in range(8)]
    assert set(pool._threads) == threads and 1 <= len(threads) <= 2


@pytest.mark.slow
def test_a_forked_child_gets_pools_of_its_own(tmp_path):
    """A child made by ``fork`` (a data loader's worker, a launcher) inherits the parent's pool objects but not their
    threads: without a fresh pool its first save would wait forever. Forked from a fresh interpreter (forking the
    test process, with the threads other tests left, could deadlock on a lock one of them held)."""
    script = f"""
import os, signal, sys, torch, arrayckpt
from arrayckpt._io.pools import kept_pool
from arrayckpt._settings import settings
pools = [("io", settings().io_threads), ("fsync", settings().fsync_threads)]
for name, threads in pools:  # the parent's pools exist, and have a thread idle
    kept_pool(name, threads).submit(lambda: None).result()
pid = os.fork()
if pid == 0:  # the child: a task on each kept pool, a save and a load through them; the alarm ends a hang
    code = 1
    try:
        signal.alarm(60)
        assert all(kept_pool(name, threads).submit(lambda: 7).result() == 7 for name, threads in pools)
        state = {{f"t{{i}}": torch.full((512, 256), float(i)) for i in range(8)}}  # 4 MiB: more than runs inline
        arrayckpt.save(state, {str(tmp_path / "c")!r})
        out = {{key: value.clone().zero_() for key, value in state.items()}}
        arrayckpt.load(out, {str(tmp_path / "c")!r})
        code = 0 if all(out[key].equal(state[key]) for key in state) else 2
    finally:
        os._exit(code)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])


def test_map_kept_raises_only_once_every_started_task_ended():
    """A failed transfer must not leave others writing into buffers its caller hands back or reuses."""
    import threading
    import time

    import pytest

    from arrayckpt._io.pools import map_kept

    ended: list[int] = []
    stop = threading.Event()

    def task(i: int) -> int:
        if i == 0:
            raise OSError("disk gone")
        for _ in range(50):  # a long transfer that looks at the stop flag between pieces
            if stop.is_set():
                break
            time.sleep(0.01)
        ended.append(i)
        return i

    with pytest.raises(OSError, match="disk gone"):
        map_kept("test-errors", 2, task, list(range(4)), on_error=stop.set)
    assert stop.is_set()
    snapshot = list(ended)
    time.sleep(0.2)
    assert ended == snapshot  # nothing still running after the raise
    assert list(map_kept("test-errors", 2, lambda x: x * x, [1, 2, 3])) == [1, 4, 9]


@pytest.mark.slow
def test_a_save_from_an_atexit_handler_still_fsyncs_and_commits(tmp_path):
    """Once the interpreter shuts down no pool takes new work: the transfers and the fsyncs run on the calling thread
    (a final save from an ``atexit`` handler, or a background save ending as the main thread returns)."""
    script = f"""
import atexit, torch, arrayckpt
path = {str(tmp_path / "c")!r}
def final():
    arrayckpt.save({{"w": torch.ones(512, 1024), "v": torch.zeros(512, 1024), "step": 1}}, path)
    print("saved", flush=True)
atexit.register(final)
arrayckpt.save({{"w": torch.ones(512, 1024), "v": torch.zeros(512, 1024)}}, path + "0")  # the kept pools exist
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "saved" in done.stdout, done.stderr[-2000:]
    with arrayckpt.open(tmp_path / "c") as checkpoint:
        assert checkpoint.plain_values["step"] == 1 and checkpoint["w"][:].sum() == 512 * 1024
