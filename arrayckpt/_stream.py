"""Writing a checkpoint one tensor at a time, for converters whose source is far bigger than memory.

``arrayckpt.save`` takes the whole state at once: right for training, where the state is in memory
anyway, wrong for a converter reading a 500 GiB file. Here the state's *structure* comes first, with
meta-device tensors standing for the data (so keys, containers and the layout are exactly what ``save``
would produce for the real state); the data is then fetched key by key, written, and dropped. The
save protocol is the same as ``save``'s with one process: plan, write array metadata, write chunks,
commit the root ``zarr.json`` last (or remove everything on failure). Memory stays at about one batch of
tensors (``batch_bytes``, or the largest tensor if bigger).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ._codecs import CodecChoice
from ._dtypes import dtype_of_numpy, dtype_of_torch
from ._errors import PickleNotAllowedError, StateError
from ._format import Manifest, ValueEntry, encode_root_document
from ._io import ArrayIO, array_spec, write_all, write_context
from ._saveplan import ArrayDescription, LocalDescription, plan_save
from ._shards import Box
from ._state import walk
from ._storage import LocalWriter, parse_location
from ._tensors import readable_numpy
from ._values import NotJSONable, encode_value

__all__ = ["BATCH_BYTES", "write_streaming"]

BATCH_BYTES = 128 << 20  # tensors fetched before writing them together (concurrency for small tensors)
PICKLE_PROTOCOL = 5

Fetch = Callable[[str], "torch.Tensor | np.ndarray"]


def write_streaming(
    skeleton: Mapping[str, Any],
    fetch: Fetch,
    path: str | os.PathLike[str],
    *,
    codec: CodecChoice = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    step: int | None = None,
    source: str | None = None,
    batch_bytes: int = BATCH_BYTES,
    progress: Callable[[int, int], None] | None = None,
    release: Callable[[str], None] | None = None,
) -> None:
    """Save ``skeleton`` as a checkpoint, fetching each meta-tensor leaf's data with ``fetch(key)`` when written.

    Leaves that are real tensors or numpy arrays are written as they are; plain values as in ``save``.
    ``release(key)``, if given, is called once a fetched tensor has been written (e.g. to drop the pages of
    a memory-mapped source).
    ``source`` is recorded in the manifest's ``created`` provenance (e.g. ``"safetensors: model.safetensors"``).
    """
    walked = walk(dict(skeleton))
    arrays: list[ArrayDescription] = []
    values: list[ValueEntry] = []
    inline: dict[str, np.ndarray | torch.Tensor] = {}
    for key, leaf in walked.leaves.items():
        value = leaf.value
        if isinstance(value, torch.Tensor):
            dt = dtype_of_torch(value.dtype, key)
            arrays.append(ArrayDescription(key, leaf.parts, "tensor", dt.name, tuple(value.shape),
                                           Box.whole(tuple(value.shape)), 0))
            if value.device.type != "meta":
                inline[key] = value
        elif isinstance(value, np.ndarray) and (nd := dtype_of_numpy(value.dtype)) is not None:
            arrays.append(ArrayDescription(key, leaf.parts, "ndarray", nd.name, value.shape, Box.whole(value.shape), 0))
            inline[key] = value
        else:
            try:
                values.append(ValueEntry(key, leaf.parts, encode_value(value)))
            except NotJSONable as e:
                if not allow_pickle:
                    raise PickleNotAllowedError(
                        f"value {key!r} of type {e} cannot be stored as JSON; pass allow_pickle=True (--allow-pickle) "
                        "to store it pickled"
                    ) from None
                raw = np.frombuffer(pickle.dumps(value, protocol=PICKLE_PROTOCOL), np.uint8)
                arrays.append(ArrayDescription(key, leaf.parts, "pickle", "uint8", raw.shape, Box.whole(raw.shape), 0))
                inline[key] = raw
    plan = plan_save([LocalDescription(tuple(arrays), tuple(values), (), walked.containers)], codec)
    writer = LocalWriter(parse_location(path), overwrite)
    wait = writer.write_documents(plan.documents)
    try:
        _write_arrays(plan, arrays, inline, fetch, writer, batch_bytes, progress, release)
        wait()
        created = _created(source)
        writer.commit(encode_root_document(Manifest(plan.entries, step, plan.containers, created),
                                           plan.consolidated_json))
    except BaseException:
        try:
            wait()  # nothing may still be writing into the directory we remove
        finally:
            writer.abort()
        raise


def _write_arrays(plan: Any, arrays: list[ArrayDescription], inline: dict[str, Any], fetch: Fetch,
                  writer: LocalWriter, batch_bytes: int, progress: Callable[[int, int], None] | None,
                  release: Callable[[str], None] | None) -> None:
    """Fetch, write and drop the arrays in batches of at most ``batch_bytes`` (one tensor if bigger).

    Only ``jobs`` holds fetched data, so a batch is freed as soon as it is written: no reference to the
    previous tensor may survive into the next fetch, or two big tensors would be in memory at once.
    """
    tasks = {task.key: task for task in plan.tasks[0]}
    context = write_context()
    where = str(writer.location)
    total = sum(plan.arrays[tasks[a.key].path].dtype.itemsize * a.box.size for a in arrays if a.key in tasks)
    done = 0
    jobs: list[ArrayIO] = []
    held = 0
    for description in arrays:
        task = tasks.get(description.key)
        if task is None:  # an empty tensor: no chunks
            continue
        array_plan = plan.arrays[task.path]
        data = inline[description.key] if description.key in inline else fetch(description.key)
        host = _host_view(data, description, array_plan.dtype)
        spec = array_spec(writer.kvstore(task.path), array_plan.metadata)
        jobs.append(ArrayIO(description.key, spec, host, task.box.slices()))
        held += host.nbytes
        del data, host
        if held >= batch_bytes:
            _flush(jobs, context, where, release, inline)
            done += held
            jobs, held = [], 0
            if progress is not None:
                progress(done, total)
    if jobs:
        _flush(jobs, context, where, release, inline)
        if progress is not None:
            progress(total, total)


def _flush(jobs: list[ArrayIO], context: Any, where: str, release: Callable[[str], None] | None,
           inline: dict[str, Any]) -> None:
    write_all(jobs, context, where)
    if release is not None:
        for job in jobs:
            if job.key not in inline:
                release(job.key)
    jobs.clear()


def _host_view(data: torch.Tensor | np.ndarray, description: ArrayDescription, dtype: Any) -> np.ndarray:
    """The fetched data as the numpy view to write, after checking it is what the skeleton promised."""
    key = description.key
    if isinstance(data, np.ndarray):
        got_dtype, got_shape = data.dtype, data.shape
        ok = dtype_of_numpy(data.dtype) == dtype
        host = data
    else:
        got_dtype, got_shape = data.dtype, tuple(data.shape)
        ok = dtype_of_torch(data.dtype, key) == dtype
        host = readable_numpy(data, dtype, key) if ok else None  # type: ignore[assignment]
    if not ok or tuple(got_shape) != description.global_shape:
        raise StateError(f"tensor {key!r}: the source gave {got_dtype}{list(got_shape)} where its index promised "
                         f"{dtype.name}{list(description.global_shape)}; the source file is inconsistent")
    return host


def _created(source: str | None) -> dict[str, Any]:
    """Provenance like ``save``'s, plus where the data was converted from."""
    from . import __version__

    created: dict[str, Any] = {
        "library": f"arrayckpt {__version__}",
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "world_size": 1,
    }
    if source is not None:
        created["converted_from"] = source
    return created
