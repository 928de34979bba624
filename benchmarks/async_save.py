"""How long an asynchronous save blocks training: arrayckpt.async_save vs a plain host copy vs DCP.

Run from the repository root::

    python benchmarks/async_save.py                        # 1 GiB state, 5 repeats, /dev/shm
    python benchmarks/async_save.py --size-gib 0.25 --dir /tmp --repeats 3

What it measures, in one process, interleaved per repeat:

``copy``
    The limit: copying every tensor of the state into host buffers allocated once beforehand
    (``Tensor.copy_``). Any async save must at least do this before training may go on.
``arrayckpt``
    ``arrayckpt.async_save(state, path)``: the time until it returns (its staging buffers are allocated
    by the first save and reused, so the first repeat is reported apart), then ``wait()`` for the
    background write (reported as "total").
``dcp``
    ``torch.distributed.checkpoint.async_save`` (thread mode; a one-rank gloo group on 127.0.0.1, which DCP's
    async path needs), blocking time until it returns, then the future's result.

Reported: median blocking seconds, the ratio to the plain copy (target: arrayckpt ≤ 1.5x) and to DCP
(target: < 1), and the median total time until the checkpoint is committed. On a CUDA machine the
tensors are put on the GPU first (``--device cuda``), so the copy is device -> pinned host.
The state is the one of ``benchmarks/save_load.py`` (half fp32, half bf16; many small tensors, a few
big ones).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from save_load import build_state, plan_state  # noqa: E402

import arrayckpt  # noqa: E402


def _init_single_rank_group() -> None:
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    import torch.distributed.checkpoint as dcp

    _init_single_rank_group()
    state = {k: v.to(args.device) for k, v in build_state(plan_state(int(args.size_gib * 2**30)), 0).items()}
    nbytes = sum(t.nbytes for t in state.values())
    pinned = args.device == "cuda"
    buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in state.items()}
    root = Path(tempfile.mkdtemp(prefix="arrayckpt-async-", dir=args.dir))
    print(f"state: {len(state)} tensors, {nbytes / 2**30:.2f} GiB on {args.device}; writing under {root}")

    def plain_copy() -> None:
        for key, tensor in state.items():
            buffers[key].copy_(tensor, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize()

    blocking: dict[str, list[float]] = {"copy": [], "arrayckpt": [], "dcp": []}
    total: dict[str, list[float]] = {"arrayckpt": [], "dcp": []}
    first_arrayckpt = None
    try:
        for repeat in range(args.repeats + 1):
            blocking["copy"].append(_timed(plain_copy)[0])

            start = time.perf_counter()
            seconds, handle = _timed(lambda r=repeat: arrayckpt.async_save(state, root / f"a{r}"))
            handle.wait()  # type: ignore[union-attr]
            if repeat == 0:
                first_arrayckpt = seconds
            else:
                blocking["arrayckpt"].append(seconds)
                total["arrayckpt"].append(time.perf_counter() - start)

            start = time.perf_counter()
            seconds, future = _timed(lambda r=repeat: dcp.async_save(state, checkpoint_id=str(root / f"d{r}")))
            future.result()  # type: ignore[union-attr]
            if repeat:
                blocking["dcp"].append(seconds)
                total["dcp"].append(time.perf_counter() - start)
            for name in (f"a{repeat}", f"d{repeat}"):
                shutil.rmtree(root / name, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    copy = statistics.median(blocking["copy"][1:])
    print(f"\n{'system':<12}{'blocking s':>12}{'x copy':>9}{'x dcp':>9}{'total s':>10}")
    dcp_blocking = statistics.median(blocking["dcp"])
    for system in ("copy", "arrayckpt", "dcp"):
        b = statistics.median(blocking[system][1:] if system == "copy" else blocking[system])
        t = f"{statistics.median(total[system]):>10.3f}" if system in total else f"{'':>10}"
        print(f"{system:<12}{b:>12.3f}{b / copy:>9.2f}{b / dcp_blocking:>9.2f}{t}")
    print(f"\narrayckpt's first save (allocates its staging buffers): {first_arrayckpt:.3f} s blocking")
    print(f"GB/s of the plain copy: {nbytes / copy / 1e9:.2f}")


if __name__ == "__main__":
    main()
