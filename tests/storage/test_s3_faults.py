"""Flaky object storage beyond 503s: connections dropped before the request reaches the store, after it took effect
(its answer lost), or halfway through the answer; slow answers; answers that never come. Through the fault proxy
of ``s3_server.py`` in front of moto.

What must hold: a save either completes through TensorStore's retries (a dropped or truncated answer is
``UNAVAILABLE`` to it, and retried like a 503) and the checkpoint reads back bit for bit, with nothing stale left
under the prefix, or it fails with a ``StorageError`` and commits nothing: the checkpoint it was replacing stays
exactly as it was (same objects, same ETags). A commit whose answer was lost is recognised as done (it did take
effect: aborting would delete the chunks of the checkpoint just committed). Reads retry the same way; when their
retries are used up they fail with a ``StorageError`` naming the tensor, and ``verify`` raises instead of
reporting damage it has no evidence of. ``max_retries`` is small here (TensorStore waits 50 ms, doubling, between
tries), so the whole module takes about 20 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_bit_equal
from policies import small_chunks
from s3_server import FaultProxy, S3Server

import arrayckpt
from arrayckpt._storage.object import kept_of, stale_keys

pytestmark = pytest.mark.slow  # spawns processes, starts a server or runs a foreign stack

MODES = ["before", "after", "half"]  # see FaultProxy.drop_mode
# Every save here: sharded arrays of several outer chunks, so that a save is many PUTs and a read many ranged GETs.
SMALL = small_chunks(256, 1024)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    state: dict = {f"layer{i}": {"w": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)}
                   for i in range(4)}
    state["emb"] = torch.randn(100, 8, generator=g).bfloat16()
    state["count"] = torch.tensor(seed)
    state["step"] = seed
    return state


def _flat(state: dict) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        elif isinstance(value, torch.Tensor):
            out[key] = value
    return out


def _zeros(state: dict) -> dict:
    return {k: ({kk: torch.zeros_like(vv) for kk, vv in v.items()} if isinstance(v, dict)
                else torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1) for k, v in state.items()}


def _same(url: str, state: dict, options: dict) -> None:
    """The checkpoint at ``url`` is ``state``: opened and sliced, and loaded in place, bit for bit."""
    opened = arrayckpt.open(url, storage_options=options)
    assert opened.plain_values["step"] == state["step"]
    for key, tensor in _flat(state).items():
        assert_bit_equal(opened[key].torch(), tensor)
        if tensor.ndim:
            assert np.array_equal(np.asarray(opened[key][3:7], dtype=np.float64), tensor[3:7].double().numpy())
    target = _zeros(state)
    arrayckpt.load(target, url, storage_options=options)
    assert target["step"] == state["step"]
    for key, tensor in _flat(target).items():
        assert_bit_equal(tensor, _flat(state)[key])


def _objects(server: S3Server, bucket: str) -> dict[str, str]:
    """Every object under the bucket with its ETag, straight from moto."""
    out = {}
    for page in server.client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        out.update({o["Key"]: o["ETag"] for o in page.get("Contents", [])})
    return out


def _nothing_stale(server: S3Server, bucket: str, prefix: str) -> None:
    """Under ``prefix``: exactly the committed checkpoint's objects (its root lists every node; no other chunk)."""
    keys = [k.removeprefix(f"{prefix}/") for k in server.list_keys(bucket, f"{prefix}/")]
    root = json.loads(server.client.get_object(Bucket=bucket, Key=f"{prefix}/zarr.json")["Body"].read())
    assert stale_keys(keys, kept_of(root)) == []


def _is_root(bucket: str, prefix: str, method: str):
    return lambda m, path, query: m == method and path == f"/{bucket}/{prefix}/zarr.json"


