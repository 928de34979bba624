"""spec/FORMAT.md against real output: its tables and examples must be what the code writes.

The spec marks checked material with ``<!-- spec-test: NAME -->`` comments; each is followed by a
Markdown table or a JSON code block.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
from collections import OrderedDict
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import arrayckpt
import arrayckpt._plan as plan
import arrayckpt._storage as storage
from arrayckpt._codecs import BLOSC_COMPRESSORS, Codec, check_checksummed, codec_pipeline
from arrayckpt._dtypes import DTYPES
from arrayckpt._errors import FormatError
from arrayckpt._format import GROUP_METADATA, MAX_NDIM, Manifest, node_documents, per_rank_path
from arrayckpt._io import read_context
from arrayckpt._keys import array_path, parse_array_path
from arrayckpt._save import describe_local, host_view
from arrayckpt._saveplan import plan_save
from arrayckpt._shards import Box
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


def test_shard_step_examples_match_the_planner():
    for shape, boxes, step in _table("shard-grid"):
        distinct = [Box(tuple(offset), tuple(extent)) for offset, extent in json.loads(_code(boxes))]
        assert plan.shard_grid(tuple(json.loads(_code(shape))), distinct) == tuple(json.loads(_code(step))), boxes


def test_sharded_chunk_grid_examples_match_the_planner_and_never_straddle_shards():
    for shape, itemsize, step, inner, outer, _ in _table("chunks-sharded"):
        steps = tuple(json.loads(_code(step)))
        got_outer, got_inner = plan.choose_chunks(tuple(json.loads(_code(shape))), int(itemsize), steps)
        assert (got_outer, got_inner) == (tuple(json.loads(_code(outer))), tuple(json.loads(_code(inner)))), shape
        for s, o, i in zip(steps, got_outer, got_inner, strict=True):
            assert o % i == 0 and (s is None or s % o == 0), (shape, step)
    assert plan.FRAGMENTATION_LIMIT == 16 and "`FRAGMENTATION = 16`" in SPEC
    assert (plan.INNER_CHUNK_BYTES, plan.OUTER_CHUNK_BYTES) == (4194304, 67108864)


def test_value_examples_match_the_encoder():
    for python_cell, json_cell in _table("values"):
        scope = {"__builtins__": {}, "float": float, "OrderedDict": OrderedDict}
        value = eval(_code(python_cell), scope)  # the spec's own literals
        expected = json.loads(_code(json_cell))
        assert json.dumps(encode_value(value)) == json.dumps(expected), python_cell
        assert json.dumps(encode_value(decode_value(expected))) == json.dumps(expected), json_cell


def test_malformed_dict_markers_named_in_the_spec_are_refused():
    for text in ('{"$dict": ["ab"]}', '{"$dict": [[1, 2, 3]]}', '{"$dict": [[[1], 2]]}'):
        assert f"`{text}`" in SPEC
        with pytest.raises(FormatError, match=r"malformed \$dict"):
            decode_value(json.loads(text), "k")


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


def test_codec_limits_are_the_spec_ranges():
    listed = re.search(r"with `C` one of (.*?)\s*\(default `zstd`", SPEC, re.S)
    assert listed, "blosc compressor list"
    assert tuple(re.findall(r"`(\w+)`", listed.group(1))) == BLOSC_COMPRESSORS
    for name, low, high in (("zstd", -7, 22), ("blosc", 0, 9)):
        Codec(name, level=low), Codec(name, level=high)
        for level in (low - 1, high + 1):
            with pytest.raises(arrayckpt.StateError, match="out of range"):
                Codec(name, level=level)
    with pytest.raises(arrayckpt.StateError, match="unknown blosc compressor"):
        Codec("blosc", cname="snappy")


def test_checksum_rule_of_the_reader():
    sharded = _json_block("sharded-array")
    check_checksummed(sharded, "x")
    check_checksummed({"codecs": _json_block("pipeline none 4")}, "x")
    config = sharded["codecs"][0]["configuration"]
    for codecs in (
        [{"name": "bytes", "configuration": {"endian": "little"}}],
        [{"name": "bytes"}, {"name": "crc32c", "configuration": {}}],  # refused: only the exact form counts
        [{"name": "sharding_indexed", "configuration": {**config, "index_codecs": config["index_codecs"][:1]}}],
        [{"name": "sharding_indexed", "configuration": {**config, "codecs": config["codecs"][:2]}}],
    ):
        with pytest.raises(FormatError, match="crc32c"):
            check_checksummed({"codecs": codecs}, "x")


def test_sharded_array_example(tmp_path, monkeypatch):
    monkeypatch.setattr(plan, "INNER_CHUNK_BYTES", 16)
    monkeypatch.setattr(plan, "OUTER_CHUNK_BYTES", 64)
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.arange(40, dtype=torch.float32).reshape(10, 4)}, path, codec="zstd")
    assert json.loads((path / "w" / "zarr.json").read_text()) == _json_block("sharded-array")
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert files == ["w/c.0.0", "w/c.1.0", "w/c.2.0", "w/zarr.json", "zarr.json"]


def test_shard_file_layout_example(tmp_path, monkeypatch):
    """The 108-byte shard of section 7.4: two encoded inner chunks, then the index and its crc32c."""
    monkeypatch.setattr(plan, "INNER_CHUNK_BYTES", 16)
    monkeypatch.setattr(plan, "OUTER_CHUNK_BYTES", 64)
    path = tmp_path / "ckpt"
    arrayckpt.save({"w": torch.arange(40, dtype=torch.float32).reshape(10, 4)}, path)
    assert "shard `w/c.2.0` holds rows 8–11" in SPEC and "is 108 bytes" in SPEC
    shard = (path / "w" / "c.2.0").read_bytes()
    assert len(shard) == 108
    index = np.frombuffer(shard[40:104], "<u8").reshape(4, 2).tolist()
    assert index == [[0, 20], [20, 20], [2**64 - 1, 2**64 - 1], [2**64 - 1, 2**64 - 1]]
    assert np.frombuffer(shard[0:16], "<f4").tolist() == [32.0, 33.0, 34.0, 35.0]


def test_chunk_keys_of_the_layout_section(tmp_path):
    path = tmp_path / "ckpt"
    arrayckpt.save({"scalar": torch.tensor(1.0), "empty": torch.ones(0, 3), "m": torch.ones(2, 3)}, path)
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert files == ["empty/zarr.json", "m/c.0.0", "m/zarr.json", "scalar/c", "scalar/zarr.json", "zarr.json"]


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
        "model/bias/c.0", "model/bias/zarr.json", "model/weight/c.0.0", "model/weight/zarr.json",
        "model/zarr.json", "zarr.json",
    ]
    listing = re.search(r"produces\n\n```text\n(.*?)\n```", SPEC, re.S)
    assert listing, "the file listing of section 2"
    assert sorted(line.split()[0].removeprefix("P/") for line in listing.group(1).splitlines()) == files


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
    with pytest.raises(arrayckpt.StateError, match="prefix"):  # a tensor above a per-rank entry's arrays
        arrayckpt.save({"a": torch.ones(1), "a.b": arrayckpt.PerRank(torch.ones(1))}, tmp_path / "three")
    with pytest.raises(arrayckpt.StateError, match="letter case"):
        arrayckpt.save({"W": torch.ones(1), "w": torch.ones(1)}, tmp_path / "four")
    with pytest.raises(arrayckpt.StateError, match="letter case"):
        arrayckpt.save({"R": arrayckpt.PerRank(torch.ones(1)), "r": arrayckpt.PerRank(torch.ones(1))}, tmp_path / "5")
    with pytest.raises(arrayckpt.StateError, match="255 bytes"):
        arrayckpt.save({"é" * 43: torch.ones(1)}, tmp_path / "six")  # 43 * 6 = 258 bytes escaped
    assert not [p for p in tmp_path.iterdir()]  # refused before anything was written
    # allowed: values share prefixes with arrays, values ignore the case and length rules, and a per-rank
    # entry's own path is a group
    arrayckpt.save({"a": 1, "a.b": torch.ones(1), "W": 2, "w": torch.ones(1), "x" * 300: 3}, tmp_path / "ok1")
    arrayckpt.save({"a": arrayckpt.PerRank(torch.ones(1)), "a.b": torch.ones(2)}, tmp_path / "ok2")
    nodes = json.loads((tmp_path / "ok2" / "zarr.json").read_text())["consolidated_metadata"]["metadata"]
    assert sorted(nodes) == ["a", "a/%r0", "a/b"] and nodes["a"] == GROUP_METADATA
    arrayckpt.save({"é" * 42: torch.ones(1)}, tmp_path / "ok3")  # 252 bytes


def test_walked_dict_keys_must_be_str_or_int_and_valid_unicode(tmp_path):
    class Stateful:
        def __init__(self, state):
            self.state = state

        def state_dict(self):
            return self.state

        def load_state_dict(self, state):
            pass

    for state in ({True: torch.ones(1)}, {1.5: 3}, {None: 3}, {"m": Stateful({(1, 2): torch.ones(1)})},
                  {"a\udc80": 3}, {"a": {"b\udc80": torch.ones(1)}}):
        with pytest.raises(arrayckpt.StateError):
            arrayckpt.save(state, tmp_path / "bad")
    arrayckpt.save({"a": {None: 3, (1, 2): 4}}, tmp_path / "ok")  # not walked: a plain value
    entry = json.loads((tmp_path / "ok" / "zarr.json").read_text())["attributes"]["arrayckpt"]["entries"]["a"]
    assert entry["value"] == {"$dict": [[None, 3], [{"$tuple": [1, 2]}, 4]]}


def test_manifest_shapes_are_limited_to_32_dimensions():
    assert MAX_NDIM == 32 and "list of at most 32 integers" in SPEC
    entry = {"kind": "tensor", "keys": ["t"], "path": "t", "dtype": "float32"}
    Manifest.from_dict({"format_version": 1, "entries": {"t": {**entry, "shape": [1] * 32}}})
    with pytest.raises(FormatError, match="shape"):
        Manifest.from_dict({"format_version": 1, "entries": {"t": {**entry, "shape": [1] * 33}}})


_RANK_SEGMENT = re.compile(r"%r(0|[1-9][0-9]*)")  # the spec's rank-segment


@given(st.text(max_size=12), st.integers(min_value=0, max_value=10**6))
def test_per_rank_paths_are_outside_the_escaped_grammar(key, rank):
    path = per_rank_path(key, rank)
    assert path == f"{array_path(key)}/%r{rank}"
    assert not any(_RANK_SEGMENT.fullmatch(segment) for segment in array_path(key).split("/"))
    assert _RANK_SEGMENT.fullmatch(path.rsplit("/", 1)[1])
    with pytest.raises(FormatError):
        parse_array_path(path, key)


def _per_rank_example_states() -> list[dict]:
    return [
        {"step": 7, "rng": arrayckpt.PerRank(torch.tensor([1, 2], dtype=torch.uint8)),
         "loader": arrayckpt.PerRank({"epoch": 2, "offset": 0})},
        {"step": 7, "rng": arrayckpt.PerRank(torch.tensor([3, 4], dtype=torch.uint8))},
    ]


def test_per_rank_example():
    """The two-rank example of section 4.3, planned as the coordinator plans it (no processes needed)."""
    states = _per_rank_example_states()
    planned = plan_save([describe_local(s, r, False, host_view).description for r, s in enumerate(states)], None)
    manifest = Manifest(planned.entries, None, planned.containers, {}).to_dict()
    expected = _json_block("per-rank-example")
    assert _without_created(manifest) == _without_created(expected)
    assert list(manifest["entries"]) == list(expected["entries"])  # the order the spec describes
    assert expected["created"]["world_size"] == len(states) == len(manifest["entries"]["rng"]["ranks"])
    assert set(node_documents(dict.fromkeys(planned.arrays, {}))) == {"rng", "rng/%r0", "rng/%r1"}
    assert [[task.path for task in tasks] for tasks in planned.tasks] == [["rng/%r0"], ["rng/%r1"]]
    for path, array in planned.arrays.items():
        metadata = plan.array_metadata(array)
        assert (metadata["data_type"], metadata["shape"], metadata["attributes"]) == \
            ("uint8", [2], {"arrayckpt": {"key": "rng"}}), path


def test_per_rank_entries_on_disk_and_read_back(tmp_path):
    path = tmp_path / "ckpt"
    arrayckpt.save(_per_rank_example_states()[0], path)
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert files == ["rng/%r0/c.0", "rng/%r0/zarr.json", "rng/zarr.json", "zarr.json"]
    opened = arrayckpt.open(path)
    assert list(opened) == [] and list(opened.plain_values) == ["step"]  # per-rank entries are neither
    assert [t.tolist() for t in opened.per_rank("rng")] == [[1, 2]]
    assert opened.per_rank("loader") == [{"epoch": 2, "offset": 0}]
    target = {"rng": arrayckpt.PerRank(torch.zeros(2, dtype=torch.uint8)), "loader": arrayckpt.PerRank(None)}
    arrayckpt.load(target, path, strict=False)
    assert target["rng"].value.tolist() == [1, 2] and target["loader"].value == {"epoch": 2, "offset": 0}
    with pytest.raises(arrayckpt.StateError, match="PerRank"):  # only into PerRank targets
        arrayckpt.load({"rng": torch.zeros(2, dtype=torch.uint8)}, path, strict=False)
    with pytest.raises(arrayckpt.StateError, match="no value saved by rank 3"):
        arrayckpt.load({"rng": arrayckpt.PerRank(torch.zeros(2, dtype=torch.uint8), rank=3)}, path, strict=False)


def test_plain_values_come_from_the_lowest_rank_holding_them():
    states = [{"w": torch.ones(2)}, {"w": torch.ones(2), "v": "rank1"}, {"w": torch.ones(2), "v": "rank2"}]
    planned = plan_save([describe_local(s, r, False, host_view).description for r, s in enumerate(states)], None)
    assert planned.entries["v"].value == "rank1"


def test_temporary_directory_name(tmp_path):
    writer = LocalWriter(parse_location(tmp_path / "ckpt"), overwrite=False)
    try:
        assert re.fullmatch(r"\.ckpt\.arrayckpt-tmp-[0-9a-f]{12}", writer.temp.name)
        assert writer.temp.parent == tmp_path
    finally:
        writer.abort()


def test_three_rename_fallback_uses_a_marked_aside_directory(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    arrayckpt.save({"v": 1}, path)
    renames: list[tuple[str, str]] = []
    real_rename = os.rename

    def recording_rename(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        real_rename(src, dst)

    monkeypatch.setattr(storage, "_renameat2", lambda src, dst, flags: errno.ENOSYS)  # no renameat2 at all
    monkeypatch.setattr(storage.os, "rename", recording_rename)
    arrayckpt.save({"v": 2}, path, overwrite=True)
    assert arrayckpt.open(path).plain_values["v"] == 2
    (p_aside, aside), (temp, p), (aside_again, temp_again) = renames
    assert (p_aside, p, aside_again, temp_again) == ("ckpt", "ckpt", aside, temp)
    assert re.fullmatch(r"\.ckpt\.arrayckpt-tmp-old-[0-9a-f]{8}", aside)
    assert "`A = D/.N.arrayckpt-tmp-old-XXXXXXXX` (8 random lower-case hex digits)" in SPEC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_only_arrayckpt_checkpoints_count_as_committed_for_overwrite(tmp_path):
    foreign, damaged = tmp_path / "foreign", tmp_path / "damaged"
    foreign.mkdir()
    (foreign / "zarr.json").write_text(json.dumps(GROUP_METADATA))
    damaged.mkdir()
    (damaged / "zarr.json").write_text("{not json")
    for path in (foreign, damaged):
        with pytest.raises(arrayckpt.CheckpointExistsError, match="not an arrayckpt checkpoint"):
            arrayckpt.save({"v": 1}, path, overwrite=True)
        assert (path / "zarr.json").exists()


def test_reads_memory_map_chunk_files():
    assert read_context().spec.to_json()["file_io_mode"] == {"mode": "memmap"}
    assert '`"file_io_mode": "memmap"`' in SPEC


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
