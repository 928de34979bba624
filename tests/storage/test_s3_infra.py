"""The S3 test infrastructure (tests/s3_server.py) works, and what TensorStore, s3fs/zarr and torch DCP do
against moto through the fault-injecting proxy: which spec works, how many requests each operation
costs, and which failures each client retries how often."""

from __future__ import annotations

import http.client
import json
import os
import time
import warnings
from urllib.parse import urlsplit

import numpy as np
import pytest
import tensorstore as ts
from s3_server import (
    FAST_TS_RETRIES,
    REGION,
    FaultProxy,
    S3Server,
    s3fs_storage_options,
    tensorstore_kvstore_spec,
)

pytestmark = pytest.mark.slow  # spawns processes, starts a server or runs a foreign stack

# A sharded zarr3 array: 64x64 float32 in 32x32 shards of 8x8 inner chunks, crc32c on chunks and index.
SHARDED_META = {
    "shape": [64, 64],
    "data_type": "float32",
    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [32, 32]}},
    "chunk_key_encoding": {"name": "default"},
    "codecs": [{"name": "sharding_indexed", "configuration": {
        "chunk_shape": [8, 8],
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "index_location": "end",
    }}],
}
# 16 inner chunks x (offset, nbytes) x 8 bytes + 4 bytes of crc32c
SHARD_INDEX_BYTES = 16 * 16 + 4
INNER_CHUNK_BYTES = 8 * 8 * 4 + 4


def _kv(proxy: FaultProxy, bucket: str, path: str = "", **kw: object) -> ts.KvStore:
    return ts.KvStore.open(tensorstore_kvstore_spec(bucket, proxy.endpoint, path, **kw)).result()


def _signed_headers(method: str, endpoint: str, path: str, body: bytes = b"", headers: dict | None = None) -> dict:
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method=method, url=endpoint + path, data=body, headers=headers or {})
    S3SigV4Auth(Credentials("testing", "testing"), "s3", REGION).add_auth(req)
    return {k: v for k, v in req.headers.items() if k.lower() != "content-length"}


# --- the server and the fixtures ---------------------------------------------------------------------


def test_server_fixture_env_and_buckets(s3_server: S3Server, s3_bucket: str) -> None:
    assert s3_server.endpoint == f"http://127.0.0.1:{s3_server.port}"
    assert os.environ["AWS_ACCESS_KEY_ID"] == "testing" and os.environ["AWS_REGION"] == REGION
    assert s3_bucket.startswith("test-") and s3_server.list_keys(s3_bucket) == []
    assert s3_server.create_bucket("abc") == "abc"  # names of 3 characters are fine
    kv = ts.KvStore.open(tensorstore_kvstore_spec("abc", s3_server.endpoint)).result()
    kv.write("k", b"v").result()
    assert s3_server.list_keys("abc") == ["k"]


def test_server_is_a_separate_process_and_closes() -> None:
    with S3Server() as server:
        assert server._proc is not None and server._proc.pid != os.getpid()
        bucket = server.create_bucket()
        assert server.list_keys(bucket) == []
        port = server.port
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    with pytest.raises(OSError):
        conn.request("GET", "/")
        conn.getresponse()


# --- the proxy itself, on raw (signed) HTTP ------------------------------------------------------------


