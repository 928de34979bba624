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
import shutil
import uuid
import warnings
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from policies import small_chunks

import arrayckpt
import arrayckpt._layout.chunking as plan
import arrayckpt._storage.local as storage
import arrayckpt._storage.renames as durability
from arrayckpt._errors import FormatError
from arrayckpt._format.codecs import BLOSC_COMPRESSORS, Codec, check_checksummed, codec_pipeline
from arrayckpt._format.dtypes import DTYPES
from arrayckpt._format.keys import array_path, parse_array_path
from arrayckpt._format.manifest import (
    FILES_VERSION,
    FORMAT_VERSION,
    INTEGRITY_VERSION,
    MAX_NDIM,
    PACKED_VERSION,
    Manifest,
    PerRankEntry,
    ValueEntry,
    per_rank_path,
)
from arrayckpt._format.quant import dequantize_rows, max_abs_error, packed_columns, quantize_rows
from arrayckpt._format.values import decode_value, encode_value
from arrayckpt._format.zarr import (
    GROUP_METADATA,
    KEY_ENCODINGS,
    check_array_metadata,
    chunk_key,
    node_documents,
    parse_chunk_key,
)
from arrayckpt._io.arrays import read_context
from arrayckpt._layout.box import Box
from arrayckpt._layout.delta import plan_delta
from arrayckpt._layout.digests import stored_chunks
from arrayckpt._layout.saveplan import plan_save
from arrayckpt._read.chain import read_plan
from arrayckpt._read.checkpoint import stored_of
from arrayckpt._storage import follow_base, parse_location
from arrayckpt._storage import object as _objstore
from arrayckpt._storage.local import LocalWriter
from arrayckpt._torch.dtypes import torch_dtype
from arrayckpt._write.changes import base_ref, find_changes, rows_jobs
from arrayckpt._write.save import Record, build_manifest, describe_local, host_view, open_delta

SPEC = (Path(__file__).resolve().parents[2] / "spec" / "FORMAT.md").read_text(encoding="utf-8")


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
    """A manifest without what differs from save to save: its provenance, its random ``id`` (checked to be
    32 lower-case hex digits wherever it is present) and the digests (checked to be digests)."""
    if "id" in manifest:
        assert re.fullmatch(r"[0-9a-f]{32}", manifest["id"]), manifest["id"]
    digests = [manifest.get("integrity", "sha256:" + "0" * 64), *manifest.get("chunk_digests", {}).values()]
    assert all(re.fullmatch(r"sha256:([0-9a-f]{64}|[0-9a-f]{4}…)", d) for d in digests), digests  # (…: the spec's)
    return {k: v for k, v in manifest.items() if k not in ("created", "id", "integrity", "chunk_digests")}


def _text_block(marker: str) -> str:
    match = re.match(r"\s*```text\n(.*?)\n```", _after(marker), re.S)
    assert match, marker
    return match.group(1)


def _files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


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
    assert plan.DEFAULT_CHUNKING.fragmentation_limit == 16 and "`FRAGMENTATION = 16`" in SPEC
    assert (plan.DEFAULT_CHUNKING.inner_chunk_bytes, plan.DEFAULT_CHUNKING.outer_chunk_bytes) == (4194304, 67108864)


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
        assert _code(torch_cell) == str(torch_dtype(dt))
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


def test_sharded_array_example(tmp_path):
    path = tmp_path / "ckpt"
    small_chunks(16, 64).save({"w": torch.arange(40, dtype=torch.float32).reshape(10, 4)}, path, codec="zstd")
    names = {"dimension_names": ["w.dim_0", "w.dim_1"]}  # written since version 3 (§7.2)
    assert json.loads((path / "w" / "zarr.json").read_text()) == _json_block("sharded-array") | names
    files = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    assert files == ["w/c.0.0", "w/c.1.0", "w/c.2.0", "w/zarr.json", "zarr.json"]


def test_shard_file_layout_example(tmp_path):
    """The 108-byte shard of section 7.4: two encoded inner chunks, then the index and its crc32c."""
    path = tmp_path / "ckpt"
    small_chunks(16, 64).save({"w": torch.arange(40, dtype=torch.float32).reshape(10, 4)}, path)
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
    assert "id" in manifest and "id" in spec_root["attributes"]["arrayckpt"] and "base" not in manifest
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
    assert "id" in root["attributes"]["arrayckpt"] and "id" not in expected  # the spec leaves it out
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
    reported = {a.path: dict.fromkeys(stored_chunks(a, planned.entries), 0) for a in planned.arrays.values()}
    manifest = build_manifest(planned, Record(), len(states), None, [({}, reported)], "P").to_dict()
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


