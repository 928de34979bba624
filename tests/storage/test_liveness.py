"""Live saves and live managers are recognised, and what they hold is never removed or interleaved (spec §9.4).

- gc and ``clean_up`` never remove a save's temporary directory (local: its ``flock``) or the prefix of a first save
  on object storage (its lease), whatever the minimum age; a save whose files were removed anyway (something that
  ignored the lock) is not committed: the commit checks every chunk the manifest stores, and the temporary
  directory's identity;
- gc never removes committed checkpoints lying below a prefix it looks at (a manager's root under the gc root);
- one ``CheckpointManager`` per root: a second is warned at construction and its saves and clean-ups are refused
  (``CheckpointBusyError``) while the first holds the root; a crashed holder never blocks the next one (its flock
  is gone; its lease is taken over at once from a dead process of the same host, else once it expires);
- ``restore`` never writes part of a damaged step into the state, and falls back to the newest step that reads
  whole, naming the damaged one (with several ranks, all of them agree on the step);
- a two-tier manager whose remote bucket does not exist fails at construction, not after its saves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from helpers import FILES_LAYOUT_ONLY, assert_bit_equal
from s3_server import S3Server

import arrayckpt
import arrayckpt._storage.liveness as liveness
from arrayckpt._layout.chunking import ChunkPolicy
from arrayckpt._storage import ObjectLocation, parse_location
from arrayckpt._storage.liveness import Holder
from arrayckpt._write.options import SaveOptions, SaveSetup
from arrayckpt._write.save import save_with
from arrayckpt._write.transaction import WriteTransaction

pytestmark = pytest.mark.usefixtures("storage_layout")

SMALL = ChunkPolicy(inner_chunk_bytes=64, outer_chunk_bytes=256)  # several chunk files per tensor


def _state(i: int) -> dict:
    return {"a": torch.full((64,), float(i)), "b": torch.full((8, 16), float(i)), "c": torch.arange(40) + i, "i": i}


def _check(path: object, i: int, options: dict | None = None) -> None:
    ckpt = arrayckpt.open(path, storage_options=options)
    expected = _state(i)
    for key in ("a", "b", "c"):
        assert_bit_equal(ckpt[key].torch(), expected[key])
    assert ckpt.plain_values["i"] == i
    assert arrayckpt.verify(path, storage_options=options).ok


@pytest.fixture
def during_commit(monkeypatch):
    """``hook(fn)``: the next commits call ``fn(transaction)`` first (every rank has written and reported)."""
    original = WriteTransaction.commit

    def install(fn):
        def commit(self, manifest, consolidated_json):
            self._wait_for_documents()  # (the coordinator's document writes end first: fn may remove the directory)
            fn(self)
            original(self, manifest, consolidated_json)

        monkeypatch.setattr(WriteTransaction, "commit", commit)

    return install


# --- gc and clean_up beside saves -----------------------------------------------------------------------------

_GC_LOOP = textwrap.dedent("""
    import sys, arrayckpt
    print("ready", flush=True)
    while True:
        arrayckpt.gc(sys.argv[1], min_age_s=0)
