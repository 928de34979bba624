"""``verify``: read every stored byte of a checkpoint and report all the damage found, not just the first.

Loading already refuses damaged data, but only for what it reads, and stops at the first problem. Before
deleting the previous checkpoint, or after copying one between storage systems, you want every chunk of
every array read and its crc32c checked, and a list of *everything* that is wrong, named by entry and
chunk file. Pickled values are checked as bytes and never unpickled. Memory stays bounded: chunks are
taken lazily from each grid and read in batches of at most ``batch_bytes`` and ``BATCH_CHUNKS`` (a single chunk
larger than that is read alone), and an array with more than ``MAX_ARRAY_DAMAGE`` damaged chunks is left there
(one more damage says so): a crafted grid of millions of missing chunks costs a hundred reports, not millions.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from .._errors import (
    ArrayckptError,
    BaseNotAllowedError,
    CorruptCheckpointError,
    FormatError,
    IncompleteCheckpointError,
    ReplacedCheckpointError,
    StorageError,
)
from .._format.codecs import check_checksummed
from .._format.dtypes import dtype_by_name
from .._format.integrity import ChunkDigest, chunk_crc
from .._format.jsontypes import JSON, json_object
from .._format.manifest import ArrayEntry, PerRankEntry, PickleEntry, per_rank_path
from .._format.zarr import array_shape, check_array_metadata
from .._io.staged import TOKEN_PREFIX
from .._read.checkpoint import open_location, stored_of
from .._read.stored import StoredCheckpoint
from .._settings import settings
from .._storage import ROOT_METADATA, Location, parse_location, parse_roots
from .._tools.chunkwise import ChunkRef, iter_chunks, read_chunks
from .damage import Damage
from .verify_packs import check_packs, stored_range

__all__ = ["Damage", "VerifyReport", "verify"]

_STAGED = re.compile(re.escape(TOKEN_PREFIX) + r"[0-9a-f]+/[0-9]+/")  # where a read staged a packed chunk file
BATCH_CHUNKS = 4096  # and at most this many (tiny chunks: the batch's own bookkeeping stays small)
MAX_ARRAY_DAMAGE = 100  # damaged chunks reported per array; verify leaves the array there (saying so)

Progress = Callable[[int, int], None]  # (bytes checked so far, bytes to check)


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` checked and every problem it found; ``ok`` when there were none.

    Attributes:
        path: the checkpoint verified.
        damage: every problem found.
        arrays: how many arrays were checked.
        chunks: how many chunks were checked.
        bytes_checked: their stored bytes.
        damaged_keys: the keys with damage.
        unprotected: what could not be checked because the checkpoint (or a base) predates the checksums (format
            version < 3).

    Examples:
        >>> import arrayckpt, torch, tempfile, os, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.ones(4)}, path)
        >>> chunk = next(p for p in (path / "w").rglob("*") if p.is_file() and p.name != "zarr.json")
        >>> _ = chunk.write_bytes(b"garbage")
        >>> report = arrayckpt.verify(path)
        >>> report.ok, report.damaged_keys, report.damage[0].key
        (False, ('w',), 'w')
    """

    path: str
    damage: tuple[Damage, ...] = ()
    arrays: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    damaged_keys: tuple[str, ...] = ()
    unprotected: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.damage

    def to_dict(self) -> JSON:
        return {"path": self.path, "ok": self.ok, "arrays": self.arrays, "chunks": self.chunks,
                "bytes_checked": self.bytes_checked, "damaged_keys": list(self.damaged_keys),
                "damage": [d.to_dict() for d in self.damage], "unprotected": list(self.unprotected)}


