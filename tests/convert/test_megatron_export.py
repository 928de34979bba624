"""arrayckpt to Megatron-Core ``torch_dist`` (``convert ... --to megatron``), judged by Megatron's own loader.

Megatron-Core 0.16 on CPU with gloo, in one spawned job shared by the module (``jobs`` fixture): on 2 ranks, then
on rank 0 alone in a process group of one. At each tensor-parallel degree it saves the same model-plus-optimizer
state with ``megatron.core.dist_checkpointing.save`` (TP=2: column-, row- and vocab-parallel weights of two layers,
a layer axis prepended as Megatron's transformer layers do; a replicated norm, an int64 counter and a 0-d step; a
ShardedObject per rank; ``common.pt`` items, a tensor among them), rank 0 converts that save to arrayckpt and back
to Megatron, and every rank loads the result with ``dist_checkpointing.load`` and the sharded state dict a model of
its degree builds (``ShardedTensor.from_rank_offsets``, as Megatron's own dist-checkpointing tests do where no
model is built). The 1-rank phase also loads the 2-rank export, and both load an export of a checkpoint arrayckpt
saved itself (its keys nested as ``arrayckpt.save`` nests them). What each rank loaded comes back here and is
compared bit for bit with the state it was saved from; then each export is converted back into arrayckpt and
compared with the arrayckpt checkpoint it came from. ``torch.cuda.synchronize`` and ``torch.cuda.current_device``,
which Megatron's save calls even on CPU, are stubbed in the job (``tests/convert/test_megatron.py`` explains them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import weakref
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_helpers import run_ranks
from helpers import assert_bit_equal, random_tensor

import arrayckpt

needs_megatron = pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                    reason="megatron-core is not installed")

LAYERS = 2
FC1, PROJ = "decoder.layers.mlp.linear_fc1.weight", "decoder.layers.self_attention.linear_proj.weight"
EMB, NORM = "embedding.word_embeddings.weight", "decoder.final_layernorm.weight"
MOMENT, TOKENS, STEP = f"optimizer.state.exp_avg.{FC1}", "tokens_seen", "optimizer.state.step"
CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
          "common_backend_version": 1}


def _full() -> dict[str, torch.Tensor]:
    """The global tensors (random bits, NaN patterns included)."""
    return {FC1: random_tensor((LAYERS, 8, 5), torch.float32, 1), PROJ: random_tensor((LAYERS, 5, 8), torch.float32, 2),
            EMB: random_tensor((6, 4), torch.bfloat16, 3), NORM: random_tensor((5,), torch.float32, 4),
            MOMENT: random_tensor((LAYERS, 8, 5), torch.float32, 5), TOKENS: torch.tensor([3, 2**40]),
            STEP: torch.tensor(7.0)}


def _common(with_tensor: bool = True) -> dict[str, Any]:
    """The state's non-sharded part (``common.pt``); Megatron-LM's fp16 grad scaler keeps its scale as a tensor."""
    scaler: dict[str, Any] = {"growth_tracker": 2}
    if with_tensor:
        scaler["scale"] = torch.tensor(65536.0)
    return {"iteration": 7, "checkpoint_version": 3.0, "opt_param_scheduler": {"num_steps": 56, "max_lr": 3e-4},
            "optimizer": {"param_groups": [{"lr": 3e-4, "params": [0, 1]}], "grad_scaler": scaler}}


def _rng(rank: int) -> dict[str, Any]:
    return {"seed": 1234 + rank, "offsets": [rank, 7]}


def _sharded(rank: int, tp: int, full: dict[str, torch.Tensor], saved_tp: int | None = None,
             build: bool = True) -> dict[str, Any]:
    """The sharded state dict a model and optimizer at tensor-parallel degree ``tp`` build on TP rank ``rank``:
    per layer, fc1 split on its output rows, proj on its input columns (the layer axis prepended), the embedding on
    its vocabulary rows; the rest replicated (rank 0 the main replica); the RNG states of a save at ``saved_tp``
    (default ``tp``; ShardedObjects do not reshard: one rank loading a 2-rank save asks for both). Without
    ``build``: the data alone, where each ShardedTensor and ShardedObject would be (what a load returns)."""
    if build:
        from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

        tensor, obj = ShardedTensor.from_rank_offsets, ShardedObject
    else:
        def tensor(key: str, data: torch.Tensor, *offsets: Any, **options: Any) -> torch.Tensor:
            return data

        def obj(key: str, data: Any, *shape_and_offset: Any, **options: Any) -> Any:
            return data

    def part(t: torch.Tensor, axis: int) -> torch.Tensor:
        return t.chunk(tp, axis)[rank].clone()

    def layer(key: str, number: int, axis: int) -> Any:
        return tensor(key, part(full[key][number], axis), (0, number, LAYERS), (axis + 1, rank, tp), prepend_axis_num=1)

    def replicated(key: str) -> Any:
        return tensor(key, full[key].clone(), replica_id=rank)

    shards = saved_tp or tp
    objects = [obj("rng_state", _rng(r), (shards,), (r,), replica_id=0) for r in range(rank, shards, tp)]
    return {
        "model": {
            "embedding": tensor(EMB, part(full[EMB], 0), (0, rank, tp)),
            "layers": [{"fc1": layer(FC1, n, 0), "proj": layer(PROJ, n, 1)} for n in range(LAYERS)],
            "final_layernorm": replicated(NORM),
        },
        "optimizer": {"state": {"exp_avg": [layer(MOMENT, n, 0) for n in range(LAYERS)], "step": replicated(STEP)}},
        "tokens_seen": replicated(TOKENS),
        "rng_state": objects[0] if len(objects) == 1 else objects,
    }


def _loaded(rank: int, tp: int, saved_tp: int | None = None, common: bool = True) -> dict[str, Any]:
    """What Megatron's load at TP=``tp`` returns on ``rank``: common.pt's items and this rank's data."""
    return _merged(_common(common), _sharded(rank, tp, _full(), saved_tp, build=False))


