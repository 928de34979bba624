"""The step checkpoints right below one root (:class:`StepTree`): the storage of the local and the remote tier.

A :class:`StepTree` is one root holding ``step-<step:08d>`` checkpoints (a local directory or an object-storage
prefix): listing, retention that deletes in a crash-consistent order and never a base a kept delta reads through,
and clean-up of what interrupted saves and deletions left. :class:`~arrayckpt._manage.tiers.LocalTier` and
:class:`~arrayckpt._manage.tiers.RemoteTier` each hold one; the remote tier's
:class:`~arrayckpt._manage.copier.StepCopier` copies the local tree's committed steps to the remote one.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from .._errors import ArrayckptError, CheckpointNotFoundError, IncompleteCheckpointError
from .._format.jsontypes import member
from .._format.manifest import MANIFEST_ATTRIBUTE
from .._read.checkpoint import Checkpoint, open_checkpoint
from .._storage import CleanedUp, Location
from .._storage.gc import incomplete_leftovers
from .policy import Retention

__all__ = ["StepTree", "deletion_order"]

STEP_DIR = re.compile(r"step-(\d{8,})")


class StepTree:
    """The step checkpoints right below one root (see the module docstring)."""

    def __init__(self, location: Location) -> None:
        self.location = location

    def step_location(self, step: int) -> Location:
        return self.location.child(f"step-{step:08d}")

    def listed_steps(self) -> list[int]:
        """Steps with something at their path, committed or not."""
        return sorted(int(m.group(1)) for m in map(STEP_DIR.fullmatch, self.location.children()) if m)

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint, ascending."""
        return [s for s in self.listed_steps() if self.step_location(s).is_committed()]

    def open(self, step: int) -> Checkpoint:
        """Step ``step``'s checkpoint, opened (use it in a ``with`` block)."""
        return open_checkpoint(self.step_location(step))

    def identity(self, step: int) -> str | None:
        """The id of step ``step``'s committed checkpoint (``None``: none is committed there, or it has no id)."""
        try:
            manifest = member(self.step_location(step).read_root(), "attributes", MANIFEST_ATTRIBUTE)
        except (CheckpointNotFoundError, IncompleteCheckpointError):
            return None
        return manifest.get("id") if isinstance(manifest, dict) else None

    def base_step(self, step: int) -> int | None:
        """The step of this tree that step ``step`` is a delta against (``None``: a full checkpoint, or a base
        elsewhere). Raises what opening the checkpoint raises."""
        with self.open(step) as checkpoint:
            ref = checkpoint.manifest.base
        if ref is None:
            return None
        base = str(self.step_location(step).resolve(ref.path))
        match = STEP_DIR.fullmatch(base.rstrip("/").rpartition("/")[2])
        if match is None or str(self.step_location(int(match.group(1)))) != base:
            return None
        return int(match.group(1))

    def apply_retention(self, retention: Retention, protect: set[int] | None = None) -> list[int]:
        """Delete the committed steps ``retention`` does not keep (nor ``protect``; ``None``: protect them all), and
        that no kept delta reads through, in an order where every state a crash can leave is consistent: a delta
        before the base it reads through (newest first), each root document first. Returns the steps deleted."""
        if protect is None:
            return []
        steps = self.steps()
        metrics: dict[int, dict[str, float]] = {}
        if retention.keep_best and retention.metric:
            for step in steps:
                with self.open(step) as checkpoint:
                    metrics[step] = dict(checkpoint.metrics)
        kept = retention.keep(steps, metrics) | (protect & set(steps))
        bases: dict[int, int | None] = {}
        for step in steps:
            try:
                bases[step] = self.base_step(step)
            except ArrayckptError:
                if step in kept:
                    raise  # what it reads through is unknown: deleting anything could break it
                bases[step] = None
        todo = sorted(kept)
        while todo:  # the bases kept checkpoints read through, transitively
            base = bases.get(todo.pop())
            if base is not None and base not in kept:
                kept.add(base)
                todo.append(base)
        doomed = deletion_order(set(steps) - kept, bases)
        for step in doomed:
            self.step_location(step).delete()
        return doomed

    def clean_up(self, min_age_s: float, skip: Collection[int] = ()) -> CleanedUp:
        """Remove what interrupted saves and deletions left (see ``CheckpointManager.clean_up``), except at the steps
        ``skip``; returns what was removed and what looked like a leftover but stays, with why."""
        removed = self.remove_orphaned_deltas()
        kept: list[tuple[str, str]] = []
        committed = self.steps()
        if committed:
            for step in self.listed_steps():
                if step < committed[-1] and step not in committed and step not in skip:
                    location = self.step_location(step)
                    try:
                        location.read_root()
                        continue  # readable after all (a transient failure hid it): never delete
                    except IncompleteCheckpointError:  # positively no root document: an interrupted save
                        pass
                    except ArrayckptError:  # unreadable or foreign: leave it for a person to look at
                        continue
                    found, why = incomplete_leftovers(location, min_age_s)
                    removed.extend(leftover.url for leftover in found if leftover.remove())
                    kept.extend(why)
        skipped = {str(self.step_location(step)) for step in skip}
        found, why = self.location.leftovers(min_age_s)
        removed.extend(leftover.url for leftover in found if leftover.url not in skipped and leftover.remove())
        kept.extend(k for k in why if k not in kept)
        return CleanedUp(removed, kept)

    def remove_orphaned_deltas(self) -> list[str]:
        """Delete committed delta checkpoints whose base, a step of this tree, is positively gone (no checkpoint, or an
        incomplete one, at its path): a deletion of that base was cut short before its deltas were removed. A base
        that cannot be read for another reason (a storage error) keeps its deltas."""
        removed: list[str] = []
        gone: set[int] = set()
        changed = True
        while changed:
            changed = False
            for step in self.steps():
                try:
                    base = self.base_step(step)
                except ArrayckptError:
                    continue
                if base is None:
                    continue
                if base not in gone:
                    try:
                        self.step_location(base).read_root()
                        continue
                    except (CheckpointNotFoundError, IncompleteCheckpointError):
                        pass
                    except ArrayckptError:
                        continue
                location = self.step_location(step)
                location.delete()
                removed.append(str(location))
                gone.add(step)
                changed = True
        return removed


def deletion_order(doomed: set[int], bases: Mapping[int, int | None]) -> list[int]:
    """``doomed`` ordered so that a delta comes before every base it reads through, newest first otherwise."""
    order: list[int] = []
    remaining = set(doomed)
    while remaining:
        read_through = {bases.get(s) for s in remaining}
        ready = [s for s in remaining if s not in read_through] or list(remaining)  # (a loop of bases: any order)
        order.append(max(ready))
        remaining.discard(order[-1])
    return order
