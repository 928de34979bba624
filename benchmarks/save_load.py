"""Save/load throughput benchmark: arrayckpt vs torch.save, PyTorch DCP and plain parallel file I/O.

Run from the repository root::

    python benchmarks/save_load.py                                # 1 GiB state, 3 repeats, /dev/shm
    python benchmarks/save_load.py --size-gib 0.25 --repeats 1    # quick smoke run
    python benchmarks/save_load.py --dir /tmp --json out.json     # on disk, keep the numbers
    python benchmarks/save_load.py --skip torch,plain --codecs zstd

What it measures
----------------
One deterministic state dict of about ``--size-gib`` GiB (half float32, half bfloat16 by bytes: a tall
embedding-like matrix, a few big 2-D matrices with biases, many small matrices with 1-D biases) is saved
and loaded by every system, in one process, on one filesystem (a temporary directory made inside
``--dir`` and removed at the end):

``torch``
    ``torch.save`` of the dict to one file (then ``flush`` + ``os.fsync``, as the other systems sync their
    files) / ``torch.load(mmap=False, weights_only=True)`` followed by ``copy_`` into the preallocated
    destination tensors, so that it compares like for like with the in-place loads.
``dcp``
    ``torch.distributed.checkpoint.save`` / ``.load`` (in place) in a single process with no process
    group (``no_dist=True``), ``FileSystemWriter(thread_count=--dcp-threads)`` (DCP's default is 1).
``arrayckpt[<codec>]``
    ``arrayckpt.save(state, path, codec=...)`` / ``arrayckpt.load(dst, path)`` (in place), for each codec
    of ``--codecs``.
``plain``
    The machine's limit: raw tensor bytes, one file per tensor, written by ``--threads`` threads (tensors
    larger than 32 MiB are split into pieces written with ``os.pwrite`` at their offsets), one
    ``os.fsync`` per file; read back with ``os.preadv`` (``readinto`` at an offset) straight into the
    preallocated destination tensors.

Fairness: the systems are interleaved per repeat (A B C D A B C D ...); every system is warmed up once on
a tiny state first (imports, thread pools); each system's output is deleted between repeats; ``os.sync()``,
``gc.collect()`` and ``malloc_trim(0)`` run before every timed section, outside the timing; the
destination tensors are preallocated and zero-filled (pages touched) outside the timing. With
``--drop-caches`` (root only) the kernel page cache is dropped before every load, so loads from a disk
really read the disk; without it, loads right after a save are mostly served from the page cache.
Every system's first load is checked bit for bit against the source state (outside the timing).

Reported per system and op: median and min wall time over the repeats, GB/s (1e9 bytes of tensor data /
median), CPU seconds used by the process during the op (user + sys, all threads; less sensitive than wall
time to other load on the machine), peak RSS increase, size on disk and compression ratio (tensor bytes /
stored bytes), and speed relative to DCP and to the plain parallel I/O (baseline median / this median,
> 1 = faster).

Peak RSS increase: before each op the kernel's peak-RSS counter is reset (``echo 5 >
/proc/self/clear_refs``) and after it ``VmHWM - VmRSS(before)`` is read from ``/proc/self/status``. This
is exact (no sampling), covers all threads of the process, and counts mapped file pages; pages written to
tmpfs/page cache through ``write()`` are not process RSS and are not counted. Reported as the maximum over
the repeats.

Data: values ~ N(0, 0.02) from ``torch.Generator().manual_seed(--seed)``, i.e. random mantissas like
trained weights. Only the sign/exponent bits are predictable, so codecs gain a little on bfloat16 and
very little on float32; sparse, quantised or freshly initialised (zeros/ones) tensors compress far better.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import hashlib
import importlib.metadata
import json
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

State = dict[str, torch.Tensor]
StateIO = Callable[[State, Path], None]  # save(state, path) or in-place load(dst, path)

GB = 1e9
MIB = 2**20
GIB = 2**30
PLAIN_PIECE_BYTES = 32 * MIB
SYSTEM_KINDS = ("torch", "dcp", "arrayckpt", "plain")
KNOWN_CODECS = ("none", "zstd", "blosc")
OPS = ("save", "load")
DATA_STD = 0.02
DATA_DESCRIPTION = (
    f"values ~ N(0, {DATA_STD}) (torch.Generator seed {{seed}}): random mantissas, like trained weights; "
    "only sign/exponent bits compress (bf16 a little, fp32 barely)"
)


# --------------------------------------------------------------------------------------------- the state


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


EMBED_WIDTH = 1024
EMBED_SHARE = 0.30
BIG_MATRICES = 4
BIG_SHARE = 0.14  # each
SMALL_SHAPES = ((256, 256), (512, 128), (128, 512), (384, 384), (64, 64), (1024, 64), (96, 320), (192, 192))


def _round_down(value: float, multiple: int) -> int:
    return max(multiple, int(value) // multiple * multiple)


def plan_group(budget_bytes: int, dtype: torch.dtype, prefix: str) -> list[TensorSpec]:
    """Tensor specs filling ``budget_bytes`` with one dtype: embedding, big matrices, small ones, biases."""
    elems = budget_bytes // dtype.itemsize
    rows = _round_down(elems * EMBED_SHARE / EMBED_WIDTH, 64)
    specs = [TensorSpec(f"{prefix}.embed.weight", (rows, EMBED_WIDTH), dtype)]
    side = _round_down(math.sqrt(elems * BIG_SHARE / 4), 64)  # (4*side, side): an MLP-like matrix
    for i in range(BIG_MATRICES):
        shape = (4 * side, side) if i % 2 == 0 else (side, 4 * side)
        specs += [
            TensorSpec(f"{prefix}.big.{i}.weight", shape, dtype),
            TensorSpec(f"{prefix}.big.{i}.bias", (shape[0],), dtype),
        ]
    left = budget_bytes - sum(s.nbytes for s in specs)
    i = 0
    while True:
        shape = SMALL_SHAPES[i % len(SMALL_SHAPES)]
        pair = [
            TensorSpec(f"{prefix}.small.{i}.weight", shape, dtype),
            TensorSpec(f"{prefix}.small.{i}.bias", (shape[0],), dtype),
        ]
        cost = sum(s.nbytes for s in pair)
        if cost > left:
            return specs
        specs += pair
        left -= cost
        i += 1


def plan_state(total_bytes: int) -> list[TensorSpec]:
    half = total_bytes // 2
    return plan_group(half, torch.float32, "fp32") + plan_group(half, torch.bfloat16, "bf16")


def build_state(specs: Iterable[TensorSpec], seed: int) -> State:
    gen = torch.Generator().manual_seed(seed)
    return {
        s.name: torch.empty(s.shape, dtype=torch.float32).normal_(0.0, DATA_STD, generator=gen).to(s.dtype)
        for s in specs
    }


def state_nbytes(state: State) -> int:
    return sum(t.nbytes for t in state.values())


def zeros_like_state(state: State) -> State:
    return {k: torch.zeros_like(t) for k, t in state.items()}


def zero_fill(state: State) -> None:
    for t in state.values():
        t.zero_()


def raw_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes, writable, without a copy."""
    if not t.is_contiguous():
        raise ValueError("raw_bytes needs a contiguous tensor (reshape would copy)")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def assert_bit_exact(expected: State, actual: State, system: str) -> None:
    assert expected.keys() == actual.keys(), f"{system}: keys differ"
    for k, t in expected.items():
        got = actual[k]
        assert got.dtype == t.dtype and got.shape == t.shape, f"{system}: {k} dtype/shape differ"
        assert raw_bytes(t) == raw_bytes(got), f"{system}: {k} is not bit-exact after load"


