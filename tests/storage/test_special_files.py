"""Hostile files in a checkpoint: special files (a FIFO) where a chunk or the root document should be, chunk shapes
that would make TensorStore allocate terabytes, a chunk count too large to list, and the path errors name.

Every case that could hang (a FIFO) or abort the process (``std::bad_alloc``) runs in a subprocess with a timeout,
so a regression fails the test instead of hanging or killing the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import write_root

import arrayckpt
from arrayckpt._tools import verify as verify_module

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


def _edit_metadata(path: Path, **changes: object) -> None:
    """Change fields of array ``w``'s consolidated metadata (and the manifest's shape, if given)."""
    document = json.loads((path / "zarr.json").read_text())
    metadata = document["consolidated_metadata"]["metadata"]["w"]
    if "shape" in changes:
        metadata["shape"] = changes["shape"]
        document["attributes"]["arrayckpt"]["entries"]["w"]["shape"] = changes["shape"]
    if "chunk_shape" in changes:
        metadata["chunk_grid"]["configuration"]["chunk_shape"] = changes["chunk_shape"]
    write_root(path, document)


@pytest.mark.slow
def test_a_chunk_larger_than_its_array_is_refused_before_allocating(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")
    _edit_metadata(path, chunk_shape=[2**45, 4])
    results = _probe(path, "slice,show,verify")
    for op, (kind, message) in results.items():
        assert kind in ("FormatError", "CorruptCheckpointError"), (op, kind, message)
        assert "chunk shape [35184372088832, 4] is larger than the array's shape [4, 4]" in message, (op, message)
    with pytest.raises(arrayckpt.FormatError, match=r"entry 'w': array metadata chunk shape \[35184372088832, 4\]"):
        arrayckpt.open(path)["w"]  # in this process too: refused before TensorStore sees it


@pytest.mark.slow
def test_a_huge_array_with_one_huge_chunk_is_refused_before_allocating(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")
    _edit_metadata(path, shape=[2**45, 4], chunk_shape=[2**45, 4])
    kind, message = _probe(path, "slice")["slice"]
    assert kind == "FormatError" and "exceeds the limit of 17179869184 bytes per decoded chunk" in message, message


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


@pytest.mark.slow
def test_verify_streams_chunks_in_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2**15 chunks (shape [2]*15, chunk [1]*15): a list of every ChunkRef took ~50 MB (1.5 KB a chunk); batches
    stay small."""
    ndim = 15
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.zeros([2] * ndim, dtype=torch.uint8)}, path)
    _edit_metadata(path, chunk_shape=[1] * ndim)
    batches: list[int] = []
    def read_chunks(checkpoint: object, batch: list) -> list[np.ndarray]:
        batches.append(len(batch))
        return [np.zeros(chunk.shape, np.uint8) for chunk in batch]

    monkeypatch.setattr(verify_module, "read_chunks", read_chunks)
    tracemalloc.start()
    try:
        report = arrayckpt.verify(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.chunks == 2**ndim and sum(batches) == 2**ndim and report.bytes_checked == 2**ndim
    assert max(batches) <= verify_module.BATCH_CHUNKS
    assert peak < 24 << 20, f"verify's peak traced memory {peak / 2**20:.0f} MiB grows with the chunk count"


def test_a_save_never_writes_a_chunk_readers_would_refuse():
    """Shards with a prime row count and small rows fall back to one chunk per shard; past the readers' limit on a
    decoded chunk the save is refused with the fix, rather than writing a checkpoint nobody can read."""
    from arrayckpt._errors import StateError
    from arrayckpt._format.zarr import MAX_CHUNK_BYTES
    from arrayckpt._layout.box import Box
    from arrayckpt._layout.saveplan import ArrayDescription, LocalDescription, plan_save

    def describe(rows: int, cols: int) -> list[LocalDescription]:
        return [LocalDescription(arrays=(ArrayDescription("w", ("w",), "tensor", "float32", (2 * rows, cols),
                                                          Box((r * rows, 0), (rows, cols)), 0),)) for r in range(2)]

    prime = 4194319  # rows per rank: no divisor near any chunk target
    assert prime * 1024 * 4 > MAX_CHUNK_BYTES
    with pytest.raises(StateError, match="tensor 'w': its shards .* leave no chunk grid under"):
        plan_save(describe(prime, 1024), None)
    planned = plan_save(describe(prime, 4), None)  # the same fallback, small enough: planned as before
    assert planned.arrays["w"].outer_chunk == (prime, 4)
