"""CheckpointManager: intervals, retention, resume from the newest committed checkpoint, preemption."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import arrayckpt

pytestmark = pytest.mark.usefixtures("storage_layout")  # every test holds in both layouts (spec §2, §16)


def _state(value: float) -> dict:
    return {"w": torch.full((4,), value), "step": int(value)}


def test_interval_every_steps_and_retention_keep_last_and_every(tmp_path):
    manager = arrayckpt.CheckpointManager(tmp_path, interval=arrayckpt.Interval(every_steps=2),
                                          retention=arrayckpt.Retention(keep_last=2, keep_every=4))
    saved = [step for step in range(1, 13) if manager.save(step, _state(step))]
    assert saved == [2, 4, 6, 8, 10, 12]
    assert manager.steps() == [4, 8, 10, 12]  # the last two, and every multiple of 4
    assert manager.save(13, _state(13), force=True)
    assert manager.steps() == [4, 8, 12, 13]


def test_keep_best_by_metric(tmp_path):
    manager = arrayckpt.CheckpointManager(
        tmp_path, retention=arrayckpt.Retention(keep_last=1, keep_best=2, metric="val_loss", mode="min"))
    losses = {1: 3.0, 2: 1.0, 3: 2.5, 4: 0.5, 5: 4.0}
    for step, loss in losses.items():
        manager.save(step, _state(step), metrics={"val_loss": loss})
    assert manager.steps() == [2, 4, 5]  # best two (4, 2) and the newest (5)
    assert arrayckpt.open(manager.path(4)).metrics == {"val_loss": 0.5}


def test_restore_picks_the_newest_committed_checkpoint_after_a_crash(tmp_path):
    manager = arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=None))
    for step in (1, 2):
        manager.save(step, _state(step))
    (tmp_path / "step-00000003").mkdir()  # a crash mid-save on a filesystem without atomic rename
    (tmp_path / ".step-00000004.arrayckpt-tmp-0123456789ab").mkdir()  # a crash before the rename
    fresh = arrayckpt.CheckpointManager(tmp_path)
    assert fresh.steps() == [1, 2] and fresh.latest_step() == 2
    target = _state(0)
    assert fresh.restore(target) == 2
    assert torch.equal(target["w"], torch.full((4,), 2.0)) and target["step"] == 2
    assert fresh.restore(target, step=1) == 1 and target["step"] == 1
    with pytest.raises(arrayckpt.CheckpointNotFoundError, match="no committed checkpoint for step 3"):
        fresh.restore(target, step=3)
    assert arrayckpt.CheckpointManager(tmp_path / "empty").restore(target) is None


def test_asynchronous_manager_matches_synchronous(tmp_path):
    with arrayckpt.CheckpointManager(tmp_path, asynchronous=True,
                                     retention=arrayckpt.Retention(keep_last=2)) as manager:
        w = torch.zeros(1000)
        for step in range(1, 5):
            w.fill_(step)
            assert manager.save(step, {"w": w})
            w.fill_(-1)  # training mutates right after the save returns
    assert manager.steps() == [3, 4]
    assert torch.equal(arrayckpt.open(manager.path(4))["w"].torch(), torch.full((1000,), 4.0))


@pytest.mark.parametrize(("keep_buffers", "held"), [(True, 4000), (False, 0)])
def test_asynchronous_manager_keeps_or_frees_the_staging_buffers(tmp_path, keep_buffers, held):
    from arrayckpt._write.asynchronous import _STAGER

    arrayckpt.release_host_buffers()  # (other tests' saves leave theirs)
    with arrayckpt.CheckpointManager(tmp_path, asynchronous=True, keep_buffers=keep_buffers) as manager:
        for step in (1, 2):
            manager.save(step, {"w": torch.full((1000,), float(step))})
        manager.wait()
        assert _STAGER.held_bytes() == held  # the option reached the save
    assert torch.equal(arrayckpt.open(manager.path(2))["w"].torch(), torch.full((1000,), 2.0))
    arrayckpt.release_host_buffers()


def test_steps_must_increase(tmp_path):
    manager = arrayckpt.CheckpointManager(tmp_path)
    manager.save(5, _state(5))
    with pytest.raises(arrayckpt.StateError, match="not after the last saved step 5"):
        manager.save(5, _state(5), force=True)


def test_daly_interval_from_measured_blocking_time(tmp_path):
    manager = arrayckpt.CheckpointManager(tmp_path, interval=arrayckpt.Interval(mtbf_hours=1e-9))
    assert manager.save(1, _state(1))  # the first save measures the blocking time
    time.sleep(0.01)  # with an MTBF of 3.6 microseconds, Daly says: save again at once
    assert manager.should_save(2)
    patient = arrayckpt.CheckpointManager(tmp_path / "p", interval=arrayckpt.Interval(mtbf_hours=1e6))
    patient.save(1, _state(1))
    assert not patient.should_save(2)


@pytest.mark.slow
def test_sigterm_completes_a_save_before_exiting(tmp_path):
    script = textwrap.dedent(f"""
        import signal, sys, time, torch, arrayckpt
        manager = arrayckpt.CheckpointManager({str(tmp_path)!r}, interval=arrayckpt.Interval(every_steps=1000))
        step = 0
        w = torch.zeros(8)
        manager.save_on_sigterm(lambda: (step, {{"w": w}}))
        print("ready", flush=True)
        while True:
            step += 1
            w.fill_(step)
            time.sleep(0.001)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == -signal.SIGTERM
    manager = arrayckpt.CheckpointManager(tmp_path)
    step = manager.latest_step()
    assert step is not None and step > 0
    assert torch.equal(arrayckpt.open(manager.path(step))["w"].torch(), torch.full((8,), float(step)))


