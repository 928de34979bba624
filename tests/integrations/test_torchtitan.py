"""TorchTitan's own checkpoint component (``torchtitan.components.checkpointer``, the real package) driven as its
trainer drives it: ``build`` from the config, ``load()`` at start, ``save(step)`` after every step, with TorchTitan's
``OptimizersContainer`` (AdamW), ``LRSchedulersContainer`` and ``ParallelAwareDataloader`` (its position is part of
the state), a train state and ``keep_latest_k``.

TorchTitan's trainer does not run on CPU with torch 2.13; its checkpoint manager does, on gloo ranks on 127.0.0.1.
What must hold after switching to :class:`arrayckpt.torchtitan.ArrayckptCheckpointManager` (one line of config):
every step is an arrayckpt checkpoint; a restarted run finds the last step (TorchTitan's own step discovery, through
the DCP marker) and its losses are bit for bit those of a run never interrupted; DCP's own reader refuses such a step
with the message naming arrayckpt's reader; a run started on DCP's writer resumes across the switch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import run_ranks

pytest.importorskip("torchtitan.components.checkpointer")

from arrayckpt._format.marker import MARKER, MESSAGE  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class TrainState:
    """What TorchTitan's trainer puts under ``train_state`` (its step)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class Batches(torch.utils.data.IterableDataset):
    """An endless stream of (x, y) batches, a different one per data-parallel rank: TorchTitan's dataloader keeps its
    position in the checkpoint, so a resumed run gets the batches an uninterrupted one would."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Any:
        n = 0
        while True:
            generator = torch.Generator().manual_seed(1000 * n + self.rank)
            yield torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)
            n += 1


def _manager_class(name: str) -> Any:
    if name == "dcp":
        from torchtitan.components.checkpointer.dcp import CheckpointManager

        return CheckpointManager
    from arrayckpt.torchtitan import ArrayckptCheckpointManager

    return ArrayckptCheckpointManager


def _run(rank: int, world: int, manager: str, folder: str, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    """Build the model, TorchTitan's optimizer and scheduler containers and checkpoint manager, resume with
    ``load()``, train up to ``steps`` saving after each step; the losses of the steps run here, and what was
    resumed."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    if world > 1:  # FSDP2 over the ranks, as TorchTitan's data parallelism shards parameters
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]
    optimizers = OptimizersContainer(OptimizersContainer.Config(param_groups=groups, implementation="for-loop"),
                                     model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=20)
    state = TrainState()
    dataloader = ParallelAwareDataloader(Batches(rank), dp_rank=rank, dp_world_size=world, batch_size=None)
    checkpointer = _manager_class(manager).Config(enable=True, folder=folder, interval=5, keep_latest_k=2,
                                                  **options).build(
        dataloader=dataloader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=None)
    found = checkpointer._find_load_step()
    resumed = checkpointer.load()
    losses = []
    batches = iter(dataloader)
    for step in range(state.step + 1, steps + 1):
        x, y = next(batches)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        schedulers.step()
        state.step = step
        losses.append(loss.item())
        checkpointer.save(step)
    checkpointer.maybe_wait_for_saving()
    checkpointer.close()
    return {"found": found, "resumed": resumed, "losses": losses}


def _refused_by_dcp(rank: int, world: int, step_dir: str) -> str:
    """What DCP's own reader (``dcp.load`` with only a ``checkpoint_id``: its ``FileSystemReader``) says."""
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load({"0.weight": torch.zeros(16, 8)}, checkpoint_id=step_dir)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return str(e)
    return "loaded"


def _uninterrupted(tmp_path: Path, world: int = 1) -> list[float]:
    return run_ranks(world, _run, "arrayckpt", str(tmp_path / "reference"), 20, {})[0]["losses"]


@pytest.mark.slow
def test_switched_run_resumes_where_it_stopped(tmp_path: Path) -> None:
    """Ten steps, a restart, ten more: the restart finds step 10 and the losses are those of a run never stopped;
    every kept step is an arrayckpt checkpoint (TorchTitan's purge keeps the last two); DCP's reader refuses one."""
    import arrayckpt

    folder = str(tmp_path / "checkpoint")
    first = run_ranks(1, _run, "arrayckpt", folder, 10, {})[0]
    second = run_ranks(1, _run, "arrayckpt", folder, 20, {})[0]
    assert (first["found"], first["resumed"]) == (-1, False)
    assert (second["found"], second["resumed"]) == (10, True)
    assert first["losses"] + second["losses"] == _uninterrupted(tmp_path)
    assert sorted(os.listdir(folder)) == ["step-15", "step-20"]
    step = Path(folder, "step-20")
    assert (step / ".metadata").read_bytes() == MARKER
    checkpoint = arrayckpt.open(step)
    assert checkpoint.step == 20 and checkpoint.plain_values["lr_scheduler.last_epoch"] == 20
    assert isinstance(checkpoint.plain_values["dataloader.dp_rank_0"], bytes)  # its position, as TorchTitan pickles it
    assert checkpoint["0.weight"].shape == (16, 8) and "optimizer.state.0.weight.exp_avg" in checkpoint
    assert arrayckpt.verify(step).ok
    assert MESSAGE in run_ranks(1, _refused_by_dcp, str(step))[0]


