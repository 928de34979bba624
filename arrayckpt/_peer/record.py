"""A memory step's record (``step-N.peer.json``, spec §15): every chunk file of the step with what its bytes must be,
and the check of a file against it.

Each file's entry is ``[size, crc32c of all bytes but the last four, the last four]``. Why not the crc32c of the
whole file (record version 1): every chunk file ends with the crc32c of what precedes it (a shard file: every inner
chunk and the index do), and the crc32c of bytes followed by their own crc32c is the same constant for every input,
so it could not tell a valid chunk file of another step (or job) from this step's, and a restore loaded it silently.
The crc32c of the bytes before the trailer identifies the content; the trailer, compared too, makes the check cover
every byte. A record is untrusted input: its keys must be chunk keys of the step's own arrays, every chunk listed
once, every number in range.
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

import crc32c

from .._errors import CorruptCheckpointError, FormatError
from .._format.jsontypes import JSON
from .._format.zarr import grid_counts, parse_chunk_key
from .._io.smallfiles import check_no_links

__all__ = ["FileSum", "Files", "StepRecord", "file_sum", "sum_file"]

_VERSION = 2  # of the step record: 2 identifies each file's content (module docstring); 1 is refused
_TRAILER = 4  # bytes of the crc32c that ends every chunk file

Files = dict[str, dict[str, "FileSum"]]  # array path -> chunk key -> its size and sums


@dataclass(frozen=True)
class FileSum:
    """What a chunk file's bytes must be: its size, the crc32c of all its bytes but the last four (which identifies
    its content), and those last four (its own trailing crc32c) as a little-endian integer."""

    size: int
    body: int
    tail: int


def file_sum(data: bytes | memoryview | mmap.mmap) -> FileSum:
    """The :class:`FileSum` of a chunk file's bytes (one pass of crc32c, no copy)."""
    size = len(data)
    if size < _TRAILER:
        return FileSum(size, crc32c.crc32c(data), 0)
    view = memoryview(data)
    try:
        return FileSum(size, crc32c.crc32c(view[:size - _TRAILER]), int.from_bytes(view[size - _TRAILER:], "little"))
    finally:
        view.release()


def _unique_members(pairs: list[tuple[str, object]]) -> JSON:
    """A JSON object's members, refusing a name given twice (JSON keeps the last: a damaged key could hide a file)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError(f"a member is named twice in one object ({len(pairs) - len(out)} repeat(s))")
    return out


@dataclass(frozen=True)
class StepRecord:
    """``step-N.peer.json``: what a memory step holds across all nodes (see the module docstring)."""

    step: int
    id: str
    world_size: int
    files: Files

    def to_json(self) -> bytes:
        files = {path: {key: [s.size, s.body, s.tail] for key, s in keys.items()} for path, keys in self.files.items()}
        return json.dumps({"arrayckpt_peer_step": _VERSION, "step": self.step, "id": self.id,
                           "world_size": self.world_size, "files": files}, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes, nodes: Mapping[str, JSON], where: str) -> StepRecord:
        """The record in ``data``, each key checked to be a chunk key of an array among ``nodes`` (the step's
        consolidated metadata) and every chunk of every array listed; ``FormatError`` naming ``where`` otherwise."""
        try:
            doc = json.loads(data, object_pairs_hook=_unique_members)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{where}: not JSON ({e})") from None
        version = doc.get("arrayckpt_peer_step") if isinstance(doc, dict) else None
        if version == 1:
            raise FormatError(f"{where}: a memory step record of version 1 (an older arrayckpt), whose sums cannot "
                              "tell a chunk file of another step from this one's: not used")
        if version != _VERSION:
            raise FormatError(f"{where}: not a memory step record of version {_VERSION}")
        step, ident, world, raw = doc.get("step"), doc.get("id"), doc.get("world_size"), doc.get("files")
        if type(step) is not int or not isinstance(ident, str) or type(world) is not int or world < 1 \
                or not isinstance(raw, dict):
            raise FormatError(f"{where}: malformed step, id, world_size or files")
        files: Files = {}
        for path, keys in raw.items():
            metadata = nodes.get(path)
            if not isinstance(metadata, dict) or metadata.get("node_type") != "array" or not isinstance(keys, dict):
                raise FormatError(f"{where}: {path!r} is not an array of the step")
            files[path] = {}
            for key, value in keys.items():
                if not isinstance(key, str) or parse_chunk_key(metadata, key) is None:
                    raise FormatError(f"{where}: {path}/{key!r} is not a chunk key of that array")
                if not (isinstance(value, list) and len(value) == 3 and all(type(v) is int for v in value)
                        and value[0] >= _TRAILER and 0 <= value[1] < 2**32 and 0 <= value[2] < 2**32):
                    raise FormatError(f"{where}: {path}/{key}: malformed [size, crc32c, trailer]")
                files[path][key] = FileSum(*value)
        _check_whole(files, nodes, where)
        return cls(step, ident, world, files)


def _check_whole(files: Files, nodes: Mapping[str, JSON], where: str) -> None:
    """Refuse a record that leaves out a chunk of the step (a memory step stores every chunk of every array): a file
    it does not list would be loaded unchecked."""
    for path, metadata in nodes.items():
        if not isinstance(metadata, dict) or metadata.get("node_type") != "array":
            continue
        count = 1
        for n in grid_counts(metadata):
            count *= n
        if len(files.get(path, {})) != count:
            raise FormatError(f"{where}: lists {len(files.get(path, {}))} chunk file(s) of array {path!r}, which "
                              f"has {count}: not this step's record")


def sum_file(directory: str, relative: str, size: int) -> FileSum | None:
    """The :class:`FileSum` of the regular file ``relative`` below ``directory`` (no link followed at any level),
    read through ``mmap``; ``None`` when its size is not ``size`` (not read then). ``FileNotFoundError`` when it
    is absent."""
    check_no_links(directory, relative.rpartition("/")[0], f"{directory}/{relative}")
    fd = os.open(f"{directory}/{relative}", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(f"{directory}/{relative}: not a regular file")
        if info.st_size != size:
            return None
        if size < _TRAILER:
            return file_sum(os.pread(fd, size, 0))
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapped:
            return file_sum(mapped)
    finally:
        os.close(fd)
