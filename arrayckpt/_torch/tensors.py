"""Host views of tensors: the numpy arrays TensorStore reads from and writes into, without copies."""

from __future__ import annotations

import numpy as np
import torch

from .._errors import StateError
from .._format.dtypes import DType
from .dtypes import numpy_view

__all__ = ["check_loadable", "overlaps_itself", "readable_numpy", "writable_numpy"]


def _check_plain(tensor: torch.Tensor, key: str) -> None:
    if tensor.layout != torch.strided:
        raise StateError(f"tensor {key!r} has layout {tensor.layout}; convert it with .to_dense() first")
    if type(tensor).__name__ == "DTensor":
        raise StateError(
            f"tensor {key!r} is a DTensor; distributed tensors are not supported yet — "
            "pass .full_tensor() or its local shard"
        )


def readable_numpy(tensor: torch.Tensor, dt: DType, key: str) -> np.ndarray:
    """A numpy view of ``tensor``'s values for writing; copies only off-CPU or lazily conjugated data."""
    _check_plain(tensor, key)
    host = tensor.detach()
    if host.device.type != "cpu":
        host = host.cpu()
    return numpy_view(host.resolve_conj().resolve_neg(), dt)


def overlaps_itself(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int = 1) -> bool:
    """Whether some memory location is shared by two elements of an array of this shape and these strides (in
    units of which an element takes ``itemsize``: 1 for torch's element strides, the item size for numpy's byte
    strides): an expanded, stride-0 dimension, an ``as_strided`` view. Conservative: a layout whose dimensions,
    sorted by stride, do not each step past everything the smaller ones span counts as overlapping."""
    if any(size == 0 for size in shape):
        return False
    dims = sorted((abs(stride), size) for size, stride in zip(shape, strides, strict=True) if size > 1)
    span = itemsize - 1  # the furthest unit reached by the dimensions with smaller strides
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def check_loadable(tensor: torch.Tensor, key: str) -> None:
    """Refuse load targets that cannot hold what is read into them: a meta tensor (no memory: loading would
    "succeed" with nothing loaded) and a tensor whose elements share memory (an expanded, stride-0 view: each
    row would overwrite the previous one, silently keeping the last)."""
    if tensor.device.type == "meta":
        raise StateError(f"tensor {key!r} is on the meta device and has no memory to load into; load into a "
                         "materialised tensor (e.g. module.to_empty(device='cpu') first)")
    if overlaps_itself(tuple(tensor.shape), tuple(tensor.stride())):
        raise StateError(f"tensor {key!r} (shape {list(tensor.shape)}, strides {list(tensor.stride())}) has elements "
                         "sharing memory (an expanded or overlapping view), so it cannot hold distinct values; load "
                         "into a tensor with its own memory: .contiguous() or .clone() it first")


def writable_numpy(tensor: torch.Tensor, dt: DType, key: str = "") -> np.ndarray:
    """A numpy view of a CPU tensor's memory for reading into (any strides)."""
    _check_plain(tensor, key)
    check_loadable(tensor, key)
    if tensor.device.type != "cpu":
        raise StateError(f"tensor {key!r} is on {tensor.device}; read into a CPU tensor and copy it over")
    if tensor.is_conj() or tensor.is_neg():
        raise StateError(f"tensor {key!r} is a lazy conjugate/negative view; load into a plain tensor")
    return numpy_view(tensor.detach(), dt)
