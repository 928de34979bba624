"""Two-tier checkpoints: a ``CheckpointManager`` on ``s3://`` alone against one that saves locally and uploads in the
background (``remote=arrayckpt.Remote(...)``), on a loopback S3 endpoint (moto), in the same run.

Run from the repository root (needs the test extras: moto[server], s3fs)::

    python benchmarks/tiers.py                                  # 128 MiB in 32 tensors, 3 saves x 2 repeats
    python benchmarks/tiers.py --size-mib 32 --saves 2 --repeats 1   # smoke run
    python benchmarks/tiers.py --max-rate 50e6 --json tiers.json     # uploads paced to 50 MB/s
    python benchmarks/tiers.py --latency-ms 20                       # each S3 request answered 20 ms late

What it measures
----------------
The script starts its own moto S3 server (``tests/s3_server.py``) and one deterministic state dict (half float32,
half bfloat16 matrices, values ~ N(0, 0.02)). Each system is a manager with its own fresh root; it saves ``--saves``
steps (one row of one tensor changes between saves; every save is a full one), and for every save the script
records, from the moment ``save`` is called:

``blocked``
    how long ``save`` blocked the caller: what a checkpoint costs training.
``local``
    until the checkpoint is committed in the first tier it goes to (for ``s3*``, that is S3).
``remote``
    until it is committed on S3 (``manager.wait()`` for an asynchronous ``s3`` manager,
    ``manager.wait_for_uploads()`` for a two-tier one). The script waits for it before the next save, so the saves
    of one run never overlap: each figure is one save's, alone.

Systems, interleaved per repeat: ``s3`` (``CheckpointManager("s3://...")``, synchronous), ``s3[async]``
(``asynchronous=True``), ``two-tier`` (local root in ``--local-dir``, synchronous local saves, remote ``s3://``)
and ``two-tier[async]``. ``--max-rate`` paces the two-tier uploads (``Remote(max_bytes_per_second=...)``);
``--latency-ms`` sends every system's requests through the fault proxy of ``tests/s3_server.py``, which answers each
one that much later (a real store takes tens of ms per request; loopback moto, none).

A loopback moto server is single-process Python with none of a real store's latency or bandwidth limits: the
ratios show the shape (training blocked for the local save, or only for staging, instead of the whole upload), not
what a real S3 bucket would give. ``--local-dir`` defaults to ``/dev/shm`` (tmpfs, the library's own cost); pass
a disk directory to include a local disk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from s3_server import FaultProxy, S3Server, patched_environ, s3_test_env  # noqa: E402

import arrayckpt  # noqa: E402

MIB = 2**20
SYSTEMS = ("s3", "s3[async]", "two-tier", "two-tier[async]")


def build_state(size_bytes: int, count: int, seed: int) -> dict[str, torch.Tensor]:
    """``count`` matrices of width 1024, half float32 and half bfloat16, filling about ``size_bytes``."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(count):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        rows = max(1, size_bytes // count // (1024 * dtype.itemsize))
        state[f"layers.{i}.weight"] = (torch.randn(rows, 1024, generator=g) * 0.02).to(dtype)
    return state


def make_manager(system: str, local: Path, url: str, endpoint: str, max_rate: float | None) -> Any:
    options = {"endpoint_url": endpoint}
    keep = arrayckpt.Retention(keep_last=2)
    asynchronous = system.endswith("[async]")
    if system.startswith("s3"):
        return arrayckpt.CheckpointManager(url, storage_options=options, retention=keep, asynchronous=asynchronous)
    remote = arrayckpt.Remote(url, storage_options=options, retention=keep, max_bytes_per_second=max_rate)
    return arrayckpt.CheckpointManager(local, retention=keep, asynchronous=asynchronous, remote=remote)


