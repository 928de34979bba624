"""Format version 3's checksums (spec §11): the root document's own, and the digest that ties every chunk's content
to its place. Before them a flipped digit in a plain value, the step or a metric, a duplicated JSON key, swapped or
foreign chunk files and bytes appended to an uncompressed chunk all read silently and passed verify."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from policies import small_chunks

import arrayckpt
from arrayckpt._format.integrity import INTEGRITY_MEMBER, chunk_crc
from arrayckpt._write import save as save_module


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 4, generator=g), "z": torch.randn(12, 6, generator=g), "lr": 0.125,
            "name": "run-7", "sched": {"milestones": [10, 20]}}


def _chunk_files(array_dir: Path) -> list[Path]:
    return sorted(p for p in array_dir.iterdir() if p.is_file() and p.name != "zarr.json")


def _verify_cli(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arrayckpt.cli", "verify", str(path)], capture_output=True,
                          text=True, timeout=120)


# --- the root document ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit", [
    pytest.param(lambda t: t.replace('"value": 0.125', '"value": 0.135'), id="plain-value"),
    pytest.param(lambda t: t.replace('"step": 3', '"step": 7'), id="step"),
    pytest.param(lambda t: t.replace('"loss": 1.5', '"loss": 1.25'), id="metric"),
    pytest.param(lambda t: t.replace('"run-7"', '"run-8"'), id="string-value"),
    # a duplicated key: JSON parsers keep the last one, so this drops every entry but "lr"
    pytest.param(lambda t: t.replace('"containers":', '"entries": {}, "containers":'), id="duplicate-key"),
])
def test_a_changed_root_document_is_refused_and_verify_reports_it(tmp_path, edit):
    path = tmp_path / "ckpt"
    arrayckpt.save(_state(), path, step=3, metrics={"loss": 1.5})
    text = (path / "zarr.json").read_text()
    changed = edit(text)
    assert changed != text and json.loads(changed)  # still valid JSON: only the checksum can tell
    (path / "zarr.json").write_text(changed)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="root zarr.json is damaged: its SHA-256"):
        arrayckpt.open(path)
    report = arrayckpt.verify(path)
    assert not report.ok and report.damage[0].file == "zarr.json" and "SHA-256" in report.damage[0].problem
    done = _verify_cli(path)
    assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout


def test_a_removed_or_renamed_checksum_is_damage_from_version_3(tmp_path):
    path = tmp_path / "ckpt"
    arrayckpt.save(_state(), path)
    text = (path / "zarr.json").read_text()
    (path / "zarr.json").write_text(text.replace(f'"{INTEGRITY_MEMBER}":', '"integritz":'))  # one flipped bit
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="no 'integrity' checksum"):
        arrayckpt.open(path)
    (path / "zarr.json").write_text(text.replace(f'"{INTEGRITY_MEMBER}": "sha256:', f'"{INTEGRITY_MEMBER}": "sha257:'))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="is not 'sha256:'"):
        arrayckpt.open(path)


def test_every_byte_of_the_root_document_is_covered(tmp_path):
    """Flip each byte of a small checkpoint's root document: every flip is refused or reads exactly as before."""
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.arange(6.0), "lr": 0.5, "step": 2}, path, step=2)
    original = (path / "zarr.json").read_bytes()
    expected = arrayckpt.open(path)
    values, w = dict(expected.plain_values), expected["w"][...].copy()
    silent = []
    for i in range(len(original)):
        flipped = bytearray(original)
        flipped[i] ^= 0x01
        (path / "zarr.json").write_bytes(bytes(flipped))
        try:
            opened = arrayckpt.open(path)
            same = dict(opened.plain_values) == values and np.array_equal(opened["w"][...], w)
        except arrayckpt.ArrayckptError:
            continue
        if not same:
            silent.append(i)
    assert silent == [], [original[i - 20:i + 20] for i in silent[:3]]


