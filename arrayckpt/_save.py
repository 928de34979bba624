"""``save``: flatten, plan, write every array concurrently, then commit the root metadata last."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ._codecs import CodecChoice, resolve_codec
from ._dtypes import DTYPES, dtype_of_numpy, dtype_of_torch
from ._errors import PickleNotAllowedError, StateError
from ._format import ArrayEntry, Entry, Manifest, PickleEntry, ValueEntry, node_documents, root_document
from ._io import ArrayIO, array_spec, write_all, write_context
from ._keys import array_path
from ._plan import ArrayPlan, array_metadata, plan_array
from ._state import Leaf, walk
from ._storage import LocalWriter, parse_location
from ._tensors import readable_numpy
from ._values import NotJSONable, encode_value

__all__ = ["save"]

PICKLE_PROTOCOL = 5


def save(
    state: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    codec: CodecChoice = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    process_group: Any = None,
    step: int | None = None,
) -> None:
    """Save ``state`` as a checkpoint at ``path``.

    ``state`` is a dict of tensors, numpy arrays, plain values (int, float, str, bool, None, bytes and
    lists/tuples/dicts of them) and objects with ``state_dict()`` (modules, optimizers, schedulers),
    nested in dicts and lists. ``codec`` is ``None`` (no compression), ``"zstd"``, ``"blosc"``, an
    :class:`arrayckpt.Codec`, or a per-key choice (``{"optim.*": "zstd"}``). Every chunk carries a crc32c.
    The checkpoint becomes visible only once complete; a committed checkpoint at ``path`` is replaced
    only with ``overwrite=True``, and stays readable until the new one has committed.

    >>> import arrayckpt, torch, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "step-100")
    >>> model = torch.nn.Linear(4, 2)
    >>> arrayckpt.save({"model": model, "step": 100}, path, codec={"model.*": "zstd"})
    >>> sorted(arrayckpt.open(path))
    ['model.bias', 'model.weight']
    """
    _require_single_process(process_group)
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise StateError(f"step must be an int or None, got {step!r}")
    location = parse_location(path)
    where = str(location)
    walked = walk(state)
    entries: dict[str, Entry] = {}
    plans: list[tuple[ArrayPlan, np.ndarray]] = []
    for key, leaf in walked.leaves.items():
        entries[key] = _describe(key, leaf, codec, allow_pickle, plans)
    _check_paths(plans)
    metadata = {plan.path: array_metadata(plan) for plan, _ in plans}
    nodes = node_documents(metadata)
    manifest = Manifest(entries, step, walked.containers, _created())
    writer = LocalWriter(location, overwrite)
    try:
        for node_path, document in nodes.items():
            writer.write_json(node_path, document)
        jobs = [ArrayIO(p.key, array_spec(writer.kvstore(p.path), metadata[p.path]), data) for p, data in plans]
        write_all(jobs, write_context(), where)
        writer.commit(root_document(manifest, nodes))
    except BaseException:
        writer.abort()
        raise


def _describe(key: str, leaf: Leaf, codec: CodecChoice, allow_pickle: bool, plans: list) -> Entry:
    """The manifest entry of one leaf; arrays also get a plan and their host data appended."""
    value = leaf.value
    if isinstance(value, torch.Tensor):
        dt = dtype_of_torch(value.dtype, key)
        data = readable_numpy(value, dt, key)
        plans.append((plan_array(key, array_path(key), dt, tuple(value.shape), resolve_codec(codec, key)), data))
        return ArrayEntry(key, leaf.parts, dt, tuple(value.shape), "tensor")
    if isinstance(value, np.ndarray) and (dt := dtype_of_numpy(value.dtype)) is not None:
        plans.append((plan_array(key, array_path(key), dt, value.shape, resolve_codec(codec, key)), value))
        return ArrayEntry(key, leaf.parts, dt, value.shape, "ndarray")
    try:
        return ValueEntry(key, leaf.parts, encode_value(value))
    except NotJSONable as e:
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"value {key!r} of type {e} cannot be stored as JSON; convert it to plain types, or pass "
                "allow_pickle=True to pickle it (loading will then need allow_pickle=True too)"
            ) from None
    raw = np.frombuffer(pickle.dumps(value, protocol=PICKLE_PROTOCOL), np.uint8)
    dt = DTYPES["uint8"]
    plans.append((plan_array(key, array_path(key), dt, raw.shape, resolve_codec(None, key)), raw))
    return PickleEntry(key, leaf.parts, raw.size)


def _check_paths(plans: list[tuple[ArrayPlan, np.ndarray]]) -> None:
    """An array cannot have children in Zarr: refuse keys like ``a`` and ``a.b`` both being arrays."""
    paths = {plan.path: plan.key for plan, _ in plans}
    for path, key in paths.items():
        segments = path.split("/")
        for i in range(1, len(segments)):
            parent = "/".join(segments[:i])
            if parent in paths:
                raise StateError(
                    f"{paths[parent]!r} is a tensor and also the prefix of tensor {key!r}; rename one of them"
                )


def _created() -> dict[str, Any]:
    from . import __version__

    return {
        "library": f"arrayckpt {__version__}",
        "torch": torch.__version__,
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "world_size": 1,
    }


def _require_single_process(process_group: Any) -> None:
    """Multi-rank saves and loads come with the distributed layer; refuse rather than race."""
    import torch.distributed as dist

    world = 1
    if process_group is not None:
        world = dist.get_world_size(process_group)
    elif dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    if world > 1:
        raise StateError(
            f"multi-process save/load (world size {world}) is not supported by this version of arrayckpt; "
            "save from a single process (e.g. rank 0 with full tensors)"
        )
