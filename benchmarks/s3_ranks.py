"""Multi-rank S3 benchmark: the requests of a 4-rank save, open, load and 4 -> 3 reshard on moto S3, counted per
phase, for arrayckpt's packed layout, its one-object-per-chunk layout and PyTorch DCP's fsspec writer/reader.

Run from the repository root (needs the test extras: moto[server], s3fs)::

    python benchmarks/s3_ranks.py                                     # 16-layer toy Llama, 4 ranks, 4 -> 3
    python benchmarks/s3_ranks.py --layers 2 --hidden 32 --ranks 2 --reshard-to 1   # smoke run
    python benchmarks/s3_ranks.py --json s3_ranks.json                # keep the numbers

What it measures
----------------
The script starts its own moto S3 server (``tests/s3_server.py``: ``python -m moto.server`` in a subprocess on
127.0.0.1) and, in front of it, one counting ``FaultProxy`` per rank (so every request is attributed to the rank
that sent it) plus one for this process. The state is a toy Llama-shaped training state in float32 (HF names:
``model.embed_tokens``, ``--layers`` decoder layers of q/k/v/o projections (grouped-query: k and v are a quarter
of q), gate/up/down MLP projections and two RMS norms, ``model.norm``, ``lm_head``), every parameter sharded
FSDP-style on dim 0 (``torch.chunk`` rows, uneven where the sizes are), plus AdamW's ``exp_avg`` and
``exp_avg_sq`` (sharded like their parameter) and a 0-d ``step`` per parameter (the same on every rank).

Per system, each phase runs in fresh processes (spawned gloo ranks on 127.0.0.1; a job restart is a fresh
process too), and its requests are counted:

``save``
    ``--ranks`` ranks save the state to a fresh prefix. arrayckpt: ``arrayckpt.save(state, url, packed=...,
    storage_options=...)`` with each piece an ``arrayckpt.Shard``; DCP: ``dcp.save(state,
    storage_writer=FsspecWriter(url, **s3fs_options))`` with DCP's defaults (one ``.distcp`` file per rank, a
    thread each) and each piece a ``DTensor`` ``[Shard(0)]`` on a 1-D mesh.
``open``
    this process opens the checkpoint: ``arrayckpt.open`` / ``FsspecReader.read_metadata()`` (what a load does
    first).
``load``
    ``--ranks`` ranks load every tensor in place into zeroed targets of the saved sharding; checked bit for bit.
``reshard``
    ``--reshard-to`` ranks load their ``Shard(0)`` piece of every tensor (arrayckpt: ``arrayckpt.Shard`` targets;
    DCP: ``DTensor`` targets on a ``--reshard-to``-rank mesh, which DCP reshards itself); checked bit for bit.

Requests are counted by kind: ``PUT`` (whole objects), ``part`` (``PUT ?partNumber=``: multipart parts),
``POST`` (multipart create and complete), ``GET`` (objects, whole or ranged), ``HEAD``, ``LIST`` (ListObjects
pages) and ``DELETE``; ``POST`` also counts s3fs's ``DeleteObjects`` (DCP's rename of ``.metadata.tmp``).
``GET/rank`` and ``req/rank`` are the most GETs and requests one rank sent; they are ``-`` for arrayckpt's
saves, whose ranks all write through the coordinator's storage options (the save plan carries its kvstore spec),
so that every request of the save reaches rank 0's proxy. Bytes fetched are the bytes the GETs
returned (from their ``Range`` headers, or the object's size); ``data`` counts only the GETs of data objects
(arrayckpt's packs and chunk files, DCP's ``.distcp`` files), ``needed`` is the bytes of the pieces the
reshard's ranks load (every 0-d step once per rank). Seconds are the slowest rank's, between barriers, on a
loopback moto server (single-process Python): treat them as relative; the request counts are what they are on
any S3 endpoint.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import re
import sys
import time
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from s3_server import FaultProxy, LogEntry, S3Server, patched_environ, s3_test_env, s3fs_storage_options  # noqa: E402
from spawned_ranks import (  # noqa: E402  (shared with distributed.py)
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

MIB = 2**20
DATA_STD = 0.02
SYSTEMS = ("arrayckpt[packed]", "arrayckpt[files]", "dcp")
PHASES = ("save", "open", "load", "reshard")
KINDS = ("PUT", "part", "POST", "GET", "HEAD", "LIST", "DELETE")
DATA_SUFFIXES = (".pack", ".distcp")  # data objects; in the files layout, every chunk key too (CHUNK_KEY)
CHUNK_KEY = re.compile(r"(^|/)c([./]\d+)*$")  # a Zarr v3 chunk key, "." or "/" separated: c, c.0.1, c/0/1
TARGET_READ_RATIO = 1.1  # issue 35: a reshard reads at most 1.1x the bytes it needs


# --------------------------------------------------------------------------------------------- the state


@dataclass(frozen=True)
class Model:
    """The toy Llama's sizes."""

    layers: int
    hidden: int
    vocab: int

    @property
    def intermediate(self) -> int:
        return 11 * self.hidden // 4  # Llama's ~2.7x, a multiple of the hidden size's quarter

    @property
    def kv(self) -> int:
        return max(1, self.hidden // 4)  # grouped-query attention: 4 query heads per key/value head

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter, as in ``LlamaForCausalLM.state_dict()``."""
        h, i, kv = self.hidden, self.intermediate, self.kv
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                    (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                    (p + "post_attention_layernorm.weight", (h,))]
        return [*out, ("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]


def specs_of(model: Model) -> tuple[TensorSpec, ...]:
    params = model.params()
    f32 = torch.float32
    specs = [TensorSpec(("model", name), shape, f32, True) for name, shape in params]
    for name, shape in params:
        specs += [TensorSpec(("optim", "state", name, "exp_avg"), shape, f32, True),
                  TensorSpec(("optim", "state", name, "exp_avg_sq"), shape, f32, True),
                  TensorSpec(("optim", "state", name, "step"), (), f32, False)]
    return tuple(specs)


def build_global(specs: Sequence[TensorSpec], seed: int) -> dict[str, torch.Tensor]:
    """Every global tensor, in shared memory so that spawned ranks map it instead of copying it."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for s in specs:
        if s.sharded:
            t = torch.empty(s.shape).normal_(0.0, DATA_STD, generator=gen)
        else:
            t = torch.tensor(1000.0)
        out[s.name] = t.share_memory_()
    return out


# ------------------------------------------------------------------------------------------ rank side


@dataclass(frozen=True)
class Job:
    """One phase of one system on spawned ranks; picklable (the global tensors travel as shared memory)."""

    system: str
    phase: str  # "save", "load" or "reshard"
    url: str
    endpoints: tuple[str, ...]  # rank r talks to S3 through endpoints[r] (its own counting proxy)
    specs: tuple[TensorSpec, ...]
    full: dict[str, torch.Tensor]


def _quiet_dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.checkpoint")
    warnings.filterwarnings("ignore", category=FutureWarning)
    return dcp


def rank_state(job: Job, rank: int, world: int, mesh: Any, *, zeros: bool) -> tuple[State, int]:
    """This rank's pieces (copies of the global tensors, or zeroed load targets) and their bytes."""
    import arrayckpt

    items: list[tuple[tuple[str, ...], Any]] = []
    nbytes = 0
    for s in job.specs:
        full = job.full[s.name]
        if not s.sharded:
            local = torch.zeros_like(full) if zeros else full.clone()
            items.append((s.path, local))
            nbytes += local.nbytes
            continue
        start, stop = local_rows(s.shape[0], world, rank)
        local = torch.zeros((stop - start, *s.shape[1:])) if zeros else full[start:stop].clone()
        nbytes += local.nbytes
        if job.system == "dcp":
            from torch.distributed.tensor import DTensor, Shard

            items.append((s.path, DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size(s.shape),
                                                     stride=contiguous_stride(s.shape))))
        else:
            offset = (start,) + (0,) * (len(s.shape) - 1)
            items.append((s.path, arrayckpt.Shard(local, global_shape=s.shape, global_offset=offset)))
    return nest(items), nbytes


