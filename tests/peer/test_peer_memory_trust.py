"""The peer-memory tier treats its directory as untrusted input (issue 33): a stale chunk file (another step's, another
job's) is never restored or flushed, no link under the memory directory is followed, a directory another user could
change is refused, gc takes a memory directory whole or not at all, what peers announce is bounded.

Memory saves need two "nodes" (spawned gloo ranks); restores and flushes here run in this process on one rank from
node 0's directory, which holds the whole step (its own files and the replicas of node 1's).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

import arrayckpt
from arrayckpt._peer.node import NodeMemory
from arrayckpt._peer.record import StepRecord, file_sum
from arrayckpt._peer.save import _announced_file
from tests.dist_helpers import run_ranks
from tests.peer.test_peer_memory import _full, _state

STEP3 = "step-00000003"


def _train(rank: int, world: int, root: str, dirs: list[str], offset: int) -> None:
    """Memory steps 1..3 (keep=2: steps 2 and 3 kept), a durable step 2; the state of step s is ``_full(s + offset)``
    (another job: another offset)."""
    manager = _manager(root, dirs[rank], keep=2)
    for step in range(1, 4):
        state = _state(rank, world, step + offset)
        state["step"] = step
        manager.save(step, state)
    manager.close()
    torch.distributed.barrier()


def _manager(root: str, directory: str, **memory: object) -> arrayckpt.CheckpointManager:
    return arrayckpt.CheckpointManager(root, interval=arrayckpt.Interval(every_steps=2),
                                       memory=arrayckpt.PeerMemory(every_steps=1, ranks_per_node=1,
                                                                   directory=directory, **memory))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two jobs of the same layout, each on two nodes: ``a`` (values of step s) and ``b`` (values of step s + 100)."""
    base = tmp_path_factory.mktemp("peer-trust")
    for job, offset in (("a", 0), ("b", 100)):
        run_ranks(2, _train, str(base / job / "root"), [str(base / job / "n0"), str(base / job / "n1")], offset)
    return base


@pytest.fixture
def job(jobs: Path, tmp_path: Path) -> Path:
    """A fresh copy of job ``a`` (its durable root and both nodes), and job ``b``'s nodes beside it."""
    for name in ("root", "n0", "n1"):
        shutil.copytree(jobs / "a" / name, tmp_path / name)
    shutil.copytree(jobs / "b" / "n0", tmp_path / "other")
    return tmp_path


def _restore(job: Path, node: str = "n0") -> tuple[int | None, dict, list[str]]:
    """One rank restores from ``node``'s memory (which holds the whole step) or the durable tier."""
    manager = _manager(str(job / "root"), str(job / node), keep=2)
    state = _state(0, 1, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = manager.restore(state)
    manager.close()
    return step, state, [str(w.message) for w in caught]


def _assert_right(step: int | None, state: dict) -> None:
    """What was restored is exactly some step's state (or nothing at all: zeros, step 0)."""
    if step is None:
        assert state["step"] == 0 and not state["w"].tensor.any()
        return
    assert state["step"] == step
    assert torch.equal(state["w"].tensor, _full(step)["w"]) and torch.equal(state["b"].tensor, _full(step)["b"])


def _chunk_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != "zarr.json")


# --- 1. stale chunk files ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_valid_chunk_file_of_another_step_or_job_is_refused_and_another_copy_used(job: Path):
    for stale_from in (job / "n0" / "step-00000002", job / "other" / STEP3):
        own = job / "n0" / STEP3 / "w" / "c.0.0"
        good = own.read_bytes()
        stale = (stale_from / "w" / "c.0.0").read_bytes()
        assert len(stale) == len(good) and stale != good
        own.write_bytes(stale)  # a valid chunk file: its own crc32c passes
        step, state, said = _restore(job, "n0")
        _assert_right(step, state)
        assert step == 2, said  # node 0 alone lacks an intact copy of step 3: its whole step 2 is restored instead
        assert any("not this step's" in w and "w/c.0.0" in w for w in said), said
        # The load on two ranks takes node 1's copy: step 3, right
        own.write_bytes(good)


