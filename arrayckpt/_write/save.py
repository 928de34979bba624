"""``save``: describe, plan on the coordinator, write every rank's chunks concurrently, commit last.

Call order (every rank calls ``save`` with its own state)::

    each rank:    walk state -> LocalDescription (metadata only)      gather ->
    coordinator:  validate + plan (SavePlan), begin the write transaction (temp dir, array/group metadata)
                                                                  <- broadcast plan
    each rank:    write its WriteTasks (TensorStore, concurrently)    gather results ->
    coordinator:  commit (root zarr.json written last) or abort   <- broadcast outcome

Four collectives per save whatever the number of tensors; none with one process. A failure on any
rank, at any stage, is raised on every rank and nothing is committed (``_write/transaction.py``). Describing
the state is ``describe.py``; everything after it is :func:`finish_save`, shared with ``async_save``.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket
import uuid
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._errors import ArrayckptError, CollectiveError, FormatError, ReplacedCheckpointError, StateError
from .._format.codecs import CodecChoice
from .._format.manifest import ArrayEntry, Manifest, format_version, parse_metrics, parse_root_document
from .._io.arrays import ArrayIO, array_spec, collector_paused, write_all
from .._layout.delta import PieceChange, RowsTask, plan_delta, stored_bytes
from .._layout.saveplan import SavePlan, plan_save, with_key_encoding
from .._read.checkpoint import Checkpoint, open_checkpoint
from .._storage import Location, parse_location
from .._torch.dist import Group, resolve_group
from .._version import __version__
from .changes import DeltaRequest, Reference, base_ref, chunk_jobs, find_changes, rows_jobs
from .describe import LocalState, describe_local, host_view
from .options import SaveOptions
from .transaction import WriteTransaction, begin_write

__all__ = ["SaveRequest", "prepare", "save", "save_with"]


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    codec: CodecChoice = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    process_group: Any = None,
    step: int | None = None,
    metrics: Mapping[str, float] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    base: Any = None,
    changed_rows: Mapping[str, Any] | None = None,
    quantize: Mapping[str, int] | None = None,
) -> None:
    """Save ``state`` as a checkpoint at ``path``; with several ranks, every rank calls it.

    ``state`` is a dict of tensors (plain, DTensor, or :class:`arrayckpt.Shard`), numpy arrays, plain
    values (int, float, str, bool, None, bytes and lists/tuples/dicts of them), :class:`arrayckpt.PerRank`
    values and objects with ``state_dict()`` (modules, optimizers, schedulers), nested in dicts and
    lists. ``codec`` is ``None`` (no compression), ``"zstd"``, ``"blosc"``, an :class:`arrayckpt.Codec`,
    or a per-key choice (``{"optim.*": "zstd"}``). Every chunk carries a crc32c. The checkpoint
    becomes visible only once complete; a committed checkpoint at ``path`` is replaced only with
    ``overwrite=True``, and stays readable until the new one has committed. ``step`` and ``metrics``
    (finite numbers by name, e.g. a validation loss) are recorded in the manifest. ``path`` may be an
    object-storage URL (``s3://bucket/prefix``, ``gs://``, ``memory://``); ``storage_options`` then
    configure the client (``endpoint_url``, ``region``, ``key``/``secret``/``token``, ``anon``,
    ``max_retries``, ``request_concurrency``), else the standard AWS environment variables do.

    With ``base`` (the path of a committed checkpoint, or an open :class:`arrayckpt.Checkpoint`) the save is
    incremental: each tensor stores only what differs, bit for bit, from the base — nothing if unchanged,
    the changed chunks, or the changed rows (indices and values), whichever is smallest — and reads fall
    through to the base. Change detection reads the base back, except for keys in ``changed_rows``
    (key -> global row indices, e.g. from an embedding's sparse gradient), whose other rows the caller
    vouches are unchanged. ``quantize`` (key pattern -> 4 or 8 bits) stores the changed rows of matching
    floating-point tensors quantized (lossy; the manifest records the largest error).

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
                                       quantize=quantize))


def save_with(state: Mapping[str, Any], path: str | os.PathLike[str], options: SaveOptions) -> None:
    """:func:`save` with its options as one value (which may also choose the chunk policy)."""
    record = check_record(options.step, options.metrics)
    group = resolve_group(options.process_group)
    request = prepare(path, options, record)
    with collector_paused():
        local, error = _attempt(lambda: describe_local(state, group.rank, options.allow_pickle, host_view))
        finish_save(local, error, group, request)


@dataclass(frozen=True)
class Record:
    """What the manifest records about the save besides the state: its step and metrics."""

    step: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)


def check_record(step: object, metrics: object) -> Record:
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise StateError(f"step must be an int or None, got {step!r}")
    try:
        return Record(step, parse_metrics(metrics if metrics is not None else {}))  # type: ignore[arg-type]
    except FormatError as e:
        raise StateError(str(e)) from None


