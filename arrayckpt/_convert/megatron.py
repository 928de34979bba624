"""Megatron-Core ``dist_checkpointing`` checkpoints (the ``torch_dist`` backend) into arrayckpt.

Such a checkpoint (``megatron/core/dist_checkpointing``: ``serialization.save``, ``strategies/torch.py``,
``strategies/common.py``) is a PyTorch DCP directory plus two files::

    metadata.json    {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", ...}
    common.pt        torch.save of the state dict's non-sharded part (iteration, checkpoint_version, args, ...)
    .metadata, __<rank>_<n>.distcp    DCP: every ShardedTensor as one global tensor under its sharded key;
                                      every ShardedObject as DCP bytes under "<key>/shard_<offsets>_<shape>"

A Megatron-LM save directory holding ``latest_checkpointed_iteration.txt`` is read at the iteration it names
(``iter_0000100/``). The mapping into arrayckpt:

- every ShardedTensor is the array named by its sharded key, unchanged (``decoder.layers.mlp.linear_fc1.weight``,
  ``optimizer.state.exp_avg.decoder...``), with its global shape and dtype: DCP's reader (``dcp.py``) joins the
  saved shards, whatever the tensor/pipeline/data-parallel layout of the save;
- every ShardedObject shard is a value named by DCP's key (``rng_state/shard_0_2``), as Megatron stores it: the
  list of the objects of that key on the saving rank (``[obj]``; ``_mcore_to_torch_sharded_object``); a plain
  value when it is JSON-able, else pickled, which needs ``allow_pickle`` (and then it is unpickled fully);
- every top-level item of ``common.pt`` is a value (or an array, for a tensor) under its own key: plain where
  JSON-able, pickled only with ``allow_pickle``. ``common.pt`` is read with ``torch.load(weights_only=True)``
  (``argparse.Namespace`` allowed, it holds Megatron-LM's ``args``); anything else it holds needs
  ``allow_pickle``, which loads it fully;
- ``metadata.json`` is the value ``megatron.metadata``.

DCP's ``.metadata`` is read by the restricted unpickler of ``dcp.py``; Megatron-Core 0.16 also stores its save
plans there (``all_local_plans``), whose DCP planner classes that unpickler admits.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

from .._errors import FormatError, PickleNotAllowedError, PickleWarning, outside_stacklevel
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .common import ConvertResult, Progress, refusal_reason
from .dcp import METADATA_FILE, from_dcp

__all__ = ["COMMON_FILE", "CONFIG_FILE", "checkpoint_directory", "from_megatron"]

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
LATEST_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's save directory: which iter_XXXXXXX is newest
SUPPORTED_BACKENDS = ("torch_dist",)


def checkpoint_directory(src: Path) -> Path:
    """``src``, or the iteration directory its ``latest_checkpointed_iteration.txt`` names."""
    latest = src / LATEST_FILE
    if (src / CONFIG_FILE).is_file() or not latest.is_file():
        return src
    text = latest.read_text().strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None or not (src / name).is_dir():
        raise FormatError(f"{latest}: names {text!r}, but there is no {src / (name or text)} checkpoint directory")
    return src / name


def _config(directory: Path) -> dict[str, Any]:
    file = directory / CONFIG_FILE
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise FormatError(f"{directory}: no {CONFIG_FILE}; not a Megatron-Core dist_checkpointing checkpoint (or "
                          "its save did not finish: metadata.json is written last)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"{file}: not JSON: {e}") from e
    if not isinstance(config, dict):
        raise FormatError(f"{file}: holds {config!r}, not Megatron's checkpointing config")
    backend = config.get("sharded_backend")
    if backend not in SUPPORTED_BACKENDS:
        raise FormatError(f"{file}: sharded_backend {backend!r}; only {', '.join(SUPPORTED_BACKENDS)} (PyTorch DCP) "
                          "checkpoints are converted")
    if config.get("common_backend", "torch") != "torch":
        raise FormatError(f"{file}: common_backend {config.get('common_backend')!r}; only 'torch' is converted")
    if not (directory / METADATA_FILE).is_file():
        raise FormatError(f"{directory}: no DCP {METADATA_FILE}; the torch_dist checkpoint is incomplete")
    return config


def _common(directory: Path, allow_pickle: bool) -> dict[str, Any]:
    """``common.pt``: with ``weights_only=True`` (plus ``argparse.Namespace``), or fully with ``allow_pickle``."""
    file = directory / COMMON_FILE
    if not file.is_file():
        raise FormatError(f"{directory}: no {COMMON_FILE}; the Megatron checkpoint is incomplete")
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            common = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not allow_pickle:
            raise PickleNotAllowedError(f"{file}: holds pickled content that weights_only loading refuses "
                                        f"({refusal_reason(e)}); converting it needs allow_pickle=True "
                                        "(--allow-pickle), only for checkpoints you trust") from e
        warnings.warn(f"{file}: unpickling it fully (allow_pickle=True; weights_only loading refused it: "
                      f"{refusal_reason(e)}): unpickling runs whatever code its writer put there; convert it only "
                      "if you trust it (silence: warnings.filterwarnings('ignore', category=arrayckpt.PickleWarning))",
                      PickleWarning, stacklevel=outside_stacklevel())
        common = torch.load(file, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise FormatError(f"{file}: not a readable torch.save file: {e}") from e
    if not isinstance(common, dict):
        raise FormatError(f"{file}: holds a {type(common).__name__}, not a state dict")
    return common


def from_megatron(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
                  allow_pickle: bool = False, progress: Progress | None = None,
                  chunking: ChunkPolicy = DEFAULT_CHUNKING) -> ConvertResult:
    """A Megatron-Core ``torch_dist`` checkpoint into arrayckpt (the mapping is this module's docstring)."""
    directory = checkpoint_directory(Path(src))
    config = _config(directory)
    common = _common(directory, allow_pickle)
    extra = {**{str(k): v for k, v in common.items()}, "megatron": {"metadata": config}}
    if len(extra) != len(common) + 1:
        raise FormatError(f"{directory / COMMON_FILE}: has a 'megatron' item, where the converter puts metadata.json")
    return from_dcp(directory, dst, overwrite=overwrite, allow_pickle=allow_pickle, progress=progress,
                    chunking=chunking, extra=extra, label="megatron", trusted_values=allow_pickle)
