"""Bounded memory: a checkpoint larger than the memory a process may use is read slice by slice, and verified.

A child process measures its own address space after importing torch, TensorStore and arrayckpt and reading a
small checkpoint once (TensorStore's thread pools and their stacks exist by then), then caps it with
``RLIMIT_AS`` at that baseline + 512 MiB, and reads a 1.4 GiB checkpoint: every tensor in row blocks of 1/16
through ``arrayckpt.open(path)[key][rows]``, a few blocks through ``load`` into ``arrayckpt.Shard`` targets, and
the whole checkpoint through ``arrayckpt.verify`` (which reads in bounded batches, falling back to one chunk at a
time when a batch does not fit). Every value read is checked. The child also shows that the cap binds (an
allocation of 576 MiB fails there), and that ``verify`` with room for less than one chunk raises ``MemoryError``
instead of reporting a healthy checkpoint as damaged.

``RLIMIT_AS`` limits address space, not resident memory, so the child runs with ``MALLOC_ARENA_MAX=2``: glibc
otherwise reserves (without touching) 64 MiB of address space per malloc arena, one arena per thread up to
8 per core, which would count against the cap without using any memory. Memory-mapped chunk files (arrayckpt
reads local chunks through mmap) do count, which is part of what is checked.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import arrayckpt

MiB = 1 << 20
GROWTH = 512 * MiB  # what the child may add to its baseline address space
ROWS = 1 << 16  # rows of the 1024-column tensors: 256 MiB each in float32


def _state() -> dict[str, torch.Tensor]:
    """1.375 GiB: four float32 tensors whose every element is their number, an int32 ``arange`` (any misplaced
    row shows) and a bfloat16 tensor."""
    state = {f"w{i}": torch.full((ROWS, 1024), float(i)) for i in range(4)}
    state["ids"] = torch.arange(ROWS * 1024, dtype=torch.int32).reshape(-1, 2048)
    state["bf"] = torch.full((ROWS, 1024), 5.0, dtype=torch.bfloat16)
    return state


@pytest.fixture(scope="module")
def big_checkpoint() -> Iterator[tuple[Path, int]]:
    """The checkpoint (on /dev/shm when it has room, for speed) and its tensor bytes; the state is freed at once."""
    shm = Path("/dev/shm")
    room = shm.is_dir() and shutil.disk_usage(shm).free > 4 << 30
    root = Path(tempfile.mkdtemp(prefix="arrayckpt-memory-", dir=shm if room else None))
    try:
        state = _state()
        total = sum(t.nbytes for t in state.values())
        arrayckpt.save(state, root / "ckpt")
        del state
        arrayckpt.save({"a": torch.ones(1000, 100), "b": torch.ones(10)}, root / "warm")
        yield root, total
    finally:
        shutil.rmtree(root, ignore_errors=True)


_CHILD = r"""
import json, resource, sys
import numpy as np, torch, tensorstore, arrayckpt

def vm():
    return {k: int(v.split()[0]) << 10 for k, _, v in (l.partition(":") for l in open("/proc/self/status"))
            if k in ("VmSize", "VmPeak", "VmHWM")}

root, growth = sys.argv[1], int(sys.argv[2])
warm = arrayckpt.open(f"{root}/warm")
[warm[k][...] for k in warm]
assert arrayckpt.verify(f"{root}/warm").ok
base = vm()["VmSize"]
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (base + growth, hard))

path = f"{root}/ckpt"
opened = arrayckpt.open(path)
blocks = 0
for key in opened:
    array = opened[key]
    step = array.shape[0] // 16
    for start in range(0, array.shape[0], step):
        block = np.asarray(array[start:start + step])
        if key == "ids":
            first = start * array.shape[1]
            ok = np.array_equal(block.ravel(), np.arange(first, first + block.size, dtype=np.int32))
        else:
            want = 5.0 if key == "bf" else float(key[1:])
            ok = block.min() == want == block.max()
        assert ok, (key, start)
        blocks += 1
after_slices = vm()

rows = opened["w1"].shape[0] // 4
for r in range(4):
    shard = arrayckpt.Shard(torch.zeros(rows, 1024), global_shape=opened["w1"].shape, global_offset=(r * rows, 0))
    arrayckpt.load({"w1": shard}, path, strict=False)
    assert torch.all(shard.tensor == 1.0)
after_loads = vm()

report = arrayckpt.verify(path)
after_verify = vm()
try:
    np.ones(growth + (64 << 20), np.uint8)
    binds = False
except MemoryError:
    binds = True

# with room for less than one chunk (64 MiB), verify cannot check anything: it must say so, not report damage
resource.setrlimit(resource.RLIMIT_AS, (vm()["VmSize"] + (32 << 20), hard))
try:
    starved = f"returned ok={arrayckpt.verify(path).ok}"
except MemoryError:
    starved = "MemoryError"
print(json.dumps({"base": base, "limit": base + growth, "blocks": blocks, "ok": report.ok,
                  "bytes_checked": report.bytes_checked, "after_slices": after_slices, "after_loads": after_loads,
                  "after_verify": after_verify, "binds": binds, "starved": starved}))
"""


@pytest.mark.slow
def test_slices_loads_and_verify_of_a_checkpoint_bigger_than_memory(big_checkpoint: tuple[Path, int]) -> None:
    root, total = big_checkpoint
    assert total > 2.5 * GROWTH
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD, str(root), str(GROWTH)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["binds"], "the address-space cap does not bind: the test would prove nothing"
    assert seen["starved"] == "MemoryError", seen["starved"]  # no memory is no evidence of damage
    assert seen["blocks"] == 6 * 16
    assert seen["ok"] and seen["bytes_checked"] >= total, seen
    peak = seen["after_verify"]["VmPeak"]
    assert peak <= seen["limit"], seen  # (the kernel enforces it; this documents it)
    print(f"checkpoint {total / MiB:.0f} MiB; address space above the baseline at its peak: "
          f"{(peak - seen['base']) / MiB:.0f} MiB (cap {GROWTH / MiB:.0f} MiB); resident peak "
          f"{seen['after_verify']['VmHWM'] / MiB:.0f} MiB")


def test_a_block_past_the_shape_is_an_index_error_not_damage(tmp_path: Path) -> None:
    """Reading slice by slice, a last block that runs past the shape is clipped as numpy clips it, and a position
    past the shape is ``IndexError`` — never a failed read reported as a ``CorruptCheckpointError`` of a healthy
    checkpoint."""
    arrayckpt.save({"w": torch.arange(40.0).reshape(10, 4)}, tmp_path / "ckpt")
    w = arrayckpt.open(tmp_path / "ckpt")["w"]
    expected = torch.arange(40.0).reshape(10, 4).numpy()
    for index in (slice(8, 12), (slice(None), slice(2, 5)), -1):
        assert (w[index] == expected[index]).all() and w[index].shape == expected[index].shape
    for index in (10, -11, (0, 4)):
        with pytest.raises(IndexError):
            w[index]
    assert w[8:10].tolist() == [[32.0, 33.0, 34.0, 35.0], [36.0, 37.0, 38.0, 39.0]]
