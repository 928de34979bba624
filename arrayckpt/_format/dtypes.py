"""The dtype table: Zarr v3 ``data_type`` name <-> numpy dtype, with no torch needed.

One name serves as both the torch dtype name (``torch.<name>``) and the Zarr v3 data type name that
TensorStore writes, so the manifest needs a single ``dtype`` field.  Types without a numpy equivalent
(bfloat16, the float8 family) map to ``ml_dtypes``. The torch side of the table (``torch.<name>``, and views
between torch and numpy memory) is ``_torch/dtypes.py``: reading a checkpoint into numpy needs no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .._errors import FormatError

__all__ = ["DTYPES", "DType", "dtype_by_name", "dtype_of_numpy"]


@dataclass(frozen=True)
class DType:
    """One row of the dtype table."""

    name: str  # Zarr v3 data_type and torch.<name>
    numpy: np.dtype

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def fill_value(self) -> object:
        """The fill value written in array metadata (never read: missing chunks are errors)."""
        if self.name == "bool":
            return False
        if self.name == "float8_e8m0fnu":  # has no zero: the all-zero bits, as Zarr's hex form
            return "0x00"
        if self.name.startswith("complex"):
            return [0.0, 0.0]
        if self.name.startswith(("float", "bfloat")):
            return 0.0
        return 0


_NUMPY: dict[str, object] = {
    "bool": np.bool_, "uint8": np.uint8, "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64, "float16": np.float16, "float32": np.float32,
    "float64": np.float64, "complex64": np.complex64, "complex128": np.complex128, "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    _NUMPY["float8_e8m0fnu"] = ml_dtypes.float8_e8m0fnu

DTYPES: dict[str, DType] = {name: DType(name, np.dtype(numpy)) for name, numpy in _NUMPY.items()}
_BY_NUMPY: dict[np.dtype, DType] = {row.numpy: row for row in DTYPES.values()}


def dtype_by_name(name: object) -> DType:
    """Parse a manifest/zarr dtype name, failing with the list of known names."""
    try:
        return DTYPES[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {name!r}; known dtypes: {', '.join(DTYPES)}") from None


def dtype_of_numpy(dtype: np.dtype) -> DType | None:
    """The table row of a numpy dtype (native byte order only), or ``None``."""
    if dtype.byteorder == ">":
        return None
    return _BY_NUMPY.get(dtype.newbyteorder("=") if dtype.byteorder == "<" else dtype)
