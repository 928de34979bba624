"""``ArrayckptIO``: PyTorch Lightning's ``CheckpointIO`` plug-in, saving every checkpoint as an arrayckpt checkpoint.

``Trainer(plugins=[ArrayckptIO()])`` hands each checkpoint dict Lightning builds (``state_dict``,
``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``, ``hyper_parameters``, ...) to
:func:`arrayckpt.save`: tensors become chunked Zarr arrays, everything else plain JSON values.
``load_checkpoint`` rebuilds that dict with torch tensors; ``Trainer.fit(ckpt_path=...)`` resumes from it.

- **A path is a directory.** Lightning names checkpoints ``.../epoch=0-step=10.ckpt``; the checkpoint is a directory
  of that name (replaced atomically by a later save to the same name). ``ModelCheckpoint``'s existence checks,
  top-k bookkeeping, ``last.ckpt`` (also ``save_last="link"``) and ``ckpt_path="last"`` work with directories
  as they do with files. ``LightningModule.load_from_checkpoint`` reads files with ``torch.load`` and cannot read
  one: load through the trainer (``trainer.test(model, ckpt_path=...)``) or ``ArrayckptIO().load_checkpoint``.
- **No pickle unless allowed.** A value that is not plain JSON (say a hyper-parameter holding a function) fails
  the save with :class:`arrayckpt.PickleNotAllowedError` naming its key, before anything is written;
  ``ArrayckptIO(allow_pickle=True)`` pickles such values, and loading then unpickles them (``weights_only=True``
  never does).
- **Asynchronous saves.** ``ArrayckptIO(asynchronous=True)`` saves through :func:`arrayckpt.async_save`: the trainer
  waits only while tensors are copied to host memory. A save waits for the one in flight first (raising its
  error), as does :meth:`ArrayckptIO.teardown` (the end of ``fit``). A removal Lightning asks for meanwhile is
  done once the save in flight has committed, so a failed save never costs the checkpoint it was to replace.
- **Removal** is :meth:`arrayckpt.CheckpointManager`'s (``Location.delete``): the commit first, then arrayckpt's
  own files only; a link is removed as a link; whatever else is in the directory stays (with a warning).
- **Object storage.** ``s3://``/``gs://`` paths get ``storage_options`` (the constructor's, overridden by those of
  ``Trainer.save_checkpoint(..., storage_options=...)``).
- **One writer.** Lightning calls ``save_checkpoint`` and ``remove_checkpoint`` on global rank 0 only, and
  ``load_checkpoint`` on every rank: each call here is a single-process save or load, with no collectives.

Keys are those of Lightning's dict (``state_dict.layer.weight``, ``optimizer_states.0.state.0.exp_avg``), except the
callback states: each is one plain value under ``callbacks.<ClassName>`` (``callbacks.ModelCheckpoint``), which
holds Lightning's own state key and is given back exactly on load (``lightning_callbacks.py``). A dict holding
tensors whose key cannot name a directory (over 255 bytes once escaped; before readable callback keys,
``ModelCheckpoint``'s state key with a long monitor name, or a long path in its ``best_k_models``) is stored as a
list of ``[key, value]`` pairs under one key, :data:`FOLDED`, and unfolded on load.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast, overload

import numpy as np
import torch

from .._convert.common import restore_containers
from .._errors import CheckpointNotFoundError, PickleNotAllowedError
from .._format.codecs import CodecChoice
from .._format.keys import array_path
from .._format.manifest import AliasEntry, ArrayEntry, Entry, PerRankEntry
from .._layout.saveplan import MAX_SEGMENT_BYTES
from .._read.checkpoint import open_checkpoint
from .._read.load import load
from .._storage import parse_location
from .._torch.dist import Group
from .._torch.dtypes import torch_dtype
from .._torch.shards import PerRank
from .._write.asynchronous import SaveHandle, async_save
from .._write.save import save
from .lightning_callbacks import readable_callbacks, restore_callbacks

if TYPE_CHECKING:
    from torch.serialization import MAP_LOCATION

__all__ = ["FOLDED", "LIGHTNING_EXTRA", "ArrayckptIO"]

LIGHTNING_EXTRA = "pip install 'arrayckpt[lightning]'"
#: The one key of a dict stored as ``[[key, value], ...]`` because a key of it cannot name a directory.
FOLDED = "arrayckpt_folded_items"
_SINGLE = Group(0, 1)  # Lightning calls the plug-in on one rank: no collectives with the others


def _checkpoint_io_bases() -> tuple[type, ...]:
    """Lightning's ``CheckpointIO`` base classes: ``lightning_fabric``'s (what ``pytorch_lightning`` uses) and
    ``lightning.fabric``'s (the ``lightning`` package), those installed; the plug-in is an instance of both, so
    either package's ``Trainer`` (and ``Fabric``) accepts it."""
    found = []
    for package, module in (("lightning_fabric", "lightning_fabric.plugins.io.checkpoint_io"),
                            ("lightning", "lightning.fabric.plugins.io.checkpoint_io")):
        if importlib.util.find_spec(package) is not None:
            found.append(importlib.import_module(module).CheckpointIO)
    if not found:
        raise ModuleNotFoundError(f"arrayckpt.lightning requires PyTorch Lightning: {LIGHTNING_EXTRA} (or install "
                                  "the 'lightning' package)", name="pytorch_lightning")
    return tuple(found)