def run_one(system: str, state: dict[str, torch.Tensor], saves: int, server: S3Server, endpoint: str, bucket: str,
            local_dir: Path, max_rate: float | None) -> list[dict[str, float]]:
    """``saves`` saves of one fresh manager; per save: blocked, local commit and remote commit seconds."""
    prefix = f"{re.sub(r'[^a-z0-9]+', '-', system)}-{uuid.uuid4().hex[:8]}"
    local = Path(tempfile.mkdtemp(prefix="tiers-", dir=local_dir))
    manager = make_manager(system, local, f"s3://{bucket}/{prefix}", endpoint, max_rate)
    first = next(iter(state.values()))
    out = []
    try:
        for step in range(1, saves + 1):
            first[step % first.shape[0]] += 1  # training changed something
            start = time.perf_counter()
            manager.save(step, state, force=True)
            blocked = time.perf_counter() - start
            manager.wait()
            committed = time.perf_counter() - start
            if manager.remote is not None:
                manager.wait_for_uploads()
            uploaded = time.perf_counter() - start
            out.append({"blocked_s": blocked, "local_s": committed, "remote_s": uploaded})
        manager.close()
    finally:
        shutil.rmtree(local, ignore_errors=True)
        keys = server.list_keys(bucket, prefix + "/")
        for i in range(0, len(keys), 1000):
            server.client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]]})
    return out


def median(samples: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-mib", type=float, default=128, help="state size in MiB (default 128)")
    p.add_argument("--tensors", type=int, default=32, help="number of tensors (default 32)")
    p.add_argument("--saves", type=int, default=3, help="saves per manager (default 3)")
    p.add_argument("--repeats", type=int, default=2, help="managers per system, interleaved (default 2)")
    p.add_argument("--local-dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                   help="where the local tier goes (default /dev/shm)")
    p.add_argument("--max-rate", type=float, default=None, help="upload limit in bytes/s for the two-tier systems")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="answer every S3 request this much later (through the fault proxy of tests/s3_server.py), "
                        "as a real store's tens of ms per request")
    p.add_argument("--json", help="write every figure and sample here")
    args = p.parse_args(argv)
    state = build_state(int(args.size_mib * MIB), args.tensors, 0)
    size = sum(t.numel() * t.element_size() for t in state.values())
    print(f"{size / MIB:.0f} MiB in {len(state)} tensors; starting moto ...", flush=True)
    samples: dict[str, list[dict[str, float]]] = {s: [] for s in SYSTEMS}
    with patched_environ(s3_test_env()), S3Server() as server, FaultProxy(server.endpoint) as proxy:
        proxy.latency_s = args.latency_ms / 1000
        endpoint = proxy.endpoint if args.latency_ms else server.endpoint
        bucket = server.create_bucket()
        tiny = build_state(MIB, 2, 1)
        for system in SYSTEMS:  # warm-up: imports, thread pools, connections
            run_one(system, tiny, 1, server, endpoint, bucket, args.local_dir, args.max_rate)
        for rep in range(args.repeats):
            for system in SYSTEMS:
                runs = run_one(system, state, args.saves, server, endpoint, bucket, args.local_dir, args.max_rate)
                samples[system].extend(runs)
                print(f"  rep {rep + 1}/{args.repeats} {system:>16}: blocked "
                      + ", ".join(f"{r['blocked_s']:.2f}" for r in runs) + " s; on S3 after "
                      + ", ".join(f"{r['remote_s']:.2f}" for r in runs) + " s", flush=True)
    base = median(samples["s3"], "blocked_s")
    rows = [{"system": s, "blocked_s": median(runs, "blocked_s"), "min_blocked_s": min(r["blocked_s"] for r in runs),
             "local_s": median(runs, "local_s"), "remote_s": median(runs, "remote_s"),
             "blocked_vs_s3": median(runs, "blocked_s") / base, "samples": runs} for s, runs in samples.items()]
    latency = f" + {args.latency_ms:g} ms per request" if args.latency_ms else ""
    print(f"\n{size / MIB:.0f} MiB in {len(state)} tensors, {args.saves} saves x {args.repeats} managers per system, "
          f"loopback moto S3{latency}, local tier in {args.local_dir}; medians over saves\n")
    print(f"{'system':>16} {'blocked s':>10} {'(min)':>7} {'1st tier commit s':>17} {'on S3 after s':>13} "
          f"{'blocked / s3':>12}")
    for r in rows:
        print(f"{r['system']:>16} {r['blocked_s']:10.3f} {r['min_blocked_s']:7.3f} {r['local_s']:17.3f} "
              f"{r['remote_s']:13.3f} {r['blocked_vs_s3']:12.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size_bytes": size, "tensors": len(state), "saves": args.saves, "repeats": args.repeats,
                       "cpus": os.cpu_count(), "max_rate": args.max_rate, "latency_ms": args.latency_ms, "rows": rows},
                      f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