@pytest.mark.slow
def test_without_the_marker_torchtitan_would_start_fresh(tmp_path: Path) -> None:
    """The counterfactual: TorchTitan's discovery finds nothing in a step directory without ``.metadata``."""
    folder = str(tmp_path / "checkpoint")
    run_ranks(1, _run, "arrayckpt", folder, 5, {})
    os.unlink(Path(folder, "step-5", ".metadata"))
    assert run_ranks(1, _run, "arrayckpt", folder, 5, {})[0]["found"] == -1


@pytest.mark.slow
def test_a_dcp_run_resumes_across_the_switch(tmp_path: Path) -> None:
    """Steps 1-10 on TorchTitan's DCP writer, 11-20 after switching to arrayckpt: the switched run loads DCP's step
    10 (DCP's reader for DCP's files) and trains on as the uninterrupted run does; its new steps are arrayckpt's."""
    import arrayckpt

    folder = str(tmp_path / "checkpoint")
    first = run_ranks(1, _run, "dcp", folder, 10, {})[0]
    second = run_ranks(1, _run, "arrayckpt", folder, 20, {})[0]
    assert (second["found"], second["resumed"]) == (10, True)
    assert first["losses"] + second["losses"] == _uninterrupted(tmp_path)
    assert arrayckpt.open(Path(folder, "step-20")).step == 20


@pytest.mark.slow
def test_async_save_resumes(tmp_path: Path) -> None:
    """TorchTitan's ``async_mode="async"`` (``dcp.async_save`` with its own gloo group)."""
    folder = str(tmp_path / "checkpoint")
    first = run_ranks(1, _run, "arrayckpt", folder, 10, {"async_mode": "async"})[0]
    second = run_ranks(1, _run, "arrayckpt", folder, 20, {"async_mode": "async"})[0]
    assert second["found"] == 10
    assert first["losses"] + second["losses"] == _uninterrupted(tmp_path)


@pytest.mark.slow
def test_fsdp_on_two_ranks(tmp_path: Path) -> None:
    """FSDP2 on 2 ranks (a packed save: one pack per rank per step), restarted: each rank's losses are those of the
    uninterrupted run, and one process opens the step whole."""
    import arrayckpt

    folder = str(tmp_path / "checkpoint")
    first = run_ranks(2, _run, "arrayckpt", folder, 10, {})
    second = run_ranks(2, _run, "arrayckpt", folder, 20, {})
    reference = run_ranks(2, _run, "arrayckpt", str(tmp_path / "reference"), 20, {})
    for rank in range(2):
        assert second[rank]["found"] == 10
        assert first[rank]["losses"] + second[rank]["losses"] == reference[rank]["losses"]
    checkpoint = arrayckpt.open(Path(folder, "step-20"))
    assert checkpoint["0.weight"].shape == (16, 8)
    assert len(os.listdir(Path(folder, "step-20", "packs"))) == 3  # two packs and the index
    assert arrayckpt.verify(Path(folder, "step-20")).ok


@pytest.mark.slow
def test_a_run_on_s3_resumes(tmp_path: Path, s3_server: Any, s3_bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``checkpoint.folder`` on S3 (moto on 127.0.0.1): TorchTitan lists and probes it through fsspec, arrayckpt
    saves and loads there; the endpoint comes from the environment, as for both of them."""
    import arrayckpt

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    folder = f"s3://{s3_bucket}/run/checkpoint"
    first = run_ranks(1, _run, "arrayckpt", folder, 10, {})[0]
    second = run_ranks(1, _run, "arrayckpt", folder, 20, {})[0]
    assert (second["found"], second["resumed"]) == (10, True)
    assert first["losses"] + second["losses"] == _uninterrupted(tmp_path)
    assert arrayckpt.open(f"{folder}/step-20").step == 20
    assert arrayckpt.verify(f"{folder}/step-20").ok
