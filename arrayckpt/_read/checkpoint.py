"""Reading: a committed checkpoint opened as lazy arrays, with no torch needed to look inside.

``open`` costs one read (the root ``zarr.json`` holds the manifest and every array's metadata); array
data is read only when sliced, and only the chunks the slice touches.

:class:`Checkpoint` is what users hold: a mapping of lazy arrays, the manifest, plain values, closing. What it holds
on storage, and everything the read layer, the tools and the converters need besides, is its
:class:`~.stored.StoredCheckpoint` (``stored.py``), which they reach through :func:`stored_of`. An open checkpoint
holds storage resources until :meth:`Checkpoint.close` (or the end of a ``with`` block); one garbage-collected
unclosed releases them then, with a :class:`ResourceWarning` as Python's files do.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import cached_property
from typing import Any

import numpy as np

from .._format.manifest import ArrayEntry, Manifest, PerRankEntry, PickleEntry, ValueEntry
from .._format.values import decode_value
from .._io.arrays import ArrayIO
from .._read.lazy import LazyArray
from .._read.reader import read
from .._read.stored import StoredCheckpoint
from .._storage import Location, parse_location, parse_roots
from .._storage.base import Opened

__all__ = ["Checkpoint", "LazyArray", "open_checkpoint", "open_location", "opened", "stored_of"]


class _Values(Mapping[str, Any]):
    """Plain values by key; pickled ones are unpickled on access, only with consent."""

    def __init__(self, stored: StoredCheckpoint) -> None:
        self._stored = stored
        self._entries = [k for k, e in stored.manifest.entries.items() if isinstance(e, (ValueEntry, PickleEntry))]
        self._keys = frozenset(self._entries)

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._stored.value(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class Checkpoint(Mapping[str, LazyArray]):
    """A committed checkpoint, read-only: dotted key -> :class:`LazyArray`. Made by :func:`arrayckpt.open`.

    Plain values are in :attr:`plain_values`, the manifest in :attr:`manifest`. A tensor the state held under two
    keys (tied weights) is stored once: the second key is an alias (:meth:`aliases`), and ``checkpoint[alias]``
    is the target's :class:`LazyArray`. Close it when done (``with
    arrayckpt.open(path) as ckpt:``, or :meth:`close`) to release what it holds on storage. After closing, what is
    in memory keeps working (keys, shapes, dtypes, :attr:`manifest`, :attr:`step`, :attr:`metrics`, plain values
    that are not pickled), as a closed file's name does; reading data (slicing, ``.numpy()``, ``.torch()``,
    ``read_into``, :meth:`per_rank`, pickled values, opening a :attr:`base`) raises
    :class:`ClosedCheckpointError`.
    Made by :func:`arrayckpt.open`.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"model": torch.nn.Linear(2, 1), "step": 3}, path, step=3, metrics={"loss": 0.5})
        >>> with arrayckpt.open(path) as ckpt:
        ...     sorted(ckpt), ckpt.step, ckpt.metrics, dict(ckpt.plain_values)
        (['model.bias', 'model.weight'], 3, {'loss': 0.5}, {'step': 3})
    """

    def __init__(self, stored: StoredCheckpoint) -> None:
        self._stored = stored  # what it holds on storage, and what reading needs (stored_of)
        arrays = {key: LazyArray(stored, entry, stored.metadata[key])
                  for key, entry in stored.manifest.entries.items() if isinstance(entry, ArrayEntry)}
        aliases = stored.manifest.aliases  # an alias is its target's array, in the order of the entries
        self._arrays = {key: arrays[aliases.get(key, key)] for key in stored.manifest.entries
                        if aliases.get(key, key) in arrays}
        self._base: Checkpoint | None = None  # the public face of the base, once opened (always the same object)

    @property
    def location(self) -> Location:
        """Where the checkpoint is (``str(location)``: its path or URL)."""
        return self._stored.location

    @property
    def manifest(self) -> Manifest:
        """What the checkpoint holds: every entry by key, its step, metrics, aliases and base."""
        return self._stored.manifest

    # --- closing ------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (by itself, a ``with`` block, or the delta that opened this base)."""
        return self._stored.closed

    def close(self) -> None:
        """Release what the checkpoint holds on storage: the pinned directory (local storage), the TensorStore
        context and array handles, and the bases it opened (a delta checkpoint's chain). Calling it again does
        nothing. Do not close while reads run on other threads. Reading data afterwards raises
        :class:`ClosedCheckpointError`; what is in memory (keys, shapes, manifest, plain values) stays readable.
        """
        self._stored.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- delta checkpoints ------------------------------------------------------------------------

    @property
    def base(self) -> Checkpoint:
        """The checkpoint this delta checkpoint was saved against (opened on first use, and checked to be the
        very one: a base replaced since is refused). Only where spec §10.1 lets a reader go: the directory holding
        this checkpoint, or one of the ``base_roots`` it was opened with (:class:`arrayckpt.BaseNotAllowedError`
        otherwise). Closing this checkpoint closes it."""
        stored = self._stored.base  # opened on first use; raises once closed
        if self._base is None:
            self._base = Checkpoint(stored)
        return self._base

    def chain(self) -> list[Checkpoint]:
        """This checkpoint and its bases, newest first, down to a full checkpoint (every one opened; closing this
        checkpoint closes them)."""
        out = [self]
        while out[-1].manifest.base is not None:
            out.append(out[-1].base)
        return out

    # --- contents ---------------------------------------------------------------------------------------------

    def per_rank(self, key: str) -> list[Any]:
        """Every rank's value of a :class:`arrayckpt.PerRank` entry (tensors read whole; ``None`` where a rank
        had none), e.g. to inspect RNG states or resume at another world size."""
        from .._torch.dtypes import torch_view  # per-rank tensors come back as torch tensors

        entry = self.manifest.entries.get(key)
        if not isinstance(entry, PerRankEntry):
            raise KeyError(f"{self.location}: {key!r} is not a per-rank entry")
        stored = self._stored
        stored.check_open()
        arrays = {rank: np.empty(item.shape, item.dtype.numpy) for rank, item in enumerate(entry.items)
                  if isinstance(item, ArrayEntry)}
        read(stored, [ArrayIO(key, stored.per_rank_spec(key, rank), array) for rank, array in arrays.items()])
        out: list[Any] = []
        for rank, item in enumerate(entry.items):
            if isinstance(item, ArrayEntry):
                out.append(arrays[rank] if item.kind == "ndarray" else torch_view(arrays[rank], item.dtype))
            else:
                out.append(None if item is None else decode_value(item.value, key))
        return out

    @property
    def step(self) -> int | None:
        """The training step recorded at save (``save(..., step=...)``), or ``None``."""
        return self.manifest.step

    def aliases(self) -> Mapping[str, str]:
        """Every alias key and the key of the tensor it names, stored once under that target (e.g.
        ``{"lm_head.weight": "transformer.wte.weight"}`` for tied weights); ``{}`` when there are none. An export that
        drops tied duplicates keeps the targets."""
        return self.manifest.aliases

    @property
    def metrics(self) -> Mapping[str, float]:
        """The metrics recorded at save (``save(..., metrics={"val_loss": 1.9})``)."""
        return self.manifest.metrics

    @cached_property
    def plain_values(self) -> Mapping[str, Any]:
        """Plain values by dotted key (pickled ones raise unless opened with ``allow_pickle=True``)."""
        return _Values(self._stored)

    def __getitem__(self, key: str) -> LazyArray:
        try:
            return self._arrays[key]
        except KeyError:
            hint = " (it is a plain value: see .plain_values)" if key in self.manifest.entries else ""
            raise KeyError(f"{self.location}: no tensor {key!r}{hint}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def __repr__(self) -> str:
        closed = ", closed" if self.closed else ""
        aliases = len(self.manifest.aliases)
        stored = f"{len(self) - aliases} arrays" + (f" (+{aliases} aliases)" if aliases else "")
        return f"arrayckpt.Checkpoint({str(self.location)!r}, {stored}, {len(self.plain_values)} values{closed})"

    @property
    def nbytes(self) -> int:
        """The bytes of the tensors, each stored tensor counted once (an alias adds none)."""
        return sum(a.nbytes for key, a in self._arrays.items() if a.key == key)


def stored_of(checkpoint: Checkpoint) -> StoredCheckpoint:
    """What ``checkpoint`` holds on storage, and what reading needs besides its public members: the read layer's,
    the tools' and the converters' way in (``stored.py``)."""
    return checkpoint._stored


def open_location(location: Location, *, allow_pickle: bool = False, opened: Opened | None = None,
                  base_roots: tuple[Location, ...] = ()) -> Checkpoint:
    """:func:`open_checkpoint` for internal callers holding a parsed location (and, with ``opened``, the root
    document another rank read: what ``location.open_committed()`` gives)."""
    return Checkpoint(StoredCheckpoint(location, allow_pickle, opened, base_roots))


def open_checkpoint(path: str | os.PathLike[str] | Location, *, allow_pickle: bool = False,
                    storage_options: Mapping[str, Any] | None = None,
                    base_roots: Sequence[str | os.PathLike[str]] | None = None) -> Checkpoint:
    """Open a committed checkpoint read-only: a local path or an object-storage URL (``s3://bucket/prefix``,
    with ``storage_options`` as for :func:`arrayckpt.save`). Opening reads one object, the root ``zarr.json``.
    Use it as a context manager (or call :meth:`Checkpoint.close`) to release what it holds when done.

    A delta checkpoint's bases are read from the directory (prefix) holding it, as saves write them; a base
    elsewhere is read only inside one of ``base_roots`` (directories or URLs you trust), else opening the delta
    raises :class:`arrayckpt.BaseNotAllowedError` naming its reference (spec §10.1).

    Args:
        path: a directory or an object-storage URL.
        allow_pickle: let pickled values be read (unpickling runs the writer's code: only for checkpoints you trust).
        storage_options: for object storage, as for :func:`arrayckpt.save`.
        base_roots: directories or URLs you trust, where a delta's bases may be read besides the delta's own.

    Returns:
        The open checkpoint, a read-only mapping of dotted keys to :class:`LazyArray`.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        IncompleteCheckpointError: a save at ``path`` never committed.
        CorruptCheckpointError: the root metadata is damaged.
        FormatError: the metadata does not follow the format (or a newer version of it).
        BaseNotAllowedError: a delta's base is outside the delta's directory and ``base_roots``.
        LocationError: ``path`` or ``storage_options`` cannot name a location.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, d)
        >>> with arrayckpt.open(d) as ckpt:
        ...     ckpt["w"].shape, ckpt["w"][1, :2].tolist(), ckpt.plain_values["step"]
        ((2, 3), [3.0, 4.0], 7)
        >>> ckpt.closed, sorted(ckpt)  # closed: data can no longer be read, what is in memory can
        (True, ['w'])
    """
    return open_location(parse_location(path, storage_options), allow_pickle=allow_pickle,
                         base_roots=parse_roots(base_roots, storage_options))


def opened(source: Checkpoint | str | os.PathLike[str], *, allow_pickle: bool = False,
           storage_options: Mapping[str, Any] | None = None,
           base_roots: Sequence[str | os.PathLike[str]] | None = None) -> AbstractContextManager[Checkpoint]:
    """``with opened(source) as checkpoint:`` for internal callers: a :class:`Checkpoint` passed in is used as is
    and left open (its owner closes it); a path is opened (the options as for :func:`open_checkpoint`) and closed
    when the block ends."""
    if isinstance(source, Checkpoint):
        return nullcontext(source)
    return open_checkpoint(source, allow_pickle=allow_pickle, storage_options=storage_options, base_roots=base_roots)
