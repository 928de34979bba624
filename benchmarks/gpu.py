"""GPU benchmark: device-to-host copies, save, async save and load of a CUDA state, arrayckpt vs PyTorch DCP.

Run from the repository root on a machine with a CUDA device::

    python benchmarks/gpu.py                                   # ~4 GiB state, 3 repeats, /dev/shm (~2-3 min)
    python benchmarks/gpu.py --size-gib 1 --repeats 1          # quick run
    python benchmarks/gpu.py --dir /tmp --json gpu.json        # on disk, keep every sample

Without CUDA it prints a message and exits with status 0. ``--device cpu --size-gib 0.01 --repeats 1`` (an option
not listed by ``--help``) runs the same code on CPU tensors, without pinned memory: a smoke test of the script
itself, its numbers are meaningless.

What it measures
----------------
One state on the device of about ``--size-gib`` GiB, half bfloat16 and half float32 by bytes, shaped like a
transformer's (per layer: qkv, out, MLP up/down matrices with 1-D biases, two norms' 1-D weight and bias; an
embedding matrix fills what is left), values ~ N(0, 0.02). In one run, one warm-up round (not reported: imports,
thread pools, pinned staging buffers allocated once) then ``--repeats`` rounds; in each round every group below
runs every system, in an order rotated from round to round (a system that raises is reported, with its traceback
on stderr, and left out from then on; the exit status is then 1):

``d2h``
    The state copied to the host: ``pinned`` (``torch.empty(..., pin_memory=True)`` buffers allocated once,
    ``copy_(non_blocking=True)`` per tensor, one synchronize) and ``pageable`` (``.cpu()`` per tensor).
``save``
    ``arrayckpt.save(state, path)`` vs ``torch.distributed.checkpoint.save(state, checkpoint_id=path,
    no_dist=True)`` (DCP's defaults: one writer thread), synchronous.
``load``
    In place into zero-filled CUDA tensors (zeroed outside the timing): ``arrayckpt.load(dst, path)`` vs
    ``dcp.load(dst, checkpoint_id=path, no_dist=True)``, of the checkpoints just saved; every tensor is checked
    with ``torch.equal`` against the saved state after each load (outside the timing).
``async blocking`` / ``async total``
    ``arrayckpt.async_save(state, path)`` (blocking: until it returns, the state staged in pinned buffers it
    reuses; total: until ``handle.wait()`` returns, committed) vs ``dcp.async_save(state, checkpoint_id=path,
    no_dist=True)`` with its default stager (``dcp[default]``: pageable buffers allocated at each save), with a
    ``DefaultStager`` kept across saves, pinned memory and non-blocking copies (``dcp[pinned]``), and the same
    staging in a background thread (``dcp[pinned, async staging]``: the call returns before the copy is done, so
    blocking runs until ``staging_completion`` is done, when the state may change again; the ``async returns`` row
    is until the call returned). ``x pinned copy`` = blocking / ``d2h pinned`` (arrayckpt's target: <= 1.1).

Every timed op runs ``gc.collect()`` first (outside the timing) and ``torch.cuda.synchronize()`` before starting
and before stopping the clock; checkpoints are removed between rounds. Printed: one markdown table of medians and
mins over the rounds, GB/s (1e9 bytes of tensor data / median), speed relative to DCP (DCP's median / this median;
async rows against ``dcp[default]``). ``--json PATH`` writes every sample, the warm-up round's too.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

import arrayckpt

GB = 1e9
GIB = 2**30
State = dict[str, torch.Tensor]
Spec = tuple[str, tuple[int, ...], torch.dtype]
Samples = dict[tuple[str, str], list[float]]  # (op, system) -> seconds, one per round
T = TypeVar("T")


@dataclass(frozen=True)
class Env:
    """Where the state lives and where checkpoints go; ``sync`` waits for the device (a no-op on CPU)."""

    device: torch.device
    root: Path
    cuda: bool  # the device is a CUDA one (not the CPU of the smoke test)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


# ------------------------------------------------------------------------------------------------ the state


def plan_group(budget: int, dtype: torch.dtype, prefix: str, width: int) -> list[Spec]:
    """Transformer-like layers of one dtype filling ``budget`` bytes, an embedding matrix taking the rest; the
    width shrinks (multiples of 64) until at least 4 layers fit, so that tiny smoke sizes keep the same shapes."""
    size = dtype.itemsize
    d = max(64, width // 64 * 64)
    while d > 64 and 4 * 12 * d * d * size > budget:
        d -= 64
    layer = [("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)), ("attn.out.weight", (d, d)),
             ("attn.out.bias", (d,)), ("mlp.up.weight", (4 * d, d)), ("mlp.up.bias", (4 * d,)),
             ("mlp.down.weight", (d, 4 * d)), ("mlp.down.bias", (d,)), ("norm1.weight", (d,)), ("norm1.bias", (d,)),
             ("norm2.weight", (d,)), ("norm2.bias", (d,))]
    layer_bytes = sum(math.prod(shape) for _, shape in layer) * size
    layers = max(1, budget // layer_bytes)
    specs = [(f"{prefix}.layers.{i}.{name}", shape, dtype) for i in range(layers) for name, shape in layer]
    rows = (budget - layers * layer_bytes) // (d * size)
    if rows > 0:
        specs.append((f"{prefix}.embed.weight", (rows, d), dtype))
    return specs


def build_state(specs: list[Spec], device: torch.device, seed: int) -> State:
    """Random values made on the device itself (a CPU generator would take tens of seconds for 4 GiB)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {name: torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=gen)
            .to(dtype) for name, shape, dtype in specs}


