"""The files of a DeepSpeed checkpoint, found by DeepSpeed's own naming and read without running its code.

A DeepSpeed checkpoint directory holds ``latest`` (the newest tag) and one directory per tag; a tag directory
(``runtime/engine.py``: ``_get_ckpt_name``, ``_get_rank_zero_ckpt_name``; ``checkpoint/constants.py``) holds

- ``mp_rank_00_model_states.pt`` (ZeRO 1 and 2) or one ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per
  data-parallel rank (ZeRO 3): the module's state dict (ZeRO 3: empty placeholders for the partitioned
  parameters), ``param_shapes``, ``frozen_param_shapes``/``frozen_param_fragments``, ``buffer_names``,
  ``shared_params``, the step counters, ``ds_config`` and the client state, at the top level;
- one ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per data-parallel rank: the rank's flat partitions
  of the fp32 master weights and of the optimizer state (``optimizer_state_dict``).

They are pickles (``torch.save``). :func:`load_pt` reads them with ``torch.load(weights_only=True)`` and an
explicit allow-list of the classes DeepSpeed stores, each mapped to a stand-in of ours, so no DeepSpeed code runs
(DeepSpeed need not even be installed); any other global is refused, naming the file. Optimizer files are
memory-mapped: a partition's pages are read when a parameter needs them and dropped once it is written.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import FormatError
from .._io.smallfiles import read_regular_file
from .common import refusal_reason

__all__ = ["DEEPSPEED_KEYS", "LAYOUT_KEYS", "OPTIMIZER_KEYS", "ZeroFiles", "find_zero_files", "load_pt", "load_value",
           "model_states_file", "plain_scaler", "tag_directory"]

# model-state keys that are DeepSpeed's (kept as deepspeed.<key>) or that describe the layout (used, not kept);
# every other top-level key is the client state.
DEEPSPEED_KEYS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size",
                  "checkpoint_parallel_dimensions", "ds_config", "ds_version", "lr_scheduler", "data_sampler",
                  "random_ltd", "buffer_names", "shared_params", "universal_checkpoint_info")
LAYOUT_KEYS = ("module", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments")
OPTIMIZER_KEYS = ("zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")

MODEL_STATES = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")
OPTIM_STATES = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
LATEST_LIMIT = 1 << 16  # a `latest` file names one tag directory: a few bytes
UNSUPPORTED_FILES = {  # file name patterns of layouts not read here, and what they are
    re.compile(r"layer_\d+.*\.pt"): "pipeline-parallel layer files",
    re.compile(r"(?:layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_\d+_.*\.pt"): "MoE expert files",
}


class LossScalerState:
    """Stands for DeepSpeed's loss scaler objects while unpickling: their attributes, nothing else."""


class FragmentAddress:
    """Stands for ``deepspeed.utils.tensor_fragment.fragment_address`` (``numel``, ``start``)."""

    numel: int
    start: int


