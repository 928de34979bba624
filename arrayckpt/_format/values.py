"""Plain (non-tensor) values as typed JSON, so no pickle is needed for the common cases.

JSON alone loses tuples, non-finite floats, bytes and non-string dict keys; the encoding below keeps
them with one-key marker objects (``{"$tuple": [...]}``), and leaves everything else as plain JSON so a
human reading ``zarr.json`` sees ordinary values.  Anything else needs pickle (opt-in).
"""

from __future__ import annotations

import base64
import math
from typing import Any

from .._errors import FormatError

__all__ = ["NotJSONable", "decode_value", "encode_value"]

_MARKERS = ("$tuple", "$float", "$bytes", "$dict")


class NotJSONable(TypeError):
    """Raised by :func:`encode_value` for a value that only pickle can store."""


def encode_value(value: object) -> Any:
    """Encode a plain value as typed JSON, or raise :class:`NotJSONable`."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # IntEnum and friends become plain ints
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"$float": repr(float(value))}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, tuple):
        if hasattr(value, "_fields"):  # a namedtuple would come back as a plain tuple
            raise NotJSONable(type(value).__name__)
        return {"$tuple": [encode_value(v) for v in value]}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, dict):  # OrderedDict and friends come back as plain (ordered) dicts
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: encode_value(v) for k, v in value.items()}
        return {"$dict": [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    raise NotJSONable(type(value).__name__)


def decode_value(data: Any, key: str = "") -> Any:
    """Invert :func:`encode_value`; malformed input raises :class:`FormatError` naming ``key``."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_value(v, key) for v in data]
    if isinstance(data, dict):
        if len(data) == 1 and next(iter(data)) in _MARKERS:
            ((marker, inner),) = data.items()
            try:
                return _decode_marker(marker, inner, key)
            except (TypeError, ValueError) as e:
                raise FormatError(f"value {key!r}: malformed {marker} value {inner!r}") from e
        return {k: decode_value(v, key) for k, v in data.items()}
    raise FormatError(f"value {key!r}: {data!r} is not a valid encoded value")


def _decode_marker(marker: str, inner: Any, key: str) -> Any:
    if marker == "$tuple":
        if not isinstance(inner, list):
            raise TypeError(inner)
        return tuple(decode_value(v, key) for v in inner)
    if marker == "$float":
        if inner not in ("nan", "inf", "-inf"):
            raise ValueError(inner)
        return float(inner)
    if marker == "$bytes":
        return base64.b64decode(inner, validate=True)
    if not isinstance(inner, list) or not all(isinstance(p, list) and len(p) == 2 for p in inner):
        raise TypeError(inner)
    return {decode_value(k, key): decode_value(v, key) for k, v in inner}
