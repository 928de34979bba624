"""The packed layout's format (issue 35, ``_format/packs.py``): pack names, the chunk table and its index file, the
manifest member, kerchunk references. The index and the member are untrusted input (spec §12): every crafted
section and member below is refused with one line naming the checkpoint, the array and the chunk. The last test
packs a real checkpoint's chunk files into two pack files and reads every array back with zarr-python."""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch
from policies import SHARDED

import arrayckpt
from arrayckpt._errors import CorruptCheckpointError, FormatError
from arrayckpt._format.packs import (
    INDEX_NAME,
    ROW_SIZE,
    ChunkTable,
    PackFile,
    Section,
    SectionBytes,
    StoredChunks,
    check_index,
    decode_section,
    decode_sections,
    encode_index,
    index_name,
    is_pack_key,
    new_tag,
    pack_name,
    packs_member,
    parse_packs_member,
    reference_document,
    row_of,
    stored_chunk_keys,
)
from arrayckpt._format.paths import is_node_path
from arrayckpt._format.stored import max_chunk_file_bytes

WHERE = "/ck"
PACKS = [PackFile(pack_name(0), 1000, 0), PackFile(pack_name(1), 500, 1)]


def _rows(*rows: tuple[int, int, int]) -> np.ndarray:
    return np.array(rows, np.uint64).reshape(-1, 3)


def _section(rows: np.ndarray) -> bytes:
    """A section as a writer would make it, so that what follows its checksum is what is tested."""
    body = rows.astype("<u8").tobytes()
    return body + struct.pack("<I", crc32c.crc32c(body))


def _decode(data: bytes, n: int, max_length: int = 10_000, **options: object) -> np.ndarray:
    return decode_section(data, "model/w", n, PACKS, WHERE, max_length, **options)  # type: ignore[arg-type]


# pack names and rows


def test_pack_names_of_a_save_sort_by_rank_and_carry_its_tag():
    names = [pack_name(r, "1f0c9a2e") for r in (0, 2, 10, 999_999)]
    assert names == sorted(names) and all(n.startswith("packs/1f0c9a2e-r") for n in names)
    assert pack_name(3) == "packs/r000003.pack" and index_name("ab") == "packs/ab-index.bin"
    assert len({new_tag() for _ in range(100)}) == 100 and all(is_pack_key(pack_name(0, new_tag())) for _ in range(3))


@pytest.mark.parametrize("rank, tag", [(-1, ""), (10**6, ""), (True, ""), (1.0, ""), ("1", ""), (0, "XY"), (0, "../a"),
                                       (0, "a" * 17)])
def test_pack_name_refuses_what_does_not_fit(rank, tag):
    with pytest.raises(ValueError, match="must be"):
        pack_name(rank, tag)


def test_row_of_maps_a_flat_chunk_index_to_its_row():
    assert [row_of(range(5), f) for f in (0, 4, 5, -1)] == [0, 4, None, None]
    present = (2, 3, 7, 11)
    assert [row_of(present, f) for f in (2, 7, 11, 0, 5, 12)] == [0, 2, 3, None, None, None]
    assert row_of((), 0) is None and row_of(range(0), 0) is None


def test_stored_chunks_name_rows_by_grid_index():
    assert StoredChunks((2, 3)).describe(4) == "chunk (1, 1) (row 4)"
    assert StoredChunks((2, 3), (1, 5)).describe(1) == "chunk (1, 2) (row 1)"
    assert StoredChunks((2, 3)).describe(6) == "row 6"
    assert StoredChunks(()).describe(0) == "chunk () (row 0)"


def test_stored_chunk_keys_follow_the_key_encoding_and_present():
    meta = {"shape": [5, 4], "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 4]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}}}
    assert stored_chunk_keys(meta) == ["c.0.0", "c.1.0", "c.2.0"]
    assert stored_chunk_keys(meta, (2,)) == ["c.2.0"]
    v2 = {**meta, "chunk_key_encoding": {"name": "v2", "configuration": {"separator": "."}}}
    assert stored_chunk_keys(v2) == ["0.0", "1.0", "2.0"]
    scalar = {**meta, "shape": [], "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": []}}}
    assert stored_chunk_keys(scalar) == ["c"]