def test_plain_values_are_stored_once_where_ranks_agree_and_per_rank_where_they_differ():
    """§5.3 item 3: one value, the lowest holding rank's, where every holder has the same; else a per-rank entry
    (``null`` for a rank that does not hold the key), so that no rank's value is lost."""
    def plan(values):
        states = [{"w": torch.ones(2)}, *({"w": torch.ones(2), "v": v} for v in values)]
        return plan_save([describe_local(s, r, False, host_view).description for r, s in enumerate(states)], None)

    same = plan(["a", "a"]).entries["v"]
    assert isinstance(same, ValueEntry) and same.value == "a"
    differ = plan(["rank1", "rank2"]).entries["v"]
    assert differ.to_dict() == {"kind": "per_rank", "keys": ["v"],
                                "ranks": [None, {"value": "rank1"}, {"value": "rank2"}]}
    assert isinstance(plan([1, 1.0]).entries["v"], PerRankEntry)  # equal as typed JSON only: 1 is not 1.0


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

    monkeypatch.setattr(durability, "_renameat2", lambda src, dst, flags: errno.ENOSYS)  # no renameat2 at all
    monkeypatch.setattr(storage.os, "rename", recording_rename)
    arrayckpt.save({"v": 2}, path, overwrite=True)
    assert arrayckpt.open(path).plain_values["v"] == 2
    created, (p_aside, aside), (temp, p), (aside_again, temp_again) = renames
    assert created == (temp.replace("-tmp-", "-tmp-new-"), temp)  # T appears locked (§9.4)
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
    assert read_context().spec["file_io_mode"] == {"mode": "memmap"}
    assert '`"file_io_mode": "memmap"`' in SPEC


def test_reading_without_arrayckpt_examples(tmp_path):
    """The zarr-python and TensorStore snippets of section 13 run as printed (path replaced)."""
    path = tmp_path / "ckpt"
    weight = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    arrayckpt.save({"model": {"weight": weight}}, path)
    section = SPEC.split("## 14. Reading without arrayckpt", 1)[1].split("\n## ", 1)[0]
    snippets = re.findall(r"```python\n(.*?)\n```", section, re.S)
    assert len(snippets) == 2
    for snippet in snippets:
        scope: dict = {}
        exec(snippet.replace("/ckpt/step-100", str(path)), scope)  # the spec's own example
        assert np.array_equal(np.asarray(scope["weight"], dtype=np.float32), weight.float().numpy())


# --- format version 2: chunk key encodings, object storage, delta checkpoints ----------------------------


def test_format_versions():
    assert (FORMAT_VERSION, FILES_VERSION, PACKED_VERSION, INTEGRITY_VERSION) == (4, 3, 4, 3)
    assert SPEC.startswith("# arrayckpt on-disk format, version 4\n")
    assert "`format_version` **4**" in SPEC and "(arrayckpt: `N = 4`)" in SPEC
    with pytest.raises(FormatError, match="lacks the 'packs' member"):  # version 4 is the packed layout only
        Manifest.from_dict({"format_version": 4, "entries": {}, "chunk_digests": {}})
    entry = {"kind": "tensor", "keys": ["t"], "path": "t", "dtype": "float32", "shape": [2]}
    for version in (1, 2):
        assert Manifest.from_dict({"format_version": version, "entries": {"t": entry}}).format_version == version
    assert Manifest.from_dict({"format_version": 3, "entries": {"t": entry}, "chunk_digests": {}}).format_version == 3
    with pytest.raises(FormatError, match="requires"):  # version 3 without its chunk digests
        Manifest.from_dict({"format_version": 3, "entries": {"t": entry}})
    for version in (0, 5, True):
        with pytest.raises(FormatError, match="format_version|not supported"):
            Manifest.from_dict({"format_version": version, "entries": {}})


def _array_document(encoding: dict, shape: list[int]) -> dict:
    document = plan.array_metadata(plan.ArrayPlan("x", "x", DTYPES["float32"], tuple(shape), (1,) * len(shape),
                                                  (1,) * len(shape), Codec()))
    return {**document, "chunk_key_encoding": encoding}


