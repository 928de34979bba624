"""Reads of packed arrays (spec §16): the chunk files a read needs, fetched from their packs and staged in
TensorStore's ``memory`` kvstore under their Zarr keys, where TensorStore decodes them with the array's own spec.

A packed checkpoint's arrays have no kvstore TensorStore can open: their chunk files are byte ranges of pack files.
The read layer gives each such array a ``memory`` kvstore spec whose path starts with the token of a registered
:class:`ChunkSource` (``_read/packed.py``), which knows where each chunk lies. Before a read, :func:`staged` finds
the jobs on such specs, fetches the chunk files they touch (one ranged read per chunk, concurrent), writes them into
the read context's ``memory`` kvstore under a prefix of that read's own, and hands back the jobs re-pointed there;
the prefix is emptied when the read ends. Everything TensorStore checks on a read — codecs, crc32c, shapes,
missing chunks as errors — is unchanged; a chunk the table does not hold is an error naming it, never fill values.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .._errors import ClosedCheckpointError
from .._format.jsontypes import JSON, json_object
from .._format.zarr import array_shape, chunk_keys, grid_counts, grid_indices, outer_chunk_shape
from .shards import Part, PartialShard, fixed_inner_size, inner_chunks, inner_grid, partial_shards

if TYPE_CHECKING:
    import tensorstore as ts

    from .fastio import Locate

#: What a read wants of an array: its spec, and the part of it (``None``: all of it).
Want = tuple[JSON, "tuple[slice, ...] | None"]

__all__ = ["ChunkSource", "register", "source_of", "staged"]

TOKEN_PREFIX = "arrayckpt-packed-"  # the first path segment of a packed array's memory kvstore spec


class ChunkSource(Protocol):
    """Where a packed checkpoint's chunk files are, by array path and flat C-order grid index (``token`` names it
    in the memory kvstore specs of its arrays)."""

    token: str

    def prepare(self, paths: Sequence[str]) -> None:
        """Read what finding the chunk files of arrays ``paths`` needs (their sections of the index), at once."""
        ...

    def fetch_many(self, requests: Sequence[tuple[str, Sequence[int]]]) -> list[list[bytes]]:
        """For each ``(path, flats)``, the bytes of the chunk files of array ``path`` at those flat C-order grid
        indices, all arrays at once (each pack read in one call, whatever array its ranges are of). A chunk the source
        does not store, or whose bytes cannot be read whole, is a ``CorruptCheckpointError`` naming the checkpoint,
        the array and the chunk."""
        ...

    def fetch_parts(self, parts: Sequence[Part]) -> list[list[bytes]]:
        """For each ``(path, flat, ranges)``, the ``(offset, length)`` ranges of that chunk file of array ``path``
        (offsets within it; a range past its end is a ``CorruptCheckpointError``); ``(offset, -n)``: its last ``n``
        bytes. Parts of any arrays at once (each pack read in one call)."""
        ...

    def lengths(self, path: str, flats: Sequence[int]) -> list[int]:
        """The byte length of each chunk file of array ``path`` at those flat C-order grid indices (from the checked
        table; a chunk the source does not store is a ``CorruptCheckpointError``)."""
        ...

    def locate(self, path: str) -> Locate | None:
        """Where each chunk file of array ``path`` lies in a local pack file (for ``fastio``), or ``None`` when
        the packs are not local files."""
        ...


_SOURCES: weakref.WeakValueDictionary[str, ChunkSource] = weakref.WeakValueDictionary()
_READS = itertools.count()
_LOCK = threading.Lock()


def register(source: ChunkSource) -> None:
    """Make ``source``'s arrays readable (held weakly: a closed, collected checkpoint's reads fail)."""
    with _LOCK:
        _SOURCES[source.token] = source


def source_of(spec: JSON) -> tuple[ChunkSource, str] | None:
    """The chunk source and array path of a packed array's spec, or ``None`` for any other array; a
    :class:`ClosedCheckpointError` naming the array once its checkpoint is closed and gone."""
    kvstore = json_object(spec.get("kvstore"))
    path = kvstore.get("path")
    if kvstore.get("driver") != "memory" or not isinstance(path, str) or not path.startswith(TOKEN_PREFIX):
        return None
    token, _, node = path.rstrip("/").partition("/")
    with _LOCK:
        source = _SOURCES.get(token)
    if source is None:  # its checkpoint was closed and collected; the spec outlived it
        raise ClosedCheckpointError(f"array {node!r}: the checkpoint was closed; its data can no longer be read "
                                    "(open it again: arrayckpt.open)")
    return source, node


def _chunks_of(index: tuple[slice, ...] | None, metadata: JSON
               ) -> Iterator[tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]]]:
    """The (flat index, grid index, part of it read: per dimension ``[start, stop)`` within the chunk) of every outer
    chunk a read of ``index`` touches."""
    shape, chunks = array_shape(metadata), outer_chunk_shape(metadata)
    counts = grid_counts(metadata)
    index = index or ()
    bounds, ranges = [], []
    for d, (n, c) in enumerate(zip(shape, chunks, strict=True)):
        part = index[d] if d < len(index) else slice(None)
        start, stop = slice(part.start, part.stop).indices(n)[:2]
        if stop <= start:
            return
        bounds.append((start, stop))
        ranges.append(range(start // c, -(-stop // c)))
    for grid_index in grid_indices(ranges):
        flat = 0
        for i, count in zip(grid_index, counts, strict=True):
            flat = flat * count + i
        within = tuple((max(lo - i * c, 0), min(hi - i * c, c))
                       for (lo, hi), i, c in zip(bounds, grid_index, chunks, strict=True))
        yield flat, grid_index, within


class Staged:
    """The specs of one read's arrays, re-pointed at chunk files staged in memory (in the order of the wants);
    :meth:`release` empties the staging."""

    def __init__(self, specs: list[JSON], prefixes: list[str], context: ts.Context) -> None:
        self.specs = specs
        self._prefixes, self._context = prefixes, context

    def release(self) -> None:
        """Remove this read's staged chunk files (after the read, failed or not)."""
        if not self._prefixes:
            return
        import tensorstore as ts

        store = ts.KvStore.open({"driver": "memory"}, context=self._context).result()
        for prefix in self._prefixes:
            store.delete_range(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()  # '0' follows '/'
        self._prefixes = []


def staged(wants: Sequence[Want], context: ts.Context) -> Staged:
    """The specs of ``wants`` with the chunk files of packed arrays fetched and staged in ``context``'s memory
    kvstore (the others unchanged). The caller must :meth:`Staged.release` it once the read is over."""
    wanted: dict[tuple[int, str], _Wanted] = {}
    keys: list[tuple[int, str] | None] = []
    for spec, index in wants:
        hit = source_of(spec)
        if hit is None:
            keys.append(None)
            continue
        key = (id(hit[0]), hit[1])
        keys.append(key)
        entry = wanted.setdefault(key, _Wanted(hit[0], hit[1], spec, {}, {}))
        metadata = json_object(spec.get("metadata"))
        inner = inner_grid(metadata)
        for flat, grid_index, part in _chunks_of(index, metadata):
            entry.chunks[flat] = grid_index
            if inner is not None:
                entry.inner.setdefault(flat, set()).update(inner_chunks(part, *inner))
    if not wanted:
        return Staged([spec for spec, _ in wants], [], context)
    import tensorstore as ts

    read = next(_READS)
    store = ts.KvStore.open({"driver": "memory"}, context=context).result()
    prefixes = sorted({f"{entry.source.token}/{read}/" for entry in wanted.values()})
    specs: dict[tuple[int, str], JSON] = {}
    try:
        pending = []
        fetched = _fetch_all(list(wanted.values()))
        for key, entry in wanted.items():
            prefix = f"{entry.source.token}/{read}/{entry.path}/"
            flats = sorted(entry.chunks)
            metadata = json_object(entry.spec.get("metadata"))
            names = chunk_keys(metadata, (entry.chunks[flat] for flat in flats))
            for name, flat in zip(names, flats, strict=True):
                pending.append(store.write(prefix + name, fetched[key][flat]))
            specs[key] = {**entry.spec, "kvstore": {"driver": "memory", "path": prefix}}
        for future in pending:
            future.result()
    except BaseException:
        Staged([], prefixes, context).release()
        raise
    out = [spec if key is None else specs[key] for (spec, _), key in zip(wants, keys, strict=True)]
    return Staged(out, prefixes, context)


@dataclass(frozen=True)
class _Wanted:
    """The chunks one read needs of one packed array (flat index -> grid index)."""

    source: ChunkSource
    path: str
    spec: JSON
    chunks: dict[int, tuple[int, ...]]  # flat index -> grid index
    inner: dict[int, set[int]]  # of a sharded array: flat index -> the inner chunks read (flat within the shard)


def _fetch_all(entries: list[_Wanted]) -> dict[tuple[int, str], dict[int, bytes]]:
    """Every chunk file the entries need, by entry and flat index: whole chunk files of all arrays of one source in
    one call (each pack's ranges in one merged read: a load of hundreds of small arrays is a few requests per pack,
    not one per array); a shard of which a read needs only some inner chunks as a compact shard of only those
    (``partial_shards``, all such shards of a source together), so that a reshard reads about what it needs."""
    out: dict[tuple[int, str], dict[int, bytes]] = {}
    whole: dict[int, list[tuple[_Wanted, list[int]]]] = {}
    partial: dict[int, list[PartialShard]] = {}
    sources: dict[int, ChunkSource] = {}
    for entry in entries:
        out[(id(entry.source), entry.path)] = {}
        sources[id(entry.source)] = entry.source
        flats = sorted(entry.chunks)
        metadata = json_object(entry.spec.get("metadata"))
        inner = inner_grid(metadata)
        if inner is not None:
            count = math.prod(inner[1])
            parts = [flat for flat in flats if len(entry.inner.get(flat, ())) < count]
            lengths = entry.source.lengths(entry.path, parts) if parts else []
            shards = [(entry.path, flat, entry.inner[flat], count,
                       fixed_inner_size(metadata, entry.chunks[flat], length))
                      for flat, length in zip(parts, lengths, strict=True)]
            partial.setdefault(id(entry.source), []).extend(shards)
            flats = [flat for flat in flats if len(entry.inner.get(flat, ())) >= count]
        if flats:
            whole.setdefault(id(entry.source), []).append((entry, flats))
    for key, shards in partial.items():
        if shards:
            compact = partial_shards(sources[key].fetch_parts, shards)
            for (path, flat, *_), shard in zip(shards, compact, strict=True):
                out[(key, path)][flat] = shard
    for key, requests in whole.items():
        chunk_files = sources[key].fetch_many([(e.path, f) for e, f in requests])
        for (entry, flats), files in zip(requests, chunk_files, strict=True):
            out[(key, entry.path)].update(zip(flats, files, strict=True))
    return out


def staged_bytes(want: Want, itemsize: int) -> int:
    """About how many bytes staging ``want`` holds in memory (its chunks' decoded size: an upper bound uncompressed),
    to read packed arrays in batches of bounded memory."""
    spec, index = want
    metadata = json_object(spec.get("metadata"))
    chunk = math.prod(outer_chunk_shape(metadata)) if metadata.get("shape") else 1
    return sum(1 for _ in _chunks_of(index, metadata)) * chunk * max(1, itemsize)
