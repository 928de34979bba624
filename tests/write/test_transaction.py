"""The one write transaction every writer uses, the format-version rule, and the chunk policy as an input."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest
import torch
from policies import small_chunks

import arrayckpt
from arrayckpt._errors import StorageError
from arrayckpt._format.manifest import FILES_VERSION, Manifest
from arrayckpt._layout.box import Box
from arrayckpt._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from arrayckpt._layout.plancache import PlanCache
from arrayckpt._layout.saveplan import ArrayDescription, LocalDescription
from arrayckpt._storage import parse_location
from arrayckpt._write.transaction import WriteTransaction, begin_write


class FakeWriter:
    """A storage writer that records what is done to it; its documents finish only when ``release`` is set."""

    def __init__(self, commit_error: BaseException | None = None) -> None:
        self.location = self.target = "fake://ckpt"
        self.key_encoding = "default"
        self.calls: list[str] = []
        self.release = threading.Event()
        self.commit_error = commit_error

    def write_documents(self, documents: dict) -> object:
        self.calls.append("documents")

        def wait() -> None:
            assert self.release.wait(5)
            self.calls.append("documents written")

        return wait

    def missing(self, chunks: dict) -> list[str]:  # everything the save wrote is there
        return []

    def commit(self, root_document: bytes) -> None:
        self.calls.append("commit")
        if self.commit_error is not None:
            raise self.commit_error

    def abort(self) -> None:
        self.calls.append("abort")


def _manifest() -> Manifest:
    return Manifest({})


def test_a_failing_body_aborts_after_the_documents_are_written() -> None:
    writer = FakeWriter()
    threading.Timer(0.05, writer.release.set).start()
    with pytest.raises(ValueError, match="boom"), WriteTransaction(writer) as transaction:  # type: ignore[arg-type]
        transaction.write_documents({"w": b"{}"})
        raise ValueError("boom")
    assert writer.calls == ["documents", "documents written", "abort"]
    transaction.abort()  # once is enough
    assert writer.calls.count("abort") == 1


def test_a_body_that_does_not_commit_is_undone_and_a_committed_one_is_not() -> None:
    forgot = FakeWriter()
    with WriteTransaction(forgot):  # type: ignore[arg-type]
        pass
    assert forgot.calls == ["abort"]
    done = FakeWriter()
    done.release.set()
    with WriteTransaction(done) as transaction:  # type: ignore[arg-type]
        transaction.write_documents({})
        transaction.commit(_manifest(), "{}")
    transaction.abort()
    assert done.calls == ["documents", "documents written", "commit"]


def test_a_failed_commit_is_a_storage_error_and_is_undone() -> None:
    writer = FakeWriter(commit_error=PermissionError("read-only"))
    writer.release.set()
    with pytest.raises(StorageError, match="fake://ckpt: commit failed: read-only"):
        with WriteTransaction(writer) as transaction:  # type: ignore[arg-type]
            transaction.write_documents({})
            transaction.commit(_manifest(), "{}")
    assert writer.calls == ["documents", "documents written", "commit", "abort"]


def test_an_interrupted_commit_removes_nothing() -> None:
    """Whether an interrupted commit took effect is unknown: removing the save could damage a committed one."""
    writer = FakeWriter(commit_error=KeyboardInterrupt())
    writer.release.set()
    with pytest.raises(KeyboardInterrupt), WriteTransaction(writer) as transaction:  # type: ignore[arg-type]
        transaction.commit(_manifest(), "{}")
    assert writer.calls == ["commit"]


def test_begin_write_refuses_a_committed_checkpoint_and_leaves_nothing(tmp_path: Path) -> None:
    arrayckpt.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.CheckpointExistsError, match="overwrite=True"):
        begin_write(parse_location(tmp_path / "ckpt"), False)
    with begin_write(parse_location(tmp_path / "ckpt"), True) as transaction:
        assert transaction.target != transaction.location  # a temporary directory beside it
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # not committed: removed
    assert torch.equal(arrayckpt.open(tmp_path / "ckpt")["w"].torch(), torch.ones(2))


def test_every_new_checkpoint_records_the_version_that_requires_its_checksums(tmp_path) -> None:
    """Version 3 makes the root checksum and the chunk digests required, so their removal is itself damage: every
    save, full or delta, local or on object storage, records it."""
    arrayckpt.save({"w": torch.ones(3)}, tmp_path / "a")
    arrayckpt.save({"w": torch.zeros(3)}, tmp_path / "b", base=tmp_path / "a")
    url = f"memory://tx/{uuid.uuid4().hex}"
    arrayckpt.save({"w": torch.ones(3)}, url)
    arrayckpt.save({"w": torch.ones(3)}, url, overwrite=True)  # the v2 chunk key encoding
    for where in (tmp_path / "a", tmp_path / "b", url):
        manifest = arrayckpt.open(where).manifest
        assert manifest.format_version == FILES_VERSION == 3 and manifest.integrity is not None
        assert set(manifest.chunk_digests) == {"w"}


def test_a_chunk_policy_is_checked_and_part_of_the_plan() -> None:
    with pytest.raises(ValueError, match="inner_chunk_bytes must be a positive int, got 0"):
        ChunkPolicy(inner_chunk_bytes=0)
    described = [LocalDescription(arrays=(ArrayDescription("w", ("w",), "tensor", "float32", (64, 16),
                                                           Box((0, 0), (64, 16)), 0),))]
    cache = PlanCache()
    default = cache.plan_save(described, None)
    assert cache.plan_save(described, None, DEFAULT_CHUNKING).arrays is default.arrays  # the same input: reused
    small = cache.plan_save(described, None, small_chunks(256, 1024).policy)
    assert (small.arrays["w"].outer_chunk, small.arrays["w"].inner_chunk) == ((16, 16), (4, 16))
    assert default.arrays["w"].outer_chunk == (64, 16)
    assert cache.plan_save(described, None).arrays is not default.arrays  # the policy changed in between: anew


def test_durable_false_skips_the_fsync_and_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save fsyncs its directory and the parent (after the rename) before it returns; ``durable=False`` (save,
    async_save, a manager) skips both, and commits the same checkpoint."""
    import arrayckpt._storage.local as local

    synced: list[str] = []
    monkeypatch.setattr(local, "make_durable", lambda root: synced.append(f"data {Path(root).name[:1]}"))
    monkeypatch.setattr(local, "fsync_dir", lambda directory: synced.append("parent"))
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}
    arrayckpt.save(state, tmp_path / "durable", step=3)
    assert synced == ["data .", "parent"]  # the temporary directory's data, then the rename
    synced.clear()
    arrayckpt.save(state, tmp_path / "fast", step=3, durable=False)
    arrayckpt.async_save(state, tmp_path / "fast-async", durable=False).wait()
    with arrayckpt.CheckpointManager(tmp_path / "run", durable=False) as manager:
        manager.save(1, state)
        manager.save(2, state)  # replaces nothing, but retention and the root's lock run as usual
    assert synced == []
    for name in ("fast", "fast-async", "run/step-00000002"):
        with arrayckpt.open(tmp_path / name) as checkpoint:
            assert torch.equal(torch.from_numpy(checkpoint["w"][:]), state["w"])
    arrayckpt.save({"w": torch.ones(2)}, tmp_path / "fast", overwrite=True, durable=False)  # the exchange path too
    assert synced == [] and arrayckpt.open(tmp_path / "fast")["w"][:].tolist() == [1.0, 1.0]


