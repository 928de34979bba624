"""Peer memory: lose a node mid-training, resume on fewer ranks from the survivors' memory, losses continuing.

What it does (CPU, gloo on 127.0.0.1, about 15 s on 2 cores):

1. Trains a small MLP for ``--steps`` steps in this process (one rank), as the reference. The training is
   ZeRO-style: the parameters and the Adam moments live as one flat vector sharded over the ranks
   (``arrayckpt.Shard``); each step every rank gathers the full parameters, computes the loss and gradient of the
   same global batch, and updates its own shard. So the losses do not depend on the number of ranks, bit for bit.
2. Starts 4 rank processes (as ``torchrun`` would: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``) forming 2
   "nodes" of 2 ranks, each node with its own memory directory under ``--dir`` (what ``/dev/shm`` is per machine)::

       manager = arrayckpt.CheckpointManager(dir / "durable", interval=arrayckpt.Interval(every_steps=6),
                                             memory=arrayckpt.PeerMemory(every_steps=2, ranks_per_node=2,
                                                                         directory=dir / f"shm-node{node}"))

   Every 2 steps each rank saves its shard into its node's memory and a replica into the other node's; every 6
   steps the state also goes to the durable tier (a shared disk directory).
3. Once memory step ``--kill-after`` is committed (a memory save returns once the state is staged and replicates
   in the background; the next memory save, two steps later, waits for it and rank 0 reports it), sends SIGKILL to
   both processes of node 1 (the node is gone) and removes node 1's memory directory (its shared memory is gone
   with it). The surviving ranks' job is then torn
   down as ``torchrun``'s agent would: SIGTERM, and SIGKILL after a grace period (their process group has a short
   timeout too, so nothing waits forever for the dead peers).
4. Restarts the job on 3 ranks: ranks 0-1 on node 0 (its memory survived), rank 2 on a fresh node. Each calls
   ``manager.restore(state)``: the newest memory step the survivors hold whole (node 0's own chunks and its
   replicas of node 1's), newer than the durable tier's, resharded from 4 ranks onto 3; the job trains on to
   ``--steps``, after making the restored step durable (``manager.flush_memory``: its chunk files copied from the
   survivors' memory to the local tier, as stored).
5. Prints the loss trajectory (before the loss, after it, and the reference) and checks that every loss of the
   resumed run and the final parameters equal the uninterrupted run's, bit for bit.

Run it with::

    python examples/peer_recovery.py                       # temporary directory
    python examples/peer_recovery.py --dir /tmp/peer --steps 24 --kill-after 10

It exits with status 1 if anything differs (0 on success).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

import arrayckpt

SUCCESS_LINE = "OK: resumed on 3 ranks from the survivors' memory; losses continue bit for bit"
IN, HIDDEN, OUT, BATCH = 16, 48, 4, 64
LR, BETAS, EPS = 3e-3, (0.9, 0.999), 1e-8
SHAPES = [(HIDDEN, IN), (HIDDEN,), (OUT, HIDDEN), (OUT,)]
SIZE = sum(torch.Size(s).numel() for s in SHAPES)
RANKS_PER_NODE = 2
TIMEOUT_S = 60  # for every wait on a rank: nothing hangs longer


# --- the model: a flat parameter vector, sharded over the ranks ----------------------------------------------------

def initial_parameters(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([(torch.randn(s, generator=g) * 0.2).reshape(-1) for s in SHAPES])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step`` (the same on every rank and in every run)."""
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(BATCH, IN, generator=g)
    return x, torch.sin(x[:, :OUT] * 2) + x[:, OUT:2 * OUT] ** 2 * 0.1


def loss_and_grad(flat: torch.Tensor, step: int) -> tuple[float, torch.Tensor]:
    """The loss of the global batch and its gradient with respect to the full flat parameters."""
    flat = flat.detach().requires_grad_(True)
    w1, b1, w2, b2 = (t.reshape(s) for t, s in zip(flat.split([torch.Size(s).numel() for s in SHAPES]), SHAPES,
                                                   strict=True))
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(torch.tanh(x @ w1.T + b1) @ w2.T + b2, y)
    loss.backward()
    assert flat.grad is not None
    return loss.item(), flat.grad


