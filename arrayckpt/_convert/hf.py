"""A Hugging Face export: the model's weights of a training checkpoint, as ``save_pretrained`` writes them, into a
directory that ``from_pretrained`` loads with no missing or unexpected keys.

What goes in, and under which names (:func:`select_model`): the tensors under one key prefix (``model.``), the
prefix stripped. With no prefix given it is found: the one top-level key whose entries are all tensors (an
``nn.Module``'s state), whatever else the state holds (optimizer, step, RNG); or, where the state is nothing
but tensors, the whole of it (a bare state dict, a converted ``model.safetensors``), unless it is one module
under one key (``{"model": model}``). A state with two modules (``model`` and ``ema``) is refused until
``select`` names one.
Optimizer state (a ``state`` beside a ``param_groups``), plain values, per-rank entries and numpy arrays never
go in; they are listed in the result's ``skipped``.

What is written into the directory: ``model.safetensors``, or shards of at most ``max_shard_bytes`` named as
transformers names them (``model-00001-of-00003.safetensors``) with ``model.safetensors.index.json``; every file's
``__metadata__`` is ``{"format": "pt"}``; dtypes are kept (bfloat16 stays bfloat16); tied duplicates are left out
as ``save_pretrained`` leaves them out (``hf_ties.py``); a given ``config.json`` is copied (without one, a
``config.json`` already in the directory is the model's, read for its ties and checks). Weight files of an
earlier export that this one does not replace are removed (with ``overwrite``), or the export is refused: a
stale shard or index beside the new files would be loaded instead of them. Other files (tokenizer, README) are
the user's, left alone. Tensors stream one at a time (``safetensors.py::write_file``); no torch is needed unless
transformers is asked which weights the config's model ties.

Replacing an earlier export (``switch.py``). ``from_pretrained`` finds the weights through ``model.safetensors``
(preferred where both are there) or else ``model.safetensors.index.json``, whose ``weight_map`` names the shards;
arrayckpt's own reader looks for the index first. The new files (and a copied ``config.json`` whose bytes differ
from the one there) are written into ``.model.safetensors.arrayckpt-tmp-<hex>/`` inside the directory, made
durable, then moved in: the *commit* (the index, or ``model.safetensors`` alone) last. Where no other new file
takes a name already there and the old export's entry point is the new one's (shards to shards of another count,
one file to one file), every move before the commit adds files the old entry point does not name. Otherwise (the
same shard count, one file to shards or back, a new ``config.json``) the old entry points are removed first.
A kill can leave:

1. before the moves: the old export, whole; the temporary directory beside it;
2. during the moves, no name taken: the old export (its entry point names none of the new files);
3. during the moves, a name taken: no entry point, so ``from_pretrained`` fails ("no file named
   model.safetensors") and arrayckpt's reader refuses several ``.safetensors`` files without an index, or one
   shard (``-of-00003``) without its index;
4. after the commit: the new export, whole, maybe beside old shards nothing names (and the temporary directory;
   arrayckpt's reader refuses ``model.safetensors`` beside such shards, not knowing which is meant).

A rerun of the export removes what 1, 3 and 4 left; ``arrayckpt gc DIR`` removes the temporary directory (never
one a running export holds). The user's files are never touched.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .._errors import CheckpointExistsError, FormatError, StateError
from .._format.manifest import AliasEntry, ArrayEntry, Entry
from .._io.smallfiles import read_user_file
from .._read.checkpoint import Checkpoint
from .common import ConvertResult, Progress
from .hf_ties import Tie, model_check, option_ties, resolve_ties
from .safetensors import (
    DEFAULT_FILE_METADATA,
    SAFETENSORS_INDEX,
    WEIGHTS,
    check_storable,
    cut_shards,
    earlier_weights,
    shard_files,
    write_file,
)
from .switch import held_temporary, switch_files

__all__ = ["HF_MAX_SHARD_BYTES", "HfOptions", "Selection", "is_tensor", "refuse_earlier_export", "select_model",
           "to_hf", "top_level_keys"]

HF_MAX_SHARD_BYTES = 50 * 10**9  # save_pretrained's default max_shard_size, "50GB"
CONFIG = "config.json"
FLOATS = ("float64", "float32", "float16", "bfloat16")
NO_CONFIG = ("no config.json given (--config): from_pretrained needs the model's beside the weights, and the "
             "model's tied weights were not looked up (only those the checkpoint stores once, and those a tie names, "
             "are left out)")


@dataclass(frozen=True)
class HfOptions:
    """What a Hugging Face export takes besides the checkpoint: which tensors (``select``: a key prefix, ``""``
    for the whole state, ``None`` to find the model), which names are one tensor (``tie``: alias -> target, as
    ``{"lm_head.weight": "transformer.wte.weight"}``), and the ``config.json`` to copy (and read ties from)."""

    select: str | None = None
    tie: Mapping[str, str] = field(default_factory=dict)
    config: str | os.PathLike[str] | None = None


@dataclass(frozen=True)
class Selection:
    """The tensors an export writes: name in the export -> key in the checkpoint (in the checkpoint's order), the
    prefix stripped from each key, and every other entry, left out."""

    prefix: str
    tensors: dict[str, str]
    skipped: tuple[str, ...]


def select_model(checkpoint: Checkpoint, select: str | None) -> Selection:
    """The model's tensors of ``checkpoint``: those under ``select`` (``"model."``; ``"model"`` means the same;
    ``""`` the whole state), or under the prefix found as the module docstring says."""
    entries = checkpoint.manifest.entries
    prefix = _find_prefix(checkpoint) if select is None else (select.rstrip(".") + "." if select.strip(".") else "")
    chosen = {key: entry for key, entry in entries.items() if key.startswith(prefix)}
    tensors = {key[len(prefix):]: key for key, entry in chosen.items() if is_tensor(checkpoint, entry)}
    if not tensors:
        raise StateError(f"{checkpoint.location}: no tensors under {prefix!r}; the top-level keys are "
                         f"{top_level_keys(entries)}; choose the model's with --select PREFIX (select=...)")
    optimizer = _optimizer_at(chosen.values(), len(prefix.split(".")) - 1 if prefix else 0)
    if optimizer is not None:
        raise StateError(f"{checkpoint.location}: the selection {prefix or '(the whole state)'!r} holds optimizer "
                         f"state at {optimizer!r}, which a Hugging Face export never takes; choose the model's "
                         "prefix with --select PREFIX (select=...)")
    kept = set(tensors.values())
    return Selection(prefix, tensors, tuple(key for key in entries if key not in kept))


def is_tensor(checkpoint: Checkpoint, entry: Entry) -> bool:
    """A tensor entry, or an alias of one (a tied weight stored once, spec §4.3): both are the model's weights."""
    found = checkpoint.manifest.array_entry(entry.key) if isinstance(entry, AliasEntry) else entry
    return isinstance(found, ArrayEntry) and found.kind == "tensor"


