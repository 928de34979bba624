"""Packs (issue 35, ``arrayckpt/_storage/packs.py``): a rank's chunk files appended into a few files (locally) or
objects (object storage), written from many threads into reserved ranges, and ranged reads of them.

Each behaviour runs on a local directory and on TensorStore's in-memory object store (quick), and on a moto S3
server (slow): several threads write, segments roll over, close lists what was written, abort removes it, and a
link, a truncated or a missing pack reads as a damaged checkpoint, naming it."""

from __future__ import annotations

import os
import random
import re
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from s3_server import FaultProxy, S3Server

from arrayckpt._errors import CorruptCheckpointError, FormatError, StorageError
from arrayckpt._format.packs import PackFile, pack_name
from arrayckpt._storage import LocalLocation, Location, ObjectLocation, parse_object_url
from arrayckpt._storage.base import open_pack, read_into, read_ranges
from arrayckpt._storage.packs import MAX_PUT_BYTES, PackWriter


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


def _chunks(count: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(rng.choice([0, 1, 17, 4096, 5000, 70_000])) for _ in range(count)]


def _write_all(pack: PackWriter, chunks: list[bytes], threads: int = 4) -> list[tuple[int, int]]:
    """Reserve every chunk in order, then write them from ``threads`` threads in a shuffled order (every third one
    in pieces); the slots."""
    slots = [pack.reserve(len(chunk)) for chunk in chunks]
    order = list(range(len(chunks)))
    random.Random(1).shuffle(order)

    def write(i: int) -> None:
        data = memoryview(chunks[i])
        pieces = [data[:3], data[3:10], data[10:]] if i % 3 == 0 else data
        pack.write(*slots[i], pieces)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(write, order))
    return slots


def _check_round_trip(location: Location, files: list[PackFile], chunks: list[bytes], slots: list) -> None:
    """Every chunk reads back equal, through ``read_ranges`` and ``read_into``, one call per pack file."""
    assert [f.name for f in files] == [pack_name(3, s) for s in range(len(files))]
    assert _stored(location) == [f.name for f in files]
    for segment, file in enumerate(files):
        mine = [i for i, slot in enumerate(slots) if slot.segment == segment]
        ranges = [(slots[i].offset, len(chunks[i])) for i in mine]
        assert file.size == sum(n for _, n in ranges)
        assert read_ranges(location, file.name, ranges) == [chunks[i] for i in mine]
        buffers = [memoryview(bytearray(n)) for _, n in ranges]
        read_into(location, file.name, ranges, buffers)
        assert [bytes(b) for b in buffers] == [chunks[i] for i in mine]


def test_threads_write_reserved_ranges_and_read_them_back(target: Location) -> None:
    chunks = _chunks(300)
    pack = open_pack(target, 3)
    slots = _write_all(pack, chunks)
    files = pack.close()
    assert len(files) == 1 and files[0] == PackFile("packs/r000003-000.pack", sum(map(len, chunks)), 3)
    _check_round_trip(target, files, chunks, slots)


def test_segments_roll_over_at_segment_bytes(target: Location) -> None:
    chunks = [b"a" * 300, b"b" * 300, b"c" * 300, b"d" * 300, b"e" * 2500, b"f" * 10, b"", b"g" * 991]
    pack = open_pack(target, 3, segment_bytes=1000)
    slots = _write_all(pack, chunks)
    # three fit in 1,000 bytes; a chunk longer than a segment gets one of its own; the next starts another
    assert [tuple(s) for s in slots] == [(0, 0), (0, 300), (0, 600), (1, 0), (2, 0), (3, 0), (3, 10), (4, 0)]
    files = pack.close()
    assert [f.size for f in files] == [900, 300, 2500, 10, 991]
    _check_round_trip(target, files, chunks, slots)


def test_abort_removes_everything_it_wrote(target: Location) -> None:
    other = open_pack(target, 4)  # another rank's pack stays
    other.write(*other.reserve(5), b"other")
    assert other.close() == [PackFile("packs/r000004-000.pack", 5, 4)]
    pack = open_pack(target, 3, segment_bytes=100)
    _write_all(pack, [b"x" * 80] * 5)
    assert len(_stored(target)) > 2  # (on object storage the full segments were PUT already)
    pack.abort()
    assert _stored(target) == ["packs/r000004-000.pack"]
    other.abort()  # after close too: the save failed elsewhere
    assert _stored(target) == []
    with pytest.raises(ValueError, match="pack is aborted"):
        other.reserve(1)


def test_writes_must_match_their_reservations(target: Location) -> None:
    pack = open_pack(target, 0)
    slot = pack.reserve(4)
    with pytest.raises(ValueError, match=r"reserved for 4 bytes, not 3"):
        pack.write(*slot, b"abc")
    with pytest.raises(ValueError, match="was not reserved"):
        pack.write(0, 1, b"abc")
    with pytest.raises(ValueError, match=r"1 reserved range\(s\) not written"):
        pack.close()
    pack.write(*slot, b"abcd")
    with pytest.raises(ValueError, match="written already"):
        pack.write(*slot, b"abcd")
    assert pack.close() == [PackFile("packs/r000000-000.pack", 4, 0)]
    with pytest.raises(ValueError, match="pack is closed"):
        pack.write(*slot, b"abcd")
    pack.abort()


def test_an_empty_pack_writes_nothing(target: Location) -> None:
    assert open_pack(target, 0).close() == []
    assert _stored(target) == []


