"""The storage interface's contract (``arrayckpt/_storage/base.py``), checked on every storage: a local
directory, TensorStore's ``memory://`` store and S3 (moto). One test class, like zarr-python's ``StoreTests``:
each test states a promise of :class:`Location` or :class:`Writer` and must hold on all three."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tensorstore as ts
import torch
from helpers import crash

import arrayckpt
import arrayckpt._storage.local as local_storage
import arrayckpt._storage.object as object_storage
from arrayckpt._errors import FormatError
from arrayckpt._format.zarr import chunk_key
from arrayckpt._io.arrays import resolve_context
from arrayckpt._storage import ROOT_METADATA, Location, Writer, parse_location


@dataclass(frozen=True)
class Storage:
    kind: str
    root: Location  # a place holding checkpoints (empty at first)
    options: dict[str, Any] | None  # the storage_options it was parsed with

    def at(self, name: str) -> Location:
        return self.root.child(name)


@pytest.fixture(params=["local", "memory", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage("local", parse_location(tmp_path / "run"), None)
    if request.param == "memory":
        return Storage("memory", parse_location(f"memory://conformance-{uuid.uuid4().hex[:12]}/run"), None)
    server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    options = {"endpoint_url": server.endpoint}
    return Storage("s3", parse_location(f"s3://{bucket}/run", options), options)


@pytest.fixture
def elsewhere(storage: Storage, tmp_path: Path) -> Location:
    """A location on another kind of storage than ``storage``'s."""
    if storage.kind == "local":
        return parse_location(f"memory://elsewhere-{uuid.uuid4().hex[:12]}/x")
    return parse_location(tmp_path / "elsewhere" / "x")


# --- helpers: bytes in and out through the interface's own kvstore specs and contexts ------------------------


def _put(location: Location, subpath: str, key: str, data: bytes) -> None:
    store = ts.KvStore.open(location.kvstore(subpath), context=resolve_context(location.write_context())).result()
    store.write(key, data).result()


def _get(kvstore: dict[str, Any], context: Any, key: str) -> bytes | None:
    result = ts.KvStore.open(kvstore, context=resolve_context(context)).result().read(key).result()
    return result.value if result.state == "value" else None


def _array_document(encoding: str) -> dict[str, Any]:
    return {"zarr_format": 3, "node_type": "array", "shape": [4], "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4]}},
            "chunk_key_encoding": {"name": encoding, "configuration": {"separator": "."}}, "fill_value": 0,
            "codecs": [{"name": "bytes"}], "attributes": {"arrayckpt": {"key": "w"}}}


def _root_document(array: dict[str, Any], step: int) -> bytes:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {"arrayckpt": {"step": step}},
                       "consolidated_metadata": {"kind": "inline", "must_understand": False,
                                                 "metadata": {"w": array}}}).encode()


def _write_data(writer: Writer) -> dict[str, Any]:
    """What the ranks of a save do: one array's document (through the coordinator) and its one chunk."""
    array = _array_document(writer.key_encoding)
    wait = writer.write_documents({"w": json.dumps(array).encode()})
    store = ts.KvStore.open(writer.kvstore("w"), context=resolve_context(writer.target.write_context())).result()
    store.write(chunk_key(array, (0,)), b"\x01\x02\x03\x04").result()
    writer.target.finish_rank_writes()
    wait()
    return array


def _save(storage: Storage, location: Location, value: float, overwrite: bool = False) -> None:
    arrayckpt.save({"w": torch.full((4,), value)}, location.native, overwrite=overwrite,
                   storage_options=storage.options)


def _value(storage: Storage, location: Location) -> float:
    return float(arrayckpt.open(location.native, storage_options=storage.options)["w"].torch()[0])


