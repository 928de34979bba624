"""One node's memory directory: its memory steps, their file lists, what it holds intact, retention and clean-up.

On disk (spec §15)::

    <directory>/node.json                     {"arrayckpt_peer_node": 1, "id": "<hex>", "root": "<manager root>"}
    <directory>/step-00000120/                a memory step: an arrayckpt checkpoint tree (every document, and the
                                              chunk files this node holds: its ranks' own and the replicas it got)
    <directory>/step-00000120.peer.json       the step's record, written last on each node: its commit there

The record names the step, its checkpoint id, the world size that saved it, and every chunk file of the whole step
(array path -> chunk key -> ``[size, crc32c of the file's bytes]``), so that each node can tell which of its files
are intact and the survivors can tell whether they hold the step whole. A directory without its record is an
interrupted memory save. Everything here is read as untrusted input: keys must be chunk keys of the step's own
arrays (so no path leaves the directory), files must be regular files (no links), sizes and crcs must match.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import stat
import time
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import crc32c

from .._errors import ArrayckptError, FormatError
from .._format.manifest import parse_root_document
from .._format.zarr import parse_chunk_key
from .._io.fastio import IO_THREADS, check_no_links, read_checkpoint_file
from .._io.pools import map_kept
from .._storage.base import ROOT_METADATA, parse_root_bytes
from .._storage.files import directory_files, remove_arrayckpt_files

__all__ = ["NODE_FILE", "FileSum", "Holding", "NodeMemory", "StepRecord", "ended_memory_directories", "file_sum",
           "remove_memory_directory"]

NODE_FILE = "node.json"
RECORD_SUFFIX = ".peer.json"
_STEP = re.compile(r"step-(\d{8,})")
_VERSION = 1

Files = dict[str, dict[str, "FileSum"]]  # array path -> chunk key -> its size and crc


@dataclass(frozen=True)
class FileSum:
    """A chunk file's size and the crc32c of its bytes as stored (not of its decoded content)."""

    size: int
    crc: int


_ABSENT = "absent"  # a chunk file this node does not hold (not damage: another node may)


def file_sum(data: bytes | memoryview) -> FileSum:
    return FileSum(len(data), crc32c.crc32c(data))


