"""Storage: where a checkpoint's bytes live, and the commit that makes them a checkpoint.

One interface, :class:`Location` and :class:`Writer` (``base.py``, with the call order of a save and a read),
implemented completely by a local directory (``local.py``) and an object-storage prefix (``object.py``);
callers hold a ``Location`` from :func:`parse_location` and never ask which one it is. Each implementation
registers the URL schemes it serves when imported (this package imports them all). Garbage collection
(``gc.py``) is written once, through the interface. Beside them: object-storage clients and contexts
(``clients.py``) and requests (``kvio.py``); local durability and atomic renames (``renames.py``) and arrayckpt's
own files in a directory (``files.py``); a local commit into a directory holding the user's files, for DCP's
writer (``beside.py``); the locks and leases of live saves and managers (``liveness.py``); one
root document read for many ranks (``shared.py``); a rank's pack of chunk files, the packed layout's IO
(``packs.py`` writes one, ``packread.py`` reads ranges of it).
"""

from __future__ import annotations

from .base import (
    ROOT_METADATA,
    Beside,
    CleanedUp,
    Leftover,
    Leftovers,
    Location,
    Writer,
    finish_rank_writes,
    follow_base,
    kvstore_at,
    open_writer,
    parse_location,
    parse_roots,
)
from .gc import collect_garbage
from .local import LocalLocation, LocalWriter
from .object import OBJECT_SCHEMES, ObjectLocation, ObjectWriter, parse_object_url

__all__ = [
    "OBJECT_SCHEMES",
    "ROOT_METADATA",
    "Beside",
    "CleanedUp",
    "Leftover",
    "Leftovers",
    "LocalLocation",
    "LocalWriter",
    "Location",
    "ObjectLocation",
    "ObjectWriter",
    "Writer",
    "collect_garbage",
    "finish_rank_writes",
    "follow_base",
    "kvstore_at",
    "open_writer",
    "parse_location",
    "parse_object_url",
    "parse_roots",
]
