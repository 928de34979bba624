"""Plain values that differ between ranks are stored per rank, never the lowest rank's alone (spec §5.3 item 3):
planned afresh or on a reused layout; values that agree stay one entry; each rank loads its own back, and a load at
another world size needs a ``per_rank`` policy (ranks as threads here; spawned gloo ranks:
``tests/read/test_per_rank_resume.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from thread_ranks import run_thread_ranks

import arrayckpt
import arrayckpt._write.save as save_module
from arrayckpt._format.manifest import PerRankEntry, ValueEntry
from arrayckpt._write.exchange import forget_plan_caches


@pytest.fixture(autouse=True)
def planned(monkeypatch: pytest.MonkeyPatch) -> Any:
    """No layout left by another test; count the layouts planned."""
    forget_plan_caches()
    count: list[int] = []
    plan_layout = save_module.plan_layout

    def counting(*args: Any, **kwargs: Any) -> Any:
        count.append(1)
        return plan_layout(*args, **kwargs)

    monkeypatch.setattr(save_module, "plan_layout", counting)
    yield count
    forget_plan_caches()


def _state(rank: int, offset: int) -> dict[str, Any]:
    return {"w": torch.ones(2), "epoch": 3, "loader": {"offset": offset, "seed": 5}}


def _kinds(path: Path) -> dict[str, str]:
    with arrayckpt.open(path) as ckpt:
        return {key: type(entry).__name__ for key, entry in ckpt.manifest.entries.items()}


def test_values_that_agree_stay_one_entry_and_values_that_differ_are_kept_for_every_rank(tmp_path: Path) -> None:
    run_thread_ranks(2, lambda rank, group: arrayckpt.save(_state(rank, 1000 * rank), tmp_path / "ckpt",
                                                           process_group=group))
    assert _kinds(tmp_path / "ckpt") == {"w": "ArrayEntry", "epoch": "ValueEntry", "loader.offset": "PerRankEntry",
                                         "loader.seed": "ValueEntry"}
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert ckpt.plain_values == {"epoch": 3, "loader.seed": 5}
        assert ckpt.per_rank("loader.offset") == [0, 1000]  # the world size it was saved at: one item per rank

    def load(rank: int, group: Any) -> Any:
        state = _state(rank, -1)
        arrayckpt.load(state, tmp_path / "ckpt", process_group=group)
        return state["loader"]

    assert run_thread_ranks(2, load) == [{"offset": 0, "seed": 5}, {"offset": 1000, "seed": 5}]


def test_a_value_that_starts_to_differ_on_a_reused_layout_is_stored_per_rank(tmp_path: Path, planned: Any) -> None:
    """The second save reuses the first one's layout: each rank sends the values it owns and a digest of the others,
    which no longer matches; the coordinator plans afresh from every rank's values. The third save reuses that
    layout (every rank sends the value that varies), and a fourth in which the ranks agree again stores one value."""
    offsets = [(7, 7), (100, 101), (200, 201), (9, 9)]

    def save(rank: int, group: Any) -> None:
        for step, pair in enumerate(offsets):
            arrayckpt.save(_state(rank, pair[rank]), tmp_path / f"s{step}", process_group=group)

    run_thread_ranks(2, save)
    assert len(planned) == 2  # the first save, and the second once a value was found to differ
    with arrayckpt.open(tmp_path / "s0") as first, arrayckpt.open(tmp_path / "s3") as last:
        assert first.plain_values["loader.offset"] == 7 and last.plain_values["loader.offset"] == 9
    for step in (1, 2):
        with arrayckpt.open(tmp_path / f"s{step}") as ckpt:
            assert ckpt.per_rank("loader.offset") == list(offsets[step])
            assert ckpt.plain_values == {"epoch": 3, "loader.seed": 5}


def test_a_value_only_some_ranks_hold_is_none_for_the_others(tmp_path: Path) -> None:
    def save(rank: int, group: Any) -> None:
        state: dict[str, Any] = {"w": torch.ones(2)}
        if rank > 0:  # the last pipeline stages, say
            state["stage"] = {"name": f"stage{rank}"}
        arrayckpt.save(state, tmp_path / "ckpt", process_group=group)

    run_thread_ranks(3, save)
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        entry = ckpt.manifest.entries["stage.name"]
        assert isinstance(entry, PerRankEntry) and ckpt.per_rank("stage.name") == [None, "stage1", "stage2"]


def test_optimizer_param_groups_that_differ_by_pipeline_stage_save_and_load_at_the_same_size(tmp_path: Path) -> None:
    """Pipeline parallelism: each stage's optimizer has its own parameters, so ``param_groups`` differs by rank."""
    def stage(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(rank)  # stage r: r + 1 layers of its own
        model = torch.nn.ModuleDict({f"layer{rank}_{i}": torch.nn.Linear(2, 2) for i in range(rank + 1)})
        return model, torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1))

    def save(rank: int, group: Any) -> None:
        model, optim = stage(rank)
        arrayckpt.save({"model": model, "optim": optim}, tmp_path / "ckpt", process_group=group)

    def load(rank: int, group: Any) -> Any:
        model, _ = stage(rank)
        optim = torch.optim.SGD(model.parameters(), lr=1.0)
        arrayckpt.load({"model": model, "optim": optim}, tmp_path / "ckpt", process_group=group)
        group_ = optim.state_dict()["param_groups"][0]
        return group_["lr"], group_["params"]

    run_thread_ranks(2, save)
    assert _kinds(tmp_path / "ckpt")["optim.param_groups"] == "PerRankEntry"
    assert run_thread_ranks(2, load) == [(pytest.approx(0.1), [0, 1]), (pytest.approx(0.2), [0, 1, 2, 3])]


