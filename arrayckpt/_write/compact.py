"""``compact``: materialise a delta chain into one standalone full checkpoint, bit for bit.

Every array is read through the chain (as ``load`` would read it) and written whole, in batches of bounded
size; plain values, per-rank entries, aliases and pickled values (as bytes, never unpickled) are carried over;
the new checkpoint has no base. Each tensor keeps the compression of the array it was stored in.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._format.codecs import Codec, CodecChoice, codec_of_metadata, resolve_codec
from .._format.dtypes import dtype_by_name
from .._format.jsontypes import JSON, json_object
from .._format.manifest import FILES_VERSION, ArrayEntry, Entry, Manifest, PerRankEntry, PickleEntry, per_rank_path
from .._io.arrays import ArrayIO, Checksums, array_spec, write_all
from .._layout.box import Box
from .._layout.chunking import ArrayPlan, plan_array
from .._layout.digests import chunk_digests
from .._layout.saveplan import documents_of
from .._read.chain import dense_metadata
from .._read.checkpoint import Checkpoint, opened, stored_of
from .._read.reader import ChainRead, Request, read
from .._read.stored import StoredCheckpoint
from .._settings import settings
from .._storage import parse_location
from .transaction import begin_write

__all__ = ["CompactResult", "compact"]



@dataclass(frozen=True)
class CompactResult:
    """What :func:`compact` did.

    Attributes:
        source: the checkpoint compacted.
        destination: the full checkpoint written.
        chain: the source's chain, newest first (the source, then its bases).
        arrays: how many arrays were written.
        bytes_written: their stored bytes.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
            >>> d = tempfile.mkdtemp()
            >>> arrayckpt.save({"w": torch.ones(4)}, f"{d}/a")
            >>> result = arrayckpt.compact(f"{d}/a", f"{d}/b")
            >>> result.arrays, len(result.chain)
            (1, 1)
    """

    source: str
    destination: str
    chain: tuple[str, ...]
    arrays: int
    bytes_written: int

    def to_dict(self) -> JSON:
        return {"source": self.source, "destination": self.destination, "chain": list(self.chain),
                "arrays": self.arrays, "bytes_written": self.bytes_written}


_KEEP = object()


def compact(src: str | os.PathLike[str] | Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
            codec: CodecChoice | object = _KEEP, storage_options: Mapping[str, Any] | None = None,
            progress: Callable[[int, int], None] | None = None,
            base_roots: Sequence[str | os.PathLike[str]] | None = None) -> CompactResult:
    """Write the checkpoint at ``src`` (a delta chain, or a full checkpoint) as a full checkpoint at ``dst``.

    Loading ``dst`` gives exactly what loading ``src`` gives.

    Args:
        src: a checkpoint's directory or URL, or an open :class:`Checkpoint`.
        dst: where to write the full checkpoint; it may be on other storage than ``src`` (e.g. compact an S3 chain
            to a local directory).
        overwrite: replace a committed checkpoint at ``dst``.
        codec: overrides the compression, as for :func:`arrayckpt.save` (default: each tensor keeps its own).
        storage_options: for object storage (both ends), as for :func:`arrayckpt.save`.
        progress: called as ``progress(bytes done, bytes in all)``.
        base_roots: where bases may be besides the directory holding each checkpoint of the chain (as for
            :func:`arrayckpt.open`).

    Returns:
        What was written.

    Raises:
        CheckpointNotFoundError: nothing is at ``src``.
        CheckpointExistsError: a committed checkpoint is at ``dst`` and ``overwrite`` was not given.
        CorruptCheckpointError: stored bytes of the chain are damaged or missing (nothing is committed).
        BaseNotAllowedError: a base is outside its delta's directory and ``base_roots``.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> w = torch.zeros(4, 3)
        >>> arrayckpt.save({"w": w}, f"{d}/base")
        >>> w[1] = 1.0
        >>> arrayckpt.save({"w": w}, f"{d}/delta", base=f"{d}/base")
        >>> arrayckpt.compact(f"{d}/delta", f"{d}/full").chain == (f"{d}/delta", f"{d}/base")
        True
        >>> with arrayckpt.open(f"{d}/full") as full: full["w"][1].tolist(), full.manifest.base is None
        ([1.0, 1.0, 1.0], True)
    """
    with opened(src, storage_options=storage_options, base_roots=base_roots) as checkpoint:  # one passed in stays open
        return _compact(checkpoint, dst, overwrite, codec, storage_options, progress)


def _compact(checkpoint: Checkpoint, dst: str | os.PathLike[str], overwrite: bool, codec: CodecChoice | object,
             storage_options: Mapping[str, Any] | None, progress: Callable[[int, int], None] | None) -> CompactResult:
    chain = checkpoint.chain()  # every base opened and checked before anything is written
    with begin_write(parse_location(dst, storage_options), overwrite) as transaction:
        entries, arrays, sources = _plan(stored_of(checkpoint), codec, transaction.key_encoding)
        documents, consolidated = documents_of(arrays)
        transaction.write_documents(documents)
        written, checksums = _copy(stored_of(checkpoint), arrays, sources, transaction.target, progress)
        created = dict(checkpoint.manifest.created) | {"compacted_from": str(checkpoint.location)}
        manifest = Manifest(entries=entries, step=checkpoint.manifest.step, containers=checkpoint.manifest.containers,
                            created=created, format_version=FILES_VERSION, metrics=checkpoint.manifest.metrics,
                            id=uuid.uuid4().hex, base=None, stored_bytes=written,
                            chunk_digests=chunk_digests(arrays, entries, checksums, str(transaction.location)))
        transaction.commit(manifest, consolidated)
    return CompactResult(str(checkpoint.location), str(transaction.location), tuple(str(c.location) for c in chain),
                         len(arrays), written)


Source = Callable[[np.ndarray], Request]  # how to read one array of the new checkpoint from the source, into memory


def _plan(checkpoint: StoredCheckpoint, codec: CodecChoice | object, encoding: str,
          ) -> tuple[dict[str, Entry], dict[str, ArrayPlan], dict[str, Source]]:
    """The full checkpoint's entries and array plans, and for each array how to read its data from ``src``."""
    entries: dict[str, Entry] = {}
    arrays: dict[str, ArrayPlan] = {}
    sources: dict[str, Source] = {}
    named_by: dict[str, tuple[str, ...]] = {}  # a tensor's aliases, listed in its array's attributes
    for alias, target in checkpoint.manifest.aliases.items():
        named_by[target] = (*named_by.get(target, ()), alias)

    def add(key: str, path: str, dtype_name: str, shape: tuple[int, ...], kept: Codec, source: Source) -> None:
        chosen = kept if codec is _KEEP else resolve_codec(codec, key)  # type: ignore[arg-type]
        plan = plan_array(key, path, dtype_by_name(dtype_name), shape, chosen)
        arrays[path] = dataclasses.replace(plan, key_encoding=encoding, aliases=named_by.get(key, ()))
        sources[path] = source

    for key, entry in checkpoint.manifest.entries.items():
        if isinstance(entry, ArrayEntry):
            entries[key] = dataclasses.replace(entry, delta=None)
            kept = codec_of_metadata(dense_metadata(checkpoint, key))
            add(key, entry.path, entry.dtype.name, entry.shape, kept, _chain_source(key, entry.shape))
        elif isinstance(entry, PickleEntry):
            entries[key] = entry
            add(key, entry.path, "uint8", (entry.nbytes,), Codec(), _spec_source(key, checkpoint.pickle_spec(key)))
        elif isinstance(entry, PerRankEntry):
            entries[key] = entry
            for rank, item in enumerate(entry.items):
                if isinstance(item, ArrayEntry):
                    spec = checkpoint.per_rank_spec(key, rank)
                    codec = codec_of_metadata(json_object(spec.get("metadata")))
                    add(key, per_rank_path(key, rank), item.dtype.name, item.shape, codec, _spec_source(key, spec))
        else:
            entries[key] = entry
    return entries, arrays, sources


