"""The one type of a JSON object as arrayckpt builds or parses it: ``zarr.json`` documents, the manifest, a
safetensors header, a report's data, a TensorStore spec.

``JSON`` is ``dict[str, object]``, not ``dict[str, Any]``: a field read from a parsed document is ``object`` until
the reader checks it (``isinstance``, or a ``parse_*`` validator that raises naming the field), so the type checker
holds every reader to the check that a crafted or damaged document needs anyway. The accessors below are those
checks for documents a validator has already accepted (array metadata after ``zarr.check_array_metadata``): they
never fail there, and fail with a :class:`FormatError` naming the member, not a ``KeyError`` or ``TypeError``,
anywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

from .._errors import FormatError

__all__ = ["JSON", "int_list", "json_object", "member"]

JSON: TypeAlias = dict[str, object]


def json_object(value: object) -> JSON:
    """``value`` if it is a JSON object, else ``{}``: an optional object member (``.get(name, {})``) read as its
    reader always did, absent and empty alike."""
    return value if isinstance(value, dict) else {}


def member(document: Mapping[str, object], *names: str) -> object:
    """The value at ``names`` below ``document``, through nested objects (``member(m, "chunk_grid",
    "configuration", "chunk_shape")``); ``None`` where a member on the way is missing or not an object."""
    value: object = document
    for name in names:
        value = value.get(name) if isinstance(value, dict) else None
    return value


def int_list(value: object, what: str) -> list[int]:
    """``value`` as a list of integers (a shape, a chunk shape); :class:`FormatError` naming ``what`` if it is not
    one."""
    if not (isinstance(value, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in value)):
        raise FormatError(f"{what} {value!r} is not a list of integers")
    return value
