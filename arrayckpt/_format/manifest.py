"""The manifest: what a checkpoint holds, as frozen dataclasses with JSON round trips.

The manifest lives in the root group's ``zarr.json`` under ``attributes["arrayckpt"]``, next to the
consolidated metadata of every array, so opening a checkpoint is one read. Writing that document is the
commit. Parsing is strict: unknown versions, wrong types and unsafe paths raise :class:`FormatError`
naming the entry, and unknown entry kinds are refused rather than skipped; an alias must name a tensor entry of the
same checkpoint (``alias.py``). See ``spec/FORMAT.md``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeGuard

from .._errors import FormatError
from .alias import AliasEntry, alias_problem, parse_alias
from .dtypes import DType, dtype_by_name
from .integrity import INTEGRITY_MEMBER, PLACEHOLDER, parse_chunk_digests, seal, valid_digest
from .jsontypes import JSON
from .keys import Key, array_path, parse_array_path, parse_key_parts
from .packs import PACKS_MEMBER, PackLayout, check_section_arrays, packs_member, parse_packs_member
from .paths import BaseRef, check_node_paths

__all__ = [
    "FILES_VERSION",
    "FORMAT_VERSION",
    "PACKED_VERSION",
    "MANIFEST_ATTRIBUTE",
    "AliasEntry",
    "ArrayEntry",
    "BaseRef",
    "Delta",
    "Entry",
    "Manifest",
    "PerRankEntry",
    "PickleEntry",
    "Quantization",
    "ValueEntry",
    "array_nodes",
    "encode_root_document",
    "is_arrayckpt_root",
    "parse_root_document",
    "per_rank_path",
]

FORMAT_VERSION = 4  # the newest version this code reads (it reads 1 to 3 too)
FILES_VERSION = 3  # what a checkpoint of one file per chunk is written as (readers of version 3 read it)
PACKED_VERSION = 4  # from this version on, a checkpoint may be packed (spec §16); it is written only for those
NODES_MEMBER = "nodes"  # a packed root keeps the node metadata here, inside the manifest attribute (spec §16.1)
INTEGRITY_VERSION = 3  # from this version on, the root checksum and the chunk digests are required
MANIFEST_ATTRIBUTE = "arrayckpt"
MAX_NDIM = 32  # TensorStore's limit
QUANTIZED_DTYPES = ("float16", "bfloat16", "float32", "float64")  # the dtypes quantized rows are defined for


@dataclass(frozen=True)
class Quantization:
    """Lossy row values of a row delta: row-wise asymmetric ``bits``-bit codes (see ``_quant``), with the
    largest absolute error any stored element has."""

    bits: int
    max_abs_error: float

    def to_dict(self) -> JSON:
        return {"bits": self.bits, "max_abs_error": self.max_abs_error}


@dataclass(frozen=True)
class Delta:
    """How an entry of a delta checkpoint is stored relative to its base (format version 2).

    ``mode="chunks"``: the array at the entry's path has only the chunks whose bytes changed since the base
    (``present``: their flat C-order indices in its chunk grid); every other chunk reads through to the base.
    ``mode="rows"``: the entry's path is a group of arrays ``rows`` (int64 row indices, -1 for padding) and
    ``values`` (those rows' new values; with ``quantized``, ``codes``/``scale``/``offset`` instead); every
    other row reads through to the base.
    """

    mode: Literal["chunks", "rows"]
    present: tuple[int, ...] = ()
    rows: int = 0  # number of changed rows (rows mode)
    quantized: Quantization | None = None

    @property
    def arrays(self) -> tuple[str, ...]:
        """The names of the arrays a rows delta stores below the entry's path (none for a chunks delta)."""
        if self.mode == "chunks":
            return ()
        return ("rows", "values") if self.quantized is None else ("rows", "codes", "scale", "offset")

    def to_dict(self) -> JSON:
        out: JSON = {"mode": self.mode}
        if self.mode == "chunks":
            out["present"] = list(self.present)
        else:
            out["rows"] = self.rows
            if self.quantized is not None:
                out["quantized"] = self.quantized.to_dict()
        return out


@dataclass(frozen=True)
class ArrayEntry:
    """A tensor (``kind="tensor"``) or numpy array (``kind="ndarray"``) stored as a Zarr array."""

    key: str
    parts: Key
    dtype: DType
    shape: tuple[int, ...]
    kind: Literal["tensor", "ndarray"] = "tensor"
    delta: Delta | None = None  # None: stored whole; else only what changed since the base

    @property
    def path(self) -> str:
        return array_path(self.key)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def to_dict(self) -> JSON:
        out: JSON = {
            "kind": self.kind,
            "keys": list(self.parts),
            "path": self.path,
            "dtype": self.dtype.name,
            "shape": list(self.shape),
        }
        if self.delta is not None:
            out["delta"] = self.delta.to_dict()
        return out


@dataclass(frozen=True)
class ValueEntry:
    """A plain value stored inline as typed JSON (see ``values.py``)."""

    key: str
    parts: Key
    value: object  # the encoded JSON form (``values.py``: decode_value)

    def to_dict(self) -> JSON:
        return {"kind": "value", "keys": list(self.parts), "value": self.value}


@dataclass(frozen=True)
class PickleEntry:
    """A value only pickle could store, kept as a 1-D uint8 array; loading it needs consent."""

    key: str
    parts: Key
    nbytes: int

    @property
    def path(self) -> str:
        return array_path(self.key)

    def to_dict(self) -> JSON:
        return {"kind": "pickle", "keys": list(self.parts), "path": self.path, "nbytes": self.nbytes}


@dataclass(frozen=True)
class PerRankEntry:
    """A value saved once per rank; ``items[r]`` is rank ``r``'s: a :class:`ValueEntry` or :class:`ArrayEntry`
    (whose array lives at ``<key path>/%r<r>``, a segment no escaped key can produce)."""

    key: str
    parts: Key
    items: tuple[ValueEntry | ArrayEntry | None, ...]  # None: that rank did not hold the key

    def to_dict(self) -> JSON:
        return {
            "kind": "per_rank",
            "keys": list(self.parts),
            "ranks": [None if item is None else _per_rank_item(item) for item in self.items],
        }


def per_rank_path(key: str, rank: int) -> str:
    """Where rank ``rank``'s array of a per-rank entry is stored."""
    return f"{array_path(key)}/%r{rank}"


def _per_rank_item(item: ValueEntry | ArrayEntry) -> JSON:
    if isinstance(item, ValueEntry):
        return {"value": item.value}
    return {"dtype": item.dtype.name, "shape": list(item.shape), "kind": item.kind}


Entry = ArrayEntry | ValueEntry | PickleEntry | PerRankEntry | AliasEntry


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs besides the arrays' own metadata."""

    entries: Mapping[str, Entry]
    step: int | None = None
    # Containers that are not dicts, by dotted prefix ("list" or "tuple"), to rebuild nested state.
    containers: Mapping[str, str] = field(default_factory=dict)
    created: Mapping[str, object] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    # Training metrics the caller attached (e.g. validation loss), for choosing which checkpoints to keep.
    metrics: Mapping[str, float] = field(default_factory=dict)
    id: str | None = None  # unique per save; deltas name their base by it
    base: BaseRef | None = None  # set for delta checkpoints
    stored_bytes: int | None = None  # array bytes this checkpoint stores itself (before compression)
    # Per array node it stores: the digest of its chunks' crc32c values in order (``_format/integrity.py``).
    chunk_digests: Mapping[str, str] = field(default_factory=dict)
    # The root document's checksum as read (``None``: an older checkpoint without one). Never written from here:
    # :func:`encode_root_document` computes it over the serialised document.
    integrity: str | None = None
    # Where each stored chunk lies in a packed checkpoint (spec §16; ``None``: one file or object per chunk).
    packs: PackLayout | None = None

    def to_dict(self) -> JSON:
        out: JSON = {
            "format_version": self.format_version,
            "step": self.step,
            "created": dict(self.created),
            "containers": dict(self.containers),
            "entries": {key: entry.to_dict() for key, entry in self.entries.items()},
        }
        if self.metrics:
            out["metrics"] = dict(self.metrics)
        if self.id is not None:
            out["id"] = self.id
        if self.base is not None:
            out["base"] = self.base.to_dict()
        if self.stored_bytes is not None:
            out["stored_bytes"] = self.stored_bytes
        if self.format_version >= INTEGRITY_VERSION or self.chunk_digests:
            out["chunk_digests"] = dict(self.chunk_digests)
        if self.packs is not None:
            layout = self.packs
            out[PACKS_MEMBER] = packs_member(layout.packs, layout.index_name, layout.index_size, layout.index_crc,
                                             layout.sections)
        return out

    @property
    def aliases(self) -> dict[str, str]:
        """Every alias key and the key of the tensor it names (spec §4.3): a tensor the state held under both keys
        (tied weights), stored once under the target. ``{}`` when the checkpoint has none."""
        return {key: entry.target for key, entry in self.entries.items() if isinstance(entry, AliasEntry)}

    @property
    def delta_chunks(self) -> dict[str, tuple[int, ...]]:
        """By array path, the flat indices of the chunks each chunks delta stores (spec §10.3, ascending); an array
        not named stores every chunk of its grid."""
        return {entry.path: entry.delta.present for entry in self.entries.values()
                if isinstance(entry, ArrayEntry) and entry.delta is not None and entry.delta.mode == "chunks"}

    def array_entry(self, key: str) -> ArrayEntry | None:
        """The tensor or ndarray entry of ``key``, through an alias to its target; ``None`` for other keys."""
        entry = self.entries.get(key)
        if isinstance(entry, AliasEntry):
            entry = self.entries.get(entry.target)
        return entry if isinstance(entry, ArrayEntry) else None

    @classmethod
    def from_dict(cls, data: object) -> Manifest:
        if not isinstance(data, dict):
            raise FormatError(f"manifest must be a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise FormatError(f"manifest has no valid format_version (got {version!r})")
        if version > FORMAT_VERSION or version < 1:
            raise FormatError(
                f"checkpoint format version {version} is not supported by this arrayckpt "
                f"(reads versions 1..{FORMAT_VERSION}); upgrade arrayckpt"
            )
        step = data.get("step")
        if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
            raise FormatError(f"manifest 'step' must be an integer or null, got {step!r}")
        entries = data.get("entries")
        if not isinstance(entries, dict):
            raise FormatError("manifest 'entries' must be a JSON object")
        containers = data.get("containers", {})
        if not isinstance(containers, dict) or not all(v in ("list", "tuple") for v in containers.values()):
            raise FormatError(f"manifest 'containers' must map prefixes to 'list' or 'tuple', got {containers!r}")
        created = data.get("created", {})
        if not isinstance(created, dict):
            raise FormatError("manifest 'created' must be a JSON object")
        parsed = {key: parse_entry(key, value) for key, value in entries.items()}
        _check_structure(parsed, containers)
        identity = data.get("id")
        if identity is not None and not isinstance(identity, str):
            raise FormatError(f"manifest 'id' must be a string, got {identity!r}")
        base = BaseRef.from_dict(data["base"]) if data.get("base") is not None else None
        if base is None and any(isinstance(e, ArrayEntry) and e.delta is not None for e in parsed.values()):
            raise FormatError("manifest has delta entries but no 'base'")
        stored = data.get("stored_bytes")
        if stored is not None and (not isinstance(stored, int) or isinstance(stored, bool) or stored < 0):
            raise FormatError(f"manifest 'stored_bytes' must be a non-negative integer, got {stored!r}")
        digests = data.get("chunk_digests")
        if digests is None and version >= INTEGRITY_VERSION:
            raise FormatError(f"manifest has no 'chunk_digests', which format version {version} requires")
        integrity = data.get(INTEGRITY_MEMBER)
        if integrity is not None and not valid_digest(integrity):
            raise FormatError(f"manifest '{INTEGRITY_MEMBER}' must be 'sha256:<64 hex digits>', got {integrity!r}")
        packs = data.get(PACKS_MEMBER)
        if (packs is not None) != (version >= PACKED_VERSION):
            raise FormatError(f"manifest of format version {version} {'has' if packs is not None else 'lacks'} the "
                              f"'{PACKS_MEMBER}' member, which versions from {PACKED_VERSION} on require and earlier "
                              "ones do not have")
        layout = parse_packs_member(packs, "manifest") if packs is not None else None
        return cls(parsed, step, containers, created, version, parse_metrics(data.get("metrics", {})), identity,
                   base, stored, parse_chunk_digests(digests if digests is not None else {}), integrity, layout)


def parse_metrics(metrics: object) -> dict[str, float]:
    """Metrics: a JSON object of finite numbers by name."""
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        for k, v in metrics.items()
    ):
        raise FormatError(f"metrics must map names to finite numbers, got {metrics!r}")
    return {k: float(v) for k, v in metrics.items()}


def _parse_shape(shape: object, key: str) -> tuple[int, ...]:
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM
        or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**63 for n in shape)
    ):
        raise FormatError(f"entry {key!r}: shape {shape!r} must be a list of non-negative integers")
    return tuple(shape)


