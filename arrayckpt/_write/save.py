"""``save``: describe, plan on the coordinator, write every rank's chunks concurrently, commit last.

Call order (every rank calls ``save`` with its own state)::

    each rank:    walk state -> LocalDescription (metadata only)      gather ->
    coordinator:  validate + plan (SavePlan), begin the write transaction (temp dir, array/group metadata)
                                                                  <- scatter each rank its part
    each rank:    write its WriteTasks (TensorStore, concurrently)    gather results ->
    coordinator:  commit (root zarr.json written last) or abort   <- broadcast outcome

Four collectives per save whatever the number of tensors and ranks; none with one process. A save with the
layout of the previous one sends fingerprints instead of descriptions and reuses every rank's part of the last
plan (``exchange.py``; when the coordinator cannot, one more gather and scatter ask for the descriptions).
A failure on any rank, at any stage, is raised on every rank and nothing is committed
(``_write/transaction.py``). Describing the state is ``describe.py``; everything after it is
:func:`finish_save`, shared with ``async_save``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch

from .._errors import ArrayckptError, CollectiveError, FormatError, ReplacedCheckpointError, StateError
from .._format.codecs import CodecChoice
from .._format.manifest import FILES_VERSION, PACKED_VERSION, ArrayEntry, Manifest, parse_metrics, parse_root_document
from .._format.packs import new_tag
from .._io.arrays import ArrayIO, Checksums, array_spec, collector_paused
from .._layout.delta import plan_delta, stored_bytes
from .._layout.digests import chunk_digests, chunk_writers
from .._layout.plainvalues import unsent_agree
from .._layout.plancache import PlanCache
from .._layout.rankplan import RankLayout, RankPlan, explicit_part
from .._layout.saveplan import SavePlan, assemble, plan_layout
from .._layout.tasks import RowsTask
from .._read.checkpoint import Checkpoint, open_checkpoint
from .._storage import Location, parse_location
from .._torch.dist import Group, resolve_group
from .._version import __version__
from .changes import NO_CHANGES, Changes, DeltaRequest, Reference, base_ref, chunk_jobs, find_changes, rows_jobs
from .describe import HostView, LocalState, describe_local, host_view
from .devicewrite import DeviceData, device_parts, device_view, write_batched
from .exchange import Agreement, Reply, Report, Resend, exchange, plan_cache_for
from .options import NO_SETUP, SaveOptions, SaveSetup, packed_layout
from .packed import ChunkDestination, PackReport, RankPack, chunk_destination, chunk_table, index_files
from .transaction import WriteTransaction, begin_write

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["Record", "SaveRequest", "begin_save", "build_manifest", "created_info", "finish_save", "packed_manifest",
           "save", "save_with"]

T = TypeVar("T")  # what a rank-local stage returns (``_attempt``)


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    codec: CodecChoice = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    process_group: ProcessGroup | Group | None = None,
    step: int | None = None,
    metrics: Mapping[str, float] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    base: str | os.PathLike[str] | Checkpoint | None = None,
    changed_rows: Mapping[str, torch.Tensor | np.ndarray | Sequence[int]] | None = None,
    quantize: Mapping[str, int] | None = None,
    durable: bool = True,
    packed: bool | None = None,
) -> None:
    """Save ``state`` as a checkpoint at ``path``; with several ranks, every rank calls it.

    The checkpoint becomes visible only once complete; a committed checkpoint at ``path`` is replaced only with
    ``overwrite=True``, and stays readable until the new one has committed. Every chunk carries a crc32c.

    Args:
        state: a dict of tensors (plain, DTensor, or :class:`arrayckpt.Shard`), numpy arrays, plain values (int,
            float, str, bool, None, bytes and lists/tuples/dicts of them), :class:`arrayckpt.PerRank` values and
            objects with ``state_dict()`` (modules, optimizers, schedulers), nested in dicts and lists. A plain
            value the ranks hold alike is stored once; one that differs between them (a data loader's position) is
            stored per rank, as a ``PerRank`` value is (a load at another world size then needs ``per_rank=``).
        path: a directory, or an object-storage URL (``s3://bucket/prefix``, ``gs://``, ``memory://``).
        codec: ``None`` (no compression), ``"zstd"``, ``"blosc"``, an :class:`arrayckpt.Codec`, or a per-key
            choice (``{"optim.*": "zstd"}``).
        overwrite: replace a committed checkpoint at ``path``.
        allow_pickle: store values that are not plain (pickled; loading them needs ``allow_pickle`` too).
        process_group: the ranks that save together (default: the default group, if initialised).
        step: recorded in the manifest.
        metrics: finite numbers by name (e.g. a validation loss), recorded in the manifest.
        storage_options: for object storage: ``endpoint_url``, ``region``, ``key``/``secret``/``token``, ``anon``,
            ``max_retries``, ``request_concurrency`` (else the standard AWS environment variables).
        base: the path of a committed checkpoint, or an open :class:`arrayckpt.Checkpoint`: the save is
            incremental — each tensor stores only what differs, bit for bit, from the base (nothing if unchanged,
            the changed chunks, or the changed rows, whichever is smallest) and reads fall through to the base.
            Readers follow a base beside the delta (same directory or prefix); one elsewhere is written all the
            same, with a warning that its readers will need to name its root (``base_roots``, spec §10.1). A base
            whose own chain leads elsewhere is opened from a path by those rules too: pass it opened,
            ``arrayckpt.open(path, base_roots=[...])``.
        changed_rows: with ``base``: key -> global row indices changed since the base (e.g. from an embedding's
            sparse gradient); the caller vouches the other rows are unchanged, which spares reading them back.
        quantize: with ``base``: key pattern -> 4 or 8 bits; the changed rows of matching floating-point tensors
            are stored quantized (lossy; the manifest records the largest error).
        durable: ``False`` skips the sync to disk before the commit (locally an ``fsync`` of every file written),
            as ``torch.save`` does: the commit stays atomic and a crash of the process leaves the previous
            checkpoint, but a power loss soon after may leave the committed checkpoint without its data (a load
            then names the missing or damaged chunk). Object stores are durable either way.
        packed: ``True`` writes each rank's chunk files into one pack file (object) per save, with an index (format
            version 4, spec §16): a few files whatever the number of tensors; ``False`` one file (object) per chunk
            (version 3), which every Zarr v3 reader opens directly; ``None`` (default): packed from
            ``ARRAYCKPT_PACKED_FROM_RANKS`` ranks up (2). zarr-python reads a packed checkpoint through its
            ``refs.json`` (``docs/guide/reading-without-arrayckpt.md``).

    Raises:
        CheckpointExistsError: a committed checkpoint is at ``path`` and ``overwrite`` was not given.
        StateError: a value of ``state`` cannot be saved as it is, or the ranks' shards do not cover a tensor (the
            message names the key and the fix).
        PickleNotAllowedError: a value needs pickle and ``allow_pickle`` was not given.
        CheckpointBusyError: another writer (a manager, a save in progress) holds ``path``.
        LocationError: ``path`` or ``storage_options`` cannot name a location.
        StorageError: a write failed (full disk, permissions, a store past its retries); nothing was committed.
        CollectiveError: another rank failed or hung (with several ranks).

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "step-100")
        >>> model = torch.nn.Linear(4, 2)
        >>> arrayckpt.save({"model": model, "step": 100}, path, codec={"model.*": "zstd"})
        >>> sorted(arrayckpt.open(path))
        ['model.bias', 'model.weight']
    """
    save_with(state, path, SaveOptions(codec=codec, overwrite=overwrite, allow_pickle=allow_pickle,
                                       process_group=process_group, step=step, metrics=metrics,
                                       storage_options=storage_options, base=base, changed_rows=changed_rows,
                                       quantize=quantize, durable=durable, packed=packed))


def save_with(state: Mapping[str, Any], path: str | os.PathLike[str], options: SaveOptions,
              setup: SaveSetup = NO_SETUP) -> None:
    """:func:`save` with its options as one value, and what an internal caller adds (``setup``: the chunk policy,
    a guard, a plan cache)."""
    request = begin_save(path, options, setup)
    group = resolve_group(options.process_group)
    try:
        with collector_paused():
            # a delta reads its data before writing; a DeviceData stands for its host view until its batch is copied
            host = host_view if options.base is not None else cast(HostView, device_view)
            local, error = _attempt(lambda: describe_local(state, group.rank, options.allow_pickle, host))
            finish_save(local, error, group, request)
    finally:
        request.close()


@dataclass(frozen=True)
class Record:
    """What the manifest records about the save besides the state: its step and metrics."""

    step: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)


def check_record(step: object, metrics: object) -> Record:
    """The step and metrics a save records, checked (a bad one fails the save before anything else is done)."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise StateError(f"step must be an int or None, got {step!r}")
    try:
        return Record(step, parse_metrics(metrics if metrics is not None else {}))
    except FormatError as e:
        raise StateError(str(e)) from None