def manifest_ties(checkpoint: Checkpoint, selection: Selection) -> list[Tie]:
    """The ties the checkpoint itself records: each alias in the selection whose target is in it too. They hold
    by construction (one stored array), and come after the config's so that transformers' choice of which name
    is written wins where both name the same pair."""
    names = {key: name for name, key in selection.tensors.items()}
    aliases = checkpoint.manifest.aliases
    return [Tie(names[key], names[target], "manifest") for key, target in aliases.items()
            if key in names and target in names]


def top_level_keys(entries: Mapping[str, Entry]) -> str:
    return ", ".join(dict.fromkeys(str(e.parts[0]) for e in entries.values())) or "(none)"


def _find_prefix(checkpoint: Checkpoint) -> str:
    """Where the model is: a state of nothing but tensors is a bare state dict (``""``), unless it is one module
    under one top-level key (``{"model": model}``); otherwise the one top-level key holding a module (only
    tensors, each one level down or more) beside the rest (optimizer, values)."""
    groups: dict[str, list[Entry]] = {}
    for entry in checkpoint.manifest.entries.values():
        groups.setdefault(str(entry.parts[0]), []).append(entry)
    modules = [top for top, group in groups.items() if _optimizer_at(group, 0) is None
               and all(is_tensor(checkpoint, e) and len(e.parts) > 1 for e in group)]
    if all(is_tensor(checkpoint, e) for group in groups.values() for e in group):
        return f"{modules[0]}." if len(groups) == 1 and modules else ""
    if len(modules) == 1:
        return f"{modules[0]}."
    found = f"several modules ({', '.join(f'{m}.' for m in modules)})" if modules else \
        f"no module (top-level keys holding only tensors) among {top_level_keys(checkpoint.manifest.entries)}"
    raise StateError(f"{checkpoint.location}: cannot tell which tensors are the model's: {found}; choose with "
                     "--select PREFIX (select='model.'; '' for the whole state)")


