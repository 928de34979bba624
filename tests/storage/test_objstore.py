"""Object-storage semantics (commit = root document, generation-alternating overwrite, incomplete prefixes),
exercised on TensorStore's in-memory kvstore; the same code runs against S3 in ``test_s3.py``."""

from __future__ import annotations

import uuid

import helpers
import numpy as np
import pytest
import tensorstore as ts
import torch

import arrayckpt
from arrayckpt._storage import object as _objstore
from arrayckpt._storage.object import Kept, ObjectWriter, parse_object_url, stale_keys


def _url() -> str:
    return f"memory://bucket/ckpt-{uuid.uuid4().hex[:8]}"


def _keys(url: str) -> list[str]:
    location = parse_object_url(url)
    return sorted(k.decode() for k in ts.KvStore.open(location.kvstore(), context=location.context()).result()
                  .list().result())


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "count": torch.tensor(seed), "step": seed, "bf": torch.randn(8, 8, generator=g).to(torch.bfloat16)}


def _same(url: str, state: dict) -> None:
    ckpt = arrayckpt.open(url)
    assert torch.equal(ckpt["model.w"].torch(), state["model"]["w"])
    assert torch.equal(ckpt["model.b"].torch(), state["model"]["b"])
    assert torch.equal(ckpt["count"].torch(), state["count"])
    assert torch.equal(ckpt["bf"].torch(), state["bf"])
    assert ckpt.plain_values["step"] == state["step"]


def test_save_open_load_roundtrip() -> None:
    url = _url()
    state = _state(1)
    arrayckpt.save(state, url)
    _same(url, state)
    target = _state(2)
    arrayckpt.load(target, url)
    assert torch.equal(target["model"]["w"], state["model"]["w"]) and target["step"] == 1
    assert arrayckpt.verify(url).ok


def test_refuses_to_replace_without_overwrite() -> None:
    url = _url()
    arrayckpt.save(_state(1), url)
    with pytest.raises(arrayckpt.CheckpointExistsError, match="overwrite=True"):
        arrayckpt.save(_state(2), url)
    _same(url, _state(1))


def test_overwrite_keeps_old_checkpoint_whole_until_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Right before the new root document is written, every chunk of the new checkpoint is in place and the
    old checkpoint must still read back exactly; afterwards only the new one's objects remain."""
    url = _url()
    old, new = _state(1), _state(2)
    arrayckpt.save(old, url)
    before = set(_keys(url))
    seen = []
    original = ObjectWriter.commit

    def commit(self: ObjectWriter, root_document: bytes) -> None:
        _same(url, old)  # the old checkpoint, read while the new one's data is all written
        seen.append(set(_keys(url)) - before)
        original(self, root_document)

    monkeypatch.setattr(ObjectWriter, "commit", commit)
    arrayckpt.save(new, url, overwrite=True)
    assert seen and seen[0], "the new save wrote no objects of its own before committing"
    assert all("zarr.json" not in key for key in seen[0]), "node documents must wait for the commit"
    _same(url, new)
    assert arrayckpt.verify(url).ok  # node documents rewritten, old generation deleted
    after = _keys(url)
    assert not set(after) & (before - {k for k in before if k.endswith("zarr.json")})
    # a third save goes back to the first generation's chunk keys, again without touching the second's
    monkeypatch.undo()
    arrayckpt.save(old, url, overwrite=True)
    _same(url, old)
    assert arrayckpt.verify(url).ok


def test_failed_overwrite_leaves_old_checkpoint_and_no_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    url = _url()
    old = _state(1)
    arrayckpt.save(old, url)
    before = _keys(url)
    from arrayckpt._write import packed as _packed  # chunk_destination's write_all

    real = _packed.write_all

    def failing(jobs, context, where):  # write everything, then fail as a flaky rank would
        real(jobs, context, where)
        raise arrayckpt.StorageError(f"{where}: injected failure")

    monkeypatch.setattr(_packed, "write_all", failing)
    with pytest.raises(arrayckpt.StorageError, match="injected failure"):
        arrayckpt.save(_state(2), url, overwrite=True)
    assert _keys(url) == before
    _same(url, old)


def test_incomplete_prefix_is_reported_and_replaceable(monkeypatch: pytest.MonkeyPatch) -> None:
    url = _url()

    def crash(self: ObjectWriter, root_document: bytes) -> None:
        helpers.crash(self)  # its lease is left to expire
        raise KeyboardInterrupt  # the process dies before its commit; abort never runs

    monkeypatch.setattr(ObjectWriter, "commit", crash)
    monkeypatch.setattr(ObjectWriter, "abort", lambda self: None)
    with pytest.raises(KeyboardInterrupt):
        arrayckpt.save(_state(1), url)
    monkeypatch.undo()
    assert _keys(url), "the interrupted save should have left chunks behind"
    with pytest.raises(arrayckpt.IncompleteCheckpointError, match="never committed"):
        arrayckpt.open(url)
    with pytest.raises(arrayckpt.CheckpointExistsError, match="interrupted save"):
        arrayckpt.save(_state(2), url)
    arrayckpt.save(_state(2), url, overwrite=True)
    _same(url, _state(2))
    assert arrayckpt.verify(url).ok


