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

import arrayckpt
from arrayckpt._convert import detect_format

DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int64,
          torch.uint8, torch.bool, torch.float64]


def _tensors() -> dict[str, torch.Tensor]:
    out = {f"layers.{i}.{str(dt).removeprefix('torch.')}": random_tensor((3 + i, 5), dt, seed=i)
           for i, dt in enumerate(DTYPES)}
    out["scalar"] = random_tensor((), torch.bfloat16, seed=99)
    out["empty"] = torch.empty(0, 4)
    return out


# -------------------------------------------------------------------------------------------- safetensors


def test_safetensors_round_trip_is_bit_exact(tmp_path, chunking):
    from safetensors.torch import load_file, save_file

    weights = _tensors()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert detect_format(tmp_path / "model.safetensors") == "safetensors"
    result = arrayckpt.convert(tmp_path / "model.safetensors", tmp_path / "ckpt")
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
    arrayckpt.convert(tmp_path / "state.pt", tmp_path / "ckpt")
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
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        arrayckpt.convert(tmp_path / "evil.pt", tmp_path / "ckpt")


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
    arrayckpt.convert(tmp_path / "dcp", tmp_path / "ckpt")
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


def test_dcp_from_2_fsdp2_ranks_converts_and_loads_on_3(tmp_path):
    from dist_helpers import run_ranks

    dcp_path, ckpt_path = str(tmp_path / "dcp"), str(tmp_path / "ckpt")
    reference = run_ranks(2, _save_dcp_on_2_ranks, dcp_path)[0]
    assert sum(v.ndim == 2 for v in reference.values()) == 6  # 2 weights, and Adam's 2 moments of each
    arrayckpt.convert(dcp_path, ckpt_path)
    assert arrayckpt.verify(ckpt_path).ok
    for problems in run_ranks(3, _load_on_3_ranks, ckpt_path, reference):
        assert problems == []
