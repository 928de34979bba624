"""What a caller keeps between saves to plan the next one faster: :class:`PlanCache`, the only state of this layer.

The planning functions (``saveplan.py``, ``rankplan.py``) keep nothing; a caller that saves again and again holds a
:class:`PlanCache` (the write layer keeps one per process group, a ``CheckpointManager`` and a DCP writer their own),
so that a save whose ranks report the fingerprints of the previous one reuses its :class:`Layout`, every rank's
:class:`RankLayout` of it and its documents, and two callers in one process never see each other's plans. On the
coordinator it keeps the Layout; on every rank of this process (ranks run as threads share one) the RankLayout that
rank received, by (rank, world size).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import NamedTuple

from .._format.codecs import CodecChoice, resolve_codec
from .chunking import DEFAULT_CHUNKING, ArrayPlan, ChunkPolicy
from .rankplan import RankLayout, rank_layouts
from .saveplan import Layout, LocalDescription, SavePlan, assemble, fingerprint, plan_layout, with_key_encoding

__all__ = ["Held", "PlanCache"]


class Held(NamedTuple):
    """The :class:`RankLayout` one rank received, kept in its slot of a :class:`PlanCache` for the next save."""

    plan_id: str  # of the Layout it is a part of
    fingerprint: bytes  # of the rank's description it was planned from
    rank_layout: RankLayout


class _Encoded(NamedTuple):
    """A plan's arrays with another chunk key encoding, and their documents (:func:`with_key_encoding`)."""

    source: dict[str, ArrayPlan]  # the arrays it was made from (compared by identity)
    encoding: str
    arrays: dict[str, ArrayPlan]
    documents: dict[str, bytes]
    consolidated_json: str


class PlanCache:
    """What one caller's next save may reuse. On the coordinator: the last :class:`Layout` it planned (one: a Layout is
    big at scale), every rank's :class:`RankLayout` of it, and its last plan with another chunk key encoding; on each
    rank of this process: the RankLayout it received (:meth:`held`). Held by the caller (a process group's saves, a
    manager, a DCP writer), so that two of them in one process never see each other's plans; used by one save at a
    time (the ranks' slots have a lock: ranks run as threads save at once)."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self._rank_layouts: tuple[str, list[RankLayout]] | None = None  # (plan id, every rank's RankLayout)
        self._encoded: _Encoded | None = None
        self._held: dict[tuple[int, int], Held] = {}  # (rank, world size) -> what that rank received
        self._lock = threading.Lock()

    def reusable(self, fingerprints: tuple[bytes, ...], codec: CodecChoice, chunking: ChunkPolicy) -> Layout | None:
        """The kept layout, if it was planned from these fingerprints and chunk policy and every key still resolves
        to the same codec (a callable codec is asked again)."""
        layout = self.layout
        if layout is None or layout.fingerprints != fingerprints or layout.chunking != chunking:
            return None
        if tuple(resolve_codec(codec, name) for name in layout.names) != layout.codecs:
            return None
        return layout

    def keep(self, layout: Layout) -> None:
        """Keep ``layout`` for the next save (instead of the one kept before)."""
        self.layout = layout

    def forget(self) -> None:
        """Keep nothing: the next save plans afresh, and every rank sends its full description."""
        with self._lock:
            self._held.clear()
        self.forget_layout()

    def forget_layout(self) -> None:
        """Forget the coordinator's side only (its Layout and what was made from it), as a coordinator whose process
        restarted does while the ranks of other processes still hold their RankLayouts: they claim them, and are asked
        for their descriptions."""
        self.layout, self._rank_layouts, self._encoded = None, None, None

    def held(self, rank: int, world: int) -> Held | None:
        """What rank ``rank`` of a group of ``world`` ranks received at its last full save (``None``: nothing)."""
        with self._lock:
            return self._held.get((rank, world))

    def hold(self, rank: int, world: int, held: Held) -> None:
        """Keep what rank ``rank`` of a group of ``world`` ranks received, for its next save."""
        with self._lock:
            self._held[(rank, world)] = held

    def plan_save(self, descriptions: Sequence[LocalDescription], codec: CodecChoice,
                  chunking: ChunkPolicy = DEFAULT_CHUNKING) -> SavePlan:
        """:func:`plan_save`, reusing the kept layout where it still fits (same fingerprints, codecs and chunk policy)
        and keeping a new one; plain and per-rank values are taken fresh every time."""
        fingerprints = tuple(fingerprint(d) for d in descriptions)
        layout = self.reusable(fingerprints, codec, chunking)
        if layout is None:
            layout = plan_layout(descriptions, fingerprints, codec, chunking)
            self.keep(layout)
        return assemble(layout, [(d.values, d.per_rank) for d in descriptions])

    def rank_layouts(self, layout: Layout) -> list[RankLayout]:
        """:func:`rank_layouts`, kept for the layout's next use."""
        if self._rank_layouts is None or self._rank_layouts[0] != layout.plan_id:
            self._rank_layouts = (layout.plan_id, rank_layouts(layout))
        return self._rank_layouts[1]

    def with_key_encoding(self, plan: SavePlan, encoding: str) -> SavePlan:
        """:func:`with_key_encoding`, kept for the plan's arrays, so that saves reusing a layout do not serialise its
        documents again."""
        if all(a.key_encoding == encoding for a in plan.arrays.values()):
            return plan
        kept = self._encoded
        if kept is None or kept.source is not plan.arrays or kept.encoding != encoding:
            encoded = with_key_encoding(plan, encoding)
            kept = self._encoded = _Encoded(plan.arrays, encoding, encoded.arrays, encoded.documents,
                                           encoded.consolidated_json)
        return dataclasses.replace(plan, arrays=kept.arrays, documents=kept.documents,
                                   consolidated_json=kept.consolidated_json)
