"""Async saves: the caller blocks only for staging; the result equals a synchronous save bit for bit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from helpers import assert_bit_equal, random_tensor

import arrayckpt
import arrayckpt._write.packed as packed_module
import arrayckpt._write.save as save_module

pytestmark = pytest.mark.usefixtures("storage_layout")  # every test holds in both layouts (spec §2, §16)


def _state() -> dict:
    model = torch.nn.Linear(6, 4)
    return {"model": model, "emb": random_tensor((50, 8), torch.bfloat16), "step": 3,
            "view": torch.arange(24.0).reshape(4, 6).t(), "np": random_tensor((5,), torch.int32).numpy()}


def test_async_result_equals_sync_even_when_training_mutates_right_away(tmp_path):
    state = _state()
    arrayckpt.save(state, tmp_path / "sync")
    expected = {k: a.torch() for k, a in arrayckpt.open(tmp_path / "sync").items()}
    handle = arrayckpt.async_save(state, tmp_path / "async", step=3)
    with torch.no_grad():  # the training loop moves on at once
        state["model"].weight.add_(1.0)
        state["emb"].zero_()
        state["view"].fill_(-1)
    state["np"][:] = 0
    handle.wait()
    assert handle.done() and handle.blocking_seconds > 0
    opened = arrayckpt.open(tmp_path / "async")
    assert opened.step == 3 and sorted(opened) == sorted(expected)
    for key, value in expected.items():
        assert_bit_equal(opened[key].torch(), value)


def test_background_failure_surfaces_on_wait_and_nothing_is_committed(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise arrayckpt.StorageError("disk on fire")

    monkeypatch.setattr(save_module, "_write_jobs", broken)
    handle = arrayckpt.async_save({"w": torch.ones(3)}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.StorageError, match="disk on fire"):
        handle.wait()
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    # the failure was seen: the next save goes ahead (and an unseen failure would be raised here)
    arrayckpt.async_save({"w": torch.ones(3)}, tmp_path / "ckpt").wait()
    assert "w" in arrayckpt.open(tmp_path / "ckpt")


def test_unseen_background_failure_is_raised_by_the_next_save(tmp_path, monkeypatch):
    monkeypatch.setattr(save_module, "_write_jobs", lambda *a, **k: (_ for _ in ()).throw(arrayckpt.StorageError("x")))
    first = arrayckpt.async_save({"w": torch.ones(3)}, tmp_path / "a")
    while not first.done():  # let it fail without calling wait()
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(arrayckpt.StorageError, match="x"):
        arrayckpt.async_save({"w": torch.ones(3)}, tmp_path / "b")
    arrayckpt.async_save({"w": torch.ones(3)}, tmp_path / "b").wait()


def test_second_save_waits_or_refuses_while_the_first_runs(tmp_path, monkeypatch):
    import threading

    gate = threading.Event()
    real = packed_module.write_all  # chunk_destination's

    def slow(*args, **kwargs):
        gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(packed_module, "write_all", slow)
    first = arrayckpt.async_save({"w": torch.ones(3)}, tmp_path / "one")
    with pytest.raises(arrayckpt.CheckpointBusyError, match="still running"):
        arrayckpt.async_save({"w": torch.ones(3)}, tmp_path / "two", if_busy="error")
    assert not first.done()
    gate.set()
    second = arrayckpt.async_save({"w": torch.zeros(3)}, tmp_path / "two")  # waits for the first
    assert first.done()
    second.wait()
    assert torch.equal(arrayckpt.open(tmp_path / "two")["w"].torch(), torch.zeros(3))


def test_bad_state_fails_at_once_in_a_single_process(tmp_path):
    with pytest.raises(arrayckpt.PickleNotAllowedError):
        arrayckpt.async_save({"x": object()}, tmp_path / "ckpt")


def _async_two_ranks(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(40.0).reshape(10, 4)
    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "rep": torch.ones(5)}
    handle = arrayckpt.async_save(state, path)
    state["w"].to_local().zero_()
    torch.distributed.barrier()  # training collectives go on while the save runs in the background
    handle.wait()


@pytest.mark.slow
def test_multi_rank_async_save(tmp_path: Path):
    run_ranks(2, _async_two_ranks, str(tmp_path / "ckpt"))
    opened = arrayckpt.open(tmp_path / "ckpt")
    assert torch.equal(opened["w"].torch(), torch.arange(40.0).reshape(10, 4))
    assert torch.equal(opened["rep"].torch(), torch.ones(5))
