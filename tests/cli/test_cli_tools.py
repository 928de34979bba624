"""``arrayckpt verify | show | diff | estimate | interval | convert``: through the console script for the main
paths, in-process (``cli.main``, the same code without the 2 s interpreter start) for the variations."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from policies import small_chunks

from arrayckpt import cli


def _run(*args: str | Path) -> subprocess.CompletedProcess:
    exe = shutil.which("arrayckpt")
    assert exe, "the arrayckpt console script is not installed (pip install -e .)"
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def main(capsys: pytest.CaptureFixture[str]):
    """``arrayckpt ARGS`` in-process: returns (exit status, stdout, stderr) like the console script."""

    def run(*args: str | Path) -> subprocess.CompletedProcess:
        try:
            code = cli.main([str(a) for a in args])
        except SystemExit as e:  # argparse usage errors
            code = int(e.code or 0)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    return run


@pytest.fixture
def saved(ckpt: Path) -> Path:
    """A checkpoint with several chunk files per tensor (saved in-process with tiny chunk targets)."""
    w = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    small_chunks(32, 64).save({"model": {"w": w, "b": torch.ones(4, dtype=torch.bfloat16)}, "step": 7}, ckpt, step=7)
    return ckpt


@pytest.mark.slow
def test_verify_ok(saved):
    done = _run("verify", saved)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("OK ") and "2 arrays" in done.stdout


@pytest.mark.slow
def test_verify_names_a_flipped_byte_and_a_missing_chunk(saved, main):
    victim = saved / "model" / "w" / "c.1.0"
    raw = bytearray(victim.read_bytes())
    raw[5] ^= 0x40
    victim.write_bytes(bytes(raw))
    (saved / "model" / "w" / "c.2.0").unlink()
    done = _run("verify", saved)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "DAMAGED model.w: model/w/c.1.0:" in done.stdout and "checksum" in done.stdout
    assert "DAMAGED model.w: model/w/c.2.0:" in done.stdout and "missing" in done.stdout
    assert "2 problem(s) in 1 entry" in done.stdout
    report = json.loads(main("verify", "--json", saved).stdout)
    assert report["ok"] is False and [d["file"] for d in report["damage"]] == ["model/w/c.1.0", "model/w/c.2.0"]


def test_verify_incomplete_and_missing(tmp_path):
    (tmp_path / "half" / "w").mkdir(parents=True)
    done = _run("verify", tmp_path / "half")
    assert done.returncode == 1 and "zarr.json" in done.stdout and "incomplete checkpoint" in done.stdout
    done = _run("verify", tmp_path / "nothing")
    assert done.returncode == 2 and "no checkpoint here" in done.stderr


@pytest.mark.slow
def test_show_values_and_statistics(saved, main):
    done = _run("show", saved, "model.w", "1:3, ::2")
    assert done.returncode == 0, done.stderr
    assert "selected 2×2 (4 values)" in done.stdout and "min 4.0  max 10.0  mean 7.0" in done.stdout
    data = json.loads(main("show", "--json", saved, "model.w", "-1").stdout)
    assert data["values"] == [60.0, 61.0, 62.0, 63.0] and data["selected_shape"] == [4] and data["nan_count"] == 0
    assert json.loads(main("show", "--json", saved, "model.b").stdout)["dtype"] == "bfloat16"
    assert main("show", saved, "step").stdout.strip() == "step = 7"


def test_show_refuses_bad_keys_and_slices(saved, main):
    done = main("show", saved, "model.ww")
    assert done.returncode == 2 and "did you mean 'model.w'" in done.stderr
    done = main("show", saved, "model.w", "__import__('os')")
    assert done.returncode == 2 and "cannot parse" in done.stderr
    done = main("show", saved, "model.w", "99")
    assert done.returncode == 2 and "out of bounds" in done.stderr


def test_diff(saved, tmp_path, main):
    other = tmp_path / "other"
    w = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    w[9, 1] += 0.5
    small_chunks(32, 64).save({"model": {"w": w, "b": torch.ones(4)}, "step": 8, "extra": 1}, other)
    done = _run("diff", saved, other)
    assert done.returncode == 1, done.stderr
    assert "only in B: extra" in done.stdout
    assert "changed:   model.b: tensor bfloat16[4] -> tensor float32[4]" in done.stdout
    assert "value:     step: 7 -> 8" in done.stdout
    report = json.loads(main("diff", "--json", saved, other).stdout)
    w_diff = report["tensors"]["model.w"]
    assert w_diff["differing_elements"] == 1 and w_diff["max_abs"] == 0.5
    assert w_diff["max_rel"] == pytest.approx(0.5 / 37.5)
    assert w_diff["chunks"] == 4 and w_diff["differing_chunks"] == 1
    same = main("diff", saved, saved)
    assert same.returncode == 0 and same.stdout.strip().endswith("identical")


def test_diff_counts_chunks_on_the_same_grid(tmp_path, main):
    a = torch.randn(16, 4)
    b = a.clone()
    b[0, 0], b[15, 3] = float("nan"), b[15, 3] * 2
    small_chunks(32, 64).save({"w": a}, tmp_path / "a")
    small_chunks(32, 64).save({"w": b}, tmp_path / "b")
    w = json.loads(main("diff", "--json", tmp_path / "a", tmp_path / "b").stdout)["tensors"]["w"]
    assert (w["differing_elements"], w["differing_chunks"], w["chunks"], w["nonfinite"]) == (2, 2, 4, 1)


def test_estimate_and_interval(main):
    done = _run("estimate", "--params", "7B", "--ranks", "8", "--json")
    assert done.returncode == 0, done.stderr
    e = json.loads(done.stdout)
    assert e["bytes_per_param"] == 10 and e["total_bytes"] == 70 * 10**9 and e["per_rank_bytes"] == 70 * 10**9 // 8
    e = json.loads(main("estimate", "--params", "405e9", "--master-weights", "--json").stdout)
    assert e["bytes_per_param"] == 14
    assert "per rank" in main("estimate", "--params", "1.5B", "--ranks", "4").stdout
    assert main("estimate", "--params", "lots").returncode == 2
    done = _run("interval", "--blocking-seconds", "60", "--mtbf-hours", "24", "--json")
    i = json.loads(done.stdout)
    assert i["young_seconds"] == pytest.approx((2 * 60 * 86400) ** 0.5)
    assert i["daly_seconds"] == pytest.approx(3180.062, abs=1e-3)
    assert "Daly" in main("interval", "--blocking-seconds", "60", "--mtbf-hours", "24").stdout
    assert main("interval", "--blocking-seconds", "-1", "--mtbf-hours", "24").returncode == 2


@pytest.mark.slow
def test_convert_through_the_console_script(tmp_path, main):
    from safetensors.torch import load_file, save_file

    weights = {"embed.weight": torch.randn(10, 4).bfloat16(), "head.bias": torch.randn(3)}
    save_file(weights, tmp_path / "model.safetensors")
    done = _run("convert", tmp_path / "model.safetensors", tmp_path / "ckpt")
    assert done.returncode == 0, done.stderr
    assert "converted safetensors" in done.stdout and "2 tensors" in done.stdout
    done = main("convert", tmp_path / "ckpt", tmp_path / "out", "--to", "safetensors", "--max-shard-size", "50B")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    done = main("convert", tmp_path / "ckpt", tmp_path / "back.safetensors")
    assert done.returncode == 0, done.stderr
    back = load_file(tmp_path / "back.safetensors")
    assert all(torch.equal(back[k].view(torch.uint8), v.view(torch.uint8)) for k, v in weights.items())
    done = main("convert", tmp_path / "ckpt", tmp_path / "back.safetensors")
    assert done.returncode == 2 and "--overwrite" in done.stderr
    done = main("convert", tmp_path / "ckpt", tmp_path / "somewhere")
    assert done.returncode == 2 and "--to" in done.stderr