def verify(path: str | os.PathLike[str], *, progress: Progress | None = None,
           batch_bytes: int | None = None, storage_options: Mapping[str, Any] | None = None,
           base_roots: Sequence[str | os.PathLike[str]] | None = None) -> VerifyReport:
    """Read every chunk of every array of the checkpoint at ``path`` and check it; return all damage found.

    Checks: the commit (root ``zarr.json``) exists, parses and matches its checksum; every array's and group's
    own ``zarr.json`` is present and matches the consolidated copy (other Zarr readers need it); every chunk of
    every tensor, per-rank array and pickled value is present and passes its crc32c, and each array's chunks,
    in order, match the digest recorded at save (so swapped, misplaced or foreign chunk files are caught). A packed
    checkpoint (spec §16) has no node files: instead every pack and the index must hold exactly the bytes the manifest
    records, the index its crc32c, every array's section must be sound and no two chunks may share bytes; a damaged
    chunk is named by its chunk file, its pack and its bytes there (``_tools/verify_packs.py``).
    Checkpoints older than format version 3 have neither checksum: the report lists them as ``unprotected``
    (``ok`` says nothing about what was not checked). What says something about the data is reported, not raised
    (each damaged chunk by file, up to 100 per array: then the array's other chunks are skipped, and a damage on the
    array says so); what says nothing about it is raised.

    Args:
        path: a directory or an object-storage URL.
        progress: called as ``progress(bytes checked so far, bytes to check)``.
        batch_bytes: how many stored bytes to read per batch (default: the ``verify_batch_bytes`` setting).
        storage_options: for object storage, as for :func:`arrayckpt.save`.
        base_roots: where a delta's bases may be besides the directory holding it (as for :func:`arrayckpt.open`).

    Returns:
        What was checked and every damage found; ``report.ok`` when there was none.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        StorageError: storage cannot be read at all (its retries used up, access refused).
        ReplacedCheckpointError: the checkpoint (or a base) was replaced or removed while it was being verified.
        BaseNotAllowedError: a base is outside the directory holding its delta and outside ``base_roots``
            (spec §10.1).

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.ones(4, 4), "step": 1}, path)
        >>> report = arrayckpt.verify(path)
        >>> report.ok, report.arrays, report.bytes_checked
        (True, 1, 64)
    """
    location = parse_location(path, storage_options)
    where = str(location)
    try:
        checkpoint = open_location(location, base_roots=parse_roots(base_roots, storage_options))
    except (IncompleteCheckpointError, CorruptCheckpointError, FormatError) as e:
        return VerifyReport(where, (Damage(None, ROOT_METADATA, _short(str(e), where)),))
    with checkpoint:  # closing it closes the bases the layer walk opened
        budget = settings().verify_batch_bytes if batch_bytes is None else batch_bytes
        return _verify_chain(stored_of(checkpoint), where, budget, progress)


def _verify_chain(checkpoint: StoredCheckpoint, where: str, batch_bytes: int,
                  progress: Progress | None) -> VerifyReport:
    """The checks of :func:`verify` on the opened checkpoint and every base of its chain."""
    damage: list[Damage] = []
    unprotected: list[str] = []
    arrays = chunks = checked = 0
    layer: StoredCheckpoint | None = checkpoint
    while layer is not None:  # a delta checkpoint is only as good as its chain of bases: check them all
        prefix = "" if layer is checkpoint else f"{layer.location}: "
        found: list[Damage] = []
        counts = _verify_layer(layer, found, batch_bytes, progress)
        arrays, chunks, checked = arrays + counts[0], chunks + counts[1], checked + counts[2]
        damage.extend(dataclasses.replace(d, file=prefix + d.file) for d in found)
        unprotected.extend(prefix + u for u in _unprotected(layer))
        layer = _next_layer(layer, damage)
    keys = tuple(dict.fromkeys(d.key for d in damage if d.key is not None))
    return VerifyReport(where, tuple(damage), arrays, chunks, checked, keys, tuple(unprotected))


def _unprotected(layer: StoredCheckpoint) -> list[str]:
    """What this checkpoint's format version leaves unchecked (nothing from version 3 on)."""
    manifest = layer.manifest
    out = []
    if manifest.integrity is None:
        out.append(f"{ROOT_METADATA}: no checksum (format version {manifest.format_version}): a changed plain value, "
                   "step or metric cannot be detected")
    if not manifest.chunk_digests:
        out.append(f"chunks: no chunk digests (format version {manifest.format_version}): swapped or misplaced chunk "
                   "files cannot be detected")
    return out