def test_foreign_objects_are_never_replaced() -> None:
    url = _url()
    location = parse_object_url(url)
    store = ts.KvStore.open(location.kvstore(), context=location.context()).result()
    store.write("notes.txt", b"mine").result()
    with pytest.raises(arrayckpt.CheckpointExistsError, match="notes.txt"):
        arrayckpt.save(_state(1), url, overwrite=True)
    store.write("zarr.json", b'{"zarr_format": 3, "node_type": "group", "attributes": {}}').result()
    with pytest.raises(arrayckpt.CheckpointExistsError, match="not an arrayckpt checkpoint"):
        arrayckpt.save(_state(1), url, overwrite=True)
    assert store.read("notes.txt").result().value == b"mine"


def test_missing_chunk_is_an_error_naming_the_tensor() -> None:
    url = _url()
    arrayckpt.save(_state(1), url)
    location = parse_object_url(url)
    store = ts.KvStore.open(location.kvstore(), context=location.context()).result()
    store.delete_range(ts.KvStore.KeyRange("model/w/c", "model/w/d")).result()
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="model.w"):
        arrayckpt.open(url)["model.w"].numpy()
    report = arrayckpt.verify(url)
    assert not report.ok and report.damaged_keys == ("model.w",)


def test_stale_keys_keep_only_the_checkpoints_objects() -> None:
    metadata = {"node_type": "array", "shape": [4, 6], "chunk_grid": {"configuration": {"chunk_shape": [2, 3]}},
                "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}}}
    nodes = {"": {"node_type": "group"}, "a": {"node_type": "group"}, "a/w": metadata}
    keys = ["zarr.json", "a/zarr.json", "a/w/zarr.json", "a/w/1.1", "a/w/c.1.1", "a/w/2.0", "gone/zarr.json",
            "gone/c.0", "a/w/readme.txt"]
    assert stale_keys(keys, Kept(nodes)) == ["a/w/c.1.1", "a/w/2.0", "gone/zarr.json", "gone/c.0"]


@pytest.mark.parametrize("url, error", [
    ("s3://", "no bucket"),
    ("s3://bucket/a/../b", "must not contain"),
    ("ftp://host/x", "not supported"),
])
def test_bad_urls(url: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        arrayckpt.save({"x": torch.ones(1)}, url)


def test_storage_options_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_REGION", "eu-west-3")
    spec = parse_object_url("s3://bkt/some/prefix/").kvstore("model/w")
    assert spec["endpoint"] == "http://127.0.0.1:9" and spec["aws_region"] == "eu-west-3"
    assert spec["bucket"] == "bkt" and spec["path"] == "some/prefix/model/w/"
    explicit = parse_object_url("s3://bkt/p", {"endpoint_url": "http://127.0.0.1:8", "anon": True}).kvstore()
    assert explicit["endpoint"] == "http://127.0.0.1:8" and explicit["aws_credentials"] == {"type": "anonymous"}
    keyed = parse_object_url("s3://bkt/p", {"key": "AK", "secret": "SK"}).kvstore()
    assert keyed["aws_credentials"]["type"] == "profile"
    with open(keyed["aws_credentials"]["credentials_file"]) as file:
        assert "aws_access_key_id = AK" in file.read()
    with pytest.raises(ValueError, match="unknown storage option"):
        parse_object_url("s3://bkt/p", {"endpoint": "x"})
    with pytest.raises(ValueError, match="go together"):
        parse_object_url("s3://bkt/p", {"key": "AK"}).kvstore()
    assert parse_object_url("gs://bkt/p").kvstore("a") == {"driver": "gcs", "bucket": "bkt", "path": "p/a/"}
    # keys in the environment: TensorStore's environment provider, which opens no ~/.aws files (the default chain
    # would, logging an error line for each one missing); a profile named in the environment: the default chain
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AK")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "SK")
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    assert parse_object_url("s3://bkt/p").kvstore()["aws_credentials"] == {"type": "environment"}
    monkeypatch.setenv("AWS_PROFILE", "work")
    assert "aws_credentials" not in parse_object_url("s3://bkt/p").kvstore()
    with pytest.raises(ValueError, match="object-storage URLs only"):
        arrayckpt.open("/tmp/x", storage_options={"anon": True})


def test_numpy_and_per_rank_and_pickle_values() -> None:
    url = _url()
    state = {"np": np.arange(10, dtype=np.int16), "r": arrayckpt.PerRank(torch.ones(2)), "obj": {1, 2}}
    arrayckpt.save(state, url, allow_pickle=True)
    ckpt = arrayckpt.open(url, allow_pickle=True)
    assert np.array_equal(ckpt["np"].numpy(), state["np"])
    assert torch.equal(ckpt.per_rank("r")[0], torch.ones(2))
    assert ckpt.plain_values["obj"] == {1, 2}
    assert _objstore.OBJECT_SCHEMES == ("s3", "gs", "memory")


def test_reader_overtaken_by_two_replacements_fails_instead_of_mixing() -> None:
    """The second replacement writes the first checkpoint's chunk keys again; a reader that opened the first
    must not get the third checkpoint's bytes under the first's metadata."""
    url = _url()
    arrayckpt.save(_state(1), url)
    first = arrayckpt.open(url)
    arrayckpt.save(_state(2), url, overwrite=True)
    arrayckpt.save(_state(3), url, overwrite=True)  # same chunk keys as the first again
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="replaced"):
        first["model.w"].numpy()
    _same(url, _state(3))  # opened afresh: the third, whole


def _copy_checkpoint(source: str, destination: str, options: dict | None = None) -> None:
    """Copy every object of ``source`` to ``destination`` (object by object, bypassing the writer's checks)."""
    src, dst = parse_object_url(source, options), parse_object_url(destination, options)
    objects = src.read_objects(src.object_keys())
    store = dst.open_store()
    for key, data in objects.items():
        store.write(key, data).result()


def check_checkpoints_never_nest(outer: str, options: dict | None = None) -> None:
    """Issue 13 item 14: a checkpoint inside another's prefix is refused both ways, and an outer save over a
    prefix holding an inner checkpoint (however it got there) never deletes it."""
    kw = {"storage_options": options} if options else {}
    arrayckpt.save(_state(1), outer, **kw)
    before = sorted(parse_object_url(outer, options).object_keys())
    for overwrite in (False, True):
        with pytest.raises(arrayckpt.CheckpointExistsError,
                           match=f"{outer}/in/ner: lies inside the committed checkpoint at {outer};"):
            arrayckpt.save(_state(2), f"{outer}/in/ner", overwrite=overwrite, **kw)
    assert sorted(parse_object_url(outer, options).object_keys()) == before, "a refused save must not write"

    # an inner checkpoint under a committed outer one (saved there by an older version): replacing the outer one
    # is refused and deletes nothing
    arrayckpt.save(_state(3), f"{outer}-src", **kw)
    _copy_checkpoint(f"{outer}-src", f"{outer}/inner", options)
    keys = sorted(parse_object_url(outer, options).object_keys())
    with pytest.raises(arrayckpt.CheckpointExistsError,
                       match=f"{outer}: the committed checkpoint at {outer}/inner lies inside it"):
        arrayckpt.save(_state(4), outer, overwrite=True, **kw)
    assert sorted(parse_object_url(outer, options).object_keys()) == keys
    _same_with(f"{outer}/inner", _state(3), options)
    _same_with(outer, _state(1), options)

    # an inner checkpoint saved first: an outer save over it (an incomplete-looking prefix) is refused too
    lone = f"{outer}-lone"
    arrayckpt.save(_state(5), f"{lone}/inner", **kw)
    keys = sorted(parse_object_url(lone, options).object_keys())
    with pytest.raises(arrayckpt.CheckpointExistsError,
                       match=f"{lone}: the committed checkpoint at {lone}/inner lies inside it"):
        arrayckpt.save(_state(6), lone, overwrite=True, **kw)
    assert sorted(parse_object_url(lone, options).object_keys()) == keys
    _same_with(f"{lone}/inner", _state(5), options)


def _same_with(url: str, state: dict, options: dict | None) -> None:
    ckpt = arrayckpt.open(url, storage_options=options)
    assert torch.equal(ckpt["model.w"].torch(), state["model"]["w"])
    assert ckpt.plain_values["step"] == state["step"]
    assert arrayckpt.verify(url, storage_options=options).ok


def test_checkpoints_never_nest_on_object_storage() -> None:
    check_checkpoints_never_nest(_url())


def test_a_store_answering_a_conditional_read_with_the_object_is_judged_by_its_generation(monkeypatch):
    """fake-gcs-server (the usual GCS emulator) answers ``ifGenerationNotMatch`` with 200, the object and the same
    generation: the checkpoint has not changed, and reads of it must not fail as replaced ones."""
    from arrayckpt._storage import parse_location

    url = _url()
    arrayckpt.save({"w": torch.ones(4)}, url)
    location = parse_location(url)
    _, _, release, token = location.open_committed()
    opened = _objstore.ObjectLocation.open_store

    class IgnoresCondition:
        def __init__(self, store: ts.KvStore) -> None:
            self.store = store

        def read(self, key: str, **conditions: object) -> object:
            return self.store.read(key)  # the condition dropped, as the emulator does

    monkeypatch.setattr(_objstore.ObjectLocation, "open_store", lambda self: IgnoresCondition(opened(self)))
    try:
        assert location.changed_since(token) is False
        with arrayckpt.open(url) as checkpoint:
            assert torch.equal(torch.from_numpy(checkpoint["w"][:]), torch.ones(4))
        monkeypatch.undo()
        arrayckpt.save({"w": torch.zeros(4)}, url, overwrite=True)
        monkeypatch.setattr(_objstore.ObjectLocation, "open_store", lambda self: IgnoresCondition(opened(self)))
        assert location.changed_since(token) is True  # another generation: replaced
    finally:
        release()
