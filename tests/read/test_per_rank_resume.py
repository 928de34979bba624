"""A data loader's state saved by 2 data-parallel ranks (spawned, gloo) differs per rank: it is stored per rank, each
rank of a 2-rank load gets its own, and a 1-rank load is refused unless it names a ``per_rank`` policy (the 2026
report: rank 1's position was dropped while the load reported success). Pipeline stages' ``param_groups``, which
differ by stage, save and load at the same size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import run_ranks

import arrayckpt

pytestmark = pytest.mark.slow  # spawns processes, starts a server or runs a foreign stack


def _state(rank: int, position: int) -> dict[str, Any]:
    model = torch.nn.ModuleDict({f"stage{rank}": torch.nn.Linear(2, 2)})  # a pipeline stage's own layer
    optim = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1))
    return {"model": model, "optim": optim, "step": 3,
            "dataloader": {"position": position, "epoch": 1, "shard": f"dp{rank}"}}


def _save(rank: int, world: int, path: str) -> None:
    for step in range(2):  # the second save reuses the first one's layout
        state = _state(rank, 100 * step + 10 * rank + 1)
        arrayckpt.save(state, f"{path}/s{step}", process_group=None)


def _load(rank: int, world: int, path: str) -> tuple[dict[str, Any], float]:
    state = _state(rank, -1)
    state["optim"] = torch.optim.SGD(state["model"].parameters(), lr=1.0)
    arrayckpt.load(state, f"{path}/s1")
    return state["dataloader"], state["optim"].param_groups[0]["lr"]


def test_a_data_loader_state_saved_by_two_ranks_resumes_at_two_and_at_one_with_a_policy(tmp_path: Path) -> None:
    path = str(tmp_path)
    run_ranks(2, _save, path)
    with arrayckpt.open(tmp_path / "s1") as ckpt:
        assert ckpt.per_rank("dataloader.position") == [101, 111]
        assert ckpt.per_rank("dataloader.shard") == ["dp0", "dp1"]
        assert ckpt.plain_values["dataloader.epoch"] == 1 and ckpt.plain_values["step"] == 3  # agree: one entry
    loaded = run_ranks(2, _load, path)
    assert [d for d, _ in loaded] == [{"position": 101, "epoch": 1, "shard": "dp0"},
                                      {"position": 111, "epoch": 1, "shard": "dp1"}]
    assert [lr for _, lr in loaded] == [pytest.approx(0.1), pytest.approx(0.2)]  # each stage its own param_groups

    state = {"dataloader": {"position": -1, "epoch": 0, "shard": ""}}  # one rank: no process group
    with pytest.raises(arrayckpt.StateError, match=r"'dataloader.position' was saved per rank at world size 2 and is "
                                                   r"loaded at world size 1.*per_rank="):
        arrayckpt.load(state, tmp_path / "s1", strict=False)
    assert state["dataloader"] == {"position": -1, "epoch": 0, "shard": ""}
    arrayckpt.load(state, tmp_path / "s1", strict=False, per_rank={"dataloader.*": "rank0"})
    assert state["dataloader"] == {"position": 101, "epoch": 1, "shard": "dp0"}
