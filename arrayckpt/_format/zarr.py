"""Zarr v3 metadata as arrayckpt writes and checks it: node documents, chunk grids, chunk keys.

Every array and intermediate group has its own ``zarr.json`` (Zarr v3 has no implicit groups), and the root's
consolidated metadata holds a copy of each, listed in the order zarr-python needs (:func:`node_documents`).
Every array names its dimensions (:func:`dimension_names`). Readers validate an array's metadata before acting
on it (:func:`check_array_metadata`); chunk keys follow Zarr's ``default`` or ``v2`` encodings.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from .._errors import FormatError
from .dtypes import dtype_by_name
from .jsontypes import JSON, int_list, json_object, member

__all__ = ["GROUP_METADATA", "KEY_ENCODINGS", "MAX_GRID_CHUNKS", "ROOT_METADATA", "array_shape", "check_array_metadata",
           "check_grid", "chunk_key", "chunk_keys", "dimension_names", "grid_counts", "grid_indices", "node_documents",
           "outer_chunk_shape", "parse_chunk_key", "read_chunk_shape", "unravel"]

ROOT_METADATA = "zarr.json"  # the metadata document of every Zarr v3 node; the root's is the commit


def _group_paths(array_paths: list[str]) -> list[str]:
    """Every intermediate group path above the given arrays (Zarr v3 has no implicit groups)."""
    groups: set[str] = set()
    for path in array_paths:
        segments = path.split("/")
        groups.update("/".join(segments[:i]) for i in range(1, len(segments)))
    return sorted(groups)


GROUP_METADATA: JSON = {"zarr_format": 3, "node_type": "group", "attributes": {}}


def _node_order(path: str) -> tuple[int, str]:
    return path.count("/"), path


def node_documents(arrays: Mapping[str, JSON]) -> dict[str, JSON]:
    """``zarr.json`` documents for every array and every intermediate group, by path, in the order of the root's
    consolidated metadata (spec §8): by depth, then by path. zarr-python 3 (``ConsolidatedMetadata._flat_to_nested``)
    sorts the nodes by depth, keeping their order within a depth, and takes each run of consecutive nodes with
    the same parent as that parent's *only* members: the members of one group must be listed together, which
    sorting by path within a depth ensures (every path below ``g/`` sorts between ``g/`` and the next group)."""
    nodes: dict[str, JSON] = {path: GROUP_METADATA for path in _group_paths(list(arrays))}
    nodes.update(arrays)
    return {path: nodes[path] for path in sorted(nodes, key=_node_order)}


def dimension_names(path: str, ndim: int) -> list[str]:
    """The ``dimension_names`` arrayckpt writes for the array at ``path`` (spec §7.2): ``<dotted path>.dim_<i>``,
    unique in the whole checkpoint, so that xarray opens any group, and the whole tree, without two arrays ever
    sharing a dimension of different lengths (``model/w`` -> ``["model.w.dim_0", "model.w.dim_1"]``)."""
    prefix = path.replace("/", ".")
    return [f"{prefix}.dim_{i}" for i in range(ndim)]


def _positive_ints(value: object, length: int) -> bool:
    return isinstance(value, list) and len(value) == length and all(
        isinstance(n, int) and not isinstance(n, bool) and 0 < n < 2**62 for n in value)


def check_array_metadata(metadata: object, shape: tuple[int, ...], data_type: str, where: str) -> JSON:
    """Validate one array's (consolidated) metadata before anything acts on it: the fields arrayckpt relies
    on must have the right types and agree with the manifest; codecs are checked by the reader."""
    def bad(what: str) -> FormatError:
        return FormatError(f"{where}: array metadata {what}")

    if not isinstance(metadata, dict) or metadata.get("node_type") != "array" or metadata.get("zarr_format") != 3:
        raise bad("is missing or not a Zarr v3 array")
    if metadata.get("data_type") != data_type:
        raise bad(f"data_type {metadata.get('data_type')!r} does not match the manifest's {data_type!r}")
    if metadata.get("shape") != list(shape):
        raise bad(f"shape {metadata.get('shape')!r} does not match the manifest's {list(shape)}")
    grid = metadata.get("chunk_grid")
    if not (isinstance(grid, dict) and grid.get("name") == "regular" and isinstance(grid.get("configuration"), dict)
            and _positive_ints(grid["configuration"].get("chunk_shape"), len(shape))):
        raise bad(f"chunk_grid {grid!r} is not a regular grid of positive chunk extents, one per dimension")
    encoding = metadata.get("chunk_key_encoding")
    if not (isinstance(encoding, dict) and encoding.get("name") in KEY_ENCODINGS
            and isinstance(encoding.get("configuration", {}), dict)
            and _separator(encoding) in ("/", ".")):
        raise bad(f"chunk_key_encoding {encoding!r} is not the 'default' or 'v2' encoding with '/' or '.'")
    _check_dimension_names(metadata, len(shape), bad)
    codecs = metadata.get("codecs")
    if not isinstance(codecs, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in codecs):
        raise bad(f"codecs {codecs!r} are not a list of codec objects")
    outer, inner = grid["configuration"]["chunk_shape"], None
    if codecs and codecs[0].get("name") == "sharding_indexed":
        config = codecs[0].get("configuration")
        if not (isinstance(config, dict) and _positive_ints(config.get("chunk_shape"), len(shape))
                and all(o % i == 0 for o, i in zip(outer, config["chunk_shape"], strict=True))):
            raise bad(f"sharding configuration {config!r} has inner chunks that do not divide the outer chunks")
        inner = config["chunk_shape"]
    _check_chunk_sizes(outer, inner, shape, data_type, bad)
    problem = check_grid(shape, outer, inner)
    if problem is not None:
        raise bad(f"{problem}; the metadata is damaged or crafted")
    return metadata


def _check_dimension_names(metadata: JSON, ndim: int, bad: Callable[[str], FormatError]) -> None:
    """``dimension_names`` is optional (format versions 1 and 2 lack it); when present it is a list of one string
    or null per dimension, no non-empty name twice (TensorStore cannot open an array whose names repeat)."""
    if "dimension_names" not in metadata:
        return
    names = metadata["dimension_names"]
    if not (isinstance(names, list) and len(names) == ndim and all(n is None or isinstance(n, str) for n in names)):
        raise bad(f"dimension_names {names!r} are not a list of {ndim} strings or nulls, one per dimension")
    labels = [n for n in names if n]
    if len(set(labels)) != len(labels):
        raise bad(f"dimension_names {names!r} name a dimension twice")


# Chunks in one array's (outer) grid, and inner chunks in one outer chunk, at most (spec §12, "Limits"). Everything
# that walks a grid (verify, copy, compact, report) runs in time proportional to it, and a grid is described by a
# few bytes of metadata: without a limit, a 1 KB crafted checkpoint claims 2**26 chunks and more. No real checkpoint
# comes near: at the planner's chunk targets (64 MiB outer, at least 32 KiB inner) 2**24 chunks are a 1 PiB array,
# and 2**24 inner chunks (a 256 MiB shard index) would need 512 GiB outer chunks.
MAX_GRID_CHUNKS = 2**24


def check_grid(shape: tuple[int, ...] | list[int], outer: tuple[int, ...] | list[int],
               inner: tuple[int, ...] | list[int] | None = None) -> str | None:
    """Why an array's chunk grid is over :data:`MAX_GRID_CHUNKS` (``None``: it is not): its outer grid, or the
    inner chunks of one outer chunk. Readers refuse such metadata and writers never plan it."""
    counts = [-(-n // c) for n, c in zip(shape, outer, strict=True)]
    total = math.prod(counts)
    if total > MAX_GRID_CHUNKS:
        across = f" ({' x '.join(map(str, counts))})" if len(counts) > 1 else ""
        return (f"chunk grid of {total} chunks{across} exceeds the limit of {MAX_GRID_CHUNKS} chunks per array "
                "(spec §12)")
    per_outer = math.prod(o // i for o, i in zip(outer, inner, strict=True)) if inner else 1
    if per_outer > MAX_GRID_CHUNKS:
        return (f"{per_outer} inner chunks per outer chunk exceed the limit of {MAX_GRID_CHUNKS} (spec §12)")
    return None


def grid_indices(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    """Every index of the grid ``ranges`` spans, in C order, lazily: memory does not grow with the grid
    (``itertools.product`` first copies every range into a tuple: 2 GB for a range of 2**26; it is used only
    where that copy is small)."""
    if sum(len(r) for r in ranges) <= _SMALL_RANGES:
        return itertools.product(*ranges)
    return _lazy_product(ranges)


_SMALL_RANGES = 1 << 16  # ranges whose copy itertools.product may make (a few hundred KB)


def unravel(flat: int, counts: Sequence[int]) -> tuple[int, ...]:
    """The grid index at C-order position ``flat`` of a grid of ``counts`` chunks per dimension (a chunks delta
    records its chunks as such positions)."""
    index = []
    for n in reversed(counts):
        flat, i = divmod(flat, n)
        index.append(i)
    return tuple(reversed(index))


def _lazy_product(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    if len(ranges) == 1:
        for i in ranges[0]:
            yield (i,)
        return
    if any(len(r) == 0 for r in ranges[1:]):
        return
    for head in ranges[0]:
        for tail in grid_indices(ranges[1:]):
            yield (head, *tail)


MAX_CHUNK_BYTES = 2**34  # a decoded chunk (what TensorStore allocates at once to read any of it) at most this big


def _check_chunk_sizes(outer: list[int], inner: list[int] | None, shape: tuple[int, ...], data_type: str,
                       bad: Callable[[str], FormatError]) -> None:
    """Refuse chunks no writer makes, before TensorStore allocates one (a lying chunk shape aborted the process
    with ``std::bad_alloc``): a chunk exceeds the array by less than one (inner) chunk per dimension (arrayckpt's
    chunks never exceed ``max(extent, 1)``; its outer chunks are whole multiples of inner ones that may reach
    past the edge), and a decoded chunk is at most ``MAX_CHUNK_BYTES``."""
    unit = inner or outer
    for o, i, n in zip(outer, unit, shape, strict=True):
        if i > max(n, 1) or o >= max(n, 1) + i:
            raise bad(f"chunk shape {outer}" + (f" (inner chunks {inner})" if inner else "") +
                      f" is larger than the array's shape {list(shape)} allows (each chunk extent at most the "
                      "array's, an outer chunk less than one inner chunk beyond it); the metadata is damaged")
    try:
        itemsize = dtype_by_name(data_type).itemsize
    except FormatError:  # an unknown data type is refused by the reader, naming it
        itemsize = 1
    chunks_per_outer = math.prod(o // i for o, i in zip(outer, unit, strict=True))
    if math.prod(unit) * itemsize > MAX_CHUNK_BYTES or chunks_per_outer * 16 > MAX_CHUNK_BYTES:
        raise bad(f"chunk shape {unit} of {data_type} exceeds the limit of {MAX_CHUNK_BYTES} bytes per decoded chunk "
                  "(no arrayckpt save writes one); the metadata is damaged")


# Zarr v3's chunk key encodings. arrayckpt writes "default" with "." ("c.0.1"); on object storage a save
# that replaces a committed checkpoint uses the other one, so its chunks never overwrite the old ones.
KEY_ENCODINGS = ("default", "v2")


def _separator(encoding: JSON) -> str:
    default = "/" if encoding.get("name") == "default" else "."
    return str(json_object(encoding.get("configuration")).get("separator", default))


def array_shape(metadata: JSON) -> list[int]:
    """The ``shape`` of an array's metadata (checked by :func:`check_array_metadata`, or written by arrayckpt)."""
    return int_list(metadata.get("shape"), "array shape")


