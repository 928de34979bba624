"""arrayckpt: distributed PyTorch checkpoints in which every tensor is a chunked Zarr v3 array.

>>> import arrayckpt, torch, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> arrayckpt.save({"model": torch.nn.Linear(3, 2), "step": 10}, path, step=10)
>>> arrayckpt.open(path)["model.weight"].shape
(2, 3)

Importing the package is cheap and does not import torch: the public names are loaded on first use
(PEP 562), so zarr-python can load ``arrayckpt._zarr_dtypes`` through its entry points without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _zarr_dtypes as _zarr_dtypes  # registers bfloat16/float8 with zarr-python

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ._async import CheckpointBusyError, SaveHandle, async_save
    from ._codecs import Codec
    from ._errors import (
        ArrayckptError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CorruptCheckpointError,
        FormatError,
        IncompleteCheckpointError,
        KeyMismatchError,
        PickleNotAllowedError,
        StateError,
        StorageError,
    )
    from ._interval import OptimalInterval, optimal_interval
    from ._load import LoadResult, load
    from ._manager import CheckpointManager, Interval, Retention
    from ._reader import Checkpoint, LazyArray
    from ._reader import open_checkpoint as open  # noqa: A004
    from ._save import save
    from ._shards import PerRank, Shard
    from ._storage import collect_garbage as gc

_LAZY = {
    "ArrayckptError": "._errors",
    "CheckpointBusyError": "._async",
    "Checkpoint": "._reader",
    "CheckpointExistsError": "._errors",
    "CheckpointManager": "._manager",
    "CheckpointNotFoundError": "._errors",
    "Codec": "._codecs",
    "CorruptCheckpointError": "._errors",
    "FormatError": "._errors",
    "IncompleteCheckpointError": "._errors",
    "Interval": "._manager",
    "KeyMismatchError": "._errors",
    "LazyArray": "._reader",
    "LoadResult": "._load",
    "OptimalInterval": "._interval",
    "SaveHandle": "._async",
    "PerRank": "._shards",
    "Shard": "._shards",
    "PickleNotAllowedError": "._errors",
    "Retention": "._manager",
    "StateError": "._errors",
    "StorageError": "._errors",
    "async_save": "._async",
    "gc": "._storage:collect_garbage",
    "load": "._load",
    "optimal_interval": "._interval",
    "open": "._reader:open_checkpoint",
    "save": "._save",
}

__all__ = [
    "ArrayckptError",
    "Checkpoint",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "Codec",
    "CorruptCheckpointError",
    "FormatError",
    "IncompleteCheckpointError",
    "Interval",
    "KeyMismatchError",
    "LazyArray",
    "LoadResult",
    "OptimalInterval",
    "PerRank",
    "PickleNotAllowedError",
    "Retention",
    "SaveHandle",
    "Shard",
    "StateError",
    "StorageError",
    "__version__",
    "async_save",
    "gc",
    "load",
    "open",
    "optimal_interval",
    "save",
]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'arrayckpt' has no attribute {name!r}")
    module_name, _, attribute = target.partition(":")
    value = getattr(importlib.import_module(module_name, __name__), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
