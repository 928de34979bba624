"""``load_together``: an atomic load on several ranks that restores all of them or none.

``atomic=True`` protects one rank: its reads go to fresh buffers and its state changes only once they all passed. A
restore that falls back to another source when it fails (peer memory, ``_peer/restore.py``) needs more: if one rank's
reads fail after another's passed, that other rank must not keep what it read. Here the ranks agree (one
``all_gather``) between their reads and the first change to any state.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import ArrayckptError
from .._storage import parse_location, parse_roots
from .._torch.dist import Group
from .checkpoint import open_location, stored_of
from .load import LoadResult, _load, load
from .perrank import PerRankPolicy, check_policy

__all__ = ["Agreement", "load_together"]


def load_together(state: Mapping[str, Any], path: str | os.PathLike[str], group: Group, *, strict: bool = True,
                  allow_pickle: bool = False, read_once: bool = False,
                  storage_options: Mapping[str, Any] | None = None, atomic: bool = True, share_root: bool = True,
                  base_roots: Sequence[str | os.PathLike[str]] | None = None,
                  per_rank: PerRankPolicy | None = None) -> LoadResult:
    """:func:`load` (same options; ``atomic=True`` by default) whose ranks agree before any changes its state: every
    rank's reads and checks passed, or every rank raises (its own error, or the first failing rank's, named) with
    ``state`` untouched everywhere. A load of one step that must restore all ranks or none (a restore from peer
    memory, which falls back to another source when it fails). Collective: every rank calls it once. With
    ``atomic=False`` (reads in place: nothing to agree on before the state changes) it is :func:`load`."""
    check_policy(per_rank)
    if not atomic or group.size == 1:
        return load(state, path, strict=strict, allow_pickle=allow_pickle, process_group=group, read_once=read_once,
                    storage_options=storage_options, atomic=atomic, share_root=share_root, base_roots=base_roots,
                    per_rank=per_rank)
    agreement = Agreement(group)
    try:
        location = parse_location(path, storage_options)
        with open_location(location, allow_pickle=allow_pickle,
                           base_roots=parse_roots(base_roots, storage_options)) as checkpoint:
            return _load(state, stored_of(checkpoint), group, strict=strict, read_once=read_once, atomic=True,
                         agreement=agreement, per_rank=per_rank)
    except ArrayckptError as e:
        if not agreement.reached:  # failed before its reads (opening, matching the state): tell the others
            agreement.settle(e)
        raise


class Agreement:
    """One ``all_gather`` of the ranks' outcomes, between an atomic load's reads and the first change to the state."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.reached = False

    def settle(self, error: ArrayckptError | None) -> None:
        """Report this rank's outcome; raise ``error``, or the first failing rank's error (named) if another failed."""
        self.reached = True
        reports = self.group.all_gather(None if error is None else _picklable(error))
        if error is not None:
            raise error
        for rank, failed in enumerate(reports):
            if failed is not None:
                failed.args = (f"rank {rank}: {failed.args[0] if failed.args else failed}", *failed.args[1:])
                raise failed


def _picklable(error: ArrayckptError) -> ArrayckptError:
    try:
        pickle.dumps(error)
        return error
    except Exception:
        return ArrayckptError(f"{type(error).__name__}: {error}")
