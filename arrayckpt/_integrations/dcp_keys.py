"""DCP's flattened keys and arrayckpt's keys, both ways (no IO, no torch).

DCP's default planners flatten a state dict into *fqns*: the object path of each leaf (dict keys as strings,
list indices as ints) joined by dots, e.g. ``("optim", "state", "layer.weight", "exp_avg")`` ->
``"optim.state.layer.weight.exp_avg"``; the planner keeps fqn -> path as its ``planner_data``. arrayckpt names a
leaf by the same two things: its key parts (the path) and its dotted key (the parts joined by dots), stored as
the array ``optim/state/layer/weight/exp_avg`` (the key split on every dot, ``_format/keys.py``).

Saving (:func:`object_path`, :func:`key_parts`, :func:`regroup`): an entry's parts are DCP's own object path of
the fqn when the planner gives one — the nesting of the state the user passed, which is also what
``arrayckpt.save`` records for that state, so the dotted key is the fqn itself; ``arrayckpt.open(p)["model.fc.weight"]``
works, and ``arrayckpt.load`` into the same nested state matches key for key. (DCP's path turns every dict key into
a string; a decimal one, ``"0"``, is stored as the int it was in a torch optimizer's state dict, as
``arrayckpt.save`` stores it, so that ``arrayckpt.load`` can hand a fresh optimizer its state.) Without a path (a
planner that does not flatten) the fqn is split on its dots. The two walkers differ in one place: DCP walks into a
list that holds dicts (an optimizer's ``param_groups``) and stores each leaf as its own value, where arrayckpt keeps
a list that holds no tensor as one plain value. The writer regroups such leaves into the list they came from, so a
checkpoint written through DCP has the keys ``arrayckpt.save`` gives the same state (``optim.param_groups``, one
value). Keys arrayckpt cannot store (a tensor whose key is the prefix of another tensor's, keys equal but for
letter case, over-long segments) are refused by its planner; two DCP leaves that would end up under one key are
refused by the writer.

Loading (:func:`dcp_path`, :func:`dcp_terminals`): the reader offers each plain value under the fqns DCP's
load planner asks for, walking the decoded value as DCP's flattening walks the target state (into dicts, and
into lists holding dicts), so ``optim.param_groups.0.lr`` is found in the ``optim.param_groups`` value of a
checkpoint saved by ``arrayckpt.save``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import StateError
from .._format.keys import Key, dotted

__all__ = ["Grouped", "dcp_path", "dcp_terminals", "key_parts", "list_containers", "object_path", "regroup"]

_DECIMAL = re.compile(r"0|[1-9][0-9]*")


def object_path(fqn: str, mapping: Mapping[str, Any] | None) -> tuple[str | int, ...]:
    """DCP's object path of an fqn: the planner's (``mapping``: its ``planner_data``; dict keys as strings, list
    indices as ints), else the fqn split on its dots. Refuses an fqn that is not valid Unicode."""
    if not isinstance(fqn, str):
        raise StateError(f"DCP key {fqn!r} is not a string; arrayckpt stores string keys")
    try:
        fqn.encode()
    except UnicodeEncodeError:
        raise StateError(f"DCP key {fqn!r} is not valid Unicode; rename it") from None
    path = mapping.get(fqn) if mapping else None
    if isinstance(path, (tuple, list)) and path and all(
            isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in path) \
            and dotted(tuple(path)) == fqn:
        return tuple(path)
    return tuple(fqn.split("."))


def key_parts(path: tuple[str | int, ...]) -> Key:
    """The arrayckpt key parts of a DCP object path: the same, with a decimal string (``"0"``) back to the int it
    was (DCP turns every dict key into a string; a torch optimizer's state is keyed by ints)."""
    return tuple(int(p) if isinstance(p, str) and _DECIMAL.fullmatch(p) else p for p in path)


def list_containers(paths: Iterable[tuple[str | int, ...]]) -> dict[str, str]:
    """The manifest's ``containers`` for entries at these DCP object paths: an int in a path indexes a list."""
    return {dotted(path[:i]): "list" for path in paths for i, p in enumerate(path) if isinstance(p, int) and i}


@dataclass(frozen=True)
class Grouped:
    """One plain value of the checkpoint, made from one DCP leaf or regrouped from several."""

    path: tuple[str | int, ...]  # DCP's object path of the value (its key parts: ``key_parts(path)``)
    value: Any  # the Python value
    members: tuple[str, ...]  # the DCP fqns it holds


def _group_parts(parts: Key, array_prefixes: set[Key]) -> Key | None:
    """The parts of the list a DCP leaf is regrouped into: the outermost list on its path that holds no array
    (``None``: the leaf stays a value of its own)."""
    for j in range(1, len(parts)):
        if isinstance(parts[j], int) and parts[:j] not in array_prefixes:
            return parts[:j]
    return None


def regroup(plain: Sequence[tuple[str, Key, Any]], pickled: Iterable[tuple[str, Key]],
            array_paths: Iterable[Key]) -> list[Grouped]:
    """The plain values of a DCP save as arrayckpt stores them (see the module docstring): each list holding no
    array (``array_paths``: the object paths of every array entry) becomes one value built from the leaves DCP
    walked into it; ``plain`` gives each leaf's fqn, object path and value. A list with a pickled member
    (``pickled``), or whose leaves cannot be put back together (DCP dropped an empty dict inside it), stays as DCP's
    separate leaves. Values come in the order of their first leaf."""
    prefixes = {path[:i] for path in array_paths for i in range(1, len(path))}
    blocked = {g for _, parts in pickled if (g := _group_parts(parts, prefixes)) is not None}
    groups: dict[Key, list[tuple[str, Key, Any]]] = {}
    out: list[Grouped | Key] = []  # a Key marks where a group goes
    for fqn, parts, value in plain:
        group = _group_parts(parts, prefixes)
        if group is None or group in blocked:
            out.append(Grouped(parts, value, (fqn,)))
            continue
        if group not in groups:
            groups[group] = []
            out.append(group)
        groups[group].append((fqn, parts, value))
    result: list[Grouped] = []
    for item in out:
        if isinstance(item, Grouped):
            result.append(item)
            continue
        members = groups[item]
        try:
            value = _build([(parts[len(item):], value) for _, parts, value in members])
        except ValueError:  # not a tree of dense lists and dicts: keep DCP's leaves
            result.extend(Grouped(parts, value, (fqn,)) for fqn, parts, value in members)
            continue
        result.append(Grouped(item, value, tuple(fqn for fqn, _, _ in members)))
    return result


class _Node(dict):
    """A container being rebuilt (its leaves are wrapped in :class:`_Leaf`)."""


@dataclass(frozen=True)
class _Leaf:
    value: Any


def _build(members: list[tuple[Key, Any]]) -> Any:
    """The nested lists and dicts whose leaves are ``members`` (sub path, value); ``ValueError`` when they do not
    form one (a slot taken twice, a list with a gap, int and str keys in one container)."""
    root = _Node()
    for sub, value in members:
        node = root
        for part in sub[:-1]:
            child = node.setdefault(part, _Node())
            if not isinstance(child, _Node):
                raise ValueError(sub)
            node = child
        if sub[-1] in node:
            raise ValueError(sub)
        node[sub[-1]] = _Leaf(value)
    return _unwrap(root)


def _unwrap(node: Any) -> Any:
    if isinstance(node, _Leaf):
        return node.value
    keys = list(node)
    if all(isinstance(k, int) for k in keys):
        if sorted(keys) != list(range(len(keys))):
            raise ValueError(keys)
        return [_unwrap(node[i]) for i in range(len(keys))]
    if all(isinstance(k, str) for k in keys):
        return {k: _unwrap(v) for k, v in node.items()}
    raise ValueError(keys)


def dcp_path(parts: Key, containers: Mapping[str, str]) -> tuple[str | int, ...]:
    """DCP's object path of an entry: its parts, with an int kept only where it indexes a list or tuple of the
    saved state (``containers``, the manifest's) — DCP turns every dict key into a string."""
    return tuple(p if isinstance(p, str) or dotted(parts[:i]) in containers else str(p)
                 for i, p in enumerate(parts))


def _is_terminal(value: Any) -> bool:
    """DCP's rule (``_traverse.traverse_state_dict``): dicts are walked; a list is walked when it holds a dict or
    a list that is walked; everything else (tuples included) is a leaf. Plain values hold no tensors."""
    if isinstance(value, Mapping):
        return False
    if isinstance(value, list):
        return not any(isinstance(v, (Mapping, list)) and not _is_terminal(v) for v in value)
    return True


def dcp_terminals(value: Any) -> Iterator[tuple[tuple[str | int, ...], tuple[Any, ...]]]:
    """Every leaf DCP's flattening finds in a plain value: (its path below the value as DCP names it, the keys and
    indices that reach it in ``value``). An empty dict has none (DCP asks for nothing there)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            for below, sub in dcp_terminals(v):
                yield (str(k), *below), (k, *sub)
    elif _is_terminal(value):
        yield (), ()
    else:
        for i, v in enumerate(value):
            for below, sub in dcp_terminals(v):
                yield (i, *below), (i, *sub)