class ArrayckptIO(*_checkpoint_io_bases()):  # type: ignore[misc]
    """Lightning's checkpoints as arrayckpt checkpoints: ``Trainer(plugins=[ArrayckptIO()])``.

    Args:
        allow_pickle: pickle values that are not plain JSON (else saving one fails, naming it).
        asynchronous: save in the background (:func:`arrayckpt.async_save`).
        codec: as for :func:`arrayckpt.save`.
        storage_options: for object-storage paths (``s3://bucket/run/epoch=0-step=10.ckpt``).

    Examples:
        >>> import os, tempfile, torch
        >>> from arrayckpt.lightning import ArrayckptIO
        >>> io = ArrayckptIO()
        >>> path = os.path.join(tempfile.mkdtemp(), "epoch=0-step=10.ckpt")
        >>> io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 10, "lr_schedulers": []}, path)
        >>> os.path.isdir(path), io.load_checkpoint(path)
        (True, {'state_dict': {'w': tensor([1., 1.])}, 'global_step': 10, 'lr_schedulers': []})
        >>> io.remove_checkpoint(path)
        >>> os.path.exists(path)
        False
    """

    def __init__(self, *, allow_pickle: bool = False, asynchronous: bool = False, codec: CodecChoice = None,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.allow_pickle = allow_pickle
        self.asynchronous = asynchronous
        self.codec = codec
        self.storage_options = storage_options
        self._pending: SaveHandle | None = None  # the asynchronous save in flight
        self._removals: list[str] = []  # removals asked for while it was in flight, done once it has committed

    # --- saving -------------------------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, object], path: str | os.PathLike[str],
                        storage_options: Mapping[str, Any] | None = None) -> None:
        """Save Lightning's checkpoint dict as the arrayckpt checkpoint (a directory, or a prefix) ``path``,
        replacing one already there; asynchronous plug-ins wait for the save in flight first."""
        self._finish_pending()
        target = os.fspath(path)
        step = checkpoint.get("global_step")
        options: dict[str, Any] = {  # Any: the keyword arguments of save and async_save, each of its own type
            "overwrite": True, "allow_pickle": self.allow_pickle, "codec": self.codec,
            "step": step if isinstance(step, int) and not isinstance(step, bool) else None,
            "storage_options": self._options(target, storage_options), "process_group": _SINGLE}
        state = _fold(readable_callbacks(checkpoint))
        if (local := _local_path(target)) is not None:  # the parent exists on return, as with TorchCheckpointIO
            os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)  # (save_last="link" links in it)
        try:
            if self.asynchronous:
                self._pending = async_save(state, target, **options)
            else:
                save(state, target, **options)
        except PickleNotAllowedError as e:
            raise PickleNotAllowedError(
                f"{target}: {e}. With Lightning: keep the value out of the checkpoint (for a hyper-parameter, "
                "save_hyperparameters(ignore=[...])) or make it plain, or pickle it with ArrayckptIO("
                "allow_pickle=True) (loading it then unpickles: only for checkpoints you trust); nothing was saved"
            ) from None

    def teardown(self) -> None:
        """Wait for the save in flight (raising its error), then do the removals that waited for it."""
        self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        removals, self._removals = self._removals, []
        try:
            pending.wait()
        except BaseException as e:
            if removals:
                e.add_note(f"arrayckpt.lightning: kept {', '.join(removals)}, which were to be removed once the "
                           f"save to {pending.path} had committed")
            raise
        for removal in removals:
            self._remove(removal)

    # --- loading ------------------------------------------------------------------------------------------------

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: MAP_LOCATION = None,
                        weights_only: bool | None = None) -> dict[str, object]:
        """The checkpoint dict saved at ``path``, with torch tensors (on the CPU, or where ``map_location`` puts
        them: a device, a ``{"cpu": device}`` dict, or torch.load's ``(storage, location)`` function). Pickled
        values are unpickled only with ``allow_pickle=True`` and ``weights_only`` not ``True``."""
        self._finish_pending()
        target = os.fspath(path)
        if (local := _local_path(target)) is not None and os.path.isfile(local):
            raise CheckpointNotFoundError(f"{target}: is a file, not an arrayckpt checkpoint (a directory): a "
                                          "torch.save checkpoint? Load it with Lightning's default CheckpointIO, or "
                                          f"convert it: arrayckpt convert {target} <new path>")
        allow = self.allow_pickle and weights_only is not True
        options = self._options(target, None)
        with open_checkpoint(target, storage_options=options) as checkpoint:
            template, containers = _template(checkpoint.manifest.entries), checkpoint.manifest.containers
        try:
            load(template, target, allow_pickle=allow, process_group=_SINGLE, storage_options=options)
        except PickleNotAllowedError as e:
            fix = "it was loaded with weights_only=True" if self.allow_pickle else "use ArrayckptIO(allow_pickle=True)"
            raise PickleNotAllowedError(f"{e}; with Lightning: {fix}") from None
        loaded = restore_callbacks(_unfold(restore_containers(_unwrap(template), (), containers)), target)
        return _mapped(loaded, map_location)

    # --- removing -----------------------------------------------------------------------------------------------

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the checkpoint at ``path`` as :class:`arrayckpt.CheckpointManager` does: its commit first, then
        arrayckpt's own files (never anything else, never through a link). While a save is in flight the removal
        waits for it to commit (and is dropped if it fails)."""
        target = os.fspath(path)
        if self._pending is not None:
            if not self._pending.done():
                self._removals.append(target)
                return
            self._finish_pending()
        self._remove(target)

    def _remove(self, target: str) -> None:
        parse_location(target, self._options(target, None)).delete()
        if (local := _local_path(target)) is not None and os.path.lexists(local):
            warnings.warn(f"{target}: left in place: it holds files that are not arrayckpt's (or is not an arrayckpt "
                          "checkpoint); remove it yourself if it is not needed", RuntimeWarning, stacklevel=3)

    def _options(self, target: str, given: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
        """The storage options for ``target``: none for a local path (unless given: arrayckpt then says they do not
        apply), else the constructor's updated with ``given``."""
        if _local_path(target) is not None:
            return given
        merged = {**(self.storage_options or {}), **(given or {})}
        return merged or None


