"""Any Zarr v3 reader opens a checkpoint: zarr-python lists the tensors and reads every dtype bit-exactly."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import tensorstore as ts
import torch
from helpers import ALL_DTYPES, bits, random_tensor

import arrayckpt


def _state() -> dict:
    state = {str(d).removeprefix("torch."): random_tensor((9, 5), d, seed=i) for i, d in enumerate(ALL_DTYPES)}
    state["model"] = {"layers": [{"w": random_tensor((40, 3), torch.bfloat16)}], "scalar": torch.tensor(3.5)}
    return state


@pytest.mark.slow
@pytest.mark.parametrize("chunking", ["whole", "sharded"], indirect=True)
def test_zarr_python_reads_every_tensor_without_importing_arrayckpt(ckpt, chunking):
    state = _state()
    chunking.save(state, ckpt, step=4)
    expected = {key: bits(arr.torch()).numpy().tobytes().hex() for key, arr in arrayckpt.open(ckpt).items()}
    paths = {key: arr.entry.path for key, arr in arrayckpt.open(ckpt).items()}
    script = f"""
import json, sys, zarr
root = zarr.open_group({str(ckpt)!r}, mode="r")
found = sorted(name for name, node in root.members(max_depth=None) if isinstance(node, zarr.Array))
out = {{"members": found, "bits": {{}}, "step": root.attrs["arrayckpt"]["step"]}}
for key, path in json.loads(sys.argv[1]).items():
    arr = zarr.open_array({str(ckpt)!r} + "/" + path, mode="r")
    data = arr[...]
    out["bits"][key] = (data.astype("uint8") if data.dtype == bool else data).reshape(-1).view("uint8").tobytes().hex()
assert "torch" not in sys.modules, "reading a checkpoint with zarr-python must not need torch"
print(json.dumps(out))
"""
    done = subprocess.run([sys.executable, "-c", script, json.dumps(paths)], capture_output=True, text=True,
                          cwd=ckpt.parent)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["members"] == sorted(paths.values())
    assert out["step"] == 4
    assert out["bits"] == expected


def test_consolidated_metadata_matches_every_zarr_json(ckpt):
    arrayckpt.save(_state(), ckpt)
    root = json.loads((ckpt / "zarr.json").read_text())
    consolidated = root["consolidated_metadata"]["metadata"]
    on_disk = {
        str(p.parent.relative_to(ckpt)): json.loads(p.read_text()) for p in ckpt.rglob("zarr.json") if p.parent != ckpt
    }
    assert consolidated == on_disk


def test_tensorstore_reads_a_tensor_from_its_spec(ckpt):
    value = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    arrayckpt.save({"x": value}, ckpt)
    store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(ckpt / "x")}}).result()
    np.testing.assert_array_equal(store.read().result(), value.numpy())
