"""Files of a local checkpoint that are not what they should be: special files (a FIFO) where a chunk, the root
document or a node document should be are refused without waiting on them, and chunk errors name the user's path,
not the directory pinned for the read.

Every case that could hang (a FIFO) runs in a subprocess with a timeout, so a regression fails the test instead of
hanging the suite.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from crafted import probe, save_small

import arrayckpt


def _fifo_in_place_of(file: Path) -> None:
    file.unlink()
    os.mkfifo(file)


@pytest.mark.slow
@pytest.mark.parametrize("codec", [None, "zstd"])  # the local fast path, and TensorStore's file kvstore
def test_a_fifo_in_place_of_a_chunk_is_refused_not_waited_on(tmp_path: Path, codec: str | None) -> None:
    path = save_small(tmp_path / "ckpt", codec)
    _fifo_in_place_of(path / "w" / "c.0.0")
    results = probe(path, "slice,numpy,load,verify")
    for op, (kind, message) in results.items():
        assert kind == "CorruptCheckpointError", (op, kind, message)
        assert "not a regular file" in message and f"{path}/w/c.0.0" in message, (op, message)
        assert "/proc/self/fd" not in message, (op, message)


@pytest.mark.slow
def test_a_fifo_as_root_document_is_refused_not_waited_on(tmp_path: Path) -> None:
    root = tmp_path / "run"
    path = save_small(root / "step_00000001")
    _fifo_in_place_of(path / "zarr.json")
    results = probe(path, "open,steps", str(root))
    assert results["open"][0] == "CorruptCheckpointError"
    assert f"{path}: zarr.json is not a regular file" in results["open"][1]
    assert results["steps"] == ["ok", "[]"]  # not a committed checkpoint; listed without waiting on the pipe


@pytest.mark.slow
def test_a_fifo_as_a_node_document_is_reported_by_verify(tmp_path: Path) -> None:
    path = save_small(tmp_path / "ckpt")
    _fifo_in_place_of(path / "w" / "zarr.json")
    kind, message = probe(path, "verify")["verify"]
    assert kind == "CorruptCheckpointError" and "w/zarr.json is not a regular file" in message


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_chunk_errors_name_the_users_path_not_the_pinned_directory(tmp_path: Path, codec: str | None) -> None:
    path = save_small(tmp_path / "ckpt", codec)
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
