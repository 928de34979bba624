"""arrayckpt: distributed PyTorch checkpoints in which every tensor is a chunked Zarr v3 array.

>>> import arrayckpt, torch, tempfile, os
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> arrayckpt.save({"model": torch.nn.Linear(3, 2), "step": 10}, path, step=10)
>>> arrayckpt.open(path)["model.weight"].shape
(2, 3)

Importing the package is cheap and does not import torch: the public names are loaded on first use
(PEP 562), so zarr-python can load ``arrayckpt._zarr_dtypes`` through its entry points without torch.
torch is optional (``pip install 'arrayckpt[torch]'``): without it, opening, slicing into numpy, ``verify``,
``show``, ``diff`` and ``compact`` work, and each torch-only name (``save``, ``load``, ``Shard``...) raises
:class:`TorchNotInstalledError` when called.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any

from ._version import __version__


def _register_zarr_types() -> None:
    """bfloat16/float8 for zarr-python, without importing zarr or ml_dtypes now (about a second of start-up that
    ``arrayckpt --help`` would pay): register at once when zarr is already imported, else arm the start-up hook's
    finder (``_arrayckpt_zarr_hook``), which registers them when zarr finishes importing. Where the hook module
    is missing (a source tree not on ``sys.path``) or disabled, register now as before."""
    if "zarr" not in sys.modules:
        try:
            import _arrayckpt_zarr_hook as hook
        except ImportError:
            pass
        else:
            if hook.os.environ.get(hook.DISABLE_ENV, "") in ("", "0"):
                hook.install()
                return
    importlib.import_module("._zarr_dtypes", __name__)


_register_zarr_types()

if TYPE_CHECKING:
    from ._convert.common import ConvertResult
    from ._convert.dispatch import convert
    from ._errors import (
        ArrayckptError,
        BaseNotAllowedError,
        CheckpointBusyError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        ClosedCheckpointError,
        CollectiveError,
        CorruptCheckpointError,
        FormatError,
        IncompleteCheckpointError,
        KeyMismatchError,
        LocationError,
        PickleNotAllowedError,
        PickleWarning,
        ReplacedCheckpointError,
        StateError,
        StorageError,
        TorchNotInstalledError,
        UntrustedDirectoryError,
    )
    from ._format.codecs import Codec
    from ._manage.manager import CheckpointManager
    from ._manage.policy import Incremental, Interval, OptimalInterval, Retention, optimal_interval
    from ._manage.tiers import Remote
    from ._peer.config import PeerMemory
    from ._read.checkpoint import Checkpoint
    from ._read.checkpoint import open_checkpoint as open  # noqa: A004
    from ._read.lazy import LazyArray
    from ._read.load import LoadResult, load
    from ._storage.gc import collect_garbage as gc
    from ._tools.copy import CopyResult, copy
    from ._tools.damage import Damage
    from ._tools.estimate import SizeEstimate, estimate_size
    from ._tools.inspect import DiffReport, SliceSummary, TensorDiff, diff, show
    from ._tools.refs import RefsResult, write_refs
    from ._tools.report.build import report
    from ._tools.verify import VerifyReport, verify
    from ._torch.shards import PerRank, Shard
    from ._write.asynchronous import SaveHandle, async_save, release_host_buffers
    from ._write.compact import CompactResult, compact
    from ._write.save import save

# The public API: name -> module (and attribute, where it differs) that defines it, imported on first use.
# This is the one table: ``__all__`` is derived from it, and ``tests/test_architecture.py`` checks that the
# TYPE_CHECKING imports above (for type checkers and IDEs only) say the same.
_LAZY: dict[str, str] = {
    "ArrayckptError": "._errors",
    "BaseNotAllowedError": "._errors",
    "Checkpoint": "._read.checkpoint",
    "CheckpointBusyError": "._errors",
    "CheckpointExistsError": "._errors",
    "CheckpointManager": "._manage.manager",
    "CheckpointNotFoundError": "._errors",
    "ClosedCheckpointError": "._errors",
    "Codec": "._format.codecs",
    "CollectiveError": "._errors",
    "CompactResult": "._write.compact",
    "ConvertResult": "._convert.common",
    "CopyResult": "._tools.copy",
    "CorruptCheckpointError": "._errors",
    "Damage": "._tools.damage",
    "DiffReport": "._tools.inspect",
    "FormatError": "._errors",
    "IncompleteCheckpointError": "._errors",
    "Incremental": "._manage.policy",
    "Interval": "._manage.policy",
    "KeyMismatchError": "._errors",
    "LazyArray": "._read.lazy",
    "LocationError": "._errors",
    "LoadResult": "._read.load",
    "OptimalInterval": "._manage.policy",
    "PeerMemory": "._peer.config",
    "PerRank": "._torch.shards",
    "RefsResult": "._tools.refs",
    "PickleNotAllowedError": "._errors",
    "PickleWarning": "._errors",
    "Remote": "._manage.tiers",
    "ReplacedCheckpointError": "._errors",
    "Retention": "._manage.policy",
    "SaveHandle": "._write.asynchronous",
    "Shard": "._torch.shards",
    "SizeEstimate": "._tools.estimate",
    "SliceSummary": "._tools.inspect",
    "StateError": "._errors",
    "StorageError": "._errors",
    "TensorDiff": "._tools.inspect",
    "TorchNotInstalledError": "._errors",
    "UntrustedDirectoryError": "._errors",
    "VerifyReport": "._tools.verify",
    "async_save": "._write.asynchronous",
    "compact": "._write.compact",
    "convert": "._convert.dispatch",
    "copy": "._tools.copy",
    "diff": "._tools.inspect",
    "estimate_size": "._tools.estimate",
    "gc": "._storage.gc:collect_garbage",
    "load": "._read.load",
    "open": "._read.checkpoint:open_checkpoint",
    "optimal_interval": "._manage.policy",
    "release_host_buffers": "._write.asynchronous",
    "report": "._tools.report.build",
    "save": "._write.save",
    "show": "._tools.inspect",
    "verify": "._tools.verify",
    "write_refs": "._tools.refs",
}

__all__ = sorted([*_LAZY, "__version__"])


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'arrayckpt' has no attribute {name!r}")
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name, __name__)
    except ModuleNotFoundError as e:  # torch is not installed: a stand-in that says so when called
        from ._torch import is_missing_torch, torch_missing

        if not is_missing_torch(e):
            raise
        value = torch_missing(f"arrayckpt.{name}")
    else:
        value = getattr(module, attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