def test_clean_up_removes_incomplete_steps_and_old_leftovers(tmp_path):
    import os
    import time

    manager = arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=None))
    manager.save(1, {"w": torch.ones(2)})
    (tmp_path / "step-00000002").mkdir()
    (tmp_path / "step-00000002" / "w").mkdir()  # an incomplete step: no root zarr.json
    (tmp_path / "step-00000000").mkdir()
    (tmp_path / "step-00000000" / "zarr.json").write_text("{damaged")  # unreadable, not incomplete: kept
    manager.save(3, {"w": torch.ones(2)})
    leftover = tmp_path / ".step-00000004.arrayckpt-tmp-0123456789ab"
    leftover.mkdir()
    old = time.time() - 7200
    for path in (leftover, tmp_path / "step-00000002" / "w", tmp_path / "step-00000002"):
        os.utime(path, (old, old))  # untouched for long enough (younger ones are kept: a save may be running)
    assert manager.steps() == [1, 3]
    removed = manager.clean_up()
    assert sorted(removed) == sorted([str(tmp_path / "step-00000002"), str(leftover)])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".arrayckpt-manager.lock", "step-00000000", "step-00000001",
                                                         "step-00000003"]  # (the lock: the manager is open)


def test_interval_steps_stay_aligned_after_an_off_interval_save(tmp_path):
    """Orbax's rule: saves at multiples of every_steps; a forced save at 17 does not move the next one to 22."""
    manager = arrayckpt.CheckpointManager(tmp_path, interval=arrayckpt.Interval(every_steps=5))
    state = {"w": torch.zeros(2)}
    saved = [step for step in range(1, 31) if manager.save(step, state, force=step == 17)]
    assert saved == [5, 10, 15, 17, 20, 25, 30]
    skipping = arrayckpt.CheckpointManager(tmp_path / "sparse", interval=arrayckpt.Interval(every_steps=5))
    assert [s for s in (3, 5, 8, 12, 14, 16) if skipping.save(s, state)] == [5, 12, 16]  # 10 and 15 passed by