@dataclass(frozen=True)
class StepRecord:
    """``step-N.peer.json``: what a memory step holds across all nodes (see the module docstring)."""

    step: int
    id: str
    world_size: int
    files: Files

    def to_json(self) -> bytes:
        files = {path: {key: [s.size, s.crc] for key, s in keys.items()} for path, keys in self.files.items()}
        return json.dumps({"arrayckpt_peer_step": _VERSION, "step": self.step, "id": self.id,
                           "world_size": self.world_size, "files": files}, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, data: bytes, nodes: Mapping[str, Any], where: str) -> StepRecord:
        """The record in ``data``, each key checked to be a chunk key of an array among ``nodes`` (the step's
        consolidated metadata); ``FormatError`` naming ``where`` otherwise."""
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise FormatError(f"{where}: not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("arrayckpt_peer_step") != _VERSION:
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
                if not (isinstance(value, list) and len(value) == 2 and all(type(v) is int and v >= 0 for v in value)):
                    raise FormatError(f"{where}: {path}/{key}: malformed [size, crc]")
                files[path][key] = FileSum(value[0], value[1])
        return cls(step, ident, world, files)


@dataclass(frozen=True)
class Holding:
    """One memory step as one node holds it: its record, root document, and the chunk files found intact."""

    step: int
    id: str
    record: StepRecord
    root_document: bytes
    intact: dict[str, frozenset[str]]  # array path -> chunk keys whose file matches the record


class NodeMemory:
    """One node's memory directory (see the module docstring). Every rank of the node holds a shared ``flock`` on its
    ``node.json`` while its manager lives, so that clean-up elsewhere never removes a live job's memory."""

    def __init__(self, directory: Path, root: str) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.id = self._identity(root)
        self._fd: int | None = os.open(directory / NODE_FILE, os.O_RDONLY)
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)

    def _identity(self, root: str) -> str:
        """This directory's node id (made once, when the directory is first used)."""
        path = self.directory / NODE_FILE
        try:
            doc = json.loads(read_checkpoint_file(str(self.directory), NODE_FILE, str(path)))
            if isinstance(doc, dict) and doc.get("arrayckpt_peer_node") == _VERSION and isinstance(doc.get("id"), str):
                return str(doc["id"])
        except (FileNotFoundError, ValueError, ArrayckptError):
            pass
        ident = uuid.uuid4().hex
        _write_atomic(path, json.dumps({"arrayckpt_peer_node": _VERSION, "id": ident, "root": root}).encode())
        return ident

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # --- steps ------------------------------------------------------------------------------------------------

    def step_path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}"

    def record_path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}{RECORD_SUFFIX}"

    def listed_steps(self) -> list[int]:
        """Steps with a directory here, committed on this node or not."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_STEP.fullmatch, names) if m)

    def committed_steps(self) -> list[int]:
        """Steps whose record is here (committed on this node)."""
        return [s for s in self.listed_steps() if self.record_path(s).is_file()]

    def commit(self, record: StepRecord) -> None:
        """Write the step's record: the step is committed on this node."""
        _write_atomic(self.record_path(record.step), record.to_json())

    def remove_step(self, step: int) -> None:
        """Remove a memory step: its record first (the node no longer offers it), then arrayckpt's files."""
        with contextlib.suppress(FileNotFoundError):
            self.record_path(step).unlink()
        remove_arrayckpt_files(self.step_path(step))

    def apply_retention(self, keep: int) -> list[int]:
        """Remove every step but the newest ``keep`` committed ones (and incomplete ones older than those)."""
        committed = self.committed_steps()
        kept = set(committed[-keep:])
        newest = max(kept, default=None)
        doomed = [s for s in self.listed_steps() if s not in kept and (newest is None or s < newest)]
        for step in doomed:
            self.remove_step(step)
        return doomed

    def write_documents(self, step: int, documents: Mapping[str, bytes]) -> None:
        """Write a step's node documents (node path -> ``zarr.json`` bytes; ``""`` is the root, written last)."""
        base = self.step_path(step)
        for path in sorted(documents, key=lambda p: (p == "", p)):
            directory = base / path if path else base
            directory.mkdir(parents=True, exist_ok=True)
            (directory / ROOT_METADATA).write_bytes(documents[path])

    def read_documents(self, step: int) -> dict[str, bytes]:
        """A step's documents as stored here: node path -> ``zarr.json`` bytes (``""``: the root document)."""
        where = str(self.step_path(step))
        root = read_checkpoint_file(where, ROOT_METADATA, f"{where}/{ROOT_METADATA}")
        _, nodes = parse_root_document(parse_root_bytes(root, where), where)
        out = {"": root}
        for node_path in nodes:
            with contextlib.suppress(FileNotFoundError):
                out[node_path] = read_checkpoint_file(where, f"{node_path}/{ROOT_METADATA}", f"{where}/{node_path}")
        return out

    def read_file(self, step: int, array_path: str, key: str) -> bytes:
        """A chunk file of a step (no link followed; ``FileNotFoundError`` when absent)."""
        relative = f"{array_path}/{key}"
        return read_checkpoint_file(str(self.step_path(step)), relative, f"{self.step_path(step)}/{relative}")

    def write_file(self, step: int, array_path: str, key: str, data: bytes | memoryview) -> None:
        """Write a chunk file of a step, replacing what is there (never through a link)."""
        root = str(self.step_path(step))
        directory = self.step_path(step) / array_path
        directory.mkdir(parents=True, exist_ok=True)
        check_no_links(root, array_path, f"{root}/{array_path}")
        path = directory / key
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with open(fd, "wb") as f:
            f.write(data)

    # --- what is here, checked ----------------------------------------------------------------------------------

    def holdings(self, read: bool = True) -> list[Holding]:
        """Every committed step here with the chunk files that match its record (read and checksummed: a damaged
        or missing file is left out, with a warning naming it). A step whose record or root document cannot be
        read is left out with a warning.

        ``read=False`` checks each file's size only (a regular file, no link on its way): for a restore, whose load
        checks every chunk's crc32c anyway and, when one fails, surveys again reading everything — reading every
        file here first would read the step twice."""
        out = []
        for step in self.committed_steps():
            try:
                out.append(self._holding(step, read))
            except (ArrayckptError, OSError) as e:
                warnings.warn(f"{self.step_path(step)}: memory step not usable here ({e})", RuntimeWarning,
                              stacklevel=3)
        return out

    def _holding(self, step: int, read: bool = True) -> Holding:
        where = str(self.step_path(step))
        root_bytes = read_checkpoint_file(where, ROOT_METADATA, f"{where}/{ROOT_METADATA}")
        manifest, nodes = parse_root_document(parse_root_bytes(root_bytes, where), where)
        record_file = self.record_path(step)
        record = StepRecord.parse(read_checkpoint_file(str(self.directory), record_file.name, str(record_file)),
                                  nodes, str(record_file))
        if record.id != manifest.id or record.step != step:
            raise FormatError(f"{record_file}: names step {record.step} id {record.id}, the tree holds {manifest.id}")
        files = [(path, key, expected) for path, keys in record.files.items() for key, expected in keys.items()]
        found = map_kept("io", IO_THREADS, lambda file: self._check_file(step, *file, read), files)
        intact: dict[str, set[str]] = {path: set() for path in record.files}  # in parallel: a restore waits on it
        damaged = []
        for (path, key, _), problem in zip(files, found, strict=True):
            if problem is None:
                intact[path].add(key)
            elif problem is not _ABSENT:
                damaged.append(f"{path}/{key}{problem}")
        if damaged:
            warnings.warn(f"{where}: {len(damaged)} chunk file(s) damaged (size or crc32c differ from the step's "
                          f"record), refused: {', '.join(damaged[:5])}; other copies are used", RuntimeWarning,
                          stacklevel=4)
        return Holding(step, record.id, record, root_bytes, {path: frozenset(keys) for path, keys in intact.items()})

    def _check_file(self, step: int, path: str, key: str, expected: FileSum, read: bool) -> str | None:
        """``None`` when the chunk file is here and matches the record (``read``: its size and crc32c, else its
        size), :data:`_ABSENT` when it is not here, else what the warning says after its name."""
        try:
            if read:
                return None if file_sum(self.read_file(step, path, key)) == expected else ""
            root, relative = str(self.step_path(step)), f"{path}/{key}"
            check_no_links(root, relative, f"{root}/{relative}")
            found = os.lstat(f"{root}/{relative}")
        except FileNotFoundError:
            return _ABSENT
        except (ArrayckptError, OSError) as e:
            return f" ({e})"
        if not stat.S_ISREG(found.st_mode):
            return " (not a regular file)"
        return None if found.st_size == expected.size else ""

    # --- clean-up ---------------------------------------------------------------------------------------------

    def clean_up(self, min_age_s: float) -> list[str]:
        """Remove interrupted memory saves here (a step directory without its record, untouched for ``min_age_s``),
        and the memory directories of ended jobs beside this one (see :func:`remove_memory_directory`)."""
        removed = []
        now = time.time()
        committed = set(self.committed_steps())
        for step in self.listed_steps():
            path = self.step_path(step)
            if step not in committed and _age(path, now) >= min_age_s:
                remove_arrayckpt_files(path)
                removed.append(str(path))
        return removed + ended_memory_directories(self.directory.parent, min_age_s, remove=True)