def test_chunk_table_holds_read_only_uint64_rows():
    table = ChunkTable({"w": _rows((0, 0, 8))})
    assert not table.rows["w"].flags.writeable
    with pytest.raises(TypeError):
        table.rows["x"] = _rows()  # type: ignore[index]
    for bad in (np.zeros((2, 3), np.int64), np.zeros((2, 2), np.uint64), np.zeros(3, np.uint64), [[0, 0, 8]]):
        with pytest.raises(ValueError, match="rows must be an \\(n, 3\\) uint64 array"):
            ChunkTable({"w": bad})  # type: ignore[dict-item]


# the index file


def test_index_round_trip_reads_each_section_alone():
    table = ChunkTable({"a": _rows((0, 0, 100), (1, 0, 50), (0, 100, 4)), "b/c": _rows(), "d": _rows((1, 50, 450))})
    data, sections = encode_index(PACKS, table)
    assert list(sections) == ["a", "b/c", "d"]
    assert sections["a"] == Section(0, 3 * ROW_SIZE + 4, crc32c.crc32c(data[:3 * ROW_SIZE]))
    assert sum(s.length for s in sections.values()) == len(data) == 4 * ROW_SIZE + 12
    for path, (offset, length, crc) in sections.items():
        rows = decode_section(data[offset:offset + length], path, len(table.rows[path]), PACKS, WHERE, 1000, crc=crc)
        assert rows.dtype == np.uint64 and np.array_equal(rows, table.rows[path])
    check_index(PACKS, table, WHERE)


def test_encode_index_refuses_a_table_no_writer_makes():
    with pytest.raises(ValueError, match="names pack 2, but the checkpoint has 2 pack files.*a bug in arrayckpt"):
        encode_index(PACKS, ChunkTable({"w": _rows((2, 0, 8))}))
    with pytest.raises(ValueError, match="overlaps"):
        encode_index(PACKS, ChunkTable({"a": _rows((0, 0, 8)), "b": _rows((0, 4, 8))}))


BAD_SECTIONS = [
    # rows, what the error says (the section is otherwise well formed: a valid crc32c)
    (_rows((2, 0, 8)), r"row 0 names pack 2, but the checkpoint has 2 pack files"),
    (_rows((0, 0, 8), (0, 992, 9)), r"row 1 lies at bytes \[992, 1001\) of packs/r000000.pack, which has 1000"),
    (_rows((1, 0, 501)), r"row 0 lies at bytes \[0, 501\) of packs/r000001.pack, which has 500 bytes"),
    (_rows((1, 2**64 - 1, 8)), r"row 0 lies at bytes \[18446744073709551615, "),  # no wrap-around past 2**64
    (_rows((1, 8, 2**64 - 4)), r"row 0 is 18446744073709551612 bytes long, more than any chunk file"),
    (_rows((0, 0, 3)), r"row 0 is 3 bytes long, shorter than a chunk file's crc32c"),
    (_rows((0, 0, 600)), r"row 0 is 600 bytes long, more than any chunk file of this array holds \(550 bytes\)"),
    (_rows((0, 0, 8), (1, 0, 8), (0, 4, 8)), r"row 2 at bytes \[4, 12\) of packs/r000000.pack overlaps row 0 "
                                             r"at \[0, 8\)"),
    (_rows((0, 100, 8), (0, 0, 200)), r"row 0 at bytes \[100, 108\) .* overlaps row 1 at \[0, 200\)"),
]


@pytest.mark.parametrize("rows, match", BAD_SECTIONS)
def test_decode_section_refuses_a_crafted_section(rows, match):
    with pytest.raises(CorruptCheckpointError, match=f"^/ck: the pack index section of array 'model/w' is wrong: "
                                                     f"{match}.*restore the checkpoint from a copy$"):
        _decode(_section(rows), len(rows), max_length=550)


def test_decode_section_refuses_another_row_count_and_damage():
    data = _section(_rows((0, 0, 8), (0, 8, 8)))
    with pytest.raises(CorruptCheckpointError, match=r"'model/w' has 52 bytes, 76 expected \(3 stored chunks of 24 "):
        _decode(data, 3)
    with pytest.raises(CorruptCheckpointError, match="has 0 bytes, 28 expected"):
        _decode(b"", 1)
    damaged = bytearray(data)
    damaged[9] ^= 1
    with pytest.raises(CorruptCheckpointError, match=r"'model/w' fails its checksum \(crc32c 0x"):
        _decode(bytes(damaged), 2)
    foreign = _section(_rows((0, 16, 8), (0, 24, 8)))  # valid in itself, but not the section the manifest records
    with pytest.raises(CorruptCheckpointError, match=r"has the crc32c 0x[0-9a-f]{8}, the manifest records 0x"):
        _decode(foreign, 2, crc=struct.unpack("<I", data[-4:])[0])


