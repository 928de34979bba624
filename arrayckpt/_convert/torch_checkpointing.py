"""``torch_checkpointing`` checkpoints (PyTorch's checkpointing package: ``CheckpointManager``) to and from
arrayckpt, one tensor at a time.

Into arrayckpt (:func:`from_torch_checkpointing`): every item (``model``, ``optimizer``, ``step``...) is a top-level
key holding what the item held; every tensor becomes ONE global array, assembled from the pieces all ranks' files
hold (``torch_checkpointing_layout.py`` says where they are: ``metadata.pkl``, a DTensor's own placements, a
``CheckpointableTensor``'s boxes, or a plain tensor's replicas), and a tensor whose saved pieces leave a region
uncovered is refused, naming the checkpoint, the tensor, the region and the missing files. Each rank's file is read
with ``torch.load(weights_only=True)`` (memory-mapped; DTensors are admitted), or fully with ``allow_pickle`` (a
tensor subclass of the user's, any class a value pickled). Values other than tensors are taken from the lowest rank
whose file has the item, and stored as arrayckpt values (plain, or pickled with ``allow_pickle``).

Out of it (:func:`to_torch_checkpointing`): the directory ``CheckpointManager().load(dst, into=...)`` loads at world
size 1 with its default configuration: every top-level key is an item saved as ``<item>_0.pt`` (``torch.save``
streamed, one tensor read at a time: ``torch_save.py``), and ``metadata.pkl`` describes every tensor as replicated
on that one rank, as torch_checkpointing's own save writes it when an item declares a ``DefaultResharder`` (so a
resharding load can spread it over more ranks). Per-rank entries are skipped (named in the result).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import math
import os
import pickle
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch

from .._errors import FormatError, PickleNotAllowedError, warn_unpickling
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._read.checkpoint import Checkpoint
from .._torch.state import walk
from .._write.options import SaveOptions
from .._write.stream import write_streaming
from .common import ConvertResult, Progress, nested_state, refuse_existing
from .dcp import new_directory, refuse_pickles
from .torch_checkpointing_layout import (
    METADATA_FILE,
    RANK_FILE,
    Layout,
    NestedPath,
    TensorPlan,
    leaf_at,
    local_tensor,
    rank_file,
    read_layout,
    tensor_plan,
)
from .torch_save import _Deferred, _load_weights_only, _NotStreamable, _release_pages, _write_torch_file

__all__ = ["from_torch_checkpointing", "to_torch_checkpointing"]

FORMAT = "torch_checkpointing"


def from_torch_checkpointing(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
                             allow_pickle: bool = False, progress: Progress | None = None,
                             chunking: ChunkPolicy = DEFAULT_CHUNKING, key_prefix: str = "") -> ConvertResult:
    """A ``torch_checkpointing`` checkpoint directory, saved by any number of ranks, into arrayckpt (the mapping is
    this module's docstring)."""
    directory = Path(src)
    if not directory.is_dir():
        raise FormatError(f"{src}: a torch_checkpointing checkpoint is a directory")
    layout = read_layout(directory)
    states: dict[str, dict[int, object]] = {}
    for item, files in sorted(layout.files.items()):
        if not files:
            raise FormatError(f"{src}: item {item!r} has no file of any rank "
                              f"({', '.join(layout.missing.get(item, ())) or 'none named'}); the checkpoint is "
                              "incomplete")
        states[item] = {rank: _load(directory / name, allow_pickle) for rank, name in sorted(files.items())}
    plans: dict[int, tuple[TensorPlan, str]] = {}  # by id of the meta tensor standing for it in the skeleton
    skeleton: dict[str, object] = {}
    for item, ranks in states.items():
        skeleton[item] = _skeleton(ranks[min(ranks)], (), item, directory, layout, ranks, plans)
        _check_extra_tensors(directory, item, ranks)
    leaves = walk(skeleton).leaves
    used: dict[str, list[torch.Tensor]] = {}

    def fetch(key: str) -> torch.Tensor:
        plan, item = plans[id(leaves[key].value)]
        tensor, used[key] = _assemble(directory, plan, states[item])
        return tensor

    def release(key: str) -> None:
        for local in used.pop(key, ()):
            _release_pages(local)

    options = SaveOptions(overwrite=overwrite, allow_pickle=allow_pickle)
    record = {"format": FORMAT, "world_size": layout.world_size, "metadata": layout.has_metadata}
    write_streaming(skeleton, fetch, dst, options, chunking=chunking, source=f"{FORMAT}: {directory.name}",
                    progress=progress, release=release, created={"source": record}, key_prefix=key_prefix)
    nbytes = sum(torch.empty((), dtype=p.dtype).element_size() * math.prod(p.global_shape) for p, _ in plans.values())
    return ConvertResult(FORMAT, "arrayckpt", len(plans), nbytes, (str(dst),))


@contextlib.contextmanager
def _quiet_mesh() -> Iterator[None]:
    """Unpickling a DTensor rebuilds its ``DeviceMesh`` outside any process group, which torch logs a warning about
    (for torch.compile's sake) on every file: not the user's concern here."""
    logger = logging.getLogger("torch.distributed.device_mesh")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _load(file: Path, allow_pickle: bool) -> object:
    """One rank's file: ``weights_only`` (with DTensor admitted), or fully with ``allow_pickle``."""
    if torch.distributed.is_available():  # registers DTensor, DeviceMesh, Shard... as safe globals
        importlib.import_module("torch.distributed.tensor")
    with _quiet_mesh():
        try:
            return _load_weights_only(file)
        except PickleNotAllowedError as e:
            if not allow_pickle:
                raise PickleNotAllowedError(f"{e}; or convert it with allow_pickle=True (--allow-pickle), only for "
                                            "checkpoints you trust") from None
            warn_unpickling(f"{file}: unpickling it fully")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                return torch.load(file, map_location="cpu", weights_only=False, mmap=True)


def _skeleton(value: object, path: NestedPath, item: str, src: Path, layout: Layout, ranks: Mapping[int, object],
              plans: dict[int, tuple[TensorPlan, str]]) -> object:
    """``value`` (the lowest rank's) as nested dicts, lists and tuples, every tensor a meta tensor of its global
    shape whose plan ``plans`` keeps."""
    if isinstance(value, torch.Tensor):
        key = ".".join(str(p) for p in (item, *path))
        plan = tensor_plan(src, layout, ranks, item, path, key)
        meta = torch.empty(plan.global_shape, dtype=plan.dtype, device="meta")
        plans[id(meta)] = (plan, item)
        return meta
    if isinstance(value, dict):
        return {k: _skeleton(v, (*path, k), item, src, layout, ranks, plans) for k, v in value.items()}
    if isinstance(value, list):
        return [_skeleton(v, (*path, i), item, src, layout, ranks, plans) for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_skeleton(v, (*path, i), item, src, layout, ranks, plans) for i, v in enumerate(value))
    return value


def _tensor_paths(value: object, path: NestedPath = ()) -> Iterator[NestedPath]:
    if isinstance(value, torch.Tensor):
        yield path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensor_paths(v, (*path, k))
    elif isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        for i, v in enumerate(value):
            yield from _tensor_paths(v, (*path, i))


def _check_extra_tensors(src: Path, item: str, ranks: Mapping[int, object]) -> None:
    """A tensor only other ranks than the lowest saved would be lost: refuse it, naming it."""
    first = min(ranks)
    for rank, state in ranks.items():
        if rank == first:
            continue
        for path in _tensor_paths(state):
            if not isinstance(leaf_at(ranks[first], path), torch.Tensor):
                name = ".".join(str(p) for p in (item, *path))
                raise FormatError(f"{src}: tensor {name!r} is in rank {rank}'s file but not in rank {first}'s; the "
                                  "ranks saved different structures, which one arrayckpt checkpoint cannot hold")


def _assemble(src: Path, plan: TensorPlan, ranks: Mapping[int, object]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The global tensor of ``plan``, each region copied from the first rank holding it (and the local tensors read,
    whose pages are released once it is written)."""
    out = torch.empty(plan.global_shape, dtype=plan.dtype)
    filled: dict[object, int] = {}
    locals_: list[torch.Tensor] = []
    for piece in plan.pieces:
        local = local_tensor(leaf_at(ranks[piece.rank], plan.path))  # type: ignore[arg-type]
        locals_.append(local)
        if local.dtype != plan.dtype or any(o + n > s for o, n, s in zip(piece.local.offset, piece.local.shape,
                                                                         local.shape, strict=True)):
            raise FormatError(f"{src}: tensor {plan.key!r} on rank {piece.rank} is {tuple(local.shape)} "
                              f"{local.dtype}, which does not hold its shard {piece.local.offset}+{piece.local.shape} "
                              f"of {plan.dtype}; the file does not match the checkpoint's metadata")
        data = local[piece.local.slices()]
        if piece.target in filled:
            if plan.check_replicas and not _same_bits(out[piece.target.slices()], data):
                raise FormatError(f"{src}: tensor {plan.key!r} differs between rank {filled[piece.target]} and rank "
                                  f"{piece.rank}, and no metadata.pkl says how it is split; save it with a resharder "
                                  "(ItemSpec(resharder=DefaultResharder())) so that torch_checkpointing records its "
                                  "sharding")
            continue
        out[piece.target.slices()] = data
        filled[piece.target] = piece.rank
    return out, locals_


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def to_torch_checkpointing(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
                           progress: Progress | None = None) -> ConvertResult:
    """An arrayckpt checkpoint into a ``torch_checkpointing`` directory of one rank (the mapping is this module's
    docstring), each item's tensors read only when written; written aside and switched into place whole
    (``dcp.py::new_directory``), so a kill leaves the old directory or the new one."""
    target = Path(dst)
    if target.exists() and any(target.iterdir()):
        refuse_existing(target, overwrite)
    refuse_pickles(checkpoint)
    state, skipped = nested_state(checkpoint, lambda key: _Deferred(checkpoint, key))
    for item in state:
        if not isinstance(item, str) or not item or "/" in item or "\0" in item or item in (".", ".."):
            raise FormatError(f"{checkpoint.location}: top-level key {item!r} cannot name a torch_checkpointing item "
                              "file (<item>_0.pt)")
    total = checkpoint.nbytes
    done = 0

    def advance(offset: int) -> Callable[[int, int], None] | None:
        return None if progress is None else lambda n, _: progress(offset + n, total)

    with new_directory(target, _owned, [METADATA_FILE]) as temporary:
        for item, value in state.items():
            file = temporary / rank_file(item, 0)
            try:
                _write_torch_file(value, file, advance(done))
            except _NotStreamable:
                file.unlink(missing_ok=True)
                torch.save(nested_state(checkpoint, lambda key: checkpoint[key].torch())[0][item], file)
            done += sum(int(leaf.nbytes) for _, leaf in _leaves(value))
        (temporary / METADATA_FILE).write_bytes(pickle.dumps(_metadata(state)))
    files = tuple(sorted(str(p) for p in target.iterdir()))
    keys = [k for k in checkpoint.manifest.entries if checkpoint.manifest.array_entry(k) is not None]
    return ConvertResult("arrayckpt", FORMAT, len(keys), total, files, skipped)


def _owned(name: str) -> bool:
    """A file of a torch_checkpointing checkpoint (what an earlier export, or its own save, wrote)."""
    return name == METADATA_FILE or RANK_FILE.fullmatch(name) is not None


def _metadata(state: Mapping[str, object]) -> dict[str, object]:
    """``DistributedMetadata.to_dict()`` of one rank holding every tensor whole: each a replicated DTensor on a mesh
    of that rank, as torch_checkpointing's ``DefaultResharder`` describes a plain tensor (its walk goes into every
    mapping and sequence)."""
    mesh = {"device_type": "cpu", "mesh_shape": (1,), "mesh_data": (0,), "mesh_dim_names": None}
    items: dict[str, object] = {}
    for item, value in state.items():
        described = {}
        for path, leaf in _leaves(value):
            shape = tuple(leaf.shape)
            stride = [math.prod(shape[d + 1:]) for d in range(len(shape))]
            data = {"global_shape": list(shape), "dtype": str(leaf.dtype), "stride": stride, "mesh_spec": mesh,
                    "placements": [{"type": "Replicate"}]}
            text = json.dumps(list(path), separators=(",", ":"))  # distributed_metadata._serialize_nested_path
            described[text] = [{"sharding_metadata": {"type": "DTensorShardingMetadata", "data": data},
                                "ranks": (0,)}]
        if described:
            items[item] = {"nested_path_to_metadata": described, "rank_to_layout_info": {0: None}}
    return {"metadata": items, "world_size": 1, "version": "2.0"}


def _leaves(value: object, path: NestedPath = ()) -> Iterator[tuple[NestedPath, _Deferred | torch.Tensor]]:
    if isinstance(value, (_Deferred, torch.Tensor)):
        yield path, value
    elif isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
