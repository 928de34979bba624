"""Where the tensors of a ``torch_checkpointing`` checkpoint are: its files per item and rank, its ``metadata.pkl``,
and the pieces of every global tensor each rank's file holds (``torch_checkpointing.py`` reads and writes them).

``torch_checkpointing`` (PyTorch's checkpointing package: ``CheckpointManager``) writes, by default, one
``torch.save`` file per item and rank, ``<item>_<rank>.pt`` (``checkpoint_layout.default_torch_layout_info``). When an
item declares a resharder it also writes ``metadata.pkl`` (``metadata_serialization.TorchDistributedMetadataFormat``):
a pickle of plain dicts (``DistributedMetadata.to_dict()``, version 2.0) giving, per item and nested path, the
sharding of each tensor (``DTensorShardingMetadata``: global shape, mesh and placements;
``DefaultShardingMetadata``, ``"default_tensor_v1"``: a ``CheckpointableTensor``'s boxes) and the ranks it holds for,
and per item and rank the file (``rank_to_layout_info``; ``None``: the default name). It is unpickled here with no
global admitted at all, so reading it runs no code.

A tensor's pieces come from that metadata, or, for an item it does not describe, from the saved leaf itself: a
DTensor's own mesh and placements, a tensor's ``CheckpointableTensor`` attributes, or else a plain tensor, which every
rank holding it holds whole (a replica: the copies are checked to be equal when several ranks saved one).
"""

from __future__ import annotations

import io
import math
import pickle
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._errors import FormatError
from .._io.smallfiles import first_link, read_regular_file
from .._layout.box import Box, cover_problem

__all__ = ["METADATA_FILE", "Layout", "Piece", "TensorPlan", "leaf_at", "local_tensor", "read_layout",
           "rank_file", "tensor_plan"]

METADATA_FILE = "metadata.pkl"  # metadata_serialization.METADATA_FILE_NAME
RANK_FILE = re.compile(r"(.+)_(\d+)\.pt")  # the default layout: <item>_<rank>.pt
SUPPORTED_VERSION = "2.0"  # distributed_metadata._CURRENT_VERSION (1.0 is an older, flat layout)
DTENSOR = "DTensorShardingMetadata"
BOXES = "default_tensor_v1"  # DefaultShardingMetadata's registered type name
CHECKPOINTABLE = ("global_shape", "global_offsets", "local_offsets", "local_sizes")
MAX_RANKS = 2**20  # a world size beyond any job: what a crafted file name or world_size could claim
NestedPath = tuple[str | int, ...]
_MISSING = object()


def rank_file(item: str, rank: int) -> str:
    """The default file of ``item`` saved by ``rank`` (``model_0.pt``)."""
    return f"{item}_{rank}.pt"


@dataclass(frozen=True)
class Layout:
    """What a checkpoint directory holds: its world size, each item's file per rank (relative paths, those present
    only), the files that ranks of the world size lack, and ``metadata.pkl``'s sharding (item -> nested path -> the
    ``(sharding dict, ranks)`` groups)."""

    world_size: int
    files: Mapping[str, Mapping[int, str]]
    missing: Mapping[str, tuple[str, ...]]
    sharding: Mapping[str, Mapping[NestedPath, tuple[tuple[Mapping[str, Any], tuple[int, ...]], ...]]]
    has_metadata: bool


