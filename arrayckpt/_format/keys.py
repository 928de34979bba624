"""State keys and the array paths they map to.

A leaf of the state is named by the tuple of container keys leading to it (``("optim", "state", 0,
"exp_avg")``); its flattened name is those parts joined by dots (``"optim.state.0.exp_avg"``, the name
users see), and its array path in the Zarr hierarchy is that dotted name split on dots, each segment
percent-escaped (``optim/state/0/exp_avg``).  Escaping keeps every path inside the checkpoint: a segment
holds only ``[A-Za-z0-9_-]`` and ``%XX`` escapes, so ``..``, ``/`` and absolute paths cannot occur.
"""

from __future__ import annotations

import functools
import re

from .._errors import FormatError

__all__ = ["SEGMENT_PATTERN", "Key", "array_path", "dotted", "parse_array_path", "parse_key_parts", "prefix_parts",
           "valid_segment"]

Key = tuple[str | int, ...]

_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
# One escaped path segment (spec §3.2): "%" alone, or safe characters and upper-case %XX escapes, at least one. Written
# as an unrolled loop (safe characters, then escapes each followed by safe characters), the same language as
# ``%|(?:[A-Za-z0-9_-]|%[0-9A-F]{2})+`` matched about twice as fast (``paths.py`` matches whole node paths with it).
SEGMENT_PATTERN = r"%|[A-Za-z0-9_-]+(?:%[0-9A-F]{2}[A-Za-z0-9_-]*)*|(?:%[0-9A-F]{2}[A-Za-z0-9_-]*)+"
_SEGMENT = re.compile(SEGMENT_PATTERN)
EMPTY_SEGMENT = "%"  # an empty segment ("a..b"); a lone "%" can never come from escaping


def dotted(parts: Key) -> str:
    """The flattened, user-facing name of a key path."""
    return ".".join(str(p) for p in parts)


def prefix_parts(key_prefix: str) -> tuple[str, ...]:
    """The parts of a key prefix as ``convert`` and ``load`` take one (``key_prefix``): ``"model"`` and ``"model."``
    are both ``("model",)``; ``""`` is no prefix. An empty part (``"a..b"``) is refused: no key has one there.

    >>> prefix_parts("model."), prefix_parts("base.model"), prefix_parts("")
    (('model',), ('base', 'model'), ())
    """
    if not isinstance(key_prefix, str):
        raise TypeError(f"key_prefix must be a string (such as 'model'), not {type(key_prefix).__name__}")
    trimmed = key_prefix[:-1] if key_prefix.endswith(".") else key_prefix
    parts = tuple(trimmed.split(".")) if trimmed else ()
    if any(not part for part in parts):
        raise ValueError(f"key_prefix {key_prefix!r} has an empty part; write it as dotted names, such as 'model'")
    return parts


def _escape_segment(segment: str) -> str:
    if not segment:
        return EMPTY_SEGMENT
    out = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in segment)
    # Zarr v3 reserves node names starting with "__".
    return "%5F" + out[1:] if out.startswith("__") else out


@functools.lru_cache(maxsize=1 << 16)
def array_path(key: str) -> str:
    """The array path of a flattened key: dot-separated segments, each escaped (cached: called often)."""
    return "/".join(_escape_segment(s) for s in key.split("."))


def valid_segment(segment: str) -> bool:
    """Whether ``segment`` is one escaped path segment (spec §3.2): ``%`` alone, or safe characters and upper-case
    ``%XX`` escapes, not beginning with ``__``."""
    return bool(_SEGMENT.fullmatch(segment)) and not segment.startswith("__")


def parse_array_path(path: object, key: str) -> str:
    """Check that a stored array path is the one ``key`` maps to (no traversal, no surprises)."""
    if not isinstance(path, str) or not all(_SEGMENT.fullmatch(s) for s in path.split("/")):
        raise FormatError(f"entry {key!r}: array path {path!r} is not a valid arrayckpt array path")
    if path != array_path(key):
        raise FormatError(f"entry {key!r}: array path {path!r} should be {array_path(key)!r}")
    return path


def parse_key_parts(parts: object, key: str) -> Key:
    """Check a stored key path: a non-empty list of strings and ints whose dotted form is ``key``."""
    if (
        not isinstance(parts, list)
        or not parts
        or not all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in parts)
    ):
        raise FormatError(f"entry {key!r}: 'keys' must be a non-empty list of strings and ints, got {parts!r}")
    if dotted(tuple(parts)) != key:
        raise FormatError(f"entry {key!r}: 'keys' {parts!r} do not join to the entry's name")
    return tuple(parts)