def test_a_load_at_another_world_size_needs_a_policy(tmp_path: Path) -> None:
    run_thread_ranks(2, lambda rank, group: arrayckpt.save(_state(rank, 1000 * rank + 1), tmp_path / "ckpt",
                                                           process_group=group))
    state = {**_state(0, -1), "w": torch.zeros(2)}
    with pytest.raises(arrayckpt.StateError, match=r"'loader.offset' was saved per rank at world size 2 and is loaded "
                                                   r"at world size 1.*per_rank=\{'loader.offset': 'rank0'\}"):
        arrayckpt.load(state, tmp_path / "ckpt")
    assert state["loader"] == {"offset": -1, "seed": 5} and state["w"].tolist() == [0, 0]  # untouched
    arrayckpt.load(state, tmp_path / "ckpt", per_rank={"loader.*": "rank0"})
    assert state["loader"] == {"offset": 1, "seed": 5}
    state["loader"]["offset"] = -1
    arrayckpt.load(state, tmp_path / "ckpt", per_rank="keep")
    assert state["loader"] == {"offset": -1, "seed": 5}
    seen = []

    def total(key: str, values: list[Any], rank: int, world: int) -> int:
        seen.append((key, values, rank, world))
        return sum(values)

    arrayckpt.load(state, tmp_path / "ckpt", per_rank={"other.*": "keep", "loader.off*": total})
    assert state["loader"]["offset"] == 1002 and seen == [("loader.offset", [1, 1001], 0, 1)]
    with pytest.raises(arrayckpt.StateError, match="per_rank=.*must be one of"):
        arrayckpt.load(state, tmp_path / "ckpt", per_rank={"loader.*": "rank1"})  # type: ignore[dict-item]


def test_a_load_at_more_ranks_than_the_save_had(tmp_path: Path) -> None:
    """One rank saved: its values are single values, which every rank of a larger group takes; an explicit PerRank
    value saved by one rank follows the policy too."""
    arrayckpt.save({**_state(0, 4), "cursor": arrayckpt.PerRank({"pos": 8})}, tmp_path / "ckpt")
    assert _kinds(tmp_path / "ckpt")["loader.offset"] == "ValueEntry"

    def load(rank: int, group: Any, **options: Any) -> Any:
        state = {**_state(rank, -1), "cursor": arrayckpt.PerRank(None)}
        arrayckpt.load(state, tmp_path / "ckpt", process_group=group, **options)
        return state["loader"]["offset"], state["cursor"].value

    with pytest.raises(arrayckpt.StateError, match="'cursor' was saved per rank at world size 1 and is loaded at "
                                                   "world size 2.*PerRank\\(value, rank=r\\)"):
        run_thread_ranks(2, load)
    assert run_thread_ranks(2, lambda r, g: load(r, g, per_rank="rank0")) == [(4, {"pos": 8})] * 2


def test_manager_restore_takes_the_policy(tmp_path: Path) -> None:
    def save(rank: int, group: Any) -> None:
        manager = arrayckpt.CheckpointManager(tmp_path / "run", process_group=group)
        manager.save(1, _state(rank, 10 + rank))
        manager.close()

    run_thread_ranks(2, save)
    manager = arrayckpt.CheckpointManager(tmp_path / "run")
    state = _state(0, -1)
    with pytest.raises(arrayckpt.StateError, match="'loader.offset' was saved per rank at world size 2"):
        manager.restore(state)
    assert manager.restore(state, per_rank={"loader.*": "rank0"}) == 1 and state["loader"]["offset"] == 10
    manager.close()


def test_identical_values_plan_no_per_rank_entry() -> None:
    from arrayckpt._layout.saveplan import plan_save
    from arrayckpt._write.describe import describe_local, host_view

    states = [{"w": torch.ones(2), "cfg": {"lr": 0.1, "betas": (0.9, 0.95)}} for _ in range(4)]
    planned = plan_save([describe_local(s, r, False, host_view).description for r, s in enumerate(states)], None)
    assert all(isinstance(planned.entries[k], ValueEntry) for k in ("cfg.lr", "cfg.betas"))
    assert planned.layout is not None and planned.layout.values.sent == (("cfg.lr", "cfg.betas"), (), (), ())
