"""Resuming a DeepSpeed ZeRO engine from an arrayckpt checkpoint at any data-parallel degree.

The checkpoint is one converted from a ZeRO checkpoint (``arrayckpt convert <deepspeed dir> <dst>``, keys in
``_convert/deepspeed.py``): every parameter and optimizer moment is one global array, so an engine of any world
size fills its own partitions by reading the slices they cover, with no conversion pass and no collective
beyond the one DeepSpeed itself runs to rebuild the module weights.

The partitions are filled the way DeepSpeed's own Universal Checkpoint loader fills them, with the array
slices in place of its per-parameter files:

- ZeRO 1/2 (``runtime/base_optimizer.py`` ``load_hp_checkpoint_state_from_checkpoint_dir`` and
  ``checkpoint/universal_checkpoint.py`` ``load_hp_checkpoint_state``): each parameter's piece of this rank's
  fp32 partition is ``param._hp_mapping.lp_fragment_address`` (start, numel) of the flattened parameter; the
  master piece is copied into ``_hp_mapping.get_hp_fragment()``, the moments become ``optim_fragment`` entries
  gathered into the flat state by DeepSpeed's ``map_to_flat_opt_states``; the step and the hyper-parameters are
  set per group; ``optimizer.update_lp_params()`` then sets the module weights (all-gather).
- ZeRO 3 (``runtime/zero/stage3.py`` ``load_hp_checkpoint_state_from_checkpoint_dir_stage3``): parameter ``p``
  of sub-group ``j`` owns elements ``[rank * n, (rank + 1) * n)`` of its flattened self (``n`` its
  ``partition_numel()``, zeros past the end); the pieces in sub-group order make the flat fp32 group and each
  moment; the bit16 partitions are set from the fp32 ones; frozen parameters' partitions (``ds_tensor``) are read
  the same way; ``checkpoint_event_prologue``/``epilogue`` bracket it as in ``engine.load_checkpoint``.

Every name and shape is checked before anything is changed. What this needs of the engine is what DeepSpeed's
own loaders use (``bit16_groups``, ``_hp_mapping``, ``fp16_groups``, ``fp32_partitioned_groups_flat``...); an
engine without them (another DeepSpeed generation, offload to NVMe) is refused with a :class:`StateError`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._convert.common import nested_state
from .._errors import FormatError, KeyMismatchError, StateError
from .._format.dtypes import DType
from .._io.pools import batches
from .._layout.box import Box
from .._read.checkpoint import Checkpoint, open_checkpoint, stored_of
from .._read.reader import ChainRead, read
from .._settings import settings
from .._torch.tensors import writable_numpy
from .._torch.transfer import Batch, aligned

if TYPE_CHECKING:  # deepspeed ships no type information: these name the classes, the checker sees Any
    from deepspeed import DeepSpeedEngine
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

__all__ = ["FlatReads", "Parts", "load_engine"]




def _rows(shape: tuple[int, ...], start: int, numel: int) -> tuple[int, int, int]:
    """The rows ``[first, last)`` that elements ``[start, start + numel)`` of a flattened array span, and the
    size of a row."""
    row = math.prod(shape[1:]) if shape else 1
    return start // row, -(-(start + numel) // row), row


@dataclass(frozen=True)
class _Slice:
    """One planned slice: the rows of array ``key`` it spans (``rows``: their shape), where in them it starts."""

    key: str
    rows: tuple[int, ...]
    first: int  # the first row
    dtype: torch.dtype
    stored: DType  # the array's dtype as stored (how its bytes are viewed)
    scalar: bool  # a 0-d array (its one element)
    skip: int  # elements of the first row before the slice
    numel: int
    then: Callable[[torch.Tensor], object]

    @property
    def nbytes(self) -> int:
        return math.prod(self.rows) * self.dtype.itemsize


class FlatReads:
    """Slices of flattened arrays (``[start, start + numel)``), planned first and then read together, in batches of
    about ``deepspeed_read_batch_bytes`` (``_settings.py``), only the rows each slice spans; ``then(slice)`` puts each
    in place (the slice is valid during the call only: it is a view of a pooled host buffer, pinned where CUDA is there,
    so a copy to a GPU partition runs at the link's pinned speed and no batch allocates fresh memory)."""

    def __init__(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint
        self.planned: list[_Slice] = []

    def add(self, key: str, start: int, numel: int, then: Callable[[torch.Tensor], object]) -> None:
        array = self.checkpoint[key]
        shape = tuple(array.shape) or (1,)
        first, last, row = _rows(shape, start, numel) if numel else (0, 0, 1)
        self.planned.append(_Slice(key, (last - first, *shape[1:]), first, array.dtype, array.entry.dtype,
                                   not array.shape, start - first * row, numel, then))

    def run(self) -> None:
        limit = settings().deepspeed_read_batch_bytes
        try:
            for group in batches(self.planned, lambda piece: aligned(piece.nbytes), limit):
                batch = Batch()
                try:
                    if len(group) == 1 and aligned(group[0].nbytes) > limit:  # not pooled: the pool
                        outs = [torch.empty(group[0].rows, dtype=group[0].dtype)]  # would pin it rounded up
                    else:
                        outs = batch.views([(piece.rows, piece.dtype) for piece in group])
                    read(stored_of(self.checkpoint),
                         [self._request(piece, out) for piece, out in zip(group, outs, strict=True) if piece.numel])
                    for piece, out in zip(group, outs, strict=True):
                        piece.then(out.reshape(-1)[piece.skip:piece.skip + piece.numel])
                finally:
                    batch.settle()
        finally:
            self.planned.clear()

    @staticmethod
    def _request(piece: _Slice, out: torch.Tensor) -> ChainRead:
        if piece.scalar:
            return ChainRead(piece.key, Box((), ()), writable_numpy(out.reshape(()), piece.stored, piece.key))
        box = Box((piece.first,) + (0,) * (len(piece.rows) - 1), piece.rows)
        return ChainRead(piece.key, box, writable_numpy(out, piece.stored, piece.key))


def _optimizer(engine: DeepSpeedEngine) -> tuple[int, DeepSpeedZeroOptimizer | DeepSpeedZeroOptimizer_Stage3]:
    stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
    optimizer = getattr(engine, "optimizer", None)
    needs = {1: ("bit16_groups", "update_lp_params", "optimizer"), 2: ("bit16_groups", "update_lp_params", "optimizer"),
             3: ("fp16_groups", "fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat", "optimizer")}
    if stage not in needs:
        raise StateError(f"arrayckpt.deepspeed.load fills ZeRO stage 1, 2 or 3 engines; this engine runs stage "
                         f"{stage!r}")
    missing = [a for a in needs[stage] if not hasattr(optimizer, a)]
    if stage == 3 and not missing and optimizer is not None and \
            any(g is None for g in optimizer.fp16_partitioned_groups_flat):
        missing = ["fp16_partitioned_groups_flat (parameters offloaded to NVMe)"]
    if missing:
        raise StateError(f"this DeepSpeed engine's ZeRO {stage} optimizer has no {', '.join(missing)}; "
                         "arrayckpt.deepspeed.load supports the layout of DeepSpeed 0.19 without NVMe offload")
    return stage, optimizer


def _shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


def _check(checkpoint: Checkpoint, engine: DeepSpeedEngine, trainable: list[tuple[str, torch.Tensor]],
           state_keys: list[str],
           strict: bool, load_optimizer_states: bool) -> None:
    """Every parameter and buffer the engine holds is in the checkpoint with its shape (and, loading the
    optimizer, every trainable parameter's state); with ``strict``, nothing of the model is left over. A tied
    parameter (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) is wanted under each of its names, as its
    state dict holds it: ``named_parameters()`` would name it once, and the checkpoint's other name would be
    unexpected. It is filled once, from the name DeepSpeed partitions it under (its first)."""
    wanted = {f"model.{name}": _shape(p) for name, p in engine.module.named_parameters(remove_duplicate=False)}
    wanted |= {f"model.{name}": tuple(b.shape) for name, b in _buffers(engine.module)}
    if load_optimizer_states:
        for name, p in trainable:
            wanted |= {f"optim.state.{name}.{k}": _shape(p) for k in state_keys if k != "step"}
    missing = sorted(k for k in wanted if k not in checkpoint)
    extra = sorted(k for k in checkpoint if k.startswith("model.") and k not in wanted) if strict else []
    if missing or extra:
        raise KeyMismatchError(f"{checkpoint.location}: does not fit this engine: missing {missing[:5]}"
                               f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                               f"{' ...' if len(extra) > 5 else ''} (strict=False ignores unexpected ones)")
    for key, shape in wanted.items():
        if tuple(checkpoint[key].shape) != shape:
            raise StateError(f"{checkpoint.location}: {key} has shape {list(checkpoint[key].shape)}, the engine's "
                             f"{list(shape)}")


def _buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's persistent buffers (those its state dict holds), by state-dict name."""
    out = []
    for prefix, sub in module.named_modules():
        for name, buffer in sub.named_buffers(recurse=False):
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                out.append((f"{prefix}.{name}" if prefix else name, buffer))
    return out


def _state_keys(checkpoint: Checkpoint, name: str) -> list[str]:
    prefix = f"optim.state.{name}."
    return sorted({k[len(prefix):] for k in checkpoint.manifest.entries if k.startswith(prefix)})


def _group_values(checkpoint: Checkpoint, groups: Sequence[object], names: list[list[str]]) -> list[dict[str, object]]:
    """The saved hyper-parameters of each of the engine's param groups (matched by their parameters' names)."""
    saved = checkpoint.plain_values.get("optim.param_groups")
    if saved is None:
        return [{} for _ in groups]
    if not isinstance(saved, list) or len(saved) != len(groups):
        raise StateError(f"{checkpoint.location}: {len(saved) if isinstance(saved, list) else saved!r} saved param "
                         f"groups, the engine has {len(groups)}")
    for i, (group, own) in enumerate(zip(saved, names, strict=True)):
        if sorted(group.get("params", [])) != sorted(own):
            raise StateError(f"{checkpoint.location}: param group {i} holds {sorted(group.get('params', []))} in the "
                             f"checkpoint, {sorted(own)} in the engine")
    return [{k: v for k, v in group.items() if k != "params"} for group in saved]


def _saved_step(checkpoint: Checkpoint, key: str) -> float | None:
    """``optim.state.<name>.step`` as saved: an array of one element (torch's optimizers keep a tensor) or a plain
    number (DeepSpeed's FusedAdam and DeepSpeedCPUAdam keep an int); ``None`` where there is none."""
    if key in checkpoint:
        value = checkpoint[key].torch()
        if value.numel() != 1 or value.dtype.is_complex or value.dtype == torch.bool:
            raise FormatError(f"{checkpoint.location}: {key} is an array of shape {list(value.shape)} and dtype "
                              f"{value.dtype}, not one step count")
        return float(value.item())
    if key not in checkpoint.manifest.entries:
        return None
    value = checkpoint.plain_values[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise FormatError(f"{checkpoint.location}: {key} is {value!r}, not a step count")
    return float(value)


def _step(checkpoint: Checkpoint, names: list[str], base_optimizer: torch.optim.Optimizer, group: Mapping[str, object],
          flat: torch.Tensor) -> int | torch.Tensor | None:
    """The step of a param group (every parameter of it has the same one), in the type ``base_optimizer`` keeps:
    a 0-d tensor for torch's optimizers and their subclasses (their ``step`` adds to it in place; on the parameter's
    device with ``capturable``/``fused``, as torch's ``Optimizer.load_state_dict`` puts it), an int for the others
    (DeepSpeed's FusedAdam, DeepSpeedCPUAdam...: ``state['step'] += 1``, handed to a C++ kernel). A checkpoint saved
    with the other kind (``torch_adam`` or ZeRO-Offload switched on or off) is converted, as torch's own
    ``Adam.__setstate__`` turns an int step into a tensor."""
    steps = {n: s for n in names if (s := _saved_step(checkpoint, f"optim.state.{n}.step")) is not None}
    if len(set(steps.values())) > 1:
        raise FormatError(f"{checkpoint.location}: the parameters of one param group have different steps "
                          f"{dict(list(steps.items())[:4])}; DeepSpeed keeps one step per flat group")
    if not steps:
        return None
    step = next(iter(steps.values()))
    if any(c.__module__.startswith("torch.optim.") and c is not torch.optim.Optimizer
           for c in type(base_optimizer).__mro__):
        on_device = group.get("capturable") or group.get("fused")
        return torch.tensor(step, dtype=torch.float64 if torch.get_default_dtype() == torch.float64 else
                            torch.float32, device=flat.device if on_device else None)
    if not step.is_integer():
        raise FormatError(f"{checkpoint.location}: the step of {names[0]} is {step}, not a whole number of steps")
    return int(step)


@torch.no_grad()
def _load_zero12(checkpoint: Checkpoint, engine: DeepSpeedEngine, optimizer: DeepSpeedZeroOptimizer, keys: list[str],
                 load_optim: bool) -> None:
    from deepspeed.utils import map_to_flat_opt_states

    names = engine.param_names
    groups = [[names[p] for p in group] for group in optimizer.bit16_groups]
    values = _group_values(checkpoint, optimizer.optimizer.param_groups, groups) if load_optim else []
    moments = [k for k in keys if k != "step"]
    reads = FlatReads(checkpoint)
    for group in optimizer.bit16_groups:
        for lp in group:
            mapping = lp._hp_mapping
            if mapping is None:  # no piece of this parameter in this rank's partition
                continue
            address, name = mapping.lp_fragment_address, names[lp]
            reads.add(f"model.{name}", address.start, address.numel, mapping.get_hp_fragment().copy_)
            if load_optim:
                mapping.optim_fragment = {}
                for k in moments:
                    reads.add(f"optim.state.{name}.{k}", address.start, address.numel,
                              lambda piece, m=mapping, k=k: m.optim_fragment.__setitem__(k,
                                                                                         piece.clone()))  # type: ignore[misc]
    reads.run()
    for i, group in enumerate(optimizer.bit16_groups if load_optim else []):
        flat = optimizer.optimizer.param_groups[i]["params"][0]
        map_to_flat_opt_states(flat, group, optimizer.optimizer.state, moments)
        step = _step(checkpoint, groups[i], optimizer.optimizer, optimizer.optimizer.param_groups[i], flat)
        if step is not None:
            optimizer.optimizer.state[flat]["step"] = step
        optimizer.optimizer.param_groups[i].update(values[i])
    optimizer.update_lp_params()  # bit16 partitions from the fp32 ones, then all-gathered (DeepSpeed's own)


@torch.no_grad()
def _load_zero3(checkpoint: Checkpoint, engine: DeepSpeedEngine, optimizer: DeepSpeedZeroOptimizer_Stage3,
                keys: list[str], load_optim: bool) -> None:
    import deepspeed.comm as dist

    names = engine.param_names
    moments = [k for k in keys if k != "step"] if load_optim else []
    sub_names = [[names[p] for p in group] for group in optimizer.fp16_groups]
    group_of = getattr(optimizer, "sub_group_to_group_id", {j: j for j in range(len(sub_names))})
    groups = optimizer.optimizer.param_groups
    values = _group_values(checkpoint, groups, [[n for j, ns in enumerate(sub_names) if group_of[j] == g for n in ns]
                                                for g in range(len(groups))]) if load_optim else []
    reads = FlatReads(checkpoint)

    def partition(param: Any, key: str, into: torch.Tensor) -> None:  # Any: a Parameter with ZeRO-3's ds_* members
        """This rank's part of ``param`` (``partition_numel()`` elements, zeros past its end) read into ``into``."""
        rank = dist.get_rank(group=getattr(param, "ds_process_group", optimizer.dp_process_group))
        size, numel = param.partition_numel(), param.ds_numel
        start = min(rank * size, numel)
        into.zero_()
        reads.add(key, start, min(size, numel - start), lambda piece: into[:piece.numel()].copy_(piece))

    flats: dict[tuple[int, str], torch.Tensor] = {}
    for j, group in enumerate(optimizer.fp16_groups):
        for key in ["fp32", *moments]:
            flat = flats[j, key] = torch.zeros_like(optimizer.fp32_partitioned_groups_flat[j])
            offset = 0
            for param in group:
                source = f"model.{names[param]}" if key == "fp32" else f"optim.state.{names[param]}.{key}"
                partition(param, source, flat.narrow(0, offset, param.partition_numel()))
                offset += param.partition_numel()
    trainable = {id(p) for group in optimizer.fp16_groups for p in group}
    frozen = [(name, p) for name, p in engine.module.named_parameters() if id(p) not in trainable and
              hasattr(p, "ds_tensor")]
    staged = [torch.empty(p.partition_numel(), dtype=p.ds_tensor.dtype) for _, p in frozen]
    for (name, param), into in zip(frozen, staged, strict=True):
        partition(param, f"model.{name}", into)
    reads.run()
    for j in range(len(optimizer.fp16_groups)):
        fp32 = optimizer.fp32_partitioned_groups_flat[j]
        fp32.data.copy_(flats[j, "fp32"])
        for key in moments:
            optimizer.optimizer.state[fp32][key] = flats[j, key]
        if load_optim:
            step = _step(checkpoint, sub_names[j], optimizer.optimizer, groups[group_of[j]], fp32)
            if step is not None:
                optimizer.optimizer.state[fp32]["step"] = step
    for g, group in enumerate(groups if load_optim else []):
        group.update(values[g])
    for j in range(len(optimizer.fp16_groups)):  # the bit16 partitions from the fp32 ones, as DeepSpeed does
        optimizer.fp16_partitioned_groups_flat[j].data.copy_(optimizer.fp32_partitioned_groups_flat[j].data)
        updated = optimizer.unflatten(optimizer.fp16_partitioned_groups_flat[j], optimizer.fp16_partitioned_groups[j])
        for partitioned, new in zip(optimizer.fp16_partitioned_groups[j], updated, strict=True):
            partitioned.data = new.data
    for (_, param), new in zip(frozen, staged, strict=True):  # frozen parameters: their own partitions
        param.ds_tensor.data.copy_(new)


@dataclass(frozen=True)
class Parts:
    """What a load restores besides the module's weights, buffers and frozen parameters (always restored), from
    ``engine.load_checkpoint``'s flags: ``load_module_only`` restores nothing more; ``load_optimizer_states=False``
    keeps the optimizer (moments, steps, hyper-parameters, loss scaler) as it is; ``load_lr_scheduler_states=False``
    keeps the LR scheduler."""

    optimizer: bool
    lr_scheduler: bool
    counters: bool  # global_steps, global_samples, skipped_steps

    @classmethod
    def of(cls, load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool) -> Parts:
        return cls(load_optimizer_states and not load_module_only, load_lr_scheduler_states and not load_module_only,
                   not load_module_only)


def load_engine(engine: DeepSpeedEngine, path: str | os.PathLike[str], *, load_optimizer_states: bool = True,
                load_lr_scheduler_states: bool = True, load_module_only: bool = False, strict: bool = True,
                allow_pickle: bool = False, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """See :func:`arrayckpt.deepspeed.load`."""
    parts = Parts.of(load_optimizer_states, load_lr_scheduler_states, load_module_only)
    stage, optimizer = _optimizer(engine)
    names = engine.param_names
    groups = optimizer.bit16_groups if stage < 3 else optimizer.fp16_groups
    trainable = [(names[p], p) for group in groups for p in group]
    with open_checkpoint(path, allow_pickle=allow_pickle, storage_options=storage_options) as checkpoint:
        keys = _state_keys(checkpoint, trainable[0][0]) if trainable and parts.optimizer else []
        if trainable and parts.optimizer and not [k for k in keys if k != "step"]:
            raise KeyMismatchError(f"{checkpoint.location}: has no optimizer state for {trainable[0][0]!r} "
                                   f"(optim.state.{trainable[0][0]}.*); load_optimizer_states=False loads the weights")
        _check(checkpoint, engine, trainable, keys, strict, parts.optimizer)
        nested, _ = nested_state(checkpoint, lambda key: checkpoint[key].torch() if key.startswith("client.")
                                 else None)
        if stage == 3:
            optimizer.checkpoint_event_prologue()
            _load_zero3(checkpoint, engine, optimizer, keys, parts.optimizer)
        else:
            _load_zero12(checkpoint, engine, optimizer, keys, parts.optimizer)
        trainable_ids = {id(p) for _, p in trainable}
        with torch.no_grad():
            for name, param in engine.module.named_parameters():
                if id(param) not in trainable_ids and not hasattr(param, "ds_tensor"):
                    param.data.copy_(checkpoint[f"model.{name}"].torch())
            for name, buffer in _buffers(engine.module):
                buffer.copy_(checkpoint[f"model.{name}"].torch())
        if stage == 3:
            optimizer.checkpoint_event_epilogue()
    saved, client = nested.get("deepspeed", {}), nested.get("client", {})  # dicts: nested_state made them
    _restore_counters(engine, optimizer, saved if isinstance(saved, dict) else {}, parts)
    return client if isinstance(client, dict) else {}


def _restore_counters(engine: DeepSpeedEngine, optimizer: DeepSpeedZeroOptimizer | DeepSpeedZeroOptimizer_Stage3,
                      saved: Mapping[str, object], parts: Parts) -> None:
    """DeepSpeed's step counters, loss scaler and learning-rate schedule, as ``engine.load_checkpoint`` sets them."""
    for attribute in ("global_steps", "global_samples", "skipped_steps") if parts.counters else ():
        if isinstance(saved.get(attribute), int):
            setattr(engine, attribute, saved[attribute])
    if parts.lr_scheduler and getattr(engine, "lr_scheduler", None) is not None and \
            saved.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    scaler = getattr(optimizer, "loss_scaler", None)
    loss_scaler = saved.get("loss_scaler")
    if parts.optimizer and scaler is not None and isinstance(loss_scaler, dict):
        for attribute, value in loss_scaler.items():
            setattr(scaler, attribute, value)
    for attribute in ("dynamic_loss_scale", "overflow") if parts.optimizer else ():
        if attribute in saved and hasattr(optimizer, attribute):
            setattr(optimizer, attribute, saved[attribute])
