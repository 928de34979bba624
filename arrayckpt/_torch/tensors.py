"""Host views of tensors: the numpy arrays TensorStore reads from and writes into, without copies."""

from __future__ import annotations

import numpy as np
import torch

from .._errors import StateError
from .._format.dtypes import DType
from .dtypes import numpy_view

__all__ = ["readable_numpy", "writable_numpy"]


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


def writable_numpy(tensor: torch.Tensor, dt: DType, key: str = "") -> np.ndarray:
    """A numpy view of a CPU tensor's memory for reading into (any strides)."""
    _check_plain(tensor, key)
    if tensor.device.type != "cpu":
        raise StateError(f"tensor {key!r} is on {tensor.device}; read into a CPU tensor and copy it over")
    if tensor.is_conj() or tensor.is_neg():
        raise StateError(f"tensor {key!r} is a lazy conjugate/negative view; load into a plain tensor")
    return numpy_view(tensor.detach(), dt)
