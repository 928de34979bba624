"""What every converter shares: the result type, refusing to overwrite, replacing a file atomically and
durably, torch's legacy storage classes, and the nested state of a checkpoint.

Every converter streams: the source's index (safetensors header, DCP ``.metadata``, the pickle of a
torch.save file) gives the structure first, then tensors are read one at a time and written by
``_write/stream.py::write_streaming`` (into arrayckpt) or appended to the target file (out of it). Bit
patterns are kept exactly (bfloat16 and float8 included); nothing is cast. ``dispatch.py`` chooses the
converter; ``torch_save.py``, ``safetensors.py`` and ``dcp.py`` are the formats.
"""

from __future__ import annotations

import contextlib
import math
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointExistsError
from .._format.manifest import ArrayEntry, PerRankEntry
from .._read.checkpoint import Checkpoint

__all__ = ["LEGACY_STORAGES", "LEGACY_STORAGE_NAMES", "ConvertResult", "Progress", "into_result", "nested_state",
           "refuse_existing", "replaced_atomically"]

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ConvertResult:
    """What a conversion wrote, and the entries of the source the target format could not hold."""

    source_format: str
    target_format: str
    tensors: int
    bytes: int
    files: tuple[str, ...]
    skipped: tuple[str, ...] = ()  # keys left out (e.g. plain values going to safetensors)

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "files": list(self.files), "skipped": list(self.skipped)}


def refuse_existing(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CheckpointExistsError(f"{path}: already exists; pass overwrite=True (--overwrite) to replace it")


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write the new file to; once the block succeeds the file is made durable
    (fsync) and renamed over ``path`` in one step, so ``path`` is never seen half-written. On failure the
    temporary file is removed and ``path`` is untouched."""
    temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield temp
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        temp.unlink(missing_ok=True)


# torch.save's legacy storage classes (``torch.FloatStorage``...) by dtype; newer dtypes are saved as an
# ``UntypedStorage`` with the dtype given to ``_rebuild_tensor_v3``.
LEGACY_STORAGE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "DoubleStorage", torch.float32: "FloatStorage", torch.float16: "HalfStorage",
    torch.int64: "LongStorage", torch.int32: "IntStorage", torch.int16: "ShortStorage", torch.int8: "CharStorage",
    torch.uint8: "ByteStorage", torch.bool: "BoolStorage", torch.bfloat16: "BFloat16Storage",
    torch.complex128: "ComplexDoubleStorage", torch.complex64: "ComplexFloatStorage",
}
LEGACY_STORAGES: dict[str, torch.dtype] = {name: dtype for dtype, name in LEGACY_STORAGE_NAMES.items()}


def nested_state(checkpoint: Checkpoint, tensor: Callable[[str], Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The checkpoint's state rebuilt as nested dicts/lists/tuples; ``tensor(key)`` gives each array leaf.

    Per-rank entries have no place in a single-process format and are skipped (returned).
    """
    root: dict[Any, Any] = {}
    skipped = []
    for key, entry in checkpoint.manifest.entries.items():
        if isinstance(entry, PerRankEntry):
            skipped.append(key)
            continue
        value = tensor(key) if isinstance(entry, ArrayEntry) else checkpoint.value(key)
        node = root
        for part in entry.parts[:-1]:
            node = node.setdefault(part, {})
        node[entry.parts[-1]] = value
    containers = checkpoint.manifest.containers
    return restore_containers(root, (), containers), tuple(skipped)


def restore_containers(node: Any, parts: tuple, containers: Mapping[str, str]) -> Any:
    """Turn the dicts that stood for lists and tuples back into them (children first)."""
    if not isinstance(node, dict):
        return node
    out = {k: restore_containers(v, (*parts, k), containers) for k, v in node.items()}
    kind = containers.get(".".join(str(p) for p in parts)) if parts else None
    if kind is None:
        return out
    items = [out[i] for i in sorted(out)]
    return items if kind == "list" else tuple(items)


def into_result(source: str, dst: str | os.PathLike[str], leaves: Mapping[str, Any]) -> ConvertResult:
    tensors = [leaf.value for leaf in leaves.values() if isinstance(leaf.value, torch.Tensor)]
    return ConvertResult(source, "arrayckpt", len(tensors),
                         sum(math.prod(t.shape) * t.element_size() for t in tensors), (str(dst),))


