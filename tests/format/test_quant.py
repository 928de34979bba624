"""Row-wise quantization of embedding rows (``arrayckpt._format.quant``).

The references here are written independently of the module: a float64 min/max quantizer, a scalar
one-row-at-a-time port of FBGEMM's greedy range search, and a nibble-by-nibble decoder of the packed codes.
"""

from __future__ import annotations

import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from arrayckpt._format import quant as quant
from arrayckpt._format.quant import (
    BITS,
    SEARCH_BINS,
    SEARCH_RATIO,
    QuantizedRows,
    dequantize_rows,
    max_abs_error,
    packed_columns,
    quantize_rows,
)

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def levels(bits: int) -> int:
    return (1 << bits) - 1


def decode(q: QuantizedRows) -> np.ndarray:
    """Codes read straight from the bytes: column c is byte c // 2, low nibble when c is even."""
    codes = np.zeros((q.rows, q.columns), dtype=np.int64)
    for row in range(q.rows):
        for col in range(q.columns):
            if q.bits == 8:
                codes[row, col] = q.codes[row, col]
            else:
                codes[row, col] = (int(q.codes[row, col // 2]) >> (4 * (col % 2))) & 0xF
    return codes


def rebuild(q: QuantizedRows, dtype: np.dtype) -> np.ndarray:
    """offset + scale * code in float64, rounded once to ``dtype``."""
    codes = decode(q).astype(np.float64)
    values = q.offset.astype(np.float64)[:, None] + q.scale.astype(np.float64)[:, None] * codes
    return values.astype(dtype)


def minmax_sse(values: np.ndarray, bits: int) -> np.ndarray:
    """Per-row squared L2 error of plain [min, max] quantization, all in float64."""
    x = values.astype(np.float64)
    low, high = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    scale = (high - low) / levels(bits)
    safe = np.where(scale > 0, scale, 1.0)
    codes = np.clip(np.rint((x - low) / safe), 0, levels(bits))
    return ((low + codes * scale - x) ** 2).sum(axis=1)


def sse(values: np.ndarray, q: QuantizedRows) -> np.ndarray:
    return ((dequantize_rows(q, np.float64) - values.astype(np.float64)) ** 2).sum(axis=1)


def greedy_range(row: np.ndarray, bits: int) -> tuple[float, float]:
    """FBGEMM's param_search_greedy for one row, in float64, keeping the best range visited."""

    def loss(low: float, high: float) -> float:
        scale = (high - low) / levels(bits)
        codes = np.clip(np.rint((row - low) / scale), 0, levels(bits))
        return float(((low + codes * scale - row) ** 2).sum())

    low, high = float(row.min()), float(row.max())
    step = (high - low) / SEARCH_BINS
    cut_low = cut_high = 0
    best = (loss(low, high), 0, 0)
    for _ in range(round(SEARCH_BINS * SEARCH_RATIO)):
        up = loss(low + (cut_low + 1) * step, high - cut_high * step)
        down = loss(low + cut_low * step, high - (cut_high + 1) * step)
        if up < down:
            cut_low, current = cut_low + 1, up
        else:
            cut_high, current = cut_high + 1, down
        if current < best[0]:
            best = (current, cut_low, cut_high)
    return low + best[1] * step, high - best[2] * step


def assert_error_bound(values: np.ndarray, q: QuantizedRows, out_dtype: np.dtype) -> None:
    """Inside each row's stored range a value is within scale/2 of its reconstruction; outside, it is clamped
    to the nearer end.  Both allow for the final rounding to ``out_dtype``."""
    x = values.astype(np.float64)
    scale = q.scale.astype(np.float64)[:, None]
    low = q.offset.astype(np.float64)[:, None]
    high = low + levels(q.bits) * scale
    outside = np.maximum(np.maximum(low - x, x - high), 0.0)
    rounding = np.finfo(out_dtype).eps if out_dtype != BFLOAT16 else float(ml_dtypes.finfo(BFLOAT16).eps)
    slack = rounding * (np.abs(x) + scale) + 1e-12 * (np.abs(x) + scale) + float(np.finfo(np.float64).tiny)
    error = np.abs(dequantize_rows(q, out_dtype).astype(np.float64) - x)
    assert np.all(error <= np.maximum(scale / 2, outside) + slack)


def heavy_tailed(rows: int, columns: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_t(2, size=(rows, columns)).astype(np.float32)


# --- layout ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("columns", "bits", "expected"),
    [(0, 4, 0), (1, 4, 1), (2, 4, 1), (5, 4, 3), (64, 4, 32), (0, 8, 0), (5, 8, 5), (64, 8, 64)],
)
def test_packed_columns(columns: int, bits: int, expected: int) -> None:
    assert packed_columns(columns, bits) == expected


@pytest.mark.parametrize("columns", [1, 2, 3, 7, 16, 63])
def test_four_bit_packing_layout(columns: int) -> None:
    # Rows holding 0 and 15 and integers between have range [0, 15] and scale exactly 1 (no range can beat
    # zero error), so the code of every value is the value itself and the bytes can be checked directly.
    rng = np.random.default_rng(columns)
    values = rng.integers(0, 16, size=(9, columns)).astype(np.float32)
    if columns >= 2:
        values[:, 0], values[:, -1] = 0, 15
    q = quantize_rows(values, 4)
    assert q.codes.shape == (9, packed_columns(columns, 4))
    if columns >= 2:
        np.testing.assert_array_equal(q.scale, 1.0)
        np.testing.assert_array_equal(decode(q), values.astype(np.int64))
    if columns % 2:
        assert not np.any(q.codes[:, -1] >> 4), "the padding nibble of an odd column count must be zero"
    np.testing.assert_array_equal(dequantize_rows(q, np.float32), values)
    np.testing.assert_array_equal(dequantize_rows(q, np.float64), rebuild(q, np.dtype(np.float64)))


@pytest.mark.parametrize("columns", [1, 3, 31, 64])
def test_four_bit_round_trip_odd_columns(columns: int) -> None:
    values = heavy_tailed(50, columns, seed=columns)
    q = quantize_rows(values, 4)
    np.testing.assert_array_equal(dequantize_rows(q, np.float32), rebuild(q, np.dtype(np.float32)))
    assert_error_bound(values, q, np.dtype(np.float32))


# --- accuracy -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_trip_error_bound(bits: int, dtype: type) -> None:
    values = (heavy_tailed(300, 48) * 3 + 1).astype(dtype)
    before = values.copy()
    q = quantize_rows(values, bits)
    np.testing.assert_array_equal(values, before)  # the input is not modified
    assert q.bits == bits and q.columns == 48 and q.rows == 300
    assert q.codes.dtype == np.uint8 and q.scale.dtype == np.float32 and q.offset.dtype == np.float32
    assert_error_bound(values, q, np.dtype(dtype))

    # The range lies within [min, max] and clips away at most SEARCH_RATIO of the width.
    x = values.astype(np.float64)
    low, high = x.min(axis=1), x.max(axis=1)
    top = q.offset.astype(np.float64) + levels(bits) * q.scale.astype(np.float64)
    width = high - low
    assert np.all(q.offset >= low - 1e-6 * width) and np.all(top <= high + 1e-6 * width)
    assert np.all(top - q.offset >= (1 - SEARCH_RATIO) * width * (1 - 1e-6))


@pytest.mark.parametrize("bits", BITS)
def test_search_never_worse_than_min_max_and_often_better(bits: int) -> None:
    values = heavy_tailed(400, 64, seed=1)
    searched = sse(values, quantize_rows(values, bits))
    # Exactly never worse than the module's own min/max encoding (same float32 scale and offset rounding) ...
    assert np.all(searched <= sse(values, quantize_rows(values, bits, optimize_range=False)) * (1 + 1e-12))
    # ... and within float32 rounding of a float64 min/max quantizer.
    plain = minmax_sse(values, bits)
    assert np.all(searched <= plain * (1 + 1e-4))
    better = searched < plain * (1 - 1e-3)
    if bits == 4:  # the search pays off at 4 bits: most rows and the total improve clearly
        assert better.mean() > 0.5
        assert searched.sum() < 0.8 * plain.sum()
    else:  # at 8 bits the levels are fine enough that only rows with strong outliers gain
        assert better.any()


def test_a_searched_range_worse_than_min_max_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    values = heavy_tailed(20, 16, seed=10)

    def halve(block: np.ndarray, low: np.ndarray, high: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
        return low + (high - low) / 4, high - (high - low) / 4

    monkeypatch.setattr(quant, "_search_range", halve)
    q, plain = quantize_rows(values, 4), quantize_rows(values, 4, optimize_range=False)
    np.testing.assert_array_equal(q.codes, plain.codes)
    np.testing.assert_array_equal(q.offset, plain.offset)


def test_search_clips_an_outlier() -> None:
    values = np.append(np.linspace(-1, 1, 63, dtype=np.float32), np.float32(5))[None]
    q = quantize_rows(values, 4)
    top = float(q.offset[0]) + 15 * float(q.scale[0])
    assert top < 5 - 3 * 6 / SEARCH_BINS, "the search should pull the top of the range below the outlier"
    assert sse(values, q)[0] < 0.95 * minmax_sse(values, 4)[0]


@pytest.mark.parametrize("bits", BITS)
def test_search_matches_scalar_greedy_reference(bits: int) -> None:
    values = heavy_tailed(40, 32, seed=2)
    q = quantize_rows(values, bits)
    expected = np.array([greedy_range(row, bits) for row in values.astype(np.float64)])
    top = q.offset.astype(np.float64) + levels(bits) * q.scale.astype(np.float64)
    same = np.isclose(q.offset, expected[:, 0], rtol=1e-6, atol=1e-6) & np.isclose(top, expected[:, 1], rtol=1e-5)
    # The module scores ranges in float32, so a near-tie could in principle send one row another way.
    assert same.mean() >= 0.95, np.flatnonzero(~same)


def test_optimize_range_false_is_min_max() -> None:
    values = heavy_tailed(30, 20, seed=3)
    q = quantize_rows(values, 4, optimize_range=False)
    low, high = values.astype(np.float64).min(axis=1), values.astype(np.float64).max(axis=1)
    np.testing.assert_array_equal(q.offset, low.astype(np.float32))
    np.testing.assert_array_equal(q.scale, ((high - low) / 15).astype(np.float32))
    np.testing.assert_allclose(sse(values, q), minmax_sse(values, 4), rtol=1e-5)


# --- special rows and dtypes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64])
@pytest.mark.parametrize("bits", BITS)
def test_constant_rows_are_exact(dtype: np.dtype, bits: int) -> None:
    # Constants of any of these dtypes are float32 numbers, which the offset stores exactly.
    constants = np.array([0.0, 1.0, -3.5, 2.0**-10, 60000.0, -(2.0**-14), 3 * 2.0**-16], dtype=dtype)
    values = np.repeat(constants[:, None], 5, axis=1)
    values = np.concatenate([values, np.array([[0, 1, 2, 3, 4]], dtype=dtype)])
    q = quantize_rows(values, bits)
    assert np.all(q.scale[:-1] == 0) and q.scale[-1] > 0
    out = dequantize_rows(q, dtype)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out[:-1].astype(np.float64), values[:-1].astype(np.float64))
    assert max_abs_error(values[:-1], quantize_rows(values[:-1], bits)) == 0.0


def test_float64_constants_come_back_at_float32_precision() -> None:
    values = np.full((2, 3), 0.1)
    out = dequantize_rows(quantize_rows(values, 8), np.float64)
    np.testing.assert_array_equal(out, np.float64(np.float32(0.1)))


def test_single_column_is_exact() -> None:
    values = heavy_tailed(100, 1)
    q = quantize_rows(values, 4)
    assert q.codes.shape == (100, 1) and np.all(q.scale == 0)
    assert max_abs_error(values, q) == 0.0


@pytest.mark.parametrize("bits", BITS)
def test_empty_inputs(bits: int) -> None:
    q = quantize_rows(np.zeros((0, 9), np.float32), bits)
    assert q.codes.shape == (0, packed_columns(9, bits)) and q.scale.shape == q.offset.shape == (0,)
    assert dequantize_rows(q, BFLOAT16).shape == (0, 9)
    assert max_abs_error(np.zeros((0, 9), np.float32), q) == 0.0

    q = quantize_rows(np.zeros((3, 0), np.float32), bits)
    assert q.codes.shape == (3, 0) and q.scale.shape == (3,)
    assert dequantize_rows(q, np.float32).shape == (3, 0)
    assert max_abs_error(np.zeros((3, 0), np.float32), q) == 0.0


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
@pytest.mark.parametrize("bits", BITS)
def test_low_precision_inputs_round_trip_in_their_dtype(dtype: np.dtype, bits: int) -> None:
    values = (heavy_tailed(200, 40, seed=4) * 0.05).astype(dtype)
    q = quantize_rows(values, bits)
    out = dequantize_rows(q, dtype)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out.astype(np.float64), rebuild(q, np.dtype(dtype)).astype(np.float64))
    assert_error_bound(values, q, np.dtype(dtype))
    # max_abs_error measures what the reader gets back, after the cast to the tensor's dtype ...
    expected = np.abs(rebuild(q, np.dtype(dtype)).astype(np.float64) - values.astype(np.float64)).max()
    assert max_abs_error(values, q) == expected
    # ... and the cast matters: measured before it, the error differs.
    unrounded = np.abs(rebuild(q, np.dtype(np.float64)) - values.astype(np.float64)).max()
    assert max_abs_error(values, q, dtype=np.float64) == unrounded != expected


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_values_at_the_top_of_the_dtype_stay_finite(dtype: type) -> None:
    # With these rows the float32 scale rounds up, and offset + levels * scale lands past float32's largest
    # value by more than half an ulp: a plain cast would give infinity.
    top = np.finfo(dtype).max
    values = np.array([[-1.8498598e38, top], [-1.3942567e37, top], [top, top]], dtype=np.float32).clip(-top, top)
    values = values.astype(dtype)
    for bits in BITS:
        out = dequantize_rows(quantize_rows(values, bits), dtype)
        assert np.all(np.isfinite(out)) and np.all(out[:, -1] == top)


def test_max_abs_error_matches_an_independent_computation() -> None:
    values = heavy_tailed(120, 33, seed=5)
    for bits in BITS:
        q = quantize_rows(values, bits)
        expected = np.abs(rebuild(q, np.dtype(np.float32)).astype(np.float64) - values.astype(np.float64)).max()
        assert max_abs_error(values, q) == expected > 0


def test_non_contiguous_input() -> None:
    values = heavy_tailed(64, 40, seed=6)
    strided = np.asfortranarray(values)[:, ::2]
    q, expected = quantize_rows(strided, 4), quantize_rows(np.ascontiguousarray(strided), 4)
    np.testing.assert_array_equal(q.codes, expected.codes)
    np.testing.assert_array_equal(q.scale, expected.scale)


@settings(max_examples=60, deadline=None)
@given(
    values=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
        elements=st.floats(-(2.0**100), 2.0**100, width=32, allow_subnormal=True),
    ),
    bits=st.sampled_from(BITS),
)
def test_property_error_bound_and_never_worse(values: np.ndarray, bits: int) -> None:
    q = quantize_rows(values, bits)
    assert_error_bound(values, q, np.dtype(np.float32))
    x = values.astype(np.float64)
    # Against a float64 min/max quantizer, allow for storing scale and offset in float32: that moves each level
    # by up to ~2**-24 of the row's magnitude (or, for subnormal scales, up to a level's count of 2**-149).
    shift = np.abs(x).max(axis=1) * 2.0**-21 + levels(bits) * 2.0**-149
    assert np.all(np.sqrt(sse(values, q)) <= np.sqrt(minmax_sse(values, bits)) + np.sqrt(values.shape[1]) * shift)
    constant = x.min(axis=1) == x.max(axis=1)
    assert np.all(dequantize_rows(q, np.float32)[constant] == values[constant])


# --- size and speed -------------------------------------------------------------------------------------------


def test_memory_stays_bounded() -> None:
    values = heavy_tailed(100_000, 16, seed=7)
    tracemalloc.start()
    try:
        q = quantize_rows(values, 8)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The work is done in blocks: beyond the result itself, only a few MiB of temporaries.
    assert peak < q.nbytes + 8 * 2**20, (peak, q.nbytes)


def test_speed_is_vectorised() -> None:
    values = heavy_tailed(20_000, 64, seed=8)
    started = time.perf_counter()
    quantize_rows(values, 4)
    # About 0.2 s on one core; a loop over rows in Python would take tens of seconds.
    assert time.perf_counter() - started < 5.0


# --- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_refuses_non_finite_values_naming_the_row(bad: float) -> None:
    values = heavy_tailed(5000, 64, seed=9)  # several blocks: the row number must count from the tensor start
    values[4321, 17] = bad
    values[4500, 0] = np.nan
    with pytest.raises(ValueError, match=r"row 4321 contains .*finite"):
        quantize_rows(values, 8)


def test_refuses_float64_beyond_float32_range() -> None:
    values = np.ones((3, 4))
    values[2, 1] = 1e300
    with pytest.raises(ValueError, match=r"row 2 .*float32 range"):
        quantize_rows(values, 8)


@pytest.mark.parametrize("shape", [(8,), (2, 3, 4), ()])
def test_refuses_non_matrix_input(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(np.zeros(shape, np.float32), 8)


@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.bool_, np.complex64, ml_dtypes.float8_e4m3fn])
def test_refuses_non_float_input(dtype: type) -> None:
    with pytest.raises(TypeError, match="without quantization"):
        quantize_rows(np.zeros((2, 2), dtype), 8)


