"""zarr-python <-> TensorStore interop for the ml_dtypes data types of ``arrayckpt._zarr_dtypes``.

Every comparison is of raw bits (``.view(np.uint8)``/``.view(np.uint16)``), so NaN payloads, negative
zeros and fill values must survive exactly, not just compare equal as floats.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec
from zarr.core.dtype import data_type_registry, get_data_type_from_native_dtype

from arrayckpt import _zarr_dtypes

NAMES = [cls._zarr_v3_name for cls in _zarr_dtypes.SUPPORTED_DTYPES]
REQUIRED = {
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
}
SHAPE = (6, 8)
CHUNK = [2, 4]
SHARD = [4, 8]
MODULE_PATH = Path(_zarr_dtypes.__file__)


def _np_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(getattr(ml_dtypes, name))


def _uint(name: str) -> type[np.unsignedinteger[Any]]:
    return np.uint8 if _np_dtype(name).itemsize == 1 else np.uint16


def _zdtype(name: str) -> _zarr_dtypes.MLDtypesFloat:
    return data_type_registry.get(name)()  # type: ignore[return-value]


def _bits(value: object, name: str) -> int:
    return int(np.asarray(value, dtype=_np_dtype(name)).view(_uint(name)))


def _bytes_codec(itemsize: int) -> dict[str, Any]:
    # TensorStore rejects an endianness for one-byte types; zarr-python drops it for them too.
    if itemsize == 1:
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}


def _ts_codecs(name: str, layout: str) -> tuple[list[int], list[dict[str, Any]]]:
    """(chunk_grid chunk_shape, codecs) as arrayckpt writes them."""
    inner = [_bytes_codec(_np_dtype(name).itemsize), {"name": "crc32c"}]
    if layout == "plain":
        return CHUNK, inner
    sharding = {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": CHUNK,
            "codecs": inner,
            "index_codecs": [_bytes_codec(8), {"name": "crc32c"}],
            "index_location": "end",
        },
    }
    return SHARD, [sharding]


def _ts_open(path: Path, name: str, fill: object, layout: str = "plain", create: bool = True) -> Any:
    grid, codecs = _ts_codecs(name, layout)
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    if create:
        spec["metadata"] = {
            "shape": list(SHAPE),
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
            "data_type": name,
            "fill_value": fill,
            "codecs": codecs,
        }
    return ts.open(spec, create=create).result()


def _random_bits(name: str, seed: int) -> np.ndarray:
    """Every bit pattern is fair game: NaNs with payloads, -0, subnormals, infinities."""
    u = _uint(name)
    return np.random.default_rng(seed).integers(0, np.iinfo(u).max + 1, SHAPE).astype(u)


def _ts_write_partial(path: Path, name: str, fill: object, layout: str, seed: int) -> np.ndarray:
    """Write a full chunk row and part of one chunk, leave the rest missing; return the bits TS reads."""
    t = _ts_open(path, name, fill, layout)
    data = _random_bits(name, seed).view(_np_dtype(name))
    t[:2, :].write(data[:2]).result()
    t[4:5, 4:8].write(data[4:5, 4:8]).result()
    return t.read().result().view(_uint(name))


def test_required_dtypes_are_supported() -> None:
    assert REQUIRED <= set(NAMES)
    assert len(set(NAMES)) == len(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_registry_maps_names_and_numpy_dtypes(name: str) -> None:
    _zarr_dtypes.register()
    _zarr_dtypes.register()  # idempotent
    cls = data_type_registry.get(name)
    assert cls in _zarr_dtypes.SUPPORTED_DTYPES
    # exactly one registered type claims the numpy dtype (match_dtype raises on 0 or >1 matches)
    zdtype = get_data_type_from_native_dtype(_np_dtype(name))
    assert type(zdtype) is cls
    assert zdtype.to_native_dtype() == _np_dtype(name)
    assert zdtype.to_json(zarr_format=3) == name
    assert zdtype.to_json(zarr_format=2) == {"name": name, "object_codec_id": None}


# Fill values as a user would pass them to TensorStore. float8_e8m0fnu has no zero, no sign and no
# infinity, and TensorStore 0.1.86 converts numbers to/from it with the wrong exponent bias (see
# test_tensorstore_e8m0fnu_number_quirk), so only zero (bits 0x00 on both sides) and NaN agree there.
FILLS: list[object] = [0, -0.0, 1.5, -2.0, 0.1, 1e30, "NaN", "Infinity", "-Infinity", "0x01", "0x7f", "0xff"]
E8M0_FILLS: list[object] = [0, -0.0, "NaN", "0xff"]


@pytest.mark.parametrize(
    ("name", "fill"),
    [(n, f) for n in NAMES for f in (E8M0_FILLS if n == "float8_e8m0fnu" else FILLS)],
)
def test_fill_value_json_matches_tensorstore(tmp_path: Path, name: str, fill: object) -> None:
    t = _ts_open(tmp_path / "a", name, fill)
    ts_json = json.loads((tmp_path / "a" / "zarr.json").read_text())["fill_value"]
    ts_bits = _bits(t.fill_value, name)
    zdtype = _zdtype(name)
    decoded = zdtype.from_json_scalar(ts_json, zarr_format=3)
    assert _bits(decoded, name) == ts_bits, (ts_json, hex(ts_bits))
    encoded = zdtype.to_json_scalar(decoded, zarr_format=3)
    if name == "float8_e8m0fnu" and ts_json != "NaN":
        assert encoded == f"0x{ts_bits:02x}"  # hex: TensorStore misreads numbers for this type
    else:
        assert json.dumps(encoded) == json.dumps(ts_json)  # json.dumps tells -0.0 from 0.0
    # and TensorStore reads our encoding back to the same bits
    t2 = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "memory"},
            "metadata": {"shape": [1], "data_type": name, "fill_value": encoded},
        },
        create=True,
    ).result()
    assert _bits(t2.fill_value, name) == ts_bits


def test_tensorstore_e8m0fnu_number_quirk(tmp_path: Path) -> None:
    """TensorStore 0.1.86 reads the e8m0 byte b as the number +-2**(b-63) (ml_dtypes: 2**(b-127)).

    So for bits 0x7f (1.0) it writes the fill value 2**64. We decode numbers by value, like every
    other type (2**64 is bits 0xbf), and write this type's fill values as hex, which TensorStore
    reads exactly. If TensorStore is fixed it writes 1.0 and both sides agree on 0x7f.
    """
    t = _ts_open(tmp_path / "a", "float8_e8m0fnu", "0x7f")
    assert _bits(t.fill_value, "float8_e8m0fnu") == 0x7F
    ts_json = json.loads((tmp_path / "a" / "zarr.json").read_text())["fill_value"]
    zdtype = _zdtype("float8_e8m0fnu")
    decoded = _bits(zdtype.from_json_scalar(ts_json, zarr_format=3), "float8_e8m0fnu")
    assert (ts_json, decoded) in [(2.0**64, 0xBF), (1.0, 0x7F)]
    assert zdtype.to_json_scalar(np.uint8(0x7F).view(_np_dtype("float8_e8m0fnu")), zarr_format=3) == "0x7f"
    assert zdtype.from_json_scalar(0.0, zarr_format=3) == zdtype.default_scalar()


@pytest.mark.parametrize("name", NAMES)
def test_fill_value_parsing_edge_cases(name: str) -> None:
    zdtype = _zdtype(name)
    width = 2 * zdtype.item_size
    assert _bits(zdtype.from_json_scalar("0x" + "0" * (width - 1) + "1", zarr_format=3), name) == 1
    for bad in ["0x" + "0" * (width + 1), "0x", "0xzz", "0x-1", "0x1_0", "nonsense"]:
        with pytest.raises(ValueError):
            zdtype.from_json_scalar(bad, zarr_format=3)
    for bad_type in [None, True, [1.0], {"a": 1}]:
        with pytest.raises(TypeError):
            zdtype.from_json_scalar(bad_type, zarr_format=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        zdtype.cast_scalar("nonsense")
    # a scalar of the type itself keeps its exact bits (here: an arbitrary pattern, maybe a NaN)
    odd = np.array(0x7F81 if width == 4 else 0x7D, dtype=_uint(name)).view(_np_dtype(name))[()]
    assert _bits(zdtype.cast_scalar(odd), name) == _bits(odd, name)
    # Zarr v2 has no hex encoding: any NaN becomes "NaN" there
    nan_json = zdtype.to_json_scalar("NaN", zarr_format=2)
    assert nan_json == "NaN"


def test_non_canonical_nan_fill_keeps_its_payload(tmp_path: Path) -> None:
    t = _ts_open(tmp_path / "a", "bfloat16", "0x7f81")
    assert json.loads((tmp_path / "a" / "zarr.json").read_text())["fill_value"] == "0x7f81"
    a = zarr.open_array(tmp_path / "a", mode="r")
    assert _bits(a.metadata.fill_value, "bfloat16") == 0x7F81
    assert (a[:].view(np.uint16) == 0x7F81).all()
    assert _bits(t.fill_value, "bfloat16") == 0x7F81


@pytest.mark.parametrize("layout", ["plain", "sharded"])
@pytest.mark.parametrize("name", NAMES)
def test_zarr_reads_tensorstore_bits(tmp_path: Path, name: str, layout: str) -> None:
    fill = "NaN" if name == "float8_e8m0fnu" else 1.5  # a fill that is not all-zero bits
    expected = _ts_write_partial(tmp_path / "a", name, fill, layout, seed=len(name))
    a = zarr.open_array(tmp_path / "a", mode="r")
    assert a.dtype == _np_dtype(name)
    got = a[:].view(_uint(name))
    np.testing.assert_array_equal(got, expected)
    # the missing region really is the fill value, so the fill was decoded to the right bits
    assert (got[2:4] == _bits(a.metadata.fill_value, name)).all()
    ts_fill = _ts_open(tmp_path / "a", name, None, create=False).fill_value
    assert _bits(a.metadata.fill_value, name) == _bits(ts_fill, name)


@pytest.mark.parametrize("layout", ["default", "plain", "sharded"])
@pytest.mark.parametrize("name", NAMES)
def test_tensorstore_reads_zarr_written_bits(tmp_path: Path, name: str, layout: str) -> None:
    dtype = _np_dtype(name)
    kwargs: dict[str, Any] = {}
    if layout != "default":
        kwargs = {"serializer": BytesCodec(), "compressors": [Crc32cCodec()]}
    if layout == "sharded":
        kwargs["shards"] = tuple(SHARD)
    fill = "0x7fc1" if dtype.itemsize == 2 else "0xff"  # a NaN (or -max) that is not canonical
    a = zarr.create_array(tmp_path / "a", shape=SHAPE, chunks=tuple(CHUNK), dtype=dtype, fill_value=fill, **kwargs)
    data = _random_bits(name, seed=7)
    a[:2, :] = data[:2].view(dtype)
    a[4:5, 4:8] = data[4:5, 4:8].view(dtype)
    expected = np.full(SHAPE, int(fill, 16), dtype=_uint(name))
    expected[:2] = data[:2]
    expected[4:5, 4:8] = data[4:5, 4:8]

    meta = json.loads((tmp_path / "a" / "zarr.json").read_text())
    assert meta["data_type"] == name
    codecs = meta["codecs"][0]["configuration"]["codecs"] if layout == "sharded" else meta["codecs"]
    assert codecs[0] == _bytes_codec(dtype.itemsize)  # what TensorStore writes and accepts

    t = _ts_open(tmp_path / "a", name, None, create=False)
    assert t.dtype.numpy_dtype == dtype
    np.testing.assert_array_equal(t.read().result().view(_uint(name)), expected)
    assert _bits(t.fill_value, name) == int(fill, 16)


def test_big_endian_bfloat16_is_refused_not_misread(tmp_path: Path) -> None:
    t = ts.open(
        {
            "driver": "zarr3",
            "kvstore": {"driver": "file", "path": str(tmp_path / "a")},
            "metadata": {
                "shape": [4],
                "data_type": "bfloat16",
                "fill_value": 0,
                "codecs": [{"name": "bytes", "configuration": {"endian": "big"}}],
            },
        },
        create=True,
    ).result()
    t.write(np.arange(4).astype(ml_dtypes.bfloat16)).result()
    a = zarr.open_array(tmp_path / "a", mode="r")
    with pytest.raises(ValueError, match="native byte order"):
        a[:]


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn"])
def test_zarr_v2_as_written_by_tensorstore(tmp_path: Path, name: str) -> None:
    t = ts.open(
        {
            "driver": "zarr",
            "kvstore": {"driver": "file", "path": str(tmp_path / "a")},
            "metadata": {"shape": [5], "chunks": [2], "dtype": name, "fill_value": 1.5, "compressor": None},
        },
        create=True,
    ).result()
    data = _random_bits(name, seed=3).ravel()[:4]
    t[:4].write(data.view(_np_dtype(name))).result()
    a = zarr.open_array(tmp_path / "a", mode="r", zarr_format=2)
    got = a[:].view(_uint(name))
    np.testing.assert_array_equal(got[:4], data)
    assert got[4] == _bits(1.5, name)


@pytest.fixture(scope="module", autouse=True)
def _fresh_interpreter_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """TensorStore writes every dtype and layout; one fresh interpreter, which never imports arrayckpt
    itself, reads them back: first with nothing registered, then with this module loaded by file path
    (no package ``__init__``, so no torch), then through the ``zarr.data_type`` entry points.

    Started before the first test of the module (it is slow: loading the entry point imports the
    ``arrayckpt`` package and so torch) and collected by :func:`fresh_interpreter` at the end.
    """
    root = tmp_path_factory.mktemp("fresh")
    cases = {}
    for name in NAMES:
        for layout in ("plain", "sharded"):
            path = root / f"{name}-{layout}"
            np.save(f"{path}.npy", _ts_write_partial(path, name, 0, layout, seed=11))
            cases[f"{name}-{layout}"] = str(path)
    script = f"""
        import importlib.util, json, sys
        import numpy as np
        assert not any(m.split(".")[0] == "arrayckpt" for m in sys.modules)
        import zarr
        from zarr.core.dtype import data_type_registry

        cases = {cases!r}
        probe = cases["bfloat16-plain"]

        def read_all():
            res = {{}}
            for key, path in cases.items():
                a = zarr.open_array(path, mode="r")
                u = np.uint8 if a.dtype.itemsize == 1 else np.uint16
                res[key] = [str(a.dtype), bool(np.array_equal(a[:].view(u), np.load(path + ".npy")))]
            return res

        out = {{"lazy": sorted(e.name for e in data_type_registry._lazy_load_list)}}
        # zarr 3.1 collects the entry points but never loads them; this records whether that changed
        try:
            zarr.open_array(probe, mode="r")
            out["without_flush"] = "ok"
        except ValueError as e:
            out["without_flush"] = str(e)

        spec = importlib.util.spec_from_file_location("zd_by_path", {str(MODULE_PATH)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out["torch_after_module_import"] = "torch" in sys.modules
        out["registered_on_import"] = all(
            data_type_registry.get(c._zarr_v3_name) is c for c in module.SUPPORTED_DTYPES
        )
        out["by_path"] = read_all()

        data_type_registry._lazy_load()  # the flush zarr itself never calls: loads our entry points
        out["registered_from"] = sorted({{data_type_registry.get(n).__module__ for n in out["lazy"]}})
        out["by_entry_points"] = read_all()
        print(json.dumps(out))
    """
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=root,  # not the repository root: only the installed package can provide arrayckpt
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def fresh_interpreter(_fresh_interpreter_proc: subprocess.Popen[str]) -> dict[str, Any]:
    """The fresh interpreter's findings (see :func:`_fresh_interpreter_proc`)."""
    stdout, stderr = _fresh_interpreter_proc.communicate(timeout=120)
    assert _fresh_interpreter_proc.returncode == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1])


def test_fresh_interpreter_entry_points(fresh_interpreter: dict[str, Any]) -> None:
    assert set(NAMES) <= set(fresh_interpreter["lazy"]), "entry points missing: pip install -e . ?"
    assert fresh_interpreter["registered_from"] == ["arrayckpt._zarr_dtypes"]
    # Without a flush zarr-python 3.1 cannot know the type; if this ever says "ok", zarr fixed it.
    msg = fresh_interpreter["without_flush"]
    assert msg == "ok" or "No Zarr data type found that matches 'bfloat16'" in msg


def test_module_import_registers_without_torch(fresh_interpreter: dict[str, Any]) -> None:
    assert fresh_interpreter["torch_after_module_import"] is False
    assert fresh_interpreter["registered_on_import"] is True


@pytest.mark.parametrize("how", ["by_path", "by_entry_points"])
@pytest.mark.parametrize("layout", ["plain", "sharded"])
@pytest.mark.parametrize("name", NAMES)
def test_fresh_interpreter_reads_exact_bits(
    fresh_interpreter: dict[str, Any], name: str, layout: str, how: str
) -> None:
    assert fresh_interpreter[how][f"{name}-{layout}"] == [name, True]
