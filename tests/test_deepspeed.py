"""DeepSpeed: real ZeRO checkpoints (DeepSpeed on CPU with gloo under torchrun) into arrayckpt, checked against
DeepSpeed's own consolidation and state getters, and resumed at other data-parallel degrees with
``arrayckpt.deepspeed.load``.

One 2-rank training job (module fixture) trains a tiny model with ZeRO-2 and ZeRO-3 (fp32), ZeRO-1 (bf16) and
stage 0 and saves each; the ZeRO-2/3 runs then go on uninterrupted for the reference losses. Each resume job
(1, 2 and 3 ranks) loads the converted checkpoints into fresh engines and trains the same next steps. The global
batch (6 samples) is the same at every world size (micro-batch x gradient accumulation x ranks), so the losses
differ only by the order in which the gradient reduction adds floating-point numbers: measured here, at most
1.2e-7 (one float32 ulp of a loss near 1) at 3 ranks, none at 1 rank; bit for bit at the saving world size.
This file is also the torchrun worker (``python -m torch.distributed.run ... test_deepspeed.py MODE DIR``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")

GLOBAL_BATCH = 6
MICRO_BATCH = {1: 3, 2: 3, 3: 2}  # by world size: x gradient accumulation x ranks = GLOBAL_BATCH
TRAIN_STEPS, NEXT_STEPS = 3, 3
RESUME_RTOL = 1e-6  # measured: <= 1.2e-7 relative at 3 ranks (reduction order), 0 at 1 and 2 ranks
RUNS = {"zero2": 2, "zero3": 3}  # checkpoint directory -> ZeRO stage (fp32, resumed); also "zero1_bf16", "stage0"
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # DeepSpeed on CPU; 2 cores for up to 3 ranks


# ------------------------------------------------------------------------------------------------ the worker


def _model(outputs: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(11, 6)
            self.fc1 = torch.nn.Linear(6, 9)
            self.frozen = torch.nn.Linear(9, 9)
            self.frozen.requires_grad_(False)
            self.fc2 = torch.nn.Linear(9, outputs)
            self.register_buffer("counter", torch.arange(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.frozen(torch.relu(self.fc1(self.emb(x).mean(1))))))

    return Tiny()


def _engine(stage: int, world: int, bf16: bool = False, outputs: int = 3) -> Any:
    import deepspeed

    model = _model(outputs)
    micro = MICRO_BATCH[world]
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": GLOBAL_BATCH // (micro * world),
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},  # no C++ op to build
              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": bf16}}
    params = [p for p in model.parameters() if p.requires_grad]
    return deepspeed.initialize(model=model, model_parameters=params, config=config)[0]


def _train(engine: Any, first: int, steps: int) -> list[float]:
    """``steps`` optimizer steps from global step ``first``; the global batch of a step is the same at any world
    size. Returns each step's loss over the whole global batch (before the step)."""
    import deepspeed.comm as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    micro, accumulation = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(100 + step)
        x, y = torch.randint(0, 11, (GLOBAL_BATCH, 4), generator=generator), torch.randn(GLOBAL_BATCH, 3,
                                                                                          generator=generator)
        total = torch.zeros(())
        for i in range(accumulation):
            part = slice((i * world + rank) * micro, (i * world + rank + 1) * micro)
            loss = ((engine(x[part]).float() - y[part]) ** 2).mean()
            engine.backward(loss)
            engine.step()
            total += loss.detach()
        dist.all_reduce(total)
        losses.append((total / (accumulation * world)).item())
    return losses


def _full_states(engine: Any) -> dict[str, torch.Tensor]:
    """DeepSpeed's own view of the full fp32 parameters and Adam moments (collectives: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            out[f"model.{name}"] = safe_get_full_fp32_param(param).cpu()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"optim.state.{name}.{key}"] = safe_get_full_optimizer_state(param, key).cpu()
    return out


def _worker(mode: str, root: Path) -> None:
    import deepspeed
    import deepspeed.comm as dist

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo only: no shm op to compile
    deepspeed.init_distributed("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results: dict[str, Any] = {}
    if mode == "train":
        for name, stage in RUNS.items():
            engine = _engine(stage, world)
            _train(engine, 0, TRAIN_STEPS)
            engine.save_checkpoint(str(root / name), client_state={"epoch": 3, "note": "tiny"})
            full = _full_states(engine)
            if rank == 0:
                torch.save(full, root / f"{name}_full.pt")
            results[name] = _train(engine, TRAIN_STEPS, NEXT_STEPS)
        for name, stage, bf16 in (("zero1_bf16", 1, True), ("stage0", 0, False)):
            engine = _engine(stage, world, bf16)
            _train(engine, 0, 1)
            engine.save_checkpoint(str(root / name))
    else:
        import arrayckpt.deepspeed

        for name, stage in RUNS.items():
            engine = _engine(stage, world)
            fresh = ((engine(torch.zeros(1, 4, dtype=torch.long)).float()) ** 2).sum().item()
            client = arrayckpt.deepspeed.load(engine, root / f"{name}.arrayckpt")
            loaded = ((engine(torch.zeros(1, 4, dtype=torch.long)).float()) ** 2).sum().item()
            results[name] = {"client": client, "global_steps": engine.global_steps, "changed": fresh != loaded,
                             "losses": _train(engine, TRAIN_STEPS, NEXT_STEPS)}
        if world == 1:  # a checkpoint of another model: refused before anything changes
            engine = _engine(2, world, outputs=4)
            try:
                arrayckpt.deepspeed.load(engine, root / "zero2.arrayckpt")
            except arrayckpt.ArrayckptError as e:
                results["refused"] = f"{type(e).__name__}: {e}"
    if rank == 0:
        (root / f"{mode}.json").write_text(json.dumps(results))
    dist.barrier()


# ------------------------------------------------------------------------------------------------ the tests


def _torchrun(ranks: int, mode: str, root: Path) -> dict[str, Any]:
    env = {**os.environ, **ENV, "TORCH_EXTENSIONS_DIR": str(root / "torch_extensions")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           __file__, mode, str(root)], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"torchrun {mode} on {ranks} ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads((root / f"{mode}.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One 2-rank job: every run's checkpoint, DeepSpeed's full states, the uninterrupted runs' next losses."""
    root = tmp_path_factory.mktemp("deepspeed")
    return root, _torchrun(2, "train", root)