@pytest.mark.parametrize("bits", [0, 2, 16, 8.0, True, "8", None])
def test_refuses_unsupported_bits(bits: object) -> None:
    with pytest.raises(ValueError, match=r"bits must be one of \(4, 8\)"):
        quantize_rows(np.zeros((2, 2), np.float32), bits)  # type: ignore[arg-type]


def test_refuses_mismatched_parts() -> None:
    q = quantize_rows(heavy_tailed(4, 5), 4)
    with pytest.raises(ValueError, match="pack into 4"):
        QuantizedRows(q.codes, q.scale, q.offset, bits=4, columns=7)
    with pytest.raises(ValueError, match="pack into 5"):
        QuantizedRows(q.codes, q.scale, q.offset, bits=8, columns=5)
    with pytest.raises(ValueError, match="scale must be a float32"):
        QuantizedRows(q.codes, q.scale.astype(np.float64), q.offset, bits=4, columns=5)
    with pytest.raises(ValueError, match="offset must be a float32 numpy array of shape \\(4,\\)"):
        QuantizedRows(q.codes, q.scale, q.offset[:3], bits=4, columns=5)
    with pytest.raises(ValueError, match="codes must be a 2-D uint8"):
        QuantizedRows(q.codes.astype(np.int16), q.scale, q.offset, bits=4, columns=5)
    with pytest.raises(ValueError, match="pass the values the rows were quantized from"):
        max_abs_error(heavy_tailed(4, 6), q)
    with pytest.raises(TypeError, match="cannot dequantize to int32"):
        dequantize_rows(q, np.int32)