def parse_entry(key: object, data: object) -> Entry:
    """Parse one manifest entry, refusing anything unexpected."""
    if not isinstance(key, str):
        raise FormatError(f"entry name {key!r} must be a string")
    if not isinstance(data, dict):
        raise FormatError(f"entry {key!r} must be a JSON object")
    kind = data.get("kind")
    parts = parse_key_parts(data.get("keys"), key)
    if kind in ("tensor", "ndarray"):
        parse_array_path(data.get("path"), key)
        try:
            dtype = dtype_by_name(data.get("dtype"))
        except FormatError as e:
            raise FormatError(f"entry {key!r}: {e}") from None
        shape = _parse_shape(data.get("shape"), key)
        delta = _parse_delta(data["delta"], key, shape) if data.get("delta") is not None else None
        if delta is not None and delta.quantized is not None and dtype.name not in QUANTIZED_DTYPES:
            raise FormatError(f"entry {key!r}: a quantized rows delta of a {dtype.name} tensor (quantized rows are "
                              f"defined for {', '.join(QUANTIZED_DTYPES)} only)")
        return ArrayEntry(key, parts, dtype, shape, kind, delta)
    if kind == "value":
        if "value" not in data:
            raise FormatError(f"entry {key!r}: value entry has no 'value'")
        return ValueEntry(key, parts, data["value"])
    if kind == "pickle":
        parse_array_path(data.get("path"), key)
        nbytes = data.get("nbytes")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
            raise FormatError(f"entry {key!r}: 'nbytes' must be a non-negative integer, got {nbytes!r}")
        return PickleEntry(key, parts, nbytes)
    if kind == "per_rank":
        ranks = data.get("ranks")
        if not isinstance(ranks, list) or not ranks:
            raise FormatError(f"entry {key!r}: 'ranks' must be a non-empty list")
        return PerRankEntry(key, parts, tuple(_parse_per_rank_item(key, parts, item) for item in ranks))
    if kind == "alias":
        return parse_alias(key, parts, data)
    raise FormatError(f"entry {key!r} has unknown kind {kind!r}; this arrayckpt knows tensor, ndarray, value, pickle, "
                      "per_rank and alias (a newer arrayckpt may know more: upgrade)")


