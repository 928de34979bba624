"""torch_checkpointing checkpoints (PyTorch's ``CheckpointManager``) into arrayckpt and back: saved by its own saver
(one process; two spawned gloo ranks with DTensor shards, slow), crafted several-rank directories with
``metadata.pkl`` (DTensor and CheckpointableTensor shardings), exports loaded by its own loader, and the errors of a
checkpoint missing a shard."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

import arrayckpt
from arrayckpt._convert.dispatch import detect_format
from arrayckpt._convert.whatis import explain_path
from arrayckpt._errors import FormatError
from arrayckpt.cli import main

tcp = pytest.importorskip("torch_checkpointing")
from torch_checkpointing.default_resharder import DefaultResharder  # noqa: E402
from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig  # noqa: E402

# Its default LocalFileSystemStorageConfig writes with O_DIRECT, which ext4 accepts at the open and then refuses for
# a file whose size is not block-aligned (EINVAL at close): the one setting changed from its defaults here.
BUFFERED = LocalFileSystemStorageConfig(use_direct_io=False)


def _manager(resharder: bool = False) -> tcp.CheckpointManager:
    items = {"model": tcp.ItemSpec(resharder=DefaultResharder())} if resharder else {}
    return tcp.CheckpointManager(tcp.CheckpointManager.Config(items=items, storage_config=BUFFERED))


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _flat(value: object, prefix: str) -> dict[str, torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        return {k: t for key, v in value.items() for k, t in _flat(v, f"{prefix}.{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: t for i, v in enumerate(value) for k, t in _flat(v, f"{prefix}.{i}").items()}
    return {}


@pytest.mark.parametrize("resharder", [False, True], ids=["files", "metadata"])
def test_its_save_converts_with_every_tensor_equal(tmp_path: Path, resharder: bool) -> None:
    model, optimizer = _trained()
    manager = _manager(resharder)
    try:
        future = manager.save(str(tmp_path / "src"), {"model": model.state_dict(), "optimizer":
                                                      optimizer.state_dict(), "step": 12})
        if future is not None:
            future.result()
    finally:
        manager.close()
    assert (tmp_path / "src" / "metadata.pkl").exists() == resharder
    assert detect_format(tmp_path / "src") == "torch_checkpointing"
    done = arrayckpt.convert(tmp_path / "src", tmp_path / "ckpt")
    expected = _flat(model.state_dict(), "model") | _flat(optimizer.state_dict(), "optimizer")
    assert (done.source_format, done.tensors) == ("torch_checkpointing", len(expected))
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert {k for k in ckpt.manifest.entries if ckpt.manifest.array_entry(k) is not None} == expected.keys()
        for key, tensor in expected.items():
            assert torch.equal(ckpt[key].torch(), tensor), key
        assert ckpt.plain_values["step"] == 12
        assert ckpt.manifest.created["source"]["format"] == "torch_checkpointing"
    restored = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = {"model": restored, "step": 0}
    arrayckpt.load(state, tmp_path / "ckpt")
    assert state["step"] == 12 and torch.equal(restored[0].weight, model[0].weight)


def test_cli_converts_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, _ = _trained()
    manager = _manager()
    try:
        future = manager.save(str(tmp_path / "src"), {"model": model.state_dict()})
        if future is not None:
            future.result()
    finally:
        manager.close()
    assert main(["convert", str(tmp_path / "src"), str(tmp_path / "out")]) == 0
    assert "converted torch_checkpointing" in capsys.readouterr().out
    assert "a torch_checkpointing checkpoint" in (explain_path(str(tmp_path / "src")) or "")


def _metadata(items: dict[str, dict], world: int) -> bytes:
    """metadata.pkl as torch_checkpointing writes it (DistributedMetadata.to_dict(), pickled)."""
    return pickle.dumps({"metadata": {item: {"nested_path_to_metadata": paths,
                                             "rank_to_layout_info": dict.fromkeys(range(world))}
                                      for item, paths in items.items()}, "world_size": world, "version": "2.0"})


def _dtensor_rows(shape: tuple[int, ...], world: int) -> dict:
    """A DTensor sharded by rows over a 1-D mesh of ``world`` ranks (DTensorShardingMetadata.to_dict())."""
    return {"sharding_metadata": {"type": "DTensorShardingMetadata", "data": {
        "global_shape": list(shape), "dtype": "torch.float32", "stride": [shape[1], 1],
        "mesh_spec": {"device_type": "cpu", "mesh_shape": (world,), "mesh_data": tuple(range(world)),
                      "mesh_dim_names": None},
        "placements": [{"type": "Shard", "dim": 0}]}}, "ranks": tuple(range(world))}


@pytest.fixture
def two_ranks(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    """A two-rank checkpoint as a DefaultResharder save writes it: rank r's ``model_r.pt`` holds its rows of ``w``
    (5 rows: 3 and 2, as DTensor splits them) and a replica of ``b``; ``step_r.pt`` an int."""
    full = torch.arange(15.0).reshape(5, 3)
    src = tmp_path / "two"
    src.mkdir()
    replicated = {"sharding_metadata": {"type": "DTensorShardingMetadata", "data": {
        "global_shape": [2], "dtype": "torch.float32", "stride": [1],
        "mesh_spec": {"device_type": "cpu", "mesh_shape": (2,), "mesh_data": (0, 1), "mesh_dim_names": None},
        "placements": [{"type": "Replicate"}]}}, "ranks": (0, 1)}
    (src / "metadata.pkl").write_bytes(_metadata({"model": {'["w"]': [_dtensor_rows((5, 3), 2)],
                                                            '["b"]': [replicated]}}, 2))
    for rank, rows in enumerate((full[:3], full[3:])):
        torch.save({"w": rows.clone(), "b": torch.tensor([1.0, 2.0])}, src / f"model_{rank}.pt")
        torch.save(7, src / f"step_{rank}.pt")
    return src, full


def test_shards_of_several_ranks_become_one_array(two_ranks: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    src, full = two_ranks
    done = arrayckpt.convert(src, tmp_path / "ckpt")
    assert done.tensors == 2
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert torch.equal(ckpt["model.w"].torch(), full)
        assert torch.equal(ckpt["model.b"].torch(), torch.tensor([1.0, 2.0]))
        assert ckpt.plain_values["step"] == 7


def test_a_missing_shard_names_the_tensor_and_region(two_ranks: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    src, _ = two_ranks
    (src / "model_1.pt").unlink()
    with pytest.raises(arrayckpt.FormatError, match=r"tensor 'model\.w' of shape \(5, 3\) is not covered .* region "
                       r"\[3:5, 0:3\] is missing .*model_1\.pt"):
        arrayckpt.convert(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_damaged_file_is_named(two_ranks: tuple[Path, torch.Tensor], tmp_path: Path) -> None:
    src, _ = two_ranks
    data = (src / "model_1.pt").read_bytes()
    (src / "model_1.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(arrayckpt.FormatError, match=r"model_1\.pt: not a readable torch\.save file"):
        arrayckpt.convert(src, tmp_path / "ckpt")


def test_checkpointable_tensor_boxes(tmp_path: Path) -> None:
    """DefaultShardingMetadata ("default_tensor_v1"): each rank's local tensor holds its shard at a local offset."""
    full = torch.arange(12.0).reshape(4, 3)
    src = tmp_path / "boxes"
    src.mkdir()
    groups = [{"sharding_metadata": {"type": "default_tensor_v1", "data": {
        "global_shape": [4, 3], "global_offsets": [[2 * r, 0]], "local_offsets": [[1, 0]], "local_sizes": [[2, 3]],
        "dtype": "torch.float32"}}, "ranks": (r,)} for r in range(2)]
    (src / "metadata.pkl").write_bytes(_metadata({"model": {'["w"]': groups}}, 2))
    for rank in range(2):
        local = torch.full((3, 3), -1.0)
        local[1:] = full[2 * rank: 2 * rank + 2]
        torch.save({"w": local}, src / f"model_{rank}.pt")
    arrayckpt.convert(src, tmp_path / "ckpt")
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert torch.equal(ckpt["model.w"].torch(), full)


