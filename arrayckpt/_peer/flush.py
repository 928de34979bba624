"""Flush a memory step to a durable tier: its chunk files copied as they are, from whichever nodes hold them.

A memory step is an ordinary checkpoint tree spread over the nodes (each holds its ranks' chunk files and the
replicas it received), so making it durable is a copy, never a new save: no tensor is read back, no chunk is encoded
again, and the durable checkpoint has the memory step's very bytes and id. It works on any number of ranks and after
a node was lost (the survivors' replicas stand in), like a restore.

Call order (every rank calls :func:`flush_memory_step`; collectives in brackets)::

    every rank:   its node's id; node leaders: the steps here and their intact chunk files     [all_gather x2]
    every rank:   the step to flush (the newest the nodes hold whole, or the one asked for), or an error
    a holder:     the step's documents and record                                             [broadcast]
    coordinator:  the durable checkpoint there already (same id): nothing to do; else opens the write transaction
                  (a temporary directory locally, the generation's key encoding on object storage) and writes the
                  node documents                                                              [broadcast]
    every rank:   copies its share of the chunk files (each file from one node holding it intact, spread over
                  those nodes' ranks by the key's hash), every file checked against the step's record first
                                                                                              [gather]
    coordinator:  commits (root document last, after checking every chunk file is there) or aborts  [broadcast]

A failure on any rank is raised on every rank, and nothing is committed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

from .._errors import (
    ArrayckptError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StateError,
    StorageError,
)
from .._format.jsontypes import JSON, json_object, member
from .._format.manifest import MANIFEST_ATTRIBUTE, parse_root_document
from .._format.zarr import chunk_key, parse_chunk_key
from .._io.arrays import resolve_context
from .._storage import Location
from .._storage.base import parse_root_bytes
from .._storage.kvio import wait_all, write_key
from .._torch.dist import Group
from .._write.transaction import WriteTransaction, begin_write
from .node import NodeMemory
from .record import FileSum, StepRecord, file_sum
from .restore import choose, pick_holder, ranks_by_node, share_documents, survey

__all__ = ["Flushed", "flush_memory_step"]

# What the coordinator's ``_open`` tells every rank: the checkpoint is at the location already, or where to copy into
# (the destination's location and chunk key encoding).
_Opened: TypeAlias = Literal["there"] | tuple[Literal["copy"], Location, str]


@dataclass(frozen=True)
class Flushed:
    """What a flush did: the step, its checkpoint id, where it is now durable, and what this rank copied."""

    step: int
    id: str
    location: str
    copied: bool  # False: the durable tier held this very checkpoint already
    files: int  # chunk files this rank copied
    nbytes: int  # their bytes


def flush_memory_step(node: NodeMemory, group: Group, step: int | None, location_of: Callable[[int], Location],
                      guard: Callable[[], None] | None = None) -> Flushed | None:
    """Copy memory step ``step`` (``None``: the newest one the nodes hold whole) to ``location_of(step)`` as a
    committed checkpoint; collective. ``None`` when there is no memory step to flush (only with ``step=None``).
    ``guard`` is called on the coordinator before it opens the transaction (the manager's hold on its root).
    Raises ``StateError`` when the step is not whole among the nodes, ``CorruptCheckpointError`` naming a chunk file
    that no longer matches the step's record, ``StorageError`` when the durable tier fails; on every rank alike."""
    found = survey(node, group)
    choice = choose(found.ids, found.summaries, None, step)
    if choice.step is None or choice.id is None:
        if step is None and not choice.why_not:
            return None
        why = "; ".join(choice.why_not) or f"no node holds a committed memory step {step}"
        raise StateError(f"{node.directory}: cannot flush memory step{'' if step is None else f' {step}'}: {why}")
    step, ident = choice.step, choice.id
    where = str(node.step_path(step))
    documents, record_bytes, error = share_documents(node, group, step, found.source(step, ident))
    if error is not None:
        raise ArrayckptError(f"{where}: cannot flush: reading the step's documents failed: {error}") from error
    manifest, nodes = parse_root_document(parse_root_bytes(documents[""], where), where)
    files = StepRecord.parse(record_bytes, nodes, where).files
    location = location_of(step)
    transaction: WriteTransaction | None = None
    opened: _Opened | BaseException | None = None  # ("copy", target, encoding) / "there" / the error
    if group.is_coordinator:
        try:
            opened, transaction = _open(location, manifest.id, nodes, guard)
        except Exception as e:
            opened = e
    try:
        opened = group.broadcast(opened)
        if isinstance(opened, BaseException):
            raise opened
        assert opened is not None, "the coordinator broadcasts what it opened, or its error, never None"
        if opened == "there":
            return Flushed(step, ident, str(location), False, 0, 0)
        _, target, encoding = opened
        ranks_of = ranks_by_node(found.ids)
        mine = [(path, key, expected) for path, keys in sorted(files.items()) for key, expected in sorted(keys.items())
                if pick_holder(path, key, choice.holders, ranks_of) == group.rank]
        copied, error = 0, None
        try:
            copied = _copy_files(node, step, mine, nodes, target, encoding, where)
        except ArrayckptError as e:
            error = type(e)(f"rank {group.rank}: {e}")
        except OSError as e:
            error = StorageError(f"rank {group.rank}: {e}")
        reports = group.gather(error)
        outcome: BaseException | None = None
        if transaction is not None:
            assert reports is not None
            outcome = next((e for e in reports if e is not None), None)
            if outcome is None:
                try:
                    transaction.commit(manifest, _consolidated(nodes, encoding))
                except Exception as e:  # told to every rank below (none may wait for a broadcast never sent)
                    outcome = e
            if outcome is not None:
                transaction.abort()
        outcome = group.broadcast(outcome)
        if outcome is not None:
            raise outcome
    except BaseException:
        if transaction is not None:
            transaction.abort()
        raise
    return Flushed(step, ident, str(location), True, len(mine), copied)


def _open(location: Location, ident: str | None, nodes: Mapping[str, JSON],
          guard: Callable[[], None] | None) -> tuple[_Opened, WriteTransaction | None]:
    """The coordinator's part before the copy: ``"there"`` when ``location`` holds this checkpoint already, else the
    write transaction (its documents written) and what the ranks need of it."""
    try:
        manifest = member(location.read_root(), "attributes", MANIFEST_ATTRIBUTE)
        if isinstance(manifest, dict) and ident is not None and manifest.get("id") == ident:
            return "there", None
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        pass
    if guard is not None:
        guard()
    transaction = begin_write(location, overwrite=True)
    try:
        encoding = transaction.key_encoding
        transaction.write_documents({path: json.dumps(_encoded(node, encoding)).encode()
                                     for path, node in nodes.items() if path})
    except BaseException:
        transaction.abort()
        raise
    return ("copy", transaction.target, encoding), transaction


def _encoded(node: JSON, encoding: str) -> JSON:
    """A node document with the destination's chunk key encoding (arrays only; separator ``.``)."""
    if node.get("node_type") == "array" and json_object(node.get("chunk_key_encoding")).get("name") != encoding:
        return {**node, "chunk_key_encoding": {"name": encoding, "configuration": {"separator": "."}}}
    return node


def _consolidated(nodes: Mapping[str, JSON], encoding: str) -> str:
    return "{" + ", ".join(f"{json.dumps(p)}: {json.dumps(_encoded(n, encoding))}" for p, n in nodes.items()) + "}"


def _copy_files(node: NodeMemory, step: int, mine: list[tuple[str, str, FileSum]], nodes: Mapping[str, JSON],
                target: Location, encoding: str, where: str) -> int:
    """Copy this rank's share of the chunk files into ``target`` (each checked against the record first, each key
    turned into the destination's encoding); the bytes copied."""
    import tensorstore as ts

    context = resolve_context(target.write_context())
    stores: dict[str, ts.KvStore] = {}
    pending = []
    nbytes = 0
    for path, key, expected in mine:
        data = node.read_file(step, path, key)
        if file_sum(data) != expected:
            raise CorruptCheckpointError(f"{where}: chunk file {path}/{key} does not match the step's record (size or "
                                         "crc32c): damaged since it was checked")
        index = parse_chunk_key(nodes[path], key)
        if index is None:  # the record's keys were checked to be chunk keys of the array: cannot be
            raise CorruptCheckpointError(f"{where}: {path}/{key!r} is not a chunk key of that array")
        if path not in stores:
            stores[path] = ts.KvStore.open(target.kvstore(path), context=context).result()
        pending.append((f"{path}/{key}", write_key(stores[path], chunk_key(_encoded(nodes[path], encoding), index),
                                                   data, target)))
        nbytes += len(data)
    wait_all(pending, target, "copying chunk files")
    if pending:
        target.finish_rank_writes()
    return nbytes