def outer_chunk_shape(metadata: JSON) -> list[int]:
    """The (outer) chunk shape of an array's metadata (checked, or written by arrayckpt): its regular grid's."""
    return int_list(member(metadata, "chunk_grid", "configuration", "chunk_shape"), "chunk shape")


def read_chunk_shape(metadata: JSON) -> list[int]:
    """The shape of the chunks an array's data is read in (checked metadata): its inner chunks when sharded, else
    its outer chunks."""
    codecs = metadata.get("codecs")
    if isinstance(codecs, list) and codecs and json_object(codecs[0]).get("name") == "sharding_indexed":
        return int_list(member(codecs[0], "configuration", "chunk_shape"), "inner chunk shape")
    return outer_chunk_shape(metadata)


def grid_counts(metadata: JSON) -> list[int]:
    """Chunks per dimension of an array's (outer) chunk grid."""
    return [-(-n // c) for n, c in zip(array_shape(metadata), outer_chunk_shape(metadata), strict=True)]


def chunk_key(metadata: JSON, grid_index: tuple[int, ...]) -> str:
    """The key of chunk ``grid_index`` below its array (``c.1.0`` or ``c`` for 0-d with the default encoding;
    ``1.0`` or ``0`` with the v2 encoding)."""
    encoding = json_object(metadata.get("chunk_key_encoding"))
    if encoding.get("name") == "v2":
        return _separator(encoding).join(str(i) for i in grid_index) or "0"
    return _separator(encoding).join(["c", *(str(i) for i in grid_index)])


def chunk_keys(metadata: JSON, grid_indices: Iterable[tuple[int, ...]]) -> list[str]:
    """:func:`chunk_key` of many grid indices, the encoding read once (about 1 µs a key)."""
    encoding = json_object(metadata.get("chunk_key_encoding"))
    separator = _separator(encoding)
    if encoding.get("name") == "v2":
        return [separator.join(map(str, index)) or "0" for index in grid_indices]
    return [separator.join(("c", *map(str, index))) for index in grid_indices]


def parse_chunk_key(metadata: JSON, name: str) -> tuple[int, ...] | None:
    """The grid index a chunk key names, if it is a valid key of this array (right encoding, inside the grid)."""
    shape = metadata.get("shape", [])
    chunks = member(metadata, "chunk_grid", "configuration", "chunk_shape") or []
    if not (isinstance(shape, list) and isinstance(chunks, list)):
        return None
    encoding = json_object(metadata.get("chunk_key_encoding"))
    separator = _separator(encoding)
    parts = name.split(separator) if name else []
    if encoding.get("name") == "v2":
        if not shape:
            return () if name == "0" else None
    else:
        if not parts or parts[0] != "c":
            return None
        parts = parts[1:]
    if len(parts) != len(shape) or not all(p.isdigit() for p in parts):
        return None
    index = tuple(int(p) for p in parts)
    grid = [-(-n // c) for n, c in zip(shape, chunks, strict=False)]
    return index if all(0 <= i < g for i, g in zip(index, grid, strict=False)) else None
