"""``report``: a picture of a checkpoint, as one self-contained HTML file (``arrayckpt report CKPT -o report.html``).

It shows the state as a tree of sizes (a treemap of bytes by key prefix, and bytes by dtype), statistics of every
tensor (min, max, mean, std, fraction of zeros, NaN and inf counts, flagged in red), value histograms of the
largest tensors, the chunk grids of the largest tensors, the delta chain of a delta checkpoint (stored bytes per
layer, and which chunks or rows each tensor stores), and, against another checkpoint, the relative change
``||a - b|| / ||b||`` of every tensor, as a sorted bar chart and a heat map of layers (keys such as
``model.layers.3.attn.q.weight``, ``h.3.`` or ``blocks.3.``).

Memory stays bounded whatever the tensor sizes: every tensor is read in the blocks ``show`` reads
(``inspect.selection_blocks``, about ``inspect_block_bytes`` each), its statistics are accumulated exactly as ``show``
accumulates them (so the numbers are ``show``'s), histograms are counts of a random sample of at most
``SAMPLE`` values per tensor, and the relative change is two sums of squares over the same blocks of both
checkpoints. Images are PNGs embedded as base64; nothing is fetched when the file is opened.

**Chunk grids are coloured by the rank that wrote each chunk**, from the manifest's ``created.writers`` (spec §4.2;
arrayckpt records it at every save with more than one rank), with a key from colour to rank above them (a colour bar
from 20 ranks on). In a delta checkpoint, the chunks its bases store are drawn lighter, in the colour of the rank that
wrote them there. Checkpoints without the record (written before it was recorded) are drawn with a colour per chunk,
and the report says the writers are not recorded.

What a report shows is a set of values (``data.py``); chunk grids, the chain and what a delta stores come
from metadata (``layout.py``); the HTML is written by ``page.py`` and the pictures drawn by
``figures.py`` and ``grids.py`` (the chunk pictures), in ``style.py``'s shared style
(matplotlib, an optional extra: ``pip install 'arrayckpt[report]'``); ``_cli/report.py`` is the command line.
"""

from __future__ import annotations

import math
import os
import re
import zlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from ..._errors import ArrayckptError
from ..._format.manifest import AliasEntry, ArrayEntry, PerRankEntry, PickleEntry, ValueEntry
from ..._format.values import decode_value
from ..._read.checkpoint import Checkpoint, LazyArray, opened
from ..inspect import _Stats, normalize_index, selection_blocks
from .data import Change, Histogram, ReportData, TensorStats, printable
from .layout import chain_of, deltas_of, grid_of, step_of, stored_text

__all__ = ["Written", "collect", "layer_of", "report", "write_report"]

SAMPLE = 1 << 16  # values sampled per tensor for its histogram (exact below this size)
BINS = 64  # histogram bins
HISTOGRAMS = 8  # histograms of the largest tensors
GRIDS = 6  # chunk grid pictures of the largest tensors (and delta pictures)
LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?=\.|$)")


def report(path: str | os.PathLike[str] | Checkpoint, *, against: str | os.PathLike[str] | Checkpoint | None = None,
           output: str | os.PathLike[str] = "report.html", overview: str | os.PathLike[str] | None = None,
           storage_options: Mapping[str, Any] | None = None, max_tensors: int | None = None,
           histograms: int = HISTOGRAMS, grids: int = GRIDS,
           base_roots: Sequence[str | os.PathLike[str]] | None = None) -> Path:
    """Write a self-contained HTML report of checkpoint ``path`` to ``output`` and return its path.

    Needs matplotlib (``pip install 'arrayckpt[report]'``); reads every tensor once (twice with ``against``) in
    bounded memory.

    Args:
        path: a checkpoint's directory or URL, or an open :class:`Checkpoint`.
        against: another checkpoint; the report then ranks the tensors by their relative change
            ``||path - against|| / ||against||`` and maps it over layers.
        output: the HTML file to write.
        overview: also write the main pictures as one PNG, here.
        storage_options: for object storage, as for :func:`arrayckpt.save`.
        max_tensors: compute statistics for the largest so many tensors only (default: all).
        histograms: how many of the largest tensors get a histogram.
        grids: how many of the largest tensors get a chunk-grid picture.
        base_roots: where a delta's bases may be besides the directory holding it (as for :func:`arrayckpt.open`).

    Returns:
        The path of the HTML file written.

    Raises:
        ValueError: a negative ``max_tensors``, ``histograms`` or ``grids``.
        ModuleNotFoundError: matplotlib is not installed.
        CheckpointNotFoundError: nothing is at ``path`` (or ``against``).

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> arrayckpt.save({"model.w": torch.ones(4, 3), "step": 1}, os.path.join(d, "ckpt"))
        >>> report(os.path.join(d, "ckpt"), output=os.path.join(d, "ckpt.html"), histograms=0, grids=0).name
        'ckpt.html'
    """
    return write_report(path, against=against, output=output, overview=overview, storage_options=storage_options,
                        max_tensors=max_tensors, histograms=histograms, grids=grids, base_roots=base_roots).path


