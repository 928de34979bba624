"""Packs (issue 35, ``arrayckpt/_storage/packs.py`` and ``packread.py``): a rank's chunk files appended into one
file (locally) or one object (object storage), written from many threads into reserved ranges or appended in order,
and ranged reads of them.

Each behaviour runs on a local directory and on TensorStore's in-memory object store (quick); the multipart path runs
against an in-process stand-in for an s3fs/gcsfs file (quick), a moto S3 server and fake-gcs-server (slow): parts are
uploaded in order whatever the order of the writes, a pack of one part is one PUT, abort leaves no object and no
pending upload, and a link, a truncated or a missing pack reads as a damaged checkpoint, naming it."""

from __future__ import annotations

import math
import os
import random
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from gcs_server import GCSServer
from s3_server import FaultProxy, S3Server

from arrayckpt._errors import CorruptCheckpointError, FormatError, StorageError
from arrayckpt._format.packs import PackFile, pack_name
from arrayckpt._storage import LocalLocation, Location, ObjectLocation, parse_object_url
from arrayckpt._storage.base import open_pack, read_into, read_ranges
from arrayckpt._storage.packread import _requests
from arrayckpt._storage.packs import MIN_PART_BYTES, ObjectPackWriter, PackSlot, PackWriter

MIB = 1 << 20


@pytest.fixture(params=["local", "memory"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Location:
    """Where a save's ranks write: a (temporary) directory, or a prefix of the in-memory object store."""
    if request.param == "local":
        (tmp_path / "save").mkdir()
        return LocalLocation(tmp_path / "save")
    return parse_object_url(f"memory://packs-{uuid.uuid4().hex}/step")


@pytest.fixture
def s3_target(s3_proxy: FaultProxy, s3_bucket: str) -> ObjectLocation:
    return parse_object_url(f"s3://{s3_bucket}/run/step", {"endpoint_url": s3_proxy.endpoint})


def _stored(location: Location) -> list[str]:
    """The pack files (objects) at ``location``."""
    if isinstance(location, LocalLocation):
        packs = location.path / "packs"
        return sorted(f"packs/{p.name}" for p in packs.iterdir()) if packs.is_dir() else []
    assert isinstance(location, ObjectLocation)
    return sorted(location.object_keys())


def _chunks(count: int, seed: int = 0, sizes: tuple[int, ...] = (0, 1, 17, 4096, 5000, 70_000)) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice(sizes)) for _ in range(count)]


def _write_all(pack: PackWriter, chunks: list[bytes], threads: int = 4) -> list[PackSlot]:
    """Reserve every chunk in order, then write them from ``threads`` threads in a shuffled order (every third one
    in pieces); the slots."""
    slots = [pack.reserve(len(chunk)) for chunk in chunks]
    order = list(range(len(chunks)))
    random.Random(1).shuffle(order)

    def write(i: int) -> None:
        data = memoryview(chunks[i])
        pieces = [data[:3], data[3:10], data[10:]] if i % 3 == 0 else data
        pack.write(slots[i].offset, pieces)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, order))
    return slots


def _check_round_trip(location: Location, files: list[PackFile], chunks: list[bytes], slots: list[PackSlot],
                      rank: int = 3) -> None:
    """The pack is one file holding every chunk, read back equal through ``read_ranges`` and ``read_into``."""
    assert files == [PackFile(pack_name(rank), sum(map(len, chunks)), rank)]
    assert _stored(location) == [files[0].name]
    ranges = [(slot.offset, slot.length) for slot in slots]
    assert [n for _, n in ranges] == [len(c) for c in chunks]
    assert read_ranges(location, files[0].name, ranges) == chunks
    buffers = [memoryview(bytearray(n)) for _, n in ranges]
    read_into(location, files[0].name, ranges, buffers)
    assert [bytes(b) for b in buffers] == chunks


def test_threads_write_reserved_ranges_and_read_them_back(target: Location) -> None:
    chunks = _chunks(300)
    pack = open_pack(target, 3)
    slots = _write_all(pack, chunks)
    assert [s.offset for s in slots] == [sum(map(len, chunks[:i])) for i in range(len(chunks))]
    _check_round_trip(target, pack.close(), chunks, slots)


