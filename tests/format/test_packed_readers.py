"""A packed checkpoint (spec §16) read from outside: zarr-python through its kerchunk references, without torch;
a plain Zarr reader opening the directory itself sees no arrays (never fill values for the chunks it cannot find);
and the layout's files: one pack per rank, an index, a root, references."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from policies import SHARDED

import arrayckpt
from arrayckpt._write.options import SaveOptions
from arrayckpt._write.save import save_with

READ_WITH_ZARR = """
import json, sys
sys.modules["torch"] = None  # no torch: the reader needs none
import numpy as np, zarr
ck = sys.argv[1]
group = zarr.open_group("reference://", mode="r", zarr_format=3, storage_options={
    "fo": f"{ck}/refs.json", "remote_protocol": "dir", "remote_options": {
        "path": ck, "asynchronous": True, "target_protocol": "async_wrapper",
        "target_options": {"target_protocol": "file", "target_options": {}, "asynchronous": True}}})
out = {path: group[path][...].tolist() for path in sys.argv[2:]}
print(json.dumps(out))
"""


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(37, 3, generator=g), "b": torch.randn(5, generator=g)},
            "steps": torch.tensor([3, 1, 4], dtype=torch.int32)}


@pytest.mark.slow  # a fresh interpreter, without torch
@pytest.mark.parametrize("chunking", ["whole", "sharded"])
def test_zarr_python_reads_a_packed_save_through_its_references_without_torch(tmp_path: Path, chunking: str):
    state, ck = _state(), tmp_path / "ck"
    if chunking == "sharded":
        SHARDED.save(state, ck, packed=True)
    else:
        save_with(state, ck, SaveOptions(packed=True))
    assert sorted(os.listdir(ck)) == ["packs", "refs.json", "zarr.json"]
    assert len([name for name in os.listdir(ck / "packs") if name.endswith(".pack")]) == 1
    paths = ["model/w", "model/b", "steps"]
    run = subprocess.run([sys.executable, "-c", READ_WITH_ZARR, str(ck), *paths], capture_output=True, text=True,
                         check=True)
    read = json.loads(run.stdout)
    for path, key in zip(paths, ["model.w", "model.b", "steps"], strict=True):
        expected = state["model"][path.split("/")[1]] if path.startswith("model") else state["steps"]
        assert np.array_equal(np.asarray(read[path]), expected.numpy()), key


@pytest.mark.filterwarnings("ignore:Object at packs is not recognized:UserWarning")
def test_a_plain_zarr_reader_opening_the_directory_finds_no_arrays(tmp_path: Path):
    """The root of a packed checkpoint has no consolidated metadata and no node documents: zarr-python opening the
    directory itself sees a group without members, never arrays whose chunks would read as fill values."""
    zarr = pytest.importorskip("zarr")
    ck = tmp_path / "ck"
    save_with(_state(), ck, SaveOptions(packed=True))
    group = zarr.open_group(str(ck), mode="r")
    assert list(group.keys()) == []
    assert "arrayckpt" in group.attrs and group.attrs["arrayckpt"]["format_version"] == 4
    with arrayckpt.open(ck) as ckpt:  # arrayckpt reads it through the index
        assert np.array_equal(ckpt["steps"].numpy(), [3, 1, 4])


def test_info_says_a_checkpoint_is_packed(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from arrayckpt.cli import main

    save_with(_state(), tmp_path / "packed", SaveOptions(packed=True))
    save_with(_state(), tmp_path / "files", SaveOptions(packed=False))
    assert main(["info", str(tmp_path / "packed")]) == 0
    assert "(format v4, packed: 1 pack, " in capsys.readouterr().out
    assert main(["info", str(tmp_path / "files")]) == 0
    assert "(format v3, step" in capsys.readouterr().out
