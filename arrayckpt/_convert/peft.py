"""A PEFT (LoRA) adapter: what ``PeftModel.save_pretrained`` writes and ``PeftModel.from_pretrained`` reads, out of a
training checkpoint and back into one.

The directory holds ``adapter_model.safetensors`` (the adapter's tensors under the names
``get_peft_model_state_dict`` gives them, ``__metadata__`` ``{"format": "pt"}``, dtypes kept) and
``adapter_config.json`` (the ``LoraConfig``, as ``PeftConfig.save_pretrained`` writes it, ``inference_mode`` true).

The names (:func:`adapter_names`). A training checkpoint holds the ``PeftModel``'s own state (``{"model":
peft_model}``: ``model.base_model.model.<module>.lora_A.default.weight``, beside the frozen base weights); the file
names are those of the adapter's tensors, relative to the ``PeftModel`` and without the adapter's name
(``base_model.model.<module>.lora_A.weight``), as PEFT maps them for LoRA, key by key:

- ``lora_A``, ``lora_B`` (``.weight``, ``.bias`` with ``lora_bias``), ``lora_embedding_A``, ``lora_embedding_B``: the
  adapter's name dropped; ``lora_magnitude_vector`` (DoRA): the name and ``.weight`` dropped;
- ``<module>.modules_to_save.<adapter>.<rest>`` (a module trained whole): ``<module>.<rest>``; its
  ``original_module`` copy is never written; ``token_adapter.trainable_tokens_delta.<adapter>``: the name dropped;
- biases, as the config's ``bias`` says: ``"lora_only"``: the ``base_layer.bias`` of each LoRA-wrapped module;
  ``"all"``: every ``.bias`` (PEFT's renaming applied); ``"none"``: none;
- never the base model's weights (the embeddings PEFT adds with ``save_embedding_layers`` either: the base model
  has them), other adapters' tensors, or anything outside the selection (optimizer moments, values).

Where the model's tensors are (``select``, as for a Hugging Face export): found as the key prefix in front of
``base_model.model.`` in the LoRA tensors' keys (``"model."``); a state saved from ``peft_model.get_base_model()``
(LoRA layers, no ``base_model.model.``) is found as ``hf.py`` finds a model, and its names get ``base_model.model.``
in front. The adapter (``adapter``): the one whose LoRA tensors the selection holds; several need the name.

The config (:func:`adapter_config`): the ``config`` given (a ``LoraConfig`` or any ``PeftConfig``, its
``to_dict()`` as a mapping, or the path of an ``adapter_config.json`` or of a directory holding one); without one,
a plain value of the checkpoint that is a mapping with a string ``peft_type`` (saved as ``{"model": peft_model,
"adapter_config": ...}``, or put there by the import); several need ``config`` unless one is under the adapter's
name. Only LoRA (``peft_type`` ``"LORA"``) is converted; its ``r`` is checked against the ``lora_A`` tensors.

The import (:func:`from_peft`) reverses the names (the adapter's name put back, ``modules_to_save`` from the
config's list), so that ``arrayckpt.load({"model": peft_model}, ckpt, strict=False)`` fills the adapter of a
``PeftModel`` built with the same config (``key_prefix="model"``), and stores the config as the plain value
``adapter_config``: exported again, it gives the same files. The export replaces an earlier one in the directory
as ``hf.py`` does (``switch.py``): ``adapter_model.safetensors`` first, ``adapter_config.json``, which
``from_pretrained`` reads first, last; a kill in between leaves a directory without a config that loads as
nothing. No torch is needed for the export; the import needs it (the streaming writer's meta tensors).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .._errors import CheckpointExistsError, FormatError, StateError
from .._format.keys import prefix_parts
from .._format.manifest import ValueEntry
from .._format.values import decode_value
from .._io.smallfiles import read_user_file
from .._layout.chunking import DEFAULT_CHUNKING, ChunkPolicy
from .._read.checkpoint import Checkpoint
from .common import ConvertResult, Progress, restore_containers
from .hf import Selection, is_tensor, select_model, top_level_keys
from .safetensors import DEFAULT_FILE_METADATA, check_storable, from_safetensors, safetensors_names, write_file
from .switch import held_temporary, switch_files

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PeftOptions", "adapter_config", "adapter_names", "from_peft",
           "model_names", "to_peft"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"  # PEFT's pickle format (safe_serialization=False): replaced, never read
PEFT_ROOT = "base_model.model."  # the PeftModel's names of the wrapped model's tensors
LORA_LAYERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
NAMED_BY_ADAPTER = (*LORA_LAYERS, "trainable_tokens_delta")  # containers keyed by the adapter's name
RECORDED = "adapter_config"  # the plain value the import stores the config as
SHOWN = 5


class PeftConfigLike(Protocol):
    """A ``peft.PeftConfig`` (``LoraConfig``): what the export reads of one."""

    def to_dict(self) -> dict[str, Any]: ...


AdapterConfig = str | os.PathLike[str] | Mapping[str, object] | PeftConfigLike


@dataclass(frozen=True)
class PeftOptions:
    """What a PEFT export takes besides the checkpoint: where the model's tensors are (``select``, ``None`` to find
    them), which adapter (``adapter``, ``None``: the only one), and its config (``config``, ``None``: the one the
    checkpoint records)."""

    select: str | None = None
    adapter: str | None = None
    config: AdapterConfig | None = None


# ------------------------------------------------------------------------------------------------- the names


def _named_by_adapter(parts: Sequence[str]) -> int | None:
    """The index of the part naming an adapter (the one after ``lora_A``, ``modules_to_save``...), or ``None``."""
    return next((i + 1 for i, part in enumerate(parts[:-1]) if part in (*NAMED_BY_ADAPTER, "modules_to_save")), None)


def adapters_of(names: Sequence[str]) -> list[str]:
    """The adapters whose LoRA tensors are among ``names``, in order of appearance."""
    found: dict[str, None] = {}
    for name in names:
        parts = name.split(".")
        i = next((i + 1 for i, part in enumerate(parts[:-1]) if part in LORA_LAYERS), None)
        if i is not None:
            found[parts[i]] = None
    return list(found)


def _without_adapter(name: str, adapter: str) -> str:
    """PEFT's ``_remove_adapter_name_from_state_dict_key``: the adapter's name dropped where it is the last part or
    the one before it."""
    parts = name.split(".")
    if parts[-1] == adapter and len(parts) > 1:
        return ".".join(parts[:-1])
    if len(parts) > 2 and parts[-2] == adapter:
        return ".".join(parts[:-2] + parts[-1:])
    return name


def adapter_names(names: Sequence[str], adapter: str, bias: str = "none") -> dict[str, str]:
    """The file names of ``adapter``'s tensors among ``names`` (the ``PeftModel``'s), as name in the file -> name
    given; the module docstring lists the rules.

    >>> adapter_names(["base_model.model.q.base_layer.weight", "base_model.model.q.lora_A.default.weight",
    ...                "base_model.model.q.lora_A.other.weight", "base_model.model.head.modules_to_save.default.weight",
    ...                "base_model.model.q.lora_magnitude_vector.default.weight"], "default")
    {'base_model.model.q.lora_A.weight': 'base_model.model.q.lora_A.default.weight', \
'base_model.model.q.lora_magnitude_vector': 'base_model.model.q.lora_magnitude_vector.default.weight', \
'base_model.model.head.weight': 'base_model.model.head.modules_to_save.default.weight'}
    """
    others = set(adapters_of(names)) - {adapter}
    kept = [n for n in names if not any(f".{o}." in n or n.endswith(f".{o}") for o in others)]
    tuned: dict[str, str] = {}
    auxiliary: dict[str, str] = {}
    wrapped = set()
    for name in kept:
        parts = name.split(".")
        i = _named_by_adapter(parts)
        if i is None or parts[i] != adapter:
            continue
        layer = parts[i - 1]
        if layer == "modules_to_save":
            auxiliary[".".join(parts[:i - 1] + parts[i + 1:])] = name
        elif layer == "trainable_tokens_delta":
            auxiliary[".".join(parts[:i] + parts[i + 1:])] = name
        elif layer == "lora_magnitude_vector":
            tuned[".".join(parts[:i])] = name
        else:
            tuned[_without_adapter(name, adapter)] = name
            wrapped.add(".".join(parts[:i - 1]))
    if bias == "all":
        tuned.update({_without_adapter(n, adapter): n for n in kept if n.endswith(".bias") and n not in tuned.values()})
    elif bias.endswith("_only"):
        tuned.update({f"{m}.base_layer.bias": f"{m}.base_layer.bias" for m in wrapped
                      if f"{m}.base_layer.bias" in kept})
    return {**tuned, **auxiliary}


def model_names(names: Sequence[str], adapter: str, modules_to_save: Sequence[str] = ()) -> dict[str, str]:
    """The ``PeftModel``'s names of an adapter file's ``names``: :func:`adapter_names` reversed (the adapter's name
    put back; a module of ``modules_to_save``, matched as PEFT matches it, by its last parts).

    >>> model_names(["m.q.lora_A.weight", "m.q.lora_magnitude_vector", "m.head.weight", "m.q.base_layer.bias"],
    ...             "default", ["head"])
    {'m.q.lora_A.weight': 'm.q.lora_A.default.weight', 'm.q.lora_magnitude_vector': \
'm.q.lora_magnitude_vector.default.weight', 'm.head.weight': 'm.head.modules_to_save.default.weight', \
'm.q.base_layer.bias': 'm.q.base_layer.bias'}
    """
    out = {}
    for name in names:
        parts = name.split(".")
        at = next((i for i, part in enumerate(parts) if part in NAMED_BY_ADAPTER), None)
        if at is not None and parts[at] == "lora_magnitude_vector" and at == len(parts) - 1:
            out[name] = f"{name}.{adapter}.weight"
        elif at is not None:
            out[name] = ".".join([*parts[:at + 1], adapter, *parts[at + 1:]])
        else:
            module = next((j for j in range(len(parts) - 1, 0, -1) for target in modules_to_save
                           if ".".join(parts[:j]) == target or ".".join(parts[:j]).endswith(f".{target}")), None)
            out[name] = name if module is None else \
                ".".join([*parts[:module], "modules_to_save", adapter, *parts[module:]])
    return out


# -------------------------------------------------------------------------------------------------- the export


def _selection(checkpoint: Checkpoint, select: str | None) -> Selection:
    """The ``PeftModel``'s tensors: those under ``select``, else under the prefix in front of ``base_model.model.``
    in the LoRA tensors' keys, else where ``hf.py`` finds a model."""
    if select is not None:
        return select_model(checkpoint, select)
    entries = checkpoint.manifest.entries
    tensors = [key for key, entry in entries.items() if is_tensor(checkpoint, entry)]
    roots = {root for key in tensors if adapters_of([key]) and (root := _root(key)) is not None}
    if len(roots) > 1:  # an optimizer's state keyed by the parameters' names is not the model
        roots = {root for root in roots if not {"state", "param_groups"} & set(root.split("."))}
    if len(roots) > 1:
        raise StateError(f"{checkpoint.location}: LoRA tensors under several prefixes ({', '.join(sorted(roots))}); "
                         "choose the model's with select='model.' (--select PREFIX)")
    if not roots:  # saved from get_base_model(), or no adapter at all (to_peft says so, naming the model's tensors)
        return select_model(checkpoint, None)
    prefix = roots.pop()
    chosen = {key[len(prefix):]: key for key in tensors if key.startswith(prefix)}
    return Selection(prefix, chosen, tuple(key for key in entries if key not in chosen.values()))


