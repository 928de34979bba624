"""Converters: torch.save, safetensors and DCP to arrayckpt and back, bit for bit, one tensor at a time."""

from __future__ import annotations

import json
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import assert_bit_equal, random_tensor
from policies import Chunking

import arrayckpt
from arrayckpt._convert.common import ConvertResult
from arrayckpt._convert.dcp import from_dcp
from arrayckpt._convert.dispatch import detect_format
from arrayckpt._convert.safetensors import from_safetensors
from arrayckpt._convert.torch_save import from_torch

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64,
          torch.uint8, torch.bool, torch.float64]


def _tensors() -> dict[str, torch.Tensor]:
    out = {f"layers.{i}.{str(dt).removeprefix('torch.')}": random_tensor((3 + i, 5), dt, seed=i)
           for i, dt in enumerate(DTYPES)}
    out["scalar"] = random_tensor((), torch.bfloat16, seed=99)
    out["empty"] = torch.empty(0, 4)
    return out


def _into(src: Path, dst: Path, chunking: Chunking) -> ConvertResult:
    """``arrayckpt.convert(src, dst)`` into arrayckpt, planned with ``chunking`` (the converter ``convert`` picks)."""
    converter = {"safetensors": from_safetensors, "torch": from_torch, "dcp": from_dcp}[detect_format(src) or ""]
    return converter(src, dst, chunking=chunking.policy)


# -------------------------------------------------------------------------------------------- safetensors


def test_safetensors_round_trip_is_bit_exact(tmp_path, chunking):
    from safetensors.torch import load_file, save_file

    weights = _tensors()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert detect_format(tmp_path / "model.safetensors") == "safetensors"
    result = _into(tmp_path / "model.safetensors", tmp_path / "ckpt", chunking)
    assert result.tensors == len(weights) and detect_format(tmp_path / "ckpt") == "arrayckpt"
    opened = arrayckpt.open(tmp_path / "ckpt")
    for key, tensor in weights.items():
        assert_bit_equal(opened[key].torch(), tensor)
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "back.safetensors")
    back = load_file(tmp_path / "back.safetensors")
    assert back.keys() == weights.keys()
    for key, tensor in weights.items():
        assert_bit_equal(back[key], tensor)


def test_safetensors_shards_with_an_index(tmp_path):
    from safetensors.torch import load_file

    weights = _tensors()
    arrayckpt.save(weights, tmp_path / "ckpt")
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="safetensors", max_shard_bytes=100)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == result.bytes == sum(t.nbytes for t in weights.values())
    merged = {k: v for shard in shards for k, v in load_file(tmp_path / "hf" / shard).items()}
    for key, tensor in weights.items():
        assert_bit_equal(merged[key], tensor)
    for source in (tmp_path / "hf", tmp_path / "hf" / "model.safetensors.index.json"):  # directory or index
        target = tmp_path / f"again-{source.name}"
        arrayckpt.convert(source, target)
        opened = arrayckpt.open(target)
        for key, tensor in weights.items():
            assert_bit_equal(opened[key].torch(), tensor)


def test_safetensors_output_leaves_out_values_and_says_so(tmp_path):
    arrayckpt.save({"w": torch.ones(2), "step": 3}, tmp_path / "ckpt")
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "w.safetensors")
    assert result.skipped == ("step",)


def test_damaged_safetensors_header_is_refused(tmp_path):
    bad = tmp_path / "bad.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 64]}}).encode()
    bad.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(arrayckpt.FormatError, match=r"'w' data_offsets \[0, 64\] do not fit"):
        arrayckpt.convert(bad, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt*"))  # nothing left behind


# -------------------------------------------------------------------------------------------- torch.save


def test_torch_save_round_trip_keeps_nesting_and_values(tmp_path, chunking):
    state = {"model": _tensors(), "optim": {"state": {0: {"exp_avg": torch.randn(4), "step": torch.tensor(5.0)}},
                                            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0]}]},
             "step": 12, "layers": [torch.ones(2), torch.zeros(3)], "pair": (torch.arange(3), "x")}
    torch.save(state, tmp_path / "state.pt")
    assert detect_format(tmp_path / "state.pt") == "torch"
    _into(tmp_path / "state.pt", tmp_path / "ckpt", chunking)
    opened = arrayckpt.open(tmp_path / "ckpt")
    assert opened.plain_values["step"] == 12 and opened.plain_values["optim.param_groups"][0]["betas"] == (0.9, 0.999)
    assert_bit_equal(opened["model.layers.0.bfloat16"].torch(), state["model"]["layers.0.bfloat16"])
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "back.pt")
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    for key, tensor in state["model"].items():
        assert_bit_equal(back["model"][key], tensor)
    assert_bit_equal(back["optim"]["state"][0]["exp_avg"], state["optim"]["state"][0]["exp_avg"])
    assert back["optim"]["param_groups"] == state["optim"]["param_groups"] and back["step"] == 12
    assert isinstance(back["layers"], list) and isinstance(back["pair"], tuple) and back["pair"][1] == "x"
    assert_bit_equal(back["pair"][0], state["pair"][0])


