"""Plain (non-tensor) values as typed JSON, so no pickle is needed for the common cases.

JSON alone loses tuples, non-finite floats, bytes and non-string dict keys; the encoding below keeps
them with one-key marker objects (``{"$tuple": [...]}``), and leaves everything else as plain JSON so a
human reading ``zarr.json`` sees ordinary values.  Anything else needs pickle (opt-in).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping
from typing import NamedTuple

from .._errors import FormatError

__all__ = ["NotJSONable", "StepValue", "decode_value", "encode_value", "step_value"]

_MARKERS = ("$tuple", "$float", "$bytes", "$dict")
# Nesting deeper than this is refused both ways (a value nested 500 deep would otherwise exhaust Python's
# recursion limit): encoding it raises NotJSONable (pickle, with consent, stores it), decoding a FormatError.
MAX_DEPTH = 200


class NotJSONable(TypeError):
    """Raised by :func:`encode_value` for a value that only pickle can store."""


class StepValue(NamedTuple):
    """The plain value of a state that holds the trainer's step (:func:`step_value`)."""

    key: str
    step: int


def step_value(values: Mapping[str, object]) -> StepValue | None:
    """The trainer's step among a state's plain values (dotted key -> value, encoded or decoded: an int is the same
    in both), when exactly one value can be it: a top-level ``step`` holding an integer, or else the only integer
    value whose last key part is ``step`` (``train_state.step``). ``None`` when there is none, or when several
    nested ones could be it (``a.step`` and ``b.step``: which is the trainer's is not for arrayckpt to guess).
    Tensors (the optimizer's ``state.0.step``) and booleans never count.

    DCP's ``ArrayckptWriter``, which is given no step, records this one in the manifest (so that
    :attr:`Checkpoint.step` sees it); ``arrayckpt info`` and ``report`` point at it where no step is recorded
    (``arrayckpt.save`` records only the ``step=`` it is given).

    >>> step_value({"step": 7, "optim.state.0.step": 3}), step_value({"train_state.step": 5, "lr": 0.1})
    (StepValue(key='step', step=7), StepValue(key='train_state.step', step=5))
    >>> step_value({"a.step": 1, "b.step": 2}), step_value({"step": True}), step_value({"step": "7"})
    (None, None, None)
    """
    found = {key: value for key, value in values.items()
             if (key == "step" or key.endswith(".step")) and type(value) is int}
    if "step" in found:
        return StepValue("step", found["step"])
    return StepValue(*next(iter(found.items()))) if len(found) == 1 else None


def encode_value(value: object) -> object:
    """Encode a plain value as typed JSON, or raise :class:`NotJSONable`."""
    return _encode(value, 0)


def _encode(value: object, depth: int) -> object:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # IntEnum and friends become plain ints
    if isinstance(value, float) and math.isfinite(value):
        return float(value)
    if depth >= MAX_DEPTH:  # what follows is a JSON array or object, as deep as decoding accepts
        raise NotJSONable(f"{type(value).__name__} nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, float):
        return {"$float": repr(float(value))}
    if isinstance(value, list):
        return [_encode(v, depth + 1) for v in value]
    if isinstance(value, tuple):
        if hasattr(value, "_fields"):  # a namedtuple would come back as a plain tuple
            raise NotJSONable(type(value).__name__)
        return {"$tuple": [_encode(v, depth + 1) for v in value]}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, dict):  # OrderedDict and friends come back as plain (ordered) dicts
        if all(isinstance(k, str) and not k.startswith("$") for k in value):
            return {k: _encode(v, depth + 1) for k, v in value.items()}
        return {"$dict": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    raise NotJSONable(type(value).__name__)


def decode_value(data: object, key: str = "") -> object:
    """Invert :func:`encode_value`; malformed input raises :class:`FormatError` naming ``key``."""
    return _decode(data, key, 0)


def _decode(data: object, key: str, depth: int) -> object:
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if depth >= MAX_DEPTH:
        raise FormatError(f"value {key!r} is nested more than {MAX_DEPTH} levels deep; arrayckpt never writes "
                          "such a value: the checkpoint is damaged or was crafted")
    if isinstance(data, list):
        return [_decode(v, key, depth + 1) for v in data]
    if isinstance(data, dict):
        if len(data) == 1 and next(iter(data)) in _MARKERS:
            ((marker, inner),) = data.items()
            try:
                return _decode_marker(marker, inner, key, depth)
            except (TypeError, ValueError) as e:
                raise FormatError(f"value {key!r}: malformed {marker} value {_brief(inner)}") from e
        return {k: _decode(v, key, depth + 1) for k, v in data.items()}
    raise FormatError(f"value {key!r}: {_brief(data)} is not a valid encoded value")


def _brief(data: object) -> str:
    text = repr(data)
    return text if len(text) <= 200 else text[:200] + "..."


def _decode_marker(marker: str, inner: object, key: str, depth: int) -> object:
    if marker == "$tuple":
        if not isinstance(inner, list):
            raise TypeError(inner)
        return tuple(_decode(v, key, depth + 1) for v in inner)
    if marker == "$float":
        if not isinstance(inner, str) or inner not in ("nan", "inf", "-inf"):
            raise ValueError(inner)
        return float(inner)
    if marker == "$bytes":
        if not isinstance(inner, str):  # what b64decode would refuse with a TypeError
            raise TypeError(inner)
        return base64.b64decode(inner, validate=True)
    if not isinstance(inner, list) or not all(isinstance(p, list) and len(p) == 2 for p in inner):
        raise TypeError(inner)
    return {_decode(k, key, depth + 1): _decode(v, key, depth + 1) for k, v in inner}
