"""The DeepSpeed jobs of ``tests/convert/test_deepspeed_universal.py`` (the torchrun script: ``python -m
torch.distributed.run ... universal_worker.py MODE DIR``), on ``deepspeed_worker.py``'s CPU recipe, model, batches and
config: one 2-rank ``train`` job and one ``resume`` job per world size, each process paying DeepSpeed's start-up once.

- ``train`` (2 ranks): ZeRO-2 (fp32, torch's AdamW, WarmupLR) trains 3 steps and saves ``zero2/`` with a client
  state; DeepSpeed's full view of the state goes to ``zero2_full.pt``; rank 0 runs DeepSpeed's own
  ``ds_to_universal.py`` on the tag (``ds_universal/``); the run goes on 3 steps (the reference losses).
- ``resume`` (1 or 3 ranks): ``engine.load_checkpoint`` with ``"load_universal": true`` from the universal
  checkpoints the test wrote: ``zero2.universal`` into a ZeRO-2 and a ZeRO-3 engine, ``plain.universal`` (a plain
  PyTorch run) into a ZeRO-2 engine without an LR scheduler; each reports DeepSpeed's view of the state against the
  saved one, its counters and client state, and the next 3 losses.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import deepspeed_worker as dw
import torch

TRAIN_STEPS, NEXT_STEPS = dw.TRAIN_STEPS, dw.NEXT_STEPS


def universal_engine(stage: int, world: int, scheduler: bool = True) -> Any:
    """A fresh engine (the worker's model and config) that loads universal checkpoints."""
    import deepspeed

    config = dw.config(stage, world) | {"checkpoint": {"load_universal": True}}
    if not scheduler:
        del config["scheduler"]
    module = dw.model()
    return deepspeed.initialize(model=module, model_parameters=[p for p in module.parameters() if p.requires_grad],
                                config=config)[0]


def _ds_to_universal(tag_dir: Path, out: Path) -> None:
    """DeepSpeed's own converter on ``tag_dir`` (one process: no worker pools)."""
    from deepspeed.checkpoint import ds_to_universal

    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        ds_to_universal.main(args)


def _train(root: Path, world: int, rank: int) -> dict[str, Any]:
    import deepspeed.comm as dist

    run = dw.make_engine(2, world)
    dw.train(run, 0, TRAIN_STEPS)
    run.save_checkpoint(str(root / "zero2"), client_state={"epoch": 3})
    full = dw.full_states(run)
    if rank == 0:
        torch.save(full, root / "zero2_full.pt")
        _ds_to_universal(root / "zero2" / f"global_step{TRAIN_STEPS}",
                         root / "ds_universal" / f"global_step{TRAIN_STEPS}_universal")
    dist.barrier()
    return {"zero2": dw.train(run, TRAIN_STEPS, NEXT_STEPS)}


def _resume(root: Path, world: int) -> dict[str, Any]:
    results = {}
    for name, stage, source, scheduler in (("zero2", 2, "zero2", True), ("zero2->zero3", 3, "zero2", True),
                                           ("plain", 2, "plain", False)):
        run = universal_engine(stage, world, scheduler)
        path, client = run.load_checkpoint(str(root / f"{source}.universal"))
        results[name] = {"loaded": Path(path).parent.name if path else None, "epoch": client.get("epoch"),
                         "global_steps": run.global_steps, "steps": dw.steps(run),
                         "scheduler": run.lr_scheduler.last_batch_iteration if scheduler else None,
                         "differences": dw.differences(run, root / f"{source}_full.pt"),
                         "losses": dw.train(run, TRAIN_STEPS, NEXT_STEPS)}
    return results


def _worker(mode: str, root: Path) -> None:
    import cpuinfo
    import deepspeed
    import deepspeed.comm as dist

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # gloo only (deepspeed_worker.py)
    cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)  # as deepspeed_worker.py
    deepspeed.init_distributed("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    results = _train(root, world, rank) if mode == "train" else _resume(root, world)
    if rank == 0:
        (root / f"universal_{mode}_{world}.json").write_text(json.dumps(results))
    dw.leave(dist)


def torchrun(ranks: int, mode: str, root: Path) -> dict[str, Any]:
    """This file's worker in ``mode`` on ``ranks`` ranks; what its rank 0 wrote."""
    return dw.torchrun(__file__, ranks, mode, root, f"universal_{mode}_{ranks}.json")


if __name__ == "__main__":
    _worker(sys.argv[1], Path(sys.argv[2]))
