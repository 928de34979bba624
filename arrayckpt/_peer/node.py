"""One node's memory directory: its memory steps, their records, what it holds intact, retention.

On disk (spec §15)::

    <directory>/node.json                     {"arrayckpt_peer_node": 1, "id": "<hex>", "root": "<manager root>"}
    <directory>/step-00000120/                a memory step: an arrayckpt checkpoint tree (every document, and the
                                              chunk files this node holds: its ranks' own and the replicas it got)
    <directory>/step-00000120.peer.json       the step's record (``record.py``), written last on each node: its
                                              commit there

A directory without its record is an interrupted memory save. Everything here is read as untrusted input: the
directory must be private (``private.py``); nothing is read or written through a link; a chunk file is used only when
it matches the step's record (which ties it to the step, not only to itself).
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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .._errors import ArrayckptError, CorruptCheckpointError, FormatError, StateError
from .._format.manifest import parse_root_document
from .._io.pools import map_kept
from .._io.smallfiles import read_checkpoint_file
from .._settings import settings
from .._storage.base import ROOT_METADATA, parse_root_bytes
from .._storage.files import directory_files, remove_arrayckpt_files
from .private import check_private, make_private
from .record import FileSum, StepRecord, sum_file

__all__ = ["NODE_FILE", "Holding", "NodeMemory", "is_own_file", "is_regular", "is_step_name", "last_written",
           "write_below"]

NODE_FILE = "node.json"
RECORD_SUFFIX = ".peer.json"
_STEP = re.compile(r"step-(\d{8,})")
_OWN_FILE = re.compile(r"step-\d{8,}\.peer\.json|\.(step-\d{8,}\.peer\.json|node\.json)\.[0-9a-f]{8}")  # + temporaries
_NODE_VERSION = 1

_ABSENT = "absent"  # a chunk file this node does not hold (not damage: another node may)


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
    ``node.json`` while its manager lives, so that clean-up elsewhere never removes a live job's memory.

    The directory is made private (mode 0700) and checked to be so when opened and before every survey
    (``private.py``); nothing below it is read or written through a link."""

    def __init__(self, directory: Path, root: str) -> None:
        self.directory = directory
        make_private(directory)
        self.id = self._identity(root)
        try:
            self._fd: int | None = os.open(directory / NODE_FILE, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise CorruptCheckpointError(f"{directory / NODE_FILE}: cannot open the memory directory's node file "
                                         f"({e.strerror}); remove it") from None
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)

    def _identity(self, root: str) -> str:
        """This directory's node id (made once, when the directory is first used)."""
        path = self.directory / NODE_FILE
        try:
            doc = json.loads(read_checkpoint_file(str(self.directory), NODE_FILE, str(path)))
            if isinstance(doc, dict) and doc.get("arrayckpt_peer_node") == _NODE_VERSION \
                    and isinstance(doc.get("id"), str):
                return str(doc["id"])
        except (FileNotFoundError, ValueError, ArrayckptError):
            pass
        ident = uuid.uuid4().hex
        _write_atomic(path, json.dumps({"arrayckpt_peer_node": _NODE_VERSION, "id": ident, "root": root}).encode())
        return ident

    def check(self) -> None:
        """Refuse the directory if another user could have changed it since it was opened (``private.py``)."""
        check_private(self.directory)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # --- steps ------------------------------------------------------------------------------------------------

    def step_path(self, step: int) -> Path:
        return self.directory / _step_name(step)

    def record_path(self, step: int) -> Path:
        return self.directory / f"{_step_name(step)}{RECORD_SUFFIX}"

    def listed_steps(self) -> list[int]:
        """Steps with a directory here, committed on this node or not."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_STEP.fullmatch, names) if m)

    def committed_steps(self) -> list[int]:
        """Steps whose record is here (committed on this node)."""
        return [s for s in self.listed_steps() if is_regular(self.record_path(s))]

    def commit(self, record: StepRecord) -> None:
        """Write the step's record: the step is committed on this node."""
        _write_atomic(self.record_path(record.step), record.to_json())

    def remove_step(self, step: int) -> None:
        """Remove a memory step: its record first (the node no longer offers it), then arrayckpt's files (a link in
        the step's place is removed itself, never followed)."""
        with contextlib.suppress(FileNotFoundError):
            self.record_path(step).unlink()
        path = self.step_path(step)
        if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
            path.unlink()
        else:
            remove_arrayckpt_files(path)

    def prepare_step(self, step: int) -> None:
        """An empty, new directory for memory step ``step`` (an earlier one of that number removed first); refuses
        when something that is not arrayckpt's is left in its place, which a save would otherwise write through or
        beside."""
        self.check()
        self.remove_step(step)
        path = self.step_path(step)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            keys, _, odd = directory_files(path)
            raise StateError(f"{path}: holds what is not arrayckpt's ({odd or (keys[0] if keys else 'a directory')}"
                             "), so no memory step is saved there; remove it") from None

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
        for path in sorted(documents, key=lambda p: (p == "", p)):
            self.write(step, f"{path}/{ROOT_METADATA}" if path else ROOT_METADATA, documents[path])

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
        relative = f"{_step_name(step)}/{array_path}/{key}"
        return read_checkpoint_file(str(self.directory), relative, f"{self.directory}/{relative}")

    def write_file(self, step: int, array_path: str, key: str, data: bytes | memoryview) -> None:
        """Write a chunk file of a step, replacing what is there (never through a link)."""
        self.write(step, f"{array_path}/{key}", data)

    def write(self, step: int, relative: str, data: bytes | memoryview) -> None:
        """Write the file ``relative`` of step ``step``'s tree (:func:`write_below`)."""
        write_below(self.directory, f"{_step_name(step)}/{relative}", data)

    # --- what is here, checked ----------------------------------------------------------------------------------

    def holdings(self) -> list[Holding]:
        """Every committed step here with the chunk files that match its record: each one's size and sums (read
        through ``mmap``, no copy, in parallel on the IO pool), so that a damaged file or a valid chunk file of
        another step is left out, with a warning naming it. A step whose record or root document cannot be read is
        left out with a warning. Refuses (``UntrustedDirectoryError``) a directory that is no longer private."""
        self.check()
        out = []
        for step in self.committed_steps():
            try:
                out.append(self._holding(step))
            except (ArrayckptError, OSError) as e:
                warnings.warn(f"{self.step_path(step)}: memory step not usable here ({e})", RuntimeWarning,
                              stacklevel=3)
        return out

    def _holding(self, step: int) -> Holding:
        where = str(self.step_path(step))
        root_bytes = read_checkpoint_file(str(self.directory), f"{_step_name(step)}/{ROOT_METADATA}",
                                          f"{where}/{ROOT_METADATA}")
        manifest, nodes = parse_root_document(parse_root_bytes(root_bytes, where), where)
        record_file = self.record_path(step)
        record = StepRecord.parse(read_checkpoint_file(str(self.directory), record_file.name, str(record_file)),
                                  nodes, str(record_file))
        if record.id != manifest.id or record.step != step:
            raise FormatError(f"{record_file}: names step {record.step} id {record.id}, the tree holds {manifest.id}")
        files = [(path, key, expected) for path, keys in record.files.items() for key, expected in keys.items()]
        found = map_kept("io", settings().io_threads, lambda file: self._check_file(step, *file), files)
        intact: dict[str, set[str]] = {path: set() for path in record.files}  # in parallel: a restore waits on it
        damaged = []
        for (path, key, _), problem in zip(files, found, strict=True):
            if problem is None:
                intact[path].add(key)
            elif problem is not _ABSENT:
                damaged.append(f"{path}/{key}{problem}")
        if damaged:
            warnings.warn(f"{where}: {len(damaged)} chunk file(s) damaged or not this step's (size, crc32c or "
                          f"trailer differ from the step's record), refused: {', '.join(damaged[:5])}; other copies "
                          "are used", RuntimeWarning, stacklevel=4)
        return Holding(step, record.id, record, root_bytes, {path: frozenset(keys) for path, keys in intact.items()})

    def _check_file(self, step: int, path: str, key: str, expected: FileSum) -> str | None:
        """``None`` when the chunk file is here and matches the record, :data:`_ABSENT` when it is not here, else
        what the warning says after its name."""
        relative = f"{_step_name(step)}/{path}/{key}"
        try:
            found = sum_file(str(self.directory), relative, expected.size)
        except FileNotFoundError:
            return _ABSENT
        except (ArrayckptError, OSError) as e:
            return f" ({e})"
        return None if found == expected else ""

    # --- clean-up ---------------------------------------------------------------------------------------------

    def clean_up(self, min_age_s: float) -> list[str]:
        """Remove interrupted memory saves here (a step directory without its record, untouched for ``min_age_s``)."""
        self.check()
        removed = []
        now = time.time()
        committed = set(self.committed_steps())
        for step in self.listed_steps():
            path = self.step_path(step)
            if step not in committed and last_written(path, now) >= min_age_s:
                self.remove_step(step)
                if not os.path.lexists(path):
                    removed.append(str(path))
        return removed


