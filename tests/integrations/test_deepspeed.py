"""DeepSpeed: real ZeRO checkpoints (DeepSpeed on CPU with gloo under torchrun) into arrayckpt, checked against
DeepSpeed's own consolidation and state getters, and resumed at other data-parallel degrees with
``arrayckpt.deepspeed.load``.

The 2-rank training job (``tests/deepspeed_worker.py``, shared with ``test_deepspeed_matrix.py``) trains a tiny
model with ZeRO-2 and ZeRO-3 (fp32, torch's AdamW), ZeRO-1 (bf16) and stage 0 and saves each; the ZeRO-2/3 runs
then go on uninterrupted for the reference losses. Each resume job (1, 2 and 3 ranks) loads the converted
checkpoints into fresh engines and trains the same next steps. The global batch (6 samples) is the same at every
world size (micro-batch x gradient accumulation x ranks), so the losses differ only by the order in which the
gradient reduction adds floating-point numbers: measured here, at most 1.2e-7 (one float32 ulp of a loss near 1)
at 3 ranks, none at 1 rank; bit for bit at the saving world size.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import deepspeed_worker
import pytest
import torch
from deepspeed_worker import RUNS, TRAIN_STEPS

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
              pytest.mark.slow]  # runs a foreign training stack, spawns processes

RESUME_RTOL = 1e-6  # measured: <= 1.2e-7 relative at 3 ranks (reduction order), 0 at 1 and 2 ranks


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The 2-rank job: every run's checkpoint, DeepSpeed's full states, the uninterrupted runs' next losses."""
    jobs = deepspeed_worker.jobs(tmp_path_factory)
    return jobs.root, jobs.trained()["runs"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, trained: tuple[Path, dict[str, Any]]) -> Path:
    """The root, with every run converted (``<name>.arrayckpt``)."""
    done = deepspeed_worker.jobs(tmp_path_factory).trained()["converted"]
    for name in (*RUNS, "zero1_bf16"):
        assert done[name] == ["deepspeed", "arrayckpt"], name
    return trained[0]


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
def test_resume_at_another_data_parallel_degree(tmp_path_factory, trained, converted, ranks):
    _, reference = trained
    results = deepspeed_worker.jobs(tmp_path_factory).resumed(ranks)["runs"]
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


def test_a_tied_model_resumes(tmp_path_factory):
    # GPT-2 with tie_word_embeddings under ZeRO-2 (FusedAdam), in the 1-rank resume job. Before: the strict check
    # named parameters by named_parameters(), which names a tie once: "unexpected ['model.lm_head.weight']"
    tied = deepspeed_worker.jobs(tmp_path_factory).resumed(1)["tied"]
    assert "error" not in tied, tied["error"]
    assert tied["stored"]["model.lm_head.weight"] == "model.transformer.wte.weight"  # stored once: an alias
    assert tied["stored"]["model.transformer.wte.weight"] == "array"
    assert tied["tied"] and tied["differences"] == [] and tied["steps"] == [["int", 2.0]] and tied["global_steps"] == 2
    assert tied["losses"] == tied["deepspeed_losses"]  # bit for bit what DeepSpeed's own loader resumes to
    assert tied["losses"] == pytest.approx(tied["reference"], rel=RESUME_RTOL)


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
