"""Tied weights through DCP's writer: a tensor the state holds under two keys is stored once (spec §4.3, "Aliases").

``arrayckpt.save`` sees the tensors when it plans; a DCP ``StorageWriter`` does not: its plans carry write items
(a key, a global size, a box, a dtype), and a rank's tensors are reachable only in ``write_data``, through the
planner that resolves each item. So the tie is found where the tensors are and decided at the commit::

    every rank   prepare_local_plan  remember the rank's tensor items (all of them: DCP then deduplicates replicated
                                     items, so that a rank may write ``lm_head.weight`` but not ``wte.weight``)
    coordinator  prepare_global_plan whether any two arrays could be one tensor (same dtype and shape); if not,
                                     nothing below happens and the zarr.json documents are written at once
    every rank   write_data          resolve those items; a key whose item is one tensor with an earlier key's item
                                     (``tensor_identity``: same memory, same view; and the same global size and
                                     box) is *claimed* as an alias of it and its chunks are not written; the claims
                                     and the keys the rank holds go to the coordinator with its write results
    coordinator  finish              as ``arrayckpt.save``'s planner decides (``_layout/planner.py``): an alias
                                     where every rank holding either key holds both and claims the same target;
                                     its array leaves the plan, an alias entry enters the manifest, the target's
                                     attributes name it

A claim that the other ranks do not share (a key tied on one rank and not on another, whose replicas DCP assumes
equal) stores the key as an array of its own when no rank left its chunks out, and fails the save otherwise,
naming the key: a checkpoint never commits without them.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.planner import SavePlanner, WriteItem, WriteItemType

from .._errors import StateError
from .._format.keys import array_path
from .._format.manifest import AliasEntry, ArrayEntry
from .._layout.saveplan import SavePlan, documents_of
from .._torch.aliases import tensor_identity

__all__ = ["TiesOnRank", "claim_ties", "may_tie", "with_ties"]


@dataclass(frozen=True)
class TiesOnRank:
    """What one rank tells the coordinator about tied weights (in a ``WriteResult.storage_data``)."""

    holds: frozenset[str]  # every tensor key the rank holds, before DCP's deduplication
    claims: dict[str, str]  # alias -> the earlier key it is one tensor with, on this rank
    skipped: frozenset[str]  # the claimed aliases whose chunks this rank was planned to write and did not


def may_tie(plan: SavePlan) -> bool:
    """Whether two arrays of the plan could be one tensor: a tie has one dtype and shape."""
    seen = {(a.dtype.name, a.shape) for a in plan.arrays.values()}
    return len(seen) < len(plan.arrays)


def tensor_items(items: Iterable[WriteItem]) -> tuple[WriteItem, ...]:
    """The tensor write items of a rank's local plan (what :func:`claim_ties` resolves)."""
    return tuple(item for item in items if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None)


def claim_ties(held: Sequence[WriteItem], planner: SavePlanner) -> dict[str, str]:
    """The keys of ``held`` (one rank's tensor items, in the order of its state) whose item is one tensor with an
    earlier key's, mapped to the first such key. A key with several local items (a ShardedTensor's shards) is
    never tied."""
    count: dict[str, int] = defaultdict(int)
    for item in held:
        count[item.index.fqn] += 1
    resolved = {}  # kept alive while identities are compared (an identity may be an object's id)
    for item in held:
        if count[item.index.fqn] == 1:
            resolved[item.index.fqn] = (item, planner.resolve_data(item))
    first: dict[Hashable, str] = {}
    out: dict[str, str] = {}
    for fqn, (item, tensor) in resolved.items():
        identity = tensor_identity(tensor)
        if identity is None:
            continue
        data = item.tensor_data
        assert data is not None and data.chunk is not None
        where = (tuple(data.size), tuple(data.chunk.offsets), tuple(data.chunk.sizes))
        target = first.setdefault((identity, where), fqn)
        if target != fqn:
            out[fqn] = target
    return out


def agreed_ties(ranks: Sequence[TiesOnRank], where: str) -> dict[str, str]:
    """The aliases of the save (alias -> target): those every rank holding either key claims alike. Raises
    :class:`StateError` for a claim not agreed whose chunks a rank left out."""
    claims: dict[str, dict[int, str]] = defaultdict(dict)
    holders: dict[str, set[int]] = defaultdict(set)
    for rank, ties in enumerate(ranks):
        for key in ties.holds:
            holders[key].add(rank)
        for alias, target in ties.claims.items():
            claims[alias][rank] = target
    agreed = {}
    for alias, by in claims.items():
        targets = set(by.values())
        target = min(targets)
        if len(targets) == 1 and set(by) == holders[alias] == holders[target]:
            agreed[alias] = target
    agreed = {alias: target for alias, target in agreed.items() if target not in agreed}  # no alias of an alias
    for rank, ties in enumerate(ranks):
        for alias in sorted(ties.skipped - agreed.keys()):
            untied = sorted(holders[alias] - {r for r, t in claims[alias].items() if t == ties.claims[alias]})
            raise StateError(f"{where}: tensor {alias!r} is one tensor with {ties.claims[alias]!r} on rank {rank} but "
                             f"not on rank(s) {untied}: DCP takes a replicated tensor from any one rank, so every rank "
                             "must hold the same state; tie the two keys on every rank or on none")
    return agreed


def with_ties(plan: SavePlan, aliases: Mapping[str, str]) -> SavePlan:
    """``plan`` with every alias's array replaced by an alias entry, its target's attributes naming it, and the
    documents made again."""
    entries: dict[str, Any] = dict(plan.entries)
    arrays = dict(plan.arrays)
    named_by: dict[str, list[str]] = defaultdict(list)
    for alias, target in aliases.items():
        entry, of = entries.get(alias), entries.get(target)
        if not (isinstance(entry, ArrayEntry) and isinstance(of, ArrayEntry) and entry.dtype == of.dtype and
                entry.shape == of.shape):  # (one memory is one dtype and shape: never, but checked)
            raise StateError(f"tensor {alias!r} was found tied to {target!r} but was planned differently (a bug in "
                             "arrayckpt: please report it)")
        entries[alias] = AliasEntry(alias, entry.parts, target)
        del arrays[array_path(alias)]
        named_by[target].append(alias)
    for target, names in named_by.items():
        path = array_path(target)
        arrays[path] = dataclasses.replace(arrays[path], aliases=tuple(arrays[path].aliases) + tuple(names))
    documents, consolidated = documents_of(arrays)
    return dataclasses.replace(plan, entries=entries, arrays=arrays, documents=documents,
                               consolidated_json=consolidated)