""")


@pytest.mark.slow
def test_gc_looping_beside_saves_removes_nothing_they_hold(tmp_path: Path) -> None:
    """The campaign's race in small: gc with no minimum age in a loop in another process, 30 saves (overwriting 3
    paths) beside it. Before: gc emptied the saves' temporary directories and some of them committed without their
    chunks (289 of ~1,600 in the campaign)."""
    root = tmp_path / "run"
    root.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _GC_LOOP, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        for i in range(30):
            save_with(_state(i), root / f"s{i % 3}", SaveOptions(overwrite=True), SaveSetup(chunking=SMALL))
            _check(root / f"s{i % 3}", i)
    finally:
        child.kill()
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    assert sorted(p.name for p in root.iterdir()) == ["s0", "s1", "s2"]


def test_a_live_saves_temporary_directory_is_kept_and_removed_files_are_never_committed(
        tmp_path: Path, during_commit, storage_layout: str) -> None:
    root = tmp_path / "run"
    seen: list = []

    def gc_now(transaction):
        seen.append(arrayckpt.gc(root, min_age_s=0))
        seen.append(parse_location(root).leftovers(0).kept)

    during_commit(gc_now)
    save_with(_state(1), root / "s", SaveOptions(), SaveSetup(chunking=SMALL))
    assert seen[0] == [] and len(seen[1]) == 1 and "a save is running in it" in seen[1][0][1]
    _check(root / "s", 1)

    def remove_a_chunk(transaction):  # what a gc that ignores the lock (or a person) does (packed: a rank's pack)
        packs = sorted((transaction.target.path / "packs").glob("*.pack"))
        (packs[0] if packs else transaction.target.path / "b" / "c.1.0").unlink()

    during_commit(remove_a_chunk)
    gone = r"packs/.*\.pack" if storage_layout == "packed" else r"b/c\.1"
    with pytest.raises(arrayckpt.StorageError, match=r"not committed: 1 file\(s\) this save wrote are gone .*" + gone):
        save_with(_state(2), root / "s", SaveOptions(overwrite=True), SaveSetup(chunking=SMALL))
    _check(root / "s", 1)  # the old one stays

    def replace_the_directory(transaction):  # removed and made again under its name: another directory
        temp = transaction.target.path
        shutil.rmtree(temp)
        temp.mkdir()

    during_commit(replace_the_directory)
    with pytest.raises(arrayckpt.StorageError, match="not committed"):
        save_with(_state(3), root / "t", SaveOptions(), SaveSetup(chunking=SMALL))
    assert sorted(p.name for p in root.iterdir()) == ["s"]  # nothing committed at t, nothing left beside


def test_clean_up_beside_an_asynchronous_save_of_its_manager(tmp_path: Path) -> None:
    manager = arrayckpt.CheckpointManager(tmp_path, asynchronous=True, retention=arrayckpt.Retention(keep_last=None))
    for step in range(1, 6):
        manager.save(step, _state(step))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (nor something to warn about)
            assert manager.clean_up(min_age_s=0) == []  # the save in flight is not a leftover
    manager.close()
    for step in range(1, 6):
        _check(manager.path(step), step)


def test_a_save_directory_appears_locked_and_one_left_unlocked_while_created_is_removed_later(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save's temporary directory is made under a name of its own, locked, then renamed: no gc sees it unlocked
    (a clean-up racing the save's start once removed it, and the save had to start over). One left behind by a
    process that died between the mkdir and the rename is kept while young, removed once 60 s old."""
    seen: list[tuple[str, str | None]] = []
    hold = liveness.hold_directory

    def look_first(path: Path):  # what a gc would find right before the save locks its new directory
        with liveness.exclusive_directory(path) as busy:
            seen.append((path.name, busy))
        return hold(path)

    monkeypatch.setattr(liveness, "hold_directory", look_first)
    arrayckpt.save(_state(1), tmp_path / "step-1")
    assert len(seen) == 1 and ".step-1.arrayckpt-tmp-new-" in seen[0][0] and seen[0][1] is None
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step-1"]
    _check(tmp_path / "step-1", 1)
    leaked = tmp_path / ".step-2.arrayckpt-tmp-new-0123456789ab"
    leaked.mkdir()
    assert arrayckpt.gc(tmp_path, min_age_s=0) == []  # young: maybe a save about to lock it
    kept = parse_location(tmp_path).leftovers(0).kept
    assert len(kept) == 1 and "maybe still being saved: just created, not locked yet" in kept[0][1]
    old = time.time() - 61
    os.utime(leaked, (old, old))
    assert arrayckpt.gc(tmp_path, min_age_s=0) == [leaked] and not leaked.exists()


@pytest.fixture(params=["memory", "s3"])
def object_root(request: pytest.FixtureRequest) -> tuple[str, dict | None]:
    if request.param == "memory":
        return f"memory://live-{uuid.uuid4().hex[:12]}/run", None
    server, bucket = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run", {"endpoint_url": server.endpoint}