def _bytes(path: str, rows: np.ndarray, max_length: int = 550, **options: object) -> SectionBytes:
    return SectionBytes(path, _section(rows), len(rows), max_length, **options)  # type: ignore[arg-type]


def test_decode_sections_reads_each_section_as_decode_section_does():
    # 'a' and 'c' share bytes: a load checks each section alone; only verify's check_index looks across them
    good = [_bytes("a", _rows((0, 0, 8), (1, 0, 8))), _bytes("b", _rows()), _bytes("c", _rows((0, 4, 8)))]
    decoded = decode_sections(good, PACKS, WHERE)
    alone = [decode_section(s.data, s.path, s.n_stored, PACKS, WHERE, s.max_length) for s in good]
    assert [r.tolist() for r in decoded] == [r.tolist() for r in alone] and all(r.dtype == np.uint64 for r in decoded)
    assert decode_sections([], PACKS, WHERE) == []


@pytest.mark.parametrize("rows, match", BAD_SECTIONS)
def test_decode_sections_refuses_a_crafted_section_as_decode_section_does(rows, match):
    sections = [_bytes("model/v", _rows((0, 0, 8), (0, 8, 8))), _bytes("model/w", rows)]
    with pytest.raises(CorruptCheckpointError, match=f"^/ck: the pack index section of array 'model/w' is wrong: "
                                                     f"{match}.*restore the checkpoint from a copy$"):
        decode_sections(sections, PACKS, WHERE)


def test_decode_sections_names_the_first_bad_section():
    damaged = bytearray(_section(_rows((0, 0, 8))))
    damaged[3] ^= 1
    bad_rows, bad_crc = _bytes("a", _rows((0, 0, 3))), SectionBytes("b", bytes(damaged), 1, 550)
    with pytest.raises(CorruptCheckpointError, match="array 'a' is wrong: row 0 is 3 bytes long"):
        decode_sections([bad_rows, bad_crc], PACKS, WHERE)
    with pytest.raises(CorruptCheckpointError, match="array 'b' fails its checksum"):
        decode_sections([bad_crc, bad_rows], PACKS, WHERE)
    other = _bytes("c", _rows((0, 16, 8)))
    foreign = other._replace(crc=struct.unpack("<I", other.data[-4:])[0] ^ 1)  # the manifest records another
    with pytest.raises(CorruptCheckpointError, match=r"array 'c' has the crc32c 0x[0-9a-f]{8}, the manifest records"):
        decode_sections([_bytes("a", _rows((0, 0, 8))), foreign], PACKS, WHERE)
    with pytest.raises(CorruptCheckpointError, match=r"array 'c' has 28 bytes, 52 expected"):
        decode_sections([other._replace(n_stored=2)], PACKS, WHERE)
    with pytest.raises(CorruptCheckpointError, match=r"chunk \(3, 1\) \(row 0\) names pack 5"):
        decode_sections([_bytes("d", _rows((5, 0, 8)), stored=StoredChunks((4, 2), (7,)))], PACKS, WHERE)


def test_decode_section_names_the_chunk_by_grid_index():
    rows = _rows((0, 0, 8), (0, 8, 8), (5, 0, 8))
    with pytest.raises(CorruptCheckpointError, match=r"chunk \(3, 1\) \(row 2\) names pack 5"):
        _decode(_section(rows), 3, stored=StoredChunks((4, 2), (0, 1, 7)))
    with pytest.raises(CorruptCheckpointError, match=r"chunk \(1, 0\) \(row 2\) names pack 5"):
        _decode(_section(rows), 3, stored=StoredChunks((3, 2)))


