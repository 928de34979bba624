"""What a caller keeps between saves to plan the next one faster: :class:`PlanCache`.

The planning functions (``saveplan.py``, ``rankplan.py``) keep nothing; a caller that saves again and again holds a
:class:`PlanCache` (the write layer's planner of a process group or of a manager, a DCP writer), so that a save whose
ranks report the fingerprints of the previous one reuses its layout, every rank's part of it and its documents, and
two callers in one process never see each other's plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from .._format.codecs import CodecChoice, resolve_codec
from .chunking import DEFAULT_CHUNKING, ArrayPlan, ChunkPolicy
from .rankplan import RankLayout, rank_layouts
from .saveplan import Layout, LocalDescription, SavePlan, assemble, fingerprint, plan_layout, with_key_encoding

__all__ = ["PlanCache"]


class _Encoded(NamedTuple):
    """A plan's arrays with another chunk key encoding, and their documents (:func:`with_key_encoding`)."""

    source: dict[str, ArrayPlan]  # the arrays it was made from (compared by identity)
    encoding: str
    arrays: dict[str, ArrayPlan]
    documents: dict[str, bytes]
    consolidated_json: str


class PlanCache:
    """What one caller's next save may reuse: the last layout it planned (one: a save's layout is big at scale), every
    rank's part of it, and its last plan with another chunk key encoding. Held by the caller (a process group's saves,
    a manager, a DCP writer), so that two of them in one process never see each other's plans; used by one save at a
    time."""

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self.parts: tuple[str, list[RankLayout]] | None = None  # (plan id, every rank's part)
        self.encoded: _Encoded | None = None

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
        """Keep nothing (the next save plans afresh)."""
        self.layout, self.parts, self.encoded = None, None, None

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
        if self.parts is None or self.parts[0] != layout.plan_id:
            self.parts = (layout.plan_id, rank_layouts(layout))
        return self.parts[1]

    def with_key_encoding(self, plan: SavePlan, encoding: str) -> SavePlan:
        """:func:`with_key_encoding`, kept for the plan's arrays, so that saves reusing a layout do not serialise its
        documents again."""
        if all(a.key_encoding == encoding for a in plan.arrays.values()):
            return plan
        kept = self.encoded
        if kept is None or kept.source is not plan.arrays or kept.encoding != encoding:
            encoded = with_key_encoding(plan, encoding)
            kept = self.encoded = _Encoded(plan.arrays, encoding, encoded.arrays, encoded.documents,
                                           encoded.consolidated_json)
        return dataclasses.replace(plan, arrays=kept.arrays, documents=kept.documents,
                                   consolidated_json=kept.consolidated_json)