def _local_path(target: str) -> str | None:
    """The local path ``target`` names (a path or a ``file://`` URL), or ``None`` for object storage."""
    scheme, separator, rest = target.partition("://")
    if not separator:
        return target
    return rest if scheme == "file" else None


def _storable(key: object) -> bool:
    """Whether a dict key can be a part of an array's key (each dot-separated piece at most 255 bytes escaped)."""
    return all(len(segment) <= MAX_SEGMENT_BYTES for segment in array_path(str(key)).split("/"))


def _holds_tensors(value: object) -> bool:
    if isinstance(value, torch.Tensor | np.ndarray):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_holds_tensors(v) for v in value)
    return False


@overload
def _fold(value: dict[str, object]) -> dict[str, object]: ...
@overload
def _fold(value: object) -> object: ...
def _fold(value: object) -> object:
    """``value`` with every dict that holds tensors under a key that cannot be stored as ``{FOLDED: [[k, v], ...]}``
    (new containers only where something changed)."""
    if isinstance(value, dict):
        items = {k: _fold(v) for k, v in value.items()}
        if not all(_storable(k) for k in items) and _holds_tensors(items):
            return {FOLDED: [[k, v] for k, v in items.items()]}
        return items if any(items[k] is not value[k] for k in items) else value
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        folded = [_fold(v) for v in value]
        if all(a is b for a, b in zip(folded, value, strict=True)):
            return value
        return folded if isinstance(value, list) else tuple(folded)
    return value


