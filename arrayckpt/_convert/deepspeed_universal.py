"""An arrayckpt checkpoint into DeepSpeed's Universal Checkpoint layout, which ``engine.load_checkpoint(OUT)`` reads
with ``"checkpoint": {"load_universal": true}`` at any data-parallel degree and ZeRO stage 1, 2 or 3.

The layout is what DeepSpeed 0.19's ``checkpoint/ds_to_universal.py`` writes, and what its loaders read
(``checkpoint/universal_checkpoint.py`` ``load_hp_checkpoint_state`` for ZeRO 1/2, ``runtime/zero/stage3.py``
``load_hp_checkpoint_state_from_checkpoint_dir_stage3`` for ZeRO 3, ``runtime/engine.py`` ``load_checkpoint``)::

    OUT/latest_universal                    the tag, which load_checkpoint reads with load_universal
    OUT/<tag>/zero/<name>/fp32.pt           {"param": the fp32 master weights, "cat_dim": 0}, per trainable parameter
    OUT/<tag>/zero/<name>/exp_avg.pt        the same for each optimizer moment (exp_avg_sq.pt, ...), fp32
    OUT/<tag>/zero/<name>/step.pt           the parameter's step as its optimizer keeps it (a 0-d tensor or an int)
    OUT/<tag>/zero/<frozen>/fp32.pt         {"param": ...} for other floating-point tensors (frozen parameters), as
                                            ds_to_universal writes them (DeepSpeed's loader does not read them)
    OUT/<tag>/zero/optimizer_state.pt       param_groups (hyper-parameters, each group's "params": [its index]),
                                            ds_version, and DeepSpeed's loss scaler, clip_grad, ... where the source
                                            had them; also what ZeRO 3's loader reads: optimizer_state_dict's
                                            state[g]["step"] and param_groups
    OUT/<tag>/mp_rank_00_model_states.pt                 (read by ZeRO 1/2 engines) } one dict: global_steps,
    OUT/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt (read by ZeRO 3 engines)   } skipped_steps, dp/mp_world_size,
                                            lr_scheduler, param_shapes, frozen_param_shapes, buffer_names, ds_config,
                                            ds_version... as DeepSpeed saved them, and the client state at the top level

Where it differs from ds_to_universal, on purpose: the model-states file's ``module`` holds the tensors that are not
floating point and the buffers whole (dtype kept) and every other tensor as a 0-element placeholder of its dtype, as
ZeRO 3's own model-states files do; ds_to_universal copies the source's file, with all the module's weights. DeepSpeed's
universal load never reads the module (the weights come from ``zero/``), and a file holding every weight at once
would need them all in memory. Both model-states names are written, so engines of every ZeRO stage find theirs.
Buffers are not also written as ``zero/<buffer>/fp32.pt`` (ds_to_universal casts them to float there; nothing reads
them). Nothing else differs: tensors are written with ``torch.save`` as plain tensors and dicts; the one DeepSpeed
class pickled is the loss scaler (``deepspeed.runtime.fp16.loss_scaler.LossScaler``/``DynamicLossScaler``, rebuilt
from its saved attributes), because DeepSpeed's loader uses the object it finds there; a source with a loss scaler
(one converted from DeepSpeed) therefore needs DeepSpeed installed to convert.

One tensor is read, written and dropped at a time, so memory stays near the largest tensor. Everything goes to a
hidden directory beside ``OUT`` first (``switch.py``: a rerun or ``arrayckpt gc`` removes it after a kill), made
durable, then switched in (:func:`_install`); ``latest_universal`` is put in place last.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._errors import FormatError
from .._format.manifest import ArrayEntry, PerRankEntry
from .._layout.box import Box
from .._read.checkpoint import Checkpoint, stored_of
from .._read.reader import ChainRead, read
from .._settings import settings
from .._storage.renames import exchange, fsync_dir, make_durable, rename_noreplace
from .._torch.tensors import writable_numpy
from .common import ConvertResult, Progress, nested_state, refuse_existing
from .deepspeed_files import DEEPSPEED_KEYS
from .switch import held_temporary, switch_directory, switched_path
from .universal_plan import MODEL, Source, Trainable, plan_source

if TYPE_CHECKING:
    from .universal_plan import Step

__all__ = ["LATEST", "MODEL_STATES", "OPTIMIZER_STATE", "ZERO3_MODEL_STATES", "param_directory", "to_universal"]

LATEST = "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIMIZER_STATE = "optimizer_state.pt"
DS_VERSION = "0.19.8"  # the DeepSpeed whose layout this writes; its loader checks a checkpoint's ds_version is there
CARRIED_OPTIMIZER_KEYS = ("dynamic_loss_scale", "overflow", "clip_grad")  # from deepspeed.*, into optimizer_state.pt


def param_directory(zero: Path, name: str, where: str) -> Path:
    """``zero/<name>``, for a parameter name from a checkpoint, which must stay inside ``zero/``."""
    if not name or name in (".", "..") or any(c in name for c in "/\\\0") or name.startswith("."):
        raise FormatError(f"{where}: parameter name {name!r} cannot be a directory name of the universal layout")
    return zero / name


def _widened(checkpoint: Checkpoint, key: str) -> torch.Tensor:
    """The whole array, widened to fp32 (exactly) where it is a narrower float, as DeepSpeed's master weights and
    moments are; fp32 and wider as stored. Widening reads row blocks of ``widen_block_bytes`` (``_settings.py``)
    into the fp32 tensor, so the narrow copy is never held whole beside it."""
    array = checkpoint[key]
    if not array.entry.dtype.name.startswith(("float", "bfloat")) or array.entry.dtype.itemsize >= 4:
        return array.torch()
    shape = array.shape
    if not shape or not array.size:
        return array.torch().float()
    out = torch.empty(shape, dtype=torch.float32)
    rows = max(1, settings().widen_block_bytes // max(1, array.nbytes // shape[0]))
    block = torch.empty((min(rows, shape[0]), *shape[1:]), dtype=array.dtype)
    for start in range(0, shape[0], rows):
        part = block[:min(rows, shape[0] - start)]
        box = Box((start,) + (0,) * (len(shape) - 1), tuple(part.shape))
        read(stored_of(checkpoint), [ChainRead(key, box, writable_numpy(part, array.entry.dtype, key))])
        out[start:start + part.shape[0]].copy_(part)
    return out


def _placeholder(entry: ArrayEntry) -> torch.Tensor:
    return torch.empty(0, dtype=getattr(torch, entry.dtype.name))


class _Writer:
    """Writes the files of one tag, counting tensors and bytes for the result and the progress."""

    def __init__(self, checkpoint: Checkpoint, tag_dir: Path, moments: tuple[str, ...],
                 progress: Progress | None) -> None:
        self.checkpoint = checkpoint
        self.where = str(checkpoint.location)
        self.zero = tag_dir / "zero"
        self.zero.mkdir(parents=True)
        self.moments = moments
        self.progress = progress
        self.total = sum(checkpoint[k].nbytes for k, e in checkpoint.manifest.entries.items()
                         if isinstance(e, ArrayEntry) and e.parts[0] == MODEL)
        self.tensors = self.bytes = self.done = 0

    def save(self, name: str, file: str, value: object) -> None:
        directory = param_directory(self.zero, name, self.where)
        directory.mkdir(exist_ok=True)
        torch.save(value, directory / file)
        if isinstance(value, dict) and isinstance(value.get("param"), torch.Tensor):
            self.tensors += 1
            self.bytes += value["param"].nbytes

    def tensor(self, key: str) -> torch.Tensor:
        return _widened(self.checkpoint, key)

    def trainable(self, p: Trainable, step: Step | None) -> None:
        """fp32.pt, one file per moment and step.pt for one trainable parameter."""
        weights = self.tensor(f"{MODEL}.{p.name}")
        self.save(p.name, "fp32.pt", {"param": weights, "cat_dim": 0})
        shape, dtype = weights.shape, weights.dtype
        del weights
        for moment in self.moments:
            value = self.tensor(p.state[moment]) if moment in p.state else torch.zeros(shape, dtype=dtype)
            self.save(p.name, f"{moment}.pt", {"param": value, "cat_dim": 0})
            del value  # before the next one is read
        if step is not None:
            self.save(p.name, "step.pt", step)
        self._advance(self.checkpoint[f"{MODEL}.{p.name}"].nbytes)

    def frozen(self, name: str) -> None:
        self.save(name, "fp32.pt", {"param": self.tensor(f"{MODEL}.{name}")})
        self._advance(self.checkpoint[f"{MODEL}.{name}"].nbytes)

    def whole(self, name: str) -> torch.Tensor:
        tensor = self.checkpoint[f"{MODEL}.{name}"].torch()
        self.tensors += 1
        self.bytes += tensor.nbytes
        self._advance(tensor.nbytes)
        return tensor

    def _advance(self, nbytes: int) -> None:
        """Progress by the module's bytes (the moments follow their parameter)."""
        self.done += nbytes
        if self.progress is not None:
            self.progress(self.done, self.total)


