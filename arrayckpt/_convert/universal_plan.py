"""Which of an arrayckpt checkpoint's tensors a DeepSpeed Universal Checkpoint needs, and under which names:
the trainable parameters by param group, each with its optimizer state, read from the manifest alone.

Two kinds of source are understood:

- one converted from DeepSpeed (``_convert/deepspeed.py``): ``optim.param_groups`` name every group's parameters,
  ``deepspeed.*`` holds DeepSpeed's own values (``buffer_names``, ``loss_scaler``, ...);
- plain PyTorch training saved as ``{"model": module, "optim": optimizer, ...}``: the optimizer's state is keyed
  by what its ``state_dict()`` gives, parameter *numbers* (0, 1, ... in the order its param groups list them), or
  names where it was saved by name (``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``, as DCP and
  FSDP users do). Names are used as they are. Numbers are mapped to the module's names only where that cannot be
  wrong: ``param_names`` (the names in the order the optimizer holds its parameters) when given, or else one param
  group holding every floating-point tensor of the module, in the module's order (what ``AdamW(model.parameters())``
  gives for a module without buffers, frozen or tied parameters). Anything else is ambiguous and refused.

DeepSpeed keeps one step per param group (its loader asserts that the parameters' steps agree), so differing steps
within a group are refused; a parameter without optimizer state (it never had a gradient) gets zero moments and its
group's step, which is what DeepSpeed's flat partition holds for it (and a note says so).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from .._errors import FormatError
from .._format.manifest import ArrayEntry, ValueEntry
from .._read.checkpoint import Checkpoint

if TYPE_CHECKING:
    import torch

    Step: TypeAlias = torch.Tensor | int | float  # an optimizer's step count: a 0-d tensor (torch's) or a number

__all__ = ["Source", "Trainable", "plan_source"]

MODEL = "model"  # the top-level key of the module's tensors


@dataclass(frozen=True)
class Trainable:
    """A trainable parameter: the module's (and the engine's) name for it, and its state's arrayckpt keys."""

    name: str
    group: int
    state: Mapping[str, str]  # state name (exp_avg, exp_avg_sq, ...) -> arrayckpt key; missing ones are zero-filled
    step: str | None  # arrayckpt key of its step (None: no step of its own; its group's is used)


@dataclass(frozen=True)
class Source:
    """What a Universal Checkpoint takes from a checkpoint."""

    optim: str  # the optimizer's top-level key
    groups: tuple[tuple[Trainable, ...], ...]
    hyper: tuple[Mapping[str, object], ...]  # each param group's hyper-parameters (without "params")
    moments: tuple[str, ...]  # the per-element state every trainable parameter gets (exp_avg, exp_avg_sq, ...)
    steps: tuple[Step | None, ...]  # each group's step as the optimizer keeps it (None: none)
    from_deepspeed: bool
    notes: tuple[str, ...]

    @property
    def trainable(self) -> dict[str, Trainable]:
        return {p.name: p for group in self.groups for p in group}


def _model_entries(checkpoint: Checkpoint) -> dict[str, ArrayEntry]:
    """The module's tensors by name (``model.<name>``)."""
    out = {}
    for entry in checkpoint.manifest.entries.values():
        if entry.parts[0] == MODEL and isinstance(entry, ArrayEntry):
            out[".".join(str(p) for p in entry.parts[1:])] = entry
    if not out:
        raise FormatError(f"{checkpoint.location}: no module under 'model' (no model.<name> tensors); a DeepSpeed "
                          "Universal Checkpoint is written from a checkpoint that holds the module under 'model' and "
                          "its optimizer beside it, as {'model': module, 'optim': optimizer, ...} saves it or a "
                          "DeepSpeed checkpoint converts to (a Megatron-Core checkpoint's module and moments are not "
                          "laid out so)")
    return out


