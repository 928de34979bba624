"""Save an FSDP2 training run on 2 ranks, resume it on 1 rank and on 3 ranks.

This example shows arrayckpt's central promise: a sharded checkpoint written by N ranks can be
loaded by any number M of ranks, each rank reading only the rows its shards hold, and training
continues as if it had never stopped.

Everything runs on the CPU (gloo on 127.0.0.1, ranks spawned with ``multiprocessing``) in a few
seconds:

* The model is three ``Linear`` layers with uneven sizes (6 -> 10 -> 7 -> 2), each wrapped with
  ``torch.distributed.fsdp.fully_shard`` (FSDP2) on a 1-D ``init_device_mesh("cpu", (world,))``,
  and trained with AdamW. FSDP2 shards every parameter along dim 0 (DTensor ``Shard(0)``), so on
  3 ranks the 10-row weight is split 4/4/2, the 7-row one 3/3/1, and the 2-row one 1/1/0 (the last
  rank holds none of it) -- the save layout (2 ranks: 5/5, 4/3, 1/1) and the load layouts differ.
* Model and optimizer state dicts come from ``torch.distributed.checkpoint.state_dict``:
  ``get_state_dict(model, optim)`` gives DTensors (it also creates the AdamW state of a fresh
  optimizer, so that there is something to load into), ``set_state_dict(...)`` puts loaded
  values back. arrayckpt saves and loads those dicts directly.

Why the losses do not depend on the world size: every step draws one *global* batch of
``GLOBAL_BATCH`` (24, divisible by 1, 2 and 3) samples from the global RNG, which is seeded
identically on every rank, so all ranks draw the same batch; rank ``r`` of ``W`` trains on rows
``r*24/W .. (r+1)*24/W``. Each rank's loss is the mean over its equally sized slice, and FSDP2
averages the gradients over the ranks, so the gradient is the mean-squared-error gradient of the
whole global batch whatever ``W`` is; the loss printed is the all-reduced mean of the ranks'
losses, i.e. the loss of the whole batch. Only the order of float additions (inside the matmuls
and in the gradient reduce-scatter) depends on ``W``, so losses on different world sizes agree to
float tolerance (checked with ``rtol=1e-5``), not bit for bit. The RNG state is part of the
checkpoint (``arrayckpt.PerRank(torch.get_rng_state())``); resuming on another world size takes
rank 0's (``PerRank(..., rank=0)``), so the resumed run draws the same batches as the reference.

Phases:

A. reference: 2 ranks train ``2 * --steps`` steps without interruption; losses are recorded.
B. 2 ranks train ``--steps`` steps from the same seed and save
   ``{"model": model_sd, "optim": optim_sd, "step": N, "rng": PerRank(rng_state)}``; the saved
   arrays are compared with the ranks' gathered (``full_tensor()``) state.
C. on 1 rank, then on 3 ranks: a fresh, differently initialised model + ``fully_shard`` + a fresh
   AdamW; ``get_state_dict`` gives the target dicts, ``arrayckpt.load`` fills them (in place: each
   rank reads just its rows into the DTensors' local shards), ``set_state_dict`` applies them.
   Right after loading, every gathered parameter and optimizer state must be bit-identical to the
   saved global arrays (``arrayckpt.open(path)[key].torch()``); then ``--steps`` more steps must
   reproduce phase A's losses for steps N+1..2N.

Run it with::

    python examples/fsdp_resume.py                    # checkpoint in a temporary directory
    python examples/fsdp_resume.py --dir /tmp/ck --steps 8

It prints a short summary and exits with status 1 on any mismatch (0 on success).
"""

from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing as mp
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import arrayckpt

SUCCESS_LINE = "OK: FSDP2 checkpoint saved on 2 ranks resumes on 1 and 3 ranks"

SAVE_WORLD = 2
RESUME_WORLDS = (1, 3)
IN_FEATURES, HIDDEN1, HIDDEN2, OUT_FEATURES = 6, 10, 7, 2
GLOBAL_BATCH = 24  # divisible by every world size used
INIT_SEED, OTHER_INIT_SEED, DATA_SEED = 0, 1234, 42
LR, WEIGHT_DECAY = 1e-2, 0.01
RTOL, ATOL = 1e-5, 1e-8
RANK_TIMEOUT_S = 120