def _chain_source(key: str, shape: tuple[int, ...]) -> Source:
    return lambda out: ChainRead(key, Box.whole(shape), out)


def _spec_source(key: str, spec: JSON) -> Source:
    return lambda out: ArrayIO(key, spec, out)


def _copy(checkpoint: StoredCheckpoint, arrays: dict[str, ArrayPlan], sources: dict[str, Source], target: Any,
          progress: Callable[[int, int], None] | None) -> tuple[int, Checksums]:
    """Read and write every array in batches of at most ``compact_batch_bytes`` (``_settings.py``; one array if bigger).
    Each batch is read through the read path, which refuses a source replaced before the batch was read: nothing is
    committed then. Returns the bytes copied and the checksums of the chunks written."""
    total = sum(a.dtype.itemsize * int(np.prod(a.shape, dtype=np.int64)) for a in arrays.values())
    done = 0
    batch: list[tuple[ArrayPlan, np.ndarray]] = []
    held = 0
    context = target.write_context()
    checksums: Checksums = {}

    def copy_batch() -> None:
        nonlocal done, held
        read(checkpoint, [sources[plan.path](data) for plan, data in batch])
        checksums.update(write_all([ArrayIO(p.key, array_spec(target.kvstore(p.path), p.metadata), d, None, p.path)
                                    for p, d in batch], context, str(target)))
        done += held
        held = 0
        batch.clear()
        if progress is not None:
            progress(done, total)

    for plan in arrays.values():
        data = np.empty(plan.shape, plan.dtype.numpy)
        batch.append((plan, data))
        held += data.nbytes
        if held >= settings().compact_batch_bytes:
            copy_batch()
    if batch:
        copy_batch()
    return done, checksums
