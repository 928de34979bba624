"""``save``: describe, plan on the coordinator, write every rank's chunks concurrently, commit last.

Call order (every rank calls ``save`` with its own state)::

    each rank:    walk state -> LocalDescription (metadata only)      gather ->
    coordinator:  validate + plan (SavePlan), create temp dir, write array/group metadata
                                                                  <- broadcast plan
    each rank:    write its WriteTasks (TensorStore, concurrently)    gather results ->
    coordinator:  commit (root zarr.json written last) or abort   <- broadcast outcome

Four collectives per save whatever the number of tensors; none with one process. A failure on any
rank, at any stage, is raised on every rank and nothing is committed.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .._errors import ArrayckptError, CollectiveError, FormatError, PickleNotAllowedError, StateError, StorageError
from .._format.codecs import CodecChoice
from .._format.dtypes import DType, dtype_of_numpy
from .._format.keys import array_path
from .._format.manifest import (
    FORMAT_VERSION,
    MAX_NDIM,
    PLAIN_VERSION,
    ArrayEntry,
    Manifest,
    ValueEntry,
    encode_root_document,
    parse_metrics,
    per_rank_path,
)
from .._format.values import NotJSONable, encode_value
from .._io.arrays import ArrayIO, array_spec, collector_paused, write_all
from .._layout.box import Box
from .._layout.delta import PieceChange, RowsTask, base_ref, plan_delta, stored_bytes
from .._layout.saveplan import ArrayDescription, LocalDescription, SavePlan, plan_save, with_key_encoding
from .._storage.local import Location, Writer, finish_rank_writes, open_writer, parse_location
from .._torch.dist import Group, resolve_group
from .._torch.dtypes import dtype_of_torch
from .._torch.shards import PerRank, Shard, local_piece
from .._torch.state import walk
from .._torch.tensors import readable_numpy
from .changes import DeltaRequest, Reference, chunk_jobs, find_changes, rows_jobs

__all__ = ["save"]

PICKLE_PROTOCOL = 5


@dataclass
class _Local:
    """One rank's description plus the host data behind it (which never leaves the rank)."""

    description: LocalDescription
    data: dict[str, tuple[Box, np.ndarray]]  # by array path: the box this rank holds and its host view


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
    record = check_record(step, metrics)
    group = resolve_group(process_group)
    location = parse_location(path, storage_options)
    delta = open_delta(base, location, changed_rows, quantize, storage_options)
    with collector_paused():
        local, error = _attempt(lambda: describe_local(state, group.rank, allow_pickle, host_view))
        finish_save(local, error, group, location, codec, overwrite, record, delta)


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


def host_view(key: str, path: str, value: torch.Tensor | np.ndarray, dt: DType) -> np.ndarray:
    """How a synchronous save reaches array data: the memory itself (a copy only off the CPU)."""
    return readable_numpy(value, dt, key) if isinstance(value, torch.Tensor) else value


def finish_save(local: _Local | None, error: BaseException | None, group: Group, location: Any,
                codec: CodecChoice, overwrite: bool, record: Record, delta: DeltaRequest | None = None,
                reference: Reference | None = None) -> str:
    """Everything after describing the local state: the collectives, the writes, the commit. Returns the
    committed checkpoint's id. ``reference(path, box)`` may give the bytes the base holds for a piece (a
    host copy kept from the save that wrote the base), spared from reading them back."""
    where = str(location)
    changes: Any = ([], {})
    if delta is not None and local is not None and error is None:
        found, error = _attempt(lambda: find_changes(local.description.arrays, local.data, delta, reference))
        changes = found or changes
    agreement = None if delta is None else (delta.ref.id, sorted(delta.quantize.items()))
    gathered = group.gather((None if local is None else local.description, error, changes[0], agreement))
    coordination: _Coordination | None = None
    message: Any = None
    if group.is_coordinator:
        message, coordination = _coordinate(gathered, codec, location, overwrite, delta)
    message = group.broadcast(message)
    if isinstance(message, BaseException):
        raise message
    plan, target = message
    assert local is not None  # a failed description was broadcast as an error above

    written, error = _attempt(lambda: _write_tasks(plan, group.rank, local, target, where, changes, delta))
    try:
        results = group.gather((error, written or {}))
    except CollectiveError:
        if coordination is not None:  # a rank died mid-save: nothing to commit, remove what was written
            coordination.wait_for_metadata = lambda: None
            coordination.writer.abort()
        raise
    outcome: BaseException | str | None = None
    if group.is_coordinator:
        assert coordination is not None and results is not None
        outcome = _commit_or_abort(coordination, plan, results, record, group, delta)
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