def test_chunk_key_examples():
    for encoding, separator, shape, index, key in _table("chunk-keys"):
        dims = json.loads(_code(shape))
        document = _array_document({"name": _code(encoding), "configuration": {"separator": _code(separator)}}, dims)
        check_array_metadata(document, tuple(dims), "float32", "x")
        grid_index = tuple(json.loads(_code(index)))
        assert chunk_key(document, grid_index) == _code(key), key
        assert parse_chunk_key(document, _code(key)) == grid_index, key
    # a missing separator means "/" for default and "." for v2, as in Zarr
    assert chunk_key(_array_document({"name": "default"}, [10, 4]), (2, 0)) == "c/2/0"
    assert chunk_key(_array_document({"name": "v2"}, [10, 4]), (2, 0)) == "2.0"
    for encoding in ({"name": "default", "configuration": {"separator": "-"}}, {"name": "v3"}, "default"):
        with pytest.raises(FormatError, match="chunk_key_encoding"):
            check_array_metadata(_array_document(encoding, [10, 4]), (10, 4), "float32", "x")  # type: ignore[arg-type]
    assert KEY_ENCODINGS == ("default", "v2")


def _memory_keys(url: str) -> list[str]:
    location = parse_location(url)
    return sorted(k.decode() for k in location.open_store().list().result())


def _memory_root(url: str) -> dict:
    return json.loads(parse_location(url).open_store().read("zarr.json").result().value)


def test_arrayckpt_shaped_keys():
    assert "`c(\\.[0-9]+)*|[0-9]+(\\.[0-9]+)*`" in SPEC
    keys = ["a/c", "a/c.0.1", "a/0", "a/0.1", "a/zarr.json", "zarr.json", "a/c.x", "a/notes.txt", "a/c0", "a/.0"]
    assert _objstore.arrayckpt_keys(keys) == ["a/c", "a/c.0.1", "a/0", "a/0.1", "a/zarr.json", "zarr.json"]


def test_object_storage_generations():
    url = f"memory://spec-bucket/generations-{uuid.uuid4().hex[:8]}"
    state = {"w": torch.ones(2, 3), "s": torch.tensor(1.0)}
    for number, (_, encoding, version, objects) in enumerate(_table("generations")):
        arrayckpt.save(state, url, overwrite=number > 0)
        root = _memory_root(url)
        assert root["attributes"]["arrayckpt"]["format_version"] == int(version)
        encodings = {doc["chunk_key_encoding"]["name"] for doc in root["consolidated_metadata"]["metadata"].values()}
        assert encodings == {_code(encoding)}
        assert _memory_keys(url) == re.findall(r"`([^`]*)`", objects)
        assert torch.equal(arrayckpt.open(url)["w"].torch(), state["w"])


def test_object_storage_interrupted_saves(monkeypatch):
    """The rows of the table of interrupted saves in section 9.3 that concern replacing saves."""
    url = f"memory://spec-bucket/interrupted-{uuid.uuid4().hex[:8]}"
    arrayckpt.save({"w": torch.ones(2, 3)}, url)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # the process dies here: nothing after it runs, abort included

    # a replacing save, before the commit: the old checkpoint, whole, beside the new save's chunks
    monkeypatch.setattr(_objstore.ObjectWriter, "commit", crash)
    with pytest.raises(KeyboardInterrupt):
        arrayckpt.save({"w": torch.zeros(2, 3)}, url, overwrite=True)
    monkeypatch.undo()
    assert _memory_keys(url) == ["w/0.0", "w/c.0.0", "w/zarr.json", "zarr.json"]
    assert torch.equal(arrayckpt.open(url)["w"].torch(), torch.ones(2, 3)) and arrayckpt.verify(url).ok
    # after the commit, in step 5: the new checkpoint reads through its root; its node document is the old one's
    monkeypatch.setattr(_objstore, "_write", crash)  # the deferred documents are the first written after it
    with pytest.raises(KeyboardInterrupt):
        arrayckpt.save({"w": torch.full((2, 3), 2.0)}, url, overwrite=True)
    monkeypatch.undo()
    assert _memory_keys(url) == ["w/0.0", "w/c.0.0", "w/zarr.json", "zarr.json"]
    assert torch.equal(arrayckpt.open(url)["w"].torch(), torch.full((2, 3), 2.0))
    stale = json.loads(parse_location(url).open_store().read("w/zarr.json").result().value)
    assert stale["chunk_key_encoding"]["name"] == "default"  # describes the replaced checkpoint's chunks
    report = arrayckpt.verify(url)
    assert not report.ok and [d.file for d in report.damage] == ["w/zarr.json"]
    # the next replacing save removes what is left
    arrayckpt.save({"w": torch.full((2, 3), 3.0)}, url, overwrite=True)
    assert _memory_keys(url) == ["w/c.0.0", "w/zarr.json", "zarr.json"] and arrayckpt.verify(url).ok


