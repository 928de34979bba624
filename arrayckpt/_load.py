"""``load``: read a checkpoint in place into the tensors of a state, then hand state dicts back."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._dtypes import dtype_of_numpy
from ._errors import KeyMismatchError, StateError
from ._format import ArrayEntry, Entry
from ._io import ArrayIO, read_into
from ._reader import Checkpoint, open_checkpoint
from ._save import _require_single_process
from ._state import Leaf, StatefulNode, Walk, walk
from ._tensors import writable_numpy

__all__ = ["LoadResult", "load"]


@dataclass(frozen=True)
class LoadResult:
    """What ``load`` could not match: keys of the state absent from the checkpoint, and the reverse."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def load(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    process_group: Any = None,
) -> LoadResult:
    """Load the checkpoint at ``path`` into ``state`` in place.

    Tensors are filled in place (read straight into their memory when on the CPU); plain values are
    replaced in their dicts and lists; objects with ``load_state_dict`` get their filled state dict
    back. Optimizers and other non-module stateful objects get state they lack created from the
    checkpoint (a fresh optimizer has no per-parameter state yet). Shapes and dtypes must match
    exactly. With ``strict=True`` keys of ``state`` missing from the checkpoint raise
    :class:`KeyMismatchError`; either way the result lists missing and unexpected keys. Everything
    is checked before the first byte is read, so a mismatch leaves ``state`` untouched.

    >>> import arrayckpt, torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> arrayckpt.save({"w": torch.ones(3), "step": 5}, path)
    >>> state = {"w": torch.zeros(3), "step": 0}
    >>> arrayckpt.load(state, path)
    LoadResult(missing_keys=[], unexpected_keys=[])
    >>> state
    {'w': tensor([1., 1., 1.]), 'step': 5}
    """
    _require_single_process(process_group)
    checkpoint = open_checkpoint(path, allow_pickle=allow_pickle)
    where = str(checkpoint.location)
    walked = walk(state)
    entries = checkpoint.manifest.entries
    _create_missing(walked, entries)
    missing = [key for key in walked.leaves if key not in entries]
    unexpected = [key for key in entries if key not in walked.leaves]
    if strict and missing:
        raise KeyMismatchError(
            f"{where}: {len(missing)} key(s) of the state are not in the checkpoint: {_few(missing)}"
            + (f"; the checkpoint has {len(unexpected)} other key(s): {_few(unexpected)}" if unexpected else "")
            + ". Pass strict=False to load the rest"
        )
    reads: list[ArrayIO] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    replacements: list[tuple[Leaf, Any]] = []
    for key, leaf in walked.leaves.items():
        if key in entries:
            _plan_leaf(checkpoint, entries[key], leaf, reads, copies, replacements)
    read_into(reads, checkpoint._context, where)
    for target, staged in copies:
        target.copy_(staged)
    for leaf, value in replacements:
        leaf.parent[leaf.slot] = value
    _hand_back(walked.statefuls)
    return LoadResult(missing, unexpected)


def _few(keys: list[str], limit: int = 10) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f", … ({len(keys) - limit} more)" if len(keys) > limit else "")


