"""safetensors through the ``safetensors`` library: every file arrayckpt writes opens with ``safe_open`` and reads
back bit for bit (bfloat16 and float8 included), an index records ``total_size`` and ``total_parameters``, the
source's metadata survives a round trip, and files the library refuses are refused naming the file."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors = pytest.importorskip("safetensors")

from helpers import assert_bit_equal, random_tensor  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import arrayckpt  # noqa: E402
from arrayckpt._convert.safetensors import from_safetensors, source_record  # noqa: E402
from arrayckpt.cli import main  # noqa: E402

# dtypes numpy has (safe_open(framework="numpy") reads them) and those it lacks (framework="pt")
NUMPY_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32,
                torch.int64, torch.uint64, torch.float16, torch.float32, torch.float64, torch.complex64]
TORCH_ONLY = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def _weights(dtypes: list[torch.dtype]) -> dict[str, torch.Tensor]:
    """Random bit patterns (NaNs, infinities, -0 included) of every dtype, plus a scalar and an empty tensor."""
    out = {f"layers.{i}.{str(dt).removeprefix('torch.')}": random_tensor((3 + i, 5), dt, seed=i)
           for i, dt in enumerate(dtypes)}
    out["scalar"] = random_tensor((), dtypes[0], seed=99)
    out["empty"] = torch.empty(0, 4, dtype=dtypes[-1])
    return out


def _read_with_library(file: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """Every tensor of ``file`` as the safetensors library reads it: numpy where numpy has the dtype (checked
    against torch's reading), torch for the rest; and the file's ``__metadata__``."""
    with safe_open(file, framework="pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        metadata = f.metadata()
    with safe_open(file, framework="numpy") as f:
        for key, tensor in tensors.items():
            if tensor.dtype in NUMPY_DTYPES:
                array = f.get_tensor(key)
                assert array.shape == tuple(tensor.shape) and array.tobytes() == tensor.numpy().tobytes(), key
    return tensors, metadata


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert_bit_equal(got[key], tensor)


def _raw(path: Path, header: bytes | dict, data: bytes, length: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


# ------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtypes", [NUMPY_DTYPES, TORCH_ONLY], ids=["numpy-dtypes", "bf16-fp8"])
def test_single_file_round_trip_reads_back_with_safe_open(tmp_path: Path, dtypes: list[torch.dtype]) -> None:
    weights = _weights(dtypes)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    result = arrayckpt.convert(tmp_path / "model.safetensors", tmp_path / "ckpt")
    assert result.tensors == len(weights) and result.bytes == sum(t.nbytes for t in weights.values())
    opened = arrayckpt.open(tmp_path / "ckpt")
    _assert_same({k: opened[k].torch() for k in weights}, weights)
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "back.safetensors")
    back, metadata = _read_with_library(tmp_path / "back.safetensors")
    _assert_same(back, weights)
    assert metadata == {"format": "pt"}  # transformers refuses a file without it
    (length,) = struct.unpack("<Q", (tmp_path / "back.safetensors").read_bytes()[:8])
    assert length % 8 == 0  # the data 8-byte aligned, as the library writes it


@pytest.mark.parametrize("dtype", TORCH_ONLY)
def test_bf16_and_float8_every_bit_pattern_survives(tmp_path: Path, dtype: torch.dtype) -> None:
    every = torch.arange(2 ** (8 * dtype.itemsize), dtype=torch.int32)
    pattern = every.to(torch.int16 if dtype.itemsize == 2 else torch.uint8).view(dtype).reshape(-1, 256)
    save_file({"w": pattern}, tmp_path / "in.safetensors")
    arrayckpt.convert(tmp_path / "in.safetensors", tmp_path / "ckpt")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out.safetensors")
    back, _ = _read_with_library(tmp_path / "out.safetensors")
    assert_bit_equal(back["w"], pattern)


def test_sharded_output_opens_with_safe_open_and_its_index_adds_up(tmp_path: Path) -> None:
    weights = _weights(NUMPY_DTYPES[:6] + TORCH_ONLY)
    arrayckpt.save(weights, tmp_path / "ckpt")
    result = arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="safetensors", max_shard_bytes=120)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and len(result.files) == len(shards) + 1
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in weights.values())
    assert index["metadata"]["total_parameters"] == sum(t.numel() for t in weights.values())
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors, metadata = _read_with_library(tmp_path / "hf" / shard)
        assert metadata == {"format": "pt"}
        assert all(index["weight_map"][k] == shard for k in tensors)  # each tensor where the index says
        assert sum(t.nbytes for t in tensors.values()) <= 120 or len(tensors) == 1
        merged |= tensors
    _assert_same(merged, weights)
    arrayckpt.convert(tmp_path / "hf", tmp_path / "again")  # and back in, through the index
    opened = arrayckpt.open(tmp_path / "again")
    _assert_same({k: opened[k].torch() for k in weights}, weights)


def test_every_fetched_tensor_is_released_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import arrayckpt._convert.torch_save as torch_save

    released: list[int] = []
    monkeypatch.setattr(torch_save, "_release_pages", lambda tensor: released.append(tensor.numel()))
    weights = {f"w{i}": torch.randn(64, i + 1) for i in range(5)}
    save_file(weights, tmp_path / "m.safetensors")
    from_safetensors(tmp_path / "m.safetensors", tmp_path / "ckpt")
    assert sorted(released) == sorted(t.numel() for t in weights.values())  # the mapping's pages dropped


# ------------------------------------------------------------------------------------------- metadata


def test_source_record_keeps_what_every_file_shares_and_the_index_metadata() -> None:
    record = source_record({"total_size": 8, "base_model": "x"}, [{"format": "pt", "a": "1"}, {"format": "pt"}])
    assert record == {"format": "safetensors", "metadata": {"format": "pt"},
                      "index_metadata": {"total_size": 8, "base_model": "x"}}
    assert source_record(None, [{"format": "pt", "a": "1"}]) == {"format": "safetensors",
                                                                 "metadata": {"format": "pt", "a": "1"}}


def test_source_metadata_survives_a_round_trip(tmp_path: Path) -> None:
    """A sharded source's index metadata and its files' ``__metadata__`` are kept in ``created["source"]`` and
    written back: to a single file its ``__metadata__``, to shards the index too (totals recounted)."""
    weights = {"a": torch.randn(8, 4), "b": torch.randn(16).bfloat16(), "c": torch.arange(6)}
    src = tmp_path / "src"
    src.mkdir()
    meta = {"format": "pt", "license": "mit"}
    save_file({"a": weights["a"]}, src / "model-00001-of-00002.safetensors", metadata=meta)
    save_file({"b": weights["b"], "c": weights["c"]}, src / "model-00002-of-00002.safetensors", metadata=meta)
    (src / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": 1, "model_type": "llama"},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                       "c": "model-00002-of-00002.safetensors"}}))
    arrayckpt.convert(src, tmp_path / "ckpt")
    with arrayckpt.open(tmp_path / "ckpt") as ckpt:
        assert ckpt.manifest.created["source"]["index_metadata"] == {"total_size": 1, "model_type": "llama"}
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "one.safetensors")
    assert _read_with_library(tmp_path / "one.safetensors")[1] == {"format": "pt", "license": "mit"}
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "hf", to_format="safetensors", max_shard_bytes=40)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"model_type": "llama", "total_size": 8 * 4 * 4 + 16 * 2 + 6 * 8,
                                 "total_parameters": 32 + 16 + 6}  # recounted, not the recorded 1
    for shard in set(index["weight_map"].values()):
        assert _read_with_library(tmp_path / "hf" / shard)[1] == {"format": "pt", "license": "mit"}


def test_malformed_recorded_metadata_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import arrayckpt._convert.safetensors as module

    record = {"format": "safetensors", "metadata": {"n": 1, "ok": "y"}, "index_metadata": [1]}
    monkeypatch.setattr(module, "source_record", lambda *args: record)
    save_file({"a": torch.ones(2)}, tmp_path / "m.safetensors")
    arrayckpt.convert(tmp_path / "m.safetensors", tmp_path / "ckpt")
    arrayckpt.convert(tmp_path / "ckpt", tmp_path / "out.safetensors")
    assert _read_with_library(tmp_path / "out.safetensors")[1] == {"format": "pt", "ok": "y"}


# ------------------------------------------------------------------------------------------- refusals

F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _overlap(tmp_path: Path) -> Path:
    header = {"a": F32x2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}
    return _raw(tmp_path / "overlap.safetensors", header, bytes(12))


def _truncated(tmp_path: Path) -> Path:
    save_file({"a": torch.ones(64), "b": torch.ones(64)}, tmp_path / "full.safetensors")
    cut = tmp_path / "truncated.safetensors"
    cut.write_bytes((tmp_path / "full.safetensors").read_bytes()[:-100])
    return cut


def _long_header(tmp_path: Path) -> Path:  # the length says more bytes than the file has
    return _raw(tmp_path / "long.safetensors", {"a": F32x2}, bytes(8), length=10_000)


def _short_header(tmp_path: Path) -> Path:  # the length cuts the JSON short
    return _raw(tmp_path / "short.safetensors", {"a": F32x2}, bytes(8), length=20)


def _gap(tmp_path: Path) -> Path:  # disjoint, but the library wants the data packed
    header = {"a": F32x2, "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]}}
    return _raw(tmp_path / "gap.safetensors", header, bytes(20))


def _unknown_dtype(tmp_path: Path) -> Path:  # the library knows F8_E8M0, arrayckpt does not store it
    return _raw(tmp_path / "e8m0.safetensors", {"s": {"dtype": "F8_E8M0", "shape": [4], "data_offsets": [0, 4]}},
                bytes(4))


@pytest.mark.parametrize(("make", "match"), [
    (_overlap, r"tensors 'a' and 'b' have overlapping data_offsets"),
    (_truncated, r"'b' data_offsets \[256, 512\] do not fit its F32\[64\] or the file's"),
    (_long_header, r"header length 10000 is impossible"),
    (_short_header, r"not usable JSON"),
    (_gap, r"invalid offset for tensor `b`: the tensors' data must follow one another"),
    (_unknown_dtype, r"tensor 's' has dtype 'F8_E8M0', which arrayckpt cannot store"),
], ids=["overlap", "truncated", "long-header", "short-header", "gap", "unknown-dtype"])
def test_bad_files_are_refused_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], make,
                                               match: str) -> None:
    src = make(tmp_path)
    with pytest.raises(arrayckpt.FormatError, match=match) as caught:
        arrayckpt.convert(src, tmp_path / "out")
    assert str(caught.value).startswith(f"{src}: ")
    assert main(["convert", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("arrayckpt: error: ") and src.name in err[0]
    assert not (tmp_path / "out").exists()


def test_a_bad_shard_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    save_file({"a": torch.ones(4)}, tmp_path / "model-00001-of-00002.safetensors")
    _overlap(tmp_path).rename(tmp_path / "model-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": 32}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                                           "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(arrayckpt.FormatError, match=r"model-00002-of-00002.safetensors: tensors 'a' and 'b'"):
        arrayckpt.convert(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    save_file({"a": torch.ones(4)}, tmp_path / "one.safetensors")
    save_file({"a": torch.zeros(4)}, tmp_path / "two.safetensors")
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(arrayckpt.FormatError, match=r"tensor 'a' is in both one.safetensors and two.safetensors"):
        arrayckpt.convert(tmp_path, tmp_path / "out")


def test_zero_size_tensors_where_the_library_puts_them_convert(tmp_path: Path) -> None:
    header = {"a": F32x2, "z": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}
    src = _raw(tmp_path / "m.safetensors", header, np.arange(3, dtype=np.float32).tobytes())
    arrayckpt.convert(src, tmp_path / "out")
    opened = arrayckpt.open(tmp_path / "out")
    assert opened["b"].numpy().tolist() == [2.0] and opened["z"].shape == (0, 3)
    assert math.prod(opened["z"].shape) == 0