def test_torch_file_that_is_not_a_dict_is_refused(tmp_path):
    torch.save([torch.ones(2)], tmp_path / "list.pt")
    with pytest.raises(arrayckpt.StateError, match="holds a list, not a dict"):
        arrayckpt.convert(tmp_path / "list.pt", tmp_path / "ckpt")


def test_torch_file_with_code_in_its_pickle_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"w": torch.ones(1), "evil": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(arrayckpt.PickleNotAllowedError, match="GLOBAL (posix|nt|os).system"):
        arrayckpt.convert(tmp_path / "evil.pt", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


# -------------------------------------------------------------------------------------------- DCP


def _dcp_save(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=path, no_dist=True)


def test_dcp_round_trip_is_bit_exact(tmp_path, chunking):
    import torch.distributed.checkpoint as dcp

    state = {"model": _tensors(), "optim": {"state": {"w": {"exp_avg": torch.randn(4)}},
                                            "param_groups": [{"lr": 0.1, "params": ["w"]}]}, "step": 3}
    state["model"].pop("empty")  # DCP cannot write empty tensors
    _dcp_save(state, tmp_path / "dcp")
    assert detect_format(tmp_path / "dcp") == "dcp"
    _into(tmp_path / "dcp", tmp_path / "ckpt", chunking)
    opened = arrayckpt.open(tmp_path / "ckpt")
    assert opened.plain_values["step"] == 3 and opened.plain_values["optim.param_groups"] == [{"lr": 0.1,
                                                                                               "params": ["w"]}]
    for key, tensor in state["model"].items():
        assert_bit_equal(opened[f"model.{key}"].torch(), tensor)
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "dcp2", to_format="dcp")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
              "optim": {"state": {"w": {"exp_avg": torch.zeros(4)}}, "param_groups": [{"lr": None, "params": None}]},
              "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, checkpoint_id=tmp_path / "dcp2", no_dist=True)
    for key, tensor in state["model"].items():
        assert_bit_equal(target["model"][key], tensor)
    assert target["step"] == 3 and target["optim"]["param_groups"] == state["optim"]["param_groups"]


