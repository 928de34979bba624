"""bfloat16 and float8 tensors reach numpy as carrier views (``int16``, ``uint8``: no ``ml_dtypes`` import for a save or
load that only moves bytes); wherever values are interpreted — TensorStore (compressed, non-contiguous), row overlays
and quantization of deltas, comparisons with a kept copy, ``open`` — they must come out as the same bits (or, quantized,
as what ``open`` reads too), never converted as integers."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import assert_bit_equal, random_tensor

import arrayckpt
from arrayckpt._format.dtypes import as_typed, dtype_by_name
from arrayckpt._torch.dtypes import numpy_view, torch_view

NARROW = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def _finite(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_views_carry_integers_and_typed_reinterprets_them() -> None:
    t = torch.tensor([1.0, -2.5], dtype=torch.bfloat16)
    dt = dtype_by_name("bfloat16")
    view = numpy_view(t, dt)
    assert view.dtype == np.int16 and view.ctypes.data == t.data_ptr()  # a view, not a copy
    values = as_typed(view, dt)
    assert values.dtype == ml_dtypes.bfloat16 and values.tolist() == [1.0, -2.5]
    assert as_typed(values, dt) is values and as_typed(np.zeros(2, np.int16), dtype_by_name("int16")).dtype == np.int16
    assert_bit_equal(torch_view(view, dt), t)
    assert_bit_equal(torch_view(values, dt), t)


@pytest.mark.parametrize("codec", [None, "zstd"])
def test_narrow_types_round_trip_through_both_paths(tmp_path: Path, codec: str | None) -> None:
    """Every bit pattern, through the fast path (``None``) or TensorStore (``zstd``, and a non-contiguous tensor the
    fast path declines)."""
    state = {f"t{i}": random_tensor((37, 5), dtype, seed=i) for i, dtype in enumerate(NARROW)}
    state["strided"] = random_tensor((12, 9), torch.bfloat16, seed=9)[:, ::2]
    state["scalar"] = random_tensor((), torch.float8_e5m2, seed=10)
    arrayckpt.save(state, tmp_path / "c", codec=codec)
    out = {key: torch.empty_like(value) for key, value in state.items()}
    out["strided"] = torch.empty(9, 12, dtype=torch.bfloat16).t()[:, :5]  # non-contiguous target: TensorStore
    arrayckpt.load(out, tmp_path / "c")
    staged = {key: torch.empty_like(value) for key, value in state.items()}
    arrayckpt.load(staged, tmp_path / "c", atomic=True)
    ckpt = arrayckpt.open(tmp_path / "c")
    for key, value in state.items():
        assert_bit_equal(out[key], value)
        assert_bit_equal(staged[key], value)
        assert_bit_equal(ckpt[key].torch(), value)
        read = ckpt[key].numpy()
        assert read.dtype == getattr(ml_dtypes, str(value.dtype).removeprefix("torch."))
        assert_bit_equal(torch_view(read.copy(), dtype_by_name(read.dtype.name)), value.contiguous())
    assert ckpt["t0"][3:17:2, 1:4].tobytes() == state["t0"].contiguous().view(torch.int16).numpy()[3:17:2, 1:4] \
        .tobytes()


@pytest.mark.parametrize("base_codec", [None, "zstd"])
def test_rows_delta_of_bfloat16_overlays_values_not_integers(tmp_path: Path, base_codec: str | None) -> None:
    emb = _finite((3000, 16), torch.bfloat16, 0)
    arrayckpt.save({"emb": emb}, tmp_path / "a", codec=base_codec)
    emb[[5, 700, 2999]] = torch.tensor(1.5, dtype=torch.bfloat16)  # 1.5 is int16 16320: converted, it would differ
    arrayckpt.save({"emb": emb}, tmp_path / "b", base=tmp_path / "a")  # compared with the base read back
    ckpt = arrayckpt.open(tmp_path / "b")
    assert ckpt.manifest.array_entry("emb").delta.mode == "rows"
    out = {"emb": torch.zeros_like(emb)}
    arrayckpt.load(out, tmp_path / "b")
    assert_bit_equal(out["emb"], emb)
    assert_bit_equal(ckpt["emb"].torch(), emb)
    assert ckpt["emb"][700].tolist() == [1.5] * 16 and ckpt["emb"].numpy().dtype == ml_dtypes.bfloat16


def test_quantized_rows_of_bfloat16_read_the_same_everywhere(tmp_path: Path) -> None:
    emb = _finite((3000, 16), torch.bfloat16, 1)
    arrayckpt.save({"emb": emb}, tmp_path / "a")
    rows = torch.tensor([3, 40, 2000])
    emb[rows] += 0.5
    arrayckpt.save({"emb": emb}, tmp_path / "b", base=tmp_path / "a", changed_rows={"emb": rows},
                   quantize={"emb": 8})
    ckpt = arrayckpt.open(tmp_path / "b")
    quantized = ckpt.manifest.array_entry("emb").delta.quantized
    assert quantized is not None and 0 < quantized.max_abs_error < 0.1
    out = {"emb": torch.zeros_like(emb)}
    arrayckpt.load(out, tmp_path / "b")
    error = (out["emb"].float() - emb.float()).abs().max().item()
    assert 0 < error <= quantized.max_abs_error
    assert_bit_equal(ckpt["emb"].torch(), out["emb"])
    assert np.array_equal(ckpt["emb"].numpy().view(np.int16), out["emb"].view(torch.int16).numpy())


def test_async_kept_copy_of_bfloat16_finds_the_changed_rows(tmp_path: Path) -> None:
    emb = _finite((3000, 16), torch.bfloat16, 2)
    arrayckpt.async_save({"emb": emb}, tmp_path / "a", keep_copy=True).wait()
    emb[17] = 2.0
    arrayckpt.async_save({"emb": emb}, tmp_path / "b", base=tmp_path / "a", keep_copy=True).wait()
    delta = arrayckpt.open(tmp_path / "b").manifest.array_entry("emb").delta
    assert delta.mode == "rows" and delta.rows == 1
    assert_bit_equal(arrayckpt.open(tmp_path / "b")["emb"].torch(), emb)
