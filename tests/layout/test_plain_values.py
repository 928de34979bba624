"""Plain values that every rank saves are stored once (the lowest holding rank's): one that differs between ranks
would lose the others' silently, so the save is refused on every rank, whether the layout is planned afresh or
reused (spec §5.3); a value each rank has its own of goes in ``arrayckpt.PerRank``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from thread_ranks import run_thread_ranks

import arrayckpt


def _save(path: Path, loader_offset: int, group, **extra) -> None:
    arrayckpt.save({"w": torch.ones(2), "epoch": 3, "loader": {"offset": loader_offset}, **extra}, path,
                   process_group=group, overwrite=True)


def test_a_plain_value_that_differs_between_ranks_is_refused_on_every_rank(tmp_path: Path) -> None:
    def save_rank(rank: int, group) -> str:
        with pytest.raises(arrayckpt.StateError, match=r"plain value 'loader.offset' differs between ranks "
                                                       r"\(rank 0: 0, rank 1: 1000\).*arrayckpt.PerRank"):
            _save(tmp_path / "ckpt", 1000 * rank, group)
        return "refused"

    assert run_thread_ranks(2, save_rank) == ["refused", "refused"]
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_values_that_agree_are_stored_once_and_per_rank_values_keep_every_rank(tmp_path: Path) -> None:
    def save_rank(rank: int, group) -> None:
        _save(tmp_path / "ckpt", 7, group, rng=arrayckpt.PerRank({"offset": 1000 * rank}))

    run_thread_ranks(2, save_rank)
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert ckpt.plain_values["loader.offset"] == 7 and ckpt.plain_values["epoch"] == 3
        assert ckpt.per_rank("rng") == [{"offset": 0}, {"offset": 1000}]


def test_a_value_that_starts_to_differ_on_a_reused_layout_is_refused(tmp_path: Path) -> None:
    """The second save reuses the first one's layout: a rank then sends only the values it owns, and a digest of
    the others, which the coordinator compares with what their owner sent."""
    def save_rank(rank: int, group) -> list[str]:
        seen = []
        for step in range(3):
            offset = 100 * step + (rank if step == 2 else 0)  # equal on both ranks, then not
            try:
                _save(tmp_path / f"s{step}", offset, group)
                seen.append("saved")
            except arrayckpt.StateError as e:
                assert "rank 1 holds a plain value that differs" in str(e) and "'loader.offset'" in str(e), e
                seen.append("refused")
        return seen

    assert run_thread_ranks(2, save_rank) == [["saved", "saved", "refused"]] * 2
    with arrayckpt.open(tmp_path / "s1") as ckpt:
        assert ckpt.plain_values["loader.offset"] == 100
    assert not (tmp_path / "s2").exists()
