"""What the read path needs of an open checkpoint: :class:`ChainSource`, which ``stored.py``'s ``StoredCheckpoint``
implements.

``reader.py`` (the one read path) and ``chain.py`` (reads through a delta's chain) sit below ``stored.py`` and read
through this protocol, so that neither imports the class that imports them, and neither reaches into its private
members.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from .._format.jsontypes import JSON

if TYPE_CHECKING:
    import numpy as np

    from .._format.manifest import ArrayEntry, Manifest
    from .._io.arrays import StoreContext
    from .._storage import Location

__all__ = ["ChainSource"]


class ChainSource(Protocol):
    """An open checkpoint as the read path sees it (one layer of a delta chain, with its base behind it)."""

    location: Location
    manifest: Manifest
    #: Row indices of rows deltas read so far, by key (each read once per open checkpoint).
    rows_cache: dict[str, np.ndarray]

    @property
    def metadata(self) -> Mapping[str, JSON]:
        """Each array entry's array metadata (``{}`` for a rows delta)."""

    @property
    def base(self) -> ChainSource:
        """The checkpoint a delta reads through (opened on first use)."""

    @property
    def read_context(self) -> StoreContext:
        """The context every read of data uses (raises once the checkpoint is closed)."""

    def read_spec(self, key: str) -> JSON:
        """The array spec of array entry ``key`` (not a rows delta)."""

    def present_chunks(self, key: str) -> frozenset[int]:
        """A chunks delta's stored chunks (flat grid indices)."""

    def rows_delta_spec(self, entry: ArrayEntry, name: str) -> JSON:
        """The array spec of one part (``rows``, ``values``, ...) of a rows delta."""

    def check_delta_rows(self, entry: ArrayEntry, rows: np.ndarray) -> None:
        """Refuse row indices a rows delta must not hold."""

    def check_unchanged(self) -> None:
        """Raise when the checkpoint (or a base) was replaced since it was opened."""

    def raise_if_replaced(self, error: BaseException) -> None:
        """Raise ``ReplacedCheckpointError`` from ``error`` when the checkpoint was replaced meanwhile."""
