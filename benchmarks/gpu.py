"""GPU state: device-to-host bandwidth, sync save, async blocking time and load into CUDA tensors, against DCP.

Run on a machine with a CUDA device, from the repository root::

    python benchmarks/gpu.py                       # ~4 GiB bf16 + fp32 state, 3 repeats, /dev/shm (< 5 minutes)
    python benchmarks/gpu.py --size-gib 8 --dir /local/nvme --json gpu.json
    python benchmarks/gpu.py --device cpu --size-gib 0.02 --repeats 1   # smoke test of the script (numbers meaningless)

Without CUDA (and without ``--device cpu``) it says so and exits 0.

What it measures (one process, one GPU; every timed op is bracketed by ``torch.cuda.synchronize()``):

- ``d2h pinned`` / ``d2h pageable``: copying the whole state to host memory: into pinned buffers allocated once,
  ``copy_(non_blocking=True)`` per tensor then one synchronize; against ``.cpu()`` per tensor (pageable). The
  pinned time is "the time of the copies" that an asynchronous save must at least block for.
- ``save``: ``arrayckpt.save(state, path)`` against ``dcp.save(state, checkpoint_id=path, no_dist=True)``.
- ``async blocked`` / ``async total``: how long the call blocks training (until the tensors may change) and until the
  checkpoint is committed: ``arrayckpt.async_save`` (blocked = until it returns; total = ``handle.wait()``), DCP's
  ``async_save`` with its default stager (blocked = until it returns) and with ``DefaultStager(StagingOptions(
  use_pinned_memory=True, use_async_staging=True, use_non_blocking_copy=True))`` (blocked = until its
  ``staging_completion``; the tensors must not change before). ``blocked / d2h pinned`` is printed: arrayckpt's
  target is at most 1.1.
- ``load``: in place into CUDA tensors: ``arrayckpt.load`` against ``dcp.load(..., no_dist=True)``; values are
  checked once after the timed repeats.

The state: transformer-like, half bfloat16 and half float32 by bytes (square matrices of ``--width`` plus a vector
per matrix), made with ``torch.randn`` on the device. A first untimed round warms up each system (CUDA contexts,
pinned pools, imports); per repeat the systems alternate. Reported: median and min seconds and GB/s (1e9 bytes of
tensor data over the median).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(size_gib: float, width: int, device: str) -> dict[str, Any]:
    """Half bf16, half fp32 by bytes: ``width`` x ``width`` matrices and a vector each."""
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    state: dict[str, Any] = {}
    for dtype in (torch.bfloat16, torch.float32):
        target = size_gib * 2**30 / 2
        per = width * width * dtype.itemsize
        for i in range(max(1, round(target / per))):
            name = f"{str(dtype).split('.')[-1]}.{i}"
            state[f"{name}.weight"] = torch.randn(width, width, generator=generator, device=device).to(dtype)
            state[f"{name}.bias"] = torch.randn(width, generator=generator, device=device).to(dtype)
    return state


def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _d2h(state: dict[str, Any], device: str) -> dict[str, Callable[[], Any]]:
    import torch

    pinned = device == "cuda"
    buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}

    def to_pinned() -> None:
        for key, tensor in state.items():
            buffers[key].copy_(tensor, non_blocking=pinned)

    return {"d2h pinned": to_pinned, "d2h pageable": lambda: [t.cpu() for t in state.values()]}


class _Systems:
    """The timed operations of arrayckpt and DCP on one state; every checkpoint goes under ``root``."""

    def __init__(self, state: dict[str, Any], root: str, device: str) -> None:
        self.state, self.root, self.device = state, root, device
        self.counter = 0
        self.stager: Any = None
        if device == "cuda":
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self.stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                       use_async_staging=True, use_non_blocking_copy=True))

    def path(self) -> str:
        self.counter += 1
        return os.path.join(self.root, f"ckpt-{self.counter}")

    def save(self, system: str) -> tuple[float, str]:
        import torch.distributed.checkpoint as dcp

        import arrayckpt

        path = self.path()
        if system == "arrayckpt":
            return _timed(lambda: arrayckpt.save(self.state, path), self.device), path
        return _timed(lambda: dcp.save(self.state, checkpoint_id=path, no_dist=True), self.device), path

    def load(self, system: str, path: str) -> float:
        import torch.distributed.checkpoint as dcp

        import arrayckpt

        if system == "arrayckpt":
            return _timed(lambda: arrayckpt.load(self.state, path), self.device)
        return _timed(lambda: dcp.load(self.state, checkpoint_id=path, no_dist=True), self.device)

    def async_save(self, system: str) -> tuple[float, float]:
        """(blocked, total) seconds."""
        import torch.distributed.checkpoint as dcp

        import arrayckpt

        path = self.path()
        _sync(self.device)
        start = time.perf_counter()
        if system == "arrayckpt":
            handle = arrayckpt.async_save(self.state, path)
            blocked = time.perf_counter() - start
            handle.wait()
        elif system == "dcp":
            future = dcp.async_save(self.state, checkpoint_id=path, no_dist=True)
            blocked = time.perf_counter() - start
            future.result()
        else:  # dcp with its pinned, asynchronous stager
            response = dcp.async_save(self.state, checkpoint_id=path, no_dist=True, async_stager=self.stager)
            staged = getattr(response, "staging_completion", None)  # an AsyncSaveResponse with async staging
            if staged is not None:
                staged.result()
            blocked = time.perf_counter() - start
            getattr(response, "upload_completion", response).result()
        total = time.perf_counter() - start
        shutil.rmtree(path, ignore_errors=True)
        return blocked, total

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def _round(systems: _Systems, repeat: int, samples: dict[tuple[str, str], list[float]] | None) -> None:
    """One round of every measurement, systems alternating by ``repeat`` (``samples`` None: a warm-up)."""
    def add(op: str, system: str, seconds: float) -> None:
        if samples is not None:
            samples.setdefault((op, system), []).append(seconds)

    for op, fn in _d2h(systems.state, systems.device).items():
        add(op, "torch", _timed(fn, systems.device))
    order = ["arrayckpt", "dcp"] if repeat % 2 == 0 else ["dcp", "arrayckpt"]
    for system in order:
        seconds, path = systems.save(system)
        add("save", system, seconds)
        add("load", system, systems.load(system, path))
        shutil.rmtree(path, ignore_errors=True)
    kinds = order + (["dcp pinned stager"] if systems.stager is not None else [])
    for system in kinds:
        blocked, total = systems.async_save(system)
        add("async blocked", system, blocked)
        add("async total", system, total)


def _check(systems: _Systems) -> None:
    """Each system's load gives back the saved values (once, untimed)."""
    import torch

    saved = {k: v.clone() for k, v in systems.state.items()}
    for system in ("arrayckpt", "dcp"):
        _, path = systems.save(system)
        for value in systems.state.values():
            value.zero_()
        systems.load(system, path)
        shutil.rmtree(path, ignore_errors=True)
        for key, value in saved.items():
            if not torch.equal(systems.state[key], value):
                raise SystemExit(f"{system}: {key} differs after the load")


