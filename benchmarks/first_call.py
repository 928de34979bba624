"""First call in a fresh process: ``arrayckpt.save`` / ``arrayckpt.load`` against DCP's, at 1, 2 and 4 gloo ranks.

Run from the repository root::

    python benchmarks/first_call.py                        # 1, 2, 4 ranks, 3 repeats, /dev/shm, DCP pre-imported
    python benchmarks/first_call.py --ranks 2 --repeats 5
    python benchmarks/first_call.py --no-dcp-preimport     # DCP's import is then part of its first call
    python benchmarks/first_call.py --dtype bfloat16       # an LLM-like bf16 state (ml_dtypes must not be imported)

What it measures
----------------
Every measurement runs in fresh interpreters (one per rank, started with ``subprocess``; ranks > 1 form a gloo
process group on 127.0.0.1): a GPT-2-like model of about ``--size-mib`` MiB (token and position embeddings, per
layer a QKV, an output projection, an MLP up and down matrix, layer norms and biases; float32), wrapped with
FSDP2 ``fully_shard`` per block and at the top when there are several ranks (its ``state_dict()`` then holds
``DTensor`` shards), plain with one. ``torch``, ``torch.distributed`` and (unless ``--no-dcp-preimport``)
``torch.distributed.checkpoint`` and its ``state_dict`` helpers are imported first, as in training code that
uses ``get_state_dict``; ``import arrayckpt`` too (it imports nothing heavy). arrayckpt's modules are
byte-compiled first, as an installed wheel's are. Then, timed between two barriers:

- ``save`` process: the first ``save`` of the state, then a second one (warm) to another path;
- ``load`` process (a resume: a fresh process that saved nothing): the first in-place ``load`` of the
  checkpoint the save process wrote, then a second one.

The time of an op is the maximum over the ranks. Per repeat the systems alternate (arrayckpt then DCP, DCP
then arrayckpt, ...). Reported: median (min) seconds of first and second calls, ``first - DCP first`` in
milliseconds (target: at most +50 ms), and whether TensorStore was in ``sys.modules`` after arrayckpt's call.
The machine may be shared and have few cores (ranks share them): trust medians.
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

SYSTEMS = ("arrayckpt", "dcp")


def _model(size_mib: float) -> Any:
    """A GPT-2-like stack (vocabulary 8192, width 256, enough blocks to reach about ``size_mib``)."""
    import torch

    vocab, width = 8192, 256
    per_block = (12 * width * width + 13 * width) * 4
    blocks = max(1, round((size_mib * 2**20 - (vocab + 1024) * width * 4) / per_block))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
            self.attn = torch.nn.Linear(width, 3 * width)
            self.proj = torch.nn.Linear(width, width)
            self.fc = torch.nn.Linear(width, 4 * width)
            self.fc_out = torch.nn.Linear(4 * width, width)

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(1024, width)
            self.h = torch.nn.ModuleList(Block() for _ in range(blocks))
            self.ln_f = torch.nn.LayerNorm(width)

    torch.manual_seed(0)
    return GPT()


def _worker(args: argparse.Namespace) -> None:
    """One rank of one measurement: prints a JSON line with its timings."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process says so
    if args.dcp_preimport:
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401
    import arrayckpt

    torch.set_num_threads(1)
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world)
    model = _model(args.size_mib).to(getattr(torch, args.dtype))
    if args.world > 1:
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        fully_shard(model)
    state = {"model": model.state_dict()}
    barrier = dist.barrier if args.world > 1 else (lambda: None)

    def timed(fn: Any) -> float:
        barrier()
        start = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - start

    path = os.path.join(args.dir, args.system)
    if args.system == "arrayckpt":
        ops = {"save": lambda p: arrayckpt.save(state, p), "load": lambda p: arrayckpt.load(state, p)}
    else:
        import torch.distributed.checkpoint as dcp

        ops = {"save": lambda p: dcp.save(state, checkpoint_id=p), "load": lambda p: dcp.load(state, checkpoint_id=p)}
    op = ops[args.op]
    first = timed(lambda: op(path))
    heavy = [m for m in ("tensorstore", "ml_dtypes", "zarr") if m in sys.modules]
    second = timed(lambda: op(path + "-2" if args.op == "save" else path))
    print(json.dumps({"first": first, "second": second, "heavy": heavy}))
    if args.world > 1:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(system: str, op: str, world: int, directory: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh set of ranks doing ``op`` with ``system``; the max over ranks of their timings."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, __file__, "--worker", "--system", system, "--op", op, "--world", str(world),
               "--port", str(port), "--dir", directory, "--size-mib", str(args.size_mib), "--dtype", args.dtype]
    if not args.dcp_preimport:
        command.append("--no-dcp-preimport")
    procs = [subprocess.Popen([*command, "--rank", str(rank)], stdout=subprocess.PIPE, env=env, text=True)
             for rank in range(world)]
    outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{system} {op} at {world} ranks failed")
    return {"first": max(o["first"] for o in outs), "second": max(o["second"] for o in outs),
            "heavy": sorted({m for o in outs for m in o["heavy"]})}


def compile_arrayckpt() -> None:
    """Byte-compile arrayckpt's modules, as installing its wheel does (pip compiles what it installs, and torch's
    modules, DCP's included, come compiled): an editable install, or ``PYTHONDONTWRITEBYTECODE=1``, leaves them
    uncompiled, and compiling ~60 modules from source in the first call (~0.15 s here) is no cost a user pays."""
    import compileall

    import arrayckpt

    compileall.compile_dir(os.path.dirname(arrayckpt.__file__), quiet=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size-mib", type=float, default=34)
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--no-dcp-preimport", dest="dcp_preimport", action="store_false")
    parser.add_argument("--json", help="write every sample here")
    parser.add_argument("--dtype", default="float32", help="the model's parameter dtype, e.g. bfloat16")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--system", "--op"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--world", "--rank", "--port"):
        parser.add_argument(name, type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    compile_arrayckpt()
    samples: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for world in [int(r) for r in args.ranks.split(",")]:
        for repeat in range(args.repeats):
            for system in SYSTEMS if repeat % 2 == 0 else SYSTEMS[::-1]:
                directory = tempfile.mkdtemp(prefix="first-call-", dir=args.dir)
                try:
                    for op in ("save", "load"):
                        samples.setdefault((world, system, op), []).append(_run(system, op, world, directory, args))
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
    print(f"first call in a fresh process, ~{args.size_mib} MiB GPT-2-like {args.dtype} state, {args.dir}, "
          f"DCP {'pre-imported' if args.dcp_preimport else 'not pre-imported'}; median (min) over {args.repeats}")
    print(f"{'ranks':>5} {'op':<5} {'system':<10} {'first s':>16} {'second s':>16} {'first - DCP ms':>15} heavy")
    for (world, system, op), runs in sorted(samples.items()):
        first = [r["first"] for r in runs]
        second = [r["second"] for r in runs]
        dcp_first = statistics.median(r["first"] for r in samples[(world, "dcp", op)])
        heavy = ",".join(sorted({m for r in runs for m in r["heavy"]})) or "-"
        print(f"{world:>5} {op:<5} {system:<10} {statistics.median(first):8.3f} ({min(first):.3f}) "
              f"{statistics.median(second):8.3f} ({min(second):.3f}) "
              f"{(statistics.median(first) - dcp_first) * 1e3:+15.0f} {heavy}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"ranks": w, "system": s, "op": o, "runs": r} for (w, s, o), r in samples.items()], f, indent=1)


if __name__ == "__main__":
    main()
