"""A restore from peer memory, on any number of ranks: survey the survivors, take the newest step they hold whole,
fetch what each node lacks from a peer, then the ordinary ``load`` from the node's own directory.

Call order (every rank calls :func:`memory_restore`; collectives in brackets)::

    every rank:   its node's id                                                          [all_gather]
    node leaders: every committed memory step here, each chunk file checked against the step's record: its size,
                  the crc32c of its bytes before the trailer, the trailer (read through mmap, no copy; missing,
                  damaged ones and valid chunk files of another step refused)              [all_gather]
    every rank:   the newest step (at least ``at_least``) whose chunk files the survivors hold whole, between them
    a holder:     the step's documents and record                                       [broadcast]
    every rank:   the chunk files its targets meet (``needs.py``)                        [all_gather]
    every rank:   the same transfer plan: each file a node lacks comes from one holder (spread over holders and
                  their ranks); sends and receives it, checking each file         [point-to-point, all_gather]
    every rank:   load(state, <its node dir>/step-N, atomic=True), the ranks agreeing after their reads, before
                  any state changes (``load_together``: all restored, or none)       [all_gather, all_gather]

Any failure is reported on every rank alike, with a warning saying why, and ``None`` is returned: the caller
restores from the durable tiers instead (an atomic load leaves ``state`` as it was). A chunk found damaged after the
survey (by the load, or by the check of a fetched file) first gets one more try: the node leaders survey again
(damaged files refused, with a warning naming them), so that another node's good copy is used.

Why the survey checks every file's content sums and not only its size: each chunk's own crc32c (checked by the
load) passes for any valid chunk file, also one of another step or job copied over this one's; only the record's
sums tie a file to its step (``node.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import crc32c

from .._errors import ArrayckptError, CorruptCheckpointError, UntrustedDirectoryError
from .._format.manifest import parse_root_document
from .._read.together import load_together
from .._storage.base import parse_root_bytes
from .._torch.dist import Group
from .needs import needed_files
from .node import NodeMemory
from .record import FileSum, StepRecord
from .wire import FileRef, Transfer, exchange_files

__all__ = ["Survey", "choose", "memory_restore", "pick_holder", "ranks_by_node", "share_documents", "survey"]

T = TypeVar("T")  # what _broadcast_from sends


@dataclass(frozen=True)
class StepSummary:
    """What one node holds of one memory step: its id, how many files the step has per array, the intact ones."""

    step: int
    id: str
    expected: dict[str, int]
    intact: dict[str, frozenset[str]]


@dataclass(frozen=True)
class Choice:
    """The step to restore, which nodes hold which of its files, and why newer steps could not be taken."""

    step: int | None
    id: str | None
    holders: dict[str, dict[str, frozenset[str]]]  # node id -> array path -> intact chunk keys
    why_not: list[str]


@dataclass(frozen=True)
class Survey:
    """What every node holds: each rank's node id, and each rank's summaries (a node's leader's; others' empty)."""

    ids: list[str]
    summaries: list[list[StepSummary]]

    def source(self, step: int, ident: str) -> int:
        """The lowest rank whose node holds ``step`` (as ``ident``): the one that broadcasts its documents."""
        return min(r for r, summary in enumerate(self.summaries)
                   if any(s.step == step and s.id == ident for s in summary))

    def held_by(self, rank: int, step: int, ident: str) -> bool:
        """Whether ``rank`` is its node's leader and the node holds ``step`` (as ``ident``)."""
        return any(s.step == step and s.id == ident for s in self.summaries[rank])


def survey(node: NodeMemory, group: Group) -> Survey:
    """Every node's committed memory steps and intact chunk files (checked by each node's leader, its lowest rank,
    against the step's record: ``NodeMemory.holdings``); collective. A leader whose directory is no longer private
    offers nothing (with a warning)."""
    ids = group.all_gather(node.id)
    summaries: list[StepSummary] = []
    if ids.index(node.id) == group.rank:
        try:
            summaries = [StepSummary(h.step, h.id, {p: len(k) for p, k in h.record.files.items()}, h.intact)
                         for h in node.holdings()]
        except UntrustedDirectoryError as e:
            warnings.warn(f"peer memory of this node not used: {e}", RuntimeWarning, stacklevel=3)
    return Survey(ids, group.all_gather(summaries))


def memory_restore(state: Mapping[str, Any], node: NodeMemory, group: Group, load_options: Mapping[str, Any],
                   at_least: int | None, only: int | None = None) -> int | None:
    """Restore the newest memory step (not older than ``at_least``; with ``only``, that step) the surviving nodes
    hold whole into ``state``; its step, or ``None`` (with a warning saying why, where memory held anything) when
    the caller must use the durable tiers."""
    try:
        return _attempt(state, node, group, load_options, at_least, only, first=True)
    except _Damaged as e:
        if group.is_coordinator:
            warnings.warn(f"{node.directory}: peer memory restore met a damaged chunk file ({e}); checking every "
                          "chunk file held in memory again and trying again", RuntimeWarning, stacklevel=3)
    return _attempt(state, node, group, load_options, at_least, only, first=False)


def _attempt(state: Mapping[str, Any], node: NodeMemory, group: Group, load_options: Mapping[str, Any],
             at_least: int | None, only: int | None, first: bool) -> int | None:
    """One try of :func:`memory_restore`. Raises :class:`_Damaged` on the ``first`` try when a chunk file was found
    damaged after the survey (the caller tries once more); other failures warn and return ``None``."""
    found = survey(node, group)
    ids, surveyed = found.ids, found.summaries
    choice = choose(ids, surveyed, at_least, only)
    if choice.step is None or choice.id is None:
        if choice.why_not and group.is_coordinator:
            warnings.warn(f"{node.directory}: peer memory cannot restore: {'; '.join(choice.why_not)}; restoring from "
                          "the durable tiers", RuntimeWarning, stacklevel=3)
        return None
    step = choice.step
    where = str(node.step_path(step))
    source = found.source(step, choice.id)
    try:
        held = found.held_by(group.rank, step, choice.id)
        return _restore(state, node, group, load_options, choice, ids, source, held)
    except _Failed as e:
        if isinstance(e, _Damaged) and first:
            raise
        if group.is_coordinator:
            warnings.warn(f"{where}: peer memory cannot restore step {step}: {e}; restoring from the durable tiers",
                          RuntimeWarning, stacklevel=3)
        return None


class _Failed(Exception):
    """A stage failed on some rank (every rank raises it alike)."""


class _Damaged(_Failed):
    """A stage failed on some rank because a chunk file's content is damaged (``CorruptCheckpointError``)."""


def _agree(group: Group, error: BaseException | None, what: str) -> None:
    """Raise :class:`_Failed` on every rank when ``error`` happened on any (:class:`_Damaged` when it was a damaged
    chunk on every rank that failed)."""
    report = None if error is None else (f"{type(error).__name__}: {error}", isinstance(error, CorruptCheckpointError))
    failed = [(rank, report) for rank, report in enumerate(group.all_gather(report)) if report is not None]
    if failed:
        rank, (text, _) = failed[0]
        kind = _Damaged if all(damaged for _, (_, damaged) in failed) else _Failed
        raise kind(f"{what} failed on rank {rank}: {text}")


def _restore(state: Mapping[str, Any], node: NodeMemory, group: Group, load_options: Mapping[str, Any],
             choice: Choice, ids: list[str], source: int, held: bool) -> int:
    """The restore of the chosen step; ``held``: this rank is its node's leader and the node holds the step."""
    step = choice.step
    assert step is not None
    where = str(node.step_path(step))
    documents, record, error = share_documents(node, group, step, source)
    if error is not None:
        raise _Failed(f"reading the step's documents on rank {source} failed: {error}")
    needs: dict[str, set[str]] = {}
    try:
        manifest, nodes = parse_root_document(parse_root_bytes(documents[""], where), where)
        files = StepRecord.parse(record, nodes, where).files
        if not held and ids.index(node.id) == group.rank:  # a node without it (or with another save of that step)
            node.prepare_step(step)
            node.write_documents(step, documents)
        needs = needed_files(state, manifest, nodes)
    except (ArrayckptError, OSError, ValueError) as e:
        error = e
    _agree(group, error, "preparing the restore")
    wanted = group.all_gather({p: sorted(k) for p, k in needs.items()})
    transfers = _plan(ids, wanted, choice.holders, files)
    try:
        exchange_files(group, transfers, lambda ref: node.read_file(step, ref.array_path, ref.key),
                       lambda ref, data: node.write_file(step, ref.array_path, ref.key, data), where)
    except (ArrayckptError, OSError) as e:
        error = e
    _agree(group, error, "fetching chunk files from peers")
    try:
        load_together(state, node.step_path(step), group, **load_options)  # all ranks restored, or none
    except ArrayckptError as e:
        error = e
    _agree(group, error, "loading")
    return step


def share_documents(node: NodeMemory, group: Group, step: int,
                    source: int) -> tuple[dict[str, bytes], bytes, BaseException | None]:
    """A memory step's documents and record bytes, read on rank ``source`` and broadcast to every rank (with the
    error reading them raised there, if any)."""
    documents: dict[str, bytes] = {}
    record = b""
    error: BaseException | None = None
    if group.rank == source:
        try:
            documents = node.read_documents(step)
            record = node.record_path(step).read_bytes()
        except (ArrayckptError, OSError) as e:
            error = e
    return _broadcast_from(group, source, (documents, record, error))


def _broadcast_from(group: Group, source: int, obj: T) -> T:
    """``obj`` of rank ``source`` on every rank."""
    if group.size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=group.global_rank(source), group=group.cpu_pg)
    return box[0]


