"""``show`` and ``diff``: look at values and compare checkpoints without loading whole tensors.

Statistics of a slice are accumulated block by block (a few MiB of the selection at a time), and ``diff``
compares two checkpoints chunk by chunk, so neither needs memory in proportion to the tensors. Slices are
parsed from numpy-style text (``0:4,::2``, ``...,-1``) by a small grammar, never by ``eval``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any

import numpy as np

from .._format.jsontypes import JSON
from .._format.manifest import AliasEntry, ArrayEntry, Entry, PerRankEntry, PickleEntry, ValueEntry
from .._layout.box import Box
from .._read.chain import dense_metadata
from .._read.checkpoint import Checkpoint, opened, stored_of
from .._read.reader import read_boxes
from .._settings import settings
from .._tools.chunkwise import ChunkRef, iter_chunks

__all__ = ["DiffReport", "SliceSummary", "TensorDiff", "diff", "parse_slice", "selection_blocks", "show"]

BLOCK_CHUNKS = 4096  # and at most so many chunks compared at once
MAX_VALUES = 1000  # selections up to this many elements have their values returned

Index = tuple[int | slice, ...]
_INT = r"\s*-?\d+\s*"
_PART = re.compile(rf"(?P<int>{_INT})|(?P<slice>({_INT}|\s*):({_INT}|\s*)(:({_INT}|\s*))?)|(?P<ellipsis>\s*\.\.\.\s*)")


def parse_slice(text: str) -> tuple[int | slice | EllipsisType, ...]:
    """Parse numpy-style index text: ``"0:4,::2"`` -> ``(slice(0, 4), slice(None, None, 2))``.

    Parts are integers, ``start:stop[:step]`` slices (each bound optional) and at most one ``...``.

    >>> parse_slice("1, 2:, ..., ::-1")
    (1, slice(2, None, None), Ellipsis, slice(None, None, -1))
    """
    if not text.strip():
        return ()
    parts: list[int | slice | EllipsisType] = []
    for raw in text.split(","):
        match = _PART.fullmatch(raw)
        if match is None:
            raise ValueError(f"slice {text!r}: cannot parse {raw.strip()!r}; use integers, start:stop:step and ...")
        if match["int"] is not None:
            parts.append(int(match["int"]))
        elif match["ellipsis"] is not None:
            parts.append(Ellipsis)
        else:
            bounds = [int(b) if b.strip() else None for b in (raw.split(":") + [""])[:3]]
            if bounds[2] == 0:
                raise ValueError(f"slice {text!r}: step must not be zero")
            parts.append(slice(*bounds))
    if parts.count(Ellipsis) > 1:
        raise ValueError(f"slice {text!r}: at most one '...'")
    return tuple(parts)


def normalize_index(index: tuple[Any, ...], shape: tuple[int, ...], key: str) -> Index:
    """An index with ``...`` expanded, negative numbers resolved and bounds checked (for TensorStore)."""
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = (*index[:at], *(slice(None),) * max(fill, 0), *index[at + 1:])
    if len(index) > len(shape):
        raise IndexError(f"tensor {key!r} has {len(shape)} dimension(s); the slice has {len(index)} parts")
    index = (*index, *(slice(None),) * (len(shape) - len(index)))
    out: list[int | slice] = []
    for d, (part, n) in enumerate(zip(index, shape, strict=True)):
        if isinstance(part, int):
            if not -n <= part < n:
                raise IndexError(f"tensor {key!r}: index {part} is out of bounds for dimension {d} of size {n}")
            out.append(part % n)
            continue
        if part.step is not None and part.step < 0:
            raise IndexError(f"tensor {key!r}: negative steps are not supported (dimension {d}); use a positive "
                             "step")
        out.append(slice(*part.indices(n)))
    return tuple(out)


def _selected_shape(index: Index) -> tuple[int, ...]:
    return tuple(len(range(p.start, p.stop, p.step)) for p in index if isinstance(p, slice))


@dataclass(frozen=True)
class SliceSummary:
    """Statistics of a selection of one tensor, as :func:`show` returns them.

    Attributes:
        key: the tensor's key.
        dtype: its dtype's name.
        shape: the shape of the whole tensor.
        index: the selection, as given.
        selected_shape: the shape of the selection.
        count: how many elements were selected.
        nan_count: how many of them are NaN.
        inf_count: how many are infinite.
        min: the least finite value (``None``: none).
        max: the greatest finite value.
        mean: the mean of the finite values.
        std: their standard deviation.
        values: nested lists, for selections of at most ``max_values`` elements (else ``None``).
        note: what the statistics leave out, in words (``""``: nothing).

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.tensor([1.0, float("nan"), 3.0])}, path)
        >>> s = arrayckpt.show(path, "w")
        >>> s.count, s.nan_count, s.mean
        (3, 1, 2.0)
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    index: str
    selected_shape: tuple[int, ...]
    count: int
    nan_count: int
    inf_count: int
    min: float | int | None
    max: float | int | None
    mean: float | None
    std: float | None
    values: object = None
    note: str = ""

    def to_dict(self) -> JSON:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class _Stats:
    """Streaming count/mean/M2 (Chan et al.'s parallel update) plus min, max, NaN and inf counts."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    nan: int = 0
    inf: int = 0
    min: float | int | None = None
    max: float | int | None = None

    def add(self, block: np.ndarray) -> None:
        if block.dtype.kind == "c":
            block = np.abs(block.astype(np.complex128))
        elif block.dtype.kind == "b":
            block = block.astype(np.uint8)
        exact = block.dtype.kind in "iu"
        values = block.astype(np.int64 if block.dtype.kind == "i" else np.uint64) if exact else block.astype(np.float64)
        if not exact:
            nan = np.isnan(values)
            inf = np.isinf(values)
            self.nan += int(nan.sum())
            self.inf += int(inf.sum())
            values = values[~(nan | inf)]
        values = values.reshape(-1)
        if not values.size:
            return
        low, high = values.min().item(), values.max().item()
        self.min = low if self.min is None else min(self.min, low)
        self.max = high if self.max is None else max(self.max, high)
        as_float = values.astype(np.float64)
        n, mean = as_float.size, float(as_float.mean())
        m2 = float(((as_float - mean) ** 2).sum())
        total = self.count + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.count * n / total
        self.count = total


def _blocks(index: Index, row_bytes: int) -> Iterator[Index]:
    """Split a selection along its first sliced dimension into parts of about ``inspect_block_bytes``."""
    sliced = next((d for d, p in enumerate(index) if isinstance(p, slice)), None)
    if sliced is None:
        yield index
        return
    part = index[sliced]
    assert isinstance(part, slice)
    rows = range(part.start, part.stop, part.step)
    per_block = max(1, settings().inspect_block_bytes // max(1, row_bytes))
    for first in range(0, len(rows), per_block):
        chosen = rows[first:first + per_block]
        sub = slice(chosen.start, chosen.stop, chosen.step)
        yield (*index[:sliced], sub, *index[sliced + 1:])


def selection_blocks(index: Index, itemsize: int) -> Iterator[Index]:
    """A normalized selection split along its first sliced dimension into blocks of about ``inspect_block_bytes`` (of
    items of ``itemsize`` bytes): the parts ``show`` reads one at a time, and ``report`` reads the same way."""
    return _blocks(index, itemsize * math.prod(_selected_shape(index)[1:]))


def show(path: str | os.PathLike[str] | Checkpoint, key: str, index: str = "", *,
         max_values: int = MAX_VALUES) -> SliceSummary:
    """Statistics (and, for small selections, the values) of ``checkpoint[key][index]``.

    Memory stays bounded whatever the selection size.

    Args:
        path: a checkpoint's directory or URL, or an open :class:`Checkpoint`.
        key: the tensor's key.
        index: numpy-style text such as ``"0:4,::2"`` (``""``: the whole tensor).
        max_values: the values themselves are returned for selections of at most this many elements.

    Returns:
        The selection's statistics (and values).

    Raises:
        KeyError: no tensor ``key`` (or it is a plain value).
        ValueError: ``index`` cannot be parsed.
        IndexError: ``index`` does not fit the tensor's shape.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> arrayckpt.save({"w": torch.arange(12.0).reshape(3, 4)}, path)
        >>> s = arrayckpt.show(path, "w", "1:,::2")
        >>> s.selected_shape, s.values, s.min, s.max
        ((2, 2), [[4.0, 6.0], [8.0, 10.0]], 4.0, 10.0)
    """
    with opened(path) as checkpoint:  # a Checkpoint passed in stays open
        return _show(checkpoint, key, index, max_values)


def _show(checkpoint: Checkpoint, key: str, index: str, max_values: int) -> SliceSummary:
    array = checkpoint[_known_tensor(checkpoint, key)]
    normalized = normalize_index(parse_slice(index), array.shape, key)
    selected = _selected_shape(normalized)
    stats = _Stats()
    values = None
    size = math.prod(selected)
    for block in selection_blocks(normalized, array.entry.dtype.itemsize):
        data = array[block]
        stats.add(data)
        if size <= max_values:
            values = _plain_list(data)
    std = math.sqrt(stats.m2 / stats.count) if stats.count else None
    note = "" if size <= max_values else f"{size} values selected; select at most {max_values} to see them"
    if array.entry.dtype.numpy.kind == "c":
        note = (note + "; " if note else "") + "statistics of complex values are of their magnitudes"
    return SliceSummary(key, array.entry.dtype.name, array.shape, index, selected, stats.count + stats.nan + stats.inf,
                        stats.nan, stats.inf, stats.min, stats.max, stats.mean if stats.count else None, std, values,
                        note)


def _plain_list(data: np.ndarray) -> object:
    """JSON-able nested lists (bfloat16/float8 as floats, complex as [re, im])."""
    if data.dtype.kind == "c":
        return np.stack([data.real, data.imag], axis=-1).astype(np.float64).tolist()
    if data.dtype.kind in "biu":
        return data.tolist()
    return data.astype(np.float64).tolist()


def _known_tensor(checkpoint: Checkpoint, key: str) -> str:
    """``key`` if the checkpoint has a tensor by that name, else a KeyError that says what there is."""
    if key in checkpoint:
        return key
    if key in checkpoint.manifest.entries:
        raise KeyError(f"{checkpoint.location}: {key!r} is a plain value, not a tensor; `arrayckpt info` shows it")
    close = difflib.get_close_matches(key, list(checkpoint), n=3)
    hint = f"; did you mean {', '.join(map(repr, close))}?" if close else "; `arrayckpt info` lists the keys"
    raise KeyError(f"{checkpoint.location}: no tensor {key!r}{hint}")


# ----------------------------------------------------------------------------------------------- diff


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor present in both checkpoints (same dtype and shape) differs.

    Attributes:
        key: the tensor's key.
        differing_elements: how many elements differ (bitwise).
        max_abs: ``max |a - b|`` over elements whose difference is finite.
        max_rel: ``max |a - b| / max(|a|, |b|)`` over the same elements.
        nonfinite: elements that differ where either side is NaN or infinite.
        chunks: the chunks of ``a``'s grid (both sides are read box by box on it, whatever ``b``'s grid is).
        differing_chunks: how many of them differ (``None`` only in reports made by older versions).

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> arrayckpt.save({"w": torch.ones(4)}, os.path.join(d, "a"))
        >>> arrayckpt.save({"w": torch.tensor([1.0, 1.0, 1.5, 1.0])}, os.path.join(d, "b"))
        >>> t = arrayckpt.diff(os.path.join(d, "a"), os.path.join(d, "b")).tensors[0]
        >>> t.key, t.differing_elements, t.max_abs, round(t.max_rel, 3)
        ('w', 1, 0.5, 0.333)
    """

    key: str
    differing_elements: int
    max_abs: float
    max_rel: float
    nonfinite: int
    chunks: int
    differing_chunks: int | None

    def to_dict(self) -> JSON:
        return dict(self.__dict__)


