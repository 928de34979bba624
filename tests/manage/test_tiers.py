"""Two-tier checkpoints: a ``CheckpointManager`` that saves to local storage and uploads every committed step to a
remote root in the background (``remote=arrayckpt.Remote(...)``), restores from whichever tier holds the newest step
whole, and keeps each tier by its own retention.

What must hold: saves never wait for the remote tier; every upload reads back bit for bit, deltas as deltas with
their bases; a local step is deleted only once its upload committed (unless told otherwise), a remote base never
while a kept remote delta reads through it; transient S3 errors are retried, permanent ones reported (by
``upload_errors()`` and raised once by the next ``save``) and retried later; a process killed mid-upload leaves the
remote step uncommitted and the next manager uploads it again; a full local disk or an unreachable remote corrupts
neither tier. The remote is ``memory://`` where S3 adds nothing, else moto (behind the fault proxy for faults).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from helpers import assert_bit_equal
from s3_server import FaultProxy, S3Server

import arrayckpt
import arrayckpt._manage.copier as copier_module
import arrayckpt._tools.copy_files as copy_files_module
from arrayckpt._manage.tiers import Remote
from arrayckpt._storage import parse_location

pytestmark = pytest.mark.usefixtures("storage_layout")


@pytest.fixture(autouse=True)
def _fast_retries(monkeypatch) -> None:
    """Retries of a failed upload (whole steps, and single files) a few milliseconds apart, not seconds."""
    monkeypatch.setattr(copier_module, "STEP_RETRY_DELAYS", (0.01,))
    monkeypatch.setattr(copy_files_module, "RETRY_DELAYS", (0.01,))


def _memory() -> str:
    return f"memory://tiers-{uuid.uuid4().hex[:12]}/run"


def _state(step: int, size: int = 64) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(size, 8, generator=g), "b": torch.full((8,), float(step)).bfloat16()},
            "step": step}


def _zeros() -> dict:
    return {"model": {"w": torch.zeros(64, 8), "b": torch.zeros(8, dtype=torch.bfloat16)}, "step": -1}


def _same(path: str | Path, state: dict, options: dict | None = None) -> None:
    target = _zeros()
    arrayckpt.load(target, path, storage_options=options)
    assert target["step"] == state["step"]
    for key in ("w", "b"):
        assert_bit_equal(target["model"][key], state["model"][key])
    assert arrayckpt.verify(path, storage_options=options).ok


def test_uploads_run_behind_the_saves_and_each_tier_keeps_what_its_retention_says(tmp_path: Path) -> None:
    remote = _memory()
    manager = arrayckpt.CheckpointManager(
        tmp_path, retention=arrayckpt.Retention(keep_last=2),
        remote=Remote(remote, retention=arrayckpt.Retention(keep_last=3, keep_every=4)))
    for step in range(1, 11):
        manager.save(step, _state(step))
    manager.wait_for_uploads()
    assert manager.tiers() == {4: ("remote",), 8: ("remote",), 9: ("local", "remote"), 10: ("local", "remote")}
    assert manager.steps() == [4, 8, 9, 10] and manager.latest_step() == 10 and manager.upload_errors() == []
    for step in (4, 8, 9, 10):
        _same(manager.remote_path(step), _state(step))
    manager.close()
    manager.close()  # again: nothing to do


def test_saves_never_wait_for_uploads_and_local_steps_stay_until_uploaded(tmp_path: Path, monkeypatch) -> None:
    gate = threading.Event()
    copy = copier_module.copy_checkpoint

    def held(*args, **kwargs):
        assert gate.wait(30), "the gate never opened"
        return copy(*args, **kwargs)

    monkeypatch.setattr(copier_module, "copy_checkpoint", held)
    manager = arrayckpt.CheckpointManager(tmp_path / "kept", retention=arrayckpt.Retention(keep_last=1),
                                          remote=Remote(_memory(), retention=arrayckpt.Retention(keep_last=None)))
    eager = arrayckpt.CheckpointManager(tmp_path / "eager", retention=arrayckpt.Retention(keep_last=1),
                                        remote=Remote(_memory(), keep_until_uploaded=False))
    started = time.monotonic()
    for step in range(1, 6):
        assert manager.save(step, _state(step)) and eager.save(step, _state(step))
    assert time.monotonic() - started < 20  # the uploads are all held: the saves did not wait for them
    assert manager.tiers() == {s: ("local",) for s in range(1, 6)}  # none uploaded: none deleted
    assert list(eager.tiers()) == [5]
    with pytest.raises(TimeoutError, match="uploads still running"):
        manager.wait_for_uploads(timeout=0.1)
    gate.set()
    manager.wait_for_uploads()
    assert manager.tiers() == {**{s: ("remote",) for s in range(1, 5)}, 5: ("local", "remote")}
    eager.close()
    assert eager.tiers()[5] == ("local", "remote")  # the steps deleted before their upload were never uploaded
    manager.close()


def test_deltas_upload_as_deltas_and_remote_bases_stay_while_a_kept_delta_reads_through_them(tmp_path: Path) -> None:
    manager = arrayckpt.CheckpointManager(
        tmp_path, asynchronous=True, retention=arrayckpt.Retention(keep_last=1),
        incremental=arrayckpt.Incremental(max_chain_length=2, max_chain_ratio=100.0),
        remote=Remote(_memory(), retention=arrayckpt.Retention(keep_last=1)))
    state = _state(1)
    for step in range(1, 6):
        state["model"]["w"][step] += 1.0  # one row changes: chunk deltas against the previous step
        state["model"]["b"].fill_(float(step))
        state["step"] = step
        manager.save(step, state)
        expected = {"model": {k: v.clone() for k, v in state["model"].items()}, "step": step}
    manager.wait_for_uploads()
    remote = manager.tiers()
    assert sorted(remote) == [4, 5] and remote[5] == ("local", "remote")  # step 5 is a delta of 4 (chain: 3 full)
    with arrayckpt.open(manager.remote_path(5)) as ckpt:
        assert ckpt.manifest.base.path == "../step-00000004"
        assert [c.step for c in ckpt.chain()] == [5, 4]
    _same(manager.remote_path(5), expected)
    manager.close()


def test_restore_takes_the_newest_step_from_the_local_copy_else_the_remote_one(tmp_path: Path) -> None:
    remote = _memory()
    with arrayckpt.CheckpointManager(tmp_path / "a", retention=arrayckpt.Retention(keep_last=None),
                                     remote=remote) as manager:
        for step in (1, 2):
            manager.save(step, _state(step))
    fresh = arrayckpt.CheckpointManager(tmp_path / "empty", remote=remote)  # a new node: nothing local
    target = _zeros()
    assert fresh.tiers() == {1: ("remote",), 2: ("remote",)}
    assert fresh.restore(target) == 2 and target["step"] == 2
    assert_bit_equal(target["model"]["w"], _state(2)["model"]["w"])
    fresh.save(3, _state(3))  # a full save (no local base), uploaded like any other
    fresh.close()
    assert fresh.tiers()[3] == ("local", "remote")
    step_2 = tmp_path / "a" / "step-00000002"
    chunk = next(iter([*(step_2 / "packs").glob("*.pack"), *(step_2 / "model" / "w").glob("c*")]))  # either layout
    chunk.write_bytes(chunk.read_bytes()[:-1] + bytes([chunk.read_bytes()[-1] ^ 1]))  # damage the local copy
    damaged = arrayckpt.CheckpointManager(tmp_path / "a", remote=remote)
    with pytest.warns(RuntimeWarning, match="restoring step 2 from the remote tier"):
        assert damaged.restore(target, step=2) == 2
    assert_bit_equal(target["model"]["w"], _state(2)["model"]["w"])
    damaged.close()


# --- S3 faults (moto behind the fault proxy) ----------------------------------------------------------------------


def _s3(proxy: FaultProxy | S3Server, bucket: str, **more: object) -> Remote:
    options = {"endpoint_url": proxy.endpoint, "max_retries": 2, **more.pop("options", {})}
    return Remote(f"s3://{bucket}/run", storage_options=options, **more)


@pytest.mark.slow
def test_transient_s3_errors_and_dropped_connections_are_retried(s3_proxy: FaultProxy, s3_bucket: str,
                                                                 tmp_path: Path) -> None:
    s3_proxy.fail_put_fraction = s3_proxy.fail_get_fraction = s3_proxy.fail_list_fraction = 0.2
    s3_proxy.drop_fraction = {"PUT": 0.1}
    remote = _s3(s3_proxy, s3_bucket, retention=arrayckpt.Retention(keep_last=2))
    with arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=1), remote=remote) as manager:
        for step in range(1, 4):
            manager.save(step, _state(step))
    assert s3_proxy.injected["PUT"] > 0 and manager.upload_errors() == []
    s3_proxy.clear_faults()
    assert manager.tiers() == {2: ("remote",), 3: ("local", "remote")}
    for step in (2, 3):
        _same(manager.remote_path(step), _state(step), remote.storage_options)


@pytest.mark.slow
def test_permanent_errors_are_reported_raised_once_and_retried_later(s3_proxy: FaultProxy, s3_bucket: str,
                                                                    tmp_path: Path) -> None:
    remote = _s3(s3_proxy, s3_bucket, retention=arrayckpt.Retention(keep_last=None))
    manager = arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=1), remote=remote)
    manager.save(1, _state(1))
    manager.wait_for_uploads()
    s3_proxy.fail_puts_always, s3_proxy.permanent_error = True, "AccessDenied"
    manager.save(2, _state(2))
    deadline = time.monotonic() + 30
    while not manager.upload_errors() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [step for step, _ in manager.upload_errors()] == [2]
    assert "PERMISSION_DENIED" in str(manager.upload_errors()[0][1])
    with pytest.raises(arrayckpt.StorageError, match=r"uploading step\(s\) 2 to the remote tier failed"):
        manager.save(3, _state(3))  # saved locally all the same, then the failure is raised (once)
    with pytest.raises(arrayckpt.StorageError, match="failed"):
        manager.wait_for_uploads()  # tried again: still refused
    assert manager.tiers() == {1: ("remote",), 2: ("local",), 3: ("local",)}  # not uploaded: not deleted
    s3_proxy.clear_faults()
    manager.save(4, _state(4))  # the failures were raised already: not again (and now the retries succeed)
    manager.wait_for_uploads()
    assert manager.upload_errors() == [] and manager.tiers()[4] == ("local", "remote")
    assert [s for s, where in manager.tiers().items() if "local" in where] == [4]
    _same(manager.remote_path(3), _state(3), remote.storage_options)
    manager.close()


def test_an_unreachable_remote_corrupts_nothing(tmp_path: Path) -> None:
    with socket_closed() as port:
        remote = Remote("s3://bucket/run", storage_options={"endpoint_url": f"http://127.0.0.1:{port}",
                                                            "max_retries": 0}, retention=arrayckpt.Retention())
        manager = arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=1), remote=remote)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the uploader warns that it cannot list the remote
            manager.save(1, _state(1))
            with pytest.raises(arrayckpt.StorageError, match="uploading step"):
                manager.wait_for_uploads()
            try:  # the local save is made; an upload that failed meanwhile (here at once) is raised after it
                manager.save(2, _state(2))
            except arrayckpt.StorageError as e:
                assert "uploading step" in str(e) and "tried again with the next save" in str(e)
        assert [p.name for p in sorted(tmp_path.iterdir())] == [".arrayckpt-manager.lock", "step-00000001",
                                                                "step-00000002"]  # (the lock: the manager is open)
        target = _zeros()
        with pytest.warns(RuntimeWarning, match="cannot be listed"):
            assert manager.restore(target) == 2
        _same(tmp_path / "step-00000002", _state(2))
        with pytest.raises(arrayckpt.StorageError):
            manager.close()


class socket_closed:
    """A local port nothing listens on (bound, then closed)."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        pass