class TestStorage:
    """Every promise of ``_storage/base.py``, on every storage."""

    def test_parse_location_round_trip(self, storage: Storage) -> None:
        root = storage.root
        assert isinstance(root, Location)
        assert parse_location(str(root), storage.options) == root
        assert parse_location(root) is root
        assert str(root.native) == str(root) and parse_location(root.native, storage.options) == root
        assert str(root.child("step-1")) == f"{root}/step-1"

    def test_read_root_errors(self, storage: Storage) -> None:
        missing = storage.at("missing")
        for read in (missing.read_root, missing.open_committed):
            with pytest.raises(arrayckpt.CheckpointNotFoundError, match="no checkpoint here"):
                read()
        assert not missing.is_committed() and missing.node_document("") is None

        incomplete = storage.at("incomplete")
        _put(incomplete, "w", "c.0", b"data but no commit")
        for read in (incomplete.read_root, incomplete.open_committed):
            with pytest.raises(arrayckpt.IncompleteCheckpointError, match="incomplete checkpoint"):
                read()
        assert not incomplete.is_committed()

        damaged = storage.at("damaged")
        _put(damaged, "", ROOT_METADATA, b"{damaged")
        with pytest.raises(arrayckpt.CorruptCheckpointError, match="root zarr.json is damaged"):
            damaged.read_root()
        assert not damaged.is_committed()

    def test_writer_save_then_read(self, storage: Storage) -> None:
        location = storage.at("step-1")
        writer = location.open_writer(overwrite=False)
        assert writer.location == location and writer.key_encoding in ("default", "v2")
        array = _write_data(writer)
        with pytest.raises(arrayckpt.ArrayckptError):
            location.read_root()  # nothing is committed before the commit
        writer.commit(_root_document(array, 1))

        assert location.is_committed()
        assert location.read_root()["attributes"]["arrayckpt"] == {"step": 1}
        document, kvstore, release, token = location.open_committed()
        try:
            assert document == location.read_root()
            assert _get(kvstore, location.read_context(), f"w/{chunk_key(array, (0,))}") == b"\x01\x02\x03\x04"
            assert not location.changed_since(token)
        finally:
            release()
        assert json.loads(location.node_document("w")) == array
        assert json.loads(location.node_document("")) == document
        assert location.node_document("nothing") is None

    def test_replacing_needs_overwrite(self, storage: Storage) -> None:
        location = storage.at("step-1")
        _save(storage, location, 1.0)
        before = location.read_root()
        with pytest.raises(arrayckpt.CheckpointExistsError, match="a committed checkpoint is already here"):
            location.open_writer(overwrite=False)
        writer = location.open_writer(overwrite=True)  # allowed, and harmless until it commits
        _write_data(writer)
        assert location.read_root() == before and _value(storage, location) == 1.0
        writer.abort()
        assert location.read_root() == before and _value(storage, location) == 1.0
        _save(storage, location, 2.0, overwrite=True)
        assert location.read_root() != before and _value(storage, location) == 2.0

    def test_changed_since(self, storage: Storage) -> None:
        location = storage.at("step-1")
        _save(storage, location, 1.0)
        _, _, release, token = location.open_committed()
        try:
            assert location.changed_since(token) is False
            assert location.changed_since(token) is False  # asking does not change anything
            _save(storage, location, 2.0, overwrite=True)
            assert location.changed_since(token) is True
        finally:
            release()
        _, _, release, token = location.open_committed()
        try:
            assert location.changed_since(token) is False
            location.delete()
            assert location.changed_since(token) is True
        finally:
            release()

    def test_pins_reads(self, storage: Storage) -> None:
        """Where reads are pinned, the opened kvstore never yields a later checkpoint's bytes; where not, it does,
        and ``changed_since`` is what tells the reader."""
        location = storage.at("step-1")
        _save(storage, location, 1.0)
        old_root = location.node_document("")
        _, kvstore, release, token = location.open_committed()
        try:
            context = location.read_context()
            assert _get(kvstore, context, ROOT_METADATA) == old_root
            _save(storage, location, 2.0, overwrite=True)
            new_root = location.node_document("")
            assert new_root != old_root
            seen = _get(kvstore, context, ROOT_METADATA)
            assert location.changed_since(token)
            if location.pins_reads:
                assert seen in (old_root, None)  # the old checkpoint's bytes, or none once it is removed
            else:
                assert seen == new_root  # the reader must check changed_since after reading
        finally:
            release()
        assert location.pins_reads == (storage.kind == "local")  # local directories are pinned

    def test_abort_leaves_nothing(self, storage: Storage) -> None:
        location = storage.at("step-1")
        writer = location.open_writer(overwrite=False)
        _write_data(writer)
        writer.abort()
        assert storage.root.children() == []
        assert storage.root.leftovers(0) == ([], [])
        with pytest.raises(arrayckpt.CheckpointNotFoundError):
            location.read_root()
        _save(storage, location, 3.0)  # nothing is in the way
        assert _value(storage, location) == 3.0

    def test_interrupted_save_is_a_leftover(self, storage: Storage) -> None:
        sibling = storage.at("step-1")
        _save(storage, sibling, 1.0)
        writer = storage.at("step-2").open_writer(overwrite=False)
        _write_data(writer)
        for min_age in (3600, 0):  # a live save is kept whatever the minimum age (its lock or lease, spec §9.4)
            found, kept = storage.root.leftovers(min_age)
            assert found == [] and len(kept) == 1 and "step-2" in kept[0][0]
            assert "a save is running" in kept[0][1]
        crash(writer)  # ... and the process dies: no commit, no abort

        found, kept = storage.root.leftovers(3600)
        assert found == [] and len(kept) == 1 and "step-2" in kept[0][0]  # too recent: maybe still running
        found, kept = storage.root.leftovers(0)
        assert kept == [] and len(found) == 1
        (leftover,) = found
        assert leftover.url == str(leftover.location) and leftover.url.startswith(f"{storage.root}/")
        assert "step-2" in leftover.url and (leftover.age_s is None or leftover.age_s >= 0)

        assert leftover.remove() is True
        assert storage.root.leftovers(0) == ([], [])
        assert storage.root.children() == ["step-1"]
        assert sibling.is_committed() and _value(storage, sibling) == 1.0

    def test_overwrite_replaces_what_an_interrupted_first_save_left(self, storage: Storage) -> None:
        """A save killed after its documents but before some array's chunks (what a killed upload of a two-tier
        manager leaves) is replaced by a save with ``overwrite=True``: an array's ``zarr.json``, whose attributes
        carry ``arrayckpt`` too, is not mistaken for a committed checkpoint lying inside."""
        location = storage.at("step-1")
        writer = location.open_writer(overwrite=False)
        other = {**_array_document(writer.key_encoding), "attributes": {"arrayckpt": {"key": "v"}}}
        writer.write_documents({"v": json.dumps(other).encode()})()
        _write_data(writer)  # "w" with its chunk; "v" without: then the process dies (no commit, no abort)
        crash(writer)
        _save(storage, location, 4.0, overwrite=True)
        assert _value(storage, location) == 4.0
        assert arrayckpt.verify(location.native, storage_options=storage.options).ok

    def test_children_and_child(self, storage: Storage) -> None:
        root = storage.root
        assert root.children() == []
        root.make_directory()
        assert root.children() == [] and root.leftovers(0) == ([], [])
        for name in ("step-3", "step-1"):
            _save(storage, storage.at(name), 1.0)
        _put(storage.at("step-2"), "w", "c.0", b"incomplete")
        assert root.children() == ["step-1", "step-2", "step-3"]
        assert root.child("step-1") == parse_location(f"{root}/step-1", storage.options)
        assert root.child("step-1").is_committed() and not root.child("step-2").is_committed()
        assert root.child("step-1").children() == ["w"]
        assert root.child("nothing").children() == []
        for bad in ("", ".", "..", "a/b"):
            with pytest.raises(ValueError, match="is not the name of a location right below it"):
                root.child(bad)

    def test_resolve_and_reference_from(self, storage: Storage, elsewhere: Location) -> None:
        base, delta = storage.at("base"), storage.at("delta")
        deep = storage.at("x").child("y")
        assert base.reference_from(delta) == "../base"
        assert base.reference_from(deep) == "../../base"
        assert base.reference_from(base) == "."
        for here in (delta, deep):
            assert here.resolve(base.reference_from(here)) == base
        with pytest.raises(FormatError, match="does not begin with '../'"):  # spec §10.1: never the checkpoint itself
            base.resolve(base.reference_from(base))
        with pytest.raises(FormatError, match="climbs"):  # resolved on segments, never clamped at the storage's root
            base.resolve("../" * (len(base.tree.parts) + 1) + "x")
        # across kinds of storage: absolute, and resolved without this storage's options
        assert base.reference_from(elsewhere) == str(base) and elsewhere.reference_from(base) == str(elsewhere)
        assert str(elsewhere.resolve(str(base))) == str(base)
        assert base.resolve(str(elsewhere)) == parse_location(str(elsewhere))
        assert base.resolve(str(base)) == base  # same storage, absolute: this storage's options go with it

    def test_delete_removes_the_commit_first(self, storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
        location = storage.at("step-1")
        _save(storage, location, 1.0)

        class CutShort(Exception):
            pass

        def fail(*args: Any, **kwargs: Any) -> None:
            raise CutShort

        with monkeypatch.context() as patch:  # the removal of the data fails, after the commit's
            if storage.kind == "local":
                patch.setattr(local_storage, "remove_arrayckpt_files", fail)
            else:
                delete = object_storage._delete
                patch.setattr(object_storage, "_delete",
                              lambda store, keys, where: delete(store, keys, where) if keys == [ROOT_METADATA]
                              else fail())
            with pytest.raises(CutShort):
                location.delete()
        with pytest.raises(arrayckpt.IncompleteCheckpointError):
            location.read_root()  # never a damaged committed checkpoint
        location.delete()
        with pytest.raises(arrayckpt.CheckpointNotFoundError):
            location.read_root()
        assert not location.is_committed() and storage.root.children() == []
        location.delete()  # nothing there: not an error
