"""What a reader checks in a checkpoint's root document before trusting it (issue 13, items 4, 8, 9; issue 5): manifests
that break what writers guarantee, JSON nested too deeply or with integers too long for Python, damaged pickle
metadata, a root document claiming a gigabyte, a tensor claiming more memory than the machine has. Each is refused
with an arrayckpt error naming the file and the key, reported by ``verify``, and never a traceback in the CLI.
(Converters' checks of their sources: ``tests/convert/test_source_validation.py``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from crafted import assert_one_line_error, cli_error, edit_root, entries
from policies import small_chunks

import arrayckpt
from arrayckpt._format.values import NotJSONable, decode_value, encode_value
from arrayckpt._read.checkpoint import stored_of

# --- item 4: structural invariants of the manifest -------------------------------------------------------------


@pytest.fixture
def chunks_delta(tmp_path) -> Path:
    w = torch.arange(1024.0).reshape(32, 32)
    chunking = small_chunks(64, 256)
    chunking.save({"w": w}, tmp_path / "a")
    w[:, :2] += 1  # every row changes: a chunks delta
    chunking.save({"w": w}, tmp_path / "b", base=tmp_path / "a")
    entry = entries(json.loads((tmp_path / "b" / "zarr.json").read_text()))["w"]
    assert entry["delta"]["mode"] == "chunks" and len(entry["delta"]["present"]) >= 2
    return tmp_path / "b"


def test_duplicate_present_chunk_is_refused_and_verify_reports_it(chunks_delta, capsys):
    def duplicate(document):  # one flipped bit: the last chunk's index becomes the first's
        present = entries(document)["w"]["delta"]["present"]
        present[-1] = present[0]
    edit_root(chunks_delta, duplicate)
    with pytest.raises(arrayckpt.FormatError, match=r"entry 'w': delta 'present' must list each chunk index once"):
        arrayckpt.open(chunks_delta)
    report = arrayckpt.verify(chunks_delta)
    assert not report.ok and "each chunk index once" in report.damage[0].problem
    code, _ = cli_error(capsys, "verify", str(chunks_delta))
    assert code == 1


def test_present_chunk_beyond_the_grid_is_refused_at_open(chunks_delta):
    edit_root(chunks_delta, lambda d: entries(d)["w"]["delta"].update(present=[0, 10_000]))
    with pytest.raises(arrayckpt.FormatError, match=r"b: entry 'w': its delta names chunk 10000, beyond its"):
        arrayckpt.open(chunks_delta)
    assert not arrayckpt.verify(chunks_delta).ok


@pytest.fixture
def rows_delta(tmp_path) -> Path:
    arrayckpt.save({"e": torch.zeros(10, 2)}, tmp_path / "a")
    e = torch.zeros(10, 2)
    e[[2, 5]] = 1.0
    arrayckpt.save({"e": e}, tmp_path / "b", base=tmp_path / "a", changed_rows={"e": [2, 5]})
    assert entries(json.loads((tmp_path / "b" / "zarr.json").read_text()))["e"]["delta"]["rows"] == 2
    return tmp_path / "b"


def test_rows_delta_row_count_must_match_the_stored_rows(rows_delta):
    edit_root(rows_delta, lambda d: entries(d)["e"]["delta"].update(rows=1))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"tensor 'e': its changed rows are 2, but the "
                                                               r"manifest records 1"):
        arrayckpt.open(rows_delta)["e"].numpy()
    edit_root(rows_delta, lambda d: entries(d)["e"]["delta"].update(rows=3))
    with pytest.raises(arrayckpt.FormatError, match=r"entry 'e': its rows delta records 3 changed rows but stores 2"):
        arrayckpt.open(rows_delta)["e"].numpy()
    assert not arrayckpt.verify(rows_delta).ok


def test_rows_stored_twice_are_refused(rows_delta):
    checkpoint = stored_of(arrayckpt.open(rows_delta))
    entry = checkpoint.manifest.entries["e"]
    checkpoint.check_delta_rows(entry, np.array([2, 5, -1]))  # padding is fine
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"tensor 'e': its changed rows name a row twice"):
        checkpoint.check_delta_rows(entry, np.array([2, 2]))
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"name rows outside 0..9"):
        checkpoint.check_delta_rows(entry, np.array([2, -3]))


def test_quantized_delta_of_an_integer_tensor_is_refused(rows_delta):
    def quantize_ints(document):
        entries(document)["e"]["dtype"] = "int32"
        entries(document)["e"]["delta"]["quantized"] = {"bits": 8, "max_abs_error": 0.0}
    edit_root(rows_delta, quantize_ints)
    with pytest.raises(arrayckpt.FormatError, match=r"entry 'e': a quantized rows delta of a int32 tensor"):
        arrayckpt.open(rows_delta)


@pytest.mark.parametrize("error", [float("nan"), -1.0])
def test_quantized_max_abs_error_must_be_finite_and_non_negative(rows_delta, error):
    edit_root(rows_delta, lambda d: entries(d)["e"]["delta"].update(quantized={"bits": 8, "max_abs_error": error}))
    with pytest.raises(arrayckpt.FormatError, match=r"entry 'e': delta 'quantized' must be"):
        arrayckpt.open(rows_delta)


def test_per_rank_entries_must_agree_on_the_number_of_ranks(ckpt):
    arrayckpt.save({"r": arrayckpt.PerRank(torch.zeros(2)), "s": arrayckpt.PerRank(3)}, ckpt)
    edit_root(ckpt, lambda d: entries(d)["s"]["ranks"].append({"value": 4}))
    with pytest.raises(arrayckpt.FormatError, match=r"per-rank entries disagree on the number of ranks that saved "
                                                    r"\(\[1, 2\]\)"):
        arrayckpt.open(ckpt)


def test_containers_must_hold_entries(ckpt):
    arrayckpt.save({"layers": [torch.ones(2), torch.zeros(1)]}, ckpt)
    arrayckpt.open(ckpt)
    edit_root(ckpt, lambda d: d["attributes"]["arrayckpt"]["containers"].update({"layer": "list"}))
    with pytest.raises(arrayckpt.FormatError, match=r"'containers' names a list at 'layer', but no entry lies below"):
        arrayckpt.open(ckpt)


def test_an_array_inside_another_array_is_refused(ckpt):
    arrayckpt.save({"w": torch.ones(2), "v": torch.zeros(2)}, ckpt)

    def nest(document):
        entry = entries(document).pop("v")
        entries(document)["w.v"] = {**entry, "keys": ["w", "v"], "path": "w/v"}
    edit_root(ckpt, nest)
    with pytest.raises(arrayckpt.FormatError, match=r"entry 'w.v' is stored inside the array of entry 'w'"):
        arrayckpt.open(ckpt)


# --- item 8: hostile JSON --------------------------------------------------------------------------------------


def test_deeply_nested_root_document_is_a_corrupt_checkpoint(ckpt, capsys):
    arrayckpt.save({"w": torch.ones(2)}, ckpt)
    (ckpt / "zarr.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"root zarr.json is damaged: JSON nested too deeply"):
        arrayckpt.open(ckpt)
    assert not arrayckpt.verify(ckpt).ok
    assert_one_line_error(*cli_error(capsys, "info", str(ckpt)), match="nested too deeply")


def test_integer_of_too_many_digits_is_a_corrupt_checkpoint(ckpt, capsys):
    arrayckpt.save({"w": torch.ones(2), "n": 1}, ckpt)
    text = (ckpt / "zarr.json").read_text().replace('"value": 1', '"value": ' + "7" * 5000)
    (ckpt / "zarr.json").write_text(text)
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"root zarr.json is damaged: .*digits"):
        arrayckpt.open(ckpt)
    assert_one_line_error(*cli_error(capsys, "info", str(ckpt)), match="digits")


def test_deeply_nested_plain_value_is_a_format_error(ckpt, capsys):
    arrayckpt.save({"w": torch.ones(2), "cfg": 1}, ckpt)
    edit_root(ckpt, lambda d: entries(d)["cfg"].update(value=json.loads("[" * 500 + "]" * 500)))
    with pytest.raises(arrayckpt.FormatError, match=r"value 'cfg' is nested more than 200 levels deep"):
        arrayckpt.open(ckpt).plain_values["cfg"]
    assert_one_line_error(*cli_error(capsys, "info", str(ckpt)), match="nested more than 200 levels")


def test_values_nest_as_deep_as_decoding_accepts():
    for leaf in (0, b"x", float("inf"), [], (), {"a": 1}):
        value: Any = leaf
        encoded = 0
        for _ in range(210):  # whatever encodes decodes back, and nothing nested 210 deep encodes
            try:
                assert decode_value(encode_value(value)) == value
                encoded += 1
            except NotJSONable as e:
                assert "nested more than 200 levels deep" in str(e)
            value = [value]
        assert 199 <= encoded <= 201


# --- item 9: pickle metadata -----------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["drop", "string"])
def test_damaged_pickle_metadata_is_reported_as_damage(ckpt, capsys, damage):
    arrayckpt.save({"w": torch.ones(2), "obj": {1, 2}}, ckpt, allow_pickle=True)

    def hurt(document):
        node = document["consolidated_metadata"]["metadata"]["obj"]
        if damage == "drop":
            del node["chunk_grid"]
        else:
            node["chunk_grid"] = "regular"
    edit_root(ckpt, hurt)
    report = arrayckpt.verify(ckpt)
    assert [(d.key, d.file) for d in report.damage] == [("obj", "obj/zarr.json")]
    assert "chunk_grid" in report.damage[0].problem
    code, _ = cli_error(capsys, "verify", str(ckpt))
    assert code == 1


# --- issue 5, item 3: a metadata document is read only when it is of a sane size ------------------------------------


def test_a_root_document_claiming_a_gigabyte_is_refused_unread(ckpt: Path, capsys) -> None:
    arrayckpt.save({"w": torch.ones(2)}, ckpt)
    with open(ckpt / "zarr.json", "r+b") as f:
        f.truncate((1 << 30) + 1)  # sparse: nothing stored, a gigabyte claimed
    with pytest.raises(arrayckpt.CorruptCheckpointError, match=r"zarr.json holds more than 1,073,741,824 bytes"):
        arrayckpt.open(ckpt)
    code, err = cli_error(capsys, "info", str(ckpt))
    assert_one_line_error(code, err, f"{ckpt}: zarr.json holds more than")


# --- issue 5, item 2: a tensor claiming gigabytes its files do not hold ---------------------------------------------


def test_a_tensor_too_big_to_allocate_is_an_error_naming_it(claims_32_gib, monkeypatch, capsys, tuned):

    tuned(probe_bytes=1 << 62)  # no probe: straight to the allocation
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("can't allocate memory")))
    with arrayckpt.open(claims_32_gib) as ckpt, pytest.raises(MemoryError, match=r"ckpt: tensor 'w' \(float32"
                                                                                  r"\[8589934592\], 34,359,738,368 "
                                                                                  r"bytes\) is more than this machine"):
        ckpt["w"].torch()