def test_append_reserves_and_writes_in_one_call(target: Location) -> None:
    chunks = _chunks(50, seed=4)
    pack = open_pack(target, 3)
    slots = [pack.append(c if i % 3 == 0 else memoryview(c) if i % 3 == 1 else [memoryview(c)[:5], memoryview(c)[5:]])
             for i, c in enumerate(chunks)]
    slots.append(pack.reserve(4))  # appends and reservations mix: one sequence of offsets
    pack.write(slots[-1].offset, b"last")
    chunks.append(b"last")
    _check_round_trip(target, pack.close(), chunks, slots)


def test_a_pack_is_one_file_however_large(tmp_path: Path, tuned: Callable[..., object]) -> None:
    """(There were segments once: 1 GiB files, 64 MiB objects; docs/PACKED_LAYOUT.md says why no more.)"""
    tuned(object_part_bytes=MIN_PART_BYTES)
    target = LocalLocation(tmp_path)
    pack = open_pack(target, 3)
    chunks = [bytes([i]) * (3 * MIB) for i in range(5)]
    slots = [pack.append(c) for c in chunks]
    _check_round_trip(target, pack.close(), chunks, slots)


def test_abort_removes_everything_it_wrote(target: Location) -> None:
    other = open_pack(target, 4)  # another rank's pack stays
    other.write(other.reserve(5).offset, b"other")
    assert other.close() == [PackFile("packs/r000004.pack", 5, 4)]
    pack = open_pack(target, 3)
    _write_all(pack, [b"x" * 80] * 5)
    pack.abort()
    assert _stored(target) == ["packs/r000004.pack"]
    other.abort()  # after close too: the save failed elsewhere
    assert _stored(target) == []
    with pytest.raises(ValueError, match="pack is aborted"):
        other.reserve(1)


def test_a_crash_like_abort_leaves_no_file(tmp_path: Path) -> None:
    """A rank that fails mid-save (ranges reserved and some never written) aborts: nothing of its pack is left."""
    target = LocalLocation(tmp_path)
    pack = open_pack(target, 0)
    slots = [pack.reserve(1000) for _ in range(4)]
    pack.write(slots[2].offset, b"x" * 1000)
    assert (tmp_path / "packs" / "r000000.pack").is_file()
    pack.abort()
    assert not (tmp_path / "packs").exists()
    with pytest.raises(ValueError, match="pack is aborted"):
        pack.write(slots[0].offset, b"x" * 1000)


def test_writes_must_match_their_reservations(target: Location) -> None:
    pack = open_pack(target, 0)
    slot = pack.reserve(4)
    with pytest.raises(ValueError, match=r"reserved for 4 bytes, not 3"):
        pack.write(slot.offset, b"abc")
    with pytest.raises(ValueError, match="was not reserved"):
        pack.write(1, b"abc")
    with pytest.raises(ValueError, match=r"1 reserved range\(s\) not written \(the first at offset 0\)"):
        pack.close()
    pack.write(slot.offset, b"abcd")
    with pytest.raises(ValueError, match="written already"):
        pack.write(slot.offset, b"abcd")
    assert pack.close() == [PackFile("packs/r000000.pack", 4, 0)]
    with pytest.raises(ValueError, match="pack is closed"):
        pack.write(slot.offset, b"abcd")
    pack.abort()


def test_an_empty_pack_writes_nothing(target: Location) -> None:
    assert open_pack(target, 0).close() == []
    assert _stored(target) == []


def _one_pack(target: Location, data: bytes = b"0123456789") -> str:
    pack = open_pack(target, 0)
    pack.append(data)
    return pack.close()[0].name


