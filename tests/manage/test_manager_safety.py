"""CheckpointManager safety: clean-up removes only arrayckpt's leftovers, retention never reaches outside the root
and deletes in a crash-consistent order, SIGTERM is handled once (issue 13, items 1-3 and 13)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import arrayckpt


def _age(path, seconds=7200.0):
    """Make everything below ``path`` look untouched for ``seconds``."""
    old = time.time() - seconds
    for directory, _, files in os.walk(path):
        for name in (directory, *(os.path.join(directory, f) for f in files)):
            os.utime(name, (old, old), follow_symlinks=False)


# --- item 13: SIGTERM twice, with an async save in flight ------------------------------------------------------

_SIGTERM_CHILD = """
import os, signal, sys, threading, time, torch, arrayckpt
from arrayckpt._storage import local

gate = threading.Event()
commit = local.LocalWriter.commit
def slow_commit(self, document):  # each commit waits for the first SIGTERM, then takes a while
    if not gate.wait(30):
        print("gate never opened", flush=True)
    print("commit", self.location.path.name, flush=True)
    for _ in range(50):
        time.sleep(0.01)
    commit(self, document)
local.LocalWriter.commit = slow_commit

manager = arrayckpt.CheckpointManager({root!r}, asynchronous=True, retention=arrayckpt.Retention(keep_last=None),
                                      interval=arrayckpt.Interval(every_steps=1000))
step, w = 5, torch.full((8,), 5.0)
manager.save_on_sigterm(lambda: (step, {{"w": w}}))
installed = signal.getsignal(signal.SIGTERM)
count = 0
def counting(signum, frame):  # counts the signals that reach Python, then hands each to the manager's handler
    global count
    count += 1
    print(f"signal {{count}}", flush=True)
    gate.set()
    installed(signum, frame)
signal.signal(signal.SIGTERM, counting)
manager.save(5, {{"w": w}}, force=True)  # in flight until the gate opens
step = {next_step}
w = torch.full((8,), float(step))
print("ready", flush=True)
{then}
"""


@pytest.mark.slow
@pytest.mark.parametrize("next_step, then", [
    (6, "while True: time.sleep(0.01)"),  # training went on: both the in-flight save and a new one commit
    (5, "while True: time.sleep(0.01)"),  # nothing new to save: the in-flight save must still commit
    (5, "manager.wait()"),  # the signals arrive while the main thread waits for the save itself
], ids=["newer-step", "same-step", "during-wait"])
def test_sigterm_twice_finishes_the_save_in_flight_then_saves_and_exits(tmp_path, next_step, then):
    script = _SIGTERM_CHILD.format(root=str(tmp_path), next_step=next_step, then=then)
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        lines = [proc.stdout.readline().strip()]
        assert lines == ["signal 1"]
        while lines[-1] not in ("commit step-00000006", ""):  # the handler's own save, or exit
            if lines[-1] == "commit step-00000005" and next_step == 5:
                break
            lines.append(proc.stdout.readline().strip())
        proc.send_signal(signal.SIGTERM)  # while the handler saves
        out = "\n".join(lines) + "\n" + proc.stdout.read()
        status = proc.wait(timeout=120)
    finally:
        proc.kill()
    assert status == -signal.SIGTERM, out
    assert "gate never opened" not in out
    manager = arrayckpt.CheckpointManager(tmp_path)
    assert manager.steps() == sorted({5, next_step})
    for step in manager.steps():
        assert torch.equal(arrayckpt.open(manager.path(step))["w"].torch(), torch.full((8,), float(step)))


# --- item 1: clean_up removes only what arrayckpt wrote -------------------------------------------------------


def _incomplete_step(manager, step, value=1.0):
    """A step whose deletion was cut short after its root document: arrayckpt's files, no root."""
    manager.save(step, {"w": torch.full((4,), value)}, force=True)
    os.unlink(manager.path(step) / "zarr.json")


def test_clean_up_leaves_a_users_step_named_directory_and_young_leftovers(tmp_path):
    manager = arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=None))
    _incomplete_step(manager, 1)  # arrayckpt's, old: removed
    _incomplete_step(manager, 2)  # arrayckpt's, but just written: kept (maybe a save in progress)
    user = tmp_path / "step-00000003"
    (user / "data").mkdir(parents=True)
    (user / "data" / "notes.txt").write_text("mine")
    (user / "data" / "0.1").write_text("numbered, but not arrayckpt's")
    plain = tmp_path / "step-00000004"
    plain.mkdir()
    (plain / "0").write_text("only chunk-named files: no evidence")
    empty = tmp_path / "step-00000005" / "w"
    empty.mkdir(parents=True)
    manager.save(9, {"w": torch.ones(4)}, force=True)
    for path in (manager.path(1), user, plain, empty.parent):
        _age(path)
    with pytest.warns(RuntimeWarning, match="not known to be arrayckpt's leftovers"):
        removed = manager.clean_up()
    assert sorted(removed) == [str(manager.path(1)), str(manager.path(5))]
    assert (user / "data" / "notes.txt").read_text() == "mine" and (user / "data" / "0.1").exists()
    assert (plain / "0").exists() and manager.path(2).is_dir() and not manager.path(1).exists()
    why = dict(manager.kept)
    assert "not arrayckpt's" in why[str(user)] and "maybe still being saved" in why[str(manager.path(2))]
    assert "no zarr.json of an arrayckpt array" in why[str(plain)]
    assert manager.steps() == [9]


