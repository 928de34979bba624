"""Resuming a manager: the newest step that reads back whole, from whichever of its sources (one per durable tier
holding it: :meth:`Tier.source`) does.

A damaged source is named in a warning and the next source, then the next older step, is tried; the ranks of a group
agree on one step before any counts as restored.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from .._errors import (
    ArrayckptError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatError,
    IncompleteCheckpointError,
)
from .._read.load import load
from .._torch.dist import Group

__all__ = ["StepCandidate", "StepSource", "restore_newest"]

_DAMAGE = (CorruptCheckpointError, FormatError, CheckpointNotFoundError, IncompleteCheckpointError)  # worth a fallback


@dataclass(frozen=True)
class StepSource:
    """Where :func:`restore_newest` may load a step from (one tier's checkpoint of it): its path, with its storage
    options, and the tier's name."""

    path: Path | str  # a Path, or an object-storage URL
    storage_options: Mapping[str, Any] | None
    tier: str  # the name of the tier holding it: "local" or "remote"


class StepCandidate(NamedTuple):
    """A step :func:`restore_newest` may restore, with its sources (fastest tier first)."""

    step: int
    sources: list[StepSource]


def restore_newest(state: Mapping[str, Any], candidates: list[StepCandidate], group: Group,
                   load_options: Mapping[str, Any]) -> int:
    """Load the first of ``candidates`` (newest first: a step and its sources, fastest tier first) that reads whole
    into ``state``; returns its step. Each source is loaded with ``load_options`` (``atomic=True`` unless the caller
    chose otherwise: a damaged source then leaves ``state`` as it was). A damaged source (a failed checksum, a missing
    chunk, an incomplete or unreadable checkpoint) is named in a warning and the next source, then the next older step,
    is
    tried; any other error (the state does not fit the checkpoint, storage unreachable) is raised at once. With
    several ranks every rank loads its part and they agree (one ``all_gather`` per step tried) before a step counts
    as restored, so that all of them restore the same step; the remote source a rank falls back to is opened by that
    rank alone (``share_root=False``). When no candidate reads whole the newest one's error is raised."""
    newest: BaseException | None = None
    for n, (step, sources) in enumerate(candidates):
        error = _load_sources(state, step, sources, group, load_options)
        text = None if error is None else f"{type(error).__name__}: {error}"
        reports = group.all_gather((text, error is not None and not isinstance(error, _DAMAGE)))
        failed = [(rank, what) for rank, (what, _) in enumerate(reports) if what is not None]
        if not failed:
            return step
        if error is None:  # another rank could not restore this step: neither can the group
            error = CorruptCheckpointError(f"step {step}: rank {failed[0][0]} could not restore it ({failed[0][1]})")
        if any(fatal for _, fatal in reports):
            raise error
        newest = newest or error
        if n + 1 == len(candidates):
            raise newest
        if group.is_coordinator or text is not None:
            where = " or ".join(str(source.path) for source in sources)
            warnings.warn(f"{where}: step {step} cannot be restored ({failed[0][1]}"
                          f"{f', on rank {failed[0][0]}' if group.size > 1 else ''}); restoring step "
                          f"{candidates[n + 1][0]}, the newest before it, instead", RuntimeWarning, stacklevel=3)
    raise CheckpointNotFoundError("nothing to restore")  # (no candidates: the caller returns None before)


def _load_sources(state: Mapping[str, Any], step: int, sources: list[StepSource], group: Group,
                  options: Mapping[str, Any]) -> BaseException | None:
    """Load step ``step`` from its first source that reads whole; the last source's error if none does (or the first
    error that is not damage)."""
    for i, source in enumerate(sources):
        more = {"share_root": False} if i and group.size > 1 else {}
        try:
            load(state, source.path, process_group=group, storage_options=source.storage_options, **{**options, **more})
            return None
        except _DAMAGE as e:
            if i + 1 == len(sources):
                return e
            warnings.warn(f"{source.path}: cannot be restored ({e}); restoring step {step} from the "
                          f"{sources[i + 1].tier} tier instead", RuntimeWarning, stacklevel=4)
        except ArrayckptError as e:
            return e
    return None
