"""Peak memory of save, async save, load, open + slice, open + whole tensors and verify, against the state size.

Run from the repository root::

    python benchmarks/memory.py                          # 1 GiB state on /dev/shm, 2 repeats
    python benchmarks/memory.py --size-gib 0.25 --repeats 1
    python benchmarks/memory.py --dir /tmp --json memory.json

The state is the one ``save_load.py`` builds (half float32, half bfloat16 by bytes: a tall embedding, four big
matrices, ~2,000 small matrices and biases; random values), held by this process for the whole run, so it is part
of every baseline. Each operation runs in this process, repeatedly, interleaved:

``save``         ``arrayckpt.save(state, path)``: writes straight from the tensors' memory.
``async_save``   ``arrayckpt.async_save(state, path)`` then ``handle.wait()``: stages a host copy of the state first
                 (that is what lets training change the tensors at once), writes it in the background. The
                 staging buffers are allocated by the first async save of a process and kept for the next ones:
                 ``async_save (first)`` is measured after ``arrayckpt.release_host_buffers()`` (which frees the
                 previous buffers), ``async_save (again)`` right after it, reusing its buffers.
``load``         ``arrayckpt.load(dst, path)`` into preallocated, zero-filled tensors (allocated and touched
                 outside the measurement, so they are part of the baseline).
``open+slice``   ``arrayckpt.open(path)`` and every tensor read in row blocks of at most ``--slice-mib``, each
                 block dropped before the next is read.
``open+tensor``  every tensor read whole (``LazyArray.torch()``), one at a time, each dropped before the next.
``verify``       ``arrayckpt.verify(path)``: reads every chunk in batches of at most ``verify_batch_bytes`` (256 MiB).

Measurement (as in ``save_load.py``): ``gc.collect()`` and ``malloc_trim(0)`` first, then the kernel's peak-RSS
counter is reset (``echo 5 > /proc/self/clear_refs``) and the baseline ``VmRSS`` read; after the operation,
``VmHWM - baseline`` is its peak: exact, over all threads, memory-mapped file pages included (arrayckpt reads
local chunks through mmap), pages written to tmpfs or the page cache with ``write()`` not (they are not the
process's). ``retained`` is ``VmRSS`` after the operation and another ``gc.collect()``/``malloc_trim(0)``, minus the
baseline. Reported: the maximum over the repeats, in MiB and as a fraction of the state, against the bound
arrayckpt claims for that operation (``X`` = ``--slack-mib``, default 128 MiB, for buffers, index tables, thread
stacks and allocator slack); the exit status is 1 if any operation exceeds its bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from save_load import (  # noqa: E402  (the state and the measurement of save_load.py, shared)
    _libc,
    _proc_status_bytes,
    assert_bit_exact,
    build_state,
    plan_state,
    reset_peak_rss,
    state_nbytes,
    zero_fill,
    zeros_like_state,
)

import arrayckpt  # noqa: E402
from arrayckpt._settings import settings  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30


def _settle() -> None:
    gc.collect()
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)


@dataclass
class Sample:
    seconds: float
    peak: int  # VmHWM - VmRSS(before), bytes
    retained: int  # VmRSS(after, settled) - VmRSS(before), bytes


def measure(fn: Callable[[], object]) -> Sample:
    _settle()
    if not reset_peak_rss():
        raise SystemExit("/proc/self/clear_refs is not writable here: the peak cannot be measured")
    before = _proc_status_bytes("VmRSS")
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    peak = _proc_status_bytes("VmHWM") - before
    del result
    _settle()
    return Sample(seconds, peak, _proc_status_bytes("VmRSS") - before)


def read_sliced(path: Path, slice_bytes: int) -> None:
    opened = arrayckpt.open(path)
    for key in opened:
        array = opened[key]
        if not array.shape:
            np.asarray(array[()])
            continue
        row = max(1, array.nbytes // max(1, array.shape[0]))
        step = max(1, slice_bytes // row)
        for start in range(0, array.shape[0], step):
            block = array[start:min(start + step, array.shape[0])]
            del block


def read_tensors(path: Path) -> None:
    opened = arrayckpt.open(path)
    for key in opened:
        tensor = opened[key].torch()
        del tensor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0, help="state size (default 1)")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                        help="where to write (default /dev/shm, a tmpfs)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every operation (default 2); max reported")
    parser.add_argument("--slice-mib", type=float, default=16.0, help="row block size of open+slice (default 16)")
    parser.add_argument("--slack-mib", type=float, default=128.0, help="X of the bounds (default 128)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    print(f"building a {args.size_gib:g} GiB state ...", flush=True)
    state = build_state(plan_state(int(args.size_gib * GiB)), args.seed)
    size = state_nbytes(state)
    largest = max(t.nbytes for t in state.values())
    slack = int(args.slack_mib * MiB)
    slice_bytes = int(args.slice_mib * MiB)
    root = Path(tempfile.mkdtemp(prefix="arrayckpt-membench-", dir=args.dir))
    try:
        reference = root / "reference"
        arrayckpt.save(state, reference)  # what the reading operations read (also warms everything up)
        dst = zeros_like_state(state)
        arrayckpt.load(dst, reference)
        assert_bit_exact(state, dst, "arrayckpt")
        arrayckpt.async_save(state, root / "warm-async").wait()
        shutil.rmtree(root / "warm-async")
        arrayckpt.release_host_buffers()  # the warm-up's staging buffers freed

        def save() -> None:
            arrayckpt.save(state, root / "sync", overwrite=True)

        def async_save() -> None:
            arrayckpt.async_save(state, root / "async", overwrite=True).wait()

        def load() -> None:
            arrayckpt.load(dst, reference)

        ops: list[tuple[str, Callable[[], object], int, str]] = [
            ("save", save, slack, "X"),
            ("async_save (first)", async_save, size + slack, "state + X"),
            ("async_save (again)", async_save, slack, "X"),
            ("load", load, slack, "X (into preallocated tensors)"),
            ("open+slice", lambda: read_sliced(reference, slice_bytes), slice_bytes + slack, "slice + X"),
            ("open+tensor", lambda: read_tensors(reference), largest + slack, "largest tensor + X"),
            ("verify", lambda: arrayckpt.verify(reference), settings().verify_batch_bytes + slack,
             "verify_batch_bytes + X"),
        ]
        samples: dict[str, list[Sample]] = {name: [] for name, *_ in ops}
        for _ in range(args.repeats):
            for name, fn, _, _ in ops:
                if name == "load":
                    zero_fill(dst)
                if name == "async_save (first)":  # drop the buffers of the last async save (outside the measure)
                    arrayckpt.release_host_buffers()
                samples[name].append(measure(fn))
        assert_bit_exact(state, dst, "arrayckpt")

        print(f"\nstate {size / MiB:.0f} MiB in {len(state)} tensors (largest {largest / MiB:.0f} MiB) on {root} "
              f"({args.repeats} repeats; peak = max over repeats of VmHWM - VmRSS before; X = {args.slack_mib:g} MiB)")
        header = f"{'operation':19} {'peak MiB':>9} {'/ state':>8} {'retained MiB':>13} {'seconds':>8}  " \
                 f"{'bound':>28}  within"
        print(header)
        rows: list[dict[str, Any]] = []
        failures = 0
        for name, _, bound, rule in ops:
            peak = max(s.peak for s in samples[name])
            retained = max(s.retained for s in samples[name])
            seconds = min(s.seconds for s in samples[name])
            ok = peak <= bound
            failures += not ok
            print(f"{name:19} {peak / MiB:9.0f} {peak / size:8.2f} {retained / MiB:13.0f} {seconds:8.2f}  "
                  f"{rule + f' = {bound / MiB:.0f} MiB':>28}  {'yes' if ok else 'NO'}")
            rows.append({"operation": name, "peak_bytes": peak, "peak_over_state": peak / size,
                         "retained_bytes": retained, "seconds_min": seconds, "bound_bytes": bound, "bound": rule,
                         "within": ok, "samples": [vars(s) for s in samples[name]]})
        if args.json:
            args.json.write_text(json.dumps({"state_bytes": size, "tensors": len(state), "largest_bytes": largest,
                                             "directory": str(root), "slack_bytes": slack, "rows": rows}, indent=1))
        return 1 if failures else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
