"""Aliases: one stored tensor under a second key (spec §4.3, "Aliases").

A state can hold one tensor under two keys: tied weights, such as GPT-2's ``lm_head.weight`` and
``transformer.wte.weight``, are one parameter that ``state_dict()`` returns twice. A writer stores such a tensor
once, under the key met first in the state (the *target*), and the other key as an ``alias`` entry naming the
target; every reader reads an alias as its target. An alias has no Zarr node of its own (the node set of spec §8
is what the other entries imply), so zarr-python sees one array, whose attributes list its aliases.

The target must be a ``tensor`` or ``ndarray`` entry of the same checkpoint: an alias of a missing key, of a
value, of a per-rank or pickled entry, of itself or of another alias (hence any cycle) is a format error, checked
when the manifest is parsed (``manifest.py``). Pure: no IO, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._errors import FormatError
from .jsontypes import JSON
from .keys import Key
from .paths import shown

__all__ = ["AliasEntry", "alias_problem", "parse_alias"]


@dataclass(frozen=True)
class AliasEntry:
    """Another name of the array entry ``target`` of the same checkpoint: the state held one tensor under both
    keys (tied weights), stored once. Reads of the alias are reads of the target."""

    key: str
    parts: Key
    target: str  # the dotted key of a tensor or ndarray entry

    def to_dict(self) -> JSON:
        return {"kind": "alias", "keys": list(self.parts), "target": self.target}


def parse_alias(key: str, parts: Key, data: JSON) -> AliasEntry:
    """An ``alias`` entry, its target a string (that it names an array entry is checked with the other entries)."""
    target = data.get("target")
    if not isinstance(target, str):
        raise FormatError(f"entry {key!r}: an alias's 'target' must be the dotted key of a tensor entry, got "
                          f"{shown(target)}")
    return AliasEntry(key, parts, target)


def alias_problem(alias: AliasEntry, found: object) -> str:
    """Why ``alias`` is refused, ``found`` being the entry its target names (``None``: none): every writer makes an
    alias of a tensor or ndarray entry of the same checkpoint, so anything else was damaged or crafted."""
    if found is None:
        what = "which is not an entry of the checkpoint"
    elif found is alias:
        what = "itself"
    elif isinstance(found, AliasEntry):
        what = f"another alias (of {found.target!r}); an alias names the stored tensor itself, never an alias"
    else:
        kind = found.to_dict().get("kind") if hasattr(found, "to_dict") else type(found).__name__
        what = f"a {kind} entry; only tensor and ndarray entries can have aliases"
    target = "" if found is alias else f"{alias.target!r}, "
    return f"entry {alias.key!r} is an alias of {target}{what}: the manifest was damaged or crafted"