def check_equal(expected: State, actual: State, system: str) -> None:
    """Every loaded tensor equals the saved one (a raise, not an assert, so that ``python -O`` checks too)."""
    for key, tensor in expected.items():
        if not torch.equal(tensor, actual[key]):
            raise AssertionError(f"{system}: {key} differs from the saved tensor after load")


# ------------------------------------------------------------------------------------------------ the systems


@functools.cache
def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    # DCP warns on every call without a process group, even with no_dist=True; that is the intended use here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    return dcp


def d2h_modes(env: Env, state: State) -> dict[str, Callable[[], object]]:
    """The two ways to copy the state to the host; the pinned buffers are allocated once, here."""
    buffers = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=env.cuda) for k, t in state.items()}

    def pinned() -> None:
        for key, tensor in state.items():
            buffers[key].copy_(tensor, non_blocking=env.cuda)

    def pageable() -> list[torch.Tensor]:
        return [t.cpu() for t in state.values()]  # returned, so freed after the clock stops

    return {"pinned": pinned, "pageable (.cpu())": pageable}


def sync_systems() -> tuple[dict[str, Callable[[State, Path], object]], dict[str, Callable[[State, Path], object]]]:
    """The synchronous saves and the in-place loads, by system."""
    dcp = _dcp()
    return ({"arrayckpt": lambda state, path: arrayckpt.save(state, os.fspath(path)),
             "dcp": lambda state, path: dcp.save(state, checkpoint_id=os.fspath(path), no_dist=True)},
            {"arrayckpt": lambda dst, path: arrayckpt.load(dst, os.fspath(path)),
             "dcp": lambda dst, path: dcp.load(dst, checkpoint_id=os.fspath(path), no_dist=True)})


def async_modes(env: Env, state: State, notes: list[str]) -> tuple[dict[str, Callable[[Path], Any]], list[Any]]:
    """How each system starts an async save to a path, and the DCP stagers to close at the end (kept across saves
    so that their pinned buffers are reused, as arrayckpt's are)."""
    dcp = _dcp()
    modes: dict[str, Callable[[Path], Any]] = {
        "arrayckpt": lambda path: arrayckpt.async_save(state, os.fspath(path)),
        "dcp[default]": lambda path: dcp.async_save(state, checkpoint_id=os.fspath(path), no_dist=True),
    }
    stagers = []
    for name, in_background in (("dcp[pinned]", False), ("dcp[pinned, async staging]", True)):
        try:  # pinned memory and non-blocking copies need CUDA (DCP raises otherwise): off in the CPU smoke test
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(use_pinned_memory=env.cuda, use_shared_memory=False,
                                                  use_async_staging=in_background, use_non_blocking_copy=env.cuda))
        except Exception as e:  # an older or newer torch: measure the rest
            notes.append(f"{name} skipped: DCP's DefaultStager/StagingOptions failed ({type(e).__name__}: {e})")
            continue
        stagers.append(stager)
        modes[name] = lambda path, stager=stager: dcp.async_save(state, checkpoint_id=os.fspath(path), no_dist=True,
                                                                 async_stager=stager)
    return modes, stagers


def _wait_until_committed(started: Any) -> None:
    """arrayckpt's SaveHandle, DCP's Future, or DCP's AsyncSaveResponse (staging in the background)."""
    wait = started.wait if isinstance(started, arrayckpt.SaveHandle) else (
        getattr(started, "upload_completion", started).result)
    wait()


