"""One write transaction: a checkpoint appears at its location whole, or not at all.

Every writer (``save``'s coordinator, ``write_streaming``, ``compact``) runs the same sequence over the
storage ``Writer`` (``_storage/base.py``)::

    transaction = begin_write(location, overwrite)  # opens the writer: refuses to replace a committed
                                                    #   checkpoint without overwrite; nothing visible changes
    plan = with_key_encoding(plan, transaction.key_encoding)
    transaction.write_documents(plan.documents)     # array/group zarr.json documents, in the background
    ... the data is written into transaction.target (by this process, or by every rank) ...
    transaction.commit(manifest, consolidated_json) # waits for the documents, then the root document, last
    transaction.abort()                             # instead, on any failure: waits for the documents (nothing
                                                    #   may still be writing into what is removed), then
                                                    #   removes what this save wrote

Used as a context manager (``with begin_write(location, overwrite) as transaction:``) a failure in the body
(any exception, ``KeyboardInterrupt`` included) aborts and propagates, and a body that ends without committing
aborts too. ``save`` cannot use ``with``, as its transaction spans collectives: the coordinator begins it when
it has planned, and commits or aborts it once every rank has reported (it aborts as well when a rank dies
mid-save, or when anything else fails before the commit). Aborting a committed or aborted transaction does
nothing, so "abort on any failure" needs no bookkeeping of how far a save got. Nor does aborting a commit that
was interrupted (``KeyboardInterrupt``, ``SystemExit``) inside the storage's commit: whether it took effect is
unknown, and removing the save could damage the checkpoint just committed (on object storage its chunks are
"what this save wrote"); what is left is an incomplete save, for ``arrayckpt.gc``. A storage commit that
*raises an error* did not take effect, or knows that it cannot tell (then its abort removes nothing).

The check before the commit (``Writer.missing``) is the last line of defence against a save's files removed after
the ranks reported them written (a gc that ignored the save's lock or lease, spec §9.4; a person): the chunk keys
come from the manifest and the consolidated metadata (every chunk of every array; a chunks delta's present ones),
so a save never commits chunks it cannot see. Its cost: naming the keys (1–3 µs each), then one directory listing
per node locally, or one LIST per 1,000 objects on object storage. For 10,000 chunks in 10 arrays (tmpfs, 2 busy
cores): 25 ms to name them and 50 ms to list them, beside a save of 7.8 s; on S3, 10 LISTs beside 10,000 PUTs.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from .._errors import ArrayckptError, StorageError
from .._format.jsontypes import JSON
from .._format.manifest import Manifest, encode_root_document
from .._format.zarr import chunk_keys, grid_counts, unravel

if TYPE_CHECKING:
    from .._storage.base import Beside, Location, Writer

__all__ = ["WriteTransaction", "begin_write", "stored_chunk_keys"]


def begin_write(location: Location, overwrite: bool, beside: Beside | None = None) -> WriteTransaction:
    """Begin one save to ``location``. Raises ``CheckpointExistsError`` when a committed
    checkpoint is there and ``overwrite`` is false, or when something that is not arrayckpt's is in the way (unless
    ``beside`` says to keep it: see ``Location.open_writer``)."""
    return WriteTransaction(location.open_writer(overwrite, beside))


class WriteTransaction:
    """One save to one location, from an open storage writer to its commit or abort (see the module docstring)."""

    def __init__(self, writer: Writer) -> None:
        self._writer = writer
        self._wait: Callable[[], None] | None = None  # waits for the documents written in the background
        self._state = "open"  # "open", then "committed" or "aborted" ("committing" while the storage commits)

    @property
    def location(self) -> Location:
        """Where the checkpoint appears at the commit."""
        return self._writer.location

    @property
    def target(self) -> Location:
        """Where the data is written (may differ from :attr:`location`: a temporary directory)."""
        return self._writer.target

    @property
    def key_encoding(self) -> str:
        """The Zarr chunk key encoding the save's arrays must use (``with_key_encoding``)."""
        return self._writer.key_encoding

    def write_documents(self, documents: Mapping[str, bytes]) -> None:
        """Start writing the serialised ``zarr.json`` of every array and group (node path -> bytes) in the
        background; :meth:`commit` and :meth:`abort` wait for them."""
        self._check_open("write documents in")
        if self._wait is not None:
            raise RuntimeError("the documents of a save are written once")
        self._wait = self._writer.write_documents(documents)

    def write_file(self, name: str, data: bytes) -> None:
        """Write the file ``name`` of a packed checkpoint (its index, its references) before the commit."""
        self._check_open("write a file in")
        self._writer.write_file(name, data)

    def commit(self, manifest: Manifest, consolidated_json: str) -> None:
        """Wait for the documents, then write the root document (``manifest`` and the consolidated metadata):
        the commit. Raises ``StorageError`` (or the storage's ``ArrayckptError``) when the documents or the
        commit failed; the transaction is then still open, to be aborted."""
        self._check_open("commit")
        self._wait_for_documents()
        gone = self._writer.missing(stored_files(manifest, consolidated_json))
        if gone:
            raise StorageError(f"{self.location}: not committed: {len(gone)} file(s) this save wrote are gone from "
                               f"{self.target} (e.g. {', '.join(gone[:3])}): removed after they were written, by "
                               "something that ignored the save's lock or lease (an old arrayckpt gc, a person); "
                               "save again")
        root_document = encode_root_document(manifest, consolidated_json)
        self._state = "committing"  # stays so if interrupted inside the storage's commit: outcome unknown
        try:
            self._writer.commit(root_document)
        except Exception as e:  # the storage's commit failed: it did not take effect (see the module docstring)
            self._state = "open"
            if isinstance(e, OSError) and not isinstance(e, ArrayckptError):
                raise StorageError(f"{self.location}: commit failed: {e}") from e
            raise
        self._state = "committed"

    def abort(self) -> None:
        """Remove what this save wrote, once the documents written in the background are done (their own
        failure is no news then); a committed checkpoint it was going to replace stays whole. Nothing once
        committed or aborted, or after a commit that was interrupted. Never raises for a failed clean-up (the
        storage warns)."""
        if self._state != "open":
            return
        self._state = "aborted"
        try:
            self._wait_for_documents()
        except Exception:  # the save is being undone: the error that undoes it is the one raised
            pass
        finally:
            self._writer.abort()

    def __enter__(self) -> WriteTransaction:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # nothing after a commit; else the body failed, or forgot to commit: undo

    def _wait_for_documents(self) -> None:
        wait, self._wait = self._wait, None
        if wait is not None:
            wait()

    def _check_open(self, what: str) -> None:
        if self._state != "open":
            raise RuntimeError(f"{self.location}: cannot {what} a save that was {self._state}")


