"""The DeepSpeed jobs of ``tests/integrations/test_deepspeed.py`` and ``tests/integrations/test_deepspeed_matrix.py``:
DeepSpeed on CPU with gloo under torchrun, a tiny model, real ZeRO checkpoints.

A DeepSpeed process spends ~18 s of CPU before its first step (importing DeepSpeed, torch's compiler stack that
creating an optimizer imports, loading the compiled ops), so the two files share their jobs: one 2-rank ``train``
job runs every training setup of both, and one ``resume`` job per world size (1, 2, 3) resumes them all
(:class:`Jobs`, run once per test session). The global batch (6 samples) is the same at every world size
(micro-batch x gradient accumulation x ranks), so the losses after a resume at another degree differ only by the
order in which the gradient reduction adds floating-point numbers.

DeepSpeed on CPU (docs/guide, "DeepSpeed on CPU"): ``DS_ACCELERATOR=cpu``; the shared-memory all-reduce op DeepSpeed
would compile in ``init_distributed`` is replaced by nothing (gloo does every collective); FusedAdam and
DeepSpeedCPUAdam are C++ ops DeepSpeed compiles on first use into torch's extension cache, once per machine.
This file is the torchrun script (``python -m torch.distributed.run ... deepspeed_worker.py MODE DIR``).
"""

from __future__ import annotations

import fcntl
import functools
import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import run_group

GLOBAL_BATCH = 6
MICRO_BATCH = {1: 3, 2: 3, 3: 2}  # by world size: x gradient accumulation x ranks = GLOBAL_BATCH
TRAIN_STEPS, NEXT_STEPS = 3, 3
RUNS = {"zero2": 2, "zero3": 3}  # test_deepspeed.py: checkpoint directory -> ZeRO stage (fp32, torch AdamW, resumed)
ONE_STEP_RUNS = {"zero1_bf16": (1, True), "stage0": (0, False)}  # test_deepspeed.py: saved after one step only
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # DeepSpeed on CPU; 2 cores for up to 3 ranks


@dataclass(frozen=True)
class Cell:
    """One training setup of test_deepspeed_matrix.py."""

    stage: int
    optimizer: str  # "fused" (DeepSpeed's default), "torch" (torch_adam) or "cpu_adam" (ZeRO-Offload)
    bf16: bool

    @property
    def name(self) -> str:
        return f"zero{self.stage}_{self.optimizer}_{'bf16' if self.bf16 else 'fp32'}"


CELLS = [Cell(stage, optimizer, bf16) for stage in (1, 2, 3) for optimizer in ("fused", "torch", "cpu_adam")
         for bf16 in (False, True)]
MATRIX_WORLDS = (1, 3)  # the matrix resumes at these world sizes (saved at 2)
OPTIONS = {"no_optimizer": {"load_optimizer_states": False}, "module_only": {"load_module_only": True},
           "no_lr_scheduler": {"load_lr_scheduler_states": False}}
OPTION_CELLS = [Cell(2, "fused", False), Cell(3, "fused", True)]  # ZeRO 1/2's code path and ZeRO 3's
CROSS = [(Cell(2, "fused", False), "torch"), (Cell(2, "torch", False), "fused"), (Cell(3, "cpu_adam", True), "fused"),
         (Cell(1, "fused", True), "cpu_adam")]  # saved with one optimizer, resumed with another


# ------------------------------------------------------------------------------------------------ engines


def model(outputs: int = 3) -> torch.nn.Module:
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


