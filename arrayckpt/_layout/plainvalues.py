"""Plain values of a save: one entry per key, a single value where every rank holding it holds the same, per rank
where they differ (spec §5.3 item 3).

A plain value (an int, a string, a dict of them: anything that is not an array) is usually the same on every rank
(a step, a learning rate): one copy is stored, the lowest holding rank's, and a save whose layout is reused sends it
from that rank only (:attr:`ValueLayout.sent`). One that differs between ranks (a data loader's position under data
parallelism, ``optim.param_groups`` under pipeline parallelism) is stored per rank instead, as an
``arrayckpt.PerRank`` value is, so that no rank's value is lost; a load at another world size then needs the
caller to say how to resume it (``_read/perrank.py``).

Finding them costs nothing extra when the ranks send every value (a layout planned afresh: :func:`plan_values`).
When a layout is reused, a rank sends the values it owns and those that differed when the layout was planned
(:attr:`ValueLayout.varying`), and a digest of the others (:func:`unsent_digest`), which :func:`unsent_agree` compares
with their owners' values; where one differs, the coordinator plans afresh and every rank sends all of its values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from .._format.manifest import PerRankEntry, ValueEntry
from .pieces import FINGERPRINT_BYTES

__all__ = ["ValueLayout", "canonical", "merge_value", "plan_values", "unsent_agree", "unsent_digest"]


@dataclass(frozen=True)
class ValueLayout:
    """Who sends which plain values when a layout is reused, and what the coordinator needs to check the others.
    Its size grows with the number of value keys and of ranks, not with their product: ``held_sets`` has one item
    per distinct set of keys (one per pipeline stage, say)."""

    owners: dict[str, int]  # key -> the lowest rank holding it (whose value is stored where all agree)
    sent: tuple[tuple[str, ...], ...]  # by rank: the keys it sends (those it owns, and the varying ones it holds)
    varying: frozenset[str]  # the keys whose values differed between ranks when the layout was planned
    held_sets: tuple[tuple[str, ...], ...]  # the distinct sets of value keys the ranks hold
    held_by: tuple[int, ...]  # by rank: the index of its set in ``held_sets``


def canonical(value: ValueEntry) -> str:
    """The typed JSON of a value as text with sorted keys: equal exactly where the values are (``1``, ``1.0`` and
    ``true`` differ, as NaN does not from NaN)."""
    return json.dumps(value.value, sort_keys=True)


def plan_values(values_by_rank: Sequence[Sequence[ValueEntry]]) -> ValueLayout:
    """The :class:`ValueLayout` of every rank's plain values (``values_by_rank[r]``: rank ``r``'s)."""
    owners: dict[str, int] = {}
    first: dict[str, str] = {}
    varying: set[str] = set()
    index: dict[tuple[str, ...], int] = {}
    held_by = []
    for rank, values in enumerate(values_by_rank):
        for value in values:
            owners.setdefault(value.key, rank)
            if value.key not in varying:
                text = canonical(value)
                if first.setdefault(value.key, text) != text:
                    varying.add(value.key)
        held_by.append(index.setdefault(tuple(v.key for v in values), len(index)))
    sent = tuple(tuple(v.key for v in values if owners[v.key] == rank or v.key in varying)
                 for rank, values in enumerate(values_by_rank))
    return ValueLayout(owners, sent, frozenset(varying), tuple(index), tuple(held_by))


def unsent_digest(values: Sequence[ValueEntry], sent: Collection[str]) -> bytes:
    """A digest of the plain values a rank holds and does not send (those not in ``sent``), in key order: what it
    sends instead of them when a layout is reused."""
    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    for value in sorted((v for v in values if v.key not in sent), key=lambda v: v.key):
        h.update(json.dumps([value.key, value.value], sort_keys=True).encode("utf-8", "surrogatepass"))
    return h.digest()


def unsent_agree(layout: ValueLayout, sent: Sequence[Sequence[ValueEntry]], digests: Sequence[bytes | None]) -> bool:
    """Whether every rank's :func:`unsent_digest` (``digests[r]``; ``None``: it sent all of its values) matches the
    values their owners sent (``sent[r]``: rank ``r``'s), so that none of the values not sent differs."""
    owners: dict[str, ValueEntry] = {}
    for rank, values in enumerate(sent):
        for value in values:
            if layout.owners.get(value.key) == rank:
                owners[value.key] = value
    expected: dict[tuple[int, tuple[str, ...]], bytes] = {}
    for rank, digest in enumerate(digests):
        if digest is None:
            continue
        case = (layout.held_by[rank], layout.sent[rank])  # most ranks share a few of these
        if case not in expected:
            own = set(case[1])
            expected[case] = unsent_digest([owners[k] for k in layout.held_sets[case[0]] if k not in own], ())
        if expected[case] != digest:
            return False
    return True


def merge_value(layout: ValueLayout, key: str, sent: Mapping[int, ValueEntry]) -> ValueEntry | PerRankEntry:
    """The entry of plain value ``key`` from what the ranks sent (``sent``: by rank, the owner's among them): the
    owner's value where they agree; else a per-rank entry, in which a holder that did not send it has the owner's
    (its digest said so) and a rank that does not hold it has none."""
    owner = sent[layout.owners[key]]
    if len(sent) == 1 or len({canonical(value) for value in sent.values()}) == 1:
        return owner
    holders = {i for i, keys in enumerate(layout.held_sets) if key in keys}
    items = tuple(sent.get(rank, owner) if held in holders else None for rank, held in enumerate(layout.held_by))
    return PerRankEntry(key, owner.parts, items)
