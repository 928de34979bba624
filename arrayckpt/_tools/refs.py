"""``refs``: the kerchunk references of a committed packed checkpoint (spec §16.4), written on demand.

A packed save writes ``refs.json`` only up to ``refs_max_chunks`` stored chunks (``_settings.py``: the references
take about 100 bytes a chunk, and every save would pay for them); :func:`write_refs` writes them for a checkpoint of
any size, afterwards, locally or on object storage. They are made as a save and ``copy`` make them
(:func:`references`, the one place): from the checkpoint's node metadata and its chunk table, read from the index and
checked as ``copy`` checks it (the whole index file against the size and crc32c its manifest records, every
section, no two chunks sharing bytes). A damaged table is refused, never turned into references; the
``refs.json`` already there is never read (it is derived: rewriting it is harmless, and replaces one a save wrote
before the references carried consolidated metadata, or one that was damaged).

Written whole or not at all (``Location.write_references``: locally a new file renamed over the old, no link
followed; on object storage one PUT), after checking that the checkpoint read is still the one at the location. A
files-layout checkpoint (format versions 1 to 3) has no references: Zarr readers open its directory directly.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import FormatError
from .._format.jsontypes import JSON
from .._format.packs import REFS_NAME, ChunkTable, PackFile, references_file
from .._read.checkpoint import open_location, stored_of
from .._read.stored import StoredCheckpoint
from .._storage import parse_location, parse_roots
from .copy_files import checked_arrays
from .copy_packs import checked_table, read_index

__all__ = ["RefsResult", "references", "write_refs"]

NOTHING_WRITTEN = "no references were written"


@dataclass(frozen=True)
class RefsResult:
    """What :func:`write_refs` wrote.

    Attributes:
        checkpoint: the checkpoint's path or URL.
        refs: where the references were written (``<checkpoint>/refs.json``).
        chunks: how many stored chunks they point into the packs.
        size: their size in bytes.

    Examples:
        >>> import arrayckpt, torch, tempfile
        >>> d = tempfile.mkdtemp()
        >>> arrayckpt.save({"w": torch.ones(4)}, f"{d}/ck", packed=True)
        >>> arrayckpt.write_refs(f"{d}/ck").chunks
        1
    """

    checkpoint: str
    refs: str
    chunks: int
    size: int

    def to_dict(self) -> JSON:
        return {"checkpoint": self.checkpoint, "refs": self.refs, "chunks": self.chunks, "size": self.size}


def write_refs(path: str | os.PathLike[str], *, storage_options: Mapping[str, Any] | None = None,
               base_roots: Sequence[str | os.PathLike[str]] | None = None) -> RefsResult:
    """Write ``refs.json``, the kerchunk references through which zarr-python reads a packed checkpoint without
    arrayckpt (``docs/guide/reading-without-arrayckpt.md``), for a committed packed checkpoint of any size: what a
    save writes only up to ``refs_max_chunks`` chunks (spec §16.4). Any ``refs.json`` there is replaced (it is
    derived from the checked chunk table: see the module docstring).

    Args:
        path: a committed packed checkpoint's directory or URL (``s3://``, ``gs://``, ``memory://``).
        storage_options: for object storage (as for :func:`arrayckpt.save`).
        base_roots: directories or URLs where a delta checkpoint's bases may be read besides the directory holding
            it (spec §10.1); opening a delta checks its chain.

    Returns:
        Where the references were written, and how many chunks they name.

    Raises:
        FormatError: the checkpoint is not packed (format versions 1 to 3: Zarr readers open it directly).
        CorruptCheckpointError: its pack index or metadata is damaged (nothing is written), or a link is where
            ``refs.json`` or ``packs`` should be.
        IncompleteCheckpointError: nothing is committed there (a save that never finished).
        ReplacedCheckpointError: the checkpoint was replaced while its table was read (nothing is written).
        StorageError: the storage fails past its retries.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> arrayckpt.save({"model": {"w": torch.ones(2, 3)}, "step": 1}, f"{d}/ck", packed=True)
        >>> os.remove(f"{d}/ck/refs.json")   # as when the save had more than refs_max_chunks chunks
        >>> result = arrayckpt.write_refs(f"{d}/ck")
        >>> os.path.relpath(result.refs, d), result.chunks
        ('ck/refs.json', 1)
    """
    location = parse_location(path, storage_options)
    roots = parse_roots(base_roots, storage_options)
    with open_location(location, base_roots=roots) as opened:
        checkpoint = stored_of(opened)
        data, chunks = _checked_references(checkpoint)
        checkpoint.check_unchanged(pinned_too=True)  # the references are of the checkpoint that is there now
        location.write_references(data)
    return RefsResult(str(location), f"{str(location).rstrip('/')}/{REFS_NAME}", chunks, len(data))


def _checked_references(checkpoint: StoredCheckpoint) -> tuple[bytes, int]:
    """The references of ``checkpoint`` and how many chunks they name, from its checked metadata and table."""
    where, packed = str(checkpoint.location), checkpoint.packed
    if packed is None:
        raise FormatError(f"{where}: not a packed checkpoint (format version {checkpoint.manifest.format_version}, "
                          "one file per chunk): it needs no references, zarr-python and other Zarr readers open "
                          "its directory directly")
    arrays = checked_arrays(checkpoint, where)
    table = checked_table(packed, [array.path for array in arrays], NOTHING_WRITTEN)
    read_index(packed, NOTHING_WRITTEN)  # the whole index is the one the manifest records, as copy checks it
    data = references(checkpoint, table, packed.layout.packs)
    return data, sum(len(rows) for rows in table.rows.values())


def references(checkpoint: StoredCheckpoint, table: ChunkTable, packs: Sequence[PackFile]) -> bytes:
    """The bytes of ``refs.json`` of the packed ``checkpoint`` (spec §16.4), from its node metadata and its checked
    chunk ``table`` (``copy_packs.checked_table``) into its ``packs``, made as a save makes them
    (``_format/packs.py::references_file``): what ``copy`` writes at its destination (a damaged ``refs.json`` of the
    source is never copied) and :func:`write_refs` writes in place."""
    documents = {path: json.dumps(node).encode() for path, node in checkpoint.nodes.items() if path}
    return references_file(checkpoint.nodes, documents, checkpoint.manifest.delta_chunks, table, packs)
