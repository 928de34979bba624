"""Lightning's callback states under keys a person can read, given back exactly on load.

Lightning keys ``checkpoint["callbacks"]`` by each callback's ``state_key``: its class name and the arguments that
tell two instances apart (``ModelCheckpoint{'monitor': 'val_loss', 'mode': 'min', 'every_n_train_steps': 0, ...}``),
and ``ModelCheckpoint`` keys ``best_k_models`` by checkpoint paths. Stored as they come, those become array keys
such as ``callbacks.ModelCheckpoint{'monitor': 'val_loss', …}.best_k_models./abs/path/epoch=0-step=8.ckpt``.
Instead, each callback's state is stored under ``callbacks.<ClassName>`` (a second instance of a class:
``<ClassName>_2``, ...) as **one plain value**, the tuple ``(state, state_key, tensors)``:

- ``state``: the state dict with each tensor replaced by its values (``tensor.tolist()``: a number for the 0-d
  scores of ``ModelCheckpoint`` and ``EarlyStopping``), so ``arrayckpt show CKPT callbacks.ModelCheckpoint`` reads
  as the state does;
- ``state_key``: Lightning's key, given back on load so that ``Trainer.fit(ckpt_path=...)`` finds the state;
- ``tensors``: where the tensors were, ``[[path, dtype, shape], ...]`` (``path``: the keys and indices that lead to
  it), so that load gives back tensors of the same dtype, shape and values (``tolist`` is exact for every real
  dtype).

A state holding a tensor of more than :data:`MAX_INLINE` elements (``StochasticWeightAveraging``'s average model),
a complex or numpy array, or a value that is not plain JSON keeps its tensors as arrays: it is stored as
``{STATE_KEY: state_key, "state": state}`` under the same readable key. Checkpoints written before this (callbacks
under their ``state_key``) load as they are.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping

import numpy as np
import torch

from .._errors import FormatError, StateError
from .._format.dtypes import dtype_by_name
from .._format.values import NotJSONable, encode_value
from .._torch.dtypes import dtype_of_torch, torch_dtype

__all__ = ["CALLBACKS", "MAX_INLINE", "STATE_KEY", "readable_callbacks", "restore_callbacks"]

CALLBACKS = "callbacks"  # Lightning's key of the callback states in its checkpoint dict
MAX_INLINE = 64  # elements of the largest tensor stored inside a callback's plain value
STATE_KEY = "arrayckpt_state_key"  # Lightning's state key, beside a state kept as arrays
_LABEL_CHARACTERS = re.compile(r"[^A-Za-z0-9_-]+")
_MAX_LABEL = 64


class _KeepArrays(Exception):
    """A state that cannot be one plain value: its tensors stay arrays."""


def readable_callbacks(checkpoint: dict[str, object]) -> dict[str, object]:
    """Lightning's checkpoint dict with its callback states under readable keys (a new top-level dict; ``checkpoint``
    is not changed)."""
    states = checkpoint.get(CALLBACKS)
    if not isinstance(states, dict) or not states:
        return checkpoint
    out: dict[str, object] = {}
    for state_key, state in states.items():
        label = _label(state_key, out)
        if not isinstance(state_key, str) or not isinstance(state, dict):
            raise StateError(f"{CALLBACKS}: {state_key!r} -> {type(state).__name__}: Lightning's callback states are "
                             "dicts under str keys (Callback.state_key / state_dict())")
        out[label] = _stored(state_key, state)
    return {**checkpoint, CALLBACKS: out}


def restore_callbacks(checkpoint: dict[str, object], where: str) -> dict[str, object]:
    """Invert :func:`readable_callbacks` on a loaded dict (``where``: the checkpoint, for errors); callbacks of a
    checkpoint written before (under their own state keys) stay as they are."""
    states = checkpoint.get(CALLBACKS)
    if not isinstance(states, dict):
        return checkpoint
    out: dict[str, object] = {}
    for label, stored in states.items():
        state_key, state = _original(label, stored, f"{where}: {CALLBACKS}.{label}")
        if state_key in out:
            raise FormatError(f"{where}: two callback states name the state key {state_key!r}; arrayckpt never "
                              "writes that: the checkpoint is damaged or was crafted")
        out[state_key] = state
    return {**checkpoint, CALLBACKS: out}


def _label(state_key: object, taken: Mapping[str, object]) -> str:
    """The readable key of a callback: its class name (``state_key`` up to the first ``{``), in letters, digits,
    ``_`` and ``-``; ``_2``, ``_3``, ... for later callbacks of the same name."""
    name = _LABEL_CHARACTERS.sub("_", str(state_key).split("{", 1)[0]).strip("_")[:_MAX_LABEL] or "callback"
    label, n = name, 1
    while label in taken:
        n += 1
        label = f"{name}_{n}"
    return label


def _stored(state_key: str, state: dict[str, object]) -> object:
    """One callback's state as stored: the plain tuple where it can be, else the state beside its key."""
    tensors: list[list[object]] = []
    try:
        plain = (_plain(state, (), tensors), state_key, tensors)
        encode_value(plain)
    except (_KeepArrays, NotJSONable, StateError):
        return {STATE_KEY: state_key, "state": state}
    return plain


def _plain(value: object, path: tuple[str | int, ...], tensors: list[list[object]]) -> object:
    """``value`` with each tensor replaced by its values and recorded in ``tensors``."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor or value.numel() > MAX_INLINE or value.is_complex() or \
                value.layout != torch.strided:  # (a subclass, a DTensor say, stays what it is: an array)
            raise _KeepArrays
        if not all(isinstance(p, str) or (type(p) is int) for p in path):
            raise _KeepArrays  # a tensor under a key JSON cannot name
        tensors.append([list(path), dtype_of_torch(value.dtype, ".".join(map(str, path))).name, list(value.shape)])
        return value.detach().cpu().tolist()
    if isinstance(value, np.ndarray):
        raise _KeepArrays
    if isinstance(value, dict):
        return {k: _plain(v, (*path, k), tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, (*path, i), tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_plain(v, (*path, i), tensors) for i, v in enumerate(value))
    return value


def _original(label: str, stored: object, where: str) -> tuple[str, object]:
    """Lightning's state key and the state of one stored callback."""
    if isinstance(stored, tuple) and len(stored) == 3 and isinstance(stored[0], dict) and isinstance(stored[1], str) \
            and isinstance(stored[2], list):
        state, state_key, tensors = stored
        for record in tensors:
            path, dtype, shape = _record(record, where)
            state = _put(state, path, functools.partial(_tensor, dtype=dtype, shape=shape, where=f"{where} {path}"),
                         where)
        return state_key, state
    if isinstance(stored, dict) and set(stored) == {STATE_KEY, "state"} and isinstance(stored[STATE_KEY], str):
        return stored[STATE_KEY], stored["state"]
    return label, stored  # written before readable keys: the label is Lightning's state key


def _record(record: object, where: str) -> tuple[list[str | int], str, list[int]]:
    """One ``[path, dtype, shape]`` record, checked."""
    if not (isinstance(record, list) and len(record) == 3 and isinstance(record[0], list) and isinstance(record[1], str)
            and isinstance(record[2], list) and all(isinstance(p, str) or type(p) is int for p in record[0])
            and all(type(n) is int and n >= 0 for n in record[2])):
        raise FormatError(f"{where}: {record!r} is not a [path, dtype, shape] record of a tensor; the checkpoint is "
                          "damaged or was crafted")
    return record[0], record[1], record[2]


def _put(container: object, path: list[str | int], make: Callable[[object], object], where: str) -> object:
    """``container`` with the leaf at ``path`` replaced by ``make(leaf)`` (containers copied along the path)."""
    if not path:
        return make(container)
    head, rest = path[0], path[1:]
    if isinstance(container, dict) and head in container:
        return {**container, head: _put(container[head], rest, make, where)}
    if isinstance(container, list | tuple) and type(head) is int and 0 <= head < len(container):
        items = list(container)
        items[head] = _put(items[head], rest, make, where)
        return items if isinstance(container, list) else tuple(items)
    raise FormatError(f"{where}: a tensor's path {path!r} leads nowhere in the state; the checkpoint is damaged or "
                      "was crafted")


def _tensor(values: object, dtype: str, shape: list[int], where: str) -> torch.Tensor:
    """The tensor a callback state's ``values`` (``tolist()``'s output) stood for."""
    try:
        tensor = torch.tensor(values, dtype=torch_dtype(dtype_by_name(dtype)))
        if tensor.numel() != math.prod(shape):
            raise ValueError(f"{tensor.numel()} values for shape {shape}")
        return tensor.reshape(shape)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise FormatError(f"{where}: not a {dtype} tensor of shape {shape} ({e}); the checkpoint is damaged or was "
                          "crafted") from None
