"""Start-up time of the ``arrayckpt`` command line, hyperfine-style: each command run ``--runs`` times in a fresh
process after ``--warmup`` runs; prints the median and the spread, and what ``import arrayckpt`` costs alone.

    python benchmarks/cli_startup.py [--runs 10] [--checkpoint PATH]

Targets (issue 19): ``--help`` <= 0.3 s, ``info`` on a local checkpoint <= 1 s.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(command: list[str], runs: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        subprocess.run(command, capture_output=True, check=True)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(command, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--checkpoint", help="checkpoint for `info` (default: a small one made here, needs torch)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            import torch

            import arrayckpt

            checkpoint = str(Path(tmp) / "ckpt")
            arrayckpt.save({"model": torch.nn.Linear(64, 64).state_dict(), "step": 3}, checkpoint)
        cli = [sys.executable, "-m", "arrayckpt.cli"]
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "import arrayckpt": [sys.executable, "-c", "import arrayckpt"],
            "arrayckpt --help": [*cli, "--help"],
            "arrayckpt info": [*cli, "info", checkpoint],
            "arrayckpt info --json": [*cli, "info", checkpoint, "--json"],
        }
        print(f"{'command':<24} {'median':>8} {'min':>8} {'max':>8}   ({args.runs} runs, {args.warmup} warm-up)")
        for name, command in cases.items():
            times = timed(command, args.runs, args.warmup)
            print(f"{name:<24} {statistics.median(times):>7.3f}s {min(times):>7.3f}s {max(times):>7.3f}s")


if __name__ == "__main__":
    main()