def check(job: Job, state: State, rank: int, world: int) -> None:
    """Every loaded piece equals its rows of the global tensor, bit for bit."""
    for s in job.specs:
        got = leaf(state, s.path)
        got = got.tensor if hasattr(got, "global_offset") else got.to_local() if hasattr(got, "to_local") else got
        start, stop = local_rows(s.shape[0], world, rank) if s.sharded else (0, 0)
        want = job.full[s.name][start:stop] if s.sharded else job.full[s.name]
        if not same_bits(got, want):
            raise AssertionError(f"{job.system} {job.phase}: {s.name} on rank {rank} differs from the saved data")


def run_op(job: Job, rank: int, world: int, state: State, mesh: Any) -> None:
    endpoint = job.endpoints[rank]
    if job.system == "dcp":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

        dcp = _quiet_dcp()
        options = s3fs_storage_options(endpoint)
        if job.phase == "save":
            dcp.save(state, storage_writer=FsspecWriter(job.url, **options))
        else:
            dcp.load(state, storage_reader=FsspecReader(job.url, **options))
        return
    import arrayckpt

    options = {"endpoint_url": endpoint}
    if job.phase == "save":
        arrayckpt.save(state, job.url, packed=job.system == "arrayckpt[packed]", storage_options=options)
    else:
        arrayckpt.load(state, job.url, storage_options=options)


