"""arrayckpt on S3: a real moto server on 127.0.0.1, reached through the fault-injecting, request-counting
proxy of ``s3_server.py``. Saves and loads (one rank and several), reading with arrayckpt and with
zarr-python over s3fs, the cost of opening a large checkpoint, incomplete prefixes, transient and permanent
failures, overwrites that keep the old checkpoint whole until the commit, and explicit credentials."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers import assert_bit_equal, bits
from policies import small_chunks
from s3_server import REGION, FaultProxy, S3Server, patched_environ, s3fs_storage_options

import arrayckpt
from arrayckpt._storage.object import ObjectWriter, kept_of, parse_object_url, stale_keys

pytestmark = pytest.mark.slow  # spawns processes, starts a server or runs a foreign stack

MANY = 1_500  # tensors in the checkpoint whose open must cost O(1) requests


def _options(proxy: FaultProxy | S3Server, **more: object) -> dict:
    return {"endpoint_url": proxy.endpoint, **more}


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)},
            "bf": torch.randn(8, 8, generator=g).to(torch.bfloat16), "count": torch.tensor(seed),
            "step": seed}


def _zeros_like(state: dict) -> dict:
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "bf": torch.zeros_like(state["bf"]), "count": torch.zeros_like(state["count"]), "step": -1}


def _same(url: str, state: dict, options: dict) -> None:
    """The checkpoint at ``url`` holds exactly ``state`` (open, read every tensor, and load in place)."""
    ckpt = arrayckpt.open(url, storage_options=options)
    assert sorted(ckpt) == ["bf", "count", "model.b", "model.w"]
    assert_bit_equal(ckpt["model.w"].torch(), state["model"]["w"])
    assert_bit_equal(ckpt["model.b"].torch(), state["model"]["b"])
    assert_bit_equal(ckpt["bf"].torch(), state["bf"])
    assert_bit_equal(ckpt["count"].torch(), state["count"])
    assert ckpt.plain_values["step"] == state["step"]
    target = _zeros_like(state)
    arrayckpt.load(target, url, storage_options=options)
    for key in ("w", "b"):
        assert_bit_equal(target["model"][key], state["model"][key])
    assert_bit_equal(target["bf"], state["bf"])
    assert_bit_equal(target["count"], state["count"])
    assert target["step"] == state["step"]


def _etags(server: S3Server, bucket: str, prefix: str) -> dict[str, str]:
    out = {}
    for page in server.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return out


def _authorization(headers: dict[str, str]) -> str:
    """A request's SigV4 ``Authorization`` header (TensorStore sends it in lower case)."""
    return next((v for k, v in headers.items() if k.lower() == "authorization"), "")


def _range_bytes(header: str, size: int) -> int:
    """Bytes a ``Range`` header asks for (``bytes=a-b`` or a suffix ``bytes=-n``)."""
    first, last = re.fullmatch(r"bytes=(\d*)-(\d*)", header).groups()
    return int(last) if not first else min(int(last), size - 1) - int(first) + 1


# --- 1. one rank: save through TensorStore, read with arrayckpt and with zarr-python (s3fs) ---------------


