"""Converters refuse a lying source with an arrayckpt error naming the file and the key, never a traceback in the CLI
and never an allocation the source's files do not back: safetensors headers whose offsets overlap, nest too deeply or
hold integers too long for Python (issue 13, items 8 and 14); a tensor whose (resealed) root document claims 32 GiB
its chunks do not hold (issue 5, item 2); a FIFO or a device in place of a foreign checkpoint's metadata file."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from crafted import assert_one_line_error, cli_error

import arrayckpt
from arrayckpt.cli import main

# --- items 8 and 14: safetensors headers -----------------------------------------------------------------------


def _safetensors(path: Path, header: bytes | dict[str, Any], data: bytes) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_overlapping_safetensors_offsets_are_refused(tmp_path, capsys):
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    src = _safetensors(tmp_path / "m.safetensors", header, bytes(12))
    with pytest.raises(arrayckpt.FormatError, match=r"m.safetensors: tensors 'a' and 'b' have overlapping "
                                                    r"data_offsets"):
        arrayckpt.convert(src, tmp_path / "out")
    assert_one_line_error(*cli_error(capsys, "convert", str(src), str(tmp_path / "out")), match="overlapping")
    assert not (tmp_path / "out").exists()


def test_disjoint_and_empty_safetensors_tensors_convert(tmp_path):
    """An empty tensor between two others converts; one placed inside another's bytes is refused as the
    safetensors library (and Hugging Face's loader) refuses it, naming the file."""
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
              "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
    src = _safetensors(tmp_path / "m.safetensors", header, np.arange(3, dtype=np.float32).tobytes())
    arrayckpt.convert(src, tmp_path / "out")
    with arrayckpt.open(tmp_path / "out") as out:
        assert out["b"].numpy().tolist() == [2.0] and out["z"].shape == (0,)
    header["z"]["data_offsets"] = [4, 4]
    inside = _safetensors(tmp_path / "inside.safetensors", header, np.arange(3, dtype=np.float32).tobytes())
    with pytest.raises(arrayckpt.FormatError, match="inside.safetensors"):
        arrayckpt.convert(inside, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


@pytest.mark.parametrize(("header", "match"), [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}', "digits"),
    (json.dumps({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}).encode(), "malformed shape"),
], ids=["deep", "huge-integer", "boolean-shape"])
def test_lying_safetensors_headers_are_format_errors(tmp_path, capsys, header, match):
    src = _safetensors(tmp_path / "m.safetensors", header, bytes(4))
    with pytest.raises(arrayckpt.FormatError, match=match):
        arrayckpt.convert(src, tmp_path / "out")
    assert_one_line_error(*cli_error(capsys, "convert", str(src), str(tmp_path / "out")), match=match)


# --- issue 5, item 2: a tensor claiming gigabytes its files do not hold ---------------------------------------------


@pytest.mark.parametrize("missing", [False, True], ids=["short chunk", "missing chunk"])
@pytest.mark.parametrize("to", [["--to", "megatron"], ["--to", "dcp"], ["--to", "hf"], ["--to", "torch"], []],
                         ids=["megatron", "dcp", "hf", "torch", "safetensors"])
def test_convert_of_a_tensor_claiming_32_gib_fails_before_allocating(claims_32_gib, capsys, to, missing):
    if missing:
        (claims_32_gib / "w/c.0").unlink()
    before = sorted(p.name for p in claims_32_gib.parent.iterdir())
    out = claims_32_gib.parent / ("out.pt" if to == ["--to", "torch"] else "out.safetensors" if not to else "out")
    code, err = cli_error(capsys, "convert", str(claims_32_gib), str(out), *to)
    assert_one_line_error(code, err, f"{claims_32_gib}: tensor 'w': ")
    assert "c.0" in err and sorted(p.name for p in claims_32_gib.parent.iterdir()) == before  # nothing left behind


# --- the metadata files of foreign checkpoints --------------------------------------------------------------------


@pytest.mark.parametrize("source, file", [("dcp", ".metadata"), ("megatron", "metadata.json"),
                                          ("megatron-latest", "latest_checkpointed_iteration.txt")])
def test_a_fifo_or_device_in_place_of_a_foreign_metadata_file_is_refused_at_once(tmp_path, capsys, source, file):
    """A source checkpoint's metadata read by the converters is a bounded regular file: a FIFO there would block a
    plain read forever, /dev/zero would exhaust memory."""
    import os

    src = tmp_path / "src"
    src.mkdir()
    if source == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"w": torch.ones(3)}, checkpoint_id=str(src))
    elif source == "megatron":
        (src / "common.pt").write_bytes(b"")
    else:
        (src / "iter_0000001").mkdir()
    (src / file).unlink(missing_ok=True)
    os.mkfifo(src / file)
    code = main(["convert", str(src), str(tmp_path / "out"), "--from", source.partition("-")[0]])
    err = capsys.readouterr().err
    if source == "megatron-latest":  # not a regular file: not taken for the pointer to an iteration
        assert code != 0 and "no metadata.json" in err, err
    else:
        assert code != 0 and file in err and "regular file" in err, err
    os.unlink(src / file)
    os.symlink("/dev/zero", src / file)
    code = main(["convert", str(src), str(tmp_path / "out"), "--from", source.partition("-")[0]])
    err = capsys.readouterr().err
    assert code != 0 and (file in err or source == "megatron-latest" and "no metadata.json" in err), err
