"""A local save committed into a directory that holds files of the user's, keeping them: DCP's semantics, where
``FileSystemWriter`` adds its files to whatever a directory holds (``torch.save(sd, d + "/model.pt")`` then
``dcp.save(..., checkpoint_id=d)``). Used only when the save asks for it (``LocalLocation.open_writer(...,
beside=...)``: ``arrayckpt.dcp.ArrayckptWriter``); ``arrayckpt.save`` refuses such a directory.

The checkpoint is written into the save's temporary sibling as always and made durable; then, at the commit
(:func:`commit_beside`), its top-level entries are moved into the directory one by one, the root ``zarr.json`` last
(so a loader finds the new checkpoint whole or none). What the directory already holds is never deleted. A name the
new checkpoint needs that holds anything else is refused before anything is moved or removed.

A committed arrayckpt checkpoint there is kept: the save is refused (:func:`refuse_shared_checkpoint`, at the
writer's opening and again at the commit) unless it asked to replace it (``Beside.REPLACE_CHECKPOINT`` with
``overwrite``: ``ArrayckptWriter(..., overwrite=True)`` given explicitly). Then it goes first — its root
``zarr.json``, then the arrayckpt files (``remove_arrayckpt_files``) of its top-level nodes, as its root document
names them (a packed one, spec §16: its ``packs`` folder and its ``refs.json``), where they hold nothing else;
another checkpoint in a subdirectory is never one of them. What that replacement costs against one in a directory of
its own (``local.py``), and why it is never a default: between the removal of the old root document and the new
one's rename the directory loads as no checkpoint, so a kill there leaves neither (and the next save there is
refused, naming the new nodes left in the way, until they are removed; ``arrayckpt.gc`` does not touch the
directory); and a reader of the old checkpoint that is reading meanwhile reads from the same directory, so its
chunks' checksums fail rather than mix.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import NoReturn

from .._errors import CheckpointExistsError, CorruptCheckpointError
from .._format.jsontypes import member
from .._format.manifest import MANIFEST_ATTRIBUTE, is_arrayckpt_root
from .._format.marker import MARKER_NAME
from .._format.packs import PACK_PREFIX, REFS_NAME, is_pack_key
from .._io.smallfiles import read_regular_file
from .base import ROOT_METADATA, arrayckpt_keys
from .files import directory_files, holds_marker, remove_arrayckpt_files, remove_marker
from .renames import fsync_dir, rename_noreplace

__all__ = ["checkpoint_nodes", "commit_beside", "refuse_shared_checkpoint"]

_PACKS = PACK_PREFIX.rstrip("/")  # a packed checkpoint's folder of packs and index (spec §16.1)


def checkpoint_nodes(target: Path) -> set[str]:
    """The top-level names of the checkpoint committed in ``target``: its nodes (its root document's consolidated
    metadata), or for a packed one (spec §16.1) its packs folder and references, and its DCP marker (spec §2.1) when
    the ``.metadata`` there is arrayckpt's; none when there is none or it cannot tell: then nothing of it is removed,
    and a name the new checkpoint needs is refused."""
    nodes = _checkpoint_nodes(target)
    return nodes | {MARKER_NAME} if nodes and holds_marker(target) else nodes


def _checkpoint_nodes(target: Path) -> set[str]:
    try:
        document = json.loads(read_regular_file(target / ROOT_METADATA, ROOT_METADATA, follow=False))
        if not is_arrayckpt_root(document):
            return set()
        if member(document, "attributes", MANIFEST_ATTRIBUTE, "packs") is not None:
            return {_PACKS, REFS_NAME}
        nodes = member(document, "consolidated_metadata", "metadata")
    except (OSError, ValueError, KeyError, TypeError, RecursionError, CorruptCheckpointError):
        return set()
    return {str(path).split("/")[0] for path in nodes} if isinstance(nodes, dict) else set()


def refuse_shared_checkpoint(where: str, others: list[str], nodes: set[str]) -> NoReturn:
    """Refuse to replace the committed checkpoint in a directory that holds the user's files ``others`` (one line):
    its replacement there is not atomic, so it is replaced only where the save asked for that explicitly."""
    shown = ", ".join(map(repr, [ROOT_METADATA, *sorted(nodes)][:4]))
    held = f"{', '.join(map(repr, others[:3]))}{' ...' if len(others) > 3 else ''}"
    raise CheckpointExistsError(
        f"{where}: the directory holds a committed arrayckpt checkpoint beside other files ({held}), kept because "
        f"replacing it in a shared directory is not atomic; save to another directory, or remove the old checkpoint "
        f"({shown}) first, or pass overwrite=True explicitly (ArrayckptWriter) to replace it in place")


def _holds_only_arrayckpt_files(path: Path) -> bool:
    """Whether ``path`` is a directory (not a link) whose every file is shaped like arrayckpt's, and nothing else
    (no link, FIFO, ...); or a packed checkpoint's references (a regular file)."""
    if path.name == REFS_NAME:
        return path.is_file() and not path.is_symlink()
    if path.is_symlink() or not path.is_dir():
        return False
    keys, _, odd = directory_files(path)
    return odd is None and len(arrayckpt_keys([f"{path.name}/{key}" for key in keys])) == len(keys)