def test_save_open_load_and_zarr_python_read(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str) -> None:
    import zarr

    url, options = f"s3://{s3_bucket}/run/step-1", _options(s3_proxy)
    state = _state(1)
    arrayckpt.save(state, url, storage_options=options, step=1)
    # a fresh prefix: probe the root of each prefix above (the bucket's, run/: no checkpoint to lie inside) and
    # its own, list the prefix, take the save's lease (spec §9.4: a GET, a conditional PUT, a GET to read it
    # back), then one PUT per chunk and per document; list the prefix once more (every chunk still there), PUT the
    # root and delete the lease (HEAD, DELETE: conditional); nothing else is listed or deleted after the commit
    # (there was nothing to replace)
    keys = sorted(s3_server.list_keys(s3_bucket))
    arrays = {"model/w", "model/b", "bf", "count"}
    assert {k.rpartition("/")[0] for k in keys} == {"run/step-1"} | {f"run/step-1/{a}" for a in arrays} | {
        "run/step-1/model"}
    assert s3_proxy.counts == {"GET": 7, "HEAD": 1, "PUT": len(keys) + 1, "DELETE": 1}, s3_proxy.counts
    assert s3_proxy.log[-3][:2] == ("PUT", f"/{s3_bucket}/run/step-1/zarr.json"), "the root must be written last"
    assert [r[:2] for r in s3_proxy.log[-2:]] == [(m, f"/{s3_bucket}/run/step-1/.arrayckpt-lease")
                                                 for m in ("HEAD", "DELETE")]  # (a conditional DELETE)
    assert s3_proxy.count("GET", lists=True) == 2

    _same(url, state, options)
    report = arrayckpt.verify(url, storage_options=options)
    assert report.ok and report.arrays == 4, report.to_dict()

    # zarr-python through fsspec/s3fs, torch not involved: consolidated metadata at the root, every array
    # readable (bfloat16 too, registered with zarr-python by arrayckpt's entry point)
    s3_proxy.reset()
    group = zarr.open_group(f"s3://{s3_bucket}/run/step-1", mode="r",
                            storage_options=s3fs_storage_options(s3_proxy.endpoint))
    consolidated = group.metadata.consolidated_metadata
    assert consolidated is not None and arrays <= set(consolidated.flattened_metadata)
    assert group.attrs["arrayckpt"]["step"] == 1
    np.testing.assert_array_equal(group["model/w"][:], state["model"]["w"].numpy())
    np.testing.assert_array_equal(group["model/b"][:], state["model"]["b"].numpy())
    assert group["count"][()] == 1
    bf = group["bf"][:]
    assert str(bf.dtype) == "bfloat16" and bf.shape == (8, 8)
    assert bf.view(np.uint16).tobytes() == bits(state["bf"]).numpy().tobytes()
    assert s3_proxy.count("PUT") == 0 and s3_proxy.count("DELETE") == 0


# --- 2. several ranks: each writes its own chunks; a load on another number of ranks reshards ----------


def _global() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(12, 16, generator=g),  # rows split 6/6 at save, 4/4/4 at load
            "bf": torch.randn(9, 8, generator=g).bfloat16(),  # rows split 5/4 at save, columns 3/3/2 at load
            "rep": torch.arange(40, dtype=torch.int64)}  # replicated


def _s3_writes() -> tuple[int, int]:
    """PUTs and bytes this process has written to S3 (TensorStore's own counters)."""
    import tensorstore as ts

    found = {m["name"].rpartition("/")[2]: m["values"][0]["value"]
             for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/s3/")
             if m["name"].endswith(("/write", "/bytes_written"))}
    return found.get("write", 0), found.get("bytes_written", 0)


def _save_on_ranks(rank: int, world: int, url: str, endpoint: str) -> tuple[int, int]:
    full = _global()
    bf_rows = (0, 5, 9)
    state = {"w": arrayckpt.Shard(full["w"][6 * rank:6 * (rank + 1)].clone(), (12, 16), (6 * rank, 0)),
             "bf": arrayckpt.Shard(full["bf"][bf_rows[rank]:bf_rows[rank + 1]].clone(), (9, 8), (bf_rows[rank], 0)),
             "rep": full["rep"].clone(), "step": 3}
    # several (sharded) chunks per rank's piece
    small_chunks(64, 256).save(state, url, storage_options={"endpoint_url": endpoint}, step=3)
    return _s3_writes()


