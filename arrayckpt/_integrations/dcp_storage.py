"""A PyTorch DCP ``StorageWriter`` that writes a normal arrayckpt checkpoint: :class:`ArrayckptWriter`.

``torch.distributed.checkpoint.save(state, storage_writer=ArrayckptWriter(path))`` keeps DCP's own planning
(its default planner flattens the state, deduplicates replicated data and gives every shard one writer) and
hands the bytes to arrayckpt's planner, write path and commit, mirroring what ``arrayckpt.save`` does
(``_write/save.py``)::

    every rank   prepare_local_plan   DCP's local plan, unchanged                                  gather ->
    coordinator  prepare_global_plan  DCP's write items -> one LocalDescription per rank -> plan_save
                                      (validates keys, dtypes, tiling; chunk grids aligned with the shards,
                                      so every chunk has one writer); begin_write (the temporary directory of
                                      a local save, the target prefix on object storage)
                                      <- scatter: each rank's plan carries its WriteTasks, the arrays they
                                         write to and the target Location in ``SavePlan.storage_data``
    every rank   write_data           its chunks, concurrently, straight from its tensors' memory
                                      (``_io.arrays.write_all``; packed: into its one pack, ``RankPack``); each
                                      WriteResult carries the crc32c of the chunks it wrote, or the value of a
                                      BYTE_IO item, and once per rank its pack (``RankPacked``)   gather ->
    coordinator  finish               values (and pickles, written here: packed, into the coordinator's pack,
                                      kept open since its write_data) enter the plan; every array's and group's
                                      zarr.json (packed: none, and the chunk table, ``packed_manifest``), the
                                      manifest with its chunk digests, then the root document, last: the commit

A save is packed (spec §16: one pack per rank, whatever the number of tensors) as ``arrayckpt.save``'s is: from
``packed_from_ranks`` ranks of DCP's process group up, or as ``packed=`` says.

A tensor the state holds under two keys (tied weights: GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``)
is stored once, the second key an alias (spec §4.3), as ``arrayckpt.save`` stores it; DCP's plans carry no tensors,
so the ranks find ties in ``write_data`` and the coordinator decides at the commit: ``dcp_ties.py``.

DCP's ``BYTE_IO`` items are stored as plain values where they are plain (an optimizer's ``param_groups`` need no
pickle), else only with ``allow_pickle=True``: see ``dcp_values.py``. DCP has no way to pass a step, so the manifest
records the state's own when one plain integer value names it (``step``, or a single ``train_state.step``:
``_format.values.step_value``), and :attr:`arrayckpt.Checkpoint.step`, ``arrayckpt info`` and ``report`` show it.
Keys: see ``dcp_keys.py`` (the dotted key of every tensor is DCP's fqn).

Saving to a path that holds a checkpoint (arrayckpt's, or one DCP's ``FileSystemWriter`` wrote there: a save
switched to this writer at a fixed path) replaces it (``overwrite=True``, DCP's default; ``overwrite=False`` refuses
with ``CheckpointExistsError``), atomically: the old checkpoint stays whole until the new one commits. A local
directory that holds the user's files gets the checkpoint beside them, as with DCP's writer
(``_storage/beside.py``); a committed checkpoint there is replaced (in place, not atomically) only with
``overwrite=True`` given explicitly, and refused by default. A failed save — an exception on any rank, after which
DCP raises ``CheckpointException`` everywhere and never calls ``finish`` — commits nothing, and a committed
checkpoint at the path stays whole (the data went to a temporary directory, or under other chunk keys on object
storage). What it wrote is removed when the coordinator's writer is next used from the same thread (``reset``, or
the next save's set-up) or from any thread once the failed save's thread has ended (a failed ``dcp.async_save``),
when the writer is garbage-collected, or at interpreter exit; a process killed meanwhile leaves it for
``arrayckpt.gc``. A save in flight in another thread (a writer reused by overlapping ``dcp.async_save`` calls) is
never touched: each thread's save is its own.

``dcp.async_save`` stages through the writer unless given ``async_stager=`` (the writer is a
``BlockingAsyncStager``, as DCP's ``FileSystemWriter`` is: a CPU copy of the state, kept for the next save with
``cache_staged_state_dict=True``); with ``AsyncCheckpointerType.PROCESS`` the writer is pickled into DCP's
checkpoint process (its configuration only). DCP's other ``FileSystemWriter`` arguments: ``dcp_options.py``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .._errors import ArrayckptError, CheckpointExistsError, StateError
from .._format.codecs import CodecChoice
from .._format.keys import array_path, dotted
from .._format.manifest import MAX_NDIM, ValueEntry
from .._format.packs import new_tag
from .._format.values import step_value
from .._io.arrays import ArrayIO, Checksums, array_spec
from .._layout.box import Box, grid_cells
from .._layout.chunking import DEFAULT_CHUNKING, ArrayPlan, ChunkPolicy
from .._layout.plancache import PlanCache
from .._layout.saveplan import ArrayDescription, LocalDescription, documents_of
from .._layout.saveplan import SavePlan as ArrayckptPlan
from .._layout.tasks import WriteTask
from .._storage import Beside, Location, parse_location
from .._torch.dtypes import dtype_of_torch
from .._torch.tensors import readable_numpy
from .._write.options import packed_layout
from .._write.packed import PackReport, RankPack, chunk_destination
from .._write.save import Record, build_manifest, created_info, packed_manifest
from .._write.transaction import WriteTransaction, begin_write
from .dcp_keys import key_parts, object_path
from .dcp_options import accelerator_available, check_writer_options
from .dcp_ties import TiesOnRank, agreed_ties, claim_ties, may_tie, tensor_items, with_ties
from .dcp_values import ValueWritten, encode_item, value_entries, write_pickles

__all__ = ["ArrayckptWriter"]


@dataclass(frozen=True)
class RankWork:
    """What the coordinator's plan gives one rank (in its ``SavePlan.storage_data``): where to write, and which
    boxes of which arrays."""

    target: Location  # the transaction's target (a temporary directory for a local save)
    where: str  # the checkpoint's location, for messages
    tasks: tuple[WriteTask, ...]
    arrays: dict[str, ArrayPlan]  # the arrays the tasks write to, by path
    ties: bool = False  # two arrays could be one tensor: look for tied weights (``dcp_ties.py``)
    pack_tag: str | None = None  # packed (spec §16): the save's tag; the rank's chunk files go into its one pack
    rank: int = 0  # this rank's place in the plans (its pack's rank)


@dataclass(frozen=True)
class ChunksWritten:
    """``WriteResult.storage_data`` of a tensor item: the crc32c of each whole chunk it wrote."""

    path: str
    checksums: dict[int, int]  # flat chunk index -> crc32c


PACK_RESULT = "arrayckpt.pack"  # the MetadataIndex of the WriteResult that carries a rank's pack


@dataclass(frozen=True)
class RankPacked:
    """``WriteResult.storage_data`` of a packed save's rank, once per rank: its pack and where its chunks lie in it
    (their checksums travel in its :class:`ChunksWritten`)."""

    rank: int
    report: PackReport


@dataclass
class _Pending:
    """The coordinator's save between planning and the commit."""

    transaction: WriteTransaction
    plan: ArrayckptPlan
    mapping: dict[str, Any]  # DCP's fqn -> object path
    documents_written: bool  # the plan's zarr.json documents are being written (else: at the commit, or never)
    pack_tag: str | None = None  # packed (its tag): no zarr.json documents, the root holds the node metadata (§16.1)
    pack: RankPack | None = None  # the coordinator's own pack, kept open from write_data for the pickles
    pack_rank: int = 0  # the coordinator's rank among the plans (its pack's)

    def abort(self) -> None:
        """Remove what the save wrote: the coordinator's pack (when still open), the transaction's target."""
        if self.pack is not None:
            self.pack.abort()
        self.transaction.abort()


