"""Array IO through TensorStore: many arrays written or read concurrently, errors named by key.

Specs are built by pure functions (cf. Orbax ``tensorstore_utils.py``). Every array is opened with
``assume_metadata`` and the metadata arrayckpt planned or read from the root's consolidated metadata,
so opening costs no storage request. Missing chunks are errors (``fill_missing_data_reads: false``)
and chunks equal to the fill value are still written (``store_data_equal_to_fill_value: true``), so a
missing chunk can never read back as zeros.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import numpy as np

from .._errors import CorruptCheckpointError, FormatError, StorageError
from .._format.dtypes import as_typed, dtype_by_name
from .._format.integrity import chunk_crc
from .._format.jsontypes import JSON, json_object
from .._format.zarr import array_shape, chunk_key, grid_indices, outer_chunk_shape
from .._io.fastio import RowLayout, read_rows, row_layout, write_rows
from .._io.priority import worker_initializer
from .._io.smallfiles import user_paths
from .._layout.box import Box, grid_cells
from .._settings import settings
from .pools import batches
from .staged import ChunkSource, source_of, staged, staged_bytes

if TYPE_CHECKING:
    import tensorstore as ts

__all__ = ["ArrayIO", "Checksums", "LazyContext", "array_spec", "check_chunk_files", "chunk_checksums",
           "collector_paused", "open_array", "read_context", "read_into", "resolve_context", "split_rows", "typed_data",
           "write_all", "write_context"]



@contextlib.contextmanager
def collector_paused(limit_s: float | None = None) -> Iterator[None]:
    """Python's cyclic garbage collector paused for a save or load: describing, planning and reading thousands of
    tensors allocates enough objects to trigger full collections over the whole heap (measured: ~8% of a 1 GiB,
    2,186-tensor synchronous save on tmpfs). In the background thread of an asynchronous save, those collections
    hold the GIL for the whole heap walk (measured: 80-120 ms, about once per save of 818 tensors), stalling the
    training loop; paused, the save's objects die by reference counting without ever reaching the old generation.
    The loop's own cyclic garbage then waits for the end of the save. Pauses may overlap across threads (a
    synchronous load while an asynchronous save writes): the collector is enabled again when the last one ends,
    if it was enabled when the first began. ``limit_s``: this block's pause ends after that long even if the block
    has not (a background save writing to object storage for minutes must not hold back the loop's garbage that
    long; its objects are made while describing and planning, in the first seconds)."""
    token = _PAUSE.enter()
    timer = None
    if limit_s is not None:
        timer = threading.Timer(limit_s, _PAUSE.exit, (token,))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        _PAUSE.exit(token)


class _CollectorPause:
    """How many :func:`collector_paused` blocks are open, in any thread, and whether the collector was on before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._restore = False

    def enter(self) -> list[bool]:
        """Open a pause; returns its token for :meth:`exit`."""
        with self._lock:
            if self._depth == 0:
                self._restore = gc.isenabled()
                gc.disable()
            self._depth += 1
        return [True]

    def exit(self, token: list[bool]) -> None:
        """Close the pause of ``token`` (once: a second exit, e.g. by its time limit and then its block, is ignored)."""
        with self._lock:
            if not token[0]:
                return
            token[0] = False
            self._depth -= 1
            if self._depth == 0 and self._restore:
                gc.enable()


_PAUSE = _CollectorPause()


class LazyContext:
    """A TensorStore context made from ``spec`` when a transfer first needs it (:func:`resolve_context`). A save or
    load that the local fast path serves entirely never imports TensorStore, which costs about a second in a
    fresh process (with ``ml_dtypes``) — more than a small checkpoint's whole first save. Thread-safe: one
    context, however many threads ask at once."""

    def __init__(self, spec: JSON) -> None:
        self.spec = spec
        self._context: ts.Context | None = None
        self._lock = threading.Lock()

    def get(self) -> ts.Context:
        """The context (made, and TensorStore imported, on the first call)."""
        with self._lock:
            if self._context is None:
                import tensorstore as ts  # only where a transfer goes through TensorStore
                self._context = ts.Context(self.spec)
            return self._context


if TYPE_CHECKING:
    StoreContext: TypeAlias = ts.Context | LazyContext  # what a transfer is given: a context, or one made on first use