@dataclass(frozen=True)
class SaveRequest:
    """A save's options, checked against its destination before anything is described or written."""

    location: Location
    options: SaveOptions
    setup: SaveSetup
    record: Record  # options.step and options.metrics, checked
    delta: DeltaRequest | None  # options.base, .changed_rows and .quantize, checked (None: a full save)

    def begin_write(self) -> WriteTransaction:
        """The coordinator's write transaction: the destination's writer when the caller brought one."""
        destination = self.setup.destination
        if destination is None:
            return begin_write(self.location, self.options.overwrite)
        return WriteTransaction(destination.open_writer(self.options.overwrite))

    def packed(self, ranks: int) -> bool:
        """Whether a save of ``ranks`` ranks is packed (spec §16): as the options say, else from
        ``packed_from_ranks`` ranks up; never where the caller brings its own destination (peer memory)."""
        if self.setup.destination is not None:
            return False
        return packed_layout(self.options.packed, ranks)

    def check_guard(self) -> None:
        """Raise (on the coordinator; the save then fails on every rank) unless the caller's guard allows the save
        to go on."""
        if self.setup.guard is not None:
            self.setup.guard()

    def close(self) -> None:
        """The save is over (committed or failed, synchronous or in the background): close the base it opened
        from a path (``delta.owned``; a :class:`Checkpoint` passed as ``base=`` stays open)."""
        if self.delta is not None:
            self.delta.close()