def _load_as_rank(rank: int, url: str, options: dict) -> None:
    """Load rank ``rank``'s pieces of a 3-rank layout: rows of ``w`` by 4, columns of ``bf`` by 3/3/2."""
    full = _global()
    cols = [(0, 3), (3, 6), (6, 8)][rank]
    target = {"w": arrayckpt.Shard(torch.zeros(4, 16), (12, 16), (4 * rank, 0)),
              "bf": arrayckpt.Shard(torch.zeros(9, cols[1] - cols[0], dtype=torch.bfloat16), (9, 8), (0, cols[0])),
              "rep": torch.zeros(40, dtype=torch.int64), "step": 0}
    arrayckpt.load(target, url, storage_options=options)
    assert_bit_equal(target["w"].tensor, full["w"][4 * rank:4 * (rank + 1)])
    assert_bit_equal(target["bf"].tensor, full["bf"][:, cols[0]:cols[1]])
    assert_bit_equal(target["rep"], full["rep"])
    assert target["step"] == 3


@pytest.mark.usefixtures("storage_layout")  # each chunk object's GETs: the files layout (packed: test_s3_packed)
@pytest.mark.parametrize("storage_layout", ["files"], indirect=True)
def test_two_rank_save_and_resharded_loads(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str) -> None:
    from dist_helpers import run_ranks

    url = f"s3://{s3_bucket}/dist"
    writes = run_ranks(2, _save_on_ranks, url, s3_proxy.endpoint)
    # both ranks wrote their share straight to S3 (the replicated tensor's chunks spread over both); every
    # PUT the store saw came from one of them; the root document came last
    data = 12 * 16 * 4 + 9 * 8 * 2 + 40 * 8
    assert all(puts > 0 for puts, _ in writes) and 0 < writes[1][1] < data, writes  # rank 0 also wrote metadata
    # (TensorStore counts the DELETE of the save's lease after the commit as a write)
    assert sum(puts for puts, _ in writes) == s3_proxy.counts["PUT"] + s3_proxy.counts["DELETE"]
    assert s3_proxy.count("PUT", path_contains="/dist/zarr.json") == 1
    assert [r[:2] for r in s3_proxy.log if r[0] == "PUT"][-1] == ("PUT", f"/{s3_bucket}/dist/zarr.json")

    full = _global()
    ckpt = arrayckpt.open(url, storage_options=_options(s3_server))
    assert ckpt.manifest.created["world_size"] == 2
    assert ckpt["w"].metadata["codecs"][0]["name"] == "sharding_indexed", "the test wants sharded chunks"
    for key, value in full.items():
        assert_bit_equal(ckpt[key].torch(), value)
    # resharding loads, in this process (spawning 3 more ranks would double the test's time; the per-rank
    # reads are the same): a 3-rank layout's pieces, whole tensors, a piece straddling both saved shards
    # w is stored in 4 shards of 3 rows; each rank reads only the shards its 4 rows touch, a partly needed
    # shard by byte ranges (its index, then the rows' inner chunks)
    prefix = f"/{s3_bucket}/dist/w/"
    for rank, (whole_shard, partial_shard) in enumerate([("c.0.0", "c.1.0"), (None, None), ("c.3.0", "c.2.0")]):
        s3_proxy.reset()
        _load_as_rank(rank, url, _options(s3_proxy))
        reads = [(path.removeprefix(prefix), rng) for m, path, _, rng in s3_proxy.log if path.startswith(prefix)]
        assert {name for name, _ in reads} == [{"c.0.0", "c.1.0"}, {"c.1.0", "c.2.0"}, {"c.2.0", "c.3.0"}][rank]
        if whole_shard is not None:
            assert (whole_shard, None) in reads and all(rng for name, rng in reads if name == partial_shard), reads
        else:  # rows 4..7: the ends of two shards, both by ranges
            assert all(rng for _, rng in reads), reads
    whole = {k: torch.zeros_like(v) for k, v in full.items()}
    arrayckpt.load(whole, url, storage_options=_options(s3_server), strict=False)
    for key, value in full.items():
        assert_bit_equal(whole[key], value)
    middle = {"w": arrayckpt.Shard(torch.zeros(5, 7), (12, 16), (4, 5))}
    arrayckpt.load(middle, url, storage_options=_options(s3_server), strict=False)
    assert_bit_equal(middle["w"].tensor, full["w"][4:9, 5:12])
    assert arrayckpt.verify(url, storage_options=_options(s3_server)).ok