@dataclass(frozen=True)
class DiffReport:
    """What differs between checkpoints ``a`` and ``b``, as :func:`diff` returns it; ``identical`` when nothing does.

    Attributes:
        a: the first checkpoint.
        b: the second.
        only_in_a: keys only ``a`` has.
        only_in_b: keys only ``b`` has.
        changed: key -> how its dtype, shape or kind changed (``"tensor float32[4, 3] -> tensor bfloat16[4, 3]"``).
        tensors: every common tensor, identical ones included.
        values: the plain values that differ: key -> (in ``a``, in ``b``).

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> arrayckpt.save({"w": torch.zeros(2), "x": torch.zeros(1)}, os.path.join(d, "a"))
        >>> arrayckpt.save({"w": torch.zeros(2, dtype=torch.bfloat16)}, os.path.join(d, "b"))
        >>> r = arrayckpt.diff(os.path.join(d, "a"), os.path.join(d, "b"))
        >>> r.identical, r.only_in_a, r.changed
        (False, ('x',), {'w': 'tensor float32[2] -> tensor bfloat16[2]'})
    """

    a: str
    b: str
    only_in_a: tuple[str, ...] = ()
    only_in_b: tuple[str, ...] = ()
    changed: dict[str, str] = field(default_factory=dict)
    tensors: tuple[TensorDiff, ...] = ()
    values: dict[str, tuple[object, object]] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.changed or self.values
                    or any(t.differing_elements for t in self.tensors))

    def to_dict(self) -> JSON:
        return {"a": self.a, "b": self.b, "identical": self.identical, "only_in_a": list(self.only_in_a),
                "only_in_b": list(self.only_in_b), "changed": self.changed,
                "tensors": {t.key: t.to_dict() for t in self.tensors},
                "values": {k: {"a": a, "b": b} for k, (a, b) in self.values.items()}}


