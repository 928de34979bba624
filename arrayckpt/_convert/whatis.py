"""What a local path holds when it is not one arrayckpt checkpoint (a DCP, DeepSpeed or safetensors checkpoint, a
torch.save file, a manager's directory of checkpoints), as the sentence an error should say instead of "incomplete
checkpoint". Both the command line and ``convert`` use it; it imports nothing (the CLI's start-up).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

__all__ = ["checkpoint_steps", "explain_path", "torch_checkpointing_kind"]

ROOT_DOCUMENT = "zarr.json"  # the root zarr.json a committed checkpoint has (`_format.zarr.ROOT_METADATA`)
MAX_LISTED = 8
TCP_METADATA = "metadata.pkl"  # torch_checkpointing's metadata (`_convert.torch_checkpointing_layout.METADATA_FILE`)
TCP_RANK_FILE = re.compile(r".+_\d+\.pt")  # its default per-item, per-rank torch.save files: model_0.pt


def torch_checkpointing_kind(directory: Path) -> str | None:
    """How ``directory`` looks like a ``torch_checkpointing`` checkpoint: ``"metadata"`` (its ``metadata.pkl``),
    ``"files"`` (``.pt`` files all named ``<item>_<rank>.pt``, rank 0 among them: its default layout, written
    without metadata when no item declares a resharder), or ``None``. The caller checks the formats with a marker
    of their own first (DeepSpeed's ``*_model_states.pt`` never end in ``_<digits>.pt``)."""
    if (directory / TCP_METADATA).is_file():
        return "metadata"
    names = [child.name for child in directory.iterdir() if child.name.endswith(".pt")]
    if names and all(TCP_RANK_FILE.fullmatch(n) for n in names) and any(n.endswith("_0.pt") for n in names):
        return "files"
    return None


def checkpoint_steps(directory: Path) -> list[str]:
    """The names of the committed checkpoints directly inside ``directory`` (a manager's root), sorted: directories
    with a root document, both reached without a link (a link is never followed into or inside a checkpoint)."""
    return sorted(child.name for child in directory.iterdir()
                  if _is_real(child, stat.S_ISDIR) and _is_real(child / ROOT_DOCUMENT, stat.S_ISREG))


def _is_real(path: Path, kind: Callable[[int], bool]) -> bool:
    """Whether ``path`` itself (not what a link there names) is of ``kind`` (``stat.S_ISDIR``, ``stat.S_ISREG``)."""
    try:
        return kind(os.lstat(path).st_mode)
    except OSError:
        return False


def _local(path: str) -> Path | None:
    """The local path a command-line path names (``None`` for object storage URLs)."""
    if path.startswith("file://"):
        return Path(path.removeprefix("file://"))
    return None if "://" in path else Path(path)


def explain_path(path: str, verb: str = "name") -> str | None:
    """What a local path that is not an arrayckpt checkpoint holds, as the sentence to print instead of "incomplete
    checkpoint" (``None``: a checkpoint, a URL, or nothing recognisable: the library's own error says it). For a
    directory of checkpoints, the sentence asks to ``verb`` one of them."""
    p = _local(path)
    if p is None:
        return None
    try:
        if p.is_file():
            return _explain_file(path, p)
        if not p.is_dir() or os.path.lexists(p / ROOT_DOCUMENT):  # a checkpoint, or a damaged one (a link, a device
            return None  # in its root document's place): the reader says which, naming it
        convert = f"convert it with `arrayckpt convert {path} OUT`"
        if (p / ".metadata").is_file():
            kind = "a Megatron-Core torch_dist" if (p / "metadata.json").is_file() else "a PyTorch DCP"
            return f"{path}: {kind} checkpoint, not an arrayckpt one; {convert}"
        if (p / "latest").is_file() or next(p.glob("*_model_states.pt"), None) is not None:
            return f"{path}: a DeepSpeed checkpoint, not an arrayckpt one; {convert}"
        if torch_checkpointing_kind(p) is not None:
            return f"{path}: a torch_checkpointing checkpoint, not an arrayckpt one; {convert}"
        if next(p.glob("*.safetensors"), None) is not None or next(p.glob("*.safetensors.index.json"), None):
            return f"{path}: safetensors files, not an arrayckpt checkpoint; {convert}"
        steps = checkpoint_steps(p)
    except OSError:
        return None
    if not steps:
        return None
    shown = ", ".join(steps[-MAX_LISTED:]) + (f" (and {len(steps) - MAX_LISTED} older)" if len(steps) > MAX_LISTED
                                             else "")
    return (f"{path}: a directory of {len(steps)} checkpoint(s), not one checkpoint; {verb} one of them, e.g. "
            f"{os.path.join(path, steps[-1])} (found: {shown})")


def _explain_file(path: str, p: Path) -> str | None:
    convert = f"convert it with `arrayckpt convert {path} OUT`"
    if p.name.endswith((".safetensors", ".safetensors.index.json")):
        return f"{path}: a safetensors file, not an arrayckpt checkpoint (a directory); {convert}"
    with open(p, "rb") as f:
        magic = f.read(2)
    if magic == b"PK" or magic[:1] == b"\x80":
        return f"{path}: a torch.save file, not an arrayckpt checkpoint (a directory); {convert}"
    return None