# --- 3. opening is cheap: O(1) requests however many tensors; slice reads fetch byte ranges -------------


@pytest.fixture(scope="module")
def many_tensors(s3_server: S3Server) -> Iterator[tuple[str, dict]]:
    """A checkpoint of MANY small tensors plus one sharded 64x64 tensor, written straight to moto (once)."""
    bucket = s3_server.create_bucket()
    url = f"s3://{bucket}/many"
    state = {f"layers.{i // 10}.p{i % 10}": torch.full((4,), float(i)) for i in range(MANY)}
    state["big"] = torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64)
    # 512-byte inner chunks, 4 KiB shards: "big" is sharded
    small_chunks(512, 4096).save(state, url, storage_options=_options(s3_server))
    yield url, state


def test_opening_a_large_checkpoint_costs_a_few_requests(many_tensors: tuple[str, dict], s3_proxy: FaultProxy,
                                                         s3_bucket: str) -> None:
    url, state = many_tensors
    options = _options(s3_proxy)
    ckpt = arrayckpt.open(url, storage_options=options)
    opened = list(s3_proxy.log)
    assert len(ckpt) == MANY + 1
    assert len(opened) <= 5 and [m for m, *_ in opened] == ["GET"] * len(opened), opened
    assert opened[0][1].endswith("/many/zarr.json")
    assert ckpt["layers.123.p4"].shape == (4,) and s3_proxy.log == opened, "shapes come from the root document"

    assert ckpt["layers.123.p4"][2] == 1234.0
    # the read: the tensor's chunk, and (on object storage) the root document again, to make sure the
    # checkpoint was not replaced while it was being read
    data = s3_proxy.log[len(opened):]
    assert 1 <= len(data) <= 2 and all(m == "GET" for m, *_ in data), data
    chunk = [path for _, path, _, _ in data if "/many/layers/123/p4/" in path]
    assert len(chunk) == 1 and len(data) - len(chunk) <= 1, data

    # opening it costs no more than opening a checkpoint of one tensor
    arrayckpt.save({"x": torch.ones(1)}, f"s3://{s3_bucket}/one", storage_options=options)
    s3_proxy.reset()
    arrayckpt.open(f"s3://{s3_bucket}/one", storage_options=options)
    assert len(s3_proxy.log) == len(opened), s3_proxy.log


def test_slice_of_a_sharded_tensor_reads_byte_ranges(many_tensors: tuple[str, dict], s3_server: S3Server,
                                                      s3_proxy: FaultProxy) -> None:
    url, state = many_tensors
    ckpt = arrayckpt.open(url, storage_options=_options(s3_proxy))
    big = ckpt["big"]
    assert big.metadata["codecs"][0]["name"] == "sharding_indexed"
    s3_proxy.reset()
    np.testing.assert_array_equal(big[3:5, 3:5], state["big"][3:5, 3:5].numpy())
    assert all(m == "GET" for m, *_ in s3_proxy.log), s3_proxy.log
    data = [(path, rng) for _, path, _, rng in s3_proxy.log if "/many/big/" in path]
    others = [path for _, path, _, _ in s3_proxy.log if "/many/big/" not in path]
    assert others in ([], [others[0]]) and all(p.endswith("/many/zarr.json") for p in others), s3_proxy.log
    # the shard's index (a suffix range), then the inner chunks holding rows 3..4 (rows 2-3 and 4-5, one
    # coalesced range): two ranged GETs of one object
    assert len(data) == 2 and len({path for path, _ in data}) == 1, data
    assert all(rng is not None for _, rng in data), "every data read must be a byte range of a shard"
    bucket, _, key = data[0][0].lstrip("/").partition("/")
    size = s3_server.client.head_object(Bucket=bucket, Key=key)["ContentLength"]
    fetched = sum(_range_bytes(rng, size) for _, rng in data)
    index, inner = 8 * 16 + 4, 512 + 4  # 8 inner chunks of 512 bytes per shard, each with its crc32c
    assert size == 8 * inner + index and fetched == index + 2 * inner, (fetched, size, data)