def test_a_truncated_or_missing_pack_is_a_damaged_checkpoint(target: Location) -> None:
    name = _one_pack(target)
    assert read_ranges(target, name, [(8, 2), (0, 0)]) == [b"89", b""]
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{target}: pack {name} is shorter than its table says: "
                                                               "bytes [8, 12) are past its end")):
        read_ranges(target, name, [(0, 4), (8, 4)])
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{target}: pack packs/r000009.pack is missing")):
        read_ranges(target, "packs/r000009.pack", [(0, 1)])
    with pytest.raises(FormatError, match="is not the name of a pack file inside the checkpoint"):
        read_ranges(target, "packs/../../etc/passwd", [(0, 1)])


def test_links_and_special_files_are_never_read(tmp_path: Path) -> None:
    (tmp_path / "save").mkdir()
    target = LocalLocation(tmp_path / "save")
    name = _one_pack(target)
    outside = tmp_path / "outside.pack"
    outside.write_bytes(b"0123456789")
    (target.path / name).unlink()
    (target.path / name).symlink_to(outside)
    with pytest.raises(CorruptCheckpointError, match=rf"{name} is a symbolic link"):
        read_ranges(target, name, [(0, 1)])
    (target.path / name).unlink()
    os.mkfifo(target.path / name)
    with pytest.raises(CorruptCheckpointError, match=rf"{name} is not a regular file"):
        read_ranges(target, name, [(0, 1)])
    (target.path / name).unlink()
    (target.path / "packs").rmdir()
    (target.path / "packs").symlink_to(tmp_path)  # a link in place of the directory: neither read nor written
    with pytest.raises(CorruptCheckpointError, match=r"packs is a symbolic link"):
        read_ranges(target, "packs/outside.pack", [(0, 1)])
    with pytest.raises(StorageError, match="packs is not a directory"):
        open_pack(target, 1).reserve(1)


def test_a_pack_is_created_exclusively(tmp_path: Path) -> None:
    (tmp_path / "save").mkdir()
    target = LocalLocation(tmp_path / "save")
    _one_pack(target)
    with pytest.raises(StorageError, match=r"packs/r000000.pack exists already: two writers of rank 0"):
        open_pack(target, 0).reserve(1)
    assert read_ranges(target, "packs/r000000.pack", [(0, 10)]) == [b"0123456789"]


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    calls: list[int] = []
    real = os.fsync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    yield calls


def test_a_durable_pack_is_fsynced_and_durable_false_skips_it(tmp_path: Path, fsyncs: list[int]) -> None:
    (tmp_path / "durable").mkdir()
    (tmp_path / "fast").mkdir()
    durable = LocalLocation(tmp_path / "durable")
    pack = open_pack(durable, 0)
    _write_all(pack, [b"abcd", b"efgh"])
    pack.close()
    assert len(fsyncs) == 2  # its file and the directory holding it
    fsyncs.clear()
    pack = open_pack(LocalLocation(tmp_path / "fast").without_fsync(), 0)
    _write_all(pack, [b"abcd", b"efgh"])
    assert len(pack.close()) == 1
    assert fsyncs == []


def test_reads_into_buffers_of_other_types(target: Location) -> None:
    import numpy as np

    values = np.arange(10, dtype=np.float32)
    pack = open_pack(target, 0)
    pack.append(memoryview(values))
    name = pack.close()[0].name
    out = np.zeros(5, dtype=np.float32)
    read_into(target, name, [(20, 20)], [memoryview(out)])
    assert out.tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="holds 20 bytes, not 8"):
        read_into(target, name, [(0, 8)], [memoryview(out)])


# --- the multipart path, against a stand-in for an s3fs/gcsfs file ------------------------------------------------


class _Recorder:
    """An :class:`~arrayckpt._storage.packs.Upload` keeping the parts it is given, in order (a stand-in for an s3fs
    or gcsfs file opened for writing); ``fail_at``: the part whose write raises; ``delay_s``: each write's time."""

    def __init__(self, fail_at: int | None = None, delay_s: float = 0.0) -> None:
        self.parts: list[bytes] = []
        self.fail_at, self.delay_s = fail_at, delay_s
        self.opened: list[tuple[str, int]] = []
        self.closed = self.completed = self.discarded = False

    def open(self, name: str, part_bytes: int) -> _Recorder:
        self.opened.append((name, part_bytes))
        return self

    def write(self, data: memoryview, /) -> int:
        if len(self.parts) == self.fail_at:
            raise OSError("the store refused the part")
        threading.Event().wait(self.delay_s)
        self.parts.append(bytes(data))
        return len(data)

    def close(self) -> None:
        self.completed = self.closed = True

    def discard(self) -> None:
        self.discarded = True


