"""Recovery after losing a node: time to a restored state from peer memory, the node's own shared memory, the
local-disk tier and the object-storage tier (moto on 127.0.0.1), for the same state; and what a memory save blocks
training for next to an asynchronous save.

Run from the repository root (needs the test extras: moto[server], s3fs)::

    python benchmarks/recovery.py                      # 256 MiB, 4 ranks as 2 nodes of 2, 3 repeats
    python benchmarks/recovery.py --mib 32 --repeats 1 # smoke run
    python benchmarks/recovery.py --json recovery.json

What it measures
----------------
One deterministic state of ``--mib`` MiB: ``--tensors`` float32 matrices of width 1024 (values ~ N(0, 0.02)),
each sharded by rows over the ranks (``arrayckpt.Shard``, uneven at 3 ranks). A first job of 4 spawned gloo ranks
on 127.0.0.1, as 2 "nodes" of 2 ranks (each node's memory directory its own directory under ``/dev/shm``), saves it
``--saves`` times with each system, and records the median time ``manager.save`` blocked the caller (the slowest
rank's):

``memory save``
    ``CheckpointManager(..., memory=PeerMemory(every_steps=1, ranks_per_node=2))``: the memory tier alone; returns
    once the state is copied to host buffers (the save into shared memory and the replication run in the
    background).
``async save``
    ``CheckpointManager(<disk>, asynchronous=True)``: returns once the state is staged (copied) in host memory.
``sync save``
    ``CheckpointManager(<disk>)``: for scale.

Each save is waited for (``manager.wait()``, ``manager.memory.wait()``) after its figure is taken, so that no figure
includes waiting for the save before it.

Then each restore runs in a fresh job (new processes, as a restarted job), timed from a barrier after the process
group is up to the state restored on the slowest rank, manager construction included; every restore is checked
(per-row sums of every tensor's bits against the saved state's):

``peer, node lost, 4 ranks``
    node 1's memory directory removed; ranks 2-3 on a replacement node (an empty directory): node 0 surveys and
    checks its files, node 2 fetches what its ranks read from node 0 over the process group, every rank loads.
``peer, node lost, 3 ranks``
    the same onto 3 ranks (N -> M: ranks 0-1 on node 0, rank 2 on the replacement node).
``own shared memory``
    nothing lost: every node restores from its own directory (the baseline a peer restore is held to, 1.5x).
``local disk``
    the durable tier on ``--disk-dir`` (default: a temporary directory under the repository's file system). Right
    after the save its files are mostly in the page cache: this is a warm-cache figure (a real restart after a node
    loss reads a parallel file system over the network).
``object storage``
    ``CheckpointManager("s3://...")`` on a loopback moto server: single-process Python, no real store's latency or
    bandwidth limit (a real bucket is usually slower per byte, faster in parallel).

Each peer restore is run from a freshly saved memory step (the files a replacement node fetched stay in its
directory and would make a second restore local). Repeats run the restores interleaved; medians are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from dist_helpers import run_ranks  # noqa: E402
from s3_server import S3Server, patched_environ, s3_test_env  # noqa: E402

import arrayckpt  # noqa: E402

MIB = 2**20
WIDTH = 1024
NODES_4 = [0, 0, 1, 1]


# --- the state ------------------------------------------------------------------------------------------------------

def rows_of(rank: int, world: int, rows: int) -> tuple[int, int]:
    """torch.chunk's split of ``rows`` over ``world`` ranks: (start, count) of ``rank``."""
    per = -(-rows // world)
    start = min(rank * per, rows)
    return start, min(per, rows - start)


def full_tensor(index: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(index)
    return torch.randn(rows, WIDTH, generator=g) * 0.02


def make_state(rank: int, world: int, mib: float, tensors: int, zeros: bool) -> dict[str, Any]:
    """This rank's rows of every tensor (zeros: a target to restore into)."""
    rows = max(world, int(mib * MIB) // tensors // (WIDTH * 4))
    start, count = rows_of(rank, world, rows)
    state: dict[str, Any] = {}
    for i in range(tensors):
        local = torch.zeros(count, WIDTH) if zeros else full_tensor(i, rows)[start:start + count].clone()
        state[f"layers.{i}.weight"] = arrayckpt.Shard(local, (rows, WIDTH), (start, 0))
    state["step"] = 0
    return state


def row_sums(state: dict[str, Any]) -> dict[str, list[int]]:
    """Every tensor's per-row sums of its bits (int32 view), gathered over the ranks in row order: an exact
    fingerprint of the global state."""
    import torch.distributed as dist

    mine = {k: v.tensor.view(torch.int32).to(torch.int64).sum(dim=1).tolist() for k, v in state.items()
            if isinstance(v, arrayckpt.Shard)}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {k: [s for part in gathered for s in part[k]] for k in mine}


def slowest(seconds: float) -> float:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, seconds)
    return max(out)


# --- the jobs (each runs on every rank of a spawned job) ---------------------------------------------------------

def memory_manager(root: str, directory: str) -> arrayckpt.CheckpointManager:
    return arrayckpt.CheckpointManager(root, interval=arrayckpt.Interval(every_steps=10**9),
                                       memory=arrayckpt.PeerMemory(every_steps=1, ranks_per_node=2,
                                                                   directory=directory))


def save_job(rank: int, world: int, cfg: dict[str, Any], systems: list[str]) -> dict[str, Any]:
    """Save the state with each of ``systems`` ``cfg['saves']`` times; blocked seconds (slowest rank) per save."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    warm_up(rank, world, cfg)
    state = make_state(rank, world, cfg["mib"], cfg["tensors"], zeros=False)
    out: dict[str, Any] = {"fingerprint": row_sums(state)}
    for system in systems:
        if system == "memory save":
            manager = memory_manager(cfg["memory_root"], cfg["shm"][NODES_4[rank]])
        elif system == "async save":
            manager = arrayckpt.CheckpointManager(cfg["disk_root"] + "-async", asynchronous=True)
        elif system == "sync save":
            manager = arrayckpt.CheckpointManager(cfg["disk_root"])
        else:  # object storage
            manager = arrayckpt.CheckpointManager(cfg["s3_root"], storage_options={"endpoint_url": cfg["endpoint"]})
        blocked = []
        for step in range(1, cfg["saves"] + 1):
            state["step"] = step
            dist.barrier()
            start = time.perf_counter()
            manager.save(step, state, force=system != "memory save")
            blocked.append(slowest(time.perf_counter() - start))
            manager.wait()  # each save alone: the next one's figure never includes waiting for this one
            if manager.memory is not None:
                manager.memory.wait()
        manager.close()
        out[system] = blocked
    dist.barrier()
    return out


def restore_job(rank: int, world: int, cfg: dict[str, Any], system: str, nodes: list[int]) -> dict[str, Any]:
    """A restarted job restoring with ``system``: seconds (slowest rank, manager construction included), the
    restored step and the state's fingerprint."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    warm_up(rank, world, cfg)
    state = make_state(rank, world, cfg["mib"], cfg["tensors"], zeros=True)
    dist.barrier()
    start = time.perf_counter()
    if system.startswith("peer") or system == "own shared memory":
        manager = memory_manager(cfg["memory_root"], cfg["shm"][nodes[rank]])
    elif system == "local disk":
        manager = arrayckpt.CheckpointManager(cfg["disk_root"])
    else:
        manager = arrayckpt.CheckpointManager(cfg["s3_root"], storage_options={"endpoint_url": cfg["endpoint"]})
    step = manager.restore(state)
    seconds = slowest(time.perf_counter() - start)
    from_memory = manager.memory is not None and manager.memory.last_step == step
    manager.close()
    return {"seconds": seconds, "step": step, "from_memory": from_memory, "fingerprint": row_sums(state)}


def warm_up(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """A tiny collective save and load elsewhere: the imports (TensorStore alone takes seconds on a busy machine) and
    first-call costs, the same for every system, are paid before the clock starts."""
    tiny = make_state(rank, world, 4 * world * WIDTH / MIB, 1, zeros=False)
    path = f"{cfg['memory_root']}-warm-up-{world}"
    arrayckpt.save(tiny, path, overwrite=True)
    arrayckpt.load(tiny, path)


# --- the driver -------------------------------------------------------------------------------------------------

RESTORES = ("peer, node lost, 4 ranks", "peer, node lost, 3 ranks", "own shared memory", "local disk",
            "object storage")


def lose_node(cfg: dict[str, Any]) -> None:
    """Node 1 is gone (its memory directory with it); the replacement node's directory starts empty."""
    for node in (1, 2):
        shutil.rmtree(cfg["shm"][node], ignore_errors=True)


def run_restore(cfg: dict[str, Any], system: str, fingerprint: dict[str, list[int]], steps: int) -> float:
    if system.startswith("peer") or system == "own shared memory":
        run_ranks(4, save_job, cfg, ["memory save"])  # a fresh memory step on every node
    if system.startswith("peer"):
        lose_node(cfg)
    world = 3 if "3 ranks" in system else 4
    nodes = [0, 0, 2] if world == 3 else ([0, 0, 1, 1] if system == "own shared memory" else [0, 0, 2, 2])
    results = run_ranks(world, restore_job, cfg, system, nodes)
    first = results[0]
    if first["fingerprint"] != fingerprint:
        raise AssertionError(f"{system}: the restored state differs from the saved one")
    expect_memory = system.startswith("peer") or system == "own shared memory"
    if first["step"] != steps or first["from_memory"] != expect_memory:
        raise AssertionError(f"{system}: restored step {first['step']} (from memory: {first['from_memory']})")
    return first["seconds"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=256, help="state size in MiB over all ranks (default 256)")
    p.add_argument("--tensors", type=int, default=16, help="number of tensors (default 16)")
    p.add_argument("--saves", type=int, default=3, help="saves per system in the save job (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="restores per system, interleaved (default 3; 0: saves only)")
    p.add_argument("--shm-dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                   help="where the nodes' memory directories go (default /dev/shm)")
    p.add_argument("--disk-dir", type=Path, default=Path(__file__).resolve().parents[1],
                   help="where the local-disk tier goes (default: a temporary directory in the repository)")
    p.add_argument("--json", help="write every figure and sample here")
    args = p.parse_args(argv)
    shm = Path(tempfile.mkdtemp(prefix="recovery-", dir=args.shm_dir))
    disk = Path(tempfile.mkdtemp(prefix=".recovery-", dir=args.disk_dir))
    samples: dict[str, list[float]] = {s: [] for s in RESTORES}
    try:
        with patched_environ(s3_test_env()), S3Server() as server:
            bucket = server.create_bucket()
            cfg = {"mib": args.mib, "tensors": args.tensors, "saves": args.saves, "endpoint": server.endpoint,
                   "shm": [str(shm / f"node{i}") for i in range(3)], "memory_root": str(disk / "memory-root"),
                   "disk_root": str(disk / "durable"), "s3_root": f"s3://{bucket}/run-{uuid.uuid4().hex[:8]}"}
            print(f"{args.mib:g} MiB in {args.tensors} tensors, 4 ranks as 2 nodes; saving ...", flush=True)
            saved = run_ranks(4, save_job, cfg, ["memory save", "async save", "sync save", "object storage"])[0]
            for system in ("memory save", "async save", "sync save", "object storage"):
                print(f"  {system:>16} blocked " + ", ".join(f"{s:.3f}" for s in saved[system]) + " s", flush=True)
            for rep in range(args.repeats):
                for system in RESTORES:
                    seconds = run_restore(cfg, system, saved["fingerprint"], args.saves)
                    samples[system].append(seconds)
                    print(f"  rep {rep + 1}/{args.repeats} {system:>26}: {seconds:.3f} s", flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    blocked = {s: statistics.median(saved[s]) for s in ("memory save", "async save", "sync save", "object storage")}
    print(f"\n| save (4 ranks, {args.mib:g} MiB) | blocks training s (median of {args.saves}) |\n| --- | --- |")
    for system, value in blocked.items():
        print(f"| {system} | {value:.3f} |")
    print(f"memory save blocks {blocked['memory save'] / blocked['async save']:.2f}x an async save (target <= 1x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "tensors": args.tensors, "cpus": os.cpu_count(), "restores": samples,
                       "saves": {s: saved[s] for s in blocked}}, f, indent=1)
        print(f"wrote {args.json}")
    if not args.repeats:
        return 0
    med = {s: statistics.median(v) for s, v in samples.items()}
    s3 = med["object storage"]
    own = med["own shared memory"]
    print(f"\n{args.mib:g} MiB in {args.tensors} tensors, saved by 4 ranks as 2 nodes; medians over {args.repeats} "
          f"restores (slowest rank, from a barrier after the process group is up, manager included)\n")
    print("| restore | seconds | (min) | x object storage | / own shared memory |\n| --- | --- | --- | --- | --- |")
    for system, value in med.items():
        print(f"| {system} | {value:.3f} | {min(samples[system]):.3f} | {s3 / value:.1f}x faster | "
              f"{value / own:.2f} |")
    print(f"\ntargets: peer (node lost, 4 ranks) {s3 / med['peer, node lost, 4 ranks']:.1f}x faster than object "
          f"storage (>= 5x); {med['peer, node lost, 4 ranks'] / own:.2f}x own shared memory (<= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
