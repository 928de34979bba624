"""Sweep: arrayckpt against DCP over state sizes x gloo ranks x cold (fresh process) and warm, in one run.

Run from the repository root::

    python benchmarks/sweep.py                                   # 1, 8, 64, 512, 2048 MiB x 1, 2, 4 ranks, /dev/shm
    python benchmarks/sweep.py --sizes 1,8,64 --ranks 1,2        # what a small machine allows in a few minutes
    python benchmarks/sweep.py --dir /tmp --json disk.json       # on disk (both systems flush; plain fsyncs)

What it measures
----------------
A state of ``size`` MiB (global, float32): 2-D matrices of up to 16 MiB (1024 columns), sharded on dim 0 as
``DTensor`` ``[Shard(0)]`` over the ranks (plain tensors with one rank), and per matrix a 4 KiB bias identical on
every rank (replicated, as FSDP's norms and biases are in DCP's eyes). The values are a cheap fill: neither
system compresses, so they do not matter. Ranks are spawned interpreters (``subprocess``), in one gloo process
group on 127.0.0.1 when there are several; each op is timed by every rank between two barriers, and its time
is the maximum over the ranks.

- ``cold``: a fresh set of processes makes the first ``save`` of the process (torch, ``torch.distributed`` and
  DCP imported beforehand, as in training code that uses ``get_state_dict``; ``import arrayckpt`` too); another
  fresh set makes the first in-place ``load`` of that checkpoint (a resume). Per repeat the systems alternate.
- ``warm``: one set of processes saves and loads a tiny state with every system first (imports, thread pools),
  then per repeat, systems interleaved (A B A B ...): a save of the state, an in-place load, removal.
  At >= 256 MiB ``plain`` takes part: the same bytes (each rank its shards, rank 0 the replicated biases), one
  file per tensor, written by the same number of writers (``pwritev`` + ``fsync`` per file; no format, no
  checksums) and read back with ``preadv`` into the tensors: the machine's limit. ``plaincrc`` is the same plus
  one crc32c pass over the bytes (before writing, after reading): the limit of any format that checksums its
  data, as arrayckpt does every chunk (the `crc32c` package, ~13 GB/s on one core here). With one rank ``torch``
  takes part too: ``torch.save`` to one file (no flush) and ``torch.load(weights_only=True)`` + ``copy_``.

Reported per cell: median seconds over the repeats of each system, ``DCP/arrayckpt`` (> 1: arrayckpt is faster)
and, where measured, ``plain/arrayckpt``, ``plain+crc/arrayckpt`` and ``torch/arrayckpt``. The machine may be
shared and have few cores: trust medians, and rerun a cell that looks off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

MATRIX_MIB = 16
COLUMNS = 1024
PLAIN_MIN_MIB = 256


# --------------------------------------------------------------------------------------------- worker


def _state(size_mib: float, rank: int, world: int) -> dict[str, Any]:
    """This rank's part of the state (see the module docstring)."""
    import torch

    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
    total_rows = max(world, int(size_mib * 2**20 / (COLUMNS * 4)))
    per = MATRIX_MIB * 2**20 // (COLUMNS * 4)
    state: dict[str, Any] = {}
    for i, start in enumerate(range(0, total_rows, per)):
        rows = min(per, total_rows - start)
        lo, hi = rank * rows // world, (rank + 1) * rows // world
        local = torch.full((hi - lo, COLUMNS), float(i + 1))
        state[f"layer{i}.weight"] = local if world == 1 else DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=torch.Size((rows, COLUMNS)),
            stride=(COLUMNS, 1))
        state[f"layer{i}.bias"] = torch.full((COLUMNS,), float(i))
    return {"model": state}