def _multipart(recorder: _Recorder, max_parts: int | None = None) -> ObjectPackWriter:
    store = parse_object_url(f"memory://packs-{uuid.uuid4().hex}/step").open_store()
    return ObjectPackWriter(store, 0, "test", MIN_PART_BYTES, recorder.open, max_parts)


def test_parts_go_out_in_order_whatever_the_order_of_the_writes() -> None:
    recorder = _Recorder()
    pack = _multipart(recorder)
    chunks = _chunks(60, seed=3, sizes=(1, 100_000, 700_000))
    _write_all(pack, chunks)
    files = pack.close()
    assert recorder.opened == [("packs/r000000.pack", MIN_PART_BYTES)] and recorder.completed
    assert [len(p) for p in recorder.parts[:-1]] == [MIN_PART_BYTES] * (len(recorder.parts) - 1)
    assert len(recorder.parts) == math.ceil(files[0].size / MIN_PART_BYTES) > 2
    assert b"".join(recorder.parts) == b"".join(chunks)


def test_appending_holds_a_few_parts_at_most(tuned: Callable[..., object]) -> None:
    """One thread appending waits for uploads once ``object_pack_parts`` parts are held."""
    tuned(object_pack_parts=2)
    recorder = _Recorder(delay_s=0.02)
    pack = _multipart(recorder)
    held = 0
    for chunk in _chunks(80, seed=6, sizes=(300_000, 1_000_000)):
        pack.append(chunk)
        held = max(held, pack.reserve(0).offset - sum(map(len, recorder.parts)))
    pack.close()
    assert held <= 2 * MIN_PART_BYTES + 1_000_000  # (the parts held, and the chunk that waited for one to go)


def test_writes_in_reverse_order_from_one_thread_do_not_deadlock(tuned: Callable[..., object]) -> None:
    """A write waits only when every byte before it is written: a thread writing the last range first goes on."""
    tuned(object_pack_parts=1)
    recorder = _Recorder()
    pack = _multipart(recorder)
    chunks = [bytes([i]) * MIB for i in range(12)]
    slots = [pack.reserve(len(c)) for c in chunks]
    done = threading.Event()

    def backwards() -> None:
        for slot, chunk in reversed(list(zip(slots, chunks, strict=True))):
            pack.write(slot.offset, chunk)
        pack.close()
        done.set()

    threading.Thread(target=backwards, daemon=True).start()
    assert done.wait(30), "writing in reverse order deadlocked"
    assert b"".join(recorder.parts) == b"".join(chunks)


def test_a_pack_of_one_part_is_one_put_and_opens_no_upload() -> None:
    recorder = _Recorder()
    pack = _multipart(recorder)
    pack.append(b"x" * (MIN_PART_BYTES - 1))
    pack.append(b"y")  # exactly one part: still one PUT
    assert pack.close() == [PackFile("packs/r000000.pack", MIN_PART_BYTES, 0)]
    assert recorder.opened == [] and recorder.parts == []


def test_a_failed_part_fails_the_pack_and_abort_abandons_the_upload() -> None:
    recorder = _Recorder(fail_at=1)
    pack = _multipart(recorder)
    for _ in range(4):
        pack.append(b"z" * (2 * MIB))
    with pytest.raises(StorageError, match=r"test: writing rank 0's pack failed: packs/r000000.pack: the store "
                                           "refused the part"):
        pack.close()
    pack.abort()
    assert recorder.discarded and not recorder.completed