def _one_pack(target: Location, data: bytes = b"0123456789") -> str:
    pack = open_pack(target, 0)
    pack.write(*pack.reserve(len(data)), data)
    return pack.close()[0].name


def test_a_truncated_or_missing_pack_is_a_damaged_checkpoint(target: Location) -> None:
    name = _one_pack(target)
    assert read_ranges(target, name, [(8, 2), (0, 0)]) == [b"89", b""]
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{target}: pack {name} is shorter than its table says: "
                                                               "bytes [8, 12) are past its end")):
        read_ranges(target, name, [(0, 4), (8, 4)])
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{target}: pack packs/r000009-000.pack is missing")):
        read_ranges(target, "packs/r000009-000.pack", [(0, 1)])
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
    with pytest.raises(StorageError, match=r"packs/r000000-000.pack exists already: two writers of rank 0"):
        open_pack(target, 0).reserve(1)
    assert read_ranges(target, "packs/r000000-000.pack", [(0, 10)]) == [b"0123456789"]


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
    pack = open_pack(durable, 0, segment_bytes=4)
    _write_all(pack, [b"abcd", b"efgh"])
    pack.close()
    assert len(fsyncs) == 3  # its two files and the directory holding them
    fsyncs.clear()
    pack = open_pack(LocalLocation(tmp_path / "fast").without_fsync(), 0, segment_bytes=4)
    _write_all(pack, [b"abcd", b"efgh"])
    assert len(pack.close()) == 2
    assert fsyncs == []


def test_one_object_is_at_most_one_put() -> None:
    target = parse_object_url(f"memory://packs-{uuid.uuid4().hex}/step")
    with pytest.raises(ValueError, match="more than one PUT takes"):
        open_pack(target, 0, segment_bytes=MAX_PUT_BYTES + 1)
    pack = open_pack(target, 0)
    with pytest.raises(StorageError, match="does not fit in one object .* save with smaller chunks"):
        pack.reserve(MAX_PUT_BYTES + 1)  # (nothing is allocated before a write)
    pack.abort()


def test_reads_into_buffers_of_other_types(target: Location) -> None:
    import numpy as np

    values = np.arange(10, dtype=np.float32)
    pack = open_pack(target, 0)
    pack.write(*pack.reserve(values.nbytes), memoryview(values))
    name = pack.close()[0].name
    out = np.zeros(5, dtype=np.float32)
    read_into(target, name, [(20, 20)], [memoryview(out)])
    assert out.tolist() == [5, 6, 7, 8, 9]
    with pytest.raises(ValueError, match="holds 20 bytes, not 8"):
        read_into(target, name, [(0, 8)], [memoryview(out)])


# --- S3 (moto): slow -------------------------------------------------------------------------------------------


def test_s3_threads_segments_and_reads(s3_target: ObjectLocation, s3_proxy: FaultProxy, s3_server: S3Server,
                                       tuned: Callable[..., object]) -> None:
    tuned(object_segment_puts=1)
    chunks = _chunks(120, seed=2)
    s3_proxy.latency_s = 0.02  # PUTs that overlapped would be seen to
    pack = open_pack(s3_target, 3, segment_bytes=200_000)
    slots = _write_all(pack, chunks)
    files = pack.close()
    assert len(files) > 3
    puts = [entry for entry in s3_proxy.log if entry[0] == "PUT"]
    # one PUT each (in the order they were completed: written in shuffled order here)
    assert sorted(p[1].rpartition("/")[2] for p in puts) == [f.name.rpartition("/")[2] for f in files]
    assert s3_proxy.max_in_flight == 1
    s3_proxy.latency_s = 0.0
    _check_round_trip(s3_target, files, chunks, slots)


def test_s3_abort_deletes_its_segments(s3_target: ObjectLocation, s3_server: S3Server) -> None:
    pack = open_pack(s3_target, 0, segment_bytes=100)
    _write_all(pack, [b"x" * 80] * 4)
    pack.abort()
    assert _stored(s3_target) == []


def test_s3_truncated_and_missing_packs(s3_target: ObjectLocation, s3_server: S3Server) -> None:
    name = _one_pack(s3_target)
    s3_server.client.put_object(Bucket=s3_target.bucket, Key=f"run/step/{name}", Body=b"01234")
    with pytest.raises(CorruptCheckpointError, match=rf"pack {name} is shorter than its table says: bytes \[4, 8\)"):
        read_ranges(s3_target, name, [(0, 2), (4, 4)])
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{s3_target}: pack packs/r000001-000.pack is missing")):
        read_ranges(s3_target, "packs/r000001-000.pack", [(0, 1)])
    assert read_ranges(s3_target, name, [(1, 3)]) == [b"123"]


def test_s3_storage_failures_are_storage_errors(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    target = parse_object_url(f"s3://{s3_bucket}/run/step", {"endpoint_url": s3_proxy.endpoint, "max_retries": 1})
    s3_proxy.fail_puts_always = True
    pack = open_pack(target, 0)
    pack.write(*pack.reserve(3), b"abc")
    with pytest.raises(StorageError, match=r"writing rank 0's pack failed: packs/r000000-000.pack"):
        pack.close()
    s3_proxy.clear_faults()
    pack.abort()
    s3_proxy.fail_get_fraction = 1.0
    with pytest.raises(StorageError, match=r"reading bytes \[0, 1\) of packs/r000000-000.pack failed"):
        read_ranges(target, "packs/r000000-000.pack", [(0, 1)])