# ------------------------------------------------------------------------------------------- the systems


@dataclass(frozen=True)
class System:
    name: str
    kind: str
    save: StateIO
    load: StateIO

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "_" for c in self.name)


def copy_into(dst: State, src: dict[str, Any]) -> None:
    if dst.keys() != src.keys():
        raise KeyError(f"key mismatch: {sorted(dst.keys() ^ src.keys())[:5]}")
    for k, t in dst.items():
        t.copy_(src[k])


def torch_save(state: State, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load(dst: State, path: Path) -> None:
    copy_into(dst, torch.load(path, map_location="cpu", mmap=False, weights_only=True))


def make_torch_system() -> System:
    return System("torch.save", "torch", torch_save, torch_load)


@functools.cache
def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    # DCP warns on every no-process-group call even with no_dist=True; that is the intended use here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    return dcp


def dcp_save(state: State, path: Path, *, threads: int) -> None:
    dcp = _dcp()
    writer = dcp.FileSystemWriter(path, thread_count=threads)
    dcp.save(state, checkpoint_id=path, storage_writer=writer, no_dist=True)


def dcp_load(dst: State, path: Path) -> None:
    _dcp().load(dst, checkpoint_id=path, no_dist=True)


def make_dcp_system(threads: int) -> System:
    return System("dcp", "dcp", functools.partial(dcp_save, threads=threads), dcp_load)


def make_arrayckpt_system(codec: str) -> System:
    import arrayckpt

    ac_save, ac_load = arrayckpt.save, arrayckpt.load  # AttributeError while the package is incomplete
    codec_arg = None if codec == "none" else codec

    def save(state: State, path: Path) -> None:
        ac_save(state, os.fspath(path), codec=codec_arg)

    def load(dst: State, path: Path) -> None:
        ac_load(dst, os.fspath(path))

    return System(f"arrayckpt[{codec}]", "arrayckpt", save, load)


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.pwrite(fd, buf, offset)
        buf, offset = buf[n:], offset + n


def _pread_all(fd: int, buf: memoryview, offset: int) -> None:
    while buf:
        n = os.preadv(fd, [buf], offset)
        if n == 0:
            raise EOFError(f"file descriptor {fd} ended early at offset {offset}")
        buf, offset = buf[n:], offset + n


def _run_all(pool: ThreadPoolExecutor, fn: Callable[..., object], calls: Iterable[tuple[Any, ...]]) -> None:
    for future in [pool.submit(fn, *args) for args in calls]:
        future.result()


def plain_transfer(state: State, path: Path, *, threads: int, write: bool) -> None:
    """Write (and fsync) or read every tensor's raw bytes to/from its own file, in pieces, in parallel."""
    if write:
        path.mkdir()
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY
    bufs = [raw_bytes(t) for t in state.values()]
    fds: list[int] = []
    try:
        fds.extend(os.open(path / f"{i:06d}.bin", flags, 0o644) for i in range(len(bufs)))
        with ThreadPoolExecutor(threads) as pool:
            pieces = [
                (fd, buf[off : off + PLAIN_PIECE_BYTES], off)
                for fd, buf in zip(fds, bufs, strict=True)
                for off in range(0, len(buf), PLAIN_PIECE_BYTES)
            ]
            _run_all(pool, _pwrite_all if write else _pread_all, pieces)
            if write:
                _run_all(pool, os.fsync, [(fd,) for fd in fds])
    finally:
        for fd in fds:
            os.close(fd)


def make_plain_system(threads: int) -> System:
    return System(
        f"plain[{threads} threads]",
        "plain",
        functools.partial(plain_transfer, threads=threads, write=True),
        functools.partial(plain_transfer, threads=threads, write=False),
    )


def make_systems(args: argparse.Namespace) -> tuple[list[System], list[str]]:
    """The systems to run, in interleaving order, and notes on those that could not be set up."""
    systems: list[System] = []
    notes: list[str] = []
    if "torch" not in args.skip:
        systems.append(make_torch_system())
    if "dcp" not in args.skip:
        systems.append(make_dcp_system(args.dcp_threads))
    if "arrayckpt" not in args.skip:
        try:
            systems += [make_arrayckpt_system(codec) for codec in args.codecs]
        except (ImportError, AttributeError) as exc:
            notes.append(f"arrayckpt skipped: not importable ({type(exc).__name__}: {exc})")
    if "plain" not in args.skip:
        systems.append(make_plain_system(args.threads))
    return systems, notes


# ------------------------------------------------------------------------------------------- measurement


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process; False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def settle(drop_caches: bool) -> None:
    """Outside the timing: free garbage, return freed heap to the OS, flush dirty pages, maybe drop caches."""
    gc.collect()
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)
    os.sync()
    if drop_caches:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")