@overload
def _unfold(value: dict[str, object]) -> dict[str, object]: ...
@overload
def _unfold(value: object) -> object: ...
def _unfold(value: object) -> object:
    """Invert :func:`_fold`."""
    if isinstance(value, dict):
        if len(value) == 1 and isinstance(folded := value.get(FOLDED), list) and all(
                isinstance(item, list | tuple) and len(item) == 2 for item in folded):
            return {k: _unfold(v) for k, v in folded}
        return {k: _unfold(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unfold(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_unfold(v) for v in value)
    return value


def _template(entries: Mapping[str, Entry]) -> dict[str, object]:
    """Nested dicts for ``load`` to fill: an empty tensor (or array) per array entry, the same tensor again for its
    aliases (tied weights: one tensor under both keys, as saved), ``None`` for each plain value (replaced by it), rank
    0's value of a per-rank entry; lists and tuples as dicts by index for now."""
    root: dict[str, object] = {}
    made: dict[str, object] = {}
    ties: list[tuple[dict[str | int, object], str | int, str]] = []  # (container, slot, target) of each alias,
    # filled last
    for entry in entries.values():
        node: Any = root  # Any: the dict at each depth, made here (setdefault's result is typed object)
        for part in entry.parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(entry, PerRankEntry):
            leaf: object = PerRank(None, rank=0)
        elif isinstance(entry, ArrayEntry) and entry.kind == "ndarray":
            leaf = np.empty(entry.shape, entry.dtype.numpy)
        elif isinstance(entry, ArrayEntry):
            leaf = torch.empty(entry.shape, dtype=torch_dtype(entry.dtype))
        else:
            leaf = None
            if isinstance(entry, AliasEntry):
                ties.append((node, entry.parts[-1], entry.target))
        node[entry.parts[-1]] = made[entry.key] = leaf
    for node, slot, target in ties:
        node[slot] = made[target]
    return root


@overload
def _unwrap(value: dict[str, object]) -> dict[str, object]: ...
@overload
def _unwrap(value: object) -> object: ...
def _unwrap(value: object) -> object:
    """The loaded template with per-rank values replaced by the value they hold."""
    if isinstance(value, dict):
        return {k: _unwrap(v) for k, v in value.items()}
    return value.value if isinstance(value, PerRank) else value


@overload
def _mapped(value: dict[str, object], map_location: MAP_LOCATION) -> dict[str, object]: ...
@overload
def _mapped(value: object, map_location: MAP_LOCATION) -> object: ...
def _mapped(value: object, map_location: MAP_LOCATION) -> object:
    """Every tensor moved as ``torch.load(map_location=...)`` would move a tensor saved on the CPU."""
    if map_location is None:
        return value
    if isinstance(value, dict):
        return {k: _mapped(v, map_location) for k, v in value.items()}
    if isinstance(value, list | tuple) and not hasattr(value, "_fields"):
        return type(value)(_mapped(v, map_location) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    device: torch.device | str | None
    if isinstance(map_location, Mapping):
        device = map_location.get("cpu")
    elif callable(map_location):  # torch's MAP_LOCATION names Storage; torch.load hands it untyped storages too
        relocate = cast("Callable[[torch.UntypedStorage, str], torch.UntypedStorage | None]", map_location)
        storage = relocate(value.untyped_storage(), "cpu")
        device = None if storage is None else storage.device
    else:
        device = map_location
    return value if device is None else value.to(device)
