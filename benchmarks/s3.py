"""S3 benchmark: arrayckpt vs PyTorch DCP (``FsspecWriter``/``FsspecReader`` over s3fs) on a loopback S3 endpoint.

Run from the repository root (needs the test extras: moto[server], s3fs, pytest)::

    python benchmarks/s3.py                                   # 256 MiB in 40 tensors, 3 repeats
    python benchmarks/s3.py --size-mib 64 --repeats 1         # smoke run
    python benchmarks/s3.py --size-mib 480 --dcp-threads 1,8 --json s3.json

What it measures
----------------
The script starts its own moto S3 server (``tests/s3_server.py``: ``python -m moto.server`` in a subprocess
on 127.0.0.1) and one deterministic state dict of about ``--size-mib`` MiB in ``--tensors`` tensors (half
float32, half bfloat16 by count; row counts vary so the tensors are not all alike; values ~ N(0, 0.02)).
In one process, interleaved per repeat (A B A B ...), each system saves the state to a fresh prefix and
loads it back in place into preallocated tensors:

``arrayckpt``
    ``arrayckpt.save(state, "s3://bucket/prefix", storage_options={"endpoint_url": ...})`` /
    ``arrayckpt.load(dst, url, storage_options=...)`` (TensorStore's S3 driver, 64 concurrent requests).
``dcp[N threads]``
    ``dcp.save(state, storage_writer=FsspecWriter(url, thread_count=N, **s3fs_options), no_dist=True)`` /
    ``dcp.load(dst, storage_reader=FsspecReader(url, **s3fs_options), no_dist=True)``, for each N of
    ``--dcp-threads`` (DCP's default is 1: one ``.distcp`` file per process, uploaded by s3fs).

Timed traffic goes straight to moto. Every system's first load is checked bit for bit (outside the timing);
each checkpoint is deleted after its load (outside the timing). Reported per system and op: median and
min seconds, MB/s (1e6 bytes of tensor data / median), the CPU seconds of this process and of the moto
server during the op (moto is single-process Python: when its CPU time is close to the wall time, the
server is the bottleneck and the figures say more about moto than about either client), and ratios
(DCP median / arrayckpt median, > 1 = arrayckpt faster).

Request counts: after the timed runs, each system saves once more and is read through the counting proxy
of ``tests/s3_server.py``: the requests of the save (by method), of opening the checkpoint (arrayckpt:
``arrayckpt.open``; DCP: ``FsspecReader.read_metadata``, what ``dcp.load`` does first) and of reading one
slice of one tensor (arrayckpt: ``ckpt[key][:2]``; DCP, which reads whole tensors: ``dcp.load`` of that one
key), with the bytes those reads fetched.

A loopback moto server has none of a real store's latency or bandwidth limits and a CPU cost per request
far above a real store's; treat the throughput figures as relative, on this machine, and the request
counts as what they are on any S3 endpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import resource
import statistics
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from s3_server import FaultProxy, S3Server, patched_environ, s3_test_env, s3fs_storage_options  # noqa: E402

import arrayckpt  # noqa: E402

MIB = 2**20
State = dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------------- the state


def build_state(size_bytes: int, count: int, seed: int) -> State:
    """``count`` matrices of width 1024 (half float32, half bfloat16) filling about ``size_bytes``."""
    g = torch.Generator().manual_seed(seed)
    weights = [1.0 + 0.5 * ((i * 7) % 5 - 2) / 2 for i in range(count)]  # 0.5x .. 1.5x the mean size
    state: State = {}
    for i, w in enumerate(weights):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = max(1, int(size_bytes * w / sum(weights) / (1024 * dtype.itemsize)))
        state[f"layers.{i}.weight"] = (torch.randn(rows, 1024, generator=g) * 0.02).to(dtype)
    return state


def nbytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def same(a: State, b: State) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


# -------------------------------------------------------------------------------------------- the systems


@dataclass(frozen=True)
class System:
    name: str
    save: Callable[[State, str, str], None]  # (state, url, endpoint)
    load: Callable[[State, str, str], None]  # (dst, url, endpoint), in place
    open: Callable[[str, str], Any]  # (url, endpoint) -> handle; what a reader does first
    read_slice: Callable[[Any, str, str, str, torch.Tensor], None]  # (handle, url, endpoint, key, dst row pair)


def _ac_options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint}


def make_arrayckpt() -> System:
    def read_slice(handle: Any, url: str, endpoint: str, key: str, out: torch.Tensor) -> None:
        out.copy_(torch.from_numpy(handle[key][:2]))  # numpy; the key is a float32 tensor

    return System(
        "arrayckpt",
        lambda state, url, ep: arrayckpt.save(state, url, storage_options=_ac_options(ep)),
        lambda dst, url, ep: arrayckpt.load(dst, url, storage_options=_ac_options(ep)),
        lambda url, ep: arrayckpt.open(url, storage_options=_ac_options(ep)),
        read_slice,
    )


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
    return dcp


def make_dcp(threads: int) -> System:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    dcp = _dcp()

    def save(state: State, url: str, ep: str) -> None:
        writer = FsspecWriter(url, thread_count=threads, **s3fs_storage_options(ep))
        dcp.save(state, storage_writer=writer, no_dist=True)

    def load(dst: State, url: str, ep: str) -> None:
        dcp.load(dst, storage_reader=FsspecReader(url, **s3fs_storage_options(ep)), no_dist=True)

    def open_(url: str, ep: str) -> Any:
        return FsspecReader(url, **s3fs_storage_options(ep)).read_metadata()

    def read_slice(handle: Any, url: str, ep: str, key: str, out: torch.Tensor) -> None:
        shape = handle.state_dict_metadata[key].size  # DCP reads whole tensors: load the key, keep 2 rows
        one = {key: torch.empty(tuple(shape), dtype=out.dtype)}
        dcp.load(one, storage_reader=FsspecReader(url, **s3fs_storage_options(ep)), no_dist=True)
        out.copy_(one[key][:2])

    return System(f"dcp[{threads} thread{'s' if threads > 1 else ''}]", save, load, open_, read_slice)


# ----------------------------------------------------------------------------------------------- timing


def _cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def measured(server_pid: int, out: dict[str, float]) -> Iterator[None]:
    gc.collect()
    cpu, server, start = _self_cpu(), _cpu_of(server_pid), time.perf_counter()
    yield
    out["s"] = time.perf_counter() - start
    out["cpu_s"] = _self_cpu() - cpu
    out["server_cpu_s"] = _cpu_of(server_pid) - server


def delete_prefix(server: S3Server, bucket: str, prefix: str) -> None:
    keys = server.list_keys(bucket, prefix)
    for i in range(0, len(keys), 1000):
        server.client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})


def run_timed(systems: Sequence[System], state: State, server: S3Server, bucket: str,
              repeats: int) -> dict[str, dict[str, list[dict[str, float]]]]:
    samples: dict[str, dict[str, list[dict[str, float]]]] = {s.name: {"save": [], "load": []} for s in systems}
    dst = {k: torch.zeros_like(v) for k, v in state.items()}
    checked: set[str] = set()
    for rep in range(repeats):
        for system in systems:
            prefix = f"{re.sub(r'[^a-z0-9]+', '-', system.name)}-{rep}-{uuid.uuid4().hex[:6]}"
            url = f"s3://{bucket}/{prefix}"
            for t in dst.values():
                t.zero_()
            save: dict[str, float] = {}
            with measured(server._proc.pid, save):
                system.save(state, url, server.endpoint)
            load: dict[str, float] = {}
            with measured(server._proc.pid, load):
                system.load(dst, url, server.endpoint)
            if system.name not in checked:
                if not same(dst, state):
                    raise AssertionError(f"{system.name}: the loaded state differs from the saved one")
                checked.add(system.name)
            samples[system.name]["save"].append(save)
            samples[system.name]["load"].append(load)
            print(f"  rep {rep + 1}/{repeats} {system.name:>16}: save {save['s']:6.2f} s, load {load['s']:6.2f} s",
                  flush=True)
            delete_prefix(server, bucket, prefix + "/")
    return samples


# ----------------------------------------------------------------------------------------- request counts


def _fetched_bytes(server: S3Server, bucket: str, log: list[tuple[str, str, str, str | None]]) -> int:
    total = 0
    for method, path, query, rng in log:
        if method != "GET" or FaultProxy.is_list(method, path, query):
            continue
        key = path.removeprefix(f"/{bucket}/")
        size = server.client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        if rng is None:
            total += size
            continue
        first, last = re.fullmatch(r"bytes=(\d*)-(\d*)", rng).groups()
        if not first:
            total += min(int(last), size)
        else:
            total += min(int(last) if last else size - 1, size - 1) - int(first) + 1
    return total


def count_requests(systems: Sequence[System], state: State, server: S3Server, bucket: str) -> dict[str, dict]:
    key = next(iter(state))  # a float32 tensor
    counts: dict[str, dict] = {}
    for system in systems:
        prefix = f"count-{re.sub(r'[^a-z0-9]+', '-', system.name)}-{uuid.uuid4().hex[:6]}"
        url = f"s3://{bucket}/{prefix}"
        with FaultProxy(server.endpoint) as proxy:
            system.save(state, url, proxy.endpoint)
            save = dict(proxy.counts)
            objects = len(server.list_keys(bucket, prefix + "/"))
            proxy.reset()
            handle = system.open(url, proxy.endpoint)
            opened = list(proxy.log)
            proxy.reset()
            out = torch.empty(2, *state[key].shape[1:], dtype=state[key].dtype)
            system.read_slice(handle, url, proxy.endpoint, key, out)
            read = list(proxy.log)
        if not torch.equal(out, state[key][:2]):
            raise AssertionError(f"{system.name}: the slice read back differs")
        counts[system.name] = {
            "save_requests": save, "objects": objects,
            "open_requests": len(opened), "open_bytes": _fetched_bytes(server, bucket, opened),
            "slice_requests": len(read), "slice_ranged": sum(1 for *_, r in read if r is not None),
            "slice_bytes": _fetched_bytes(server, bucket, read), "slice_key_bytes": state[key].nbytes,
        }
        delete_prefix(server, bucket, prefix + "/")
    return counts


# ----------------------------------------------------------------------------------------------- report


def summarise(samples: dict[str, dict[str, list[dict[str, float]]]], data_bytes: int) -> list[dict[str, Any]]:
    rows = []
    base = {op: statistics.median(x["s"] for x in samples["arrayckpt"][op]) for op in ("save", "load")}
    for name, ops in samples.items():
        for op, runs in ops.items():
            median = statistics.median(x["s"] for x in runs)
            rows.append({"system": name, "op": op, "median_s": median, "min_s": min(x["s"] for x in runs),
                         "MB_per_s": data_bytes / 1e6 / median,
                         "cpu_s": statistics.median(x["cpu_s"] for x in runs),
                         "server_cpu_s": statistics.median(x["server_cpu_s"] for x in runs),
                         "time_vs_arrayckpt": median / base[op], "samples": runs})
    return rows


def print_report(rows: list[dict[str, Any]], counts: dict[str, dict], data_bytes: int, tensors: int) -> None:
    print(f"\n{data_bytes / MIB:.0f} MiB in {tensors} tensors, loopback moto S3\n")
    print(f"{'system':>16} {'op':>5} {'median s':>9} {'min s':>7} {'MB/s':>7} {'cpu s':>6} {'moto cpu s':>10} "
          f"{'time / arrayckpt':>16}")
    for r in rows:
        print(f"{r['system']:>16} {r['op']:>5} {r['median_s']:9.2f} {r['min_s']:7.2f} {r['MB_per_s']:7.0f} "
              f"{r['cpu_s']:6.2f} {r['server_cpu_s']:10.2f} {r['time_vs_arrayckpt']:16.2f}")
    print(f"\n{'system':>16} {'objects':>7} {'save requests':>28} {'open: req':>9} {'bytes':>9} "
          f"{'1 slice: req':>12} {'ranged':>6} {'bytes':>10}")
    for name, c in counts.items():
        save = ", ".join(f"{m} {n}" for m, n in sorted(c["save_requests"].items()))
        print(f"{name:>16} {c['objects']:7d} {save:>28} {c['open_requests']:9d} {c['open_bytes']:9d} "
              f"{c['slice_requests']:12d} {c['slice_ranged']:6d} {c['slice_bytes']:10d}")
    key_bytes = next(iter(counts.values()))["slice_key_bytes"]
    print(f"(the slice is 2 rows of a tensor of {key_bytes} bytes; bytes are what the GETs fetched)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=float, default=256, help="state size in MiB (default 256)")
    p.add_argument("--tensors", type=int, default=40, help="number of tensors (default 40)")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per system (default 3)")
    p.add_argument("--dcp-threads", default="1", help="comma-separated FsspecWriter thread counts (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every figure and sample here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    systems = [make_arrayckpt()] + [make_dcp(int(t)) for t in args.dcp_threads.split(",")]
    state = build_state(int(args.size_mib * MIB), args.tensors, args.seed)
    data_bytes = nbytes(state)
    print(f"{data_bytes / MIB:.0f} MiB in {len(state)} tensors; starting moto ...", flush=True)
    with patched_environ(s3_test_env()), S3Server() as server:
        bucket = server.create_bucket()
        tiny = build_state(MIB, 2, 1)  # warm-up: imports, thread pools, connections
        run_timed(systems, tiny, server, bucket, 1)
        print("timed runs:", flush=True)
        samples = run_timed(systems, state, server, bucket, args.repeats)
        counts = count_requests(systems, state, server, bucket)
    rows = summarise(samples, data_bytes)
    print_report(rows, counts, data_bytes, len(state))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_bytes": data_bytes, "tensors": len(state), "repeats": args.repeats,
                       "cpus": os.cpu_count(), "torch": torch.__version__, "rows": rows, "requests": counts}, f,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
