"""arrayckpt on GCS: a real fake-gcs-server (``tests/gcs_server.py``) reached through ``storage_options`` as gcsfs
users write them (``endpoint_url``, ``token="anon"``). Saves, opens and loads, a delta, ``arrayckpt.copy`` both ways,
a two-tier manager with a ``gs://`` remote, ``arrayckpt.gc`` with the objects' times from gcsfs, and zarr-python
reading through gcsfs. The first tests need no server: which options ``gs://`` takes, and where the endpoint goes
(TensorStore's ``gcs`` driver reads it from ``TENSORSTORE_GCS_HTTP_URL``, one per process)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gcs_server import GCSServer
from helpers import assert_bit_equal, bits

import arrayckpt
from arrayckpt._storage.clients import GCS_ENDPOINT_VARIABLE, GCS_PUBLIC_ENDPOINT, point_gcs_at
from arrayckpt._storage.object import parse_object_url

# --- the options, without a server ---------------------------------------------------------------------------------


def test_unknown_or_unhonoured_gs_options_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    with pytest.raises(arrayckpt.LocationError, match=r"unknown storage option\(s\) \['endpoint'\] for gs://; "
                                                      r"known: \['endpoint_url', 'max_retries', 'project'"):
        parse_object_url("gs://bkt/p", {"endpoint": "http://127.0.0.1:4443"})
    with pytest.raises(ValueError, match=r"unknown storage option\(s\) \['key', 'region'\] for gs://"):
        arrayckpt.save({"x": torch.ones(1)}, "gs://bkt/p", storage_options={"key": "K", "region": "us"})
    with pytest.raises(arrayckpt.LocationError, match="point GOOGLE_APPLICATION_CREDENTIALS at the key file"):
        parse_object_url("gs://bkt/p", {"token": "/keys/service-account.json"})
    with pytest.raises(arrayckpt.LocationError, match="must be an http:// or https:// URL"):
        parse_object_url("gs://bkt/p", {"endpoint_url": "127.0.0.1:4443"})


def test_the_endpoint_reaches_tensorstore_and_gcsfs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    location = parse_object_url("gs://bkt/p", {"endpoint_url": "http://127.0.0.1:4443/", "token": "anon",
                                               "project": "test", "request_concurrency": 8})
    assert location.kvstore("a") == {"driver": "gcs", "bucket": "bkt", "path": "p/a/"}  # (no endpoint member)
    assert location.fsspec_options() == {"endpoint_url": "http://127.0.0.1:4443", "token": "anon", "project": "test"}
    # the standard emulator variable of google-cloud-storage and gcsfs is the default
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "localhost:9023")
    assert parse_object_url("gs://bkt/p").option["endpoint_url"] == "http://localhost:9023"
    assert parse_object_url("gs://bkt/p", {"endpoint_url": "http://e:1"}).option["endpoint_url"] == "http://e:1"
    # TensorStore's gcs driver reads its endpoint from the environment when it opens a bucket: the first gs://
    # configuration of a process sets it, another endpoint is refused (it would redirect the first one's requests)
    environ: dict[str, str] = {}
    point_gcs_at("http://127.0.0.1:4443", environ)
    assert environ == {GCS_ENDPOINT_VARIABLE: "http://127.0.0.1:4443"}
    point_gcs_at("http://127.0.0.1:4443/", environ)
    with pytest.raises(arrayckpt.LocationError, match=r"already reaches GCS at http://127.0.0.1:4443 .*one GCS "
                                                      "endpoint per process"):
        point_gcs_at(None, environ)
    public: dict[str, str] = {}
    point_gcs_at(None, public)  # Google's endpoint is pinned too, so that an emulator cannot take its requests
    assert public == {GCS_ENDPOINT_VARIABLE: GCS_PUBLIC_ENDPOINT}
    with pytest.raises(arrayckpt.LocationError, match="already reaches GCS at https://storage.googleapis.com"):
        point_gcs_at("http://127.0.0.1:4443", public)


# --- against fake-gcs-server ---------------------------------------------------------------------------------------


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "bf": torch.randn(8, 8, generator=g).to(torch.bfloat16), "step": seed}


def _same(url: str, state: dict, options: dict) -> None:
    """The checkpoint at ``url`` holds exactly ``state`` (open and read every tensor, then load in place)."""
    with arrayckpt.open(url, storage_options=options) as ckpt:
        assert sorted(ckpt) == ["bf", "model.b", "model.w"]
        assert_bit_equal(ckpt["model.w"].torch(), state["model"]["w"])
        assert ckpt.plain_values["step"] == state["step"]
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
              "bf": torch.zeros_like(state["bf"]), "step": -1}
    arrayckpt.load(target, url, storage_options=options)
    for key in ("w", "b"):
        assert_bit_equal(target["model"][key], state["model"][key])
    assert_bit_equal(target["bf"], state["bf"])
    assert target["step"] == state["step"]


def test_save_open_load_overwrite_and_zarr_python_read(gcs_server: GCSServer, gcs_bucket: str) -> None:
    import zarr
    from gcsfs.core import GCSFileSystem

    url, options = f"gs://{gcs_bucket}/run/step-1", gcs_server.options
    state = _state(1)
    arrayckpt.save(state, url, storage_options=options, step=1)
    arrays = {"model/w", "model/b", "bf"}
    keys = gcs_server.list_keys(gcs_bucket)
    assert {k.rpartition("/")[0] for k in keys} == {"run/step-1", "run/step-1/model"} | {
        f"run/step-1/{a}" for a in arrays}, keys  # (no lease left behind)
    _same(url, state, options)
    assert arrayckpt.verify(url, storage_options=options).ok

    # a replacement: the old checkpoint is whole until the new one commits (the other chunk key encoding), and its
    # chunks are gone after; readers notice the replacement by the root's generation
    location = parse_object_url(url, options)
    before = location.open_committed()
    assert not location.changed_since(before.token)  # (the emulator answers 200, not 304: judged by generation)
    arrayckpt.save(_state(2), url, storage_options=options, step=2, overwrite=True)
    assert location.changed_since(before.token)
    _same(url, _state(2), options)
    assert not any(k.endswith("/c.0.0") or k.endswith("/c.0") for k in gcs_server.list_keys(gcs_bucket)), \
        "the replaced checkpoint's chunks are deleted after the commit"

    # zarr-python through gcsfs, torch not involved. gcsfs.core.GCSFileSystem: the file system recent gcsfs makes by
    # default asks each bucket's layout over gRPC first, which the emulator does not serve (up to a minute per call)
    fs = GCSFileSystem(asynchronous=True, **location.fsspec_options())
    store = zarr.storage.FsspecStore(fs, path=f"{gcs_bucket}/run/step-1", read_only=True)
    group = zarr.open_group(store, mode="r")
    consolidated = group.metadata.consolidated_metadata
    assert consolidated is not None and arrays <= set(consolidated.flattened_metadata)
    assert group.attrs["arrayckpt"]["step"] == 2
    np.testing.assert_array_equal(group["model/w"][:], _state(2)["model"]["w"].numpy())
    bf = group["bf"][:]
    assert str(bf.dtype) == "bfloat16" and bf.view(np.uint16).tobytes() == bits(_state(2)["bf"]).numpy().tobytes()


def test_delta_save_and_load(gcs_server: GCSServer, gcs_bucket: str) -> None:
    options, root = gcs_server.options, f"gs://{gcs_bucket}/delta"
    emb = torch.arange(4000.0).reshape(1000, 4)
    arrayckpt.save({"emb": emb, "step": 1}, f"{root}/base", storage_options=options)
    emb[7], emb[900] = -1.0, -2.0
    arrayckpt.save({"emb": emb, "step": 2}, f"{root}/delta", storage_options=options, base=f"{root}/base",
                   changed_rows={"emb": [7, 900]})
    with arrayckpt.open(f"{root}/delta", storage_options=options) as delta:
        assert delta.manifest.base.path == "../base"
    target = {"emb": torch.zeros(1000, 4), "step": 0}
    arrayckpt.load(target, f"{root}/delta", storage_options=options)
    assert torch.equal(target["emb"], emb) and target["step"] == 2


def test_copy_local_to_gs_and_back(gcs_server: GCSServer, gcs_bucket: str, tmp_path: Path) -> None:
    options, state = gcs_server.options, _state(3)
    arrayckpt.save(state, tmp_path / "local", step=3)
    url = f"gs://{gcs_bucket}/copied/step-3"
    arrayckpt.copy(tmp_path / "local", url, dst_options=options, read_back=True)
    _same(url, state, options)
    arrayckpt.copy(url, tmp_path / "back", src_options=options)
    _same(str(tmp_path / "back"), state, {})


def test_two_tier_manager_with_a_gs_remote(gcs_server: GCSServer, gcs_bucket: str, tmp_path: Path) -> None:
    options = gcs_server.options
    remote = arrayckpt.Remote(f"gs://{gcs_bucket}/run", storage_options=options,
                              retention=arrayckpt.Retention(keep_last=2))
    with arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=1), remote=remote) as manager:
        for step in range(1, 4):
            manager.save(step, _state(step))
        manager.wait_for_uploads()
        assert manager.upload_errors() == []
        assert manager.tiers() == {2: ("remote",), 3: ("local", "remote")}
        _same(manager.remote_path(2), _state(2), options)
    restored = _state(0)
    with arrayckpt.CheckpointManager(tmp_path / "elsewhere", remote=remote) as fresh:
        assert fresh.restore(restored) == 3
    assert_bit_equal(restored["model"]["w"], _state(3)["model"]["w"])


def test_gc_on_a_gs_root_uses_the_objects_times(gcs_server: GCSServer, gcs_bucket: str) -> None:
    options, root = gcs_server.options, f"gs://{gcs_bucket}/run"
    arrayckpt.save(_state(1), f"{root}/step-1", storage_options=options)
    # an interrupted save: an array's document and a chunk, no root zarr.json
    document = gcs_server.get_object(gcs_bucket, "run/step-1/model/w/zarr.json")
    gcs_server.put_object(gcs_bucket, "run/step-2/model/w/zarr.json", document)
    gcs_server.put_object(gcs_bucket, "run/step-2/model/w/c.0.0", b"partial")
    assert arrayckpt.gc(root, storage_options=options) == []  # just written (gcsfs gives the times): kept
    assert arrayckpt.gc(root, min_age_s=0, dry_run=True, storage_options=options) == [f"{root}/step-2"]
    assert arrayckpt.gc(root, min_age_s=0, storage_options=options) == [f"{root}/step-2"]
    assert {k.split("/")[1] for k in gcs_server.list_keys(gcs_bucket, "run/")} == {"step-1"}
    _same(f"{root}/step-1", _state(1), options)