def timed(env: Env, fn: Callable[[], object]) -> float:
    """Seconds ``fn`` took, the device synchronised before starting and before stopping the clock."""
    gc.collect()
    env.sync()
    start = time.perf_counter()
    result = fn()
    env.sync()
    seconds = time.perf_counter() - start
    del result  # e.g. the pageable copies: freed outside the timing
    return seconds


def timed_async(env: Env, start_save: Callable[[Path], Any], path: Path) -> tuple[float, float, float]:
    """(call returned, blocking, total) seconds of one async save: blocking runs until the state may change again
    (DCP's staging_completion where it stages in the background), total until committed."""
    gc.collect()
    env.sync()
    start = time.perf_counter()
    started = start_save(path)
    returned = time.perf_counter() - start
    staging = getattr(started, "staging_completion", None)
    if staging is not None:
        staging.result()
    env.sync()
    blocking = time.perf_counter() - start
    _wait_until_committed(started)
    env.sync()
    return returned, blocking, time.perf_counter() - start


def _rotated(names: list[str], round_: int) -> list[str]:
    return names[round_ % len(names):] + names[:round_ % len(names)]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


@dataclass
class Systems:
    """What each group runs, by system name, and the (group, system) pairs that failed (left out from then on)."""

    d2h: dict[str, Callable[[], object]]
    save: dict[str, Callable[[State, Path], object]]
    load: dict[str, Callable[[State, Path], object]]
    asynchronous: dict[str, Callable[[Path], Any]]
    failed: dict[tuple[str, str], str] = field(default_factory=dict)

    def attempt(self, group: str, name: str, fn: Callable[[], T]) -> T | None:
        """``fn()``, or None where it raised: reported once (traceback on stderr) and that system left out of the
        group, so that one broken system does not cost the rest of a run on a lent GPU."""
        if (group, name) in self.failed:
            return None
        try:
            return fn()
        except Exception as e:
            traceback.print_exc()
            self.failed[(group, name)] = f"{type(e).__name__}: {e}"
            return None


def run_round(env: Env, state: State, dst: State, systems: Systems, round_: int, out: Samples) -> None:
    """One round: every group, every system, in an order rotated by ``round_``; checkpoints removed after."""

    def record(op: str, name: str, seconds: float | None) -> None:
        if seconds is not None:
            out.setdefault((op, name), []).append(seconds)

    for name in _rotated(list(systems.d2h), round_):
        record("d2h", name, systems.attempt("d2h", name, functools.partial(timed, env, systems.d2h[name])))
    saved = {name: env.root / f"save-{_slug(name)}" for name in systems.save}
    for name in _rotated(list(systems.save), round_):
        save = functools.partial(timed, env, functools.partial(systems.save[name], state, saved[name]))
        record("save", name, seconds := systems.attempt("save", name, save))
        if seconds is None:
            systems.failed.setdefault(("load", name), "its save failed")
    for name in _rotated(list(systems.load), round_):
        for tensor in dst.values():
            tensor.zero_()

        def load(name: str = name) -> float:
            seconds = timed(env, functools.partial(systems.load[name], dst, saved[name]))
            check_equal(state, dst, name)
            return seconds
        record("load", name, systems.attempt("load", name, load))
    for path in saved.values():
        shutil.rmtree(path, ignore_errors=True)
    for name in _rotated(list(systems.asynchronous), round_):
        path = env.root / f"async-{_slug(name)}"
        times = systems.attempt("async", name, functools.partial(timed_async, env, systems.asynchronous[name], path))
        for op, seconds in zip(("async returns", "async blocking", "async total"), times or (), strict=False):
            record(op, name, seconds)
        shutil.rmtree(path, ignore_errors=True)


OPS = ("d2h", "save", "load", "async blocking", "async returns", "async total")
BASELINES = {"save": "dcp", "load": "dcp", "async blocking": "dcp[default]", "async total": "dcp[default]"}


