"""Distributed save/load benchmark: arrayckpt vs PyTorch DCP on gloo ranks, resharding and read-once loads.

Run from the repository root::

    python benchmarks/distributed.py                                   # 512 MiB, ranks 2 and 4, 3 repeats
    python benchmarks/distributed.py --size-mib 64 --repeats 1         # quick smoke run
    python benchmarks/distributed.py --ranks 4 --json dist.json        # keep the numbers
    python benchmarks/distributed.py --dir /tmp                        # on disk instead of /dev/shm

What it measures
----------------
One FSDP-like training state of about ``--size-mib`` MiB, float32 and bfloat16: a model (an embedding
with an uneven number of rows, not divisible by 2, 3 or 4; per layer a QKV, an output, an MLP up and an
MLP down matrix), all 2-D matrices sharded on dim 0 as DTensors ``[Shard(0)]`` on a 1-D mesh; norms,
biases and a small position table as plain tensors, identical on every rank (replicated, a few MiB); and
an optimizer-like state (``exp_avg``, ``exp_avg_sq`` of every parameter, same dtype, sharded or
replicated like it). The parent process builds the global tensors once (N(0, 0.02), seeded) in shared
memory; every rank copies its own shards out of them.

Ranks are spawned processes (``torch.multiprocessing``, spawn) in one gloo process group on 127.0.0.1
per measurement set. Each rank times its own op between two ``dist.barrier()``; the op's wall time is
the maximum over the ranks taking part. Garbage collection and ``malloc_trim`` run before every op,
outside the timing; load targets are preallocated and zeroed outside the timing. Systems are interleaved
per repeat (A B A B ...); each measurement set first saves and loads a tiny state with every system
(imports, thread pools, gloo connections).

1. ``compare``, one process group per world size of ``--ranks``: per repeat, for arrayckpt
   (``arrayckpt.save`` / ``arrayckpt.load`` in place, uncompressed), DCP
   (``torch.distributed.checkpoint.save`` / ``.load``, default planner and ``FileSystemWriter`` /
   ``FileSystemReader``), ``arrayckpt[files]`` (``packed=False``: one file per chunk, the layout before the packed
   default) and ``dcp[arrayckpt]`` (the same DCP calls with arrayckpt's storage,
   ``arrayckpt.dcp.ArrayckptWriter`` / ``ArrayckptReader``: DCP plans, arrayckpt stores), a save of the
   state then a load into zeroed targets of the same sharding; the checkpoint is deleted after.
2. ``reshard``, one 4-rank process group: the state is saved once by each system with ``Shard(0)`` on
   a 4-rank mesh; then, per repeat, loads into targets on the same 4-rank mesh (4 -> 4) and into DTensor
   targets ``Shard(0)`` on a 3-rank mesh over ranks 0-2 (4 -> 3, a subgroup; rank 3 waits). Reported:
   reshard / same-topology time (target <= 1.1) and, for arrayckpt, the bytes read from storage by the 3
   ranks vs the bytes they need (their local shards, plus every replicated tensor once per rank;
   target <= 1.1).
3. ``read_once`` (when ``arrayckpt.load`` has the keyword): the same loads with ``read_once=True``: data
   several ranks need is read by one and sent over the process group. Reported: bytes read from storage
   summed over ranks, and time, with vs without.

Bytes read from storage (arrayckpt and ``dcp[arrayckpt]``): the change of
``arrayckpt._io.fastio.STATS["bytes_read"]`` over the op on each rank
(arrayckpt's local fast path, which serves uncompressed local arrays: every array here), summed over the
ranks; it includes each chunk's 4-byte checksum and shard indexes. DCP's reads are not counted.

Every system's first load of each kind is compared bit for bit with the global tensors (outside the
timing). Reported per system, ranks and op: median and min seconds over the repeats; GB/s = 1e9 bytes of
global checkpoint data (every tensor once) / median seconds; CPU s = median of the user + system CPU
seconds of the taking ranks during the op, summed over them (less sensitive than wall time to other load
on the machine); ``x DCP`` = DCP's median / this median for the same ranks and op (> 1: faster);
``/ same`` = reshard median / same-topology median, and ``paired`` = the median over repeats of the same
ratio within each repeat (the two loads ran back to back, so they share the machine's noise). The
machine may be shared and have few cores (all ranks share them): trust medians over several repeats.
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import json
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from save_load import _libc, _version, fs_type  # noqa: E402  (shared with the single-process benchmark)
from spawned_ranks import (  # noqa: E402  (shared with s3_ranks.py)
    State,
    TensorSpec,
    between_barriers,
    contiguous_stride,
    leaf,
    local_rows,
    nest,
    same_bits,
    spawn,
)

GB = 1e9
MIB = 2**20
DATA_STD = 0.02
LAYERS = 4
WIDTH_STEP = 32
POS_ROWS = 256  # rows of the replicated position table
VOCAB_PER_WIDTH = 8
OPTIM_MOMENTS = ("exp_avg", "exp_avg_sq")
RESHARD_FROM, RESHARD_TO = 4, 3
TARGET_TIME_RATIO = 1.1
TARGET_BYTES_RATIO = 1.1  # issue 35: a 4->3 reshard reads at most 1.1x the bytes it needs
F32, BF16 = torch.float32, torch.bfloat16


# --------------------------------------------------------------------------------------------- the state


def _uneven(rows: int) -> int:
    """The first row count >= ``rows`` divisible by neither 2 nor 3 (so 2, 3 and 4 ranks shard it unevenly)."""
    while rows % 2 == 0 or rows % 3 == 0:
        rows += 1
    return rows


def model_params(width: int) -> list[tuple[str, tuple[int, ...], torch.dtype, bool]]:
    """(name, shape, dtype, sharded) of the model's parameters, as in ``model.state_dict()``."""
    w = width
    params = [
        ("embed.weight", (_uneven(VOCAB_PER_WIDTH * w), w), BF16, True),
        ("pos_embed", (POS_ROWS, w), F32, False),
    ]
    for i in range(LAYERS):
        p = f"layers.{i}."
        params += [
            (p + "norm1.weight", (w,), F32, False),
            (p + "attn.qkv.weight", (3 * w, w), F32, True),
            (p + "attn.qkv.bias", (3 * w,), F32, False),
            (p + "attn.out.weight", (w, w), BF16, True),
            (p + "norm2.weight", (w,), F32, False),
            (p + "mlp.up.weight", (4 * w, w), F32, True),
            (p + "mlp.up.bias", (4 * w,), F32, False),
            (p + "mlp.down.weight", (w, 4 * w), BF16, True),
        ]
    return [*params, ("norm.weight", (w,), F32, False)]