def config(stage: int, world: int, bf16: bool = False, optimizer: str = "torch") -> dict[str, Any]:
    """The DeepSpeed config of a run: the same global batch at any world size; ``optimizer`` "torch" is torch's
    AdamW (``torch_adam``), "fused" DeepSpeed's default for ``"type": "AdamW"`` (FusedAdam), "cpu_adam" the same
    with ZeRO-Offload (DeepSpeedCPUAdam)."""
    micro = MICRO_BATCH[world]
    params = {"lr": 1e-2, **({"torch_adam": True} if optimizer == "torch" else {})}
    zero: dict[str, Any] = {"stage": stage}
    if optimizer == "cpu_adam":
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": GLOBAL_BATCH // (micro * world),
            "optimizer": {"type": "AdamW", "params": params},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
            "zero_optimization": zero, "bf16": {"enabled": bf16}}


def make_engine(stage: int, world: int, bf16: bool = False, optimizer: str = "torch", outputs: int = 3) -> Any:
    import deepspeed

    module = model(outputs)
    params = [p for p in module.parameters() if p.requires_grad]
    return deepspeed.initialize(model=module, model_parameters=params,
                                config=config(stage, world, bf16, optimizer))[0]


def cell_engine(cell: Cell, world: int, optimizer: str | None = None) -> Any:
    """A fresh engine for ``cell`` (with another optimizer if given) at ``world`` ranks."""
    return make_engine(cell.stage, world, cell.bf16, optimizer or cell.optimizer)


def train(engine: Any, first: int, steps: int) -> list[float]:
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


