"""``arrayckpt refs`` / :func:`arrayckpt.write_refs`: a packed checkpoint's kerchunk references (spec §16.4), written on
demand for a checkpoint saved above ``refs_max_chunks`` chunks.

What must hold: the references written are byte for byte those a save writes under the limit; zarr-python reads every
array through them, equal to what was saved, and lists the whole hierarchy (``members(max_depth=None)``); a
checkpoint that is not packed, not committed, whose pack index is damaged, or with a link where ``refs.json`` or
``packs`` should be, is refused in one line, and nothing is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from helpers import zarr_group
from s3_server import S3Server, s3fs_storage_options

import arrayckpt
from arrayckpt.cli import main

# the arrays of _state (up to three levels deep), by path and key: plain dtypes, which zarr-python reads without
# arrayckpt's registration
ARRAYS = {"model/w": "model.w", "model/b": "model.b", "optim/state/m": "optim.state.m", "steps": "steps"}


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(37, 3, generator=g), "b": torch.randn(5, generator=g)},
            "optim": {"state": {"m": torch.randn(6, 4, generator=g)}, "lr": 0.1},
            "steps": torch.tensor([3, 1, 4], dtype=torch.int32), "step": 7}


def _save(path: Path, tuned=None, *, refs: bool = True) -> dict:
    state = _state()
    if not refs:
        tuned(refs_max_chunks=0)  # as a checkpoint of more than refs_max_chunks chunks
    arrayckpt.save(state, path, packed=True)
    return state


def _refs_cli(path: Path | str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    status = main(["refs", str(path)])
    out, err = capsys.readouterr()
    return status, out, err


def _refused(path: Path, capsys: pytest.CaptureFixture[str], match: str) -> None:
    """``arrayckpt refs path`` fails with one line on stderr matching ``match``, and writes no ``refs.json``."""
    status, out, err = _refs_cli(path, capsys)
    assert status == 2 and out == "", (status, out, err)
    assert err.count("\n") == 1 and err.startswith("arrayckpt: error: ") and str(path) in err, err
    assert match in err, err
    assert not os.path.lexists(path / "refs.json") or (path / "refs.json").is_symlink()
    assert not list(path.glob("packs/*.tmp"))


def test_refs_writes_the_references_a_save_writes_under_the_limit(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    _save(ck)
    saved = (ck / "refs.json").read_bytes()
    (ck / "refs.json").unlink()
    status, out, err = _refs_cli(ck, capsys)
    assert status == 0 and err == ""
    assert out == f"wrote {ck}/refs.json: kerchunk references of 4 chunks ({len(saved) / 1024:.1f} KiB)\n"
    assert (ck / "refs.json").read_bytes() == saved
    assert sorted(os.listdir(ck / "packs"))[-1].endswith(".pack")  # no temporary file left: an index and a pack
    assert len(os.listdir(ck / "packs")) == 2
    (ck / "refs.json").write_text("damaged")  # derived: rewriting it is harmless, and mends it
    result = arrayckpt.write_refs(ck)
    assert (result.chunks, result.size, result.refs) == (4, len(saved), f"{ck}/refs.json")
    assert (ck / "refs.json").read_bytes() == saved


def test_zarr_python_reads_and_lists_every_array_through_references_written_on_demand(
        tmp_path: Path, tuned, capsys: pytest.CaptureFixture[str]) -> None:
    zarr = pytest.importorskip("zarr")
    ck = tmp_path / "ck"
    state = _save(ck, tuned, refs=False)
    assert sorted(os.listdir(ck)) == ["packs", "zarr.json"]  # above refs_max_chunks: no references
    assert _refs_cli(ck, capsys)[0] == 0
    group = zarr_group(ck)
    assert isinstance(group, zarr.Group)
    members = dict(group.members(max_depth=None))  # from the consolidated metadata of the references' root
    assert sorted(path for path, node in members.items() if isinstance(node, zarr.Array)) == sorted(ARRAYS)
    assert sorted(path for path, node in members.items() if isinstance(node, zarr.Group)) == [
        "model", "optim", "optim/state"]
    assert sorted(group["optim"].array_keys()) == [] and list(group["optim/state"].array_keys()) == ["m"]
    with arrayckpt.open(ck) as ckpt:
        for path, key in ARRAYS.items():
            expected = ckpt[key].numpy()
            assert np.array_equal(group[path][...], expected), key
    assert np.array_equal(group["optim/state/m"][...], state["optim"]["state"]["m"].numpy())


def test_a_checkpoint_in_the_files_layout_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    arrayckpt.save(_state(), ck, packed=False)
    _refused(ck, capsys, "not a packed checkpoint (format version 3, one file per chunk): it needs no references")


def test_an_uncommitted_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], tuned) -> None:
    ck = tmp_path / "ck"
    _save(ck, tuned, refs=False)
    (ck / "zarr.json").unlink()  # a save that never committed: packs, no root
    _refused(ck, capsys, "incomplete checkpoint (no root zarr.json: its save never committed)")


def test_a_damaged_pack_index_is_refused_not_turned_into_references(tmp_path: Path, tuned,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ck = tmp_path / "ck"
    _save(ck, tuned, refs=False)
    index = next((ck / "packs").glob("*-index.bin"))
    data = bytearray(index.read_bytes())
    data[9] ^= 0x40  # a row's offset: every section still has its length, one fails its crc32c
    index.write_bytes(bytes(data))
    _refused(ck, capsys, "the pack index section of array")


def test_a_crafted_section_with_a_valid_checksum_is_refused(tmp_path: Path, tuned,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A section whose rows were changed and its crc32c recomputed passes its own checksum, but not the one the
    manifest records for it: refused as ``copy`` refuses it."""
    ck = tmp_path / "ck"
    _save(ck, tuned, refs=False)
    with arrayckpt.open(ck) as ckpt:
        layout = ckpt.manifest.packs
    offset, length, _ = layout.sections["model/w"]
    index = ck / layout.index_name
    data = bytearray(index.read_bytes())
    body = data[offset:offset + length - 4]
    body[16:24] = (int.from_bytes(body[16:24], "little") - 4).to_bytes(8, "little")  # its first chunk, 4 bytes short
    data[offset:offset + length] = bytes(body) + crc32c.crc32c(bytes(body)).to_bytes(4, "little")
    index.write_bytes(bytes(data))
    _refused(ck, capsys, "the manifest records")


