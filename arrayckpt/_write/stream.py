"""Writing a checkpoint one tensor at a time, for converters whose source is far bigger than memory.

``arrayckpt.save`` takes the whole state at once: right for training, where the state is in memory
anyway, wrong for a converter reading a 500 GiB file. Here the state's *structure* comes first, with
meta-device tensors standing for the data (so keys, containers and the layout are exactly what ``save``
would produce for the real state); the data is then fetched key by key, written, and dropped. The
save protocol is the same as ``save``'s with one process, one write transaction (``transaction.py``): plan,
write array metadata, write chunks, commit the root ``zarr.json`` last (or remove everything on failure).
Memory stays at about one batch of tensors (``batch_bytes``, or the largest tensor if bigger).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from .._errors import StateError
from .._format.dtypes import DType, dtype_of_numpy
from .._format.keys import dotted, prefix_parts
from .._io.arrays import ArrayIO, Checksums, array_spec, write_all
from .._layout.box import Box
from .._layout.chunking import DEFAULT_CHUNKING, ArrayPlan, ChunkPolicy
from .._layout.saveplan import SavePlan, plan_save, with_key_encoding
from .._settings import settings
from .._torch.dtypes import dtype_of_torch
from .._torch.tensors import readable_numpy
from .describe import describe_local, host_view
from .options import SaveOptions
from .save import begin_save, build_manifest, created_info
from .transaction import WriteTransaction, begin_write

__all__ = ["write_streaming"]


Fetch = Callable[[str], "torch.Tensor | np.ndarray"]
_LATER = np.empty(0)  # stands for the data of a meta-tensor leaf until it is fetched


def write_streaming(
    skeleton: Mapping[str, Any],
    fetch: Fetch,
    path: str | os.PathLike[str],
    options: SaveOptions,
    *,
    chunking: ChunkPolicy = DEFAULT_CHUNKING,
    source: str | None = None,
    batch_bytes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    release: Callable[[str], None] | None = None,
    created: Mapping[str, Any] | None = None,
    key_prefix: str = "",
) -> None:
    """Save ``skeleton`` as a checkpoint, fetching each meta-tensor leaf's data with ``fetch(key)`` when written.

    The skeleton is described exactly as ``save`` describes a state (same keys, containers, values and
    layout); leaves that are real tensors or numpy arrays are written as they are. ``options`` are those of
    ``save`` for one process writing a full checkpoint (``process_group`` and the incremental options are
    refused). ``release(key)``, if given, is called once a fetched tensor has been written (e.g. to drop the
    pages of a memory-mapped source). ``source`` is recorded in the manifest's ``created`` provenance
    (``converted_from``), with ``created``'s members (e.g. the source's own metadata, kept for a later export).
    ``key_prefix`` (``"model"``) nests the whole skeleton under it, so that every key starts with ``model.``;
    ``fetch`` and ``release`` are still called with the skeleton's own keys.
    """
    parts = prefix_parts(key_prefix)
    if parts:
        skeleton, fetch, release = _nested(skeleton, fetch, release, parts)

    def host(key: str, array_path: str, value: torch.Tensor | np.ndarray, dt: DType) -> np.ndarray:
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            return _LATER
        return host_view(key, array_path, value, dt)

    if options.process_group is not None or options.base is not None:
        raise StateError("a streaming write is one process writing a full checkpoint: process_group and base "
                         "do not apply")
    request = begin_save(path, options)
    local = describe_local(dict(skeleton), 0, options.allow_pickle, host)
    plan = plan_save([local.description], options.codec, chunking)  # one write: no cache for a next
    with begin_write(request.location, options.overwrite) as transaction:
        plan = with_key_encoding(plan, transaction.key_encoding)
        transaction.write_documents(plan.documents)
        batch = settings().fetch_batch_bytes if batch_bytes is None else batch_bytes
        checksums = _write_arrays(plan, local.data, fetch, transaction, batch, progress, release)
        created = created_info(1) | ({"converted_from": source} if source is not None else {}) | dict(created or {})
        manifest = build_manifest(plan, request.record, 1, None, [({}, checksums)], str(request.location), created)
        transaction.commit(manifest, plan.consolidated_json)


def _nested(skeleton: Mapping[str, Any], fetch: Fetch, release: Callable[[str], None] | None,
            parts: tuple[str, ...]) -> tuple[Mapping[str, Any], Fetch, Callable[[str], None] | None]:
    """``skeleton`` under the key prefix ``parts``, with ``fetch`` and ``release`` taking the prefixed keys."""
    for part in reversed(parts):
        skeleton = {part: skeleton}
    cut = len(dotted(parts)) + 1
    inner_release = release
    return (skeleton, lambda key: fetch(key[cut:]),
            None if inner_release is None else lambda key: inner_release(key[cut:]))


def _write_arrays(plan: SavePlan, data: dict[str, tuple[Box, np.ndarray]], fetch: Fetch, transaction: WriteTransaction,
                  batch_bytes: int, progress: Callable[[int, int], None] | None,
                  release: Callable[[str], None] | None) -> Checksums:
    """Fetch, write and drop the arrays in batches of at most ``batch_bytes`` (one tensor if bigger); returns the
    checksums of the chunks written.

    Only ``jobs`` holds fetched data, so a batch is freed as soon as it is written: no reference to the
    previous tensor may survive into the next fetch, or two big tensors would be in memory at once.
    """
    context = transaction.target.write_context()
    where = str(transaction.location)
    tasks = plan.tasks[0]
    total = sum(plan.arrays[t.path].dtype.itemsize * t.box.size for t in tasks)
    done = held = 0
    jobs: list[ArrayIO] = []
    fetched: list[str] = []
    checksums: Checksums = {}
    for task in tasks:
        array = plan.arrays[task.path]
        _, host = data[task.path]
        if host is _LATER:
            host = _fetched_view(task.key, fetch(task.key), array)
            fetched.append(task.key)
        spec = array_spec(transaction.target.kvstore(task.path), array.metadata)
        jobs.append(ArrayIO(task.key, spec, host, task.box.slices(), task.path))
        held += host.nbytes
        del host
        if held >= batch_bytes:
            _write_batch(jobs, fetched, context, where, release, checksums)
            done += held
            held = 0
            if progress is not None:
                progress(done, total)
    _write_batch(jobs, fetched, context, where, release, checksums)
    if progress is not None:
        progress(total, total)
    return checksums


def _write_batch(jobs: list[ArrayIO], fetched: list[str], context: Any, where: str,
                 release: Callable[[str], None] | None, checksums: Checksums) -> None:
    for path, found in write_all(jobs, context, where).items():
        checksums.setdefault(path, {}).update(found)
    if release is not None:
        for key in fetched:
            release(key)
    jobs.clear()
    fetched.clear()


def _fetched_view(key: str, value: torch.Tensor | np.ndarray, array: ArrayPlan) -> np.ndarray:
    """The fetched data as the numpy view to write, after checking it is what the skeleton promised."""
    got = dtype_of_numpy(value.dtype) if isinstance(value, np.ndarray) else dtype_of_torch(value.dtype, key)
    if got != array.dtype or tuple(value.shape) != array.shape:
        raise StateError(f"tensor {key!r}: the source gave {value.dtype}{list(value.shape)} where its index "
                         f"promised {array.dtype.name}{list(array.shape)}; the source file is inconsistent")
    return value if isinstance(value, np.ndarray) else readable_numpy(value, array.dtype, key)
