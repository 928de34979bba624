"""Megatron-Core ``dist_checkpointing`` (``torch_dist``) checkpoints into arrayckpt.

The checkpoints are saved by the real ``megatron.core.dist_checkpointing.save`` on 2 gloo ranks (module fixture,
one torchrun job). Megatron-Core 0.16 is GPU software: on a CPU-only torch its save calls
``torch.cuda.synchronize()`` (``FileSystemWriterAsync.preload_tensors``) and builds one flag tensor on
``torch.cuda.current_device()`` (``state_dict_saver.save_state_dict_async_finalize``); the worker stubs those two
for the job, everything else is Megatron's own code path. This file is also the worker
(``python -m torch.distributed.run ... test_megatron.py DIR``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
              pytest.mark.slow]  # runs a foreign training stack, spawns processes


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"decoder.layers.mlp.linear_fc1.weight": torch.randn(3, 8, 5, generator=generator),  # stacked layers
            "embedding.word_embeddings.weight": torch.randn(6, 4, generator=generator).to(torch.bfloat16),
            "decoder.final_layernorm.weight": torch.ones(5),
            "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight": torch.randn(3, 8, 5, generator=generator)}


def _worker(root: Path) -> None:
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *args, **kwargs: None  # see the module docstring
    torch.cuda.current_device = lambda: "cpu"
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    full = _tensors()
    fc1, emb, norm, moment = full.values()

    def state() -> dict:
        keys = list(full)
        return {
            "model": {  # fc1: tensor-parallel rows of every layer; the embedding: columns; the norm: replicated
                keys[0]: ShardedTensor.from_rank_offsets(keys[0], fc1[:, rank * 4:(rank + 1) * 4].clone(), (1, rank,
                                                                                                             world)),
                keys[1]: ShardedTensor.from_rank_offsets(keys[1], emb[:, rank * 2:(rank + 1) * 2].clone(), (1, rank,
                                                                                                             world)),
                keys[2]: ShardedTensor.from_rank_offsets(keys[2], norm.clone(), replica_id=rank),
            },
            "optimizer": {keys[3]: ShardedTensor.from_rank_offsets(keys[3], moment[:, rank * 4:(rank + 1) * 4].clone(),
                                                                   (1, rank, world))},
            "rng_state": ShardedObject("rng_state", {"seed": 1234 + rank, "offsets": [rank, 7]}, (world,), (rank,),
                                       replica_id=0),
            "iteration": 7,
            "checkpoint_version": 3.0,
            "opt_param_scheduler": {"num_steps": 56, "max_lr": 3e-4},
        }

    plain = root / "run" / "iter_0000007"
    with_args = root / "with_args"
    for directory in (plain, with_args):
        if rank == 0:
            directory.mkdir(parents=True)
        dist.barrier()
        sd = state()
        if directory == with_args:  # what Megatron-LM saves: its argparse Namespace, holding a torch dtype
            sd["args"] = argparse.Namespace(lr=3e-4, params_dtype=torch.bfloat16, seq_length=16)
        dist_checkpointing.save(sd, str(directory))
    if rank == 0:  # Megatron-LM's training loop names its newest iteration beside the iteration directories
        (root / "run" / "latest_checkpointed_iteration.txt").write_text("7")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("megatron")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           __file__, str(root)], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"megatron save failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return root


def test_a_torch_dist_checkpoint_converts_under_its_sharded_keys(saved, tmp_path):
    import arrayckpt
    from arrayckpt._convert.dispatch import detect_format

    src = saved / "run" / "iter_0000007"
    assert detect_format(src) == "megatron" and detect_format(saved / "run") == "megatron"
    result = arrayckpt.convert(src, tmp_path / "ckpt")
    assert (result.source_format, result.tensors) == ("megatron", 4)
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        for key, tensor in _tensors().items():
            assert ckpt[key].dtype == tensor.dtype and torch.equal(ckpt[key].torch(), tensor), key
        values = ckpt.plain_values
        assert values["iteration"] == 7 and values["checkpoint_version"] == 3.0
        assert values["opt_param_scheduler.num_steps"] == 56
        # a ShardedObject: the list of the rank's objects under that key that Megatron stores (here one)
        assert values["rng_state/shard_0_2"] == [{"seed": 1234, "offsets": [0, 7]}]
        assert values["rng_state/shard_1_2"] == [{"seed": 1235, "offsets": [1, 7]}]
        assert values["megatron.metadata.sharded_backend"] == "torch_dist"
    # a Megatron-LM save directory: the iteration latest_checkpointed_iteration.txt names
    arrayckpt.convert(saved / "run", tmp_path / "latest")
    with arrayckpt.open(tmp_path / "latest") as ckpt:
        assert ckpt.plain_values["iteration"] == 7 and len(list(ckpt)) == 4


def test_values_that_are_not_plain_need_allow_pickle(saved, tmp_path):
    import arrayckpt

    with pytest.raises(arrayckpt.PickleNotAllowedError, match="args"):
        arrayckpt.convert(saved / "with_args", tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    with pytest.warns(arrayckpt.PickleWarning, match="unpickling values .* fully"):  # DCP's, with weights_only=False
        arrayckpt.convert(saved / "with_args", tmp_path / "ckpt", allow_pickle=True)
    with arrayckpt.open(tmp_path / "ckpt", allow_pickle=True) as ckpt:
        args = ckpt.plain_values["args"]
        assert isinstance(args, argparse.Namespace) and args.params_dtype == torch.bfloat16 and args.seq_length == 16
        assert torch.equal(ckpt["embedding.word_embeddings.weight"].torch(), _tensors()[
            "embedding.word_embeddings.weight"])


def test_common_pt_outside_weights_only_needs_allow_pickle(saved, tmp_path):
    import arrayckpt

    src = tmp_path / "src"
    shutil.copytree(saved / "run" / "iter_0000007", src)
    common = torch.load(src / "common.pt", weights_only=True)
    torch.save({**common, "ratio": Fraction(1, 3)}, src / "common.pt")
    with pytest.raises(arrayckpt.PickleNotAllowedError, match="common.pt: .*GLOBAL fractions.Fraction"):
        arrayckpt.convert(src, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    with pytest.warns(arrayckpt.PickleWarning, match="common.pt: unpickling it fully"):  # says it runs code
        arrayckpt.convert(src, tmp_path / "ckpt", allow_pickle=True)
    with arrayckpt.open(tmp_path / "ckpt", allow_pickle=True) as ckpt:
        assert ckpt.plain_values["ratio"] == Fraction(1, 3)


def test_other_backends_and_incomplete_checkpoints_are_refused(saved, tmp_path):
    import arrayckpt

    src = tmp_path / "src"
    shutil.copytree(saved / "run" / "iter_0000007", src)
    config = json.loads((src / "metadata.json").read_text())
    (src / "metadata.json").write_text(json.dumps({**config, "sharded_backend": "zarr"}))
    with pytest.raises(arrayckpt.FormatError, match="sharded_backend 'zarr'; only torch_dist"):
        arrayckpt.convert(src, tmp_path / "out")
    (src / "metadata.json").write_text(json.dumps(config))
    (src / "common.pt").unlink()
    with pytest.raises(arrayckpt.FormatError, match="no common.pt"):
        arrayckpt.convert(src, tmp_path / "out")
    (saved / "run" / "latest_checkpointed_iteration.txt").rename(tmp_path / "latest.txt")
    try:
        (saved / "run" / "latest_checkpointed_iteration.txt").write_text("8")
        with pytest.raises(arrayckpt.FormatError, match="names '8', but there is no .*iter_0000008"):
            arrayckpt.convert(saved / "run", tmp_path / "out")
    finally:
        (tmp_path / "latest.txt").replace(saved / "run" / "latest_checkpointed_iteration.txt")
    assert not (tmp_path / "out").exists()


def test_cli_converts_a_megatron_checkpoint(saved, tmp_path):
    exe = shutil.which("arrayckpt")
    assert exe, "the arrayckpt console script is not installed (pip install -e .)"
    done = subprocess.run([exe, "convert", "--from", "megatron", str(saved / "run"), str(tmp_path / "cli")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "converted megatron" in done.stdout and "4 tensors" in done.stdout


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