def _nonneg_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_delta(data: object, key: str, shape: tuple[int, ...]) -> Delta:
    if not isinstance(data, dict) or data.get("mode") not in ("chunks", "rows"):
        raise FormatError(f"entry {key!r}: 'delta' must be an object with mode 'chunks' or 'rows', got {data!r}")
    if data["mode"] == "chunks":
        present = data.get("present")
        if not isinstance(present, list) or not all(_nonneg_int(i) for i in present):
            raise FormatError(f"entry {key!r}: delta 'present' must be a list of chunk indices")
        if any(a >= b for a, b in zip(present, present[1:], strict=False)):
            raise FormatError(f"entry {key!r}: delta 'present' must list each chunk index once, in ascending order "
                              "(as every writer does); it was damaged or crafted")
        return Delta("chunks", tuple(present))
    rows = data.get("rows")
    if not shape or not _nonneg_int(rows):
        raise FormatError(f"entry {key!r}: a rows delta needs an array of at least 1 dimension and a row count")
    quantized = data.get("quantized")
    if quantized is not None:
        error = quantized.get("max_abs_error") if isinstance(quantized, dict) else None
        if not (isinstance(quantized, dict) and quantized.get("bits") in (4, 8) and type(quantized["bits"]) is int
                and isinstance(error, (int, float)) and not isinstance(error, bool)
                and math.isfinite(error) and error >= 0):
            raise FormatError(f"entry {key!r}: delta 'quantized' must be {{bits: 4|8, max_abs_error: a finite "
                              f"number >= 0}}, got {quantized!r}")
        return Delta("rows", rows=rows, quantized=Quantization(quantized["bits"], float(quantized["max_abs_error"])))
    return Delta("rows", rows=rows)