class Net(nn.Module):
    """Three Linear layers whose output sizes (10, 7, 2) do not divide by 3."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_FEATURES, HIDDEN1)
        self.fc2 = nn.Linear(HIDDEN1, HIDDEN2)
        self.fc3 = nn.Linear(HIDDEN2, OUT_FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


# ---------------------------------------------------------------------------------------------
# Training (runs inside every rank)
# ---------------------------------------------------------------------------------------------


def build(world: int, init_seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A seeded model, sharded with FSDP2 over all ``world`` ranks, and a fresh AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(init_seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model.fc1, model.fc2, model.fc3):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    return model, optim


_TEACHER = torch.randn(IN_FEATURES, OUT_FEATURES, generator=torch.Generator().manual_seed(7))


def global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, from the global RNG (identical on all ranks: same seed, same draws)."""
    x = torch.randn(GLOBAL_BATCH, IN_FEATURES)
    y = torch.sin(x @ _TEACHER) + 0.1 * torch.randn(GLOBAL_BATCH, OUT_FEATURES)
    return x, y


def train(model: nn.Module, optim: torch.optim.Optimizer, rank: int, world: int, steps: int) -> list[float]:
    """``steps`` optimizer steps; returns the global-batch loss of each step (same on every rank)."""
    per_rank = GLOBAL_BATCH // world
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    losses = []
    for _ in range(steps):
        x, y = global_batch()
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        optim.zero_grad(set_to_none=True)
        loss.backward()  # FSDP2 reduce-scatters the gradients, averaging over the ranks
        optim.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def full_tensors(model_sd: dict, optim_sd: dict) -> dict[str, torch.Tensor]:
    """Every tensor of the state dicts gathered to its global value (collective: all ranks call it),
    keyed like the checkpoint's arrays (``model.<fqn>``, ``optim.state.<fqn>.<name>``)."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model.{fqn}": full(t) for fqn, t in model_sd.items()}
    for fqn, per_param in optim_sd["state"].items():
        for name, value in per_param.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.state.{fqn}.{name}"] = full(value)
    return out


def compare_with_checkpoint(path: str, gathered: dict[str, torch.Tensor], what: str) -> list[str]:
    """Bit-exact comparison of gathered global tensors with the checkpoint's arrays."""
    reader = arrayckpt.open(path)
    problems = []
    missing = sorted(set(gathered) - set(reader))
    extra = sorted(k for k in set(reader) - set(gathered) if k != "rng")
    if missing or extra:
        problems.append(f"{what}: keys not in the checkpoint {missing}, only in the checkpoint {extra}")
    for key, tensor in gathered.items():
        if key not in reader:
            continue
        saved = reader[key].torch()
        if saved.dtype != tensor.dtype or saved.shape != tensor.shape:
            problems.append(f"{what}: {key} is {tensor.dtype}{list(tensor.shape)}, saved "
                            f"{saved.dtype}{list(saved.shape)}")
        elif not torch.equal(saved, tensor):
            diff = (saved.double() - tensor.double()).abs().max().item()
            problems.append(f"{what}: {key} differs from the saved array (max abs diff {diff:.3g})")
    return problems


def shard_layout(model: nn.Module) -> dict[str, int]:
    """Rows of each weight held by this rank."""
    return {name: p.to_local().shape[0] for name, p in model.named_parameters() if name.endswith("weight")}


