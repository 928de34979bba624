"""The planning exchange of a save: what every rank tells the coordinator, and the part of the plan it gets back.

::

    each rank:    Report (its fingerprint; its description unless the layout is one it holds a part of;
                  its values and per-rank values; its delta findings)                           gather ->
    coordinator:  the layout it kept, when every rank's fingerprint is the one it was planned from and every
                  key's codec and the chunk policy are unchanged; else a fresh one from the descriptions (if
                  a rank sent none: Resend, and every rank sends its description once more)
                  + this save's values -> SavePlan; the write transaction begins
                                                         <- scatter: each rank its Reply (or the error)
    each rank:    its part: the RankLayout it kept (Reply.part is None), or the one sent (kept for next time),
                  or, for a delta save, its explicit RankPlan

A save whose layout did not change sends a 16-byte fingerprint and the values per rank, and each rank receives a
few hundred bytes; a rank's received part never grows with the number of ranks. What the fingerprint covers:
``_layout/pieces.py::fingerprint``; the coordinator adds the codec each key resolves to (asked again every
save) and the chunk policy. Delta saves reuse the layout too, but their tasks depend on what changed, so
every rank gets its explicit part.

What is kept between saves belongs to a :class:`Planner`: the coordinator's layout (a ``PlanCache``) and the part of
it each rank of this process received. Each process group has one (:func:`planner_for`); a ``CheckpointManager``
holds its own (``SaveOptions.planner``), so two groups or two managers in one process never share plans.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import ArrayckptError
from .._format.manifest import ArrayEntry, ValueEntry
from .._layout.delta import PieceChange
from .._layout.plancache import PlanCache
from .._layout.rankplan import RankLayout, RankPlan, expand
from .._layout.saveplan import LocalDescription, fingerprint
from .._torch.dist import Group

if TYPE_CHECKING:
    from .._storage import Location

__all__ = ["Planner", "Report", "Reply", "Resend", "exchange", "forget_parts", "planner_for"]


@dataclass(frozen=True)
class Report:
    """What a rank sends the coordinator at the start of a save."""

    error: BaseException | None
    fingerprint: bytes | None  # of its description (None: describing failed)
    plan_id: str | None  # the layout whose part it holds and claims still fits (None: none)
    description: LocalDescription | None  # None when claiming plan_id
    values: tuple[ValueEntry, ...]  # all of them with a description, else those it owns
    per_rank: tuple[ValueEntry | ArrayEntry, ...]
    changes: list[PieceChange]  # a delta save's findings
    agreement: Any  # a delta save's base id and quantize settings (every rank must agree)


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


@dataclass(frozen=True)
class _Held:
    plan_id: str
    fingerprint: bytes
    part: RankLayout


class Planner:
    """The plans one caller's saves keep for the next: the coordinator's layout (:attr:`layouts`) and, by (rank, world
    size), the part of it each rank of this process received (ranks run as threads share a process)."""

    def __init__(self) -> None:
        self.layouts = PlanCache()
        self._parts: dict[tuple[int, int], _Held] = {}
        self._lock = threading.Lock()

    def held(self, slot: tuple[int, int]) -> _Held | None:
        with self._lock:
            return self._parts.get(slot)

    def hold(self, slot: tuple[int, int], held: _Held) -> None:
        with self._lock:
            self._parts[slot] = held

    def forget(self) -> None:
        """Keep nothing: the next save plans afresh, and every rank sends its full description."""
        with self._lock:
            self._parts.clear()
        self.layouts.forget()


_PLANNERS: dict[Any, Planner] = {}  # process group (None: one process, or ranks run as threads) -> its planner
_LOCK = threading.Lock()


def planner_for(group: Group) -> Planner:
    """The planner of ``group``'s saves (made at its first save), for the saves that bring none of their own."""
    with _LOCK:
        return _PLANNERS.setdefault(group.pg, Planner())


def forget_parts() -> None:
    """Every process group's planner forgets (the next save plans afresh and sends full descriptions)."""
    with _LOCK:
        planners = list(_PLANNERS.values())
    for planner in planners:
        planner.forget()


def _report(description: LocalDescription | None, error: BaseException | None, print_: bytes | None,
            held: _Held | None, changes: list[PieceChange], agreement: Any) -> Report:
    if description is None:
        return Report(error, None, None, None, (), (), changes, agreement)
    if held is not None:
        owned = set(held.part.owned)
        values = tuple(v for v in description.values if v.key in owned)
        return Report(error, print_, held.plan_id, None, values, description.per_rank, changes, agreement)
    return Report(error, print_, None, description, description.values, description.per_rank, changes, agreement)


def exchange(group: Group, planner: Planner, description: LocalDescription | None, error: BaseException | None,
             changes: list[PieceChange], agreement: Any,
             coordinate: Callable[[list[Report]], list[Reply | BaseException] | Resend]) -> Reply | BaseException:
    """Run the exchange on this rank; the coordinator's ``coordinate(reports)`` returns every rank's reply (a
    :class:`Reply` or an error to raise), or :class:`Resend`. Returns this rank's reply: an error, or a
    :class:`Reply` whose ``part`` is this rank's :class:`RankPlan`."""
    slot = (group.rank, group.size)
    print_ = fingerprint(description) if description is not None and error is None else None
    held = planner.held(slot)
    claim = held if held is not None and print_ is not None and held.fingerprint == print_ else None
    report = _report(description, error, print_, claim, changes, agreement)
    while True:
        gathered = group.gather(report)
        replies: Any = None
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
        part = claim.part
    if isinstance(part, RankLayout):
        planner.hold(slot, _Held(reply.plan_id, print_ or b"", part))
        part = expand(part, description, group.rank, reply.key_encoding)
    return Reply(reply.plan_id, part, reply.target, reply.key_encoding)
