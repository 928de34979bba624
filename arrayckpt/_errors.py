"""Exceptions raised by arrayckpt, and the one warning category of its own (:class:`PickleWarning`).

Every error has a builtin base as well, so callers can catch either the arrayckpt class or the
builtin one (the pattern of zarr-python's ``errors.py``): ``except FileNotFoundError`` keeps working for
"there is no checkpoint here", ``except ValueError`` for "the state does not fit the checkpoint".
"""

from __future__ import annotations

import sys
import warnings
from types import FrameType

__all__ = [
    "ArrayckptError",
    "BaseNotAllowedError",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ClosedCheckpointError",
    "CollectiveError",
    "CorruptCheckpointError",
    "FormatError",
    "IncompleteCheckpointError",
    "KeyMismatchError",
    "LocationError",
    "PickleNotAllowedError",
    "PickleWarning",
    "ReplacedCheckpointError",
    "StateError",
    "StorageError",
    "TorchNotInstalledError",
    "UntrustedDirectoryError",
    "outside_stacklevel",
    "warn_unpickling",
]

TORCH_EXTRA = "pip install 'arrayckpt[torch]'"


class ArrayckptError(Exception):
    """Base class of every error arrayckpt raises on purpose."""


class CheckpointNotFoundError(ArrayckptError, FileNotFoundError):
    """There is no checkpoint (committed or not) at the given location."""


class IncompleteCheckpointError(ArrayckptError, FileNotFoundError):
    """Something is at the location, but its commit (the root metadata) was never written."""


class CheckpointExistsError(ArrayckptError, FileExistsError):
    """A committed checkpoint is already at the location and ``overwrite`` was not given."""


class CollectiveError(ArrayckptError, RuntimeError):
    """An exchange with the other ranks failed: a rank died, hung past the group's timeout, or disagreed."""


class CorruptCheckpointError(ArrayckptError, OSError):
    """Stored bytes are damaged or missing: a checksum mismatch, a missing chunk, unreadable metadata, a delta
    whose base is gone or was replaced."""


class ReplacedCheckpointError(CorruptCheckpointError):
    """The checkpoint (or a base it reads through) was replaced or removed while it was being read, so what was
    read may mix two checkpoints. Nothing is damaged: open it again. (A :class:`CorruptCheckpointError`, so
    ``except CorruptCheckpointError`` keeps catching it.)"""


class FormatError(ArrayckptError, ValueError):
    """Metadata does not follow the arrayckpt format (wrong types, unknown version, unsafe paths)."""


class LocationError(ArrayckptError, ValueError):
    """A path or URL cannot name a checkpoint's location as written (an unsupported scheme, no bucket, a prefix with
    ``.``, ``..`` or empty segments, unknown storage options): the message names it and says how to write it."""


class StateError(ArrayckptError, ValueError):
    """The state given to ``save`` or ``load`` cannot be handled as it is (the message says the fix)."""


class KeyMismatchError(StateError, KeyError):
    """``load(strict=True)`` found keys missing from the checkpoint or not present in the state."""

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return str(self.args[0]) if self.args else ""


class PickleNotAllowedError(ArrayckptError, PermissionError):
    """A value needs pickle, and ``allow_pickle=True`` was not given."""


class BaseNotAllowedError(ArrayckptError, PermissionError):
    """A delta checkpoint names a base outside the places a reader follows by default (the directory or prefix
    holding the delta checkpoint): the caller must name a root that holds it (``base_roots=[...]``, CLI
    ``--base-root``) to have it read. A checkpoint from an untrusted source could otherwise make a reader open
    any directory or URL, with the delta checkpoint's credentials (spec §10.1, §12)."""


class UntrustedDirectoryError(ArrayckptError, PermissionError):
    """A peer-memory directory (or one above it) that another local user could change: not owned by this user,
    writable by others, or a link. Its steps are never loaded and nothing is written into it (``docs/PEER_MEMORY.md``,
    "A shared host")."""


class StorageError(ArrayckptError, OSError):
    """Storage could not be used: a write failed (full disk, permissions), or a store could not be reached or
    kept refusing requests past its retries (on reads too: that says nothing about the data)."""


class CheckpointBusyError(ArrayckptError, RuntimeError):
    """``async_save(..., if_busy="error")`` was called while an earlier async save was still running; or a root, or a
    prefix, is held by another writer: a ``CheckpointManager`` (its lock or lease), a save in progress (spec §9.4)."""


class ClosedCheckpointError(ArrayckptError, ValueError):
    """A checkpoint's data was read after :meth:`Checkpoint.close` (or its ``with`` block) released it: open it
    again. (A ``ValueError``, as for I/O on a closed Python file.)"""


class TorchNotInstalledError(ArrayckptError, ModuleNotFoundError):
    """A function that needs PyTorch was called where torch is not installed: ``pip install 'arrayckpt[torch]'``.

    A :class:`ModuleNotFoundError` (so ``except ImportError`` catches it, as for any missing optional dependency)
    with ``name == "torch"``, and an :class:`arrayckpt.ArrayckptError` like every error arrayckpt raises.
    """

    @classmethod
    def needed_by(cls, what: str) -> TorchNotInstalledError:
        """The error for ``what`` (``arrayckpt.save``, ``converting torch to arrayckpt``)."""
        return cls(f"{what} requires PyTorch: {TORCH_EXTRA}", name="torch")


class PickleWarning(UserWarning):
    """A load unpickled values of a checkpoint (it was opened with ``allow_pickle=True``): unpickling runs whatever
    code the checkpoint's writer put in it, so it is only safe for checkpoints you trust. Emitted once per load,
    and once per read of a pickled value of an open checkpoint, naming the keys (as ``torch.load`` warns about
    ``weights_only=False``). Silence it where you trust the source::

        warnings.filterwarnings("ignore", category=arrayckpt.PickleWarning)
    """


def warn_unpickling(what: str) -> None:
    """One :class:`PickleWarning` that ``what`` (``"<path>: unpickling 'a', 'b'"``) is being unpickled with
    ``allow_pickle=True``, naming the user's line, as ``torch.load(weights_only=False)`` warns."""
    warnings.warn(f"{what} (allow_pickle=True): unpickling runs whatever code its writer put there; unpickle only "
                  "from checkpoints you trust (silence: warnings.filterwarnings('ignore', "
                  "category=arrayckpt.PickleWarning))", PickleWarning, stacklevel=outside_stacklevel())


def outside_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn``, in the function that calls this one, of the first caller outside
    arrayckpt: the warning then names the user's line (which the default filter shows once), not arrayckpt's."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "arrayckpt":
        frame, level = frame.f_back, level + 1
    return level