def test_plain_tensors_that_differ_between_ranks_are_refused(tmp_path: Path) -> None:
    src = tmp_path / "plain"
    src.mkdir()
    torch.save({"w": torch.zeros(3)}, src / "model_0.pt")
    torch.save({"w": torch.ones(3)}, src / "model_1.pt")
    assert detect_format(src) == "torch_checkpointing"
    with pytest.raises(arrayckpt.FormatError, match="'model.w' differs between rank 0 and rank 1.*resharder"):
        arrayckpt.convert(src, tmp_path / "ckpt")


def test_metadata_with_globals_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "evil"
    src.mkdir()
    (src / "metadata.pkl").write_bytes(pickle.dumps(Path("/")))
    with pytest.raises(arrayckpt.FormatError, match="not plain data"):
        arrayckpt.convert(src, tmp_path / "ckpt", from_format="torch_checkpointing")


@pytest.mark.parametrize("resharder", [False, True], ids=["default", "resharder"])
def test_export_loads_with_its_own_loader(tmp_path: Path, resharder: bool) -> None:
    model, optimizer = _trained()
    half = torch.arange(6, dtype=torch.bfloat16)
    arrayckpt.save({"model": model, "optimizer": optimizer, "step": 5, "half": half}, tmp_path / "ckpt")
    done = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="torch_checkpointing")
    assert done.target_format == "torch_checkpointing"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["half_0.pt", "metadata.pkl", "model_0.pt",
                                                                     "optimizer_0.pt", "step_0.pt"]
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    manager = _manager(resharder)
    try:
        loaded = manager.load(str(tmp_path / "out"), into={"model": fresh.state_dict(), "optimizer": None,
                                                           "step": None, "half": torch.zeros(6, dtype=torch.bfloat16)})
    finally:
        manager.close()
    for key, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], tensor), key
    saved = _flat(optimizer.state_dict(), "optimizer")
    assert _flat(loaded["optimizer"], "optimizer").keys() == saved.keys()
    for key, tensor in _flat(loaded["optimizer"], "optimizer").items():
        assert torch.equal(tensor, saved[key]), key
    assert loaded["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]
    assert loaded["step"] == 5 and torch.equal(loaded["half"], half)
    back = arrayckpt.convert(tmp_path / "out", tmp_path / "back")  # and into arrayckpt again
    assert back.tensors == len(saved) + len(model.state_dict()) + 1


def test_export_refuses_a_key_that_cannot_name_a_file(tmp_path: Path) -> None:
    arrayckpt.save({"a/b": torch.ones(1)}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.FormatError, match="'a/b' cannot name a torch_checkpointing item"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="torch_checkpointing")


def _save_dtensors(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {"w": distribute_tensor(torch.arange(15.0).reshape(5, 3), mesh, [Shard(0)]),
             "b": distribute_tensor(torch.ones(3), mesh, [Replicate()]), "plain": torch.full((2,), 7.0)}
    manager = tcp.CheckpointManager(tcp.CheckpointManager.Config(storage_config=BUFFERED))
    try:
        future = manager.save(path, {"model": state, "step": 3})
        if future is not None:
            future.result()
    finally:
        manager.close()


@pytest.mark.slow
def test_two_spawned_ranks_with_dtensor_shards(tmp_path: Path) -> None:
    """Its own save on two gloo ranks (without a resharder: its metadata gathering needs CUDA): each rank's file
    holds its DTensor shard, whose placements say where it goes."""
    from dist_helpers import run_ranks

    run_ranks(2, _save_dtensors, str(tmp_path / "src"))
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == ["model_0.pt", "model_1.pt", "step_0.pt",
                                                                    "step_1.pt"]
    arrayckpt.convert(tmp_path / "src", tmp_path / "ckpt")
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert torch.equal(ckpt["model.w"].torch(), torch.arange(15.0).reshape(5, 3))
        assert torch.equal(ckpt["model.b"].torch(), torch.ones(3))
        assert torch.equal(ckpt["model.plain"].torch(), torch.full((2,), 7.0))
        assert ckpt.plain_values["step"] == 3
    shutil.rmtree(tmp_path / "src")


class _Mine(torch.Tensor):
    """A tensor subclass of the user's: weights_only loading refuses its class."""


def test_a_file_holding_other_classes_needs_allow_pickle(tmp_path: Path) -> None:
    src = tmp_path / "mine"
    src.mkdir()
    torch.save({"w": torch.ones(2).as_subclass(_Mine)}, src / "model_0.pt")
    with pytest.raises(arrayckpt.PickleNotAllowedError, match=r"model_0\.pt: refused to unpickle it .*allow_pickle"):
        arrayckpt.convert(src, tmp_path / "ckpt")
    with pytest.warns(arrayckpt.PickleWarning):
        arrayckpt.convert(src, tmp_path / "ckpt", allow_pickle=True)
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert torch.equal(ckpt["model.w"].torch(), torch.ones(2))


def test_a_link_among_the_rank_files_and_an_absurd_world_size_are_refused(tmp_path: Path) -> None:
    """A crafted source: a rank file that is a symbolic link (to a file outside) is never read through; a file name
    claiming rank 99,999,999 does not make the reader list a hundred million missing files."""
    from arrayckpt._convert.torch_checkpointing_layout import read_layout

    outside = tmp_path / "outside.pt"
    torch.save({"w": torch.ones(2)}, outside)
    linked = tmp_path / "linked"
    linked.mkdir()
    torch.save({"w": torch.ones(2)}, linked / "model_0.pt")
    (linked / "model_1.pt").symlink_to(outside)
    with pytest.raises(FormatError, match="symbolic link"):
        read_layout(linked)
    absurd = tmp_path / "absurd"
    absurd.mkdir()
    torch.save({"w": torch.ones(2)}, absurd / "model_99999999.pt")
    with pytest.raises(FormatError, match="world size of 100,000,000"):
        read_layout(absurd)
