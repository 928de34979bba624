"""``arrayckpt gc`` / ``arrayckpt.gc`` on object storage: incomplete checkpoints (a prefix with arrayckpt's objects
and no root ``zarr.json``, spec §9.3) right below the root are removed once old enough; committed checkpoints,
foreign objects and foreign Zarr data are never touched; a root inside a checkpoint is refused. On ``memory://``
(no modification times) and on S3 (moto, ``LastModified`` through s3fs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import uuid

import pytest
import torch
from helpers import FILES_LAYOUT_ONLY, assert_bit_equal, crash
from s3_server import S3Server

import arrayckpt
from arrayckpt._storage.object import ObjectLocation, ObjectWriter, parse_object_url

pytestmark = [pytest.mark.slow,  # spawns processes, starts a server or runs a foreign stack
              pytest.mark.usefixtures("storage_layout")]

find_object_garbage = ObjectLocation.leftovers  # (found, kept) right below a prefix


class Died(Exception):
    """Stands for the saving process dying before its commit."""


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(8, 4, generator=g), "b": torch.randn(4, generator=g)}, "step": seed}


def _interrupted_save(url: str, monkeypatch: pytest.MonkeyPatch, **options: object) -> None:
    """Save up to the commit, then "die": every chunk and document is written, no root zarr.json, nothing removed; the
    save's lease (spec §9.4) stays, expired."""
    def die(self: ObjectWriter, root_document: bytes) -> None:
        crash(self)
        raise Died

    with monkeypatch.context() as patch:
        patch.setattr(ObjectWriter, "commit", die)
        patch.setattr(ObjectWriter, "abort", lambda self: None)
        with pytest.raises(Died):
            arrayckpt.save(_state(1), url, storage_options=options or None)


def _keys(url: str, **options: object) -> list[str]:
    location = parse_object_url(url, options or None)
    return sorted(k.decode() for k in location.open_store().list().result())


def _put(url: str, key: str, data: bytes, **options: object) -> None:
    parse_object_url(url, options or None).open_store().write(key, data).result()


def _same(url: str, state: dict, **options: object) -> None:
    ckpt = arrayckpt.open(url, storage_options=options or None)
    assert_bit_equal(ckpt["model.w"].torch(), state["model"]["w"])
    assert_bit_equal(ckpt["model.b"].torch(), state["model"]["b"])
    assert ckpt.plain_values["step"] == state["step"]


@pytest.fixture
def root() -> str:
    return f"memory://gc-{uuid.uuid4().hex[:12]}/run"  # the memory store is shared by the whole process


# --- memory:// ----------------------------------------------------------------------------------------------


@FILES_LAYOUT_ONLY  # lists chunk objects (packed: below)
def test_memory_removes_incomplete_checkpoints_only(root, monkeypatch):
    arrayckpt.save(_state(0), f"{root}/step-1")
    _interrupted_save(f"{root}/step-2", monkeypatch)
    assert _keys(f"{root}/step-2") == [".arrayckpt-lease", "model/b/c.0", "model/b/zarr.json", "model/w/c.0.0",
                                       "model/w/zarr.json", "model/zarr.json"]
    _put(f"{root}/logs", "app.log", b"not a checkpoint")  # foreign objects
    _put(f"{root}/numbered", "0", b"x")  # chunk-shaped names, but no arrayckpt metadata
    _put(f"{root}/numbered", "1", b"y")
    _interrupted_save(f"{root}/step-3", monkeypatch)  # arrayckpt's objects, plus someone else's
    _put(f"{root}/step-3", "NOTES.txt", b"mine")
    other = {"zarr_format": 3, "node_type": "array", "shape": [2], "data_type": "uint8", "attributes": {}}
    _put(f"{root}/other", "data/x/zarr.json", json.dumps(other).encode())  # a foreign Zarr v3 array, no root
    _put(f"{root}/other", "data/x/c.0", b"\x01\x02")
    _put(root, "README", b"objects right at the root are never candidates")

    assert arrayckpt.gc(root, min_age_s=0, dry_run=True) == [f"{root}/step-2"]
    assert _keys(f"{root}/step-2")  # a dry run deletes nothing
    found, kept = find_object_garbage(parse_object_url(root), 0)
    assert [leftover.url for leftover in found] == [f"{root}/step-2"] and found[0].age_s is None
    reasons = dict(kept)
    assert sorted(reasons) == [f"{root}/logs", f"{root}/numbered", f"{root}/other", f"{root}/step-3"]
    assert "not arrayckpt's" in reasons[f"{root}/logs"] and "NOTES.txt" in reasons[f"{root}/step-3"]
    assert "only chunk-named objects" in reasons[f"{root}/numbered"]
    assert "did not write" in reasons[f"{root}/other"]

    before = {name: _keys(f"{root}/{name}") for name in ("step-1", "logs", "numbered", "step-3", "other")}
    assert arrayckpt.gc(root, min_age_s=0) == [f"{root}/step-2"]
    assert _keys(f"{root}/step-2") == []
    assert {name: _keys(f"{root}/{name}") for name in before} == before  # nothing else touched
    assert "README" in _keys(root)
    _same(f"{root}/step-1", _state(0))
    assert arrayckpt.gc(root, min_age_s=0) == []