def bounds(rank: int, world: int) -> tuple[int, int]:
    """This rank's slice of the flat vector: (start, stop)."""
    per = -(-SIZE // world)
    return min(rank * per, SIZE), min((rank + 1) * per, SIZE)


@dataclass
class Shards:
    """This rank's training state: its slices of the parameters and of Adam's moments, and the step."""

    param: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    start: int
    step: int = 0

    def checkpoint(self) -> dict:
        """The state to save or restore into: each slice an ``arrayckpt.Shard`` of the global (SIZE,) vector."""
        return {name: arrayckpt.Shard(getattr(self, name), (SIZE,), (self.start,))
                for name in ("param", "exp_avg", "exp_avg_sq")} | {"step": self.step}


def new_shards(rank: int, world: int, seed: int) -> Shards:
    start, stop = bounds(rank, world)
    return Shards(initial_parameters(seed)[start:stop].clone(), torch.zeros(stop - start), torch.zeros(stop - start),
                  start)


def train_step(shards: Shards, gather: object, world: int) -> float:
    """One step: gather the full parameters, loss and gradient of the global batch, Adam on this rank's slice."""
    full = gather(shards.param) if world > 1 else shards.param  # type: ignore[operator]
    shards.step += 1
    loss, grad = loss_and_grad(full, shards.step)
    g = grad[shards.start:shards.start + shards.param.numel()]
    b1, b2 = BETAS
    shards.exp_avg.mul_(b1).add_(g * (1 - b1))
    shards.exp_avg_sq.mul_(b2).add_(g * g * (1 - b2))
    denom = (shards.exp_avg_sq / (1 - b2 ** shards.step)).sqrt_().add_(EPS)
    shards.param.sub_(shards.exp_avg / (1 - b1 ** shards.step) / denom * LR)
    return loss


def gather_full(world: int) -> object:
    """All-gather of the ranks' slices into the full flat vector (slices padded to one length for gloo)."""
    import torch.distributed as dist

    per = -(-SIZE // world)

    def gather(mine: torch.Tensor) -> torch.Tensor:
        padded = torch.zeros(per)
        padded[:mine.numel()] = mine
        parts = [torch.empty(per) for _ in range(world)]
        dist.all_gather(parts, padded)
        return torch.cat(parts)[:SIZE]

    return gather


# --- one rank (a process started as torchrun would) ---------------------------------------------------------------

def manager_for(workdir: Path, node: str) -> arrayckpt.CheckpointManager:
    return arrayckpt.CheckpointManager(
        workdir / "durable", interval=arrayckpt.Interval(every_steps=6),
        memory=arrayckpt.PeerMemory(every_steps=2, ranks_per_node=RANKS_PER_NODE, directory=workdir / node))


def rank_main(workdir: Path, node: str, steps: int, seed: int, delay: float) -> None:
    """A rank: restore (nothing on the first start), train to ``steps``, saving; rank 0 reports each step."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = new_shards(rank, world, seed + 1000)  # other weights: a resumed run must get everything back
    manager = manager_for(workdir, node)
    state = shards.checkpoint()
    restored = manager.restore(state)
    if restored is None:
        shards = new_shards(rank, world, seed)
    else:
        shards.step = state["step"]
        tier = "peer memory" if manager.memory.last_step == restored else f"durable tier {manager.tiers()[restored]}"
        report(rank, f"restored step {restored} from {tier} onto {world} ranks")
        if tier == "peer memory":  # make it durable before training goes on: its chunk files copied, as stored
            manager.flush_memory(restored)
            report(rank, f"step {restored} flushed to the durable tier: {manager.tiers()[restored]}")
    gather = gather_full(world)
    while shards.step < steps:
        loss = train_step(shards, gather, world)
        committed = manager.memory.last  # the last memory step known committed (waited for by the next one)
        manager.save(shards.step, shards.checkpoint())  # a memory save returns once staged; it replicates meanwhile
        report(rank, f"step {shards.step} loss {loss!r}")
        if manager.memory.last is not committed and manager.memory.last is not None:
            report(rank, f"memory step {manager.memory.last.step} committed on every node")
        time.sleep(delay)  # the rest of a training step (the launcher kills node 1 mid-training)
    manager.close()
    report(rank, "param " + " ".join(repr(v) for v in shards.param.tolist()))
    dist.destroy_process_group()


def report(rank: int, line: str) -> None:
    print(f"rank {rank}: {line}", flush=True)


# --- the launcher: start ranks, kill a node, restart ----------------------------------------------------------------

class Job:
    """A job's rank processes, started as ``torchrun`` starts them, and their output lines (read by threads)."""

    def __init__(self, workdir: Path, nodes: list[str], steps: int, seed: int, delay: float) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
        self.output: list[list[str]] = [[] for _ in nodes]
        self.procs = []
        for rank, node in enumerate(nodes):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(len(nodes)), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "LOCAL_RANK": str(rank % RANKS_PER_NODE), "OMP_NUM_THREADS": "1"}
            command = [sys.executable, __file__, "--rank-of", node, "--dir", str(workdir), "--steps", str(steps),
                       "--seed", str(seed), "--step-delay", str(delay)]
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            threading.Thread(target=self._read, args=(rank, proc), daemon=True).start()
            self.procs.append(proc)

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.output[rank].append(line.rstrip())
            self.lines.put((rank, line.rstrip()))
        self.lines.put((rank, None))

    def wait_for(self, rank: int, text: str) -> None:
        """Until rank ``rank`` printed a line containing ``text`` (at most TIMEOUT_S)."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                who, line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"rank {rank} did not print {text!r} within {TIMEOUT_S} s") from None
            if who == rank and line is None:
                raise RuntimeError(f"rank {rank} ended before printing {text!r}:\n" + "\n".join(self.output[rank]))
            if who == rank and line is not None and text in line:
                return

    def kill(self, ranks: list[int]) -> None:
        for rank in ranks:
            self.procs[rank].send_signal(signal.SIGKILL)
        for rank in ranks:
            self.procs[rank].wait(timeout=TIMEOUT_S)

    def tear_down(self, grace_s: float = 5.0) -> list[int | None]:
        """What torchrun's agent does to the rest of a failed job: SIGTERM, then SIGKILL after ``grace_s``."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=TIMEOUT_S)
        return [proc.returncode for proc in self.procs]

    def finish(self) -> list[int]:
        """Wait for every rank to end (at most TIMEOUT_S), tearing the job down past that."""
        deadline = time.monotonic() + TIMEOUT_S
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        codes = self.tear_down(grace_s=0)
        time.sleep(0.1)  # let the reader threads take the last lines
        return [code if code is not None else -1 for code in codes]


def losses_of(lines: list[str]) -> dict[int, float]:
    out = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[2] == "step" and parts[4] == "loss":
            out[int(parts[3])] = float(parts[5])
    return out


def run(workdir: Path, steps: int, kill_after: int, seed: int, delay: float) -> int:
    torch.set_num_threads(1)
    reference = new_shards(0, 1, seed)
    expected = [train_step(reference, None, 1) for _ in range(steps)]

    first = Job(workdir, ["shm-node0", "shm-node0", "shm-node1", "shm-node1"], steps, seed, delay)
    try:
        first.wait_for(0, f"memory step {kill_after} committed")
    except BaseException:
        first.tear_down()
        raise
    first.kill([2, 3])  # node 1 is gone: both of its processes, kill -9
    shutil.rmtree(workdir / "shm-node1")  # and its shared memory with it
    codes = first.tear_down()
    before = losses_of(first.output[0])
    print(f"4 ranks (2 nodes): trained to step {max(before)}; node 1 (ranks 2, 3) SIGKILLed after memory step "
          f"{kill_after}; the job torn down (exit codes {codes})")

    second = Job(workdir, ["shm-node0", "shm-node0", "shm-node2"], steps, seed, delay)  # rank 2 on a replacement node
    codes = second.finish()
    if any(codes):
        print(f"the resumed job failed (exit codes {codes}):\n" + "\n".join(second.output[0] + second.output[2]))
        return 1
    after = losses_of(second.output[0])
    restored = next((line for line in second.output[0] if "restored step" in line), "rank 0: nothing restored")
    start = min(after) - 1
    print(f"3 ranks (node 0 + a new node): {restored.split(': ', 1)[1]}")
    print(f"{'step':>5} {'4 ranks':>12} {'3 ranks':>12} {'reference':>12}")
    for step in range(1, steps + 1):
        cells = [f"{d[step]:12.6f}" if step in d else " " * 12 for d in (before, after)]
        print(f"{step:5d} {cells[0]} {cells[1]} {expected[step - 1]:12.6f}")

    problems = []
    if "from peer memory onto 3 ranks" not in restored:
        problems.append(f"expected a restore from peer memory: {restored}")
    flushed = next((line for line in second.output[0] if "flushed to the durable tier" in line), None)
    if flushed is None or "'local'" not in flushed:  # (the step stays in memory too: ('memory', 'local'))
        problems.append(f"expected the restored step flushed to the local tier: {flushed}")
    else:
        print(f"3 ranks: {flushed.split(': ', 1)[1]}")
    if start < kill_after or start % 2:
        problems.append(f"restored step {start}: expected a memory step at or after {kill_after}")
    if any(loss != expected[step - 1] for step, loss in before.items()):
        problems.append("the 4-rank losses differ from the reference")
    if sorted(after) != list(range(start + 1, steps + 1)) or any(after[s] != expected[s - 1] for s in after):
        problems.append("the resumed losses differ from the reference's from the restored step")
    params = [float(v) for rank in range(3) for line in second.output[rank] if " param " in line
              for v in line.split()[3:]]
    if params != reference.param.tolist():
        problems.append("the final parameters differ from the reference's")
    for problem in problems:
        print(f"MISMATCH: {problem}")
    if problems:
        return 1
    print(SUCCESS_LINE)
    return 0


@contextlib.contextmanager
def directory(path: str | None) -> Iterator[Path]:
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="peer-recovery-") as temp:
        yield Path(temp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", help="working directory (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-after", type=int, default=8, help="kill node 1 once this memory step is committed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-delay", type=float, default=0.1, help="seconds of simulated compute per step")
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run one rank on this node's directory
    args = parser.parse_args()
    if args.kill_after % 2 or not 6 < args.kill_after < args.steps - 2:
        parser.error("--kill-after must be an even step (a memory step) after 6 (the first durable one) and before "
                     "--steps - 2")
    if args.rank_of is not None:
        rank_main(Path(args.dir), args.rank_of, args.steps, args.seed, args.step_delay)
        return 0
    with directory(args.dir) as workdir:
        return run(workdir, args.steps, args.kill_after, args.seed, args.step_delay)


if __name__ == "__main__":
    sys.exit(main())
