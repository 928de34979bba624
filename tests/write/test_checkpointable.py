"""Tensors implementing the CheckpointableTensor protocol (``global_shape``, ``global_offsets``, ``local_offsets``,
``local_sizes``: torch_checkpointing's, which torch is to carry) are saved and loaded as a ``Shard`` is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import arrayckpt
from arrayckpt._torch.shards import is_checkpointable


class Local(torch.Tensor):
    """A local tensor carrying its shard geometry, as a framework's would."""


def local(data: torch.Tensor, global_shape: tuple[int, ...], global_offsets: tuple[tuple[int, ...], ...],
          local_offsets: tuple[tuple[int, ...], ...], local_sizes: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    tensor = data.as_subclass(Local)
    tensor.global_shape, tensor.global_offsets = global_shape, global_offsets
    tensor.local_offsets, tensor.local_sizes = local_offsets, local_sizes
    return tensor


FULL = torch.arange(12.0).reshape(4, 3)


def test_is_recognised_by_its_attributes() -> None:
    assert is_checkpointable(local(torch.zeros(1), (1,), ((0,),), ((0,),), ((1,),)))
    assert not is_checkpointable(torch.zeros(1)) and not is_checkpointable(arrayckpt.Shard(torch.zeros(1), (1,), (0,)))
    torch_checkpointing = pytest.importorskip("torch_checkpointing.checkpointable")
    assert isinstance(local(torch.zeros(1), (1,), ((0,),), ((0,),), ((1,),)), torch_checkpointing.CheckpointableTensor)


def test_a_shard_covering_the_tensor_saves_its_local_region(tmp_path: Path) -> None:
    padded = torch.full((6, 3), -1.0)
    padded[1:5] = FULL  # the shard sits at row 1 of the local tensor
    arrayckpt.save({"w": local(padded, (4, 3), ((0, 0),), ((1, 0),), ((4, 3),))}, tmp_path / "ckpt")
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert torch.equal(ckpt["w"].torch(), FULL)


def test_load_fills_the_local_region_in_place(tmp_path: Path) -> None:
    arrayckpt.save({"w": FULL}, tmp_path / "ckpt")
    padded = torch.full((3, 3), -1.0)
    target = local(padded, (4, 3), ((2, 0),), ((1, 0),), ((2, 3),))  # rows 2..3, at local row 1
    arrayckpt.load({"w": target}, tmp_path / "ckpt")
    assert torch.equal(padded[1:], FULL[2:]) and torch.equal(padded[0], torch.full((3,), -1.0))


def test_several_shards_on_one_rank_are_refused(tmp_path: Path) -> None:
    two = local(FULL.clone(), (4, 3), ((0, 0), (2, 0)), ((0, 0), (2, 0)), ((2, 3), (2, 3)))
    with pytest.raises(arrayckpt.StateError, match="'w': a CheckpointableTensor holding 2 shards on one rank is not "
                       "supported yet"):
        arrayckpt.save({"w": two}, tmp_path / "ckpt")


@pytest.mark.parametrize(("offsets", "sizes", "message"), [
    (((0, 0),), ((5, 3),), "does not fit in its local tensor"),
    (((0, 0),), (("a", 3),), "are not shapes"),
])
def test_bad_geometry_names_the_key(tmp_path: Path, offsets: tuple, sizes: tuple, message: str) -> None:
    with pytest.raises(arrayckpt.StateError, match=f"'w': .*{message}"):
        arrayckpt.save({"w": local(FULL.clone(), (4, 3), ((0, 0),), offsets, sizes)}, tmp_path / "ckpt")


def test_a_shard_outside_the_global_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(arrayckpt.StateError, match="'w': .*does not fit in its global shape"):
        arrayckpt.save({"w": local(FULL.clone(), (4, 3), ((1, 0),), ((0, 0),), ((4, 3),))}, tmp_path / "ckpt")


def _rows_per_rank(rank: int, world: int, path: str) -> list[float]:
    padded = torch.zeros(3, 3)
    padded[1:] = FULL[2 * rank: 2 * rank + 2]
    arrayckpt.save({"w": local(padded, (4, 3), ((2 * rank, 0),), ((1, 0),), ((2, 3),))}, path)
    out = torch.zeros(2, 3)
    arrayckpt.load({"w": local(out, (4, 3), ((2 * (1 - rank), 0),), ((0, 0),), ((2, 3),))}, path)  # the other's
    return out.flatten().tolist()


@pytest.mark.slow
def test_two_ranks_each_holding_half(tmp_path: Path) -> None:
    from dist_helpers import run_ranks

    got = run_ranks(2, _rows_per_rank, str(tmp_path / "ckpt"))
    assert got == [FULL[2:].flatten().tolist(), FULL[:2].flatten().tolist()]
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert torch.equal(ckpt["w"].torch(), FULL)