class _Saves:
    """The coordinator's saves between planning and the commit, one per thread (DCP plans and finishes a save in
    one thread; overlapping ``dcp.async_save`` calls through one writer run in different threads). Held apart from
    the writer so that its finalizer holds no reference to the writer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[threading.Thread, _Pending] = {}

    def begin(self, pending: _Pending) -> None:
        with self._lock:
            self._by_thread[threading.current_thread()] = pending

    def take(self) -> _Pending | None:
        """This thread's planned save, handed over to be committed or aborted."""
        with self._lock:
            return self._by_thread.pop(threading.current_thread(), None)

    def abort_stale(self) -> None:
        """Abort the saves that can no longer finish: this thread's (a save that failed on some rank never reached
        ``finish``) and those of threads that have ended (a failed ``dcp.async_save``)."""
        me = threading.current_thread()
        with self._lock:
            stale = [t for t in self._by_thread if t is me or not t.is_alive()]
            pending = [self._by_thread.pop(t) for t in stale]
        for p in pending:
            p.abort()

    def current(self) -> _Pending | None:
        """This thread's planned save (the coordinator's ``write_data`` keeps its pack there)."""
        with self._lock:
            return self._by_thread.get(threading.current_thread())

    def abort_all(self) -> None:
        """Abort every planned save (the writer's finalizer)."""
        with self._lock:
            pending = list(self._by_thread.values())
            self._by_thread.clear()
        for p in pending:
            p.abort()


