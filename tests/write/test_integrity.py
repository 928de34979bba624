"""Damage is detected and named; a save never leaves a half-written checkpoint or hurts an older one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import write_root
from policies import small_chunks

import arrayckpt


def _chunk_files(array_dir: Path) -> list[Path]:
    return sorted(p for p in array_dir.iterdir() if p.is_file() and (p.name == "c" or p.name.startswith("c.")))


def _state() -> dict:
    return {"model": {"w": torch.arange(64, dtype=torch.float32).reshape(16, 4), "b": torch.ones(4)}, "step": 1}


@pytest.mark.parametrize("where", ["data", "shard-index"])
def test_flipped_byte_is_detected_by_load_and_open_naming_the_key(ckpt, where):
    small_chunks(64, 128).save(_state(), ckpt)
    victim = _chunk_files(ckpt / "model" / "w")[1]
    raw = bytearray(victim.read_bytes())
    raw[3 if where == "data" else -6] ^= 0x10
    victim.write_bytes(bytes(raw))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'model\.w'.*(Digest mismatch|checksum)"):
        arrayckpt.load(_state(), ckpt)
    opened = arrayckpt.open(ckpt)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'model\.w'") as info:
        opened["model.w"][...]
    assert "c.1.0" in str(info.value)  # the damaged chunk file is named
    assert torch.equal(opened["model.b"].torch(), torch.ones(4))  # undamaged tensors still read


def test_flipped_byte_in_unsharded_chunk(ckpt):
    arrayckpt.save(_state(), ckpt)
    victim = _chunk_files(ckpt / "model" / "b")[0]
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 1
    victim.write_bytes(bytes(raw))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'model\.b'"):
        arrayckpt.open(ckpt)["model.b"][:]


def test_deleted_chunk_is_an_error_not_zeros(ckpt, chunking):
    zeros = {"z": torch.zeros(16, 4)}
    chunking.save(zeros, ckpt)
    files = _chunk_files(ckpt / "z")
    assert files, "all-zero chunks must still be written"
    files[-1].unlink()
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'z'.*(missing|NOT_FOUND)"):
        arrayckpt.open(ckpt)["z"][...]
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="'z'"):
        arrayckpt.load({"z": torch.ones(16, 4)}, ckpt)


def test_damaged_root_metadata_is_reported(ckpt):
    arrayckpt.save(_state(), ckpt)
    (ckpt / "zarr.json").write_text("{ not json")
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="root zarr.json is damaged"):
        arrayckpt.open(ckpt)


def test_incomplete_and_absent_checkpoints_are_reported(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "model").mkdir()
    with pytest.raises(arrayckpt.IncompleteCheckpointError, match="incomplete checkpoint"):
        arrayckpt.open(tmp_path / "half")
    with pytest.raises(arrayckpt.IncompleteCheckpointError):
        arrayckpt.load({}, tmp_path / "half")
    with pytest.raises(arrayckpt.CheckpointNotFoundError, match="no checkpoint here"):
        arrayckpt.open(tmp_path / "nothing")
    with pytest.raises(FileNotFoundError):  # the builtin base works too
        arrayckpt.open(tmp_path / "nothing")


def test_save_refuses_to_replace_without_overwrite(ckpt):
    arrayckpt.save(_state(), ckpt)
    with pytest.raises(arrayckpt.CheckpointExistsError, match="overwrite=True"):
        arrayckpt.save({"other": torch.zeros(1)}, ckpt)
    assert sorted(arrayckpt.open(ckpt)) == ["model.b", "model.w"]
    arrayckpt.save({"other": torch.zeros(1)}, ckpt, overwrite=True)
    assert sorted(arrayckpt.open(ckpt)) == ["other"]
    assert [p.name for p in ckpt.parent.iterdir()] == ["ckpt"]  # no temporary leftovers


def test_save_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path):
    precious = tmp_path / "data"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(arrayckpt.CheckpointExistsError, match="not an arrayckpt checkpoint"):
            arrayckpt.save(_state(), precious, overwrite=overwrite)
    assert (precious / "notes.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    arrayckpt.save(_state(), empty)  # an empty directory is fine
    assert "model.w" in arrayckpt.open(empty)


_KILLED_SAVE = textwrap.dedent(
    """
    import os, sys, torch, arrayckpt, arrayckpt._io.arrays as io, arrayckpt._storage.local as storage
    point = sys.argv[2]
    if point == "during-data":
        real = io.write_all
        def write_half(jobs, context, where):
            real(jobs[: len(jobs) // 2], context, where)
            os._exit(17)
        import arrayckpt._write.packed as packed_module  # chunk_destination's write_all
        packed_module.write_all = write_half
    elif point == "before-commit":
        storage.LocalWriter.commit = lambda self, root: os._exit(17)
    elif point == "during-commit":
        storage.make_durable = lambda root: os._exit(17)  # root zarr.json written, not yet renamed
    state = {"w": torch.full((64, 8), 2.0), "extra": torch.ones(3), "step": 2}
    arrayckpt.save(state, sys.argv[1], overwrite=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["during-data", "before-commit", "during-commit"])
@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "over-previous"])
def test_killed_save_leaves_no_committed_checkpoint_and_the_previous_intact(ckpt, point, previous):
    if previous:
        arrayckpt.save({"w": torch.full((64, 8), 1.0), "step": 1}, ckpt)
    done = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(ckpt), point], capture_output=True, text=True)
    assert done.returncode == 17, done.stderr
    if previous:
        opened = arrayckpt.open(ckpt)
        assert opened.plain_values["step"] == 1
        assert torch.equal(opened["w"].torch(), torch.full((64, 8), 1.0))
        assert sorted(opened) == ["w"]
    else:
        with pytest.raises(arrayckpt.CheckpointNotFoundError, match="interrupted save"):
            arrayckpt.open(ckpt)
    leftovers = [p for p in ckpt.parent.iterdir() if p.name != "ckpt"]
    assert leftovers and all(".arrayckpt-tmp-" in p.name for p in leftovers)
    assert arrayckpt.gc(ckpt.parent, min_age_s=0) == leftovers
    assert [p.name for p in ckpt.parent.iterdir()] == (["ckpt"] if previous else [])