def test_a_flush_never_makes_a_stale_chunk_durable(job: Path):
    (job / "n0" / STEP3 / "b" / "c.0").write_bytes((job / "n0" / "step-00000002" / "b" / "c.0").read_bytes())
    manager = _manager(str(job / "root"), str(job / "n0"), keep=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(arrayckpt.StateError, match=r"not whole.*b \(1 of 1\)"):
            manager.flush_memory(3)
    manager.close()
    assert not (job / "root" / STEP3).exists()


def test_a_record_of_version_1_or_one_leaving_out_a_chunk_is_not_used(job: Path):
    record = job / "n0" / f"{STEP3}.peer.json"
    doc = json.loads(record.read_bytes())
    del doc["files"]["w"]["c.1.0"]
    record.write_text(json.dumps(doc))
    step, state, said = _restore(job)
    assert step == 2 and any("lists 1 chunk file(s) of array 'w', which has 2" in w for w in said), said
    _assert_right(step, state)
    doc["arrayckpt_peer_step"] = 1
    record.write_text(json.dumps(doc))
    step, _, said = _restore(job)
    assert step == 2 and any("version 1" in w for w in said), said


def test_a_record_naming_a_chunk_twice_is_refused(job: Path):
    record = job / "n0" / f"{STEP3}.peer.json"
    text = record.read_text()
    assert text.count('"c.1.0"') == 1
    record.write_text(text.replace('"c.0.0"', '"c.1.0"'))  # JSON would keep the last one: c.0.0 unlisted
    step, _, said = _restore(job)
    assert step == 2 and any("named twice" in w for w in said), said


# --- the sweep -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_byte_flip_and_every_stale_file_restores_right_or_refuses(job: Path):
    """Every byte of every chunk file of the newest memory step flipped, then each file replaced by its valid
    counterpart of another step and of another job: the restore gives exactly some step's state, every time."""
    files = _chunk_files(job / "n0" / STEP3)
    assert len(files) == 3
    outcomes: dict[int | None, int] = {}
    for path in files:
        good = path.read_bytes()
        for i in range(len(good)):
            flipped = bytearray(good)
            flipped[i] ^= 0x41
            path.write_bytes(bytes(flipped))
            step, state, _ = _restore(job)
            _assert_right(step, state)
            outcomes[step] = outcomes.get(step, 0) + 1
        for source in (job / "n0" / "step-00000002", job / "other" / STEP3):
            path.write_bytes((source / path.relative_to(job / "n0" / STEP3)).read_bytes())
            step, state, _ = _restore(job)
            _assert_right(step, state)
            assert step == 2
        path.write_bytes(good)
    assert outcomes == {2: sum(p.stat().st_size for p in files)}  # every flip refused: step 2 (memory) instead
    for document in (job / "n0" / f"{STEP3}.peer.json", job / "n0" / STEP3 / "zarr.json"):
        good = document.read_bytes()
        for i in range(0, len(good), 7):
            flipped = bytearray(good)
            flipped[i] ^= 0x01
            document.write_bytes(bytes(flipped))
            step, state, _ = _restore(job)
            _assert_right(step, state)
        document.write_bytes(good)
    step, state, _ = _restore(job)
    assert step == 3
    _assert_right(step, state)


# --- 2. links --------------------------------------------------------------------------------------------------


def _digest(tree: Path) -> dict[str, str]:
    return {str(p.relative_to(tree)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(tree.rglob("*")) if p.is_file() and not p.is_symlink()}


def _save_past_links(rank: int, world: int, root: str, dirs: list[str], victim: str) -> list[str]:
    """Memory steps 4, 5, 6 and 7 with a link planted by node 0 before each: at the step's directory, at an array
    directory inside it, at a chunk file, at the step's record. What each save did."""
    manager = _manager(root, dirs[rank], keep=4)
    mine = Path(dirs[rank])
    out = []
    for step, plant in ((4, ""), (5, "w"), (6, "w/c.0.0"), (7, "record")):
        if rank == 0:
            name = f"step-{step:08d}"
            if plant == "record":
                os.symlink(Path(victim) / "zarr.json", mine / f"{name}.peer.json")
            elif plant:
                (mine / name / plant).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(Path(victim) / plant, mine / name / plant)
            else:
                os.symlink(victim, mine / name)
        try:
            manager.save(step, _state(rank, world, step))
            manager.memory.wait()
            out.append("saved")
        except arrayckpt.ArrayckptError as e:
            out.append(str(e))
    manager.close()
    return out


@pytest.mark.slow
def test_memory_saves_never_write_through_a_link_in_the_memory_directory(job: Path):
    victim = job / "root" / "step-00000002"  # a durable checkpoint another link would overwrite
    before = _digest(victim)
    dirs = [str(job / "n0"), str(job / "n1")]
    results = run_ranks(2, _save_past_links, str(job / "root"), dirs, str(victim))
    assert _digest(victim) == before
    for said in results:  # a link in the step's or the record's place is removed (itself), the save goes on
        assert said[0] == "saved" and said[3] == "saved", said
        for refused, step in ((said[1], 5), (said[2], 6)):  # a link inside the step's directory: refused
            assert "not arrayckpt's" in refused and f"step-{step:08d}" in refused, said
    assert not (job / "n0" / "step-00000004").is_symlink() and (job / "n0" / "step-00000007.peer.json").is_file()
    step, state, _ = _restore(job)
    assert step == 7
    _assert_right(step, state)


def test_links_at_the_memory_directory_or_its_node_file_are_never_followed(tmp_path: Path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "node.json").write_text("precious")
    os.symlink(victim, tmp_path / "memory")
    with pytest.raises(arrayckpt.UntrustedDirectoryError, match="symbolic link"):
        _manager(str(tmp_path / "root"), str(tmp_path / "memory"))
    (tmp_path / "mine").mkdir(mode=0o700)
    os.symlink(victim / "node.json", tmp_path / "mine" / "node.json")
    _manager(str(tmp_path / "root"), str(tmp_path / "mine")).close()  # the link is replaced, never followed
    assert (victim / "node.json").read_text() == "precious"
    assert not (tmp_path / "mine" / "node.json").is_symlink()


# --- 3. other users -------------------------------------------------------------------------------------------


NOBODY = 65534


@pytest.mark.parametrize("change", ["owner", "group-writable", "world-writable", "parent"])
def test_a_memory_directory_another_user_could_change_is_refused(tmp_path: Path, change: str):
    directory = tmp_path / "shared" / "memory"
    directory.mkdir(parents=True, mode=0o700)
    if os.geteuid() != 0 and change in ("owner", "parent"):
        pytest.skip("changing a directory's owner needs root")
    if change == "owner":
        os.chown(directory, NOBODY, NOBODY)
    elif change == "parent":
        os.chown(directory.parent, NOBODY, NOBODY)
    else:
        directory.chmod(0o770 if change == "group-writable" else 0o777)
    with pytest.raises(arrayckpt.UntrustedDirectoryError, match="PeerMemory\\(directory=") as caught:
        _manager(str(tmp_path / "root"), str(directory))
    assert isinstance(caught.value, PermissionError) and "\n" not in str(caught.value)
    assert not list(directory.iterdir())  # nothing was written into it


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="creating a directory as another user needs root")
def test_a_default_memory_directory_planted_by_another_user_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       request: pytest.FixtureRequest):
    """Another local user creates the predictable default directory first (running as that user) and plants a step
    in it: the manager refuses it with a clear error, and never loads the planted step."""
    shm = Path(tempfile.mkdtemp(prefix="arrayckpt-test-shm-"))  # below /tmp: the other user can reach it
    shm.chmod(0o1777)  # as /dev/shm
    request.addfinalizer(lambda: shutil.rmtree(shm))
    parent = shm / f"arrayckpt-{os.geteuid()}"
    root = str(tmp_path / "root")
    memory = arrayckpt.PeerMemory(every_steps=1, ranks_per_node=1)
    monkeypatch.setattr("arrayckpt._peer.config.default_parent", lambda: parent)
    planted = memory.node_directory(os.path.abspath(root))
    script = f"mkdir -p -m 777 '{planted}/step-00000009' && printf '{{}}' > '{planted}/step-00000009.peer.json'"
    subprocess.run(["/bin/sh", "-c", script], check=True, user=NOBODY, group=NOBODY, cwd="/")
    assert parent.stat().st_uid == NOBODY
    with pytest.raises(arrayckpt.UntrustedDirectoryError, match=f"uid {NOBODY}"):
        arrayckpt.CheckpointManager(root, memory=memory)


