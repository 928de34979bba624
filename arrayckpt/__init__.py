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
    from ._compact import CompactResult, compact
    from ._convert import ConvertResult, convert
    from ._errors import (
        ArrayckptError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CollectiveError,
        CorruptCheckpointError,
        FormatError,
        IncompleteCheckpointError,
        KeyMismatchError,
        PickleNotAllowedError,
        StateError,
        StorageError,
    )
    from ._estimate import SizeEstimate, estimate_size
    from ._inspect import DiffReport, SliceSummary, TensorDiff, diff, show
    from ._interval import OptimalInterval, optimal_interval
    from ._load import LoadResult, load
    from ._manager import CheckpointManager, Incremental, Interval, Retention
    from ._reader import Checkpoint, LazyArray
    from ._reader import open_checkpoint as open  # noqa: A004
    from ._save import save
    from ._shards import PerRank, Shard
    from ._storage import collect_garbage as gc
    from ._verify import Damage, VerifyReport, verify

_LAZY = {
    "ArrayckptError": "._errors",
    "Checkpoint": "._reader",
    "CheckpointBusyError": "._async",
    "CheckpointExistsError": "._errors",
    "CheckpointManager": "._manager",
    "CheckpointNotFoundError": "._errors",
    "CollectiveError": "._errors",
    "Codec": "._codecs",
    "CompactResult": "._compact",
    "ConvertResult": "._convert",
    "CorruptCheckpointError": "._errors",
    "Damage": "._verify",
    "DiffReport": "._inspect",
    "FormatError": "._errors",
    "IncompleteCheckpointError": "._errors",
    "Incremental": "._manager",
    "Interval": "._manager",
    "KeyMismatchError": "._errors",
    "LazyArray": "._reader",
    "LoadResult": "._load",
    "OptimalInterval": "._interval",
    "PerRank": "._shards",
    "PickleNotAllowedError": "._errors",
    "Retention": "._manager",
    "SaveHandle": "._async",
    "Shard": "._shards",
    "SizeEstimate": "._estimate",
    "SliceSummary": "._inspect",
    "StateError": "._errors",
    "StorageError": "._errors",
    "TensorDiff": "._inspect",
    "VerifyReport": "._verify",
    "async_save": "._async",
    "compact": "._compact",
    "convert": "._convert",
    "diff": "._inspect",
    "estimate_size": "._estimate",
    "gc": "._storage:collect_garbage",
    "load": "._load",
    "open": "._reader:open_checkpoint",
    "optimal_interval": "._interval",
    "save": "._save",
    "show": "._inspect",
    "verify": "._verify",
}

__all__ = [
    "ArrayckptError",
    "Checkpoint",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CollectiveError",
    "Codec",
    "CompactResult",
    "ConvertResult",
    "CorruptCheckpointError",
    "Damage",
    "DiffReport",
    "FormatError",
    "IncompleteCheckpointError",
    "Incremental",
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
    "SizeEstimate",
    "SliceSummary",
    "StateError",
    "StorageError",
    "TensorDiff",
    "VerifyReport",
    "__version__",
    "async_save",
    "compact",
    "convert",
    "diff",
    "estimate_size",
    "gc",
    "load",
    "open",
    "optimal_interval",
    "save",
    "show",
    "verify",
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