@dataclass
class _Coordination:
    """What only the coordinator holds during a save."""

    writer: Writer
    wait_for_metadata: Any  # waits for the array/group zarr.json documents written in the background


def _coordinate(gathered: list | None, codec: CodecChoice, location: Any,
                overwrite: bool, delta: DeltaRequest | None) -> tuple[Any, _Coordination | None]:
    """Plan the save and prepare storage, or return the error every rank must raise."""
    assert gathered is not None
    error = _first_error([e for _, e, _, _ in gathered])
    if error is not None:
        return error, None
    agreements = {repr(a) for _, _, _, a in gathered}
    if len(agreements) > 1:
        return StateError(f"{location}: the ranks disagree on the incremental save (base checkpoint id and quantize, "
                          f"by rank: {[a for _, _, _, a in gathered]}); every rank must pass the same base= and "
                          "quantize="), None
    try:
        descriptions = [d for d, _, _, _ in gathered]
        plan = plan_save(descriptions, codec)
        if delta is not None:
            plan = plan_delta(plan, descriptions, [f for _, _, f, _ in gathered], delta)
        writer = open_writer(location, overwrite)
        plan = with_key_encoding(plan, writer.key_encoding)
    except ArrayckptError as e:
        return e, None
    return (plan, writer.target), _Coordination(writer, writer.write_documents(plan.documents))


