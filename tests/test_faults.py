"""Faults around a save: a full disk, and two writers racing for the same path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import arrayckpt


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 4 MiB tmpfs (mounting needs root, as in CI; elsewhere the test is skipped with that reason)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


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


def test_two_writers_racing_for_one_path_one_wins_cleanly(tmp_path):
    path = tmp_path / "ckpt"
    racers = [subprocess.Popen([sys.executable, "-c", _RACER, str(path), str(v)], stdout=subprocess.PIPE, text=True)
              for v in (1.0, 2.0)]
    outputs = [r.communicate(timeout=120)[0].strip() for r in racers]
    assert sorted(o.split(":")[0] for o in outputs) == ["lost", "won"], outputs
    winner = 1.0 if outputs[0] == "won" else 2.0
    assert torch.equal(arrayckpt.open(path)["w"].torch(), torch.full((256, 256), winner))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # the loser cleaned up after itself