def specs_for_width(width: int) -> list[TensorSpec]:
    params = model_params(width)
    specs = [TensorSpec(("model", name), shape, dtype, sharded) for name, shape, dtype, sharded in params]
    for name, shape, dtype, sharded in params:
        specs += [TensorSpec(("optim", "state", name, m), shape, dtype, sharded) for m in OPTIM_MOMENTS]
    return specs


def plan_state(total_bytes: int) -> list[TensorSpec]:
    """The widest model (width a multiple of 32) whose state fits in ``total_bytes``."""
    width = WIDTH_STEP
    while sum(s.nbytes for s in specs_for_width(width + WIDTH_STEP)) <= total_bytes:
        width += WIDTH_STEP
    return specs_for_width(width)


def build_global(specs: Iterable[TensorSpec], seed: int) -> dict[str, torch.Tensor]:
    """Every global tensor, in shared memory so that spawned ranks map it instead of copying it."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for s in specs:
        t = torch.empty(s.shape, dtype=F32).normal_(0.0, DATA_STD, generator=gen).to(s.dtype)
        out[s.name] = t.share_memory_()
    return out


def global_bytes(specs: Iterable[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


# --------------------------------------------------------------------------------- rank-side state views


def row_range(spec: TensorSpec, mesh: Any) -> tuple[int, int]:
    if not spec.sharded:
        return 0, spec.shape[0]
    return local_rows(spec.shape[0], mesh.size(), mesh.get_local_rank())


def rank_state(specs: Sequence[TensorSpec], mesh: Any, full: dict[str, torch.Tensor] | None) -> State:
    """This rank's state on ``mesh``: copies of its shards of ``full``, or zeros (load targets) when ``None``."""
    from torch.distributed.tensor import DTensor, Shard

    items = []
    for s in specs:
        start, stop = row_range(s, mesh)
        if full is None:
            local = torch.zeros((stop - start, *s.shape[1:]), dtype=s.dtype)
        else:
            local = full[s.name][start:stop].clone()
        if s.sharded:
            local = DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size(s.shape),
                                       stride=contiguous_stride(s.shape))
        items.append((s.path, local))
    return nest(items)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_nbytes(state: State, specs: Iterable[TensorSpec]) -> int:
    return sum(local_tensor(leaf(state, s.path)).nbytes for s in specs)