def _write_tasks(plan: SavePlan, rank: int, local: _Local, target: Location, where: str,
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
        finish_rank_writes(target)
    return errors


def _commit_or_abort(coordination: _Coordination, plan: SavePlan, results: list, record: Record,
                     group: Group, delta: DeltaRequest | None) -> BaseException | str:
    """Commit (returning the new checkpoint's id) or abort (returning the error every rank raises)."""
    writer = coordination.writer
    error = _first_error([e for e, _ in results])
    try:
        coordination.wait_for_metadata()  # even on failure: nothing may still be writing when we abort
    except StorageError as e:
        error = error or e
    if error is None:
        try:
            manifest = build_manifest(plan, record, group.size, delta, [q for _, q in results], writer.key_encoding)
            writer.commit(encode_root_document(manifest, plan.consolidated_json))
            return str(manifest.id)
        except (OSError, ArrayckptError) as e:
            error = e if isinstance(e, ArrayckptError) else StorageError(f"{writer.location}: commit failed: {e}")
    writer.abort()
    return error


HostView = Callable[[str, str, "torch.Tensor | np.ndarray", DType], np.ndarray]


def describe_local(state: Mapping[str, Any], rank: int, allow_pickle: bool, host: HostView) -> _Local:
    """Walk the state into metadata for the coordinator and host memory of this rank's data.

    ``host(key, array path, tensor or array, dtype)`` gives the memory to write from: the data itself
    for a synchronous save (:func:`host_view`), a staged copy for an asynchronous one.
    """
    walked = walk(state)
    arrays: list[ArrayDescription] = []
    values: list[ValueEntry] = []
    per_rank: list[ValueEntry | ArrayEntry] = []
    data: dict[str, tuple[Box, np.ndarray]] = {}
    for key, leaf in walked.leaves.items():
        value = leaf.value
        if isinstance(value, PerRank):
            per_rank.append(_describe_per_rank(key, leaf.parts, value.value, rank, data, host))
        elif isinstance(value, (torch.Tensor, Shard)):
            piece = local_piece(value, key, rank)
            _check_ndim(key, piece.global_shape)
            dt = dtype_of_torch(piece.tensor.dtype, key)
            arrays.append(ArrayDescription(key, leaf.parts, "tensor", dt.name, piece.global_shape, piece.box,
                                           piece.replica_id))
            data[array_path(key)] = (piece.box, host(key, array_path(key), piece.tensor, dt))
        elif isinstance(value, np.ndarray) and (dt := dtype_of_numpy(value.dtype)) is not None:
            _check_ndim(key, value.shape)
            arrays.append(ArrayDescription(key, leaf.parts, "ndarray", dt.name, value.shape, Box.whole(value.shape),
                                           rank))
            data[array_path(key)] = (Box.whole(value.shape), host(key, array_path(key), value, dt))
        else:
            encoded = _encode(key, value, allow_pickle)
            if isinstance(encoded, np.ndarray):
                shape = encoded.shape
                arrays.append(ArrayDescription(key, leaf.parts, "pickle", "uint8", shape, Box.whole(shape), rank))
                data[array_path(key)] = (Box.whole(shape), encoded)
            else:
                values.append(ValueEntry(key, leaf.parts, encoded))
    return _Local(LocalDescription(tuple(arrays), tuple(values), tuple(per_rank), walked.containers), data)


def _describe_per_rank(key: str, parts: Any, value: Any, rank: int, data: dict,
                       host: HostView) -> ValueEntry | ArrayEntry:
    """A per-rank tensor is written by its rank as its own array; other per-rank values must be JSON."""
    if isinstance(value, torch.Tensor):
        _check_ndim(key, tuple(value.shape))
        dt = dtype_of_torch(value.dtype, key)
        path = per_rank_path(key, rank)
        data[path] = (Box.whole(tuple(value.shape)), host(key, path, value, dt))
        return ArrayEntry(key, parts, dt, tuple(value.shape), "tensor")
    try:
        return ValueEntry(key, parts, encode_value(value))
    except NotJSONable as e:
        raise StateError(f"per-rank value {key!r} of type {e} must be a tensor or a JSON-able plain value "
                         "(per-rank values are never pickled)") from None


def _check_ndim(key: str, shape: tuple[int, ...]) -> None:
    if len(shape) > MAX_NDIM:
        raise StateError(f"tensor {key!r} has {len(shape)} dimensions; at most {MAX_NDIM} can be stored")


def _encode(key: str, value: Any, allow_pickle: bool) -> Any:
    """Typed JSON for a plain value, or (with consent) its pickle as a uint8 array."""
    try:
        return encode_value(value)
    except NotJSONable as e:
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"value {key!r} of type {e} cannot be stored as JSON; convert it to plain types, or pass "
                "allow_pickle=True to pickle it (loading will then need allow_pickle=True too)"
            ) from None
    return np.frombuffer(pickle.dumps(value, protocol=PICKLE_PROTOCOL), np.uint8)


def open_delta(base: Any, location: Location, changed_rows: Mapping[str, Any] | None,
               quantize: Mapping[str, int] | None, storage_options: Mapping[str, Any] | None) -> DeltaRequest | None:
    """The delta request of a save against ``base`` (``None`` for a full save), checked before anything is
    written."""
    from .._read.checkpoint import Checkpoint, open_checkpoint

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
    version = FORMAT_VERSION if delta is not None or key_encoding != "default" else PLAIN_VERSION
    return Manifest(entries, record.step, plan.containers, created or created_info(world_size), version, record.metrics,
                    uuid.uuid4().hex, delta.ref if delta is not None else None, stored_bytes(plan))


def created_info(world_size: int) -> dict[str, Any]:
    """Provenance recorded in the manifest (informational)."""
    from .. import __version__

    return {
        "library": f"arrayckpt {__version__}",
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "world_size": world_size,
    }


