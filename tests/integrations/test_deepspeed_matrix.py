"""DeepSpeed resume with every optimizer DeepSpeed runs on CPU: ZeRO 1, 2 and 3 x {FusedAdam (what
``"type": "AdamW"`` gives by default), torch AdamW (``"torch_adam": true``), DeepSpeedCPUAdam (ZeRO-Offload:
``"offload_optimizer": {"device": "cpu"}``)} x {fp32, bf16}. Each cell trains a tiny model on 2 ranks, saves with
``engine.save_checkpoint`` and goes on uninterrupted for the reference losses; the checkpoints are converted, then
the resume jobs at 1 and 3 ranks load every cell with ``arrayckpt.deepspeed.load`` into a fresh engine, check
DeepSpeed's own view of the state (``safe_get_full_fp32_param``/``safe_get_full_optimizer_state`` and each flat
group's ``step``, int or tensor as the optimizer keeps it) against the saved one, and train the same next steps.
The 1-rank job also loads with each of ``engine.load_checkpoint``'s flags, and with another optimizer than the
checkpoint was saved with.

The global batch is the same at every world size (see ``test_deepspeed.py``), so the next losses differ from the
uninterrupted run's only by the order of the gradient reduction's sums: measured here, not at all at 1 rank, at most
1.2e-7 at 3 ranks in fp32 (``LOSS_ATOL`` 1e-5). bf16 at 3 ranks is held to ``BF16_ATOL``: bf16 training is not
that stable across degrees by itself (the same uninterrupted bf16 run at 2 and at 3 ranks, no checkpoint involved,
differs by up to 2.9e-4 within 6 steps); measured after the resume, at most 2.8e-5. The state itself is checked
bit for bit in every cell.

The jobs are ``tests/deepspeed_worker.py``'s, shared with ``test_deepspeed.py`` (a DeepSpeed process costs ~18 s
of CPU before its first step). DeepSpeed's FusedAdam and CPUAdam are C++ ops it compiles on first use into torch's
extension cache (``~/.cache/torch_extensions``, or ``TORCH_EXTENSIONS_DIR``): the first run on a machine pays
~3-5 minutes for them (``docs/guide/integrations.md``, "DeepSpeed on CPU"), later runs load them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import deepspeed_worker
import pytest
import torch
from deepspeed_worker import CELLS, CROSS, MATRIX_WORLDS, OPTION_CELLS, OPTIONS, TRAIN_STEPS

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
              pytest.mark.slow]  # runs a foreign training stack, spawns processes

LOSS_ATOL = 1e-5  # resumed vs the uninterrupted 2-rank run; measured: 0 at 1 rank, <= 1.2e-7 at 3 ranks in fp32
BF16_ATOL = 5e-4  # bf16 at 3 ranks (module docstring): measured <= 2.8e-5; bf16 itself spreads 2.9e-4 across degrees
BASE_OPTIMIZER = {"fused": "FusedAdam", "torch": "AdamW", "cpu_adam": "DeepSpeedCPUAdam"}
STEP_TYPE = {"fused": "int", "torch": "Tensor", "cpu_adam": "int"}  # how each keeps its step


# ------------------------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Every cell trained and saved by the 2-rank job, then converted: the root and the cells' results."""
    jobs = deepspeed_worker.jobs(tmp_path_factory)
    return jobs.root, jobs.trained()["cells"]


def _resumed(tmp_path_factory: pytest.TempPathFactory, ranks: int) -> dict[str, Any]:
    return deepspeed_worker.jobs(tmp_path_factory).resumed(ranks)["cells"]


def test_the_matrix_trained_with_the_optimizers_it_names(matrix):
    _, trained = matrix
    for cell in CELLS:
        got = trained[cell.name]
        assert got["optimizer"] == BASE_OPTIMIZER[cell.optimizer], cell.name
        assert got["steps"] == [[STEP_TYPE[cell.optimizer], TRAIN_STEPS]], (cell.name, got["steps"])


def test_each_optimizers_state_converts_as_deepspeed_holds_it(matrix):
    """The moments are DeepSpeed's own full view of them; the step is a plain int where the optimizer keeps an int
    (FusedAdam, DeepSpeedCPUAdam), a 0-d array where it keeps a tensor (torch)."""
    import arrayckpt

    root, _ = matrix
    for cell in CELLS:
        full = torch.load(root / f"{cell.name}_full.pt", weights_only=True)
        with arrayckpt.open(root / f"{cell.name}.arrayckpt") as ckpt:
            for key, tensor in full.items():
                assert torch.equal(ckpt[key].torch(), tensor), (cell.name, key)
            for name in ("emb.weight", "fc2.bias"):
                key = f"optim.state.{name}.step"
                if cell.optimizer == "torch":
                    assert ckpt[key].shape == () and ckpt[key].torch().item() == TRAIN_STEPS, cell.name
                else:
                    step = ckpt.plain_values[key]
                    assert type(step) is int and step == TRAIN_STEPS, (cell.name, step)