def _root(key: str) -> str | None:
    """The key prefix in front of ``base_model.model.`` in ``key`` (``"model."``; ``""`` at the start), or ``None``."""
    if key.startswith(PEFT_ROOT):
        return ""
    at = key.find(f".{PEFT_ROOT}")
    return key[:at + 1] if at >= 0 else None


def _no_adapter(checkpoint: Checkpoint, tensors: Sequence[str], prefix: str) -> StateError:
    shown = ", ".join(tensors[:SHOWN]) + (", ..." if len(tensors) > SHOWN else "")
    where = f"under {prefix!r}" if prefix else "of the model"
    return StateError(f"{checkpoint.location}: holds no LoRA adapter: none of the {len(tensors)} tensor(s) {where} "
                      f"has lora_A or lora_B in its name ({shown or 'none'}; top-level keys: "
                      f"{top_level_keys(checkpoint.manifest.entries)}); save the PeftModel that get_peft_model "
                      "returned ({'model': peft_model}), or export a whole model with to_format='hf'")


def to_peft(checkpoint: Checkpoint, dst: str | os.PathLike[str], options: PeftOptions, *, overwrite: bool = False,
            progress: Progress | None = None) -> ConvertResult:
    """The adapter of ``checkpoint`` into the directory ``dst``, as ``PeftModel.from_pretrained`` loads it (the
    module docstring says what goes in). Everything is checked before the first file is written."""
    target = Path(dst)
    refuse_earlier_adapter(target, overwrite)
    selection = _selection(checkpoint, options.select)
    rooted = {name if name.startswith(PEFT_ROOT) else PEFT_ROOT + name: key for name, key in selection.tensors.items()}
    found = adapters_of(list(rooted))
    if not found:
        raise _no_adapter(checkpoint, list(selection.tensors.values()), selection.prefix)
    adapter = _adapter(checkpoint, found, options.adapter)
    config = adapter_config(checkpoint, options.config, adapter)
    bias = config.get("bias", "none")
    names = adapter_names(list(rooted), adapter, bias if isinstance(bias, str) else "none")
    tensors = {name: rooted[model] for name, model in names.items()}
    check_storable(checkpoint, list(tensors.values()))
    _check_rank(checkpoint, config, tensors)
    total = sum(checkpoint[key].nbytes for key in tensors.values())
    old = [name for name in (ADAPTER_WEIGHTS, ADAPTER_BIN) if (target / name).is_file()]
    with held_temporary(target, ADAPTER_WEIGHTS) as temporary:
        write_file(checkpoint, tensors, temporary / ADAPTER_WEIGHTS, DEFAULT_FILE_METADATA, 0, total, progress)
        (temporary / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
        switch_files(temporary, target, ADAPTER_CONFIG, (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_BIN), old)
    kept = set(tensors.values())
    return ConvertResult("arrayckpt", "peft", len(tensors), total,
                         (str(target / ADAPTER_WEIGHTS), str(target / ADAPTER_CONFIG)),
                         tuple(key for key in checkpoint.manifest.entries if key not in kept),
                         selected=selection.prefix)


def _adapter(checkpoint: Checkpoint, found: list[str], adapter: str | None) -> str:
    if adapter is None and len(found) == 1:
        return found[0]
    if adapter is not None and adapter in found:
        return adapter
    said = f"no adapter {adapter!r}" if adapter is not None else "several adapters"
    raise StateError(f"{checkpoint.location}: {said}; its LoRA tensors are of {', '.join(map(repr, found))}: "
                     "choose one with adapter=NAME (--adapter NAME)")


def _check_rank(checkpoint: Checkpoint, config: Mapping[str, object], tensors: Mapping[str, str]) -> None:
    """Refuse a config whose rank ``r`` is not the ``lora_A`` tensors' (another adapter's config: ``from_pretrained``
    would fail on every tensor); a ``rank_pattern`` gives ranks per module, which are not checked."""
    r = config.get("r")
    if config.get("rank_pattern") or not isinstance(r, int):
        return
    for name, key in tensors.items():
        if name.endswith(".lora_A.weight") and checkpoint[key].shape[:1] != (r,):
            raise FormatError(f"{checkpoint.location}: the adapter config says r={r}, but {key!r} has rank "
                              f"{checkpoint[key].shape[0]}; pass the config this adapter was trained with "
                              "(config=LoraConfig(...))")


def refuse_earlier_adapter(target: Path, overwrite: bool) -> None:
    """Refuse a target that is a file, or (without ``overwrite``) a directory holding an adapter already."""
    if target.exists() and not target.is_dir():
        raise FormatError(f"{target}: a PEFT adapter is a directory, and this is a file")
    found = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_BIN) if os.path.lexists(target / name)]
    if found and not overwrite:
        raise CheckpointExistsError(f"{target}: already holds {', '.join(found)}; pass overwrite=True (--overwrite) "
                                    "to replace an earlier adapter")


