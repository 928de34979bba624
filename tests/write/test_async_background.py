"""What the background of an async save does to the training loop beside it: no collector runs that hold the GIL
for a heap walk, and the IO worker threads it starts run at a lower CPU priority (never the caller's threads)."""

from __future__ import annotations

import gc
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import assert_bit_equal

import arrayckpt
import arrayckpt._io.priority as priority
import arrayckpt._write.save as save_module
from arrayckpt._io.arrays import collector_paused
from arrayckpt._settings import settings

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_collector_pauses_overlapping_in_two_threads_end_with_the_last():
    """The async save's thread pauses the collector, a synchronous load in the training thread pauses it too, and
    the save ends first: the collector must stay off until the load ends, and be on again after."""
    assert gc.isenabled()
    entered, release = threading.Event(), threading.Event()

    def background() -> None:
        with collector_paused():
            entered.set()
            release.wait()

    thread = threading.Thread(target=background)
    thread.start()
    entered.wait()
    with collector_paused():
        release.set()
        thread.join()  # the background pause ended inside this one
        still_paused = not gc.isenabled()
    assert still_paused and gc.isenabled()


def test_collector_left_off_when_it_was_off_before():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


@linux_only
def test_workers_started_inside_background_priority_are_niced_and_the_caller_is_not():
    before = _niceness()
    assert priority.worker_initializer() is None  # outside: workers run as their creator
    with priority.background_priority(3):
        with ThreadPoolExecutor(1, initializer=priority.worker_initializer()) as pool:
            worker = pool.submit(_niceness).result()
    assert worker == min(19, before + 3)
    assert _niceness() == before and priority.worker_initializer() is None


@linux_only
def test_async_save_writes_on_niced_workers_with_the_collector_paused(tmp_path, monkeypatch):
    """Big enough for the fast path to start worker threads (more than INLINE_BYTES); the sync save of the same
    state starts them at normal priority."""
    seen: dict[str, list] = {"nice": [], "collector": []}
    lower, finish = priority.lower_this_thread, save_module.finish_save

    def spy_lower(nice: int) -> None:
        seen["nice"].append(nice)
        lower(nice)

    def spy_finish(*args, **kwargs):
        seen["collector"].append(gc.isenabled())
        return finish(*args, **kwargs)

    monkeypatch.setattr(priority, "lower_this_thread", spy_lower)
    monkeypatch.setattr("arrayckpt._write.asynchronous.finish_save", spy_finish)
    state = {"a": torch.randn(1024, 1024), "b": torch.randn(1024, 1024)}  # 8 MiB, two chunk files
    arrayckpt.save(state, tmp_path / "sync")
    assert seen["nice"] == []
    handle = arrayckpt.async_save(state, tmp_path / "async")
    handle.wait()
    assert seen["nice"] and set(seen["nice"]) == {settings().background_nice}
    assert seen["collector"] == [False] and gc.isenabled()
    opened = arrayckpt.open(tmp_path / "async")
    for key, value in state.items():
        assert_bit_equal(opened[key].torch(), value)


def test_collector_pause_with_a_limit_ends_after_it_and_its_block_exit_is_then_ignored():
    """A long background save (minutes of upload) holds the collector off only for ``limit_s``; the pause of another
    block still open keeps it off, and the late exit of the limited block does not end that other pause."""
    assert gc.isenabled()
    expired = threading.Event()
    with collector_paused(limit_s=0.05):
        assert not gc.isenabled()
        for _ in range(200):
            if gc.isenabled():
                expired.set()
                break
            threading.Event().wait(0.01)
        with collector_paused():  # a synchronous load starts now
            pass
        assert gc.isenabled()
    assert expired.is_set() and gc.isenabled()
    with collector_paused():
        with collector_paused(limit_s=0.01):
            threading.Event().wait(0.2)
        assert not gc.isenabled()  # the outer (unlimited) pause is still open
    assert gc.isenabled()


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("5", 5), ("19", 19), ("25", 10), ("x", 10), ("-1", 10)])
def test_background_niceness_from_the_environment(value, expected):
    import warnings

    from arrayckpt._settings import Settings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an invalid value is said, and ignored
        assert Settings.from_environ({"ARRAYCKPT_BACKGROUND_NICE": value}).background_nice == expected