def _parse_per_rank_item(key: str, parts: Key, item: object) -> ValueEntry | ArrayEntry | None:
    if item is None:
        return None
    if not isinstance(item, dict):
        raise FormatError(f"entry {key!r}: per-rank item {item!r} must be an object or null")
    if "value" in item:
        return ValueEntry(key, parts, item["value"])
    kind = item.get("kind", "tensor")
    if kind not in ("tensor", "ndarray"):
        raise FormatError(f"entry {key!r}: per-rank item kind {kind!r} must be tensor or ndarray")
    try:
        dtype = dtype_by_name(item.get("dtype"))
    except FormatError as e:
        raise FormatError(f"entry {key!r}: {e}") from None
    return ArrayEntry(key, parts, dtype, _parse_shape(item.get("shape"), key), kind)


def _check_structure(entries: Mapping[str, Entry], containers: Mapping[str, str]) -> None:
    """What writers guarantee across entries (spec §3.3, §4.3): every per-rank entry has one item per rank of
    the same saving group; every container prefix holds entries; no array node lies inside another; every alias
    names a tensor or ndarray entry (so no alias of an alias, and no cycle)."""
    for entry in entries.values():
        if isinstance(entry, AliasEntry) and not isinstance(entries.get(entry.target), ArrayEntry):
            raise FormatError(alias_problem(entry, entries.get(entry.target)))
    counts = {len(e.items) for e in entries.values() if isinstance(e, PerRankEntry)}
    if len(counts) > 1:
        raise FormatError(f"per-rank entries disagree on the number of ranks that saved ({sorted(counts)}); every "
                          "writer writes one item per rank")
    prefixes = {name[:i] for name in entries for i, c in enumerate(name) if c == "."}
    for prefix, kind in containers.items():
        if prefix not in prefixes:
            raise FormatError(f"manifest 'containers' names a {kind} at {prefix!r}, but no entry lies below it")
    nodes: dict[str, str] = {}  # array node path -> entry name
    for name, entry in entries.items():
        if isinstance(entry, (ArrayEntry, PickleEntry)):
            nodes[entry.path] = name
        elif isinstance(entry, PerRankEntry):
            nodes.update((per_rank_path(name, r), name) for r, item in enumerate(entry.items)
                         if isinstance(item, ArrayEntry))
    for path, name in nodes.items():
        for i, c in enumerate(path):
            if c == "/" and path[:i] in nodes:
                raise FormatError(f"entry {name!r} is stored inside the array of entry {nodes[path[:i]]!r} "
                                  f"({path!r} below {path[:i]!r}); a Zarr array cannot have children")