_UPLOADER_CHILD = textwrap.dedent("""
    import sys, time, torch, arrayckpt
    from arrayckpt._manage.tiers import Remote
    local, url, endpoint = sys.argv[1:4]
    remote = Remote(url, storage_options={"endpoint_url": endpoint}, max_bytes_per_second=256 << 10)
    manager = arrayckpt.CheckpointManager(local, remote=remote)
    manager.save(1, {f"t{i}": torch.full((32 << 10,), float(i)) for i in range(12)})  # 12 files of 128 KiB: ~6 s
    print("saved", flush=True)
    time.sleep(120)
""")


@pytest.mark.slow
def test_a_kill_during_an_upload_leaves_the_remote_step_uncommitted_and_the_next_manager_uploads_it(
        s3_server: S3Server, s3_bucket: str, tmp_path: Path, storage_layout: str) -> None:
    url, options = f"s3://{s3_bucket}/run", {"endpoint_url": s3_server.endpoint}
    # killed once the upload has begun: files, with a chunk object written; packed, while its one pack is being read
    # (paced): the pack lands whole, and the index and root right after it
    begun = 1 if storage_layout == "packed" else 2
    child = subprocess.Popen([sys.executable, "-c", _UPLOADER_CHILD, str(tmp_path), url, s3_server.endpoint],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, **s3_server.env})
    try:
        assert child.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            keys = s3_server.list_keys(s3_bucket, "run/step-00000001/")
            if sum(not k.endswith("zarr.json") for k in keys) >= begun:
                break
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert "run/step-00000001/zarr.json" not in s3_server.list_keys(s3_bucket, "run/")
    assert arrayckpt.CheckpointManager(tmp_path).tiers() == {1: ("local",)}
    with arrayckpt.CheckpointManager(tmp_path, remote=Remote(url, storage_options=options)) as manager:
        manager.wait_for_uploads(timeout=60)  # it found step 1 missing remotely and uploaded it again
        assert manager.tiers() == {1: ("local", "remote")}
    with arrayckpt.open(f"{url}/step-00000001", storage_options=options) as ckpt:
        assert all(torch.equal(ckpt[f"t{i}"].torch(), torch.full((32 << 10,), float(i))) for i in range(12))
    assert arrayckpt.verify(f"{url}/step-00000001", storage_options=options).ok