def test_the_default_memory_directory_is_private_and_per_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    parent = tmp_path / "shm" / f"arrayckpt-{os.geteuid()}"
    monkeypatch.setattr("arrayckpt._peer.config.default_parent", lambda: parent)
    manager = arrayckpt.CheckpointManager(tmp_path / "root", memory=arrayckpt.PeerMemory(every_steps=1,
                                                                                        ranks_per_node=1))
    directory = manager.memory.node.directory
    manager.close()
    assert directory.parent == parent
    for level in (parent, directory):
        assert level.stat().st_mode & 0o777 == 0o700 and level.stat().st_uid == os.geteuid()
    assert arrayckpt.PeerMemory(every_steps=1).node_directory("r").parent.name == f"arrayckpt-{os.geteuid()}"


# --- gc ---------------------------------------------------------------------------------------------------------


def test_gc_memory_takes_a_directory_whole_or_leaves_it_untouched(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]):
    from arrayckpt._cli.main import main

    shm = tmp_path / "shm"
    mixed = NodeMemory(shm / "mixed", "root-a")
    (mixed.step_path(7) / "w").mkdir(parents=True)
    (mixed.step_path(7) / "w" / "c.0").write_bytes(b"x")
    (shm / "mixed" / "c.0").write_bytes(b"the user's")  # chunk-named, but not where arrayckpt puts chunk files
    mixed.close()
    linked = NodeMemory(shm / "linked", "root-b")
    (linked.step_path(3)).mkdir()
    os.symlink(tmp_path, linked.step_path(3) / "w")
    linked.close()
    whole = NodeMemory(shm / "whole", "root-c")
    (whole.step_path(1) / "w").mkdir(parents=True)
    (whole.step_path(1) / "w" / "c.0").write_bytes(b"x")
    whole.commit(StepRecord(1, "id", 1, {}))
    whole.close()
    before = sorted(str(p) for p in shm.rglob("*"))
    root = tmp_path / "root"
    root.mkdir()
    assert main(["gc", str(root), "--memory", str(shm), "--min-age", "0", "--dry-run", "--json"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert sorted(str(p) for p in shm.rglob("*")) == before
    assert main(["gc", str(root), "--memory", str(shm), "--min-age", "0", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert dry["would_remove"] == done["removed"] == [str(shm / "whole")]
    assert dry["kept"] == done["kept"]
    kept = {item["path"]: item["reason"] for item in done["kept"]}
    assert "'c.0'" in kept[str(shm / "mixed")] and "step-00000003/w" in kept[str(shm / "linked")]
    assert not (shm / "whole").exists()
    assert sorted(str(p) for p in (shm / "mixed").rglob("*")) == [p for p in before if "/mixed/" in p]
    assert (shm / "mixed" / "node.json").is_file() and (shm / "mixed" / "c.0").read_bytes() == b"the user's"


# --- what peers announce ----------------------------------------------------------------------------------------


def test_what_a_peer_announces_is_checked_against_the_step(job: Path):
    from arrayckpt._format.manifest import parse_root_document
    from arrayckpt._storage.base import parse_root_bytes

    step = job / "n0" / STEP3
    _, nodes = parse_root_document(parse_root_bytes((step / "zarr.json").read_bytes(), "x"), "x")
    good = file_sum((step / "w" / "c.0.0").read_bytes())
    assert _announced_file(("w", "c.0.0", good.size, good.body, good.tail), nodes) is not None
    for bad in [("../w", "c.0.0", good.size, good.body, good.tail), ("w", "../../x", good.size, 0, 0),
                ("w", "c.9.0", good.size, 0, 0), ("w", "c.0.0", 1 << 40, 0, 0), ("w", "c.0.0", 2, 0, 0),
                ("w", "c.0.0", good.size, -1, 0), ("w", "c.0.0"), "w/c.0.0"]:
        assert _announced_file(bad, nodes) is None, bad