def write_below(directory: Path, relative: str, data: bytes | memoryview) -> None:
    """Write the file ``relative`` below ``directory``, replacing what is there: its directories made as needed
    (mode 0700), no link followed at any level (one in a directory's place is refused), the file created anew
    (``O_EXCL | O_NOFOLLOW``, mode 0600)."""
    folder, _, name = relative.rpartition("/")
    path = directory
    for segment in folder.split("/") if folder else []:
        path = path / segment
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        if not stat.S_ISDIR(os.lstat(path).st_mode):  # a link (or a file) where a directory must be
            raise CorruptCheckpointError(f"{path}: not a directory (a link?); arrayckpt never writes through a link "
                                         "in a memory directory: remove it")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path / name)
    fd = os.open(path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with open(fd, "wb") as f:
        f.write(data)


def is_step_name(name: str) -> bool:
    """Whether ``name`` is a memory step's directory name."""
    return _STEP.fullmatch(name) is not None


def is_own_file(name: str) -> bool:
    """Whether ``name`` is a step record's, or a temporary file's of a record or of ``node.json``."""
    return _OWN_FILE.fullmatch(name) is not None


def _step_name(step: int) -> str:
    return f"step-{step:08d}"


def is_regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not through a link)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def last_written(path: Path, now: float) -> float:
    """Seconds since anything below ``path`` was last written."""
    try:
        _, newest, _ = directory_files(path)
    except FileNotFoundError:
        return float("inf")
    return max(0.0, now - newest)


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: a new temporary file beside it (never through a link), renamed over it (a
    link in its place is replaced, not followed)."""
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with open(fd, "wb") as f:
            f.write(data)
        os.replace(temp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
