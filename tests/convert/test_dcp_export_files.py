"""Converting arrayckpt to DCP writes one ``__0_0.distcp`` holding every item, as DCP's own writer groups a rank's
items, streamed one tensor at a time (issue 19: it used to write one ``.distcp`` file per tensor)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, random_tensor

import arrayckpt
from arrayckpt._convert.dcp import _write_one_file, read_dcp_metadata, to_dcp
from arrayckpt._convert.dcp_payload import read_in_place

DATA_FILE = "__0_0.distcp"
MiB = 1 << 20


def _state() -> dict[str, Any]:
    return {
        "model": {
            "f32": random_tensor((7, 5), torch.float32, seed=1),
            "bf16": random_tensor((4, 6), torch.bfloat16, seed=2),
            "i64": torch.arange(-9, 12, dtype=torch.int64),
            "cube": random_tensor((3, 4, 5), torch.float32, seed=3),
            "scalar": torch.tensor(2.75, dtype=torch.float64),
        },
        "step": 17,
        "lr": 0.125,
        "name": "run-7",
    }


def _flat(state: dict[str, Any]) -> dict[str, Any]:
    """``{"model.f32": tensor, "step": 17, ...}``: DCP's fqns for :func:`_state`."""
    out = {f"model.{k}": v for k, v in state["model"].items()}
    out.update({k: v for k, v in state.items() if k != "model"})
    return out


def _export(tmp_path: Path, state: dict[str, Any], name: str = "dcp") -> Path:
    arrayckpt.save(state, tmp_path / "ckpt")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / name, to_format="dcp")
    return tmp_path / name


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def test_export_writes_one_data_file_and_the_metadata(tmp_path: Path) -> None:
    out = _export(tmp_path, _state())
    assert sorted(p.name for p in out.iterdir()) == [".metadata", DATA_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "dcp"]  # no temporary directory or file left


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_load_reads_every_tensor_bit_exactly_and_the_values(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = _state()
    out = _export(tmp_path, state)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "step": 0, "lr": 0.0,
              "name": ""}
    dcp.load(target, checkpoint_id=out, no_dist=True)
    for key, tensor in state["model"].items():
        assert_bit_equal(target["model"][key], tensor)
    assert (target["step"], target["lr"], target["name"]) == (17, 0.125, "run-7")


def test_storage_info_points_into_the_one_file_without_overlaps(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    state = _state()
    out = _export(tmp_path, state)
    metadata = FileSystemReader(out).read_metadata()
    infos = {index.fqn: info for index, info in metadata.storage_data.items()}
    assert set(infos) == set(_flat(state))
    assert {info.relative_path for info in infos.values()} == {DATA_FILE}
    spans = sorted((info.offset, info.length) for info in infos.values())
    assert all(length > 0 for _, length in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))  # no overlaps
    assert spans[0][0] == 0 and sum(n for _, n in spans) == (out / DATA_FILE).stat().st_size  # nothing else in it


def test_each_item_is_serialised_as_dcps_own_writer_does(tmp_path: Path) -> None:
    state = _state()
    ours = _export(tmp_path, state)
    _dcp_save(state, tmp_path / "reference")

    def payloads(path: Path) -> dict[str, bytes]:
        data = (path / DATA_FILE).read_bytes()
        return {index.fqn: data[info.offset:info.offset + info.length]
                for index, info in read_dcp_metadata(path).storage_data.items()}

    assert payloads(ours) == payloads(tmp_path / "reference")


def test_tensors_in_the_one_file_are_read_back_in_place(tmp_path: Path) -> None:
    from arrayckpt._convert.dcp_payload import storage_index

    state = _state()
    out = _export(tmp_path, state)
    metadata = read_dcp_metadata(out)
    for key, tensor in state["model"].items():
        item = metadata.state_dict_metadata[f"model.{key}"]
        back = read_in_place(out, f"model.{key}", item, storage_index(metadata))
        assert back is not None, f"model.{key} at a non-zero offset was not recognised"
        assert_bit_equal(back, tensor)
    arrayckpt.convert(out, tmp_path / "again")
    assert_bit_equal(arrayckpt.open(tmp_path / "again")["model.cube"].torch(), state["model"]["cube"])