def test_a_full_local_disk_fails_the_save_and_corrupts_neither_tier(small_disk: Path) -> None:
    remote = _memory()
    manager = arrayckpt.CheckpointManager(small_disk, retention=arrayckpt.Retention(keep_last=2), remote=remote)
    for step in (1, 2):
        manager.save(step, _state(step))
    with pytest.raises(arrayckpt.StorageError, match="step-00000003"):
        manager.save(3, {"model": {"w": torch.randn(2, 1 << 20)}, "step": 3})  # 8 MiB on a 4 MiB disk
    manager.wait_for_uploads()
    assert manager.tiers() == {1: ("local", "remote"), 2: ("local", "remote")}
    for step in (1, 2):
        _same(manager.path(step), _state(step))
        _same(manager.remote_path(step), _state(step))
    manager.close()


def test_clean_up_removes_an_abandoned_remote_upload_but_not_one_of_a_local_step(tmp_path: Path) -> None:
    remote = _memory()
    with arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=None), remote=remote) as m:
        for step in (1, 2, 3):
            m.save(step, _state(step))
    root = parse_location(remote)
    for step in (1, 2):  # uploads cut short: the root document never written (step 2 is still a local step)
        root.child(f"step-0000000{step}").delete_objects(["zarr.json"])
    (tmp_path / "step-00000001").rename(tmp_path / "elsewhere")
    manager = arrayckpt.CheckpointManager(tmp_path, retention=arrayckpt.Retention(keep_last=None), remote=remote)
    manager.wait_for_uploads()  # step 2 is uploaded again; step 1 is not local any more
    removed = manager.clean_up(min_age_s=0)
    assert removed == [f"{remote}/step-00000001"]
    assert manager.tiers() == {2: ("local", "remote"), 3: ("local", "remote")}
    manager.close()
