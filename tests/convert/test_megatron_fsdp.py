"""Megatron-LM's ``--ckpt-format fsdp_dtensor`` (Megatron-FSDP) into arrayckpt and back, judged by Megatron's load.

The source is saved on 2 gloo ranks (one spawned job shared by the module, ``job`` fixture) the way Megatron-LM's
``save_checkpoint`` saves it (``arrayckpt/_convert/megatron_fsdp.py`` says where that is read): Megatron-FSDP's
``MegatronFSDP`` wrapper itself needs CUDA (it makes CUDA streams and checks ``torch.cuda.current_device()``), so the
parameters' DTensors are made by what it calls to make them, megatron-core's ``make_fsdp_dtensor`` over an
``FSDPDistributedIndex`` of a CPU device mesh: each rank's uneven shard of rows (one rank's empty for some
parameters), and at TP=2 Megatron's tensor-parallel partition too. The state around them (``args``,
``checkpoint_version``, ``iteration``, the optimizer state ``sharded_param_state_fsdp_dtensor`` returns, the
scheduler, ``rng_state`` per ``(pp, tp)``) is typed in here as ``generate_state_dict`` lays it out; then the
megatron-core functions Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` applies (``handle_fp8_extra_state_case``,
``preprocess_state_dict_for_uneven_dtensor``; no SwiGLU split, no experts) and
``torch.distributed.checkpoint.save(state_dict, FileSystemWriter(dir))``, then the tracker file, as Megatron-LM does.
Two layouts: FSDP over both ranks (DP=2, TP=1) and TP=2 (DP=1).

Rank 0 converts each save to arrayckpt and back (``--to megatron --ckpt-format fsdp_dtensor``); then every rank loads
every export at both layouts as Megatron-LM's ``_load_base_checkpoint`` does: the state built again (fresh DTensors),
the same megatron-core preprocessing, ``torch.distributed.checkpoint.load_state_dict`` with ``FileSystemReader`` and
``DefaultLoadPlanner(allow_partial_load=True)``, after the ``{args, iteration, checkpoint_version}`` load of
``--use-checkpoint-args``. What each rank loaded comes back here, compared bit for bit with what it was saved from.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pickle
import random
import shutil
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

FC1, BIAS = "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc1.bias"
PROJ, EMB = "decoder.layers.0.self_attention.linear_proj.weight", "embedding.word_embeddings.weight"
NORM = "decoder.final_layernorm.weight"
# name: (shape, dtype, tensor-parallel partition dim or None, rows of dim 0 on rank 0 when FSDP shards over 2 ranks)
PARAMS = {FC1: ((8, 6), torch.float32, 0, 5), BIAS: ((8,), torch.float32, 0, 8), PROJ: ((6, 8), torch.float32, 1, 2),
          EMB: ((10, 6), torch.bfloat16, 0, 7), NORM: ((6,), torch.float32, None, 1)}
LAYOUTS = {"dp2": (2, 1), "tp2": (1, 2)}  # (FSDP data-parallel size, tensor-parallel size)
ITERATION = 7


def _full() -> dict[str, torch.Tensor]:
    """The global tensors: each parameter and its two Adam moments (random bits, NaN patterns included)."""
    out = {}
    for n, (name, (shape, dtype, _, _)) in enumerate(PARAMS.items()):
        out[f"model.{name}"] = random_tensor(shape, dtype, n)
        for m, moment in enumerate(("exp_avg", "exp_avg_sq")):
            out[f"optimizer.state.module.{name}.{moment}"] = random_tensor(shape, torch.float32, 100 + 10 * n + m)
    return out


def _rng(tp_rank: int) -> dict[str, Any]:
    """One rank's RNG states as Megatron-LM's ``get_rng_state`` gathers them (CPU: no CUDA states)."""
    rng = random.Random(1234 + tp_rank)
    return {"random_rng_state": rng.getstate(), "np_rng_state": np.random.RandomState(1234 + tp_rank).get_state(),
            "torch_rng_state": torch.Generator().manual_seed(1234 + tp_rank).get_state()}


def _values(tp_rank: int) -> dict[str, Any]:
    return {"args": argparse.Namespace(lr=3e-4, params_dtype=torch.bfloat16, use_megatron_fsdp=True,
                                       ckpt_format="fsdp_dtensor"),
            "checkpoint_version": 3.0, "iteration": ITERATION,
            "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": 56, "decay_style": "cosine"},
            "rng_state": {f"(0, {tp_rank})": [_rng(tp_rank)]},
            "num_floating_point_operations_so_far": 1.5e15}


def _state(rank: int, layout: str, full: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What Megatron-LM's ``generate_state_dict`` gives on ``rank`` for ``--ckpt-format fsdp_dtensor``: the model's
    and the optimizer's DTensors made by megatron-core's ``make_fsdp_dtensor`` from this rank's shard of ``full``."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer import make_fsdp_dtensor
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex
    from torch.distributed.device_mesh import init_device_mesh

    dp, tp = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp_shard", "tp"))
    index = FSDPDistributedIndex(mesh, dp_shard_dim="dp_shard", tp_dim="tp")
    tp_rank, dp_rank = mesh.get_local_rank("tp"), mesh.get_local_rank("dp_shard")

    def dtensor(name: str, key: str) -> torch.Tensor:
        shape, _, axis, rows = PARAMS[name]
        data = full[key]
        param = torch.nn.Parameter(torch.empty(shape, dtype=data.dtype), requires_grad=False)
        if axis is not None and tp > 1:  # Megatron's tensor-parallel attributes, on this rank's partition
            data = data.chunk(tp, axis)[tp_rank]
            param = torch.nn.Parameter(torch.empty(data.shape, dtype=data.dtype), requires_grad=False)
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, axis, 1
        if dp > 1:  # Megatron-FSDP's shard of the flat buffer: whole rows, unevenly (rank 1's may be empty)
            data = data[:rows] if dp_rank == 0 else data[rows:]
        return make_fsdp_dtensor(data.clone().reshape(-1), param, index, is_sharded_param=True,
                                 update_uneven_dtensor_chunk_meta=True)

    model: dict[str, Any] = {name: dtensor(name, f"model.{name}") for name in PARAMS}
    model[FC1.replace("weight", "_extra_state")] = None  # Transformer Engine's; dropped by handle_fp8_extra_state_case
    optimizer = {"state": {f"module.{n}": {m: dtensor(n, f"optimizer.state.module.{n}.{m}")
                                           for m in ("exp_avg", "exp_avg_sq")} for n in PARAMS},
                 "param_to_group_meta": {f"module.{n}": {"lr": 3e-4, "weight_decay": 0.0 if n == NORM else 0.1,
                                                         "betas": (0.9, 0.95), "step": ITERATION} for n in PARAMS}}
    return {**_values(tp_rank), "model": model, "optimizer": optimizer}


def _preprocess(state: dict[str, Any]) -> dict[str, Any]:
    """Megatron-LM's ``preprocess_fsdp_dtensor_state_dict`` (no ``--swiglu``, no ``--num-experts``): megatron-core's
    own functions, on save and load alike."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_fp8_extra_state_case

    state = state.copy()
    handle_fp8_extra_state_case(state["model"])
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def _megatron_save(rank: int, layout: str, root: Path) -> None:
    """Megatron-LM's ``save_checkpoint`` for ``fsdp_dtensor`` (synchronous): the iteration directory, DCP's save,
    a barrier, then rank 0's tracker file."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    directory = root / layout / f"iter_{ITERATION:07d}"
    if rank == 0:
        directory.mkdir(parents=True)
    dist.barrier()
    dcp.save(state_dict=_preprocess(_state(rank, layout, _full())), storage_writer=dcp.FileSystemWriter(directory))
    dist.barrier()
    if rank == 0:
        (root / layout / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def _megatron_load(rank: int, layout: str, directory: Path) -> dict[str, Any]:
    """Megatron-LM's ``_load_base_checkpoint`` for ``fsdp_dtensor``: the ``--use-checkpoint-args`` load, then the
    state built for loading (zeros where the tensors go), preprocessed, loaded by DCP; returned flat, tensors as
    this rank's local shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    first: dict[str, Any] = {"args": None, "iteration": None, "checkpoint_version": None}
    dcp.load(state_dict=first, checkpoint_id=directory)
    state = _preprocess(_state(rank, layout, {k: torch.zeros_like(v) for k, v in _full().items()}))
    state["args"] = state["iteration"] = state["checkpoint_version"] = None  # this run's, replaced by the load
    dcp.load_state_dict(state_dict=state, storage_reader=dcp.FileSystemReader(directory),
                        planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    flat: dict[str, Any] = {f"first.{k}": v for k, v in first.items()}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            flat[prefix] = value.to_local().clone() if isinstance(value, DTensor) else value

    walk("", state)
    return flat


def _job(rank: int, world: int, root: str) -> None:
    """Save both layouts; rank 0 converts each to arrayckpt and back; every rank loads every export at both
    layouts (``loaded-<rank>.pt``: results through the spawn's queue would need the rank alive until read)."""
    import torch.distributed as dist

    base = Path(root)
    for layout in LAYOUTS:
        _megatron_save(rank, layout, base)
    if rank == 0:
        for layout in LAYOUTS:
            arrayckpt.convert(base / layout, base / f"arrayckpt_{layout}", allow_pickle=True)
            arrayckpt.convert(base / f"arrayckpt_{layout}", base / f"export_{layout}", to_format="megatron",
                              ckpt_format="fsdp_dtensor", allow_pickle=True)
    dist.barrier()
    results = {(export, layout): _megatron_load(rank, layout, base / f"export_{export}")
               for export in LAYOUTS for layout in LAYOUTS}
    results |= {("saved", layout): _megatron_load(rank, layout, base / layout / f"iter_{ITERATION:07d}")
                for layout in LAYOUTS}
    torch.save(results, base / f"loaded-{rank}.pt")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[tuple[str, str], dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("megatron_fsdp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_ranks(2, _job, str(root))
    return root, [torch.load(root / f"loaded-{rank}.pt", weights_only=False) for rank in range(2)]


def _same(got: Any, expected: Any, where: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert_bit_equal(got, expected)
    elif isinstance(expected, np.ndarray):  # numpy's RNG state: a tensor once through arrayckpt; numpy takes either
        assert np.array_equal(np.asarray(got), expected), where
    elif isinstance(expected, (tuple, list)):
        assert isinstance(got, type(expected)) and len(got) == len(expected), (where, got)
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            _same(g, e, f"{where}.{i}")
    elif isinstance(expected, argparse.Namespace):
        assert vars(got) == vars(expected), where
    else:
        assert got == expected and type(got) is type(expected), (where, got, expected)


@pytest.mark.slow
@needs_megatron
@pytest.mark.parametrize("source", ["saved", "dp2", "tp2"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_loads_the_export_at_either_layout_bit_for_bit(job, source, layout):
    """Every rank's loaded shard of every parameter and moment, and every value, as the save at that layout had
    them ("saved": Megatron's own save loaded the same way, the reference)."""
    _, loaded = job
    for rank in range(2):
        got = loaded[rank][(source, layout)]
        tp_rank = rank if LAYOUTS[layout][1] > 1 else 0
        for key, value in _values(tp_rank).items():
            if isinstance(value, dict):
                continue
            _same(got[key], value, f"{source}@{layout} rank {rank}: {key}")
            if key in ("args", "iteration", "checkpoint_version"):
                _same(got[f"first.{key}"], value, f"{source}@{layout} rank {rank}: first {key}")
        saved_tp = LAYOUTS[layout if source == "saved" else source][1]
        for name, value in _rng(tp_rank).items() if tp_rank < saved_tp else ():  # else Megatron-LM takes another's
            _same(got[f"rng_state.(0, {tp_rank}).0.{name}"], value, f"{source}@{layout} rank {rank}: {name}")
        assert got["opt_param_scheduler.num_steps"] == 56
        assert got[f"optimizer.param_to_group_meta.module.{FC1}.betas"] == (0.9, 0.95)
        reference = loaded[rank][("saved", layout)]
        tensors = [k for k, v in reference.items() if isinstance(v, torch.Tensor) and k.startswith(("model.", "opt"))]
        assert len(tensors) == 3 * len(PARAMS)
        for key in tensors:
            assert_bit_equal(got[key], reference[key])
    np.random.set_state(loaded[0][("dp2", layout)]["rng_state.(0, 0).0.np_rng_state"])  # as Megatron-LM's load does


@pytest.mark.slow
@needs_megatron
def test_megatron_own_load_of_its_save_holds_the_shards_it_saved(job):
    """The reference itself: Megatron's load of its own save at the other layout gives each rank its shard of the
    global tensors (so comparing with it compares with the global tensors)."""
    _, loaded = job
    full = _full()
    for rank in range(2):
        got = loaded[rank][("saved", "tp2")]
        for name, (_, _, axis, _) in PARAMS.items():
            expected = full[f"model.{name}"] if axis is None else full[f"model.{name}"].chunk(2, axis)[rank]
            assert_bit_equal(got[f"model.{name}"], expected)
        got = loaded[rank][("saved", "dp2")]
        rows = PARAMS[PROJ][3]
        assert_bit_equal(got[f"optimizer.state.module.{PROJ}.exp_avg"],
                         full[f"optimizer.state.module.{PROJ}.exp_avg"][:rows] if rank == 0 else
                         full[f"optimizer.state.module.{PROJ}.exp_avg"][rows:])


@pytest.mark.slow
@needs_megatron
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_an_fsdp_dtensor_save_imports_every_tensor_whole(job, layout, tmp_path):
    """Detected as megatron (the save directory with its tracker, and the iteration directory); every DTensor one
    global array under its DCP key, bit for bit; the values under theirs; the provenance says fsdp_dtensor."""
    from arrayckpt._convert.dispatch import detect_format

    root, _ = job
    assert detect_format(root / layout) == "megatron"
    assert detect_format(root / layout / f"iter_{ITERATION:07d}") == "megatron"
    with arrayckpt.open(root / f"arrayckpt_{layout}", allow_pickle=True) as ckpt:
        full = _full()
        for key, tensor in full.items():
            assert_bit_equal(ckpt[key].torch(), tensor)
        assert ckpt.manifest.created["source"] == {"format": "megatron", "ckpt_format": "fsdp_dtensor"}
        values = ckpt.plain_values
        assert values["iteration"] == ITERATION and values["checkpoint_version"] == 3.0
        assert vars(values["args"])["ckpt_format"] == "fsdp_dtensor"
        assert values[f"optimizer.param_to_group_meta.module.{NORM}.weight_decay"] == 0.0
        for tp_rank in range(LAYOUTS[layout][1]):  # one RNG state per (pp, tp) rank: numpy's array an array too
            assert_bit_equal(ckpt[f"rng_state.(0, {tp_rank}).0.torch_rng_state"].torch(),
                             _rng(tp_rank)["torch_rng_state"])
            assert np.array_equal(ckpt[f"rng_state.(0, {tp_rank}).0.np_rng_state.1"].numpy(),
                                  _rng(tp_rank)["np_rng_state"][1])
        assert sorted(k for k in ckpt if not k.startswith("rng_state")) == sorted(full)  # no _extra_state


@pytest.mark.slow
@needs_megatron
def test_values_need_allow_pickle_and_an_incomplete_save_names_the_tensor(job, tmp_path):
    root, _ = job
    with pytest.raises(arrayckpt.PickleNotAllowedError, match="argparse.Namespace.*allow_pickle"):
        arrayckpt.convert(root / "dp2", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    src = tmp_path / "src"
    shutil.copytree(root / "dp2" / f"iter_{ITERATION:07d}", src)
    (src / "__1_0.distcp").unlink()  # rank 1's shards: the rows it held
    with pytest.raises(arrayckpt.FormatError, match=r"data file __1_0.distcp is missing, which holds tensor "
                                                    r"'(model|optimizer)\..*' and \d+ more items"):
        arrayckpt.convert(src, tmp_path / "out", allow_pickle=True)
    assert not (tmp_path / "out").exists()
    from arrayckpt._convert.dcp import read_dcp_metadata

    shutil.copy(root / "dp2" / f"iter_{ITERATION:07d}" / "__1_0.distcp", src)
    metadata = read_dcp_metadata(src)  # a rank's chunk of one tensor left out of the index
    item = metadata.state_dict_metadata[f"model.{FC1}"]
    item.chunks = item.chunks[:1]
    with open(src / ".metadata", "wb") as f:  # pickled as DCP's writer pickles it
        pickle.dump(metadata, f)
    with pytest.raises(arrayckpt.FormatError, match=f"the saved chunks of tensor 'model.{FC1}' do not cover"):
        arrayckpt.convert(src, tmp_path / "out", allow_pickle=True)


# ---------------------------------------------------------------------------------- the export itself, no Megatron


def test_the_export_is_dcp_of_the_flattened_state_with_numpy_rng_arrays_kept(tmp_path):
    """Arrays under their dotted keys, one whole chunk each; values as DCP's bytes; an array inside a tuple (numpy's
    RNG state, which DCP saves whole) written with its data; per-rank entries and empty dicts left out, named."""
    import torch.distributed.checkpoint as dcp

    w = random_tensor((3, 4), torch.bfloat16, 7)
    state = {"model": {"decoder.w": w}, "iteration": 7, "rng": ("MT19937", torch.arange(5, dtype=torch.int64), 2),
             "cursor": arrayckpt.PerRank(torch.arange(3)), "empty": {}}
    arrayckpt.save(state, tmp_path / "ckpt")
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="megatron", ckpt_format="fsdp_dtensor")
    assert (result.target_format, result.tensors, result.notes) == ("megatron", 2, ())
    assert sorted(result.skipped) == ["cursor", "empty"]
    assert sorted(os.listdir(tmp_path / "out")) == [".metadata", "__0_0.distcp"]
    loaded: dict[str, Any] = {"model": {"decoder.w": torch.empty(3, 4, dtype=torch.bfloat16)}, "iteration": None,
                              "rng": None}
    dcp.load(loaded, checkpoint_id=tmp_path / "out", no_dist=True)
    assert_bit_equal(loaded["model"]["decoder.w"], w)
    assert loaded["iteration"] == 7 and loaded["rng"][0] == "MT19937" and loaded["rng"][2] == 2
    assert_bit_equal(loaded["rng"][1], torch.arange(5, dtype=torch.int64))  # not a meta tensor
    arrayckpt.convert(tmp_path / "out", tmp_path / "back")  # read back as DCP: it holds no checkpoint_version
    with arrayckpt.open(tmp_path / "back") as back:
        assert_bit_equal(back["model.decoder.w"].torch(), w)


def test_an_export_without_a_model_entry_says_where_megatron_looks(tmp_path):
    arrayckpt.save({"w": torch.ones(2), "checkpoint_version": 3.0}, tmp_path / "ckpt")
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="megatron", ckpt_format="fsdp_dtensor")
    assert len(result.notes) == 1 and "model.<parameter name>" in result.notes[0]
    from arrayckpt._convert.dispatch import detect_format

    assert detect_format(tmp_path / "out") == "megatron"  # it names checkpoint_version, as Megatron-LM saves do
    arrayckpt.convert(tmp_path / "out", tmp_path / "back")
    with arrayckpt.open(tmp_path / "back") as back:
        assert back.manifest.created["source"]["ckpt_format"] == "fsdp_dtensor"
        assert back.plain_values["checkpoint_version"] == 3.0


def test_ckpt_format_is_for_a_megatron_export_only(tmp_path):
    arrayckpt.save({"w": torch.ones(2)}, tmp_path / "ckpt")
    with pytest.raises(arrayckpt.FormatError, match="ckpt_format is for a Megatron export"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="dcp", ckpt_format="fsdp_dtensor")
    with pytest.raises(arrayckpt.FormatError, match="ckpt_format 'zarr'"):
        arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out", to_format="megatron", ckpt_format="zarr")
    assert not (tmp_path / "out").exists()


def test_cli_writes_fsdp_dtensor_with_ckpt_format(tmp_path, capsys):
    from arrayckpt.cli import main

    torch.save({"model": {"w": torch.ones(2, 2)}, "iteration": 5, "checkpoint_version": 3.0}, tmp_path / "model.pt")
    assert main(["convert", str(tmp_path / "model.pt"), str(tmp_path / "out"), "--to", "megatron", "--ckpt-format",
                 "fsdp_dtensor"]) == 0
    assert "-> megatron" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "out")) == [".metadata", "__0_0.distcp"]
    assert main(["convert", str(tmp_path / "out"), str(tmp_path / "back")]) == 0
    assert "converted megatron" in capsys.readouterr().out
