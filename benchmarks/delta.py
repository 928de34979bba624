"""Incremental saves: bytes written and save time of delta checkpoints against full ones.

Run from the repository root::

    python benchmarks/delta.py                          # 2M x 64 fp32 embedding + 256 MiB dense, /dev/shm
    python benchmarks/delta.py --rows 200000 --steps 2  # smoke run
    python benchmarks/delta.py --dir /tmp --json out.json

The state (Check-N-Run's setting): an embedding table of ``--rows`` x 64 float32 (2M rows: 512 MiB) of
which 1% of the rows, at random, change every step, and dense layers (``--dense-mib``, 4 square float32
matrices) of which 10% of the chunks (on the checkpoint's chunk grid) change every step.

Every step, interleaved, in one process on one filesystem:

``full``
    ``arrayckpt.save(state)`` — what a save without ``base`` writes.
``delta[rows given]``
    ``arrayckpt.save(state, base=previous, changed_rows=given)`` — the caller knows the touched
    rows (an embedding's sparse gradient); the dense layers are compared with the base read back.
``delta[detected]``
    ``arrayckpt.save(state, base=previous)`` — everything compared with the base read back (exact,
    bitwise); no help from the caller.
``delta[detected, async, kept copy]``
    ``arrayckpt.async_save(state, base=previous).wait()`` where the base was saved with
    ``async_save(..., keep_copy=True)``: the staged copy is compared with the kept host copy of the base in
    memory (exact), no read-back; the time is staging + background save.
``delta[rows given, 8-bit]``
    as ``rows given``, with the embedding's changed rows quantized to 8 bits (lossy, opt-in).

The embedding is also saved alone (``emb only``), full and as a delta with its rows given, to state the
acceptance figures for that tensor: delta bytes / full bytes and delta time / full time. Reported: the
median over ``--steps`` steps of seconds and of the bytes the checkpoint stores itself
(``manifest.stored_bytes``, before compression) and the files' size on disk. Every delta is checked bit for
bit against the state after it is written (outside the timing).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import arrayckpt
from arrayckpt._read.chain import dense_grid
from arrayckpt._read.checkpoint import stored_of


def _disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _state(rows: int, dense_mib: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    side = int((dense_mib * 2**20 / 4 / 4) ** 0.5)
    state = {"emb": torch.randn(rows, 64, generator=g) * 0.02}
    for i in range(4):
        state[f"dense{i}"] = torch.randn(side, side, generator=g) * 0.02
    return state


def _step(state: dict[str, torch.Tensor], grids: dict[str, tuple[int, ...]], g: torch.Generator) -> torch.Tensor:
    """1% of the embedding rows and 10% of each dense layer's chunks change."""
    emb = state["emb"]
    rows = torch.randperm(emb.shape[0], generator=g)[: max(1, emb.shape[0] // 100)]
    emb[rows] += torch.randn(len(rows), emb.shape[1], generator=g) * 1e-3
    for key, value in state.items():
        if key == "emb":
            continue
        grid = grids[key]
        counts = [-(-n // c) for n, c in zip(value.shape, grid, strict=True)]
        total = counts[0] * counts[1]
        for flat in torch.randperm(total, generator=g)[: max(1, total // 10)].tolist():
            i, j = divmod(flat, counts[1])
            value[i * grid[0]:(i + 1) * grid[0], j * grid[1]:(j + 1) * grid[1]] += 1e-3
    return rows


def _runs(state: dict[str, torch.Tensor], work: Path, given: dict[str, torch.Tensor]) -> dict:
    """The saves compared each step, by name (each takes the path to save to)."""
    emb = {"emb": state["emb"]}
    return {
        "full": lambda p: arrayckpt.save(state, p),
        "delta[rows given]": lambda p: arrayckpt.save(state, p, base=work / "base", changed_rows=given),
        "delta[detected]": lambda p: arrayckpt.save(state, p, base=work / "base"),
        "delta[detected, async, kept copy]": lambda p: arrayckpt.async_save(state, p, base=work / "base").wait(),
        "delta[rows given, 8-bit]": lambda p: arrayckpt.save(state, p, base=work / "base", changed_rows=given,
                                                             quantize={"emb": 8}),
        "emb only: full": lambda p: arrayckpt.save(emb, p),
        "emb only: delta[rows given]": lambda p: arrayckpt.save(emb, p, base=work / "emb-base", changed_rows=given),
    }


def _timed(fn) -> float:  # noqa: ANN001
    gc.collect()
    os.sync()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--dense-mib", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="arrayckpt-delta-", dir=args.dir))
    g = torch.Generator().manual_seed(0)
    state = _state(args.rows, args.dense_mib, g)
    samples: dict[str, dict[str, list[float]]] = {}

    def record(name: str, seconds: float, path: Path) -> None:
        entry = samples.setdefault(name, {"seconds": [], "stored_bytes": [], "disk_bytes": []})
        entry["seconds"].append(seconds)
        entry["stored_bytes"].append(arrayckpt.open(path).manifest.stored_bytes or 0)
        entry["disk_bytes"].append(_disk_bytes(path))

    try:
        arrayckpt.async_save(state, work / "base", keep_copy=True).wait()
        arrayckpt.save({"emb": state["emb"]}, work / "emb-base")
        base = arrayckpt.open(work / "base")
        grids = {k: dense_grid(stored_of(base), k) for k in state if k != "emb"}
        for step in range(args.steps):
            given = {"emb": _step(state, grids, g)}
            runs = _runs(state, work, given)
            for name, run in runs.items():
                path = work / f"{step}-{name.replace(' ', '_').replace(':', '')}"
                record(name, _timed(lambda run=run, path=path: run(path)), path)
                if "8-bit" not in name:
                    ckpt = arrayckpt.open(path)
                    for key in ckpt:
                        assert torch.equal(ckpt[key].torch(), state[key]), (name, key)
                shutil.rmtree(path)
            # the next step's deltas are against this step's state
            shutil.rmtree(work / "base")
            shutil.rmtree(work / "emb-base")
            arrayckpt.async_save(state, work / "base", keep_copy=True).wait()
            arrayckpt.save({"emb": state["emb"]}, work / "emb-base")
            print(f"step {step + 1}/{args.steps} done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    summary = {name: {k: statistics.median(v) for k, v in entry.items()} for name, entry in samples.items()}
    full, emb_full = summary["full"], summary["emb only: full"]
    print(f"state: embedding {args.rows} x 64 fp32 (1% rows change per step) + 4 dense fp32 "
          f"({args.dense_mib} MiB, 10% of chunks change); {args.steps} steps; directory {args.dir}")
    print(f"{'save':32} {'seconds':>8} {'stored MB':>10} {'on disk MB':>10} {'bytes/full':>10} {'time/full':>9}")
    for name, entry in summary.items():
        ref = emb_full if name.startswith("emb only") else full
        stored, disk = entry["stored_bytes"] / 1e6, entry["disk_bytes"] / 1e6
        print(f"{name:32} {entry['seconds']:8.3f} {stored:10.2f} {disk:10.2f}"
              f" {entry['stored_bytes'] / ref['stored_bytes']:10.4f} {entry['seconds'] / ref['seconds']:9.3f}")
    emb_delta = summary["emb only: delta[rows given]"]
    byte_share = 100 * emb_delta["stored_bytes"] / emb_full["stored_bytes"]
    time_share = 100 * emb_delta["seconds"] / emb_full["seconds"]
    print(f"\nembedding, 1% of rows changed: delta bytes = {byte_share:.2f}% of a full save (target <= 2%), "
          f"delta save time = {time_share:.1f}% of a full save (target <= 10%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "samples": samples, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
