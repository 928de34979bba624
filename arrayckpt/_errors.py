"""Exceptions raised by arrayckpt.

Every error has a builtin base as well, so callers can catch either the arrayckpt class or the
builtin one (the pattern of zarr-python's ``errors.py``): ``except FileNotFoundError`` keeps working for
"there is no checkpoint here", ``except ValueError`` for "the state does not fit the checkpoint".
"""

from __future__ import annotations

__all__ = [
    "ArrayckptError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CollectiveError",
    "CorruptCheckpointError",
    "FormatError",
    "IncompleteCheckpointError",
    "KeyMismatchError",
    "PickleNotAllowedError",
    "StateError",
    "StorageError",
]


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
    """Stored bytes are damaged or missing: a checksum mismatch, a missing chunk, unreadable metadata."""


class FormatError(ArrayckptError, ValueError):
    """Metadata does not follow the arrayckpt format (wrong types, unknown version, unsafe paths)."""


class StateError(ArrayckptError, ValueError):
    """The state given to ``save`` or ``load`` cannot be handled as it is (the message says the fix)."""


class KeyMismatchError(StateError, KeyError):
    """``load(strict=True)`` found keys missing from the checkpoint or not present in the state."""

    def __str__(self) -> str:  # KeyError would otherwise quote the whole message
        return str(self.args[0]) if self.args else ""


class PickleNotAllowedError(ArrayckptError, PermissionError):
    """A value needs pickle, and ``allow_pickle=True`` was not given."""


class StorageError(ArrayckptError, OSError):
    """Writing to storage failed (full disk, permissions, a store that keeps refusing requests)."""