def is_arrayckpt_root(document: object) -> TypeGuard[JSON]:
    """Whether a parsed root ``zarr.json`` is arrayckpt's (it carries the manifest); a foreign Zarr group is not."""
    return isinstance(document, dict) and isinstance(document.get("attributes"), dict) and \
        MANIFEST_ATTRIBUTE in document["attributes"]


def encode_root_document(manifest: Manifest, consolidated_json: str) -> bytes:
    """The root ``zarr.json``, reusing the JSON text of the consolidated node metadata (which a repeated save
    with the same layout does not need to encode again), sealed with its checksum (spec §11). A packed
    checkpoint's root keeps the node metadata inside its manifest attribute instead of ``consolidated_metadata``
    (spec §16.1): a Zarr reader opening the directory itself then finds no arrays, rather than arrays whose chunk
    files are missing and would read as fill values."""
    fields = {**manifest.to_dict(), INTEGRITY_MEMBER: PLACEHOLDER}
    if manifest.packs is not None:
        return seal((
            '{"zarr_format": 3, "node_type": "group", "attributes": {"' + MANIFEST_ATTRIBUTE + '": '
            + json.dumps(fields)[:-1] + ', "' + NODES_MEMBER + '": ' + consolidated_json + "}}}"
        ).encode())
    return seal((
        '{"zarr_format": 3, "node_type": "group", "attributes": {"' + MANIFEST_ATTRIBUTE + '": '
        + json.dumps(fields)
        + '}, "consolidated_metadata": {"kind": "inline", "must_understand": false, "metadata": '
        + consolidated_json + "}}"
    ).encode())