def test_dcp_metadata_is_unpickled_with_an_allow_list(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(arrayckpt.FormatError, match="posix.system is not a DCP metadata type"):
        arrayckpt.convert(tmp_path / "dcp", tmp_path / "ckpt")
    assert not (tmp_path / "pwned").exists()


# ---------------------------------------------------------------- DCP from 2 FSDP2 ranks -> 3 ranks


def _fsdp_model(world: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 7))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _full(state: dict, prefix: str, out: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict gathered whole (collective), by dotted key."""
    for key, value in state.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict):
            _full(value, name, out)
        elif isinstance(value, torch.Tensor):
            out[name] = (value.full_tensor() if hasattr(value, "full_tensor") else value).detach().clone()
    return out


def _save_dcp_on_2_ranks(rank: int, world: int, path: str) -> dict[str, np.ndarray]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp_model(world, seed=0)
    model(torch.randn(4, 6)).sum().backward()
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": 1}, checkpoint_id=path)
    full = _full(optim_sd["state"], "optim.state", _full(model_sd, "model", {}))
    return {key: value.numpy() for key, value in full.items()}  # numpy: tensors would travel by shared memory


def _load_on_3_ranks(rank: int, world: int, path: str, reference: dict[str, np.ndarray]) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _fsdp_model(world, seed=1)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    result = arrayckpt.load(state, path)
    loaded = _full(state["model"], "model", {})
    loaded = _full(state["optim"]["state"], "optim.state", loaded)
    problems = [] if state["step"] == 1 and not result.missing_keys else [f"step {state['step']}, {result}"]
    problems += [f"{key} differs" for key, want in reference.items()
                 if not torch.equal(loaded[key], torch.from_numpy(want))]
    return problems + [f"{key} is not in the DCP checkpoint" for key in loaded if key not in reference]


@pytest.mark.slow
def test_dcp_from_2_fsdp2_ranks_converts_and_loads_on_3(tmp_path):
    from dist_helpers import run_ranks

    dcp_path, ckpt_path = str(tmp_path / "dcp"), str(tmp_path / "ckpt")
    reference = run_ranks(2, _save_dcp_on_2_ranks, dcp_path)[0]
    assert sum(v.ndim == 2 for v in reference.values()) == 6  # 2 weights, and Adam's 2 moments of each
    arrayckpt.convert(dcp_path, ckpt_path)
    assert arrayckpt.verify(ckpt_path).ok
    for problems in run_ranks(3, _load_on_3_ranks, ckpt_path, reference):
        assert problems == []


# ------------------------------------------------------------------ memory: one tensor at a time, in place


@pytest.fixture
def one_tensor_at_a_time(monkeypatch):
    """Fails a conversion out of arrayckpt that reads a tensor while one it read before is still alive."""
    import weakref

    from arrayckpt._read.checkpoint import LazyArray

    alive: list[weakref.ref] = []
    read = LazyArray.torch

    def torch_once(self):
        held = [r for r in alive if r() is not None]
        assert not held, f"reading {self.key!r} while {len(held)} tensor(s) read before are still referenced"
        tensor = read(self)
        # memory we can watch: a numpy buffer lives exactly as long as the storage of every view of the tensor
        memory = np.empty(tensor.nbytes, dtype=np.uint8)
        alive.append(weakref.ref(memory))
        return torch.from_numpy(memory).view(tensor.dtype).reshape(tensor.shape).copy_(tensor)

    monkeypatch.setattr(LazyArray, "torch", torch_once)
    return alive


def _no_dcp_reader(monkeypatch) -> list[list[str]]:
    """Records what goes through DCP's own reader (values only, when tensors are read in place)."""
    import arrayckpt._convert.dcp as dcp_module

    calls: list[list[str]] = []
    load = dcp_module._dcp_load

    def spy(state, *args):
        calls.append(sorted(state))
        return load(state, *args)

    monkeypatch.setattr(dcp_module, "_dcp_load", spy)
    return calls


def test_dcp_tensors_are_read_in_place_not_through_dcp(tmp_path, monkeypatch):
    state = {"model": {k: v for k, v in _tensors().items() if v.numel()}, "step": 3, "u16": torch.arange(7).to(
        torch.uint16), "c64": random_tensor((3, 2), torch.complex64, seed=5)}
    _dcp_save(state, tmp_path / "dcp")  # one .distcp file holding every tensor (DCP's default)
    calls = _no_dcp_reader(monkeypatch)
    arrayckpt.convert(tmp_path / "dcp", tmp_path / "ckpt")
    assert calls == [["step"]]  # the one plain value; every tensor straight from the file
    opened = arrayckpt.open(tmp_path / "ckpt")
    for key, tensor in state["model"].items():
        assert_bit_equal(opened[f"model.{key}"].torch(), tensor)
    assert_bit_equal(opened["u16"].torch(), state["u16"])
    assert_bit_equal(opened["c64"].torch(), state["c64"])


def test_dcp_payload_it_does_not_recognise_goes_through_dcp(tmp_path, monkeypatch):
    transposed = torch.randn(4, 6).t()  # DCP keeps a dense tensor's strides: not C-contiguous in the file
    _dcp_save({"t": transposed, "w": torch.randn(3)}, tmp_path / "dcp")
    calls = _no_dcp_reader(monkeypatch)
    arrayckpt.convert(tmp_path / "dcp", tmp_path / "ckpt")
    assert calls == [["t"]]
    assert_bit_equal(arrayckpt.open(tmp_path / "ckpt")["t"].torch(), transposed)


def _rewrite_metadata(path: Path, change) -> None:
    from arrayckpt._convert.dcp import read_dcp_metadata

    metadata = read_dcp_metadata(path)
    change(metadata)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("layout", ["gap", "overlap"])
def test_dcp_chunks_that_do_not_cover_a_tensor_are_refused(tmp_path, layout):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    _dcp_save({"w": torch.randn(4, 3)}, tmp_path / "dcp")

    def change(metadata):
        chunks = metadata.state_dict_metadata["w"].chunks
        if layout == "gap":  # rows 2 and 3 saved nowhere
            chunks[0].sizes = torch.Size([2, 3])
        else:  # as many elements as the tensor has, but rows 1-2 twice and row 3 never
            chunks[:] = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
                         ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([2, 3]))]

    _rewrite_metadata(tmp_path / "dcp", change)
    with pytest.raises(arrayckpt.FormatError, match=r"chunks of tensor 'w' do not cover its shape \[4, 3\]"):
        arrayckpt.convert(tmp_path / "dcp", tmp_path / "ckpt")


