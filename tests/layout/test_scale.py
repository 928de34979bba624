"""Planning at scale: the vectorised planner against brute force, each rank's part of the plan, the benchmark's
simulation, and the root document read once by many ranks on object storage."""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_helpers import run_ranks
from helpers import assert_bit_equal

import arrayckpt
import arrayckpt._layout.box as box_module
from arrayckpt._layout.box import Box, cover_problem, distinct_rows
from arrayckpt._layout.chunking import ChunkPolicy
from arrayckpt._layout.rankplan import expand, rank_layouts
from arrayckpt._layout.saveplan import ArrayDescription, LocalDescription, plan_save

pytestmark = pytest.mark.slow  # spawns processes, starts a server or runs a foreign stack

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


# --- the geometry ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mix", [None, 0], ids=["hashed", "every-hash-collides"])
def test_distinct_rows_groups_identical_rows_in_order_of_their_first(monkeypatch: pytest.MonkeyPatch, mix: Any):
    if mix is not None:  # every row hashes alike: the exact sort must take over
        monkeypatch.setattr(box_module, "_MIX", np.uint64(mix))
    rows = np.random.default_rng(1).integers(0, 4, (3000, 3))
    order, starts, counts = distinct_rows([rows[:, 0], rows[:, 1:]])
    groups = [order[s:s + n].tolist() for s, n in zip(starts, counts, strict=True)]
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    assert all(g == sorted(g) and (rows[g] == rows[g[0]]).all() for g in groups)
    assert len(groups) == len({tuple(r) for r in rows.tolist()}) and sorted(sum(groups, [])) == list(range(3000))