def _next_layer(layer: StoredCheckpoint, damage: list[Damage]) -> StoredCheckpoint | None:
    """The base of a delta checkpoint (``None`` for a full one, or when the base is unreadable: damage)."""
    if layer.manifest.base is None:
        return None
    try:
        return layer.base
    except BaseNotAllowedError:  # not damage: the caller has to say whether the base may be read
        raise
    except ArrayckptError as e:
        damage.append(Damage(None, f"{layer.manifest.base.path} (base)", _short(str(e), str(layer.location))))
        return None


def _verify_layer(checkpoint: StoredCheckpoint, damage: list[Damage], batch_bytes: int,
                  progress: Progress | None) -> tuple[int, int, int]:
    """Check one checkpoint's own node files and chunks: (arrays, chunks, bytes checked)."""
    location, nodes = checkpoint.location, checkpoint.nodes
    stored: list[tuple[str, str, JSON]] = []  # one item per array (the manifest's size), never per chunk
    packed = checkpoint.packed
    for key, array_path, spec in _arrays(checkpoint, nodes, damage):
        stored.append((key, array_path, spec))
        if packed is None:  # a packed checkpoint has no node documents (spec §16.1): its nodes are the manifest's
            damage.extend(_check_node_file(location, key, array_path, nodes[array_path]))
    groups = sorted(p for p, doc in nodes.items() if isinstance(doc, dict) and doc.get("node_type") == "group")
    for group_path in groups if packed is None else ():
        damage.extend(_check_node_file(location, None, group_path, nodes[group_path]))
    failed: dict[str, int] = {}  # damaged chunks by array path
    if packed is not None:  # its packs and index: sizes, checksum, sections, no chunks of two arrays overlapping
        found = check_packs(packed, [(key, path) for key, path, _ in stored], nodes, batch_bytes, MAX_ARRAY_DAMAGE)
        damage.extend(found.damage)
        failed.update(found.failed)
    total = sum(_stored_bytes(checkpoint, *array) for array in stored if failed.get(array[1], 0) < MAX_ARRAY_DAMAGE)
    chunks = _walk(checkpoint, stored, failed)
    digests: dict[str, ChunkDigest] = {}
    count, checked = _read_all(checkpoint, chunks, total, batch_bytes, damage, progress, digests, failed)
    recorded = checkpoint.manifest.chunk_digests
    for key, array_path, _ in stored:
        expected = recorded.get(array_path)
        if expected is None or array_path in failed:  # unprotected (older version), or its damage already reported
            continue
        if digests.get(array_path, ChunkDigest()).value != expected:
            damage.append(Damage(key, array_path, "its chunk files do not hold the chunks saved there (each passes "
                                                  "its own checksum, but their contents do not match the digest "
                                                  "recorded at save): chunk files swapped, misplaced or copied from "
                                                  "another checkpoint; restore the array from a copy"))
    return len(stored), count, checked


def _walk(checkpoint: StoredCheckpoint, stored: list[tuple[str, str, JSON]],
          failed: Mapping[str, int]) -> Iterator[ChunkRef]:
    """The chunks of every array, lazily, leaving an array once ``MAX_ARRAY_DAMAGE`` of its chunks were found
    damaged (``failed``, filled in as the chunks are read): a crafted grid of millions of missing chunks costs a
    hundred reports and reads, not millions."""
    for key, array_path, spec in stored:
        for chunk in _present_chunks(checkpoint, key, array_path, spec):
            if failed.get(array_path, 0) >= MAX_ARRAY_DAMAGE:
                break
            yield chunk


def _delta_present(checkpoint: StoredCheckpoint, key: str, array_path: str) -> frozenset[int] | None:
    """The flat indices of the chunks a chunks delta stores for this array (``None``: it stores all of them)."""
    entry = checkpoint.manifest.entries.get(key)
    if isinstance(entry, ArrayEntry) and entry.delta is not None and entry.delta.mode == "chunks" \
            and array_path == entry.path:
        return checkpoint.present_chunks(key)
    return None


def _present_chunks(checkpoint: StoredCheckpoint, key: str, array_path: str,
                    spec: JSON) -> Iterator[ChunkRef]:
    """The chunks an array stores, lazily: all of them, except in a chunks delta (only the changed ones)."""
    present = _delta_present(checkpoint, key, array_path)
    if present is None:
        return iter_chunks(key, array_path, spec)
    return iter_chunks(key, array_path, spec, sorted(present))