def test_a_first_save_on_object_storage_holds_a_lease_that_gc_respects(object_root, during_commit,
                                                                      storage_layout: str) -> None:
    root, options = object_root
    seen: list = []

    def gc_now(transaction):
        seen.append(arrayckpt.gc(root, min_age_s=0, storage_options=options))
        seen.append(parse_location(root, options).leftovers(0).kept)

    during_commit(gc_now)
    save_with(_state(1), f"{root}/s", SaveOptions(storage_options=options), SaveSetup(chunking=SMALL))
    assert seen[0] == [] and len(seen[1]) == 1 and "a save is running in it (its lease" in seen[1][0][1]
    _check(f"{root}/s", 1, options)
    assert ".arrayckpt-lease" not in parse_location(f"{root}/s", options).object_keys()  # released at the commit

    def remove_a_chunk(transaction):  # packed: the index (the commit reads it back; packs were whole when uploaded)
        index = [key for key in transaction.target.object_keys() if key.endswith("-index.bin")]
        transaction.target.delete_objects(index or ["b/c.1.0"])

    during_commit(remove_a_chunk)
    gone = r"packs/.*-index\.bin" if storage_layout == "packed" else r"b/c\.1\.0"
    with pytest.raises(arrayckpt.StorageError, match=r"not committed: 1 file\(s\) .*" + gone):
        save_with(_state(2), f"{root}/t", SaveOptions(storage_options=options), SaveSetup(chunking=SMALL))
    assert parse_location(f"{root}/t", options).object_keys() == []  # aborted: nothing left, the lease neither


def test_gc_never_removes_committed_checkpoints_below_the_prefixes_it_looks_at() -> None:
    """Before: ``gc`` of the prefix above a manager's root took the root for an incomplete checkpoint (no root
    document of its own, arrayckpt's objects below) and deleted every step."""
    above = f"memory://live-{uuid.uuid4().hex[:12]}/q"
    with arrayckpt.CheckpointManager(f"{above}/run") as manager:
        manager.save(1, _state(1))
    assert arrayckpt.gc(above, min_age_s=0) == []
    (path, why), = parse_location(above).leftovers(0).kept
    assert path == f"{above}/run" and ("committed checkpoint" in why or "not arrayckpt's" in why)
    _check(f"{above}/run/step-00000001", 1)


# --- one manager per root ----------------------------------------------------------------------------------------


def test_a_second_manager_on_a_held_root_is_warned_and_its_saves_are_refused(tmp_path: Path) -> None:
    first = arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=None))
    first.save(1, _state(1))
    with pytest.warns(RuntimeWarning, match=rf"another CheckpointManager holds this root \(pid {os.getpid()} on host"):
        second = arrayckpt.CheckpointManager(tmp_path)
    target = _state(0)
    assert second.restore(target) == 1  # reading is fine
    with pytest.raises(arrayckpt.CheckpointBusyError, match="another CheckpointManager holds this root"):
        second.save(2, _state(2))
    with pytest.raises(arrayckpt.CheckpointBusyError):
        second.clean_up()
    first.save(2, _state(2))  # the holder goes on undisturbed
    assert first.steps() == [1, 2] and not list(tmp_path.glob(".*arrayckpt-tmp*"))
    first.close()
    second.save(3, _state(3))  # free now: taken at its next save
    assert second.steps() == [1, 2, 3]
    second.close()
    assert not (tmp_path / ".arrayckpt-manager.lock").exists()  # closed: the lock file is gone too
    for step in (1, 2, 3):
        _check(tmp_path / f"step-{step:08d}", step)


_HOLDER = textwrap.dedent("""
    import os, sys, time, torch
    os.environ["ARRAYCKPT_LEASE_RENEW_S"] = sys.argv[3]  # read when arrayckpt first needs it
    import arrayckpt
    managers = [arrayckpt.CheckpointManager(sys.argv[1]),
                arrayckpt.CheckpointManager(sys.argv[2], storage_options={"endpoint_url": sys.argv[4]})]
    for manager in managers:
        manager.save(1, {"w": torch.ones(4)})
    print("holding", flush=True)
    time.sleep(120)
""")


