"""The dtype table: torch dtype <-> Zarr v3 ``data_type`` name <-> numpy dtype.

One name serves as both the torch dtype name (``torch.<name>``) and the Zarr v3 data type name that
TensorStore writes, so the manifest needs a single ``dtype`` field.  Types without a numpy equivalent
(bfloat16, the float8 family) map to ``ml_dtypes``; conversions between torch and numpy are views of the
same memory through a same-width integer type, never copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

from .._errors import FormatError, StateError

__all__ = [
    "DTYPES",
    "DType",
    "dtype_by_name",
    "dtype_of_numpy",
    "dtype_of_torch",
    "numpy_view",
    "torch_view",
]


@dataclass(frozen=True)
class DType:
    """One row of the dtype table."""

    name: str  # Zarr v3 data_type and torch.<name>
    torch: torch.dtype
    numpy: np.dtype
    # torch dtype of the same width that numpy understands natively; ``None`` when numpy does.
    carrier: torch.dtype | None = None

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


def _row(name: str, numpy_dtype: object, carrier: torch.dtype | None = None) -> DType:
    return DType(name, getattr(torch, name), np.dtype(numpy_dtype), carrier)


_ROWS = [
    _row("bool", np.bool_),
    _row("uint8", np.uint8),
    _row("int8", np.int8),
    _row("int16", np.int16),
    _row("int32", np.int32),
    _row("int64", np.int64),
    _row("uint16", np.uint16),
    _row("uint32", np.uint32),
    _row("uint64", np.uint64),
    _row("float16", np.float16),
    _row("float32", np.float32),
    _row("float64", np.float64),
    _row("complex64", np.complex64),
    _row("complex128", np.complex128),
    _row("bfloat16", ml_dtypes.bfloat16, torch.int16),
    _row("float8_e4m3fn", ml_dtypes.float8_e4m3fn, torch.uint8),
    _row("float8_e5m2", ml_dtypes.float8_e5m2, torch.uint8),
    _row("float8_e4m3fnuz", ml_dtypes.float8_e4m3fnuz, torch.uint8),
    _row("float8_e5m2fnuz", ml_dtypes.float8_e5m2fnuz, torch.uint8),
]
if hasattr(torch, "float8_e8m0fnu") and hasattr(ml_dtypes, "float8_e8m0fnu"):
    _ROWS.append(_row("float8_e8m0fnu", ml_dtypes.float8_e8m0fnu, torch.uint8))

DTYPES: dict[str, DType] = {row.name: row for row in _ROWS}
_BY_TORCH: dict[torch.dtype, DType] = {row.torch: row for row in _ROWS}
_BY_NUMPY: dict[np.dtype, DType] = {row.numpy: row for row in _ROWS}


def dtype_by_name(name: object) -> DType:
    """Parse a manifest/zarr dtype name, failing with the list of known names."""
    try:
        return DTYPES[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise FormatError(f"unknown dtype {name!r}; known dtypes: {', '.join(DTYPES)}") from None


def dtype_of_torch(dtype: torch.dtype, key: str) -> DType:
    """The table row of a torch dtype, or an error naming the key when it cannot be stored."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise StateError(
            f"tensor {key!r} has dtype {dtype}, which arrayckpt cannot store; "
            f"supported: {', '.join(DTYPES)}. Convert it (e.g. .to(torch.float32)) before saving"
        ) from None


def dtype_of_numpy(dtype: np.dtype) -> DType | None:
    """The table row of a numpy dtype (native byte order only), or ``None``."""
    if dtype.byteorder == ">":
        return None
    return _BY_NUMPY.get(dtype.newbyteorder("=") if dtype.byteorder == "<" else dtype)


def numpy_view(tensor: torch.Tensor, dt: DType) -> np.ndarray:
    """A numpy array sharing ``tensor``'s memory (any strides), typed with the table's numpy dtype.

    The tensor must be on the CPU with its lazy conjugate/negative bits resolved.
    """
    if dt.carrier is None:
        return tensor.numpy()
    return tensor.view(dt.carrier).numpy().view(dt.numpy)


def torch_view(array: np.ndarray, dt: DType) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory, typed with the table's torch dtype."""
    if dt.carrier is None:
        return torch.from_numpy(array)
    carrier_np = torch.empty((), dtype=dt.carrier).numpy().dtype
    return torch.from_numpy(array.view(carrier_np)).view(dt.torch)