def _brute_cover(shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray:
    cover = np.zeros(shape, np.int64)
    for b in boxes:
        cover[b.slices()] += 1
    return cover


def test_cover_problem_agrees_with_brute_force_on_random_boxes():
    rng = np.random.default_rng(2)
    for _ in range(300):
        shape = tuple(int(n) for n in rng.integers(1, 7, int(rng.integers(1, 4))))
        boxes = []
        for _ in range(int(rng.integers(0, 6))):
            offset = tuple(int(rng.integers(0, n)) for n in shape)
            extent = tuple(int(rng.integers(1, n - o + 1)) for o, n in zip(offset, shape, strict=True))
            boxes.append(Box(offset, extent))
        boxes = list(dict.fromkeys(boxes))
        offsets = np.array([b.offset for b in boxes], np.int64).reshape(-1, len(shape))
        shapes = np.array([b.shape for b in boxes], np.int64).reshape(-1, len(shape))
        problem = cover_problem(shape, offsets, shapes)
        cover = _brute_cover(shape, boxes)
        if (cover > 1).any():
            assert problem is not None and problem.what == "overlap" and len(problem.boxes) >= 2
        elif (cover == 0).any():
            assert problem is not None and problem.what == "gap"
            assert (cover[tuple(slice(a, b) for a, b in zip(problem.start, problem.stop, strict=True))] == 0).all()
        else:
            assert problem is None


def test_a_box_outside_its_tensor_is_refused():
    descriptions = [LocalDescription(arrays=(ArrayDescription("w", ("w",), "tensor", "float32", (4,), Box(o, s), 0),))
                    for o, s in (((0,), (2,)), ((2,), (3,)))]
    with pytest.raises(arrayckpt.StateError, match=r"'w' of shape \[4\]: rank\(s\) \[1\] hold offset \[2\] shape "
                                                   r"\[3\], which reaches outside it"):
        plan_save(descriptions, None)


# --- the planner on random layouts ------------------------------------------------------------------------------


def _random_layout(rng: np.random.Generator, world: int) -> tuple[list[LocalDescription], dict[str, tuple]]:
    """Tensors split on a random grid (dimension by dimension, torch.chunk-style or arbitrary cuts), pieces dealt
    to ranks, some replicated on several ranks, some ranks holding nothing of a tensor."""
    pieces: list[list[ArrayDescription]] = [[] for _ in range(world)]
    tensors = {}
    for t in range(int(rng.integers(1, 5))):
        shape = tuple(int(n) for n in rng.integers(1, 13, int(rng.integers(0, 3))))
        dtype = ["float32", "bfloat16", "int64"][t % 3]
        cuts = [sorted({0, n, *(int(c) for c in rng.integers(1, max(2, n), int(rng.integers(0, 3))))})
                for n in shape]
        cells = list(itertools.product(*[zip(c[:-1], c[1:], strict=True) for c in cuts]))
        tensors[f"t{t}"] = (shape, dtype)
        for cell in cells:
            box = Box(tuple(a for a, _ in cell), tuple(b - a for a, b in cell))
            holders = rng.choice(world, size=int(rng.integers(1, world + 1)), replace=False)
            for replica, rank in enumerate(sorted(holders.tolist())):
                pieces[rank].append(ArrayDescription(f"t{t}", (f"t{t}",), "tensor", dtype, shape, box, replica))
    descriptions = []
    for held in pieces:
        seen: set[str] = set()  # a rank holds one piece of a key
        descriptions.append(LocalDescription(arrays=tuple(p for p in held if not (p.key in seen or seen.add(p.key)))))
    return descriptions, tensors


def test_random_layouts_are_planned_like_brute_force_says():
    """Valid layouts: every element written exactly once, by a rank holding it, in whole outer chunks, and each
    rank's compact part expands to exactly its tasks. Invalid ones (a piece left out): refused."""
    rng = np.random.default_rng(3)
    policy = ChunkPolicy(inner_chunk_bytes=8, outer_chunk_bytes=16, min_inner_chunk_bytes=4, smallest_chunk_bytes=1)
    checked = refused = 0
    for _ in range(150):
        world = int(rng.integers(1, 6))
        descriptions, tensors = _random_layout(rng, world)
        boxes = {k: {p.box for d in descriptions for p in d.arrays if p.key == k and p.box.size} for k in tensors}
        covers = {k: _brute_cover(s, list(boxes[k])) for k, (s, _) in tensors.items()}
        valid = all(((c == 1).all() if c.size else True) for c in covers.values())
        try:
            plan = plan_save(descriptions, None, policy)
        except arrayckpt.StateError as e:
            assert not valid, e
            refused += 1
            continue
        assert valid
        checked += 1
        written = {k: np.zeros(s, np.int64) for k, (s, _) in tensors.items()}
        parts = rank_layouts(plan.layout)
        for rank, tasks in enumerate(plan.tasks):
            part = expand(parts[rank], descriptions[rank], rank, "default")
            assert part.tasks == tasks and all(plan.arrays[p] == a for p, a in part.arrays.items())
            held = {p.key: p.box for p in descriptions[rank].arrays}
            for task in tasks:
                written[task.key][task.box.slices()] += 1
                assert task.box.intersect(held[task.key]) == task.box or task.box.size == 0
                outer = plan.arrays[task.path].outer_chunk
                for o, n, c, total in zip(task.box.offset, task.box.shape, outer, tensors[task.key][0],
                                          strict=True):
                    assert o % c == 0 and ((o + n) % c == 0 or o + n == total)
        for key, count in written.items():
            assert (count == 1).all(), key
        sizes = {k: np.dtype({"bfloat16": np.uint16}.get(d, d)).itemsize for k, (_, d) in tensors.items()}
        assert sum(plan.bytes_by_rank) == sum(int(np.prod(s)) * sizes[k] for k, (s, _) in tensors.items())
    assert checked > 30 and refused > 10


# --- each rank's part of the plan --------------------------------------------------------------------------------


def _scale_module(monkeypatch: pytest.MonkeyPatch, layers: int) -> Any:
    spec = importlib.util.spec_from_file_location("scale_benchmark", BENCHMARKS / "scale.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "scale_benchmark", module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LAYERS", layers)
    return module


def test_the_plan_a_rank_receives_does_not_grow_with_the_world(monkeypatch: pytest.MonkeyPatch):
    """The benchmark's Llama-like state with one layer per pipeline stage: 256 and 512 ranks hold the same number of
    pieces each, and every rank's reply is as big at both (the whole plan was broadcast before: it doubled)."""
    scale = _scale_module(monkeypatch, 16)
    sizes = {}
    for ranks in (256, 512):
        result = scale.run_arrayckpt(ranks, scale.mesh(ranks), scale.specs())
        assert result["pieces"] == ranks * 27 + ranks // 16 * (3 + 6)  # a layer; the embedding; norm and output
        sizes[ranks] = (result["plan_bytes_per_rank"], result["replan_bytes_per_rank"],
                        result["replan_report_bytes_per_rank"])
    assert sizes[256] == sizes[512], sizes
    assert sizes[256][1] < 200  # a reused plan: "keep your part" and where to write


def test_the_benchmark_runs_and_ends_with_its_summary_line(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path):
    scale = _scale_module(monkeypatch, 4)
    scale.main(["--ranks", "64", "--json", str(tmp_path / "out.json")])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"scale: ranks=64 plan_s=[\d.]+ dcp_plan_s=[\d.]+ ratio=[\d.]+ peak_mib=\d+ "
                        r"plan_bytes_per_rank=\d+ replan_s=[\d.]+", last), last
    assert (tmp_path / "out.json").exists()