class _NoGlobals(pickle.Unpickler):
    """``metadata.pkl`` holds dicts, lists, tuples, strings and numbers only: any global is refused."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data; torch_checkpointing's metadata.pkl holds "
                                     "none, refusing to load it")


def _metadata(directory: Path) -> Mapping[str, Any] | None:
    file = directory / METADATA_FILE
    if not file.is_file():
        return None
    try:
        document = _NoGlobals(io.BytesIO(read_regular_file(file, str(file)))).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise FormatError(f"{file}: not a readable torch_checkpointing metadata file: {e}") from e
    if not isinstance(document, dict) or not isinstance(document.get("metadata"), dict):
        raise FormatError(f"{file}: holds no torch_checkpointing DistributedMetadata (a dict with 'metadata')")
    version = document.get("version", "1.0")
    if version != SUPPORTED_VERSION:
        raise FormatError(f"{file}: metadata version {version!r}; only {SUPPORTED_VERSION} (torch_checkpointing "
                          "0.1) is read: load the checkpoint with torch_checkpointing and save it again")
    return document


def read_layout(directory: Path) -> Layout:
    """The files and sharding of the checkpoint in ``directory`` (see the module's docstring)."""
    document = _metadata(directory)
    found: dict[str, dict[int, str]] = {}
    for path in directory.iterdir():
        match = RANK_FILE.fullmatch(path.name)
        if match and _rank_file_here(directory, path.name):
            found.setdefault(match[1], {})[int(match[2])] = path.name
    sharding: dict[str, dict[NestedPath, tuple[tuple[Mapping[str, Any], tuple[int, ...]], ...]]] = {}
    if document is None:
        if not found:
            raise FormatError(f"{directory}: no {METADATA_FILE} and no <item>_<rank>.pt files; not a "
                              "torch_checkpointing checkpoint")
        world = max(max(ranks) for ranks in found.values()) + 1
    else:
        recorded = document.get("world_size")
        if not isinstance(recorded, int) or recorded < 1:
            raise FormatError(f"{directory / METADATA_FILE}: world_size {recorded!r} is not a number of ranks")
        world = recorded
        for item, described in document["metadata"].items():
            found[item] = {}  # the files metadata.pkl names for its items, not those found by name
            for rank, layout in _items(described, "rank_to_layout_info", directory):
                name = _file_of(item, int(rank), layout, directory)
                if _rank_file_here(directory, name):
                    found[item][int(rank)] = name
            sharding[item] = {_nested_path(text, directory): tuple(_groups(groups, directory))
                              for text, groups in _items(described, "nested_path_to_metadata", directory)}
    if world > MAX_RANKS:  # (crafted: a file model_99999999.pt, or such a world_size; the missing files are listed)
        raise FormatError(f"{directory}: a world size of {world:,} ranks; at most {MAX_RANKS:,} are read")
    missing = {item: tuple(rank_file(item, r) for r in range(world) if r not in ranks) for item, ranks in found.items()}
    return Layout(world, found, {k: v for k, v in missing.items() if v}, sharding, document is not None)


def _rank_file_here(directory: Path, name: str) -> bool:
    """Whether ``name`` is a regular file below ``directory`` reached without a link: a link in its place, or on the
    way to it, is damage (never followed out of the checkpoint)."""
    link = first_link(str(directory), name)
    if link is not None:
        raise FormatError(f"{directory}: {link} is a symbolic link; a checkpoint's files are never read through one: "
                          "replace it with the file itself")
    return (directory / name).is_file()


def _items(described: object, member: str, directory: Path) -> Iterator[tuple[Any, Any]]:
    table = described.get(member) if isinstance(described, dict) else None
    if not isinstance(table, dict):
        raise FormatError(f"{directory / METADATA_FILE}: an item has no {member} table")
    return iter(table.items())


def _file_of(item: str, rank: int, layout: object, directory: Path) -> str:
    """The file ``rank`` saved ``item`` to: the default name, or the layout metadata.pkl records (torch.save only)."""
    if layout is None:
        return rank_file(item, rank)
    kind = layout.get("serialization_format", {}).get("type") if isinstance(layout, dict) else None
    name = layout.get("file_path") if isinstance(layout, dict) else None
    if kind != "TorchSerialization" or not isinstance(name, str):
        raise FormatError(f"{directory}: item {item!r} is saved as {kind or layout!r} by rank {rank}; only "
                          "torch.save files (TorchSerialization, the default layout) are converted")
    if Path(name).is_absolute() or ".." in Path(name).parts:
        raise FormatError(f"{directory / METADATA_FILE}: item {item!r} of rank {rank} names {name!r}, outside the "
                          "checkpoint directory")
    return name


def _nested_path(text: object, directory: Path) -> NestedPath:
    import json

    try:
        parts = json.loads(text) if isinstance(text, str) else None
    except ValueError:
        parts = None
    if not isinstance(parts, list) or not all(isinstance(p, (str, int)) for p in parts):
        raise FormatError(f"{directory / METADATA_FILE}: {text!r} is not a nested path (a JSON list of keys)")
    return tuple(parts)


def _groups(groups: object, directory: Path) -> Iterator[tuple[Mapping[str, Any], tuple[int, ...]]]:
    for group in groups if isinstance(groups, list) else [groups]:
        sharding = group.get("sharding_metadata") if isinstance(group, dict) else None
        ranks = group.get("ranks") if isinstance(group, dict) else None
        if not isinstance(sharding, dict) or not isinstance(ranks, (list, tuple)):
            raise FormatError(f"{directory / METADATA_FILE}: a sharding entry is {group!r}, not sharding metadata "
                              "and ranks")
        yield sharding, tuple(int(r) for r in ranks)


@dataclass(frozen=True)
class Piece:
    """A region ``target`` of a global tensor, held by ``rank`` at ``local`` of its local tensor."""

    rank: int
    local: Box
    target: Box


@dataclass(frozen=True)
class TensorPlan:
    """One global tensor to assemble: the pieces to copy (those of ranks whose files hold it), and whether pieces
    of the same region must be checked equal (plain tensors of several ranks, which no metadata says are replicas)."""

    key: str
    path: NestedPath
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    check_replicas: bool


def leaf_at(state: object, path: NestedPath) -> object:
    """The value at ``path`` in nested dicts, lists and tuples (a private sentinel when there is none)."""
    node = state
    for part in path:
        if isinstance(node, Mapping) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            return _MISSING
    return node


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a saved leaf: a DTensor's local shard, a subclass's data as a ``torch.Tensor``."""
    if type(value).__name__ == "DTensor" and hasattr(value, "_local_tensor"):
        return value._local_tensor
    return value if type(value) is torch.Tensor else value.as_subclass(torch.Tensor)


def tensor_plan(src: Path, layout: Layout, states: Mapping[int, object], item: str, path: NestedPath,
                key: str) -> TensorPlan:
    """The pieces of the tensor at ``path`` of ``item`` (``states``: each present rank's loaded file), checked to
    cover it whole; a gap is an error naming the checkpoint, the tensor, the region and the files missing."""
    held = {rank: leaf for rank, state in states.items() if isinstance(leaf := leaf_at(state, path), torch.Tensor)}
    first = held[min(held)]
    groups = layout.sharding.get(item, {}).get(path)
    plain = False
    if groups is not None:
        shape, pieces = _from_metadata(groups, key, src)
    elif type(first).__name__ == "DTensor":
        shape, pieces = tuple(first.shape), _dtensor_pieces(_spec_of(first), tuple(first.shape), key, src)
    elif all(hasattr(first, name) for name in CHECKPOINTABLE):
        shape, pieces = tuple(int(n) for n in _attributes(first)["global_shape"]), \
            [p for rank, leaf in held.items() for p in _boxes(_attributes(leaf), rank, key, src)]
    else:
        plain = True
        shape, pieces = tuple(first.shape), [Piece(r, Box.whole(tuple(t.shape)), Box.whole(tuple(t.shape)))
                                             for r, t in held.items()]
        for rank, leaf in held.items():
            if tuple(leaf.shape) != shape or leaf.dtype != first.dtype:
                raise FormatError(f"{src}: tensor {key!r} is {tuple(leaf.shape)} {leaf.dtype} on rank {rank} but "
                                  f"{shape} {first.dtype} on rank {min(held)}, and no metadata.pkl says how it is "
                                  "split; save it with a resharder (ItemSpec(resharder=DefaultResharder())) so that "
                                  "torch_checkpointing records its sharding")
    available = tuple(p for p in pieces if p.rank in held)
    _check_cover(src, layout, item, key, shape, available, [p.rank for p in pieces if p.rank not in held])
    return TensorPlan(key, path, shape, local_tensor(first).dtype, available, plain and len(held) > 1)


def _from_metadata(groups: Sequence[tuple[Mapping[str, Any], tuple[int, ...]]], key: str, src: Path) \
        -> tuple[tuple[int, ...], list[Piece]]:
    shape: tuple[int, ...] | None = None
    pieces: list[Piece] = []
    for sharding, ranks in groups:
        kind, data = sharding.get("type"), sharding.get("data")
        if not isinstance(data, dict) or not isinstance(data.get("global_shape"), (list, tuple)):
            raise FormatError(f"{src}: metadata.pkl's sharding of {key!r} is {sharding!r}, without a global shape")
        shape = tuple(int(n) for n in data["global_shape"])
        if kind == DTENSOR:
            pieces += [p for p in _dtensor_pieces(data, shape, key, src) if p.rank in ranks]
        elif kind == BOXES:
            pieces += [p for rank in ranks for p in _boxes(data, rank, key, src)]
        else:
            raise FormatError(f"{src}: tensor {key!r} is described by {kind!r} sharding metadata; only DTensor and "
                              "CheckpointableTensor (default_tensor_v1) shardings are converted")
    if shape is None:
        raise FormatError(f"{src}: metadata.pkl lists tensor {key!r} without any sharding")
    return shape, pieces


def _spec_of(dtensor: Any) -> Mapping[str, Any]:
    """A DTensor's mesh and placements, in metadata.pkl's terms (``DTensorShardingMetadata.to_dict``)."""
    mesh = dtensor.device_mesh.mesh
    placements: list[dict[str, Any]] = []
    for p in dtensor.placements:
        name = type(p).__name__
        if name == "_StridedShard":
            placements.append({"type": "StridedShard", "dim": p.dim, "split_factor": p.split_factor})
        elif p.is_shard():
            placements.append({"type": "Shard", "dim": p.dim})
        elif p.is_replicate():
            placements.append({"type": "Replicate"})
        else:
            placements.append({"type": name})
    return {"mesh_spec": {"mesh_shape": tuple(mesh.shape), "mesh_data": tuple(mesh.flatten().tolist())},
            "placements": placements}


def _dtensor_pieces(data: Mapping[str, Any], shape: tuple[int, ...], key: str, src: Path) -> list[Piece]:
    """Every mesh rank's piece of a DTensor layout (its local tensor is the piece whole), computed as DTensor
    computes them (``_compute_local_shape_and_global_offset``, as torch_checkpointing's resharder does)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    placements: list[Shard | Replicate] = []
    for spec in data.get("placements", ()):
        kind = spec.get("type") if isinstance(spec, dict) else spec
        if kind == "Shard":
            placements.append(Shard(int(spec["dim"])))
        elif kind == "Replicate":
            placements.append(Replicate())
        else:
            raise FormatError(f"{src}: DTensor {key!r} is placed as {kind!r}; only Shard(d) and Replicate() "
                              "placements are converted (strided sharding is not supported yet)")
    mesh = data.get("mesh_spec", {})
    mesh_shape, ranks = tuple(int(n) for n in mesh.get("mesh_shape", ())), [int(r) for r in mesh.get("mesh_data", ())]
    if len(ranks) != math.prod(mesh_shape) or len(placements) != len(mesh_shape):
        raise FormatError(f"{src}: DTensor {key!r} has mesh {mesh!r} and placements {placements}, which do not agree")
    pieces = []
    for index, rank in enumerate(ranks):
        coordinate = [int(c) for c in np.unravel_index(index, mesh_shape)] if mesh_shape else []
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, coordinate, placements)
        pieces.append(Piece(rank, Box.whole(tuple(local)), Box(tuple(offset), tuple(local))))
    return pieces


def _attributes(leaf: Any) -> Mapping[str, Any]:
    return {name: getattr(leaf, name) for name in CHECKPOINTABLE}


def _boxes(data: Mapping[str, Any], rank: int, key: str, src: Path) -> list[Piece]:
    """A ``CheckpointableTensor``'s pieces: shard ``i`` is ``local[local_offsets[i]:+local_sizes[i]]`` at
    ``global_offsets[i]``."""
    try:
        triples = list(zip(data["global_offsets"], data["local_offsets"], data["local_sizes"], strict=True))
        return [Piece(rank, Box(tuple(map(int, lo)), tuple(map(int, n))), Box(tuple(map(int, go)), tuple(map(int, n))))
                for go, lo, n in triples]
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{src}: the shard geometry of tensor {key!r} on rank {rank} is malformed ({e})") from e


def _check_cover(src: Path, layout: Layout, item: str, key: str, shape: tuple[int, ...], pieces: Sequence[Piece],
                 absent: Sequence[int]) -> None:
    distinct = list(dict.fromkeys(p.target for p in pieces))
    ndim = len(shape)
    offsets = np.array([b.offset for b in distinct], np.int64).reshape(len(distinct), ndim)
    shapes = np.array([b.shape for b in distinct], np.int64).reshape(len(distinct), ndim)
    problem = cover_problem(shape, offsets, shapes)
    if problem is None:
        return
    if problem.what == "gap":
        region = ", ".join(f"{a}:{b}" for a, b in zip(problem.start, problem.stop, strict=True))
        files = sorted({layout.files.get(item, {}).get(r) or rank_file(item, r) for r in absent})
        why = f"the file(s) of rank(s) {sorted(set(absent))} are missing or lack it: {', '.join(files)}" if absent \
            else "no rank's shard holds it"
        raise FormatError(f"{src}: tensor {key!r} of shape {shape} is not covered by its saved shards: region "
                          f"[{region}] is missing ({why}); copy the checkpoint again whole")
    boxes = ", ".join(f"{distinct[i].offset}+{distinct[i].shape}" for i in problem.boxes)
    raise FormatError(f"{src}: tensor {key!r} of shape {shape} has shards that {problem.what} ({boxes}); the "
                      "checkpoint's sharding is inconsistent")
