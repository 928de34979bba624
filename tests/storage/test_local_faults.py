"""A local directory under faults: a full disk, two writers racing for the same path, a checkpoint path that is a
link, leftovers that are links or cannot be removed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import arrayckpt


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_full_disk_fails_clearly_and_keeps_older_checkpoints(small_disk, codec):
    older = torch.arange(1000, dtype=torch.float32)
    arrayckpt.save({"w": older}, small_disk / "step-1")
    too_big = {"w": torch.randn(2, 1 << 20)}  # 8 MiB of noise on a 4 MiB disk
    with pytest.raises(arrayckpt.StorageError, match=r"step-2.*'w'") as info:
        arrayckpt.save(too_big, small_disk / "step-2", codec=codec)
    assert "No space left" in str(info.value) or "ENOSPC" in str(info.value) or "space" in str(info.value).lower()
    assert sorted(p.name for p in small_disk.iterdir()) == ["step-1"]  # no partial checkpoint, no temp left
    assert torch.equal(arrayckpt.open(small_disk / "step-1")["w"].torch(), older)


_RACER = textwrap.dedent(
    """
    import sys, torch, arrayckpt
    value = float(sys.argv[2])
    try:
        arrayckpt.save({"w": torch.full((256, 256), value)}, sys.argv[1])
        print("won")
    except arrayckpt.CheckpointExistsError as e:
        print("lost:", e)
    """
)


@pytest.mark.slow
def test_two_writers_racing_for_one_path_one_wins_cleanly(tmp_path):
    path = tmp_path / "ckpt"
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(path), str(v)], stdout=subprocess.PIPE, text=True)
              for v in (1.0, 2.0)]
    outputs = [r.communicate(timeout=120)[0].strip() for r in racers]
    assert sorted(o.split(":")[0] for o in outputs) == ["lost", "won"], outputs
    winner = 1.0 if outputs[0] == "won" else 2.0
    assert torch.equal(arrayckpt.open(path)["w"].torch(), torch.full((256, 256), winner))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the loser cleaned up after itself


def test_overwrite_through_a_symlinked_path_replaces_the_target_and_leaves_nothing(tmp_path: Path) -> None:
    """Issue 13 item 14: a checkpoint path that is a link to a checkpoint directory. ``overwrite=True`` replaces
    the directory the link points to (the link stays, naming the new checkpoint); nothing is left beside either
    (before: the link itself was swapped away under the temporary name, a leftover ``gc`` could not remove)."""
    real = tmp_path / "store" / "real"
    arrayckpt.save({"w": torch.zeros(4)}, real)
    link = tmp_path / "ckpt"
    link.symlink_to(real)
    arrayckpt.save({"w": torch.ones(4)}, link, overwrite=True)
    assert link.is_symlink() and os.readlink(link) == str(real)
    for where in (link, real):
        assert torch.equal(arrayckpt.open(where)["w"].torch(), torch.ones(4))
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "store"] and os.listdir(real.parent) == ["real"]
    assert arrayckpt.gc(tmp_path, min_age_s=0) == [] and arrayckpt.gc(real.parent, min_age_s=0) == []
    with pytest.raises(arrayckpt.CheckpointExistsError, match="a committed checkpoint is already here"):
        arrayckpt.save({"w": torch.ones(4)}, link)


def test_gc_removes_a_linked_leftover_as_a_link_and_reports_only_what_it_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A temporary name that is a link (what the old overwrite through a link left) is removed as a link, its
    target intact; a leftover that cannot be removed is not reported as removed."""
    from arrayckpt._storage.local import LocalLeftover, LocalLocation

    target = tmp_path / "elsewhere"
    arrayckpt.save({"w": torch.ones(4)}, target)
    runs = tmp_path / "runs"
    runs.mkdir()
    leftover = runs / ".ckpt.arrayckpt-tmp-0123456789ab"
    leftover.symlink_to(target)
    assert arrayckpt.gc(runs, min_age_s=0) == [leftover]
    assert not os.path.lexists(leftover)
    assert torch.equal(arrayckpt.open(target)["w"].torch(), torch.ones(4))

    stuck = runs / ".other.arrayckpt-tmp-0123456789ab"
    (stuck / "w").mkdir(parents=True)
    (stuck / "w" / "c.0").write_bytes(b"x")
    monkeypatch.setattr(shutil, "rmtree", lambda *args, **kwargs: None)  # a removal that fails silently
    assert LocalLeftover(LocalLocation(stuck), 0.0).remove() is False
    assert arrayckpt.gc(runs, min_age_s=0) == [], "gc must not report as removed what is still there"
    assert (stuck / "w" / "c.0").exists()
