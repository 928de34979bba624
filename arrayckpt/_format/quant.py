"""Lossy row-wise quantization of embedding rows for incremental (delta) checkpoints.

Check-N-Run (Eisenman et al., "Check-N-Run: a Checkpointing System for Training Deep Learning
Recommendation Models", NSDI 2022) makes recommendation-model checkpoints small in two steps: a differential
checkpoint stores only the embedding rows that changed, and those rows are quantized to a few bits each.  Of
the schemes it compares (uniform, k-means and adaptive uniform quantization) it settles on adaptive asymmetric
quantization, which is what this module implements: asymmetric uniform quantization with one range per row,
the range chosen to minimise the row's L2 reconstruction error.

* Every row gets its own clipping range ``[lo, hi]`` and ``2**bits`` evenly spaced levels across it, so a
  row of small values keeps its precision next to a row of large ones.  A value is stored as the code
  ``round((value - lo) / scale)`` clamped to ``[0, 2**bits - 1]``, with ``scale = (hi - lo) / (2**bits - 1)``,
  and read back as ``offset + scale * code`` with ``offset = lo``.
* Embedding rows are heavy-tailed: a few outliers would stretch a min/max range and leave the levels too far
  apart for everything else.  The range is therefore found by FBGEMM's greedy row-wise search
  (``param_search_greedy``, the search behind Check-N-Run's adaptive quantization): start from ``[min, max]``
  and, one step of ``(max - min) / 200`` at a time, shrink whichever end lowers the L2 error more, for at most
  16 % of the width (32 steps), keeping the best range seen.  Outliers then clamp to the nearest end of the
  range, which costs less in total than the coarse levels they would otherwise force on the whole row.

Differences from FBGEMM, all deliberate: ``scale`` and ``offset`` are float32 (FBGEMM stores float16 to save 4
bytes a row, but float16 cannot hold offsets beyond 65504 or small scales, and rounding them moves every level);
the search keeps the best range it visits rather than only strict local optima; and a final float64 check keeps
plain ``[min, max]`` for any row where the search did not actually lower the error, so the chosen range is never
worse than min/max.  4-bit codes are packed two to a byte, the even column in the low nibble (FBGEMM's layout).
A constant row gets scale 0 and comes back exactly (a float64 one at float32 precision, and -0.0 as 0.0).

>>> import numpy as np
>>> rows = np.array([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0]], dtype=np.float32)
>>> q = quantize_rows(rows, 8)
>>> q.codes.shape, q.scale.dtype.name
((2, 4), 'float32')
>>> dequantize_rows(q, np.float32)[1].tolist()  # a constant row has scale 0 and comes back exactly
[5.0, 5.0, 5.0, 5.0]
>>> max_abs_error(rows, q) < 3.0 / 255
True
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

__all__ = [
    "BITS",
    "SEARCH_BINS",
    "SEARCH_RATIO",
    "QuantizedRows",
    "dequantize_rows",
    "max_abs_error",
    "packed_columns",
    "quantize_rows",
]

BITS = (4, 8)
# FBGEMM's parameters for the greedy range search: the step is 1/SEARCH_BINS of the row's width, and at most
# SEARCH_RATIO of the width is clipped away in total.
SEARCH_BINS = 200
SEARCH_RATIO = 0.16
_SHRINK_STEPS = round(SEARCH_BINS * SEARCH_RATIO)  # 32 steps, each trying two candidate ranges

# Rows are processed in blocks of about this many values, so the float64/float32 temporaries stay a few MiB
# (and mostly in cache) however many rows a tensor has.
_BLOCK_VALUES = 1 << 16

_FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")  # dtypes quantization accepts (numpy made lazily)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True, eq=False)
class QuantizedRows:
    """Quantized rows: row ``i`` reads back as ``offset[i] + scale[i] * code`` for each of its codes.

    The arrays are stored as they are, so a reader can rebuild this from what it loaded; construction checks
    that they fit together, since a mismatch would otherwise surface as a wrong tensor much later.
    """

    codes: np.ndarray  # uint8 [n, packed_columns(columns, bits)]; 4-bit: two codes a byte, even column low
    scale: np.ndarray  # float32 [n]; 0 for a constant row
    offset: np.ndarray  # float32 [n]; the low end of the clipping range
    bits: int
    columns: int  # number of columns before packing

    def __post_init__(self) -> None:
        """Refuse arrays that cannot be the output of :func:`quantize_rows` for these bits and columns."""
        _check_bits(self.bits)
        if isinstance(self.columns, bool) or not isinstance(self.columns, int | np.integer) or self.columns < 0:
            raise ValueError(f"columns must be a non-negative int, got {self.columns!r}")
        if not isinstance(self.codes, np.ndarray) or self.codes.dtype != np.uint8 or self.codes.ndim != 2:
            raise ValueError(
                f"codes must be a 2-D uint8 numpy array, got {_describe(self.codes)}; "
                "pass the codes array written by quantize_rows unchanged"
            )
        rows, width = self.codes.shape
        expected = packed_columns(self.columns, self.bits)
        if width != expected:
            raise ValueError(
                f"codes have {width} columns but {self.columns} columns at {self.bits} bits pack into {expected}; "
                "check that bits and columns are the ones the codes were written with"
            )
        for name in ("scale", "offset"):
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.dtype != np.float32 or array.shape != (rows,):
                raise ValueError(
                    f"{name} must be a float32 numpy array of shape ({rows},) to match the codes, "
                    f"got {_describe(array)}"
                )

    @property
    def rows(self) -> int:
        """Number of quantized rows."""
        return int(self.codes.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by codes, scales and offsets: what a delta checkpoint stores for these rows."""
        return int(self.codes.nbytes + self.scale.nbytes + self.offset.nbytes)


