"""State flattening: nested training state <-> named leaves.

One walker serves save and load so both see the same keys. Dicts are always walked (keys must be
strings or ints); lists and tuples are walked only when they hold a tensor, an array or a stateful
object somewhere (otherwise they are one plain value, like ``betas=(0.9, 0.999)``); objects with
``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers) are walked through
``state_dict()``. Everything else is a leaf.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._errors import StateError
from .._format.keys import Key, dotted
from .shards import PerRank, Shard

__all__ = ["Leaf", "StatefulNode", "Walk", "is_array_leaf", "walk"]


@dataclass
class Leaf:
    """One named leaf and where it sits, so load can replace it."""

    parts: Key
    value: Any
    parent: Any  # the dict, list or tuple holding it
    slot: str | int


@dataclass
class StatefulNode:
    """A stateful object met during the walk and the state dict it returned."""

    parts: Key
    obj: Any
    state_dict: dict[str, Any]


@dataclass
class Walk:
    """The result of walking a state: leaves by dotted key, stateful objects in post-order."""

    leaves: dict[str, Leaf] = field(default_factory=dict)
    statefuls: list[StatefulNode] = field(default_factory=list)
    containers: dict[str, str] = field(default_factory=dict)  # non-dict containers walked, by prefix


def is_stateful(obj: object) -> bool:
    return (
        not isinstance(obj, (dict, list, tuple, torch.Tensor, type))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


def is_array_leaf(obj: object) -> bool:

    return isinstance(obj, (torch.Tensor, np.ndarray, Shard, PerRank))


def _holds_arrays(obj: object, depth: int = 0) -> bool:
    """Whether a container holds, at any depth, something that must not be frozen into a plain value."""
    if depth > 100:
        raise StateError("state is nested more than 100 levels deep (a reference cycle?)")
    if is_array_leaf(obj) or is_stateful(obj):
        return True
    if isinstance(obj, dict):
        return any(_holds_arrays(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_arrays(v, depth + 1) for v in obj)
    return False


def _walkable_dict(obj: object) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(
        isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)) for k in obj
    )


def walk(state: Mapping[str, Any]) -> Walk:
    """Walk ``state`` (a dict) into leaves; raises :class:`StateError` on key collisions."""
    if not isinstance(state, dict):
        raise StateError(f"state must be a dict, got {type(state).__name__}; wrap it: {{'model': obj}}")
    result = Walk()
    _walk_children(state, (), result, 0)
    return result


def _walk_children(container: Any, parts: Key, result: Walk, depth: int) -> None:
    if isinstance(container, dict):
        for k in container:
            if not (isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool))):
                raise StateError(f"{dotted(parts) or 'state'!r} has key {k!r}; keys of dicts holding tensors and of "
                                 "state dicts must be str or int")
            if isinstance(k, str):
                try:
                    k.encode()
                except UnicodeEncodeError:
                    raise StateError(f"key {k!r} under {dotted(parts)!r} is not valid Unicode") from None
    items = container.items() if isinstance(container, dict) else enumerate(container)
    for slot, value in items:
        _walk_value(value, (*parts, slot), container, slot, result, depth + 1)


def _walk_value(value: Any, parts: Key, parent: Any, slot: str | int, result: Walk, depth: int) -> None:
    if depth > 100:
        raise StateError(f"state is nested more than 100 levels deep at {dotted(parts)!r} (a reference cycle?)")
    if is_stateful(value):
        state_dict = value.state_dict()
        if not isinstance(state_dict, dict):
            raise StateError(f"{dotted(parts)!r}: state_dict() returned {type(state_dict).__name__}, not a dict")
        _walk_children(state_dict, parts, result, depth)
        result.statefuls.append(StatefulNode(parts, value, state_dict))
        return
    if _walkable_dict(value):
        _walk_children(value, parts, result, depth)
        return
    if isinstance(value, dict) and _holds_arrays(value):
        raise StateError(f"{dotted(parts)!r}: a dict holding tensors must have str or int keys")
    if isinstance(value, (list, tuple)) and value and _holds_arrays(value):
        result.containers[dotted(parts)] = "tuple" if isinstance(value, tuple) else "list"
        _walk_children(value, parts, result, depth)
        return
    key = dotted(parts)
    if key in result.leaves:
        other = result.leaves[key].parts
        raise StateError(
            f"two entries flatten to the same key {key!r}: {list(other)!r} and {list(parts)!r}; rename one"
        )
    result.leaves[key] = Leaf(parts, value, parent, slot)