def test_older_versions_still_read_and_verify_says_they_are_unprotected(tmp_path):
    path = tmp_path / "ckpt"
    arrayckpt.save(_state(), path)
    assert arrayckpt.verify(path).unprotected == ()
    document = json.loads((path / "zarr.json").read_text())
    manifest = document["attributes"]["arrayckpt"]
    for version in (2, 1):
        del manifest[INTEGRITY_MEMBER], manifest["chunk_digests"]
        manifest["format_version"] = version
        (path / "zarr.json").write_text(json.dumps(document))  # as arrayckpt 0.1 wrote them: no checksum
        opened = arrayckpt.open(path)
        assert opened.manifest.format_version == version and opened.manifest.integrity is None
        assert np.array_equal(opened["w"][...], _state()["w"].numpy())
        report = arrayckpt.verify(path)
        assert report.ok and len(report.unprotected) == 2
        assert "no checksum" in report.unprotected[0] and "chunk digests" in report.unprotected[1]
        done = _verify_cli(path)
        assert done.returncode == 0 and "unprotected" in done.stdout
        manifest["chunk_digests"], manifest[INTEGRITY_MEMBER] = {}, "sha256:" + "0" * 64  # restored for the loop


def test_a_checksum_present_in_an_older_version_is_still_checked(tmp_path):
    path = tmp_path / "ckpt"
    arrayckpt.save(_state(), path)
    text = (path / "zarr.json").read_text()
    (path / "zarr.json").write_text(text.replace('"format_version": 3', '"format_version": 2'))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="SHA-256"):
        arrayckpt.open(path)


# --- chunks tied to their places -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("codec", [None, "zstd"])
@pytest.mark.parametrize("sharded", [False, True], ids=["unsharded", "sharded"])
def test_swapped_chunk_files_are_caught_by_verify(tmp_path, codec, sharded):
    path = tmp_path / "ckpt"
    policy = small_chunks(32, 64) if sharded else small_chunks(64, 64)
    policy.save(_state(), path, codec=codec)
    files = _chunk_files(path / "w")
    assert len(files) >= 2
    first, second = files[0].read_bytes(), files[1].read_bytes()
    assert first != second
    files[0].write_bytes(second)
    files[1].write_bytes(first)
    opened = arrayckpt.open(path)
    assert not np.array_equal(opened["w"][...], _state()["w"].numpy())  # each chunk passes its own crc32c
    report = arrayckpt.verify(path)
    assert not report.ok and report.damaged_keys == ("w",)
    assert report.damage[0].file == "w" and "swapped, misplaced" in report.damage[0].problem
    assert _verify_cli(path).returncode == 1