@pytest.mark.parametrize("storage_layout", ["packed"], indirect=True)
def test_memory_removes_an_interrupted_packed_save_and_never_a_committed_ones_packs(root, monkeypatch):
    arrayckpt.save(_state(0), f"{root}/step-1")
    _interrupted_save(f"{root}/step-2", monkeypatch)
    left = _keys(f"{root}/step-2")  # its packs, index and references, no node document (spec §16.1)
    assert [k for k in left if not k.startswith("packs/")] == [".arrayckpt-lease", "refs.json"] and len(left) == 4
    _put(f"{root}/refs-only", "refs.json", b"{}")  # no pack or index named as a save names them: not evidence
    _put(f"{root}/foreign", "packs/r000000.pack", b"x")  # a pack name, but beside objects of someone else's
    _put(f"{root}/foreign", "NOTES.txt", b"mine")
    committed = _keys(f"{root}/step-1")
    assert arrayckpt.gc(root, min_age_s=0) == [f"{root}/step-2"]
    assert _keys(f"{root}/step-2") == [] and _keys(f"{root}/step-1") == committed
    assert _keys(f"{root}/refs-only") == ["refs.json"] and len(_keys(f"{root}/foreign")) == 2
    _same(f"{root}/step-1", _state(0))


def test_memory_has_no_modification_times_so_only_min_age_zero_removes(root, monkeypatch):
    _interrupted_save(f"{root}/step-2", monkeypatch)
    assert arrayckpt.gc(root) == []  # default min_age_s=3600: a save of this process might still be running
    (url, reason), = find_object_garbage(parse_object_url(root), 3600)[1]
    assert url == f"{root}/step-2" and "memory:// gives no modification times" in reason
    assert _keys(f"{root}/step-2")
    assert arrayckpt.gc(root, min_age_s=0) == [f"{root}/step-2"]


@FILES_LAYOUT_ONLY  # counts chunk objects
def test_memory_a_commit_after_the_listing_keeps_the_checkpoint(root, monkeypatch):
    _interrupted_save(f"{root}/step-2", monkeypatch)
    (leftover,), _ = find_object_garbage(parse_object_url(root), 0)
    _put(f"{root}/step-2", "zarr.json", b"{}")  # the save committed after all, after the listing
    assert leftover.remove() is False
    assert len(_keys(f"{root}/step-2")) == 7


def test_memory_root_that_is_or_lies_in_a_checkpoint_is_refused(root, monkeypatch):
    arrayckpt.save(_state(0), f"{root}/step-1")
    with pytest.raises(arrayckpt.StateError, match="is a committed checkpoint, not a prefix holding checkpoints"):
        arrayckpt.gc(f"{root}/step-1", min_age_s=0)
    with pytest.raises(arrayckpt.StateError, match=r"lies inside a committed checkpoint at .*/run/step-1"):
        arrayckpt.gc(f"{root}/step-1/model", min_age_s=0)  # its arrays would look like incomplete checkpoints
    _put(f"{root}/zarr", "zarr.json", json.dumps({"zarr_format": 3, "node_type": "group"}).encode())
    with pytest.raises(arrayckpt.StateError, match=r"lies inside a Zarr hierarchy"):
        arrayckpt.gc(f"{root}/zarr/sub", min_age_s=0)
    _same(f"{root}/step-1", _state(0))