def _merged(common: dict[str, Any], sharded: dict[str, Any]) -> dict[str, Any]:
    out = dict(common)
    for k, v in sharded.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _native() -> dict[str, Any]:
    """The same state as arrayckpt saves it from a training script: keys nested on their dots, the RNG shards as
    the lists Megatron stores, values where they are (no tensor among them: every array becomes a ShardedTensor)."""
    state: dict[str, Any] = _common(with_tensor=False)
    for key, tensor in _full().items():
        *path, last = key.split(".")
        node = state
        for part in path:
            node = node.setdefault(part, {})
        node[last] = tensor
    return state | {f"rng_state/shard_{r}_2": [_rng(r)] for r in range(2)}


def _save_convert_load(rank: int, world: int, base: Path) -> dict[str, Any]:
    """Save at TP=``world``, convert (rank 0) to arrayckpt and back to Megatron, load every export there is."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    saved, ckpt, export = base / f"megatron_tp{world}", base / f"arrayckpt_tp{world}", base / f"export_tp{world}"
    if rank == 0:
        saved.mkdir()
    dist.barrier()
    dist_checkpointing.save(_merged(_common(), _sharded(rank, world, _full())), str(saved))
    if rank == 0:
        arrayckpt.convert(saved, ckpt)
        arrayckpt.convert(ckpt, export, to_format="megatron")
    dist.barrier()
    empty = {k: torch.empty_like(v) for k, v in _full().items()}
    return {p.name: dist_checkpointing.load(_sharded(rank, world, empty, 1 if p.name == "export_tp1" else 2), str(p))
            for p in sorted(base.glob("export_*"))}


def _job(rank: int, world: int, root: str) -> None:
    """On 2 ranks; then rank 0 alone, in a process group of one (one spawn for both degrees). What each rank loaded
    goes to ``loaded-<rank>.pt`` (tensors through the spawn's queue would need the rank alive until read)."""
    import torch.distributed as dist
    from dist_helpers import free_port

    torch.cuda.synchronize = lambda *args, **kwargs: None  # see the module docstring
    torch.cuda.current_device = lambda: "cpu"
    results = {2: _save_convert_load(rank, world, Path(root))}
    if rank == 0:  # rank 1 is done (its group is destroyed when it returns)
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        results[1] = _save_convert_load(0, 1, Path(root))
    torch.save(results, Path(root) / f"loaded-{rank}.pt")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, list[dict[str, Any]]]]:
    """An arrayckpt-saved state exported, then the job: what each rank loaded, by world size."""
    root = tmp_path_factory.mktemp("megatron_export")
    arrayckpt.save(_native(), root / "native")
    arrayckpt.convert(root / "native", root / "export_native", to_format="megatron")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(2, _job, str(root))
    ranks = [torch.load(root / f"loaded-{rank}.pt", weights_only=True) for rank in range(2)]
    return root, {2: [r[2] for r in ranks], 1: [ranks[0][1]]}


