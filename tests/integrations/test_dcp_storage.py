"""arrayckpt as PyTorch DCP's storage (``arrayckpt.dcp``): ``ArrayckptWriter`` and ``ArrayckptReader``.

Distributed: FSDP2 (``fully_shard``) + AdamW after a step on 3 spawned gloo ranks saves through ``dcp.save``,
``dcp.async_save`` and the ``checkpoint_id`` form, and through ``arrayckpt.save`` (full and delta); 2 ranks then
load every one of them with ``dcp.load`` + ``ArrayckptReader`` and with ``arrayckpt.load``, and one process loads
the DCP-written one with ``arrayckpt.load``, all bit for bit. A save that fails on one rank commits nothing and
leaves the checkpoint it was replacing whole. Single process: round trips with ``no_dist=True`` (optimizer
``param_groups`` as plain values, no pickle), pickles only with consent, the keys arrayckpt refuses, readers
given something that is not a checkpoint, and an S3 round trip against moto.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_helpers import run_ranks
from helpers import assert_bit_equal, zarr_group
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import arrayckpt
from arrayckpt._integrations.dcp_keys import dcp_terminals, key_parts, object_path, regroup
from arrayckpt._layout.chunking import ChunkPolicy
from arrayckpt.dcp import ArrayckptReader, ArrayckptWriter

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning"),
              pytest.mark.usefixtures("storage_layout")]

TMP_MARKER = ".arrayckpt-tmp-"
SMALL = ChunkPolicy(inner_chunk_bytes=24, outer_chunk_bytes=48, min_inner_chunk_bytes=8, smallest_chunk_bytes=8)


class Net(nn.Module):
    """Layer sizes 10, 7 and 2 do not divide by 2 or 3: FSDP2 shards them unevenly (2 rows over 3 ranks: 1, 1, 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 7)
        self.fc3 = nn.Linear(7, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


@dataclasses.dataclass
class Opaque:
    """A value only pickle can store."""

    name: str


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if TMP_MARKER in p.name)


def _failure(error: BaseException) -> BaseException:
    """The first rank's exception inside DCP's ``CheckpointException`` (or the error itself)."""
    if isinstance(error, CheckpointException):
        return next(iter(error.failures.values()))[0]
    return error


# --- distributed: FSDP2 + AdamW on 3 ranks saves, 2 ranks (and one process) load -------------------------------