def _optimizer_key(checkpoint: Checkpoint) -> str:
    """The top-level key holding the optimizer: the one with ``<key>.param_groups``."""
    found = sorted({str(e.parts[0]) for e in checkpoint.manifest.entries.values()
                    if len(e.parts) == 2 and e.parts[1] == "param_groups" and e.parts[0] != MODEL})
    if len(found) != 1:
        why = "no optimizer (no <key>.param_groups)" if not found else f"several optimizers ({', '.join(found)})"
        raise FormatError(f"{checkpoint.location}: {why}; a DeepSpeed Universal Checkpoint holds the module's "
                          "weights with one optimizer's state: its param groups (hyper-parameters) and moments, which "
                          "a checkpoint of tensors only (safetensors, Hugging Face weights) does not hold. To start "
                          "from weights only, load them into the module before deepspeed.initialize")
    return found[0]


def _param_groups(checkpoint: Checkpoint, optim: str) -> list[dict[str, Any]]:
    groups = checkpoint.plain_values[f"{optim}.param_groups"]
    if not isinstance(groups, list) or not groups or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise FormatError(f"{checkpoint.location}: {optim}.param_groups is {str(groups)[:120]}, not an optimizer's "
                          "param groups (a list of dicts with 'params')")
    return groups


def _states(checkpoint: Checkpoint, optim: str) -> dict[str, dict[str, str]]:
    """``<optim>.state.<id>.<name>`` keys by parameter id (a number or a name, as a string) and state name."""
    out: dict[str, dict[str, str]] = {}
    for key, entry in checkpoint.manifest.entries.items():
        if entry.parts[0] != optim or len(entry.parts) < 2 or entry.parts[1] != "state":
            continue
        if len(entry.parts) != 4:
            raise FormatError(f"{checkpoint.location}: {key} is not <optim>.state.<parameter>.<name>; an "
                              "optimizer's state_dict holds one dict of tensors or numbers per parameter")
        out.setdefault(str(entry.parts[2]), {})[str(entry.parts[3])] = key
    return out


def _names(ids: list[Any], groups: int, model: Mapping[str, ArrayEntry], param_names: Sequence[str] | None,
           where: str) -> tuple[list[str], tuple[str, ...]]:
    """The module's name of each optimizer parameter (``ids`` in param-group order), and notes."""
    if all(isinstance(i, str) for i in ids):
        if param_names is not None:
            raise FormatError(f"{where}: the optimizer's state is keyed by name already; param_names is for one "
                              "that numbers its parameters")
        return list(ids), ()
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise FormatError(f"{where}: the param groups' 'params' mix numbers and names ({ids[:6]}); cannot map them "
                          "onto the module's parameters")
    if param_names is not None:
        if len(param_names) != len(ids):
            raise FormatError(f"{where}: param_names gives {len(param_names)} names, the optimizer holds {len(ids)} "
                              "parameters; give one name per optimizer parameter, in the order its param groups "
                              "list them")
        return list(param_names), ()
    floating = [name for name, e in model.items() if e.dtype.name.startswith(("float", "bfloat"))]
    if groups == 1 and len(floating) == len(ids):
        return floating, (f"the optimizer numbers its {len(ids)} parameters; taken as the module's floating-point "
                          "tensors in order (what AdamW(model.parameters()) gives); pass param_names otherwise",)
    raise FormatError(f"{where}: the optimizer numbers its {len(ids)} parameters (in {groups} param group"
                      f"{'s' if groups > 1 else ''}) and the module has {len(floating)} floating-point tensors, so "
                      "which is which cannot be told (frozen parameters, buffers, tied weights or several groups); "
                      "pass param_names (--param-names FILE): the module's names of the optimizer's parameters in "
                      "the order its param groups list them, e.g. [n for n, p in model.named_parameters() if "
                      "p.requires_grad], or save the optimizer by name (get_optimizer_state_dict)")


def _step_value(checkpoint: Checkpoint, key: str) -> Step:
    """A step as saved: a one-element array (torch's optimizers keep a 0-d tensor) or a number."""
    entry = checkpoint.manifest.entries[key]
    if isinstance(entry, ArrayEntry):
        if math.prod(entry.shape) != 1:
            raise FormatError(f"{checkpoint.location}: {key} has shape {list(entry.shape)}, not one step count")
        return checkpoint[key].torch()
    value = checkpoint.plain_values[key] if isinstance(entry, ValueEntry) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FormatError(f"{checkpoint.location}: {key} is {value!r}, not a step count")
    return value