def _stored_bytes(checkpoint: StoredCheckpoint, key: str, array_path: str, spec: JSON) -> int:
    """The bytes :func:`_present_chunks` yields, computed without listing the chunks of a full array."""
    present = _delta_present(checkpoint, key, array_path)
    if present is None:
        metadata = json_object(spec.get("metadata"))
        return math.prod(array_shape(metadata)) * dtype_by_name(metadata.get("data_type")).itemsize
    return sum(chunk.nbytes for chunk in _present_chunks(checkpoint, key, array_path, spec))


def _arrays(checkpoint: StoredCheckpoint, nodes: Mapping[str, JSON],
            damage: list[Damage]) -> Iterator[tuple[str, str, JSON]]:
    """(key, array path, spec) of every stored array: tensors, per-rank arrays and pickled values."""
    location = checkpoint.location
    for key, entry in checkpoint.manifest.entries.items():
        if isinstance(entry, ArrayEntry) and entry.delta is not None and entry.delta.mode == "rows":
            names = ("rows", "values") if entry.delta.quantized is None else ("rows", "codes", "scale", "offset")
            for name in names:
                try:
                    yield key, f"{entry.path}/{name}", checkpoint.rows_delta_spec(entry, name)
                except ArrayckptError as e:
                    damage.append(Damage(key, f"{entry.path}/{name}/{ROOT_METADATA}", _short(str(e), str(location))))
        elif isinstance(entry, ArrayEntry):
            try:
                spec = checkpoint.read_spec(key)
            except ArrayckptError as e:  # e.g. its directory is a link (spec §12): damage, reported
                damage.append(Damage(key, entry.path, _short(str(e), str(location))))
                continue
            yield key, entry.path, spec
        elif isinstance(entry, PerRankEntry):
            for rank, item in enumerate(entry.items):
                if isinstance(item, ArrayEntry):
                    try:
                        spec = checkpoint.per_rank_spec(key, rank)
                    except (ArrayckptError, KeyError) as e:
                        damage.append(Damage(key, f"{per_rank_path(key, rank)}/{ROOT_METADATA}",
                                             _short(str(e), str(location))))
                        continue
                    yield key, per_rank_path(key, rank), spec
        elif isinstance(entry, PickleEntry):
            metadata = nodes.get(entry.path)
            problem = _pickle_metadata_problem(metadata, entry)
            if problem is None:
                try:
                    spec = checkpoint.pickle_spec(key)
                except ArrayckptError as e:
                    problem = _short(str(e), str(location))
            if problem:
                damage.append(Damage(key, f"{entry.path}/{ROOT_METADATA}", problem))
                continue
            yield key, entry.path, spec


def _pickle_metadata_problem(metadata: object, entry: PickleEntry) -> str | None:
    """Why a pickle entry's array metadata is unusable (``None`` when it is fine): checked like every array's."""
    try:
        check_array_metadata(metadata, (entry.nbytes,), "uint8", f"pickled value {entry.key!r}")
        check_checksummed(cast("dict[str, Any]", metadata), entry.key)  # a dict: checked just above
    except FormatError as e:
        return str(e)
    return None


def _check_node_file(location: Location, key: str | None, node_path: str,
                     document: JSON) -> list[Damage]:
    """A node's own ``zarr.json`` must exist and agree with the consolidated copy in the root document."""
    file = f"{node_path}/{ROOT_METADATA}"
    try:
        data = location.node_document(node_path)
        if data is None:
            return [Damage(key, file, "node metadata file is missing (Zarr readers that do not use the root's "
                                      "consolidated metadata cannot open this node)")]
        stored = json.loads(data)
    except StorageError:  # the store cannot be reached: nothing is known about the file
        raise
    except (OSError, ValueError, RecursionError, ArrayckptError) as e:
        return [Damage(key, file, f"node metadata file is unreadable: {e}")]
    if stored != document:
        return [Damage(key, file, "node metadata file differs from the root's consolidated metadata")]
    return []