def _loss_scaler(attributes: Mapping[str, object], where: str) -> object:
    """DeepSpeed's loss scaler object with the saved attributes (its loader calls the object's methods)."""
    try:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import: keep --json output clean
            from deepspeed.runtime.fp16 import loss_scaler
    except ImportError as e:
        raise FormatError(f"{where}: holds DeepSpeed's loss scaler, which the universal layout stores as a DeepSpeed "
                          "object; convert where DeepSpeed is installed") from e
    cls = loss_scaler.DynamicLossScaler if attributes.get("dynamic") else loss_scaler.LossScaler
    scaler = cls.__new__(cls)
    scaler.__dict__.update(attributes)
    return scaler


def _optimizer_state(source: Source, deepspeed: Mapping[str, Any], where: str) -> dict[str, object]:
    """``zero/optimizer_state.pt``: what ZeRO 1/2's ``_load_global_state`` and ZeRO 3's universal loader read."""
    groups = [{**dict(hyper), "params": [g]} for g, hyper in enumerate(source.hyper)]
    out: dict[str, object] = {"ds_version": deepspeed.get("ds_version", DS_VERSION)}
    if "zero_stage" in deepspeed:
        out["zero_stage"] = deepspeed["zero_stage"]
    if isinstance(deepspeed.get("loss_scaler"), dict):
        out["loss_scaler"] = _loss_scaler(deepspeed["loss_scaler"], where)
    out |= {k: deepspeed[k] for k in CARRIED_OPTIMIZER_KEYS if k in deepspeed}
    out["param_groups"] = groups
    out["optimizer_state_dict"] = {"state": {g: {"step": step} for g, step in enumerate(source.steps)
                                             if step is not None}, "param_groups": groups}
    return out