def zero_fill(state: State, specs: Iterable[TensorSpec]) -> None:
    for s in specs:
        local_tensor(leaf(state, s.path)).zero_()


def verify(state: State, specs: Iterable[TensorSpec], mesh: Any, full: dict[str, torch.Tensor], what: str) -> None:
    """Every local shard of ``state`` must equal its rows of the global tensor, bit for bit."""
    for s in specs:
        start, stop = row_range(s, mesh)
        got = local_tensor(leaf(state, s.path))
        if not same_bits(got, full[s.name][start:stop]):
            raise AssertionError(f"{what}: {s.name} rows {start}:{stop} differ from the saved data")


# ------------------------------------------------------------------------------------------- the systems


def arrayckpt_save(state: State, path: str, group: Any) -> None:
    import arrayckpt

    arrayckpt.save(state, path, process_group=group)  # packed from 2 ranks up (spec §16): the default


def arrayckpt_files_save(state: State, path: str, group: Any) -> None:
    import arrayckpt

    arrayckpt.save(state, path, process_group=group, packed=False)  # one file per chunk (format version 3)


def arrayckpt_load(state: State, path: str, group: Any, *, read_once: bool = False) -> None:
    import arrayckpt

    extra = {"read_once": True} if read_once else {}
    arrayckpt.load(state, path, process_group=group, **extra)


def dcp_save(state: State, path: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, process_group=group)


def dcp_load(state: State, path: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=path, process_group=group)


