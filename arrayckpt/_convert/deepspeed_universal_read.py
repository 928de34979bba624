"""A DeepSpeed Universal Checkpoint (what ``ds_to_universal.py`` writes, or ``convert --to deepspeed``) into arrayckpt,
under the keys a ZeRO checkpoint converts to (``_convert/deepspeed.py``), so both read back the same way.

A universal tag directory holds ``zero/optimizer_state.pt`` and one directory per parameter under ``zero/``
(``deepspeed_universal.py`` has the layout). What comes out:

- ``model.<name>``: a trainable parameter's ``zero/<name>/fp32.pt`` (the fp32 master weights; ZeRO 3's files are flat,
  reshaped by ``param_shapes``); other tensors as the model-states file's ``module`` holds them, or, where it holds a
  0-element placeholder, ``zero/<name>/fp32.pt`` cast back to the placeholder's dtype (exact: it was widened from
  it). A placeholder with no file (ds_to_universal leaves ZeRO 3's frozen parameters out) is skipped and said so.
- ``optim.state.<name>.<moment>`` from each other ``zero/<name>/<moment>.pt``; ``optim.state.<name>.step`` from
  ``step.pt`` (a 0-d array or a plain number, as saved), or, without one (ZeRO 3), the step of its sub-group in
  ``optimizer_state.pt``; ``optim.param_groups`` with each group's ``params`` as names.
- ``deepspeed.*`` (the model states' DeepSpeed values and ``optimizer_state.pt``'s loss scaler, clip_grad...,
  ``tag``) and ``client.*`` (the model states' other top-level keys), as for a ZeRO checkpoint.

Files are read with the allow-list unpickler (``deepspeed_files.load_value``) and memory-mapped; one parameter's file
is read when it is written, and its pages dropped. Names from the checkpoint never leave ``zero/``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from .._errors import FormatError
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._write.options import SaveOptions
from .._write.stream import write_streaming
from .common import ConvertResult, Progress
from .deepspeed_files import DEEPSPEED_KEYS, LAYOUT_KEYS, OPTIMIZER_KEYS, load_pt, load_value, plain_scaler
from .deepspeed_universal import MODEL_STATES, OPTIMIZER_STATE, ZERO3_MODEL_STATES, param_directory
from .torch_save import _release_pages

__all__ = ["from_universal", "is_universal"]

STATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
UNSUPPORTED = {re.compile(r"mp_rank_(?!00_)\d+.*_model_states\.pt|zero_pp_rank_\d+_mp_rank_(?!00_)\d+.*"):
               "tensor-parallel model states", re.compile(r"layer_\d+.*\.pt"): "pipeline-parallel layer files",
               re.compile(r".*expert_\d+.*\.pt"): "MoE expert files"}


def is_universal(tag_dir: Path) -> bool:
    """Whether ``tag_dir`` is a Universal Checkpoint's tag directory."""
    return (tag_dir / "zero" / OPTIMIZER_STATE).is_file()


def _model_states(tag_dir: Path) -> tuple[Path, dict[str, Any]]:
    names = sorted(p.name for p in tag_dir.iterdir())
    for pattern, what in UNSUPPORTED.items():
        found = [n for n in names if pattern.fullmatch(n)]
        if found:
            raise FormatError(f"{tag_dir}: holds {what} ({found[0]}, ...); universal checkpoints of tensor- and "
                              "pipeline-parallel degree 1 without MoE are converted")
    for name in (MODEL_STATES, ZERO3_MODEL_STATES):
        if (tag_dir / name).is_file():
            states = load_pt(tag_dir / name, mmap=True)
            if not isinstance(states.get("param_shapes"), list) or not all(
                    isinstance(g, dict) for g in states["param_shapes"]):
                raise FormatError(f"{tag_dir / name}: no param_shapes; not a DeepSpeed model-states file")
            return tag_dir / name, states
    raise FormatError(f"{tag_dir}: a universal checkpoint without {MODEL_STATES} or {ZERO3_MODEL_STATES}")