def _optimizer_at(entries: Iterable[Entry], depth: int) -> str | None:
    """Where an optimizer's state lies in ``entries`` (a key prefix with both ``state`` and ``param_groups``
    below it, at ``depth`` or deeper), or ``None``."""
    below: dict[tuple[str, ...], set[str]] = {}
    for entry in entries:
        parts = tuple(str(p) for p in entry.parts)
        for i in range(depth, len(parts)):
            if parts[i] in ("state", "param_groups"):
                below.setdefault(parts[:i], set()).add(parts[i])
    return next((".".join(parent) or "(top)" for parent, names in below.items() if len(names) == 2), None)


def to_hf(checkpoint: Checkpoint, dst: str | os.PathLike[str], options: HfOptions, *, overwrite: bool = False,
          max_shard_bytes: int | None = None, progress: Progress | None = None) -> ConvertResult:
    """The model's tensors of ``checkpoint`` into the directory ``dst`` as ``from_pretrained`` loads them (the
    module docstring says what goes in and how). Everything is checked before the first file is written.
    """
    target = Path(dst)
    # without --config, a config.json already in the directory (put there with the tokenizer) is the model's
    config = _read_config(options.config if options.config is not None or not (target / CONFIG).is_file()
                          else target / CONFIG)
    copied = config if config is not None and config.path.resolve() != (target / CONFIG).resolve() else None
    refuse_earlier_export(target, overwrite, *([CONFIG] if copied else []))
    selection = select_model(checkpoint, options.select)
    check_storable(checkpoint, list(selection.tensors.values()))
    check = model_check(config.path, list(selection.tensors)) if config is not None else None
    ties = resolve_ties(checkpoint, selection.tensors, [*option_ties(options.tie), *(check.ties if check else ()),
                                                        *manifest_ties(checkpoint, selection)])
    tensors = {name: key for name, key in selection.tensors.items() if name not in ties.aliases}
    sizes = {name: checkpoint[key].nbytes for name, key in tensors.items()}
    shards = cut_shards(sizes, max_shard_bytes or HF_MAX_SHARD_BYTES)
    files = shard_files(target, len(shards))
    commit = SAFETENSORS_INDEX if len(files) > 1 else WEIGHTS
    writes = [*files, *([target / SAFETENSORS_INDEX] if len(files) > 1 else []), *([target / CONFIG] if copied else [])]
    old = [p.name for p in earlier_weights(target)]  # from_pretrained would load a stale shard or index: removed
    total = sum(sizes.values())
    with held_temporary(target, WEIGHTS) as temporary:
        done = 0
        for file, names in zip(files, shards, strict=True):
            done = write_file(checkpoint, {name: tensors[name] for name in names}, temporary / file.name,
                              DEFAULT_FILE_METADATA, done, total, progress)
        if len(files) > 1:
            _write_index(temporary / SAFETENSORS_INDEX, files, shards, total,
                         sum(math.prod(checkpoint[key].shape) for key in tensors.values()))
        if copied is not None and not _holds(target / CONFIG, copied.text):
            (temporary / CONFIG).write_bytes(copied.text)
        switch_files(temporary, target, commit, (WEIGHTS, SAFETENSORS_INDEX), old)
    notes = (*(check.notes if check else (NO_CONFIG,)), *ties.notes, *_dtype_notes(checkpoint, config, tensors))
    return ConvertResult("arrayckpt", "hf", len(tensors), total, tuple(str(p) for p in writes), selection.skipped,
                         selected=selection.prefix, tied=ties.aliases, notes=notes)


