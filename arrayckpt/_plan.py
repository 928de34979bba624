"""Planning: each array's chunk grid and its complete Zarr v3 metadata, computed without IO.

The chunk grid follows the rank shards (with one process the whole tensor is one shard). Within a
shard, the outer chunk is the write unit (one file, one storage request) and the inner chunk, through
Zarr's ``sharding_indexed`` codec, is the read unit, so a slice read fetches only the inner chunks it
touches. Outer chunks are whole multiples of inner chunks along the split dimension, as the sharding
codec requires.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ._codecs import Codec, codec_pipeline, sharded_pipeline
from ._dtypes import DType

__all__ = ["ArrayPlan", "INNER_CHUNK_BYTES", "OUTER_CHUNK_BYTES", "array_metadata", "choose_chunks", "plan_array"]

INNER_CHUNK_BYTES = 4 << 20  # read unit: small enough for cheap reshard reads, big enough for throughput
OUTER_CHUNK_BYTES = 64 << 20  # write unit: one file per outer chunk; several per big tensor for parallelism


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


def choose_chunks(shape: tuple[int, ...], itemsize: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(outer, inner) chunk shapes for a tensor held whole by one writer.

    The inner chunk comes first; the outer chunk is the largest multiple of it, dimension by
    dimension, that stays within :data:`OUTER_CHUNK_BYTES`.
    """
    inner = _split(shape, itemsize, INNER_CHUNK_BYTES)
    counts = [math.ceil(max(1, n) / c) for n, c in zip(shape, inner, strict=True)]
    grouped = _split(tuple(counts), itemsize * math.prod(inner), OUTER_CHUNK_BYTES)
    # An outer chunk may reach past the array's edge (Zarr allows partial edge chunks); it must stay a
    # whole multiple of the inner chunk for the sharding codec.
    return tuple(g * c for g, c in zip(grouped, inner, strict=True)), inner


def plan_array(key: str, path: str, dtype: DType, shape: tuple[int, ...], codec: Codec) -> ArrayPlan:
    """Plan one array written whole by one process."""
    outer, inner = choose_chunks(shape, dtype.itemsize)
    return ArrayPlan(key, path, dtype, shape, outer, inner, codec)


def array_metadata(plan: ArrayPlan) -> dict[str, Any]:
    """The array's ``zarr.json`` document (also stored in the root's consolidated metadata)."""
    chunk_codecs = codec_pipeline(plan.codec, plan.dtype.itemsize)
    codecs = sharded_pipeline(list(plan.inner_chunk), chunk_codecs) if plan.sharded else chunk_codecs
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(plan.shape),
        "data_type": plan.dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(plan.outer_chunk)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": plan.dtype.fill_value,
        "codecs": codecs,
        "attributes": {"arrayckpt": {"key": plan.key}},
    }