def test_check_index_finds_chunks_of_two_arrays_that_share_bytes():
    table = ChunkTable({"a": _rows((0, 0, 8), (0, 100, 8)), "b": _rows((1, 0, 8), (0, 104, 20))})
    with pytest.raises(CorruptCheckpointError, match=r"^/ck: the pack index is wrong: array 'b', chunk \(1,\) \(row 1\)"
                                                     r" at bytes \[104, 124\) of packs/r000000.pack overlaps array "
                                                     r"'a', row 1 at \[100, 108\); .*from a copy$"):
        check_index(PACKS, table, WHERE, {"b": StoredChunks((2,))})
    check_index(PACKS, ChunkTable({"a": _rows((0, 0, 8)), "b": _rows((0, 8, 8))}), WHERE)
    check_index([], ChunkTable({"a": _rows()}), WHERE)
    with pytest.raises(CorruptCheckpointError, match="array 'a', row 0 names pack 0, but the checkpoint has 0 pack"):
        check_index([], ChunkTable({"a": _rows((0, 0, 8))}), WHERE)


def test_check_index_sorts_a_large_table():
    n = 200_000
    rows = np.stack([np.arange(n) % 2, (np.arange(n) // 2) * 64, np.full(n, 64)], axis=1).astype(np.uint64)
    packs = [PackFile(pack_name(r), n * 32, r) for r in (0, 1)]
    check_index(packs, ChunkTable({"a": rows[::2], "b": rows[1::2]}), WHERE)
    rows[-1, 1] -= 1
    with pytest.raises(CorruptCheckpointError, match=r"array 'b', row 99999 at bytes \[6399935, 6399999\) of "
                                                     r"packs/r000001.pack overlaps array 'b', row 99998"):
        check_index(packs, ChunkTable({"a": rows[::2], "b": rows[1::2]}), WHERE)


# the manifest member


def _member(**change: object) -> dict:
    data, sections = encode_index(PACKS, ChunkTable({"a": _rows((0, 0, 8)), "b/c": _rows((1, 0, 8), (1, 8, 8))}))
    member = json.loads(json.dumps(packs_member(PACKS, INDEX_NAME, len(data), crc32c.crc32c(data), sections)))
    member.update(change)
    return member


def test_packs_member_round_trip():
    member = _member()
    layout = parse_packs_member(member, WHERE, arrays=["a", "b/c"])
    assert layout.packs == tuple(PACKS) and layout.index_name == INDEX_NAME and layout.index_size == 3 * 24 + 8
    assert layout.sections == {"a": Section(0, 28, member["sections"]["a"][2]),
                               "b/c": Section(28, 52, member["sections"]["b/c"][2])}
    assert parse_packs_member(_member(files=[], sections={}, index={**member["index"], "size": 0}), WHERE).packs == ()


NAMES = ["../packs/x.pack", "packs/../x.pack", "/packs/x.pack", "x.pack", "packs/", "packs/a/b.pack", "packs/.x",
         "packs/..", "packs/a\\b", "packs/a\x00", "packs/" + "a" * 256, "Packs/x.pack", 7, None]


@pytest.mark.parametrize("name", NAMES)
def test_parse_packs_member_refuses_a_pack_name_outside_packs(name):
    with pytest.raises(FormatError, match=r"^/ck: manifest member 'packs' lists the pack file .* not \[name, size, "
                                          r"rank\] with a name 'packs/<file name>'.*damaged or crafted$"):
        parse_packs_member(_member(files=[[name, 10, 0]]), WHERE)


@pytest.mark.parametrize("item", [["packs/a", -1, 0], ["packs/a", 2**63, 0], ["packs/a", True, 0], ["packs/a", 1.0, 0],
                                  ["packs/a", 1, 10**6], ["packs/a", 1, -1], ["packs/a", 1], ["packs/a", 1, 0, 0],
                                  {"name": "packs/a", "size": 1, "rank": 0}])
def test_parse_packs_member_refuses_bad_sizes_and_ranks(item):
    with pytest.raises(FormatError, match="lists the pack file"):
        parse_packs_member(_member(files=[item]), WHERE)


BAD_MEMBERS = [
    (lambda m: [], r"must be an object of 'files', 'index' and 'sections', got \[\]"),
    (lambda m: {**m, "extra": 1}, "must be an object of 'files', 'index' and 'sections'"),
    (lambda m: {**m, "files": {}}, "'files' must be a list"),
    (lambda m: {**m, "files": m["files"] * 2}, "lists the pack file 'packs/r000000.pack' twice"),
    (lambda m: {**m, "index": {**m["index"], "name": "packs/r000001.pack"}}, "'index' must be"),
    (lambda m: {**m, "index": {**m["index"], "name": "../index.bin"}}, "'index' must be"),
    (lambda m: {**m, "index": {**m["index"], "crc32c": 2**32}}, "'index' must be"),
    (lambda m: {**m, "index": {**m["index"], "size": -1}}, "'index' must be"),
    (lambda m: {**m, "index": [INDEX_NAME, 1, 2]}, "'index' must be"),
    (lambda m: {**m, "sections": []}, "'sections' must map array paths"),
    (lambda m: {**m, "sections": {"../x": [0, 28, 0]}}, r"section of '../x', which is not an array path"),
    (lambda m: {**m, "sections": {"/a": [0, 28, 0]}}, r"section of '/a', which is not an array path"),
    (lambda m: {**m, "sections": {"": [0, 28, 0]}}, r"section of '', which is not an array path"),
    (lambda m: {**m, "sections": {**m["sections"], "a": [0, 27, 0]}}, r"gives array 'a' the section \[0, 27, 0\]"),
    (lambda m: {**m, "sections": {**m["sections"], "a": [0, 28, 2**32]}}, "gives array 'a' the section"),
    (lambda m: {**m, "sections": {**m["sections"], "a": [0, 28]}}, "gives array 'a' the section"),
    (lambda m: {**m, "sections": {**m["sections"], "a": [4, 28, 0]}}, r"array 'a' the section at byte 4 of the index "
                                                                      r"file, where the sections before it end at "
                                                                      r"byte 0"),
    (lambda m: {**m, "sections": {**m["sections"], "b/c": [20, 52, 0]}},
     "'b/c' the section at byte 20 .* end at byte 28"),
    (lambda m: {**m, "index": {**m["index"], "size": 81}},
     "sections that end at byte 80 of the index file, which has 81"),
]


@pytest.mark.parametrize("change, match", BAD_MEMBERS)
def test_parse_packs_member_refuses_a_crafted_member(change, match):
    with pytest.raises(FormatError, match=f"^/ck: manifest member 'packs' .*{match}.*damaged or crafted$"):
        parse_packs_member(change(_member()), WHERE)


def _node_path_by_segments(path: object) -> bool:
    """Spec §3.2's node-path grammar segment by segment, as ``is_node_path`` was written before it matched whole
    paths at once (the reference it must agree with)."""
    segment, rank = re.compile(r"%|(?:[A-Za-z0-9_-]|%[0-9A-F]{2})+"), re.compile(r"%r(?:0|[1-9][0-9]*)")
    if not isinstance(path, str) or not path:
        return False
    *parents, last = path.split("/")
    ok = [bool(segment.fullmatch(s)) and not s.startswith("__") for s in (*parents, last)]
    return all(ok[:-1]) and (ok[-1] or bool(rank.fullmatch(last)))


def test_node_paths_of_sections_follow_the_grammar_segment_by_segment():
    pieces = ["a", "Z9", "_", "-", "%", "/", "r", "%2F", "%2f", "%r", "%r0", "%r10", "%r01", "__", ".", "..", " ", "\n",
              "\x00", "é", "\\"]
    rng = random.Random(7)
    samples = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 7))) for _ in range(20_000)]
    samples += [None, 3, "a/__b", "__a", "a/_b", "%r1/a", "a/%r1", "a//b", "/a", "a/", "a\n", "model/layers/0/w"]
    assert [is_node_path(p) for p in samples] == [_node_path_by_segments(p) for p in samples]
    assert sum(map(is_node_path, samples)) > 1000