def begin_save(path: str | os.PathLike[str] | Location, options: SaveOptions,
               setup: SaveSetup = NO_SETUP) -> SaveRequest:
    """The first half of every save (the second is :func:`finish_save`, after the state is described; a caller
    may stage it in between, as ``async_save`` and peer-memory saves do): the step and metrics checked, where the
    save goes and, for an incremental save, its base opened and checked. The caller must
    :meth:`SaveRequest.close` it once the save is over."""
    record = check_record(options.step, options.metrics)
    location = parse_location(path, options.storage_options)
    if not options.durable:
        location = location.without_fsync()
    delta = open_delta(options.base, location, options.changed_rows, options.quantize, options.storage_options)
    return SaveRequest(location, options, setup, record, delta)


def finish_save(local: LocalState | None, error: BaseException | None, group: Group, request: SaveRequest,
                reference: Reference | None = None) -> str:
    """Everything after describing the local state: the collectives, the writes, the commit. Returns the
    committed checkpoint's id. ``reference(path, box)`` may give the bytes the base holds for a piece (a
    host copy kept from the save that wrote the base), spared from reading them back."""
    where, delta = str(request.location), request.delta
    changes: Changes = NO_CHANGES
    if delta is not None and local is not None and error is None:
        found, error = _attempt(lambda: find_changes(local.description.arrays, local.data, delta, reference,
                                                       local.description.aliases))
        changes = found or changes
    agreement: Agreement | None = None if delta is None else (delta.ref.id, sorted(delta.quantize.items()))
    plan_cache = request.setup.plan_cache or plan_cache_for(group)
    coordinator = _Coordinated()  # the coordinator's plan and write transaction, from planning to the commit

    def coordinate(reports: list[Report]) -> list[Reply | BaseException] | Resend:
        coordinator.pack_tag = new_tag() if request.packed(len(reports)) else None
        replies, coordinator.plan, coordinator.transaction = _coordinate(reports, request, plan_cache,
                                                                         coordinator.pack_tag)
        return replies

    try:
        reply = exchange(group, plan_cache, None if local is None else local.description, error, changes.pieces,
                         agreement, coordinate)
        if isinstance(reply, BaseException):
            raise reply
        assert local is not None  # a failed description was answered with an error above
        plan, transaction = coordinator.plan, coordinator.transaction

        destination = request.setup.destination
        target = reply.target if destination is None else destination.chunks
        part = reply.part
        assert isinstance(part, RankPlan)  # exchange expands this rank's part
        written, error = _attempt(lambda: _write_tasks(part, group.rank, local, target, where, changes, delta,
                                                       reply.pack_tag))
        results = group.gather((error, written or ({}, {}, None)))
        outcome: BaseException | str | None = None
        if transaction is not None:
            assert results is not None and plan is not None  # the coordinator's, set with its transaction
            outcome = _commit_or_abort(transaction, plan, results, request, group.size, coordinator.pack_tag)
        try:
            outcome = group.broadcast(outcome)
        except CollectiveError as e:
            if isinstance(outcome, str):  # the coordinator committed: the checkpoint is whole, only the news is lost
                warnings.warn(f"{where}: committed, but telling the other ranks failed ({e.__cause__ or e})",
                              RuntimeWarning, stacklevel=2)
                return outcome
            raise CollectiveError(f"{where}: rank {group.rank} could not learn whether the save committed (the "
                                  f"coordinator died or lost contact at the commit); open the checkpoint to find out "
                                  f"({e.__cause__ or e})") from e
    except BaseException:
        if coordinator.transaction is not None:  # e.g. a rank died mid-save: remove what was written (if not committed)
            coordinator.transaction.abort()
        raise
    if isinstance(outcome, BaseException):
        raise outcome
    return str(outcome)