def test_base_path_examples():
    """Section 10.1's table: what writers write, where it resolves, and whether readers follow it by default (the
    writer warns when they will not) or inside the root the table names."""
    for delta_cell, base_cell, path_cell, followed_cell in _table("base-paths"):
        delta, base = parse_location(_code(delta_cell)), parse_location(_code(base_cell))
        checkpoint = SimpleNamespace(location=base, manifest=SimpleNamespace(id="0" * 32, step=100))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ref = base_ref(checkpoint, delta)  # type: ignore[arg-type]
        assert (ref.path, ref.id, ref.step) == (_code(path_cell), "0" * 32, 100), delta_cell
        assert str(delta.resolve(ref.path)) == str(base), delta_cell
        followed = followed_cell == "yes"
        assert bool(caught) is not followed, delta_cell
        if followed:
            assert str(follow_base(delta, ref.path)) == str(base)
        else:
            with pytest.raises(arrayckpt.BaseNotAllowedError, match=re.escape(repr(ref.path))):
                follow_base(delta, ref.path)
            root = parse_location(re.search(r"root `([^`]+)`", followed_cell).group(1))
            assert str(follow_base(delta, ref.path, [root])) == str(base), delta_cell


def test_base_references_readers_refuse():
    """Section 10.1's second table: malformed references are format errors, the rest are not followed."""
    for path_cell, why_cell in _table("base-refusals"):
        reference = _code(path_cell)
        delta = parse_location("s3://bucket/step-2" if "bucket" in why_cell else "/ckpt/run/step-2")
        kind = FormatError if why_cell.startswith("format") else arrayckpt.BaseNotAllowedError
        with pytest.raises(kind, match=re.escape(repr(reference)[:30])):
            Manifest.from_dict({"format_version": 2, "entries": {}, "base": {"path": reference, "id": "0" * 32}})
            follow_base(delta, reference)


@pytest.mark.parametrize(("delta", "base", "error"), [
    ({"mode": "blocks"}, True, "mode 'chunks' or 'rows'"),
    ({"mode": "chunks", "present": [0, -1]}, True, "present"),
    ({"mode": "chunks"}, True, "present"),
    ({"mode": "rows", "rows": 1.5}, True, "row count"),
    ({"mode": "rows", "rows": 1, "quantized": {"bits": 2, "max_abs_error": 0.0}}, True, "quantized"),
    ({"mode": "rows", "rows": 1, "quantized": {"bits": 8}}, True, "quantized"),
    ({"mode": "chunks", "present": []}, False, "no 'base'"),
    ({"mode": "rows", "rows": 0}, True, "at least 1 dimension"),  # on the 0-d entry below
])
def test_invalid_delta_members_are_format_errors(delta, base, error):
    """The refusals listed in section 10.2."""
    shape = [] if "dimension" in error else [4, 2]
    manifest: dict = {"format_version": 2, "entries": {
        "t": {"kind": "tensor", "keys": ["t"], "path": "t", "dtype": "float32", "shape": shape, "delta": delta}}}
    if base:
        manifest["base"] = {"path": "../b", "id": "0" * 32, "step": None}
    with pytest.raises(FormatError, match=re.escape(error)):
        Manifest.from_dict(manifest)
    manifest["base"] = {"path": "../b", "id": "0" * 32, "step": 100}
    manifest["entries"]["t"] = {**manifest["entries"]["t"], "shape": [4, 2],
                                "delta": {"mode": "rows", "rows": 1, "quantized": {"bits": 4, "max_abs_error": 0.5}}}
    parsed = Manifest.from_dict(manifest)  # and the valid form parses
    assert parsed.base is not None and parsed.base.step == 100


def _unpacked(codes: np.ndarray, bits: int, columns: int) -> np.ndarray:
    """Section 10.5's code layout, written out independently of the implementation."""
    if bits == 8:
        return codes[:columns]
    out = np.empty(2 * len(codes), np.uint8)
    out[0::2], out[1::2] = codes & 0x0F, codes >> 4
    return out[:columns]


