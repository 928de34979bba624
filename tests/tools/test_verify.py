"""``arrayckpt.verify``: every chunk read and checked, every problem reported and named."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import policies
import pytest
import torch
from crafted import edit_metadata
from helpers import FILES_LAYOUT_ONLY
from policies import WHOLE, Chunking

import arrayckpt
from arrayckpt._tools import verify as verify_module

pytestmark = pytest.mark.usefixtures("storage_layout")  # every test on both layouts but those crafting chunk files


@pytest.fixture
def small_chunks() -> Chunking:
    """Several chunk files (and sharded inner chunks) per tensor, with tiny tensors."""
    return policies.small_chunks(32, 64)


def _save(path: Path, chunking: Chunking = WHOLE) -> None:
    state = {"model": {"w": torch.arange(64, dtype=torch.float32).reshape(16, 4), "b": torch.ones(4)},
             "z": torch.zeros(6, 5, dtype=torch.bfloat16), "rng": arrayckpt.PerRank(torch.ones(24, dtype=torch.uint8)),
             "obj": {1, 2}, "step": 3}
    chunking.save(state, path, allow_pickle=True)


def _flip(file: Path, at: int = 3) -> None:
    raw = bytearray(file.read_bytes())
    raw[at] ^= 0x01
    file.write_bytes(bytes(raw))


def test_a_sound_checkpoint_verifies(ckpt, chunking):
    _save(ckpt, chunking)
    report = arrayckpt.verify(ckpt)
    assert report.ok and not report.damage
    assert report.arrays == 5  # model.w, model.b, z, rng's rank-0 array, the pickled value
    assert report.bytes_checked == 64 * 4 + 4 * 4 + 30 * 2 + 24 + arrayckpt.open(ckpt).manifest.entries["obj"].nbytes
    assert report.chunks == 5 if chunking.name == "whole" else report.chunks > 5


@FILES_LAYOUT_ONLY
def test_all_damage_is_reported_by_key_and_chunk_file(ckpt, small_chunks):
    _save(ckpt, small_chunks)
    _flip(ckpt / "model" / "w" / "c.1.0")
    (ckpt / "model" / "w" / "c.3.0").unlink()
    _flip(ckpt / "z" / "c.0.0", at=-2)  # in the checksum itself
    (ckpt / "obj" / "c.0").unlink()  # a pickled value's bytes: checked, never unpickled
    report = arrayckpt.verify(ckpt)
    assert not report.ok
    found = {(d.key, d.file) for d in report.damage}
    assert found == {("model.w", "model/w/c.1.0"), ("model.w", "model/w/c.3.0"), ("z", "z/c.0.0"),
                     ("obj", "obj/c.0")}
    problems = {d.file: d.problem for d in report.damage}
    assert "checksum" in problems["model/w/c.1.0"] or "Digest" in problems["model/w/c.1.0"]
    assert "missing" in problems["model/w/c.3.0"]
    assert set(report.damaged_keys) == {"model.w", "z", "obj"}
    assert report.to_dict()["ok"] is False and len(report.to_dict()["damage"]) == 4


@FILES_LAYOUT_ONLY
def test_per_rank_arrays_and_node_metadata_are_checked(ckpt):
    _save(ckpt)
    _flip(ckpt / "rng" / "%r0" / "c.0", at=0)
    (ckpt / "model" / "b" / "zarr.json").unlink()
    report = arrayckpt.verify(ckpt)
    assert {(d.key, d.file) for d in report.damage} == {("rng", "rng/%r0/c.0"), ("model.b", "model/b/zarr.json")}


def test_incomplete_and_missing_checkpoints(tmp_path):
    half = tmp_path / "half"
    (half / "model" / "w").mkdir(parents=True)
    report = arrayckpt.verify(half)
    assert not report.ok and report.damage[0].file == "zarr.json"
    assert "incomplete checkpoint" in report.damage[0].problem
    with pytest.raises(arrayckpt.CheckpointNotFoundError, match="no checkpoint here"):
        arrayckpt.verify(tmp_path / "nothing")


def test_damaged_root_document_is_reported(ckpt):
    _save(ckpt)
    (ckpt / "zarr.json").write_text("{ not json")
    report = arrayckpt.verify(ckpt)
    assert [d.file for d in report.damage] == ["zarr.json"] and "damaged" in report.damage[0].problem


@FILES_LAYOUT_ONLY
def test_compressed_arrays_are_verified_through_tensorstore(ckpt, small_chunks):
    small_chunks.save({"w": torch.randn(32, 4)}, ckpt, codec="zstd")
    assert arrayckpt.verify(ckpt).ok
    victim = sorted((ckpt / "w").glob("c.*"))[1]
    _flip(victim, at=len(victim.read_bytes()) // 2)
    report = arrayckpt.verify(ckpt, batch_bytes=1)  # one chunk per batch: the batch path and the retry agree
    assert [d.file for d in report.damage] == [f"w/{victim.name}"]


def test_progress_is_reported(ckpt):
    _save(ckpt)
    seen: list[tuple[int, int]] = []
    arrayckpt.verify(ckpt, progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1]


# --- a crafted grid of many chunks, walked in bounded memory ------------------------------------------------------


@pytest.mark.slow
@FILES_LAYOUT_ONLY  # (edits the consolidated metadata)
def test_verify_streams_chunks_in_bounded_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2**15 chunks (shape [2]*15, chunk [1]*15): a list of every ChunkRef took ~50 MB (1.5 KB a chunk); batches
    stay small."""
    ndim = 15
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.zeros([2] * ndim, dtype=torch.uint8)}, path)
    edit_metadata(path, chunk_shape=[1] * ndim)
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
