"""The torch side of the dtype table: ``torch.<name>`` for each stored dtype, and zero-copy views between torch
tensors and numpy arrays.

Types numpy lacks (bfloat16, float8) are viewed through a torch integer type of the same width that numpy
understands (the "carrier"): host views of such tensors stay carrier-typed, so that a save or load that only
moves bytes (the local fast path) never imports ``ml_dtypes`` (0.7 s at a process's first bfloat16 save); where
values are interpreted the view is typed (``_format/dtypes.py::as_typed``): views of the same memory, never copies.
"""

from __future__ import annotations

import numpy as np
import torch

from .._errors import FormatError, StateError
from .._format.dtypes import DTYPES, DType

__all__ = ["dtype_of_torch", "numpy_view", "torch_dtype", "torch_view"]

_BY_TORCH: dict[torch.dtype, DType] = {getattr(torch, name): row for name, row in DTYPES.items()
                                       if isinstance(getattr(torch, name, None), torch.dtype)}
_CARRIERS = {1: torch.uint8, 2: torch.int16}  # same-width integer types numpy knows, for ml_dtypes types


def torch_dtype(dt: DType) -> torch.dtype:
    """The torch dtype of a table row (refused when this torch lacks it, e.g. an older torch and a newer float8)."""
    found = getattr(torch, dt.name, None)
    if not isinstance(found, torch.dtype):
        raise FormatError(f"dtype {dt.name!r} is not known to torch {torch.__version__}; read it as numpy instead")
    return found


def dtype_of_torch(dtype: torch.dtype, key: str) -> DType:
    """The table row of a torch dtype, or an error naming the key when it cannot be stored."""
    try:
        return _BY_TORCH[dtype]
    except KeyError:
        raise StateError(
            f"tensor {key!r} has dtype {dtype}, which arrayckpt cannot store; "
            f"supported: {', '.join(DTYPES)}. Convert it (e.g. .to(torch.float32)) before saving"
        ) from None


def _carrier(dt: DType) -> torch.dtype | None:
    """The torch integer dtype to view ``dt``'s memory through, when numpy has no native ``dt`` (else ``None``)."""
    return None if dt.native else _CARRIERS[dt.itemsize]


def numpy_view(tensor: torch.Tensor, dt: DType) -> np.ndarray:
    """A numpy array sharing ``tensor``'s memory (any strides), typed with the table's numpy dtype, or for a type
    numpy lacks with its carrier (:func:`~arrayckpt._format.dtypes.as_typed` types it).

    The tensor must be on the CPU with its lazy conjugate/negative bits resolved.
    """
    carrier = _carrier(dt)
    if carrier is None:
        return tensor.numpy()
    return tensor.view(carrier).numpy()


def torch_view(array: np.ndarray, dt: DType) -> torch.Tensor:
    """A torch tensor sharing ``array``'s memory, typed with the table's torch dtype."""
    carrier = _carrier(dt)
    if carrier is None:
        return torch.from_numpy(array)
    carrier_np = torch.empty((), dtype=carrier).numpy().dtype
    return torch.from_numpy(array.view(carrier_np)).view(torch_dtype(dt))