def test_part_sizes_and_the_part_limit_are_checked(target: Location, tuned: Callable[..., object]) -> None:
    with pytest.raises(StorageError, match=r"would pass 15,728,641 bytes, more than 3 parts of "
                                           r"object_part_bytes=5,242,880 hold .* raise ARRAYCKPT_OBJECT_PART_BYTES"):
        pack = _multipart(_Recorder(), max_parts=3)
        pack.reserve(3 * MIN_PART_BYTES)
        pack.reserve(1)
    if isinstance(target, ObjectLocation):
        tuned(object_part_bytes=1 << 20)
        with pytest.raises(ValueError, match=r"object_part_bytes=1,048,576 is not a part object storage takes: give a "
                                             r"multiple of 262,144 \(GCS\) from 5,242,880"):
            open_pack(target, 0)


def test_close_ranges_are_read_together(target: Location, tuned: Callable[..., object]) -> None:
    assert _requests([(0, 10), (10, 5), (100, 5), (40, 0), (400_000, 1), (400_001, 1)], 100, 1000) == [
        (0, 105, [0, 1, 3, 2]), (400_000, 400_002, [4, 5])]
    assert _requests([(0, 600), (600, 600)], 100, 1000) == [(0, 600, [0]), (600, 1200, [1])]  # (at most 1,000 bytes)
    assert _requests([(0, 1), (1, 1)], -1, 1000) == [(0, 1, [0]), (1, 2, [1])]
    chunks = _chunks(40, seed=7)
    pack = open_pack(target, 3)
    slots = [pack.append(c) for c in chunks]
    files = pack.close()
    tuned(pack_read_gap_bytes=4096)
    picked = slots[::3][::-1]  # gaps, and out of order
    assert read_ranges(target, files[0].name, [(s.offset, s.length) for s in picked]) == chunks[::3][::-1]


# --- S3 (moto) and GCS (fake-gcs-server): slow -----------------------------------------------------------------------


def _pending_uploads(s3_server: S3Server, bucket: str) -> list[dict]:
    return s3_server.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def test_s3_a_large_pack_is_one_multipart_object(s3_target: ObjectLocation, s3_proxy: FaultProxy,
                                                 s3_server: S3Server, tuned: Callable[..., object]) -> None:
    tuned(object_part_bytes=MIN_PART_BYTES, object_pack_parts=2)
    chunks = _chunks(30, seed=5, sizes=(1, 200_000, 500_000, 900_000))
    s3_proxy.reset()
    pack = open_pack(s3_target, 3)
    slots = _write_all(pack, chunks)  # out of order, from four threads
    files = pack.close()
    methods = [(method, query) for method, _, query, _ in s3_proxy.log]
    parts = [q for m, q in methods if m == "PUT" and "partNumber=" in q]
    assert len(parts) == math.ceil(files[0].size / MIN_PART_BYTES) > 2
    assert [m for m, q in methods if m != "PUT"] == ["POST", "POST"]  # CreateMultipartUpload, CompleteMultipartUpload
    assert len(methods) == len(parts) + 2
    assert _pending_uploads(s3_server, s3_target.bucket) == []
    s3_proxy.reset()
    _check_round_trip(s3_target, files, chunks, slots)
    ranges = [(slot.offset, slot.length) for slot in slots]
    gets = [entry for entry in s3_proxy.log if entry[0] == "GET" and entry[3] is not None]  # (ranged: not listings)
    assert len(gets) == 2 * len(_requests(ranges, 256 << 10, MIN_PART_BYTES)) < len(chunks)


def test_s3_a_small_pack_is_one_put(s3_target: ObjectLocation, s3_proxy: FaultProxy, s3_server: S3Server) -> None:
    s3_proxy.reset()
    name = _one_pack(s3_target)
    assert [entry[0] for entry in s3_proxy.log] == ["PUT"]
    assert read_ranges(s3_target, name, [(2, 3)]) == [b"234"]