@dataclass(frozen=True)
class SaveRequest:
    """A save's options, checked against its destination before anything is described or written."""

    location: Location
    options: SaveOptions
    record: Record  # options.step and options.metrics, checked
    delta: DeltaRequest | None  # options.base, .changed_rows and .quantize, checked (None: a full save)


def prepare(path: str | os.PathLike[str], options: SaveOptions, record: Record) -> SaveRequest:
    """Where the save goes and, for an incremental save, its base opened and checked (``record`` is
    :func:`check_record` of the options, checked first by the caller so that a bad step fails before anything
    else is done)."""
    location = parse_location(path, options.storage_options)
    delta = open_delta(options.base, location, options.changed_rows, options.quantize, options.storage_options)
    return SaveRequest(location, options, record, delta)


def finish_save(local: LocalState | None, error: BaseException | None, group: Group, request: SaveRequest,
                reference: Reference | None = None) -> str:
    """Everything after describing the local state: the collectives, the writes, the commit. Returns the
    committed checkpoint's id. ``reference(path, box)`` may give the bytes the base holds for a piece (a
    host copy kept from the save that wrote the base), spared from reading them back."""
    where, delta = str(request.location), request.delta
    changes: Any = ([], {})
    if delta is not None and local is not None and error is None:
        found, error = _attempt(lambda: find_changes(local.description.arrays, local.data, delta, reference))
        changes = found or changes
    agreement = None if delta is None else (delta.ref.id, sorted(delta.quantize.items()))
    gathered = group.gather((None if local is None else local.description, error, changes[0], agreement))
    transaction: WriteTransaction | None = None  # the coordinator's, from planning to the commit
    message: Any = None
    if group.is_coordinator:
        message, transaction = _coordinate(gathered, request)
    try:
        message = group.broadcast(message)
        if isinstance(message, BaseException):
            raise message
        plan, target = message
        assert local is not None  # a failed description was broadcast as an error above

        written, error = _attempt(lambda: _write_tasks(plan, group.rank, local, target, where, changes, delta))
        results = group.gather((error, written or {}))
        outcome: BaseException | str | None = None
        if transaction is not None:
            assert results is not None
            outcome = _commit_or_abort(transaction, plan, results, request, group.size)
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
        if transaction is not None:  # e.g. a rank died mid-save: remove what was written (nothing once committed)
            transaction.abort()
        raise
    if isinstance(outcome, BaseException):
        raise outcome
    return str(outcome)


def _attempt(fn: Any) -> tuple[Any, BaseException | None]:
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


def _coordinate(gathered: list | None, request: SaveRequest) -> tuple[Any, WriteTransaction | None]:
    """Plan the save and begin its transaction, or return the error every rank must raise."""
    assert gathered is not None
    error = _first_error([e for _, e, _, _ in gathered])
    if error is not None:
        return error, None
    agreements = {repr(a) for _, _, _, a in gathered}
    if len(agreements) > 1:
        return StateError(f"{request.location}: the ranks disagree on the incremental save (base checkpoint id and "
                          f"quantize, by rank: {[a for _, _, _, a in gathered]}); every rank must pass the same base= "
                          "and quantize="), None
    options = request.options
    try:
        descriptions = [d for d, _, _, _ in gathered]
        plan = plan_save(descriptions, options.codec, options.chunking)
        if request.delta is not None:
            plan = plan_delta(plan, descriptions, [f for _, _, f, _ in gathered], request.delta, options.chunking)
        transaction = begin_write(request.location, options.overwrite)
    except ArrayckptError as e:
        return e, None
    try:
        plan = with_key_encoding(plan, transaction.key_encoding)
        transaction.write_documents(plan.documents)
    except BaseException:
        transaction.abort()
        raise
    return (plan, transaction.target), transaction


def _write_tasks(plan: SavePlan, rank: int, local: LocalState, target: Location, where: str,
                 changes: tuple[list[PieceChange], dict[str, np.ndarray]],
                 delta: DeltaRequest | None) -> dict[str, float]:
    """Write this rank's share: each task is a box of one array, cut from this rank's local piece (for a
    delta, only its changed chunks, or its changed rows). Returns the quantization error by key."""
    jobs = []
    errors: dict[str, float] = {}
    found = {change.key: change for change in changes[0]}
    for task in plan.tasks[rank]:
        entry = plan.entries[task.key]
        mode = entry.delta.mode if isinstance(entry, ArrayEntry) and entry.delta is not None else None
        held, data = local.data[task.path]
        if isinstance(task, RowsTask):
            assert delta is not None
            more, errors[task.key] = rows_jobs(task, plan, data, held, changes[1][task.key], delta.bits(task.key),
                                               target.kvstore)
            jobs.extend(more)
            continue
        spec = array_spec(target.kvstore(task.path), plan.arrays[task.path].metadata)
        if mode == "chunks":
            jobs.extend(chunk_jobs(task, found[task.key], spec, data, held))
            continue
        jobs.append(ArrayIO(task.key, spec, data[task.box.relative_to(held)], task.box.slices()))
    write_all(jobs, target.write_context(), where)
    if rank != 0 and jobs:  # on a shared filesystem each host flushes its own writes before reporting success
        target.finish_rank_writes()
    return errors