def diff(a: str | os.PathLike[str] | Checkpoint, b: str | os.PathLike[str] | Checkpoint) -> DiffReport:
    """Compare two checkpoints: keys only in one, changed dtypes/shapes/kinds, tensor and value differences.

    Tensors are compared chunk by chunk (memory stays bounded); differences are bitwise, so NaN == NaN and
    -0.0 != +0.0. An alias (tied weights, stored once) is compared as the tensor it names, so a checkpoint of a
    tied model and one of the same weights untied are identical.

    Args:
        a: a checkpoint's directory or URL, or an open :class:`Checkpoint`.
        b: the other.

    Returns:
        What differs.

    Raises:
        CheckpointNotFoundError: nothing is at ``a`` or ``b``.
        CorruptCheckpointError: stored bytes of either are damaged.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> arrayckpt.save({"w": torch.zeros(4), "step": 1}, os.path.join(d, "a"))
        >>> arrayckpt.save({"w": torch.tensor([0.0, 0.5, 0.0, 0.0]), "step": 2}, os.path.join(d, "b"))
        >>> r = arrayckpt.diff(os.path.join(d, "a"), os.path.join(d, "b"))
        >>> r.tensors[0].differing_elements, r.tensors[0].max_abs, r.values
        (1, 0.5, {'step': (1, 2)})
    """
    with opened(a) as left, opened(b) as right:  # Checkpoints passed in stay open
        return _diff(left, right)


