"""``SaveOptions``: how to save, as one value from the public functions down to the writers.

``arrayckpt.save`` and ``arrayckpt.async_save`` keep their keyword parameters (the public API) and build a
``SaveOptions`` from them; everything below them (``save_with``, ``async_save_with``, ``finish_save``, the
streaming writer) takes the options object. ``CheckpointManager`` keeps one and derives each save's with
``dataclasses.replace`` (the step, metrics and base of that save).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._format.codecs import CodecChoice
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy

if TYPE_CHECKING:
    from .._layout.plancache import PlanCache
    from .._storage import Location

__all__ = ["SaveOptions"]


@dataclass(frozen=True)
class SaveOptions:
    """The options of one save: those of :func:`arrayckpt.save` (see its docstring), with the same names and
    defaults, and the chunk policy, which the public functions never change (internal callers and tests
    may: tiny chunks give small tensors the layout of big ones).

    Checked where they are used: ``step``/``metrics`` and the incremental options when a save starts
    (``_write/save.py::prepare``), ``codec`` and ``chunking`` when it is planned.
    """

    codec: CodecChoice = None
    overwrite: bool = False
    allow_pickle: bool = False
    process_group: Any = None
    step: int | None = None
    metrics: Mapping[str, float] | None = None
    storage_options: Mapping[str, Any] | None = None
    base: Any = None  # incremental: the base checkpoint (a path, or an open Checkpoint)
    changed_rows: Mapping[str, Any] | None = None  # incremental: key -> global row indices changed since the base
    quantize: Mapping[str, int] | None = None  # incremental: key pattern -> 4 or 8 bits
    chunking: ChunkPolicy = DEFAULT_CHUNKING
    durable: bool = True  # False: no sync to disk before the commit (``arrayckpt.save``'s docstring)
    # Called by the coordinator before the save begins writing and again right before its commit; raising stops the
    # save on every rank (a CheckpointManager checks that it still holds its root, spec §9.4).
    guard: Callable[[], None] | None = None
    # Where this rank writes its chunks instead of the coordinator's target (a Location): a peer-memory save writes
    # into its own node's directory (``_peer/save.py``). None: the coordinator's target, as every other save.
    rank_target: Location | None = None
    # The plans kept for the next save (``exchange.py``): a CheckpointManager holds its own; None: the process
    # group's, shared by every save of that group that brings none.
    plan_cache: PlanCache | None = field(default=None, compare=False, repr=False)