def test_dcp_data_file_outside_the_checkpoint_is_refused(tmp_path):
    _dcp_save({"w": torch.randn(4, 3)}, tmp_path / "dcp")

    def escape(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = "../../etc/passwd"

    _rewrite_metadata(tmp_path / "dcp", escape)
    with pytest.raises(arrayckpt.FormatError, match="a data file outside the checkpoint"):
        arrayckpt.convert(tmp_path / "dcp", tmp_path / "ckpt")


def _sharded_reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"col": torch.randn(6, 10, generator=g), "row": torch.randn(9, 4, generator=g),
            "uneven": torch.randn(5, 7, generator=g).to(torch.bfloat16), "deep": torch.randn(3, 4, 6, generator=g),
            "rep": torch.randn(5, generator=g)}


def _save_sharded_dcp(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _sharded_reference()
    placements = {"col": Shard(1), "row": Shard(0), "uneven": Shard(1), "deep": Shard(2), "rep": Replicate()}
    dcp.save({k: distribute_tensor(v, mesh, [placements[k]]) for k, v in full.items()}, checkpoint_id=path)


@pytest.mark.slow
def test_dcp_column_shards_are_read_into_place(tmp_path, monkeypatch):
    from dist_helpers import run_ranks

    import arrayckpt._convert.dcp_payload as dcp_payload

    run_ranks(2, _save_sharded_dcp, str(tmp_path / "dcp"))
    calls = _no_dcp_reader(monkeypatch)
    for buffer in (16, 64 << 20):  # a bounce buffer smaller than one row (element by element), and a big one
        monkeypatch.setattr(dcp_payload, "_READ_BUFFER", buffer)
        arrayckpt.convert(tmp_path / "dcp", tmp_path / f"ckpt-{buffer}")
        opened = arrayckpt.open(tmp_path / f"ckpt-{buffer}")
        for key, tensor in _sharded_reference().items():
            assert_bit_equal(opened[key].torch(), tensor)
    assert calls == []


def test_to_dcp_and_to_torch_hold_one_tensor_at_a_time(tmp_path, one_tensor_at_a_time):
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v for k, v in _tensors().items() if v.numel()}, "step": 5}
    arrayckpt.save(state, tmp_path / "ckpt")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "dcp", to_format="dcp")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out.pt")
    assert len(one_tensor_at_a_time) == 2 * len(state["model"])
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(target, checkpoint_id=tmp_path / "dcp", no_dist=True)
    back = torch.load(tmp_path / "out.pt", weights_only=True)
    for key, tensor in state["model"].items():
        assert_bit_equal(target["model"][key], tensor)
        assert_bit_equal(back["model"][key], tensor)
    assert target["step"] == back["step"] == 5


def test_torch_file_written_record_by_record_is_torch_saves_format(tmp_path):
    state = {"model": _tensors(), "u16": torch.arange(5).to(torch.uint16),
             "c64": random_tensor((2, 3), torch.complex64), "nested": [torch.ones(2), (torch.zeros(3), "x")],
             "step": 9, "name": "run"}
    arrayckpt.save(state, tmp_path / "ckpt")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out.pt")
    reference = tmp_path / "reference.pt"
    torch.save(arrayckpt._convert.common.nested_state(arrayckpt.open(tmp_path / "ckpt"),
                                                lambda k: torch.zeros(0))[0], reference)
    import zipfile

    names = sorted(n.partition("/")[2] for n in zipfile.ZipFile(tmp_path / "out.pt").namelist())
    assert names == sorted(n.partition("/")[2] for n in zipfile.ZipFile(reference).namelist())  # same records
    for mmap in (False, True):
        back = torch.load(tmp_path / "out.pt", weights_only=True, mmap=mmap)
        for key, tensor in state["model"].items():
            assert_bit_equal(back["model"][key], tensor)
        assert_bit_equal(back["u16"], state["u16"])
        assert_bit_equal(back["c64"], state["c64"])
        assert isinstance(back["nested"], list) and isinstance(back["nested"][1], tuple)
        assert_bit_equal(back["nested"][1][0], torch.zeros(3))
        assert back["step"] == 9 and back["name"] == "run"


class Holder:
    """A pickled value (module level, so that torch.load can find it) holding a tensor."""

    def __init__(self, value):
        self.value = value


@pytest.mark.parametrize("kind", ["tensor", "parameter"])
def test_torch_file_with_tensors_in_pickled_values(tmp_path, kind):
    inner = torch.arange(6.0).reshape(2, 3)[1:]  # a view: its record holds only its own elements
    value = Holder(inner if kind == "tensor" else torch.nn.Parameter(inner.clone()))  # a Parameter: plain torch.save
    arrayckpt.save({"w": torch.ones(3), "holder": value}, tmp_path / "ckpt", allow_pickle=True)
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out.pt", allow_pickle=True)
    back = torch.load(tmp_path / "out.pt", weights_only=False)
    assert_bit_equal(back["w"], torch.ones(3))
    assert type(back["holder"].value) is type(value.value)
    assert_bit_equal(back["holder"].value.detach(), inner)
