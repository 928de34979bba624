"""``convert``: detect the formats and hand over to the converter of each (``torch_save``, ``safetensors``,
``dcp``, ``deepspeed``, ``megatron``); between two other formats through a temporary arrayckpt checkpoint.
DeepSpeed is read as ZeRO checkpoints (and Universal Checkpoints) and written as a Universal Checkpoint
(``deepspeed_universal.py``; a DeepSpeed engine also resumes from the arrayckpt checkpoint itself:
``arrayckpt.deepspeed.load``); ``megatron`` (Megatron-Core's ``torch_dist``, Megatron-LM's ``fsdp_dtensor``) and
``torch_checkpointing`` (PyTorch's ``CheckpointManager`` directories, ``torch_checkpointing.py``) go both ways;
``hf`` (a Hugging Face export: the model's weights for ``from_pretrained``, ``hf.py``) is written only, and read
back as the safetensors it is; ``peft`` (a LoRA adapter for ``PeftModel.from_pretrained``, ``peft.py``) goes both
ways. Only arrayckpt -> safetensors, hf and peft run without torch; the other converters are imported
when used, after checking that torch is there."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from .._errors import ArrayckptError, CheckpointExistsError, CheckpointNotFoundError, FormatError
from .._format.zarr import ROOT_METADATA
from .._io.smallfiles import check_user_file
from .._read.checkpoint import open_checkpoint
from .._torch import require_torch
from .common import ConvertResult, Progress
from .hf import HfOptions, refuse_earlier_export, to_hf
from .peft import ADAPTER_CONFIG, AdapterConfig, PeftOptions, refuse_earlier_adapter, to_peft
from .safetensors import to_safetensors
from .switch import held_temporary
from .whatis import checkpoint_steps, explain_path, torch_checkpointing_kind

__all__ = ["FORMATS", "convert", "detect_format"]

FORMATS = ("arrayckpt", "dcp", "deepspeed", "hf", "megatron", "peft", "safetensors", "torch", "torch_checkpointing")
# targets that are directories
DIRECTORIES = ("arrayckpt", "dcp", "deepspeed", "hf", "megatron", "peft", "torch_checkpointing")


def detect_format(path: str | os.PathLike[str]) -> str | None:
    """The format of an existing checkpoint at ``path`` (``None`` when it cannot tell)."""
    p = Path(path)
    if p.is_dir():
        if os.path.lexists(p / ROOT_METADATA):  # a link or device in its place too: the reader refuses it, naming it
            return "arrayckpt"
        if torch_checkpointing_kind(p) == "metadata":  # its metadata.pkl: no other format has one
            return "torch_checkpointing"
        if (p / "metadata.json").is_file() or (p / "latest_checkpointed_iteration.txt").is_file():
            return "megatron"  # Megatron-Core dist_checkpointing (a DCP directory plus metadata.json, common.pt)
        if (p / ADAPTER_CONFIG).is_file():
            return "peft"  # PeftModel.save_pretrained's directory (its adapter_model.safetensors is not a model's)
        if (p / ".metadata").is_file():
            return "megatron" if _megatron_dcp(p / ".metadata") else "dcp"  # Megatron-LM's fsdp_dtensor: plain DCP
        if (p / "latest").is_file() or (p / "latest_universal").is_file() or list(p.glob("*_model_states.pt")):
            return "deepspeed"  # a DeepSpeed checkpoint directory ('latest[_universal]' names the tag) or a tag
        if torch_checkpointing_kind(p) == "files":  # <item>_<rank>.pt only: saved without a resharder
            return "torch_checkpointing"
        if list(p.glob("*.safetensors.index.json")) or list(p.glob("*.safetensors")):
            return "safetensors"
        return None
    if p.name.endswith((".safetensors", ".safetensors.index.json")):
        return "safetensors"
    if p.is_file():
        with open(p, "rb") as f:
            magic = f.read(2)
        if magic == b"PK" or magic[:1] == b"\x80":  # torch.save's zip format, or its legacy pickle format
            return "torch"
    return None


def _megatron_dcp(metadata: Path) -> bool:
    """Whether DCP's ``.metadata`` names ``checkpoint_version``, an entry of every Megatron-LM DCP save
    (``megatron_fsdp.py::MARKER``): a search of its bytes, block by block, without unpickling it (the converter
    reads it with its allow-list unpickler and checks the entry itself)."""
    marker, tail = b"checkpoint_version", b""
    with open(metadata, "rb") as f:
        while block := f.read(1 << 20):
            if marker in tail + block:
                return True
            tail = block[-len(marker):]
    return False


SUFFIXES = {"safetensors": (".safetensors",), "torch": (".pt", ".pth", ".bin", ".ckpt")}


def _target_format(path: str | os.PathLike[str]) -> str | None:
    """The format a target path's name implies (``None``: no known suffix, a directory)."""
    name = Path(path).name
    return next((fmt for fmt, suffixes in SUFFIXES.items() if name.endswith(suffixes)), None)