# --- the root document, read once ------------------------------------------------------------------------------


ROOT_RANKS = 8


def _load_twice(rank: int, world: int, urls: tuple[str, str], endpoint: str) -> None:
    """Load the same state from two prefixes: the root document shared, then read by every rank."""
    expected = torch.arange(64.0).reshape(16, 4)
    for url, share in zip(urls, (True, False), strict=True):
        target = {"w": arrayckpt.Shard(torch.zeros(1, 4), (16, 4), (rank, 0)), "step": 0}
        arrayckpt.load(target, url, storage_options={"endpoint_url": endpoint}, share_root=share)
        assert_bit_equal(target["w"].tensor, expected[rank:rank + 1])
        assert target["step"] == 5


def test_eight_ranks_read_the_root_document_once(s3_server: Any, s3_proxy: Any, s3_bucket: str):
    """On object storage the coordinator reads the root zarr.json and sends it; each rank checks its SHA-256 on
    the bytes it got. (Every rank still asks once, after reading, whether the checkpoint was replaced meanwhile: a
    conditional GET that transfers no body while it was not.)"""
    urls = (f"s3://{s3_bucket}/shared", f"s3://{s3_bucket}/each")
    for url in urls:
        arrayckpt.save({"w": torch.arange(64.0).reshape(16, 4), "step": 5}, url,
                       storage_options={"endpoint_url": s3_server.endpoint})
    s3_proxy.reset()
    run_ranks(ROOT_RANKS, _load_twice, urls, s3_proxy.endpoint)
    shared = s3_proxy.count("GET", path_contains=f"/{s3_bucket}/shared/zarr.json")
    each = s3_proxy.count("GET", path_contains=f"/{s3_bucket}/each/zarr.json")
    assert (shared, each) == (1 + ROOT_RANKS, 2 * ROOT_RANKS), (shared, each)


def test_a_root_document_damaged_on_the_way_is_refused_by_the_rank_that_got_it(tmp_path: Path):
    from arrayckpt._storage import parse_location
    from arrayckpt._storage.shared import opened_from_bytes

    arrayckpt.save({"w": torch.ones(2)}, tmp_path / "c")
    data = (tmp_path / "c" / "zarr.json").read_bytes()
    location = parse_location(tmp_path / "c")
    assert opened_from_bytes(location, data, None)[0]["attributes"]["arrayckpt"]["entries"]
    with pytest.raises(arrayckpt.CorruptCheckpointError):
        opened_from_bytes(location, data.replace(b'"float32"', b'"float64"', 1), None)