def packed_columns(columns: int, bits: int) -> int:
    """Width in bytes of one row of codes: 8-bit codes take a byte each, 4-bit codes two to a byte."""
    _check_bits(bits)
    if columns < 0:
        raise ValueError(f"columns must be non-negative, got {columns}")
    per_byte = 8 // bits
    return (columns + per_byte - 1) // per_byte


def quantize_rows(values: np.ndarray, bits: int, *, optimize_range: bool = True) -> QuantizedRows:
    """Quantize each row of a 2-D float array to ``bits``-bit codes with its own scale and offset.

    ``optimize_range=False`` uses plain ``[min, max]`` ranges: about 10x faster, with larger errors on rows with
    outliers.  Raises ValueError for NaN or infinity (naming the first bad row), for float64 values beyond
    float32 range (scale and offset are float32), for arrays that are not 2-D, and for ``bits`` not in BITS;
    TypeError for non-float arrays.
    """
    _check_bits(bits)
    array = _float_matrix(values)
    rows, columns = array.shape
    codes = np.zeros((rows, packed_columns(columns, bits)), dtype=np.uint8)
    scale = np.zeros(rows, dtype=np.float32)
    offset = np.zeros(rows, dtype=np.float32)
    if columns:  # rows without columns hold no values: zero scales and offsets describe them exactly
        for start, stop in _row_blocks(rows, columns):
            block = array[start:stop].astype(np.float64)
            _check_representable(block, start)
            block_codes, scale[start:stop], offset[start:stop] = _quantize_block(block, bits, optimize_range)
            codes[start:stop] = _pack(block_codes, bits)
    return QuantizedRows(codes=codes, scale=scale, offset=offset, bits=int(bits), columns=columns)


def dequantize_rows(q: QuantizedRows, dtype: DTypeLike) -> np.ndarray:
    """Rebuild the rows as ``dtype`` (float16, bfloat16, float32 or float64).

    Each value is computed in float64 and rounded once to ``dtype``, saturating at its largest finite value:
    a reconstruction can exceed the original maximum by a float32 rounding of the scale, which must not turn a
    value near the top of float16 into infinity.
    """
    out_dtype = _float_dtype(dtype, "dequantize to")
    out = np.empty((q.rows, q.columns), dtype=out_dtype)
    for start, stop in _row_blocks(q.rows, q.columns):
        out[start:stop] = _dequantize_block(q, start, stop, out_dtype)
    return out


def max_abs_error(values: np.ndarray, q: QuantizedRows, dtype: DTypeLike | None = None) -> float:
    """Largest ``|dequantized - values|`` over all elements, computed exactly in float64.

    The rows are rebuilt as ``dtype`` (by default the dtype of ``values``, which is what a reader restoring the
    tensor gets), so the rounding of that final cast is part of the error reported.
    """
    array = _float_matrix(values)
    if array.shape != (q.rows, q.columns):
        raise ValueError(
            f"values have shape {array.shape} but the quantized rows have shape {(q.rows, q.columns)}; "
            "pass the values the rows were quantized from"
        )
    out_dtype = _float_dtype(array.dtype if dtype is None else dtype, "dequantize to")
    worst = 0.0
    for start, stop in _row_blocks(q.rows, q.columns):
        rebuilt = _dequantize_block(q, start, stop, out_dtype).astype(np.float64)
        worst = max(worst, float(np.abs(rebuilt - array[start:stop].astype(np.float64)).max(initial=0.0)))
    return worst


# --- quantization ---------------------------------------------------------------------------------------------


