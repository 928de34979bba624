"""The local fast path writes the same Zarr v3 bytes TensorStore writes, and reads what TensorStore writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import assert_bit_equal, random_tensor
from policies import small_chunks

import arrayckpt
import arrayckpt._io.arrays as io


@pytest.fixture
def tensorstore_only(monkeypatch):
    """Switch the fast path off, so that TensorStore does all array IO."""

    def use(enabled: bool) -> None:
        if enabled:
            monkeypatch.setattr(io, "row_layout", lambda metadata: None)
        else:
            monkeypatch.undo()

    return use


SHAPES = [(), (1,), (37, 5), (40, 4), (129,), (3, 2, 7), (0, 3)]


def _state() -> dict[str, torch.Tensor]:
    dtypes = [torch.float32, torch.bfloat16, torch.uint8, torch.bool, torch.complex64, torch.float8_e5m2]
    return {f"t{i}_{j}": random_tensor(shape, dtype, seed=i * 10 + j)
            for i, shape in enumerate(SHAPES) for j, dtype in enumerate(dtypes)}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("c*")) if p.is_file()}


@pytest.mark.parametrize("chunking", ["whole", "sharded"], indirect=True)
def test_fast_path_writes_the_bytes_tensorstore_writes(tmp_path, chunking, tensorstore_only):
    state = _state()
    chunking.save(state, tmp_path / "fast")
    tensorstore_only(True)
    chunking.save(state, tmp_path / "ts")
    fast, ts = _files(tmp_path / "fast"), _files(tmp_path / "ts")
    assert fast.keys() == ts.keys() and len(fast) > 30
    assert fast == ts


@pytest.mark.parametrize("chunking", ["whole", "sharded"], indirect=True)
@pytest.mark.parametrize("writer", ["fast", "tensorstore"])
def test_each_path_reads_what_the_other_wrote(tmp_path, chunking, writer, tensorstore_only):
    state = _state()
    tensorstore_only(writer == "tensorstore")
    chunking.save(state, tmp_path / "c")
    tensorstore_only(writer != "tensorstore")
    target = {k: torch.empty_like(v) for k, v in state.items()}
    arrayckpt.load(target, tmp_path / "c")
    for key, value in state.items():
        assert_bit_equal(target[key], value)


def test_partial_row_reads_of_sharded_and_edge_chunks(ckpt):
    value = torch.arange(50 * 3, dtype=torch.float32).reshape(50, 3)  # inner 4 rows, outer 16 rows, edge at 50
    small_chunks(48, 192).save({"w": arrayckpt.Shard(value, (50, 3), (0, 0))}, ckpt)
    for start, stop in [(0, 50), (3, 9), (15, 17), (44, 50), (48, 49), (16, 32)]:
        target = {"w": arrayckpt.Shard(torch.zeros(stop - start, 3), (50, 3), (start, 0))}
        arrayckpt.load(target, ckpt)
        assert torch.equal(target["w"].tensor, value[start:stop]), (start, stop)


def test_fast_path_detects_damage_and_missing_inner_chunks(ckpt):
    small_chunks(48, 192).save({"w": torch.ones(40, 3)}, ckpt)
    shard = ckpt / "w" / "c.1.0"
    raw = bytearray(shard.read_bytes())
    raw[20] ^= 1  # inside inner chunk 0 of outer chunk 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'w'.*c\.1\.0 inner chunk 0: checksum mismatch"):
        arrayckpt.load({"w": torch.zeros(40, 3)}, ckpt)
    raw[20] ^= 1
    raw[-5] ^= 1  # the shard index
    shard.write_bytes(bytes(raw))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'w'.*c\.1\.0: shard index checksum mismatch"):
        arrayckpt.load({"w": torch.zeros(40, 3)}, ckpt)
    shard.write_bytes(bytes(raw[:30]))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'w'.*c\.1\.0"):
        arrayckpt.load({"w": torch.zeros(40, 3)}, ckpt)
    shard.unlink()
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"'w'.*c\.1\.0 is missing"):
        arrayckpt.load({"w": torch.zeros(40, 3)}, ckpt)


_FIRST_CALLS = """
    import json, sys
    import torch
    import arrayckpt

    HEAVY = ("tensorstore", "ml_dtypes", "zarr", "numpy.ma")
    generator = torch.Generator().manual_seed(0)
    state = {"model": torch.nn.Linear(8, 4), "ids": torch.arange(6), "step": 3, "scalar": torch.tensor(2.0),
             "half": torch.randn(5, 7, generator=generator).to(torch.bfloat16),
             "f8": torch.randn(9, generator=generator).to(torch.float8_e4m3fn)}
    def bits(tensor):
        return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor.view(torch.int16)
    saved = {key: bits(state[key]).clone() for key in ("half", "f8")}
    seen = {}
    arrayckpt.save(state, sys.argv[1] + "/c")
    seen["save"] = [m for m in HEAVY if m in sys.modules]
    for key in saved:
        state[key].zero_()
    arrayckpt.load(state, sys.argv[1] + "/c")
    seen["load"] = [m for m in HEAVY if m in sys.modules]
    seen["equal"] = all(torch.equal(bits(state[key]), saved[key]) for key in saved)
    arrayckpt.save(state, sys.argv[1] + "/z", codec="zstd")  # needs TensorStore: imported on demand
    seen["compressed"] = [m for m in HEAVY if m in sys.modules]
    for key in saved:  # through TensorStore both ways: bits, not values converted from the carrier's integers
        state[key].zero_()
    arrayckpt.load(state, sys.argv[1] + "/z")
    seen["equal_compressed"] = all(torch.equal(bits(state[key]), saved[key]) for key in saved)
    print(json.dumps(seen))
"""


@pytest.mark.slow
def test_first_local_uncompressed_save_and_load_import_nothing_heavy(tmp_path: Path) -> None:
    """The fast path serves a local uncompressed checkpoint without TensorStore (about a second to import with
    ml_dtypes in a fresh process) or numpy.ma (which ``np.unique`` imports): structural, not timed. bfloat16 and
    float8 tensors too: their host views keep a carrier integer type until values are interpreted, so ml_dtypes
    (0.7 s) is not imported either; through TensorStore (compressed) they are typed, and come back bit-exact."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_FIRST_CALLS), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["save"] == [] and seen["load"] == [], seen
    assert seen["equal"] and seen["equal_compressed"], seen
    assert "tensorstore" in seen["compressed"]


def test_a_lazy_context_is_made_once(tmp_path: Path) -> None:
    lazy = io.write_context()
    made = io.resolve_context(lazy)
    assert type(made).__name__ == "Context" and io.resolve_context(lazy) is made
    assert io.resolve_context(made) is made


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("3", 3), ("0", None), ("many", None), (None, None)])
def test_io_threads_from_the_environment(value, expected) -> None:
    """``ARRAYCKPT_IO_THREADS`` (e.g. cores per rank where ranks share a node's cores); unset, not a number or below 1
    (said with a warning): one per core, 2 to 8."""
    import warnings

    from arrayckpt._settings import Settings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = Settings.from_environ({} if value is None else {"ARRAYCKPT_IO_THREADS": value}).io_threads
    assert threads == (expected if expected is not None else min(8, max(2, os.cpu_count() or 2)))
    assert bool(caught) == (value in ("0", "many"))