def _check_target(dst: str | os.PathLike[str], target: str, max_shard_bytes: int | None) -> None:
    """Refuse a target whose name says another format than the one to write (``out.safetensors`` for DCP)."""
    implied = _target_format(dst)
    if implied is not None and implied != target:
        raise FormatError(f"{dst}: its name says {implied} but the target format is {target}; name the target "
                          f"for what it holds{' (a directory)' if target in DIRECTORIES else ''}")
    if target == "torch" and implied is None:
        raise FormatError(f"{dst}: a torch.save target is a file named .pt, .pth or .bin")
    if target == "safetensors" and implied is None and max_shard_bytes is None and not Path(dst).is_dir():
        raise FormatError(f"{dst}: a safetensors target is a file named .safetensors (or a directory for shards: "
                          "--max-shard-size)")


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, from_format: str | None = None,
            to_format: str | None = None, overwrite: bool = False, allow_pickle: bool = False,
            max_shard_bytes: int | None = None, select: str | None = None, tie: Mapping[str, str] | None = None,
            config: AdapterConfig | None = None, progress: Progress | None = None,
            base_roots: Sequence[str | os.PathLike[str]] | None = None,
            param_names: Sequence[str] | None = None, key_prefix: str = "",
            adapter: str | None = None, ckpt_format: str | None = None) -> ConvertResult:
    """Convert the checkpoint at ``src`` into ``dst``: any of arrayckpt, torch, safetensors, dcp, deepspeed and
    megatron (Megatron-Core ``torch_dist``, or Megatron-LM's ``fsdp_dtensor``: ``ckpt_format``) and
    torch_checkpointing (a ``CheckpointManager`` directory, saved by any number of ranks; written for one) into any
    of them, and a LoRA adapter (peft) both ways. deepspeed is read from a ZeRO checkpoint (stage 1, 2 or 3; its
    directory or a tag directory) or a Universal Checkpoint, and written as a Universal Checkpoint.
    Between two formats other than arrayckpt, the tensors go through a temporary arrayckpt checkpoint beside
    ``dst`` (streamed both ways, one tensor at a time; removed at the end).

    The source format is detected unless given; the target format is ``to_format``, or what ``dst``'s suffix says
    (``.safetensors``; ``.pt``, ``.pth``, ``.bin``: torch), or arrayckpt (a directory). A suffix that contradicts
    ``to_format`` is refused before anything is written.

    ``to_format="hf"`` writes the directory ``dst`` for people who publish weights: the model's tensors only
    (``select``: their key prefix, ``"model."``, stripped from the names; found when there is one module under
    a top-level key), tied duplicates left out as ``save_pretrained`` leaves them (``tie``: alias -> target, and
    the ties of the model ``config`` describes), dtypes kept, ``model.safetensors`` or shards (``max_shard_bytes``,
    default 50 GB) with their index, and ``config`` copied as ``config.json``. ``from_pretrained`` loads it.

    ``to_format="peft"`` writes the directory ``dst`` that ``PeftModel.from_pretrained(base_model, dst)`` loads: the
    LoRA adapter's tensors of the ``PeftModel`` saved in the checkpoint (``select``: its key prefix, found as the one
    in front of ``base_model.model.``; ``adapter``: which, when it holds several) in ``adapter_model.safetensors``
    under the names ``get_peft_model_state_dict`` gives them, and ``adapter_config.json`` from ``config`` (a
    ``LoraConfig``, its ``to_dict()``, or an ``adapter_config.json``), or else from the plain value of the
    checkpoint that holds a ``peft_type`` (``{"model": peft_model, "adapter_config": ...}``). ``from_format="peft"``
    reads such a directory back: the tensors under the ``PeftModel``'s names (``adapter``, default ``"default"``,
    put back into them), the config as the plain value ``adapter_config``.

    ``key_prefix`` (into arrayckpt): stores every key of the source under this prefix, ``"model"`` making
    ``model.layers.0...`` of a Hugging Face directory ``model.model.layers.0...``, as ``arrayckpt.save({"model":
    model})`` names them, so that ``arrayckpt.load({"model": model}, dst)`` finds them.

    ``to_format="deepspeed"`` writes the directory ``dst`` as a DeepSpeed Universal Checkpoint (``latest_universal``
    and one tag directory) that ``engine.load_checkpoint(dst)`` resumes with ``"checkpoint": {"load_universal": true}``
    at any data-parallel degree and ZeRO stage: the module under ``model``, with one optimizer's state. An optimizer
    saved by ``state_dict()`` numbers its parameters; where that does not say which of the module's tensors they are
    (frozen parameters, buffers, ties, several param groups), ``param_names`` names them, in the order the param
    groups list them. Read back with ``convert(dst, ...)`` (``from_format`` detected as deepspeed).

    Args:
        src: the checkpoint to convert: a file or a directory.
        dst: where to write it.
        from_format: ``"arrayckpt"``, ``"torch"``, ``"safetensors"``, ``"dcp"``, ``"deepspeed"``, ``"megatron"``,
            ``"torch_checkpointing"`` or ``"peft"`` (default: detected).
        to_format: one of those, or ``"hf"`` (default: what ``dst``'s suffix says, else arrayckpt).
        overwrite: replace what is at ``dst``.
        allow_pickle: read and write values that need pickle (only from sources you trust).
        max_shard_bytes: splits safetensors output into shards with a ``model.safetensors.index.json``.
        select: for ``to_format="hf"`` and ``"peft"``: the key prefix of the model's tensors, stripped from the names.
        tie: for ``to_format="hf"``: alias -> target, ties to leave out besides those ``config`` describes.
        config: for ``to_format="hf"``: the model's ``config.json``, copied beside the weights; for
            ``to_format="peft"``: the adapter's config (a ``LoraConfig``, a mapping, or an ``adapter_config.json``).
        progress: called as ``progress(bytes done, bytes in all)``.
        base_roots: where an arrayckpt delta source's bases may be besides the directory holding it (as for
            :func:`arrayckpt.open`).
        param_names: for ``to_format="deepspeed"``: the names of the optimizer's parameters, in the order its param
            groups list them.
        key_prefix: into arrayckpt: the key prefix to store the source's keys under (``"model"``).
        adapter: for peft: the adapter's name (exported: the one of several in the checkpoint; imported: the name
            put into the keys, default ``"default"``).
        ckpt_format: for ``to_format="megatron"``: Megatron-LM's ``--ckpt-format`` of the directory written,
            ``"torch_dist"`` (default; ``dist_checkpointing.load`` reads it) or ``"fsdp_dtensor"`` (Megatron-FSDP:
            DCP of the flattened state, what Megatron-LM's fsdp_dtensor load reads). Read back, either is detected.

    Returns:
        What was written, and what the target format could not hold.

    Raises:
        CheckpointNotFoundError: nothing is at ``src``.
        CheckpointExistsError: something is at ``dst`` and ``overwrite`` was not given.
        FormatError: the source's format cannot be told or read, ``dst``'s name contradicts ``to_format``, or an
            option does not go with the target format.
        PickleNotAllowedError: a value needs pickle and ``allow_pickle`` was not given.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> torch.save({"w": torch.ones(2, 3), "step": 4}, os.path.join(d, "model.pt"))
        >>> arrayckpt.convert(os.path.join(d, "model.pt"), os.path.join(d, "ckpt")).tensors
        1
        >>> with arrayckpt.open(os.path.join(d, "ckpt")) as ckpt: ckpt.plain_values["step"]
        4
        >>> arrayckpt.convert(os.path.join(d, "model.pt"), os.path.join(d, "model.safetensors")).target_format
        'safetensors'
        >>> arrayckpt.save({"model": torch.nn.Linear(2, 2), "step": 4}, os.path.join(d, "train"))
        >>> done = arrayckpt.convert(os.path.join(d, "train"), os.path.join(d, "hf"), to_format="hf")
        >>> done.selected, sorted(os.listdir(os.path.join(d, "hf"))), done.skipped
        ('model.', ['model.safetensors'], ('step',))
    """
    if (select is not None or config is not None) and to_format not in ("hf", "peft") or tie and to_format != "hf":
        raise FormatError("select, tie and config are for a Hugging Face export: to_format='hf' (--to hf); select "
                          "and config for a PEFT adapter too: to_format='peft' (--to peft)")
    path = config if isinstance(config, (str, os.PathLike)) else None
    if config is not None and path is None and to_format == "hf":
        raise FormatError(f"config: for a Hugging Face export, the path of a config.json, not {type(config).__name__}")
    hf = HfOptions(select, dict(tie or {}), path)
    peft = PeftOptions(select, adapter, config)
    if path is not None:  # read whole when the export is written: refuse /dev/zero, a FIFO or a huge file now
        name = ADAPTER_CONFIG if to_format == "peft" else "config.json"
        check_user_file(Path(path) / name if Path(path).is_dir() else path, f"a {name}")
    if ckpt_format is not None and to_format != "megatron":
        raise FormatError("ckpt_format is for a Megatron export: to_format='megatron' (--to megatron); a Megatron "
                          "source's layout is detected")
    if param_names is not None and to_format != "deepspeed":
        raise FormatError("param_names is for a DeepSpeed Universal Checkpoint: to_format='deepspeed' (--to deepspeed)")
    source = "safetensors" if from_format == "hf" else from_format or detect_format(src)
    if source is None:
        if not os.path.exists(src):
            raise CheckpointNotFoundError(f"{src}: nothing here to convert")
        if Path(src).is_dir() and checkpoint_steps(Path(src)):  # a manager's root: say which steps it holds
            raise FormatError(str(explain_path(os.fspath(src), "convert")))
        raise FormatError(f"{src}: cannot tell its format; say it with --from ({', '.join(FORMATS)})")
    target = to_format or _target_format(dst) or ("arrayckpt" if source != "arrayckpt" else None)
    if target is None:
        raise FormatError(f"{dst}: cannot tell which format to write; say it with --to "
                          f"({', '.join(f for f in FORMATS if f != 'arrayckpt')})")
    for name in (source, target):
        if name not in FORMATS:
            raise FormatError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    _check_target(dst, target, max_shard_bytes)
    if adapter is not None and "peft" not in (source, target):
        raise FormatError("adapter is for a PEFT adapter: to_format='peft' or from_format='peft' (--to/--from peft)")
    if key_prefix and target != "arrayckpt":
        raise FormatError("key_prefix is for a conversion into arrayckpt (to change the names of an export: select)")
    if source == "arrayckpt" and target == "arrayckpt":
        raise FormatError(f"{src} is already an arrayckpt checkpoint (to change its chunking or codec: "
                          "`arrayckpt compact`)")
    if target == "arrayckpt":
        into = _converter(_INTO[source], f"converting {source} to arrayckpt")
        extra = {"adapter": adapter} if source == "peft" else {}
        return into(src, dst, overwrite=overwrite, allow_pickle=allow_pickle, progress=progress, key_prefix=key_prefix,
                    **extra)
    if source == "arrayckpt":
        return _out_of(src, dst, target, overwrite=overwrite, allow_pickle=allow_pickle,
                       max_shard_bytes=max_shard_bytes, hf=hf, peft=peft, progress=progress,
                       base_roots=base_roots, param_names=param_names, ckpt_format=ckpt_format)
    into = _converter(_INTO[source], f"converting {source} to {target}")
    if target == "hf":  # refused before the (long) first half
        refuse_earlier_export(Path(dst), overwrite)
    elif target == "peft":
        refuse_earlier_adapter(Path(dst), overwrite)
    elif os.path.exists(dst) and not overwrite:
        raise CheckpointExistsError(f"{dst}: already exists; pass overwrite=True (--overwrite) to replace it")
    place = Path(dst).absolute()
    # parents made; after a kill gc removes it; not named as the export's own, which removes its own leftovers
    with held_temporary(place.parent, f"{place.name}.source") as temp:
        first = into(src, os.path.join(temp, "ckpt"), overwrite=False, allow_pickle=allow_pickle, progress=progress,
                     **({"adapter": adapter} if source == "peft" else {}))
        try:
            result = _out_of(os.path.join(temp, "ckpt"), dst, target, overwrite=overwrite, allow_pickle=allow_pickle,
                             max_shard_bytes=max_shard_bytes, hf=hf, peft=peft, progress=progress,
                             param_names=param_names, ckpt_format=ckpt_format)
        except ArrayckptError as e:
            raise _naming_source(e, os.path.join(temp, "ckpt"), src) from e
    return dataclasses.replace(result, source_format=first.source_format,
                               skipped=tuple(dict.fromkeys(first.skipped + result.skipped)))


