"""``arrayckpt.verify`` of a packed checkpoint (spec §16): damage to a pack or to the index is reported by key, chunk
file, pack and byte range, and the damaged chunk reads as an error, never as zeros."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import crc32c
import numpy as np
import policies
import pytest
import torch
from crafted import edit_root

import arrayckpt
from arrayckpt._read.checkpoint import stored_of

pytestmark = [pytest.mark.usefixtures("storage_layout"),
              pytest.mark.parametrize("storage_layout", ["packed"], indirect=True)]

PACK = "packs/r000000.pack"  # the names of an untagged save (the fixture below), so that tests can name them
INDEX = "packs/index.bin"


@pytest.fixture(autouse=True)
def untagged(monkeypatch: pytest.MonkeyPatch) -> None:
    """Saves without a tag (spec §16.1: the writer chooses it; tagged names are tested with the save path)."""
    import arrayckpt._write.save as save_module

    monkeypatch.setattr(save_module, "new_tag", lambda: "")


def _save(path: Path) -> None:
    """``model.w``: four chunk files of equal length (sharded); ``model.b``, ``z`` and a pickled value one each."""
    state = {"model": {"w": torch.arange(64, dtype=torch.float32).reshape(16, 4), "b": torch.ones(4)},
             "z": torch.zeros(6, 5, dtype=torch.bfloat16), "obj": {1, 2}, "step": 3}
    policies.small_chunks(32, 64).save(state, path, allow_pickle=True)


def _layout(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The manifest member ``packs`` and every array's rows."""
    with arrayckpt.open(path) as checkpoint:
        packed = stored_of(checkpoint).packed
        assert packed is not None, "the checkpoint is not packed"
        member = json.loads((path / "zarr.json").read_text())["attributes"]["arrayckpt"]["packs"]
        return member, {p: np.array(rows) for p, rows in packed.rows(list(packed.layout.sections)).items()}


def _rewrite_section(path: Path, array: str, rows: np.ndarray) -> None:
    """Write ``rows`` as array ``array``'s section, with its valid crc32c, and record it (and the index's crc32c)
    in the manifest, resealed: only the rows are crafted."""
    member, _ = _layout(path)
    offset, length, _ = member["sections"][array]
    body = rows.astype("<u8").tobytes()
    assert len(body) + 4 == length
    crc = crc32c.crc32c(body)
    index = bytearray((path / INDEX).read_bytes())
    index[offset:offset + length] = body + struct.pack("<I", crc)
    (path / INDEX).write_bytes(bytes(index))

    def change(document: dict) -> None:
        packs = document["attributes"]["arrayckpt"]["packs"]
        packs["sections"][array][2] = crc
        packs["index"]["crc32c"] = crc32c.crc32c(bytes(index))
    edit_root(path, change)


def _damage(path: Path) -> dict[tuple[str | None, str], str]:
    report = arrayckpt.verify(path)
    assert not report.ok
    return {(d.key, d.file): d.problem for d in report.damage}


def _read_fails(path: Path, key: str) -> None:
    with arrayckpt.open(path) as checkpoint, pytest.raises(arrayckpt.CorruptCheckpointError):
        checkpoint[key].numpy()


def test_a_sound_packed_checkpoint_verifies(ckpt):
    _save(ckpt)
    assert not list(ckpt.glob("model/**/zarr.json"))  # no node documents to check: the manifest holds them
    report = arrayckpt.verify(ckpt)
    assert report.ok and report.arrays == 4 and report.chunks == 7


