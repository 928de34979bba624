"""spec/FORMAT.md against real output: its tables and examples must be what the code writes.

The spec marks checked material with ``<!-- spec-test: NAME -->`` comments; each is followed by a
Markdown table or a JSON code block.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

import arrayckpt
import arrayckpt._plan as plan
from arrayckpt._codecs import Codec, codec_pipeline
from arrayckpt._dtypes import DTYPES
from arrayckpt._format import GROUP_METADATA
from arrayckpt._keys import array_path, parse_array_path
from arrayckpt._storage import LocalWriter, parse_location
from arrayckpt._values import decode_value, encode_value

SPEC = (Path(__file__).resolve().parent.parent / "spec" / "FORMAT.md").read_text(encoding="utf-8")


def _after(marker: str) -> str:
    head = f"<!-- spec-test: {marker} -->\n"
    assert SPEC.count(head) == 1, f"marker {marker!r} must occur exactly once in spec/FORMAT.md"
    return SPEC.split(head, 1)[1]


def _code(cell: str) -> str:
    """The first code span of a table cell."""
    match = re.search(r"`([^`]*)`", cell)
    assert match, cell
    return match.group(1)


def _table(marker: str) -> list[list[str]]:
    lines = _after(marker).splitlines()
    rows = []
    for line in lines[2:]:  # header and separator
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert rows, marker
    return rows


def _json_block(marker: str) -> object:
    match = re.match(r"\s*```json\n(.*?)\n```", _after(marker), re.S)
    assert match, marker
    return json.loads(match.group(1))


def _without_created(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k != "created"}


def test_escaping_examples_match_array_path():
    for key_cell, path_cell in _table("escaping"):
        key, path = json.loads(_code(key_cell)), json.loads(_code(path_cell))
        assert array_path(key) == path, key
        assert parse_array_path(path, key) == path


def test_chunk_grid_examples_match_the_planner():
    for shape, itemsize, inner, outer in _table("chunks"):
        got = plan.choose_chunks(tuple(json.loads(_code(shape))), int(itemsize))
        assert got == (tuple(json.loads(_code(outer))), tuple(json.loads(_code(inner)))), shape


def test_value_examples_match_the_encoder():
    for python_cell, json_cell in _table("values"):
        value = eval(_code(python_cell), {"__builtins__": {}, "float": float})  # the spec's own literals
        expected = json.loads(_code(json_cell))
        assert json.dumps(encode_value(value)) == json.dumps(expected), python_cell
        assert json.dumps(encode_value(decode_value(expected))) == json.dumps(expected), json_cell


def test_dtype_table_matches_the_code():
    rows = {_code(row[0]): row for row in _table("dtypes")}
    assert set(DTYPES) <= set(rows)
    assert set(rows) - set(DTYPES) <= {"float8_e8m0fnu"}  # only present with new enough torch/ml_dtypes
    for name, dt in DTYPES.items():
        _, torch_cell, numpy_cell, itemsize, fill = rows[name]
        assert _code(torch_cell) == str(dt.torch)
        module, _, attr = _code(numpy_cell).partition(".")
        assert np.dtype(getattr({"numpy": np, "ml_dtypes": ml_dtypes}[module], attr)) == dt.numpy
        assert int(itemsize) == dt.itemsize
        assert json.dumps(json.loads(_code(fill))) == json.dumps(dt.fill_value), name


def test_codec_pipeline_examples():
    markers = re.findall(r"<!-- spec-test: (pipeline (\w+) (\d+)) -->", SPEC)
    assert len(markers) >= 4
    for marker, name, itemsize in markers:
        assert codec_pipeline(Codec(name), int(itemsize)) == _json_block(marker), marker


def test_sharded_array_example(tmp_path, monkeypatch):
    monkeypatch.setattr(plan, "INNER_CHUNK_BYTES", 16)
    monkeypatch.setattr(plan, "OUTER_CHUNK_BYTES", 64)
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.arange(40, dtype=torch.float32).reshape(10, 4)}, path, codec="zstd")
    assert json.loads((path / "w" / "zarr.json").read_text()) == _json_block("sharded-array")
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert files == ["w/c/0/0", "w/c/1/0", "w/c/2/0", "w/zarr.json", "zarr.json"]


def test_root_document_and_manifest_examples(tmp_path):
    path = tmp_path / "ckpt"
    arrayckpt.save({"model": torch.nn.Linear(3, 2), "step": 5, "cfg": {"betas": (0.9, 0.99)}}, path, step=5)
    root = json.loads((path / "zarr.json").read_text())
    spec_root = _json_block("root-example")
    manifest = root["attributes"]["arrayckpt"]
    assert set(manifest["created"]) == {"library", "torch", "time", "host", "world_size"}
    assert _without_created(manifest) == _without_created(spec_root["attributes"]["arrayckpt"])
    assert _without_created(manifest) == _without_created(_json_block("manifest-example"))
    assert {k: v for k, v in root.items() if k != "attributes"}.keys() == spec_root.keys() - {"attributes"}
    consolidated, spec_consolidated = root["consolidated_metadata"], spec_root["consolidated_metadata"]
    assert consolidated["kind"] == spec_consolidated["kind"] == "inline"
    assert consolidated["must_understand"] is spec_consolidated["must_understand"] is False
    nodes = consolidated["metadata"]
    assert set(nodes) == set(spec_consolidated["metadata"]) | {"model/bias"}  # the spec leaves bias out
    for node_path, document in spec_consolidated["metadata"].items():
        assert nodes[node_path] == document, node_path
    for node_path, document in nodes.items():  # every node's own zarr.json is its consolidated copy
        assert json.loads((path / node_path / "zarr.json").read_text()) == document
    assert nodes["model"] == GROUP_METADATA
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert files == [
        "model/bias/c/0", "model/bias/zarr.json", "model/weight/c/0/0", "model/weight/zarr.json",
        "model/zarr.json", "zarr.json",
    ]


def test_second_manifest_example(tmp_path):
    path = tmp_path / "ckpt"
    state = {
        "layers": [torch.ones(2), torch.zeros(1)],
        "pair": (torch.ones(1), 3),
        "misc": {"weird key/é": torch.ones(1), "__dunder": np.arange(3, dtype=np.int16),
                 "": torch.tensor(1.5, dtype=torch.bfloat16)},
        "obj": {1, 2},
    }
    arrayckpt.save(state, path, allow_pickle=True)
    root = json.loads((path / "zarr.json").read_text())
    expected = _json_block("manifest-example-2")
    expected["entries"]["obj"]["nbytes"] = len(pickle.dumps({1, 2}, protocol=5))
    assert _without_created(root["attributes"]["arrayckpt"]) == expected
    assert set(root["consolidated_metadata"]["metadata"]) == {
        "layers", "pair", "misc", "layers/0", "layers/1", "pair/0",
        "misc/weird%20key%2F%C3%A9", "misc/%5F_dunder", "misc/%", "obj",
    }


def test_collisions_are_refused(tmp_path):
    with pytest.raises(arrayckpt.StateError, match="same key"):
        arrayckpt.save({"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, tmp_path / "one")
    with pytest.raises(arrayckpt.StateError, match="prefix"):
        arrayckpt.save({"a": torch.ones(1), "a.b": torch.ones(1)}, tmp_path / "two")


def test_temporary_directory_name(tmp_path):
    writer = LocalWriter(parse_location(tmp_path / "ckpt"), overwrite=False)
    try:
        assert re.fullmatch(r"\.ckpt\.arrayckpt-tmp-[0-9a-f]{12}", writer.temp.name)
        assert writer.temp.parent == tmp_path
    finally:
        writer.abort()


def test_reading_without_arrayckpt_examples(tmp_path):
    """The zarr-python and TensorStore snippets of section 13 run as printed (path replaced)."""
    path = tmp_path / "ckpt"
    weight = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    arrayckpt.save({"model": {"weight": weight}}, path)
    section = SPEC.split("## 13. Reading without arrayckpt", 1)[1].split("\n## ", 1)[0]
    snippets = re.findall(r"```python\n(.*?)\n```", section, re.S)
    assert len(snippets) == 2
    for snippet in snippets:
        scope: dict = {}
        exec(snippet.replace("/ckpt/step-100", str(path)), scope)  # the spec's own example
        assert np.array_equal(np.asarray(scope["weight"], dtype=np.float32), weight.float().numpy())
