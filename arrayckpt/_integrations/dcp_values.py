"""The values of a DCP save as arrayckpt stores them (used by ``dcp_storage.py``'s writer).

DCP's ``BYTE_IO`` items (its default planner ``torch.save``s every non-tensor leaf) are decoded on the rank that
holds them with ``torch.load(weights_only=True)``; what arrayckpt can store as a plain value (``_format/values.py``:
numbers, strings, lists, tuples, dicts, None…; an ``io.BytesIO``, DCP's documented way to store raw bytes, is
stored as its ``bytes``, which ``ArrayckptReader`` gives back as an ``io.BytesIO`` where the state loaded into holds
one) travels to the coordinator as typed JSON, so an optimizer's
``param_groups`` need no pickle. Anything else is refused with :class:`arrayckpt.PickleNotAllowedError` unless
``allow_pickle=True``, which stores it as ``arrayckpt.save(..., allow_pickle=True)`` does (``pickle.dumps`` of the
object ``torch.load`` returns, as a uint8 array the coordinator writes before the commit). The leaves DCP walked
into a list are regrouped into the list (``dcp_keys.regroup``), so the keys are those ``arrayckpt.save`` gives.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.planner import SavePlanner, WriteItem

from .._errors import PickleNotAllowedError, StateError
from .._format.codecs import Codec
from .._format.dtypes import DTYPES
from .._format.keys import Key, array_path, dotted
from .._format.manifest import ArrayEntry, Entry, PickleEntry, ValueEntry
from .._format.values import NotJSONable, decode_value, encode_value
from .._io.arrays import ArrayIO, Checksums, array_spec
from .._layout.chunking import ArrayPlan, ChunkPolicy, plan_array
from .._layout.saveplan import SavePlan as ArrayckptPlan
from .._layout.saveplan import check_paths
from .._write.packed import ChunkDestination
from .._write.transaction import WriteTransaction
from .dcp_keys import key_parts, list_containers, object_path, regroup

__all__ = ["PICKLE_PROTOCOL", "ValueWritten", "Values", "encode_bytes", "encode_item", "value_entries",
           "write_pickles"]

PICKLE_PROTOCOL = 5  # as ``arrayckpt.save(..., allow_pickle=True)`` pickles


@dataclass(frozen=True)
class ValueWritten:
    """``WriteResult.storage_data`` of a BYTE_IO item: its value as typed JSON, or (with consent) its pickle."""

    encoded: Any = None
    pickled: bytes | None = None


def encode_item(item: WriteItem, planner: SavePlanner, allow_pickle: bool) -> ValueWritten:
    """A BYTE_IO item's value. An ``io.BytesIO`` in the state (DCP's documented way to store raw bytes) is stored as
    its bytes, taken from the planner's state (``DefaultSavePlanner.lookup_object``) rather than unpickled from
    what ``torch.save`` made of it, which ``weights_only`` refuses."""
    lookup = getattr(planner, "lookup_object", None)
    if callable(lookup):
        found = lookup(item.index)
        if isinstance(found, io.BytesIO):
            return ValueWritten(encoded=encode_value(found.getvalue()))
    return encode_bytes(item.index.fqn, planner.resolve_data(item), allow_pickle)


def encode_bytes(fqn: str, data: Any, allow_pickle: bool) -> ValueWritten:
    """A BYTE_IO item's value: typed JSON when ``torch.load(weights_only=True)`` gives a plain value, else (with
    consent) the pickle of what ``torch.load`` gives — the user's own object, in their own process."""
    raw = data.getvalue() if isinstance(data, io.BytesIO) else data.read()
    what = "an object torch.load(weights_only=True) refuses"
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
        what = f"a {type(value).__name__}"
        return ValueWritten(encoded=encode_value(value))
    except NotJSONable as e:
        what = f"of type {e}"
    except Exception:  # noqa: BLE001 - not loadable without pickle's full power
        pass
    if not allow_pickle:
        raise PickleNotAllowedError(
            f"value {fqn!r} ({what}) cannot be stored as a plain value; convert it to plain types, or pass "
            "ArrayckptWriter(..., allow_pickle=True) to pickle it (loading it will then need "
            "ArrayckptReader(..., allow_pickle=True) or arrayckpt.load(..., allow_pickle=True))")
    value = torch.load(io.BytesIO(raw), weights_only=False)
    return ValueWritten(pickled=pickle.dumps(value, protocol=PICKLE_PROTOCOL))