class ArrayckptWriter(StorageWriter, BlockingAsyncStager):
    """A DCP ``StorageWriter`` whose checkpoints are normal arrayckpt checkpoints.

    Every rank writes its own chunks; rank 0 (DCP's coordinator) commits. Incompatible: DCP plan caching
    (``DefaultSavePlanner(enable_plan_caching=True)``: a cached plan would name another save's temporary
    directory) and ``use_collectives=False`` on several ranks (each would commit alone).

    Args:
        path: a local directory or an object-storage URL (``s3://bucket/prefix``); it may instead come from DCP's
            ``checkpoint_id``.
        codec: as for :func:`arrayckpt.save` (None, "zstd", "blosc", an :class:`arrayckpt.Codec` or a per-key choice).
        overwrite: by default (None) ``True``, as for DCP's ``FileSystemWriter``: a checkpoint at the path is
            replaced when the new one commits, and stays whole until then — but in a directory that also holds other
            files, where that replacement is not atomic, a committed checkpoint is refused (kept); ``True`` given
            explicitly replaces it there too, in place; ``False`` refuses everywhere.
        allow_pickle: as for :func:`arrayckpt.save`.
        storage_options: for object storage, as for :func:`arrayckpt.save`.
        packed: as for :func:`arrayckpt.save`: ``True`` writes each rank's chunk files into one pack file (object)
            per save, with an index (spec §16), ``False`` one file (object) per chunk, ``None`` (default) packed from
            ``ARRAYCKPT_PACKED_FROM_RANKS`` ranks (2) of the DCP process group up: a save at scale writes a few
            files per rank, not one per tensor shard.
        cache_staged_state_dict: ``FileSystemWriter``'s: with ``dcp.async_save`` (no ``async_stager=``) keep the CPU
            copy of the state for the next save (pinned where an accelerator is).
        dcp_marker: write, right after the commit, the file ``.metadata`` that DCP-based trainers look for to find
            their checkpoints (TorchTitan's step discovery): arrayckpt's marker (spec §2.1), which DCP's own reader
            refuses with a message naming :class:`ArrayckptReader` instead of misreading it. ``False``: no marker.
        filesystem_writer_options: ``FileSystemWriter``'s other arguments, accepted or refused as ``dcp_options.py``
            says.

    Raises:
        CheckpointExistsError: (at ``dcp.save``) a checkpoint is at the path and ``overwrite=False``, or a
            committed checkpoint is in a directory that holds other files and ``overwrite=True`` was not given.
        ValueError: a ``FileSystemWriter`` argument arrayckpt cannot honour.
        TypeError: an argument ``FileSystemWriter`` does not take either.

    Examples:
        >>> import arrayckpt, torch, tempfile, os, warnings
        >>> import torch.distributed.checkpoint as dcp
        >>> from arrayckpt.dcp import ArrayckptWriter
        >>> path = os.path.join(tempfile.mkdtemp(), "step-1")
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")  # DCP warns that it saves in a single process
        ...     _ = dcp.save({"model": torch.nn.Linear(3, 2).state_dict(), "step": 1},
        ...                  storage_writer=ArrayckptWriter(path), no_dist=True)
        >>> arrayckpt.open(path)["model.weight"].shape, arrayckpt.open(path).plain_values["step"]
        ((2, 3), 1)
    """

    #: The chunk targets arrays are planned with (as for ``arrayckpt.save``; tests set small ones so that small
    #: tensors get several chunks per shard).
    chunking: ChunkPolicy = DEFAULT_CHUNKING

    def __init__(self, path: str | os.PathLike[str] | None = None, *, codec: CodecChoice = None,
                 overwrite: bool | None = None, allow_pickle: bool = False,
                 storage_options: Mapping[str, Any] | None = None, packed: bool | None = None,
                 cache_staged_state_dict: bool = False, dcp_marker: bool = True,
                 **filesystem_writer_options: Any) -> None:
        implied = check_writer_options(filesystem_writer_options)  # ZStandard(): "zstd"
        StorageWriter.__init__(self)
        BlockingAsyncStager.__init__(self, cache_staged_state_dict=cache_staged_state_dict)
        self.path = None if path is None else os.fspath(path)
        self.codec = codec if codec is not None else implied
        self.overwrite = overwrite
        self.allow_pickle = allow_pickle
        self.storage_options = storage_options
        self.packed = packed
        self.dcp_marker = dcp_marker
        self.save_id = uuid.uuid4().hex
        self.is_coordinator = True
        self._saves = _Saves()
        self._plans = PlanCache()  # this writer's last layout, for its next save (on the coordinator)
        self._held = threading.local()  # this thread's save: the rank's tensor items, for dcp_ties.claim_ties
        self._finalizer = weakref.finalize(self, self._saves.abort_all)

    # --- DCP's StorageWriter interface, in the order DCP calls it ----------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save begins (DCP calls this when given a ``checkpoint_id``, which then becomes the path); what an
        earlier failed save of this writer left is removed."""
        self._saves.abort_stale()
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self.save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a place arrayckpt can save to: a local path or a supported URL."""
        try:
            parse_location(checkpoint_id)
        except Exception:  # noqa: BLE001 - not a location arrayckpt knows
            return False
        return True

    @property
    def checkpoint_id(self) -> str | None:
        """The path the checkpoint is saved to (DCP logs it)."""
        return self.path

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._saves.abort_stale()  # a save that failed on some rank never reached finish: undo it now
        self.is_coordinator = is_coordinator
        if kwargs.get("use_collectives", True) is False and _world_size() > 1:  # refused on every rank: none waits
            raise StateError("ArrayckptWriter needs DCP's collectives (use_collectives=True): one coordinator plans "
                             "and commits what every rank wrote; without them each rank would commit alone")
        self._location()

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._held.items = tensor_items(plan.items)  # all of them: DCP's deduplication comes next
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: plan the arrays from every rank's write items, begin the write transaction, and
        give each rank its part of the plan."""
        self._saves.abort_stale()
        location = self._location()
        if any(not plan.usable for plan in plans):
            raise StateError("ArrayckptWriter cannot reuse DCP's cached plans (enable_plan_caching=True): every save "
                             "plans its own temporary target; save with enable_plan_caching=False")
        mapping: dict[str, Any] = {}
        for plan in plans:
            if isinstance(plan.planner_data, Mapping):
                for fqn, path in plan.planner_data.items():
                    mapping.setdefault(fqn, path)
        descriptions = [LocalDescription(arrays=tuple(_describe(item, mapping) for item in plan.items
                                                      if item.type != WriteItemType.BYTE_IO)) for plan in plans]
        planned = self._plans.plan_save(descriptions, self.codec, self.chunking)
        transaction = _begin(location, self.overwrite)
        ties = may_tie(planned)
        pack_tag = new_tag() if packed_layout(self.packed, len(plans)) else None
        early = pack_tag is None and not self.allow_pickle and not ties  # no pickle can add an array, no tie remove one
        try:
            planned = self._plans.with_key_encoding(planned, transaction.key_encoding)
            if early:  # write the documents meanwhile
                transaction.write_documents(planned.documents)
            out = []
            assert planned.layout is not None  # PlanCache.plan_save's: a full save's tasks, its Layout's WriteTasks
            for rank, plan in enumerate(plans):
                tasks = planned.layout.tasks[rank]
                arrays = {t.path: planned.arrays[t.path] for t in tasks}
                work = RankWork(transaction.target, str(location), tasks, arrays, ties, pack_tag, rank)
                out.append(dataclasses.replace(plan, storage_data=work))
        except BaseException:
            transaction.abort()
            raise
        self._saves.begin(_Pending(transaction, planned, mapping, early, pack_tag))
        return out

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """On every rank: decode its BYTE_IO items, then write its chunks concurrently; the results carry the
        values and the chunks' checksums to the coordinator."""
        work = plan.storage_data
        if not isinstance(work, RankWork):
            raise ArrayckptError("ArrayckptWriter.write_data got a plan that ArrayckptWriter.prepare_global_plan did "
                                 "not make (a planner that replaces or caches plans?)")
        results: list[WriteResult] = []
        for item in plan.items:  # values first: a refused one fails the save before any chunk is written
            if item.type == WriteItemType.BYTE_IO:
                written = encode_item(item, planner, self.allow_pickle)
                size = len(written.pickled) if written.pickled is not None else len(repr(written.encoded))
                results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=written))
        skipped: frozenset[str] = frozenset()
        if work.ties:  # a tied key's chunks are its target's: not written (the coordinator decides at the commit)
            held = getattr(self._held, "items", None) or tensor_items(plan.items)
            claims = claim_ties(held, planner)
            skipped = frozenset(item.index.fqn for item in plan.items if item.index.fqn in claims)
            ties = TiesOnRank(frozenset(item.index.fqn for item in held), claims, skipped)
            results.append(WriteResult(index=MetadataIndex("arrayckpt.ties"), size_in_bytes=0, storage_data=ties))
        self._held.items = None
        pieces: dict[str, list[tuple[Box, np.ndarray, WriteItem]]] = {}
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO and item.index.fqn not in skipped:
                pieces.setdefault(item.index.fqn, []).append(_host_piece(item, planner.resolve_data(item), work))
        pack = None if work.pack_tag is None else RankPack(work.target, work.rank, work.where, work.pack_tag)
        try:
            sink = chunk_destination(work.target, pack)
            jobs = []
            for task in (t for t in work.tasks if t.key not in skipped):
                box, data = _piece_holding(pieces, task)
                spec = array_spec(sink.kvstore(task.path), work.arrays[task.path].metadata)
                jobs.append(ArrayIO(task.key, spec, data[task.box.relative_to(box)], task.box.slices(), task.path))
            checksums = sink.write(jobs, sink.context, work.where)
            if pack is not None:
                results.extend(self._report_pack(pack, work))
            elif jobs and not self.is_coordinator:  # on a shared filesystem each host fsyncs its own writes
                work.target.finish_rank_writes()  # (a pack is synced when it is closed)
        except BaseException:
            if pack is not None:
                pack.abort()
            raise
        for fqn, held in pieces.items():
            path = array_path(fqn)
            array, found = work.arrays.get(path), checksums.get(path, {})
            for box, data, item in held:  # the chunks each item wrote (all of them when it is the rank's only piece)
                mine = found if len(held) == 1 else _within(found, box, array) if array is not None else {}
                results.append(WriteResult(index=item.index, size_in_bytes=data.nbytes,
                                           storage_data=ChunksWritten(path, mine)))
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _report_pack(self, pack: RankPack, work: RankWork) -> list[WriteResult]:
        """This rank's pack, closed, as a result for the coordinator; the coordinator's own stays open until the
        commit, for the pickled values it writes then (``finish``), and reports there."""
        pending = self._saves.current() if self.is_coordinator else None
        if pending is not None:
            pending.pack, pending.pack_rank = pack, work.rank
            return []
        return [WriteResult(index=MetadataIndex(PACK_RESULT), size_in_bytes=0, storage_data=RankPacked(work.rank,
                                                                                                        pack.close()))]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator, once every rank wrote: the values enter the manifest (pickles are written here),
        then every node's zarr.json, then the root document: the commit. On failure nothing is committed."""
        pending = self._saves.take()
        if pending is None:
            raise ArrayckptError("ArrayckptWriter.finish without a planned save (prepare_global_plan was not called "
                                 "in this thread)")
        try:
            self._commit(pending, metadata, results)
        except BaseException:
            pending.abort()
            raise

    # --- the commit --------------------------------------------------------------------------------------

    def _commit(self, pending: _Pending, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        plan, transaction = pending.plan, pending.transaction
        where = str(transaction.location)
        by_rank: list[Checksums] = [{} for _ in results]  # what each rank wrote (the manifest records who wrote what)
        values: dict[str, ValueWritten] = {}
        ties: list[TiesOnRank] = [TiesOnRank(frozenset(), {}, frozenset())] * len(results)  # by rank
        packs: list[PackReport | None] = [None] * len(results)  # by rank, where packed
        for rank, rank_results in enumerate(results):
            for result in rank_results:
                data = result.storage_data
                if isinstance(data, ChunksWritten):
                    by_rank[rank].setdefault(data.path, {}).update(data.checksums)
                elif isinstance(data, ValueWritten):
                    values.setdefault(result.index.fqn, data)
                elif isinstance(data, TiesOnRank):
                    ties[rank] = data
                elif isinstance(data, RankPacked):
                    packs[data.rank] = data.report
        aliases = agreed_ties(ties, where) if any(t.claims for t in ties) else {}
        if aliases:  # stored once: the alias's array leaves the plan (its documents were not written yet)
            plan = with_ties(plan, aliases)
        entries, pickles, members, containers = value_entries(plan, values, pending.mapping)
        arrays = dict(plan.arrays)
        if pickles and pending.pack_tag is not None and pending.pack is None:
            raise ArrayckptError(f"{where}: the coordinator's pack is not open for the pickled values (DCP called "
                                 "write_data in another thread than prepare_global_plan?); save with packed=False")
        if pickles:  # (here, by the coordinator: into its pack when packed)
            sink = chunk_destination(transaction.target, pending.pack)
            arrays.update(write_pickles(pickles, arrays, transaction, sink, by_rank[0], self.chunking))
        if pending.pack is not None:
            packs[pending.pack_rank] = pending.pack.close()
        order = {fqn: i for i, fqn in enumerate(metadata.state_dict_metadata)}  # DCP's order of the state
        position = {key: min(order.get(fqn, len(order)) for fqn in members.get(key, (key,))) for key in entries}
        entries = dict(sorted(entries.items(), key=lambda kv: position[kv[0]]))
        documents, consolidated = documents_of(arrays) if pickles else (plan.documents, plan.consolidated_json)
        assert not (aliases and pending.documents_written)  # ties are looked for only when documents wait
        full = dataclasses.replace(plan, entries=entries, arrays=arrays, containers=containers,
                                   documents=documents, consolidated_json=consolidated)
        if not pending.documents_written and pending.pack_tag is None:  # (packed: the root holds them, spec §16.1)
            transaction.write_documents(documents)
        created = {**created_info(len(results)), "writer": "arrayckpt.dcp.ArrayckptWriter",
                   "dcp_save_id": self.save_id}  # DCP's StorageMeta.save_id, which ArrayckptReader gives back
        found = step_value({key: e.value for key, e in entries.items() if isinstance(e, ValueEntry)})
        record = Record(step=found.step if found is not None else None)  # DCP passes no step: the state's, if any
        manifest = build_manifest(full, record, len(results), None, [({}, sums) for sums in by_rank], where, created)
        if pending.pack_tag is not None:
            manifest = packed_manifest(manifest, full, packs, transaction, pending.pack_tag, where)
        transaction.commit(manifest, consolidated)
        if self.dcp_marker:  # after the commit, as DCP writes its .metadata last: a step found is a step committed
            transaction.location.write_marker()

    def _location(self) -> Location:
        if self.path is None:
            raise StateError("ArrayckptWriter has no path: pass one, ArrayckptWriter(path), or a checkpoint_id to "
                             "torch.distributed.checkpoint.save")
        return parse_location(self.path, self.storage_options)

    # --- dcp.async_save ------------------------------------------------------------------------------------

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """``dcp.async_save``'s staging when it is given no ``async_stager``: a CPU copy of the state, as
        ``FileSystemWriter`` makes; with ``cache_staged_state_dict=True`` the copy is kept and refilled by the next
        save, pinned where an accelerator is (DCP's own pins always, which fails on a machine without one)."""
        if not self.cache_staged_state_dict:
            return BlockingAsyncStager.stage(self, state_dict)
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        if self.state_dict_cache is None:
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=accelerator_available())
        return _copy_state_dict(state_dict, self.state_dict_cache)

    def __getstate__(self) -> dict[str, Any]:
        """The configuration only (DCP's process-based async save sends the writer to its checkpoint process):
        no planned save, no staged copy."""
        state = dict(self.__dict__)
        state.update(_saves=None, _plans=None, _held=None, _finalizer=None, state_dict_cache=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._saves = _Saves()
        self._plans = PlanCache()
        self._held = threading.local()
        self._finalizer = weakref.finalize(self, self._saves.abort_all)


def _begin(location: Location, overwrite: bool | None) -> WriteTransaction:
    """Begin the save; refused with ``overwrite=False`` where a checkpoint is committed, in the words of DCP's
    ``FileSystemWriter`` (which code written for it may look for) and arrayckpt's. DCP adds its files to a directory's:
    so does this save (``Beside``), replacing a committed checkpoint there only with ``overwrite=True`` given."""
    beside = Beside.REPLACE_CHECKPOINT if overwrite is True else Beside.KEEP_CHECKPOINT
    try:
        return begin_write(location, overwrite is not False, beside)
    except CheckpointExistsError as e:
        if overwrite is not False or not location.is_committed():
            raise
        raise CheckpointExistsError(f"Checkpoint already exists and overwrite=False: {e}") from None


def _world_size() -> int:
    """The default process group's size (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


# --- planning: DCP's write items as arrayckpt descriptions ---------------------------------------------------


def _describe(item: WriteItem, mapping: Mapping[str, Any]) -> ArrayDescription:
    """One tensor write item (a whole tensor, or one rank's shard) as an arrayckpt piece description."""
    fqn, data = item.index.fqn, item.tensor_data
    if data is None or data.chunk is None:
        raise StateError(f"DCP write item {fqn!r} of type {item.type.name} has no tensor data; it cannot be planned")
    parts = key_parts(object_path(fqn, mapping))
    key = dotted(parts)
    shape = tuple(int(n) for n in data.size)
    if len(shape) > MAX_NDIM:
        raise StateError(f"tensor {key!r} has {len(shape)} dimensions; at most {MAX_NDIM} can be stored")
    box = Box(tuple(int(o) for o in data.chunk.offsets), tuple(int(n) for n in data.chunk.sizes))
    dt = dtype_of_torch(data.properties.dtype, key)
    return ArrayDescription(key, parts, "tensor", dt.name, shape, box, 0)


def _host_piece(item: WriteItem, tensor: Any, work: RankWork) -> tuple[Box, np.ndarray, WriteItem]:
    """A resolved tensor item's box and host memory (the tensor's own memory on the CPU), checked against the
    plan."""
    fqn = item.index.fqn
    assert item.tensor_data is not None  # planned by _describe
    chunk = item.tensor_data.chunk
    box = Box(tuple(int(o) for o in chunk.offsets), tuple(int(n) for n in chunk.sizes))
    if not isinstance(tensor, torch.Tensor):
        raise StateError(f"tensor {fqn!r}: the planner resolved it to a {type(tensor).__name__}, not a tensor")
    if tuple(tensor.shape) != box.shape:
        raise StateError(f"tensor {fqn!r}: the planner resolved a shard of shape {list(tensor.shape)} for a write "
                         f"item of shape {list(box.shape)}")
    dt = dtype_of_torch(tensor.dtype, fqn)
    array = work.arrays.get(array_path(fqn))
    if array is not None and array.dtype.name != dt.name:
        raise StateError(f"tensor {fqn!r} was planned as {array.dtype.name} but resolved as {dt.name}")
    return box, readable_numpy(tensor.detach(), dt, fqn), item


def _piece_holding(pieces: Mapping[str, list[tuple[Box, np.ndarray, WriteItem]]],
                   task: WriteTask) -> tuple[Box, np.ndarray]:
    for box, data, _ in pieces.get(task.key, ()):
        if box.offset == task.box.offset and box.shape == task.box.shape or box.intersect(task.box) == task.box:
            return box, data
    raise ArrayckptError(f"tensor {task.key!r}: this rank was planned to write offset {list(task.box.offset)} shape "
                         f"{list(task.box.shape)} but holds no such piece (a bug in arrayckpt: please report it)")


def _within(found: Mapping[int, int], box: Box, array: ArrayPlan) -> dict[int, int]:
    """The checksums of the chunks lying wholly inside ``box`` (what one write item wrote)."""
    return {flat: found[flat] for flat, cell in grid_cells(box, array.outer_chunk, array.shape)
            if flat in found and cell.intersect(box) == cell}