def rank_main(rank: int, world: int, job: Job) -> dict[str, Any]:
    """One rank of a phase (``spawned_ranks.spawn``): its seconds and the bytes of its pieces."""
    mesh = None
    if job.system == "dcp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
    state, nbytes = rank_state(job, rank, world, mesh, zeros=job.phase != "save")
    _, seconds = between_barriers(lambda: run_op(job, rank, world, state, mesh))
    if job.phase != "save":
        check(job, state, rank, world)
    return {"seconds": seconds, "bytes": nbytes}


# ------------------------------------------------------------------------------------------- counting


def kind_of(method: str, path: str, query: str) -> str:
    if FaultProxy.is_list(method, path, query):
        return "LIST"
    if method == "PUT" and "partNumber=" in query:
        return "part"
    return method


def tally(log: Sequence[LogEntry]) -> dict[str, int]:
    counts = collections.Counter(kind_of(m, p, q) for m, p, q, _ in log)
    return {k: counts.get(k, 0) for k in KINDS}


class Sizes:
    """Object sizes, asked of the server directly (not through a proxy) once per key."""

    def __init__(self, server: S3Server, bucket: str) -> None:
        self.server, self.bucket = server, bucket
        self._sizes: dict[str, int] = {}

    def of(self, key: str) -> int:
        """The size of ``key``; 0 if there is no such object (a GET that probed for one got a 404)."""
        if key not in self._sizes:
            try:
                self._sizes[key] = self.server.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"]
            except self.server.client.exceptions.ClientError as e:
                if e.response.get("Error", {}).get("Code") not in ("404", "NoSuchKey"):
                    raise
                self._sizes[key] = 0
        return self._sizes[key]


def is_data(key: str) -> bool:
    return key.endswith(DATA_SUFFIXES) or CHUNK_KEY.search(key) is not None


def fetched(log: Sequence[LogEntry], sizes: Sizes) -> tuple[int, int]:
    """Bytes returned by the object GETs of ``log``: all of them, and those of data objects."""
    total = data = 0
    for method, path, query, rng in log:
        if method != "GET" or FaultProxy.is_list(method, path, query) or "/" not in path.strip("/"):
            continue
        key = path.strip("/").split("/", 1)[1]
        size = sizes.of(key)
        if rng is None:
            got = size
        else:
            match = re.fullmatch(r"bytes=(\d*)-(\d*)", rng)
            if match is None:
                raise ValueError(f"unexpected Range header {rng!r} on GET {path}")
            first, last = match.groups()
            got = min(int(last), size) if not first else min(int(last) if last else size - 1, size - 1) - int(first) + 1
        total += got
        data += got if is_data(key) else 0
    return total, data