def _naming_source(error: ArrayckptError, temporary: str, src: str | os.PathLike[str]) -> ArrayckptError:
    """``error`` of the second half of a conversion, naming the user's checkpoint where it names the temporary
    arrayckpt one (which is removed: a path to it would help nobody)."""
    return type(error)(str(error).replace(temporary, os.fspath(src)))


def _out_of(src: str | os.PathLike[str], dst: str | os.PathLike[str], target: str, *, overwrite: bool,
            allow_pickle: bool, max_shard_bytes: int | None, hf: HfOptions, peft: PeftOptions,
            progress: Progress | None, base_roots: Sequence[str | os.PathLike[str]] | None = None,
            param_names: Sequence[str] | None = None, ckpt_format: str | None = None) -> ConvertResult:
    """An arrayckpt checkpoint into ``target``."""
    if target == "hf":
        with open_checkpoint(src, allow_pickle=allow_pickle, base_roots=base_roots) as checkpoint, \
                _no_new_empty_directory(Path(dst)):
            return to_hf(checkpoint, dst, hf, overwrite=overwrite, max_shard_bytes=max_shard_bytes, progress=progress)
    if target == "peft":
        with open_checkpoint(src, allow_pickle=allow_pickle, base_roots=base_roots) as checkpoint, \
                _no_new_empty_directory(Path(dst)):
            return to_peft(checkpoint, dst, peft, overwrite=overwrite, progress=progress)
    if target == "safetensors":
        with open_checkpoint(src, allow_pickle=allow_pickle, base_roots=base_roots) as checkpoint:
            return to_safetensors(checkpoint, dst, overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                                  progress=progress)
    out_of = _converter(_OUT_OF[target], f"converting arrayckpt to {target}")
    extra: dict[str, object] = {"param_names": param_names} if target == "deepspeed" else {}
    if ckpt_format is not None:
        extra["ckpt_format"] = ckpt_format
    with open_checkpoint(src, allow_pickle=allow_pickle, base_roots=base_roots) as checkpoint:
        return out_of(checkpoint, dst, overwrite=overwrite, progress=progress, **extra)


