"""``copy``: a committed checkpoint, with its chain of bases, copied as stored between any two locations.

Local directories, ``s3://``, ``gs://`` and ``memory://`` prefixes, in any direction. The chunk files are streamed
as they are (no decoding and re-encoding; ``_tools/copy_files.py``), each one checked on the way, and the destination is
committed last through the one write transaction (``_write/transaction.py``): a copy cut short never reads as
committed, and a committed checkpoint it replaces stays whole until the commit.

What is checked, before anything is committed:

- every chunk file: its size (uncompressed chunks have a fixed one), its crc32c, and for a shard its index's crc32c,
  its entries and every inner chunk's crc32c. Uncompressed chunks are checked byte for byte without decoding;
  compressed ones are decoded through TensorStore, which checks the same. A missing chunk is damage.
- every array's chunk digest (spec §11.2, format version 3): the content checksums of the chunks read, in order,
  must give the digest the source recorded, so swapped or misplaced chunk files are caught too.
- the source was not replaced while it was read (object storage, where reads cannot pin it).
- with ``read_back=True``, every object written is read back from the destination and compared (on S3 the upload is
  already checked by the store: TensorStore signs every PUT with the SHA-256 of its payload).

A packed checkpoint (spec §16) is copied as its packs, each one file or object under its own name (on object storage
a large one as one multipart upload), byte for byte, every chunk file in it checked as above and its table checked
as ``verify`` checks it (``_tools/copy_packs.py``); then its index (its size and crc32c the manifest's) and its
kerchunk references, the root document last. Its manifest, node metadata and tag are the source's.

Delta checkpoints are copied as deltas. A base named by a relative path (what saves write when a delta and its base
are on the same storage, e.g. ``../step-100``) goes to the same relative place at the destination, if that place is
in the directory (prefix) holding the destination or inside one of ``base_roots`` (spec §10.1: the same rule that
decides which bases a reader follows, so a crafted reference never places a checkpoint elsewhere), and is copied
there first unless the checkpoint there already is that base (same id: then it, and the chain below it, are not
copied again). Base references are never rewritten: the copied root documents hold the same manifests (the same
ids), so the copied chain is checked like the original. A base named by an absolute path or URL is not copied:
the copy reads through that same base (``compact`` first for a standalone copy). A committed checkpoint of another
id at a base's destination is an error (a base is never overwritten). The destination itself needs
``overwrite=True`` to replace a committed checkpoint, unless that checkpoint is the very one being copied (same id:
nothing is copied, so copying again is cheap and safe).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from .._errors import (
    ArrayckptError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from .._format.jsontypes import JSON, json_object, member
from .._format.manifest import MANIFEST_ATTRIBUTE, parse_root_document
from .._format.packs import REFS_NAME
from .._format.paths import is_location_reference
from .._read.checkpoint import open_location, stored_of
from .._read.stored import StoredCheckpoint
from .._settings import settings
from .._storage import Location, follow_base, parse_location, parse_roots
from .._write.transaction import begin_write
from .copy_files import ArrayCopy, FileCopier, Progress, Throttle, checked_arrays
from .copy_packs import PackCopier, checked_table, read_index
from .refs import references

if TYPE_CHECKING:
    from .._read.packed import PackedChunks

__all__ = ["CopyResult", "copy", "copy_checkpoint"]

NOTHING_COPIED = "nothing was copied"


@dataclass(frozen=True)
class CopyResult:
    """What :func:`copy` did.

    Attributes:
        source: the checkpoint copied.
        destination: where it was copied.
        id: the checkpoint's id, the same at both ends.
        copied: the locations written, bases first, the destination last.
        skipped: the locations that already held the checkpoint meant for them (same id).
        objects: how many chunk files were copied.
        bytes_copied: their stored bytes.

    Examples:
        >>> import arrayckpt, torch, tempfile
        >>> d = tempfile.mkdtemp()
        >>> arrayckpt.save({"w": torch.ones(4)}, f"{d}/a")
        >>> result = arrayckpt.copy(f"{d}/a", f"{d}/b")
        >>> result.objects, result.bytes_copied > 0, result.id == arrayckpt.open(f"{d}/a").manifest.id
        (1, True, True)
    """

    source: str
    destination: str
    id: str | None
    copied: tuple[str, ...]
    skipped: tuple[str, ...]
    objects: int
    bytes_copied: int

    def to_dict(self) -> JSON:
        return {"source": self.source, "destination": self.destination, "id": self.id, "copied": list(self.copied),
                "skipped": list(self.skipped), "objects": self.objects, "bytes_copied": self.bytes_copied}


def copy(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, overwrite: bool = False,
         storage_options: Mapping[str, Any] | None = None, src_options: Mapping[str, Any] | None = None,
         dst_options: Mapping[str, Any] | None = None, max_bytes_per_second: float | None = None,
         read_back: bool = False, concurrency: int | None = None,
         progress: Progress | None = None, base_roots: Sequence[str | os.PathLike[str]] | None = None) -> CopyResult:
    """Copy the committed checkpoint at ``src`` (with its chain of bases, if it is a delta) to ``dst``, streaming
    its files as stored, checking every chunk on the way, and committing ``dst`` last (see the module docstring).

    Args:
        src: a committed checkpoint's directory or URL.
        dst: where to copy it (its bases go beside it, as they are beside ``src``).
        overwrite: replace a committed checkpoint at ``dst``.
        storage_options: for object storage, at both ends (as for :func:`arrayckpt.save`).
        src_options: overrides ``storage_options`` for ``src`` (e.g. two S3 endpoints).
        dst_options: overrides ``storage_options`` for ``dst``.
        max_bytes_per_second: caps the transfer rate.
        read_back: read every object written back from ``dst`` and compare it (see the module docstring).
        concurrency: the number of chunk files in flight (default ``copy_concurrency``, 8; at most
            ``copy_in_flight_bytes`` of them: ``_settings.py``).
        progress: called as ``progress(done, total)`` in array bytes, for each checkpoint of the chain in turn.
        base_roots: directories or URLs, at either end, where bases outside the directory holding their delta
            checkpoint may be read and written (spec §10.1).

    Returns:
        What was copied and what was already in place.

    Raises:
        BaseNotAllowedError: a base is outside its delta's directory and ``base_roots``.
        CorruptCheckpointError: damage in the source (nothing is committed).
        CheckpointExistsError: a committed checkpoint is at ``dst`` (without ``overwrite``), or another one at a
            base's place.
        StorageError: either storage fails past its retries.
        ValueError: ``dst`` is ``src`` or inside it.

    Examples:
        >>> import arrayckpt, torch, tempfile, os
        >>> d = tempfile.mkdtemp()
        >>> arrayckpt.save({"w": torch.arange(6.0)}, f"{d}/step-1")
        >>> arrayckpt.save({"w": torch.arange(6.0) * 2}, f"{d}/step-2", base=f"{d}/step-1")
        >>> result = arrayckpt.copy(f"{d}/step-2", f"{d}/mirror/step-2")   # its base goes to mirror/step-1 first
        >>> [os.path.relpath(p, d) for p in result.copied]
        ['mirror/step-1', 'mirror/step-2']
        >>> arrayckpt.open(f"{d}/mirror/step-2")["w"][:].tolist()
        [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
        >>> arrayckpt.copy(f"{d}/step-2", f"{d}/mirror/step-2").copied   # already there: nothing to do
        ()
    """
    source = parse_location(src, src_options if src_options is not None else storage_options)
    target = parse_location(dst, dst_options if dst_options is not None else storage_options)
    roots = parse_roots(base_roots, src_options if src_options is not None else storage_options) + \
        parse_roots(base_roots, dst_options if dst_options is not None else storage_options)
    return copy_checkpoint(source, target, overwrite=overwrite, throttle=Throttle(max_bytes_per_second),
                           read_back=read_back, concurrency=concurrency, progress=progress, base_roots=roots)


def copy_checkpoint(source: Location, target: Location, *, overwrite: bool, throttle: Throttle,
                    read_back: bool = False, concurrency: int | None = None,
                    progress: Progress | None = None, base_roots: tuple[Location, ...] = ()) -> CopyResult:
    """:func:`copy` between two locations, with a ``throttle`` that several copies may share (the remote tier's
    step copier)."""
    if source.tree.holds(target.tree):
        raise ValueError(f"{target}: cannot copy a checkpoint onto itself or into itself ({source})")
    with open_location(source, base_roots=base_roots) as opened:
        checkpoint = stored_of(opened)
        layers = [(checkpoint, target)]
        skipped: list[str] = []
        if _holds(target, checkpoint.manifest.id, base=False):
            return CopyResult(str(source), str(target), checkpoint.manifest.id, (), (str(target),), 0, 0)
        while (ref := layers[-1][0].manifest.base) is not None and not is_location_reference(ref.path):
            follow_base(layers[-1][0].location, ref.path, base_roots)  # may the source's base be read at all?
            place = follow_base(layers[-1][1], ref.path, base_roots)  # and placed there (never anywhere else)
            if _holds(place, ref.id, base=True):
                skipped.append(str(place))
                break
            layers.append((layers[-1][0].base, place))  # opened and checked to be the base the delta was saved on
        copied: list[str] = []
        objects = stored = 0
        transfer = _Transfer(throttle, read_back, settings().copy_concurrency if concurrency is None else concurrency,
                             progress)
        for index, (layer, place) in reversed(list(enumerate(layers))):
            # a base's place holds nothing committed (checked above): overwrite only replaces a killed copy's leftovers
            done = _copy_layer(layer, place, overwrite or index > 0, transfer)
            copied.append(str(place))
            objects, stored = objects + done.objects, stored + done.stored_bytes
        return CopyResult(str(source), str(target), checkpoint.manifest.id, tuple(copied), tuple(skipped), objects,
                          stored)


def _holds(place: Location, identity: str | None, base: bool) -> bool:
    """Whether ``place`` holds the committed checkpoint ``identity``. For a base's place, another committed checkpoint
    there is an error (a base is never overwritten); nothing, or an incomplete one (a copy cut short), is not."""
    try:
        document = place.read_root()
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        return False
    except ArrayckptError:
        if base:
            raise
        return False  # the writer decides what may be replaced
    manifest = member(document, "attributes", MANIFEST_ATTRIBUTE)
    found = manifest.get("id") if isinstance(manifest, dict) else None
    if identity is not None and found == identity:
        return True
    if base:
        raise CheckpointExistsError(f"{place}: another checkpoint (id {found}) is where the copy's base (id "
                                    f"{identity}) goes; a base is never overwritten: move it, or copy elsewhere")
    return False


@dataclass(frozen=True)
class _Transfer:
    """How one copy moves bytes: its rate limit (shared), read-back, files in flight and progress callback."""

    throttle: Throttle
    read_back: bool
    concurrency: int
    progress: Progress | None


class _Copied(NamedTuple):
    """What one layer's copy moved: chunk files, and their stored bytes (a packed layer's: its packs' bytes)."""

    objects: int
    stored_bytes: int


def _copy_layer(checkpoint: StoredCheckpoint, target: Location, overwrite: bool, transfer: _Transfer) -> _Copied:
    """Copy one checkpoint of a chain (its base, if any, is in place already), in its layout."""
    if checkpoint.packed is not None:
        return _copy_packed_layer(checkpoint, checkpoint.packed, target, overwrite, transfer)
    where = str(checkpoint.location)
    arrays = checked_arrays(checkpoint, where)
    with begin_write(target, overwrite) as transaction:
        encoding = transaction.key_encoding  # what the destination's writer needs (object storage: the generation)
        nodes: dict[str, JSON] = {}
        for path, node in checkpoint.nodes.items():
            if isinstance(node, dict) and node.get("node_type") == "array" \
                    and json_object(node.get("chunk_key_encoding")).get("name") != encoding:
                node = {**node, "chunk_key_encoding": {"name": encoding, "configuration": {"separator": "."}}}
            nodes[path] = node
        arrays = [ArrayCopy(a.path, a.key, a.source, nodes[a.path], a.present) for a in arrays]
        transaction.write_documents({path: json.dumps(node).encode() for path, node in nodes.items() if path})
        copier = FileCopier(checkpoint.location, checkpoint.node_kvstore(""), transaction.target,
                            throttle=transfer.throttle, read_back=transfer.read_back,
                            concurrency=transfer.concurrency, progress=transfer.progress)
        try:
            digests = copier.copy_arrays(arrays)
        except Exception as e:  # a chunk gone because the source was replaced meanwhile is not damage: say so
            checkpoint.raise_if_replaced(e)
            raise
        _check_digests(checkpoint, arrays, digests, where)
        checkpoint.check_unchanged()  # object storage: what was read is the checkpoint that was opened
        transaction.commit(checkpoint.manifest, _consolidated(nodes))
    return _Copied(copier.objects, copier.stored_bytes)


def _copy_packed_layer(checkpoint: StoredCheckpoint, packed: PackedChunks, target: Location, overwrite: bool,
                       transfer: _Transfer) -> _Copied:
    """Copy one packed checkpoint (spec §16): its packs under their names (each one file or object), then its index
    and references, the root document last. Its node metadata, manifest and tag stay the source's: the tag makes
    its pack names new at a destination holding another checkpoint, so replacing that one on object storage never
    writes over its packs (refused in the one case it would: the same names, see :func:`_refuse_same_packs`)."""
    where, layout = str(checkpoint.location), packed.layout
    arrays = checked_arrays(checkpoint, where)
    with begin_write(target, overwrite) as transaction:
        _refuse_same_packs(target, checkpoint)
        copier = PackCopier(packed, transaction.target, throttle=transfer.throttle, read_back=transfer.read_back,
                            concurrency=transfer.concurrency, progress=transfer.progress)
        try:
            table = checked_table(packed, [array.path for array in arrays], NOTHING_COPIED)
            digests = copier.copy_packs(arrays, table)
            index = read_index(packed, NOTHING_COPIED)
        except Exception as e:  # a pack gone because the source was replaced meanwhile is not damage: say so
            checkpoint.raise_if_replaced(e)
            raise
        _check_digests(checkpoint, arrays, digests, where)
        checkpoint.check_unchanged()  # object storage: what was read is the checkpoint that was opened
        transaction.write_file(layout.index_name, index)
        if sum(len(rows) for rows in table.rows.values()) <= settings().refs_max_chunks:  # as a save writes them
            transaction.write_file(REFS_NAME, references(checkpoint, table, layout.packs))
        transaction.commit(checkpoint.manifest, _consolidated(dict(checkpoint.nodes)))
    return _Copied(copier.objects, copier.stored_bytes)


def _refuse_same_packs(target: Location, checkpoint: StoredCheckpoint) -> None:
    """Refuse to replace a committed checkpoint at ``target`` that has packs or an index of the names the copy writes
    (two saves that drew the same tag, about one chance in 4 billion): on object storage writing them would damage
    it before the copy commits."""
    try:
        there = parse_root_document(target.read_root(), str(target))[0]
    except ArrayckptError:
        return  # nothing committed there (or damage, which the writer judged already)
    layout = checkpoint.manifest.packs
    if there.packs is None or layout is None or there.id == checkpoint.manifest.id:
        return
    mine = {pack.name for pack in layout.packs} | {layout.index_name}
    same = sorted(mine & ({pack.name for pack in there.packs.packs} | {there.packs.index_name}))
    if same:
        raise CheckpointExistsError(f"{target}: the committed checkpoint there (id {there.id}) has packs of the names "
                                    f"this copy writes (e.g. {same[0]}; saves drew the same tag): writing them would "
                                    "damage it before the copy commits; delete it first, or copy elsewhere")


def _check_digests(checkpoint: StoredCheckpoint, arrays: list[ArrayCopy], digests: Mapping[str, str],
                   where: str) -> None:
    recorded = checkpoint.manifest.chunk_digests
    for array in arrays:
        expected = recorded.get(array.path)
        if expected is not None and digests[array.path] != expected:
            raise CorruptCheckpointError(
                f"{where}: tensor {array.key!r}: the chunk files of array {array.path!r} do not hold the chunks "
                "saved there (each passes its own checksum, but their contents do not match the digest recorded "
                "at save): chunk files swapped, misplaced or copied from another checkpoint; nothing was copied")


def _consolidated(nodes: Mapping[str, JSON]) -> str:
    return "{" + ", ".join(f"{json.dumps(p)}: {json.dumps(n)}" for p, n in nodes.items()) + "}"