def _plan_leaf(
    checkpoint: Checkpoint,
    entry: Entry,
    leaf: Leaf,
    reads: list[ArrayIO],
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    replacements: list[tuple[Leaf, Any]],
) -> None:
    """Decide how one entry reaches its leaf, validating without reading any array data."""
    key, target = entry.key, leaf.value
    where = str(checkpoint.location)
    if not isinstance(entry, ArrayEntry):
        if isinstance(target, (torch.Tensor, np.ndarray)):
            raise StateError(f"{where}: {key!r} is a plain value in the checkpoint but an array in the state")
        replacements.append((leaf, checkpoint.value(key)))
        _check_assignable(leaf, where, key)
        return
    spec = checkpoint[key].spec
    if isinstance(target, torch.Tensor):
        _check_match(where, key, entry, target.dtype, entry.dtype.torch, tuple(target.shape))
        if target.device.type == "cpu":
            reads.append(ArrayIO(key, spec, writable_numpy(target, entry.dtype, key)))
        else:
            staged = torch.empty(entry.shape, dtype=entry.dtype.torch)
            reads.append(ArrayIO(key, spec, writable_numpy(staged, entry.dtype, key)))
            copies.append((target, staged))
    elif isinstance(target, np.ndarray):
        _check_match(where, key, entry, dtype_of_numpy(target.dtype), entry.dtype, target.shape)
        if not target.flags.writeable:
            raise StateError(f"{where}: numpy array {key!r} in the state is read-only")
        reads.append(ArrayIO(key, spec, target))
    else:  # a plain value in the state: replace it with a new array
        _check_assignable(leaf, where, key)
        fresh = _empty_like_entry(entry)
        reads.append(ArrayIO(key, spec, fresh if isinstance(fresh, np.ndarray) else writable_numpy(fresh, entry.dtype)))
        replacements.append((leaf, fresh))


def _check_match(where: str, key: str, entry: ArrayEntry, have: object, want: object, shape: tuple) -> None:
    if have != want or shape != entry.shape:
        raise StateError(
            f"{where}: tensor {key!r} is {entry.dtype.name}{list(entry.shape)} in the checkpoint but "
            f"{_dtype_name(have)}{list(shape)} in the state; arrayckpt never casts or reshapes "
            "silently: load into a matching tensor and convert"
        )


def _dtype_name(dtype: object) -> str:
    name = getattr(dtype, "name", None)
    return name if isinstance(name, str) else str(dtype).removeprefix("torch.")


def _check_assignable(leaf: Leaf, where: str, key: str) -> None:
    if isinstance(leaf.parent, tuple):
        raise StateError(f"{where}: cannot replace {key!r} inside a tuple; use a list in the state")


def _empty_like_entry(entry: ArrayEntry) -> torch.Tensor | np.ndarray:
    if entry.kind == "ndarray":
        return np.empty(entry.shape, entry.dtype.numpy)
    return torch.empty(entry.shape, dtype=entry.dtype.torch)


def _create_missing(walked: Walk, entries: Mapping[str, Entry]) -> None:
    """Create, inside non-module stateful objects' state dicts, entries the checkpoint has and they lack.

    A fresh optimizer has an empty ``state`` until its first step; its ``load_state_dict`` accepts the
    full state, so the checkpoint's tensors are materialised into its state dict. Modules have a fixed
    set of keys, so for them extra checkpoint keys stay unexpected.
    """
    for node in walked.statefuls:
        if isinstance(node.obj, torch.nn.Module):
            continue
        depth = len(node.parts)
        for key, entry in entries.items():
            if key in walked.leaves or entry.parts[:depth] != node.parts or len(entry.parts) == depth:
                continue
            _insert(walked, node, entry)


def _insert(walked: Walk, node: StatefulNode, entry: Entry) -> None:
    container: Any = node.state_dict
    for i in range(len(node.parts), len(entry.parts) - 1):
        part = entry.parts[i]
        if not isinstance(container, dict):
            return
        child = container.get(part)
        if child is None:
            child = container[part] = {}
        elif isinstance(child, dict) and not child:
            walked.leaves.pop(".".join(str(p) for p in entry.parts[: i + 1]), None)  # now a container
        container = child
    slot = entry.parts[-1]
    if not isinstance(container, dict) or slot in container:
        return
    container[slot] = _empty_like_entry(entry) if isinstance(entry, ArrayEntry) else None
    walked.leaves[entry.key] = Leaf(entry.parts, container[slot], container, slot)


def _hand_back(statefuls: list[StatefulNode]) -> None:
    """Give every stateful object its filled state dict, innermost first."""
    for node in statefuls:
        node.obj.load_state_dict(node.state_dict)