def stored_files(manifest: Manifest, consolidated_json: str) -> dict[str, list[str]]:
    """The files (objects) the commit of ``manifest`` needs, by directory: a packed checkpoint's packs and index
    (spec §16); else every stored chunk (:func:`stored_chunk_keys`)."""
    if manifest.packs is None:
        return stored_chunk_keys(manifest, json.loads(consolidated_json))
    out: dict[str, list[str]] = {}
    for name in [pack.name for pack in manifest.packs.packs] + [manifest.packs.index_name]:
        folder, _, file = name.rpartition("/")
        out.setdefault(folder, []).append(file)
    return out


def stored_chunk_keys(manifest: Manifest, nodes: Mapping[str, JSON]) -> dict[str, list[str]]:
    """The chunk key names every array of a checkpoint stores, by array path (``nodes``: its consolidated node
    metadata): every chunk of its grid, or for a chunks delta those in ``present``."""
    present = manifest.delta_chunks
    out = {}
    for path, metadata in nodes.items():
        if not isinstance(metadata, dict) or metadata.get("node_type") != "array":
            continue
        counts = grid_counts(metadata)
        flat = present.get(path)
        indices = itertools.product(*map(range, counts)) if flat is None else (unravel(i, counts) for i in flat)
        out[path] = chunk_keys(metadata, indices)
    return out