@dataclass
class Sample:
    seconds: float
    cpu_seconds: float
    peak_rss_increase: int | None


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(fn: Callable[[], object], *, drop_caches: bool = False) -> Sample:
    settle(drop_caches)
    rss_known = reset_peak_rss()
    rss_before = _proc_status_bytes("VmRSS")
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    fn()
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    peak = _proc_status_bytes("VmHWM") - rss_before if rss_known else None
    return Sample(seconds, cpu, peak)


def stored_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


@dataclass
class Record:
    system: System
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {op: [] for op in OPS})
    stored: int = 0


def run_once(record: Record, state: State, dst: State, root: Path, *, verify: bool, drop_caches: bool) -> None:
    """One timed save and one timed in-place load of ``state`` by one system, then clean up."""
    system = record.system
    path = root / system.slug
    remove(path)
    record.samples["save"].append(measure(functools.partial(system.save, state, path)))
    record.stored = stored_bytes(path)
    zero_fill(dst)
    load = functools.partial(system.load, dst, path)
    record.samples["load"].append(measure(load, drop_caches=drop_caches))
    if verify:
        assert_bit_exact(state, dst, system.name)
    remove(path)


def warm_up(systems: Sequence[System], root: Path) -> None:
    tiny = {"w": torch.ones(64, 64), "b": torch.ones(64, dtype=torch.bfloat16)}
    dst = zeros_like_state(tiny)
    for system in systems:
        path = root / f"warmup_{system.slug}"
        system.save(tiny, path)
        system.load(dst, path)
        assert_bit_exact(tiny, dst, system.name)
        remove(path)