def _assert_same(got: Any, expected: Any, where: str = "") -> None:
    """Equal structure and values; tensors bit for bit with their dtype."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert_bit_equal(got, expected)
    elif isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), (where, sorted(got), sorted(expected))
        for k in expected:
            _assert_same(got[k], expected[k], f"{where}.{k}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _assert_same(g, e, f"{where}.{i}")
    else:
        assert got == expected and type(got) is type(expected), (where, got, expected)


@pytest.mark.slow
@needs_megatron
@pytest.mark.parametrize("world", [2, 1])
def test_megatron_to_arrayckpt_to_megatron_loads_bit_for_bit(jobs, world):
    """Saved by Megatron at TP=world, converted there and back, loaded by Megatron at TP=world: every rank gets its
    shards, its RNG object and common.pt's items (the grad scaler's tensor a plain tensor again)."""
    root, loaded = jobs
    for rank, result in enumerate(loaded[world]):
        _assert_same(result[f"export_tp{world}"], _loaded(rank, world), f"rank {rank}")
    assert json.loads((root / f"export_tp{world}" / "metadata.json").read_text()) == CONFIG
    _assert_same(torch.load(root / f"export_tp{world}" / "common.pt"),
                 torch.load(root / f"megatron_tp{world}" / "common.pt"))  # as Megatron wrote it


@needs_megatron
def test_an_export_loads_at_another_tensor_parallel_degree(jobs):
    """The 2-rank save's export, loaded by one rank: whole tensors, and both ranks' RNG objects."""
    _, loaded = jobs
    _assert_same(loaded[1][0]["export_tp2"], _loaded(0, 1, saved_tp=2))


@needs_megatron
@pytest.mark.parametrize("world", [2, 1])
def test_an_arrayckpt_checkpoint_exports_for_megatron_and_back(jobs, world, tmp_path):
    """A checkpoint arrayckpt saved (keys nested, no common.pt record): Megatron loads it at TP=2 and TP=1; converted
    back it is the same checkpoint, arrays bit for bit, plus the import's record of metadata.json."""
    root, loaded = jobs
    for rank, result in enumerate(loaded[world]):
        _assert_same(result["export_native"], _loaded(rank, world, saved_tp=2, common=False))
    arrayckpt.convert(root / "export_native", tmp_path / "back")
    with arrayckpt.open(root / "native") as before, arrayckpt.open(tmp_path / "back") as after:
        assert sorted(after) == sorted(before)
        for key in before:
            assert_bit_equal(after[key].torch(), before[key].torch())
        values = dict(after.plain_values)
        assert {k: v for k, v in values.items() if not k.startswith("megatron.")} == dict(before.plain_values)
        assert after.manifest.created["source"]["metadata"] == CONFIG


@needs_megatron
def test_a_megatron_checkpoint_round_trips_through_megatron(jobs, tmp_path):
    """Megatron -> arrayckpt -> Megatron -> arrayckpt: the same arrays (bit for bit, wherever Megatron kept them) and
    values; the TP=1 and TP=2 saves hold the same global tensors."""
    root, _ = jobs
    arrayckpt.convert(root / "export_tp2", tmp_path / "again")
    with arrayckpt.open(root / "arrayckpt_tp2") as first, arrayckpt.open(tmp_path / "again") as again, \
            arrayckpt.open(root / "arrayckpt_tp1") as tp1:
        assert sorted(again) == sorted(first) == sorted(tp1)
        assert "optimizer.grad_scaler.scale" in first  # common.pt's tensor, an array here too
        for key in first:
            assert_bit_equal(again[key].torch(), first[key].torch())
            assert_bit_equal(tp1[key].torch(), first[key].torch())
        assert dict(again.plain_values) == dict(first.plain_values)
        assert again.manifest.created["source"]["common"] == first.manifest.created["source"]["common"]
    for key, tensor in _full().items():
        with arrayckpt.open(tmp_path / "again") as again:
            assert_bit_equal(again[key].torch(), tensor)


# ---------------------------------------------------------------------------------- the export itself, no Megatron
# (what the directory holds is read with DCP's own reader and torch.load)


def _dcp_entries(directory: Path) -> dict[str, Any]:
    from arrayckpt._convert.dcp import read_dcp_metadata

    return dict(read_dcp_metadata(directory).state_dict_metadata)


def _dcp_load(directory: Path, state: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    return state


def test_what_goes_where_and_what_is_left_out(tmp_path):
    """Arrays are DCP tensors under their keys; a list named as a ShardedObject shard is DCP bytes; every other value
    (one named like a shard but not a list, or with a key Megatron cannot parse back, a ``megatron.metadata`` that
    is not an import's copy of metadata.json) is in common.pt; per-rank entries are left out and named."""
    w = random_tensor((3, 4), torch.bfloat16, 7)
    arrayckpt.save({"model": {"w": w}, "rng/shard_0_1": [{"seed": 3}], "odd/shard_0_1": {"not": "a list"},
                    "a/b/shard_0_1": [1], "megatron": {"metadata": {"mine": 1}},
                    "cursor": arrayckpt.PerRank(torch.arange(3)), "step": 4}, tmp_path / "ckpt")
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="megatron")
    assert (result.target_format, result.tensors, result.skipped, result.notes) == ("megatron", 1, ("cursor",), ())
    assert sorted(os.listdir(tmp_path / "out")) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert json.loads((tmp_path / "out" / "metadata.json").read_text()) == CONFIG
    assert sorted(_dcp_entries(tmp_path / "out")) == ["model.w", "rng/shard_0_1"]
    loaded = _dcp_load(tmp_path / "out", {"model.w": torch.empty(3, 4, dtype=torch.bfloat16), "rng/shard_0_1": None})
    assert_bit_equal(loaded["model.w"], w)
    assert loaded["rng/shard_0_1"] == [{"seed": 3}]  # as Megatron stores a ShardedObject: the list of the rank's
    assert torch.load(tmp_path / "out" / "common.pt", weights_only=True) == {
        "odd/shard_0_1": {"not": "a list"}, "a/b/shard_0_1": [1], "megatron": {"metadata": {"mine": 1}}, "step": 4}


