"""The worker pools kept for the process (``_io/pools.py``): reused between calls, and usable after a fork."""

from __future__ import annotations

import os
import signal

import arrayckpt
from arrayckpt._io.fastio import IO_THREADS
from arrayckpt._io.pools import kept_pool


def test_a_kept_pool_is_the_same_threads_from_call_to_call():
    pool = kept_pool("test-reuse", 2)
    assert list(pool.map(lambda x: x + 1, range(8))) == list(range(1, 9))
    threads = set(pool._threads)
    assert kept_pool("test-reuse", 2) is pool
    assert list(pool.map(lambda x: x * 2, range(8))) == [x * 2 for x in range(8)]
    assert set(pool._threads) == threads and 1 <= len(threads) <= 2


def test_a_forked_child_gets_pools_of_its_own(tmp_path):
    """A child made by ``fork`` (a data loader's worker, a launcher) inherits the parent's pool objects but not their
    threads: without a fresh pool its first save would wait forever."""
    pools = [("io", IO_THREADS), ("fsync", 16)]
    for name, threads in pools:  # the parent's pools exist, and have a thread idle
        kept_pool(name, threads).submit(lambda: None).result()
    pid = os.fork()
    if pid == 0:  # the child: a save and a load through the kept pools, killed by the alarm if they hang
        code = 1
        try:
            signal.alarm(60)
            assert all(kept_pool(name, threads).submit(lambda: 7).result() == 7 for name, threads in pools)
            state = {f"t{i}": arrayckpt_tensor(i) for i in range(8)}
            arrayckpt.save(state, tmp_path / "c")
            out = {key: value.clone().zero_() for key, value in state.items()}
            arrayckpt.load(out, tmp_path / "c")
            code = 0 if all(out[key].equal(state[key]) for key in state) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def arrayckpt_tensor(i: int):
    import torch

    return torch.full((512, 256), float(i))  # 8 x 512 KiB: more than the fast path runs on the calling thread
