"""The peer-memory tier (issue 27): memory saves replicated across "nodes", restores after a node is lost onto the same
or another number of ranks, the fallback to the durable tier, damaged replicas, the memory bound, clean-up.

Spawned gloo ranks on 127.0.0.1; a "node" is a directory of its own under tmp_path (what /dev/shm is per machine),
shared by the ranks placed on it; losing a node is removing its directory once its processes have ended.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import arrayckpt
from tests.dist_helpers import run_ranks

pytestmark = pytest.mark.slow  # spawns processes, starts a server or runs a foreign stack

ROWS, COLS = 8, 6


def _rows(rank: int, world: int) -> tuple[int, int]:
    """torch.chunk's split of ROWS over ``world`` ranks: (offset, count) of ``rank``."""
    per = -(-ROWS // world)
    start = min(rank * per, ROWS)
    return start, min(per, ROWS - start)


def _full(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * step + 0.5,
            "b": torch.full((5,), float(step), dtype=torch.float64)}


def _state(rank: int, world: int, step: int | None) -> dict:
    """This rank's training state at ``step`` (``None``: zeros, to restore into): ``w`` sharded by rows, ``b``
    replicated on every rank (stored once), a plain value."""
    full = _full(step) if step is not None else {k: torch.zeros_like(v) for k, v in _full(1).items()}
    start, count = _rows(rank, world)
    return {"w": arrayckpt.Shard(full["w"][start:start + count].clone(), (ROWS, COLS), (start, 0)),
            "b": arrayckpt.Shard(full["b"].clone(), (5,), (0,), replica_id=rank), "step": step or 0}


def _manager(root: str, directory: str, rpn: int, **memory: object) -> arrayckpt.CheckpointManager:
    return arrayckpt.CheckpointManager(root, interval=arrayckpt.Interval(every_steps=2),
                                       memory=arrayckpt.PeerMemory(every_steps=1, ranks_per_node=rpn,
                                                                   directory=directory, **memory))


def _train(rank: int, world: int, root: str, dirs: list[str], rpn: int, steps: int) -> list[int]:
    manager = _manager(root, dirs[rank], rpn)
    for step in range(1, steps + 1):
        manager.save(step, _state(rank, world, step))
    manager.close()
    torch.distributed.barrier()  # every node leader has committed (a rank lists its node's directory)
    return manager.memory.steps()


def _resume(rank: int, world: int, root: str, dirs: list[str], rpn: int) -> tuple:
    manager = _manager(root, dirs[rank], rpn)
    state = _state(rank, world, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = manager.restore(state)
    manager.close()
    return (step, state["w"].tensor.numpy().copy(), state["b"].tensor.numpy().copy(), state["step"],
            [str(w.message) for w in caught])


def _resume_damaged_after_survey(rank: int, world: int, root: str, dirs: list[str], rpn: int,
                                 good: dict[int, tuple[str, bytes]]) -> tuple:
    """:func:`_resume` where, on each rank of ``good`` (rank -> a chunk file and good bytes for it), the chunk file
    holds the good bytes while the first survey checks it and its damaged ones again before the load."""
    from arrayckpt._peer.node import NodeMemory

    holdings = NodeMemory.holdings
    calls = []

    def damage_after_first_survey(self: NodeMemory) -> list:
        if rank in good and not calls:
            chunk, bytes_then = Path(good[rank][0]), good[rank][1]
            damaged = chunk.read_bytes()
            chunk.write_bytes(bytes_then)
            out = holdings(self)
            chunk.write_bytes(damaged)
        else:
            out = holdings(self)
        calls.append(1)
        return out

    NodeMemory.holdings = damage_after_first_survey  # type: ignore[method-assign]
    try:
        return _resume(rank, world, root, dirs, rpn)
    finally:
        NodeMemory.holdings = holdings  # type: ignore[method-assign]


def _check(results: list[tuple], world: int, step: int) -> None:
    for rank, (restored, w, b, plain, _) in enumerate(results):
        start, count = _rows(rank, world)
        assert restored == step
        assert torch.equal(torch.from_numpy(w), _full(step)["w"][start:start + count]), rank  # bit for bit
        assert torch.equal(torch.from_numpy(b), _full(step)["b"]), rank
        assert plain == step


def test_restore_from_peers_after_losing_a_node_on_4_and_3_ranks_and_past_a_damaged_copy(tmp_path: Path):
    root = str(tmp_path / "root")
    n = [str(tmp_path / f"node{i}") for i in range(4)]
    kept = run_ranks(4, _train, root, [n[0], n[0], n[1], n[1]], 2, 3)
    assert kept == [[3]] * 4  # keep=1: only the newest memory step (the durable tier holds step 2)
    # A damaged copy: node 0's own file of rank 0's rows is refused, and node 1's replica of it is used.
    own = Path(n[0], "step-00000003", "w", "c.0.0")
    data = bytearray(own.read_bytes())
    data[3] ^= 0xFF
    own.write_bytes(bytes(data))
    results = run_ranks(4, _resume, root, [n[0], n[0], n[1], n[1]], 2)
    _check(results, 4, 3)
    # The survey checks every file's sums against the record: the damage is refused there, no second try
    assert any("damaged" in w and "w/c.0.0" in w for w in results[0][4]), results[0][4]
    assert not any("trying again" in w for w in results[0][4]), results[0][4]
    # A cut file is refused by its size
    own.write_bytes(bytes(data[:-1]))
    results = run_ranks(4, _resume, root, [n[0], n[0], n[1], n[1]], 2)
    _check(results, 4, 3)
    assert any("damaged" in w and "w/c.0.0" in w for w in results[0][4]), results[0][4]
    # Damage after the survey (met by the load) makes the restore survey again and take the other copy
    own.write_bytes(bytes(data))
    replica = Path(n[1], "step-00000003", "w", "c.0.0").read_bytes()
    results = run_ranks(4, _resume_damaged_after_survey, root, [n[0], n[0], n[1], n[1]], 2, {0: (str(own), replica)})
    _check(results, 4, 3)
    assert any("met a damaged chunk file" in w and "trying again" in w for w in results[0][4]), results[0][4]
    # Node 1 is lost; its ranks restart on a fresh node: 4 ranks, then 3, from node 0's memory alone.
    shutil.rmtree(n[1])
    _check(run_ranks(4, _resume, root, [n[0], n[0], n[2], n[2]], 2), 4, 3)
    _check(run_ranks(3, _resume, root, [n[0], n[0], n[3]], 2), 3, 3)


def test_both_copies_lost_falls_back_to_the_durable_tier_with_a_warning(tmp_path: Path):
    root = str(tmp_path / "root")
    n = [str(tmp_path / f"node{i}") for i in range(5)]
    run_ranks(3, _train, root, n[:3], 1, 3)  # 3 nodes of 1 rank: rank 1's chunks live on nodes 1 and 2
    shutil.rmtree(n[1])
    shutil.rmtree(n[2])
    results = run_ranks(3, _resume, root, [n[0], n[3], n[4]], 1)
    _check(results, 3, 2)  # the durable step 2
    assert any("not whole" in w and "step 3" in w for w in results[0][4]), results[0][4]


def test_a_restore_that_fails_on_one_rank_changes_no_rank(tmp_path: Path):
    """Both copies of rank 0's rows damaged (same size) after the survey checked them, and no durable step yet: the
    restore finds nothing to restore on every rank, and rank 1, whose own reads were good, must not keep them (an
    atomic load protects one rank: the ranks agree after their reads, before any state changes)."""
    root = str(tmp_path / "root")
    dirs = [str(tmp_path / f"node{i}") for i in range(2)]
    run_ranks(2, _train, root, dirs, 1, 1)  # memory step 1 only (the durable tier saves every 2 steps)
    good = {}
    for rank, directory in enumerate(dirs):  # one leader per node: each gets its node's good copy for the survey
        chunk = Path(directory, "step-00000001", "w", "c.0.0")
        good[rank] = (str(chunk), chunk.read_bytes())
        data = bytearray(good[rank][1])
        data[3] ^= 0xFF
        chunk.write_bytes(bytes(data))
    results = run_ranks(2, _resume_damaged_after_survey, root, dirs, 1, good)
    for rank, (restored, w, b, plain, _) in enumerate(results):
        assert restored is None and plain == 0, rank
        assert not w.any() and not b.any(), rank  # still the zeros it had
    assert any("trying again" in w for w in results[0][4]), results[0][4]
    assert any("not whole" in w and "step 1" in w for w in results[0][4]), results[0][4]


def _over_limit(rank: int, world: int, root: str, dirs: list[str]) -> str:
    manager = _manager(root, dirs[rank], 1, max_bytes=64)
    try:
        manager.save(1, _state(rank, world, 1))  # returns once staged
        manager.memory.wait()  # the bound is checked in the background, on every rank alike
    except arrayckpt.StateError as e:
        return str(e)
    finally:
        manager.close()
    return "saved"


def test_a_memory_step_over_max_bytes_is_refused_and_not_kept(tmp_path: Path):
    dirs = [str(tmp_path / f"node{i}") for i in range(2)]
    for message in run_ranks(2, _over_limit, str(tmp_path / "root"), dirs):
        assert "max_bytes=64" in message and "keep=1" in message
    assert not [p for d in dirs for p in Path(d).glob("step-*")]


def test_peer_memory_refuses_bad_settings():
    with pytest.raises(ValueError, match="every_steps"):
        arrayckpt.PeerMemory(every_steps=0)
    with pytest.raises(ValueError, match="not both"):
        arrayckpt.PeerMemory(every_steps=1, ranks_per_node=2, nodes=[0, 0])
    with pytest.raises(arrayckpt.StateError, match="more than 1 node"):
        arrayckpt.PeerMemory(every_steps=1, ranks_per_node=4).placement(4)
    placement = arrayckpt.PeerMemory(every_steps=1, replicas=2, nodes=["a", "a", "b", "b", "c", "c"]).placement(6)
    assert placement.partners(0) == [2, 4] and placement.partners(5) == [1, 3] and placement.sources(0) == [2, 4]


def test_clean_up_removes_ended_jobs_memory_and_interrupted_steps_only(tmp_path: Path):
    from arrayckpt._peer.node import NodeMemory

    shm = tmp_path / "shm"
    ended = NodeMemory(shm / "ended", "root-a")
    (ended.step_path(7) / "w").mkdir(parents=True)
    (ended.step_path(7) / "w" / "c.0").write_bytes(b"x")
    (ended.step_path(7) / "zarr.json").write_bytes(b"{}")
    (shm / "ended" / "notes.txt").write_text("not arrayckpt's")
    ended.close()  # its job ended: nobody holds it
    live = NodeMemory(shm / "live", "root-b")  # another job's, still running
    (live.step_path(3)).mkdir()
    (shm / "foreign").mkdir()
    (shm / "foreign" / "step-00000001").mkdir()
    manager = arrayckpt.CheckpointManager(tmp_path / "root", memory=arrayckpt.PeerMemory(
        every_steps=1, ranks_per_node=1, directory=shm / "mine"))
    interrupted = manager.memory.node.step_path(5)
    (interrupted / "w").mkdir(parents=True)
    (interrupted / "w" / "c.0").write_bytes(b"x")
    removed = manager.clean_up(min_age_s=0)
    manager.close()
    assert str(interrupted) in removed and not interrupted.exists()
    assert str(shm / "ended") not in removed  # it holds a file that is not arrayckpt's: all of it stays
    assert ended.step_path(7).exists() and (shm / "ended" / "node.json").exists()
    (shm / "ended" / "notes.txt").unlink()
    manager = arrayckpt.CheckpointManager(tmp_path / "root", memory=arrayckpt.PeerMemory(
        every_steps=1, ranks_per_node=1, directory=shm / "mine"))
    assert str(shm / "ended") in manager.clean_up(min_age_s=0)
    manager.close()
    assert not (shm / "ended").exists()
    assert live.step_path(3).exists() and (shm / "foreign" / "step-00000001").exists()
    live.close()


def test_gc_memory_removes_only_ended_jobs_memory_directories(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    import json

    from arrayckpt._cli.main import main
    from arrayckpt._peer.node import NodeMemory

    shm = tmp_path / "shm"
    ended = NodeMemory(shm / "ended", "root-a")
    (ended.step_path(7) / "w").mkdir(parents=True)
    (ended.step_path(7) / "w" / "c.0").write_bytes(b"x")
    ended.close()  # its job ended
    live = NodeMemory(shm / "live", "root-b")  # a running job's: its ranks hold node.json
    (live.step_path(3) / "w").mkdir(parents=True)
    (shm / "foreign" / "step-00000001").mkdir(parents=True)  # no node.json: not arrayckpt's
    root = tmp_path / "root"
    root.mkdir()
    assert main(["gc", str(root), "--memory", str(shm), "--min-age", "0", "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"would_remove": [str(shm / "ended")]}
    assert ended.step_path(7).exists()
    assert main(["gc", str(root), "--memory", str(shm), "--min-age", "3600"]) == 0  # too recent
    assert ended.step_path(7).exists()
    capsys.readouterr()
    assert main(["gc", str(root), "--memory", str(shm), "--min-age", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"removed": [str(shm / "ended")]}
    assert not (shm / "ended").exists()
    assert live.step_path(3).exists() and (shm / "foreign" / "step-00000001").exists()
    live.close()


def _save_then_change(rank: int, world: int, root: str, dirs: list[str]) -> tuple:
    """A memory save returns before its replication runs (the replication waits here for the caller to have
    changed the state), and the step holds the state as it was when ``save`` was called."""
    import threading

    import arrayckpt._peer.save as peer_save

    returned = threading.Event()
    ran_after_return = []
    exchange = peer_save.exchange_files

    def replication_after_save_returned(*args: object, **kwargs: object) -> int:
        ran_after_return.append(returned.wait(timeout=20))  # a synchronous save would wait here in vain
        return exchange(*args, **kwargs)

    peer_save.exchange_files = replication_after_save_returned
    manager = _manager(root, dirs[rank], 1)
    state = _state(rank, world, 3)
    manager.save(3, state)
    state["w"].tensor.zero_()  # training goes on: the memory step must keep the staged copy
    state["b"].tensor.zero_()
    returned.set()
    manager.memory.wait()
    manager.close()
    peer_save.exchange_files = exchange
    return ran_after_return, _resume(rank, world, root, dirs, 1)


def test_a_memory_save_returns_once_staged_and_replicates_in_the_background(tmp_path: Path):
    root = str(tmp_path / "root")
    dirs = [str(tmp_path / f"node{i}") for i in range(2)]
    results = run_ranks(2, _save_then_change, root, dirs)
    assert [ran for ran, _ in results] == [[True], [True]]
    _check([restored for _, restored in results], 2, 3)
    assert all(Path(d, "step-00000003.peer.json").is_file() for d in dirs)


def _flush(rank: int, world: int, root: str, dirs: list[str], rpn: int, remote: str | None) -> dict:
    """A restarted job: restore memory step 3 by number, flush it to the durable tiers (twice: the second finds it
    there), and ask for a step memory never held."""
    import os

    manager = arrayckpt.CheckpointManager(root, interval=arrayckpt.Interval(every_steps=2), remote=remote,
                                          memory=arrayckpt.PeerMemory(every_steps=1, ranks_per_node=rpn,
                                                                      directory=dirs[rank]))
    state = _state(rank, world, None)
    out: dict = {"restored": manager.restore(state, step=3), "w": state["w"].tensor.numpy().copy()}
    out["tiers_before"] = manager.tiers()  # step 3 is only in memory yet
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["first"] = manager.flush_memory()
    out["warnings"] = [str(w.message) for w in caught]
    inode = os.stat(manager.path(3)).st_ino
    out["again"] = manager.flush_memory(3)
    out["copied_again"] = os.stat(manager.path(3)).st_ino != inode
    try:
        manager.flush_memory(1)
    except arrayckpt.StateError as e:
        out["missing"] = str(e)
    manager.wait_for_uploads()
    out["tiers"] = manager.tiers()
    manager.close()
    return out


def _check_durable(path: Path, memory_step: Path, step: int) -> None:
    """The durable checkpoint holds the memory step's very checkpoint (its id) and reads back whole, without torch."""
    import json

    with arrayckpt.open(path) as checkpoint:
        assert checkpoint.step == step
        assert checkpoint.manifest.id == json.loads(Path(f"{memory_step}.peer.json").read_bytes())["id"]
        assert torch.equal(torch.from_numpy(checkpoint["w"][:]), _full(step)["w"])
        assert torch.equal(torch.from_numpy(checkpoint["b"][:]), _full(step)["b"])
    assert arrayckpt.verify(path).ok


def test_flush_a_memory_step_to_the_durable_tiers_after_losing_a_node_on_fewer_ranks(tmp_path: Path):
    root, remote = str(tmp_path / "root"), str(tmp_path / "remote")
    n = [str(tmp_path / f"node{i}") for i in range(3)]
    run_ranks(4, _train, root, [n[0], n[0], n[1], n[1]], 2, 3)  # durable step 2, memory step 3
    shutil.rmtree(n[1])  # node 1 is lost: node 0's own files and its replicas of node 1's make step 3 whole
    results = run_ranks(3, _flush, root, [n[0], n[0], n[2]], 2, remote)
    for rank, out in enumerate(results):
        start, count = _rows(rank, 3)
        assert out["restored"] == 3 and torch.equal(torch.from_numpy(out["w"]), _full(3)["w"][start:start + count])
        assert out["first"] == 3 and out["again"] == 3
        assert "step 1" in out["missing"] and "no node holds" in out["missing"]
    assert results[0]["copied_again"] is False  # the durable tier held this very checkpoint: not copied again
    assert results[0]["tiers_before"][3] == ("memory",)  # tiers() reports the memory tier, fastest first
    assert results[0]["tiers"][3] == ("memory", "local", "remote")  # flushed, then uploaded like any save
    _check_durable(tmp_path / "root" / "step-00000003", Path(n[0], "step-00000003"), 3)
    _check_durable(tmp_path / "remote" / "step-00000003", Path(n[0], "step-00000003"), 3)


def _flush_only(rank: int, world: int, root: str, dirs: list[str]) -> str | int | None:
    manager = _manager(root, dirs[rank], 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return manager.flush_memory(3)
    except arrayckpt.StateError as e:
        return str(e)
    finally:
        manager.close()


def test_a_flush_takes_the_intact_copy_and_refuses_a_step_with_no_intact_copy(tmp_path: Path):
    root = str(tmp_path / "root")
    dirs = [str(tmp_path / f"node{i}") for i in range(2)]
    run_ranks(2, _train, root, dirs, 1, 3)
    own, replica = Path(dirs[0], "step-00000003", "w", "c.0.0"), Path(dirs[1], "step-00000003", "w", "c.0.0")
    good = own.read_bytes()
    assert replica.read_bytes() == good
    for path in (own, replica):  # both copies of rank 0's rows damaged
        data = bytearray(good)
        data[3] ^= 0xFF
        path.write_bytes(bytes(data))
    for message in run_ranks(2, _flush_only, root, dirs):
        assert "not whole" in message and "step 3" in message and "w (1 of" in message
    target = tmp_path / "root" / "step-00000003"
    assert not target.exists() and not [p for p in (tmp_path / "root").iterdir() if "00000003" in p.name]
    replica.write_bytes(good)  # one intact copy again (on the other node than rank 0's)
    assert run_ranks(2, _flush_only, root, dirs) == [3, 3]
    _check_durable(target, Path(dirs[1], "step-00000003"), 3)
    assert (target / "w" / "c.0.0").read_bytes() == good