def test_quantization_examples():
    for bits_cell, row, codes, scale, offset, decoded in _table("quantization"):
        bits, values = int(bits_cell), np.array([json.loads(_code(row))], np.float32)
        q = quantize_rows(values, bits)
        assert q.codes[0].tolist() == json.loads(_code(codes)), row
        assert q.scale[0] == np.float32(json.loads(_code(scale))), row
        assert q.offset[0] == np.float32(json.loads(_code(offset))), row
        limit = float(np.finfo(np.float32).max)
        codes64 = _unpacked(np.asarray(json.loads(_code(codes)), np.uint8), bits, values.shape[1]).astype(np.float64)
        spec_decoded = np.clip(codes64 * np.float64(q.scale[0]) + np.float64(q.offset[0]), -limit, limit)
        expected = np.asarray(json.loads(_code(decoded)), np.float32).tolist()
        assert spec_decoded.astype(np.float32).tolist() == expected == dequantize_rows(q, np.float32)[0].tolist(), row
    assert "bytes `0x50` (5 high, 0 low) and `0xFA`" in SPEC and "`0x30`, `0xA7` and\n`0x0F`" in SPEC
    odd = np.array([[0.0, 1.0, 2.0, 3.0, 4.5]], np.float32)
    assert _unpacked(quantize_rows(odd, 4).codes[0], 4, 5).tolist() == [0, 3, 7, 10, 15]
    assert abs(max_abs_error(odd, quantize_rows(odd, 4)) - 0.1015) < 1e-6 and "about `0.1015` (column 2" in SPEC
    assert packed_columns(5, 4) == 3 and packed_columns(5, 8) == 5


DELTA_EXAMPLE_CHUNKS = small_chunks(32, 64)


def _delta_example(tmp_path: Path) -> tuple[Path, Path, torch.Tensor, torch.Tensor]:
    base, delta = tmp_path / "step-100", tmp_path / "step-200"
    emb, w, b = torch.arange(32.0).reshape(8, 4), torch.arange(32.0).reshape(8, 4), torch.zeros(3)
    DELTA_EXAMPLE_CHUNKS.save({"emb": emb, "w": w, "b": b, "lr": 0.1}, base, step=100)
    emb[5] = -1.0
    w[0:2] = 7.0
    w[6, 1] = 0.5
    DELTA_EXAMPLE_CHUNKS.save({"emb": emb, "w": w, "b": b, "lr": 0.05}, delta, step=200, base=base)
    return base, delta, emb, w


def test_delta_example(tmp_path):
    base, delta, emb, w = _delta_example(tmp_path)
    base_root, root = (json.loads((p / "zarr.json").read_text()) for p in (base, delta))
    manifest, expected = root["attributes"]["arrayckpt"], _json_block("delta-example")
    assert manifest["base"]["id"] == base_root["attributes"]["arrayckpt"]["id"] != manifest["id"]
    expected["base"]["id"] = manifest["base"]["id"]  # the example's ids are made up
    assert _without_created(manifest) == _without_created(expected)
    assert list(manifest["entries"]) == list(expected["entries"])
    assert base_root["attributes"]["arrayckpt"]["format_version"] == 3
    base_w = base_root["consolidated_metadata"]["metadata"]["w"]  # the text's description of the base
    assert base_w["chunk_grid"]["configuration"]["chunk_shape"] == [4, 4]
    assert base_w["codecs"][0]["configuration"]["chunk_shape"] == [2, 4]
    nodes = root["consolidated_metadata"]["metadata"]
    names = {"dimension_names": ["w.dim_0", "w.dim_1"]}  # written since version 3 (§7.2)
    assert nodes["w"] == _json_block("delta-array") | names and nodes["emb"] == GROUP_METADATA
    for name, data_type, shape in (("rows", "int64", [1]), ("values", "float32", [1, 4])):
        document = nodes[f"emb/{name}"]
        assert (document["data_type"], document["shape"], document["chunk_grid"]["configuration"]["chunk_shape"],
                document["attributes"]) == (data_type, shape, shape, {"arrayckpt": {"key": "emb"}})
    listing = [line.split()[0].removeprefix("P/") for line in _text_block("delta-files").splitlines()]
    assert sorted(listing) == _files(delta)
    assert np.frombuffer((delta / "emb" / "rows" / "c.0").read_bytes()[:8], "<i8").tolist() == [5]
    opened = arrayckpt.open(delta)
    assert torch.equal(opened["emb"].torch(), emb) and torch.equal(opened["w"].torch(), w)
    # w[1:7]: row 1 from the delta's chunk 0, rows 2-5 from the base (chunks 1 and 2, in one read), row 6 from chunk 3
    out = np.empty((6, 4), np.float32)
    stored = stored_of(opened)
    jobs, overlays = read_plan(stored, "w", Box((1, 0), (6, 4)), out)
    own, of_base = stored.node_kvstore("")["path"], stored.base.node_kvstore("")["path"]
    sources = [(job.index[0].start, job.index[0].stop, "delta" if job.spec["kvstore"]["path"].startswith(own)
                else "base" if job.spec["kvstore"]["path"].startswith(of_base) else "?") for job in jobs]
    assert sources == [(1, 2, "delta"), (2, 6, "base"), (6, 7, "delta")] and not overlays
    assert np.array_equal(opened["w"][1:7], w[1:7].numpy())