def _diff(left: Checkpoint, right: Checkpoint) -> DiffReport:
    ea, eb = _resolved(left), _resolved(right)
    changed: dict[str, str] = {}
    tensors: list[TensorDiff] = []
    values: dict[str, tuple[object, object]] = {}
    compared: dict[tuple[str, str], TensorDiff] = {}  # by the arrays compared: tied keys are compared once
    for key in (k for k in ea if k in eb):
        da, db = _describe(ea[key]), _describe(eb[key])
        if da != db and not (isinstance(ea[key], ValueEntry) and isinstance(eb[key], ValueEntry)):
            changed[key] = f"{da} -> {db}"
        elif isinstance(ea[key], ArrayEntry):
            pair = (ea[key].key, eb[key].key)
            if pair not in compared:
                compared[pair] = _diff_tensor(left, right, key)
            tensors.append(dataclasses.replace(compared[pair], key=key))
        elif isinstance(ea[key], ValueEntry) and ea[key].value != eb[key].value:  # type: ignore[union-attr]
            values[key] = (left.plain_values[key], right.plain_values[key])
        elif isinstance(ea[key], PerRankEntry) and not _same_per_rank(left, right, key):
            values[key] = ("per-rank values of a", "per-rank values of b")
        elif isinstance(ea[key], PickleEntry) and not _same_pickle(left, right, key):
            values[key] = ("pickled value of a", "pickled value of b")
    return DiffReport(str(left.location), str(right.location), tuple(k for k in ea if k not in eb),
                      tuple(k for k in eb if k not in ea), changed, tuple(tensors), values)