def phase_reference_and_save(rank: int, world: int, path: str, n: int) -> dict[str, Any]:
    """Phase A (2N uninterrupted steps) and phase B (N steps, then save) on the same ranks."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = build(world, INIT_SEED)
    torch.manual_seed(DATA_SEED)
    reference = train(model, optim, rank, world, 2 * n)
    del model, optim

    model, optim = build(world, INIT_SEED)
    torch.manual_seed(DATA_SEED)
    losses = train(model, optim, rank, world, n)
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd, "step": n, "rng": arrayckpt.PerRank(torch.get_rng_state())}
    t0 = time.perf_counter()
    arrayckpt.save(state, path, step=n, overwrite=True)  # overwrite: re-running with the same --dir works
    save_s = time.perf_counter() - t0

    gathered = full_tensors(model_sd, optim_sd)
    problems = compare_with_checkpoint(path, gathered, f"save on {world} ranks") if rank == 0 else []
    if rank == 0:
        saved_rng = arrayckpt.open(path).per_rank("rng")
        if len(saved_rng) != world or not torch.equal(saved_rng[0], torch.get_rng_state()):
            problems.append("save: rank 0's RNG state is not the one saved")
    layouts = [None] * world
    dist.all_gather_object(layouts, shard_layout(model))
    return {"reference": reference, "losses": losses, "problems": problems, "save_s": save_s,
            "layout": layouts, "param_groups": optim_sd["param_groups"]}


def phase_resume(rank: int, world: int, path: str, n: int, saved_param_groups: list) -> dict[str, Any]:
    """Phase C: fresh objects on ``world`` ranks, load, check against the checkpoint, train N more steps."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = build(world, OTHER_INIT_SEED)
    torch.manual_seed(DATA_SEED + 1000)  # a different RNG state, which the checkpoint must replace
    model_sd, optim_sd = get_state_dict(model, optim)  # also creates the fresh AdamW's state
    before = full_tensors(model_sd, optim_sd)["model.fc1.weight"]
    state = {
        "model": model_sd,
        "optim": optim_sd,
        "step": -1,
        # The world size changed, so name the saved rank to take the RNG state from.
        "rng": arrayckpt.PerRank(torch.empty_like(torch.get_rng_state()), rank=0),
    }
    t0 = time.perf_counter()
    result = arrayckpt.load(state, path)
    load_s = time.perf_counter() - t0
    loaded = full_tensors(state["model"], state["optim"])  # what arrayckpt.load put into the dicts
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    torch.set_rng_state(state["rng"].value)

    what = f"resume on {_ranks(world)}"
    problems = []
    if result.missing_keys or result.unexpected_keys:
        problems.append(f"{what}: load reported {result!r}")
    if state["step"] != n:
        problems.append(f"{what}: step is {state['step']!r}, expected {n}")
    # What the model and optimizer hold now, as set_state_dict left them, gathered to global tensors.
    model_sd, optim_sd = get_state_dict(model, optim)
    gathered = full_tensors(model_sd, optim_sd)
    if rank == 0:
        problems += compare_with_checkpoint(path, loaded, f"{what}, after arrayckpt.load")
        problems += compare_with_checkpoint(path, gathered, f"{what}, after set_state_dict")
        if optim_sd["param_groups"] != saved_param_groups:
            problems.append(f"{what}: optimizer param_groups {optim_sd['param_groups']} != saved "
                            f"{saved_param_groups}")
        if not torch.equal(torch.get_rng_state(), arrayckpt.open(path).per_rank("rng")[0]):
            problems.append(f"{what}: RNG state is not rank 0's saved state")
        if torch.equal(before, gathered["model.fc1.weight"]):
            problems.append(f"{what}: the fresh model already had the saved weights (nothing was tested)")
    losses = train(model, optim, rank, world, n)
    layouts = [None] * world
    dist.all_gather_object(layouts, shard_layout(model))
    return {"losses": losses, "problems": problems, "load_s": load_s, "layout": layouts}


PHASES = {"save": phase_reference_and_save, "resume": phase_resume}


