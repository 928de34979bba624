"""Packed checkpoints (spec §16) on a real S3 endpoint (moto on 127.0.0.1): a save is one object per rank, an
index and a root; replacing a checkpoint in either layout never writes over the one it replaces, and leaves only
the new one's objects; a failed save leaves the old checkpoint whole; the commit lists nothing."""

from __future__ import annotations

import pytest
import torch
from s3_server import FaultProxy, S3Server
from test_s3 import _options, _same, _state

import arrayckpt

pytestmark = pytest.mark.slow  # starts a server


def test_a_packed_save_is_a_few_objects_and_its_commit_lists_nothing(s3_server: S3Server, s3_proxy: FaultProxy,
                                                                     s3_bucket: str) -> None:
    url, options = f"s3://{s3_bucket}/run/step-1", _options(s3_proxy)
    state = _state(1)
    arrayckpt.save(state, url, storage_options=options, packed=True)
    keys = sorted(k.removeprefix("run/step-1/") for k in s3_server.list_keys(s3_bucket))
    assert keys[-2:] == ["refs.json", "zarr.json"] and len(keys) == 4, keys  # a pack, its index, refs, the root
    assert keys[0].startswith("packs/") and keys[0].endswith("-index.bin") and keys[1].endswith("-r000000.pack")
    assert s3_proxy.count("GET", lists=True) == 1  # the fresh prefix listed before the save; none at the commit
    assert s3_proxy.log[-3][:2] == ("PUT", f"/{s3_bucket}/run/step-1/zarr.json"), "the root must be written last"
    _same(url, state, options)
    s3_proxy.reset()
    with arrayckpt.open(url, storage_options=options) as ckpt:
        ckpt["model.w"][:2]
    assert s3_proxy.counts.get("PUT", 0) == 0 and s3_proxy.count("GET", lists=True) == 0


@pytest.mark.parametrize("first, second", [(True, True), (False, True), (True, False)],
                         ids=["packed-over-packed", "packed-over-files", "files-over-packed"])
def test_replacing_a_checkpoint_leaves_only_the_new_ones_objects(s3_server: S3Server, s3_bucket: str, first: bool,
                                                                 second: bool) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", _options(s3_server)
    arrayckpt.save(_state(1), url, storage_options=options, packed=first)
    before = set(s3_server.list_keys(s3_bucket))
    arrayckpt.save(_state(2), url, storage_options=options, packed=second, overwrite=True)
    _same(url, _state(2), options)
    after = set(s3_server.list_keys(s3_bucket))
    if second:  # every object is the new save's: its tag differs from the old packs'
        packs = {k for k in after if k.startswith("ckpt/packs/")}
        assert len(packs) == 2 and not packs & before
        assert after == packs | {"ckpt/zarr.json", "ckpt/refs.json"}
    else:
        assert not any(k.startswith("ckpt/packs/") or k == "ckpt/refs.json" for k in after)
    assert arrayckpt.verify(url, storage_options=options).ok


def test_a_failed_packed_save_leaves_the_checkpoint_it_would_replace_whole(s3_server: S3Server, s3_bucket: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import arrayckpt._write.save as save_module

    url, options = f"s3://{s3_bucket}/ckpt", _options(s3_server)
    arrayckpt.save(_state(1), url, storage_options=options, packed=True)
    before = set(s3_server.list_keys(s3_bucket))
    real = save_module.packed_manifest

    def fail_after_the_index(*args, **kwargs):
        real(*args, **kwargs)  # the packs and the new index are written
        raise arrayckpt.StorageError("the store went away before the commit")

    monkeypatch.setattr(save_module, "packed_manifest", fail_after_the_index)
    with pytest.raises(arrayckpt.StorageError, match="went away"):
        arrayckpt.save(_state(2), url, storage_options=options, packed=True, overwrite=True)
    assert set(s3_server.list_keys(s3_bucket)) == before  # the new save's objects removed, the old ones kept
    _same(url, _state(1), options)


def test_a_large_pack_is_one_multipart_object(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str,
                                              tuned) -> None:
    tuned(object_part_bytes=5 << 20)
    url, options = f"s3://{s3_bucket}/big", _options(s3_proxy)
    state = {"w": torch.randn(3 << 20)}  # 12 MiB: three parts
    arrayckpt.save(state, url, storage_options=options, packed=True)
    packs = [k for k in s3_server.list_keys(s3_bucket) if k.endswith(".pack")]
    assert len(packs) == 1
    assert s3_proxy.counts.get("POST", 0) == 2  # create and complete one multipart upload
    with arrayckpt.open(url, storage_options=options) as ckpt:
        assert torch.equal(ckpt["w"].torch(), state["w"])