def test_a_chunk_copied_from_another_checkpoint_is_caught(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    small_chunks(64, 64).save(_state(0), a)
    small_chunks(64, 64).save(_state(1), b)
    shutil.copyfile(_chunk_files(b / "z")[1], _chunk_files(a / "z")[1])
    report = arrayckpt.verify(a)
    assert report.damaged_keys == ("z",) and "copied from another checkpoint" in report.damage[0].problem
    assert arrayckpt.verify(b).ok


def test_swapped_chunks_of_a_chunks_delta_are_caught(tmp_path):
    state = _state()
    small_chunks(64, 64).save(state, tmp_path / "base")
    state["w"][:4] += 1  # the first and last chunk of "w", whole: stored as a chunks delta
    state["w"][-4:] += 1
    small_chunks(64, 64).save(state, tmp_path / "delta", base=tmp_path / "base")
    entry = arrayckpt.open(tmp_path / "delta").manifest.entries["w"]
    assert entry.delta is not None and entry.delta.mode == "chunks" and len(entry.delta.present) == 2
    assert arrayckpt.verify(tmp_path / "delta").ok
    files = _chunk_files(tmp_path / "delta" / "w")
    first, second = files[0].read_bytes(), files[1].read_bytes()
    files[0].write_bytes(second)
    files[1].write_bytes(first)
    assert arrayckpt.verify(tmp_path / "delta").damaged_keys == ("w",)


def test_bytes_appended_to_an_uncompressed_chunk_are_refused(tmp_path):
    path = tmp_path / "ckpt"
    small_chunks(64, 64).save(_state(), path)
    victim = _chunk_files(path / "w")[0]
    victim.write_bytes(victim.read_bytes() + b"\0\0\0\0")
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'w'.*bytes appended or cut off"):
        arrayckpt.load(_state(1), path)  # TensorStore itself reads past such bytes; zarr-python refuses them
    report = arrayckpt.verify(path)
    assert report.damaged_keys == ("w",) and victim.name in report.damage[0].file


def test_object_storage_checkpoints_are_checked_the_same_way():
    url = f"memory://checksums/{np.random.default_rng().integers(1 << 60):x}"
    small_chunks(64, 64).save(_state(), url, codec="zstd")
    assert arrayckpt.verify(url).ok
    from arrayckpt._storage import parse_location
    store = parse_location(url).open_store()
    keys = sorted(k.decode() for k in store.list().result() if k.decode().startswith("w/c"))
    first, second = (store.read(k).result().value for k in keys[:2])
    store.write(keys[0], second).result()
    store.write(keys[1], first).result()
    assert arrayckpt.verify(url).damaged_keys == ("w",)


def test_digests_match_the_stored_content(tmp_path):
    """The recorded digest is the one the spec defines: SHA-256 over each chunk's crc32c, in C order."""
    path = tmp_path / "ckpt"
    small_chunks(64, 64).save(_state(), path)
    from arrayckpt._format.integrity import chunk_digest
    w = _state()["w"].numpy()
    rows = 64 // (4 * 4)
    assert arrayckpt.open(path).manifest.chunk_digests["w"] == chunk_digest(
        chunk_crc(w[i:i + rows]) for i in range(0, 16, rows))


def test_a_chunk_no_rank_reported_is_never_committed(tmp_path, monkeypatch, storage_layout):
    """The coordinator commits only when every stored chunk was reported written."""
    write_tasks = save_module._write_tasks

    def lose_one(*args, **kwargs):
        errors, checksums, packed = write_tasks(*args, **kwargs)
        checksums["w"].pop(1)
        return errors, checksums, packed

    monkeypatch.setattr(save_module, "_write_tasks", lose_one)
    with pytest.raises(arrayckpt.ArrayckptError, match=r"'w': chunk 1 of array 'w' was not reported written"):
        small_chunks(64, 64).save(_state(), tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and list(tmp_path.iterdir()) == []


def test_crc_combine_equals_the_crc_of_the_concatenation():
    """The fast path combines inner chunks' checksums into the outer chunk's instead of reading the bytes twice."""
    import crc32c

    from arrayckpt._format.integrity import crc_combine
    rng = np.random.default_rng(0)
    for a_len, b_len in [(0, 0), (0, 5), (5, 0), (1, 1), (4096, 17), (1 << 20, 3)] + \
            [tuple(rng.integers(0, 5000, 2)) for _ in range(50)]:
        a, b = rng.bytes(int(a_len)), rng.bytes(int(b_len))
        assert crc_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


def test_sharded_fast_path_digest_equals_the_spec_definition(tmp_path):
    """Sharded uncompressed chunks (the local fast path) record the digest of their content as a whole."""
    from arrayckpt._format.integrity import chunk_digest
    path = tmp_path / "ckpt"
    w = torch.randn(16, 4)
    small_chunks(32, 128).save({"w": w}, path)
    metadata = json.loads((path / "w" / "zarr.json").read_text())
    assert metadata["codecs"][0]["name"] == "sharding_indexed"
    rows = metadata["chunk_grid"]["configuration"]["chunk_shape"][0]
    assert arrayckpt.open(path).manifest.chunk_digests["w"] == chunk_digest(
        chunk_crc(w.numpy()[i:i + rows]) for i in range(0, 16, rows))