def ended_memory_directories(parent: Path, min_age_s: float, remove: bool) -> list[str]:
    """The memory directories of ended jobs right below ``parent`` (see :func:`remove_memory_directory`), removed
    when ``remove`` (else only found: ``gc --dry-run``); a live job's (its ranks hold ``node.json``) never."""
    try:
        children = sorted(parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [str(child) for child in children
            if (child / NODE_FILE).is_file() and remove_memory_directory(child, min_age_s, dry_run=not remove)]


def remove_memory_directory(directory: Path, min_age_s: float, dry_run: bool = False) -> bool:
    """Remove a memory directory of an ended job: one with arrayckpt's ``node.json`` that no live manager holds (its
    shared ``flock``) and where nothing was written for ``min_age_s``. Only arrayckpt's files go (node.json, records,
    step trees); the directory stays if anything else is in it. Whether it was removed (with ``dry_run``: whether
    it would be, nothing removed)."""
    if directory.is_symlink() or not directory.is_dir():
        return False
    with _exclusive(directory / NODE_FILE) as free:
        if not free or _age(directory, time.time()) < min_age_s:
            return False
        if dry_run:
            return True
        for name in sorted(os.listdir(directory)):
            path = directory / name
            if _STEP.fullmatch(name) and path.is_dir() and not path.is_symlink():
                remove_arrayckpt_files(path)
            elif name.endswith(RECORD_SUFFIX) and _STEP.fullmatch(name.removesuffix(RECORD_SUFFIX)) \
                    and path.is_file() and not path.is_symlink():
                path.unlink()
        (directory / NODE_FILE).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        directory.rmdir()
    return not directory.exists()


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[bool]:
    """Whether nobody holds ``path`` (an exclusive ``flock`` taken without waiting), held for the block."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def _age(path: Path, now: float) -> float:
    """Seconds since anything below ``path`` was last written."""
    try:
        _, newest, _ = directory_files(path)
    except FileNotFoundError:
        return float("inf")
    return max(0.0, now - newest)


def _write_atomic(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    temp.write_bytes(data)
    os.replace(temp, path)