def test_clean_up_never_follows_a_link_inside_an_incomplete_step(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "zarr.json").write_text("{}")
    manager = arrayckpt.CheckpointManager(tmp_path / "run", retention=arrayckpt.Retention(keep_last=None))
    _incomplete_step(manager, 1)
    os.symlink(outside, manager.path(1) / "linked")
    manager.save(2, {"w": torch.ones(4)}, force=True)
    _age(manager.path(1))
    with pytest.warns(RuntimeWarning, match="a link or special file"):
        assert manager.clean_up() == []
    assert (outside / "zarr.json").exists() and (manager.path(1) / "w" / "zarr.json").exists()


# --- item 2: retention never reaches through a symlinked step -----------------------------------------------


def test_retention_removes_a_symlinked_step_as_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    arrayckpt.save({"w": torch.full((4,), 7.0)}, elsewhere)
    manager = arrayckpt.CheckpointManager(tmp_path / "run", retention=arrayckpt.Retention(keep_last=1))
    os.symlink(elsewhere, manager.path(1))
    assert manager.steps() == [1]
    manager.save(2, {"w": torch.ones(4)}, force=True)
    assert manager.steps() == [2] and not os.path.lexists(manager.path(1))
    assert torch.equal(arrayckpt.open(elsewhere)["w"].torch(), torch.full((4,), 7.0))  # untouched


def test_delete_of_a_committed_checkpoint_keeps_files_that_are_not_arrayckpts(tmp_path):
    manager = arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=1))
    manager.save(1, {"w": torch.ones(4)}, force=True)
    (manager.path(1) / "w" / "README").write_text("mine")
    manager.save(2, {"w": torch.ones(4)}, force=True)
    assert manager.steps() == [2]
    assert sorted(str(p.relative_to(manager.path(1))) for p in manager.path(1).rglob("*")) == ["w", "w/README"]


# --- item 3: deletions in a crash-consistent order; clean_up removes deltas whose base is gone ---------------


def _delta_manager(root):
    return arrayckpt.CheckpointManager(root, retention=arrayckpt.Retention(keep_last=1),
                                       incremental=arrayckpt.Incremental(max_chain_ratio=100.0))


@pytest.mark.parametrize("crash_after", [1, 2, 3])
def test_a_retention_cut_short_leaves_only_readable_steps_and_clean_up_finishes(tmp_path, monkeypatch, crash_after):
    manager = _delta_manager(tmp_path)
    w = torch.zeros(64)
    for step in range(1, 4):  # step 1 full, 2 and 3 deltas: a chain 3 -> 2 -> 1
        w[step] = step
        manager.save(step, {"w": w.clone()})
    manager.retention = arrayckpt.Retention(keep_last=None)
    manager.save(4, {"w": w.clone()})  # kept chain: 4 -> 3 -> 2 -> 1
    manager.incremental = None
    manager.save(5, {"w": w.clone()})  # a full checkpoint: 1..4 are no longer needed
    assert manager.steps() == [1, 2, 3, 4, 5]
    manager.retention = arrayckpt.Retention(keep_last=1)
    calls = []
    delete = type(manager._local.tree.step_location(1)).delete

    def crashing_delete(location):
        if len(calls) == crash_after:
            raise KeyboardInterrupt("killed mid-retention")
        calls.append(location.path.name)
        delete(location)

    monkeypatch.setattr(type(manager._local.tree.step_location(1)), "delete", crashing_delete)
    with pytest.raises(KeyboardInterrupt, match="killed mid-retention"):
        manager._apply_retention()
    monkeypatch.undo()
    assert calls == ["step-00000004", "step-00000003", "step-00000002"][:crash_after]  # deltas before bases
    for step in manager.steps():  # every state a crash leaves: every listed step reads
        assert torch.equal(arrayckpt.open(manager.path(step))["w"].torch()[:step + 1], w[:step + 1])
    manager._apply_retention()
    assert manager.steps() == [5]


def test_clean_up_removes_committed_deltas_whose_base_is_gone(tmp_path):
    manager = _delta_manager(tmp_path)
    manager.retention = arrayckpt.Retention(keep_last=None)
    w = torch.zeros(64)
    for step in range(1, 4):
        w[step] = step
        manager.save(step, {"w": w.clone()})
    manager.incremental = None
    manager.save(4, {"w": torch.zeros(8)})
    manager._local.tree.step_location(1).delete()  # an old retention deleted the base before its deltas, then died
    with pytest.raises(arrayckpt.CheckpointNotFoundError, match="its base checkpoint"):
        arrayckpt.load({"w": torch.zeros(64)}, manager.path(2))
    assert manager.steps() == [2, 3, 4]
    removed = manager.clean_up()
    assert sorted(removed) == [str(manager.path(2)), str(manager.path(3))]
    assert manager.steps() == [4]


def test_clean_up_keeps_deltas_whose_base_cannot_be_read_for_another_reason(tmp_path, monkeypatch):
    manager = _delta_manager(tmp_path)
    manager.retention = arrayckpt.Retention(keep_last=None)
    for step in range(1, 3):
        manager.save(step, {"w": torch.full((8,), float(step))})
    read_root = type(manager._local.tree.step_location(1)).read_root

    def flaky(location):
        if location.path.name == "step-00000001":
            raise arrayckpt.StorageError("transient")
        return read_root(location)

    monkeypatch.setattr(type(manager._local.tree.step_location(1)), "read_root", flaky)
    assert manager.clean_up() == []
    monkeypatch.undo()
    assert manager.steps() == [1, 2]
