"""``convert``: detect the formats and hand over to the converter of each (``torch_save``, ``safetensors``,
``dcp``); one side is always arrayckpt."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from .._errors import CheckpointNotFoundError, FormatError
from .._format.zarr import ROOT_METADATA
from .._read.checkpoint import open_checkpoint
from .common import ConvertResult, Progress
from .dcp import from_dcp, to_dcp
from .safetensors import from_safetensors, to_safetensors
from .torch_save import from_torch, to_torch

__all__ = ["FORMATS", "convert", "detect_format"]

FORMATS = ("arrayckpt", "dcp", "safetensors", "torch")


def detect_format(path: str | os.PathLike[str]) -> str | None:
    """The format of an existing checkpoint at ``path`` (``None`` when it cannot tell)."""
    p = Path(path)
    if p.is_dir():
        if (p / ROOT_METADATA).is_file():
            return "arrayckpt"
        if (p / ".metadata").is_file():
            return "dcp"
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


def _target_format(path: str | os.PathLike[str]) -> str | None:
    """The format a target path's name implies (``None``: ambiguous, say it with ``to=``)."""
    name = Path(path).name
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith((".pt", ".pth", ".bin", ".ckpt")):
        return "torch"
    return None


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, from_format: str | None = None,
            to_format: str | None = None, overwrite: bool = False, allow_pickle: bool = False,
            max_shard_bytes: int | None = None, progress: Progress | None = None) -> ConvertResult:
    """Convert the checkpoint at ``src`` into ``dst``; one side is arrayckpt, the other torch, safetensors or dcp.

    Formats are detected from ``src`` (and from ``dst``'s suffix: ``.safetensors``, ``.pt``) unless given.
    ``max_shard_bytes`` splits safetensors output into shards with a ``model.safetensors.index.json``.

    >>> import arrayckpt, torch, tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> torch.save({"w": torch.ones(2, 3), "step": 4}, os.path.join(d, "model.pt"))
    >>> arrayckpt.convert(os.path.join(d, "model.pt"), os.path.join(d, "ckpt")).tensors
    1
    >>> arrayckpt.open(os.path.join(d, "ckpt")).plain_values["step"]
    4
    """
    source = from_format or detect_format(src)
    if source is None:
        if not os.path.exists(src):
            raise CheckpointNotFoundError(f"{src}: nothing here to convert")
        raise FormatError(f"{src}: cannot tell its format; say it with --from ({', '.join(FORMATS)})")
    target = to_format or ("arrayckpt" if source != "arrayckpt" else _target_format(dst))
    if target is None:
        raise FormatError(f"{dst}: cannot tell which format to write; say it with --to (dcp, safetensors, torch)")
    for name in (source, target):
        if name not in FORMATS:
            raise FormatError(f"unknown format {name!r}; known: {', '.join(FORMATS)}")
    if (source == "arrayckpt") == (target == "arrayckpt"):
        raise FormatError(f"converting {source} to {target}: one side must be arrayckpt (convert in two steps)")
    if target == "arrayckpt":
        return _INTO[source](src, dst, overwrite=overwrite, allow_pickle=allow_pickle, progress=progress)
    checkpoint = open_checkpoint(src, allow_pickle=allow_pickle)
    if target == "safetensors":
        return to_safetensors(checkpoint, dst, overwrite=overwrite, max_shard_bytes=max_shard_bytes,
                              progress=progress)
    return _OUT_OF[target](checkpoint, dst, overwrite=overwrite, progress=progress)


_INTO: dict[str, Callable[..., ConvertResult]] = {"torch": from_torch, "safetensors": from_safetensors,
                                                   "dcp": from_dcp}
_OUT_OF: dict[str, Callable[..., ConvertResult]] = {"torch": to_torch, "dcp": to_dcp}