def run_benchmark(
    systems: Sequence[System], state: State, root: Path, *, repeats: int, drop_caches: bool
) -> list[Record]:
    records = [Record(s) for s in systems]
    dst = zeros_like_state(state)
    warm_up(systems, root)
    for rep in range(repeats):
        for record in records:  # interleaved: A B C D A B C D ...
            run_once(record, state, dst, root, verify=rep == 0, drop_caches=drop_caches)
            print(
                f"  repeat {rep + 1}/{repeats} {record.system.name:<24} "
                + "  ".join(f"{op} {record.samples[op][-1].seconds:7.3f}s" for op in OPS),
                flush=True,
            )
    return records


# --------------------------------------------------------------------------------------------- reporting


@dataclass
class Summary:
    system: str
    kind: str
    op: str
    median_s: float
    min_s: float
    gb_per_s: float
    cpu_s: float
    peak_rss_mib: float | None
    stored_bytes: int
    compression_ratio: float
    vs_dcp: float | None = None
    vs_plain: float | None = None
    samples_s: list[float] = field(default_factory=list)


def summarise(records: Sequence[Record], nbytes: int) -> list[Summary]:
    rows: list[Summary] = []
    for record in records:
        for op in OPS:
            samples = record.samples[op]
            seconds = [s.seconds for s in samples]
            peaks = [s.peak_rss_increase for s in samples if s.peak_rss_increase is not None]
            median = statistics.median(seconds)
            rows.append(
                Summary(
                    system=record.system.name,
                    kind=record.system.kind,
                    op=op,
                    median_s=median,
                    min_s=min(seconds),
                    gb_per_s=nbytes / GB / median,
                    cpu_s=statistics.median(s.cpu_seconds for s in samples),
                    peak_rss_mib=max(peaks) / MIB if peaks else None,
                    stored_bytes=record.stored,
                    compression_ratio=nbytes / record.stored if record.stored else float("nan"),
                    samples_s=seconds,
                )
            )
    for row in rows:
        row.vs_dcp = _speedup(rows, row, "dcp")
        row.vs_plain = _speedup(rows, row, "plain")
    return rows


def _speedup(rows: Sequence[Summary], row: Summary, baseline_kind: str) -> float | None:
    """Baseline median / this median for the same op (> 1: this system is faster)."""
    base = next((r for r in rows if r.kind == baseline_kind and r.op == row.op), None)
    return base.median_s / row.median_s if base else None


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


COLUMNS = (
    ("system", "<22", lambda r: r.system),
    ("op", "<5", lambda r: r.op),
    ("median s", ">9", lambda r: f"{r.median_s:.3f}"),
    ("min s", ">8", lambda r: f"{r.min_s:.3f}"),
    ("GB/s", ">6", lambda r: f"{r.gb_per_s:.2f}"),
    ("CPU s", ">6", lambda r: f"{r.cpu_s:.2f}"),
    ("peak RSS +MiB", ">13", lambda r: _fmt(r.peak_rss_mib, ".0f")),
    ("stored MiB", ">10", lambda r: f"{r.stored_bytes / MIB:.0f}"),
    ("compr.", ">6", lambda r: f"{r.compression_ratio:.3f}"),
    ("x DCP", ">6", lambda r: _fmt(r.vs_dcp, ".2f")),
    ("x plain", ">7", lambda r: _fmt(r.vs_plain, ".2f")),
)


def format_table(rows: Sequence[Summary]) -> str:
    header = "  ".join(format(name, spec) for name, spec, _ in COLUMNS)
    lines = [header, "-" * len(header)]
    for op in OPS:
        lines += ["  ".join(format(get(r), spec) for _, spec, get in COLUMNS) for r in rows if r.op == op]
    return "\n".join(lines)