def _group_step(checkpoint: Checkpoint, params: list[Trainable], group: int) -> Step | None:
    """The step every parameter of ``group`` has (DeepSpeed keeps one per group); ``None`` where none has one."""
    steps = {p.name: _step_value(checkpoint, p.step) for p in params if p.step is not None}
    distinct = {float(v) for v in steps.values()}
    if len(distinct) > 1:
        shown = {n: float(v) for n, v in list(steps.items())[:4]}
        raise FormatError(f"{checkpoint.location}: the parameters of param group {group} have different steps "
                          f"{shown}; DeepSpeed keeps one step per param group")
    return next(iter(steps.values())) if steps else None


def plan_source(checkpoint: Checkpoint, param_names: Sequence[str] | None = None) -> Source:
    """The trainable parameters of ``checkpoint`` by group, with their state keys, checked against the module."""
    where = str(checkpoint.location)
    optim = _optimizer_key(checkpoint)  # first: a checkpoint of tensors only has no optimizer, whatever its names
    model = _model_entries(checkpoint)
    groups = _param_groups(checkpoint, optim)
    states = _states(checkpoint, optim)
    ids = [p for g in groups for p in g["params"]]
    names, notes = _names(ids, len(groups), model, param_names, where)
    if len(set(names)) != len(names):
        raise FormatError(f"{where}: a parameter is named twice among the optimizer's parameters")
    by_id = dict(zip((str(i) for i in ids), names, strict=True))
    unknown = sorted(set(states) - set(by_id))
    if unknown:
        raise FormatError(f"{where}: {optim}.state holds parameters {unknown[:4]} that no param group lists")
    trainable: list[list[Trainable]] = []
    position = 0
    for g, group in enumerate(groups):
        trainable.append([])
        for pid in group["params"]:
            name = names[position]
            position += 1
            if name not in model:
                raise FormatError(f"{where}: optimizer parameter {pid!r} is {name!r}, which the module does not "
                                  f"hold (no model.{name})")
            keys = states.get(str(pid), {})
            for state_name, key in keys.items():
                entry = checkpoint.manifest.entries[key]
                if state_name != "step" and (not isinstance(entry, ArrayEntry) or entry.shape != model[name].shape):
                    shape = list(entry.shape) if isinstance(entry, ArrayEntry) else "a value"
                    raise FormatError(f"{where}: {key} is {shape}, not a tensor of {name}'s shape "
                                      f"{list(model[name].shape)}; the optimizer state does not belong to {name}")
            trainable[g].append(Trainable(name, g, {k: v for k, v in keys.items() if k != "step"}, keys.get("step")))
    moments = tuple(dict.fromkeys(k for group in trainable for p in group for k in p.state))
    if not moments and all(p.step is None for group in trainable for p in group):
        raise FormatError(f"{where}: the optimizer holds no state (it never took a step); a DeepSpeed Universal "
                          "Checkpoint resumes an optimizer (to start from weights only, load them into the module "
                          "before deepspeed.initialize)")
    partial = [p.name for group in trainable for p in group if set(p.state) != set(moments)]
    if partial:
        notes += (f"no optimizer state ({', '.join(moments)}) for {', '.join(partial[:4])}"
                  f"{' ...' if len(partial) > 4 else ''}: written as zeros with its group's step, as DeepSpeed's flat "
                  "partition holds a parameter that never had a gradient",)
    steps = tuple(_group_step(checkpoint, group, g) for g, group in enumerate(trainable))
    from_deepspeed = any(e.parts[0] == "deepspeed" for e in checkpoint.manifest.entries.values())
    return Source(optim, tuple(tuple(group) for group in trainable),
                  tuple({k: v for k, v in g.items() if k != "params"} for g in groups), moments, steps,
                  from_deepspeed, notes)