# -------------------------------------------------------------------------------------------------- the config


def adapter_config(checkpoint: Checkpoint, config: AdapterConfig | None, adapter: str) -> dict[str, object]:
    """The ``adapter_config.json`` to write: ``config`` (a ``PeftConfig``, a mapping, a file or directory) or the
    one the checkpoint records, as plain JSON (sets as sorted lists), ``inference_mode`` true as
    ``PeftModel.save_pretrained`` writes it; only LoRA."""
    if config is None:
        data: object = _recorded(checkpoint, adapter)
        where = f"{checkpoint.location}'s recorded adapter config"
    elif isinstance(config, (str, os.PathLike)):
        path = Path(config) / ADAPTER_CONFIG if Path(config).is_dir() else Path(config)
        data = read_config_file(path)
        where = str(path)
    elif isinstance(config, Mapping):
        data, where = dict(config), "the config given"
    elif callable(getattr(config, "to_dict", None)):
        data, where = config.to_dict(), f"the {type(config).__name__} given"
    else:
        raise FormatError(f"config: a LoraConfig, a mapping or an adapter_config.json path, not "
                          f"{type(config).__name__}")
    try:
        plain = json.loads(json.dumps(data, default=_plain))
    except (TypeError, ValueError) as e:
        raise FormatError(f"{where}: not JSON ({e})") from None
    if not isinstance(plain, dict) or plain.get("peft_type") != "LORA":
        said = plain.get("peft_type") if isinstance(plain, dict) else plain
        raise FormatError(f"{where}: peft_type {said!r}; only LoRA adapters (peft_type 'LORA') are converted")
    return {**plain, "inference_mode": True}


