"""The ``arrayckpt`` console script, run as a user would run it."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

import arrayckpt


def _run(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("arrayckpt")
    assert exe, "the arrayckpt console script is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True)


@pytest.fixture
def saved(ckpt):
    state = {"model": {"w": torch.zeros(64, 32, dtype=torch.bfloat16), "b": torch.ones(32)}, "step": 7, "name": "run-1"}
    arrayckpt.save(state, ckpt, step=7, codec={"model.w": "zstd"})
    return ckpt


def test_info_prints_a_table_of_tensors_and_values(saved):
    done = _run("info", str(saved))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "step 7" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("model.")}
    assert lines["model.w"][1:3] == ["bfloat16", "64×32"] and lines["model.w"][-2:] == ["zstd(3)", "1×1"]
    assert lines["model.b"][1:3] == ["float32", "32"] and lines["model.b"][-2:] == ["none", "1"]
    assert "name = 'run-1'" in out and "2 tensors" in out


def test_info_json_is_machine_readable(saved):
    done = _run("info", "--json", str(saved))
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["step"] == 7 and info["format_version"] == 3
    assert info["tensors"]["model.w"] == {"dtype": "bfloat16", "shape": [64, 32], "nbytes": 4096, "codec": "zstd(3)",
                                          "kind": "tensor", "stored": "whole", "chunks": [1, 1]}
    assert [layer["step"] for layer in info["chain"]] == [7] and info["stored_bytes"] == info["total_bytes"]
    assert info["values"] == {"step": 7, "name": "run-1"}
    assert info["total_bytes"] == 64 * 32 * 2 + 32 * 4


def test_info_and_verify_say_what_zarr_python_needs_for_bfloat16(saved, tmp_path):
    note = "note: zarr-python reads the bfloat16 arrays only with arrayckpt's data types"
    for command in ("info", "verify"):
        done = _run(command, str(saved))
        assert done.returncode == 0 and done.stdout.count(note) == 1, done.stdout + done.stderr
    arrayckpt.save({"w": torch.ones(2)}, tmp_path / "plain")
    assert "note:" not in _run("info", str(tmp_path / "plain")).stdout + _run("verify", str(tmp_path / "plain")).stdout


def test_info_on_missing_or_incomplete_checkpoint_fails_clearly(tmp_path):
    done = _run("info", str(tmp_path / "nope"))
    assert done.returncode == 2 and "no checkpoint here" in done.stderr
    (tmp_path / "half").mkdir()
    done = _run("info", str(tmp_path / "half"))
    assert done.returncode == 2 and "incomplete checkpoint" in done.stderr


def test_gc_removes_leftovers_of_interrupted_saves_only(tmp_path):
    arrayckpt.save({"w": torch.ones(2)}, tmp_path / "kept")
    leftover = tmp_path / ".step-9.arrayckpt-tmp-0123456789ab"
    (leftover / "w").mkdir(parents=True)
    (leftover / "w" / "c.0").write_bytes(b"partial")
    done = _run("gc", str(tmp_path), "--min-age", "3600")
    assert done.returncode == 0 and "removed 0 leftovers; kept 1" in done.stdout  # too recent: maybe still running
    assert "under the minimum age of 3600 s" in done.stdout
    done = _run("gc", str(tmp_path), "--min-age", "0", "--dry-run")
    assert "would remove" in done.stdout and leftover.exists()
    done = _run("gc", str(tmp_path), "--min-age", "0", "--dry-run", "--json")
    assert json.loads(done.stdout) == {"would_remove": [str(leftover)]}
    done = _run("gc", str(tmp_path), "--min-age", "0")
    assert done.returncode == 0 and "removed 1 leftover\n" in done.stdout
    assert not leftover.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["kept"]
    assert "w" in arrayckpt.open(tmp_path / "kept")


def test_info_tree_shows_the_nesting(tmp_path):
    import subprocess
    import sys

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    arrayckpt.save({"model": model, "step": 3}, tmp_path / "c")
    out = subprocess.run([sys.executable, "-m", "arrayckpt.cli", "info", "--tree", str(tmp_path / "c")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[1:4] == ["model/", "  0/", "    weight  float32 3×2  24 B  none"]
    assert "  1/" in out and out[-1] == "step  = 3"
