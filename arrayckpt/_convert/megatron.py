"""Megatron-Core ``dist_checkpointing`` checkpoints (the ``torch_dist`` backend) to and from arrayckpt.

Such a checkpoint (``megatron/core/dist_checkpointing``: ``serialization.save``, ``strategies/torch.py``,
``strategies/common.py``) is a PyTorch DCP directory plus two files::

    metadata.json    {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", ...}
    common.pt        torch.save of the state dict's non-sharded part (iteration, checkpoint_version, args, ...)
    .metadata, __<rank>_<n>.distcp    DCP: every ShardedTensor as one global tensor under its sharded key;
                                      every ShardedObject as DCP bytes under "<key>/shard_<offsets>_<shape>"

A Megatron-LM save directory holding ``latest_checkpointed_iteration.txt`` is read at the iteration it names
(``iter_0000100/``). Megatron-LM's ``--ckpt-format fsdp_dtensor`` (Megatron-FSDP: plain DCP, no ``metadata.json``) is
told apart there and converted by ``megatron_fsdp.py``, both ways. The mapping into arrayckpt (:func:`from_megatron`):

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
- ``metadata.json`` is the value ``megatron.metadata``; the manifest's ``created["source"]`` records it and which
  top-level keys came from ``common.pt`` (``{"format": "megatron", "metadata": ..., "common": [...]}``).

DCP's ``.metadata`` is read by the restricted unpickler of ``dcp.py``; Megatron-Core 0.16 also stores its save
plans there (``all_local_plans``), whose DCP planner classes that unpickler admits.

And back (:func:`to_megatron`), a directory ``megatron.core.dist_checkpointing.load`` loads with the sharded state
dict of any tensor-parallel layout (the user's ``ShardedTensor.from_rank_offsets``, ``ShardedObject``):

- every array is a ShardedTensor named by its arrayckpt key (``model.layers.0.weight``), saved whole as one DCP
  chunk, so any layout reads its part (Megatron's own save writes one chunk per rank); streamed one at a time;
- a top-level value named as Megatron names a ShardedObject shard (``<key>/shard_<offsets>_<shape>``, a key
  without ``/``, as Megatron's loader parses it back) that holds a list is that shard, saved as Megatron saves it
  (``torch.save`` of the list, as DCP bytes);
- everything else goes into ``common.pt`` as the nested state it is (lists, dicts, ints, strings; pickled values
  with ``allow_pickle``), and so do the top-level keys a Megatron import took from ``common.pt``, tensors included
  (Megatron's own loader finds a plain tensor only there);
- ``metadata.json`` is Megatron-Core's ``CheckpointingConfig`` for ``torch_dist`` version 1, written last; the
  import's ``megatron.metadata`` is not copied into ``common.pt`` (it is that file);
- per-rank entries have no place in the format and are skipped (named in the result).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from .._errors import FormatError, PickleNotAllowedError, warn_unpickling
from .._format.jsontypes import JSON
from .._format.manifest import ArrayEntry, Entry, PerRankEntry
from .._io.smallfiles import read_regular_file
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._read.checkpoint import Checkpoint
from .common import ConvertResult, Progress, refusal_reason, refuse_existing, restore_containers
from .dcp import METADATA_FILE, dcp_file, from_dcp, meta_tensor, new_directory, refuse_pickles, stream_into_dcp
from .megatron_fsdp import CKPT_FORMAT, from_fsdp_dtensor, is_fsdp_dtensor, to_fsdp_dtensor

__all__ = ["CKPT_FORMATS", "COMMON_FILE", "CONFIG_FILE", "WRITTEN_CONFIG", "checkpoint_directory", "from_megatron",
           "to_megatron"]

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
LATEST_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's save directory: which iter_XXXXXXX is newest
SUPPORTED_BACKENDS = ("torch_dist",)
CKPT_FORMATS = ("torch_dist", CKPT_FORMAT)  # Megatron-LM's --ckpt-format values written here
# metadata.json as Megatron-Core writes it for its torch_dist save (asdict(CheckpointingConfig("torch_dist", 1)));
# its loader builds CheckpointingConfig(**json), so no other member may be there
WRITTEN_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                  "common_backend_version": 1}
# ShardedObject.unique_key: f"{key}/shard_{'.'.join(global_offset)}_{'.'.join(global_shape)}", as
# ShardedObject.empty_from_unique_key parses it back (Megatron's load_sharded_metadata does, for every DCP bytes item)
_SMALL_FILE = 16 << 20  # metadata.json, latest_checkpointed_iteration.txt: a few hundred bytes in practice
SHARDED_OBJECT = re.compile(r"[^/]+/shard_\d+(?:\.\d+)*_\d+(?:\.\d+)*")


def checkpoint_directory(src: Path) -> Path:
    """``src``, or the iteration directory its ``latest_checkpointed_iteration.txt`` names."""
    latest = src / LATEST_FILE
    if (src / CONFIG_FILE).is_file() or not latest.is_file():
        return src
    text = read_regular_file(latest, str(latest), limit=_SMALL_FILE).decode(errors="replace").strip()
    name = "release" if text == "release" else f"iter_{int(text):07d}" if text.isdigit() else None
    if name is None or not (src / name).is_dir():
        raise FormatError(f"{latest}: names {text!r}, but there is no {src / (name or text)} checkpoint directory")
    return src / name


def _config(directory: Path) -> JSON:
    file = directory / CONFIG_FILE
    try:
        config = json.loads(read_regular_file(file, str(file), limit=_SMALL_FILE))
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
        warn_unpickling(f"{file}: unpickling it fully (weights_only loading refused it: {refusal_reason(e)})")
        common = torch.load(file, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise FormatError(f"{file}: not a readable torch.save file: {e}") from e
    if not isinstance(common, dict):
        raise FormatError(f"{file}: holds a {type(common).__name__}, not a state dict")
    return common


def from_megatron(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
                  allow_pickle: bool = False, progress: Progress | None = None,
                  chunking: ChunkPolicy = DEFAULT_CHUNKING, key_prefix: str = "") -> ConvertResult:
    """A Megatron-Core ``torch_dist`` checkpoint into arrayckpt (the mapping is this module's docstring), or a
    Megatron-LM ``fsdp_dtensor`` one (``megatron_fsdp.py``), told apart by their files."""
    directory = checkpoint_directory(Path(src))
    if is_fsdp_dtensor(directory):
        return from_fsdp_dtensor(directory, dst, overwrite=overwrite, allow_pickle=allow_pickle, progress=progress,
                                 chunking=chunking, key_prefix=key_prefix)
    config = _config(directory)
    common = _common(directory, allow_pickle)
    extra = {**{str(k): v for k, v in common.items()}, "megatron": {"metadata": config}}
    if len(extra) != len(common) + 1:
        raise FormatError(f"{directory / COMMON_FILE}: has a 'megatron' item, where the converter puts metadata.json")
    record = {"format": "megatron", "metadata": config, "common": sorted(str(k) for k in common)}
    return from_dcp(directory, dst, overwrite=overwrite, allow_pickle=allow_pickle, progress=progress,
                    chunking=chunking, extra=extra, label="megatron", trusted_values=allow_pickle,
                    created={"source": record}, key_prefix=key_prefix)


def to_megatron(checkpoint: Checkpoint, dst: str | os.PathLike[str], *, overwrite: bool = False,
                progress: Progress | None = None, ckpt_format: str = "torch_dist") -> ConvertResult:
    """An arrayckpt checkpoint into a Megatron-Core ``torch_dist`` directory (the mapping is this module's
    docstring), or with ``ckpt_format="fsdp_dtensor"`` a Megatron-LM ``fsdp_dtensor`` one (``megatron_fsdp.py``).
    ``torch_dist``: ``common.pt``, then DCP's own save of the ShardedTensors and ShardedObjects, each tensor read only
    when written and appended to one ``__0_0.distcp`` (memory: the largest tensor), then ``metadata.json``;
    written into a hidden directory beside ``dst`` and switched into place whole (``dcp.py::new_directory``): a
    kill leaves the old checkpoint or the new one there, and the hidden directory a rerun or ``arrayckpt gc``
    removes. Files of the user's beside an earlier checkpoint stay (its files are then replaced one by one, the
    entry points ``metadata.json`` and ``.metadata`` first out and last in: a kill may leave a directory that does
    not load, never a mix). ``notes`` say when ``common.pt`` holds what Megatron's
    loader (``torch.load``, ``weights_only=True``) refuses without an allow-list."""
    if ckpt_format == CKPT_FORMAT:
        return to_fsdp_dtensor(checkpoint, dst, overwrite=overwrite, progress=progress)
    if ckpt_format != "torch_dist":
        raise FormatError(f"ckpt_format {ckpt_format!r}: Megatron checkpoints are written as {', '.join(CKPT_FORMATS)}")
    target = Path(dst)
    if target.exists() and any(target.iterdir()):
        refuse_existing(target, overwrite)
    refuse_pickles(checkpoint)
    parts = _placement(checkpoint)
    objects = _nested(checkpoint, parts.objects)
    common = _nested(checkpoint, parts.common)
    for name in [n for n, v in objects.items() if not isinstance(v, list)]:  # not the list Megatron stores
        common[name] = objects.pop(name)
    config = _nested(checkpoint, parts.config).get("megatron", {})
    if config and not (isinstance(config["metadata"], dict) and config["metadata"].get("sharded_backend") in
                       SUPPORTED_BACKENDS):
        common.setdefault("megatron", {}).update(config)  # not an import's copy of metadata.json: a value
    keys = frozenset(e.key for e in parts.tensors)
    state: dict[str, object] = {e.key: meta_tensor(checkpoint, e.key) for e in parts.tensors} | objects
    notes = []
    with new_directory(target, _megatron_file, [CONFIG_FILE, METADATA_FILE]) as temporary:
        _write_durably(temporary / COMMON_FILE, functools.partial(torch.save, common))  # first: then its tensors go
        del common
        refused = _weights_only_refusal(temporary / COMMON_FILE)
        if refused:
            notes.append(f"{COMMON_FILE} holds {refused}: Megatron's load reads it with torch.load(weights_only=True), "
                         "which refuses that unless allowed first (torch.serialization.add_safe_globals, as "
                         "Megatron-LM allows argparse.Namespace)")
        total = stream_into_dcp(checkpoint, state, keys, temporary, flatten=False, progress=progress)
        _write_durably(temporary / CONFIG_FILE, lambda f: f.write(json.dumps(WRITTEN_CONFIG).encode()))
    arrays = len(keys) + sum(isinstance(e, ArrayEntry) for e in (*parts.objects, *parts.common))
    return ConvertResult("arrayckpt", "megatron", arrays, total, tuple(sorted(str(p) for p in target.iterdir())),
                         parts.skipped, notes=tuple(notes))


@dataclass(frozen=True)
class _Placement:
    """Where each entry of the checkpoint goes in a Megatron checkpoint (entries in manifest order)."""

    tensors: tuple[Entry, ...]  # ShardedTensors
    objects: tuple[Entry, ...]  # inside a top-level ShardedObject shard
    common: tuple[Entry, ...]  # common.pt
    config: tuple[Entry, ...]  # megatron.metadata: an import's copy of metadata.json
    skipped: tuple[str, ...]  # per-rank entries


def _placement(checkpoint: Checkpoint) -> _Placement:
    """Each entry's place: a top-level key a Megatron import read from ``common.pt`` goes back there; then
    ``megatron.metadata``; then ShardedObject shards by name; then arrays are ShardedTensors; the rest is common."""
    from_common = _common_record(checkpoint)
    places: dict[str, list[Entry]] = {"tensors": [], "objects": [], "common": [], "config": []}
    skipped: list[str] = []
    for key, entry in checkpoint.manifest.entries.items():
        head = entry.parts[0]
        if isinstance(entry, PerRankEntry):
            skipped.append(key)
        elif head in from_common:
            places["common"].append(entry)
        elif entry.parts[:2] == ("megatron", "metadata"):
            places["config"].append(entry)
        elif isinstance(head, str) and SHARDED_OBJECT.fullmatch(head):
            places["objects"].append(entry)
        elif checkpoint.manifest.array_entry(key) is not None:  # an array, or an alias of one (tied weights: both)
            places["tensors"].append(entry)
        else:
            places["common"].append(entry)
    return _Placement(**{name: tuple(entries) for name, entries in places.items()}, skipped=tuple(skipped))


def _common_record(checkpoint: Checkpoint) -> frozenset[str]:
    """The top-level keys a Megatron import took from ``common.pt`` (``created["source"]["common"]``). The
    record is informational: a malformed one is ignored (arrays then become ShardedTensors), never an error."""
    record = checkpoint.manifest.created.get("source")
    if not isinstance(record, dict) or record.get("format") != "megatron" or not isinstance(record.get("common"),
                                                                                              list):
        return frozenset()
    return frozenset(k for k in record["common"] if isinstance(k, str))


def _nested(checkpoint: Checkpoint, entries: Iterable[Entry]) -> dict[Any, Any]:
    """The nested state of ``entries`` with their data (arrays as torch tensors, in memory): values for
    ``common.pt`` and ShardedObjects, which Megatron holds whole too."""
    root: dict[Any, Any] = {}
    for entry in entries:
        value = checkpoint[entry.key].torch() if isinstance(entry, ArrayEntry) else checkpoint.plain_values[entry.key]
        node = root
        for part in entry.parts[:-1]:
            node = node.setdefault(part, {})
        node[entry.parts[-1]] = value
    return restore_containers(root, (), checkpoint.manifest.containers)


def _megatron_file(name: str) -> bool:
    """A file of a Megatron ``torch_dist`` checkpoint (what an earlier export, or Megatron's save, wrote)."""
    return name in (CONFIG_FILE, COMMON_FILE) or dcp_file(name)


def _write_durably(file: Path, write: Callable[[IO[bytes]], object]) -> None:
    with open(file, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _weights_only_refusal(file: Path) -> str | None:
    """What ``torch.load(weights_only=True)`` refuses in ``file`` (``None``: it loads)."""
    try:
        torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        return refusal_reason(e)
    return None
