"""Shard descriptions: which box of a global tensor this rank holds, from DTensor, explicit ``Shard``, or a tensor
implementing the ``CheckpointableTensor`` protocol (``torch_checkpointing``'s, which torch is to carry too).

Every array leaf of the state becomes a :class:`LocalPiece` (its global shape, the box this rank holds, and
whether this rank's copy is a replica); the coordinator only ever sees these metadata, never data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

import torch

from .._errors import StateError
from .._layout.box import Box

__all__ = ["CheckpointableTensor", "LocalPiece", "PerRank", "Shard", "is_checkpointable", "local_piece", "to_local_box"]


@dataclass(frozen=True)
class Shard:
    """This rank's piece of a global tensor, for frameworks without DTensor (Megatron-style TP/PP/DP).

    ``Shard(local, global_shape=(1024, 512), global_offset=(256, 0))`` says ``local`` holds rows
    256..256+local.shape[0] of a 1024x512 tensor.

    Args:
        tensor: this rank's piece (saved from, or loaded into).
        global_shape: the shape of the whole tensor.
        global_offset: where ``tensor`` starts in it, one index per dimension.
        replica_id: ranks holding the same piece as data-parallel replicas give it distinct ids (0 for the primary
            copy); replicas are stored once.

    Raises:
        StateError: the piece does not fit in ``global_shape`` at ``global_offset``.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.arange(12.0).reshape(4, 3)}, path)  # saved whole, from one rank
        >>> rows = torch.zeros(2, 3)  # this rank's rows 2..3 of the 4x3 weight (the shards of a save cover it all)
        >>> _ = arrayckpt.load({"w": arrayckpt.Shard(rows, global_shape=(4, 3), global_offset=(2, 0))}, path)
        >>> rows
        tensor([[ 6.,  7.,  8.],
                [ 9., 10., 11.]])
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(n) for n in self.global_shape))
        object.__setattr__(self, "global_offset", tuple(int(n) for n in self.global_offset))
        ndim = self.tensor.dim()
        if len(self.global_shape) != ndim or len(self.global_offset) != ndim:
            raise StateError(
                f"Shard: tensor has {ndim} dims but global_shape {self.global_shape} and global_offset "
                f"{self.global_offset} must have one entry per dimension"
            )
        for o, n, g in zip(self.global_offset, self.tensor.shape, self.global_shape, strict=True):
            if o < 0 or o + n > g:
                raise StateError(
                    f"Shard: local shape {tuple(self.tensor.shape)} at offset {self.global_offset} does not fit "
                    f"in global shape {self.global_shape}"
                )


@dataclass(frozen=True)
class PerRank:
    """A value saved separately for every rank (RNG state, data-loader position) and restored to its rank.

    Loading at another world size than the save's needs the target to name the rank to take the value from, or a
    ``per_rank=`` policy of :func:`arrayckpt.load` (a plain value that differs between ranks is saved per rank too,
    without this wrapper).

    Args:
        value: this rank's value (on load: the target, filled in place when a tensor, else replaced).
        rank: on load: take this saved rank's value instead of the loading rank's.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"rng": arrayckpt.PerRank(torch.get_rng_state())}, path)
        >>> state = {"rng": arrayckpt.PerRank(None, rank=0)}
        >>> _ = arrayckpt.load(state, path)
        >>> torch.set_rng_state(state["rng"].value)
    """

    value: Any
    rank: int | None = None  # on load: take this saved rank's value instead of the loading rank's


@dataclass(frozen=True)
class LocalPiece:
    """What one rank holds of one array leaf: the global shape, its box, and its replica index."""

    global_shape: tuple[int, ...]
    box: Box
    replica_id: int
    tensor: torch.Tensor  # the local data, shaped like ``box``


@runtime_checkable
class CheckpointableTensor(Protocol):
    """A local tensor saying which boxes of a global tensor it holds (``torch_checkpointing.CheckpointableTensor``,
    the protocol torch 2.14 is to carry): shard ``i`` is ``tensor[local_offsets[i]:+local_sizes[i]]``, at
    ``global_offsets[i]`` of a tensor of ``global_shape``. Recognised by these four attributes (duck typing), so that
    neither package is needed to save or load one; such a tensor is saved and loaded as a :class:`Shard` is.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> class Rows(torch.Tensor):  # rows 2..3 of a 4x3 tensor, as a framework's local tensor would say
        ...     global_shape, global_offsets, local_offsets, local_sizes = (4, 3), ((2, 0),), ((0, 0),), ((2, 3),)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.arange(12.0).reshape(4, 3)}, path)
        >>> rows = torch.zeros(2, 3).as_subclass(Rows)
        >>> _ = arrayckpt.load({"w": rows}, path)
        >>> rows.as_subclass(torch.Tensor)
        tensor([[ 6.,  7.,  8.],
                [ 9., 10., 11.]])
    """

    global_shape: Sequence[int]
    global_offsets: Sequence[Sequence[int]]  # one per shard
    local_offsets: Sequence[Sequence[int]]
    local_sizes: Sequence[Sequence[int]]


def is_checkpointable(value: object) -> bool:
    """Whether ``value`` is a tensor implementing :class:`CheckpointableTensor` (ours, or torch's where it has one)."""
    if not isinstance(value, torch.Tensor):
        return False
    theirs = getattr(torch, "CheckpointableTensor", None)
    return isinstance(value, CheckpointableTensor) or (isinstance(theirs, type) and isinstance(value, theirs))