def _attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """Run a rank-local stage; its error is returned so that every rank can raise it (no rank hangs)."""
    try:
        return fn(), None
    except Exception as e:
        try:
            pickle.dumps(e)
        except Exception:
            e = ArrayckptError(f"{type(e).__name__}: {e}")
        return None, e


def _first_error(errors: list[BaseException | None]) -> BaseException | None:
    for rank, error in enumerate(errors):
        if error is not None:
            if len(errors) > 1:
                error.args = (f"rank {rank}: {error.args[0] if error.args else error}", *error.args[1:])
            return error
    return None


@dataclass
class _Coordinated:
    """What the coordinator's planning made, for the rest of its save (None elsewhere, and until planned)."""

    plan: SavePlan | None = None
    transaction: WriteTransaction | None = None
    pack_tag: str | None = None  # a packed save's tag (spec §16.1); None: one file per chunk


def _coordinate(reports: list[Report], request: SaveRequest, plan_cache: PlanCache,
                pack_tag: str | None) -> tuple[list[Reply | BaseException] | Resend, SavePlan | None,
                                               WriteTransaction | None]:
    """Plan the save (reusing the last layout when every rank's fingerprint matches it) and begin its transaction
    (packed, with the tag ``pack_tag``):
    (every rank's reply, the plan, the transaction); or the error every rank must raise; or Resend."""
    size = len(reports)
    error = _first_error([r.error for r in reports])
    if error is not None:
        return [error] * size, None, None
    agreements = {repr(r.agreement) for r in reports}
    if len(agreements) > 1:
        return [StateError(f"{request.location}: the ranks disagree on the incremental save (base checkpoint id and "
                           f"quantize, by rank: {[r.agreement for r in reports]}); every rank must pass the same base= "
                           "and quantize=")] * size, None, None
    options, chunking = request.options, request.setup.chunking
    try:
        fingerprints = tuple(r.fingerprint or b"" for r in reports)
        layout = plan_cache.reusable(fingerprints, options.codec, chunking)
        claims = {r.plan_id for r in reports if r.description is None}  # ranks that sent no description
        if claims and (layout is None or claims != {layout.plan_id}):  # (and only the values they owned in theirs)
            return Resend(), None, None
        if claims and layout is not None and not unsent_agree(layout.values, [r.values for r in reports],
                                                              [r.unsent for r in reports]):
            plan_cache.forget_layout()  # a value now differs between ranks: plan afresh, from every rank's values
            return Resend(), None, None
        if layout is None:
            descriptions = [r.description for r in reports]
            layout = plan_layout(descriptions, fingerprints, options.codec, chunking)  # type: ignore[arg-type]
            plan_cache.keep(layout)
        plan = assemble(layout, [(r.values, r.per_rank) for r in reports])
        if request.delta is not None:
            plan = plan_delta(plan, None, [r.changes for r in reports], request.delta, chunking)
        request.check_guard()
        transaction = request.begin_write()
    except ArrayckptError as e:
        return [e] * size, None, None
    try:
        plan = plan_cache.with_key_encoding(plan, transaction.key_encoding)
        if pack_tag is None:  # a packed checkpoint has its node metadata in its root only (spec §16.1)
            transaction.write_documents(plan.documents)
        if request.delta is not None:
            parts: list[RankLayout | RankPlan | None] = [explicit_part(plan, rank) for rank in range(size)]
        else:
            every = plan_cache.rank_layouts(layout)
            parts = [None if r.plan_id == layout.plan_id else every[rank] for rank, r in enumerate(reports)]
        replies: list[Reply | BaseException] = [Reply(layout.plan_id, part, transaction.target,
                                                      transaction.key_encoding, pack_tag) for part in parts]
    except BaseException:
        transaction.abort()
        raise
    return replies, plan, transaction