def _build(world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def _train(model: nn.Module, optim: torch.optim.Optimizer, rank: int, world: int, step: int) -> None:
    x = torch.randn(6, 6, generator=torch.Generator().manual_seed(step))
    optim.zero_grad()
    model(x[rank::world]).square().mean().backward()
    optim.step()


def _state(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": step}


def _gathered(state: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of the state gathered whole (collective), by arrayckpt key, and the plain values."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out: dict[str, Any] = {f"model.{k}": full(v) for k, v in state["model"].items()}
    for fqn, per_param in state["optim"]["state"].items():
        out.update({f"optim.state.{fqn}.{name}": full(v) for name, v in per_param.items()})
    out["optim.param_groups"] = state["optim"]["param_groups"]
    out["step"] = state["step"]
    return out


class _FailOnRank1(dcp.DefaultSavePlanner):
    def resolve_data(self, write_item: Any) -> Any:
        if torch.distributed.get_rank() == 1 and write_item.tensor_data is not None:
            raise RuntimeError("injected failure on rank 1")
        return super().resolve_data(write_item)


def _save_on_3(rank: int, world: int, root: str) -> dict[str, Any]:
    """Every save the loads below read, and a save that fails on one rank."""
    import torch.distributed as dist

    base = Path(root)
    model, optim = _build(world, seed=0)
    _train(model, optim, rank, world, step=1)
    state = _state(model, optim, step=1)
    expected1 = _gathered(state)
    dcp.save(state, storage_writer=ArrayckptWriter(base / "dcp"))
    small = ArrayckptWriter(base / "small-chunks")
    small.chunking = SMALL  # several chunks per shard
    dcp.save(state, storage_writer=small)
    dcp.async_save(state, storage_writer=ArrayckptWriter(base / "async")).result()
    dcp.save(state, checkpoint_id=str(base / "by-id"), storage_writer=ArrayckptWriter())
    arrayckpt.save(state, base / "native", step=1)
    dcp.save(state, storage_writer=ArrayckptWriter(base / "replaced"))
    fresh_model, fresh_optim = _build(world, seed=99)  # loaded back on 3 ranks: rank 2 holds no row of fc3
    fresh = _state(fresh_model, fresh_optim, step=0)
    dcp.load(fresh, storage_reader=ArrayckptReader(base / "dcp"))
    _same_as(fresh, expected1)

    _train(model, optim, rank, world, step=2)
    state2 = _state(model, optim, step=2)
    expected2 = _gathered(state2)
    arrayckpt.save(state2, base / "delta", base=base / "native", step=2)

    # a save that fails on rank 1 (after the other ranks wrote their chunks): nothing committed anywhere
    report: dict[str, Any] = {}
    writer = ArrayckptWriter(base / "replaced")  # DCP's default: overwrite
    try:
        dcp.save(state2, storage_writer=writer, planner=_FailOnRank1())
    except CheckpointException as e:
        report["error"] = repr(_failure(e))
    dist.barrier()
    if rank == 0:
        report["kept_step"] = arrayckpt.open(base / "replaced").plain_values["step"]
        report["leftovers_after_failure"] = _leftovers(base)
    dist.barrier()
    dcp.save(state2, storage_writer=writer)  # the same writer again: the failed save's leftovers go first
    if rank == 0:
        report["leftovers_after_retry"] = _leftovers(base)
        torch.save({"step1": expected1, "step2": expected2}, base / "expected.pt")
    return report


def _same_as(state: dict[str, Any], expected: dict[str, Any]) -> None:
    got = _gathered(state)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert_bit_equal(got[key], value)
        else:
            assert got[key] == value, key


def _load_on_2(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    base = Path(root)
    expected = torch.load(base / "expected.pt", weights_only=True)
    cases = [("dcp", "step1"), ("small-chunks", "step1"), ("async", "step1"), ("by-id", "step1"),
             ("native", "step1"), ("delta", "step2"), ("replaced", "step2")]
    for name, which in cases:
        model, optim = _build(world, seed=1234)
        state = _state(model, optim, step=0)
        if name == "by-id":
            dcp.load(state, checkpoint_id=str(base / name), storage_reader=ArrayckptReader())
        else:
            dcp.load(state, storage_reader=ArrayckptReader(base / name))
        _same_as(state, expected[which])
        set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
        _train(model, optim, rank, world, step=3)  # the loaded optimizer steps
    for name in ("dcp", "small-chunks"):  # written through DCP, loaded by arrayckpt at another world size
        model, optim = _build(world, seed=1234)
        state = _state(model, optim, step=0)
        result = arrayckpt.load(state, base / name)
        assert result.missing_keys == [] and result.unexpected_keys == []
        _same_as(state, expected["step1"])


_SAVED_ON_3: dict[str, tuple[Path, dict[str, Any]]] = {}  # by storage layout: the saves are made once per layout


@pytest.fixture
def saved_on_3(storage_layout: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The saves of ``_save_on_3`` in the test's layout (the ranks inherit it), made by the first test asking."""
    if storage_layout not in _SAVED_ON_3:
        root = tmp_path_factory.mktemp(f"dcp-fsdp-{storage_layout}")
        _SAVED_ON_3[storage_layout] = root, run_ranks(3, _save_on_3, str(root))[0]
    return _SAVED_ON_3[storage_layout]


@pytest.mark.slow
def test_fsdp_saves_on_3_ranks_load_on_2_through_dcp_and_arrayckpt(saved_on_3: tuple[Path, dict]) -> None:
    root, _ = saved_on_3
    run_ranks(2, _load_on_2, str(root))


def test_dcp_written_checkpoint_is_a_normal_arrayckpt_checkpoint(saved_on_3: tuple[Path, dict],
                                                                 storage_layout: str) -> None:
    import zarr

    root, _ = saved_on_3
    expected = torch.load(root / "expected.pt", weights_only=True)["step1"]
    tensors = {k: v for k, v in expected.items() if isinstance(v, torch.Tensor)}
    native = arrayckpt.open(root / "native").manifest.entries
    for name in ("dcp", "small-chunks", "async", "by-id"):
        path = root / name
        assert arrayckpt.verify(path).ok
        with arrayckpt.open(path) as ckpt:
            # the same keys and kinds as arrayckpt.save gives the same state
            assert {k: type(e) for k, e in ckpt.manifest.entries.items()} == {k: type(e) for k, e in native.items()}
            assert ckpt.manifest.created["world_size"] == 3
            if storage_layout == "packed":  # one pack per rank, the index, the references; no node documents
                packs = ckpt.manifest.packs
                assert packs is not None and [p.rank for p in packs.packs] == [0, 1, 2]
                assert sorted(p.name for p in path.rglob("*") if p.is_file()) == sorted(
                    ["zarr.json", ".metadata", "refs.json", *(Path(p.name).name for p in packs.packs),
                     Path(packs.index_name).name])
            else:
                assert ckpt.manifest.packs is None and not (path / "packs").exists()
            assert ckpt.plain_values["optim.param_groups"] == expected["optim.param_groups"]
            for key, tensor in tensors.items():
                assert_bit_equal(ckpt[key].torch(), tensor)
        group = zarr_group(path)
        assert_bit_equal(torch.from_numpy(group["model/fc1/weight"][:]), tensors["model.fc1.weight"])
        root_attributes = zarr.open_group(str(path), mode="r").attrs  # (packed: a group without members)
        assert root_attributes["arrayckpt"]["entries"]["step"]["value"] == 1
    # several chunks per shard where the chunk targets are small; one per shard otherwise
    small = arrayckpt.open(root / "small-chunks")["model.fc1.weight"].metadata["chunk_grid"]
    whole = arrayckpt.open(root / "dcp")["model.fc1.weight"].metadata["chunk_grid"]
    assert small["configuration"]["chunk_shape"] == [2, 6] and whole["configuration"]["chunk_shape"] == [4, 6]
    # who wrote what, as arrayckpt.save records it: fc1's 10 rows are FSDP shards of 4, 4 and 2 rows on ranks 0-2
    assert arrayckpt.open(root / "dcp").manifest.created["writers"]["model/fc1/weight"] == [[0, 1, 3, 1]]
    assert arrayckpt.open(root / "small-chunks").manifest.created["writers"]["model/fc1/weight"] == [
        [0, 1, 2, 2], [2, 0, 1, 1]]  # 2-row chunks: two each on ranks 0 and 1, one on rank 2

    # into one process, with arrayckpt.load into the same nested state (fresh tensors)
    target: dict[str, Any] = {"model": {}, "optim": {"state": {}, "param_groups": None}, "step": 0}
    for key, tensor in tensors.items():
        parts = key.split(".")
        if parts[0] == "model":
            target["model"][".".join(parts[1:])] = torch.zeros_like(tensor)
        else:
            target["optim"]["state"].setdefault(".".join(parts[2:-1]), {})[parts[-1]] = torch.zeros_like(tensor)
    result = arrayckpt.load(target, root / "dcp")
    assert result.missing_keys == [] and result.unexpected_keys == []
    for key, tensor in tensors.items():
        parts = key.split(".")
        got = target["model"][".".join(parts[1:])] if parts[0] == "model" else \
            target["optim"]["state"][".".join(parts[2:-1])][parts[-1]]
        assert_bit_equal(got, tensor)
    assert target["optim"]["param_groups"] == expected["optim.param_groups"] and target["step"] == 1


def test_a_save_failing_on_one_rank_commits_nothing(saved_on_3: tuple[Path, dict]) -> None:
    root, report = saved_on_3
    assert "injected failure on rank 1" in report["error"]
    assert report["kept_step"] == 1  # the checkpoint it was replacing is whole
    assert len(report["leftovers_after_failure"]) == 1  # its temporary directory, until the writer is used again
    assert report["leftovers_after_retry"] == []
    assert arrayckpt.open(root / "replaced").plain_values["step"] == 2
    assert _leftovers(root) == []


# --- one process -----------------------------------------------------------------------------------------------


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.9))
    model(torch.randn(4, 6)).square().mean().backward()
    optim.step()
    return model, optim


def _plain_state(seed: int) -> dict[str, Any]:
    model, optim = _trained(seed)
    return {"model": model.state_dict(), "optim": optim.state_dict(), "step": seed,
            "meta": {"name": f"run-{seed}", "pair": (seed, 2.5), "history": [{"loss": 1.5 * seed}, {"loss": None}],
                     "weird": {"inf": float("inf"), "raw": b"\x00\x01"}},
            "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) * seed, "empty": torch.full((0, 3), seed),
            "scalar": torch.tensor(seed + 0.5), "mask": torch.tensor([seed % 2 == 0, True])}


def _assert_same_state(got: Any, want: Any, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert_bit_equal(got, want)
    elif isinstance(want, dict):
        assert sorted(got, key=str) == sorted(want, key=str), where
        for k in want:
            _assert_same_state(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same_state(g, w, f"{where}.{i}")
    else:
        assert got == want, where


def test_single_process_round_trip_with_plain_values(tmp_path: Path) -> None:
    saved = _plain_state(1)
    path = tmp_path / "ckpt"
    dcp.save(saved, storage_writer=ArrayckptWriter(path, codec={"optim.*": "zstd"}), no_dist=True)
    with arrayckpt.open(path) as ckpt:  # no pickle anywhere: param_groups and the rest are plain values
        kinds = {e.to_dict()["kind"] for e in ckpt.manifest.entries.values()}
        assert kinds == {"tensor", "value"}
        assert ckpt.plain_values["optim.param_groups"] == saved["optim"]["param_groups"]
        assert ckpt.plain_values["meta.pair"] == (1, 2.5)
        assert ckpt.plain_values["meta.history"] == [{"loss": 1.5}, {"loss": None}]  # one value, as arrayckpt.save
        assert ckpt["optim.state.0.exp_avg"].metadata["codecs"] != ckpt["model.fc1.weight"].metadata["codecs"]
    arrayckpt.save(saved, tmp_path / "native")  # the same keys as arrayckpt's own save
    ours, native = arrayckpt.open(path).manifest, arrayckpt.open(tmp_path / "native").manifest
    assert {k: e.to_dict() for k, e in ours.entries.items()} == {k: e.to_dict() for k, e in native.entries.items()}
    assert ours.containers == native.containers

    target = _plain_state(2)
    dcp.load(target, storage_reader=ArrayckptReader(path), no_dist=True)
    _assert_same_state(target, saved)
    target = _plain_state(3)  # and arrayckpt.load of the same checkpoint
    arrayckpt.load(target, path)
    _assert_same_state(target, saved)
    target = _plain_state(4)  # and dcp.load of arrayckpt's own checkpoint
    dcp.load(target, storage_reader=ArrayckptReader(tmp_path / "native"), no_dist=True)
    _assert_same_state(target, saved)
    # DCP's load without a state (its planner rebuilds the nesting from the metadata's object paths)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    rebuilt = _load_state_dict_from_keys(storage_reader=ArrayckptReader(path))
    _assert_same_state(rebuilt["meta"], saved["meta"])
    _assert_same_state(rebuilt["optim"]["param_groups"], saved["optim"]["param_groups"])
    assert_bit_equal(rebuilt["optim"]["state"]["0"]["exp_avg"], saved["optim"]["state"][0]["exp_avg"])


def test_the_reader_gives_values_saved_per_rank_by_a_policy_at_another_world_size(tmp_path: Path) -> None:
    """A value that differed between 2 saving ranks (here ranks as threads) is offered to DCP; loading it on one
    process is refused before any data is read unless the reader's ``per_rank`` says which value it takes."""
    from thread_ranks import run_thread_ranks

    def save(rank: int, group: Any) -> None:
        arrayckpt.save({"w": torch.ones(2), "loader": {"pos": 10 + rank, "seen": [rank] * (rank + 1)}},
                       tmp_path / "ckpt", process_group=group)

    run_thread_ranks(2, save)

    def target() -> dict[str, Any]:
        return {"w": torch.zeros(2), "loader": {"pos": -1, "seen": [-1]}}

    state = target()
    with pytest.raises(CheckpointException, match="'loader.pos' was saved per rank at world size 2 and is loaded "
                                                  "at world size 1"):
        dcp.load(state, storage_reader=ArrayckptReader(tmp_path / "ckpt"), no_dist=True)
    assert state["w"].tolist() == [0, 0]
    dcp.load(state, storage_reader=ArrayckptReader(tmp_path / "ckpt", per_rank="rank0"), no_dist=True)
    assert state["loader"] == {"pos": 10, "seen": [0]} and state["w"].tolist() == [1, 1]
    state = target()
    reader = ArrayckptReader(tmp_path / "ckpt", per_rank={"loader.pos": lambda key, values, rank, world: max(values),
                                                          "loader.*": "keep"})
    dcp.load(state, storage_reader=reader, no_dist=True)
    assert state["loader"] == {"pos": 11, "seen": [-1]}


def test_stateful_objects_and_arrayckpt_load_into_a_fresh_optimizer(tmp_path: Path) -> None:
    model, optim = _trained(5)
    dcp.save({"model": model, "optim": optim}, storage_writer=ArrayckptWriter(tmp_path / "c"), no_dist=True)
    model2, optim2 = _trained(6)
    dcp.load({"model": model2, "optim": optim2}, storage_reader=ArrayckptReader(tmp_path / "c"), no_dist=True)
    _assert_same_state(model2.state_dict(), model.state_dict())
    _assert_same_state(optim2.state_dict(), optim.state_dict())
    # the optimizer's int state keys come back as ints: arrayckpt.load gives a fresh optimizer its whole state
    torch.manual_seed(7)
    model3 = Net()
    optim3 = torch.optim.AdamW(model3.parameters(), lr=1.0)
    arrayckpt.load({"model": model3, "optim": optim3}, tmp_path / "c")
    _assert_same_state(optim3.state_dict(), optim.state_dict())


def test_pickles_only_with_consent(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    state = {"w": torch.ones(3), "obj": Opaque("x")}
    with pytest.raises(CheckpointException) as info:
        dcp.save(state, storage_writer=ArrayckptWriter(path), no_dist=True)
    error = _failure(info.value)
    assert isinstance(error, arrayckpt.PickleNotAllowedError)
    assert "'obj'" in str(error) and "allow_pickle=True" in str(error)
    del info, error
    gc.collect()  # the failed save's writer is gone: so is its temporary directory
    assert not path.exists() and _leftovers(tmp_path) == []

    dcp.save(state, storage_writer=ArrayckptWriter(path, allow_pickle=True), no_dist=True)
    assert arrayckpt.open(path, allow_pickle=True).plain_values["obj"] == Opaque("x")
    assert arrayckpt.verify(path).ok
    target = {"w": torch.zeros(3), "obj": None}
    with pytest.raises(CheckpointException) as info:
        dcp.load(target, storage_reader=ArrayckptReader(path), no_dist=True)
    error = _failure(info.value)
    assert isinstance(error, arrayckpt.PickleNotAllowedError) and "'obj'" in str(error)
    assert target["obj"] is None and torch.equal(target["w"], torch.zeros(3))  # refused before anything was read
    dcp.load(target, storage_reader=ArrayckptReader(path, allow_pickle=True), no_dist=True)
    assert target["obj"] == Opaque("x") and torch.equal(target["w"], torch.ones(3))


def test_packed_as_arrayckpt_save_chooses_it(tmp_path: Path, storage_layout: str) -> None:
    # packed=None follows packed_from_ranks (the fixture's: 1 or never), as arrayckpt.save; a pickled value goes
    # into the coordinator's pack, written at the commit
    state = {"w": torch.arange(6.0), "obj": Opaque("x")}
    for packed in (None, True, False):
        path = tmp_path / f"packed-{packed}"
        dcp.save(state, storage_writer=ArrayckptWriter(path, allow_pickle=True, packed=packed), no_dist=True)
        expected = storage_layout == "packed" if packed is None else packed
        with arrayckpt.open(path, allow_pickle=True) as ckpt:
            packs = ckpt.manifest.packs
            assert (packs is not None) == expected and ckpt.manifest.format_version == (4 if expected else 3)
            assert packs is None or [p.rank for p in packs.packs] == [0]
            assert ckpt.plain_values["obj"] == Opaque("x") and torch.equal(ckpt["w"].torch(), state["w"])
        assert (path / "packs").is_dir() == expected and (path / "w").is_dir() != expected
        assert arrayckpt.verify(path).ok


@pytest.mark.parametrize(("state", "match"), [
    ({"a": torch.ones(2), "a.b": torch.ones(2)}, "is a tensor and also the prefix of tensor 'a.b'"),
    ({"W": torch.ones(2), "w": torch.ones(2)}, "differ only in letter case"),
    ({"m": {"p": [{"x": 1}]}, "m.p": 3}, "would both be stored under key 'm.p'"),
    ({"a": {"b": torch.ones(2)}, "a.b.c": Opaque("x")}, "is a tensor and also the prefix of tensor 'a.b.c'"),
    ({"a": {"b": torch.ones(2)}, "A.b": Opaque("x")}, "differ only in letter case"),
])
def test_keys_arrayckpt_cannot_store_are_refused(tmp_path: Path, state: dict, match: str) -> None:
    path = tmp_path / "ckpt"
    old = {"keep": torch.arange(3)}
    dcp.save(old, storage_writer=ArrayckptWriter(path), no_dist=True)
    writer = ArrayckptWriter(path, allow_pickle=True)
    with pytest.raises(CheckpointException) as info:
        dcp.save(state, storage_writer=writer, no_dist=True)
    error = _failure(info.value)
    assert isinstance(error, arrayckpt.StateError) and match in str(error), error
    writer.reset()  # the writer's next use removes what the failed save wrote
    assert _leftovers(tmp_path) == []
    assert torch.equal(arrayckpt.open(path)["keep"].torch(), old["keep"])  # the old checkpoint is whole


def test_writer_refusals(tmp_path: Path) -> None:
    dcp.save({"w": torch.ones(2)}, storage_writer=ArrayckptWriter(tmp_path / "c"), no_dist=True)
    with pytest.raises(CheckpointException) as info:  # with overwrite=False a committed checkpoint stays
        dcp.save({"w": torch.zeros(2)}, storage_writer=ArrayckptWriter(tmp_path / "c", overwrite=False), no_dist=True)
    assert isinstance(_failure(info.value), arrayckpt.CheckpointExistsError)
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.zeros(2)}, storage_writer=ArrayckptWriter(), no_dist=True)
    assert "has no path" in str(_failure(info.value))
    with pytest.raises(CheckpointException) as info:
        dcp.save({"w": torch.zeros(2)}, storage_writer=ArrayckptWriter(tmp_path / "d"),
                 planner=dcp.DefaultSavePlanner(enable_plan_caching=True), no_dist=True)
        dcp.save({"w": torch.zeros(2)}, storage_writer=ArrayckptWriter(tmp_path / "e"),
                 planner=dcp.DefaultSavePlanner(enable_plan_caching=True), no_dist=True)
    assert "enable_plan_caching" in str(_failure(info.value))
    assert ArrayckptWriter.validate_checkpoint_id(str(tmp_path / "x"))
    assert not ArrayckptWriter.validate_checkpoint_id("ftp://host/x")
    assert torch.equal(arrayckpt.open(tmp_path / "c")["w"].torch(), torch.ones(2))


def test_reader_refuses_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    with pytest.raises(arrayckpt.CheckpointNotFoundError, match=str(missing)):
        ArrayckptReader(missing)
    with pytest.raises(arrayckpt.CheckpointNotFoundError, match=str(missing)):  # the checkpoint_id form, too
        dcp.load({"w": torch.zeros(2)}, checkpoint_id=str(missing), storage_reader=ArrayckptReader(), no_dist=True)
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    with pytest.raises(arrayckpt.ArrayckptError, match=str(tmp_path / "dcp")):
        ArrayckptReader(tmp_path / "dcp")  # a DCP checkpoint: convert it (arrayckpt convert) or use FileSystemReader
    foreign = tmp_path / "zarr"
    foreign.mkdir()
    (foreign / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group", "attributes": {}}')
    with pytest.raises(arrayckpt.FormatError, match=str(foreign)):
        ArrayckptReader(foreign)
    assert not ArrayckptReader.validate_checkpoint_id(str(missing))


def test_reader_reads_only_the_needed_boxes_and_closes(tmp_path: Path) -> None:
    w = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    path = tmp_path / "c"
    arrayckpt.save({"w": w, "rng": arrayckpt.PerRank(torch.ones(2)), "t": (torch.ones(1), 2)}, path)
    reader = ArrayckptReader(path)
    metadata = reader.read_metadata()
    assert sorted(metadata.state_dict_metadata) == ["w"]  # per-rank entries and tuple members are left out
    assert [c.sizes for c in metadata.state_dict_metadata["w"].chunks] == [torch.Size([8, 5])]
    target = {"w": torch.zeros(8, 5, dtype=torch.float64)}  # another dtype: staged and cast, as DCP does
    dcp.load(target, storage_reader=reader, no_dist=True)
    assert torch.equal(target["w"], w.double())
    assert not reader._open  # closed once the load is done
    transposed = torch.zeros(5, 8).t()  # a strided target: read in place
    dcp.load({"w": transposed}, storage_reader=reader, no_dist=True)
    assert torch.equal(transposed, w)
    out = torch.zeros(8, 5)
    dcp.load({"w": out}, checkpoint_id=str(path), storage_reader=reader, no_dist=True)
    assert torch.equal(out, w)


def test_delta_chain_through_dcp(tmp_path: Path) -> None:
    emb = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    arrayckpt.save({"emb": emb, "step": 1}, tmp_path / "full")
    changed = emb.clone()
    changed[[3, 40]] += 1
    arrayckpt.save({"emb": changed, "step": 2}, tmp_path / "delta", base=tmp_path / "full",
                   changed_rows={"emb": torch.tensor([3, 40])})
    target = {"emb": torch.zeros(64, 8), "step": 0}
    dcp.load(target, storage_reader=ArrayckptReader(tmp_path / "delta"), no_dist=True)
    assert_bit_equal(target["emb"], changed)
    assert target["step"] == 2


def test_s3_round_trip(s3_server: Any, s3_bucket: str) -> None:
    url, options = f"s3://{s3_bucket}/dcp/step-1", {"endpoint_url": s3_server.endpoint}
    saved = _plain_state(7)
    dcp.save(saved, storage_writer=ArrayckptWriter(url, storage_options=options), no_dist=True)
    assert arrayckpt.verify(url, storage_options=options).ok
    target = _plain_state(8)
    dcp.load(target, storage_reader=ArrayckptReader(url, storage_options=options), no_dist=True)
    _assert_same_state(target, saved)


# --- the key mapping (no IO) -------------------------------------------------------------------------------------


def test_key_parts_follow_dcp_paths() -> None:
    mapping = {"model.fc1.weight": ("model", "fc1.weight"),
               "optim.param_groups.0.lr": ("optim", "param_groups", 0, "lr")}
    assert object_path("model.fc1.weight", mapping) == ("model", "fc1.weight")
    assert object_path("optim.param_groups.0.lr", mapping) == ("optim", "param_groups", 0, "lr")
    assert object_path("a.b.c", None) == ("a", "b", "c")  # no planner path: split on the dots
    assert object_path("x", {"x": ("y",)}) == ("x",)  # a path that does not join to the fqn is not trusted
    assert key_parts(("optim", "state", "0", "exp_avg", "01", "-1")) == ("optim", "state", 0, "exp_avg", "01", "-1")
    with pytest.raises(arrayckpt.StateError, match="not valid Unicode"):
        object_path("\ud800", None)


def test_regroup_and_expand_are_inverse() -> None:
    value = [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["a", "b"]}, {"lr": 0.2, "nested": [{"x": 1}]}]
    leaves = [(".".join(map(str, ("opt", "groups", *below))), ("opt", "groups", *below), _at(value, sub))
              for below, sub in dcp_terminals(value)]
    assert [fqn for fqn, _, _ in leaves] == ["opt.groups.0.lr", "opt.groups.0.betas", "opt.groups.0.params",
                                             "opt.groups.1.lr", "opt.groups.1.nested.0.x"]
    grouped = regroup(leaves, [], [("opt", "state", "w")])
    assert [(g.path, g.value) for g in grouped] == [(("opt", "groups"), value)]
    # a list that holds a tensor stays walked; one with a pickled member stays as DCP's leaves
    assert [g.path for g in regroup(leaves, [], [("opt", "groups", 1, "t")])] == [
        ("opt", "groups", 0, "lr"), ("opt", "groups", 0, "betas"), ("opt", "groups", 0, "params"),
        ("opt", "groups", 1, "lr"), ("opt", "groups", 1, "nested")]
    blocked = regroup(leaves, [("opt.groups.2", ("opt", "groups", 2))], [])
    assert [g.path for g in blocked] == [parts for _, parts, _ in leaves]
    # a gap (DCP drops an empty dict) cannot be put back: the leaves stay
    gap = [("l.1.x", ("l", 1, "x"), 1)]
    assert [g.path for g in regroup(gap, [], [])] == [("l", 1, "x")]
    assert list(dcp_terminals({})) == [] and list(dcp_terminals([1, 2])) == [((), ())]


def _at(value: Any, sub: tuple) -> Any:
    for part in sub:
        value = value[part]
    return value


def test_public_module() -> None:
    import arrayckpt.dcp as public

    assert public.__all__ == ["ArrayckptReader", "ArrayckptWriter"]
    assert issubclass(ArrayckptWriter, dcp.StorageWriter) and issubclass(ArrayckptReader, dcp.StorageReader)
