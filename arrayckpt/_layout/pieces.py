"""What a rank tells the coordinator about its state: its pieces of every array, as metadata only.

A rank may hold hundreds of array pieces and a save may have tens of thousands of ranks, so a rank's pieces
travel as one :class:`ArrayTable`: columns (keys, and the dtypes, global shapes, boxes and replica ids as int64
arrays) rather than one Python object per piece. Pickled, a table is a tuple of strings and a few numpy arrays;
the coordinator stacks every rank's columns and plans on whole arrays (``planner.py``). Iterating a table still
gives :class:`ArrayDescription` objects, for code that looks at one piece at a time.

:func:`fingerprint` digests everything of a description that the array layout of a save depends on (not the
plain values themselves, which are taken fresh at every save), so a rank can tell the coordinator "my state is
laid out as last time" in 16 bytes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, overload

import numpy as np

from .._format.keys import Key
from .._format.manifest import ArrayEntry, ValueEntry
from .box import Box

__all__ = ["KINDS", "ArrayDescription", "ArrayTable", "LocalDescription", "default_parts",
           "fingerprint"]

KINDS = ("tensor", "ndarray", "pickle")  # an ArrayTable's kind codes
FINGERPRINT_BYTES = 16
# ArrayTable.meta columns
NDIM, KIND, DTYPE, REPLICA = range(4)
# ArrayTable.coords planes
GLOBAL, OFFSET, SHAPE = range(3)


@dataclass(frozen=True)
class ArrayDescription:
    """One rank's piece of one array leaf (metadata only)."""

    key: str
    parts: Key
    kind: Literal["tensor", "ndarray", "pickle"]
    dtype: str
    global_shape: tuple[int, ...]
    box: Box
    replica_id: int


def default_parts(key: str) -> Key:
    """The key path a dotted key has when every part that looks like a non-negative int is one."""
    return tuple(int(s) if s.isdigit() and s.isascii() and str(int(s)) == s else s for s in key.split("."))


@dataclass(frozen=True, eq=False)
class ArrayTable(Sequence[ArrayDescription]):
    """A rank's array pieces as columns, one row per piece (see the module docstring).

    ``meta[i]`` is (ndim, kind code, dtype code, replica id); ``coords[i]`` holds the global shape, the box's
    offset and the box's shape, each padded to the table's width with 1, 0 and 1 (so sizes are products over
    the whole row). ``parts[i]`` is ``None`` where the key path is :func:`default_parts` of the key.
    """

    keys: tuple[str, ...] = ()
    parts: tuple[Key | None, ...] = ()
    dtypes: tuple[str, ...] = ()  # the dtype names the codes index
    meta: np.ndarray = field(default_factory=lambda: np.zeros((0, 4), np.int64))
    coords: np.ndarray = field(default_factory=lambda: np.zeros((0, 3, 1), np.int64))

    @classmethod
    def of(cls, items: Sequence[ArrayDescription]) -> ArrayTable:
        items = list(items)
        width = max([1, *(len(i.global_shape) for i in items)])
        dtypes: dict[str, int] = {}
        meta = np.zeros((len(items), 4), np.int64)
        coords = np.zeros((len(items), 3, width), np.int64)
        coords[:, GLOBAL] = coords[:, SHAPE] = 1
        parts: list[Key | None] = []
        for i, item in enumerate(items):
            ndim = len(item.global_shape)
            if len(item.box.offset) != ndim or len(item.box.shape) != ndim:
                raise ValueError(f"piece {item.key!r}: box {item.box} does not have {ndim} dimensions")
            meta[i] = (ndim, KINDS.index(item.kind), dtypes.setdefault(item.dtype, len(dtypes)), item.replica_id)
            coords[i, :, :ndim] = (item.global_shape, item.box.offset, item.box.shape)
            parts.append(None if _same_parts(item.parts, default_parts(item.key)) else tuple(item.parts))
        return cls(tuple(i.key for i in items), tuple(parts), tuple(dtypes), meta, coords)

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> ArrayDescription: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[ArrayDescription]: ...

    def __getitem__(self, i: int | slice) -> ArrayDescription | Sequence[ArrayDescription]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        key = self.keys[i]
        ndim, kind, dtype, replica = self.meta[i].tolist()
        shape, offset, held = (tuple(row[:ndim]) for row in self.coords[i].tolist())
        parts = self.parts[i]
        return ArrayDescription(key, default_parts(key) if parts is None else parts, KINDS[kind],  # type: ignore[arg-type]
                                self.dtypes[dtype], shape, Box(offset, held), replica)

    def __iter__(self) -> Iterator[ArrayDescription]:
        return (self[i] for i in range(len(self)))

    def parts_of(self, i: int) -> Key:
        parts = self.parts[i]
        return default_parts(self.keys[i]) if parts is None else parts


def _same_parts(a: Key, b: Key) -> bool:
    return len(a) == len(b) and all(type(x) is type(y) and x == y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class LocalDescription:
    """Everything one rank holds, as metadata (plain values travel encoded; array data never travels).

    ``arrays`` may be given as any sequence of :class:`ArrayDescription`; it is kept as an :class:`ArrayTable`.
    ``aliases``: the keys of ``arrays`` whose piece is one tensor with an earlier key's (tied weights), mapped to
    that key; the coordinator stores them once where every rank holding them agrees (``planner.py``).
    """

    arrays: Sequence[ArrayDescription] = ()
    values: tuple[ValueEntry, ...] = ()
    per_rank: tuple[ValueEntry | ArrayEntry, ...] = ()
    containers: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.arrays, ArrayTable):
            object.__setattr__(self, "arrays", ArrayTable.of(self.arrays))

    @property
    def table(self) -> ArrayTable:
        assert isinstance(self.arrays, ArrayTable)
        return self.arrays


def fingerprint(description: LocalDescription) -> bytes:
    """A digest of everything in ``description`` the array layout of a save depends on: every piece (key, key
    path, kind, dtype, global shape, box, replica id), the per-rank entries (key, key path, and dtype and shape for
    tensors), the keys and key paths of the plain values and their order, the containers and the aliases. Not the
    plain values, which every save collects afresh."""
    table = description.table
    h = hashlib.blake2b(digest_size=FINGERPRINT_BYTES)
    for chunk in (
        "\0".join(table.keys), repr(table.parts), repr(table.dtypes), repr(table.meta.shape), repr(table.coords.shape),
        repr([(v.key, v.parts) for v in description.values]),
        repr([(i.key, i.parts, i.dtype.name, i.shape, i.kind) if isinstance(i, ArrayEntry) else (i.key, i.parts)
              for i in description.per_rank]),
        repr(sorted(description.containers.items())),
        repr(sorted(description.aliases.items())),
    ):
        h.update(chunk.encode("utf-8", "surrogatepass"))
        h.update(b"\xff")
    h.update(np.ascontiguousarray(table.meta, np.int64).tobytes())
    h.update(np.ascontiguousarray(table.coords, np.int64).tobytes())
    return h.digest()