# --- a share of the connections dropped: everything completes through retries ----------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_save_load_verify_through_dropped_connections(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str,
                                                      mode: str) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", {"endpoint_url": s3_proxy.endpoint, "max_retries": 8}
    SMALL.save(_state(1), url, storage_options=options)
    s3_proxy.drop_mode = mode
    s3_proxy.drop_fraction = {"PUT": 0.2, "GET": 0.2, "LIST": 0.3, "DELETE": 0.2}
    new = _state(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SMALL.save(new, url, storage_options=options, overwrite=True)  # a replacing save: every step of it
        _same(url, new, options)
        report = arrayckpt.verify(url, storage_options=options)
    assert report.ok, report.to_dict()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    assert s3_proxy.dropped["PUT"] > 0 and s3_proxy.dropped["GET"] > 0, s3_proxy.dropped
    s3_proxy.clear_faults()
    _nothing_stale(s3_server, s3_bucket, "ckpt")
    _same(url, new, options)


# --- retries used up: the save fails clearly and commits nothing ------------------------------------------------


@pytest.mark.parametrize("mode", ["before", "after"])
@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "replacing"])
def test_dropped_chunk_writes_past_the_retries_commit_nothing(s3_server: S3Server, s3_proxy: FaultProxy,
                                                               s3_bucket: str, mode: str, previous: bool) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", {"endpoint_url": s3_proxy.endpoint, "max_retries": 1}
    old = _state(1)
    if previous:
        SMALL.save(old, url, storage_options=options)
    before = _objects(s3_server, s3_bucket)
    s3_proxy.drop_mode = mode  # "after": the chunk objects land, their writer never hears so
    s3_proxy.drop_when = lambda m, path, q: m == "PUT" and path.endswith(("/layer2/w/c.1.0", "/layer2/w/1.0"))
    with pytest.raises(arrayckpt.StorageError, match=r"tensor 'layer2\.w': write failed.*retry attempts failed"):
        SMALL.save(_state(2), url, storage_options=options, overwrite=True)
    assert s3_proxy.dropped["PUT"] >= 2
    s3_proxy.clear_faults()
    assert _objects(s3_server, s3_bucket) == before  # not one object added, changed or removed
    if previous:
        _same(url, old, options)
    else:
        with pytest.raises(arrayckpt.CheckpointNotFoundError):
            arrayckpt.open(url, storage_options=options)


# --- the commit itself: its request lost, or its answer lost ---------------------------------------------------


@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "replacing"])
def test_a_commit_whose_answer_is_lost_is_a_commit(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str,
                                                    previous: bool) -> None:
    """Every answer to the root zarr.json PUT is lost, though the PUT took effect: the save reads the root back,
    finds its own document, and completes (it used to abort, deleting the new chunks under the new root)."""
    url, options = f"s3://{s3_bucket}/ckpt", {"endpoint_url": s3_proxy.endpoint, "max_retries": 1}
    if previous:
        SMALL.save(_state(1), url, storage_options=options)
    s3_proxy.drop_mode = "after"
    s3_proxy.drop_when = _is_root(s3_bucket, "ckpt", "PUT")
    new = _state(2)
    SMALL.save(new, url, storage_options=options, overwrite=True)
    assert s3_proxy.dropped["PUT"] >= 2
    s3_proxy.clear_faults()
    _same(url, new, options)
    assert arrayckpt.verify(url, storage_options=options).ok
    _nothing_stale(s3_server, s3_bucket, "ckpt")


@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "replacing"])
def test_a_commit_that_never_arrives_commits_nothing(s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str,
                                                     previous: bool) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", {"endpoint_url": s3_proxy.endpoint, "max_retries": 1}
    old = _state(1)
    if previous:
        SMALL.save(old, url, storage_options=options)
    before = _objects(s3_server, s3_bucket)
    s3_proxy.drop_mode = "before"
    s3_proxy.drop_when = _is_root(s3_bucket, "ckpt", "PUT")
    with pytest.raises(arrayckpt.StorageError, match=r"writing the root zarr.json \(the commit\) failed"):
        SMALL.save(_state(2), url, storage_options=options, overwrite=True)
    s3_proxy.clear_faults()
    assert _objects(s3_server, s3_bucket) == before
    if previous:
        _same(url, old, options)
    else:
        with pytest.raises(arrayckpt.CheckpointNotFoundError):
            arrayckpt.open(url, storage_options=options)


def test_a_commit_of_unknown_outcome_deletes_nothing(s3_server: S3Server, s3_proxy: FaultProxy,
                                                     s3_bucket: str) -> None:
    """The root PUT's answers are lost and so are those of the GETs that would tell whether it landed: the save
    fails saying so, and deletes nothing. Whatever the root is then, its checkpoint is whole (here the new one,
    whose per-node documents were never written: verify names them), and the next save tidies up."""
    url, options = f"s3://{s3_bucket}/ckpt", {"endpoint_url": s3_proxy.endpoint, "max_retries": 1}
    SMALL.save(_state(1), url, storage_options=options)
    committing = threading.Event()

    def lost(method: str, path: str, query: str) -> bool:
        if _is_root(s3_bucket, "ckpt", "PUT")(method, path, query):
            committing.set()
            return True
        return committing.is_set() and _is_root(s3_bucket, "ckpt", "GET")(method, path, query)

    s3_proxy.drop_mode = "after"
    s3_proxy.drop_when = lost
    new = _state(2)
    with pytest.raises(arrayckpt.StorageError, match="may or may not have committed; nothing was deleted"):
        SMALL.save(new, url, storage_options=options, overwrite=True)
    s3_proxy.clear_faults()
    assert s3_proxy.dropped["GET"] >= 2
    _same(url, new, options)  # the PUT did land, with every chunk under it
    report = arrayckpt.verify(url, storage_options=options)
    assert not report.ok and all(d.file.endswith("zarr.json") for d in report.damage), report.to_dict()
    SMALL.save(_state(3), url, storage_options=options, overwrite=True)
    _nothing_stale(s3_server, s3_bucket, "ckpt")
    assert arrayckpt.verify(url, storage_options=options).ok


