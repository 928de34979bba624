"""The paths a checkpoint names, checked before anything turns them into file names or object keys.

A root document names two kinds of paths that readers act on: the keys of its consolidated metadata (node paths,
spec §2 and §8) and its base reference (``base.path``, spec §10.1). Both come from an untrusted document whose
checksum anyone can recompute, so neither is ever used as it is:

- a node path must be one the manifest implies (:func:`check_node_paths`): the array nodes of its entries, their
  row-delta and per-rank arrays, and the groups above them, each with a document of that kind. That set is built
  from validated entry names only (escaped segments, fixed names, ``%r<rank>``), so it never holds ``..``, an
  absolute path, a backslash or NUL; anything else in the document is refused, naming it.
- a relative base reference must be ``../`` one or more times, then one or more plain names
  (:func:`parse_relative_reference`), and is resolved lexically (:func:`resolve_relative`) on segments, never by
  a filesystem or an HTTP library that might normalise it differently; where it may lead is decided by the
  storage layer (``_storage/base.py::follow_base``). :class:`BaseRef` is the manifest's ``base``, parsed.

Pure: no IO, no torch.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from .._errors import FormatError
from .jsontypes import JSON
from .keys import SEGMENT_PATTERN

__all__ = ["BaseRef", "RelativeReference", "check_node_paths", "group_paths", "is_location_reference", "is_node_path",
           "parse_relative_reference", "resolve_relative", "shown"]

_RANK_SEGMENT = re.compile(r"%r(?:0|[1-9][0-9]*)")  # spec §3.2's rank-segment: only as a last segment
# A whole node path in one match (as ``valid_segment`` for each segment, the rank segment only last): a manifest's
# packs member names hundreds of arrays, and splitting each path to match its segments one by one cost a packed load
# about half a millisecond.
_NODE_PATH = re.compile(rf"(?:(?!__)(?:{SEGMENT_PATTERN})/)*(?:(?!__)(?:{SEGMENT_PATTERN})|{_RANK_SEGMENT.pattern})")
MAX_NAME_BYTES = 255  # the usual limit of one directory entry (as for array path segments, spec §3.3)
SHOWN_CHARS = 120  # how much of a hostile path an error message quotes


def shown(text: object) -> str:
    """``repr`` of a path for an error message, cut short (a crafted key may be megabytes long)."""
    quoted = repr(text)
    return quoted if len(quoted) <= SHOWN_CHARS else f"{quoted[:SHOWN_CHARS]}... ({len(quoted)} characters)"


def is_node_path(path: object) -> bool:
    """Whether ``path`` follows the node-path grammar (spec §3.2): escaped segments joined by ``/``, the last of
    which may instead be a rank segment ``%r<rank>``."""
    return isinstance(path, str) and _NODE_PATH.fullmatch(path) is not None


def group_paths(array_paths: Collection[str]) -> set[str]:
    """Every proper prefix, in whole segments, of the given array node paths: the groups a checkpoint holds."""
    groups: set[str] = set()
    for path in array_paths:
        segments = path.split("/")
        groups.update("/".join(segments[:i]) for i in range(1, len(segments)))
    return groups


def check_node_paths(nodes: Mapping[str, object], arrays: Mapping[str, str], where: str) -> None:
    """Refuse consolidated metadata whose nodes are not exactly those the manifest implies: ``arrays`` maps each
    array node path the entries imply to its entry's name (``manifest.py::array_nodes``); the groups are their
    prefixes. Every writer writes exactly these (spec §2), so anything else is damage or crafting, and a key that
    is no node path at all (``../../victim``, ``/abs``, ``a\\b``, NUL) would otherwise become a file name."""
    groups = group_paths(arrays)
    for path, document in nodes.items():
        kind = "array" if path in arrays else "group" if path in groups else None
        if kind is None:
            why = "is not a node path (spec §3.2: escaped segments joined by '/')" if not is_node_path(path) else \
                "is no node of its manifest's entries"
            raise FormatError(f"{where}: the consolidated metadata names node {shown(path)}, which {why}; a checkpoint "
                              "lists exactly the nodes its manifest implies (spec §2): it was damaged or crafted, "
                              "and nothing of it was used")
        if not (isinstance(document, dict) and document.get("node_type") == kind):
            owner = f" of entry {arrays[path]!r}" if kind == "array" else ""
            raise FormatError(f"{where}: the consolidated metadata of node {path!r}{owner} is not a Zarr {kind} "
                              f"document, which the manifest implies there (spec §2); it was damaged or crafted")
    missing = sorted(path for path in (*arrays, *groups) if path not in nodes)
    if missing:
        kind = f"array {missing[0]!r} of entry {arrays[missing[0]]!r}" if missing[0] in arrays else \
            f"group {missing[0]!r}"
        raise FormatError(f"{where}: the consolidated metadata has no document for {kind}, which every writer "
                          "lists (spec §2, §8); it was damaged or crafted")


def is_location_reference(reference: str) -> bool:
    """Whether a base reference names a location in full (an absolute local path or a URL) rather than a path
    relative to the delta checkpoint (spec §10.1)."""
    return reference.startswith("/") or "://" in reference


class RelativeReference(NamedTuple):
    """A relative base reference, parsed: climb ``up`` levels from the delta checkpoint, then descend ``names``."""

    up: int
    names: tuple[str, ...]


def parse_relative_reference(reference: str, where: str) -> RelativeReference:
    """Check a relative ``base.path`` against spec §10.1's grammar: ``../`` at least once, then at least one plain
    name (not empty, ``.`` or ``..``, no backslash or NUL, at most 255 bytes), nothing else. Writers only write this
    form (``os.path.relpath`` of a base outside the delta checkpoint), which resolves the same on every storage."""
    segments = reference.split("/")
    up = next((i for i, s in enumerate(segments) if s != ".."), len(segments))
    names = tuple(segments[up:])
    bad = [s for s in names if s in ("", ".", "..") or "\\" in s or "\x00" in s
           or len(s.encode(errors="surrogatepass")) > MAX_NAME_BYTES]
    if up == 0 or not names or bad:
        problem = "does not begin with '../'" if up == 0 else "names no checkpoint" if not names else \
            f"has the segment {shown(bad[0])}"
        raise FormatError(f"{where}: its base reference {shown(reference)} {problem}: a relative base reference is "
                          "'../' one or more times, then the names of directories (spec §10.1); it was damaged or "
                          "crafted")
    return RelativeReference(up, names)


def resolve_relative(parts: tuple[str, ...], reference: RelativeReference, where: str) -> tuple[str, ...]:
    """The segments a relative reference leads to from a delta checkpoint at ``parts`` (its path's segments below
    the root of its storage). Climbing above that root is refused, never clamped (POSIX ``normpath`` stops at
    ``/`` and an object store's prefix at the bucket, each somewhere the delta checkpoint did not name)."""
    if reference.up > len(parts):
        text = "/".join([".."] * reference.up + list(reference.names))
        raise FormatError(f"{where}: its base reference {shown(text)} climbs {reference.up} levels, above the root "
                          f"of its storage ({len(parts)} levels up); it was damaged or crafted")
    return parts[:len(parts) - reference.up] + reference.names


@dataclass(frozen=True)
class BaseRef:
    """The checkpoint a delta checkpoint was saved against: where it is (relative to the delta's own location,
    e.g. ``../step-100``, when both are local or in the same bucket; else absolute) and its id, so that a
    replaced base is detected."""

    path: str
    id: str
    step: int | None = None

    def to_dict(self) -> JSON:
        return {"path": self.path, "id": self.id, "step": self.step}

    @classmethod
    def from_dict(cls, data: object) -> BaseRef:
        if not (isinstance(data, dict) and isinstance(data.get("path"), str) and data["path"]
                and isinstance(data.get("id"), str) and data["id"]
                and (data.get("step") is None or (isinstance(data["step"], int)
                                                  and not isinstance(data["step"], bool)))):
            raise FormatError(f"manifest 'base' must be {{path, id, step}}, got {shown(data)}")
        path = data["path"]
        if "\x00" in path:
            raise FormatError(f"manifest 'base' path {shown(path)} holds a NUL character; it was damaged or crafted")
        if not is_location_reference(path):
            parse_relative_reference(path, "manifest 'base'")
        return cls(path, data["id"], data.get("step"))
