"""Property: any sharding at save, any other at load, every element comes back bit-exact."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import assert_bit_equal, random_tensor
from hypothesis import given, settings
from hypothesis import strategies as st
from policies import small_chunks
from thread_ranks import run_thread_ranks

import arrayckpt
from arrayckpt._torch.dtypes import dtype_of_torch, torch_view

pytestmark = pytest.mark.usefixtures("storage_layout")  # every test holds in both layouts (spec §2, §16)


@st.composite
def partitions(draw, shape: tuple[int, ...], max_boxes: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """A grid partition of ``shape`` into at most ``max_boxes`` boxes (offset, shape)."""
    cuts = []
    budget = max_boxes
    for n in shape:
        k = draw(st.integers(1, max(1, min(n, budget))))
        inner = sorted(draw(st.sets(st.integers(1, n - 1), min_size=k - 1, max_size=k - 1))) if n > 1 else []
        k = len(inner) + 1
        budget //= k
        cuts.append([0, *inner, n])
    boxes = [((), ())]
    for bounds in cuts:
        boxes = [(o + (a,), s + (b - a,)) for o, s in boxes for a, b in zip(bounds, bounds[1:], strict=False)]
    return boxes


@st.composite
def scenarios(draw):
    shape = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
    ranks = draw(st.integers(1, 4))
    saved = draw(partitions(shape, ranks))
    loaded = draw(partitions(shape, 6))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int16, torch.uint8]))
    codec = draw(st.sampled_from([None, None, "zstd"]))
    return shape, ranks, saved, loaded, dtype, codec


SMALL = small_chunks(16, 64)


@settings(max_examples=40, deadline=None)
@given(scenarios())
def test_any_sharding_round_trips_through_any_other(scenario):
    shape, ranks, saved, loaded, dtype, codec = scenario
    full = random_tensor(shape, dtype, seed=math.prod(shape))
    root = Path(tempfile.mkdtemp())
    try:
        path = root / "ckpt"

        def save_rank(rank: int, group) -> None:
            offset, size = saved[rank % len(saved)]  # ranks beyond the boxes hold replicas
            local = full[tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))].clone()
            piece = arrayckpt.Shard(local, shape, offset, replica_id=rank // len(saved))
            SMALL.save({"t": piece, "step": 3}, path, codec=codec, process_group=group)

        run_thread_ranks(ranks, save_rank)
        opened = arrayckpt.open(path)
        assert_bit_equal(opened["t"].torch(), full)
        for offset, size in loaded:
            region = tuple(slice(o, o + n) for o, n in zip(offset, size, strict=True))
            target = {"t": arrayckpt.Shard(torch.zeros(size, dtype=dtype), shape, offset)}
            arrayckpt.load(target, path, strict=False)
            assert_bit_equal(target["t"].tensor, full[region])
            assert_bit_equal(torch_view(opened["t"][region], dtype_of_torch(dtype, "t")), full[region])
    finally:
        shutil.rmtree(root)


def test_thread_ranks_refuse_gaps_on_every_rank(tmp_path):
    def save_rank(rank: int, group) -> str:
        piece = arrayckpt.Shard(torch.zeros(2), (6,), (4 * rank,))  # rows 0-1 and 4-5 of 6: rows 2-3 missing
        with pytest.raises(arrayckpt.StateError, match=r"no rank holds the region from \[2\] to \[4\]"):
            arrayckpt.save({"t": piece}, tmp_path / "ckpt", process_group=group)
        return "refused"

    assert run_thread_ranks(2, save_rank) == ["refused", "refused"]
    assert list(tmp_path.iterdir()) == []