def test_proxy_forwards_chunked_expect_range_head_on_one_keepalive_connection(s3_proxy: FaultProxy,
                                                                              s3_bucket: str) -> None:
    u = urlsplit(s3_proxy.endpoint)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    body = bytes(range(256)) * 40
    key = f"/{s3_bucket}/raw"

    # A chunked body (Transfer-Encoding: chunked, no Content-Length) arrives whole.
    conn.request("PUT", key, body=iter([body[:5000], body[5000:]]), encode_chunked=True,
                 headers=_signed_headers("PUT", s3_proxy.endpoint, key, body))
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    resp.read()
    sock = conn.sock
    assert s3_proxy.request_headers[-1]["Transfer-Encoding"] == "chunked"

    # Expect: 100-continue is answered (http.client sends the body right away; the interim 100 is skipped).
    conn.request("PUT", key + "2", body=b"x" * 100,
                 headers={**_signed_headers("PUT", s3_proxy.endpoint, key + "2", b"x" * 100),
                          "Expect": "100-continue"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    resp.read()

    conn.request("GET", key, headers={**_signed_headers("GET", s3_proxy.endpoint, key), "Range": "bytes=10-19"})
    resp = conn.getresponse()
    assert resp.status == 206 and resp.read() == body[10:20]
    assert resp.getheader("Content-Range") == f"bytes 10-19/{len(body)}"

    conn.request("HEAD", key, headers=_signed_headers("HEAD", s3_proxy.endpoint, key))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Length") == str(len(body)) and resp.read() == b""

    # An injected 503 is a real-looking S3 error, and the connection stays usable after it.
    s3_proxy.fail_next["GET"] = 1
    conn.request("GET", key, headers=_signed_headers("GET", s3_proxy.endpoint, key))
    resp = conn.getresponse()
    err = resp.read()
    assert resp.status == 503 and b"<Code>SlowDown</Code>" in err and resp.getheader("x-amz-request-id")
    conn.request("GET", key, headers=_signed_headers("GET", s3_proxy.endpoint, key))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read() == body

    assert conn.sock is sock, "every request went over the one kept-alive connection"
    assert s3_proxy.log == [("PUT", key, "", None), ("PUT", key + "2", "", None), ("GET", key, "", "bytes=10-19"),
                            ("HEAD", key, "", None), ("GET", key, "", None), ("GET", key, "", None)]
    assert s3_proxy.counts == {"PUT": 2, "GET": 3, "HEAD": 1} and s3_proxy.injected == {"GET": 1}
    conn.close()
    s3_proxy.reset()
    assert s3_proxy.log == [] and not s3_proxy.counts and not s3_proxy.injected


def test_proxy_fault_fraction_is_seeded_and_close_drops_connections(s3_server: S3Server, s3_bucket: str) -> None:
    def pattern(seed: int) -> list[int]:
        with FaultProxy(s3_server.endpoint, seed=seed) as proxy:
            proxy.fail_head_fraction = 0.3
            u = urlsplit(proxy.endpoint)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
            out = []
            for _ in range(40):
                conn.request("HEAD", f"/{s3_bucket}", headers=_signed_headers("HEAD", proxy.endpoint, f"/{s3_bucket}"))
                resp = conn.getresponse()
                resp.read()
                out.append(resp.status)
            assert proxy.injected["HEAD"] == out.count(503) and proxy.counts["HEAD"] == 40
        # closed: the kept-alive connection is gone and nothing listens any more
        with pytest.raises(OSError):
            conn.request("HEAD", "/")
            conn.getresponse()
        return out

    a, b, c = pattern(7), pattern(7), pattern(8)
    assert a == b and a != c and 0 < a.count(503) < 40 and set(a) == {200, 503}


# --- TensorStore ---------------------------------------------------------------------------------------


def test_tensorstore_kvstore_ops_and_request_counts(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    kv = _kv(s3_proxy, s3_bucket, "p/")
    assert s3_proxy.log == [], "opening an s3 kvstore with aws_region set issues no request"
    kv.write("a/1", b"hello").result()
    kv.write("a/2", b"world").result()
    kv.write("b/1", b"!").result()
    assert s3_proxy.log == [("PUT", f"/{s3_bucket}/p/a/1", "", None), ("PUT", f"/{s3_bucket}/p/a/2", "", None),
                            ("PUT", f"/{s3_bucket}/p/b/1", "", None)], "path-style addressing on an IP endpoint"
    s3_proxy.reset()

    assert kv.read("a/1").result().value == b"hello"
    assert kv.read("a/2", byte_range=slice(1, 3)).result().value == b"or"
    assert kv.read("nope").result().state == "missing"
    assert s3_proxy.log == [("GET", f"/{s3_bucket}/p/a/1", "", None), ("GET", f"/{s3_bucket}/p/a/2", "", "bytes=1-2"),
                            ("GET", f"/{s3_bucket}/p/nope", "", None)]
    s3_proxy.reset()

    assert sorted(kv.list().result()) == [b"a/1", b"a/2", b"b/1"]
    assert sorted(kv.list(ts.KvStore.KeyRange("a/", "a0")).result()) == [b"a/1", b"a/2"]
    assert sorted(kv.list(ts.KvStore.KeyRange("a/2", "b/2"), strip_prefix_length=2).result()) == [b"1", b"2"]
    # one ListObjectsV2 each (up to 1000 keys a page); the prefix is the longest common prefix of the range
    assert s3_proxy.log == [("GET", f"/{s3_bucket}/", "list-type=2&prefix=p%2F", None),
                            ("GET", f"/{s3_bucket}/", "list-type=2&prefix=p%2Fa%2F", None),
                            ("GET", f"/{s3_bucket}/", "list-type=2&prefix=p%2F", None)]
    s3_proxy.reset()

    kv.delete_range(ts.KvStore.KeyRange("a/", "a0")).result()
    assert s3_proxy.count("GET", lists=True) == 1 and s3_proxy.counts["DELETE"] == 2 and len(s3_proxy.log) == 3
    assert sorted(kv.list().result()) == [b"b/1"]


def test_tensorstore_without_aws_region_heads_the_bucket_first(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    spec = tensorstore_kvstore_spec(s3_bucket, s3_proxy.endpoint)
    del spec["aws_region"]
    ts.KvStore.open(spec).result().write("k", b"v").result()
    assert s3_proxy.log == [("HEAD", f"/{s3_bucket}", "", None), ("PUT", f"/{s3_bucket}/k", "", None)]


def test_tensorstore_list_pages_of_1000(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str) -> None:
    direct = ts.KvStore.open(tensorstore_kvstore_spec(s3_bucket, s3_server.endpoint, "many/")).result()
    for f in [direct.write(f"{i:05d}", b"") for i in range(1001)]:
        f.result()
    assert len(_kv(s3_proxy, s3_bucket, "many/").list().result()) == 1001
    assert [q for _, _, q, _ in s3_proxy.log][0] == "list-type=2&prefix=many%2F"
    assert len(s3_proxy.log) == 2 and "continuation-token=" in s3_proxy.log[1][2]


def test_tensorstore_zarr3_write_survives_10_percent_put_503s(s3_server: S3Server, s3_proxy: FaultProxy,
                                                              s3_bucket: str) -> None:
    s3_proxy.fail_put_fraction = 0.1
    spec = {"driver": "zarr3", "create": True,
            "kvstore": tensorstore_kvstore_spec(s3_bucket, s3_proxy.endpoint, "arr/",
                                                retries={"max_retries": 8, "initial_delay": "10ms",
                                                         "max_delay": "100ms"}),
            "metadata": {"shape": [200, 16], "data_type": "float32",
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, 16]}}}}
    data = np.arange(200 * 16, dtype=np.float32).reshape(200, 16)
    start = time.monotonic()
    arr = ts.open(spec).result()
    arr.write(data).result()
    elapsed = time.monotonic() - start
    assert s3_proxy.injected["PUT"] >= 5, s3_proxy.injected
    # 200 chunks + zarr.json, each once, plus one retry per injected failure
    assert s3_proxy.counts["PUT"] == 201 + s3_proxy.injected["PUT"]
    assert len(s3_server.list_keys(s3_bucket, "arr/")) == 201
    s3_proxy.clear_faults()
    np.testing.assert_array_equal(arr.read().result(), data)
    assert elapsed < 10


@pytest.mark.parametrize(("error", "attempts", "message"), [
    ("SlowDown", 1 + 3, "ABORTED: All 3 retry attempts failed: SlowDown"),  # 503: retried max_retries times
    ("InternalError", 1 + 3, "ABORTED: All 3 retry attempts failed: InternalError"),  # 500: likewise
    ("AccessDenied", 1, "PERMISSION_DENIED: AccessDenied"),  # 403: never retried
])
def test_tensorstore_permanent_put_failure(s3_proxy: FaultProxy, s3_bucket: str, error: str, attempts: int,
                                           message: str) -> None:
    s3_proxy.fail_puts_always = True
    s3_proxy.permanent_error = error
    kv = _kv(s3_proxy, s3_bucket, retries=FAST_TS_RETRIES)
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        kv.write("k", b"v").result()
    assert time.monotonic() - start < 2
    assert s3_proxy.counts == {"PUT": attempts} and s3_proxy.injected == {"PUT": attempts}


def test_tensorstore_retries_503_on_get_list_delete(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    kv = _kv(s3_proxy, s3_bucket, retries=FAST_TS_RETRIES)
    kv.write("k", b"v").result()

    s3_proxy.reset()
    s3_proxy.fail_next["GET"] = 2  # transient: the third try succeeds
    assert kv.read("k").result().value == b"v"
    assert s3_proxy.counts == {"GET": 3}

    # a 2 MiB PUT comes with Expect: 100-continue (libcurl), and a failed one is retried just the same
    s3_proxy.reset()
    s3_proxy.fail_next["PUT"] = 1
    big = os.urandom(2 << 20)
    kv.write("big", big).result()
    assert s3_proxy.counts == {"PUT": 2} and all(h.get("Expect") == "100-continue" for h in s3_proxy.request_headers)
    assert kv.read("big").result().value == big

    s3_proxy.reset()
    s3_proxy.fail_get_fraction = 1.0
    with pytest.raises(ValueError, match="All 3 retry attempts failed: SlowDown"):
        kv.read("k").result()
    assert s3_proxy.counts == {"GET": 4}

    s3_proxy.reset()
    s3_proxy.clear_faults()
    s3_proxy.fail_list_fraction = 1.0
    with pytest.raises(ValueError, match="All 3 retry attempts failed: SlowDown"):
        kv.list().result()
    assert s3_proxy.count("GET", lists=True) == 4

    s3_proxy.reset()
    s3_proxy.clear_faults()
    s3_proxy.fail_next["GET"] = 1  # the list
    s3_proxy.fail_next["DELETE"] = 1
    kv.delete_range(ts.KvStore.KeyRange()).result()
    assert s3_proxy.counts == {"GET": 2, "DELETE": 3} and kv.list().result() == []


def test_tensorstore_request_concurrency_limit(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    s3_proxy.latency_s = 0.02
    kv = _kv(s3_proxy, s3_bucket, concurrency=2)
    for f in [kv.write(f"k{i}", b"v") for i in range(16)]:
        f.result()
    assert s3_proxy.max_in_flight == 2

    s3_proxy.reset()
    kv = _kv(s3_proxy, s3_bucket, concurrency=16)
    for f in [kv.write(f"k{i}", b"v") for i in range(16)]:
        f.result()
    assert s3_proxy.max_in_flight > 2


def test_tensorstore_sharded_zarr3_request_counts(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    kvstore = tensorstore_kvstore_spec(s3_bucket, s3_proxy.endpoint, "sh/")
    data = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    arr = ts.open({"driver": "zarr3", "kvstore": kvstore, "metadata": SHARDED_META, "create": True}).result()
    key = f"/{s3_bucket}/sh/zarr.json"
    # create: look for an existing zarr.json, then a conditional (if-none-match, checked by a HEAD) PUT
    assert s3_proxy.log == [("GET", key, "", None), ("HEAD", key, "", None), ("PUT", key, "", None)]
    s3_proxy.reset()

    arr[:32, :32].write(data[:32, :32]).result()  # (iii) one whole shard: one PUT, nothing read
    assert s3_proxy.log == [("PUT", f"/{s3_bucket}/sh/c/0/0", "", None)]
    arr[:, 32:].write(data[:, 32:]).result()
    arr[32:, :32].write(data[32:, :32]).result()
    s3_proxy.reset()

    # (i) open with the metadata in the spec and assume_metadata: no request at all
    arr2 = ts.open({"driver": "zarr3", "kvstore": kvstore, "metadata": SHARDED_META, "assume_metadata": True}).result()
    assert s3_proxy.log == []
    ts.open({"driver": "zarr3", "kvstore": kvstore}).result()
    assert s3_proxy.log == [("GET", key, "", None)], "a plain open reads zarr.json once"
    s3_proxy.reset()

    # (ii) a slice inside one inner chunk: the shard index (suffix range), then that inner chunk's bytes
    np.testing.assert_array_equal(arr2[3:5, 3:5].read().result(), data[3:5, 3:5])
    shard = f"/{s3_bucket}/sh/c/0/0"
    assert s3_proxy.log == [("GET", shard, "", f"bytes=-{SHARD_INDEX_BYTES}"),
                            ("GET", shard, "", f"bytes=0-{INNER_CHUNK_BYTES - 1}")]
    s3_proxy.reset()
    # 2x2 inner chunks: still two requests; the inner chunks' ranges are coalesced into one
    np.testing.assert_array_equal(arr2[0:16, 0:16].read().result(), data[0:16, 0:16])
    assert [r for _, _, _, r in s3_proxy.log] == [f"bytes=-{SHARD_INDEX_BYTES}", "bytes=0-1559"]
    s3_proxy.reset()

    # part of a shard: read-modify-write of the whole shard (GET, HEAD for the if-match check, PUT)
    arr2[0:8, 0:8].write(np.zeros((8, 8), np.float32)).result()
    assert s3_proxy.log == [("GET", shard, "", None), ("HEAD", shard, "", None), ("PUT", shard, "", None)]


# --- other clients: spawned ranks, s3fs / zarr-python, torch DCP ---------------------------------------


def _rank_uses_s3(rank: int, world: int, endpoint: str, bucket: str) -> tuple[bytes, list[str]]:
    import s3fs
    import torch.distributed as dist

    kv = ts.KvStore.open(tensorstore_kvstore_spec(bucket, endpoint, "ranks/")).result()
    kv.write(f"r{rank}", str(rank).encode()).result()
    dist.barrier()
    other = kv.read(f"r{(rank + 1) % world}").result().value
    fs = s3fs.S3FileSystem(**s3fs_storage_options(endpoint), skip_instance_cache=True)
    return other, sorted(fs.ls(f"{bucket}/ranks", detail=False))


def test_spawned_gloo_ranks_reach_the_proxy(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    from dist_helpers import run_ranks

    out = run_ranks(2, _rank_uses_s3, s3_proxy.endpoint, s3_bucket)
    keys = [f"{s3_bucket}/ranks/r0", f"{s3_bucket}/ranks/r1"]
    assert out == [(b"1", keys), (b"0", keys)]
    assert s3_proxy.counts["PUT"] == 2 and s3_proxy.count("GET", lists=True) == 2


def _write_group_with_tensorstore(proxy: FaultProxy, bucket: str) -> tuple[np.ndarray, np.ndarray]:
    kv = _kv(proxy, bucket, "grp/")
    group_meta = {"zarr_format": 3, "node_type": "group", "attributes": {"a": 1}}
    kv.write("zarr.json", json.dumps(group_meta).encode()).result()
    sharded = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    arr = ts.open({"driver": "zarr3", "create": True, "metadata": SHARDED_META,
                   "kvstore": tensorstore_kvstore_spec(bucket, proxy.endpoint, "grp/w/")}).result()
    arr.write(sharded).result()
    plain = np.arange(10, dtype=np.int64)
    arr = ts.open({"driver": "zarr3", "create": True,
                   "metadata": {"shape": [10], "data_type": "int64",
                                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [5]}},
                                "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                                           {"name": "crc32c"}]},
                   "kvstore": tensorstore_kvstore_spec(bucket, proxy.endpoint, "grp/b/")}).result()
    arr.write(plain).result()
    return sharded, plain


def test_zarr_python_reads_a_tensorstore_group_through_the_proxy(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    import s3fs
    import zarr

    sharded, plain = _write_group_with_tensorstore(s3_proxy, s3_bucket)
    s3_proxy.reset()
    group = zarr.open_group(f"s3://{s3_bucket}/grp", mode="r", storage_options=s3fs_storage_options(s3_proxy.endpoint))
    assert dict(group.attrs) == {"a": 1} and sorted(group.array_keys()) == ["b", "w"]
    assert type(group["w"].metadata.codecs[0]).__name__ == "ShardingCodec"
    np.testing.assert_array_equal(group["w"][:], sharded)
    np.testing.assert_array_equal(group["b"][:], plain)
    assert s3_proxy.counts["GET"] > 0 and s3_proxy.count("PUT") == 0
    w = group["w"]  # (each group[...] re-reads the array's zarr.json: a HEAD and a GET)
    s3_proxy.reset()
    np.testing.assert_array_equal(w[3:5, 3:5], sharded[3:5, 3:5])
    # like TensorStore: the shard index (suffix range), then one inner chunk's byte range
    assert s3_proxy.log == [("GET", f"/{s3_bucket}/grp/w/c/0/0", "", f"bytes=-{SHARD_INDEX_BYTES}"),
                            ("GET", f"/{s3_bucket}/grp/w/c/0/0", "", f"bytes=0-{INNER_CHUNK_BYTES - 1}")]

    fs = s3fs.S3FileSystem(**s3fs_storage_options(s3_proxy.endpoint), asynchronous=True, skip_instance_cache=True)
    store = zarr.storage.FsspecStore(fs, path=f"{s3_bucket}/grp", read_only=True)
    np.testing.assert_array_equal(zarr.open_array(store, path="w", mode="r")[:], sharded)


def test_botocore_and_s3fs_retry_the_proxys_503(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    import s3fs

    # default settings: a single 503 is retried by botocore (legacy mode) and the write succeeds
    fs = s3fs.S3FileSystem(**s3fs_storage_options(s3_proxy.endpoint), skip_instance_cache=True)
    s3_proxy.fail_next["PUT"] = 1
    fs.pipe_file(f"{s3_bucket}/one", b"abc")
    assert s3_proxy.counts["PUT"] == 2 and fs.cat_file(f"{s3_bucket}/one") == b"abc"
    assert s3_proxy.request_headers[-2]["amz-sdk-request"] == "attempt=1"  # botocore numbers its tries

    # botocore cut to 1 try: what remains is s3fs's own loop, which repeats SlowDown S3FileSystem.retries times
    fs = s3fs.S3FileSystem(**s3fs_storage_options(s3_proxy.endpoint, botocore_attempts=1), skip_instance_cache=True)
    fs.retries = 3
    s3_proxy.reset()
    s3_proxy.fail_puts_always = True
    with pytest.raises(OSError, match="reduce your request rate"):
        fs.pipe_file(f"{s3_bucket}/two", b"abc")
    assert s3_proxy.counts == {"PUT": 3}

    # 403 is retried by neither
    fs.retries = 5
    s3_proxy.reset()
    s3_proxy.permanent_error = "AccessDenied"
    with pytest.raises(PermissionError):
        fs.pipe_file(f"{s3_bucket}/three", b"abc")
    assert s3_proxy.counts == {"PUT": 1}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dcp_fsspec_writer_reader_on_s3(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    options = s3fs_storage_options(s3_proxy.endpoint)
    sd = {"w": torch.randn(64, 32), "b": torch.arange(10), "n": {"x": torch.ones(3, dtype=torch.bfloat16)}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(sd, storage_writer=FsspecWriter(f"s3://{s3_bucket}/dcp", **options))
        assert sorted(s3_server.list_keys(s3_bucket, "dcp/")) == ["dcp/.metadata", "dcp/__0_0.distcp"]
        assert s3_proxy.counts["PUT"] == 3  # the shard file, .metadata.tmp, and .metadata (a server-side copy)
        out = {"w": torch.zeros(64, 32), "b": torch.zeros(10, dtype=torch.int64),
               "n": {"x": torch.zeros(3, dtype=torch.bfloat16)}}
        dcp.load(out, storage_reader=FsspecReader(f"s3://{s3_bucket}/dcp", **options))
    assert torch.equal(out["w"], sd["w"]) and torch.equal(out["b"], sd["b"])
    assert torch.equal(out["n"]["x"], sd["n"]["x"])