# --- 4. an interrupted save leaves an incomplete prefix, reported as such and replaceable ---------------


def test_incomplete_prefix_is_detected_and_replaced(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", _options(s3_proxy, max_retries=1)
    original = ObjectWriter.commit

    def commit_then_lose_the_store(self: ObjectWriter, root_document: bytes) -> None:
        # the store refuses the commit and then the clean-up too (as if the network went away)
        s3_proxy.fail_puts_always = True
        s3_proxy.fail_list_fraction = s3_proxy.fail_delete_fraction = 1.0
        original(self, root_document)

    monkeypatch.setattr(ObjectWriter, "commit", commit_then_lose_the_store)
    first = {"a": torch.ones(16), "gone": {"x": torch.arange(10)}}
    with pytest.warns(RuntimeWarning, match="aborted save"), \
            pytest.raises(arrayckpt.StorageError, match=r"ckpt: writing the root zarr.json \(the commit\) failed"):
        arrayckpt.save(first, url, storage_options=options)
    monkeypatch.undo()
    s3_proxy.clear_faults()
    left = s3_server.list_keys(s3_bucket)
    assert left and "ckpt/zarr.json" not in left and any(k.startswith("ckpt/gone/") for k in left), left

    with pytest.raises(arrayckpt.IncompleteCheckpointError, match="never committed"):
        arrayckpt.open(url, storage_options=options)
    with pytest.raises(arrayckpt.IncompleteCheckpointError):
        arrayckpt.load({"a": torch.zeros(16)}, url, storage_options=options)
    with pytest.raises(arrayckpt.CheckpointExistsError, match="interrupted save"):
        arrayckpt.save(_state(2), url, storage_options=options)
    assert sorted(s3_server.list_keys(s3_bucket)) == sorted(left), "a refused save must not touch anything"

    state = _state(2)
    arrayckpt.save(state, url, storage_options=options, overwrite=True)
    _same(url, state, options)
    assert arrayckpt.verify(url, storage_options=options).ok
    keys = s3_server.list_keys(s3_bucket)
    assert not any(k.startswith("ckpt/gone/") for k in keys), "the interrupted save's leftovers must be removed"
    nodes = json.loads(s3_server.client.get_object(Bucket=s3_bucket, Key="ckpt/zarr.json")["Body"].read())
    assert stale_keys([k.removeprefix("ckpt/") for k in keys], kept_of(nodes)) == []


# --- 5. transient failures are retried; permanent ones fail the save, which commits nothing -------------


def test_transient_failures_are_retried(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    url, options = f"s3://{s3_bucket}/flaky", _options(s3_proxy, max_retries=20)
    g = torch.Generator().manual_seed(3)
    state = {f"t{i}": torch.randn(16, 8, generator=g) for i in range(24)}
    state["bf"] = torch.randn(32, 4, generator=g).bfloat16()
    s3_proxy.fail_put_fraction = 0.1
    s3_proxy.fail_get_fraction = s3_proxy.fail_list_fraction = 0.1
    arrayckpt.save(state, url, storage_options=options)
    assert s3_proxy.injected["PUT"] > 0, s3_proxy.injected
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    arrayckpt.load(target, url, storage_options=options)
    for key, value in state.items():
        assert_bit_equal(target[key], value)
    assert arrayckpt.verify(url, storage_options=options).ok
    assert s3_proxy.injected["GET"] > 0, s3_proxy.injected


def test_permanent_failure_commits_nothing(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", _options(s3_proxy, max_retries=1)
    s3_proxy.fail_puts_always = True
    failed = rf"s3://{s3_bucket}/ckpt: writing \.arrayckpt-lease failed: .*SlowDown"  # its first PUT: the lease
    with pytest.raises(arrayckpt.StorageError, match=failed):
        arrayckpt.save(_state(1), url, storage_options=options)
    tried = {path for m, path, _, _ in s3_proxy.log if m == "PUT"}
    assert s3_proxy.injected["PUT"] == s3_proxy.counts["PUT"] == 2 * len(tried) > 0  # each object: 1 try + 1 retry
    assert s3_server.list_keys(s3_bucket) == []
    with pytest.raises(arrayckpt.CheckpointNotFoundError):
        arrayckpt.open(url, storage_options=options)

    # replacing a committed checkpoint: the failed save leaves it exactly as it was
    s3_proxy.clear_faults()
    old = _state(1)
    arrayckpt.save(old, url, storage_options=options)
    before = _etags(s3_server, s3_bucket, "ckpt/")
    s3_proxy.fail_puts_always = True
    with pytest.raises(arrayckpt.StorageError, match=rf"s3://{s3_bucket}/ckpt: tensor '[\w.]+': write failed"):
        arrayckpt.save(_state(2), url, storage_options=options, overwrite=True)
    s3_proxy.clear_faults()
    assert _etags(s3_server, s3_bucket, "ckpt/") == before
    _same(url, old, options)
    assert arrayckpt.verify(url, storage_options=options).ok


# --- 6. an overwrite keeps the old checkpoint whole until its commit, and leaves nothing stale ---------


def test_overwrite_keeps_old_checkpoint_until_commit(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", _options(s3_proxy)
    old, new = _state(1), _state(2)
    arrayckpt.save(old, url, storage_options=options)
    before = _etags(s3_server, s3_bucket, "ckpt/")
    seen: list[set[str]] = []
    original = ObjectWriter.commit

    def commit(self: ObjectWriter, root_document: bytes) -> None:
        # every chunk of the new checkpoint is written, none of the old objects has been touched yet
        now = _etags(s3_server, s3_bucket, "ckpt/")
        assert {k: now.get(k) for k in before} == before
        seen.append(set(now) - set(before))
        _same(url, old, options)
        s3_proxy.reset()
        original(self, root_document)

    monkeypatch.setattr(ObjectWriter, "commit", commit)
    arrayckpt.save(new, url, storage_options=options, overwrite=True)
    assert seen and seen[0] and not any(k.endswith("zarr.json") for k in seen[0]), seen
    # the commit: the root, then the node documents, and one DELETE per old chunk (nothing else: the sweep reuses the
    # listing of the check right before the commit)
    stale = {k for k in before if not k.endswith("zarr.json")}
    assert s3_proxy.log[0][:2] == ("PUT", f"/{s3_bucket}/ckpt/zarr.json")
    assert s3_proxy.count("GET", lists=True) == 0 and s3_proxy.count("GET", lists=False) == 0
    assert {path.removeprefix(f"/{s3_bucket}/") for m, path, _, _ in s3_proxy.log if m == "DELETE"} == stale
    assert s3_proxy.counts["DELETE"] == len(stale)
    after = set(s3_server.list_keys(s3_bucket))
    assert after == {k for k in before if k.endswith("zarr.json")} | seen[0], "stale objects remain"
    _same(url, new, options)
    assert arrayckpt.verify(url, storage_options=options).ok

    # a third save goes back to the first generation's chunk keys, again without touching the second's
    monkeypatch.undo()
    arrayckpt.save(old, url, storage_options=options, overwrite=True)
    assert set(s3_server.list_keys(s3_bucket)) == set(before)
    _same(url, old, options)


# --- 7. storage options: explicit keys, and wrong keys that fail clearly --------------------------------


@pytest.fixture(scope="module")
def auth_server() -> Iterator[tuple[S3Server, dict[str, str]]]:
    """A moto server that checks signatures (after 4 free calls: an IAM user, its key and policy, a bucket);
    returns it and ``{"bucket", "key", "secret"}``."""
    import botocore.session

    with patched_environ({"INITIAL_NO_AUTH_ACTION_COUNT": "4"}):  # only the server process gets it
        server = S3Server()
    with server:
        iam = botocore.session.get_session().create_client("iam", endpoint_url=server.endpoint, region_name=REGION,
                                                           aws_access_key_id="x", aws_secret_access_key="y")
        iam.create_user(UserName="trainer")
        key = iam.create_access_key(UserName="trainer")["AccessKey"]
        iam.put_user_policy(UserName="trainer", PolicyName="s3", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}))
        bucket = server.create_bucket()
        yield server, {"bucket": bucket, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}
        iam.close()


def test_explicit_credentials(auth_server: tuple[S3Server, dict[str, str]], monkeypatch: pytest.MonkeyPatch) -> None:
    server, account = auth_server
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    # moto's signature check rejects a ListObjectsV2 whose prefix contains "/" (it signs "%2F" differently),
    # so this checkpoint lives at the bucket's root, where arrayckpt lists without a prefix
    url = f"s3://{account['bucket']}"
    with FaultProxy(server.endpoint) as proxy:
        # (the region too: without one TensorStore asks the bucket with an unsigned HEAD, which moto fails with a
        # 500 when it checks signatures)
        good = _options(proxy, key=account["key"], secret=account["secret"], region=REGION, max_retries=1)
        state = _state(5)
        arrayckpt.save(state, url, storage_options=good)
        _same(url, state, good)
        assert arrayckpt.verify(url, storage_options=good).ok
        signed = {re.search(r"Credential=([^/]+)/", _authorization(h)).group(1) for h in proxy.request_headers}
        assert signed == {account["key"]}, "every request must be signed with the given key"

        for wrong, error in (({"secret": "not-the-secret"}, "SignatureDoesNotMatch"),
                             ({"key": "AKIAXXXXXXXXXXXXXXXX"}, "InvalidAccessKeyId")):
            bad = {**good, **wrong}
            proxy.reset()
            denied = rf"s3://{account['bucket']}: .*PERMISSION_DENIED.*{error}"
            with pytest.raises(arrayckpt.StorageError, match=denied):
                arrayckpt.open(url, storage_options=bad)
            assert proxy.counts == {"GET": 1}, "a 403 must not be retried"
            with pytest.raises(arrayckpt.StorageError, match=error):
                arrayckpt.save(_state(6), url, storage_options=bad, overwrite=True)
            assert proxy.count("PUT") == 0
        with pytest.raises(ValueError, match="go together"):  # a usage error, not a StorageError
            arrayckpt.open(url, storage_options={**good, "secret": None})
        assert account["secret"] not in repr(parse_object_url(url, good)), "a secret must never be shown"
    _same(url, state, {"endpoint_url": server.endpoint, "region": REGION, "key": account["key"],
                       "secret": account["secret"]})


def test_endpoint_and_region_from_the_environment(s3_proxy: FaultProxy, s3_bucket: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_proxy.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the S3-specific variable wins
    url = f"s3://{s3_bucket}/env"
    state = _state(4)
    arrayckpt.save(state, url)
    _same(url, state, {})
    assert s3_proxy.counts["PUT"] > 0
    assert all(f"/{REGION}/s3/aws4_request" in _authorization(h) for h in s3_proxy.request_headers)


def test_incremental_manager_on_s3(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str) -> None:
    """Step checkpoints under an S3 root: deltas, retention that keeps the bases kept deltas need, restore,
    and clean-up of an incomplete step left by an interrupted save."""
    options = _options(s3_proxy)
    root = f"s3://{s3_bucket}/run"
    manager = arrayckpt.CheckpointManager(root, storage_options=options, retention=arrayckpt.Retention(keep_last=1),
                                          incremental=arrayckpt.Incremental(max_chain_length=2))
    emb = torch.arange(4000.0).reshape(1000, 4)
    for step in range(1, 6):
        emb[step * 7] = -step
        manager.save(step, {"emb": emb}, changed_rows={"emb": torch.tensor([step * 7])})
    # steps 1 (full), 2, 3 (deltas), 4 (full), 5 (delta): keep_last=1 keeps 5 and its base 4
    assert manager.steps() == [4, 5]
    assert arrayckpt.open(manager.path(5), storage_options=options).manifest.base.path == "../step-00000004"
    keys = s3_server.list_keys(s3_bucket, "run/")
    assert {k.split("/")[1] for k in keys} == {"step-00000004", "step-00000005",
                                               ".arrayckpt-manager-lease"}  # (the manager is open: its lease)
    # an interrupted save of step 3's kind left objects but no commit at an older step
    s3_server.client.put_object(Bucket=s3_bucket, Key="run/step-00000003/emb/c.0.0", Body=b"partial")
    assert manager.steps() == [4, 5] and manager.latest_step() == 5
    with pytest.warns(RuntimeWarning, match="only chunk-named objects"):  # and just written: kept
        assert manager.clean_up() == []
    document = s3_server.client.get_object(Bucket=s3_bucket, Key="run/step-00000004/emb/zarr.json")["Body"].read()
    s3_server.client.put_object(Bucket=s3_bucket, Key="run/step-00000003/emb/zarr.json", Body=document)
    assert manager.clean_up(min_age_s=0) == [f"{root}/step-00000003"]
    assert {k.split("/")[1] for k in s3_server.list_keys(s3_bucket, "run/")} == {"step-00000004", "step-00000005",
                                                                                ".arrayckpt-manager-lease"}
    restored = {"emb": torch.zeros(1000, 4)}
    assert arrayckpt.CheckpointManager(root, storage_options=options).restore(restored) == 5
    assert torch.equal(restored["emb"], emb)


def test_checkpoints_never_nest(s3_server: S3Server, s3_bucket: str) -> None:
    """Issue 13 item 14 on S3 (the checks of ``test_objstore.check_checkpoints_never_nest``): a save inside a
    committed checkpoint's prefix is refused; a save over a prefix holding another checkpoint below is refused
    and leaves it intact."""
    from test_objstore import check_checkpoints_never_nest

    check_checkpoints_never_nest(f"s3://{s3_bucket}/run/outer", _options(s3_server))


_QUIET_RUN = """
import sys, torch, arrayckpt
url, options = sys.argv[1], eval(sys.argv[2])
arrayckpt.save({"w": torch.arange(6.0)}, url, storage_options=options)
target = {"w": torch.zeros(6)}
arrayckpt.load(target, url, storage_options=options)
assert torch.equal(target["w"], torch.arange(6.0))
with arrayckpt.open(url, storage_options=options) as opened:
    assert opened["w"][2:4].tolist() == [2.0, 3.0]
print("ok")
"""


@pytest.mark.parametrize("credentials", ["environment", "storage_options"])
def test_a_run_with_credentials_prints_nothing_to_stderr(s3_server: S3Server, s3_bucket: str, tmp_path,
                                                         credentials: str) -> None:
    """TensorStore's default AWS chain logs ``E... Failed to open file '~/.aws/config'`` (and credentials) to stderr
    on every run where those files are missing, even when the keys are in the environment: given keys (in the
    environment or in ``storage_options``) must leave stderr empty. A fresh process, so that its stderr is all
    TensorStore's; ``HOME`` without ``.aws``, as on a training node configured through the environment."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **s3_server.env, "HOME": str(tmp_path)}
    env.pop("AWS_PROFILE", None)
    options: dict = {"endpoint_url": s3_server.endpoint}
    if credentials == "storage_options":
        options.update(key=env.pop("AWS_ACCESS_KEY_ID"), secret=env.pop("AWS_SECRET_ACCESS_KEY"))
    url = f"s3://{s3_bucket}/quiet"
    done = subprocess.run([sys.executable, "-c", _QUIET_RUN, url, repr(options)], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "ok\n", done.stdout + done.stderr
    assert done.stderr == "", done.stderr
    if credentials == "environment":  # the command line too (endpoint from the environment)
        done = subprocess.run([sys.executable, "-m", "arrayckpt.cli", "info", url], capture_output=True, text=True,
                              env={**env, "AWS_ENDPOINT_URL": s3_server.endpoint}, timeout=120)
        assert done.returncode == 0 and "1 tensor" in done.stdout, done.stdout + done.stderr
        assert done.stderr == "", done.stderr