# ---------------------------------------------------------------------------------------------
# Launching ranks
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, phase: str, args: tuple, results: Any) -> None:
    try:
        torch.set_num_threads(1)  # several ranks share a few cores
        torch.use_deterministic_algorithms(True)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S))
        try:
            results.put((rank, "ok", PHASES[phase](rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def launch(world: int, phase: str, *args: Any) -> dict[str, Any]:
    """Run ``phase`` on ``world`` spawned ranks; returns rank 0's result, raises if any rank failed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, phase, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + RANK_TIMEOUT_S + 30
    try:
        while len(out) + len(errors) < world:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    errors.append(f"ranks {dead} of {world} died" if dead else f"timed out after {RANK_TIMEOUT_S}s")
                    break
                continue
            if status == "ok":
                out[rank] = value
            else:
                errors.append(f"--- rank {rank} of {world} ---\n{value}")
                deadline = min(deadline, time.monotonic() + 10)  # the others may wait in a collective
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError(f"phase {phase!r} failed:\n" + "\n".join(errors))
    return out[0]


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _ranks(world: int) -> str:
    return f"{world} rank{'s' if world != 1 else ''}"


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)


def _layout(layouts: list[dict[str, int]]) -> str:
    names = list(layouts[0])
    return ", ".join(f"{name.removesuffix('.weight')} " + "/".join(str(lay[name]) for lay in layouts)
                     for name in names)


def run(workdir: Path, n: int) -> int:
    path = str(workdir / f"fsdp_step{n:06d}")
    t0 = time.perf_counter()
    saved = launch(SAVE_WORLD, "save", path, n)
    reference, problems = saved["reference"], list(saved["problems"])
    # Same world size, same seeds: the first N steps should agree with the reference (checked to tolerance).
    if not all(_close(a, b) for a, b in zip(reference[:n], saved["losses"], strict=True)):
        problems.append(f"phase B losses {saved['losses']} differ from phase A's first {n} {reference[:n]}")
    resumed = {}
    for world in RESUME_WORLDS:
        resumed[world] = launch(world, "resume", path, n, saved["param_groups"])
        problems += resumed[world]["problems"]
        losses = resumed[world]["losses"]
        for i, (a, b) in enumerate(zip(reference[n:], losses, strict=True)):
            if not _close(a, b):
                problems.append(f"resume on {_ranks(world)}: loss at step {n + i + 1} is {b!r}, reference {a!r} "
                                f"(rel diff {abs(a - b) / abs(a):.2e})")
                break
    elapsed = time.perf_counter() - t0

    reader = arrayckpt.open(path)
    print(f"checkpoint : {path} (step {reader.step}, {len(reader)} arrays, saved on {SAVE_WORLD} ranks in "
          f"{saved['save_s']:.2f}s)")
    print(f"shards     : save on {SAVE_WORLD}: {_layout(saved['layout'])} rows")
    for world in RESUME_WORLDS:
        print(f"             load on {world}: {_layout(resumed[world]['layout'])} rows "
              f"(load {resumed[world]['load_s']:.2f}s)")
    print(f"losses     : step 1 {reference[0]:.6f}, step {n} {reference[n - 1]:.6f}, step {2 * n} "
          f"{reference[-1]:.6f} (reference on {SAVE_WORLD} ranks); the run that saved matched its first {n} "
          f"{'bit for bit' if reference[:n] == saved['losses'] else 'to tolerance'}")
    for world in RESUME_WORLDS:
        losses = resumed[world]["losses"]
        worst = max(abs(a - b) / abs(a) for a, b in zip(reference[n:], losses, strict=True))
        exact = sum(a == b for a, b in zip(reference[n:], losses, strict=True))
        print(f"  resumed on {world} rank{'s' if world > 1 else ' '}: step {2 * n} {losses[-1]:.6f}, max rel diff "
              f"{worst:.1e}, {exact}/{n} bit-identical")
    print(f"total time : {elapsed:.1f}s")
    if problems:
        print(f"MISMATCH ({len(problems)} problems):")
        for p in problems[:20]:
            print(f"  - {p}")
        return 1
    print(SUCCESS_LINE)
    return 0


def _launched() -> bool:
    """Whether a launcher (torchrun, torch.distributed.launch, SLURM's srun through them) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("WORLD_SIZE" in os.environ and "RANK" in os.environ)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=5, help="steps before and after the checkpoint (N)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if _launched():  # under torchrun every rank would spawn its own ranks and wait on the same port: a silent hang
        if os.environ.get("RANK", "0") == "0":
            print("fsdp_resume.py starts its own ranks (it saves on one world size and resumes on another); run it "
                  "as `python examples/fsdp_resume.py`, not under torchrun or another launcher", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
        return run(args.dir, args.steps)
    with tempfile.TemporaryDirectory(prefix="arrayckpt-fsdp-") as tmp:
        return run(Path(tmp), args.steps)


if __name__ == "__main__":
    sys.exit(main())