def test_failed_save_cleans_up_and_keeps_previous(ckpt, monkeypatch):
    arrayckpt.save({"w": torch.ones(4), "step": 1}, ckpt)
    import arrayckpt._write.packed as packed_module  # chunk_destination's write_all

    def fail(*args, **kwargs):
        raise arrayckpt.StorageError("disk on fire")

    monkeypatch.setattr(packed_module, "write_all", fail)
    with pytest.raises(arrayckpt.StorageError, match="disk on fire"):
        arrayckpt.save({"w": torch.zeros(4), "step": 2}, ckpt, overwrite=True)
    assert arrayckpt.open(ckpt).plain_values["step"] == 1
    assert [p.name for p in ckpt.parent.iterdir()] == ["ckpt"]


def test_unknown_format_version_is_refused(ckpt):
    arrayckpt.save(_state(), ckpt)
    root = json.loads((ckpt / "zarr.json").read_text())
    root["attributes"]["arrayckpt"]["format_version"] = 99
    write_root(ckpt, root)
    with pytest.raises(arrayckpt.FormatError, match="format version 99 is not supported"):
        arrayckpt.open(ckpt)


def _edit_root(ckpt: Path, edit) -> None:
    root = json.loads((ckpt / "zarr.json").read_text())
    edit(root)
    write_root(ckpt, root)


def test_manifest_shape_must_match_array_metadata(ckpt):
    arrayckpt.save({"w": torch.ones(1)}, ckpt)
    _edit_root(ckpt, lambda root: root["attributes"]["arrayckpt"]["entries"]["w"].update(shape=[3]))
    with pytest.raises(arrayckpt.FormatError, match=r"'w': array metadata shape \[1\] does not match .* \[3\]"):
        arrayckpt.open(ckpt)


def test_arrays_without_checksums_are_refused(ckpt):
    arrayckpt.save({"w": torch.ones(4)}, ckpt)

    def strip(root):
        root["consolidated_metadata"]["metadata"]["w"]["codecs"] = [
            {"name": "bytes", "configuration": {"endian": "little"}}]

    _edit_root(ckpt, strip)
    with pytest.raises(arrayckpt.FormatError, match="do not end with a crc32c checksum"):
        arrayckpt.open(ckpt)


def test_overwrite_never_replaces_a_foreign_zarr_store(tmp_path):
    import zarr

    foreign = tmp_path / "foreign"
    zarr.open_group(str(foreign), mode="w").create_array("x", shape=(2,), dtype="int8")
    with pytest.raises(arrayckpt.CheckpointExistsError, match="not an arrayckpt checkpoint"):
        arrayckpt.save({"w": torch.ones(1)}, foreign, overwrite=True)
    assert (foreign / "x" / "zarr.json").exists()


def test_an_open_checkpoint_never_reads_the_data_of_its_replacement(ckpt):
    arrayckpt.save({"w": torch.zeros(64, 8), "b": torch.zeros(3)}, ckpt)
    opened = arrayckpt.open(ckpt)
    assert torch.equal(opened["b"].torch(), torch.zeros(3))
    arrayckpt.save({"w": torch.ones(64, 8), "b": torch.ones(3)}, ckpt, overwrite=True)  # same layout
    try:
        seen = opened["w"].torch()
    except arrayckpt.ArrayckptError:
        return  # the old checkpoint is gone: a clear error is fine, new data under old metadata is not
    assert torch.equal(seen, torch.zeros(64, 8))
    assert torch.equal(arrayckpt.open(ckpt)["w"].torch(), torch.ones(64, 8))
