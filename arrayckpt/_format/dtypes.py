"""The dtype table: Zarr v3 ``data_type`` name <-> numpy dtype, with no torch needed.

One name serves as both the torch dtype name (``torch.<name>``) and the Zarr v3 data type name that
TensorStore writes, so the manifest needs a single ``dtype`` field.  Types without a numpy equivalent
(bfloat16, the float8 family) map to ``ml_dtypes``. The torch side of the table (``torch.<name>``, and views
between torch and numpy memory) is ``_torch/dtypes.py``: reading a checkpoint into numpy needs no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from .._errors import FormatError

__all__ = ["DTYPES", "DType", "as_typed", "dtype_by_name", "dtype_of_numpy"]


@dataclass(frozen=True)
class DType:
    """One row of the dtype table. The numpy dtype is made on first use: the ``ml_dtypes`` rows import
    ``ml_dtypes`` (about half a second of start-up) only when their values are touched, so ``arrayckpt info`` on a
    bfloat16 checkpoint never pays for it."""

    name: str  # Zarr v3 data_type and torch.<name>
    itemsize: int
    _source: str = field(repr=False, compare=False)  # "numpy" or "ml_dtypes": the module with the scalar type

    @property
    def native(self) -> bool:
        """Whether numpy has this type itself (else it is ``ml_dtypes``'s, and host views of torch tensors hold its
        bytes under a same-width integer "carrier" type until values are interpreted: :func:`as_typed`)."""
        return self._source == "numpy"

    @functools.cached_property
    def numpy(self) -> np.dtype:
        if self._source == "numpy":
            return np.dtype(self.name)
        import ml_dtypes

        dtype: np.dtype = np.dtype(getattr(ml_dtypes, self.name))
        return dtype

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


_NUMPY_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "float32": 4, "float64": 8, "complex64": 8, "complex128": 16,
}
_ML_DTYPES_ITEMSIZE = {
    "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,  # ml_dtypes 0.5+ (the dependency's floor)
}


DTYPES: dict[str, DType] = {name: DType(name, size, "numpy") for name, size in _NUMPY_ITEMSIZE.items()}
DTYPES.update({name: DType(name, size, "ml_dtypes") for name, size in _ML_DTYPES_ITEMSIZE.items()})


def dtype_by_name(name: object) -> DType:
    """Parse a manifest/zarr dtype name, failing with the list of known names."""
    try:
        return DTYPES[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {name!r}; known dtypes: {', '.join(DTYPES)}") from None


def as_typed(array: np.ndarray, dt: DType) -> np.ndarray:
    """``array`` with values of type ``dt``: itself, or where it holds ``dt``'s bytes under the same-width integer
    carrier (a host view of a bfloat16 or float8 tensor, typed so that a save or load that only moves bytes never
    imports ``ml_dtypes``), a view of it typed as ``dt``. Called where values are interpreted: TensorStore's
    transfers (which would convert integers to floats by value), row overlays, quantization."""
    if dt.native or array.dtype.kind not in "iu" or array.dtype.itemsize != dt.itemsize:
        return array
    return array.view(dt.numpy)


def dtype_of_numpy(dtype: np.dtype) -> DType | None:
    """The table row of a numpy dtype (native byte order only), or ``None``."""
    if dtype.byteorder == ">":
        return None
    native = dtype.newbyteorder("=") if dtype.byteorder == "<" else dtype
    row = DTYPES.get(native.name)  # an ml_dtypes dtype here means ml_dtypes is imported already
    return row if row is not None and row.numpy == native else None