@pytest.fixture(scope="module")
def converted(trained: tuple[Path, dict[str, Any]]) -> Path:
    import arrayckpt

    root, _ = trained
    for name in (*RUNS, "zero1_bf16"):
        result = arrayckpt.convert(root / name, root / f"{name}.arrayckpt")
        assert result.source_format == "deepspeed" and result.target_format == "arrayckpt"
    return root


def _zero_to_fp32(directory: Path) -> dict[str, torch.Tensor]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return get_fp32_state_dict_from_zero_checkpoint(str(directory))


@pytest.mark.parametrize("name", [*RUNS, "zero1_bf16"])
def test_model_arrays_are_what_zero_to_fp32_gives_bit_for_bit(converted, name):
    import arrayckpt

    expected = _zero_to_fp32(converted / name)
    with arrayckpt.open(converted / f"{name}.arrayckpt") as ckpt:
        model = {k.removeprefix("model."): ckpt[k].torch() for k in ckpt if k.startswith("model.")}
    # ZeRO-1 saves no frozen_param_shapes, so zero_to_fp32 leaves frozen parameters out; arrayckpt takes them from
    # the module's state dict
    extra = {"frozen.weight", "frozen.bias"} if name == "zero1_bf16" else set()
    assert set(model) == set(expected) | extra
    for key, tensor in expected.items():
        assert model[key].dtype == tensor.dtype and model[key].shape == tensor.shape
        assert torch.equal(model[key].view(-1).view(torch.uint8), tensor.contiguous().view(-1).view(torch.uint8)), key


@pytest.mark.parametrize("name", list(RUNS))
def test_optimizer_state_and_values_are_deepspeeds_own(converted, name):
    import arrayckpt

    full = torch.load(converted / f"{name}_full.pt", weights_only=True)
    with arrayckpt.open(converted / f"{name}.arrayckpt") as ckpt:
        for key, tensor in full.items():
            assert torch.equal(ckpt[key].torch(), tensor), key
        assert ckpt["optim.state.fc1.weight.step"].torch().item() == TRAIN_STEPS
        values = ckpt.plain_values
        groups = values["optim.param_groups"]
        assert [sorted(g["params"]) for g in groups] == [["emb.weight", "fc1.bias", "fc1.weight", "fc2.bias",
                                                          "fc2.weight"]]
        assert groups[0]["lr"] > 0 and groups[0]["betas"] == (0.9, 0.999)
        assert values["deepspeed.global_steps"] == TRAIN_STEPS and values["deepspeed.dp_world_size"] == 2
        assert values["deepspeed.zero_stage"] == RUNS[name] and values["deepspeed.tag"] == f"global_step{TRAIN_STEPS}"
        assert values["deepspeed.lr_scheduler.last_batch_iteration"] == TRAIN_STEPS - 1
        assert values["client.epoch"] == 3 and values["client.note"] == "tiny"
        assert ckpt.step == TRAIN_STEPS and "model.counter" in ckpt and ckpt["model.counter"].dtype == torch.int64