def _table(samples: dict[tuple[str, str], list[float]], nbytes: int, header: str) -> str:
    lines = [header, "", "| op | system | median s | min s | GB/s | note |", "| --- | --- | ---: | ---: | ---: | --- |"]
    copy = statistics.median(samples[("d2h pinned", "torch")])
    for (op, system), values in samples.items():
        median = statistics.median(values)
        note = f"{median / copy:.2f}x the pinned copy" if op == "async blocked" else ""
        if op in ("save", "load") and system == "arrayckpt" and (op, "dcp") in samples:
            note = f"DCP/arrayckpt {statistics.median(samples[(op, 'dcp')]) / median:.2f}"
        lines.append(f"| {op} | {system} | {median:.3f} | {min(values):.3f} | {nbytes / median / 1e9:.2f} | {note} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=4.0)
    parser.add_argument("--width", type=int, default=4096, help="matrices are width x width")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: a smoke test of this script (numbers meaningless)")
    parser.add_argument("--json", help="write every sample here")
    args = parser.parse_args()

    import torch

    import arrayckpt

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu.py: no CUDA device here; run it on a machine with one (or --device cpu to smoke-test the script)")
        return
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    state = _state(args.size_gib, args.width if args.device == "cuda" else min(args.width, 512), args.device)
    nbytes = _nbytes(state)
    root = tempfile.mkdtemp(prefix="gpu-bench-", dir=args.dir)
    systems = _Systems(state, root, args.device)
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        _round(systems, 0, None)  # warm-up: imports, CUDA contexts, pinned pools and stagers
        for repeat in range(args.repeats):
            _round(systems, repeat, samples)
        _check(systems)
    finally:
        systems.close()
        shutil.rmtree(root, ignore_errors=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test: numbers meaningless)"
    header = (f"{device}; torch {torch.__version__}, arrayckpt {arrayckpt.__version__}; state {nbytes / 2**30:.2f} "
              f"GiB ({len(state)} tensors, bf16 + fp32); {args.dir}; median of {args.repeats} after a warm-up round")
    print(_table(samples, nbytes, header))
    if args.json:
        with open(args.json, "w") as f:
            rows = [{"op": op, "system": system, "seconds": v} for (op, system), v in samples.items()]
            json.dump({"header": header, "bytes": nbytes, "samples": rows}, f, indent=1)


if __name__ == "__main__":
    main()