def test_s3_abort_leaves_no_object_and_no_pending_upload(s3_target: ObjectLocation, s3_server: S3Server,
                                                         tuned: Callable[..., object]) -> None:
    tuned(object_part_bytes=MIN_PART_BYTES)
    pack = open_pack(s3_target, 0)
    for _ in range(3):
        pack.append(b"x" * (4 * MIB))  # two parts go out while the pack is written
    for _ in range(200):
        if _pending_uploads(s3_server, s3_target.bucket):
            break
        threading.Event().wait(0.05)
    assert len(_pending_uploads(s3_server, s3_target.bucket)) == 1
    pack.abort()
    assert _pending_uploads(s3_server, s3_target.bucket) == [] and _stored(s3_target) == []
    pack = open_pack(s3_target, 1)  # after close too: the object is deleted
    pack.append(b"y" * (6 * MIB))
    assert pack.close() == [PackFile("packs/r000001.pack", 6 * MIB, 1)]
    assert _stored(s3_target) == ["packs/r000001.pack"]
    pack.abort()
    assert _stored(s3_target) == []


def test_s3_a_refused_part_fails_the_pack_and_abort_cleans_up(s3_target: ObjectLocation, s3_proxy: FaultProxy,
                                                              s3_server: S3Server,
                                                              tuned: Callable[..., object]) -> None:
    tuned(object_part_bytes=MIN_PART_BYTES)
    s3_proxy.permanent_error = "AccessDenied"
    s3_proxy.fail_puts_always = True  # UploadPart is a PUT; CreateMultipartUpload a POST
    pack = open_pack(s3_target, 0)
    with pytest.raises(StorageError, match=r"writing rank 0's pack failed: packs/r000000.pack: Access Denied"):
        for _ in range(4):
            pack.append(b"x" * (4 * MIB))
        pack.close()
    s3_proxy.clear_faults()
    pack.abort()
    assert _pending_uploads(s3_server, s3_target.bucket) == [] and _stored(s3_target) == []


def test_s3_truncated_and_missing_packs(s3_target: ObjectLocation, s3_server: S3Server) -> None:
    name = _one_pack(s3_target)
    s3_server.client.put_object(Bucket=s3_target.bucket, Key=f"run/step/{name}", Body=b"01234")
    with pytest.raises(CorruptCheckpointError, match=rf"pack {name} is shorter than its table says: bytes \[4, 8\)"):
        read_ranges(s3_target, name, [(0, 2), (4, 4)])
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{s3_target}: pack packs/r000001.pack is missing")):
        read_ranges(s3_target, "packs/r000001.pack", [(0, 1)])
    assert read_ranges(s3_target, name, [(1, 3)]) == [b"123"]


def test_s3_storage_failures_are_storage_errors(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    target = parse_object_url(f"s3://{s3_bucket}/run/step", {"endpoint_url": s3_proxy.endpoint, "max_retries": 1})
    s3_proxy.fail_puts_always = True
    pack = open_pack(target, 0)
    pack.append(b"abc")
    with pytest.raises(StorageError, match=r"writing rank 0's pack failed: packs/r000000.pack"):
        pack.close()
    s3_proxy.clear_faults()
    pack.abort()
    s3_proxy.fail_get_fraction = 1.0
    with pytest.raises(StorageError, match=r"reading bytes \[0, 1\) of packs/r000000.pack failed"):
        read_ranges(target, "packs/r000000.pack", [(0, 1)])


def test_gcs_a_large_pack_is_one_resumable_upload(gcs_server: GCSServer, gcs_bucket: str,
                                                  tuned: Callable[..., object]) -> None:
    tuned(object_part_bytes=MIN_PART_BYTES)
    location = parse_object_url(f"gs://{gcs_bucket}/run/step", gcs_server.options)
    chunks = _chunks(30, seed=8, sizes=(1, 200_000, 500_000, 900_000))
    pack = open_pack(location, 3)
    slots = _write_all(pack, chunks)
    _check_round_trip(location, pack.close(), chunks, slots)
    pack.abort()
    pack = open_pack(location, 0)
    for _ in range(3):
        pack.append(b"x" * (4 * MIB))
    pack.abort()  # the resumable session is cancelled: nothing lands
    assert gcs_server.list_keys(gcs_bucket) == []
