"""What every converter shares: the result type, refusing to overwrite, replacing a file atomically and
durably, and the nested state of a checkpoint. No torch here (``to_safetensors`` runs without it).

Every converter streams: the source's index (safetensors header, DCP ``.metadata``, the pickle of a
torch.save file) gives the structure first, then tensors are read one at a time and written by
``_write/stream.py::write_streaming`` (into arrayckpt) or appended to the target file (out of it). Bit
patterns are kept exactly (bfloat16 and float8 included); nothing is cast. ``dispatch.py`` chooses the
converter; ``torch_save.py``, ``safetensors.py``, ``dcp.py``, ``megatron.py`` and ``megatron_fsdp.py`` (over
``dcp.py``) are the formats; DeepSpeed is read by ``deepspeed.py`` (ZeRO, with ``deepspeed_files.py``) and
``deepspeed_universal_read.py``, written by ``deepspeed_universal.py`` (its Universal Checkpoint, from
``universal_plan.py``'s choice of tensors).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import ArrayckptError, CheckpointExistsError, StorageError
from .._format.jsontypes import JSON
from .._format.manifest import PerRankEntry, PickleEntry
from .._read.checkpoint import Checkpoint, stored_of

__all__ = ["ConvertResult", "Progress", "nested_state", "refusal_reason", "refuse_existing", "replaced_atomically",
           "restore_containers", "write_failure"]

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert` wrote, and the entries of the source the target format could not hold.

    Attributes:
        source_format: the format read (``"torch"``, ``"dcp"``...).
        target_format: the format written.
        tensors: how many tensors were written.
        bytes: their bytes.
        files: the files written.
        skipped: the keys left out (e.g. plain values going to safetensors; for a Hugging Face export, every entry
            outside the selection: optimizer state, values).
        selected: the key prefix a Hugging Face export (``to_format="hf"``) took and stripped (``"model."``; ``""``
            for the whole state; ``None`` for other targets).
        tied: the names a Hugging Face export left out as ties of others: alias -> the name written
            (``{"lm_head.weight": "transformer.wte.weight"}``).
        notes: what the caller should know before publishing, in words (e.g. names the config's model expects that
            the export lacks).

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> arrayckpt.save({"w": torch.ones(2), "step": 1}, os.path.join(d, "ckpt"))
        >>> done = arrayckpt.convert(os.path.join(d, "ckpt"), os.path.join(d, "w.safetensors"))
        >>> done.source_format, done.target_format, done.tensors, done.skipped
        ('arrayckpt', 'safetensors', 1, ('step',))
    """

    source_format: str
    target_format: str
    tensors: int
    bytes: int
    files: tuple[str, ...]
    skipped: tuple[str, ...] = ()
    selected: str | None = None
    tied: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> JSON:
        return {**self.__dict__, "files": list(self.files), "skipped": list(self.skipped), "tied": dict(self.tied),
                "notes": list(self.notes)}


def refusal_reason(error: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, in one line (``Unsupported global: GLOBAL fractions.Fraction``)
    instead of its paragraph of advice."""
    text = str(error)
    match = re.search(r"WeightsUnpickler error:\s*(.*?)(?: was not an allowed global|\. Please|\n|$)", text)
    if match and match.group(1).strip():
        return match.group(1).strip()
    match = re.search(r"unsupported GLOBAL (\S+)", text)
    if match:
        return f"Unsupported global: GLOBAL {match.group(1)}"
    lines = [line.strip() for line in text.splitlines() if line.strip()
             and not line.startswith(("Weights only load failed", "Check the documentation", "Re-running"))]
    return lines[0] if lines else type(error).__name__


def refuse_existing(path: Path, overwrite: bool) -> None:
    if path.exists() and not overwrite:
        raise CheckpointExistsError(f"{path}: already exists; pass overwrite=True (--overwrite) to replace it")


@contextlib.contextmanager
def replaced_atomically(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write the new file to; once the block succeeds the file is made durable
    (fsync) and renamed over ``path`` in one step, so ``path`` is never seen half-written. On failure the
    temporary file is removed and ``path`` is untouched; a failed write (a full disk) is a :class:`StorageError`
    naming ``path``. Missing parent directories are created, as ``save``, ``compact`` and ``sync`` create them."""
    temp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield temp
        with open(temp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(temp, path)
    except Exception as e:
        failure = write_failure(e, path)
        if failure is None:
            raise
        raise failure from e
    finally:
        temp.unlink(missing_ok=True)


def write_failure(error: BaseException, path: Path | str) -> StorageError | None:
    """``error`` as a :class:`StorageError` naming ``path`` when it is a failed write: an ``OSError`` such as
    ENOSPC, or torch's zip writer failing on one (``[enforce fail at inline_container.cc] unexpected pos``: the
    ``OSError`` is only in its context, or lost when torch wrote the file itself); ``None`` for anything else."""
    if isinstance(error, ArrayckptError):
        return None
    text = str(error)
    torch_writer = isinstance(error, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text)
    cause = error if isinstance(error, OSError) else error.__context__ if torch_writer else None
    if isinstance(cause, OSError):
        what = "no space left on the device" if cause.errno == errno.ENOSPC else (cause.strerror or str(cause))
        return StorageError(f"{path}: writing failed: {what}; nothing was written there")
    if torch_writer:
        return StorageError(f"{path}: writing failed (torch's file writer: {text.splitlines()[0].strip()}): "
                            "the disk is probably full; nothing was written there")
    return None


def nested_state(checkpoint: Checkpoint, tensor: Callable[[str], object]) \
        -> tuple[dict[str, object], tuple[str, ...]]:
    """The checkpoint's state rebuilt as nested dicts/lists/tuples; ``tensor(key)`` gives each array leaf.

    An alias (tied weights) gets the very object its target gets (``tensor`` is asked once), so that a format which
    shares objects, as ``torch.save`` does, stores it once and loads it tied. Per-rank entries have no place in a
    single-process format and are skipped (returned).
    """
    root: dict[Any, Any] = {}
    skipped = []
    entries = checkpoint.manifest.entries
    stored = stored_of(checkpoint)
    pickled = stored.unpickle([k for k, e in entries.items() if isinstance(e, PickleEntry)])  # one warning
    made: dict[str, object] = {}  # by the key of the stored tensor
    for key, entry in entries.items():
        if isinstance(entry, PerRankEntry):
            skipped.append(key)
            continue
        array = checkpoint.manifest.array_entry(key)  # an alias: its target's
        if array is not None and array.key not in made:
            made[array.key] = tensor(array.key)
        value = made[array.key] if array is not None else pickled[key] if key in pickled else stored.value(key)
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