@dataclass(frozen=True)
class _ConfigFile:
    """A ``config.json`` to copy: where it is, its bytes (copied as they are) and what they say."""

    path: Path
    text: bytes
    data: dict[str, object]


def _read_config(config: str | os.PathLike[str] | None) -> _ConfigFile | None:
    """The ``config.json`` to copy (a directory stands for its ``config.json``), checked to be a JSON object now,
    not after the weights are written."""
    if config is None:
        return None
    path = Path(config) / CONFIG if Path(config).is_dir() else Path(config)
    try:
        text = read_user_file(path, "a config.json")  # a regular file of bounded size: not /dev/zero or a FIFO
        data = json.loads(text)
    except (OSError, ValueError, RecursionError) as e:
        raise FormatError(f"{config}: not a readable config.json ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type", ""), str):
        raise FormatError(f"{config}: a config.json is a JSON object (with a string model_type)")
    return _ConfigFile(path, text, data)


def refuse_earlier_export(target: Path, overwrite: bool, *also: str) -> None:
    """Refuse a target that is a file, or (without ``overwrite``) a directory holding an earlier export's weight
    files or index (or any of ``also``). Other files (tokenizer, README) may be there."""
    if target.exists() and not target.is_dir():
        raise FormatError(f"{target}: a Hugging Face export is a directory, and this is a file")
    found = [*earlier_weights(target), *(target / name for name in also if (target / name).exists())]
    if found and not overwrite:
        raise CheckpointExistsError(f"{target}: already holds {', '.join(p.name for p in found)}; pass "
                                    "overwrite=True (--overwrite) to replace an earlier export")


def _write_index(path: Path, files: list[Path], shards: list[list[str]], total: int, parameters: int) -> None:
    """``model.safetensors.index.json`` as ``save_pretrained`` writes it (sorted keys, two-space indent), naming
    the ``files`` by their names."""
    index = {"metadata": {"total_parameters": parameters, "total_size": total},
             "weight_map": {name: file.name for file, names in zip(files, shards, strict=True) for name in names}}
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _holds(path: Path, text: bytes) -> bool:
    """Whether the file ``path`` holds exactly ``text`` (a ``config.json`` to copy that is there already is left
    as it is: it cannot mix with the old export's weights)."""
    try:
        return path.is_file() and path.read_bytes() == text
    except OSError:
        return False


def _dtype_notes(checkpoint: Checkpoint, config: _ConfigFile | None, tensors: Mapping[str, str]) -> tuple[str, ...]:
    """A note where config.json's ``dtype`` is not the weights': from_pretrained's default ``dtype="auto"`` loads
    them as the config says, so the loaded model would not compute what the trained one did."""
    if config is None:
        return ()
    said = config.data.get("dtype", config.data.get("torch_dtype"))
    floats = {checkpoint[key].entry.dtype.name for key in tensors.values()} & set(FLOATS)
    if not isinstance(said, str) or not floats or said in floats:
        return ()
    return (f"config.json says dtype {said} but the weights are {', '.join(sorted(floats))}: from_pretrained "
            f"(dtype='auto') will load them as {said}; set \"dtype\" in config.json to keep them as they are",)
