"""Every tuning knob of arrayckpt in one place (zarr-python's ``core/config.py`` is the model).

Thread counts, concurrency, byte budgets, retries and pauses used to be constants scattered over the modules that
use them, some read from the environment at import. They are the fields of one frozen :class:`Settings`, read once
(the first time arrayckpt needs one); each may be overridden by the environment variable ``ARRAYCKPT_`` + its name
in capitals (``ARRAYCKPT_IO_THREADS=4``, ``ARRAYCKPT_VERIFY_BATCH_BYTES=67108864``). A value that does not parse, or
is out of its range, is ignored with a warning naming it (a job should not die of a typo in a tuning knob).
:func:`override` changes them for a block (tests, benchmarks).

What is *not* here: limits of the format and of its readers' safety (``spec/FORMAT.md`` §12), which are facts of the
format rather than knobs, and :class:`arrayckpt.ChunkPolicy`, which a caller passes per save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields

__all__ = ["ENV_PREFIX", "Settings", "override", "settings"]

ENV_PREFIX = "ARRAYCKPT_"


def _default_io_threads() -> int:
    """One IO thread per core, 2 to 8 (more threads than cores only adds contention, measured)."""
    return min(8, max(2, os.cpu_count() or 2))


@dataclass(frozen=True)
class Settings:
    """arrayckpt's tuning knobs (module docstring). Each is a default measured on this project's machines."""

    # --- threads and concurrency
    io_threads: int = field(default_factory=_default_io_threads)  # threads per chunk transfer (e.g. cores per rank)
    background_nice: int = 10  # how far below the training loop background IO workers run (niceness, 0..19)
    fsync_threads: int = 16  # fsyncs at once: they mostly wait for the disk and the journal, sharing its commits
    file_io_concurrency: int = 32  # TensorStore's file operations in flight
    object_concurrency: int = 64  # TensorStore's requests in flight to object storage
    object_retries: int = 10  # attempts of an object-storage request before it fails
    copy_concurrency: int = 8  # chunk files in flight in a copy or sync
    # --- byte budgets
    inline_bytes: int = 2 << 20  # transfers up to this size (plus 4 KiB a file) run on the calling thread
    small_slice_bytes: int = 1 << 20  # a slice up to this size is read into new memory and copied (~10% faster)
    probe_bytes: int = 256 << 20  # an array bigger than this has its first and last elements read before allocation
    verify_batch_bytes: int = 256 << 20  # chunks ``verify`` reads at once
    compact_batch_bytes: int = 256 << 20  # array bytes a compaction reads through the chain and writes per batch
    fetch_batch_bytes: int = 128 << 20  # tensor bytes a streaming conversion fetches before writing them together
    packed_from_ranks: int = 2  # saves of at least this many ranks are packed (one file per rank), unless asked
    pack_batch_bytes: int = 256 << 20  # array bytes a rank encodes into memory before appending them to its pack
    refs_max_chunks: int = 100_000  # a packed save writes refs.json (kerchunk) up to this many chunks (~10 MB)
    device_issue_bytes: int = 64 << 20  # device-to-host copies are issued once this many bytes of them wait
    compare_block_bytes: int = 16 << 20  # rows a delta save compares at once, per thread
    dcp_staged_batch_bytes: int = 512 << 20  # reads the DCP reader stages outside their targets, per batch
    deepspeed_read_batch_bytes: int = 256 << 20  # slices the DeepSpeed engine loader reads together
    inspect_block_bytes: int = 32 << 20  # selection ``show``/``diff`` read at once for statistics
    copy_in_flight_bytes: int = 256 << 20  # chunk bytes a copy holds at once
    widen_block_bytes: int = 32 << 20  # bf16/fp16 bytes read at a time into a widened fp32 tensor (DeepSpeed export)
    tie_compare_bytes: int = 32 << 20  # bytes of each of two tensors compared at once (Hugging Face ties)
    object_part_bytes: int = 64 << 20  # a part of a rank's pack object (packed layout): its multipart upload's unit
    object_pack_parts: int = 4  # parts of its pack object a rank holds in memory while writing it (then it waits)
    pack_read_gap_bytes: int = 256 << 10  # ranges of a pack object this close are read by one GET
    # --- pauses and ages (seconds)
    lease_ttl_s: float = 60.0  # a lease not renewed for this long has expired (its holder is gone)
    lease_renew_s: float = 15.0  # how often a holder renews its lease
    new_grace_s: float = 60.0  # a save's new directory nobody holds is a leftover once this old
    uploader_poll_s: float = 0.02  # how often the uploader looks whether the save it waits for has finished
    background_pause_s: float = 30.0  # the longest a background save keeps the cyclic garbage collector paused

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The defaults, each overridden by its ``ARRAYCKPT_<NAME>`` variable where that holds a valid value."""
        changes: dict[str, int | float] = {}
        for knob in fields(cls):
            text = environ.get(ENV_PREFIX + knob.name.upper())
            if text is None:
                continue
            value = _parse(knob.name, text, float if knob.type in ("float", float) else int)
            if value is not None:
                changes[knob.name] = value
        return dataclasses.replace(cls(), **changes)  # type: ignore[arg-type]  # each value of its field's type


def _parse(name: str, text: str, kind: type[int] | type[float]) -> int | float | None:
    """``text`` as a value of the knob ``name``, or ``None`` (with a warning) when it is not a valid one."""
    try:
        value = kind(text)
    except ValueError:
        value = None
    low, high = (0, 19) if name == "background_nice" else (0 if kind is float else 1, None)
    if value is None or value < low or (high is not None and value > high):
        warnings.warn(f"{ENV_PREFIX}{name.upper()}={text!r} is not a valid value (a {kind.__name__} of at least {low}"
                      f"{f' and at most {high}' if high is not None else ''}); the default is used", RuntimeWarning,
                      stacklevel=4)
        return None
    return value


_current: list[Settings] = []  # the process's settings, read on first use


def settings() -> Settings:
    """The settings in force (read from the environment the first time)."""
    if not _current:
        _current.append(Settings.from_environ())
    return _current[-1]


@contextlib.contextmanager
def override(**changes: int | float) -> Iterator[Settings]:
    """Other settings inside the block, process-wide: ``with override(verify_batch_bytes=1 << 20): ...``."""
    _current.append(dataclasses.replace(settings(), **changes))  # type: ignore[arg-type]
    try:
        yield _current[-1]
    finally:
        _current.pop()