def _is_dtensor(value: object) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "placements")


PlacementMemo = dict[tuple[int, tuple[Any, ...], tuple[int, ...]], tuple[Any, Box, int]]
"""(id(mesh), placements, global shape) -> (the mesh, kept alive; this rank's box; its replica id)."""


def local_piece(value: torch.Tensor | Shard, key: str, rank: int, memo: PlacementMemo | None = None) -> LocalPiece:
    """This rank's piece of an array leaf. Plain tensors are whole copies, replicated across ranks. ``memo`` keeps,
    for one call over a state, the box of each DTensor layout met (a model's tensors share a few: computing one
    costs 50 µs to 0.5 ms)."""
    if isinstance(value, Shard):
        return LocalPiece(value.global_shape, Box(value.global_offset, tuple(value.tensor.shape)), value.replica_id,
                          value.tensor)
    if _is_dtensor(value):
        return _dtensor_piece(value, key, memo)
    if is_checkpointable(value):
        return _checkpointable_piece(value, key)
    shape = tuple(value.shape)
    return LocalPiece(shape, Box.whole(shape), rank, value)


def _checkpointable_piece(value: torch.Tensor, key: str) -> LocalPiece:
    """The one shard a :class:`CheckpointableTensor` holds, as a :class:`Shard` would say it (replica 0); none: an
    empty piece, as a rank outside a DTensor's mesh holds. Several shards in one local tensor would be several pieces
    of one key on one rank, which the save plan does not have: refused."""
    described = cast(CheckpointableTensor, value)  # (is_checkpointable said so)
    attributes = (described.global_shape, described.global_offsets, described.local_offsets, described.local_sizes)
    try:
        global_shape = tuple(int(n) for n in attributes[0])
        shards = [tuple(tuple(int(n) for n in box) for box in triple)
                  for triple in zip(attributes[1], attributes[2], attributes[3], strict=True)]
    except (TypeError, ValueError) as e:
        raise StateError(f"{key!r}: its CheckpointableTensor attributes (global_shape, global_offsets, local_offsets, "
                         f"local_sizes) are not shapes and one offset/size per shard: {e}") from e
    local = value.as_subclass(torch.Tensor)
    if not shards:
        empty = (0,) * len(global_shape)
        return LocalPiece(global_shape, Box(empty, empty), 1, local[tuple(slice(0, 0) for _ in global_shape)])
    if len(shards) > 1:
        raise StateError(f"{key!r}: a CheckpointableTensor holding {len(shards)} shards on one rank is not supported "
                         "yet (a save holds one piece of each key per rank); give each rank one shard per tensor")
    global_offset, local_offset, size = shards[0]
    box = Box(local_offset, size)
    if len(size) != len(global_shape) or len(local_offset) != local.dim() or \
            any(o + n > s for o, n, s in zip(box.offset, box.shape, local.shape, strict=True)):
        raise StateError(f"{key!r}: its CheckpointableTensor shard at {local_offset} of size {size} does not fit in "
                         f"its local tensor of shape {tuple(local.shape)}")
    if len(global_offset) != len(global_shape) or \
            any(o < 0 or o + n > g for o, n, g in zip(global_offset, size, global_shape, strict=True)):
        raise StateError(f"{key!r}: its CheckpointableTensor shard of size {size} at {global_offset} does not fit in "
                         f"its global shape {global_shape}")
    return LocalPiece(global_shape, Box(global_offset, size), 0, local[box.slices()])


def to_local_box(value: Any, key: str) -> tuple[tuple[int, ...], Box, torch.Tensor]:
    """For load: (global shape, box this rank needs, local tensor to fill) of a target leaf."""
    piece = local_piece(value, key, 0)
    return piece.global_shape, piece.box, piece.tensor


def _dtensor_piece(value: Any, key: str, memo: PlacementMemo | None) -> LocalPiece:
    mesh, placements = value.device_mesh, value.placements
    global_shape = tuple(value.shape)
    slot = (id(mesh), tuple(placements), global_shape)
    kept = memo.get(slot) if memo is not None else None
    if kept is None or kept[0] is not mesh:
        kept = (mesh, *_dtensor_box(mesh, placements, global_shape, key))
        if memo is not None:
            memo[slot] = kept
    return LocalPiece(global_shape, kept[1], kept[2], value.to_local())


def _dtensor_box(mesh: Any, placements: Any, global_shape: tuple[int, ...], key: str) -> tuple[Box, int]:
    """This rank's box of a DTensor layout, and its replica id (1, with an empty box, outside the mesh)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for placement in placements:
        if type(placement).__name__ == "_StridedShard":
            raise StateError(f"DTensor {key!r} uses strided sharding ({placement}), which is not supported yet")
        if not isinstance(placement, (Replicate, DShard)):
            raise StateError(f"DTensor {key!r} has placement {placement}; only Shard(d) and Replicate() can be "
                             "saved (reduce Partial placements with .redistribute() first)")
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the tensor's mesh: it holds nothing
        return Box((0,) * len(global_shape), (0,) * len(global_shape)), 1
    local_shape, offset = compute_local_shape_and_global_offset(global_shape, mesh, placements)
    replica_id = 0
    for dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            replica_id = replica_id * mesh.size(dim) + coordinate[dim]
    return Box(tuple(offset), tuple(local_shape)), replica_id