def test_pickled_values_need_allow_pickle_and_a_note_says_what_megatron_refuses(tmp_path):
    arrayckpt.save({"w": torch.ones(2), "ratio": Fraction(1, 3)}, tmp_path / "ckpt", allow_pickle=True)
    with pytest.raises(arrayckpt.PickleNotAllowedError, match="'ratio' is pickled"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="megatron")
    assert not (tmp_path / "out").exists()
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="megatron", allow_pickle=True)
    assert len(result.notes) == 1 and "fractions.Fraction" in result.notes[0] and "add_safe_globals" in result.notes[0]
    assert torch.load(tmp_path / "out" / "common.pt", weights_only=False) == {"ratio": Fraction(1, 3)}


def test_an_existing_target_is_refused_or_replaced_with_the_markers_last(tmp_path):
    arrayckpt.save({"w": torch.ones(2)}, tmp_path / "a")
    arrayckpt.save({"w": torch.zeros(3), "step": 2}, tmp_path / "b")
    arrayckpt.convert(tmp_path / "a", tmp_path / "out", to_format="megatron")
    with pytest.raises(arrayckpt.CheckpointExistsError, match="already exists"):
        arrayckpt.convert(tmp_path / "b", tmp_path / "out", to_format="megatron")
    arrayckpt.convert(tmp_path / "b", tmp_path / "out", to_format="megatron", overwrite=True)
    assert torch.equal(_dcp_load(tmp_path / "out", {"w": torch.ones(3)})["w"], torch.zeros(3))
    assert torch.load(tmp_path / "out" / "common.pt", weights_only=True) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


def test_a_failed_export_leaves_nothing(tmp_path):
    arrayckpt.save({"model": {"a": torch.ones(4), "b": torch.arange(16.0)}}, tmp_path / "ckpt")
    chunk = next(p for p in (tmp_path / "ckpt" / "model" / "b").rglob("*") if p.is_file() and p.name.startswith("c"))
    raw = bytearray(chunk.read_bytes())
    raw[3] ^= 0x10
    chunk.write_bytes(bytes(raw))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="'model.b'"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="megatron")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_the_export_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """Each tensor is read when DCP's writer reaches it and dropped before the next is read."""
    from arrayckpt._read.checkpoint import LazyArray

    alive: list[weakref.ref] = []
    read = LazyArray.torch

    def torch_once(self):
        assert not [r for r in alive if r() is not None], f"reading {self.key!r} while another is still referenced"
        tensor = read(self)
        memory = np.empty(tensor.nbytes, dtype=np.uint8)  # lives exactly as long as the tensor's storage
        alive.append(weakref.ref(memory))
        return torch.from_numpy(memory).view(tensor.dtype).reshape(tensor.shape).copy_(tensor)

    state = {f"layer{i}": random_tensor((64, 32), torch.float32, i) for i in range(4)} | {"step": 3}
    arrayckpt.save(state, tmp_path / "ckpt")
    monkeypatch.setattr(LazyArray, "torch", torch_once)
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="megatron")
    assert len(alive) == 4
    loaded = _dcp_load(tmp_path / "out", {k: torch.empty(64, 32) for k in state if k != "step"})
    for key, tensor in loaded.items():
        assert_bit_equal(tensor, state[key])


def test_cli_converts_to_megatron_and_refuses_a_file_name(tmp_path, capsys):
    from arrayckpt.cli import main

    torch.save({"model": {"w": torch.ones(2, 2)}, "step": 5}, tmp_path / "model.pt")
    assert main(["convert", str(tmp_path / "model.pt"), str(tmp_path / "out"), "--to", "megatron"]) == 0
    out = capsys.readouterr().out
    assert "converted torch" in out and "-> megatron" in out
    assert torch.load(tmp_path / "out" / "common.pt", weights_only=True) == {"step": 5}
    assert main(["convert", str(tmp_path / "model.pt"), str(tmp_path / "x.pt"), "--to", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "its name says torch but the target format is megatron" in err and err.count("\n") == 1
    assert not (tmp_path / "x.pt").exists()
