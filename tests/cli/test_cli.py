"""The ``arrayckpt`` console script, run as a user would run it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from thread_ranks import run_thread_ranks

import arrayckpt
from arrayckpt._cli.text import HOOK_PTH, zarr_hint


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = shutil.which("arrayckpt")
    assert exe, "the arrayckpt console script is not installed (pip install -e .)"
    return subprocess.run([exe, *args], capture_output=True, text=True, env=None if env is None else {**os.environ,
                                                                                                       **env})


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


@pytest.mark.slow
def test_no_bfloat16_note_where_zarr_python_reads_them_and_a_precise_one_where_not(saved, tmp_path):
    """arrayckpt installed (its start-up hook in site-packages): plain zarr-python reads bfloat16, so neither
    ``info`` nor ``verify`` tells the user to install arrayckpt; with the hook turned off, or not installed, the note
    says which and what to do."""
    reader = "import sys, zarr; print(zarr.open_array(sys.argv[1], mode='r')[:].dtype)"
    plain = subprocess.run([sys.executable, "-c", reader, str(saved / "model" / "w")], capture_output=True, text=True)
    assert plain.stdout.strip() == "bfloat16", plain.stderr  # what the note is about: zarr-python alone reads it
    for command in ("info", "verify"):
        done = _run(command, str(saved))
        assert done.returncode == 0 and "note:" not in done.stdout, done.stdout + done.stderr
        off = _run(command, str(saved), env={"ARRAYCKPT_NO_ZARR_HOOK": "1"})
        text = " ".join(off.stdout.split())
        assert text.count("note: zarr-python run without `import arrayckpt` cannot read the bfloat16 arrays") == 1
        assert "ARRAYCKPT_NO_ZARR_HOOK=1 turns off arrayckpt's start-up hook; unset it" in text, off.stdout
    missing = zarr_hint(["bfloat16", "float8_e4m3fn", "float32"], sites=[str(tmp_path)])
    assert missing is not None and "bfloat16, float8_e4m3fn arrays" in missing and str(tmp_path) in missing
    assert "`pip install arrayckpt`; from a source tree `pip install -e .`" in missing
    (tmp_path / HOOK_PTH).write_text("import _arrayckpt_zarr_hook\n")
    assert zarr_hint(["bfloat16"], sites=[str(tmp_path)]) is None and zarr_hint(["float32"], sites=[]) is None
    arrayckpt.save({"w": torch.ones(2)}, tmp_path / "plain")
    assert "note:" not in _run("info", str(tmp_path / "plain"), env={"ARRAYCKPT_NO_ZARR_HOOK": "1"}).stdout


@pytest.mark.slow
def test_info_of_a_two_rank_checkpoint_fits_the_terminal(tmp_path):
    """A save by 2 ranks records which rank wrote each chunk of each array (``created.writers``, a line of
    thousands of characters before): ``info`` summarises it and fits every line to the terminal (``COLUMNS``), long
    keys shortened in the middle; ``--wide`` prints them whole and ``--json`` keeps the whole record."""
    long_key = "model." + "encoder_block_with_a_long_name." * 4 + "weight"
    weights = {f"layers.{i}.{part}": torch.randn(8, 4) for i in range(40) for part in ("attn", "mlp")}
    weights[long_key] = torch.randn(8, 4)

    def save_rank(rank: int, group) -> None:
        rows = slice(4 * rank, 4 * rank + 4)
        state = {k: arrayckpt.Shard(v[rows].clone(), (8, 4), (4 * rank, 0)) for k, v in weights.items()}
        arrayckpt.save({**state, "notes": "x" * 300, "step": 3}, tmp_path / "c", process_group=group)

    run_thread_ranks(2, save_rank)
    with arrayckpt.open(tmp_path / "c") as opened:
        record = opened.manifest.created["writers"]
    assert len(record) == 81 and len(json.dumps(record)) > 2000  # what the line used to hold
    for columns in (60, 80, 132):
        done = _run("info", str(tmp_path / "c"), env={"COLUMNS": str(columns)})
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert max(map(len, lines)) <= columns, max(lines, key=len)
        assert "layers.39.mlp" in done.stdout and "step = 3" in done.stdout
        assert "(format v4, packed: 2 packs, step" in done.stdout  # two ranks: packed (spec §16)
        if columns >= 80:  # the summary is one item, never split
            assert "writers=2 ranks, 162 chunks (rank 0: 81, rank 1: 81)" in done.stdout
        tree = _run("info", "--tree", str(tmp_path / "c"), env={"COLUMNS": str(columns)}).stdout.splitlines()
        assert max(map(len, tree)) <= columns
    narrow = _run("info", str(tmp_path / "c"), env={"COLUMNS": "80"}).stdout
    assert long_key not in narrow  # its middle gives way:
    assert re.search(r"^model\.encoder_block_\S*…\S*_long_name\.weight  float32  8×4", narrow, re.M), narrow
    wide = _run("info", "--wide", str(tmp_path / "c"), env={"COLUMNS": "80"}).stdout
    assert long_key in wide and "x" * 300 in wide
    assert json.loads(_run("info", "--json", str(tmp_path / "c")).stdout)["created"]["writers"] == record


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


@pytest.mark.slow
def test_info_tree_shows_the_nesting(tmp_path):
    import subprocess
    import sys

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    arrayckpt.save({"model": model, "step": 3}, tmp_path / "c")
    out = subprocess.run([sys.executable, "-m", "arrayckpt.cli", "info", "--tree", str(tmp_path / "c")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    start = out.index("model/")  # after the header (on two lines when the path is long)
    assert out[start:start + 3] == ["model/", "  0/", "    weight  float32 3×2  24 B  none"]
    assert "  1/" in out and out[-1] == "step  = 3"
