"""A memory save: staged on the host, then (in the background) the ordinary save path into node-local directories,
the replication, the commit.

Call order (every rank calls :func:`start_memory_save`; collectives in brackets)::

    node leaders: remove an earlier memory step of this number from their directory and make its directory anew
                  (refused, on every rank, when something that is not arrayckpt's is in its place)
    every rank:   copies its arrays into host buffers (reused by the next memory save) and returns: training goes on
    in the background, on a process group of its own (never interleaved with the training's collectives):
    every rank:   the ordinary save of the staged copy into <node dir>/step-N (a Destination: each rank its node's dir)
                    [the save's own four collectives]: the coordinator plans, every rank writes its own chunks into
                    its node's directory (same bytes, keys, checksums as a durable save), the coordinator commits the
                    documents into its node's directory (a PeerWriter: no rename, no look into other nodes)
    coordinator:  reads the step's documents back                                  [broadcast] ->
    node leaders: write them into their directory (the root document last)
    every rank:   reads its own chunk files (which ones: the manifest's created.writers), their sizes and sums
                                                                                   [all_gather] -> the step's record
                  (each rank checks every file another rank announces: a chunk key of the step, a size its array's
                  chunks can have)
    every rank:   refuses the step if a node would hold more than max_bytes x keep
    every rank:   sends its files to its partners on the next nodes, receives its sources' (point-to-point),
                  checks and writes them                                          [all_gather of the acks]
    node leaders: write the record (the commit on that node), then apply retention

A failure anywhere is raised on every rank (by the future :func:`start_memory_save` returns) and the step is removed
from every node (it was never committed).
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
from collections.abc import Mapping
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import ArrayckptError, StateError
from .._format.jsontypes import JSON
from .._format.manifest import parse_root_document
from .._format.stored import max_chunk_file_bytes
from .._format.writers import expand_runs
from .._format.zarr import chunk_keys, grid_counts, parse_chunk_key
from .._storage import LocalLocation, Writer
from .._storage.base import ROOT_METADATA, parse_root_bytes
from .._storage.files import remove_arrayckpt_files
from .._torch.dist import Group
from .._write.describe import LocalState, describe_local
from .._write.hostcopies import HostCopies
from .._write.options import Destination, SaveOptions, SaveSetup
from .._write.save import SaveRequest, begin_save, finish_save
from .config import PeerMemory, Placement
from .node import NodeMemory, write_below
from .record import Files, FileSum, StepRecord, file_sum
from .wire import FileRef, Transfer, exchange_files

__all__ = ["MemorySaved", "start_memory_save"]


@dataclass(frozen=True)
class MemorySaved:
    """What a memory save did: its step, checkpoint id, and the bytes this node holds of it (own + replicas)."""

    step: int
    id: str
    node_bytes: int


class PeerWriter(Writer):
    """The coordinator's side of a memory save: documents and the root document go straight into its node's step
    directory (no temporary directory: the memory step's commit is its record, written after the replication), and
    the chunks of other nodes are not looked for here (the replication checks every file instead)."""

    location: LocalLocation

    def __init__(self, path: Path) -> None:
        self.location = self.target = LocalLocation(path)
        self.key_encoding = "default"
        path.mkdir(parents=True, exist_ok=True)

    def write_documents(self, documents: Mapping[str, bytes]) -> Any:
        for path, document in documents.items():
            self._write(f"{path}/{ROOT_METADATA}" if path else ROOT_METADATA, document)
        return lambda: None

    def missing(self, chunks: Mapping[str, Any]) -> list[str]:
        return []

    def commit(self, root_document: bytes) -> None:
        self._write(ROOT_METADATA, root_document)

    def _write(self, relative: str, data: bytes) -> None:
        """Write a document of the step (no link followed below the memory directory)."""
        step = self.location.path
        write_below(step.parent, f"{step.name}/{relative}", data)

    def abort(self) -> None:
        remove_arrayckpt_files(self.location.path)


def start_memory_save(state: Mapping[str, Any], step: int, metrics: Mapping[str, float] | None,
                      options: SaveOptions, setup: SaveSetup, memory: PeerMemory, node: NodeMemory, group: Group,
                      background: Group, copies: HostCopies, executor: Executor) -> Future[MemorySaved]:
    """Stage ``state`` into ``copies`` and return; the save as memory step ``step`` on every node and its
    replication run on ``executor``, their collectives on ``background`` (a group of its own over the same ranks as
    ``group``). The caller must not start another memory save (which reuses ``copies``) before the future is done."""
    placement = memory.placement(group.size)
    prepared: BaseException | None = None
    if placement.leader(group.rank):
        try:
            node.prepare_step(step)
        except (ArrayckptError, OSError) as e:  # raised on every rank by the save's first collective
            if group.size == 1:
                raise
            prepared = ArrayckptError(f"{type(e).__name__}: {e}")
    path = node.step_path(step)
    own = dataclasses.replace(options, step=step, metrics=metrics, base=None, changed_rows=None, quantize=None,
                              overwrite=True, storage_options=None)
    # the coordinator commits into its node's step in place; every rank writes its chunks into its own node's
    destination = Destination(open_writer=lambda overwrite: PeerWriter(path), chunks=LocalLocation(path, fsync=False))
    request = begin_save(LocalLocation(path), own, dataclasses.replace(setup, destination=destination))
    try:
        local, error = _stage(state, group, own.allow_pickle, copies)
    except BaseException:
        request.close()
        raise
    if prepared is not None:
        local, error = None, prepared
    return executor.submit(_save_and_replicate, local, error, request, step, memory, node, background, placement)


def _stage(state: Mapping[str, Any], group: Group, allow_pickle: bool,
           copies: HostCopies) -> tuple[LocalState | None, BaseException | None]:
    """This rank's state described and copied to the host; a rank-local error is returned (with several ranks), so
    that the background save raises it on every rank and none waits for this one forever."""
    try:
        try:
            local = describe_local(state, group.rank, allow_pickle, copies.host)
        finally:
            copies.finish()  # (also after a failure: device copies may be in flight into the buffers)
        return local, None
    except Exception as e:
        if group.size == 1:
            raise
        try:
            pickle.dumps(e)
        except Exception:
            e = ArrayckptError(f"{type(e).__name__}: {e}")
        return None, e


def _save_and_replicate(local: LocalState | None, error: BaseException | None, request: SaveRequest, step: int,
                        memory: PeerMemory, node: NodeMemory, group: Group, placement: Placement) -> MemorySaved:
    """The background part of a memory save (see the module docstring)."""
    leader = placement.leader(group.rank)
    try:
        try:
            finish_save(local, error, group, request)
        finally:
            request.close()
        saved = _replicate(step, memory, node, group, placement)
    except BaseException:
        if leader:
            node.remove_step(step)
        raise
    if leader:
        node.apply_retention(memory.keep)
    return saved


def _replicate(step: int, memory: PeerMemory, node: NodeMemory, group: Group, placement: Placement) -> MemorySaved:
    """Everything after the ordinary save: documents to every node, the record, the replicas, the commit."""
    where = str(node.step_path(step))
    documents = group.broadcast(node.read_documents(step) if group.is_coordinator else None)
    assert documents is not None, "every rank receives the coordinator's documents, which it read (never None)"
    if placement.leader(group.rank) and not group.is_coordinator:
        node.write_documents(step, documents)
    manifest, nodes = parse_root_document(parse_root_bytes(documents[""], where), where)
    mine, error = {}, None
    try:
        mine = {ref: data for ref, data in _own_files(step, node, manifest.created, nodes, group)}
    except (ArrayckptError, OSError) as e:
        error = f"rank {group.rank}: {e}"
    reports = group.all_gather((error, [(r.array_path, r.key, r.sum.size, r.sum.body, r.sum.tail) for r in mine]))
    failed = [text for text, _ in reports if text is not None]
    if failed:
        raise ArrayckptError(f"{where}: memory save failed: {failed[0]}")
    files: Files = {}
    by_rank = [_announced(refs, nodes, rank, where) for rank, (_, refs) in enumerate(reports)]
    for refs in by_rank:
        for ref in refs:
            if ref.key in files.get(ref.array_path, {}):
                raise ArrayckptError(f"{where}: memory save failed: chunk file {ref} announced by two ranks")
            files.setdefault(ref.array_path, {})[ref.key] = ref.sum
    _check_bound(memory, placement, by_rank, where)
    transfers = [Transfer(rank, partner, refs) for rank, refs in enumerate(by_rank)
                 for partner in placement.partners(rank)]
    error = None
    received = 0
    try:
        received = exchange_files(group, transfers, lambda ref: mine[ref],
                                  lambda ref, data: node.write_file(step, ref.array_path, ref.key, data), where)
    except (ArrayckptError, OSError) as e:
        error = f"rank {group.rank}: {e}"
    acks = group.all_gather(error)
    failed = [text for text in acks if text is not None]
    if failed:
        raise ArrayckptError(f"{where}: memory save not committed: replication failed: {failed[0]}")
    if placement.leader(group.rank):
        node.commit(StepRecord(step, str(manifest.id), group.size, files))
    own_bytes = sum(r.sum.size for r in mine)
    return MemorySaved(step, str(manifest.id), own_bytes + received)


def _own_files(step: int, node: NodeMemory, created: Mapping[str, object], nodes: Mapping[str, JSON],
               group: Group) -> list[tuple[FileRef, bytes]]:
    """The chunk files this rank wrote (``created.writers``; all of them with one rank), read back with their sums."""
    writers = created.get("writers") if group.size > 1 else None
    out = []
    for path, metadata in nodes.items():
        if not isinstance(metadata, dict) or metadata.get("node_type") != "array":
            continue
        indices = list(itertools.product(*map(range, grid_counts(metadata))))
        ranks = expand_runs(writers.get(path) if isinstance(writers, dict) else None, len(indices)) \
            if group.size > 1 else [0] * len(indices)
        if ranks is None:
            raise ArrayckptError(f"array {path!r}: the manifest does not say which rank wrote each chunk")
        keys = chunk_keys(metadata, [i for i, r in zip(indices, ranks, strict=True) if r == group.rank])
        for key in keys:
            data = node.read_file(step, path, key)
            out.append((FileRef(path, key, file_sum(data)), data))
    return out


def _announced(refs: object, nodes: Mapping[str, JSON], rank: int, where: str) -> tuple[FileRef, ...]:
    """The chunk files rank ``rank`` says it wrote, each checked by :func:`_announced_file`."""
    out = []
    for item in refs if isinstance(refs, list) else [refs]:
        ref = _announced_file(item, nodes)
        if ref is None:
            raise ArrayckptError(f"{where}: memory save failed: rank {rank} announced {item!r}, which is not a chunk "
                                 "file of this step")
        out.append(ref)
    return tuple(out)


def _announced_file(item: object, nodes: Mapping[str, JSON]) -> FileRef | None:
    """``(array path, key, size, crc32c, trailer)`` from a peer as a :class:`FileRef`, or ``None`` unless the key is a
    chunk key of an array of the step (so that no path leaves the step's directory) and the size one such a chunk
    file can have (so that no receiver allocates more)."""
    if not (isinstance(item, tuple) and len(item) == 5):
        return None
    path, key, size, body, tail = item
    metadata = nodes.get(path) if isinstance(path, str) else None
    if not (isinstance(metadata, dict) and metadata.get("node_type") == "array" and isinstance(key, str)
            and parse_chunk_key(metadata, key) is not None):
        return None
    if not (isinstance(size, int) and isinstance(body, int) and isinstance(tail, int)):
        return None
    if not (4 <= size <= max_chunk_file_bytes(metadata) and 0 <= body < 2**32 and 0 <= tail < 2**32):
        return None
    return FileRef(path, key, FileSum(size, body, tail))


def _check_bound(memory: PeerMemory, placement: Placement, by_rank: list[tuple[FileRef, ...]], where: str) -> None:
    """Refuse (on every rank alike) a step that would make a node hold more than ``max_bytes`` with ``keep`` steps."""
    if memory.max_bytes is None:
        return
    sizes = [sum(r.sum.size for r in refs) for refs in by_rank]
    worst, domain = 0, 0
    for d, ranks in enumerate(placement.domains):
        own = sum(sizes[r] for r in ranks)
        replicas = sum(sizes[s] for r in ranks for s in placement.sources(r))
        if (own + replicas) * memory.keep > worst:
            worst, domain = (own + replicas) * memory.keep, d
    if worst > memory.max_bytes:
        raise StateError(f"{where}: peer memory would need {worst:,} bytes on node {domain} ((own chunks + replicas) "
                         f"x keep={memory.keep}), over PeerMemory(max_bytes={memory.max_bytes:,}); raise max_bytes, "
                         "or lower keep or replicas (the step was not kept)")