def _local_tensors(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """The bytes this rank writes in ``plain``: its shards, and (rank 0) the replicated tensors."""
    out = {}
    for key, value in state["model"].items():
        if hasattr(value, "to_local"):
            out[key] = value.to_local()
        elif rank == 0:
            out[key] = value
    return out


def _plain_save(tensors: dict[str, Any], path: str, checksum: bool = False) -> None:
    """Each tensor's bytes to a file of its own, flushed; with ``checksum`` their crc32c computed first (the one
    pass over the data that a format verifying its chunks cannot avoid)."""
    import crc32c

    os.makedirs(path, exist_ok=True)
    for key, tensor in tensors.items():
        data = memoryview(tensor.numpy()).cast("B")
        if checksum:
            crc32c.crc32c(data)
        fd = os.open(os.path.join(path, key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwritev(fd, [data], 0)
            os.fsync(fd)
        finally:
            os.close(fd)


def _plain_load(tensors: dict[str, Any], path: str, checksum: bool = False) -> None:
    import crc32c

    for key, tensor in tensors.items():
        data = memoryview(tensor.numpy()).cast("B")
        fd = os.open(os.path.join(path, key), os.O_RDONLY)
        try:
            os.preadv(fd, [data], 0)
        finally:
            os.close(fd)
        if checksum:
            crc32c.crc32c(data)


def _ops(system: str, state: dict[str, Any], rank: int) -> dict[str, Any]:
    """save(path) and load(path) of ``system``."""
    import torch

    import arrayckpt

    if system == "arrayckpt":
        return {"save": lambda p: arrayckpt.save(state, p), "load": lambda p: arrayckpt.load(state, p)}
    if system == "dcp":
        import torch.distributed.checkpoint as dcp

        return {"save": lambda p: dcp.save(state, checkpoint_id=p), "load": lambda p: dcp.load(state, checkpoint_id=p)}
    if system in ("plain", "plaincrc"):
        tensors, checksum = _local_tensors(state, rank), system == "plaincrc"
        return {"save": lambda p: _plain_save(tensors, f"{p}/{rank}", checksum),
                "load": lambda p: _plain_load(tensors, f"{p}/{rank}", checksum)}

    def load(path: str) -> None:
        loaded = torch.load(path, weights_only=True)
        for key, tensor in state["model"].items():
            tensor.copy_(loaded["model"][key])

    return {"save": lambda p: torch.save(state, p), "load": load}


def _worker(args: argparse.Namespace) -> None:
    """One rank: run ``args.steps`` (JSON: [[system, op, path], ...]) timed; print the times as JSON."""
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401  (imported by code that uses get_state_dict)
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import arrayckpt  # noqa: F401

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    torch.set_num_threads(1)
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world)
    barrier = dist.barrier if args.world > 1 else (lambda: None)
    if args.warmup:  # a tiny state through every system: imports, thread pools, gloo connections
        tiny = _state(1 / 16, args.rank, args.world)
        for system in ("arrayckpt", "dcp", "plain", "plaincrc"):
            ops, path = _ops(system, tiny, args.rank), os.path.join(args.dir, f"warmup-{system}")
            ops["save"](path)
            barrier()
            ops["load"](path)
            barrier()
    state = _state(args.size_mib, args.rank, args.world)
    times = []
    for system, op, path in json.loads(args.steps):
        if op == "remove":
            barrier()
            if args.rank == 0:
                shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
            barrier()
            continue
        fn = _ops(system, state, args.rank)[op]
        barrier()
        start = time.perf_counter()
        fn(path)
        barrier()
        times.append(time.perf_counter() - start)
    print(json.dumps(times))
    if args.world > 1:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(steps: list[list[str]], world: int, size_mib: float, directory: str, warmup: bool) -> list[float]:
    """Fresh processes running ``steps``; each timed step's time (max over the ranks)."""
    port = _free_port()
    command = [sys.executable, __file__, "--worker", "--world", str(world), "--port", str(port), "--dir", directory,
               "--size-mib", str(size_mib), "--steps", json.dumps(steps)]
    if warmup:
        command.append("--warmup")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([*command, "--rank", str(rank)], stdout=subprocess.PIPE, env=env, text=True)
             for rank in range(world)]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {steps[:2]}... at {world} ranks, {size_mib} MiB")
    per_rank = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return [max(column) for column in zip(*per_rank, strict=True)]


def _cell(size: float, world: int, args: argparse.Namespace, samples: dict[tuple, list[float]]) -> None:
    """Every measurement of one size and number of ranks, into ``samples[(size, world, mode, system, op)]``."""
    directory = tempfile.mkdtemp(prefix="sweep-", dir=args.dir)
    try:
        for repeat in range(args.cold_repeats):
            for system in ("arrayckpt", "dcp") if repeat % 2 == 0 else ("dcp", "arrayckpt"):
                path = os.path.join(directory, f"cold-{system}")
                for op in ("save", "load"):
                    steps = [[system, op, path]] + ([[system, "remove", path]] if op == "load" else [])
                    samples.setdefault((size, world, "cold", system, op), []).extend(
                        _run(steps, world, size, directory, warmup=False))
        systems = ["arrayckpt", "dcp"] + (["plain", "plaincrc"] if size >= PLAIN_MIN_MIB else [])
        systems += ["torch"] if world == 1 else []
        steps, keys = [], []
        for repeat in range(args.repeats):
            for system in systems[repeat % len(systems):] + systems[:repeat % len(systems)]:
                path = os.path.join(directory, f"warm-{system}-{repeat}")
                steps += [[system, "save", path], [system, "load", path], [system, "remove", path]]
                keys += [(size, world, "warm", system, "save"), (size, world, "warm", system, "load")]
        for key, seconds in zip(keys, _run(steps, world, size, directory, warmup=True), strict=True):
            samples.setdefault(key, []).append(seconds)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


SYSTEMS = ("arrayckpt", "dcp", "plain", "plaincrc", "torch")


def _table(samples: dict[tuple, list[float]], args: argparse.Namespace) -> str:
    lines = [f"sweep on {args.dir}: median seconds (cold: {args.cold_repeats} fresh-process repeats, warm: "
             f"{args.repeats} repeats); ratios are other/arrayckpt time (> 1: arrayckpt is faster)",
             "| MiB | ranks | mode | op | arrayckpt s | DCP s | DCP/arrayckpt | plain/arrayckpt | plain+crc/arrayckpt "
             "| torch/arrayckpt |",
             "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    cells = sorted({key[:3] for key in samples}, key=lambda k: (k[0], k[1], k[2]))
    for size, world, mode in cells:
        for op in ("save", "load"):
            med = {s: statistics.median(samples[(size, world, mode, s, op)])
                   for s in SYSTEMS if (size, world, mode, s, op) in samples}
            ours = med["arrayckpt"]
            ratio = [f"{med[s] / ours:.2f}" if s in med else "" for s in SYSTEMS[1:]]
            lines.append(f"| {size:g} | {world} | {mode} | {op} | {ours:.3f} | {med['dcp']:.3f} | "
                         f"{' | '.join(ratio)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1,8,64,512,2048", help="MiB, comma-separated")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=5, help="warm repeats")
    parser.add_argument("--cold-repeats", type=int, default=2)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--json", help="write every sample here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", help=argparse.SUPPRESS)
    parser.add_argument("--size-mib", type=float, default=0, help=argparse.SUPPRESS)
    for name in ("--world", "--rank", "--port"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    from first_call import compile_arrayckpt

    compile_arrayckpt()  # as an installed wheel is (see first_call.py)
    samples: dict[tuple, list[float]] = {}
    for size in [float(s) for s in args.sizes.split(",")]:
        for world in [int(r) for r in args.ranks.split(",")]:
            _cell(size, world, args, samples)
            print(f"done: {size:g} MiB, {world} ranks", file=sys.stderr, flush=True)
    print(_table(samples, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"mib": k[0], "ranks": k[1], "mode": k[2], "system": k[3], "op": k[4], "seconds": v}
                       for k, v in samples.items()], f, indent=1)


if __name__ == "__main__":
    main()