def test_progress_counts_every_tensor_once(tmp_path: Path) -> None:
    state = _state()
    arrayckpt.save(state, tmp_path / "ckpt")
    seen: list[tuple[int, int]] = []
    to_dcp(arrayckpt.open(tmp_path / "ckpt"), tmp_path / "dcp", progress=lambda done, total: seen.append((done, total)))
    total = sum(t.nbytes for t in state["model"].values())
    assert len(seen) == len(state["model"]) and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_failed_write_leaves_no_data_file_nor_temporary(tmp_path: Path) -> None:
    class FailingPlanner:
        """Resolves the first item and fails on the second, as a damaged chunk would."""

        def __init__(self) -> None:
            self.calls = 0

        def resolve_data(self, item: Any) -> torch.Tensor:
            self.calls += 1
            if self.calls > 1:
                raise OSError("chunk unreadable")
            return torch.ones(3)

    class Item:
        type = None
        index = None

    with pytest.raises(OSError, match="chunk unreadable"):
        _write_one_file(tmp_path / DATA_FILE, [Item(), Item()], FailingPlanner(), sync=False)
    assert list(tmp_path.iterdir()) == []


_MEASURE = textwrap.dedent("""
    import os, sys, warnings
    import arrayckpt
    from arrayckpt._convert.dcp import to_dcp

    warnings.simplefilter("ignore")
    source, warm, out = sys.argv[1:4]

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    to_dcp(arrayckpt.open(warm), out + "-warm")  # imports and first-use allocations happen here, not below
    checkpoint = arrayckpt.open(source)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak RSS (VmHWM) restarts from the current RSS
    except OSError:
        pass
    before = status("VmRSS")
    to_dcp(checkpoint, out)
    print(status("VmHWM") - before)
""")


@pytest.mark.slow
def test_export_memory_stays_near_one_tensor(tmp_path: Path) -> None:
    """Peak RSS growth of the conversion, in a fresh process: RSS counts the memory torch and TensorStore
    allocate (``tracemalloc`` sees neither), and a fixed ``malloc`` mmap threshold makes freed tensors go back
    to the system at once rather than stay in an arena, so the figure is the live data, not the allocator's."""
    tensor_bytes, count = 16 * MiB, 8
    arrayckpt.save({f"layer{i}": torch.full((tensor_bytes // 4,), float(i)) for i in range(count)}, tmp_path / "big")
    arrayckpt.save({"w": torch.ones(4)}, tmp_path / "small")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MiB),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(tmp_path / "big"), str(tmp_path / "small"),
                           str(tmp_path / "dcp")], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    growth = int(done.stdout.split()[-1])
    assert growth < 3 * tensor_bytes, f"peak RSS grew {growth / MiB:.1f} MiB converting {count} x 16 MiB tensors"
    assert (tmp_path / "dcp" / DATA_FILE).stat().st_size > count * tensor_bytes


def test_empty_dicts_dcp_leaves_out_are_named_in_the_result(tmp_path: Path) -> None:
    """DCP's save walks into every dict and saves nothing for an empty one: the export says so by name (issue 28:
    DeepSpeed's ``shared_params`` vanished from a DCP export without a word)."""
    arrayckpt.save({"w": torch.ones(2), "shared_params": {}, "ds": {"empty": {}, "n": 1}, "in_list": [{}, 2],
                    "kept": ({}, 3), "rng": arrayckpt.PerRank(torch.ones(1))}, tmp_path / "ckpt")
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "dcp", to_format="dcp")
    assert result.skipped == ("rng", "shared_params", "ds.empty", "in_list.0")
    assert sorted(read_dcp_metadata(tmp_path / "dcp").state_dict_metadata) == ["ds.n", "in_list.1", "kept", "w"]
