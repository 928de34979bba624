"""The planning exchange of a save: what every rank tells the coordinator, and its part of the plan it gets back
(the nouns: the glossary in ``_layout/__init__.py``).

::

    each rank:    Report (its fingerprint; its LocalDescription unless it holds a RankLayout of a Layout
                  planned from that fingerprint; its values and per-rank values; its delta findings)   gather ->
    coordinator:  the Layout its PlanCache kept, when every rank's fingerprint is the one it was planned from
                  and every key's codec and the chunk policy are unchanged; else plan_layout from the
                  descriptions (if a rank sent none: Resend, and every rank sends its description once more)
                  + this save's values -> SavePlan; the write transaction begins
                                                         <- scatter: each rank its Reply (or the error)
    each rank:    its part: the RankLayout its PlanCache holds (Reply.part is None), or the one sent (held for
                  next time), expanded into its RankPlan; or, for a delta save, its explicit RankPlan

A save whose layout did not change sends a 16-byte fingerprint and the values per rank, and each rank receives a
few hundred bytes; a rank's received part never grows with the number of ranks. What the fingerprint covers:
``_layout/pieces.py::fingerprint``; the coordinator adds the codec each key resolves to (asked again every
save) and the chunk policy. Delta saves reuse the layout too, but their tasks depend on what changed, so
every rank gets its explicit part.

What is kept between saves belongs to a :class:`PlanCache`: the coordinator's Layout and the RankLayout each rank of
this process received. Each process group has one (:func:`plan_cache_for`); a ``CheckpointManager`` holds its own
(``SaveOptions.plan_cache``), so two groups or two managers in one process never share plans.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

from .._errors import ArrayckptError
from .._format.manifest import ArrayEntry, ValueEntry
from .._layout.delta import PieceChange
from .._layout.plancache import Held, PlanCache
from .._layout.rankplan import RankLayout, RankPlan, expand
from .._layout.saveplan import LocalDescription, fingerprint
from .._torch.dist import Group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .._storage import Location

__all__ = ["Agreement", "Report", "Reply", "Resend", "exchange", "forget_plan_caches", "plan_cache_for"]

Agreement: TypeAlias = tuple[str, list[tuple[str, int]]]  # a delta save's base id and quantize (pattern, bits) items


@dataclass(frozen=True)
class Report:
    """What a rank sends the coordinator at the start of a save."""

    error: BaseException | None
    fingerprint: bytes | None  # of its description (None: describing failed)
    plan_id: str | None  # the Layout whose RankLayout it holds and claims still fits (None: none)
    description: LocalDescription | None  # None when claiming plan_id
    values: tuple[ValueEntry, ...]  # all of them with a description, else those it owns
    per_rank: tuple[ValueEntry | ArrayEntry, ...]
    changes: list[PieceChange]  # a delta save's findings
    agreement: Agreement | None  # a delta save's (every rank must agree; None: a full save)


@dataclass(frozen=True)
class Resend:
    """The coordinator cannot use the layout the ranks claim: every rank sends its description."""


@dataclass(frozen=True)
class Reply:
    """A rank's part of the plan: ``part`` None means "the RankLayout you hold for ``plan_id``"."""

    plan_id: str
    part: RankLayout | RankPlan | None
    target: Location  # where to write
    key_encoding: str
    pack_tag: str | None = None  # packed (spec §16): each rank writes its chunks into its one pack, of this tag


_PLAN_CACHES: dict[ProcessGroup | None, PlanCache] = {}  # process group (None: one process, or ranks run as threads)
_LOCK = threading.Lock()


def plan_cache_for(group: Group) -> PlanCache:
    """The PlanCache of ``group``'s saves (made at its first save), for the saves that bring none of their own."""
    with _LOCK:
        return _PLAN_CACHES.setdefault(group.pg, PlanCache())


def forget_plan_caches() -> None:
    """Every process group's PlanCache forgets (the next save plans afresh and every rank sends its description)."""
    with _LOCK:
        caches = list(_PLAN_CACHES.values())
    for cache in caches:
        cache.forget()


def _report(description: LocalDescription | None, error: BaseException | None, print_: bytes | None,
            held: Held | None, changes: list[PieceChange], agreement: Agreement | None) -> Report:
    if description is None:
        return Report(error, None, None, None, (), (), changes, agreement)
    if held is not None:
        owned = set(held.rank_layout.owned)
        values = tuple(v for v in description.values if v.key in owned)
        return Report(error, print_, held.plan_id, None, values, description.per_rank, changes, agreement)
    return Report(error, print_, None, description, description.values, description.per_rank, changes, agreement)


def exchange(group: Group, plan_cache: PlanCache, description: LocalDescription | None, error: BaseException | None,
             changes: list[PieceChange], agreement: Agreement | None,
             coordinate: Callable[[list[Report]], list[Reply | BaseException] | Resend]) -> Reply | BaseException:
    """Run the exchange on this rank; the coordinator's ``coordinate(reports)`` returns every rank's reply (a
    :class:`Reply` or an error to raise), or :class:`Resend`. Returns this rank's reply: an error, or a
    :class:`Reply` whose ``part`` is this rank's :class:`RankPlan`."""
    print_ = fingerprint(description) if description is not None and error is None else None
    held = plan_cache.held(group.rank, group.size)
    claim = held if held is not None and print_ is not None and held.fingerprint == print_ else None
    report = _report(description, error, print_, claim, changes, agreement)
    while True:
        gathered = group.gather(report)
        replies: Sequence[Reply | BaseException | Resend] | None = None
        if group.is_coordinator:
            assert gathered is not None
            decided = coordinate(gathered)
            replies = [decided] * group.size if isinstance(decided, Resend) else decided
        reply: Reply | BaseException | Resend = group.scatter(replies)
        if not isinstance(reply, Resend):
            break
        report = _report(description, error, print_, None, changes, agreement)
    if not isinstance(reply, Reply):
        return reply
    assert description is not None  # a failed description was answered with an error above
    part = reply.part
    if part is None:
        if claim is None or claim.plan_id != reply.plan_id:
            return ArrayckptError(f"rank {group.rank} was told to reuse plan {reply.plan_id}, which it does not hold "
                                  "(a bug in arrayckpt: please report it)")
        part = claim.rank_layout
    if isinstance(part, RankLayout):
        plan_cache.hold(group.rank, group.size, Held(reply.plan_id, print_ or b"", part))
        part = expand(part, description, group.rank, reply.key_encoding)
    return Reply(reply.plan_id, part, reply.target, reply.key_encoding, reply.pack_tag)