def _model_states(checkpoint: Checkpoint, source: Source, module: dict[str, torch.Tensor],
                  values: Mapping[str, Any], frozen: list[str]) -> dict[str, object]:
    """The model-states dict: DeepSpeed's values as saved (a DeepSpeed source) or what its loader needs (others),
    the shapes, the module with placeholders, and the client state at the top level."""
    entries = {k: e for k, e in checkpoint.manifest.entries.items() if isinstance(e, ArrayEntry)}  # the tensors'
    shape = {name: torch.Size(entries[f"{MODEL}.{name}"].shape) for name in source.trainable} | \
        {name: torch.Size(entries[f"{MODEL}.{name}"].shape) for name in frozen}
    deepspeed = values.get("deepspeed", {}) if source.from_deepspeed else {}
    out: dict[str, object] = {"module": module, "optimizer": None}
    out |= {k: deepspeed[k] for k in DEEPSPEED_KEYS if k in deepspeed}
    out["param_shapes"] = [collections.OrderedDict((p.name, shape[p.name]) for p in group) for group in source.groups]
    out["frozen_param_shapes"] = collections.OrderedDict((name, shape[name]) for name in frozen)
    step = next((float(s) for s in source.steps if s is not None), None)
    defaults = {"global_steps": checkpoint.step if checkpoint.step is not None else int(step or 0),
                "skipped_steps": 0, "dp_world_size": 1, "mp_world_size": 1, "ds_version": DS_VERSION}
    out |= {k: v for k, v in defaults.items() if k not in out}
    client = values.get("client", {}) if source.from_deepspeed else \
        {k: v for k, v in values.items() if k not in (MODEL, source.optim)}
    clash = sorted(set(client) & set(out))
    if clash:
        raise FormatError(f"{checkpoint.location}: top-level value(s) {clash} would take the place of DeepSpeed's own "
                          "keys in the model states; rename them")
    return out | client