def dcp_arrayckpt_save(state: State, path: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from arrayckpt.dcp import ArrayckptWriter

    dcp.save(state, storage_writer=ArrayckptWriter(path), process_group=group)


def dcp_arrayckpt_load(state: State, path: str, group: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from arrayckpt.dcp import ArrayckptReader

    dcp.load(state, storage_reader=ArrayckptReader(path), process_group=group)


def dcp_storage_available() -> bool:
    try:
        import arrayckpt.dcp  # noqa: F401
    except ImportError:
        return False
    return True


DCP_ARRAYCKPT = "dcp[arrayckpt]"  # DCP's save/load with arrayckpt's StorageWriter/StorageReader
ARRAYCKPT_FILES = "arrayckpt[files]"  # arrayckpt with one file per chunk (packed=False), against the packed default


@dataclass(frozen=True)
class System:
    name: str
    save: Callable[[State, str, Any], None]
    load: Callable[[State, str, Any], None]


SYSTEMS = (System("arrayckpt", arrayckpt_save, arrayckpt_load),
           System(ARRAYCKPT_FILES, arrayckpt_files_save, arrayckpt_load), System("dcp", dcp_save, dcp_load),
           *([System(DCP_ARRAYCKPT, dcp_arrayckpt_save, dcp_arrayckpt_load)] if dcp_storage_available() else []))


@dataclass(frozen=True)
class LoadVariant:
    system: System
    loaded_ranks: int
    read_once: bool = False

    @property
    def label(self) -> str:
        return self.system.name + ("[read_once]" if self.read_once else "")

    def load(self, state: State, path: str, group: Any) -> None:
        if self.read_once:
            arrayckpt_load(state, path, group, read_once=True)
        else:
            self.system.load(state, path, group)


def read_once_available() -> bool:
    import arrayckpt

    return "read_once" in inspect.signature(arrayckpt.load).parameters


# ----------------------------------------------------------------------------------------- rank runtime


def settle() -> None:
    """Outside the timing: free garbage and give freed heap back to the OS."""
    gc.collect()
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def bytes_read_so_far() -> int | None:
    try:
        from arrayckpt._io.fastio import STATS
    except ImportError:
        return None
    return STATS["bytes_read"]


@dataclass(frozen=True)
class Job:
    """What one spawned process group runs; picklable (the global tensors travel as shared memory)."""

    kind: str  # "compare" or "reshard"
    specs: tuple[TensorSpec, ...]
    full: dict[str, torch.Tensor]
    root: str
    repeats: int
    read_once: bool


@dataclass
class RankRun:
    """One rank's view of a measurement set: its samples, and the helpers every op goes through."""

    job: Job
    rank: int
    world: int
    samples: list[dict[str, Any]] = field(default_factory=list)

    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"  [{self.job.kind}, {self.world} ranks] {message}", flush=True)

    def measure(self, key: dict[str, Any], op: Callable[[], object] | None, needed: int = 0) -> None:
        """Time ``op`` (``None``: this rank takes no part) between world barriers; keep a sample."""
        settle()

        def counted() -> tuple[int | None, float, int | None]:  # bytes read before, CPU seconds, bytes read after
            before, cpu_start = bytes_read_so_far(), cpu_seconds()
            if op is not None:
                op()
            return before, cpu_seconds() - cpu_start, bytes_read_so_far()

        (before, cpu, after), elapsed = between_barriers(counted)
        seconds = elapsed if op is not None else None
        read = None if before is None or after is None else after - before
        self.samples.append({**key, "seconds": seconds, "cpu_s": cpu, "bytes_read": read, "bytes_needed": needed})
        if seconds is not None and self.rank == 0:
            ranks = f"{key['saved_ranks']}->{key['loaded_ranks']}" if key["op"] == "load" else key["saved_ranks"]
            print(f"    {key['system']:<20} {key['op']} {ranks:<5} {seconds:7.3f}s (rank 0)", flush=True)

    def remove(self, path: Path) -> None:
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()

    def save(self, system: System, state: State, path: Path, key: dict[str, Any]) -> None:
        self.remove(path)
        op = functools.partial(system.save, state, str(path), None)
        self.measure({**key, "system": system.name, "op": "save"}, op)

    def load(self, variant: LoadVariant, target: State | None, path: Path, group: Any, key: dict[str, Any],
             verify_on: Any = None) -> None:
        """A timed in-place load into zeroed ``target`` (``None``: not on this rank); with ``verify_on`` (the
        target's mesh), the loaded shards are then compared with the global tensors."""
        op = None
        if target is not None:
            zero_fill(target, self.job.specs)
            op = functools.partial(variant.load, target, str(path), group)
        key = {**key, "system": variant.label, "op": "load", "loaded_ranks": variant.loaded_ranks,
               "read_once": variant.read_once}
        self.measure(key, op, 0 if target is None else local_nbytes(target, self.job.specs))
        if target is not None and verify_on is not None:
            what = f"{variant.label} {key['saved_ranks']}->{variant.loaded_ranks}"
            verify(target, self.job.specs, verify_on, self.job.full, what)

def warm_up(run: RankRun, meshes: dict[int, Any], groups: dict[int, Any]) -> None:
    """Save and load a tiny state with every system on every mesh (imports, pools, gloo connections)."""
    world_mesh = meshes[run.world]
    specs = (TensorSpec(("w",), (12, 8), F32, True), TensorSpec(("b",), (8,), BF16, False))
    full = {s.name: torch.arange(math.prod(s.shape), dtype=F32).reshape(s.shape).to(s.dtype) for s in specs}
    source = rank_state(specs, world_mesh, full)
    for system in SYSTEMS:
        path = Path(run.job.root) / f"warmup-{system.name}"
        run.remove(path)
        system.save(source, str(path), None)
        for ranks, mesh in meshes.items():
            for variant in variants_for(ranks, run.job.read_once, (system,)):
                if mesh is not None:
                    target = rank_state(specs, mesh, None)
                    variant.load(target, str(path), groups[ranks])
                    verify(target, specs, mesh, full, f"warm-up {variant.label}")
                dist.barrier()
        run.remove(path)


def variants_for(ranks: int, read_once: bool, systems: Sequence[System] = SYSTEMS) -> list[LoadVariant]:
    out = []
    for system in systems:
        out.append(LoadVariant(system, ranks))
        if read_once and system.name == "arrayckpt":
            out.append(LoadVariant(system, ranks, read_once=True))
    return out


def run_compare(run: RankRun) -> None:
    """Save then load at the world size, interleaving the systems per repeat; verify the first loads."""
    from torch.distributed.device_mesh import init_device_mesh

    job, world = run.job, run.world
    mesh = init_device_mesh("cpu", (world,))
    warm_up(run, {world: mesh}, {world: None})
    source = rank_state(job.specs, mesh, job.full)
    target = rank_state(job.specs, mesh, None)
    for rep in range(job.repeats):
        run.log(f"repeat {rep + 1}/{job.repeats}")
        for system in SYSTEMS:
            key = {"set": "compare", "saved_ranks": world, "repeat": rep}
            path = Path(job.root) / f"{system.name}-{world}"
            run.save(system, source, path, key)
            run.load(LoadVariant(system, world), target, path, None, key, mesh if rep == 0 else None)
            run.remove(path)


def run_reshard(run: RankRun) -> None:
    """Save at 4 ranks once per system; then interleave 4 -> 4 and 4 -> 3 loads (and read-once ones)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    job = run.job
    meshes: dict[int, Any] = {RESHARD_FROM: init_device_mesh("cpu", (RESHARD_FROM,))}
    sub = DeviceMesh("cpu", list(range(RESHARD_TO)))  # collective: every rank creates it
    meshes[RESHARD_TO] = sub if run.rank < RESHARD_TO else None
    groups = {RESHARD_FROM: None, RESHARD_TO: sub.get_group() if run.rank < RESHARD_TO else None}
    warm_up(run, meshes, groups)
    source = rank_state(job.specs, meshes[RESHARD_FROM], job.full)
    targets = {n: None if mesh is None else rank_state(job.specs, mesh, None) for n, mesh in meshes.items()}
    paths = {system.name: Path(job.root) / f"reshard-{system.name}" for system in SYSTEMS}
    key = {"set": "reshard", "saved_ranks": RESHARD_FROM}
    for system in SYSTEMS:
        run.save(system, source, paths[system.name], {**key, "repeat": 0})
    del source
    variants = [v for n in (RESHARD_FROM, RESHARD_TO) for v in variants_for(n, job.read_once)]
    variants.sort(key=lambda v: (v.system.name, v.read_once, -v.loaded_ranks))
    for rep in range(job.repeats):
        run.log(f"repeat {rep + 1}/{job.repeats}")
        for v in variants:
            n = v.loaded_ranks
            verify_on = meshes[n] if rep == 0 else None
            run.load(v, targets[n], paths[v.system.name], groups[n], {**key, "repeat": rep}, verify_on)
    for path in paths.values():
        run.remove(path)


JOBS = {"compare": run_compare, "reshard": run_reshard}


def rank_main(rank: int, world: int, job: Job) -> list[dict[str, Any]]:
    """One rank of a measurement set (``spawned_ranks.spawn``): its samples."""
    run = RankRun(job, rank, world)
    JOBS[job.kind](run)
    return run.samples


def merge_ranks(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One sample per op: the slowest taking rank's seconds; CPU seconds, bytes read and needed summed over ranks."""
    measured = ("seconds", "cpu_s", "bytes_read", "bytes_needed")
    by_op: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_op[tuple(sorted((k, v) for k, v in s.items() if k not in measured))].append(s)
    merged = []
    for key, group in by_op.items():
        seconds = [s["seconds"] for s in group if s["seconds"] is not None]
        reads = [s["bytes_read"] for s in group if s["seconds"] is not None]
        merged.append({**dict(key), "seconds": max(seconds), "per_rank_seconds": seconds,
                       "cpu_s": sum(s["cpu_s"] for s in group),
                       "bytes_read": None if None in reads else sum(reads),
                       "bytes_needed": sum(s["bytes_needed"] for s in group)})
    return merged


# --------------------------------------------------------------------------------------------- reporting


@dataclass
class Row:
    """One op of one system: medians over the repeats (bytes summed over ranks)."""

    set: str
    system: str
    op: str
    saved_ranks: int
    loaded_ranks: int | None
    read_once: bool
    median_s: float
    min_s: float
    gb_per_s: float
    bytes_read: float | None
    bytes_needed: int
    total_bytes: int  # the global checkpoint data, every tensor once
    cpu_s: float  # median over repeats of the CPU seconds summed over ranks
    samples_s: list[float]  # by repeat
    vs_dcp: float | None = None
    vs_same: float | None = None
    vs_same_paired: float | None = None

    @property
    def ranks(self) -> str:
        if self.loaded_ranks in (None, self.saved_ranks):
            return str(self.saved_ranks)
        return f"{self.saved_ranks}->{self.loaded_ranks}"

    @property
    def read_ratio(self) -> float | None:
        return self.bytes_read / self.bytes_needed if self.bytes_read and self.bytes_needed else None

    @property
    def read_global_ratio(self) -> float | None:
        return self.bytes_read / self.total_bytes if self.bytes_read else None


def summarise(samples: list[dict[str, Any]], total: int) -> list[Row]:
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        groups[(s["set"], s["system"], s["op"], s["saved_ranks"], s.get("loaded_ranks"), s.get("read_once", False))
               ].append(s)
    rows = []
    for (set_, system, op, saved, loaded, read_once), group in groups.items():
        group.sort(key=lambda s: s["repeat"])
        seconds = [s["seconds"] for s in group]
        reads = [s["bytes_read"] for s in group]
        median = statistics.median(seconds)
        rows.append(Row(set_, system, op, saved, loaded, read_once, median, min(seconds), total / GB / median,
                        _median_bytes(reads) if op == "load" and "arrayckpt" in system else None,
                        group[0]["bytes_needed"], total, statistics.median(s["cpu_s"] for s in group), seconds))
    for row in rows:
        dcp = _baseline(rows, row, "dcp", row.ranks)
        same = _baseline(rows, row, row.system, str(row.saved_ranks))
        row.vs_dcp = None if dcp is None else dcp.median_s / row.median_s
        row.vs_same = None if same is None else row.median_s / same.median_s
        row.vs_same_paired = None if same is None else _paired_ratio(row.samples_s, same.samples_s)
    return rows


def _paired_ratio(samples: list[float], baseline: list[float]) -> float | None:
    """Median over repeats of this / baseline in the same repeat (interleaved, so they share the noise)."""
    if len(samples) != len(baseline):
        return None
    return statistics.median(a / b for a, b in zip(samples, baseline, strict=True))


def _median_bytes(reads: list[int | None]) -> float | None:
    return None if None in reads else statistics.median(reads)  # type: ignore[type-var]


def _baseline(rows: Sequence[Row], row: Row, system: str, ranks: str) -> Row | None:
    """The row of ``system`` at ``ranks`` in the same set and op as ``row``."""
    return next((r for r in rows if (r.set, r.op, r.system, r.ranks) == (row.set, row.op, system, ranks)), None)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _mib(value: float | None) -> str:
    return _fmt(None if value is None else value / MIB, ".1f")


Column = tuple[str, str, Callable[[Row], str]]
COMMON: tuple[Column, ...] = (
    ("system", "<20", lambda r: r.system),
    ("ranks", ">6", lambda r: r.ranks),
    ("op", "<5", lambda r: r.op),
    ("median s", ">9", lambda r: f"{r.median_s:.3f}"),
    ("min s", ">7", lambda r: f"{r.min_s:.3f}"),
    ("GB/s", ">6", lambda r: f"{r.gb_per_s:.2f}"),
    ("CPU s", ">6", lambda r: f"{r.cpu_s:.2f}"),
)
COMPARE_COLUMNS = (*COMMON, ("x DCP", ">6", lambda r: _fmt(r.vs_dcp, ".2f")))
BYTES_COLUMNS: tuple[Column, ...] = (
    ("read MiB", ">9", lambda r: _mib(r.bytes_read)),
    ("needed MiB", ">10", lambda r: _mib(r.bytes_needed)),
    ("read/needed", ">11", lambda r: _fmt(r.read_ratio, ".3f")),
)
RESHARD_COLUMNS = (
    *COMMON,
    ("/ same", ">6", lambda r: _fmt(r.vs_same, ".3f")),
    ("paired", ">6", lambda r: _fmt(r.vs_same_paired, ".3f")),
    *BYTES_COLUMNS,
)
READ_ONCE_COLUMNS = (*COMMON, *BYTES_COLUMNS, ("read/global", ">11", lambda r: _fmt(r.read_global_ratio, ".3f")))


def format_table(rows: Sequence[Row], columns: Sequence[Column]) -> str:
    header = "  ".join(format(name, spec) for name, spec, _ in columns)
    lines = [header, "-" * len(header)]
    lines += ["  ".join(format(get(r), spec) for _, spec, get in columns) for r in rows]
    return "\n".join(lines)


def compare_rows(rows: Sequence[Row]) -> list[Row]:
    chosen = [r for r in rows if r.set == "compare"]
    return sorted(chosen, key=lambda r: (r.op != "save", r.saved_ranks, r.system))


def reshard_rows(rows: Sequence[Row]) -> list[Row]:
    chosen = [r for r in rows if r.set == "reshard" and r.op == "load" and not r.read_once]
    return sorted(chosen, key=lambda r: (r.system, -(r.loaded_ranks or 0)))


def read_once_rows(rows: Sequence[Row]) -> list[Row]:
    chosen = [r for r in rows if r.set == "reshard" and r.op == "load" and r.system.startswith("arrayckpt")]
    if not any(r.read_once for r in chosen):
        return []  # read_once not measured: the reshard table already has the rest
    return sorted(chosen, key=lambda r: (-(r.loaded_ranks or 0), r.read_once))


def verdicts(rows: Sequence[Row]) -> list[str]:
    """The reshard acceptance targets, met or not."""
    lines = []
    for r in reshard_rows(rows):
        if r.loaded_ranks == RESHARD_TO and r.vs_same is not None:
            ok = "met" if r.vs_same <= TARGET_TIME_RATIO else "NOT met"
            lines.append(f"{r.system} reshard/same time {r.vs_same:.3f} (paired {_fmt(r.vs_same_paired, '.3f')}; "
                         f"target <= {TARGET_TIME_RATIO}): {ok}")
        if r.loaded_ranks == RESHARD_TO and r.read_ratio is not None:
            ok = "met" if r.read_ratio <= TARGET_BYTES_RATIO else "NOT met"
            lines.append(f"{r.system} reshard bytes read/needed {r.read_ratio:.3f} (target <= {TARGET_BYTES_RATIO}): "
                         f"{ok}")
    return lines


def consistency_notes(rows: Sequence[Row]) -> list[str]:
    """Loads that read less than they needed did not go (wholly) through the counted fast path."""
    return [f"{r.system} {r.ranks}: fast-path bytes read {r.bytes_read:.0f} < needed {r.bytes_needed}; some reads "
            "bypassed arrayckpt's fast path (not counted)"
            for r in rows if r.bytes_read is not None and r.op == "load" and not r.read_once
            and r.bytes_read < r.bytes_needed]


def describe(args: argparse.Namespace, specs: Sequence[TensorSpec], root: Path, read_once: bool) -> dict[str, Any]:
    sharded = [s for s in specs if s.sharded]
    width = next(s.shape[1] for s in specs if s.path == ("model", "embed.weight"))
    return {
        "global_mib": global_bytes(specs) / MIB,
        "tensors": len(specs),
        "sharded_mib": global_bytes(sharded) / MIB,
        "replicated_mib": global_bytes(s for s in specs if not s.sharded) / MIB,
        "model": f"width {width}, {LAYERS} layers, embedding rows {specs[0].shape[0]} (uneven)",
        "largest_tensor_mib": max(s.nbytes for s in specs) / MIB,
        "dir": str(root),
        "filesystem": fs_type(root),
        "repeats": args.repeats,
        "ranks": args.ranks,
        "read_once": "measured" if read_once else "skipped: arrayckpt.load has no read_once keyword",
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("torch", "arrayckpt", "tensorstore", "zarr", "numpy")},
        "loadavg_1min_at_start": os.getloadavg()[0],
        "timing": "max over taking ranks of each rank's perf_counter time between barriers; median over repeats; "
        "GB = 1e9 bytes of global checkpoint data",
    }