@pytest.mark.parametrize("ranks", MATRIX_WORLDS)
def test_every_cell_resumes_at_another_degree(tmp_path_factory, matrix, ranks):
    _, trained = matrix
    got_all = _resumed(tmp_path_factory, ranks)
    for cell in CELLS:
        got, reference = got_all[cell.name], trained[cell.name]
        assert got["differences"] == [], cell.name  # masters and moments: DeepSpeed's own view, bit for bit
        assert got["global_steps"] == TRAIN_STEPS, cell.name
        assert got["steps"] == reference["steps"], (cell.name, got["steps"])  # the same type too
        atol = BF16_ATOL if cell.bf16 and ranks == 3 else LOSS_ATOL
        assert got["losses"] == pytest.approx(reference["losses"], abs=atol, rel=0), cell.name


def test_the_load_flags_do_what_deepspeeds_do(tmp_path_factory, matrix):
    _, trained = matrix
    got_all = _resumed(tmp_path_factory, 1)
    first, restored, next_one = ["int", 1], ["int", TRAIN_STEPS], ["int", TRAIN_STEPS + 1]  # FusedAdam's steps
    for cell in OPTION_CELLS:
        no_optimizer, module_only, no_lr = (got_all[f"{cell.name}/{option}"] for option in OPTIONS)
        for got in (no_optimizer, module_only, no_lr):  # the weights always, and engine.step() runs after
            assert got["weight_differences"] == [], cell.name
            assert got["losses"] == pytest.approx(trained[cell.name]["losses"][:1], abs=LOSS_ATOL, rel=0), cell.name
        # load_optimizer_states=False: a fresh optimizer (its first step next), the counters and LR schedule restored
        assert no_optimizer["steps"] == [] and no_optimizer["steps_after"] == [first], cell.name
        assert no_optimizer["global_steps"] == TRAIN_STEPS and not no_optimizer["scheduler_kept"], cell.name
        assert no_optimizer["scheduler_iteration"] == TRAIN_STEPS - 1, cell.name
        # load_module_only=True: the module only, nothing else
        assert module_only["steps"] == [] and module_only["steps_after"] == [first], cell.name
        assert module_only["global_steps"] == 0 and module_only["scheduler_kept"], cell.name
        # load_lr_scheduler_states=False: all but the LR scheduler
        assert no_lr["steps"] == [restored] and no_lr["steps_after"] == [next_one], cell.name
        assert no_lr["global_steps"] == TRAIN_STEPS and no_lr["scheduler_kept"], cell.name


def test_a_checkpoint_resumes_with_another_optimizer(tmp_path_factory, matrix):
    """torch_adam or ZeRO-Offload switched on or off between save and resume: the step takes the type the new
    optimizer keeps, the hyper-parameters come from the checkpoint, and the run goes on as the saved one would."""
    _, trained = matrix
    got_all = _resumed(tmp_path_factory, 1)
    for cell, optimizer in CROSS:
        got = got_all[f"{cell.name}->{optimizer}"]
        assert got["optimizer"] == BASE_OPTIMIZER[optimizer], (cell.name, optimizer)
        assert got["steps"] == [[STEP_TYPE[optimizer], TRAIN_STEPS]], (cell.name, optimizer, got["steps"])
        assert got["losses"] == pytest.approx(trained[cell.name]["losses"], abs=LOSS_ATOL, rel=0), (cell.name,
                                                                                                    optimizer)


def test_a_saved_step_is_checked_and_takes_the_type_the_optimizer_keeps(tmp_path):
    from deepspeed.ops.adam import FusedAdam

    import arrayckpt
    from arrayckpt._integrations.deepspeed_engine import _step

    steps = {"a": 3, "b": 3, "tensor": torch.tensor(3.0), "other": 4, "text": "3", "half": 2.5, "vector": torch.ones(2)}
    arrayckpt.save({"optim": {"state": {name: {"step": step} for name, step in steps.items()}}}, tmp_path / "c")
    flat = torch.zeros(2)
    torch_adam, fused = torch.optim.AdamW([flat]), object.__new__(FusedAdam)  # its class only: no C++ op to build

    class OwnAdam(torch.optim.Adam):  # a subclass of torch's keeps torch's tensor step
        pass

    with arrayckpt.open(tmp_path / "c") as ckpt:
        def step(names: list[str], optimizer: Any) -> Any:
            return _step(ckpt, names, optimizer, torch_adam.param_groups[0], flat)

        assert step(["a", "b"], fused) == 3 and type(step(["a", "b"], fused)) is int
        assert type(step(["tensor"], fused)) is int and step(["tensor"], fused) == 3
        as_tensor = step(["a"], torch_adam)
        assert isinstance(as_tensor, torch.Tensor) and as_tensor.dtype == torch.float32 and as_tensor.shape == ()
        assert as_tensor.item() == 3 and step(["missing"], fused) is None
        assert isinstance(step(["a"], OwnAdam([flat])), torch.Tensor)
        for names, match in ((["a", "other"], "different steps"), (["text"], "optim.state.text.step is '3', not a "
                             "step count"), (["half"], "2.5, not a whole number"), (["vector"], "shape \\[2\\].*not "
                             "one step count")):
            with pytest.raises(arrayckpt.FormatError, match=match):
                step(names, fused)
