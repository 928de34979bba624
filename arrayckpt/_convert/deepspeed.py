"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3, any data-parallel degree) into arrayckpt, one parameter at a time.

What comes out (every parameter under the name the module gives it)::

    model.<name>              trainable parameters: the fp32 master weights, the ranks' partitions joined and the
                              padding stripped; frozen parameters and buffers: as the module holds them (dtype kept)
    optim.state.<name>.<k>    the optimizer state of each trainable parameter (``exp_avg``, ``exp_avg_sq``, or what
                              the optimizer keeps: joined like the master weights; ``step``: its group's step, a
                              0-d array where the optimizer keeps a tensor (torch's), a plain int where it keeps an
                              int (DeepSpeed's FusedAdam, DeepSpeedCPUAdam))
    optim.param_groups        the optimizer's hyper-parameters, each group's ``params`` given as parameter names
    deepspeed.<k>             DeepSpeed's own bookkeeping: ``global_steps``, ``global_samples``, ``skipped_steps``,
                              ``dp_world_size``, ``ds_config``, ``ds_version``, ``lr_scheduler``, ``zero_stage``,
                              ``loss_scaler`` (its attributes), ``clip_grad``, ``buffer_names``, ``shared_params``,
                              ``tag``...
    client.<k>                the ``client_state`` given to ``engine.save_checkpoint``

With mixed precision the module's bf16/fp16 weights are not kept: DeepSpeed sets them from the master weights
after every step (``update_lp_params``: ``bit16.copy_(fp32)``), so they are ``model.<name>`` cast to the module's
dtype, bit for bit. A tied parameter (``shared_params``: GPT-2's ``lm_head.weight`` -> ``transformer.wte.weight``)
is stored once, its other name an alias of it (spec §5.1), as ``arrayckpt.save`` stores a tied module's state
dict. ``model.*`` equals what DeepSpeed's ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint``
returns (which also casts floating buffers to fp32; here they keep their dtype).

The partitions are unflattened only from DeepSpeed's own mapping metadata, exactly as its ``utils/zero_to_fp32.py``
does, with every count checked instead of guessed:

- ZeRO 1 and 2 (``_zero2_merge_trainable_params``): a param group's flat buffer is its parameters in
  ``param_shapes[g]`` order, each followed by ``param_alignment_paddings[g][i]``; rank ``r`` saved its partition
  with the tail padding cut off (``single_partition_of_fp32_groups[g]``; ``group_paddings[g]`` elements cut), so
  the ranks' partitions joined are the flat buffer without its tail padding: their total must equal the
  parameters plus their paddings exactly, and each rank's ``param_slice_mappings`` must agree. The optimizer state
  (``base_optimizer_state``: the base optimizer's ``state_dict`` with padded partitions, or, with
  ``elastic_checkpoint``, per-group states without padding) lines up with the master partitions.
- ZeRO 3 (``_zero3_merge_trainable_params``): every parameter is partitioned on its own into ``world_size`` parts
  of ``ceil(numel / world_size)``, the last padded; rank ``r``'s flat group ``j`` (``fp32_flat_groups[j]``, one
  per sub-group, as ``param_shapes[j]``) is its parts of the sub-group's parameters in order, and
  ``optimizer_state_dict['state'][j]`` its optimizer state. Frozen parameters are partitioned the same way
  (``frozen_param_fragments`` of each rank's model states).

Memory stays near the largest parameter: files are memory-mapped, a parameter's pieces are read from the rank
partitions that hold it and written, and their pages dropped. Everything is read and checked before anything is
written; a failed write leaves nothing (``write_streaming``).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from .._errors import FormatError
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._write.options import SaveOptions
from .._write.stream import write_streaming
from .common import ConvertResult, Progress
from .deepspeed_files import (
    DEEPSPEED_KEYS,
    LAYOUT_KEYS,
    OPTIMIZER_KEYS,
    FragmentAddress,
    ZeroFiles,
    find_zero_files,
    load_pt,
    model_states_file,
    plain_scaler,
    tag_directory,
)
from .deepspeed_universal_read import from_universal, is_universal
from .torch_save import _release_pages

__all__ = ["FlatParam", "Piece", "from_deepspeed", "zero12_layout", "zero3_layout"]



@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of rank ``rank``'s flat partition of group ``group``."""

    rank: int
    group: int
    start: int
    stop: int


@dataclass(frozen=True)
class FlatParam:
    """A trainable parameter: its shape and, in order, the pieces of rank partitions that make it up."""

    name: str
    shape: tuple[int, ...]
    group: int
    pieces: tuple[Piece, ...]


def _shape(value: object, what: str) -> tuple[int, ...]:
    shape = tuple(value) if isinstance(value, (torch.Size, tuple, list)) else None
    if shape is None or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise FormatError(f"{what}: shape {value!r} is not a list of sizes")
    return shape


def zero12_layout(param_shapes: list[dict[str, object]], paddings: list[list[int]] | None,
                  lean_sizes: list[list[int]], where: str) -> list[FlatParam]:
    """ZeRO 1/2: the pieces of every parameter, from ``param_shapes``, ``param_alignment_paddings`` and the sizes
    of the ranks' unpadded partitions (``lean_sizes[rank][group]``); the sizes must add up exactly."""
    out = []
    for g, shapes in enumerate(param_shapes):
        sizes = [sizes_of_rank[g] for sizes_of_rank in lean_sizes]
        bounds = [0, *itertools.accumulate(sizes)]
        pads = paddings[g] if paddings is not None else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise FormatError(f"{where}: group {g} has {len(shapes)} parameters but {len(pads)} alignment paddings")
        offset = 0
        for (name, raw), pad in zip(shapes.items(), pads, strict=True):
            shape = _shape(raw, f"{where}: parameter {name!r}")
            end = offset + math.prod(shape)
            pieces = tuple(Piece(r, g, max(offset, bounds[r]) - bounds[r], min(end, bounds[r + 1]) - bounds[r])
                           for r in range(len(sizes)) if max(offset, bounds[r]) < min(end, bounds[r + 1]))
            out.append(FlatParam(name, shape, g, pieces))
            offset = end + pad
        if offset != bounds[-1]:
            raise FormatError(f"{where}: param group {g}'s parameters and paddings hold {offset} elements, but the "
                              f"{len(sizes)} ranks' partitions hold {bounds[-1]} ({sizes}); the partitions do not "
                              "match the parameter shapes")
    return out


def zero3_layout(param_shapes: list[dict[str, object]], flat_sizes: list[list[int]], where: str) -> list[FlatParam]:
    """ZeRO 3: the pieces of every parameter, each split into ``world_size`` parts of ``ceil(numel / world)``;
    every rank's flat sub-group ``j`` must hold exactly its parts of ``param_shapes[j]``."""
    world = len(flat_sizes)
    if any(len(sizes) != len(param_shapes) for sizes in flat_sizes):
        raise FormatError(f"{where}: {len(param_shapes)} parameter sub-groups, but the ranks hold "
                          f"{[len(s) for s in flat_sizes]} flat groups")
    out = []
    for j, shapes in enumerate(param_shapes):
        offset = 0
        for name, raw in shapes.items():
            shape = _shape(raw, f"{where}: parameter {name!r}")
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            pieces = tuple(Piece(r, j, offset, offset + min(part, numel - r * part))
                           for r in range(world) if numel - r * part > 0)
            out.append(FlatParam(name, shape, j, pieces))
            offset += part
        for r in range(world):
            if flat_sizes[r][j] != offset:
                raise FormatError(f"{where}: rank {r}'s flat group {j} holds {flat_sizes[r][j]} elements, but its "
                                  f"parameters' partitions need {offset}; the partitions do not match the shapes")
    return out


@dataclass
class _Partitions:
    """Every rank's flat master partitions and optimizer state per flat group, and the group-wide values."""

    masters: list[list[torch.Tensor]]            # [rank][group], 1-D, unpadded where DeepSpeed cut the padding
    states: list[list[dict[str, torch.Tensor]]]  # [rank][group] -> partitioned state, aligned with masters
    scalars: list[dict[str, object]]             # [group] -> state values of the whole group (step)
    param_groups: list[dict[str, Any]] | None    # the base optimizer's param groups ("params": flat indices)


def _partitions(optim: list[dict[str, Any]], files: list[Path], zero3: bool) -> _Partitions:
    masters: list[list[torch.Tensor]] = []
    states: list[list[dict[str, torch.Tensor]]] = []
    scalars: list[dict[str, object]] = []
    for rank, (sd, file) in enumerate(zip(optim, files, strict=True)):
        if zero3:
            flat = sd.get("fp32_flat_groups")
            base = (sd.get("optimizer_state_dict") or {}).get("state")
            per_group = [base.get(j, {}) for j in range(len(flat))] if isinstance(base, dict) and \
                isinstance(flat, list) else None
            padded = [t.numel() for t in flat] if isinstance(flat, list) else []
        else:
            flat = sd.get("single_partition_of_fp32_groups")
            base = sd.get("base_optimizer_state")
            paddings = sd.get("group_paddings") or [0] * len(flat or [])
            if isinstance(base, dict):  # rigid: the base optimizer's state_dict, partitions with their padding
                per_group = [base.get("state", {}).get(g, {}) for g in range(len(flat or []))]
                padded = [t.numel() + p for t, p in zip(cast("list[torch.Tensor]", flat), paddings, strict=True)]
            else:  # elastic_checkpoint: one state dict per group, padding already cut
                per_group = base if isinstance(base, list) else None
                padded = [t.numel() for t in flat] if isinstance(flat, list) else []
        if not isinstance(flat, list) or not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in flat) \
                or per_group is None or len(per_group) != len(flat):
            raise FormatError(f"{file}: not the optimizer layout of a ZeRO {'3' if zero3 else '1/2'} checkpoint "
                              "(flat fp32 partitions and one optimizer state per partition)")
        masters.append(flat)
        rank_states = []
        for g, (state, size) in enumerate(zip(per_group, padded, strict=True)):
            if len(scalars) <= g:
                scalars.append({})
            split: dict[str, torch.Tensor] = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if value.dim() != 1 or value.numel() != size:
                        raise FormatError(f"{file}: optimizer state {key!r} of group {g} has shape "
                                          f"{list(value.shape)}, not the partition's ({size},)")
                    split[str(key)] = value[:flat[g].numel()]
                elif rank == 0:
                    scalars[g][str(key)] = value
                elif not _same(scalars[g].get(str(key)), value):
                    raise FormatError(f"{file}: optimizer state {key!r} of group {g} is {value!r} on rank {rank} "
                                      f"but {scalars[g].get(str(key))!r} on rank 0")
            if rank and sorted(split) != sorted(states[0][g]):
                raise FormatError(f"{file}: group {g}'s optimizer state has {sorted(split)}, rank 0's has "
                                  f"{sorted(states[0][g])}")
            rank_states.append(split)
        states.append(rank_states)
    base0 = optim[0].get("optimizer_state_dict") if zero3 else optim[0].get("base_optimizer_state")
    groups = base0.get("param_groups") if isinstance(base0, dict) else None
    return _Partitions(masters, states, scalars, groups if isinstance(groups, list) else None)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    return type(a) is type(b) and a == b


def _check_slice_mappings(params: list[FlatParam], optim: list[dict[str, Any]], files: list[Path]) -> None:
    """ZeRO 1/2: each rank's own ``param_slice_mappings`` (where each parameter's piece sits in its partition)
    must be what the layout computed from the shapes says."""
    for rank, (sd, file) in enumerate(zip(optim, files, strict=True)):
        mappings = sd.get("param_slice_mappings")
        if not isinstance(mappings, list):
            continue
        for param in params:
            for piece in param.pieces:
                if piece.rank != rank or piece.group >= len(mappings):
                    continue
                got = mappings[piece.group].get(param.name)
                expected = (piece.start, piece.stop - piece.start)
                if not isinstance(got, FragmentAddress) or (got.start, got.numel) != expected:
                    found = (got.start, got.numel) if isinstance(got, FragmentAddress) else got
                    raise FormatError(f"{file}: param_slice_mappings place {param.name!r} at (start, numel) "
                                      f"{found}, the shapes and paddings at {expected}; the checkpoint is inconsistent")


def from_deepspeed(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
                   allow_pickle: bool = False, progress: Progress | None = None,
                   chunking: ChunkPolicy = DEFAULT_CHUNKING, key_prefix: str = "") -> ConvertResult:
    """A DeepSpeed ZeRO checkpoint (its directory, whose ``latest`` names the tag, or a tag directory) into
    arrayckpt; the keys are in this module's docstring. A Universal Checkpoint (a tag directory with
    ``zero/optimizer_state.pt``, or a directory whose ``latest_universal`` names one) goes to
    ``deepspeed_universal_read.py``, which gives the same keys."""
    root = Path(src)
    if not root.is_dir():
        raise FormatError(f"{src}: not a directory; give a DeepSpeed checkpoint or tag directory")
    tag_dir = tag_directory(root)
    if is_universal(tag_dir):
        return from_universal(tag_dir, dst, overwrite=overwrite, allow_pickle=allow_pickle, progress=progress,
                              chunking=chunking, key_prefix=key_prefix)
    first = load_pt(model_states_file(tag_dir), mmap=True)
    files = find_zero_files(tag_dir, first)
    models = [first, *(load_pt(f, mmap=True) for f in files.model_files[1:])]
    optim = [load_pt(f, mmap=True) for f in files.optim_files]
    optim = [_optimizer_dict(sd, f) for sd, f in zip(optim, files.optim_files, strict=True)]
    stage = optim[0].get("zero_stage")
    zero3 = files.partitioned_weights
    if stage not in ((3,) if zero3 else (1, 2)):
        raise FormatError(f"{files.optim_files[0]}: zero_stage {stage!r} does not match the files' layout "
                          f"(ZeRO {'3' if zero3 else '1/2'}); only ZeRO stages 1, 2 and 3 are converted")
    counts = [sd.get("partition_count") for sd in optim]
    for count, file in zip(counts, files.optim_files, strict=True):
        if any(c != files.world_size for c in (count if isinstance(count, list) else [count])):
            raise FormatError(f"{file}: partition_count {count!r}, but the tag has {files.world_size} ranks "
                              "(dp_world_size); mismatched partition counts (MoE or mixed files) are not converted")
    parts = _partitions(optim, list(files.optim_files), zero3)
    shapes = first.get("param_shapes")
    if not isinstance(shapes, list) or not all(isinstance(s, dict) for s in shapes):
        raise FormatError(f"{files.model_files[0]}: no param_shapes; not a ZeRO checkpoint's model states")
    where = str(tag_dir)
    if zero3:
        params = zero3_layout(shapes, [[t.numel() for t in m] for m in parts.masters], where)
    else:
        params = zero12_layout(shapes, optim[0].get("param_alignment_paddings"),
                               [[t.numel() for t in m] for m in parts.masters], where)
        _check_slice_mappings(params, optim, list(files.optim_files))
    skeleton, fetchers = _skeleton(params, parts, models, files, zero3)
    skeleton["deepspeed"] = {k: first[k] for k in DEEPSPEED_KEYS if k in first} | \
        {k: plain_scaler(optim[0][k]) for k in OPTIMIZER_KEYS if k in optim[0]} | {"tag": tag_dir.name}
    client = {k: v for k, v in first.items() if k not in DEEPSPEED_KEYS and k not in LAYOUT_KEYS}
    if client:
        skeleton["client"] = client

    def fetch(key: str) -> torch.Tensor:
        return fetchers[key][0]()

    def release(key: str) -> None:
        for tensor in fetchers[key][1]:
            _release_pages(tensor)

    options = SaveOptions(overwrite=overwrite, allow_pickle=allow_pickle,
                          step=first.get("global_steps") if isinstance(first.get("global_steps"), int) else None)
    write_streaming(skeleton, fetch, dst, options, chunking=chunking, source=f"deepspeed: {tag_dir.name}",
                    progress=progress, release=release, key_prefix=key_prefix)
    metas = list({id(m): m for m in _leaves(skeleton) if isinstance(m, torch.Tensor)}.values())  # a tie once
    return ConvertResult("deepspeed", "arrayckpt", len(metas), sum(m.numel() * m.element_size() for m in metas),
                         (str(dst),))


def _optimizer_dict(sd: dict[str, Any], file: Path) -> dict[str, Any]:
    inner = sd.get("optimizer_state_dict")
    if not isinstance(inner, dict):
        raise FormatError(f"{file}: no optimizer_state_dict; not a ZeRO optimizer-state file")
    return inner


def _leaves(node: object) -> list[object]:
    if isinstance(node, dict):
        return [leaf for value in node.values() for leaf in _leaves(value)]
    if isinstance(node, (list, tuple)):
        return [leaf for value in node for leaf in _leaves(value)]
    return [node]


Fetcher = tuple[Callable[[], torch.Tensor], list[torch.Tensor]]


def _skeleton(params: list[FlatParam], parts: _Partitions, models: list[dict[str, Any]], files: ZeroFiles,
              zero3: bool) -> tuple[dict[str, object], dict[str, Fetcher]]:
    """The state to write, with meta tensors for every tensor, and how to fetch each (plus what to release)."""
    first = models[0]
    module = first.get("module")
    if not isinstance(module, dict):
        raise FormatError(f"{files.model_files[0]}: no module state dict")
    by_name = {p.name: p for p in params}
    fetchers: dict[str, Fetcher] = {}
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, object]] = {}

    def joined(pieces: tuple[Piece, ...], flats: Callable[[Piece], torch.Tensor], shape: tuple[int, ...]) -> Fetcher:
        views = [flats(p)[p.start:p.stop] for p in pieces]

        def fetch() -> torch.Tensor:
            if len(views) == 1:
                return views[0].view(shape)  # straight from the mapped file; its pages are dropped once written
            out = torch.cat(views).view(shape)
            for view in views:  # copied: the mapped pages are not needed any more
                _release_pages(view)
            return out

        return fetch, views

    def master(p: FlatParam) -> Fetcher:
        if not p.pieces:
            return (lambda: torch.empty(p.shape, dtype=parts.masters[0][p.group].dtype), [])
        return joined(p.pieces, lambda piece: parts.masters[piece.rank][piece.group], p.shape)

    shared = first.get("shared_params") or {}
    buffers = set(first.get("buffer_names") or ())
    frozen = first.get("frozen_param_shapes") or {}
    names = list(module) + [p.name for p in params if p.name not in module]
    for name in names:
        key = f"model.{name}"
        source = shared.get(name) if name not in by_name else None
        if name in model:  # a tie's source, made when its alias came first
            continue
        if source in by_name:  # a tie (shared_params: this name -> the one DeepSpeed keeps): an alias (spec §5.1)
            p = by_name[source]
            if source not in model:
                model[source] = torch.empty(p.shape, dtype=parts.masters[0][p.group].dtype, device="meta")
                fetchers[f"model.{source}"] = master(p)
            model[name] = model[source]  # one meta object under both names: the writer aliases them
            fetchers[key] = fetchers[f"model.{source}"]
        elif name in by_name:
            p = by_name[name]
            fetchers[key] = master(p)
            model[name] = torch.empty(p.shape, dtype=parts.masters[0][p.group].dtype, device="meta")
        elif zero3 and name not in buffers and name in frozen:
            fetchers[key], model[name] = _zero3_frozen(name, frozen[name], models, files)
        else:
            tensor = module.get(name) if name in module else module.get(source)
            if not isinstance(tensor, torch.Tensor):
                raise FormatError(f"{files.model_files[0]}: module entry {name!r} is not a tensor")
            if zero3 and name not in buffers and tensor.numel() == 0:
                raise FormatError(f"{files.model_files[0]}: {name!r} is a partitioned placeholder with no "
                                  "frozen_param_fragments to rebuild it from")
            fetchers[key] = (lambda t=tensor: t, [tensor])  # type: ignore[misc]
            model[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    for p in params:
        entry: dict[str, object] = {}
        for k in parts.states[0][p.group]:
            dtype = parts.states[0][p.group][k].dtype
            fetchers[f"optim.state.{p.name}.{k}"] = joined(p.pieces, lambda piece, k=k: parts.states[piece.rank][  # type: ignore[misc]
                piece.group][k], p.shape) if p.pieces else (lambda s=p.shape, d=dtype: torch.empty(s, dtype=d), [])  # type: ignore[misc]
            entry[k] = torch.empty(p.shape, dtype=dtype, device="meta")
        for k, value in parts.scalars[p.group].items():
            if isinstance(value, torch.Tensor):
                fetchers[f"optim.state.{p.name}.{k}"] = (lambda v=value: v, [])  # type: ignore[misc]
                entry[k] = torch.empty(value.shape, dtype=value.dtype, device="meta")
            else:
                entry[k] = value
        if entry:
            state[p.name] = entry
    optim: dict[str, object] = {"state": state}
    if parts.param_groups is not None:
        group_names = [[p.name for p in params if p.group == g] for g in range(len(parts.masters[0]))]
        optim["param_groups"] = [{**{k: v for k, v in group.items() if k != "params"},
                                  "params": [n for j in group.get("params", []) for n in group_names[j]]}
                                 for group in parts.param_groups]
    return {"model": model, "optim": optim}, fetchers


def _zero3_frozen(name: str, raw_shape: object, models: list[dict[str, Any]], files: ZeroFiles) \
        -> tuple[Fetcher, torch.Tensor]:
    """ZeRO 3: a frozen parameter from every rank's ``frozen_param_fragments`` (parts of ``ceil(numel / world)``)."""
    shape = _shape(raw_shape, f"{files.tag_dir}: frozen parameter {name!r}")
    numel = math.prod(shape)
    fragments = []
    for model, file in zip(models, files.model_files, strict=True):
        fragment = (model.get("frozen_param_fragments") or {}).get(name)
        if not isinstance(fragment, torch.Tensor) or fragment.numel() != math.ceil(numel / len(models)):
            raise FormatError(f"{file}: frozen parameter {name!r} has no fragment of "
                              f"{math.ceil(numel / len(models))} elements")
        fragments.append(fragment.reshape(-1))
    return ((lambda: torch.cat(fragments)[:numel].view(shape)), fragments), \
        torch.empty(shape, dtype=fragments[0].dtype, device="meta")