# --- reads: retried; past the retries a clear StorageError, never "damage" ------------------------------------


@pytest.mark.parametrize("mode", ["before", "half"])
def test_reads_past_the_retries_fail_clearly_and_verify_reports_no_damage(s3_proxy: FaultProxy, s3_bucket: str,
                                                                          mode: str) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", {"endpoint_url": s3_proxy.endpoint, "max_retries": 1}
    state = _state(1)
    SMALL.save(state, url, storage_options=options)
    opened = arrayckpt.open(url, storage_options=options)
    s3_proxy.drop_mode = mode  # "half": the status line, headers and half the bytes, then the connection closes
    s3_proxy.drop_when = lambda m, path, q: m == "GET" and "/layer1/w/c." in path  # its chunks
    unreachable = r"tensor 'layer1\.w': read failed: ABORTED.*retry attempts failed"
    with pytest.raises(arrayckpt.StorageError, match=unreachable):
        opened["layer1.w"][:4]
    with pytest.raises(arrayckpt.StorageError, match=unreachable):
        arrayckpt.load(_zeros(state), url, storage_options=options)
    with pytest.raises(arrayckpt.StorageError, match=unreachable):  # not a report of damage it cannot know of
        arrayckpt.verify(url, storage_options=options)
    assert_bit_equal(opened["layer1.b"].torch(), state["layer1"]["b"])  # the rest reads on
    s3_proxy.drop_when = lambda m, path, q: m == "GET" and path.endswith("/layer1/w/zarr.json")  # its own document
    with pytest.raises(arrayckpt.StorageError, match=r"reading layer1/w/zarr.json failed.*retry attempts failed"):
        arrayckpt.verify(url, storage_options=options)
    s3_proxy.clear_faults()
    _same(url, state, options)
    assert arrayckpt.verify(url, storage_options=options).ok


# --- slow answers, and answers that never come -----------------------------------------------------------------


def test_slow_answers_are_waited_for_concurrently(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    url, options = f"s3://{s3_bucket}/ckpt", {"endpoint_url": s3_proxy.endpoint, "max_retries": 1}
    SMALL.save(_state(1), url, storage_options=options)
    s3_proxy.reset()
    s3_proxy.slow_fraction, s3_proxy.slow_s = 0.3, 0.25
    new = _state(2)
    SMALL.save(new, url, storage_options=options, overwrite=True)
    slowed = sum(s3_proxy.slowed.values())
    assert slowed >= 5, (s3_proxy.slowed, s3_proxy.counts)
    assert s3_proxy.max_in_flight >= 2, s3_proxy.max_in_flight  # other requests went on while slow ones waited
    target = _zeros(new)
    arrayckpt.load(target, url, storage_options=options)  # reads wait too
    for key, tensor in _flat(target).items():
        assert_bit_equal(tensor, _flat(new)[key])
    assert sum(s3_proxy.slowed.values()) > slowed
    s3_proxy.clear_faults()
    _same(url, new, options)


_STALLED = """
import sys, torch, arrayckpt
url, options = sys.argv[1], {"endpoint_url": sys.argv[2], "max_retries": 3}
state = {"w": torch.arange(4096.0).reshape(64, 64), "b": torch.ones(7)}
print("ready", flush=True)
sys.stdin.readline()
arrayckpt.save(state, url, storage_options=options)
target = {k: torch.zeros_like(v) for k, v in state.items()}
arrayckpt.load(target, url, storage_options=options)
assert all(torch.equal(target[k], state[k]) for k in state)
print("ok", flush=True)
"""


def test_stalled_answers_are_abandoned_and_retried_with_curl_low_speed_limits(s3_proxy: FaultProxy,
                                                                             s3_bucket: str) -> None:
    """A server that accepts a request and then says nothing would hold a save forever: TensorStore sets no
    timeout of its own. With ``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS`` / ``..._LIMIT_BYTES`` (read once per
    process, hence the child process) curl gives up on the silent connection and the request is retried."""
    s3_proxy.drop_mode, s3_proxy.stall_s = "stall", 60.0
    env = {**os.environ, "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS": "1",
           "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES": str(10**9)}  # every exchange here takes far less than 1 s
    child = subprocess.Popen([sys.executable, "-c", _STALLED, f"s3://{s3_bucket}/ckpt", s3_proxy.endpoint],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env, cwd=Path(__file__).parent)
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        s3_proxy.drop_next.update({"PUT": 2, "GET": 1})  # two chunk PUTs (or the root), then the root GET
        started = time.perf_counter()
        child.stdin.write("\n")
        child.stdin.flush()
        out, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0 and out.strip() == "ok", err[-3000:]
    assert sum(s3_proxy.dropped.values()) == 3
    assert time.perf_counter() - started < 20, "the stalls were waited out, not cut short"