Written = tuple[dict[str, float], Checksums, PackReport | None]  # what a rank reports (``_write_tasks``)


def _write_tasks(part: RankPlan, rank: int, local: LocalState, target: Location, where: str,
                 changes: Changes, delta: DeltaRequest | None, pack_tag: str | None) -> Written:
    """Write this rank's share: each task is a box of one array, cut from this rank's local piece (for a
    delta, only its changed chunks, or its changed rows). Returns the quantization error by key, the
    checksums of the chunks written and, for a packed save, where they lie in this rank's pack."""
    destination = chunk_destination(target, None if pack_tag is None else RankPack(target, rank, where, pack_tag))
    try:
        errors, checksums = _write_jobs(part, rank, local, target, where, changes, delta, destination)
        return errors, checksums, None if destination.pack is None else destination.pack.close()
    except BaseException:
        if destination.pack is not None:
            destination.pack.abort()
        raise


def _write_jobs(part: RankPlan, rank: int, local: LocalState, target: Location, where: str, changes: Changes,
                delta: DeltaRequest | None, destination: ChunkDestination) -> tuple[dict[str, float], Checksums]:
    """:func:`_write_tasks`' jobs, each array's chunks written to ``destination`` (one file per chunk, or its
    pack)."""
    jobs, device = [], []
    errors: dict[str, float] = {}
    found = {change.key: change for change in changes.pieces}
    for task in part.tasks:
        entry = part.entries.get(task.key)
        mode = entry.delta.mode if isinstance(entry, ArrayEntry) and entry.delta is not None else None
        held, data = local.data[task.path]
        if isinstance(task, RowsTask):
            assert delta is not None
            more, errors[task.key] = rows_jobs(task, part, data, held, changes.rows[task.key],  # type: ignore[arg-type]
                                               delta.bits(task.key), destination.kvstore)
            jobs.extend(more)
            continue
        spec = array_spec(destination.kvstore(task.path), part.arrays[task.path].metadata)
        if mode == "chunks":
            jobs.extend(chunk_jobs(task, found[task.key], spec, data, held))
            continue
        if isinstance(data, DeviceData):  # copied to the host a batch at a time, below
            outer = part.arrays[task.path].outer_chunk
            device.extend(device_parts(task.key, spec, task.path, data, held, task.box, outer[0] if outer else 0))
            continue
        jobs.append(ArrayIO(task.key, spec, data[task.box.relative_to(held)], task.box.slices(), task.path))
    write, context = destination.write, destination.context
    checksums = write_batched(jobs, device, context, where, write) if device else write(jobs, context, where)
    if rank != 0 and (jobs or device) and destination.pack is None:  # on a shared filesystem each host fsyncs its
        target.finish_rank_writes()  # writes before reporting success (a pack is synced when it is closed)
    return errors, checksums