@pytest.mark.slow
def test_a_live_holder_in_another_process_is_refused_and_a_crashed_one_never_blocks(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path, monkeypatch, tuned) -> None:
    """Another process holds a local root (flock) and an S3 root (a lease renewed every 0.2 s): a manager here is
    warned, and its saves refused (on S3 after it saw the lease renewed). Then that process is killed: a new manager
    takes both roots at once, without a warning (the flock died with it; the lease's holder is a dead process of this
    host)."""
    tuned(lease_renew_s=0.2)
    tuned(lease_ttl_s=30.0)
    local, remote, options = tmp_path / "run", f"s3://{s3_bucket}/run", {"endpoint_url": s3_server.endpoint}
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(local), remote, "0.2", s3_server.endpoint],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, **s3_server.env})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "holding"
        for root, storage in ((local, None), (remote, options)):
            with pytest.warns(RuntimeWarning, match=rf"another CheckpointManager holds this root \(pid {child.pid}"):
                manager = arrayckpt.CheckpointManager(root, storage_options=storage)
            with pytest.raises(arrayckpt.CheckpointBusyError, match=f"pid {child.pid}"):
                manager.save(2, _state(2))
            manager.close()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()
    for root, storage in ((local, None), (remote, options)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            manager = arrayckpt.CheckpointManager(root, storage_options=storage)
            manager.save(2, _state(2))
        assert manager.steps() == [1, 2]
        manager.close()
        _check(manager.path(2), 2, storage)


@pytest.mark.slow
def test_a_lease_of_another_host_is_waited_out_when_it_is_not_renewed(object_root, monkeypatch, tuned) -> None:
    """A lease left by a crashed job on another host (not renewed, expiring in 1.5 s): the manager is warned at
    construction; its first save waits for the lease to expire, then takes the root and saves."""
    root, options = object_root
    tuned(lease_renew_s=0.2)
    location = parse_location(root, options)
    assert isinstance(location, ObjectLocation)
    stale = Holder("elsewhere", 1, time.time() - 100, "x" * 32, time.time() + 1.5)
    location.open_store().write(liveness.MANAGER_LEASE, stale.encode()).result()
    with pytest.warns(RuntimeWarning, match="host 'elsewhere'"):
        manager = arrayckpt.CheckpointManager(root, storage_options=options)
    manager.save(1, _state(1))
    assert Holder.decode(location.read_objects([liveness.MANAGER_LEASE])[liveness.MANAGER_LEASE]).pid == os.getpid()
    manager.close()
    assert liveness.MANAGER_LEASE not in location.object_keys()  # released
    _check(manager.path(1), 1, options)


# --- restore ---------------------------------------------------------------------------------------------------


def _same_state(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_bit_equal(got[key], value)
        else:
            assert got[key] == value


def _flip_object(server: S3Server, bucket: str, key: str) -> None:
    data = bytearray(server.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    server.client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


@FILES_LAYOUT_ONLY  # damages a chunk file
def test_restore_skips_a_damaged_newest_remote_step_and_never_writes_part_of_it(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    """The local tier is gone and the newest remote step is damaged (one flipped byte in a chunk of "b"): restore
    warns naming it and restores the step before, whole; when every step is damaged it raises and the state is
    exactly as it was. Before: it raised after it had written part of the damaged step into the state."""
    options = {"endpoint_url": s3_server.endpoint}
    remote = arrayckpt.Remote(f"s3://{s3_bucket}/run", storage_options=options,
                              retention=arrayckpt.Retention(keep_last=None))
    with arrayckpt.CheckpointManager(tmp_path / "local", remote=remote,
                                     retention=arrayckpt.Retention(keep_last=None)) as manager:
        for step in (1, 2):
            manager.save(step, _state(step))
    shutil.rmtree(tmp_path / "local")
    chunks = [key for key in s3_server.list_keys(s3_bucket) if "/b/c" in key]
    _flip_object(s3_server, s3_bucket, next(k for k in chunks if "step-00000002" in k))

    fresh = arrayckpt.CheckpointManager(tmp_path / "local", remote=remote)
    target = _state(-1)
    with pytest.warns(RuntimeWarning, match=r"step-00000002: step 2 cannot be restored .*restoring step 1"):
        assert fresh.restore(target) == 1
    _same_state(target, _state(1))

    _flip_object(s3_server, s3_bucket, next(k for k in chunks if "step-00000001" in k))
    target = _state(-1)
    with pytest.warns(RuntimeWarning, match="step 2 cannot be restored"), \
            pytest.raises(arrayckpt.CorruptCheckpointError, match=r"step-00000002.*'b'"):
        fresh.restore(target)
    _same_state(target, _state(-1))  # untouched
    fresh.close()


def test_a_missing_remote_bucket_fails_at_construction_and_an_unreachable_one_is_warned_about(
        s3_server: S3Server, tmp_path: Path) -> None:
    """Before: nothing at construction, ``restore()`` found nothing, six saves passed, and ``close()`` raised after
    79 s of retries."""
    missing = arrayckpt.Remote(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run",
                               storage_options={"endpoint_url": s3_server.endpoint})
    with pytest.raises(arrayckpt.StorageError, match=r"the remote tier cannot be used: .*NoSuchBucket"):
        arrayckpt.CheckpointManager(tmp_path, remote=missing)
    with arrayckpt.CheckpointManager(tmp_path) as manager:  # the local root was let go
        manager.save(1, _state(1))
    with socket_closed_port() as port:
        unreachable = arrayckpt.Remote("s3://bucket/run", storage_options={"endpoint_url": f"http://127.0.0.1:{port}",
                                                                          "max_retries": 0})
        with pytest.warns(RuntimeWarning, match="the remote tier cannot be reached now"):
            manager = arrayckpt.CheckpointManager(tmp_path, remote=unreachable)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with pytest.raises(arrayckpt.StorageError, match="uploading step"):
                manager.close()


class socket_closed_port:
    """A local port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        pass


# --- several ranks ------------------------------------------------------------------------------------------------


def _two_ranks(rank: int, world: int, root: str) -> tuple[int, int | None, list[str]]:
    """A 2-rank manager: only the coordinator holds the root; both ranks restore the same step when a chunk that
    only rank 1 reads is damaged in the newest one."""
    import torch.distributed as dist

    from arrayckpt._errors import CheckpointBusyError

    def state(step: int) -> dict:
        rows = torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + step
        return {"w": arrayckpt.Shard(rows[rank * 4:(rank + 1) * 4].clone(), (8, 4), (rank * 4, 0)), "step": step}

    manager = arrayckpt.CheckpointManager(root, retention=arrayckpt.Retention(keep_last=None))
    for step in (1, 2):
        manager.save(step, state(step))
    busy = 0
    if rank == 1:  # the root is held by rank 0's manager: a claim from here is refused
        try:
            parse_location(root).claim()
        except CheckpointBusyError:
            busy = 1
    dist.barrier()
    if rank == 0:
        chunk = sorted(Path(root, "step-00000002", "w").glob("c.1*"))[0]  # rows 4..7: rank 1's
        data = bytearray(chunk.read_bytes())
        data[8] ^= 0x01
        chunk.write_bytes(bytes(data))
    dist.barrier()
    target = state(-1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = manager.restore(target)
    expected = state(1)
    assert torch.equal(target["w"].tensor, expected["w"].tensor) and target["step"] == 1
    manager.close()
    return busy, restored, [str(w.message) for w in caught]


@pytest.mark.slow
@FILES_LAYOUT_ONLY  # damages a chunk file
def test_a_multi_rank_manager_holds_its_root_on_the_coordinator_and_restores_one_step_on_every_rank(
        tmp_path: Path) -> None:
    from dist_helpers import run_ranks

    (busy0, step0, warned0), (busy1, step1, warned1) = run_ranks(2, _two_ranks, str(tmp_path / "run"))
    assert busy1 == 1 and step0 == step1 == 1
    assert any("step 2 cannot be restored" in w and "rank 1" in w for w in warned0)  # the coordinator says why
    assert any("step 2 cannot be restored" in w for w in warned1)
