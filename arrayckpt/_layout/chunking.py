"""Planning: each array's chunk grid and its complete Zarr v3 metadata, computed without IO.

The chunk grid follows the rank shards (with one process the whole tensor is one shard). Within a
shard, the outer chunk is the write unit (one file, one storage request) and the inner chunk, through
Zarr's ``sharding_indexed`` codec, is the read unit, so a slice read fetches only the inner chunks it
touches. Outer chunks are whole multiples of inner chunks along the split dimension, as the sharding
codec requires.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from .._errors import StateError
from .._format.codecs import Codec, codec_pipeline, sharded_pipeline
from .._format.dtypes import DType
from .._format.jsontypes import JSON
from .._format.zarr import check_grid
from .._format.zarr import dimension_names as default_dimension_names
from .._layout.box import Box

__all__ = [
    "DEFAULT_CHUNKING",
    "ArrayPlan",
    "ChunkPolicy",
    "array_metadata",
    "choose_chunks",
    "plan_array",
    "shard_grid",
]

CHUNK_KEY_SEPARATOR = "."  # chunk files "c.0.1" beside zarr.json: no directory per chunk row


@dataclass(frozen=True)
class ChunkPolicy:
    """The chunk sizes a save aims at (spec/FORMAT.md §7.3: ``INNER``, ``OUTER``, ``MIN_INNER``, ``MIN_SPLIT_INNER``,
    ``FRAGMENTATION``, ``SMALLEST``; §10.4 for the row arrays of a delta). Part of the planner's input, like
    the codec: the public ``save`` plans with :data:`DEFAULT_CHUNKING`; tests pass tiny targets so that
    small tensors get the layout big ones get."""

    inner_chunk_bytes: int = 4 << 20  # read unit: small enough for cheap reshard reads, big enough for throughput
    outer_chunk_bytes: int = 64 << 20  # write unit: one file per outer chunk; several per big tensor (parallelism)
    min_inner_chunk_bytes: int = 256 << 10  # smaller read units cost more in index entries and calls than they save
    # ... except in arrays split across ranks: a load at another world size reads parts of their shards (a 4->3
    # reshard of 1-4 MiB shards reads 1.04x what it needs with 64 KiB inner chunks, 1.12x with 256 KiB)
    min_split_inner_chunk_bytes: int = 64 << 10
    inner_chunks_per_shard: int = 16  # a shard read at another sharding fetches at most ~2/16 of a shard too much
    # Chunks forced (by awkward shard steps) 16x below their target and under 32 KiB cost more than they help.
    fragmentation_limit: int = 16
    smallest_chunk_bytes: int = 32 << 10
    row_chunk_bytes: int = 4 << 20  # chunks of a rows delta's arrays (row indices and values)
    # Replicated pieces this small are gathered on one writer (up to gather_rank_bytes each): every rank of a load
    # reads all of them (AdamW's 0-d steps), in one ranged read of one pack rather than one per writer's pack.
    gather_piece_bytes: int = 64 << 10
    gather_rank_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ChunkPolicy.{name} must be a positive int, got {value!r}")


DEFAULT_CHUNKING = ChunkPolicy()


@dataclass(frozen=True)
class ArrayPlan:
    """Where and how one array is stored."""

    key: str
    path: str
    dtype: DType
    shape: tuple[int, ...]
    outer_chunk: tuple[int, ...]
    inner_chunk: tuple[int, ...]
    codec: Codec
    key_encoding: str = "default"  # "v2" only where a save must not reuse the chunk keys of the one it replaces
    dimension_names: tuple[str, ...] | None = None  # None: the default names of the path (``_format.zarr``)
    aliases: tuple[str, ...] = ()  # other keys of this tensor (tied weights), listed in its attributes for Zarr readers

    def __post_init__(self) -> None:
        """Never plan a grid readers refuse (spec §12): whatever chose the chunks (the planner's fallback of one
        chunk per shard when shard boundaries have no common divisor near the target, a delta on its base's grid,
        a tiny ``ChunkPolicy``), the save fails before anything is written."""
        problem = check_grid(self.shape, self.outer_chunk, self.inner_chunk if self.sharded else None)
        if problem is not None:
            raise StateError(f"tensor {self.key!r} of shape {list(self.shape)}: {problem}, which readers refuse; "
                             f"this layout (chunks of {list(self.inner_chunk)}) cannot be saved: shard the tensor so "
                             "that the ranks' boundaries have a common divisor near the chunk size (e.g. "
                             "torch.chunk-style even splits), or save it with larger chunks")

    @cached_property
    def metadata(self) -> JSON:
        """The array's ``zarr.json`` document (computed once; see :func:`array_metadata`)."""
        return array_metadata(self)

    @property
    def sharded(self) -> bool:
        """Whether inner chunks are packed into outer chunks (only when there is more than one)."""
        return self.inner_chunk != self.outer_chunk