def table(samples: Samples, systems: Systems, nbytes: int) -> str:
    """The markdown table: median and min seconds, GB/s, blocking over the pinned copy, speed relative to DCP."""
    names = {"d2h": list(systems.d2h), "save": list(systems.save), "load": list(systems.load)}
    copy = statistics.median(samples.get(("d2h", "pinned"), [math.nan]))
    lines = ["| op | system | median s | min s | GB/s | x pinned copy | speed x DCP |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for op in OPS:
        for name in names.get(op, list(systems.asynchronous)):
            values = samples.get((op, name))
            if not values or (op == "async returns" and "async staging" not in name):  # = blocking
                continue
            median = statistics.median(values)
            ratio = f"{median / copy:.2f}" if op == "async blocking" else ""
            base = samples.get((op, BASELINES.get(op, "")))
            speed = f"{statistics.median(base) / median:.2f}" if base else ""
            lines.append(f"| {op} | {name} | {median:.3f} | {min(values):.3f} | {nbytes / GB / median:.2f} | "
                         f"{ratio} | {speed} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=4.0, help="state size (half bf16, half fp32 by bytes)")
    parser.add_argument("--repeats", type=int, default=3, help="reported rounds, after one warm-up round")
    parser.add_argument("--dir", default=None, help="where checkpoints go, in a temporary directory removed at the end "
                        "(default: /dev/shm if it exists and has room, else the temporary directory)")
    parser.add_argument("--width", type=int, default=2048, help="the layers' hidden size (smaller for tiny states)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write every sample (warm-up round's too) here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)  # cpu: smoke
    return parser.parse_args(argv)


def pick_dir(requested: str | None, nbytes: int) -> str:
    """Where checkpoints go: 2 exist at once; /dev/shm is passed over where too small (often 64 MiB in a container)."""
    need = int(2.5 * nbytes) + (64 << 20)
    candidates = [requested] if requested else [d for d in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(d)]
    for candidate in candidates:
        if shutil.disk_usage(candidate).free >= need:
            return candidate
    raise SystemExit(f"no room for the checkpoints in {', '.join(candidates)}: they need {need / GIB:.1f} GiB free; "
                     "pass --dir or a smaller --size-gib")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device (torch.cuda.is_available() is False); nothing measured. "
              "Run it on a machine with a GPU, or `--device cpu --size-gib 0.01 --repeats 1` to smoke-test the script.")
        return 0
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    total = int(args.size_gib * GIB)
    specs = plan_group(total // 2, torch.bfloat16, "bf16", args.width) + plan_group(
        total // 2, torch.float32, "fp32", args.width)
    nbytes = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)
    if args.device == "cuda" and (free := torch.cuda.mem_get_info(device)[0]) < 2.2 * nbytes:  # state + dst
        raise SystemExit(f"{free / GIB:.1f} GiB free on the GPU, {2.2 * nbytes / GIB:.1f} GiB needed: pass a "
                         "smaller --size-gib")
    directory = pick_dir(args.dir, nbytes)
    began = time.perf_counter()
    state = build_state(specs, device, args.seed)
    dst = {k: torch.zeros_like(t) for k, t in state.items()}
    mib = {str(d).removeprefix("torch."): sum(t.nbytes for t in state.values() if t.dtype == d) >> 20
           for d in (torch.bfloat16, torch.float32)}
    meta = {"device": torch.cuda.get_device_name(device) if args.device == "cuda" else "cpu (smoke test: numbers "
            "meaningless)", "torch": torch.__version__, "cuda": torch.version.cuda, "arrayckpt": arrayckpt.__version__,
            "tensors": len(state), "bytes": nbytes, "mib_by_dtype": mib, "dir": directory, "repeats": args.repeats}
    print(f"device: {meta['device']}; torch {meta['torch']} (CUDA {meta['cuda']}); arrayckpt {meta['arrayckpt']}")
    print(f"state: {len(state)} tensors, {nbytes / GIB:.2f} GiB ({', '.join(f'{m} MiB {d}' for d, m in mib.items())});"
          f" checkpoints in {directory}; 1 warm-up round + {args.repeats}", flush=True)
    env = Env(device, Path(tempfile.mkdtemp(prefix="arrayckpt-gpu-", dir=directory)), args.device == "cuda")
    notes: list[str] = []
    modes, stagers = async_modes(env, state, notes)
    systems = Systems(d2h_modes(env, state), *sync_systems(), modes)
    samples: Samples = {}
    warmup: Samples = {}
    try:
        for round_ in range(args.repeats + 1):
            run_round(env, state, dst, systems, round_, samples if round_ else warmup)
            print(f"round {round_} done{' (warm-up)' if not round_ else ''}, {time.perf_counter() - began:.0f} s",
                  flush=True)
    finally:
        for stager in stagers:
            stager.close()
        shutil.rmtree(env.root, ignore_errors=True)
    notes += [f"FAILED: {group} {name}: {why}" for (group, name), why in systems.failed.items()]
    if args.json is not None:  # before the table, so that the samples are kept whatever happens
        keyed = {kind: {f"{op} | {name}": v for (op, name), v in s.items()} for kind, s in
                 (("samples", samples), ("warmup", warmup))}
        args.json.write_text(json.dumps({"meta": meta, "notes": notes, **keyed}, indent=1))
    print(f"\n{table(samples, systems, nbytes)}")
    for note in notes:
        print(f"note: {note}")
    return 1 if systems.failed else 0


if __name__ == "__main__":
    sys.exit(main())