def resolve_context(context: StoreContext) -> ts.Context:
    """The TensorStore context to hand to TensorStore: a :class:`LazyContext` made now, any other as it is."""
    return context.get() if isinstance(context, LazyContext) else context


def write_context() -> LazyContext:
    """A TensorStore context for one save: no per-file fsync (one sync to disk at commit, see ``_storage``)."""
    return LazyContext({"file_io_sync": False, "file_io_concurrency": {"limit": settings().file_io_concurrency}})


def read_context() -> LazyContext:
    """A TensorStore context for reading: local files are memory-mapped, which saves one copy per chunk
    (measured ~1.7x faster loads). Committed chunk files are never modified in place, so a mapping
    cannot see a file change under it."""
    return LazyContext({"file_io_mode": {"mode": "memmap"},
                        "file_io_concurrency": {"limit": settings().file_io_concurrency}})


def array_spec(kvstore: JSON, metadata: JSON) -> JSON:
    """The zarr3 driver spec of one array whose metadata is known up front."""
    return {
        "driver": "zarr3",
        "kvstore": kvstore,
        "metadata": metadata,
        "fill_missing_data_reads": False,
        "store_data_equal_to_fill_value": True,
    }


def open_array(spec: JSON, context: StoreContext, key: str = "", where: str = "") -> ts.TensorStore:
    """Open one array for reading slices of it (metadata is assumed from the spec); in a local directory, first
    refuse a chunk file that is not a regular file (one ``scandir``, see :func:`check_chunk_files`)."""
    _check_array_directory(spec, key, where)
    return _result(_start_open(spec, context, key, where), key, where, "open")


STAT_CHUNKS = 1024  # chunk files a read checks one by one; more, and one scan of the array's directory does