def test_parse_packs_member_wants_a_section_for_exactly_the_stored_arrays():
    with pytest.raises(FormatError, match="has no section for array 'z', which the manifest stores chunks of"):
        parse_packs_member(_member(), WHERE, arrays=["a", "b/c", "z"])
    with pytest.raises(FormatError, match="has a section for array 'b/c', which the manifest does not store"):
        parse_packs_member(_member(), WHERE, arrays=["a"])


# kerchunk references


def test_reference_document_inlines_documents_and_points_chunks_into_packs():
    table = ChunkTable({"w": _rows((1, 8, 12), (0, 0, 20))})
    refs = reference_document({"w": b'{"a": "\xc3\xa9"}'}, {"w": ["c.0", "c.1"]}, table, PACKS)
    root = ('{"zarr_format": 3, "node_type": "group", "attributes": {}, "consolidated_metadata": {"kind": "inline", '
            '"must_understand": false, "metadata": {"w": {"a": "é"}}}}')
    assert refs == {"version": 1, "refs": {"zarr.json": root, "w/zarr.json": '{"a": "é"}',
                                           "w/c.0": ["packs/r000001.pack", 8, 12],
                                           "w/c.1": ["packs/r000000.pack", 0, 20]}}
    assert json.loads(json.dumps(refs)) == refs and json.loads(root)["consolidated_metadata"]["metadata"]
    with pytest.raises(ValueError, match="'w/zarr.json' is not a node path"):
        reference_document({"w/zarr.json": b"{}"}, {"w": ["c.0", "c.1"]}, table, PACKS)
    with pytest.raises(ValueError, match="has 1 chunk keys and 2 rows"):
        reference_document({}, {"w": ["c.0"]}, table, PACKS)
    with pytest.raises(ValueError, match=r"the chunk keys name arrays \['v'\], the chunk table \['w'\]"):
        reference_document({}, {"v": ["c.0", "c.1"]}, table, PACKS)