def _commit_or_abort(transaction: WriteTransaction, plan: SavePlan, results: list[tuple[BaseException | None, Written]],
                     request: SaveRequest, world_size: int, pack_tag: str | None) -> BaseException | str:
    """Commit (returning the new checkpoint's id) or abort (returning the error every rank raises)."""
    error = _first_error([e for e, _ in results])
    if error is None:
        try:
            manifest = build_manifest(plan, request.record, world_size, request.delta,
                                      [(errors, sums) for _, (errors, sums, _) in results], str(request.location))
            if pack_tag is not None:
                manifest = packed_manifest(manifest, plan, [report for _, (_, _, report) in results], transaction,
                                           pack_tag, str(request.location))
            if request.delta is not None:
                check_bases_unchanged(request.delta, request.location)
            request.check_guard()
            transaction.commit(manifest, plan.consolidated_json)
            return str(manifest.id)
        except ArrayckptError as e:
            error = e
    transaction.abort()
    return error


def packed_manifest(manifest: Manifest, plan: SavePlan, reports: list[PackReport | None],
                    transaction: WriteTransaction, pack_tag: str, where: str) -> Manifest:
    """``manifest`` with the packs the ranks reported and the chunk table (written now, before the commit)."""
    nodes = {path: array.metadata for path, array in plan.arrays.items()}
    present = manifest.delta_chunks
    packs, table = chunk_table(nodes, present, [r or PackReport(None) for r in reports], where)
    documents = {path: data for path, data in plan.documents.items() if path}
    layout = index_files(nodes, documents, present, packs, table, pack_tag, transaction.write_file)
    return dataclasses.replace(manifest, packs=layout, format_version=PACKED_VERSION)


def check_bases_unchanged(delta: DeltaRequest, location: Location) -> None:
    """Right before a delta commits: every checkpoint of its chain of bases must still be the one opened (a
    base replaced or removed since would make the delta unreadable, and no base data may have been read to
    notice: ``changed_rows``, a kept copy). One root-document read per layer."""
    for layer in delta.base.chain():
        expected = layer.manifest.id
        try:
            now: str | None = parse_root_document(layer.location.read_root(), str(layer.location))[0].id
        except ArrayckptError as e:
            now = f"unreadable: {e}"
        if now != expected:
            what = "its base" if layer is delta.base else "a checkpoint in its chain of bases"
            raise ReplacedCheckpointError(
                f"{location}: the delta was not committed: {what} {layer.location} was replaced or removed after it "
                f"was opened (the delta was saved against id {expected}, the id there now is {now}), so the delta "
                "could never be read; save again against the checkpoint there now, or as a full checkpoint")


def open_delta(base: str | os.PathLike[str] | Checkpoint | None, location: Location,
               changed_rows: Mapping[str, torch.Tensor | np.ndarray | Sequence[int]] | None,
               quantize: Mapping[str, int] | None, storage_options: Mapping[str, Any] | None) -> DeltaRequest | None:
    """The delta request of a save against ``base`` (``None`` for a full save), checked before anything is
    written."""
    if base is None:
        if changed_rows or quantize:
            raise StateError("changed_rows and quantize apply to incremental saves only; pass base=...")
        return None
    owned = not isinstance(base, Checkpoint)  # opened here from a path: closed when the save finishes
    checkpoint = base if isinstance(base, Checkpoint) else open_checkpoint(base, storage_options=storage_options)
    try:
        return _delta_request(checkpoint, owned, location, changed_rows, quantize)
    except BaseException:
        if owned:
            checkpoint.close()
        raise