def full_states(engine: Any, moments: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> dict[str, torch.Tensor]:
    """DeepSpeed's own view of the full fp32 parameters and Adam moments (collectives: every rank calls it)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            out[f"model.{name}"] = safe_get_full_fp32_param(param).cpu()
            for key in moments:
                out[f"optim.state.{name}.{key}"] = safe_get_full_optimizer_state(param, key).cpu()
    return out


def steps(engine: Any) -> list[list[Any]]:
    """Each flat group's optimizer step as the base optimizer holds it: [type name, value]."""
    return [[type(s["step"]).__name__, float(s["step"])] for s in engine.optimizer.optimizer.state.values()
            if "step" in s]


def differences(engine: Any, reference: Path, moments: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> list[str]:
    """The keys where DeepSpeed's full view of the engine (its fp32 master weights and ``moments``) differs from the
    one saved at ``reference``; every rank calls it, rank 0 answers."""
    import deepspeed.comm as dist

    full = full_states(engine, moments)
    if dist.get_rank() != 0:
        return []
    saved = {k: v for k, v in torch.load(reference, weights_only=True).items() if moments or k.startswith("model.")}
    return sorted(k for k in saved.keys() | full.keys() if k not in full or k not in saved
                  or not torch.equal(full[k], saved[k]))


# ------------------------------------------------------------------------------------------------ the jobs


def _train_runs(root: Path, world: int, rank: int) -> dict[str, Any]:
    """test_deepspeed.py's runs: saved (with a client state), DeepSpeed's view kept, trained on (reference)."""
    results = {}
    for name, stage in RUNS.items():
        run = make_engine(stage, world)
        train(run, 0, TRAIN_STEPS)
        run.save_checkpoint(str(root / name), client_state={"epoch": 3, "note": "tiny"})
        full = full_states(run)
        if rank == 0:
            torch.save(full, root / f"{name}_full.pt")
        results[name] = train(run, TRAIN_STEPS, NEXT_STEPS)
    for name, (stage, bf16) in ONE_STEP_RUNS.items():
        run = make_engine(stage, world, bf16)
        train(run, 0, 1)
        run.save_checkpoint(str(root / name))
    return results


def _resume_runs(root: Path, world: int) -> dict[str, Any]:
    import arrayckpt.deepspeed

    results: dict[str, Any] = {}
    for name, stage in RUNS.items():
        run = make_engine(stage, world)
        fresh = ((run(torch.zeros(1, 4, dtype=torch.long)).float()) ** 2).sum().item()
        client = arrayckpt.deepspeed.load(run, root / f"{name}.arrayckpt")
        loaded = ((run(torch.zeros(1, 4, dtype=torch.long)).float()) ** 2).sum().item()
        results[name] = {"client": client, "global_steps": run.global_steps, "changed": fresh != loaded,
                         "losses": train(run, TRAIN_STEPS, NEXT_STEPS)}
    if world == 1:  # a checkpoint of another model: refused before anything changes
        run = make_engine(2, world, outputs=4)
        try:
            arrayckpt.deepspeed.load(run, root / "zero2.arrayckpt")
        except arrayckpt.ArrayckptError as e:
            results["refused"] = f"{type(e).__name__}: {e}"
    return results


def _tied_engine(seed: int) -> Any:
    """ZeRO-2 (DeepSpeed's default AdamW: FusedAdam) on a tiny GPT-2 whose ``lm_head.weight`` is
    ``transformer.wte.weight`` (``tie_word_embeddings``): ``named_parameters()`` names the tie once, its state dict
    twice."""
    import deepspeed
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    module = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=34, n_positions=8,
                                        tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                config=config(2, 1, optimizer="fused"))[0]


def _tied_steps(engine: Any, first: int, steps: int) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        ids = torch.randint(0, 34, (GLOBAL_BATCH, 8), generator=torch.Generator().manual_seed(step))
        for i in range(engine.gradient_accumulation_steps()):
            loss = engine(ids[i * 3:(i + 1) * 3], labels=ids[i * 3:(i + 1) * 3]).loss
            engine.backward(loss)
            engine.step()
        losses.append(loss.item())
    return losses


def _tied_run(root: Path) -> dict[str, Any]:
    """A tied GPT-2 trained, saved by DeepSpeed, converted and resumed into a fresh engine (one rank, in the world-1
    resume job: no launch of its own): whether the load kept the tie, gave the saved state bit for bit and the next
    losses of DeepSpeed's own ``engine.load_checkpoint`` (which differ from the uninterrupted run's by ~5e-7: ZeRO-2
    sums a tied parameter's gradient in another order after a resume)."""
    import arrayckpt
    import arrayckpt.deepspeed

    run = _tied_engine(0)
    _tied_steps(run, 0, 2)
    run.save_checkpoint(str(root / "tied"))
    saved = {k: v.clone() for k, v in run.module.state_dict().items()}
    full = full_states(run)
    reference = _tied_steps(run, 2, 2)
    arrayckpt.convert(root / "tied", root / "tied.arrayckpt")
    with arrayckpt.open(root / "tied.arrayckpt") as ckpt:
        stored = {k: ckpt.aliases().get(k, "array") for k in ckpt if k.startswith("model.")}
    own = _tied_engine(1)
    own.load_checkpoint(str(root / "tied"))
    fresh = _tied_engine(1)
    try:
        arrayckpt.deepspeed.load(fresh, root / "tied.arrayckpt")
    except arrayckpt.ArrayckptError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    module = fresh.module
    return {"stored": stored, "tied": module.lm_head.weight.data_ptr() == module.transformer.wte.weight.data_ptr(),
            "differences": sorted(k for k, v in module.state_dict().items() if not torch.equal(v, saved[k])) +
            sorted(k for k, v in full_states(fresh).items() if not torch.equal(v, full[k])), "steps": steps(fresh),
            "lr": [g["lr"] for g in fresh.optimizer.param_groups], "global_steps": fresh.global_steps,
            "losses": _tied_steps(fresh, 2, 2), "deepspeed_losses": _tied_steps(own, 2, 2), "reference": reference}


def _train_cells(root: Path, world: int, rank: int) -> dict[str, Any]:
    """Every matrix cell trained, saved, DeepSpeed's view of its state kept, then trained on (reference)."""
    results = {}
    for cell in CELLS:
        run = cell_engine(cell, world)
        train(run, 0, TRAIN_STEPS)
        run.save_checkpoint(str(root / cell.name))
        full = full_states(run)
        if rank == 0:
            torch.save(full, root / f"{cell.name}_full.pt")
        results[cell.name] = {"optimizer": type(run.optimizer.optimizer).__name__, "steps": steps(run),
                              "losses": train(run, TRAIN_STEPS, NEXT_STEPS)}
    return results


def _resume_cells(root: Path, world: int) -> dict[str, Any]:
    """Every matrix cell loaded into a fresh engine: DeepSpeed's view of the state, then the next steps."""
    import arrayckpt.deepspeed

    results = {}
    for cell in CELLS:
        run = cell_engine(cell, world)
        arrayckpt.deepspeed.load(run, root / f"{cell.name}.arrayckpt")
        results[cell.name] = {"steps": steps(run), "global_steps": run.global_steps,
                              "differences": differences(run, root / f"{cell.name}_full.pt"),
                              "losses": train(run, TRAIN_STEPS, NEXT_STEPS)}
    return results


def _options_and_cross(root: Path, world: int) -> dict[str, Any]:
    """``engine.load_checkpoint``'s flags, and checkpoints resumed with another optimizer than they were saved with."""
    import arrayckpt.deepspeed

    results: dict[str, Any] = {}
    for cell in OPTION_CELLS:
        for option, flags in OPTIONS.items():
            run = cell_engine(cell, world)
            fresh_scheduler = run.lr_scheduler.state_dict()
            arrayckpt.deepspeed.load(run, root / f"{cell.name}.arrayckpt", **flags)
            got = {"global_steps": run.global_steps, "steps": steps(run),
                   "scheduler_kept": run.lr_scheduler.state_dict() == fresh_scheduler,
                   "scheduler_iteration": run.lr_scheduler.last_batch_iteration,
                   "weight_differences": differences(run, root / f"{cell.name}_full.pt", ())}
            got["losses"] = train(run, TRAIN_STEPS, 1)
            got["steps_after"] = steps(run)
            results[f"{cell.name}/{option}"] = got
    for cell, optimizer in CROSS:
        run = cell_engine(cell, world, optimizer)
        arrayckpt.deepspeed.load(run, root / f"{cell.name}.arrayckpt")
        results[f"{cell.name}->{optimizer}"] = {"optimizer": type(run.optimizer.optimizer).__name__,
                                                "steps": steps(run), "losses": train(run, TRAIN_STEPS, NEXT_STEPS)}
    return results


def _worker(mode: str, root: Path) -> None:
    import cpuinfo
    import deepspeed
    import deepspeed.comm as dist

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo only: no shm op to compile
    # DeepSpeedCPUAdam asks py-cpuinfo (subprocesses, ~1.5 s) at every construction; the answer does not change
    cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    deepspeed.init_distributed("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if mode == "train":
        results = {"runs": _train_runs(root, world, rank), "cells": _train_cells(root, world, rank)}
    else:
        results = {"runs": _resume_runs(root, world)}
        if world in MATRIX_WORLDS:
            results["cells"] = _resume_cells(root, world)
        if world == 1:
            results["cells"] |= _options_and_cross(root, world)
            results["tied"] = _tied_run(root)
    if rank == 0:
        (root / f"{mode}_{world}.json").write_text(json.dumps(results))
    leave(dist)


def leave(dist: Any) -> None:
    """End a finished job: wait for every rank, then exit without the interpreter's teardown.

    In 2 of ~10 CI-like runs one rank of a DeepSpeed job aborted *after* its work (the same output as a good run, then
    ``terminate called without an active exception``: a joinable C++ thread destroyed while the process exits with
    DeepSpeed's and gloo's objects alive). Everything the tests read is written before the barrier, so ``os._exit``
    skips the teardown that crashes and nothing is lost."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------------ for the tests


JOB_TIMEOUT_S = 900  # one torchrun job, once the ops are built (~1-3 minutes on a quiet 2-core machine)
BUILD_TIMEOUT_S = 2400  # DeepSpeed's FusedAdam and CPUAdam compiled from scratch (~18 minutes on a busy 2-core one)


def _extensions_root() -> Path:
    """torch's extension cache, where DeepSpeed's ops are compiled (``TORCH_EXTENSIONS_DIR`` overrides it)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torch_extensions"


_BUILD = """
from deepspeed.accelerator import get_accelerator
for name in ("CPUAdamBuilder", "FusedAdamBuilder"):
    get_accelerator().create_op_builder(name).load()
"""
_BUILT: list[bool] = []


def build_ops() -> None:
    """Compile DeepSpeed's CPU ops once, before any timed job (a fresh machine spends ~18 minutes here, which the
    jobs' timeouts must not pay). Builds of concurrent test runs take turns (an ``flock``); holding it, a ``lock``
    file torch left in the cache is stale (a build killed mid-way: torch's loaders would wait on it forever), and
    is removed."""
    if _BUILT:
        return
    root = _extensions_root()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".arrayckpt-tests-build.lock", "w") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)
        for stale in root.glob("*/*/lock"):
            stale.unlink(missing_ok=True)
        env = {**os.environ, **ENV}
        done = run_group([sys.executable, "-c", _BUILD], env, BUILD_TIMEOUT_S, "building DeepSpeed's ops")
    if done.returncode != 0:
        pytest.fail(f"building DeepSpeed's CPU ops failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    _BUILT.append(True)


def torchrun(script: str, ranks: int, mode: str, root: Path, result: str) -> dict[str, Any]:
    """``script`` (a torchrun script of tests/) in ``mode`` on ``ranks`` ranks; the JSON its rank 0 wrote to
    ``root / result``. DeepSpeed's ops are built first (:func:`build_ops`), outside the job's timeout."""
    build_ops()
    env = {**os.environ, **ENV,  # DeepSpeed's C++ ops go to torch's extension cache, compiled once per machine
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script,
               mode, str(root)]
    (root / result).unlink(missing_ok=True)
    done = run_group(command, env, JOB_TIMEOUT_S, f"torchrun {mode} on {ranks} ranks")
    if done.returncode != 0:
        pytest.fail(f"torchrun {mode} on {ranks} ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads((root / result).read_text())


def _torchrun(ranks: int, mode: str, root: Path) -> dict[str, Any]:
    """This file's worker in ``mode`` on ``ranks`` ranks; what its rank 0 wrote."""
    return torchrun(__file__, ranks, mode, root, f"{mode}_{ranks}.json")


class Jobs:
    """The session's DeepSpeed jobs, each run once when a test first needs it: ``trained()`` (the 2-rank job, then
    every checkpoint converted to ``<name>.arrayckpt``) and ``resumed(ranks)``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._done: dict[tuple[str, int], dict[str, Any]] = {}

    def trained(self) -> dict[str, Any]:
        if ("train", 2) not in self._done:
            import arrayckpt

            results = _torchrun(2, "train", self.root)
            results["converted"] = {}
            for name in (*RUNS, "zero1_bf16", *(cell.name for cell in CELLS)):
                done = arrayckpt.convert(self.root / name, self.root / f"{name}.arrayckpt")
                results["converted"][name] = [done.source_format, done.target_format]
            self._done["train", 2] = results
        return self._done["train", 2]

    def resumed(self, ranks: int) -> dict[str, Any]:
        self.trained()
        if ("resume", ranks) not in self._done:
            self._done["resume", ranks] = _torchrun(ranks, "resume", self.root)
        return self._done["resume", ranks]


_SESSIONS: dict[int, Jobs] = {}  # by id of the session's tmp_path_factory (which is not hashable)


def jobs(factory: pytest.TempPathFactory) -> Jobs:
    """The session's :class:`Jobs` (``factory``: the session's ``tmp_path_factory``)."""
    if id(factory) not in _SESSIONS:
        _SESSIONS[id(factory)] = Jobs(factory.mktemp("deepspeed"))
    return _SESSIONS[id(factory)]


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
