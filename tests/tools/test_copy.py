"""``arrayckpt.copy`` / ``arrayckpt sync``: a committed checkpoint (with its chain of bases) copied as stored between
local directories, ``memory://`` and S3 (moto), every chunk checked on the way, the destination committed last.

What must hold: the copy reads back bit for bit and ``verify`` finds it whole, with the same manifest (the same id,
so a copied chain is checked like the original); damage in the source (a flipped byte, a truncated, missing or
swapped chunk file) fails the copy and commits nothing, leaving a checkpoint it was replacing whole; a copy cut short
never reads as committed; bases go first, to the same relative places, and are not copied twice.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import FILES_LAYOUT_ONLY, assert_bit_equal
from policies import SHARDED, WHOLE, small_chunks
from s3_server import FaultProxy, S3Server

import arrayckpt
import arrayckpt._tools.copy_files as copy_files_module
from arrayckpt._cli.storage import add_sync
from arrayckpt._format.integrity import chunk_crc
from arrayckpt._format.stored import stored_content_crc
from arrayckpt._format.zarr import chunk_key, grid_counts
from arrayckpt._io.decode import ChunkDecoder
from arrayckpt._read.checkpoint import stored_of
from arrayckpt._storage.object import kept_of, stale_keys
from arrayckpt._tools.copy import copy
from arrayckpt._tools.copy_files import FileCopier

pytestmark = pytest.mark.usefixtures("storage_layout")

UNSHARDED_EDGES = small_chunks(256, 256)  # several unsharded chunks per tensor, clipped at the edges


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(37, 11, generator=g), "b": torch.randn(11, generator=g).bfloat16()},
            "emb": torch.randn(7, 5, 3, generator=g), "count": torch.tensor(seed),
            "flags": torch.rand(9, generator=g) > 0.5, "rank": arrayckpt.PerRank(torch.arange(5, dtype=torch.int16)),
            "step": seed, "note": "two-tier"}


def _tensors(path: str | Path, options: dict | None = None) -> dict[str, torch.Tensor]:
    with arrayckpt.open(path, storage_options=options) as ckpt:
        return {key: ckpt[key].torch() for key in ckpt}


def _same_checkpoint(src: str | Path, dst: str | Path, src_options: dict | None = None,
                     dst_options: dict | None = None) -> None:
    """``dst`` holds what ``src`` holds, bit for bit, with the same manifest (id included), and verifies clean."""
    expected, got = _tensors(src, src_options), _tensors(dst, dst_options)
    assert sorted(expected) == sorted(got)
    for key, tensor in expected.items():
        assert_bit_equal(got[key], tensor)
    with arrayckpt.open(src, storage_options=src_options) as a, arrayckpt.open(dst, storage_options=dst_options) as b:
        assert a.manifest.to_dict() == b.manifest.to_dict()
        assert a.plain_values == b.plain_values and a.manifest.id == b.manifest.id
    report = arrayckpt.verify(dst, storage_options=dst_options)
    assert report.ok and not report.unprotected, report.to_dict()


def _chunk_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != "zarr.json")


def _stored_chunks(path: str | Path, options: dict | None = None) -> int:
    """How many chunk files the checkpoint stores (files, or chunks in its packs): what ``copy`` counts."""
    with arrayckpt.open(path, storage_options=options) as ckpt:
        packed = stored_of(ckpt).packed
        if packed is None:
            return len(_chunk_files(Path(path)))
        return sum(len(packed.stored(array).order) for array in packed.layout.sections)


# --- copying whole checkpoints ------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", [None, "zstd", "blosc"])
@pytest.mark.parametrize("policy", [WHOLE, SHARDED, UNSHARDED_EDGES], ids=lambda p: p.name)
def test_copy_is_bit_exact_with_the_same_manifest(tmp_path: Path, policy, codec) -> None:
    policy.save(_state(1), tmp_path / "src", codec=codec, step=1)
    result = copy(tmp_path / "src", tmp_path / "dst")
    _same_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert result.copied == (str(tmp_path / "dst"),) and result.skipped == ()
    assert result.objects == _stored_chunks(tmp_path / "src") and result.bytes_copied > 0
    assert sorted(p.relative_to(tmp_path / "dst") for p in (tmp_path / "dst").rglob("*")) == \
        sorted(p.relative_to(tmp_path / "src") for p in (tmp_path / "src").rglob("*"))
    assert [p.name for p in tmp_path.iterdir() if "arrayckpt-tmp" in p.name] == []


def test_a_second_copy_of_the_same_checkpoint_copies_nothing_and_another_needs_overwrite(tmp_path: Path) -> None:
    arrayckpt.save(_state(1), tmp_path / "a")
    arrayckpt.save(_state(2), tmp_path / "b")
    copy(tmp_path / "a", tmp_path / "dst")
    again = copy(tmp_path / "a", tmp_path / "dst")
    assert again.copied == () and again.skipped == (str(tmp_path / "dst"),) and again.objects == 0
    with pytest.raises(arrayckpt.CheckpointExistsError, match="pass overwrite=True"):
        copy(tmp_path / "b", tmp_path / "dst")
    copy(tmp_path / "b", tmp_path / "dst", overwrite=True)
    _same_checkpoint(tmp_path / "b", tmp_path / "dst")
    with pytest.raises(ValueError, match="onto itself or into itself"):
        copy(tmp_path / "a", tmp_path / "a" / "inside")


@FILES_LAYOUT_ONLY  # reads chunk files
def test_fast_checks_agree_with_tensorstore_decoding(tmp_path: Path) -> None:
    """The content checksums read from uncompressed chunk files without decoding equal those of the decoded chunks,
    for unsharded chunks clipped at the edges and shards whose inner chunks split one or several dimensions."""
    checked = 0
    for policy in (WHOLE, SHARDED, UNSHARDED_EDGES, small_chunks(64, 512)):
        path = tmp_path / policy.name.replace("/", "-")
        policy.save(_state(3), path)
        with arrayckpt.open(path) as ckpt:
            for key in ("model.w", "model.b", "emb", "flags", "count"):
                metadata = ckpt[key].metadata
                decoder = ChunkDecoder(metadata)
                chunks = metadata["chunk_grid"]["configuration"]["chunk_shape"]
                for grid_index in itertools.product(*(range(n) for n in grid_counts(metadata))):
                    name = chunk_key(metadata, grid_index)
                    data = (path / ckpt.manifest.entries[key].path / name).read_bytes()
                    fast = stored_content_crc(metadata, grid_index, data, name)
                    index = tuple(slice(i * c, min((i + 1) * c, n))
                                  for i, c, n in zip(grid_index, chunks, metadata["shape"], strict=True))
                    assert fast == chunk_crc(decoder.decode(name, data, index, name)), (policy.name, key, name)
                    checked += 1
    assert checked > 40


# --- damage in the source: nothing is committed ------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped data byte": (WHOLE, None, lambda f: _flip(f[0], 3), "checksum mismatch"),
    "flipped byte in a shard index": (SHARDED, None, lambda f: _flip(f[0], -10), "shard index checksum"),
    "flipped byte in an inner chunk": (SHARDED, None, lambda f: _flip(f[0], 1), "inner chunk 0 checksum"),
    "truncated chunk": (UNSHARDED_EDGES, None, lambda f: f[0].write_bytes(f[0].read_bytes()[:-7]), "truncated"),
    "missing chunk": (SHARDED, None, lambda f: f[0].unlink(), "is missing"),
    "flipped byte in a zstd chunk": (WHOLE, "zstd", lambda f: _flip(f[0], 12), "cannot be decoded"),
    "swapped chunk files": (SHARDED, None, lambda f: _swap(f[0], f[1]), "do not hold the chunks saved there"),
}


def _swap(a: Path, b: Path) -> None:
    data = a.read_bytes()
    a.write_bytes(b.read_bytes())
    b.write_bytes(data)


def _pack_rows(path: Path, array: str) -> tuple[Path, list[tuple[int, int]]]:
    """The pack file of a one-rank packed checkpoint and the ``(offset, length)`` of each chunk of ``array``."""
    with arrayckpt.open(path) as ckpt:
        packed = stored_of(ckpt).packed
        rows = packed.rows([array])[array]
        return path / packed.layout.packs[0].name, [(int(o), int(n)) for _, o, n in rows.tolist()]


def _swap_chunks(pack: Path, rows: list[tuple[int, int]]) -> None:
    (a, n), (b, m) = rows[0], rows[1]
    assert n == m
    data = bytearray(pack.read_bytes())
    data[a:a + n], data[b:b + n] = data[b:b + n], data[a:a + n]
    pack.write_bytes(bytes(data))


PACK_DAMAGE = {
    "flipped data byte": (lambda pack, rows, index: _flip(pack, rows[1][0] + 3), "checksum mismatch"),
    "truncated pack": (lambda pack, rows, index: pack.write_bytes(pack.read_bytes()[:-7]), "truncated|shorter"),
    "missing pack": (lambda pack, rows, index: pack.unlink(), "missing"),
    "flipped byte in the index": (lambda pack, rows, index: _flip(index, 5), "pack index"),
    "swapped chunk files": (lambda pack, rows, index: _swap_chunks(pack, rows), "do not hold the chunks saved there"),
}


def _damaged(layout: str, kind: str, src: Path) -> str:
    """Save a checkpoint at ``src`` in ``layout`` and damage it as ``kind`` says (``DAMAGE``: its chunk files;
    ``PACK_DAMAGE``: its pack or index); the error message the copy must fail with."""
    if layout == "files":
        policy, codec, damage, message = DAMAGE[kind]
        policy.save({"w": torch.randn(40, 8)}, src, codec=codec)
        damage(_chunk_files(src / "w"))
        return message
    pack_damage, message = PACK_DAMAGE[kind]
    small_chunks(256, 256).save({"w": torch.randn(64, 8)}, src)  # 8 chunk files of one length
    pack, rows = _pack_rows(src, "w")
    pack_damage(pack, rows, next((src / "packs").glob("*-index.bin")))
    return message


@pytest.mark.parametrize(("storage_layout", "kind"), [*(("files", kind) for kind in DAMAGE),
                                                      *(("packed", kind) for kind in PACK_DAMAGE)],
                         indirect=["storage_layout"])
def test_damage_in_the_source_fails_the_copy_and_commits_nothing(tmp_path: Path, storage_layout: str,
                                                                 kind: str) -> None:
    message = _damaged(storage_layout, kind, tmp_path / "src")
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=message):
        copy(tmp_path / "src", tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no copy, no temporary directory
    arrayckpt.save({"w": torch.ones(3)}, tmp_path / "old")  # a committed checkpoint being replaced stays whole
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=message):
        copy(tmp_path / "src", tmp_path / "old", overwrite=True)
    assert torch.equal(_tensors(tmp_path / "old")["w"], torch.ones(3)) and arrayckpt.verify(tmp_path / "old").ok
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "src"]


@pytest.mark.parametrize("storage_layout", ["packed"], indirect=True)
def test_a_packed_copy_is_read_in_windows_of_whole_chunks_paced_and_read_back(tmp_path: Path, tuned) -> None:
    small_chunks(256 << 10, 256 << 10).save({"w": torch.randn(8, 64 << 10)}, tmp_path / "src")  # 8 chunks, 1 pack
    tuned(copy_in_flight_bytes=1200 << 10)  # windows of four chunk files at concurrency 1 (two at 2)
    seen: list[tuple[int, int]] = []
    started = time.monotonic()
    result = copy(tmp_path / "src", tmp_path / "dst", max_bytes_per_second=8 << 20, read_back=True, concurrency=2,
                  progress=lambda done, total: seen.append((done, total)))
    elapsed = time.monotonic() - started
    assert result.objects == 8 and result.bytes_copied == (tmp_path / "src" / _pack_rows(tmp_path / "src", "w")[0]
                                                           .relative_to(tmp_path / "src")).stat().st_size
    assert len(seen) == 4 and seen[-1] == (8 * (256 << 10), 8 * (256 << 10))  # a window of two chunks at a time
    assert elapsed >= 6 * (256 << 10) / (8 << 20) * 0.95  # the first window starts at once
    _same_checkpoint(tmp_path / "src", tmp_path / "dst")


# --- delta chains -------------------------------------------------------------------------------------------------


def test_a_delta_chain_is_copied_as_deltas_bases_first_and_once(tmp_path: Path) -> None:
    src, dst = tmp_path / "run", f"memory://copy-{uuid.uuid4().hex[:12]}/run"
    state = _state(1)
    SHARDED.save(state, src / "step-1", step=1)
    state["model"]["w"][3] += 1  # a chunks delta
    SHARDED.save(state, src / "step-2", step=2, base=src / "step-1")
    state["emb"][2] += 1  # a rows delta, rows named by the caller
    SHARDED.save(state, src / "step-3", step=3, base=src / "step-2", changed_rows={"emb": torch.tensor([2])})
    result = copy(src / "step-3", f"{dst}/step-3")
    assert result.copied == (f"{dst}/step-1", f"{dst}/step-2", f"{dst}/step-3") and result.skipped == ()
    for step in (1, 2, 3):
        _same_checkpoint(src / f"step-{step}", f"{dst}/step-{step}")
    with arrayckpt.open(f"{dst}/step-3") as ckpt:
        assert ckpt.manifest.base.path == "../step-2" and [c.step for c in ckpt.chain()] == [3, 2, 1]
    state["model"]["b"][0] += 1
    SHARDED.save(state, src / "step-4", step=4, base=src / "step-3")
    more = copy(src / "step-4", f"{dst}/step-4")  # its base is in place: only the new delta is copied
    assert more.copied == (f"{dst}/step-4",) and more.skipped == (f"{dst}/step-3",)
    _same_checkpoint(src / "step-4", f"{dst}/step-4")


def test_another_checkpoint_where_a_base_goes_is_never_overwritten(tmp_path: Path) -> None:
    arrayckpt.save({"w": torch.zeros(4)}, tmp_path / "src" / "step-1")
    arrayckpt.save({"w": torch.ones(4)}, tmp_path / "src" / "step-2", base=tmp_path / "src" / "step-1")
    arrayckpt.save({"w": torch.full((4,), 7.0)}, tmp_path / "dst" / "step-1")
    with pytest.raises(arrayckpt.CheckpointExistsError, match="a base is never overwritten"):
        copy(tmp_path / "src" / "step-2", tmp_path / "dst" / "step-2", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "dst").iterdir()) == ["step-1"]
    assert torch.equal(_tensors(tmp_path / "dst" / "step-1")["w"], torch.full((4,), 7.0))


# --- bounded memory, rate limit, read-back, progress --------------------------------------------------------------


@FILES_LAYOUT_ONLY  # counts chunk files in flight (packs: below)
def test_few_chunk_files_are_in_flight_and_the_rate_limit_paces_the_copy(tmp_path: Path, monkeypatch, tuned) -> None:
    small_chunks(256 << 10, 256 << 10).save({"w": torch.randn(8, 64 << 10)}, tmp_path / "src")  # 8 files of 256 KiB
    tuned(copy_in_flight_bytes=600 << 10)  # room for two of them
    copy_once, lock, busy, most = FileCopier._copy_file_once, threading.Lock(), [0], [0]

    def counted(self, *args):
        with lock:
            busy[0] += 1
            most[0] = max(most[0], busy[0])
        try:
            time.sleep(0.01)
            return copy_once(self, *args)
        finally:
            with lock:
                busy[0] -= 1

    monkeypatch.setattr(FileCopier, "_copy_file_once", counted)
    seen: list[tuple[int, int]] = []
    started = time.monotonic()
    result = copy(tmp_path / "src", tmp_path / "dst", max_bytes_per_second=4 << 20, read_back=True,
                  progress=lambda done, total: seen.append((done, total)))
    elapsed = time.monotonic() - started
    assert result.objects == 8 and 1 <= most[0] <= 2  # 8 workers, but never more than two files' bytes at once
    assert elapsed >= 7 * (256 << 10) / (4 << 20) * 0.95  # the first file starts at once, then one per 62.5 ms
    assert seen[-1] == (8 * (256 << 10), 8 * (256 << 10)) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    _same_checkpoint(tmp_path / "src", tmp_path / "dst")


# --- S3: both directions, replacing, faults -----------------------------------------------------------------------


@pytest.mark.slow
def test_local_to_s3_and_back_replacing_a_committed_checkpoint(s3_server: S3Server, s3_bucket: str,
                                                                 tmp_path: Path) -> None:
    options = {"endpoint_url": s3_server.endpoint}
    url = f"s3://{s3_bucket}/run/ckpt"
    SHARDED.save(_state(1), tmp_path / "one", codec={"emb": "zstd"})
    SHARDED.save(_state(2), tmp_path / "two")
    copy(tmp_path / "one", url, dst_options=options)
    _same_checkpoint(tmp_path / "one", url, dst_options=options)
    copy(tmp_path / "two", url, dst_options=options, overwrite=True)  # the other chunk key encoding (a new generation)
    _same_checkpoint(tmp_path / "two", url, dst_options=options)
    with arrayckpt.open(url, storage_options=options) as ckpt:  # (a packed copy keeps its nodes: no chunk objects)
        packed = ckpt.manifest.packs is not None
        assert packed or ckpt["model.w"].metadata["chunk_key_encoding"]["name"] == "v2"
    keys = [k.removeprefix("run/ckpt/") for k in s3_server.list_keys(s3_bucket, "run/ckpt/")]
    root = json.loads(s3_server.client.get_object(Bucket=s3_bucket, Key="run/ckpt/zarr.json")["Body"].read())
    assert stale_keys(keys, kept_of(root)) == []  # the old generation is gone
    back = copy(url, tmp_path / "back", src_options=options)  # to a directory: the encoding the local writer uses
    assert back.objects == _stored_chunks(tmp_path / "two")
    _same_checkpoint(url, tmp_path / "back", src_options=options)


@FILES_LAYOUT_ONLY  # retries per chunk file (a pack is retried whole: copy_packs.py)
def test_transient_s3_errors_are_retried_per_file_and_permanent_ones_commit_nothing(
        s3_server: S3Server, s3_proxy: FaultProxy, s3_bucket: str, tmp_path: Path, monkeypatch) -> None:
    # 9 attempts per file: with a quarter of PUTs failing, a file fails them all with p = 0.25**9 (the test is not
    # a coin toss), while a permanent error still fails fast
    monkeypatch.setattr(copy_files_module, "RETRY_DELAYS", (0.01,) * 8)
    options = {"endpoint_url": s3_proxy.endpoint, "max_retries": 0}  # TensorStore gives up at once: ours retry
    SHARDED.save(_state(1), tmp_path / "src")
    s3_proxy.fail_put_fraction = 0.25
    copy(tmp_path / "src", f"s3://{s3_bucket}/a", dst_options=options)
    assert s3_proxy.injected["PUT"] > 0
    s3_proxy.clear_faults()
    _same_checkpoint(tmp_path / "src", f"s3://{s3_bucket}/a", dst_options=options)
    s3_proxy.fail_puts_always, s3_proxy.permanent_error = True, "AccessDenied"
    s3_proxy.reset()
    started = time.monotonic()
    with pytest.raises(arrayckpt.StorageError, match="PERMISSION_DENIED"):
        copy(tmp_path / "src", f"s3://{s3_bucket}/b", dst_options=options)
    assert time.monotonic() - started < 10 and s3_proxy.injected["PUT"] <= len(_chunk_files(tmp_path / "src")) + 10
    assert s3_server.list_keys(s3_bucket, "b/") == []


@pytest.mark.slow
@pytest.mark.parametrize("storage_layout", ["packed"], indirect=True)
def test_a_packed_copy_to_s3_and_back_writes_each_pack_once(s3_server: S3Server, s3_proxy: FaultProxy,
                                                            s3_bucket: str, tmp_path: Path, tuned) -> None:
    tuned(object_part_bytes=5 << 20)
    options, url = {"endpoint_url": s3_proxy.endpoint}, f"s3://{s3_bucket}/run/ckpt"
    arrayckpt.save({"big": torch.randn(3 << 20), "small": torch.arange(10.0), "step": 1}, tmp_path / "big")
    s3_proxy.reset()
    copy(tmp_path / "big", url, dst_options=options, read_back=True)
    keys = sorted(k.removeprefix("run/ckpt/") for k in s3_server.list_keys(s3_bucket, "run/ckpt/"))
    assert len(keys) == 4 and keys[0].endswith("-index.bin") and keys[1].endswith("-r000000.pack"), keys
    assert keys[2:] == ["refs.json", "zarr.json"] and keys[:2] == sorted(  # the source's names: its tag is kept
        str(p.relative_to(tmp_path / "big")) for p in (tmp_path / "big" / "packs").iterdir())
    # the 12 MiB pack is one multipart upload (create, three parts, complete); the index, refs and root one PUT each
    assert s3_proxy.count("POST", path_contains=".pack") == 2 and s3_proxy.count("PUT", path_contains=".pack") == 3
    assert [s3_proxy.count("PUT", path_contains=name) for name in ("index.bin", "refs.json", "ckpt/zarr.json")] == \
        [1, 1, 1]
    puts = [path for method, path, _, _ in s3_proxy.log if method == "PUT" and "lease" not in path]
    assert puts[-1].endswith("/run/ckpt/zarr.json"), "the root must be written last"
    _same_checkpoint(tmp_path / "big", url, dst_options=options)

    arrayckpt.save({"small": torch.arange(10.0), "step": 2}, tmp_path / "small")
    s3_proxy.reset()
    copy(tmp_path / "small", url, dst_options=options, overwrite=True)  # one PUT for a pack of one part
    assert s3_proxy.count("PUT", path_contains=".pack") == 1 and s3_proxy.count("POST", path_contains=".pack") == 0
    keys = [k.removeprefix("run/ckpt/") for k in s3_server.list_keys(s3_bucket, "run/ckpt/")]
    root = json.loads(s3_server.client.get_object(Bucket=s3_bucket, Key="run/ckpt/zarr.json")["Body"].read())
    assert len(keys) == 4 and stale_keys(keys, kept_of(root)) == []  # the replaced checkpoint's packs are gone
    _same_checkpoint(tmp_path / "small", url, dst_options=options)
    s3_proxy.reset()
    back = copy(url, tmp_path / "back", src_options=options)
    assert back.objects == 1 and s3_proxy.counts.get("PUT", 0) == 0
    _same_checkpoint(url, tmp_path / "back", src_options=options)
    assert sorted(p.name for p in (tmp_path / "back" / "packs").iterdir()) == \
        sorted(p.name for p in (tmp_path / "small" / "packs").iterdir())


_KILLED_COPY = """
import os, sys
from arrayckpt._tools import copy_files
from arrayckpt._tools.copy import copy
copy_once, done = copy_files.FileCopier._copy_file_once, []
def dying(self, *args):
    if len(done) == 3:
        os._exit(9)  # the process dies mid-copy: nothing is aborted
    done.append(1)
    return copy_once(self, *args)