def test_memory_save_again_after_gc(root, monkeypatch):
    _interrupted_save(f"{root}/step-2", monkeypatch)
    with pytest.raises(arrayckpt.CheckpointExistsError):
        arrayckpt.save(_state(2), f"{root}/step-2")  # the leftover is in the way
    arrayckpt.gc(root, min_age_s=0)
    arrayckpt.save(_state(2), f"{root}/step-2")
    _same(f"{root}/step-2", _state(2))


# --- S3 (moto) ------------------------------------------------------------------------------------------------


def test_s3_removes_old_incomplete_checkpoints_and_nothing_else(s3_server: S3Server, s3_bucket: str, monkeypatch):
    options = {"endpoint_url": s3_server.endpoint}
    root = f"s3://{s3_bucket}/run"
    arrayckpt.save(_state(0), f"{root}/step-1", storage_options=options)
    _interrupted_save(f"{root}/step-2", monkeypatch, **options)
    _interrupted_save(f"{root}/step-3", monkeypatch, **options)
    s3_server.client.put_object(Bucket=s3_bucket, Key="run/step-3/NOTES.txt", Body=b"mine")
    s3_server.client.put_object(Bucket=s3_bucket, Key="run/logs/app.log", Body=b"log")
    s3_server.client.put_object(Bucket=s3_bucket, Key="elsewhere/step-9/model/w/c.0.0", Body=b"outside the root")
    everything = s3_server.list_keys(s3_bucket)

    # just written: a save may still be running
    assert arrayckpt.gc(root, storage_options=options) == []
    kept = dict(find_object_garbage(parse_object_url(root, options), 3600)[1])
    assert re.search(r"newest object written [0-9]+ s ago, under the minimum age of 3600 s", kept[f"{root}/step-2"])
    assert "NOTES.txt" in kept[f"{root}/step-3"] and "app.log" in kept[f"{root}/logs"]
    assert s3_server.list_keys(s3_bucket) == everything

    # two hours later (by this machine's clock, against the objects' LastModified)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 7200)
    (leftover,), _ = find_object_garbage(parse_object_url(root, options), 3600)
    assert leftover.url == f"{root}/step-2" and 7100 < leftover.age_s < 7300
    assert arrayckpt.gc(root, storage_options=options, dry_run=True) == [f"{root}/step-2"]
    assert s3_server.list_keys(s3_bucket) == everything
    assert arrayckpt.gc(root, storage_options=options) == [f"{root}/step-2"]
    assert s3_server.list_keys(s3_bucket) == [k for k in everything if not k.startswith("run/step-2/")]
    _same(f"{root}/step-1", _state(0), **options)


def test_s3_cli_gc(s3_server: S3Server, s3_bucket: str, monkeypatch):
    options = {"endpoint_url": s3_server.endpoint}
    root = f"s3://{s3_bucket}/run"
    arrayckpt.save(_state(0), f"{root}/step-1", storage_options=options)
    _interrupted_save(f"{root}/step-2", monkeypatch, **options)
    s3_server.client.put_object(Bucket=s3_bucket, Key="run/logs/app.log", Body=b"log")
    exe = shutil.which("arrayckpt")
    assert exe, "the arrayckpt console script is not installed (pip install -e .)"
    env = {**os.environ, **s3_server.env, "AWS_ENDPOINT_URL": s3_server.endpoint}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([exe, "gc", root, *args], capture_output=True, text=True, env=env)

    done = run("--json")  # default --min-age 3600: too recent
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["removed"] == [] and [k["path"] for k in report["kept"]] == [f"{root}/logs", f"{root}/step-2"]
    done = run("--min-age", "0", "--dry-run", "--json")
    assert json.loads(done.stdout) == {"would_remove": [f"{root}/step-2"],
                                       "kept": [{"path": f"{root}/logs", "reason": report["kept"][0]["reason"]}]}
    done = run("--min-age", "0")
    assert done.returncode == 0, done.stderr
    assert f"removed {root}/step-2" in done.stdout and "removed 1 leftover;" in done.stdout
    assert f"kept {root}/logs: holds objects that are not arrayckpt's" in done.stdout
    assert not [k for k in s3_server.list_keys(s3_bucket) if k.startswith("run/step-2/")]
    done = subprocess.run([exe, "gc", f"{root}/step-1", "--min-age", "0"], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and "is a committed checkpoint" in done.stderr
    _same(f"{root}/step-1", _state(0), **options)