def print_report(info: dict[str, Any], rows: Sequence[Row], notes: Sequence[str]) -> None:
    print()
    for key, value in info.items():
        print(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: {value}")
    sections = (
        ("Save and load, same topology (x DCP: DCP median / this median, > 1 = faster)", compare_rows(rows),
         COMPARE_COLUMNS),
        (f"Resharding: saved at {RESHARD_FROM} ranks, loaded at {RESHARD_FROM} and {RESHARD_TO} "
         "(/ same: this median / the same-topology median; bytes: read from storage, summed over ranks)",
         reshard_rows(rows), RESHARD_COLUMNS),
        ("Read-once loads (bytes read from storage summed over ranks; needed counts replicated data per rank)",
         read_once_rows(rows), READ_ONCE_COLUMNS),
    )
    for title, chosen, columns in sections:
        if chosen:
            print(f"\n{title}\n{format_table(chosen, columns)}")
    for line in [*verdicts(rows), *notes]:
        print(line)


# ----------------------------------------------------------------------------------------------- the CLI


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks wants comma-separated integers, got {text!r}") from None
    if not ranks or min(ranks) < 1:
        raise argparse.ArgumentTypeError("--ranks wants world sizes >= 1")
    return ranks


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    default_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=float, default=512, help="total state size in MiB (default 512)")
    p.add_argument("--dir", type=Path, default=Path(default_dir),
                   help=f"a temporary directory is made (and removed) inside it (default {default_dir})")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per system (default 3)")
    p.add_argument("--ranks", type=_ranks, default=[2, 4], help="world sizes to compare at (default 2,4)")
    p.add_argument("--no-reshard", action="store_true", help="skip the reshard and read-once measurements")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.add_argument("--seed", type=int, default=0, help="seed of the tensor values (default 0)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.size_mib <= 0:
        p.error("--repeats must be >= 1 and --size-mib > 0")
    return args


def run_all(args: argparse.Namespace, specs: tuple[TensorSpec, ...], root: Path, read_once: bool) -> list[Row]:
    print(f"building the global state ({global_bytes(specs) / MIB:.0f} MiB, {len(specs)} tensors) ...", flush=True)
    full = build_global(specs, args.seed)
    sets = [("compare", world) for world in args.ranks]
    if not args.no_reshard:
        sets.append(("reshard", RESHARD_FROM))
    samples: list[dict[str, Any]] = []
    for kind, world in sets:
        print(f"{kind}: {world} ranks on {root}", flush=True)
        threads = max(1, (os.cpu_count() or 1) // world)
        per_rank = spawn(rank_main, Job(kind, specs, full, str(root), args.repeats, read_once), world, threads)
        samples += merge_ranks([sample for taken in per_rank for sample in taken])
    return summarise(samples, global_bytes(specs))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    read_once = read_once_available()
    specs = tuple(plan_state(int(args.size_mib * MIB)))
    root = Path(tempfile.mkdtemp(prefix="arrayckpt-dist-bench-", dir=args.dir))
    try:
        info = describe(args, specs, root, read_once)
        rows = run_all(args, specs, root, read_once)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    info["loadavg_1min_at_end"] = os.getloadavg()[0]
    notes = consistency_notes(rows)
    if not read_once:
        notes.append("read_once: arrayckpt.load has no read_once keyword; that variant was skipped")
    print_report(info, rows, notes)
    if args.json:
        payload = {"info": info, "notes": notes, "verdicts": verdicts(rows), "results": [asdict(r) for r in rows]}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
