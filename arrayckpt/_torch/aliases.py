"""Which array leaves of a state are one tensor: tied weights, stored once (spec §5.1, "Aliases").

``nn.Module.state_dict()`` returns a tied parameter under each of its names (GPT-2's ``transformer.wte.weight`` and
``lm_head.weight``): two tensor objects, ``detach()``-ed views of one parameter, so object identity cannot tell.
Two leaves are one tensor when they are the same view of the same memory: the same untyped storage (same device and
data pointer), storage offset, shape, strides, dtype and conjugate/negative bits. A view of part of a tensor, a
transpose or a reinterpreted dtype is another tensor and is stored separately. DTensors are one tensor when their
local tensors are, and their global shape, placements and device mesh are equal too; ``arrayckpt.Shard``\\ s when
their local tensors are and they describe the same box. Each rank decides this for its own leaves; the coordinator
aliases a key only where every rank holding it agrees (``_layout/planner.py``).

Tensors without memory (meta tensors, tensors whose storage has no bytes) are one tensor only when they are the
same object: their data pointers say nothing (a converter's skeleton of meta tensors stands for a tied tensor with
one object). numpy arrays are not considered.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import torch

from .shards import Shard, _is_dtensor

__all__ = ["find_aliases", "same_tensor", "tensor_identity"]


def _memory(tensor: torch.Tensor) -> Hashable | None:
    """The memory a plain strided tensor views, exactly (``None`` for one without memory of its own)."""
    if tensor.layout != torch.strided or tensor.device.type == "meta" or _is_dtensor(tensor):
        return None
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass or functional wrapper without a storage
        return None
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        return None
    return (str(tensor.device), storage.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
            tensor.dtype, tensor.is_conj(), tensor.is_neg())


MeshMemo = dict[int, tuple[Any, Hashable]]  # id(device mesh) -> (the mesh, kept alive; its description)


def _mesh(mesh: Any, memo: MeshMemo | None = None) -> Hashable:
    """A device mesh as a hashable value. ``DeviceMesh.mesh`` builds a tensor on every access (0.1–1 ms), and a
    model's hundreds of DTensors share one or two meshes: ``memo`` keeps each mesh's description for one call."""
    kept = memo.get(id(mesh)) if memo is not None else None
    if kept is not None and kept[0] is mesh:
        return kept[1]
    ranks = mesh.mesh
    described = (mesh.device_type, tuple(ranks.shape), tuple(ranks.flatten().tolist()))
    if memo is not None:
        memo[id(mesh)] = (mesh, described)
    return described


def tensor_identity(value: object, memo: MeshMemo | None = None) -> Hashable | None:
    """What two array leaves of one state share exactly when they are one tensor (see the module docstring); ``None``
    for a leaf that is never an alias (not a tensor, a DTensor or Shard without memory). ``memo``: see ``_mesh``."""
    if isinstance(value, Shard):
        local = _memory(value.tensor)
        return None if local is None else ("shard", local, value.global_shape, value.global_offset, value.replica_id)
    if _is_dtensor(value):
        local = _memory(value.to_local())  # type: ignore[attr-defined]
        if local is None:
            return None
        return ("dtensor", local, tuple(value.shape), tuple(value.placements),  # type: ignore[attr-defined]
                _mesh(value.device_mesh, memo))  # type: ignore[attr-defined]
    if isinstance(value, torch.Tensor):
        memory = _memory(value)
        return memory if memory is not None or _is_dtensor(value) else ("object", id(value))
    return None


def same_tensor(a: object, b: object) -> bool:
    """Whether two leaves are one tensor (tied): filling one fills the other."""
    identity = tensor_identity(a)
    return identity is not None and identity == tensor_identity(b)


def find_aliases(leaves: Mapping[str, object]) -> dict[str, str]:
    """For the array leaves of one rank's state (by dotted key, in walk order): every key whose leaf is one tensor
    with an earlier key's, mapped to the first such key (the target, which stores it)."""
    first: dict[Hashable, str] = {}
    out: dict[str, str] = {}
    memo: MeshMemo = {}
    for key, value in leaves.items():
        identity = tensor_identity(value, memo)
        if identity is None:
            continue
        target = first.setdefault(identity, key)
        if target != key:
            out[key] = target
    return out