def _resolved(checkpoint: Checkpoint) -> dict[str, Entry]:
    """The checkpoint's entries with every alias replaced by the tensor entry it names (whose ``key`` is the
    target's)."""
    return {key: checkpoint.manifest.array_entry(key) or entry if isinstance(entry, AliasEntry) else entry
            for key, entry in checkpoint.manifest.entries.items()}


def _describe(entry: Entry) -> str:
    if isinstance(entry, ArrayEntry):
        return f"{entry.kind} {entry.dtype.name}{list(entry.shape)}"
    if isinstance(entry, PickleEntry):
        return "pickled value"
    if isinstance(entry, PerRankEntry):
        return f"per-rank value ({len(entry.items)} ranks)"
    return "value"


def _diff_tensor(left: Checkpoint, right: Checkpoint, key: str) -> TensorDiff:
    """Compare one tensor chunk by chunk (``a``'s grid), reading both sides' boxes in bounded batches."""
    # chunk by chunk on a's grid (of the array a stores, or of its base's for a delta), through both chains
    dense_a = dense_metadata(stored_of(left), key)
    differing = nonfinite = chunks = differing_chunks = 0
    max_abs = max_rel = 0.0
    batch: list[ChunkRef] = []

    def compare_batch() -> None:
        nonlocal differing, nonfinite, differing_chunks, max_abs, max_rel
        boxes = [Box(tuple(s.start for s in c.index), c.shape) for c in batch]
        mine, theirs = read_boxes(stored_of(left), key, boxes), read_boxes(stored_of(right), key, boxes)
        for x, y in zip(mine, theirs, strict=True):
            count, worst_abs, worst_rel, bad = _compare(x, y)
            differing += count
            nonfinite += bad
            differing_chunks += bool(count)
            max_abs, max_rel = max(max_abs, worst_abs), max(max_rel, worst_rel)
        batch.clear()

    held = 0
    for chunk in iter_chunks(key, left[key].entry.path, {"metadata": dense_a}):
        chunks += 1
        batch.append(chunk)
        held += chunk.nbytes
        if held >= settings().inspect_block_bytes or len(batch) >= BLOCK_CHUNKS:  # tiny chunks: bounded by count too
            compare_batch()
            held = 0
    if batch:
        compare_batch()
    return TensorDiff(key, differing, max_abs, max_rel, nonfinite, chunks, differing_chunks)


def _compare(x: np.ndarray, y: np.ndarray) -> tuple[int, float, float, int]:
    """(elements whose bits differ, max abs diff, max rel diff, differing elements that are NaN/inf)."""
    itemsize = x.dtype.itemsize
    if itemsize in (1, 2, 4, 8):
        mask = x.view(f"u{itemsize}") != y.view(f"u{itemsize}")
    else:
        mask = (x.reshape(-1).view(np.uint8).reshape(-1, itemsize)
                != y.reshape(-1).view(np.uint8).reshape(-1, itemsize)).any(axis=1).reshape(x.shape)
    count = int(mask.sum())
    if not count:
        return 0, 0.0, 0.0, 0
    wide = np.complex128 if x.dtype.kind == "c" else np.float64
    xs, ys = x[mask].astype(wide), y[mask].astype(wide)
    delta = np.abs(xs - ys)
    finite = np.isfinite(delta)
    delta, scale = delta[finite], np.maximum(np.abs(xs[finite]), np.abs(ys[finite]))
    worst_abs = float(delta.max()) if delta.size else 0.0
    rel = np.divide(delta, scale, out=np.zeros_like(delta), where=scale > 0)
    return count, worst_abs, float(rel.max()) if rel.size else 0.0, int((~finite).sum())


def _same_per_rank(left: Checkpoint, right: Checkpoint, key: str) -> bool:
    xs, ys = left.per_rank(key), right.per_rank(key)
    return len(xs) == len(ys) and all(_same_value(x, y) for x, y in zip(xs, ys, strict=True))


def _same_value(x: object, y: object) -> bool:
    """Plain values by equality, arrays and tensors by dtype, shape and bytes."""
    import torch

    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(
            x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8))
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
        return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()
    return type(x) is type(y) and bool(x == y)


def _same_pickle(left: Checkpoint, right: Checkpoint, key: str) -> bool:
    """Pickled values compared as stored bytes (never unpickled)."""
    return stored_of(left).pickle_bytes(key) == stored_of(right).pickle_bytes(key)