def _param(file: Path, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The tensor of a per-parameter file (``{"param": tensor, ...}``, or the bare flat tensor ZeRO 3's files hold),
    memory-mapped, in ``shape`` (default: as saved)."""
    value = load_value(file, mmap=True)
    tensor = value.get("param") if isinstance(value, dict) else value
    if not isinstance(tensor, torch.Tensor) or (shape is not None and tensor.numel() != math.prod(shape)):
        got = f"{tensor.dtype}{list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise FormatError(f"{file}: holds {got}, not a tensor of {list(shape or ())} (its param_shapes); the file "
                          "does not belong to this parameter, or was merged from tensor-parallel slices")
    return tensor if shape is None else tensor.reshape(shape)


def _group_steps(optimizer: dict[str, Any], groups: int) -> list[object]:
    """Each flat group's step in ``optimizer_state.pt``'s ``optimizer_state_dict`` (what ZeRO 3's loader reads)."""
    state = (optimizer.get("optimizer_state_dict") or {}).get("state") or {}
    return [state.get(j, {}).get("step") if isinstance(state.get(j), dict) else None for j in range(groups)]


def _param_groups(optimizer: dict[str, Any], names: list[list[str]], file: Path) -> list[dict[str, object]] | None:
    groups = optimizer.get("param_groups")
    if groups is None:
        groups = (optimizer.get("optimizer_state_dict") or {}).get("param_groups")
    if groups is None:
        return None
    out = []
    for group in groups if isinstance(groups, list) else [None]:
        params = group.get("params") if isinstance(group, dict) else None
        if not isinstance(params, list) or not all(isinstance(j, int) and 0 <= j < len(names) for j in params):
            raise FormatError(f"{file}: param_groups {str(groups)[:120]} do not index its {len(names)} parameter "
                              "groups (param_shapes)")
        out.append({**{k: v for k, v in cast("dict[str, object]", group).items() if k != "params"},
                    "params": [n for j in params for n in names[j]]})
    return out


def from_universal(tag_dir: Path, dst: str | os.PathLike[str], *, overwrite: bool = False,
                   allow_pickle: bool = False, progress: Progress | None = None,
                   chunking: ChunkPolicy = DEFAULT_CHUNKING, key_prefix: str = "") -> ConvertResult:
    """The universal tag directory ``tag_dir`` into arrayckpt at ``dst``; the keys are in this module's docstring."""
    states_file, states = _model_states(tag_dir)
    zero = tag_dir / "zero"
    optimizer = load_pt(zero / OPTIMIZER_STATE, mmap=True)
    shapes = [{str(n): tuple(s) for n, s in group.items()} for group in states["param_shapes"]]
    names = [list(group) for group in shapes]
    steps = _group_steps(optimizer, len(shapes))
    module = states.get("module") or {}
    fetchers: dict[str, Callable[[], torch.Tensor]] = {}
    loaded: dict[str, torch.Tensor] = {}
    model: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, object]] = {}
    skipped: list[str] = []

    def lazy(key: str, file: Path, shape: tuple[int, ...] | None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A meta tensor for ``key``, whose data ``file`` gives (mapped now, read when written)."""
        value = _param(file, shape)

        def fetch() -> torch.Tensor:
            loaded[key] = value
            return value if dtype is None else value.to(dtype)

        fetchers[key] = fetch
        return torch.empty(value.shape, dtype=value.dtype if dtype is None else dtype, device="meta")

    for j, group in enumerate(shapes):
        for name, shape in group.items():
            directory = param_directory(zero, name, str(tag_dir))
            model[name] = lazy(f"model.{name}", directory / "fp32.pt", shape)
            entry: dict[str, object] = {}
            for file in sorted(directory.glob("*.pt")):
                moment = file.stem
                if moment in ("fp32", "step"):
                    continue
                if not STATE_NAME.fullmatch(moment):
                    raise FormatError(f"{file}: not an optimizer state's file name")
                entry[moment] = lazy(f"optim.state.{name}.{moment}", file, shape)
            step = load_value(directory / "step.pt") if (directory / "step.pt").is_file() else steps[j]
            if isinstance(step, torch.Tensor):
                fetchers[f"optim.state.{name}.step"] = lambda s=step: s  # type: ignore[misc]
                entry["step"] = torch.empty(step.shape, dtype=step.dtype, device="meta")
            elif step is not None:
                entry["step"] = step
            state[name] = entry
    trainable = {n for group in names for n in group}
    frozen_shapes = states.get("frozen_param_shapes") or {}
    for name, tensor in module.items():
        if name in trainable:
            continue
        file = param_directory(zero, str(name), str(tag_dir)) / "fp32.pt"
        if not isinstance(tensor, torch.Tensor):
            raise FormatError(f"{states_file}: module entry {name!r} is not a tensor")
        if tensor.numel() == 0 and file.is_file():  # a placeholder: the data is in zero/
            saved_shape = tuple(frozen_shapes[name]) if name in frozen_shapes else None
            model[name] = lazy(f"model.{name}", file, saved_shape, tensor.dtype)
        elif tensor.numel() == 0 and math.prod(frozen_shapes.get(name, (0,))) > 0:
            skipped.append(f"model.{name}")
        else:
            fetchers[f"model.{name}"] = lambda t=tensor: t  # type: ignore[misc]
            model[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    model = {n: model[n] for n in [*module, *(n for group in names for n in group)] if n in model}
    optim: dict[str, object] = {"state": state}
    groups = _param_groups(optimizer, names, zero / OPTIMIZER_STATE)
    if groups is not None:
        optim["param_groups"] = groups
    skeleton: dict[str, object] = {"model": model, "optim": optim}
    skeleton["deepspeed"] = {k: states[k] for k in DEEPSPEED_KEYS if k in states} | \
        {k: plain_scaler(optimizer[k]) for k in OPTIMIZER_KEYS if k in optimizer} | {"tag": tag_dir.name}
    client = {k: v for k, v in states.items() if k not in DEEPSPEED_KEYS and k not in LAYOUT_KEYS}
    if client:
        skeleton["client"] = client

    def release(key: str) -> None:
        tensor = loaded.pop(key, None)
        if tensor is not None:
            _release_pages(tensor)

    step = states.get("global_steps")
    options = SaveOptions(overwrite=overwrite, allow_pickle=allow_pickle,
                          step=step if isinstance(step, int) and not isinstance(step, bool) else None)
    write_streaming(skeleton, lambda key: fetchers[key](), dst, options, chunking=chunking,
                    source=f"deepspeed universal: {tag_dir.name}", progress=progress, release=release,
                    key_prefix=key_prefix)
    notes = (f"{', '.join(skipped)}: a placeholder in the model states with no zero/<name>/fp32.pt (ds_to_universal "
             "does not write ZeRO 3's frozen parameters); not converted",) if skipped else ()
    return ConvertResult("deepspeed", "arrayckpt", len(fetchers), sum(
        m.numel() * m.element_size() for m in _metas(skeleton)), (str(dst),), tuple(skipped), notes=notes)


def _metas(node: object) -> list[torch.Tensor]:
    if isinstance(node, dict):
        return [m for value in node.values() for m in _metas(value)]
    return [node] if isinstance(node, torch.Tensor) and node.device.type == "meta" else []