def _plain(value: object) -> object:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    raise TypeError(f"{type(value).__name__} {value!r} is not JSON")


def read_config_file(path: Path) -> object:
    try:
        return json.loads(read_user_file(path, "an adapter_config.json"))
    except (OSError, ValueError, RecursionError) as e:
        raise FormatError(f"{path}: not a readable adapter_config.json ({e})") from None


def _recorded(checkpoint: Checkpoint, adapter: str) -> dict[str, object]:
    """The adapter config the checkpoint holds as plain values: the mapping with a string ``peft_type``; of several,
    the one under the adapter's name."""
    entries = checkpoint.manifest.entries
    found = [entry.parts[:-1] for entry in entries.values() if isinstance(entry, ValueEntry)
             and entry.parts[-1] == "peft_type" and isinstance(decode_value(entry.value, entry.key), str)]
    if len(found) > 1:
        found = [parts for parts in found if parts and parts[-1] == adapter] or found
    if len(found) != 1:
        said = "none" if not found else f"several ({', '.join('.'.join(map(str, p)) or '(top)' for p in found)})"
        raise FormatError(f"{checkpoint.location}: no adapter config to write: it records {said}; pass "
                          "config=LoraConfig(...) (--config adapter_config.json), or save the config with the model: "
                          "{'model': peft_model, 'adapter_config': json-able config dict}")
    parts = found[0]
    node: dict[Any, Any] = {}
    for entry in entries.values():
        if isinstance(entry, ValueEntry) and entry.parts[:len(parts)] == parts and len(entry.parts) > len(parts):
            at = node
            for part in entry.parts[len(parts):-1]:
                at = at.setdefault(part, {})
            at[entry.parts[-1]] = decode_value(entry.value, entry.key)
    restored = restore_containers(node, parts, checkpoint.manifest.containers)
    return dict(restored)