def test_a_flipped_byte_in_a_pack_is_named_by_chunk_pack_and_bytes(ckpt):
    _save(ckpt)
    _, rows = _layout(ckpt)
    _, offset, length = (int(v) for v in rows["model/w"][1])
    raw = bytearray((ckpt / PACK).read_bytes())
    raw[offset + length // 2] ^= 0x01
    (ckpt / PACK).write_bytes(bytes(raw))
    damage = _damage(ckpt)
    assert list(damage) == [("model.w", "model/w/c.1.0")]
    assert f"bytes [{offset:,}, {offset + length:,}) of {PACK}" in damage["model.w", "model/w/c.1.0"]
    _read_fails(ckpt, "model.w")


def test_a_truncated_pack_is_reported_with_the_chunks_past_its_end(ckpt):
    _save(ckpt)
    _, rows = _layout(ckpt)
    cut = int(rows["model/w"][3][1]) + 10  # inside model.w's c.3.0: it and every chunk file after it are gone
    with open(ckpt / PACK, "r+b") as f:
        f.truncate(cut)
    damage = _damage(ckpt)
    assert "truncated" in damage[None, PACK] and f"holds {cut:,} bytes" in damage[None, PACK]
    keys = {"model/w": "model.w", "model/b": "model.b", "z": "z", "obj": "obj"}
    past = {keys[path] for path, table in rows.items() if (table[:, 1] + table[:, 2] > cut).any()}
    assert {key for key, _ in damage} == {None} | past and "model.w" in past  # (the order in a pack is the writer's)
    assert ("model.w", "model/w/c.3.0") in damage
    assert all((("model.w", f"model/w/c.{i}.0") in damage) == (int(rows["model/w"][i][1]) + int(rows["model/w"][i][2])
                                                              > cut) for i in range(4))
    assert PACK in damage["model.w", "model/w/c.3.0"]
    _read_fails(ckpt, "model.w")


def test_bytes_appended_to_a_pack_are_reported(ckpt):
    _save(ckpt)
    with open(ckpt / PACK, "ab") as f:
        f.write(b"tail")
    damage = _damage(ckpt)
    assert list(damage) == [(None, PACK)] and "appended" in damage[None, PACK]
    with arrayckpt.open(ckpt) as checkpoint:  # every chunk is whole: reads are right
        assert torch.equal(checkpoint["model.w"].torch(), torch.arange(64, dtype=torch.float32).reshape(16, 4))


def test_chunks_of_two_arrays_sharing_bytes_are_reported_by_both_chunk_files(ckpt):
    _save(ckpt)
    _, rows = _layout(ckpt)
    crafted = rows["model/b"].copy()
    crafted[0] = (0, int(rows["model/w"][2][1]), int(crafted[0][2]))  # model.b's chunk inside model.w's c.2.0
    _rewrite_section(ckpt, "model/b", crafted)
    report = arrayckpt.verify(ckpt)
    overlap, read = (d.problem for d in report.damage if (d.key, d.file) == ("model.b", "model/b/c.0"))
    assert "overlaps model/w/c.2.0 (of 'model.w')" in overlap and PACK in overlap
    assert "arrayckpt-packed" not in read and "model/b/c.0" in read and PACK in read  # its bytes fail their crc32c
    assert report.damaged_keys == ("model.b",)
    _read_fails(ckpt, "model.b")


def test_rows_of_one_array_sharing_bytes_are_a_damaged_section(ckpt):
    _save(ckpt)
    _, rows = _layout(ckpt)
    crafted = rows["model/w"].copy()
    crafted[1] = crafted[0]
    _rewrite_section(ckpt, "model/w", crafted)
    damage = _damage(ckpt)
    assert list(damage) == [("model.w", INDEX)]
    assert "chunk (1, 0)" in damage["model.w", INDEX] and "overlaps" in damage["model.w", INDEX]
    _read_fails(ckpt, "model.w")


def test_a_row_pointing_at_another_chunk_of_the_array_is_caught_by_the_digest(ckpt):
    _save(ckpt)
    _, rows = _layout(ckpt)
    crafted = rows["model/w"].copy()
    crafted[[1, 2]] = crafted[[2, 1]]  # each chunk file whole and of the same length, at the other's key
    _rewrite_section(ckpt, "model/w", crafted)
    damage = _damage(ckpt)
    assert list(damage) == [("model.w", "model/w")] and "digest" in damage["model.w", "model/w"]
    # (a read has no digest to check: it reads the two chunks swapped, as it would two swapped chunk files)


def test_an_index_that_is_not_the_manifests_is_reported(ckpt):
    _save(ckpt)
    edit_root(ckpt, lambda document: document["attributes"]["arrayckpt"]["packs"]["index"].update(crc32c=7))
    damage = _damage(ckpt)
    assert list(damage) == [(None, INDEX)] and "checksum" in damage[None, INDEX]


def test_a_damaged_index_section_is_reported_once_for_its_array(ckpt):
    _save(ckpt)
    member, _ = _layout(ckpt)
    raw = bytearray((ckpt / INDEX).read_bytes())
    raw[member["sections"]["model/w"][0] + 9] ^= 0x01  # a row of model.w: its section's crc32c and the file's fail
    (ckpt / INDEX).write_bytes(bytes(raw))
    damage = _damage(ckpt)
    assert set(damage) == {(None, INDEX), ("model.w", INDEX)}
    assert "checksum" in damage[None, INDEX] and "'model/w'" in damage["model.w", INDEX]
    _read_fails(ckpt, "model.w")


def test_a_missing_pack_is_reported_with_its_chunks(ckpt):
    _save(ckpt)
    (ckpt / PACK).unlink()
    damage = _damage(ckpt)
    assert "missing" in damage[None, PACK]
    assert ("model.w", "model/w/c.0.0") in damage and f"bytes [0, 108) of {PACK}" in damage["model.w", "model/w/c.0.0"]
    _read_fails(ckpt, "model.w")


def test_a_packed_delta_verifies_and_its_base_damage_is_named(ckpt, tmp_path):
    base = tmp_path / "base"
    _save(base)
    w = torch.arange(64, dtype=torch.float32).reshape(16, 4)
    w[0] = -1
    state = {"model": {"w": w, "b": torch.ones(4)}, "z": torch.zeros(6, 5, dtype=torch.bfloat16), "obj": {1, 2},
             "step": 4}
    policies.small_chunks(32, 64).save(state, ckpt, allow_pickle=True, base=base)
    assert arrayckpt.verify(ckpt).ok
    _, rows = _layout(base)
    offset, length = int(rows["obj"][0][1]), int(rows["obj"][0][2])  # the base's pickled value, which the delta reads
    raw = bytearray((base / PACK).read_bytes())
    raw[offset + length - 10] ^= 0x01
    (base / PACK).write_bytes(bytes(raw))
    report = arrayckpt.verify(ckpt)
    assert [d.file for d in report.damage] == [f"{base}: obj/c.0"]


def test_info_and_report_read_a_packed_checkpoint(ckpt, tmp_path, capsys):
    _save(ckpt)
    from arrayckpt.cli import main

    assert main(["info", str(ckpt)]) == 0
    assert "model.w" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    assert arrayckpt.report(ckpt, output=tmp_path / "r.html", histograms=1, grids=1).exists()


def test_a_compressed_packed_chunk_is_decoded_and_checked(ckpt):
    policies.small_chunks(32, 64).save({"w": torch.randn(32, 4)}, ckpt, codec="zstd")
    assert arrayckpt.verify(ckpt).ok
    _, rows = _layout(ckpt)
    _, offset, length = (int(v) for v in rows["w"][1])
    raw = bytearray((ckpt / PACK).read_bytes())
    raw[offset + length // 2] ^= 0x01
    (ckpt / PACK).write_bytes(bytes(raw))
    report = arrayckpt.verify(ckpt, batch_bytes=1)  # one chunk per batch: the batch path and the retry agree
    assert [d.file for d in report.damage] == ["w/c.1.0"] and PACK in report.damage[0].problem
    _read_fails(ckpt, "w")