def test_zarr_python_reads_a_packed_checkpoint_through_its_references(tmp_path: Path):
    """A real checkpoint (one sharded array with an edge chunk, one plain) packed into two pack files, round robin
    with 4 KiB alignment as the prototype did; zarr-python reads every array through the references alone."""
    zarr = pytest.importorskip("zarr")
    source, ck = tmp_path / "source", tmp_path / "ck"
    state = {"model": {"w": torch.randn(37, 3, generator=torch.Generator().manual_seed(0))},
             "steps": torch.tensor([3, 1, 4], dtype=torch.int32)}
    SHARDED.save(state, source)
    root = json.loads((source / "zarr.json").read_text())
    nodes = root["consolidated_metadata"]["metadata"]
    arrays = {path: meta for path, meta in nodes.items() if meta["node_type"] == "array"}
    assert arrays["model/w"]["codecs"][0]["name"] == "sharding_indexed" and arrays["steps"]["codecs"][1] == {
        "name": "crc32c"}

    packs_data = [bytearray(), bytearray()]
    rows, keys, turn = {}, {}, 0
    for path, meta in arrays.items():
        keys[path] = stored_chunk_keys(meta)
        rows[path] = np.zeros((len(keys[path]), 3), np.uint64)
        for row, key in enumerate(keys[path]):
            data = (source / path / key).read_bytes()
            pack = packs_data[turn % 2]
            pack.extend(b"\0" * (-len(pack) % 4096))
            rows[path][row] = (turn % 2, len(pack), len(data))
            pack.extend(data)
            turn += 1
    assert turn > 3
    packs = [PackFile(pack_name(rank), len(data), rank) for rank, data in enumerate(packs_data)]
    (ck / "packs").mkdir(parents=True)
    for pack, data in zip(packs, packs_data, strict=True):
        (ck / pack.name).write_bytes(data)
    table = ChunkTable(rows)
    check_index(packs, table, str(ck))

    index, sections = encode_index(packs, table)
    (ck / INDEX_NAME).write_bytes(index)
    member = packs_member(packs, INDEX_NAME, len(index), crc32c.crc32c(index), sections)
    layout = parse_packs_member(json.loads(json.dumps(member)), str(ck), arrays=list(arrays))
    stored = (ck / layout.index_name).read_bytes()
    for path, meta in arrays.items():
        offset, length, crc = layout.sections[path]
        found = decode_section(stored[offset:offset + length], path, len(keys[path]), layout.packs, str(ck),
                               max_chunk_file_bytes(meta), crc=crc)
        assert np.array_equal(found, rows[path])

    documents = {str(p.parent.relative_to(source)): p.read_bytes() for p in source.rglob("*/zarr.json")}
    assert set(documents) == {"model", "model/w", "steps"}
    (ck / "refs.json").write_text(json.dumps(reference_document(documents, keys, table, packs)))
    group = zarr.open_group("reference://", mode="r", zarr_format=3, storage_options={
        "fo": f"{ck}/refs.json", "remote_protocol": "dir", "remote_options": {
            "path": str(ck), "asynchronous": True, "target_protocol": "async_wrapper",
            "target_options": {"target_protocol": "file", "target_options": {}, "asynchronous": True}}})
    expected = arrayckpt.open(source)
    for key, path in (("model.w", "model/w"), ("steps", "steps")):
        assert np.array_equal(group[path][...], expected[key].numpy())
