"""Files of a local checkpoint that are not what they should be: special files (a FIFO) where a chunk, the root
document or a node document should be are refused without waiting on them, and chunk errors name the user's path,
not the directory pinned for the read.

Every case that could hang (a FIFO) runs in a subprocess with a timeout, so a regression fails the test instead of
hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import arrayckpt

TIMEOUT_S = 60  # generous: the subprocess imports torch; a hang shows as a timeout, not as a slow pass

_PROBE = textwrap.dedent("""
    import json, sys, torch, arrayckpt
    path, ops = sys.argv[1], sys.argv[2].split(",")
    def run(op):
        if op == "open":
            return arrayckpt.open(path)
        if op == "slice":
            return arrayckpt.open(path)["w"][0:1]
        if op == "numpy":
            return arrayckpt.open(path)["w"].numpy()
        if op == "load":
            return arrayckpt.load({"w": torch.zeros(4, 4)}, path)
        if op == "verify":
            report = arrayckpt.verify(path)
            raise arrayckpt.CorruptCheckpointError("; ".join(d.problem for d in report.damage) or "ok")
        if op == "show":
            return arrayckpt.show(path, "w")
        if op == "steps":
            return arrayckpt.CheckpointManager(sys.argv[3]).steps()
    out = {}
    for op in ops:
        try:
            out[op] = ["ok", repr(run(op))[:200]]
        except Exception as e:
            out[op] = [type(e).__name__, str(e)]
    print(json.dumps(out))
""")


def _probe(path: Path, ops: str, *extra: str) -> dict[str, list[str]]:
    """Run ``ops`` on the checkpoint at ``path`` in a fresh interpreter: {op: [exception name or 'ok', message]}."""
    done = subprocess.run([sys.executable, "-c", _PROBE, str(path), ops, *extra], capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, f"the process died ({done.returncode}): {done.stderr[-2000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def _save(path: Path, codec: str | None = None) -> Path:
    arrayckpt.save({"w": torch.arange(16.0).reshape(4, 4)}, path, codec=codec)
    return path


def _fifo_in_place_of(file: Path) -> None:
    file.unlink()
    os.mkfifo(file)


@pytest.mark.slow
@pytest.mark.parametrize("codec", [None, "zstd"])  # the local fast path, and TensorStore's file kvstore
def test_a_fifo_in_place_of_a_chunk_is_refused_not_waited_on(tmp_path: Path, codec: str | None) -> None:
    path = _save(tmp_path / "ckpt", codec)
    _fifo_in_place_of(path / "w" / "c.0.0")
    results = _probe(path, "slice,numpy,load,verify")
    for op, (kind, message) in results.items():
        assert kind == "CorruptCheckpointError", (op, kind, message)
        assert "not a regular file" in message and f"{path}/w/c.0.0" in message, (op, message)
        assert "/proc/self/fd" not in message, (op, message)


@pytest.mark.slow
def test_a_fifo_as_root_document_is_refused_not_waited_on(tmp_path: Path) -> None:
    root = tmp_path / "run"
    path = _save(root / "step_00000001")
    _fifo_in_place_of(path / "zarr.json")
    results = _probe(path, "open,steps", str(root))
    assert results["open"][0] == "CorruptCheckpointError"
    assert f"{path}: zarr.json is not a regular file" in results["open"][1]
    assert results["steps"] == ["ok", "[]"]  # not a committed checkpoint; listed without waiting on the pipe


@pytest.mark.slow
def test_a_fifo_as_a_node_document_is_reported_by_verify(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")
    _fifo_in_place_of(path / "w" / "zarr.json")
    kind, message = _probe(path, "verify")["verify"]
    assert kind == "CorruptCheckpointError" and "w/zarr.json is not a regular file" in message


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_chunk_errors_name_the_users_path_not_the_pinned_directory(tmp_path: Path, codec: str | None) -> None:
    path = _save(tmp_path / "ckpt", codec)
    chunk = path / "w" / "c.0.0"
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    opened = arrayckpt.open(path)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=f"{path}/w/c.0.0") as sliced:
        opened["w"][0:1]
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=f"{path}/w/c.0.0") as loaded:
        arrayckpt.load({"w": torch.zeros(4, 4)}, path)
    (damage,) = arrayckpt.verify(path).damage
    assert f"{path}/w/c.0.0" in damage.problem
    assert all("/proc/self/fd" not in m for m in (str(sliced.value), str(loaded.value), damage.problem))