def test_bf16_module_weights_are_the_master_weights_cast(converted):
    """With mixed precision only the fp32 master weights are kept: the module's bf16 weights are them, cast."""
    import arrayckpt
    from arrayckpt._convert.deepspeed_files import load_pt

    module = load_pt(next((converted / "zero1_bf16").glob("global_step*/mp_rank_00_model_states.pt")))["module"]
    with arrayckpt.open(converted / "zero1_bf16.arrayckpt") as ckpt:
        for name, tensor in module.items():
            ours = ckpt[f"model.{name}"].torch()
            assert torch.equal(ours.to(tensor.dtype), tensor), name
            trainable = name.startswith(("emb.", "fc1.", "fc2."))
            assert ours.dtype == (torch.float32 if trainable else tensor.dtype), name


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_resume_at_another_data_parallel_degree(trained, converted, ranks):
    root, reference = trained
    results = _torchrun(ranks, "resume", root)
    for name in RUNS:
        got = results[name]
        assert got["client"] == {"epoch": 3, "note": "tiny"} and got["global_steps"] == TRAIN_STEPS and got["changed"]
        if ranks == 2:
            assert got["losses"] == reference[name]  # the saving world size: bit for bit
        else:
            assert got["losses"] == pytest.approx(reference[name], rel=RESUME_RTOL, abs=0)
    if ranks == 1:
        assert results["refused"].startswith("StateError") and "model.fc2.weight has shape [3, 9]" in results["refused"]


# ------------------------------------------------------------------------------------------------ bad input


def _tag(root: Path, name: str) -> Path:
    return next((root / name).glob("global_step*"))


@pytest.fixture
def broken(converted, tmp_path) -> Path:
    """A copy of the ZeRO-2 run's tag directory, to damage."""
    tag = tmp_path / "global_step3"
    shutil.copytree(_tag(converted, "zero2"), tag)
    return tag


def _refused(src: Path, tmp_path: Path, match: str) -> None:
    import arrayckpt

    with pytest.raises(arrayckpt.ArrayckptError, match=match):
        arrayckpt.convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _rewrite(file: Path, change: Any) -> None:
    """Change a DeepSpeed file (trusted here: the test wrote it) and save it back as DeepSpeed does."""
    state = torch.load(file, weights_only=False)
    change(state)
    torch.save(state, file)


def test_a_missing_rank_file_is_named(broken, tmp_path):
    (broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    _refused(broken, tmp_path, "missing zero_pp_rank_1_mp_rank_00_optim_states.pt")


def test_a_rank_file_beyond_the_world_size_is_refused(broken, tmp_path):
    rank1 = broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(rank1, broken / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    _refused(broken, tmp_path, "zero_pp_rank_2_mp_rank_00_optim_states.pt beyond dp_world_size 2")


def test_mismatched_partition_counts_are_refused(broken, tmp_path):
    file = broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _rewrite(file, lambda s: s["optimizer_state_dict"].update(partition_count=[3]))
    _refused(broken, tmp_path, "zero_pp_rank_1.*partition_count \\[3\\], but the tag has 2 ranks")


def _shorten(state: dict[str, Any]) -> None:
    """One element less in rank 1's master partition, one more of padding: consistent within the file."""
    optim = state["optimizer_state_dict"]
    optim["single_partition_of_fp32_groups"][0] = optim["single_partition_of_fp32_groups"][0][:-1]
    optim["group_paddings"][0] += 1


def test_partitions_that_do_not_add_up_are_refused(broken, tmp_path):
    file = broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _rewrite(file, _shorten)
    _refused(broken, tmp_path, "group 0's parameters and paddings hold 159 elements, but the 2 ranks' partitions "
             "hold 158.*do not match the parameter shapes")
    _rewrite(file, lambda s: s["optimizer_state_dict"]["base_optimizer_state"]["state"][0].update(
        exp_avg=torch.zeros(3)))
    _refused(broken, tmp_path, "zero_pp_rank_1.*'exp_avg' of group 0 has shape \\[3\\], not the partition's")


def test_pickled_content_outside_the_allow_list_is_refused(broken, tmp_path):
    from fractions import Fraction

    _rewrite(broken / "mp_rank_00_model_states.pt", lambda s: s.update(ratio=Fraction(1, 3)))
    _refused(broken, tmp_path, "mp_rank_00_model_states.pt: holds pickled content outside what DeepSpeed stores.*"
             "Fraction")


def test_unsupported_layouts_are_refused(converted, broken, tmp_path):
    _refused(_tag(converted, "stage0"), tmp_path, "without ZeRO \\(stage 0")
    shutil.copy(broken / "mp_rank_00_model_states.pt", broken / "mp_rank_01_model_states.pt")
    _refused(broken, tmp_path, "tensor-parallel checkpoint")
    (broken / "mp_rank_01_model_states.pt").unlink()
    (broken / "layer_01-model_00-model_states.pt").write_bytes(b"")
    _refused(broken, tmp_path, "pipeline-parallel layer files")


def test_cli_converts_and_reports_errors_in_one_line(converted, broken, tmp_path):
    exe = shutil.which("arrayckpt")
    assert exe, "the arrayckpt console script is not installed (pip install -e .)"
    done = subprocess.run([exe, "convert", str(converted / "zero3"), str(tmp_path / "cli")], capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert f"converted deepspeed {converted / 'zero3'} -> arrayckpt" in done.stdout
    (broken / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    done = subprocess.run([exe, "convert", str(broken), str(tmp_path / "bad")], capture_output=True, text=True)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "missing zero_pp_rank_0" in done.stderr
    assert not (tmp_path / "bad").exists()


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