def _delta_request(checkpoint: Checkpoint, owned: bool, location: Location,
                   changed_rows: Mapping[str, torch.Tensor | np.ndarray | Sequence[int]] | None,
                   quantize: Mapping[str, int] | None) -> DeltaRequest:
    for layer in checkpoint.chain():
        if str(layer.location) == str(location):
            raise StateError(f"{location}: this is {'the base' if layer is checkpoint else 'in the chain of bases'} "
                             f"of the delta being saved; replacing it would make the delta unreadable: save to "
                             "another path")
    rows = {}
    for key, value in (changed_rows or {}).items():
        array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise StateError(f"changed_rows[{key!r}] must be a 1-D integer tensor or array of row indices")
        rows[key] = np.unique(array.astype(np.int64))
        entry = checkpoint.manifest.array_entry(key)
        if isinstance(entry, ArrayEntry) and entry.shape and len(rows[key]) and not (
                0 <= rows[key][0] and rows[key][-1] < entry.shape[0]):
            raise StateError(f"changed_rows[{key!r}] has rows outside 0..{entry.shape[0] - 1}")
    for pattern, bits in (quantize or {}).items():
        if bits not in (4, 8):
            raise StateError(f"quantize[{pattern!r}] = {bits!r}: only 4 and 8 bits are supported")
    return DeltaRequest(checkpoint, base_ref(checkpoint, location), rows, dict(quantize or {}), owned)


def build_manifest(plan: SavePlan, record: Record, world_size: int, delta: DeltaRequest | None,
                   written: list[tuple[dict[str, float], Checksums]], where: str,
                   created: Mapping[str, object] | None = None) -> Manifest:
    """The manifest of a save that is about to commit, from what each writer reported: the quantization errors
    and the chunk checksums (the chunk digests; every stored chunk must have been reported)."""
    entries = dict(plan.entries)
    worst: dict[str, float] = {}
    reports: dict[str, list[tuple[int, Mapping[int, int]]]] = {}  # array path -> (rank, its chunks' checksums)
    for rank, (errors, sums) in enumerate(written):
        for key, value in errors.items():
            worst[key] = max(worst.get(key, 0.0), value)
        for path, found in sums.items():
            reports.setdefault(path, []).append((rank, found))
    checksums: Checksums = {path: _merged(found for _, found in by) for path, by in reports.items()}
    for key, value in worst.items():
        entry = entries[key]
        if isinstance(entry, ArrayEntry) and entry.delta is not None and entry.delta.quantized is not None:
            quantized = dataclasses.replace(entry.delta.quantized, max_abs_error=value)
            entries[key] = dataclasses.replace(entry, delta=dataclasses.replace(entry.delta, quantized=quantized))
    digests = chunk_digests(plan.arrays, entries, checksums, where)  # (refuses a chunk nobody reported)
    created = dict(created or created_info(world_size))
    if len(written) > 1:  # who wrote what, for pictures (one writer: all of it)
        created["writers"] = chunk_writers(plan.arrays, entries, reports)
    return Manifest(entries=entries, step=record.step, containers=plan.containers, created=created,
                    format_version=FILES_VERSION, metrics=record.metrics, id=uuid.uuid4().hex,
                    base=delta.ref if delta is not None else None, stored_bytes=stored_bytes(plan),
                    chunk_digests=digests)


def _merged(parts: Iterable[Mapping[int, int]]) -> dict[int, int]:
    out: dict[int, int] = {}
    for part in parts:
        out.update(part)
    return out


def created_info(world_size: int) -> dict[str, object]:
    """Provenance recorded in the manifest (informational)."""
    return {
        "library": f"arrayckpt {__version__}",
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "world_size": world_size,
    }


