"""What an asynchronous save costs a training loop: arrayckpt.async_save vs DCP's async_save (thread and process).

Run from the repository root::

    python benchmarks/async_save.py                          # 384 MiB state, 4 rounds, /dev/shm
    python benchmarks/async_save.py --ablate --process-bound --size-mib 256 --rounds 6 2>/dev/null
    python benchmarks/async_save.py --size-mib 256 --rounds 3 --dir /tmp
    python benchmarks/async_save.py --reuse-only --size-mib 512    # only the buffer-reuse line (below)

A small training loop (an MLP, forward/backward/Adam step, ``torch.set_num_threads(1)``: CPU-bound steps of a few
ms) runs in the main thread. In each round, in an order rotated from round to round, it runs under each mode:

``none``
    No save: ``--baseline-s`` seconds of steps, the reference step time.
``copy``
    The limit of any async save: copying every tensor into host buffers allocated once (``Tensor.copy_``);
    blocking time only (nothing runs in the background).
``arrayckpt``
    ``arrayckpt.async_save(state, path)``: the call (staging copies) is timed as blocking, then steps run until
    ``handle.done()``.
``arrayckpt[not niced]``, ``arrayckpt[neither]`` (``--ablate``)
    The same without the two things its background save does for the loop: its IO worker threads niced, and the
    cyclic garbage collector paused (``neither``: as arrayckpt was before both).
``bound[process]`` (``--process-bound``)
    The best a process writer could do: one copy into shared memory allocated once, then a daemon process (started
    once, niced as arrayckpt's IO workers are) runs a plain ``arrayckpt.save`` of it — nothing described or planned
    in the training process, no collectives, no error reporting.
``dcp[thread]``, ``dcp[process]``
    ``torch.distributed.checkpoint.async_save(state, checkpoint_id=..., async_checkpointer_type=...)`` with
    ``AsyncCheckpointerType.THREAD`` / ``PROCESS`` (a one-rank gloo group on 127.0.0.1, which DCP's async path
    needs; the process mode starts its daemon, with a group of its own, on its first save), then steps until the
    future is done.

Round 0 warms every mode up (imports, thread pools, DCP's daemon process, arrayckpt's staging buffers) and is not
reported. Reported per mode, over the steps that ran while a save was in the background: median and p90 step time,
their ratio to ``none``'s median (the slowdown), the blocking time of the save call, the time until the checkpoint
was committed, and "lost": blocking + the sum over those steps of (step − none's median), i.e. how much training
time one save cost. A GIL probe runs all along: a pure-Python thread that sleeps 1 ms in a loop and records how
late it wakes; a thread holding the GIL without releasing it (a long C call that does not drop it) shows as a late
wake of the probe (so does a busy machine: compare with the ``none`` row). Its p99 and max (median over rounds
of each round's max) are printed.

Then one line on the staging buffers ``arrayckpt.async_save`` keeps between saves (``keep_buffers``): for
``keep_buffers=True`` (the default) and ``False``, the host bytes held once a save is over (what
``arrayckpt.release_host_buffers()`` gives back) and the median blocking (staging) time of the save after the first,
which stages into the kept buffers or allocates its own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from save_load import build_state, plan_state  # noqa: E402

import arrayckpt  # noqa: E402


@dataclass
class Samples:
    """What one mode measured over the reported rounds."""

    steps: list[float] = field(default_factory=list)  # seconds per training step while a save ran
    blocking: list[float] = field(default_factory=list)
    total: list[float] = field(default_factory=list)  # from the call until committed
    gaps: list[float] = field(default_factory=list)  # the GIL probe's late wakes, seconds
    max_gaps: list[float] = field(default_factory=list)  # per round
    step_sums: list[tuple[int, float]] = field(default_factory=list)  # (steps, their sum) per save


class Probe:
    """A pure-Python thread that sleeps 1 ms in a loop and records by how much each wake came late."""

    def __init__(self) -> None:
        self._gaps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="gil-probe")
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self._gaps.append(now - last - 0.001)
            last = now

    def take(self) -> list[float]:
        """The late wakes since the last call."""
        gaps, self._gaps = self._gaps, []
        return gaps

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class Trainer:
    """An MLP trained on random data: one call of :meth:`step` is one forward/backward/optimizer step."""

    def __init__(self, width: int, batch: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, 2 * width),
            torch.nn.GELU(), torch.nn.Linear(2 * width, width))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4, foreach=False)
        self.x = torch.randn(batch, width)
        self.y = torch.randn(batch, width)

    def step(self) -> float:
        """One step; returns how long it took."""
        start = time.perf_counter()
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return time.perf_counter() - start


def _init_single_rank_group() -> None:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # DCP's process mode gives its daemon a store here
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


@dataclass(frozen=True)
class Started:
    """A save in the background: how long its call blocked, and how to tell that it has committed."""

    blocking: float
    done: Callable[[], bool]
    wait: Callable[[], None]


@contextlib.contextmanager
def _ablated(nice: bool, collector: bool) -> Iterator[None]:
    """arrayckpt's background save without its niced IO workers (``nice=False``) and/or without pausing the
    collector (``collector=False``): what each of the two buys (``--ablate``)."""
    from arrayckpt._settings import override
    from arrayckpt._write import asynchronous

    saved = asynchronous.collector_paused
    if not collector:
        asynchronous.collector_paused = contextlib.nullcontext  # type: ignore[assignment]
    try:
        with override(**({} if nice else {"background_nice": 0})):
            yield
    finally:
        asynchronous.collector_paused = saved


def _bound_writer(conn: object, shared: dict[str, torch.Tensor], nice: int) -> None:
    """The daemon of ``--process-bound``: saves the shared-memory state to each path it is sent, niced."""
    os.nice(nice)
    torch.set_num_threads(1)
    while (path := conn.recv()) is not None:  # type: ignore[attr-defined]
        arrayckpt.save(shared, path)
        conn.send(path)  # type: ignore[attr-defined]


def _process_bound(state: dict[str, torch.Tensor]) -> Callable[[Path], Started]:
    """What a process writer could do at best: staging is one copy into shared memory allocated once, and the
    daemon (started once, niced like arrayckpt's IO workers) runs a plain ``arrayckpt.save`` of it; nothing
    describes or plans in the training process, no collectives, no error reporting."""
    import torch.multiprocessing as mp

    from arrayckpt._settings import settings

    shared = {k: torch.empty_like(v).share_memory_() for k, v in state.items()}
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    ctx.Process(target=_bound_writer, args=(child, shared, settings().background_nice), daemon=True).start()

    def start(path: Path) -> Started:
        began = time.perf_counter()
        torch._foreach_copy_(list(shared.values()), list(state.values()))
        conn.send(str(path))
        return Started(time.perf_counter() - began, conn.poll, conn.recv)
    return start


def _starters(state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
              ablate: bool, process_bound: bool) -> dict[str, Callable[[Path], Started]]:
    """How each mode starts its save to a path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    def timed(call: Callable[[], object]) -> tuple[float, object]:
        start = time.perf_counter()
        result = call()
        return time.perf_counter() - start, result

    def copy(path: Path) -> Started:
        seconds, _ = timed(lambda: torch._foreach_copy_(list(buffers.values()), list(state.values())))
        return Started(seconds, lambda: True, lambda: None)

    def ours(nice: bool = True, collector: bool = True, **options: object) -> Callable[[Path], Started]:
        def start(path: Path) -> Started:
            stack = contextlib.ExitStack()
            stack.enter_context(_ablated(nice, collector))  # until the background save is over

            def wait() -> None:
                with stack:
                    handle.wait()

            seconds, handle = timed(lambda: arrayckpt.async_save(state, path, **options))
            return Started(seconds, handle.done, wait)  # type: ignore[attr-defined]
        return start

    def theirs(kind: AsyncCheckpointerType) -> Callable[[Path], Started]:
        def start(path: Path) -> Started:
            seconds, future = timed(lambda: dcp.async_save(state, checkpoint_id=str(path),
                                                           async_checkpointer_type=kind))
            return Started(seconds, future.done, future.result)  # type: ignore[attr-defined]
        return start

    modes = {"copy": copy, "arrayckpt": ours()}
    if ablate:
        modes["arrayckpt[not niced]"] = ours(nice=False)
        modes["arrayckpt[neither]"] = ours(nice=False, collector=False)
    if process_bound:
        modes["bound[process]"] = _process_bound(state)
    modes["dcp[thread]"] = theirs(AsyncCheckpointerType.THREAD)
    modes["dcp[process]"] = theirs(AsyncCheckpointerType.PROCESS)
    return modes


def _run_mode(name: str, start: Callable[[Path], Started] | None, trainer: Trainer, probe: Probe, root: Path,
              baseline_s: float, out: Samples | None) -> None:
    """Train while one save of mode ``name`` runs (or for ``baseline_s`` without one); record into ``out``."""
    for _ in range(3):  # settle after whatever ran before
        trainer.step()
    probe.take()
    steps: list[float] = []
    began = time.perf_counter()
    if start is None:
        while time.perf_counter() - began < baseline_s:
            steps.append(trainer.step())
        blocking, total = 0.0, 0.0
    else:
        started = start(root / name)
        while not started.done():
            steps.append(trainer.step())
        started.wait()
        blocking, total = started.blocking, time.perf_counter() - began
    gaps = probe.take()
    if out is not None:
        out.steps += steps
        out.step_sums.append((len(steps), sum(steps)))
        out.blocking.append(blocking)
        out.total.append(total)
        out.gaps += gaps
        out.max_gaps.append(max(gaps, default=0.0))
    shutil.rmtree(root / name, ignore_errors=True)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _print_table(results: dict[str, Samples]) -> None:
    base = statistics.median(results["none"].steps)
    print(f"\n{'mode':<20}{'blocking s':>11}{'commit s':>10}{'steps':>7}{'med ms':>8}{'p90 ms':>8}"
          f"{'x med':>7}{'x p90':>7}{'lost s':>8}{'probe p99':>10}{'probe max':>10}")
    for name, s in results.items():
        if name == "copy":
            print(f"{name:<20}{statistics.median(s.blocking):>11.3f}")
            continue
        med, p90 = statistics.median(s.steps), _percentile(s.steps, 0.9)
        lost = statistics.median([b + total - n * base for b, (n, total) in zip(s.blocking, s.step_sums, strict=True)])
        commit = f"{statistics.median(s.total):>10.3f}" if name != "none" else f"{'':>10}"
        print(f"{name:<20}{statistics.median(s.blocking):>11.3f}{commit}{len(s.steps) // len(s.blocking):>7}"
              f"{med * 1e3:>8.2f}{p90 * 1e3:>8.2f}{med / base:>7.2f}{p90 / base:>7.2f}"
              f"{lost if name != 'none' else 0.0:>8.3f}{_percentile(s.gaps, 0.99) * 1e3:>10.2f}"
              f"{statistics.median(s.max_gaps) * 1e3:>10.2f}")
    print("\nsteps: training steps per save (per baseline window for none); x med / x p90: step time over none's "
          "median;\nlost: blocking + extra step time per save; probe: how late a 1 ms sleep in a pure-Python "
          "thread woke (ms)")


def _reuse_line(state: dict[str, torch.Tensor], root: Path, repeats: int = 5) -> None:
    """What keeping the staging buffers buys the next save, and costs between saves."""
    arrayckpt.release_host_buffers()
    parts = []
    for keep in (True, False):
        staging, held = [], []
        arrayckpt.async_save(state, root / "reuse", overwrite=True, keep_buffers=keep).wait()  # the first save
        for _ in range(repeats):
            handle = arrayckpt.async_save(state, root / "reuse", overwrite=True, keep_buffers=keep)
            handle.wait()
            staging.append(handle.blocking_seconds)
            held.append(_held_bytes())
        parts.append(f"keep_buffers={keep}: held {statistics.median(held) / 2**20:.0f} MiB, "
                     f"next save staged in {statistics.median(staging) * 1e3:.1f} ms")
        arrayckpt.release_host_buffers()
    shutil.rmtree(root / "reuse", ignore_errors=True)
    print(f"\nbuffer reuse ({repeats} saves after a first): " + "; ".join(parts))


def _held_bytes() -> int:
    """The host bytes async saves hold now (``release_host_buffers`` would give them back; the private count, so
    that measuring does not release them)."""
    from arrayckpt._write import asynchronous

    return asynchronous._STAGER.held_bytes()


@contextlib.contextmanager
def _workdir(parent: str) -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="arrayckpt-asyncloop-", dir=parent))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=384)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--rounds", type=int, default=4, help="reported rounds (after one warm-up round)")
    parser.add_argument("--width", type=int, default=256, help="the MLP's width (its steps' cost)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--baseline-s", type=float, default=1.0, help="seconds of steps of the 'none' mode")
    parser.add_argument("--ablate", action="store_true",
                        help="also arrayckpt without niced IO workers, and without them nor the collector paused")
    parser.add_argument("--process-bound", action="store_true",
                        help="also the best a process writer could do (a daemon saving a shared-memory copy)")
    parser.add_argument("--reuse-only", action="store_true",
                        help="only the line on keeping the staging buffers between saves (no training loop)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    if args.reuse_only:
        state = build_state(plan_state(args.size_mib << 20), 0)
        print(f"state: {len(state)} tensors, {sum(t.nbytes for t in state.values()) / 2**20:.0f} MiB")
        with _workdir(args.dir) as root:
            _reuse_line(state, root)
        return
    _init_single_rank_group()
    state = build_state(plan_state(args.size_mib << 20), 0)
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    trainer = Trainer(args.width, args.batch)
    modes: dict[str, Callable[[Path], Started] | None] = {
        "none": None, **_starters(state, buffers, args.ablate, args.process_bound)}
    results = {name: Samples() for name in modes}
    probe = Probe()
    nbytes = sum(t.nbytes for t in state.values())
    print(f"state: {len(state)} tensors, {nbytes / 2**20:.0f} MiB; MLP width {args.width}, batch {args.batch}, "
          f"1 torch thread; modes: {', '.join(modes)}")
    with _workdir(args.dir) as root:
        for round_ in range(args.rounds + 1):
            names = list(modes)
            names = names[round_ % len(names):] + names[:round_ % len(names)]  # rotate the order
            for name in names:
                _run_mode(name, modes[name], trainer, probe, root, args.baseline_s,
                          results[name] if round_ else None)
            print(f"round {round_} done{' (warm-up)' if not round_ else ''}", flush=True)
    probe.stop()
    _print_table(results)
    with _workdir(args.dir) as root:
        _reuse_line(state, root)


if __name__ == "__main__":
    main()