def _zero_stage(value: object) -> int:
    """Stands for ``ZeroStageEnum(value)``: the stage number."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise pickle.UnpicklingError(f"ZeroStageEnum({value!r}) is not a ZeRO stage")
    return value


_SCALERS = "deepspeed.runtime.fp16.loss_scaler"
ALLOW_LIST: list[Callable[..., object] | tuple[Callable[..., object], str]] = [
    *((LossScalerState, f"{_SCALERS}.{name}") for name in ("LossScaler", "DynamicLossScaler", "LossScalerBase")),
    (_zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_pt(path: Path, *, mmap: bool = False) -> dict[str, Any]:
    """A DeepSpeed ``.pt`` file holding a dict, unpickled with ``weights_only=True`` and :data:`ALLOW_LIST` only."""
    state = load_value(path, mmap=mmap)
    if not isinstance(state, dict):
        raise FormatError(f"{path}: holds a {type(state).__name__}, not DeepSpeed's state dict")
    return state


def load_value(path: Path, *, mmap: bool = False) -> object:
    """What a DeepSpeed ``.pt`` file holds (a dict, or a tensor or number: a universal checkpoint's per-parameter
    files), unpickled with ``weights_only=True`` and :data:`ALLOW_LIST` only."""
    try:
        with torch.serialization.safe_globals(ALLOW_LIST):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if not mmap or "zip" not in str(e).lower():
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # legacy format: cannot be mapped
    except FileNotFoundError:
        raise FormatError(f"{path}: missing; the DeepSpeed checkpoint is incomplete (a rank's save did not "
                          "finish, or the file was removed)") from None
    except pickle.UnpicklingError as e:
        raise FormatError(f"{path}: holds pickled content outside what DeepSpeed stores (refusing to unpickle it; "
                          f"arrayckpt never runs code from a checkpoint): {refusal_reason(e)}") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise FormatError(f"{path}: not a readable torch.save file: {e}") from e


def plain_scaler(value: object) -> object:
    """A loss scaler stand-in as the plain dict of its attributes (other values as they are)."""
    return dict(vars(value)) if isinstance(value, LossScalerState) else value


def tag_directory(src: Path) -> Path:
    """The tag directory of ``src``: ``src`` itself when it holds model-state files, else the tag ``latest`` names
    (or, without it, ``latest_universal``: a Universal Checkpoint's root)."""
    if any(MODEL_STATES.fullmatch(p.name) for p in src.iterdir()):
        return src
    latest = src / "latest" if (src / "latest").is_file() else src / "latest_universal"
    if not latest.is_file():
        raise FormatError(f"{src}: neither a DeepSpeed tag directory (no *_model_states.pt) nor a checkpoint "
                          "directory with a 'latest' (or 'latest_universal') file; give the tag directory (e.g. "
                          ".../global_step100)")
    tag = read_regular_file(latest, str(latest), limit=LATEST_LIMIT).decode(errors="replace").strip()
    if not tag or "/" in tag or tag in (".", ".."):
        raise FormatError(f"{latest}: names {tag!r}, not a tag directory")
    if not (src / tag).is_dir():
        raise FormatError(f"{latest}: names tag {tag!r}, but {src / tag} does not exist")
    return src / tag


@dataclass(frozen=True)
class ZeroFiles:
    """The files of one ZeRO checkpoint tag, in rank order: the model states (ZeRO 3: one file per rank) and one
    optimizer file per data-parallel rank."""

    tag_dir: Path
    world_size: int
    model_files: tuple[Path, ...]
    optim_files: tuple[Path, ...]

    @property
    def partitioned_weights(self) -> bool:
        """ZeRO 3's layout: every rank has a model-state file of its own."""
        return len(self.model_files) > 1 or self.model_files[0].name.startswith("zero_pp_rank_")


def model_states_file(tag_dir: Path) -> Path:
    """The rank-0 model-state file: ``zero_pp_rank_0_mp_rank_00_model_states.pt`` (ZeRO 3), else
    ``mp_rank_00_model_states.pt``."""
    zero3 = tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    return zero3 if zero3.is_file() else tag_dir / "mp_rank_00_model_states.pt"


def find_zero_files(tag_dir: Path, first_model_state: Mapping[str, object]) -> ZeroFiles:
    """The files this tag must have, from its rank-0 model states (``dp_world_size``), checked against what is
    there: a missing rank file, a rank file beyond the world size, tensor/pipeline parallelism, MoE or a
    checkpoint without ZeRO are errors naming the files."""
    names = sorted(p.name for p in tag_dir.iterdir())
    for pattern, what in UNSUPPORTED_FILES.items():
        found = [n for n in names if pattern.fullmatch(n)]
        if found:
            raise FormatError(f"{tag_dir}: holds {what} ({found[0]}, ...); only data-parallel ZeRO checkpoints "
                              "(tensor- and pipeline-parallel degree 1, no MoE) are converted")
    mp_ranks = {int(m[2]) for n in names if (m := MODEL_STATES.fullmatch(n))} | \
               {int(m[3]) for n in names if (m := OPTIM_STATES.fullmatch(n))}
    mp_world = first_model_state.get("mp_world_size", 1)
    if mp_ranks - {0} or mp_world != 1:
        raise FormatError(f"{tag_dir}: a tensor-parallel checkpoint (mp_world_size {mp_world}, mp ranks "
                          f"{sorted(mp_ranks)}); only tensor-parallel degree 1 is converted")
    world = first_model_state.get("dp_world_size")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise FormatError(f"{tag_dir}: its model states give dp_world_size {world!r}; not a DeepSpeed checkpoint")
    if not any(OPTIM_STATES.fullmatch(n) for n in names) and first_model_state.get("optimizer") is not None:
        raise FormatError(f"{tag_dir}: a checkpoint without ZeRO (stage 0: the optimizer state is in the model "
                          "states, with no parameter names to map it by); ZeRO stages 1, 2 and 3 are converted")
    prefix = "bf16_" if "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in names else ""
    optim = tuple(tag_dir / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world))
    zero3 = "zero_pp_rank_0_mp_rank_00_model_states.pt" in names
    model = tuple(tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)) if zero3 \
        else (tag_dir / "mp_rank_00_model_states.pt",)
    missing = [p.name for p in (*model, *optim) if p.name not in names]
    if missing:
        raise FormatError(f"{tag_dir}: missing {', '.join(missing)} (its model states say dp_world_size {world}); "
                          "a rank's save did not finish or its file was removed")
    extra = [n for n in names if (m := OPTIM_STATES.fullmatch(n)) and int(m[2]) >= world]
    extra += [n for n in names if (m := MODEL_STATES.fullmatch(n)) and m[1] is not None and int(m[1]) >= world]
    if extra:
        raise FormatError(f"{tag_dir}: holds {', '.join(extra)} beyond dp_world_size {world}; the partition counts "
                          "do not match (files of another save mixed in?)")
    return ZeroFiles(tag_dir, world, model, optim)