def _quantize_block(block: np.ndarray, bits: int, optimize_range: bool) -> tuple[np.ndarray, ...]:
    """Codes, float32 scales and float32 offsets for a float64 block of rows.

    With the search on, both the searched range and ``[min, max]`` are encoded and each row keeps whichever
    reconstructs it with the smaller float64 L2 error: the search scores ranges in float32, so this makes
    "never worse than min/max" exact rather than nearly so.
    """
    low, high = block.min(axis=1), block.max(axis=1)
    codes, scale, offset, sse = _encode(block, low, high, bits)
    if optimize_range:
        searched = _encode(block, *_search_range(block, low, high, bits), bits)
        better = searched[3] < sse
        codes = np.where(better[:, None], searched[0], codes)
        scale = np.where(better, searched[1], scale)
        offset = np.where(better, searched[2], offset)
    return codes, scale, offset


def _encode(block: np.ndarray, low: np.ndarray, high: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
    """Round a float64 block to the nearest level of each row's range; return codes, scale, offset, L2 error².

    Codes are computed against the float32 scale and offset that get stored, so every value inside the stored
    range is within ``scale / 2`` of its reconstruction.  A zero scale (constant row, or a range too narrow for
    float32) divides by 1 instead: every code is then 0 and the row reads back as its offset.
    """
    levels = (1 << bits) - 1
    scale = ((high - low) / levels).astype(np.float32)
    offset = low.astype(np.float32)
    scale64 = scale.astype(np.float64)[:, None]
    offset64 = offset.astype(np.float64)[:, None]
    steps = block - offset64
    steps /= np.where(scale64 > 0, scale64, 1.0)
    np.rint(steps, out=steps)
    np.clip(steps, 0, levels, out=steps)
    codes = steps.astype(np.uint8)
    steps *= scale64  # now the reconstruction error, reusing the buffer
    steps += offset64
    steps -= block
    return codes, scale, offset, np.einsum("ij,ij->i", steps, steps)


def _search_range(block: np.ndarray, low: np.ndarray, high: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """FBGEMM's greedy clipping-range search, run for all rows of a block at once.

    Each row is first mapped onto [0, 1] so that every candidate range is ``[i, 1 - j] / SEARCH_BINS`` for
    small integers i and j, the same grid for every row and free of overflow for huge values.  Every
    row takes exactly ``_SHRINK_STEPS`` steps, so the walk is a fixed loop over vectors of (i, j).
    """
    levels = np.float32((1 << bits) - 1)
    width = high - low
    unit = ((block - low[:, None]) / np.where(width > 0, width, 1.0)[:, None]).astype(np.float32)
    rows = len(block)
    cut_low = np.zeros(rows, dtype=np.int32)
    cut_high = np.zeros(rows, dtype=np.int32)
    scratch = (np.empty((2, *unit.shape), np.float32), np.empty((2, *unit.shape), np.float32))
    current = _unit_losses(unit, cut_low[None], cut_high[None], levels, tuple(s[:1] for s in scratch))[0]
    best, best_low, best_high = current, cut_low, cut_high
    for _ in range(_SHRINK_STEPS):
        candidates_low = np.stack([cut_low + 1, cut_low])
        candidates_high = np.stack([cut_high, cut_high + 1])
        losses = _unit_losses(unit, candidates_low, candidates_high, levels, scratch)
        raise_low = losses[0] < losses[1]  # FBGEMM's tie-break: move the top end down
        cut_low = cut_low + raise_low
        cut_high = cut_high + ~raise_low
        current = np.where(raise_low, losses[0], losses[1])
        improved = current < best
        best = np.where(improved, current, best)
        best_low = np.where(improved, cut_low, best_low)
        best_high = np.where(improved, cut_high, best_high)
    return low + width * (best_low / SEARCH_BINS), high - width * (best_high / SEARCH_BINS)


def _unit_losses(
    unit: np.ndarray,
    cut_low: np.ndarray,
    cut_high: np.ndarray,
    levels: np.float32,
    scratch: tuple[np.ndarray, ...],
) -> np.ndarray:
    """Squared L2 error of each row of ``unit`` quantized over ``[cut_low, 1 - cut_high] / SEARCH_BINS``.

    ``cut_low``/``cut_high`` have shape [k, rows] (k candidate ranges per row); the result has the same shape.
    The error is measured in units of the step (one pass fewer than rebuilding values) and rescaled at the end.
    """
    steps, codes = scratch
    lo = (cut_low / SEARCH_BINS).astype(np.float32)
    per_unit = (levels / (1 - cut_high / SEARCH_BINS - cut_low / SEARCH_BINS)).astype(np.float32)
    np.multiply(unit, per_unit[..., None], out=steps)
    steps -= (lo * per_unit)[..., None]
    np.rint(steps, out=codes)
    np.clip(codes, 0, levels, out=codes)
    steps -= codes
    squared = np.einsum("kij,kij->ki", steps, steps)
    errors: np.ndarray = squared / (per_unit * per_unit)
    return errors


# --- packing and dequantization -------------------------------------------------------------------------------


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack 4-bit codes two to a byte (even column in the low nibble, a zero high nibble pads an odd count)."""
    if bits == 8:
        return codes
    if codes.shape[1] % 2:
        codes = np.concatenate([codes, np.zeros((codes.shape[0], 1), np.uint8)], axis=1)
    packed: np.ndarray = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed


def _unpack(packed: np.ndarray, bits: int, columns: int) -> np.ndarray:
    """Inverse of :func:`_pack`; the padding nibble of an odd column count is dropped."""
    if bits == 8:
        return packed
    codes = np.empty((packed.shape[0], 2 * packed.shape[1]), np.uint8)
    codes[:, 0::2] = packed & 0x0F
    codes[:, 1::2] = packed >> 4
    return codes[:, :columns]


def _dequantize_block(q: QuantizedRows, start: int, stop: int, dtype: np.dtype) -> np.ndarray:
    """Rows ``start:stop`` rebuilt in float64 and rounded once to ``dtype``, saturating at its finite range."""
    values = _unpack(q.codes[start:stop], q.bits, q.columns).astype(np.float64)
    values *= q.scale[start:stop, None]
    values += q.offset[start:stop, None]
    import ml_dtypes  # here, not at import: half a second of start-up for every CLI command

    limit = float(ml_dtypes.finfo(dtype).max)
    np.clip(values, -limit, limit, out=values)
    return values.astype(dtype)


# --- validation -----------------------------------------------------------------------------------------------


def _row_blocks(rows: int, columns: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` row ranges of about ``_BLOCK_VALUES`` values each (at least one row)."""
    step = max(1, _BLOCK_VALUES // max(columns, 1))
    for start in range(0, rows, step):
        yield start, min(start + step, rows)


def _check_bits(bits: object) -> None:
    """Refuse bit widths without a packing (and bools or floats that merely compare equal to 4 or 8)."""
    if isinstance(bits, bool) or not isinstance(bits, int | np.integer) or int(bits) not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}; use 8 for small errors or 4 for half the size")


def _float_dtype(dtype: DTypeLike, purpose: str) -> np.dtype:
    """The numpy dtype for ``dtype`` if it is one of the float types rows can be quantized from or to."""
    resolved = np.dtype(dtype)
    if resolved.name not in _FLOAT_NAMES or resolved.byteorder == ">":
        names = ", ".join(_FLOAT_NAMES)
        raise TypeError(
            f"cannot {purpose} {resolved.name}: only {names} rows are supported; "
            "store tensors of other dtypes without quantization"
        )
    return resolved


def _float_matrix(values: np.ndarray) -> np.ndarray:
    """``values`` as a 2-D numpy array of a supported float dtype, or a clear error."""
    array = np.asarray(values)
    if array.ndim != 2:
        raise ValueError(
            f"expected a 2-D array of rows, got shape {array.shape}; reshape to (rows, columns) first, "
            "e.g. values.reshape(len(values), -1)"
        )
    _float_dtype(array.dtype, "quantize")
    return array


def _check_representable(block: np.ndarray, first_row: int) -> None:
    """Refuse NaN, infinity and values beyond float32 range, naming the first offending row.

    A single NaN would make its row's scale NaN and every value in it unrecoverable, so it is an error rather
    than something to quantize; float32 is the precision scale and offset are stored in.
    """
    finite = np.isfinite(block).all(axis=1)
    if not finite.all():
        row = int(np.argmin(finite))
        bad = block[row][~np.isfinite(block[row])][0]
        raise ValueError(
            f"row {first_row + row} contains {bad}; quantization needs finite values: fix the tensor or save it "
            "without quantization"
        )
    in_range = (np.abs(block) <= _FLOAT32_MAX).all(axis=1)
    if not in_range.all():
        row = int(np.argmin(in_range))
        raise ValueError(
            f"row {first_row + row} has values beyond float32 range (largest magnitude "
            f"{np.abs(block[row]).max():.6g}); scales and offsets are float32: save this tensor without quantization"
        )


def _describe(array: object) -> str:
    """Short description of something passed where a numpy array was expected, for error messages."""
    if isinstance(array, np.ndarray):
        return f"{array.dtype.name} array of shape {array.shape}"
    return type(array).__name__
