"""The host buffers async saves stage into: reused by the next save by default, freed after the save with
``keep_buffers=False``, given back by ``release_host_buffers`` (which waits for, or refuses during, a save in
flight)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator

import pytest
import torch

import arrayckpt
import arrayckpt._write.packed as packed_module  # chunk_destination's write_all
from arrayckpt._write import asynchronous

STATE_BYTES = 1000 * 4 + 10 * 10 * 2  # what _state() stages: its tensors, not its plain value


def _state(value: float = 1.0) -> dict:
    return {"w": torch.full((1000,), value), "e": torch.full((10, 10), value, dtype=torch.bfloat16), "step": 3}


def _buffers() -> list[weakref.ref]:
    """Weak references to the memory of the staging buffers the stager holds now: to their storages, which live as
    long as anything views them (a numpy view of a buffer holds an alias tensor, not the buffer)."""
    return [weakref.ref(buffer.untyped_storage()) for buffer in asynchronous._STAGER._buffers.values()]


def _alive(refs: list[weakref.ref]) -> int:
    gc.collect()
    return sum(ref() is not None for ref in refs)


@pytest.fixture(autouse=True)
def _nothing_held() -> Iterator[None]:
    """Each test starts with no buffers held (other tests' saves leave theirs), and leaves none."""
    arrayckpt.release_host_buffers()
    yield
    arrayckpt.release_host_buffers()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The background writes wait until the event is set: a save stays in flight meanwhile."""
    event = threading.Event()
    real = packed_module.write_all

    def slow(*args, **kwargs):
        event.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(packed_module, "write_all", slow)
    return event


def test_by_default_the_second_save_stages_into_the_first_saves_buffers(tmp_path):
    arrayckpt.async_save(_state(1.0), tmp_path / "one").wait()
    first = dict(asynchronous._STAGER._buffers)
    assert asynchronous._STAGER.held_bytes() == STATE_BYTES
    arrayckpt.async_save(_state(2.0), tmp_path / "two").wait()
    second = asynchronous._STAGER._buffers
    assert first.keys() == second.keys() and all(second[slot] is buffer for slot, buffer in first.items())
    assert torch.equal(arrayckpt.open(tmp_path / "two")["w"].torch(), torch.full((1000,), 2.0))
    assert torch.equal(arrayckpt.open(tmp_path / "one")["w"].torch(), torch.full((1000,), 1.0))


def test_keep_buffers_false_holds_nothing_once_the_save_is_over(tmp_path, gate, monkeypatch):
    alive_after_release: list[int] = []  # what still held the buffers when the stager let them go
    real = asynchronous._STAGER.release
    monkeypatch.setattr(asynchronous._STAGER, "release", lambda: (real(), alive_after_release.append(_alive(staged))))
    handle = arrayckpt.async_save(_state(), tmp_path / "ckpt", keep_buffers=False)
    staged = _buffers()
    assert len(staged) == 2 and asynchronous._STAGER.held_bytes() == STATE_BYTES  # in flight: the save needs them
    gate.set()
    handle.wait()
    assert asynchronous._STAGER.held_bytes() == 0
    # freed at once: nothing else held them (the executor's arguments, the staged views), so that pinned memory
    # goes back to the driver there and then (release_pinned frees only what nobody holds)
    assert alive_after_release == [0] and _alive(staged) == 0
    assert torch.equal(arrayckpt.open(tmp_path / "ckpt")["w"].torch(), torch.ones(1000))
    arrayckpt.async_save(_state(2.0), tmp_path / "again", keep_buffers=False).wait()  # stages into new buffers
    assert torch.equal(arrayckpt.open(tmp_path / "again")["w"].torch(), torch.full((1000,), 2.0))


def test_keep_buffers_false_frees_them_when_the_save_fails_too(tmp_path, monkeypatch):
    monkeypatch.setattr(packed_module, "write_all", lambda *a, **k: (_ for _ in ()).throw(arrayckpt.StorageError("x")))
    handle = arrayckpt.async_save(_state(), tmp_path / "ckpt", keep_buffers=False)
    with pytest.raises(arrayckpt.StorageError, match="x"):
        handle.wait()
    assert asynchronous._STAGER.held_bytes() == 0


def test_release_gives_back_the_buffers_and_the_next_save_still_works(tmp_path):
    arrayckpt.async_save(_state(1.0), tmp_path / "one").wait()
    staged = _buffers()
    assert len(staged) == 2
    assert arrayckpt.release_host_buffers() == STATE_BYTES
    assert asynchronous._STAGER.held_bytes() == 0 and _alive(staged) == 0
    assert arrayckpt.release_host_buffers() == 0
    arrayckpt.async_save(_state(2.0), tmp_path / "two").wait()
    assert torch.equal(arrayckpt.open(tmp_path / "two")["w"].torch(), torch.full((1000,), 2.0))


def test_release_refuses_during_a_save_in_flight_or_waits_for_it(tmp_path, gate):
    handle = arrayckpt.async_save(_state(), tmp_path / "ckpt")
    with pytest.raises(arrayckpt.CheckpointBusyError, match="still running.*wait\\(\\) for it first"):
        arrayckpt.release_host_buffers(if_busy="error")
    assert asynchronous._STAGER.held_bytes() == STATE_BYTES  # refused: nothing released
    released: list[int] = []
    waiter = threading.Thread(target=lambda: released.append(arrayckpt.release_host_buffers()))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive() and not handle.done()  # waiting for the save, whose writes read the buffers
    gate.set()
    waiter.join(10)
    assert released == [STATE_BYTES] and handle.done()
    handle.wait()
    assert torch.equal(arrayckpt.open(tmp_path / "ckpt")["w"].torch(), torch.ones(1000))


def test_release_leaves_a_failed_saves_error_to_its_handle(tmp_path, monkeypatch):
    monkeypatch.setattr(packed_module, "write_all", lambda *a, **k: (_ for _ in ()).throw(arrayckpt.StorageError("x")))
    handle = arrayckpt.async_save(_state(), tmp_path / "ckpt")
    arrayckpt.release_host_buffers()  # waits for the save; does not raise its error
    assert handle.done()
    with pytest.raises(arrayckpt.StorageError, match="x"):
        handle.wait()


@pytest.mark.parametrize(("keep_buffers", "held"), [(True, 2 * STATE_BYTES), (False, STATE_BYTES)])
def test_keep_copy_is_kept_whatever_keep_buffers_says(tmp_path, keep_buffers, held):
    for name in ("one", "two"):  # the second stages into the first's buffers unless they were freed
        arrayckpt.async_save(_state(), tmp_path / name, keep_copy=True, keep_buffers=keep_buffers).wait()
    assert asynchronous._STAGER.held_bytes() == held
    assert asynchronous._STAGER.kept_id == arrayckpt.open(tmp_path / "two").manifest.id
    assert arrayckpt.release_host_buffers() == held
    assert asynchronous._STAGER.kept_id is None
