"""Describing one rank's state: metadata for the coordinator, and the host memory its data is written from.

Every writer starts here (``save``, ``async_save``, the streaming writer): the state is walked into a
:class:`LocalDescription` (keys, dtypes, shapes, the box of each tensor this rank holds; plain values encoded)
and, beside it, the host memory of each array, which never leaves the rank. Leaves that are one tensor (tied
weights, ``_torch/aliases.py``) are described as usual and also reported as aliases; they share one host view, so an
asynchronous save stages a tied tensor once.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._errors import PickleNotAllowedError, StateError
from .._format.dtypes import DType, dtype_of_numpy
from .._format.keys import array_path
from .._format.manifest import MAX_NDIM, ArrayEntry, ValueEntry, per_rank_path
from .._format.values import NotJSONable, encode_value
from .._layout.box import Box
from .._layout.saveplan import ArrayDescription, LocalDescription
from .._torch.aliases import find_aliases
from .._torch.dtypes import dtype_of_torch
from .._torch.shards import PerRank, PlacementMemo, Shard, local_piece
from .._torch.state import walk
from .._torch.tensors import readable_numpy

__all__ = ["HostView", "LocalState", "describe_local", "host_view"]

PICKLE_PROTOCOL = 5


@dataclass(frozen=True)
class LocalState:
    """One rank's description plus the host data behind it (which never leaves the rank)."""

    description: LocalDescription
    data: dict[str, tuple[Box, np.ndarray]]  # by array path: the box this rank holds and its host view


def host_view(key: str, path: str, value: torch.Tensor | np.ndarray, dt: DType) -> np.ndarray:
    """How a synchronous save reaches array data: the memory itself (a copy only off the CPU)."""
    return readable_numpy(value, dt, key) if isinstance(value, torch.Tensor) else value


HostView = Callable[[str, str, "torch.Tensor | np.ndarray", DType], np.ndarray]


def describe_local(state: Mapping[str, Any], rank: int, allow_pickle: bool, host: HostView) -> LocalState:
    """Walk the state into metadata for the coordinator and host memory of this rank's data.

    ``host(key, array path, tensor or array, dtype)`` gives the memory to write from: the data itself
    for a synchronous save (:func:`host_view`), a staged copy for an asynchronous one.
    """
    walked = walk(state)
    aliases = find_aliases({key: leaf.value for key, leaf in walked.leaves.items()
                            if isinstance(leaf.value, (torch.Tensor, Shard))})
    arrays: list[ArrayDescription] = []
    values: list[ValueEntry] = []
    per_rank: list[ValueEntry | ArrayEntry] = []
    data: dict[str, tuple[Box, np.ndarray]] = {}
    layouts: PlacementMemo = {}
    dt: DType | None  # a tensor's, or an array's (None: not a type an array can hold)
    for key, leaf in walked.leaves.items():
        value = leaf.value
        if isinstance(value, PerRank):
            per_rank.append(_describe_per_rank(key, leaf.parts, value.value, rank, data, host))
        elif isinstance(value, (torch.Tensor, Shard)):
            piece = local_piece(value, key, rank, layouts)
            _check_ndim(key, piece.global_shape)
            dt = dtype_of_torch(piece.tensor.dtype, key)
            arrays.append(ArrayDescription(key, leaf.parts, "tensor", dt.name, piece.global_shape, piece.box,
                                           piece.replica_id))
            target = aliases.get(key)  # one tensor with an earlier key's: the same memory, viewed (staged) once
            data[array_path(key)] = data[array_path(target)] if target is not None else \
                (piece.box, host(key, array_path(key), piece.tensor, dt))
        elif isinstance(value, np.ndarray) and (dt := dtype_of_numpy(value.dtype)) is not None:
            _check_ndim(key, value.shape)
            arrays.append(ArrayDescription(key, leaf.parts, "ndarray", dt.name, value.shape, Box.whole(value.shape),
                                           rank))
            data[array_path(key)] = (Box.whole(value.shape), host(key, array_path(key), value, dt))
        else:
            encoded = _encode(key, value, allow_pickle)
            if isinstance(encoded, np.ndarray):
                shape = encoded.shape
                arrays.append(ArrayDescription(key, leaf.parts, "pickle", "uint8", shape, Box.whole(shape), rank))
                data[array_path(key)] = (Box.whole(shape), encoded)
            else:
                values.append(ValueEntry(key, leaf.parts, encoded))
    return LocalState(LocalDescription(tuple(arrays), tuple(values), tuple(per_rank), walked.containers, aliases),
                      data)


def _describe_per_rank(key: str, parts: Any, value: Any, rank: int, data: dict[str, tuple[Box, np.ndarray]],
                       host: HostView) -> ValueEntry | ArrayEntry:
    """A per-rank tensor is written by its rank as its own array; other per-rank values must be JSON."""
    if isinstance(value, torch.Tensor):
        _check_ndim(key, tuple(value.shape))
        dt = dtype_of_torch(value.dtype, key)
        path = per_rank_path(key, rank)
        data[path] = (Box.whole(tuple(value.shape)), host(key, path, value, dt))
        return ArrayEntry(key, parts, dt, tuple(value.shape), "tensor")
    try:
        return ValueEntry(key, parts, encode_value(value))
    except NotJSONable as e:
        raise StateError(f"per-rank value {key!r} of type {e} must be a tensor or a JSON-able plain value "
                         "(per-rank values are never pickled)") from None


def _check_ndim(key: str, shape: tuple[int, ...]) -> None:
    if len(shape) > MAX_NDIM:
        raise StateError(f"tensor {key!r} has {len(shape)} dimensions; at most {MAX_NDIM} can be stored")


def _encode(key: str, value: Any, allow_pickle: bool) -> Any:
    """Typed JSON for a plain value, or (with consent) its pickle as a uint8 array."""
    try:
        return encode_value(value)
    except NotJSONable as e:
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"value {key!r} of type {e} cannot be stored as JSON; convert it to plain types, or pass "
                "allow_pickle=True to pickle it (loading will then need allow_pickle=True too)"
            ) from None
    return np.frombuffer(pickle.dumps(value, protocol=PICKLE_PROTOCOL), np.uint8)