@contextlib.contextmanager
def _no_new_empty_directory(target: Path) -> Iterator[None]:
    """On failure, remove ``target`` when the block created it and left it empty: an export that fails (a tensor
    that cannot be read) leaves nothing new behind, as the other formats' writers do (a directory that was there
    stays, whatever it holds)."""
    existed = os.path.lexists(target)
    try:
        yield
    except BaseException:
        if not existed and target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
            target.rmdir()
        raise


# The converters that need torch, by format: module and function, imported when used.
_INTO = {"torch": "torch_save:from_torch", "safetensors": "safetensors:from_safetensors", "dcp": "dcp:from_dcp",
         "deepspeed": "deepspeed:from_deepspeed", "megatron": "megatron:from_megatron", "peft": "peft:from_peft",
         "torch_checkpointing": "torch_checkpointing:from_torch_checkpointing"}
_OUT_OF = {"torch": "torch_save:to_torch", "dcp": "dcp:to_dcp", "deepspeed": "deepspeed_universal:to_universal",
           "megatron": "megatron:to_megatron", "torch_checkpointing": "torch_checkpointing:to_torch_checkpointing"}


def _converter(target: str, what: str) -> Callable[..., ConvertResult]:
    """The converter ``module:function`` of this package, once torch is known to be there."""
    require_torch(what)
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(f".{module}", __package__), name)