Values = tuple[dict[str, Entry], dict[str, tuple[Key, bytes]], dict[str, tuple[str, ...]], dict[str, str]]


def value_entries(plan: ArrayckptPlan, values: Mapping[str, ValueWritten], mapping: Mapping[str, Any]) -> Values:
    """Every entry of the checkpoint by key (the plan's arrays, the values regrouped as arrayckpt stores them),
    the pickled values to write (key -> parts, bytes), the DCP fqns each value holds, and the manifest's
    ``containers``. Refuses two things under one key."""
    entries: dict[str, Entry] = dict(plan.entries)
    plain, pickled = [], []
    for fqn, written in values.items():
        path = object_path(fqn, mapping)
        if written.pickled is None:
            plain.append((fqn, path, decode_value(written.encoded, fqn)))
        else:
            pickled.append((fqn, path))
    array_paths = [object_path(key, mapping) for key, e in plan.entries.items() if isinstance(e, ArrayEntry)]
    paths = [*array_paths]
    pickles: dict[str, tuple[Key, bytes]] = {}
    made: dict[str, tuple[str, ...]] = {}  # key -> the DCP fqns it holds
    for fqn, path in pickled:
        parts, data = key_parts(path), values[fqn].pickled
        assert data is not None
        _claim(made, entries, dotted(parts), (fqn,))
        pickles[dotted(parts)] = (parts, data)
        entries[dotted(parts)] = PickleEntry(dotted(parts), parts, len(data))
        paths.append(path)
    for grouped in regroup(plain, pickled, array_paths):
        parts = key_parts(grouped.path)
        _claim(made, entries, dotted(parts), grouped.members)
        entries[dotted(parts)] = ValueEntry(dotted(parts), parts, encode_value(grouped.value))
        paths.append(grouped.path)
    return entries, pickles, made, list_containers(paths)


def _claim(made: dict[str, tuple[str, ...]], entries: Mapping[str, Entry], key: str, members: tuple[str, ...]) -> None:
    other = made.get(key) or ((key,) if key in entries else None)
    if other is not None:
        raise StateError(f"DCP keys {list(other)} and {list(members)} would both be stored under key {key!r}; "
                         "rename one")
    made[key] = members


def write_pickles(pickles: Mapping[str, tuple[Key, bytes]], arrays: Mapping[str, ArrayPlan],
                  transaction: WriteTransaction, destination: ChunkDestination, checksums: Checksums,
                  chunking: ChunkPolicy) -> dict[str, ArrayPlan]:
    """Plan and write (on the coordinator, before the commit, to ``destination``: its pack when the save is packed) the
    uint8 arrays of the pickled values; their chunks' checksums join ``checksums``. Returns their array plans by
    path."""
    planned: dict[str, ArrayPlan] = {}
    for key in pickles:
        path = array_path(key)
        if path in arrays:
            raise StateError(f"value {key!r} (pickled, so stored as an array) and tensor {arrays[path].key!r} would "
                             "be stored as one array; rename one")
        plan = plan_array(key, path, DTYPES["uint8"], (len(pickles[key][1]),), Codec(), chunking)
        planned[path] = dataclasses.replace(plan, key_encoding=transaction.key_encoding)
    check_paths({**arrays, **planned})  # the rules every save's arrays follow (nesting, letter case, lengths)
    jobs = [ArrayIO(key, array_spec(destination.kvstore(array_path(key)), planned[array_path(key)].metadata),
                    np.frombuffer(data, np.uint8), None, array_path(key)) for key, (_, data) in pickles.items()]
    for path, found in destination.write(jobs, destination.context, str(transaction.location)).items():
        checksums.setdefault(path, {}).update(found)
    return planned