def _remove_old(path: Path) -> None:
    """Remove the old checkpoint's top-level entry ``path``: its arrayckpt files, then the folders left empty."""
    if path.name == REFS_NAME:
        os.unlink(path)
    elif path.name == _PACKS:  # (its packs and index: their names are arrayckpt's only below the checkpoint)
        for key in directory_files(path)[0]:
            if is_pack_key(f"{_PACKS}/{key}"):
                os.unlink(path / key)
        os.rmdir(path)
    else:
        remove_arrayckpt_files(path)


def commit_beside(temporary: Path, target: Path, where: str, fsync: bool, replace: bool) -> None:
    """Move the checkpoint written (and made durable) in ``temporary`` into the directory ``target``, keeping what
    else ``target`` holds (see the module docstring); ``temporary`` is removed. Raises ``CheckpointExistsError``,
    with nothing moved or removed, when one of its names is taken by something that is not the old checkpoint's, or
    when a checkpoint is committed there (one committed since the save began) and not ``replace``."""
    new = sorted(name for name in os.listdir(temporary) if name != ROOT_METADATA)
    nodes = checkpoint_nodes(target)
    if not replace and os.path.lexists(target / ROOT_METADATA):
        refuse_shared_checkpoint(where, sorted(set(os.listdir(target)) - nodes - {ROOT_METADATA}), nodes)
    old = {name for name in nodes if _holds_only_arrayckpt_files(target / name)}
    taken = [name for name in new if os.path.lexists(target / name) and name not in old]
    if taken:
        raise CheckpointExistsError(
            f"{where}: the directory holds {taken[:3]}, which the checkpoint needs for its keys (its top-level nodes) "
            "and which are not the old checkpoint's; move them away, or save to another directory")
    root = target / ROOT_METADATA
    if os.path.lexists(root):  # the old checkpoint goes first (its marker, then its root document): the directory
        remove_marker(target)  # loads as neither, and is found as no checkpoint, until the commit
        os.unlink(root)
        fsync_dir(target)
    for name in old:  # its nodes (only arrayckpt's files; the user's stay)
        _remove_old(target / name)
    for name in new:
        if not rename_noreplace(temporary / name, target / name):
            raise CheckpointExistsError(f"{where}: {name!r} appeared in the directory during the commit; nothing "
                                        "committed (the new checkpoint's other nodes are in place: save again)")
    if fsync:
        fsync_dir(target)
    if not rename_noreplace(temporary / ROOT_METADATA, root):
        raise CheckpointExistsError(f"{where}: a {ROOT_METADATA} appeared in the directory during the commit; "
                                    "nothing committed")
    if fsync:
        fsync_dir(target)
    shutil.rmtree(temporary, ignore_errors=True)