def _commit_or_abort(transaction: WriteTransaction, plan: SavePlan, results: list, request: SaveRequest,
                     world_size: int) -> BaseException | str:
    """Commit (returning the new checkpoint's id) or abort (returning the error every rank raises)."""
    error = _first_error([e for e, _ in results])
    if error is None:
        try:
            manifest = build_manifest(plan, request.record, world_size, request.delta, [q for _, q in results],
                                      transaction.key_encoding)
            if request.delta is not None:
                check_bases_unchanged(request.delta, request.location)
            transaction.commit(manifest, plan.consolidated_json)
            return str(manifest.id)
        except ArrayckptError as e:
            error = e
    transaction.abort()
    return error


def check_bases_unchanged(delta: DeltaRequest, location: Location) -> None:
    """Right before a delta commits: every checkpoint of its chain of bases must still be the one opened (a
    base replaced or removed since would make the delta unreadable, and no base data may have been read to
    notice: ``changed_rows``, a kept copy). One root-document read per layer."""
    for layer in delta.base.chain():
        expected = layer.manifest.id
        try:
            now: Any = parse_root_document(layer.location.read_root(), str(layer.location))[0].id
        except ArrayckptError as e:
            now = f"unreadable: {e}"
        if now != expected:
            what = "its base" if layer is delta.base else "a checkpoint in its chain of bases"
            raise ReplacedCheckpointError(
                f"{location}: the delta was not committed: {what} {layer.location} was replaced or removed after it "
                f"was opened (the delta was saved against id {expected}, the id there now is {now}), so the delta "
                "could never be read; save again against the checkpoint there now, or as a full checkpoint")


def open_delta(base: Any, location: Location, changed_rows: Mapping[str, Any] | None,
               quantize: Mapping[str, int] | None, storage_options: Mapping[str, Any] | None) -> DeltaRequest | None:
    """The delta request of a save against ``base`` (``None`` for a full save), checked before anything is
    written."""
    if base is None:
        if changed_rows or quantize:
            raise StateError("changed_rows and quantize apply to incremental saves only; pass base=...")
        return None
    checkpoint = base if isinstance(base, Checkpoint) else open_checkpoint(base, storage_options=storage_options)
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
        entry = checkpoint.manifest.entries.get(key)
        if isinstance(entry, ArrayEntry) and entry.shape and len(rows[key]) and not (
                0 <= rows[key][0] and rows[key][-1] < entry.shape[0]):
            raise StateError(f"changed_rows[{key!r}] has rows outside 0..{entry.shape[0] - 1}")
    for pattern, bits in (quantize or {}).items():
        if bits not in (4, 8):
            raise StateError(f"quantize[{pattern!r}] = {bits!r}: only 4 and 8 bits are supported")
    return DeltaRequest(checkpoint, base_ref(checkpoint, location), rows, dict(quantize or {}))


def build_manifest(plan: SavePlan, record: Record, world_size: int, delta: DeltaRequest | None,
                   errors: list[dict[str, float]], key_encoding: str,
                   created: dict[str, Any] | None = None) -> Manifest:
    """The manifest of a save that is about to commit: quantization errors gathered from the writers, and the
    lowest format version that describes it."""
    entries = dict(plan.entries)
    worst: dict[str, float] = {}
    for found in errors:
        for key, value in found.items():
            worst[key] = max(worst.get(key, 0.0), value)
    for key, value in worst.items():
        entry = entries[key]
        if isinstance(entry, ArrayEntry) and entry.delta is not None and entry.delta.quantized is not None:
            quantized = dataclasses.replace(entry.delta.quantized, max_abs_error=value)
            entries[key] = dataclasses.replace(entry, delta=dataclasses.replace(entry.delta, quantized=quantized))
    version = format_version(delta is not None, key_encoding)
    return Manifest(entries, record.step, plan.containers, created or created_info(world_size), version, record.metrics,
                    uuid.uuid4().hex, delta.ref if delta is not None else None, stored_bytes(plan))


def created_info(world_size: int) -> dict[str, Any]:
    """Provenance recorded in the manifest (informational)."""
    return {
        "library": f"arrayckpt {__version__}",
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "world_size": world_size,
    }