def choose(ids: list[str], surveyed: list[list[StepSummary]], at_least: int | None, only: int | None = None) -> Choice:
    """The newest step (and id) held whole among the nodes, not older than ``at_least`` (with ``only``: that step
    or none); what made newer ones unusable."""
    by_step: dict[tuple[int, str], dict[str, StepSummary]] = {}
    for rank, summaries in enumerate(surveyed):
        for summary in summaries:
            if only is None or summary.step == only:
                by_step.setdefault((summary.step, summary.id), {})[ids[rank]] = summary
    why_not: list[str] = []
    for (step, ident), holders in sorted(by_step.items(), key=lambda item: (-item[0][0], item[0][1])):
        if at_least is not None and step < at_least:
            if not why_not:
                break  # older than what the durable tiers hold, and nothing newer was tried: not worth a warning
            why_not.append(f"step {step} and older are not newer than durable step {at_least}")
            break
        expected = next(iter(holders.values())).expected
        lacking = []
        for path, count in expected.items():
            have = set().union(*(h.intact.get(path, frozenset()) for h in holders.values()))
            if len(have) < count:
                lacking.append(f"{path} ({count - len(have)} of {count})")
        if not lacking:
            return Choice(step, ident, {n: h.intact for n, h in holders.items()}, why_not)
        why_not.append(f"step {step} is not whole among the {len(set(ids))} surviving node(s): no intact copy of "
                       f"chunk files of {', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''}")
    return Choice(None, None, {}, why_not)