@dataclass(frozen=True)
class Phase:
    """The requests of one phase of one system, summed over its ranks."""

    system: str
    phase: str
    ranks: int
    requests: dict[str, int]
    max_get_per_rank: int
    max_requests_per_rank: int
    bytes_fetched: int
    data_bytes_fetched: int
    bytes_needed: int  # the loading ranks' pieces (0 for save and open)
    seconds: float  # the slowest rank's (open: this process's)
    per_rank: bool  # each rank's requests reached its own proxy (not so in arrayckpt's saves: module docstring)

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    @property
    def read_ratio(self) -> float | None:
        return self.data_bytes_fetched / self.bytes_needed if self.bytes_needed else None


@dataclass(frozen=True)
class Bench:
    server: S3Server
    bucket: str
    proxies: tuple[FaultProxy, ...]  # one per rank
    local: FaultProxy  # this process's
    sizes: Sizes
    specs: tuple[TensorSpec, ...]
    full: dict[str, torch.Tensor]
    log_dir: Path | None  # each phase's requests, rank by rank, are written here when given

    def reset(self) -> None:
        for p in (*self.proxies, self.local):
            p.reset()

    def phase(self, system: str, phase: str, url: str, ranks: int) -> Phase:
        """Run one phase (``open`` here, the others on ``ranks`` spawned ranks) and count its requests."""
        self.reset()
        per_rank: list[dict[str, Any]]
        if phase == "open":
            start = time.perf_counter()
            open_checkpoint(system, url, self.local.endpoint)
            per_rank = [{"seconds": time.perf_counter() - start, "bytes": 0}]
            logs = [list(self.local.log)]
        else:
            job = Job(system, phase, url, tuple(p.endpoint for p in self.proxies[:ranks]), self.specs, self.full)
            per_rank = spawn(rank_main, job, ranks, threads=1)
            logs = [list(p.log) for p in self.proxies[:ranks]]
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            name = f"{re.sub(r'[^a-z0-9]+', '-', system).strip('-')}-{phase}.json"
            (self.log_dir / name).write_text(json.dumps(logs, indent=0))
        everything = [entry for log in logs for entry in log]
        total, data = fetched(everything, self.sizes)
        return Phase(system, phase, len(logs), tally(everything),
                     max(tally(log)["GET"] for log in logs), max(len(log) for log in logs), total, data,
                     sum(r["bytes"] for r in per_rank) if phase in ("load", "reshard") else 0,
                     max(r["seconds"] for r in per_rank), system == "dcp" or phase != "save")


def open_checkpoint(system: str, url: str, endpoint: str) -> None:
    if system == "dcp":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        FsspecReader(url, **s3fs_storage_options(endpoint)).read_metadata()
        return
    import arrayckpt

    with arrayckpt.open(url, storage_options={"endpoint_url": endpoint}) as ckpt:
        len(ckpt)


def stored_objects(server: S3Server, bucket: str, prefix: str) -> tuple[int, int]:
    """Objects under ``prefix`` and their bytes, listed straight from the server."""
    count = size = 0
    for page in server.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            count, size = count + 1, size + obj["Size"]
    return count, size


def run_system(bench: Bench, system: str, ranks: int, reshard_to: int) -> tuple[list[Phase], dict[str, int]]:
    prefix = f"{re.sub(r'[^a-z0-9]+', '-', system).strip('-')}-{uuid.uuid4().hex[:6]}"
    url = f"s3://{bench.bucket}/{prefix}"
    phases = []
    for phase, world in (("save", ranks), ("open", 1), ("load", ranks), ("reshard", reshard_to)):
        print(f"  {system}: {phase} on {world} rank{'s' if world > 1 else ''} ...", flush=True)
        phases.append(bench.phase(system, phase, url, world))
        if phase == "save":
            objects, size = stored_objects(bench.server, bench.bucket, prefix + "/")
    return phases, {"objects": objects, "bytes": size}


# --------------------------------------------------------------------------------------------- reporting


