"""Plan reuse: a save with the layout of the previous one sends fingerprints, not descriptions, and replans nothing;
any change to the layout is planned afresh (ranks as threads, see thread_ranks.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, nodes_of
from policies import small_chunks
from thread_ranks import ThreadGroup, _Hub

import arrayckpt
import arrayckpt._write.save as save_module
from arrayckpt._format.dtypes import dtype_by_name
from arrayckpt._format.manifest import ArrayEntry, ValueEntry
from arrayckpt._layout.box import Box
from arrayckpt._layout.plancache import PlanCache
from arrayckpt._layout.saveplan import ArrayDescription, LocalDescription, fingerprint
from arrayckpt._torch.dist import Group
from arrayckpt._write.exchange import Report, forget_plan_caches, plan_cache_for
from arrayckpt._write.options import SaveOptions, SaveSetup

WORLD = 4
ROWS, COLS = 16, 6


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch: pytest.MonkeyPatch) -> Any:
    """No layout or part left by another test; count the layouts planned."""
    forget_plan_caches()
    planned: list[int] = []
    plan_layout = save_module.plan_layout

    def counting(*args: Any, **kwargs: Any) -> Any:
        planned.append(1)
        return plan_layout(*args, **kwargs)

    monkeypatch.setattr(save_module, "plan_layout", counting)
    yield planned
    forget_plan_caches()


@dataclass(frozen=True)
class _Recording(ThreadGroup):
    """A thread group that records, per gather, which ranks sent their description."""

    log: Any = None

    def gather(self, obj: Any) -> list[Any] | None:
        if isinstance(obj, Report):
            with self.log[1]:
                self.log[0].append((self.rank, obj.description is not None))
        return super().gather(obj)


def _run(fn: Callable[[int, Any], Any], world: int = WORLD) -> tuple[list[Any], list[tuple[int, bool]]]:
    """``fn(rank, group)`` on ``world`` threads; returns the results and who sent a description, gather by gather."""
    hub, log = _Hub(world), ([], threading.Lock())
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, _Recording(rank, world, None, None, hub, log))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results, log[0]


def _full(seed: int, shape: tuple[int, ...] = (ROWS, COLS), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _state(rank: int, seed: int, *, rows: int = ROWS, dtype: torch.dtype = torch.float32, split: int = 0,
           extra: bool = False, drop: bool = False, rng_bytes: int = 3, value_key: str = "step") -> dict[str, Any]:
    """Every rank's state: a row-sharded matrix (``split`` 1: column-sharded), a replicated vector, per-rank values."""
    full = _full(seed, (rows, COLS), dtype)
    if split == 0:
        n = rows // WORLD
        piece = arrayckpt.Shard(full[rank * n:(rank + 1) * n].clone(), full.shape, (rank * n, 0))
    else:
        n = COLS // 2
        half = rank % 2
        piece = arrayckpt.Shard(full[:, half * n:(half + 1) * n].clone(), full.shape, (0, half * n), rank // 2)
    state: dict[str, Any] = {"model": {"w": piece, "b": _full(seed + 1, (8,))}, value_key: seed,
                             "rng": arrayckpt.PerRank(torch.full((rng_bytes,), rank + seed, dtype=torch.uint8)),
                             "cursor": arrayckpt.PerRank({"offset": 10 * rank + seed})}
    if extra:
        state["model"]["extra"] = _full(seed + 2, (4,))
    if drop:
        del state["model"]["b"]
    return state


def _save_all(path: Path, seed: int, chunking: Any = None, **changes: Any) -> list[tuple[int, bool]]:
    def save(rank: int, group: Any) -> None:
        options = {"process_group": group, "step": seed, **{k: v for k, v in changes.items() if k == "codec"}}
        state = _state(rank, seed, **{k: v for k, v in changes.items() if k != "codec"})
        if chunking is None:
            arrayckpt.save(state, path, **options)
        else:
            chunking.save(state, path, **options)

    return _run(save)[1]


def _check(path: Path, seed: int, *, rows: int = ROWS, dtype: torch.dtype = torch.float32, extra: bool = False,
           drop: bool = False, rng_bytes: int = 3, value_key: str = "step") -> None:
    with arrayckpt.open(path) as ckpt:
        assert_bit_equal(ckpt["model.w"].torch(), _full(seed, (rows, COLS), dtype))
        assert ("model.b" in ckpt) is not drop and ("model.extra" in ckpt) is extra
        if not drop:
            assert_bit_equal(ckpt["model.b"].torch(), _full(seed + 1, (8,)))
        assert ckpt.plain_values[value_key] == seed and ckpt.step == seed
        assert [t.tolist() for t in ckpt.per_rank("rng")] == [[r + seed] * rng_bytes for r in range(WORLD)]
        assert ckpt.per_rank("cursor") == [{"offset": 10 * r + seed} for r in range(WORLD)]
    assert arrayckpt.verify(path).ok


def _thread_plan_cache() -> PlanCache:
    """The PlanCache of the saves of ranks run as threads (a group without a torch process group)."""
    return plan_cache_for(Group(0, 1))


def _sent_descriptions(log: list[tuple[int, bool]]) -> list[bool]:
    """Whether each rank sent its description, gather after gather (a gather's entries all precede the next's)."""
    return [sent for i in range(0, len(log), WORLD) for _, sent in sorted(log[i:i + WORLD])]


def test_a_second_save_with_the_same_layout_sends_fingerprints_and_plans_nothing(tmp_path: Path, _fresh_caches):
    log = _save_all(tmp_path / "a", 1)
    assert _sent_descriptions(log) == [True] * WORLD and len(_fresh_caches) == 1
    _check(tmp_path / "a", 1)
    log = _save_all(tmp_path / "b", 2)  # new values, new step, new per-rank values: the same layout
    assert _sent_descriptions(log) == [False] * WORLD and len(_fresh_caches) == 1
    _check(tmp_path / "b", 2)
    _check(tmp_path / "a", 1)


CHANGES = {
    "shape": {"rows": 2 * ROWS},
    "dtype": {"dtype": torch.bfloat16},
    "sharding": {"split": 1},
    "key added": {"extra": True},
    "key removed": {"drop": True},
    "per-rank tensor shape": {"rng_bytes": 5},
    "value key": {"value_key": "epoch"},
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_layout_is_planned_afresh(tmp_path: Path, change: str, _fresh_caches):
    _save_all(tmp_path / "a", 1)
    log = _save_all(tmp_path / "b", 2, **CHANGES[change])
    assert _sent_descriptions(log) == [True] * WORLD and len(_fresh_caches) == 2
    _check(tmp_path / "b", 2, **{k: v for k, v in CHANGES[change].items() if k != "split"})
    log = _save_all(tmp_path / "c", 3, **CHANGES[change])  # and that layout is reused in turn
    assert _sent_descriptions(log) == [False] * WORLD and len(_fresh_caches) == 2
    _check(tmp_path / "c", 3, **{k: v for k, v in CHANGES[change].items() if k != "split"})


def _node_text(path: Path, node: str) -> str:
    """The metadata of ``node`` as JSON text, from the root document (either layout: spec §8, §16.1)."""
    return json.dumps(nodes_of(json.loads((path / "zarr.json").read_text()))[node])


def test_a_changed_codec_or_chunk_policy_is_planned_afresh(tmp_path: Path, _fresh_caches):
    """Ranks cannot see the coordinator's codec and chunk policy: they claim their parts, the coordinator finds its
    layout stale and asks every rank for its description once more."""
    _save_all(tmp_path / "a", 1)
    log = _save_all(tmp_path / "b", 2, codec={"model.*": "zstd"})
    assert _sent_descriptions(log) == [False] * WORLD + [True] * WORLD and len(_fresh_caches) == 2
    _check(tmp_path / "b", 2)
    assert "zstd" in _node_text(tmp_path / "b", "model/w")
    chunking = small_chunks(64, 128)
    _save_all(tmp_path / "c", 3, chunking=chunking, codec={"model.*": "zstd"})
    assert len(_fresh_caches) == 3
    _check(tmp_path / "c", 3)
    assert '"chunk_shape": [2, 6]' in _node_text(tmp_path / "c", "model/w")  # inner chunks
    _save_all(tmp_path / "d", 4, chunking=chunking, codec={"model.*": "zstd"})
    assert len(_fresh_caches) == 3  # the same again: reused
    _check(tmp_path / "d", 4)


def test_one_rank_changing_alone_makes_every_rank_send_its_description(tmp_path: Path, _fresh_caches):
    _save_all(tmp_path / "a", 1)

    def save(rank: int, group: Any) -> None:
        arrayckpt.save(_state(rank, 2, rng_bytes=7 if rank == 2 else 3), tmp_path / "b", process_group=group, step=2)

    _, log = _run(save)
    assert [sent for _, sent in log[:WORLD]].count(True) == 1  # rank 2 only, then everyone
    assert sorted(log[WORLD:]) == [(r, True) for r in range(WORLD)] and len(_fresh_caches) == 2
    with arrayckpt.open(tmp_path / "b") as ckpt:
        assert [len(t) for t in ckpt.per_rank("rng")] == [3, 3, 7, 3]
        assert_bit_equal(ckpt["model.w"].torch(), _full(2))


def test_a_coordinator_that_lost_its_layout_asks_again(tmp_path: Path, _fresh_caches):
    _save_all(tmp_path / "a", 1)
    _thread_plan_cache().forget_layout()  # e.g. the coordinator process restarted
    log = _save_all(tmp_path / "b", 2)
    assert _sent_descriptions(log) == [False] * WORLD + [True] * WORLD and len(_fresh_caches) == 2
    _check(tmp_path / "b", 2)


def test_delta_saves_reuse_the_layout_and_plan_their_own_tasks(tmp_path: Path, _fresh_caches):
    """The delta options never reach the cached layout: what a delta stores depends on what changed, so its tasks
    are planned at every save, on the reused layout, and the full save after it still reuses its parts."""
    _save_all(tmp_path / "a", 1)

    def save(rank: int, group: Any, seed: int, path: Path, base: Path | None) -> None:
        state = _state(rank, 1)
        if seed != 1:  # rank 1's rows of w change, nothing else
            state["model"]["w"].tensor.add_(float(rank == 1))
        arrayckpt.save(state, path, process_group=group, step=1, base=base)

    _, log = _run(lambda r, g: save(r, g, 2, tmp_path / "delta", tmp_path / "a"))
    assert _sent_descriptions(log) == [False] * WORLD and len(_fresh_caches) == 1
    with arrayckpt.open(tmp_path / "delta") as ckpt:
        expected = _full(1)
        expected[4:8] += 1
        assert_bit_equal(ckpt["model.w"].torch(), expected)
        assert ckpt.manifest.entries["model.w"].delta is not None and ckpt.manifest.entries["model.b"].delta is not None
    _, log = _run(lambda r, g: save(r, g, 2, tmp_path / "full", None))
    assert _sent_descriptions(log) == [False] * WORLD and len(_fresh_caches) == 1
    with arrayckpt.open(tmp_path / "full") as ckpt:
        assert ckpt.manifest.entries["model.w"].delta is None
        assert_bit_equal(ckpt["model.w"].torch(), expected)
    assert arrayckpt.verify(tmp_path / "full").ok and arrayckpt.verify(tmp_path / "delta").ok


def test_one_process_reuses_its_layout_too(tmp_path: Path, _fresh_caches):
    for step in range(3):
        arrayckpt.save({"w": torch.full((4,), float(step)), "step": step}, tmp_path / f"s{step}", step=step)
        with arrayckpt.open(tmp_path / f"s{step}") as ckpt:
            assert ckpt["w"].torch().tolist() == [float(step)] * 4 and ckpt.plain_values["step"] == step
    assert len(_fresh_caches) == 1


def test_two_plan_caches_in_one_process_keep_their_own_layouts(tmp_path: Path, _fresh_caches):
    """Two managers (each with its own PlanCache) saving states of different layouts in turn each reuse their own
    layout: neither replaces the other's (with one cache per process, every save here was planned afresh), and the
    process group's PlanCache, used by plain saves, keeps nothing of theirs."""
    from arrayckpt._write.save import save_with

    first, second = SaveSetup(plan_cache=PlanCache()), SaveSetup(plan_cache=PlanCache())
    for step in range(3):
        save_with({"w": torch.full((4,), float(step))}, tmp_path / f"a{step}", SaveOptions(), first)
        save_with({"v": torch.zeros(2, 3), "n": step}, tmp_path / f"b{step}", SaveOptions(), second)
    assert len(_fresh_caches) == 2
    assert first.plan_cache is not None and second.plan_cache is not None
    assert first.plan_cache.layout is not second.plan_cache.layout
    assert _thread_plan_cache().layout is None
    manager = arrayckpt.CheckpointManager(tmp_path / "m")
    assert manager._save_setup.plan_cache is not None and manager._save_setup.plan_cache is not first.plan_cache
    manager.close()
    with arrayckpt.open(tmp_path / "b2") as ckpt:
        assert ckpt["v"].torch().tolist() == [[0.0] * 3] * 2 and ckpt.plain_values["n"] == 2


def _description(**change: Any) -> LocalDescription:
    piece = {"key": "w", "parts": ("w",), "kind": "tensor", "dtype": "float32", "global_shape": (8, 4),
             "box": Box((0, 0), (4, 4)), "replica_id": 0}
    piece.update({k: v for k, v in change.items() if k in piece})
    values = change.get("values", (ValueEntry("step", ("step",), {"int": 1}),))
    per_rank = change.get("per_rank", (ArrayEntry("rng", ("rng",), dtype_by_name("uint8"), (3,)),))
    return LocalDescription((ArrayDescription(**piece),), values, per_rank, change.get("containers", {}))


def test_the_fingerprint_covers_the_layout_and_not_the_values():
    base = fingerprint(_description())
    assert fingerprint(_description(values=(ValueEntry("step", ("step",), {"int": 2}),))) == base
    assert fingerprint(_description(per_rank=(ArrayEntry("rng", ("rng",), dtype_by_name("uint8"), (3,)),))) == base
    assert fingerprint(_description(key="w.0", parts=("w", 0))) != fingerprint(_description(key="w.0",
                                                                                          parts=("w", "0")))
    changed = [
        _description(key="v", parts=("v",)), _description(parts=("w",), key="w"), _description(kind="ndarray"),
        _description(dtype="bfloat16"), _description(global_shape=(8, 5)),
        _description(box=Box((4, 0), (4, 4))), _description(box=Box((0, 0), (2, 4))), _description(replica_id=1),
        _description(values=(ValueEntry("epoch", ("epoch",), {"int": 1}),)),
        _description(values=()),
        _description(per_rank=(ArrayEntry("rng", ("rng",), dtype_by_name("uint8"), (4,)),)),
        _description(per_rank=(ArrayEntry("rng", ("rng",), dtype_by_name("int8"), (3,)),)),
        _description(per_rank=(ValueEntry("rng", ("rng",), {"int": 1}),)),
        _description(containers={"a": "list"}),
    ]
    prints = [fingerprint(d) for d in changed]
    assert prints[1] == base  # the same description built again
    others = [p for i, p in enumerate(prints) if i != 1]
    assert base not in others and len(set(others)) == len(others)


def test_ranks_claiming_a_plan_the_coordinator_no_longer_holds_send_their_descriptions(tmp_path: Path,
                                                                                       _fresh_caches):
    """The coordinator's layout was replaced by an equal one planned elsewhere (another plan id): the ranks' claims
    name the old one, so they are asked for their descriptions, and the equal layout is reused for them."""
    from arrayckpt._write.describe import describe_local, host_view

    _save_all(tmp_path / "a", 1)
    descriptions = [describe_local(_state(r, 2), r, False, host_view).description for r in range(WORLD)]
    cache = _thread_plan_cache()
    cache.forget_layout()
    cache.plan_save(descriptions, None)  # the same fingerprints, planned anew: another plan id
    log = _save_all(tmp_path / "b", 2)
    assert _sent_descriptions(log) == [False] * WORLD + [True] * WORLD and len(_fresh_caches) == 1
    _check(tmp_path / "b", 2)
    log = _save_all(tmp_path / "c", 3)  # every rank now holds its part of that layout
    assert _sent_descriptions(log) == [False] * WORLD and len(_fresh_caches) == 1
    _check(tmp_path / "c", 3)