# -------------------------------------------------------------------------------------------------- the import


def from_peft(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
              allow_pickle: bool = False, progress: Progress | None = None, chunking: ChunkPolicy = DEFAULT_CHUNKING,
              key_prefix: str = "", adapter: str | None = None) -> ConvertResult:
    """A PEFT adapter directory into arrayckpt: its tensors under the ``PeftModel``'s names (``adapter``'s name,
    default ``"default"``, put back), under ``key_prefix``; its config as the plain value ``adapter_config``."""
    directory = Path(src)
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = " (only adapter_model.bin, PEFT's pickle format: save it with safe_serialization=True, the " \
            "default)" if (directory / ADAPTER_BIN).is_file() else ""
        raise FormatError(f"{directory}: no {ADAPTER_WEIGHTS}{pickled}")
    config = read_config_file(directory / ADAPTER_CONFIG)
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        said = config.get("peft_type") if isinstance(config, dict) else config
        raise FormatError(f"{directory / ADAPTER_CONFIG}: peft_type {said!r}; only LoRA adapters (peft_type 'LORA') "
                          "are converted")
    parts = prefix_parts(key_prefix)
    if parts[:1] == (RECORDED,):
        raise FormatError(f"key_prefix {key_prefix!r}: the import stores the adapter config as {RECORDED!r}; choose "
                          "another prefix")
    saved = config.get("modules_to_save")
    names = model_names(safetensors_names(weights), adapter or "default",
                        [str(m) for m in saved] if isinstance(saved, list) else [])
    prefix = ".".join(parts) + "." if parts else ""
    return from_safetensors(weights, dst, overwrite=overwrite, progress=progress, chunking=chunking,
                            names={name: prefix + model for name, model in names.items()}, values={RECORDED: config},
                            label="peft")