def ranks_by_node(ids: list[str]) -> dict[str, list[int]]:
    """Node id -> its ranks, ascending."""
    ranks_of: dict[str, list[int]] = {}
    for rank, ident in enumerate(ids):
        ranks_of.setdefault(ident, []).append(rank)
    return ranks_of


def pick_holder(path: str, key: str, holders: Mapping[str, Mapping[str, frozenset[str]]],
                ranks_of: Mapping[str, list[int]]) -> int | None:
    """The rank that serves chunk file ``path/key``: one of the nodes holding it intact, then one of its ranks, both
    chosen by the key's hash (so that the files spread over holders and ranks, and every rank computes the same)."""
    sources = sorted(n for n, held in holders.items() if key in held.get(path, frozenset()) and n in ranks_of)
    if not sources:
        return None
    h = crc32c.crc32c(f"{path}/{key}".encode())
    node = sources[h % len(sources)]
    return ranks_of[node][h % len(ranks_of[node])]


def _plan(ids: list[str], wanted: list[dict[str, list[str]]], holders: Mapping[str, Mapping[str, frozenset[str]]],
          files: Mapping[str, Mapping[str, FileSum]]) -> list[Transfer]:
    """Who sends which file to whom: each file a node's ranks need and the node lacks, once per node, from one
    holder node (chosen by the key's hash among the holders, then one of its ranks the same way)."""
    ranks_of = ranks_by_node(ids)
    sends: dict[tuple[int, int], list[FileRef]] = {}
    fetched: set[tuple[str, str, str]] = set()
    for dst, needs in enumerate(wanted):
        here = ids[dst]
        for path, keys in needs.items():
            for key in keys:
                if key in holders.get(here, {}).get(path, frozenset()) or (here, path, key) in fetched:
                    continue
                src = pick_holder(path, key, holders, ranks_of)
                if src is None or key not in files.get(path, {}):
                    continue  # no survivor has it (the load then names it): the choice made sure this cannot be
                sends.setdefault((src, dst), []).append(FileRef(path, key, files[path][key]))
                fetched.add((here, path, key))
    return [Transfer(src, dst, tuple(refs)) for (src, dst), refs in sorted(sends.items())]