def check_chunk_files(job: ArrayIO, where: str) -> None:
    """Refuse, before TensorStore reads them, chunk files of a local array that are not regular files: TensorStore's
    ``file`` kvstore would block forever opening a FIFO. One ``stat`` per chunk file the read touches (missing
    ones are left to TensorStore to report), or, when it touches more than ``STAT_CHUNKS`` (a crafted grid claims
    millions), one scan of the array's directory."""
    kvstore = json_object(job.spec.get("kvstore"))
    if kvstore.get("driver") != "file":
        return
    metadata = json_object(job.spec.get("metadata"))
    chunks = outer_chunk_shape(metadata)
    index = job.index or ()
    ranges = []
    for d, (n, c) in enumerate(zip(array_shape(metadata), chunks, strict=True)):
        part = index[d] if d < len(index) else slice(None)
        start, stop = (part, part + 1) if isinstance(part, int) else slice(part.start, part.stop).indices(n)[:2]
        if stop <= start:
            return
        ranges.append(range(start // c, -(-stop // c)))
    if math.prod(len(r) for r in ranges) > STAT_CHUNKS:  # one scandir of the array beats a stat per chunk file
        _check_array_directory(job.spec, job.key, where)
        return
    for grid_index in grid_indices(ranges):
        path = str(kvstore["path"]) + chunk_key(metadata, grid_index)
        try:
            mode = os.lstat(path).st_mode  # a link is refused, never followed (spec §12)
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise _not_regular(path, job.key, where, stat.S_ISLNK(mode))


def _check_array_directory(spec: JSON, key: str, where: str) -> None:
    """Refuse a local array whose directory holds something that is neither a file nor a directory (a FIFO in a
    chunk's place): d_type from one ``scandir``, descending only into chunk-key directories (``c/0/...``)."""
    kvstore = json_object(spec.get("kvstore"))
    if kvstore.get("driver") != "file":
        return
    pending = [str(kvstore["path"])]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except OSError:  # no directory (nothing stored): TensorStore reports the missing chunks
            continue
        for entry in entries:
            try:
                is_dir, is_file, is_link = entry.is_dir(follow_symlinks=False), \
                    entry.is_file(follow_symlinks=False), entry.is_symlink()
            except OSError:  # gone meanwhile: TensorStore reports it
                continue
            if is_dir and (entry.name == "c" or entry.name.isdigit()):
                pending.append(entry.path)
            elif not (is_dir or is_file):  # a link (never followed, spec §12), a FIFO, a device
                raise _not_regular(entry.path, key, where, is_link)


def _not_regular(path: str, key: str, where: str, link: bool = False) -> CorruptCheckpointError:
    what = "a symbolic link (arrayckpt never follows a link inside a checkpoint: one from an untrusted source " \
        "could name any file of this machine)" if link else "not a regular file (a pipe or device in its place)"
    kind = "file" if path.endswith("/zarr.json") else "chunk file"
    return CorruptCheckpointError(user_paths(f"{where}: tensor {key!r}: {kind} {path} is {what}; the checkpoint is "
                                             "damaged: restore the file from a copy"))


def _start_open(spec: JSON, context: StoreContext, key: str, where: str) -> ts.Future[ts.TensorStore]:
    """``ts.open`` checks the spec at once (raising ValueError) before returning a future: name the array."""
    try:
        import tensorstore as ts  # on first use (CLI start-up)
        return ts.open(spec, open=True, assume_metadata=True, context=resolve_context(context))
    except Exception as e:
        raise FormatError(f"{where}: tensor {key!r}: TensorStore refuses the array metadata: {e}") from e


@dataclass(frozen=True)
class ArrayIO:
    """One array transfer: the named array's spec and the host memory it goes from or to."""

    key: str
    spec: JSON
    data: np.ndarray
    index: tuple[slice, ...] | None = None  # the part of the array ``data`` covers (None: all of it)
    node: str | None = None  # writes: the array's path in the checkpoint, to report its chunks' checksums by


# Array node path -> {flat C-order index of an outer chunk: crc32c of its content} (see ``_format/integrity.py``).
Checksums = dict[str, dict[int, int]]


def _describe(error: BaseException) -> str:
    return str(error).strip() or type(error).__name__


def write_all(jobs: Sequence[ArrayIO], context: StoreContext, where: str) -> Checksums:
    """Write every array's data concurrently and wait; the source memory must stay unchanged. Returns the
    checksum of every whole outer chunk written by a job that names its ``node``, for the manifest's chunk
    digests (a chunk only partly covered by one job is not reported; the commit then refuses the save).

    Uncompressed row-chunked arrays on local disk take the fast path (``_fastio``); the rest, and
    anything the fast path declines, go through TensorStore at the same time.
    """
    split = _split_fast(jobs)
    if split[1]:
        # TensorStore's jobs checksummed while they are written (CPU only: niced in a background save)
        with ThreadPoolExecutor(1, initializer=worker_initializer()) as background:
            pending = background.submit(chunk_checksums, split[1])
            taken = _both_paths(jobs, context, where, "write", write_rows, _write_store, split)
            out = pending.result()
    else:  # all on the fast path: no thread to start
        taken, out = _both_paths(jobs, context, where, "write", write_rows, _write_store, split), {}
    done = {id(job) for job, _ in taken}
    for path, found in chunk_checksums([job for job, _ in split[0] if id(job) not in done]).items():
        out.setdefault(path, {}).update(found)  # declined by the fast path, written by TensorStore
    for job, args in taken:  # the fast path computed its chunks' checksums on its way
        if job.node is not None:
            out.setdefault(job.node, {}).update(args[-1])
    return out


def chunk_checksums(jobs: Sequence[ArrayIO]) -> Checksums:
    """The crc32c of the content of every outer chunk that lies wholly inside one job's part of its array."""
    out: Checksums = {}
    for job in jobs:
        if job.node is None:
            continue
        metadata = json_object(job.spec.get("metadata"))
        shape = tuple(array_shape(metadata))
        box = Box.whole(shape) if job.index is None else \
            Box(tuple(s.start for s in job.index), tuple(s.stop - s.start for s in job.index))
        found = out.setdefault(job.node, {})
        for flat, cell in grid_cells(box, tuple(outer_chunk_shape(metadata)), shape):
            if cell.intersect(box) == cell:
                found[flat] = chunk_crc(job.data[cell.relative_to(box)])
    return out


def _write_store(store: ts.TensorStore, job: ArrayIO) -> ts.WriteFutures:
    """Start one write. TensorStore may keep referring to the source memory instead of copying it (we wait
    before returning, so it stays unchanged), except into its in-memory kvstore, which would keep the
    reference for good: a later change to the tensor would change the "stored" chunk under its checksum."""
    keep = json_object(job.spec.get("kvstore")).get("driver") != "memory"
    return store.write(typed_data(job), can_reference_source_data_indefinitely=keep)


def read_into(jobs: Sequence[ArrayIO], context: StoreContext, where: str) -> None:
    """Read every array concurrently straight into the given (writable) memory (fast path as for writes); packed
    arrays' chunk files staged in memory first (``staged.py``), a batch of ``pack_batch_bytes`` at a time."""
    sources = [source_of(job.spec) for job in jobs]
    plain = [job for job, source in zip(jobs, sources, strict=True) if source is None]
    if plain:
        _both_paths(plain, context, where, "read", read_rows, _read_store)
    if len(plain) == len(jobs):
        return
    packed = _read_packed_rows([(job, source) for job, source in zip(jobs, sources, strict=True) if source is not None],
                               where)
    size = lambda job: staged_bytes((job.spec, job.index), job.data.itemsize)  # noqa: E731
    for batch in batches(packed, size, settings().pack_batch_bytes):
        staging = staged([(job.spec, job.index) for job in batch], resolve_context(context))
        try:
            moved = [dataclasses.replace(job, spec=spec) for job, spec in zip(batch, staging.specs, strict=True)]
            _both_paths(moved, context, where, "read", read_rows, _read_store)
        finally:
            staging.release()


def _both_paths(jobs: Sequence[ArrayIO], context: StoreContext, where: str, action: str,
                fast_path: Callable[[list[tuple], str], list[int]],
                start: Callable[[ts.TensorStore, ArrayIO], ts.WriteFutures],
                split: tuple[list[tuple[ArrayIO, tuple]], list[ArrayIO]] | None = None) -> list[tuple[ArrayIO, tuple]]:
    """The fast path's jobs on this thread while TensorStore's run on one background thread — started only when
    both have work (a thread costs about a millisecond, which single-array reads would pay every time) — then
    whatever the fast path declined, through TensorStore. Returns the jobs the fast path took, with its
    arguments. ``split`` is ``_split_fast(jobs)`` when the caller has it already."""
    fast, slow = split or _split_fast(jobs)
    if fast and slow:
        with ThreadPoolExecutor(1) as background:
            pending = background.submit(_transfer, slow, context, where, action, start)
            declined = fast_path([job for _, job in fast], where)
            pending.result()
    elif fast:
        declined = fast_path([job for _, job in fast], where)
    else:
        _transfer(slow, context, where, action, start)
        return []
    _transfer([fast[i][0] for i in declined], context, where, action, start)
    skipped = set(declined)
    return [item for i, item in enumerate(fast) if i not in skipped]


def _read_store(store: ts.TensorStore, job: ArrayIO) -> ts.WriteFutures:
    import tensorstore as ts  # on first use (CLI start-up)
    return ts.array(typed_data(job), copy=False, write=True).write(store)


def typed_data(job: ArrayIO) -> np.ndarray:
    """The job's memory typed as its array (a bfloat16/float8 host view comes carrier-typed: TensorStore would
    convert its integers by value)."""
    name = json_object(job.spec.get("metadata")).get("data_type")
    return job.data if name is None else as_typed(job.data, dtype_by_name(name))


def _read_packed_rows(jobs: list[tuple[ArrayIO, tuple[ChunkSource, str]]], where: str) -> list[ArrayIO]:
    """Read the jobs of packed arrays (each with its chunk source and array path: ``staged.source_of``) in local pack
    files that the fast path takes (uncompressed row layouts) straight from the packs; the others are returned, to be
    staged for TensorStore."""
    hits = {id(job): hit for job, hit in jobs}
    fast, rest = _split_fast([job for job, _ in jobs], local=False)
    sources: dict[int, tuple[ChunkSource, list[str]]] = {}
    for job, _ in fast:
        source, path = hits[id(job)]
        sources.setdefault(id(source), (source, []))[1].append(path)
    for source, paths in sources.values():  # every section these jobs need, in one read per source
        source.prepare(paths)
    taken = []
    for job, args in fast:
        source, path = hits[id(job)]
        locate = source.locate(path)
        if locate is None:
            rest.append(job)
        else:
            taken.append((job, (args[0], locate, *args[2:])))
    if taken:
        declined = read_rows([args for _, args in taken], where)
        rest.extend(taken[i][0] for i in declined)
    return rest


def _split_fast(jobs: Sequence[ArrayIO], local: bool = True) -> tuple[list[tuple[ArrayIO, tuple]], list[ArrayIO]]:
    """Jobs the fast path can take (with its arguments), and the rest: uncompressed row layouts, in a local
    directory (``local``), or wherever their chunk files go (a pack's sink: see :func:`split_rows`)."""
    fast: list[tuple[ArrayIO, tuple]] = []
    slow: list[ArrayIO] = []
    for job in jobs:
        kvstore = json_object(job.spec.get("kvstore"))
        usable = not local or kvstore.get("driver") == "file"
        layout = row_layout(json_object(job.spec.get("metadata"))) if usable else None
        first = _first_row(job, layout) if layout is not None else None
        if first is None:
            slow.append(job)
        else:
            fast.append((job, (job.key, kvstore["path"], layout, first, job.data, {})))
    return fast, slow


def split_rows(jobs: Sequence[ArrayIO]) -> tuple[list[tuple[ArrayIO, RowLayout, int]], list[ArrayIO]]:
    """Jobs of whole rows of uncompressed row layouts, wherever they are stored (with their layout and first row),
    and the rest: what a packed save writes with ``fastio.write_rows`` into its pack."""
    fast, slow = _split_fast(jobs, local=False)
    return [(job, args[2], args[3]) for job, args in fast], slow


def _first_row(job: ArrayIO, layout: RowLayout) -> int | None:
    """The first row ``job.index`` selects, when it selects whole rows only (else ``None``)."""
    if job.index is None or layout.ndim == 0:
        return 0
    shape = array_shape(json_object(job.spec.get("metadata")))
    rows, *rest = job.index
    if rows.step not in (None, 1) or any((s.start or 0, s.stop, s.step) != (0, n, None) and
                                         (s.start, s.stop, s.step) != (None, None, None)
                                         for s, n in zip(rest, shape[1:], strict=True)):
        return None
    return rows.start or 0


def _transfer(
    jobs: Sequence[ArrayIO], context: StoreContext, where: str, action: str,
    start: Callable[[ts.TensorStore, ArrayIO], ts.WriteFutures],
) -> None:
    """Open all arrays, start every transfer, then wait for all of them (none is left running)."""
    if action == "read":
        for job in jobs:
            check_chunk_files(job, where)
    opened = [_start_open(job.spec, context, job.key, where) for job in jobs]
    pending = []
    try:
        for job, future in zip(jobs, opened, strict=True):
            store = _result(future, job.key, where, "open")
            pending.append((job, start(store if job.index is None else store[job.index], job)))
    finally:  # even when an open fails, never return while transfers still use the memory
        _wait_all(pending, where, action)


def _result(future: ts.Future[ts.TensorStore], key: str, where: str, action: str) -> ts.TensorStore:
    try:
        return future.result()
    except Exception as e:  # TensorStore raises ValueError/RuntimeError carrying a status code
        raise _wrap(e, key, where, action) from e


def _wait_all(pending: list[tuple[ArrayIO, ts.WriteFutures]], where: str, action: str) -> None:
    """Wait for every transfer, then raise the first failure (named) so none is left running."""
    first: BaseException | None = None
    for job, future in pending:
        try:
            future.result()
        except Exception as e:
            first = first or _wrap(e, job.key, where, action)
    if first is not None:
        raise first


def _wrap(error: BaseException, key: str, where: str, action: str) -> Exception:
    message = user_paths(f"{where}: tensor {key!r}: {action} failed: {_describe(error)}")
    wrapped: Exception = StorageError(message) if action == "write" else read_failure(message, error)
    wrapped.__cause__ = error
    return wrapped


# TensorStore status codes of a store that could not be reached or refused access (ABORTED: its retries were used
# up), as opposed to what it holds being damaged or missing (NOT_FOUND, DATA_LOSS, decoding errors).
_UNREACHABLE = ("ABORTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "PERMISSION_DENIED", "UNAUTHENTICATED",
                "RESOURCE_EXHAUSTED")


def read_failure(message: str, error: BaseException) -> Exception:
    """The error for a failed read: a :class:`StorageError` when the storage could not be reached (nothing says
    the data is bad), else a :class:`CorruptCheckpointError`. A pinned directory in the message is replaced by the
    path it was opened as (``smallfiles.user_paths``)."""
    kind = StorageError if _describe(error).startswith(_UNREACHABLE) else CorruptCheckpointError
    return kind(user_paths(message))