class Written(NamedTuple):
    """What :func:`write_report` wrote, and what it shows (``data.tensors[i].error``: a tensor it could not read)."""

    path: Path
    data: ReportData


def write_report(path: str | os.PathLike[str] | Checkpoint, *,
                 against: str | os.PathLike[str] | Checkpoint | None = None,
                 output: str | os.PathLike[str] = "report.html", overview: str | os.PathLike[str] | None = None,
                 storage_options: Mapping[str, Any] | None = None, max_tensors: int | None = None,
                 histograms: int = HISTOGRAMS, grids: int = GRIDS,
                 base_roots: Sequence[str | os.PathLike[str]] | None = None) -> Written:
    """:func:`report`, returning what the report shows too (the command line exits 1 when a tensor could not be
    read). Missing parent directories of ``output`` and ``overview`` are created, as ``save`` creates them."""
    from . import figures, page  # matplotlib: only here

    figures.require_matplotlib()
    def open_(source: str | os.PathLike[str] | Checkpoint) -> AbstractContextManager[Checkpoint]:
        return opened(source, storage_options=storage_options, base_roots=base_roots)

    with open_(path) as checkpoint, (nullcontext() if against is None else open_(against)) as other:
        data = collect(checkpoint, other, max_tensors=max_tensors, histograms=histograms, grids=grids)
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(printable(page.render(data, figures.figures(data))).encode("utf-8"))
    if overview is not None:
        Path(overview).parent.mkdir(parents=True, exist_ok=True)
        figures.overview(data, overview)
    return Written(out, data)


