"""Zarr-python data types for the ``ml_dtypes`` floats that TensorStore writes.

TensorStore's ``zarr3`` driver stores ``bfloat16`` and the float8 family under their ``ml_dtypes``
names (``"data_type": "bfloat16"``, ``"float8_e4m3fn"``, ...), which are not in the Zarr v3 core
spec, so out of the box zarr-python 3.1 fails with ``No Zarr data type found that matches
'bfloat16'``. This module defines one zarr-python ``ZDType`` per such type so that arrays written by
TensorStore (and so by arrayckpt) open with plain ``zarr.open_array``, and so that zarr-python can
write arrays of these types that TensorStore reads back bit for bit.

The classes are listed under the ``zarr.data_type`` entry-point group in ``pyproject.toml``.
zarr-python 3.1 only *collects* that group into ``data_type_registry._lazy_load_list`` and never
loads it by itself, so arrayckpt installs a start-up hook (``arrayckpt-zarr-dtypes.pth`` running
``_arrayckpt_zarr_hook``) that calls :func:`register` right after ``import zarr``; where ``.pth``
files are not processed (``python -S``, frozen apps), import this module (or ``arrayckpt``) first.

Fill values use the Zarr v3 float encoding, matching TensorStore: a JSON number for finite values,
``"Infinity"``/``"-Infinity"``, ``"NaN"`` for the canonical NaN, and a big-endian hex string of the
raw bits (``"0x7fc1"``, ``"0x7f"``) for any other NaN. ``float8_e8m0fnu`` is always written as hex
(except ``"NaN"``) because TensorStore <= 0.1.86 converts numbers to and from that type with the
wrong exponent bias; hex is read back exactly by every reader.

Importing this module imports numpy, ml_dtypes and zarr's dtype machinery only (never torch); its one
side effect is registering the types with zarr's data type registry.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Self, TypeGuard, cast, overload

import ml_dtypes
import numpy as np
from zarr.core.dtype import data_type_registry
from zarr.core.dtype.common import (
    DataTypeValidationError,
    DTypeConfig_V2,
    DTypeJSON,
    HasEndianness,
    HasItemSize,
    check_dtype_spec_v2,
)
from zarr.core.dtype.wrapper import ZDType

if TYPE_CHECKING:
    from zarr.core.common import JSON, ZarrFormat

__all__ = [
    "SUPPORTED_DTYPES",
    "BFloat16",
    "Float8E3M4",
    "Float8E4M3B11FNUZ",
    "Float8E4M3FN",
    "Float8E4M3FNUZ",
    "Float8E5M2",
    "Float8E5M2FNUZ",
    "Float8E8M0FNU",
    "MLDtypesFloat",
    "register",
]

_SPECIAL_FLOATS: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


@dataclass(frozen=True, kw_only=True)
class MLDtypesFloat(ZDType[np.dtype[Any], np.generic], HasItemSize):
    """Base class: a Zarr data type wrapping one ``ml_dtypes`` floating-point numpy dtype.

    Subclasses set ``_zarr_v3_name`` (the name TensorStore writes) and ``dtype_cls`` (the numpy
    dtype class of the ``ml_dtypes`` type, e.g. ``type(np.dtype(ml_dtypes.bfloat16))``). Zarr v2
    uses the same bare name as its ``dtype`` (that is what TensorStore's ``zarr`` driver writes).
    """

    @classmethod
    def _native(cls) -> np.dtype[Any]:
        """The native-byte-order numpy dtype of this type."""
        return cls.dtype_cls()  # type: ignore[call-overload]  # a DType class (numpy's stubs type only np.dtype())

    @classmethod
    def _uint(cls) -> type[np.unsignedinteger[Any]]:
        """The unsigned integer type with the same width, used to read and write raw bits."""
        return np.uint8 if cls._native().itemsize == 1 else np.uint16

    @property
    def item_size(self) -> int:
        """The size of one element in bytes."""
        return self._native().itemsize

    # --- native dtype ---------------------------------------------------------------------------

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> Self:
        """Wrap ``dtype`` if it is exactly this ``ml_dtypes`` type, else raise DataTypeValidationError."""
        if cls._check_native_dtype(dtype):
            return cls()
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {cls._native()}")

    def to_native_dtype(self) -> np.dtype[Any]:
        """The numpy dtype (``ml_dtypes`` types only exist in native byte order)."""
        return self._native()

    # --- data type JSON -------------------------------------------------------------------------

    @classmethod
    def _check_json_v2(cls, data: DTypeJSON) -> TypeGuard[DTypeConfig_V2[str, None]]:
        """Whether ``data`` is this type's Zarr v2 spec (``{"name": <name>, "object_codec_id": None}``)."""
        return check_dtype_spec_v2(data) and data["name"] == cls._zarr_v3_name and data["object_codec_id"] is None

    @classmethod
    def _from_json_v2(cls, data: DTypeJSON) -> Self:
        """Parse the Zarr v2 data type JSON."""
        if cls._check_json_v2(data):
            return cls()
        raise DataTypeValidationError(
            f"Invalid JSON representation of {cls.__name__}. Got {data!r}, expected {cls._zarr_v3_name!r}."
        )

    @classmethod
    def _from_json_v3(cls, data: DTypeJSON) -> Self:
        """Parse the Zarr v3 ``data_type`` JSON (the bare name)."""
        if data == cls._zarr_v3_name:
            return cls()
        raise DataTypeValidationError(
            f"Invalid JSON representation of {cls.__name__}. Got {data!r}, expected {cls._zarr_v3_name!r}."
        )

    @overload
    def to_json(self, zarr_format: Literal[2]) -> DTypeConfig_V2[str, None]: ...

    @overload
    def to_json(self, zarr_format: Literal[3]) -> str: ...

    def to_json(self, zarr_format: ZarrFormat) -> DTypeConfig_V2[str, None] | str:
        """The data type JSON: the bare name for v3, ``{"name", "object_codec_id"}`` for v2."""
        if zarr_format == 2:
            return {"name": self._zarr_v3_name, "object_codec_id": None}
        if zarr_format == 3:
            return self._zarr_v3_name
        raise ValueError(f"zarr_format must be 2 or 3, got {zarr_format}")  # pragma: no cover

    # --- scalars --------------------------------------------------------------------------------

    def _from_bits(self, bits: int) -> np.generic:
        """The scalar whose raw bits are ``bits``."""
        return cast(np.generic, np.array(bits, dtype=self._uint()).view(self._native())[()])  # 0-d: a scalar

    def _to_bits(self, value: np.generic) -> int:
        """The raw bits of a scalar of this type."""
        return int(np.asarray(value, dtype=self._native()).view(self._uint())[()])

    def _from_float(self, value: float) -> np.generic:
        """Round a Python float to this type (round to nearest even, as ml_dtypes and TensorStore do)."""
        return cast(np.generic, np.array(value, dtype=np.float64).astype(self._native())[()])  # 0-d: a scalar

    def _canonical_nan_bits(self) -> int:
        """The bits of the NaN that ``"NaN"`` denotes: what ml_dtypes (and TensorStore) make of a NaN."""
        return self._to_bits(self._from_float(math.nan))

    def _from_string(self, data: str) -> np.generic:
        """Parse ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, a hex bit pattern or a decimal string."""
        if data in _SPECIAL_FLOATS:
            if data == "NaN":
                return self._from_bits(self._canonical_nan_bits())
            return self._from_float(_SPECIAL_FLOATS[data])
        if data.startswith("0x"):
            digits = data[2:]
            if not (1 <= len(digits) <= 2 * self.item_size and all(c in _HEX_DIGITS for c in digits)):
                raise ValueError(
                    f"Invalid hex fill value {data!r} for {self._zarr_v3_name}: expected '0x' and at most "
                    f"{2 * self.item_size} hex digits"
                )
            return self._from_bits(int(digits, 16))
        return self._from_float(float(data))  # "1.5", "nan", "inf": raises ValueError if not a float

    def _check_scalar(self, data: object) -> bool:
        """Whether ``data`` can be cast to this type (numbers, numpy scalars, float strings)."""
        if isinstance(data, np.generic) and data.dtype == self._native():
            return True
        if isinstance(data, str):
            try:
                self._from_string(data)
            except (ValueError, OverflowError):
                return False
            return True
        return isinstance(data, int | float | np.integer | np.floating | np.bool_) or hasattr(data, "__float__")

    def cast_scalar(self, data: object) -> np.generic:
        """Cast ``data`` to a scalar of this type; a scalar already of this type keeps its exact bits."""
        if isinstance(data, np.generic) and data.dtype == self._native():
            return data
        if not self._check_scalar(data):
            raise TypeError(
                f"Cannot convert object {data!r} with type {type(data)} to a scalar compatible with "
                f"the data type {self}."
            )
        if isinstance(data, str):
            return self._from_string(data)
        return self._from_float(float(data))  # type: ignore[arg-type]

    def default_scalar(self) -> np.generic:
        """The all-zero bit pattern (0.0 for every type but float8_e8m0fnu, which has no zero)."""
        return self._from_bits(0)

    def from_json_scalar(self, data: JSON, *, zarr_format: ZarrFormat) -> np.generic:
        """Decode a JSON fill value (number, special string or hex bits) to a scalar of this type."""
        if isinstance(data, bool) or not isinstance(data, int | float | str):
            raise TypeError(f"Invalid fill value {data!r} for {self._zarr_v3_name}: expected a float")
        if isinstance(data, str):
            return self._from_string(data)
        return self._from_float(float(data))

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> float | str:
        """Encode a scalar as TensorStore does: number, "NaN"/"Infinity"/"-Infinity", or hex bits."""
        value = self.cast_scalar(data)
        bits = self._to_bits(value)
        as_float = float(value)
        if math.isnan(as_float):
            if bits == self._canonical_nan_bits() or zarr_format == 2:  # v2 has no hex encoding
                return "NaN"
            return self._hex(bits)
        if math.isinf(as_float):
            return "Infinity" if as_float > 0 else "-Infinity"
        return as_float

    def _hex(self, bits: int) -> str:
        """The Zarr v3 hex encoding of raw bits (big-endian, two digits per byte)."""
        return f"0x{bits:0{2 * self.item_size}x}"


@dataclass(frozen=True, kw_only=True)
class BFloat16(MLDtypesFloat, HasEndianness):
    """``bfloat16`` (ml_dtypes.bfloat16). Two bytes, so the ``bytes`` codec carries an endianness."""

    dtype_cls = type(np.dtype(ml_dtypes.bfloat16))
    _zarr_v3_name = "bfloat16"

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> Self:
        """Wrap a native-byte-order bfloat16 numpy dtype."""
        if cls._check_native_dtype(dtype):
            return cls(endianness=sys.byteorder)  # ml_dtypes types are always native-endian
        raise DataTypeValidationError(f"Invalid data type: {dtype}. Expected {cls._native()}")

    def to_native_dtype(self) -> np.dtype[Any]:
        """The numpy dtype; ml_dtypes has no byte-swapped bfloat16, so only native order works."""
        if self.endianness != sys.byteorder:
            raise ValueError(
                f"bfloat16 data stored {self.endianness}-endian cannot be viewed on this "
                f"{sys.byteorder}-endian machine (ml_dtypes types only exist in native byte order)"
            )
        return self._native()


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FN(MLDtypesFloat):
    """``float8_e4m3fn``: no infinities, NaN is ``0x7f``/``0xff``."""

    dtype_cls = type(np.dtype(ml_dtypes.float8_e4m3fn))
    _zarr_v3_name = "float8_e4m3fn"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2(MLDtypesFloat):
    """``float8_e5m2``: IEEE-like, with infinities and several NaNs (canonical ``0x7e``)."""

    dtype_cls = type(np.dtype(ml_dtypes.float8_e5m2))
    _zarr_v3_name = "float8_e5m2"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3FNUZ(MLDtypesFloat):
    """``float8_e4m3fnuz``: no infinities, no negative zero, the only NaN is ``0x80``."""

    dtype_cls = type(np.dtype(ml_dtypes.float8_e4m3fnuz))
    _zarr_v3_name = "float8_e4m3fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E5M2FNUZ(MLDtypesFloat):
    """``float8_e5m2fnuz``: no infinities, no negative zero, the only NaN is ``0x80``."""

    dtype_cls = type(np.dtype(ml_dtypes.float8_e5m2fnuz))
    _zarr_v3_name = "float8_e5m2fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E4M3B11FNUZ(MLDtypesFloat):
    """``float8_e4m3b11fnuz``: like e4m3fnuz with exponent bias 11."""

    dtype_cls = type(np.dtype(ml_dtypes.float8_e4m3b11fnuz))
    _zarr_v3_name = "float8_e4m3b11fnuz"


@dataclass(frozen=True, kw_only=True)
class Float8E3M4(MLDtypesFloat):
    """``float8_e3m4``: IEEE-like, with infinities and NaNs (canonical ``0x78``)."""

    dtype_cls = type(np.dtype(ml_dtypes.float8_e3m4))
    _zarr_v3_name = "float8_e3m4"


@dataclass(frozen=True, kw_only=True)
class Float8E8M0FNU(MLDtypesFloat):
    """``float8_e8m0fnu`` (MX scale): powers of two 2**-127..2**127 and NaN ``0xff``; no zero, no sign.

    A numeric zero fill value (what TensorStore and arrayckpt write by default) means the all-zero
    bits (2**-127), which is also what TensorStore stores for it; other values are written as hex.
    """

    dtype_cls = type(np.dtype(ml_dtypes.float8_e8m0fnu))
    _zarr_v3_name = "float8_e8m0fnu"

    def _from_float(self, value: float) -> np.generic:
        """Round to this type; zero (unrepresentable, ml_dtypes would give NaN) maps to bits 0x00."""
        if value == 0.0:
            return self._from_bits(0)
        return super()._from_float(value)

    def to_json_scalar(self, data: object, *, zarr_format: ZarrFormat) -> float | str:
        """``"NaN"`` or, in Zarr v3, the hex bits (TensorStore misreads numbers for this type)."""
        value = self.cast_scalar(data)
        if zarr_format == 3 and not math.isnan(float(value)):
            return self._hex(self._to_bits(value))
        return super().to_json_scalar(value, zarr_format=zarr_format)


SUPPORTED_DTYPES: tuple[type[MLDtypesFloat], ...] = (
    BFloat16,
    Float8E4M3FN,
    Float8E5M2,
    Float8E4M3FNUZ,
    Float8E5M2FNUZ,
    Float8E8M0FNU,
    Float8E4M3B11FNUZ,
    Float8E3M4,
)
"""Every data type defined here, in the order of the ``zarr.data_type`` entry points."""


def register() -> None:
    """Register every type in :data:`SUPPORTED_DTYPES` with zarr's data type registry (idempotent)."""
    for cls in SUPPORTED_DTYPES:
        data_type_registry.register(cls._zarr_v3_name, cls)


register()