@pytest.mark.parametrize("files", [3, 40])
def test_make_durable_fsyncs_every_file_and_every_directory(tmp_path, monkeypatch, files):
    """A local save's sync to disk is an fsync of what it wrote (not a filesystem-wide syncfs, which waits for every
    other writer there): every file and every directory below the root, each once."""
    from arrayckpt._storage import renames

    for i in range(files):
        folder = tmp_path / f"a{i % 3}" / "c"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"f{i}").write_bytes(b"x" * i)
    synced: list[str] = []
    real = renames._fsync_path
    monkeypatch.setattr(renames, "_fsync_path", lambda path: (synced.append(path), real(path))[1])
    renames.make_durable(tmp_path)
    every_file = {str(p) for p in tmp_path.rglob("*") if p.is_file()}
    every_directory = {str(p) for p in tmp_path.rglob("*") if p.is_dir()} | {str(tmp_path)}
    assert set(synced) == every_file | every_directory and len(synced) == len(set(synced))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a tmpfs at /dev/shm")
def test_make_durable_skips_a_memory_filesystem(monkeypatch):
    """tmpfs keeps nothing through a power loss and its fsync does nothing: walking thousands of files there would
    cost a save ~0.1 s for nothing."""
    import tempfile

    from arrayckpt._storage import renames

    synced: list[str] = []
    monkeypatch.setattr(renames, "_fsync_path", synced.append)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as directory:
        (Path(directory) / "f").write_bytes(b"x")
        assert renames._memory_backed(Path(directory))
        renames.make_durable(Path(directory))
    assert synced == []


def test_make_durable_skips_files_removed_while_it_runs(tmp_path):
    """Ranks share the temporary directory: another rank's writer removes its own temporary files (TensorStore's
    ``.__lock``) while this rank fsyncs; a file gone since it was listed is not an error."""
    from arrayckpt._storage import renames

    renames._fsync_path(str(tmp_path / "gone.__lock"))  # listed, then removed: nothing to fsync


def test_make_durable_never_follows_a_link_or_blocks_on_a_fifo(tmp_path):
    """Only what the save wrote is synced: a link planted in its directory is not followed, a FIFO does not hang."""
    import os

    from arrayckpt._storage import renames

    outside = tmp_path / "outside"
    outside.write_bytes(b"x")
    inside = tmp_path / "t"
    inside.mkdir()
    (inside / "link").symlink_to(outside)
    os.mkfifo(inside / "fifo")
    (inside / "data").write_bytes(b"y" * 10)
    renames.make_durable(inside)  # returns (a FIFO opened blocking would wait for a writer forever)
