"""How a save is asked for: ``SaveOptions`` (what the user chose) and ``SaveSetup`` (what an internal caller adds).

``arrayckpt.save`` and ``arrayckpt.async_save`` keep their keyword parameters (the public API) and build a
``SaveOptions`` from them; everything below them (``save_with``, ``async_save_with``, ``finish_save``, the
streaming writer) takes the options object. ``CheckpointManager`` keeps one and derives each save's with
``dataclasses.replace`` (the step, metrics and base of that save).

A ``SaveSetup`` is never the user's: the chunk policy (tests and converters choose tiny or streaming-sized chunks),
the guard a manager checks its root with, the plan cache a manager keeps for its own saves, and a
:class:`Destination` for a caller that writes somewhere other than a location's ordinary transaction (a peer-memory
save writes into node-local directories, ``_peer/save.py``). Keeping the two apart keeps the options exactly the
public parameters, and shows in every signature which callers reach below them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._format.codecs import CodecChoice
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._settings import settings

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch.distributed import ProcessGroup

    from .._layout.plancache import PlanCache
    from .._read.checkpoint import Checkpoint
    from .._storage import Location, Writer
    from .._torch.dist import Group

__all__ = ["NO_SETUP", "Destination", "SaveOptions", "SaveSetup", "packed_layout"]


@dataclass(frozen=True)
class SaveOptions:
    """The options of one save: those of :func:`arrayckpt.save` (see its docstring), with the same names and
    defaults.

    Checked where they are used: ``step``/``metrics`` and the incremental options when a save starts
    (``_write/save.py::begin_save``), ``codec`` when it is planned.
    """

    codec: CodecChoice = None
    overwrite: bool = False
    allow_pickle: bool = False
    process_group: ProcessGroup | Group | None = None  # a Group: already resolved (tests run ranks as threads)
    step: int | None = None
    metrics: Mapping[str, float] | None = None
    storage_options: Mapping[str, Any] | None = None  # passed on to the storage client (fsspec's style)
    base: str | os.PathLike[str] | Checkpoint | None = None  # incremental: the base checkpoint
    changed_rows: Mapping[str, torch.Tensor | np.ndarray | Sequence[int]] | None = None  # incremental: key -> rows
    quantize: Mapping[str, int] | None = None  # incremental: key pattern -> 4 or 8 bits
    durable: bool = True  # False: no fsync before the commit (``arrayckpt.save``'s docstring)
    packed: bool | None = None  # one pack file per rank (spec §16); None: from ``packed_from_ranks`` ranks up


@dataclass(frozen=True)
class Destination:
    """Where a save writes when not through its location's ordinary transaction: the coordinator's writer (its
    documents and its commit) and the location each rank writes its own chunks into. A peer-memory save gives
    every rank its own node's directory and a coordinator writer that commits in place (``_peer/save.py``)."""

    open_writer: Callable[[bool], Writer]  # called with ``overwrite`` by the coordinator when it begins writing
    chunks: Location  # where this rank writes its chunks (each rank brings its own)


@dataclass(frozen=True)
class SaveSetup:
    """What an internal caller adds to a save's :class:`SaveOptions` (see the module docstring)."""

    # Small tensors get the layout of big ones with tiny chunks (tests); converters stream with their own.
    chunking: ChunkPolicy = DEFAULT_CHUNKING
    # Called by the coordinator before the save begins writing and again right before its commit; raising stops the
    # save on every rank (a CheckpointManager checks that it still holds its root, spec §9.4).
    guard: Callable[[], None] | None = None
    # The plans kept for the next save (``exchange.py``): a CheckpointManager holds its own; None: the process
    # group's, shared by every save of that group that brings none.
    plan_cache: PlanCache | None = field(default=None, compare=False, repr=False)
    # None: the location's own writer, and every rank writes into the coordinator's target.
    destination: Destination | None = None


NO_SETUP = SaveSetup()


def packed_layout(packed: bool | None, ranks: int) -> bool:
    """Whether a save of ``ranks`` ranks is packed (spec §16), the rule of ``arrayckpt.save`` and of the DCP writer:
    as ``packed`` says, else (``None``) from ``packed_from_ranks`` ranks up."""
    return packed if packed is not None else ranks >= settings().packed_from_ranks