def collect(checkpoint: Checkpoint, other: Checkpoint | None = None, *, max_tensors: int | None = None,
            histograms: int = HISTOGRAMS, grids: int = GRIDS) -> ReportData:
    """Read what a report shows from an open checkpoint (and ``other`` to compare with), in bounded memory."""
    for name, value in (("max_tensors", max_tensors), ("histograms", histograms), ("grids", grids)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    manifest = checkpoint.manifest
    data = ReportData(str(checkpoint.location), manifest.format_version, step_of(checkpoint),
                      dict(manifest.created), [], against=None if other is None else str(other.location))
    stored = [key for key, array in checkpoint.items() if array.key == key]  # not aliases: listed with the values
    by_size = sorted(stored, key=lambda k: -checkpoint[k].nbytes)  # largest first
    chosen = set(by_size if max_tensors is None else by_size[:max_tensors])
    sampled = set([k for k in by_size if k in chosen and _histogram_kind(checkpoint[k])][:histograms])
    for key in stored:
        array = checkpoint[key]
        if key not in chosen:
            data.tensors.append(TensorStats(key, array.entry.dtype.name, array.shape, array.nbytes, stored_text(array)))
            continue
        theirs = _partner(array, other, data.unmatched)
        stats, histogram, relative = _tensor_pass(array, theirs, key in sampled)
        data.tensors.append(stats)
        if histogram is not None:
            data.histograms.append(histogram)
        if relative is not None:
            data.changes.append(Change(key, relative, layer_of(key)))
    rank = {key: i for i, key in enumerate(by_size)}
    data.histograms.sort(key=lambda h: rank[h.key])
    data.changes.sort(key=lambda c: (-c.relative if not math.isnan(c.relative) else -math.inf, c.key))
    if other is not None:
        data.unmatched += [(k, "only in the other checkpoint") for k in other if k not in checkpoint]
    data.grids = [grid for grid in (grid_of(checkpoint, k) for k in by_size) if grid is not None][:grids]
    if manifest.base is not None:
        data.chain = chain_of(checkpoint)
        data.deltas = deltas_of(checkpoint, grids)
    data.values = [(key, _describe_value(checkpoint, entry)) for key, entry in manifest.entries.items()
                   if not isinstance(entry, ArrayEntry)]
    return data


def layer_of(key: str) -> tuple[str, int] | None:
    """The row and column of a key in the layer heat map: ``model.layers.3.attn.weight`` ->
    ``("model.layers.*.attn.weight", 3)``; ``None`` for a key with no layer number.

    >>> layer_of("transformer.h.11.mlp.c_fc.weight"), layer_of("lm_head.weight")
    (('transformer.h.*.mlp.c_fc.weight', 11), None)
    """
    match = LAYER.search(key)
    if match is None:
        return None
    return key[:match.start(1)] + "*" + key[match.end(1):], int(match[1])


def _histogram_kind(array: LazyArray) -> bool:
    return array.size > 0 and array.entry.dtype.numpy.kind != "b"


def _partner(array: LazyArray, other: Checkpoint | None, unmatched: list[tuple[str, str]]) -> LazyArray | None:
    """The same tensor in ``other``, when it is there with the same shape (else why not, in ``unmatched``)."""
    if other is None:
        return None
    if array.key not in other:
        unmatched.append((array.key, "not in the other checkpoint"))
        return None
    theirs = other[array.key]
    if theirs.shape != array.shape:
        unmatched.append((array.key, f"shape {list(array.shape)} here, {list(theirs.shape)} in the other checkpoint"))
        return None
    return theirs


def _tensor_pass(array: LazyArray, theirs: LazyArray | None,
                 sample: bool) -> tuple[TensorStats, Histogram | None, float | None]:
    """One streaming pass over a tensor (and the same blocks of ``theirs``): ``show``'s statistics, zeros, a
    bounded sample for the histogram, and the sums of squares of the relative change."""
    entry = array.entry
    base = TensorStats(entry.key, entry.dtype.name, array.shape, array.nbytes, stored_text(array), computed=True)
    stats, zeros, parts = _Stats(), 0, []
    moved = norm = 0.0
    nonfinite_changed = 0
    rng = np.random.default_rng(zlib.crc32(entry.key.encode()))
    total = array.size
    try:
        for block in selection_blocks(normalize_index((), array.shape, entry.key), entry.dtype.itemsize):
            data = array[block]
            stats.add(data)
            zeros += int(np.count_nonzero(data == 0))
            if sample and data.size:
                take = data.size if total <= SAMPLE else max(1, round(data.size * SAMPLE / total))
                flat = data.reshape(-1)
                parts.append(_magnitudes(flat if take >= data.size else flat[rng.integers(0, data.size, take)]))
            if theirs is not None:
                a, b = _magnitudes(data, signed=True), _magnitudes(theirs[block], signed=True)
                finite = np.isfinite(a) & np.isfinite(b)
                if not finite.all():  # NaN and inf where they were are no change; anywhere else they are
                    same = (a == b) | (np.isnan(a) & np.isnan(b))
                    nonfinite_changed += int(np.count_nonzero(~finite & ~same))
                    a, b = a[finite], b[finite]
                a -= b
                moved += float(np.vdot(a, a).real)
                norm += float(np.vdot(b, b).real)
    except ArrayckptError as e:  # damaged or unreadable: the report says so and goes on
        broken = TensorStats(entry.key, entry.dtype.name, array.shape, array.nbytes, base.stored, error=str(e))
        return broken, None, None
    std = math.sqrt(stats.m2 / stats.count) if stats.count else None
    result = TensorStats(entry.key, entry.dtype.name, array.shape, array.nbytes, base.stored, True,
                         stats.count + stats.nan + stats.inf, stats.nan, stats.inf, zeros, stats.min, stats.max,
                         stats.mean if stats.count else None, std)
    histogram = None
    if parts and stats.count:
        values = np.concatenate(parts)
        values = values[np.isfinite(values)]
        assert stats.min is not None and stats.max is not None  # set by every block counted
        low, high = float(stats.min), float(stats.max)
        if entry.dtype.numpy.kind == "c":
            low, high = float(values.min(initial=0.0)), float(values.max(initial=0.0))
        counts, edges = np.histogram(values, bins=BINS, range=(low, high) if high > low else (low - 0.5, low + 0.5))
        histogram = Histogram(entry.key, counts, edges, int(values.size), stats.count)
    relative = None
    if theirs is not None and nonfinite_changed:
        relative = math.nan
    elif theirs is not None:
        relative = (math.sqrt(moved) / math.sqrt(norm)) if norm > 0 else (0.0 if moved == 0 else math.inf)
    return result, histogram, relative


def _magnitudes(values: np.ndarray, signed: bool = False) -> np.ndarray:
    """float64 values (complex as magnitudes, unless ``signed``: then complex128) of any stored dtype."""
    if values.dtype.kind == "c":
        return values.astype(np.complex128) if signed else np.abs(values.astype(np.complex128))
    return values.astype(np.float64)


def _describe_value(checkpoint: Checkpoint, entry: Any) -> str:
    """A short text for a plain value, a pickled value (never unpickled), a per-rank entry or an alias."""
    if isinstance(entry, AliasEntry):
        return f"alias of tensor {entry.target} (one tensor saved under both keys, e.g. tied weights: stored once)"
    if isinstance(entry, PickleEntry):
        return f"pickled value, {entry.nbytes} bytes (not unpickled)"
    if isinstance(entry, PerRankEntry):
        held = sum(item is not None for item in entry.items)
        return f"per-rank value, held by {held} of {len(entry.items)} ranks"
    assert isinstance(entry, ValueEntry)
    try:
        text = repr(decode_value(entry.value, entry.key))
    except ArrayckptError as e:
        return f"unreadable: {e}"
    return text if len(text) <= 200 else text[:197] + "..."