@pytest.mark.parametrize("link", ["refs.json", "packs"])
def test_a_link_at_refs_or_packs_is_refused_and_not_followed(tmp_path: Path, tuned, link: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    ck, elsewhere = tmp_path / "ck", tmp_path / "elsewhere"
    _save(ck, tuned, refs=False)
    if link == "refs.json":
        elsewhere.write_text("not the checkpoint's")
        (ck / "refs.json").symlink_to(elsewhere)
    else:
        (ck / "packs").rename(elsewhere)
        (ck / "packs").symlink_to(elsewhere, target_is_directory=True)
    _refused(ck, capsys, "is a symbolic link; arrayckpt never follows a link inside a checkpoint")
    assert (ck / link).is_symlink()
    if link == "refs.json":
        assert elsewhere.read_text() == "not the checkpoint's"
    else:
        assert not (elsewhere / "refs.json").exists() and not list(elsewhere.glob("*.tmp"))


def test_refs_json_output_and_a_memory_url(tuned, capsys: pytest.CaptureFixture[str]) -> None:
    url = "memory://refs-test/run/ck"
    tuned(refs_max_chunks=0)
    arrayckpt.save(_state(), url, packed=True)
    assert main(["refs", url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["refs"] == f"{url}/refs.json" and report["chunks"] == 4 and report["checkpoint"] == url


@pytest.mark.slow  # starts a server
def test_refs_on_s3_are_one_put_of_what_a_save_writes(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    zarr = pytest.importorskip("zarr")
    url, options = f"s3://{s3_bucket}/run/ck", {"endpoint_url": s3_server.endpoint}
    arrayckpt.save(_state(), url, storage_options=options, packed=True)
    key = "run/ck/refs.json"
    saved = s3_server.client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    s3_server.client.delete_object(Bucket=s3_bucket, Key=key)
    result = arrayckpt.write_refs(url, storage_options=options)
    assert (result.refs, result.chunks) == (f"{url}/refs.json", 4)
    assert s3_server.client.get_object(Bucket=s3_bucket, Key=key)["Body"].read() == saved
    s3fs = s3fs_storage_options(s3_server.endpoint)
    group = zarr.open_group("reference://", mode="r", zarr_format=3, storage_options={
        "fo": f"s3://{s3_bucket}/{key}", "target_options": s3fs, "remote_protocol": "dir", "remote_options": {
            "path": f"{s3_bucket}/run/ck", "asynchronous": True, "target_protocol": "s3",
            "target_options": {**s3fs, "asynchronous": True}}})
    assert sorted(path for path, node in group.members(max_depth=None) if isinstance(node, zarr.Array)) == \
        sorted(ARRAYS)
    with arrayckpt.open(url, storage_options=options) as ckpt:
        for path, key_ in ARRAYS.items():
            assert np.array_equal(group[path][...], ckpt[key_].numpy()), key_
