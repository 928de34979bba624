"""One root document for many readers: read once, sent to every rank, checked by each.

On object storage, every rank opening the same checkpoint is one GET of the same object per rank. A load with a
process group instead has the coordinator read the root document's bytes (:func:`read_root_bytes`, one GET) and
send them to every rank; each rank opens the checkpoint from those bytes (:func:`opened_from_bytes`), checking
their SHA-256 (spec §11) exactly as a read from storage is checked. A local directory is opened by every rank
itself (:func:`shares_root` is false): each process must pin the directory it reads, and a local read costs no
request.
"""

from __future__ import annotations

from typing import Any

from .base import Location, Opened, parse_root_bytes

__all__ = ["opened_from_bytes", "read_root_bytes", "shares_root"]


def shares_root(location: Location) -> bool:
    """Whether ranks opening ``location`` should share one read of its root document (object storage)."""
    return location.shares_root


def read_root_bytes(location: Location) -> tuple[bytes, Any]:
    """The root document of the committed checkpoint at ``location`` as stored, and the token of what was read
    (for :meth:`Location.changed_since`). Errors as :meth:`Location.read_root`."""
    return location.read_root_bytes()


def opened_from_bytes(location: Location, data: bytes, token: Any) -> Opened:
    """What :meth:`Location.open_committed` gives, from the root document's bytes read by another process (their
    checksum checked here)."""
    return Opened(parse_root_bytes(data, location), location.kvstore(), lambda: None, token)