def _plain_values(checkpoint: Checkpoint, source: Source) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The checkpoint's values as nested dicts, with the client state's tensors read (nothing of the module or the
    optimizer is read here)."""
    def client(key: str) -> bool:
        top = checkpoint.manifest.entries[key].parts[0]
        return top == "client" if source.from_deepspeed else top not in (MODEL, source.optim, "deepspeed")

    return nested_state(checkpoint, lambda key: checkpoint[key].torch() if client(key) else None)


def _write_tag(checkpoint: Checkpoint, source: Source, tag_dir: Path, progress: Progress | None) -> _Writer:
    values, _ = _plain_values(checkpoint, source)
    deepspeed = values.get("deepspeed", {}) if source.from_deepspeed else {}
    writer = _Writer(checkpoint, tag_dir, source.moments, progress)
    trainable = source.trainable
    buffers = set(deepspeed.get("buffer_names") or ())
    module: dict[str, torch.Tensor] = collections.OrderedDict()
    frozen = []
    for entry in checkpoint.manifest.entries.values():
        if entry.parts[0] != MODEL or not isinstance(entry, ArrayEntry):
            continue
        name = ".".join(str(p) for p in entry.parts[1:])
        floating = entry.dtype.name.startswith(("float", "bfloat"))
        if name in trainable:
            writer.trainable(trainable[name], source.steps[trainable[name].group])
            module[name] = _placeholder(entry)
        elif floating and name not in buffers:
            writer.frozen(name)
            module[name] = _placeholder(entry)
            frozen.append(name)
        else:
            module[name] = writer.whole(name)
    states = _model_states(checkpoint, source, module, values, frozen)
    for file in (MODEL_STATES, ZERO3_MODEL_STATES):
        torch.save(states, tag_dir / file)
    torch.save(_optimizer_state(source, deepspeed, str(checkpoint.location)), writer.zero / OPTIMIZER_STATE)
    return writer


def _tag(checkpoint: Checkpoint, source: Source) -> str:
    """The source's DeepSpeed tag plus ``_universal`` (as DeepSpeed's tutorial names it), else ``global_step<N>``."""
    if source.from_deepspeed and "deepspeed.tag" in checkpoint.manifest.entries:
        tag = checkpoint.plain_values["deepspeed.tag"]
        if isinstance(tag, str) and tag and "/" not in tag and not tag.startswith("."):
            return f"{tag}_universal"
    step = checkpoint.step if checkpoint.step is not None else next(
        (int(float(s)) for s in source.steps if s is not None), 0)
    return f"global_step{step}_universal"


def _install(temporary: Path, target: Path, tag: str) -> None:
    """Switch the export written in ``temporary`` into ``target``. Where nothing (or an empty directory) is there,
    the whole directory in one step. Otherwise ``target`` is a DeepSpeed checkpoint directory whose other tags and
    files are kept: the tag goes in in one step (exchanged with an earlier tag of that name, which ``temporary``
    then holds, to be removed), then ``latest_universal`` is replaced by the new one, in one step too. A kill in
    between leaves the new tag beside the one ``latest_universal`` still names (or, the same name, the new tag
    already named): DeepSpeed's load reads the old export or the new one, whole."""
    if not target.is_dir() or not any(target.iterdir()):
        switch_directory(temporary, target)
        return
    make_durable(temporary)
    if not rename_noreplace(temporary / tag, target / tag):
        exchange(temporary / tag, target / tag)
    fsync_dir(target)
    os.replace(temporary / LATEST, target / LATEST)
    fsync_dir(target)


def to_universal(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
                 progress: Progress | None = None, param_names: Sequence[str] | None = None) -> ConvertResult:
    """``checkpoint`` as a DeepSpeed Universal Checkpoint in the directory ``dst`` (the layout is in this module's
    docstring): ``engine.load_checkpoint(dst)`` with ``"checkpoint": {"load_universal": true}`` resumes from it.
    ``param_names``: the module's names of the optimizer's parameters, in the order its param groups list them, for
    an optimizer that numbers them where the numbers cannot be mapped unambiguously (``universal_plan.py``)."""
    target = Path(dst)
    if target.exists() and not target.is_dir():
        raise FormatError(f"{target}: not a directory; a DeepSpeed checkpoint is a directory")
    if target.is_dir() and any(target.iterdir()):
        refuse_existing(target, overwrite)
    source = plan_source(checkpoint, param_names)
    tag = _tag(checkpoint, source)
    place = switched_path(target)
    with held_temporary(place.parent, place.name) as temporary:  # its parents are made
        writer = _write_tag(checkpoint, source, temporary / tag, progress)
        (temporary / LATEST).write_text(tag)
        _install(temporary, place, tag)
    skipped = tuple(k for k, e in checkpoint.manifest.entries.items() if isinstance(e, PerRankEntry))
    return ConvertResult("arrayckpt", "deepspeed", writer.tensors, writer.bytes, (str(target / tag),
                         str(target / LATEST)), skipped, notes=source.notes)