def fs_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path`` (longest matching mount point in /proc/mounts)."""
    best, kind = "", "unknown"
    target = os.path.realpath(path)
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype, *_ = line.split()
            if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                best, kind = mount, fstype
    return kind


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _source_digest(module: str) -> str:
    """Short digest of an imported package's .py files (the code under test changes while being written)."""
    mod = sys.modules.get(module)
    if mod is None or mod.__file__ is None:
        return "not imported"
    digest = hashlib.sha256()
    for path in sorted(Path(mod.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def describe(args: argparse.Namespace, state: State, root: Path, notes: Sequence[str]) -> dict[str, Any]:
    by_dtype: dict[str, int] = {}
    for t in state.values():
        by_dtype[str(t.dtype)] = by_dtype.get(str(t.dtype), 0) + t.nbytes
    return {
        "size_gib": state_nbytes(state) / GIB,
        "dir": str(root),
        "filesystem": fs_type(root),
        "tensors": len(state),
        "largest_tensor_mib": max(t.nbytes for t in state.values()) / MIB,
        "bytes_by_dtype": by_dtype,
        "data": DATA_DESCRIPTION.format(seed=args.seed),
        "repeats": args.repeats,
        "drop_caches": args.drop_caches,
        "plain_threads": args.threads,
        "dcp_thread_count": args.dcp_threads,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("torch", "tensorstore", "zarr", "numpy", "arrayckpt")},
        "arrayckpt_source_sha256": _source_digest("arrayckpt"),
        "timing": "wall clock (perf_counter); median over repeats; GB = 1e9 bytes of tensor data; "
        "CPU s = median user+sys CPU seconds of this process (all threads) during the op",
        "peak_rss": "VmHWM - VmRSS(before) after resetting VmHWM via /proc/self/clear_refs; max over repeats",
        "loadavg_1min_at_start": os.getloadavg()[0],
        "notes": list(notes),
    }


def print_report(info: dict[str, Any], rows: Sequence[Summary]) -> None:
    print()
    for key, value in info.items():
        for line in value if key == "notes" else [value]:
            print(f"{key:>21}: {line:.3f}" if isinstance(line, float) else f"{key:>21}: {line}")
    print()
    print(format_table(rows))
    print("\nx DCP / x plain: that system's median / this median for the same op (> 1 = faster).")


def write_json(path: Path, info: dict[str, Any], rows: Sequence[Summary]) -> None:
    payload = {"info": info, "results": [vars(r) for r in rows]}
    path.write_text(json.dumps(payload, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------- the CLI


def _csv(choices: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [item.strip() for item in text.split(",") if item.strip()]
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}")
        return items

    return parse


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    default_dir = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1.0)")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path(default_dir),
        help=f"a temporary directory is made (and removed) inside it (default {default_dir})",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per system (default 3)")
    p.add_argument(
        "--codecs",
        type=_csv(KNOWN_CODECS),
        default=list(KNOWN_CODECS),
        help="arrayckpt codecs, comma-separated (default none,zstd,blosc)",
    )
    p.add_argument(
        "--skip",
        type=_csv(SYSTEM_KINDS),
        default=[],
        help=f"systems to skip, comma-separated, of {','.join(SYSTEM_KINDS)}",
    )
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.add_argument("--threads", type=int, default=8, help="threads of the plain parallel I/O (default 8)")
    p.add_argument(
        "--dcp-threads",
        type=int,
        default=1,
        help="FileSystemWriter thread_count for DCP saves (default 1, DCP's default)",
    )
    p.add_argument(
        "--drop-caches", action="store_true", help="drop the kernel page cache before every load (needs root)"
    )
    p.add_argument("--seed", type=int, default=0, help="torch.Generator seed of the state (default 0)")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.size_gib <= 0:
        p.error("--repeats must be >= 1 and --size-gib > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    systems, notes = make_systems(args)
    for note in notes:
        print(f"NOTE: {note}", file=sys.stderr)
    if not systems:
        print("nothing to run", file=sys.stderr)
        return 1
    if not reset_peak_rss():
        notes.append("/proc/self/clear_refs not writable: peak RSS not measured")
    print(f"building a {args.size_gib} GiB state (seed {args.seed}) ...", flush=True)
    state = build_state(plan_state(int(args.size_gib * GIB)), args.seed)
    root = Path(tempfile.mkdtemp(prefix="arrayckpt-bench-", dir=args.dir))
    try:
        info = describe(args, state, root, notes)
        print(f"running {', '.join(s.name for s in systems)} on {root} ({info['filesystem']})", flush=True)
        records = run_benchmark(systems, state, root, repeats=args.repeats, drop_caches=args.drop_caches)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    info["loadavg_1min_at_end"] = os.getloadavg()[0]  # > cpus while running: other processes competed
    rows = summarise(records, state_nbytes(state))
    print_report(info, rows)
    if args.json:
        write_json(args.json, info, rows)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