def _split(shape: tuple[int, ...], itemsize: int, target: int) -> tuple[int, ...]:
    """Chunk shape of at most ``target`` bytes, splitting the leading dimensions first.

    Dimension ``d`` is cut into equal pieces when one index along it (all later dimensions whole)
    fits the target; otherwise it is cut to 1 and the next dimension is split.
    """
    chunk = [max(1, n) for n in shape]
    for d in range(len(shape)):
        unit = itemsize * math.prod(chunk[d + 1 :])
        if unit * chunk[d] <= target:
            break
        if unit <= target:
            pieces = math.ceil(chunk[d] * unit / target)
            chunk[d] = min(math.ceil(chunk[d] / pieces), target // unit)  # balanced, never over target
            break
        chunk[d] = 1
    return tuple(chunk)


def shard_grid(shape: tuple[int, ...], boxes: Iterable[Box]) -> tuple[int | None, ...]:
    """Per dimension, the step every shard boundary is a multiple of (``None``: the dimension is not split).

    ``torch.chunk``-style splits (DTensor ``Shard(d)``) have boundaries at multiples of
    ``ceil(n / parts)``, so the step is that size even when the last shard is short (7 rows over 3 ranks:
    boundaries 3 and 6, step 3). Arbitrary offsets give the greatest common divisor of the boundaries.
    """
    interior: list[set[int]] = [set() for _ in shape]
    for box in boxes:
        for d, (start, stop) in enumerate(zip(box.offset, box.stop, strict=True)):
            interior[d].update(b for b in (start, stop) if 0 < b < shape[d])
    return tuple(math.gcd(*bounds) if bounds else None for bounds in interior)


def _largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is ``<= limit`` (at least 1)."""
    best = 1
    for small in range(1, math.isqrt(n) + 1):
        if n % small == 0:
            for d in (small, n // small):
                if best < d <= limit:
                    best = d
    return best


def _fit(chunk: tuple[int, ...], steps: tuple[int | None, ...]) -> tuple[int, ...]:
    """Shrink each chunk extent to a divisor of its dimension's shard step, so chunks never straddle shards."""
    return tuple(c if s is None else _largest_divisor_at_most(s, c) for c, s in zip(chunk, steps, strict=True))


def _fragmented(fitted: tuple[int, ...], wanted: tuple[int, ...], itemsize: int, policy: ChunkPolicy) -> bool:
    """Whether fitting to the shard steps left chunks far smaller than wanted and absolutely small."""
    size = itemsize * math.prod(fitted)
    return size * policy.fragmentation_limit < itemsize * math.prod(wanted) and size < policy.smallest_chunk_bytes


def choose_chunks(
    shape: tuple[int, ...], itemsize: int, steps: tuple[int | None, ...] | None = None,
    policy: ChunkPolicy = DEFAULT_CHUNKING,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(outer, inner) chunk shapes; with ``steps`` (see :func:`shard_grid`) outer chunks tile every shard.

    The inner chunk comes first, about ``policy.inner_chunk_bytes``; the outer chunk is the largest
    multiple of it, dimension by dimension, within ``policy.outer_chunk_bytes`` and within one shard.
    When shard steps have no divisor near the target (a prime number of rows per rank), inner chunks
    would be tiny, so the layout falls back to unsharded chunks the size of the outer target.
    """
    steps = steps or (None,) * len(shape)
    cell = tuple(s or max(1, n) for s, n in zip(steps, shape, strict=True))
    # Inner chunks of ~1/16 of a shard (within [min_inner_chunk_bytes, inner_chunk_bytes]), so that a
    # load at another sharding reads little more than it needs, even when shards are small.
    shard_bytes = itemsize * math.prod(cell)
    smallest = policy.min_inner_chunk_bytes if all(s is None for s in steps) else policy.min_split_inner_chunk_bytes
    inner_target = min(policy.inner_chunk_bytes, max(smallest, shard_bytes // policy.inner_chunks_per_shard))
    wanted = _split(cell, itemsize, inner_target)
    inner = _fit(wanted, steps)
    if _fragmented(inner, wanted, itemsize, policy):
        wanted_outer = _split(cell, itemsize, policy.outer_chunk_bytes)
        outer = _fit(wanted_outer, steps)
        if _fragmented(outer, wanted_outer, itemsize, policy):
            outer = cell  # no useful divisor at all (a prime step): one chunk per shard, however big
        return outer, outer
    counts = [math.ceil(c / i) for c, i in zip(cell, inner, strict=True)]
    grouped = _fit(_split(tuple(counts), itemsize * math.prod(inner), policy.outer_chunk_bytes),
                   tuple(None if s is None else cnt for s, cnt in zip(steps, counts, strict=True)))
    # An outer chunk may reach past the array's edge (Zarr allows partial edge chunks); it must stay a
    # whole multiple of the inner chunk for the sharding codec.
    return tuple(g * c for g, c in zip(grouped, inner, strict=True)), inner


def plan_array(key: str, path: str, dtype: DType, shape: tuple[int, ...], codec: Codec,
               policy: ChunkPolicy = DEFAULT_CHUNKING) -> ArrayPlan:
    """Plan one array written whole by one process."""
    outer, inner = choose_chunks(shape, dtype.itemsize, None, policy)
    return ArrayPlan(key, path, dtype, shape, outer, inner, codec)


def array_metadata(plan: ArrayPlan) -> JSON:
    """The array's ``zarr.json`` document (also stored in the root's consolidated metadata)."""
    chunk_codecs = codec_pipeline(plan.codec, plan.dtype.itemsize)
    codecs = sharded_pipeline(list(plan.inner_chunk), chunk_codecs) if plan.sharded else chunk_codecs
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(plan.shape),
        "dimension_names": list(plan.dimension_names or default_dimension_names(plan.path, len(plan.shape))),
        "data_type": plan.dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(plan.outer_chunk)}},
        "chunk_key_encoding": {"name": plan.key_encoding, "configuration": {"separator": CHUNK_KEY_SEPARATOR}},
        "fill_value": plan.dtype.fill_value,
        "codecs": codecs,
        "attributes": {"arrayckpt": {"key": plan.key, **({"aliases": list(plan.aliases)} if plan.aliases else {})}},
    }