def _batches(chunks: Iterable[ChunkRef], budget: int) -> Iterator[list[ChunkRef]]:
    """Consecutive runs of at most ``BATCH_CHUNKS`` chunks and ``budget`` bytes (a bigger chunk is a batch of its
    own)."""
    batch: list[ChunkRef] = []
    size = 0
    for chunk in chunks:
        if batch and (size + chunk.nbytes > budget or len(batch) >= BATCH_CHUNKS):
            yield batch
            batch, size = [], 0
        batch.append(chunk)
        size += chunk.nbytes
    if batch:
        yield batch


def _read_all(checkpoint: StoredCheckpoint, chunks: Iterable[ChunkRef], total: int, budget: int, damage: list[Damage],
              progress: Progress | None, digests: dict[str, ChunkDigest], failed: dict[str, int]) -> tuple[int, int]:
    """Read every chunk (batched for speed, taken lazily: memory is bounded by the batch, whatever the number of
    chunks) and add its content's checksum to its array's digest; a failed batch is re-read chunk by chunk to name
    each damage (counted in ``failed`` by array; past ``MAX_ARRAY_DAMAGE`` the array's other chunks are skipped,
    said in one more damage). Returns (chunks, bytes) read."""
    where = str(checkpoint.location)
    done = count = 0
    for batch in _batches(chunks, budget):
        if not _read_batch(checkpoint, batch, digests):
            # re-read outside the handler: a live exception keeps the failed batch's buffers alive
            batch = [chunk for chunk in batch if _read_alone(checkpoint, chunk, where, damage, digests, failed)]
        count += len(batch)
        done += sum(c.nbytes for c in batch)
        if progress is not None:
            progress(done, total)
    return count, done


def _read_alone(checkpoint: StoredCheckpoint, chunk: ChunkRef, where: str, damage: list[Damage],
                digests: dict[str, ChunkDigest], failed: dict[str, int]) -> bool:
    """Read one chunk of a failed batch, reporting its damage; False when it was skipped, its array having too
    much damage already."""
    if failed.get(chunk.array_path, 0) >= MAX_ARRAY_DAMAGE:
        return False
    try:
        data = read_chunks(checkpoint, [chunk])[0]
    except (StorageError, ReplacedCheckpointError, MemoryError):
        raise  # unreachable store, checkpoint replaced, no memory: nothing is known about the chunk
    except Exception as e:  # every other failure is reported, whatever raised it
        problem = _short(str(e), where, chunk.key)
        stored = stored_range(checkpoint.packed, chunk) if checkpoint.packed is not None else None
        if stored is not None and "bytes [" not in problem:  # name the pack and the bytes (unless the error did)
            problem = f"{problem} (its chunk file: {stored})"
        damage.append(Damage(chunk.key, chunk.file, problem))
        failed[chunk.array_path] = failed.get(chunk.array_path, 0) + 1
        if failed[chunk.array_path] == MAX_ARRAY_DAMAGE:
            damage.append(Damage(chunk.key, chunk.array_path, f"{MAX_ARRAY_DAMAGE} damaged chunks found: verify "
                                 "stopped reading this array there (its other chunks were not checked); restore "
                                 "the array from a copy"))
    else:
        digests.setdefault(chunk.array_path, ChunkDigest()).add(chunk_crc(data))
        del data
    return True


def _read_batch(checkpoint: StoredCheckpoint, batch: list[ChunkRef], digests: dict[str, ChunkDigest]) -> bool:
    """Read ``batch`` and add its chunks' checksums to ``digests``; False (nothing added) when any read failed.
    The buffers are freed on return, so the next batch never coexists with this one."""
    try:
        read = read_chunks(checkpoint, batch)
    except Exception:
        return False
    for chunk, data in zip(batch, read, strict=True):
        digests.setdefault(chunk.array_path, ChunkDigest()).add(chunk_crc(data))
    return True


def _short(message: str, where: str, key: str | None = None) -> str:
    """An error message without the location and key prefixes the report already shows (and, for a packed
    checkpoint, without the staging prefix of TensorStore's own messages: the chunk file's key is what it names)."""
    message = _STAGED.sub("", message.removeprefix(f"{where}: "))
    if key is not None:
        message = message.removeprefix(f"tensor {key!r}: ").removeprefix("read failed: ")
    return message.strip()