copy_files.FileCopier._copy_file_once = dying
copy(sys.argv[1], sys.argv[2], dst_options={"endpoint_url": sys.argv[3]}, concurrency=1)
"""


@FILES_LAYOUT_ONLY  # kills the copy after three chunk files
@pytest.mark.slow
def test_a_copy_killed_midway_is_not_committed_and_an_overwrite_finishes_it(s3_server: S3Server, s3_bucket: str,
                                                                            tmp_path: Path) -> None:
    options = {"endpoint_url": s3_server.endpoint}
    url = f"s3://{s3_bucket}/ckpt"
    SHARDED.save(_state(1), tmp_path / "src")
    done = subprocess.run([sys.executable, "-c", _KILLED_COPY, str(tmp_path / "src"), url, s3_server.endpoint],
                          capture_output=True, text=True, timeout=120, env={**os.environ, **s3_server.env})
    assert done.returncode == 9, done.stderr
    assert len(s3_server.list_keys(s3_bucket, "ckpt/")) >= 3
    with pytest.raises(arrayckpt.IncompleteCheckpointError, match="never committed"):
        arrayckpt.open(url, storage_options=options)
    with pytest.raises(arrayckpt.CheckpointExistsError, match="pass overwrite=True"):
        copy(tmp_path / "src", url, dst_options=options)
    copy(tmp_path / "src", url, dst_options=options, overwrite=True)
    _same_checkpoint(tmp_path / "src", url, dst_options=options)


# --- the command line ----------------------------------------------------------------------------------------------


def test_sync_command(tmp_path: Path, capsys) -> None:
    arrayckpt.save({"w": torch.arange(10.0)}, tmp_path / "src")
    parser = argparse.ArgumentParser(prog="arrayckpt")
    add_sync(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sync", str(tmp_path / "src"), str(tmp_path / "dst"), "--json", "--max-rate", "1GiB"])
    assert args.max_rate == 2**30 and args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["copied"] == [str(tmp_path / "dst")] and out["objects"] == 1
    args = parser.parse_args(["sync", str(tmp_path / "src"), str(tmp_path / "dst")])
    assert args.func(args) == 0 and "nothing to copy" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        parser.parse_args(["sync", "a", "b", "--max-rate", "fast"])
    assert np.array_equal(arrayckpt.open(tmp_path / "dst")["w"][:], np.arange(10.0))
