"""The trainer's step in a checkpoint written through DCP's ``ArrayckptWriter``: DCP passes no step, so the manifest
records the state's own when one plain integer names it (``step``, or a single ``train_state.step``), and
``Checkpoint.step`` and ``arrayckpt info`` show it; where none does, or several could, none is recorded and ``info``
says so (naming the value when there is one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import arrayckpt
from arrayckpt.cli import main
from arrayckpt.dcp import ArrayckptWriter

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
              pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning")]


def _trained() -> dict[str, object]:
    """A model and its AdamW state after a step (the optimizer's own ``step`` entries are tensors: never counted)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def _info(path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["info", str(path)]) == 0
    return capsys.readouterr().out.splitlines()[0]


@pytest.mark.parametrize(("extra", "step"), [
    ({"step": 120}, 120),
    ({"train_state": {"step": 7, "epoch": 2}}, 7),
    ({"step": 9, "train_state": {"step": 7}}, 9),  # the top-level one is the trainer's
])
def test_the_state_s_step_is_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: dict,
                                      step: int) -> None:
    path = tmp_path / "ckpt"
    dcp.save({**_trained(), **extra}, storage_writer=ArrayckptWriter(path), no_dist=True)
    with arrayckpt.open(path) as checkpoint:
        assert checkpoint.step == step
    assert _info(path, capsys).endswith(f", step {step})")


@pytest.mark.parametrize(("extra", "shown"), [
    ({}, "step none recorded)"),
    ({"a": {"step": 1}, "b": {"step": 2}}, "step none recorded)"),  # ambiguous: which is the trainer's?
    ({"step": True}, "step none recorded)"),
    ({"step": torch.tensor(5)}, "step none recorded)"),  # a tensor, not a plain value
])
def test_no_step_or_an_ambiguous_one_is_not_recorded(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     extra: dict, shown: str) -> None:
    path = tmp_path / "ckpt"
    dcp.save({**_trained(), **extra}, storage_writer=ArrayckptWriter(path), no_dist=True)
    with arrayckpt.open(path) as checkpoint:
        assert checkpoint.step is None
    assert _info(path, capsys).endswith(shown)


def test_info_names_the_value_of_a_save_given_no_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``arrayckpt.save`` records the step it is given and guesses none; ``info`` points at the value."""
    arrayckpt.save({"w": torch.ones(2), "train_state": {"step": 4}}, tmp_path / "ckpt")
    assert arrayckpt.open(tmp_path / "ckpt").step is None
    assert _info(tmp_path / "ckpt", capsys).endswith("step none recorded; the value `train_state.step` is 4)")