def test_delta_base_identity_is_checked(tmp_path):
    base, delta, _, _ = _delta_example(tmp_path)
    opened = arrayckpt.open(delta)
    assert opened.plain_values["lr"] == 0.05 and [c.location.path for c in opened.chain()] == [delta, base]
    DELTA_EXAMPLE_CHUNKS.save({"emb": torch.zeros(8, 4), "w": torch.zeros(8, 4), "b": torch.zeros(3)}, base,
                              overwrite=True)
    replaced = arrayckpt.open(delta)
    assert replaced.plain_values["lr"] == 0.05  # the delta's own values need no base
    with pytest.raises(arrayckpt.CorruptCheckpointError, match="base was replaced"):
        replaced["w"].torch()
    shutil.rmtree(base)
    with pytest.raises(arrayckpt.CheckpointNotFoundError, match="base checkpoint"):
        arrayckpt.open(delta)["emb"].torch()


def test_row_layout_example(tmp_path):
    """Section 10.4's two-rank example, planned as the coordinator plans it (no processes needed)."""
    assert "`[1, 3, -1, 6, 7, 9]` in two chunks, one per rank, and `N = 6`" in SPEC
    base = tmp_path / "base"
    old = torch.zeros(10, 4)
    arrayckpt.save({"t": old}, base)
    new = old.clone()
    new[[1, 3, 6, 7, 9]] = 1.0
    request = open_delta(str(base), parse_location(tmp_path / "delta"), None, None, None)
    assert request is not None
    locals_ = [describe_local({"t": arrayckpt.Shard(new[o:o + 5].clone(), (10, 4), (o, 0))}, rank, False, host_view)
               for rank, o in enumerate((0, 5))]
    found = [find_changes(local.description.arrays, local.data, request) for local in locals_]
    descriptions = [local.description for local in locals_]
    planned = plan_delta(plan_save(descriptions, None), descriptions, [f[0] for f in found], request)
    assert planned.entries["t"].delta.to_dict() == {"mode": "rows", "rows": 5}  # type: ignore[union-attr]
    rows_array = planned.arrays["t/rows"]
    assert (rows_array.shape, rows_array.outer_chunk, rows_array.inner_chunk) == ((6,), (3,), (3,))
    assert planned.arrays["t/values"].shape == (6, 4) and planned.arrays["t/values"].outer_chunk == (3, 4)
    index = np.full(6, -2, np.int64)
    for rank, (local, (_, rows)) in enumerate(zip(locals_, found, strict=True)):
        (task,) = planned.tasks[rank]
        held, data = local.data["t"]
        jobs, _ = rows_jobs(task, planned, data, held, rows["t"], None, lambda path: {"driver": "memory"})
        index[task.offset:task.offset + task.length] = jobs[0].data
    assert index.tolist() == [1, 3, -1, 6, 7, 9]


def test_dcp_marker_is_the_bytes_the_spec_gives() -> None:
    """§2.1: the marker's text as the spec gives it, and its bytes as the spec lays them out, are what writers write."""
    import struct

    from arrayckpt._format.marker import MARKER, MESSAGE

    text = re.match(r"`M` = `([^`]*)`", _after("dcp-marker"), re.S)
    assert text is not None
    message = " ".join(text.group(1).split())
    assert message == MESSAGE and f"{len(message.encode())} bytes" in _after("dcp-marker")
    laid_out = (b"\x80\x02\x63operator\x0agetitem\x0a\x7d\x58" + struct.pack("<I", len(message.encode()))
                + message.encode() + b"\x86\x52\x2e")
    assert laid_out == MARKER