def print_report(info: dict[str, Any], phases: Sequence[Phase], stored: dict[str, dict[str, int]]) -> None:
    print()
    for key, value in info.items():
        print(f"{key:>16}: {value}")
    print("\nstored after the save:")
    for system, s in stored.items():
        print(f"  {system:<18} {s['objects']:6d} objects, {s['bytes'] / MIB:8.2f} MiB")
    head = (f"{'system':<18} {'phase':<7} {'ranks':>5} " + " ".join(f"{k:>6}" for k in KINDS)
            + f" {'total':>6} {'GET/rank':>8} {'req/rank':>8} {'MiB got':>8} {'data MiB':>8} {'needed':>8}"
            f" {'ratio':>6} {'s':>6}")
    print(f"\nrequests per phase (GET/rank, req/rank: the most one rank sent; '-': every rank wrote through the "
          f"coordinator's endpoint)\n{head}\n{'-' * len(head)}")
    for p in phases:
        ratio = "-" if p.read_ratio is None else f"{p.read_ratio:.3f}"
        needed = f"{p.bytes_needed / MIB:8.2f}" if p.bytes_needed else f"{'-':>8}"
        per_get, per_req = (p.max_get_per_rank, p.max_requests_per_rank) if p.per_rank else ("-", "-")
        print(f"{p.system:<18} {p.phase:<7} {p.ranks:5d} " + " ".join(f"{p.requests[k]:6d}" for k in KINDS)
              + f" {p.total:6d} {per_get:>8} {per_req:>8} {p.bytes_fetched / MIB:8.2f}"
              f" {p.data_bytes_fetched / MIB:8.2f} {needed} {ratio:>6} {p.seconds:6.2f}")
    for p in phases:
        if p.phase == "reshard" and p.read_ratio is not None:
            ok = "met" if p.read_ratio <= TARGET_READ_RATIO else "NOT met"
            print(f"{p.system} reshard: data bytes fetched / needed {p.read_ratio:.3f} "
                  f"(target <= {TARGET_READ_RATIO}): {ok}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default 16)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 4 (default 128)")
    p.add_argument("--vocab", type=int, default=2000, help="vocabulary rows (default 2000)")
    p.add_argument("--ranks", type=int, default=4, help="ranks that save and load (default 4)")
    p.add_argument("--reshard-to", type=int, default=3, help="ranks of the resharding load (default 3)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    p.add_argument("--seed", type=int, default=0, help="seed of the tensor values (default 0)")
    p.add_argument("--json", type=Path, help="also write the results to this JSON file")
    p.add_argument("--log-dir", type=Path, help="write every phase's requests (method, path, query, range), by rank, "
                   "to <system>-<phase>.json here")
    args = p.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    if unknown := set(args.systems) - set(SYSTEMS):
        p.error(f"--systems: unknown {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if min(args.ranks, args.reshard_to, args.layers) < 1 or args.hidden < 4 or args.hidden % 4:
        p.error("--ranks, --reshard-to and --layers must be >= 1, --hidden a multiple of 4")
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase of every system of ``args``; the figures as one JSON-able dict (also printed)."""
    model = Model(args.layers, args.hidden, args.vocab)
    specs = specs_of(model)
    full = build_global(specs, args.seed)
    info = {"model": f"toy Llama, {model.layers} layers, hidden {model.hidden}, intermediate {model.intermediate},"
                     f" kv {model.kv}, vocab {model.vocab}",
            "tensors": len(specs), "state MiB": round(sum(s.nbytes for s in specs) / MIB, 2),
            "ranks": f"save and load on {args.ranks}, reshard to {args.reshard_to}",
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    phases: list[Phase] = []
    stored: dict[str, dict[str, int]] = {}
    with patched_environ(s3_test_env()), S3Server() as server:
        bucket = server.create_bucket()
        proxies = tuple(FaultProxy(server.endpoint) for _ in range(max(args.ranks, args.reshard_to)))
        local = FaultProxy(server.endpoint)
        try:
            bench = Bench(server, bucket, proxies, local, Sizes(server, bucket), specs, full, args.log_dir)
            for system in args.systems:
                got, stored[system] = run_system(bench, system, args.ranks, args.reshard_to)
                phases += got
        finally:
            for p in (*proxies, local):
                p.close()
    print_report(info, phases, stored)
    return {"info": info, "stored": stored,
            "phases": [{**asdict(p), "total": p.total, "read_ratio": p.read_ratio} for p in phases]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