def parse_root_document(document: object, where: str) -> tuple[Manifest, dict[str, JSON]]:
    """The manifest and consolidated node metadata of a root ``zarr.json``."""
    if not isinstance(document, dict) or document.get("zarr_format") != 3 or document.get("node_type") != "group":
        raise FormatError(f"{where}: root zarr.json is not a Zarr v3 group")
    attributes = document.get("attributes")
    if not isinstance(attributes, dict) or MANIFEST_ATTRIBUTE not in attributes:
        raise FormatError(f"{where}: root group has no '{MANIFEST_ATTRIBUTE}' manifest; not an arrayckpt checkpoint")
    try:
        manifest = Manifest.from_dict(attributes[MANIFEST_ATTRIBUTE])
    except FormatError as e:
        raise FormatError(f"{where}: {e}") from None
    if manifest.packs is not None:
        if "consolidated_metadata" in document:
            raise FormatError(f"{where}: root zarr.json of a packed checkpoint has consolidated metadata, which a "
                              "Zarr reader would read chunks through (spec §16.1); it was damaged or crafted")
        metadata = attributes[MANIFEST_ATTRIBUTE].get(NODES_MEMBER)
    else:
        consolidated = document.get("consolidated_metadata")
        metadata = consolidated.get("metadata") if isinstance(consolidated, dict) else None
    if not isinstance(metadata, dict):
        raise FormatError(f"{where}: root zarr.json has no consolidated metadata")
    check_node_paths(metadata, array_nodes(manifest.entries), where)
    _check_digested(manifest, metadata, where)
    if manifest.packs is not None:
        arrays = [path for path, node in metadata.items()
                  if isinstance(node, dict) and node.get("node_type") == "array"]
        check_section_arrays(manifest.packs, arrays, where)  # the member itself was parsed with the manifest
    return manifest, metadata


def array_nodes(entries: Mapping[str, Entry]) -> dict[str, str]:
    """Every array node the entries imply, by path, with the name of the entry it belongs to (spec §2): the arrays
    of ``tensor``/``ndarray``/``pickle`` entries, a rows delta's arrays below its entry's path, and the per-rank
    arrays. Built from validated names only: the one list of node paths a reader may turn into file names."""
    out: dict[str, str] = {}
    for name, entry in entries.items():
        if isinstance(entry, ArrayEntry) and entry.delta is not None and entry.delta.mode == "rows":
            out.update((f"{entry.path}/{array}", name) for array in entry.delta.arrays)
        elif isinstance(entry, (ArrayEntry, PickleEntry)):
            out[entry.path] = name
        elif isinstance(entry, PerRankEntry):
            out.update((per_rank_path(name, rank), name) for rank, item in enumerate(entry.items)
                       if isinstance(item, ArrayEntry))
    return out


def _check_digested(manifest: Manifest, nodes: JSON, where: str) -> None:
    """Chunk digests name stored arrays only, and (from the version that requires them) every stored array has
    one: an array without a digest would go unchecked by ``verify``."""
    arrays = {path for path, node in nodes.items() if isinstance(node, dict) and node.get("node_type") == "array"}
    stray = sorted(set(manifest.chunk_digests) - arrays)
    if stray:
        raise FormatError(f"{where}: manifest 'chunk_digests' names {stray[0]!r}, which is not an array of the "
                          "checkpoint")
    if manifest.format_version >= INTEGRITY_VERSION:
        missing = sorted(arrays - set(manifest.chunk_digests))
        if missing:
            raise FormatError(f"{where}: array {missing[0]!r} has no entry in the manifest's 'chunk_digests'")
