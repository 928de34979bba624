"""The torch layer: what arrayckpt needs to know about torch — the torch side of the dtype table, host views
of tensors, shards (DTensor and explicit), walking nested training state into named leaves, collectives, and
read-once loading over a process group (``dtypes.py``, ``shards.py``, ``state.py``, ``aliases.py``: tied tensors,
``tensors.py``, ``dist.py``, ``readonce.py``), and moving data between a device and pooled (pinned) host
buffers in batches, on a side stream (``transfer.py``). Nothing below this layer imports torch.

This package's own ``__init__`` imports no torch: it holds the guards that turn a missing torch (``pip install
arrayckpt`` has none; ``arrayckpt[torch]`` adds it) into one clear error naming the extra.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._errors import TORCH_EXTRA, TorchNotInstalledError

__all__ = ["TORCH_EXTRA", "TorchNotInstalledError", "is_missing_torch", "require_torch", "torch_missing"]


def is_missing_torch(error: ImportError) -> bool:
    """Whether an import failed because torch (or a part of it) is not installed."""
    return isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] == "torch"


def require_torch(what: str) -> None:
    """Raise :class:`TorchNotInstalledError` naming ``what`` unless torch can be imported."""
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as e:
        if not is_missing_torch(e):
            raise
        raise TorchNotInstalledError.needed_by(what) from None


def torch_missing(name: str) -> Any:
    """What the public name ``name`` (``arrayckpt.save``) stands for without torch: a function, or for a class
    name a class, that raises :class:`TorchNotInstalledError` when called, so ``import arrayckpt`` and
    ``from arrayckpt import *`` keep working and only the call fails."""

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise TorchNotInstalledError.needed_by(name)

    short = name.rpartition(".")[2]
    doc = f"Unavailable: {name} requires PyTorch ({TORCH_EXTRA})."
    if short[:1].isupper():
        return type(short, (), {"__new__": fail, "__doc__": doc, "__module__": "arrayckpt"})
    stub: Callable[..., Any] = fail
    stub.__name__ = stub.__qualname__ = short
    stub.__doc__ = doc
    stub.__module__ = "arrayckpt"
    return stub
